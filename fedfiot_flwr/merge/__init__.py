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
"""

from .costs import aggregate, euclidean_cost_matrix, fisher_cost_matrix
from .engine import FISHER_SCALINGS, MergeResult, PermutationReport, damp_fisher, merge, scale_fishers
from .lap import LAP_SOLVERS, assign
from .presets import METHODS, method_options
from .prepared import PreparedClients, prepare_clients
from .speed import MergeSpeed
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
from .trace import spec_from_module

__all__ = [
    "AxisPerm",
    "FISHER_SCALINGS",
    "LAP_SOLVERS",
    "Layer",
    "METHODS",
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
