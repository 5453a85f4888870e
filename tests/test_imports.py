"""The layers as imports: the server side loads neither torch nor client code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SERVER_IMPORTS = """
import json, sys
import fedfiot_flwr.server
from fedfiot_flwr.server.config import FedFiOTConfig
from fedfiot_flwr import FedFiOT, FedFiOTLegacy, RefineOptions, SweepGrid
FedFiOTConfig.default(rho=0.3); RefineOptions(finetune_epochs=3)
print(json.dumps(sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "fedfiot_flwr")))))
"""


def test_importing_the_server_loads_neither_torch_nor_client_code() -> None:
    out = subprocess.run([sys.executable, "-c", SERVER_IMPORTS], capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert "torch" not in loaded
    client_side = {"fedfiot_flwr.client", "fedfiot_flwr.task", "fedfiot_flwr.fisher", "fedfiot_flwr.curvature",
                   "fedfiot_flwr.data", "fedfiot_flwr.models"}
    assert not loaded & client_side
    assert "fedfiot_flwr.server.shell" in loaded  # the check ran on the real server modules


CLIENT_IMPORTS = """
import json, sys
import client_app
print(json.dumps(sorted(m for m in sys.modules if m.startswith("fedfiot_flwr"))))
"""


def test_importing_the_client_app_loads_no_merge_engine_and_no_server_code() -> None:
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", CLIENT_IMPORTS], capture_output=True, text=True, check=True, cwd=root)
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert "fedfiot_flwr.client" in loaded and "fedfiot_flwr.models" in loaded  # the check ran on the real client
    merge_modules = {m for m in loaded if m.startswith("fedfiot_flwr.merge.")}
    assert merge_modules <= {"fedfiot_flwr.merge.spec", "fedfiot_flwr.merge.trace"}, merge_modules
    assert not {m for m in loaded if m.startswith(("fedfiot_flwr.server", "fedfiot_flwr.refine", "fedfiot_flwr.baselines"))}
    # The engine is still one import away for whoever merges.
    from fedfiot_flwr.merge import merge

    assert callable(merge)


@pytest.mark.parametrize(
    "field, value",
    [("finetune_schedule", "cosin"), ("target_weights", "sizes"), ("finetune_epochs", -1), ("augment_copies", 1.5),
     ("checkpoint_every", -2), ("finetune_lr", 0.0), ("temperature", float("nan")), ("distill_weight", 1.5),
     ("ridges", (0.1, -1.0)), ("refit", "yes")],
)
def test_refine_options_refuse_bad_values_when_built(field: str, value: object) -> None:
    from fedfiot_flwr import RefineOptions

    with pytest.raises(ValueError, match=f"RefineOptions.{field} must be"):
        RefineOptions(**{field: value})


def test_every_mode_name_is_spelled_once() -> None:
    """The engine, the strategies and the app check their choices against the one options module."""
    from fedfiot_flwr import app_config, fisher, options
    from fedfiot_flwr.merge import costs, lap, prepared, validate
    from fedfiot_flwr.server import config, selection

    assert prepared.FISHER_SCALINGS is options.FISHER_SCALINGS
    assert lap.LAP_SOLVERS is options.LAP_SOLVERS and costs.COST_DTYPES is options.COST_DTYPES
    assert validate.MATCHINGS is options.MATCHINGS and validate.AGGREGATIONS is options.AGGREGATIONS
    assert config.SELECTIONS is options.SELECTIONS and selection.REFERENCES is options.REFERENCES
    assert app_config.SELECTIONS is options.SELECTIONS and fisher.FISHER_KINDS is options.CLIENT_FISHER_KINDS
    assert selection.SweepGrid().rhos is options.DEFAULT_GRID_RHOS
    with pytest.raises(ValueError, match=r"selection must be one of \('objective', 'validation', 'none'\)"):
        config.FedFiOTConfig(selection="accuracy")
