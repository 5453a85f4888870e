#!/usr/bin/env bash
# Build the wheel, install it with no extras into a fresh virtual environment (only the core
# dependencies: flwr, torch, numpy, scipy), and run one real FedFiOT round with it from outside
# the repository (scripts/wheel_smoke.py), so that the installed package is what is imported.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/fedfiot-wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT
start=$SECONDS

"$PY" -m venv "$work/venv"
"$work/venv/bin/python" -m pip wheel -q --no-deps -w "$work/dist" .
wheels=("$work"/dist/fedfiot_flwr-*.whl)
[[ ${#wheels[@]} == 1 && -f ${wheels[0]} ]] || { echo "check_wheel: expected one wheel, got: ${wheels[*]}" >&2; exit 1; }
# The wheel ships the package only: the repository's tools (scripts/launch.py, benchmarks/) stay out.
"$PY" - "${wheels[0]}" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
stray = [n for n in names if not n.startswith(("fedfiot_flwr/", "fedfiot_flwr-"))]
assert not stray, f"check_wheel: files outside the package in the wheel: {stray}"
assert not any(n.endswith("/launch.py") for n in names), "check_wheel: the launcher is in the wheel"
PY
# torch first, as a CPU build where this machine's disk holds one (much smaller than the CUDA build
# pip picks otherwise); the wheel's own "torch>=2.4" then installs nothing more. Any torch will do.
"$work/venv/bin/python" -m pip install -q "${WHEEL_CHECK_TORCH:-torch==2.13.0}" 2>/dev/null \
  || echo "check_wheel: ${WHEEL_CHECK_TORCH:-torch==2.13.0} not installable here; the wheel brings its own torch"
"$work/venv/bin/python" -m pip install -q "${wheels[0]}"

cp scripts/wheel_smoke.py "$work/wheel_smoke.py"
(cd "$work" && "$work/venv/bin/python" -I wheel_smoke.py)
echo "check_wheel: $(basename "${wheels[0]}") passed in a fresh venv without extras ($((SECONDS - start)) s)"
