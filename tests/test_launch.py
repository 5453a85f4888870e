"""The launcher (``scripts/run_main.sh``) ends a failed run with the app's own error; no federation is started here."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.launch import app_error, failure_message, parse_run_config

# What `flwr run --stream` printed for `--run-config "alpha=-1"` (frames trimmed, colour codes kept).
STREAM = """\
Successfully started run 8590374453575424703
\x1b[92mINFO \x1b[0m:      Starting Flower Simulation
\x1b[92mINFO \x1b[0m:      Federation `@none/default` (6 simulated SuperNodes)
\x1b[91mERROR \x1b[0m:     Simulation raised an exception
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/flwr/simulation/app.py", line 337, in run_simulation_process
    simulation_result = _run_simulation(
                        ^^^^^^^^^^^^^^^^
  File "/flwr-home/apps/fedfiot.fedfiot-flwr.0.1.0.d8a2a0fe/server_app.py", line 173, in main
    cfg = _resolve_federation(grid, AppConfig.from_run_config(context.run_config))
  File "/flwr-home/apps/fedfiot.fedfiot-flwr.0.1.0.d8a2a0fe/fedfiot_flwr/app_config.py", line 234, in raise_problems
    raise ValueError("run-config " + "; ".join(found))
ValueError: run-config alpha=-1: expected a number > 0
\x1b[91mERROR \x1b[0m:     Exit Code: 700

An unhandled exception occurred when running the simulation.

For more information, visit: <https://flower.ai/docs/framework/1.42/en/ref-exit-codes/700.html>
\x1b[92mINFO \x1b[0m:      All logs for run ID `8590374453575424703` returned
"""

CHAINED = """\
Traceback (most recent call last):
  File "a.py", line 1, in f
KeyError: 'x'

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "b.py", line 2, in g
RuntimeError: round 2: only 1 valid replies (2 needed); excluded:
  client '7': error reply: node unavailable (code 5)

INFO :      done
"""


def test_the_app_error_is_the_last_line_of_the_streamed_traceback() -> None:
    assert app_error(STREAM) == "ValueError: run-config alpha=-1: expected a number > 0"


def test_the_last_of_chained_tracebacks_counts_with_its_whole_message() -> None:
    assert app_error(CHAINED) == (
        "RuntimeError: round 2: only 1 valid replies (2 needed); excluded:\n"
        "  client '7': error reply: node unavailable (code 5)"
    )


def test_a_log_without_a_traceback_has_no_app_error() -> None:
    assert app_error("INFO :      Starting Flower Simulation\nWARNING :   slow\n") is None
    assert app_error("Traceback (most recent call last):\n  File \"a.py\", line 1\n") is None  # cut off


def test_the_failure_message_prefers_the_recorded_error_then_the_stream_then_the_superlink_log(tmp_path: Path) -> None:
    path = tmp_path / "run" / "results.json"
    recorded = {"status": "failed", "error": "only 2 SuperNodes connected after 120s"}
    assert failure_message(recorded, [STREAM], path) == recorded["error"]
    expected = "the app raised ValueError: run-config alpha=-1: expected a number > 0"
    assert failure_message({}, [STREAM, ""], path) == expected
    assert failure_message({}, ["no traceback here", STREAM], path) == expected
    assert failure_message({}, ["", ""], path).startswith(f"no results file at {path}")


def test_the_run_config_keeps_toml_values_and_passes_bare_words_on_as_strings() -> None:
    got = parse_run_config("local-epochs=abc alpha=-1 sweep=false lr=0.5 dataset=cifar10 sweep-rho='0.3,0.5' "
                           'results-dir="/abs/path"')
    assert got == {"local-epochs": "abc", "alpha": -1, "sweep": False, "lr": 0.5, "dataset": "cifar10",
                   "sweep-rho": "0.3,0.5", "results-dir": "/abs/path"}
    assert parse_run_config("") == {}


def test_text_that_is_not_key_value_is_named() -> None:
    with pytest.raises(ValueError, match=r"'local-epochs 5' is not key=value"):
        parse_run_config("alpha=0.2 local-epochs 5")
