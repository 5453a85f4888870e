"""FedFiOT's server-side merge: pure numpy/scipy, no Flower import.

Baselines are configurations of the same engine (``matching`` x ``aggregation``):

=====================  ============  =============
method                 matching      aggregation
=====================  ============  =============
FedAvg                 "none"        "size"
Fisher merging         "none"        "fisher"
OTFusion-like          "euclidean"   "uniform" (max_iters=1)
WB-fusion-like         "euclidean"   "uniform"
ablation C             "euclidean"   "fisher"
ablation D             "fisher"      "uniform"
FedFiOT                "fisher"      "fisher"
=====================  ============  =============
The names below load their module on first use: a client that only builds a model's
permutation spec (:mod:`.spec`, :mod:`.trace`) never loads the engine.
"""

from typing import TYPE_CHECKING

from fedfiot_flwr.lazy import lazy_getattr

if TYPE_CHECKING:
    from .costs import aggregate, euclidean_cost_matrix, fisher_cost_matrix
    from .engine import FISHER_SCALINGS, MergeResult, PermutationReport, damp_fisher, merge, scale_fishers
    from .lap import LAP_SOLVERS, assign
    from .options import MergeOptions
    from .prepared import PreparedClients, prepare_clients
    from .presets import METHODS, method_options
    from .spec import (
        AxisPerm,
        Layer,
        PermutationSpec,
        apply_permutations,
        chain_spec,
        cnn_spec,
        invert_permutation,
        mlp_spec,
    )
    from .speed import MergeSpeed
    from .trace import spec_from_module

_WHERE = {
    **dict.fromkeys(("aggregate", "euclidean_cost_matrix", "fisher_cost_matrix"), "costs"),
    **dict.fromkeys(("FISHER_SCALINGS", "MergeResult", "PermutationReport", "damp_fisher", "merge", "scale_fishers"),
                    "engine"),
    **dict.fromkeys(("LAP_SOLVERS", "assign"), "lap"),
    **dict.fromkeys(("METHODS", "method_options"), "presets"),
    **dict.fromkeys(("PreparedClients", "prepare_clients"), "prepared"),
    "MergeOptions": "options",
    "MergeSpeed": "speed",
    **dict.fromkeys(("AxisPerm", "Layer", "PermutationSpec", "apply_permutations", "chain_spec", "cnn_spec",
                     "invert_permutation", "mlp_spec"), "spec"),
    "spec_from_module": "trace",
}
__getattr__ = lazy_getattr(__name__, _WHERE)

__all__ = [
    "AxisPerm",
    "FISHER_SCALINGS",
    "LAP_SOLVERS",
    "Layer",
    "METHODS",
    "MergeOptions",
    "MergeResult",
    "MergeSpeed",
    "PermutationReport",
    "PermutationSpec",
    "PreparedClients",
    "aggregate",
    "apply_permutations",
    "assign",
    "chain_spec",
    "cnn_spec",
    "damp_fisher",
    "euclidean_cost_matrix",
    "fisher_cost_matrix",
    "invert_permutation",
    "merge",
    "method_options",
    "mlp_spec",
    "prepare_clients",
    "scale_fishers",
    "spec_from_module",
]
