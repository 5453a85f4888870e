"""Does FedFiOT's alternation with the Gram curvature beat RegMean and the best client on an MLP?

The one-objective form (:func:`fedfiot_flwr.algorithm.fedfiot_gram_merge`) covers Linear layers,
so this asks it of the MLP on cached one-shot uploads, one cell and seed at a time. Every Gram
merge uses the same uncompressed input Grams of the float32 clients, each client's own examples:

- RegMean (no alignment) and FedFiOT with the Gram curvature, each with its off-diagonal scaling
  chosen on the validation fold from {0.1, 0.9, 1.0};
- FedFiOT with the diagonal Fisher (the 16-bit uploads, knobs chosen on validation, as the
  long-epoch probe runs it), the size-weighted average, the best single client.

Server data selects only (the paper's protocol). The Grams are not compressed here (the shipped
RegMean packs them within FedAvg's bytes), so the Gram rows hold for uncompressed curvature.

    .venv/bin/python research/gram_alignment.py --dataset digits --model mlp --clients 4 \\
        --alphas 0.1 --inits independent shared --seeds 0 1 2 --epochs 100

Writes ``research/results/gram_alignment.{md,json}``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import harness as H  # noqa: E402
from research import long_epochs_gap, writing_here  # noqa: E402
from fedfiot_flwr.algorithm import GramCurvature, GramMergeResult, fedfiot_gram_merge  # noqa: E402
from fedfiot_flwr.baselines import size_weighted_average  # noqa: E402
from fedfiot_flwr.baselines.regmean import regmean_select  # noqa: E402
from fedfiot_flwr.choose import BestSoFar  # noqa: E402
from fedfiot_flwr.curvature import input_grams  # noqa: E402
from fedfiot_flwr.merge import prepare_clients  # noqa: E402

ALPHAS = (0.1, 0.9, 1.0)
"""Off-diagonal scalings tried by both Gram merges, chosen on validation."""

def run_setting(setting: H.Setting, args: Any, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Every merge of the probe on one cell and seed."""
    split = setting.app_config().split()
    build, spec, buffers = H.model_tools(setting, split)
    ev = H.Evaluator(split, build)
    uploads = H.one_shot_uploads(setting, split, buffers, args.cache_dir, None, log)
    up, fp32 = uploads.quantized, uploads.float32.weights
    sizes = list(up.num_examples)
    ref = int(np.argmax(sizes))
    grams = [input_grams(H.load_numpy(build(), w), H.fisher_loader(split, k)) for k, w in enumerate(fp32)]
    rows: dict[str, dict[str, Any]] = {}
    score = long_epochs_gap.scorer(ev, rows, log)

    score("FedAvg (size-weighted average)", size_weighted_average(up.weights, sizes))
    clients = prepare_clients(up.weights, up.fishers, buffers=buffers, num_examples=sizes, checked=True)
    diag, knob = long_epochs_gap.chosen_merge(clients, spec, ref, "fisher", ev.validate, args.knobs)
    score("FedFiOT, diagonal Fisher", diag.aligned_model, knobs=knob, moved=float(np.mean(diag.fraction_permuted)))
    accuracy = lambda model: float(ev.validate(model)["accuracy"])  # noqa: E731
    regmean = regmean_select(fp32, grams, sizes, accuracy, alphas=ALPHAS)
    score("RegMean", regmean.model, alpha=regmean.alpha)
    best: BestSoFar[tuple[float, GramMergeResult]] = BestSoFar()  # ties: the first of ALPHAS, as RegMean's
    for a in ALPHAS:
        merged = fedfiot_gram_merge(fp32, grams, sizes, spec, curvature=GramCurvature(alpha=a), reference=ref)
        best.offer(accuracy(merged.model), (a, merged))
    alpha, chosen = best.item
    model = chosen.model
    moved = float(np.mean([np.mean(p != np.arange(len(p))) for ps in chosen.permutations.values()
                           for k, p in enumerate(ps) if k != ref]))
    score("FedFiOT, Gram curvature", model, alpha=alpha, aligned=chosen.aligned, moved=moved,
          objective_aligned=chosen.objectives[0], objective_identity=chosen.objectives[1],
          layer_objectives={"aligned": chosen.layer_objectives[0], "identity": chosen.layer_objectives[1]})
    own = [(float(ev.validate(w)["accuracy"]), float(ev.test(w)[1])) for w in up.weights]
    best = int(np.argmax([v for v, _ in own]))
    rows["best single client"] = {"validation_accuracy": own[best][0], "test_accuracy": own[best][1], "client": best}
    return [{**H.record_fields(setting), "reference": ref, "merges": rows}]


def _chosen(merge: Mapping[str, Any]) -> str:
    """What validation chose for one merge: the scaling (and whether the alignment was kept), or the knobs."""
    if "knobs" in merge:
        k = merge["knobs"]
        return f"ρ {k['rho']}, λ {k['lam']:g}, {k['fisher_scaling']}, moved {100 * merge['moved']:.0f} %"
    if "alpha" in merge:
        kept = {True: ", aligned kept", False: ", identity kept"}.get(merge.get("aligned"), "")  # type: ignore[arg-type]
        return f"α {merge['alpha']:g}{kept}"
    return f"client {merge['client']}" if "client" in merge else ""


def markdown(payload: Mapping[str, Any]) -> str:
    """The results page: test accuracy per merge, mean ± std over seeds, per cell."""
    cells: dict[tuple, list[Mapping[str, Any]]] = {}
    for row in payload["rows"]:
        cells.setdefault((row["alpha"], row["init"], row["epochs"]), []).append(row)
    lines = ["# FedFiOT with the Gram curvature on an MLP", "", f"Command: `{payload['command']}`", "",
             f"Machine: {payload['machine']}. {payload.get('seconds', 0.0):.0f} s in all.", "",
             "Test accuracy (%), mean ± std over seeds; server data selects only. Knobs chosen on validation.", ""]
    for (alpha, init, epochs), rows in cells.items():
        lines += [f"## Dirichlet α = {alpha}, {init} initialisation, E = {epochs}, seeds "
                  f"{', '.join(str(r['seed']) for r in rows)}", "",
                  "| merge | test | per seed | chosen per seed |", "|---|---|---|---|"]
        for name in rows[0]["merges"]:
            merges = [r["merges"][name] for r in rows]
            accs = [100 * m["test_accuracy"] for m in merges]
            lines.append(f"| {name} | {np.mean(accs):.1f} ± {np.std(accs):.1f} | "
                         f"{' / '.join(f'{a:.1f}' for a in accs)} | {'; '.join(_chosen(m) for m in merges)} |")
        lines += ["The Gram merge's objective by layer (chosen α; aligned / identity):", ""]
        for r in rows:
            terms = r["merges"]["FedFiOT, Gram curvature"]["layer_objectives"]
            lines.append(f"- seed {r['seed']}: " + ", ".join(
                f"{l} {terms['aligned'][l]:.1f} / {terms['identity'][l]:.1f}" for l in terms["aligned"]))
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run every cell and seed of the command line; returns the payload written to the results files."""
    return H.run_cell_analysis(argv, __doc__, "gram_alignment", len(long_epochs_gap.KNOBS), run_setting, markdown,
                               writing_here())


if __name__ == "__main__":
    main()
