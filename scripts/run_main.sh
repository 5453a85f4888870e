#!/usr/bin/env bash
# The README's main command: a one-shot FedFiOT run of the default app (embedded digits data,
# K = 6 clients, alpha = 0.1, MLP) in Flower's simulation engine, printing the final test
# accuracy next to FedAvg's on the same uploads.
#
# It runs `flwr run . --stream` against a private SuperLink (own FLWR_HOME in a temp dir, free
# port, runtime dependency installation disabled), waits for the run's results.json, stops the
# SuperLink and all it started (also when this script is killed: scripts/supervise.py), and exits
# non-zero if the run failed (flwr run itself exits 0 either way); a
# failed run's last line is the app's own error (the one results.json recorded, else the last
# exception in the ServerApp's log), e.g. "run-config alpha=-1: expected a number > 0".
# The repository is left unmodified; results go to results/<run-name>/ (git-ignored).
#
# Usage: bash scripts/run_main.sh [extra launcher options], e.g.
#   bash scripts/run_main.sh --run-config "local-epochs=10 alpha=0.2"
#   bash scripts/run_main.sh --run-config-file configs/digits-4rounds.toml
#   bash scripts/run_main.sh --mode deployment        # real flower-supernode processes
#   bash scripts/run_main.sh --resume results/<run>   # go on after the last complete round of a stopped run
# Set SKIP_SETUP=1 to skip `scripts/setup.sh` when .venv is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${SKIP_SETUP:-0}" != 1 ]]; then
  bash scripts/setup.sh
fi
exec .venv/bin/python -m scripts.launch --app . --results-dir results "$@"
