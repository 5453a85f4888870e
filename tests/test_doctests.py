"""Run the doctest examples of the merge engine (they document the API and must stay true)."""

import doctest
import importlib

import pytest

MODULES = ["fedfiot_flwr.merge.spec", "fedfiot_flwr.merge.costs", "fedfiot_flwr.merge.engine",
           "fedfiot_flwr.merge.presets", "fedfiot_flwr.merge.prepared", "fedfiot_flwr.merge.lap",
           "fedfiot_flwr.merge.backend", "fedfiot_flwr.refine.stage", "fedfiot_flwr.refine.options",
           "fedfiot_flwr.extras", "fedfiot_flwr.lazy", "fedfiot_flwr.options", "fedfiot_flwr.server.uploads",
           "fedfiot_flwr.choose", "fedfiot_flwr.merge.dtypes"]


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0
    assert result.failed == 0
