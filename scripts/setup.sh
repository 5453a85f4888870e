#!/usr/bin/env bash
# Create .venv (once) and install the project with its test extras into it.
# Idempotent: a second call only re-installs the project itself.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch/torchvision first, pinned to the wheels this machine's pip can reach (see README).
.venv/bin/python -m pip install -q "torch>=2.4" torchvision
.venv/bin/python -m pip install -q -e ".[test]"
# The optional LAPJV solvers (the `fast` extra; lapjv compiles from source): their tests skip without them.
.venv/bin/python -m pip install -q -e ".[fast]" || echo "note: the optional 'fast' extra (LAPJV solvers) was not installed"
# Real Fashion-MNIST for the benchmark (Debian package; optional, skipped where apt is unavailable).
if [[ ! -d /usr/share/datasets/fashion-mnist ]] && command -v apt-get >/dev/null && [[ $(id -u) == 0 ]]; then
  apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 || echo "note: dataset-fashion-mnist not installed (optional)"
fi
