"""What a strategy does with the server's own labelled examples: choose only, or also fit when asked.

:func:`plan_server_data` is the one rule for every strategy (FedFiOT, FedFisher, RegMean, the
legacy form). Given ``server_data`` alone, the examples only *choose*: the aggregator's knobs
are selected on all of them, nothing is trained on them. Given ``refine=RefineOptions()`` too,
they are split into a fitting and a selection fold
(:class:`fedfiot_flwr.refine.RefinementStage`): the selection fold chooses the knobs and the
returned model, the fitting fold trains the refinement's candidates.

The data is checked when the strategy is built, with one forward pass on one batch, so that
examples that don't fit the model fail before any client trains. Torch loads only when
``server_data`` is given.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fedfiot_flwr.refine.base import PostMergeStage
from fedfiot_flwr.refine.options import RefineOptions

if TYPE_CHECKING:
    import torch
    from torch.utils.data import Dataset

    from fedfiot_flwr.merge import PermutationSpec

__all__ = ["ServerDataPlan", "check_server_data", "plan_server_data"]

ValidateFn = Callable[[Mapping[str, np.ndarray]], Mapping[str, float] | None]


@dataclass
class ServerDataPlan:
    """The selection function and post-merge stage a strategy runs with.

    Attributes
    ----------
    validate_fn : callable or None
        ``model dict -> metrics`` on the examples that choose (``None``: nothing chooses).
    stage : PostMergeStage or None
        The refinement stage (``None``: nothing is fitted on server data).
    describe : str
        What the server data does, in plain words (the start-up line).
    """

    validate_fn: ValidateFn | None
    stage: PostMergeStage | None
    describe: str


def check_server_data(model: torch.nn.Module, data: Dataset[Any], label: str) -> int:
    """Run ``model`` on one batch of ``data``; return the number of examples.

    Raises
    ------
    ValueError
        When ``data`` is empty, its items are not ``(input, label)`` pairs, the inputs don't fit
        the model, or a label is not a class index of the model's output.
    """
    import torch
    from torch.utils.data import DataLoader

    from fedfiot_flwr.batches import split_batch

    try:
        n = len(data)  # type: ignore[arg-type]
    except TypeError as exc:
        raise ValueError(f"{label}: server_data must be a map-style Dataset with a length") from exc
    if n == 0:
        raise ValueError(f"{label}: server_data is empty")
    try:
        x, y = split_batch(next(iter(DataLoader(data, batch_size=min(n, 32)))))
    except Exception as exc:  # noqa: BLE001 - any malformed item is the same user error
        raise ValueError(f"{label}: server_data items must be labelled (input, label) pairs: {exc}") from exc
    if y.dtype.is_floating_point or y.ndim != 1:
        raise ValueError(f"{label}: server_data labels must be integer class indices, got {y.dtype} of shape "
                         f"{tuple(y.shape)}")
    probe = copy.deepcopy(model).cpu().eval()
    try:
        with torch.no_grad():
            out = probe(x.float())
    except Exception as exc:  # noqa: BLE001 - the model's own error, named with the shapes
        raise ValueError(f"{label}: server_data inputs of shape {tuple(x.shape[1:])} don't fit the model "
                         f"({type(exc).__name__}: {exc})") from exc
    classes = int(out.shape[-1])
    if int(y.min()) < 0 or int(y.max()) >= classes:
        raise ValueError(f"{label}: server_data label {int(y.max()) if int(y.max()) >= classes else int(y.min())} "
                         f"is not a class of the model's {classes} outputs")
    return n


def plan_server_data(
    label: str,
    model: torch.nn.Module | None,
    server_data: Dataset[Any] | None,
    refine: RefineOptions | None,
    validate_fn: ValidateFn | None,
    describe: Callable[[bool], str],
    spec: PermutationSpec | None = None,
) -> ServerDataPlan:
    """Build the selection function and refinement stage from what the user passed.

    Parameters
    ----------
    label : str
        The strategy's name (in errors and the description).
    model : torch.nn.Module, optional
        The architecture (needed with ``server_data``).
    server_data : Dataset, optional
        Labelled ``(input, label)`` examples the server holds.
    refine : RefineOptions, optional
        Also fit the returned model on part of ``server_data``.
    validate_fn : callable, optional
        The user's own selection function (instead of ``server_data``).
    describe : callable
        ``has_validation -> str``: what the aggregator does with or without validation data.
    spec : PermutationSpec, optional
        The aggregator's permutation spec (the refinement aligns the clients with it).

    Raises
    ------
    ValueError
        With both ``validate_fn`` and ``server_data``, ``server_data`` without ``model``,
        ``refine`` without ``server_data``, or server data that does not fit the model.
    TypeError
        When ``refine`` is not a :class:`RefineOptions`.
    """
    if refine is not None and not isinstance(refine, RefineOptions):
        raise TypeError(f"{label}: refine must be a RefineOptions (e.g. refine=RefineOptions()), "
                        f"got {type(refine).__name__}")
    choices = describe(True)
    if server_data is None:
        if refine is not None:
            raise ValueError(f"{label}: refine needs labelled server_data to fit on")
        if validate_fn is not None:
            return ServerDataPlan(validate_fn, None, f"validate_fn chooses {choices}; nothing is trained on the server")
        return ServerDataPlan(None, None, f"no server data: {describe(False)}; pass server_data=<labelled Dataset> "
                                          "to choose the knobs on held-out examples")
    if validate_fn is not None:
        raise ValueError(f"{label}: pass either validate_fn or server_data, not both (with server_data the strategy "
                         "builds its own validate_fn)")
    if model is None:
        raise ValueError(f"{label}: server_data needs model=<torch module> (the architecture to run it through)")
    n = check_server_data(model, server_data, label)
    if refine is None:
        from torch.utils.data import DataLoader

        from fedfiot_flwr.validation import make_validate_fn

        fn = make_validate_fn(copy.deepcopy(model), DataLoader(server_data, batch_size=500))
        return ServerDataPlan(fn, None, f"{n} server examples choose {choices}; nothing is trained on them (pass "
                                        "refine=RefineOptions() to also fine-tune on half of them)")
    if n < 2:
        raise ValueError(f"{label}: refine needs at least 2 server examples (a fitting and a selection fold), got {n}")
    from fedfiot_flwr.refine.stage import RefinementStage

    stage = RefinementStage(model, server_data, refine, spec=spec)
    return ServerDataPlan(stage.validate_fn, stage, f"{n} server examples: {len(stage.select_indices)} choose "
                                                    f"{choices}; {stage.describe()}")
