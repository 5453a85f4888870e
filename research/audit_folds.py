"""Three folds of the server's validation set, for deciding the refinement's options without the test set.

The strategy splits its 500 validation examples into a fitting fold and a selection fold
(:func:`fedfiot_flwr.refine.stage.split_folds`). To judge a change to the refinement, the
selection fold is halved once more: a selection fold that picks candidates, and an audit fold that
neither fits nor selects and scores the returned model. ``refit_check.py`` and ``finetune_check.py``
build their cells here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
from torch.utils.data import DataLoader, Subset

from benchmarks import harness as H
from benchmarks import server_methods as S
from fedfiot_flwr.refine.stage import split_folds
from fedfiot_flwr.refine import ClientModels, Folds, RefineOptions, RefineReport, refine_merged_model


def three_folds(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fitting fold (the strategy's own), then the strategy's selection fold halved: selection, audit."""
    fit, rest = split_folds(n, seed)
    order = np.random.default_rng(seed + 1).permutation(rest)
    half = len(order) // 2
    return fit, np.sort(order[:half]), np.sort(order[half:])


@dataclass
class AuditCell:
    """One benchmark cell with FedFiOT's default merge chosen on the selection fold."""

    setting: H.Setting
    uploads: H.Uploads
    build: Callable[[], Any]
    spec: Any
    folds: dict[str, Subset]
    test_ev: H.Evaluator
    audit_ev: H.Evaluator
    outcome: Any

    def refine(self, options: RefineOptions) -> tuple[dict[str, np.ndarray], RefineReport]:
        """The refinement of the merge: fitted on the fitting fold, candidates picked on the selection fold."""
        perms = self.outcome.engine_result.permutations if self.outcome.variant == "aligned" else None
        q = self.uploads.quantized
        return refine_merged_model(
            self.outcome.model, ClientModels(q.weights, self.spec, perms, q.num_examples), self.build(),
            Folds(DataLoader(self.folds["fit"], batch_size=500), DataLoader(self.folds["select"], batch_size=500)),
            options=replace(options, seed=self.setting.seed))

    def scores(self, model: dict[str, np.ndarray]) -> tuple[float, float]:
        """``(audit accuracy, test accuracy)`` of a model."""
        return self.audit_ev.validate(model)["accuracy"], self.test_ev.test(model)[1]


def audit_cell(cell: str, args: argparse.Namespace, log: Callable[[str], None]) -> AuditCell:
    """The cell ``alpha:init:seed:epochs`` on ``args``' data set and model (by default Fashion-MNIST, the
    paper's CNN, K = 6, 500 validation examples), uploads from ``args.cache_dir``."""
    alpha, init, seed, epochs = cell.split(":")
    setting = H.Setting(dataset=args.dataset, model=args.model, clients=args.clients, alpha=float(alpha), init=init,
                        seed=int(seed), epochs=int(epochs), validation_size=args.validation_size)
    split = setting.app_config().split()
    build, spec, buffers = H.model_tools(setting, split)
    fit_idx, sel_idx, audit_idx = three_folds(len(split.validation))
    folds = {name: Subset(split.validation, idx.tolist())
             for name, idx in (("fit", fit_idx), ("select", sel_idx), ("audit", audit_idx))}
    sel_ev = H.Evaluator(replace(split, validation=folds["select"]), build)
    uploads = H.one_shot_uploads(setting, split, buffers, args.cache_dir, log=log)
    outcome = S.fedfiot_merge_on_fold(uploads, spec, buffers, sel_ev, "small", init)
    return AuditCell(setting, uploads, build, spec, folds, H.Evaluator(split, build),
                     H.Evaluator(replace(split, validation=folds["audit"]), build), outcome)


def cell_arguments(argv: list[str] | None, description: str, name: str) -> argparse.Namespace:
    """The audit scripts' command line: ``--cells alpha:init:seed:epochs ...``, the data set, model, clients and
    validation size (by default the recorded ones), ``--cache-dir``, ``--out``, ``--name``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--cells", nargs="+", required=True, help="alpha:init:seed:epochs")
    p.add_argument("--dataset", default="fashion-mnist")
    p.add_argument("--model", default="fednet")
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--validation-size", type=int, default=500)
    p.add_argument("--cache-dir", type=Path, default=H.CACHE_DIR)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--name", default=name)
    args = p.parse_args(argv)
    H.set_threads(1)
    return args
