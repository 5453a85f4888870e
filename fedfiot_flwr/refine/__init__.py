"""Post-merge stages, and the server refinement on the server's own labelled examples.

Any aggregator's model can go through a post-merge stage (:mod:`fedfiot_flwr.refine.base`)
before the round returns it. The refinement (:class:`RefinementStage`, asked for with
``FedFiOT(..., server_data=..., refine=RefineOptions())``) splits the server's examples into a
fitting and a selection fold, builds candidates from the aggregated model on the first
(least-squares refits, REPAIR, distillation fine-tuning) and returns the best on the second.

- :mod:`~fedfiot_flwr.refine.options`: :class:`RefineOptions` (torch-free, validated when built);
- :mod:`~fedfiot_flwr.refine.base`: the stage protocol (torch-free);
- :mod:`~fedfiot_flwr.refine.linalg`: least squares and REPAIR in NumPy/SciPy;
- :mod:`~fedfiot_flwr.refine.ops`: the torch side (capture layers, corrections);
- :mod:`~fedfiot_flwr.refine.finetune`: distillation fine-tuning;
- :mod:`~fedfiot_flwr.refine.candidates`: :func:`refine_merged_model`, the one entry point, and its inputs
  :class:`ClientModels` and :class:`Folds`;
- :mod:`~fedfiot_flwr.refine.stage`: :class:`RefinementStage`, the folds and the stage.

Importing this package loads neither torch nor Flower; the torch modules load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedfiot_flwr.lazy import lazy_getattr
from fedfiot_flwr.refine.base import ModelMapStage, PostMergeStage, StageResult
from fedfiot_flwr.refine.options import FINETUNE_SCHEDULES, TARGET_WEIGHTS, RefineOptions

if TYPE_CHECKING:
    from fedfiot_flwr.refine.candidates import ClientModels, Folds, RefineReport, refine_merged_model
    from fedfiot_flwr.refine.stage import RefinementStage, split_folds

__all__ = [
    "FINETUNE_SCHEDULES",
    "TARGET_WEIGHTS",
    "ClientModels",
    "Folds",
    "ModelMapStage",
    "PostMergeStage",
    "RefineOptions",
    "RefineReport",
    "RefinementStage",
    "StageResult",
    "refine_merged_model",
    "split_folds",
]

_LAZY = {
    "ClientModels": "candidates",
    "Folds": "candidates",
    "RefineReport": "candidates",
    "refine_merged_model": "candidates",
    "RefinementStage": "stage",
    "split_folds": "stage",
}


__getattr__ = lazy_getattr(__name__, _LAZY)
