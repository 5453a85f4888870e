"""Bad arguments fail when the strategy is built, naming the value, before any client trains."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from _fedfiot_helpers import task_identity  # noqa: F401 - autouse fixture
from _fedfiot_helpers import tiny_mlp
from _fedfiot_helpers import SHAPES, FakeGrid, packed
from flwr.app import Message
from torch import nn
from torch.utils.data import TensorDataset

from fedfiot_flwr import FedFiOT, FedFiOTConfig, FedFiOTLegacy, RefineOptions, RegMeanStrategy
from fedfiot_flwr.server import RunResult
from fedfiot_flwr.server.shell import arrays_to_numpy, numpy_to_arrays


Net = tiny_mlp


def with_int_parameter() -> nn.Module:
    model = tiny_mlp()
    model.steps = nn.Parameter(torch.zeros(1, dtype=torch.int64), requires_grad=False)
    return model


def _data(n: int = 16, features: int = 4, label: int | None = None) -> TensorDataset:
    y = torch.full((n,), label) if label is not None else torch.randint(0, 3, (n,))
    return TensorDataset(torch.randn(n, features), y)


CASES = [
    ({"fraction_train": 1.5}, ValueError, r"fraction_train must be a number in \[0, 1\], got 1.5"),
    ({"fraction_train": -0.5}, ValueError, r"fraction_train must be a number in \[0, 1\], got -0.5"),
    ({"fraction_evaluate": -1.0}, ValueError, r"fraction_evaluate must be a number in \[0, 1\], got -1.0"),
    ({"min_train_nodes": -3}, ValueError, r"min_train_nodes must be an integer >= 0, got -3"),
    ({"min_available_nodes": 2.5}, ValueError, r"min_available_nodes must be an integer >= 0, got 2.5"),
    ({"config": {"rho": 0.3}}, TypeError, r"config must be a FedFiOTConfig .* got dict"),
    ({"model": "mlp"}, TypeError, r"model must be a torch.nn.Module instance .* got str"),
    ({"model": with_int_parameter()}, TypeError, r"parameter 'steps' of the model is torch.int64"),
    ({"server_data": _data(features=7)}, ValueError, r"inputs of shape \(7,\) don't fit the model"),
    ({"server_data": _data(label=16)}, ValueError, r"label 16 is not a class of the model's 3 outputs"),
    ({"server_data": TensorDataset(torch.randn(8, 4))}, ValueError, r"must be labelled \(input, label\) pairs"),
    ({"server_data": _data(n=0)}, ValueError, r"server_data is empty"),
    ({"refine": RefineOptions()}, ValueError, r"refine needs labelled server_data"),
]


@pytest.mark.parametrize("kwargs, error, match", CASES, ids=[next(iter(c[0])) + f"-{i}" for i, c in enumerate(CASES)])
def test_a_bad_argument_fails_at_construction_naming_the_value(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        FedFiOT(**{"model": Net(), **kwargs})


def test_the_baselines_and_the_legacy_form_check_the_same_way() -> None:
    with pytest.raises(ValueError, match=r"RegMean: fraction_train must be a number in \[0, 1\]"):
        RegMeanStrategy(fraction_train=2.0)
    with pytest.raises(ValueError, match=r"FedFiOTLegacy: fraction_fit must be a number in \[0, 1\]"):
        FedFiOTLegacy(model=Net(), fraction_fit=1.5)
    with pytest.raises(ValueError, match="RefineOptions.finetune_schedule must be one of"):
        RefineOptions(finetune_schedule="cosin")


def test_the_legacy_form_names_the_message_api_options_it_does_not_take() -> None:
    with pytest.raises(TypeError, match="FedFiOTLegacy: node_wait_s is an option of the Message-API FedFiOT only"):
        FedFiOTLegacy(model=Net(), node_wait_s=5.0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'fraction_train'"):
        FedFiOTLegacy(model=Net(), fraction_train=0.5)  # a Message-API FedAvg option: Flower's own error


def test_start_returns_flowers_result_with_the_aggregation_metrics_and_prints_them(caplog) -> None:
    rng = np.random.default_rng(2)

    def client_fn(node: int, msg: Message) -> Message:
        arrays = arrays_to_numpy(msg.content["arrays"])
        w = {k: (v + rng.normal(scale=0.1, size=v.shape)).astype(np.float32) for k, v in arrays.items()}
        f = {k: (rng.random(v.shape) ** 2).astype(np.float32) for k, v in arrays.items()}
        return Message(content=packed(w, f, 10 * node), reply_to=msg)

    init = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    strategy = FedFiOT(model=Net(), config=FedFiOTConfig.paper(sweep=None), fraction_evaluate=0.0)
    with caplog.at_level(logging.INFO, logger="flwr"):
        result = strategy.start(grid=FakeGrid([1, 2], client_fn), initial_arrays=numpy_to_arrays(init), num_rounds=2)
    assert isinstance(result, RunResult) and set(result.aggregation_metrics_serverapp) == {1, 2}
    assert result.aggregation_metrics_serverapp[2]["num-valid"] == 2
    assert isinstance(result.aggregation_metrics_serverapp[1]["inner-iterations"][0], int)
    assert "ServerApp-side Aggregation Metrics" in repr(result) and "kept-aligned" in repr(result)
    printed = "\n".join(r.getMessage() for r in caplog.records)
    assert printed.index("ServerApp-side Aggregation Metrics") > printed.index("Final results")


def test_the_engines_own_log_lines_reach_flowers_console() -> None:
    """The sweep and the tracer log to ``fedfiot_flwr``; a strategy hands that logger Flower's handlers."""
    flower = logging.getLogger("flwr")
    assert flower.handlers  # Flower's console handler, which users watch
    FedFiOT(model=Net())
    package = logging.getLogger("fedfiot_flwr")
    assert all(h in package.handlers for h in flower.handlers)
    assert package.getEffectiveLevel() <= logging.INFO
    record = logging.LogRecord("fedfiot_flwr.server.selection", logging.INFO, __file__, 1, "trying 36 knob settings",
                               None, None)
    assert any(h.filter(record) and h.level <= logging.INFO for h in package.handlers)


@pytest.mark.parametrize("strategy", [FedFiOT, FedFiOTLegacy])
def test_a_merge_knob_given_to_the_strategy_says_it_is_a_config_field_and_shows_the_call(strategy) -> None:  # noqa: ANN001
    with pytest.raises(TypeError) as info:
        strategy(model=tiny_mlp(), rho=0.3)
    name = strategy.__name__
    assert str(info.value) == (f"{name}: rho is a FedFiOTConfig field, not a strategy option; pass it as "
                               f"{name}(model, config=FedFiOTConfig.default(rho=0.3))")
    with pytest.raises(TypeError, match=r"rho, lam are FedFiOTConfig fields.*default\(rho=0.3, lam=0.001\)"):
        strategy(model=tiny_mlp(), rho=0.3, lam=1e-3)
