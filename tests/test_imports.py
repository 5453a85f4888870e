"""The layers as imports: the server side loads neither torch nor client code."""

from __future__ import annotations

import json
import subprocess
import sys

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


def test_a_validate_fn_on_a_cached_fold_reads_it_once_and_scores_as_the_loader_does() -> None:
    import torch
    from torch import nn

    from fedfiot_flwr.validation import make_validate_fn

    class CountingLoader:
        def __init__(self) -> None:
            self.reads = 0
            g = torch.Generator().manual_seed(0)
            self.batches = [(torch.randn(8, 3, generator=g), torch.randint(0, 2, (8,), generator=g)) for _ in range(3)]

        def __iter__(self):  # noqa: ANN204
            self.reads += 1
            return iter(self.batches)

    model = nn.Linear(3, 2)
    a = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    b = {k: v.copy() for k, v in a.items()}
    b["weight"][0] += 1.0  # one class's logit moves: a different model with a different loss
    loader, plain_loader = CountingLoader(), CountingLoader()
    cached = make_validate_fn(model, loader, "cpu", cache_batches=True)
    plain = make_validate_fn(nn.Linear(3, 2), plain_loader, "cpu")
    assert [cached(a), cached(b), cached(a)] == [plain(a), plain(b), plain(a)]
    assert cached(a) != cached(b)
    assert loader.reads == 1 and plain_loader.reads == 3


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
