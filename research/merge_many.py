"""Alignment anchored to no client: MergeMany's leave-one-out matching with FedFiOT's own costs.

FedFiOT matches every client to a merge that starts from one client (the largest), so the merge
keeps that client's neuron order. MergeMany (Ainsworth et al., *Git Re-Basin*) anchors to no
client: each client in turn is matched to the merge of all the *others*, and the sweeps repeat
until no client's permutation changes. Here the matching and the merge are FedFiOT's
(Fisher-weighted costs, one assignment per permutation group in the spec's order, Fisher-weighted
aggregation), so the only difference from FedFiOT is what each client is matched to. On cached
one-shot uploads, per cell, seed and knob setting (ρ, λ, Fisher scaling):

- ``fedfiot``: FedFiOT's aligned merge from the largest client (no identity fallback);
- ``merge-many``: leave-one-out sweeps from the unaligned clients, as MergeMany starts;
- ``merge-many-from-fedfiot``: the same sweeps started from FedFiOT's alignment;

each with the full-model objective ``J`` of its alignment and its validation and test accuracy.
Every method keeps the knob setting with the best validation accuracy; no server data enters an
alignment (server data selects only, the paper's protocol).

    .venv/bin/python research/merge_many.py --alphas 0.1 0.2 --inits independent shared --seeds 0 1 2

Writes ``research/results/merge_many.{md,json}``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import harness as H  # noqa: E402
from research import reference_choice, writing_here  # noqa: E402
from fedfiot_flwr.merge import MergeOptions, MergeResult, PermutationSpec, merge, prepare_clients  # noqa: E402
from fedfiot_flwr.merge.spec import apply_permutations  # noqa: E402

KNOBS = reference_choice.KNOBS
"""(rho, lam, Fisher scaling) settings; each method keeps the one with the best validation accuracy."""

METHODS = ("fedfiot", "merge-many", "merge-many-from-fedfiot")

Model = Mapping[str, np.ndarray]
Perms = dict[str, list[np.ndarray]]


class Clients:
    """The clients' weights, Fishers and sizes, with what every merge of them needs."""

    def __init__(self, weights: Sequence[Model], fishers: Sequence[Model], num_examples: Sequence[int],
                 spec: PermutationSpec, buffers: Sequence[str]) -> None:
        self.weights, self.fishers, self.num_examples = list(weights), list(fishers), list(num_examples)
        self.spec, self.buffers = spec, list(buffers)

    def merged(self, members: Sequence[int], perms: Perms, **knobs: Any) -> MergeResult:
        """The Fisher-weighted merge of the clients ``members``, each in the global order ``perms`` gives it."""
        order = [{p: perms[p][k] for p in perms} for k in members]
        w = [apply_permutations(self.weights[k], self.spec, o) for k, o in zip(members, order)]
        f = [apply_permutations(self.fishers[k], self.spec, o) for k, o in zip(members, order)]
        prepared = prepare_clients(w, f, buffers=self.buffers, num_examples=[self.num_examples[k] for k in members],
                                   checked=True)
        return merge(prepared, None, self.spec, MergeOptions(matching="none", fallback="none", **knobs))

    def matched_to(self, k: int, target: Model, **knobs: Any) -> dict[str, np.ndarray]:
        """Client ``k``'s permutations that match it to ``target`` under FedFiOT's Fisher-weighted costs."""
        one = prepare_clients([self.weights[k]], [self.fishers[k]], buffers=self.buffers,
                              num_examples=[self.num_examples[k]], checked=True)
        res = merge(one, None, self.spec, MergeOptions(reference=dict(target), fallback="none", **knobs))
        return {p: res.permutations[p][0] for p in res.permutations}


def identity_permutations(spec: PermutationSpec, model: Model, n_clients: int) -> Perms:
    """Every client in its own order: the identity for each permutation of ``spec``, sized by ``model``."""
    return {p: [np.arange(m) for _ in range(n_clients)]
            for p, m in spec.sizes({n: np.shape(t) for n, t in model.items()}).items()}


def merge_many(clients: Clients, start: Perms, max_sweeps: int = 10, **knobs: Any) -> tuple[Perms, int, bool]:
    """Leave-one-out sweeps: every client matched to the merge of the others, until nothing changes.

    Returns the permutations, the number of sweeps run and whether the last one changed nothing.

    Examples
    --------
    Two clients with the same two neurons in swapped order: after the sweeps they agree.

    >>> spec = PermutationSpec({"w": ("P0", None)})
    >>> one = {"w": np.array([[1.0], [5.0]], np.float32)}
    >>> two = {"w": np.array([[5.0], [1.0]], np.float32)}
    >>> ones = {"w": np.ones((2, 1), np.float32)}
    >>> u = Clients([one, two], [ones, ones], [10, 10], spec, [])
    >>> perms, sweeps, converged = merge_many(u, identity_permutations(spec, one, 2), rho=1.0, lam=1e-3)
    >>> [apply_permutations(m, spec, {"P0": perms["P0"][k]})["w"].ravel().tolist() for k, m in enumerate([one, two])]
    [[5.0, 1.0], [5.0, 1.0]]
    >>> converged
    True
    """
    perms = {p: [np.asarray(a).copy() for a in arrays] for p, arrays in start.items()}
    everyone = range(len(clients.weights))
    for sweep in range(1, max_sweeps + 1):
        changed = False
        for k in everyone:
            others = [j for j in everyone if j != k]
            new = clients.matched_to(k, clients.merged(others, perms, **knobs).model, **knobs)
            if any(not np.array_equal(new[p], perms[p][k]) for p in new):
                changed = True
                for p in new:
                    perms[p][k] = new[p]
        if not changed:
            return perms, sweep, True
    return perms, max_sweeps, False


def run_setting(setting: H.Setting, args: argparse.Namespace, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """The three alignments at every knob setting of one cell and seed."""
    split = setting.app_config().split()
    build, spec, buffers = H.model_tools(setting, split)
    ev = H.Evaluator(split, build)
    q = H.one_shot_uploads(setting, split, buffers, args.cache_dir, None, log).quantized
    clients = Clients(q.weights, q.fishers, q.num_examples, spec, buffers)
    everyone = list(range(len(q.weights)))
    largest = int(np.argmax(q.num_examples))
    prepared = prepare_clients(q.weights, q.fishers, buffers=buffers, num_examples=q.num_examples, checked=True)
    identity = identity_permutations(spec, q.weights[0], len(q.weights))

    def scored(perms: Perms, knobs: dict[str, Any], **extra: Any) -> dict[str, Any]:
        """The merge of every client in the order ``perms``, at ``knobs``: its accuracies and objective."""
        res = clients.merged(everyone, perms, **knobs)
        moved = float(np.mean([np.mean(perms[p][k] != np.arange(len(perms[p][k]))) for p in perms for k in everyone]))
        return {**knobs, "validation_accuracy": ev.validate(res.model)["accuracy"], "test_accuracy": ev.test(res.model)[1],
                "objective": res.objective, "fraction_permuted": moved, **extra}

    candidates: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
    for rho, lam, scaling in KNOBS[:args.knobs]:
        knobs = {"rho": rho, "lam": lam, "fisher_scaling": scaling}
        t0 = time.perf_counter()
        fedfiot = merge(prepared, None, spec, MergeOptions(reference=largest, fallback="none", **knobs)).permutations
        candidates["fedfiot"].append(scored(fedfiot, knobs, seconds=time.perf_counter() - t0))
        for method, start in (("merge-many", identity), ("merge-many-from-fedfiot", fedfiot)):
            t0 = time.perf_counter()
            perms, sweeps, converged = merge_many(clients, start, args.max_sweeps, **knobs)
            candidates[method].append(scored(perms, knobs, sweeps=sweeps, converged=converged,
                                             seconds=time.perf_counter() - t0))
        log(f"  rho={rho} lam={lam:g} {scaling}: " + ", ".join(
            f"{m} {100 * c[-1]['test_accuracy']:.1f}% (J {c[-1]['objective']:.4g})" for m, c in candidates.items()))
    own = [(ev.validate(w)["accuracy"], ev.test(w)[1]) for w in q.weights]
    best = int(np.argmax([v for v, _ in own]))
    return [{**H.record_fields(setting), "largest": largest, "candidates": candidates,
             "best_single_client": {"client": best, "validation_accuracy": own[best][0], "test_accuracy": own[best][1]},
             "chosen": {m: max(c, key=lambda r: r["validation_accuracy"]) for m, c in candidates.items()}}]


def markdown(payload: Mapping[str, Any]) -> str:
    """The results page: per cell, the test accuracy of each method's chosen knobs, mean ± std over seeds."""
    rows = payload["rows"]
    lines = [
        "# Alignment anchored to no client: MergeMany with FedFiOT's costs",
        "",
        "Same cached one-shot uploads in every column; test accuracy in %. Each method keeps the knob setting "
        "(ρ, λ, Fisher scaling) with the best accuracy on the server's validation examples, which select only. "
        "*MergeMany* matches each client to the Fisher-weighted merge of the others (FedFiOT's costs, one "
        "assignment per permutation group) and repeats until no permutation changes; *from FedFiOT* starts those "
        "sweeps from FedFiOT's alignment. J: the full-model objective of the chosen alignment, relative to FedFiOT's "
        "at the same knob setting.",
        "",
        f"Command: `{payload['command']}`",
        "",
        f"Machine: {payload['machine']}; {payload.get('seconds', 0) / 60:.1f} min.",
        "",
        "| cell | seeds | FedFiOT (largest client) | MergeMany | MergeMany from FedFiOT | best single client "
        "| J: MergeMany / FedFiOT | J: from FedFiOT / FedFiOT | sweeps (MergeMany) | converged (MergeMany) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    cells: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["alpha"], r["init"], r["epochs"]), []).append(r)

    def stat(values: Sequence[float], scale: float = 100.0, digits: int = 1) -> str:
        v = scale * np.asarray(values, float)
        return f"{v.mean():.{digits}f}" + (f" ± {v.std(ddof=1):.{digits}f}" if len(v) > 1 else "")

    for (alpha, init, epochs), rs in cells.items():
        acc = {m: [r["chosen"][m]["test_accuracy"] for r in rs] for m in METHODS}
        ratio = {m: [r["chosen"][m]["objective"] / _fedfiot_at(r, r["chosen"][m])["objective"] for r in rs]
                 for m in METHODS}
        sweeps = [r["chosen"]["merge-many"]["sweeps"] for r in rs]
        converged = sum(r["chosen"]["merge-many"]["converged"] for r in rs)
        lines.append(
            f"| α={alpha} {init} E={epochs} | {len(rs)} | {stat(acc['fedfiot'])} | {stat(acc['merge-many'])} "
            f"| {stat(acc['merge-many-from-fedfiot'])} | {stat([r['best_single_client']['test_accuracy'] for r in rs])} "
            f"| {stat(ratio['merge-many'], 1.0, 3)} | {stat(ratio['merge-many-from-fedfiot'], 1.0, 3)} "
            f"| {min(sweeps)}-{max(sweeps)} | {converged}/{len(rs)} |")
    lines += ["", "Mean ± sample std over seeds. A J ratio below 1: that alignment fits FedFiOT's objective better "
              "than FedFiOT's own."]
    return "\n".join(lines) + "\n"


def _fedfiot_at(row: Mapping[str, Any], candidate: Mapping[str, Any]) -> Mapping[str, Any]:
    """FedFiOT's candidate of ``row`` at the knob setting of ``candidate``."""
    knob = ("rho", "lam", "fisher_scaling")
    return next(c for c in row["candidates"]["fedfiot"] if all(c[k] == candidate[k] for k in knob))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run every cell and seed of the command line; returns the payload written to the results files."""
    return H.run_cell_analysis(argv, __doc__, "merge_many", len(KNOBS), run_setting, markdown,
                               extra_args=writing_here(_extra_args))


def _extra_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-sweeps", type=int, default=10, help="leave-one-out sweeps at most")


if __name__ == "__main__":
    main()
