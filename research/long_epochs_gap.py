"""After long local training, what separates FedFiOT's merge from RegMean and from the best client?

At 25-50 local epochs (the paper's protocol) RegMean leads FedFiOT by about 14 points with a
shared initialisation, and with independent initialisations FedFiOT's aligned merge stays below
the best single client. On cached one-shot uploads this asks three questions with one set of
merges per cell and seed:

- **Renormalisation.** Does REPAIR (Jordan et al., 2023: rescale each merged neuron so its
  pre-activation mean and std on the server's *unlabelled* inputs match the aligned clients'
  average) close the gap between an aligned merge and the best client? Applied to FedFiOT's
  weight-aligned merge and to the activation-aligned one.
- **What RegMean's Grams carry.** RegMean solves ``W = (sum_k G_k)^-1 sum_k G_k W_k`` per linear
  layer with the clients' input Grams ``G_k``; a diagonal Fisher only weighs coordinates. The
  probe runs RegMean as shipped (off-diagonal scaling chosen on validation), RegMean with the
  off-diagonal part dropped (``alpha = 0``: a per-input-coordinate weighting, like a diagonal
  Fisher without the output gradients), and RegMean's closed form on the clients *after*
  FedFiOT's weight alignment and after an activation alignment.
- **Weight against activation alignment.** Does FedFiOT's weight matching pick the same
  neurons as matching by activation correlation on the same unlabelled inputs, once training
  has moved the weights away from their initialisation? (the fraction of hidden units in the
  same place, per layer).

The server inputs are used to align and to renormalise, so the REPAIR and activation rows are a
diagnosis (protocol "server data may also fit"), not the paper's protocol. Knobs (ρ, λ, Fisher
scaling; RegMean's alpha) are chosen on the validation fold; test accuracy is reported for the
chosen ones.

    .venv/bin/python research/long_epochs_gap.py --alphas 0.1 --inits independent shared --seeds 0 --epochs 50

Writes ``research/results/long_epochs_gap.{md,json}``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import harness as H  # noqa: E402
from research import alignment_cause, reference_choice, writing_here  # noqa: E402
from fedfiot_flwr.client import curvature_reply  # noqa: E402
from fedfiot_flwr.merge import MergeOptions, merge, prepare_clients  # noqa: E402
from fedfiot_flwr.refine.ops import client_neuron_stats, layer_modules, load_state, model_state, repair  # noqa: E402
from fedfiot_flwr.server.aggregators import RegMeanAggregator  # noqa: E402
from fedfiot_flwr.server.outcome import RoundContext  # noqa: E402
from fedfiot_flwr.server.uploads import collect_uploads  # noqa: E402

KNOBS = reference_choice.KNOBS
"""(rho, lam, Fisher scaling) settings of FedFiOT's merges; the best on validation is kept."""

Model = Mapping[str, np.ndarray]
Perms = Mapping[str, Sequence[np.ndarray]]


def repaired(merged: Model, clients: Sequence[Model], build: Callable[[], torch.nn.Module],
             inputs: Sequence[torch.Tensor]) -> dict[str, np.ndarray]:
    """REPAIR of ``merged`` towards the plain average of the (already aligned) ``clients``' neuron statistics.

    Uses the shipped refinement's operations: statistics on ``inputs`` (unlabelled batches), every
    hidden Linear/Conv2d layer rescaled in forward order, the logits left alone.
    """
    model, scratch = build(), build()
    layers = layer_modules(model, inputs[0])
    modules = dict(scratch.named_modules())
    targets = client_neuron_stats(scratch, list(clients), [1.0 / len(clients)] * len(clients),
                                  [(n, modules[n]) for n, _ in layers], inputs)
    load_state(model, merged)
    repair(model, layers, inputs, targets)
    return model_state(model)


def regmean_models(weights: Sequence[Model], setting: H.Setting, split: Any, build: Callable[[], torch.nn.Module],
                   buffers: Sequence[str], validate: Callable[[Model], Mapping[str, float]],
                   alphas: Sequence[Sequence[float] | None]) -> list[tuple[Model, float]]:
    """RegMean of the clients ``weights`` (float32, in any neuron order) for each alpha grid in ``alphas``.

    Each client's input Grams are computed on its own examples for *these* weights, packed and
    decoded exactly as the RegMean ClientApp and strategy do; each grid's alpha is chosen on
    validation (None: the shipped grid). Returns ``(model, chosen alpha)`` per grid.
    """
    replies = [(str(k), curvature_reply("regmean", H.load_numpy(build(), w), H.fisher_loader(split, k),
                                        num_examples=len(split.client_indices[k])))
               for k, w in enumerate(weights)]
    expected = {n: tuple(v.shape) for n, v in weights[0].items()}
    out = []
    for grid in alphas:
        aggregator = RegMeanAggregator(grid)
        collected = collect_uploads(replies, expected, buffers, kind=aggregator.reply_kind)
        if collected.rejections:
            raise ValueError(f"RegMean replies rejected: {[vars(r) for r in collected.rejections]}")
        outcome = aggregator.aggregate(collected, RoundContext(1, buffers=tuple(buffers), validate=validate))
        out.append((outcome.model, float(outcome.chosen["alpha"])))
    return out


def chosen_merge(clients: Any, spec: Any, ref: int, matching: str,
                 validate: Callable[[Model], Mapping[str, float]], knobs: int) -> tuple[Any, dict[str, Any]]:
    """FedFiOT's merge (no identity fallback) at the knob setting with the best validation accuracy."""
    best: tuple[float, Any, dict[str, Any]] | None = None
    for rho, lam, scaling in KNOBS[:knobs]:
        result = merge(clients, None, spec, MergeOptions(lam=lam, rho=rho, reference=ref, fisher_scaling=scaling,
                                                         fallback="none", matching=matching))
        model = result.aligned_model if matching != "none" else result.model
        acc = float(validate(model)["accuracy"])
        if best is None or acc > best[0]:
            best = (acc, result, {"rho": rho, "lam": lam, "fisher_scaling": scaling})
    assert best is not None
    return best[1], best[2]


def scorer(ev: H.Evaluator, rows: dict[str, dict[str, Any]], log: Callable[[str], None]) -> Callable[..., None]:
    """``score(name, model, **extra)``: the model's validation and test accuracy (and ``extra``) into
    ``rows[name]``, and a log line."""

    def score(name: str, model: Model, **extra: Any) -> None:
        rows[name] = {"validation_accuracy": float(ev.validate(model)["accuracy"]),
                      "test_accuracy": float(ev.test(model)[1]), **extra}
        log(f"  {name:44s} test {100 * rows[name]['test_accuracy']:5.1f}%  val "
            f"{100 * rows[name]['validation_accuracy']:5.1f}%")

    return score


def run_setting(setting: H.Setting, args: argparse.Namespace, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Every merge of the probe on one cell and seed."""
    split = setting.app_config().split()
    build, spec, buffers = H.model_tools(setting, split)
    ev = H.Evaluator(split, build)
    uploads = H.one_shot_uploads(setting, split, buffers, args.cache_dir, None, log)
    up, fp32 = uploads.quantized, uploads.float32.weights
    ref = int(np.argmax(up.num_examples))
    batches = [x.cpu() for x, _ in ev.validation]
    inputs = torch.cat(batches)
    acts = [alignment_cause.hidden_activations(H.load_numpy(build(), w), spec, inputs) for w in up.weights]
    act_perms = alignment_cause.activation_alignment(acts, ref)
    act_w = alignment_cause.permuted(up.weights, spec, act_perms)
    act_f = alignment_cause.permuted(up.fishers, spec, act_perms)

    def prepared(w: Sequence[Model], f: Sequence[Model]) -> Any:
        return prepare_clients(w, f, buffers=buffers, num_examples=up.num_examples, checked=True)

    rows: dict[str, dict[str, Any]] = {}
    score = scorer(ev, rows, log)

    clients = prepared(up.weights, up.fishers)
    identity, knob = chosen_merge(clients, spec, ref, "none", ev.validate, args.knobs)
    score("fisher-weighted, no alignment", identity.model, knobs=knob)
    weight, knob = chosen_merge(clients, spec, ref, "fisher", ev.validate, args.knobs)
    w_perms = weight.permutations
    agreement = alignment_cause.permutation_agreement(w_perms, act_perms, ref)
    score("FedFiOT weight alignment", weight.aligned_model, knobs=knob,
          moved=float(np.mean(weight.fraction_permuted)), agreement_with_activation=agreement)
    w_aligned = alignment_cause.permuted(up.weights, spec, w_perms)
    score("FedFiOT weight alignment + REPAIR", repaired(weight.aligned_model, w_aligned, build, batches))
    activation, knob = chosen_merge(prepared(act_w, act_f), spec, ref, "none", ev.validate, args.knobs)
    score("activation alignment + Fisher weighting", activation.model, knobs=knob)
    score("activation alignment + Fisher weighting + REPAIR", repaired(activation.model, act_w, build, batches))
    for label, clients in (("", fp32), (" after FedFiOT's weight alignment", alignment_cause.permuted(fp32, spec, w_perms)),
                           (" after activation alignment", alignment_cause.permuted(fp32, spec, act_perms))):
        (full, a_full), (diag, _) = regmean_models(clients, setting, split, build, buffers, ev.validate, [None, (0.0,)])
        score(f"RegMean{label}", full, alpha=a_full)
        score(f"RegMean, diagonal Grams only (alpha 0){label}", diag, alpha=0.0)
        if label or setting.init == "shared":  # REPAIR's targets need corresponding neurons
            score(f"RegMean{label} + REPAIR", repaired(full, clients, build, batches), alpha=a_full)
    own = [(float(ev.validate(w)["accuracy"]), float(ev.test(w)[1])) for w in up.weights]
    best = int(np.argmax([v for v, _ in own]))
    rows["best single client"] = {"validation_accuracy": own[best][0], "test_accuracy": own[best][1], "client": best}
    movement = [alignment_cause.weight_movement(w, w0) for w, w0 in zip(up.weights, H.initial_weights(setting, split))]
    return [{**H.record_fields(setting), "reference": ref, "merges": rows,
             "cosine_to_init": {t: float(np.mean([m[t]["cosine"] for m in movement])) for t in movement[0]}}]


def markdown(payload: Mapping[str, Any]) -> str:
    rows = payload["rows"]
    if not rows:
        return "# After long local training: FedFiOT against RegMean and the best client\n"
    names = list(rows[0]["merges"])
    cols = [f"α={r['alpha']:g} {r['init']} E={r['epochs']} seed {r['seed']}" for r in rows]
    lines = ["# After long local training: FedFiOT against RegMean and the best client", "",
             "Same cached one-shot uploads for every row of a column; test accuracy in % (validation accuracy in "
             "brackets). REPAIR and the activation alignment use the server's "
             f"{rows[0]['validation_size']} unlabelled validation inputs (a diagnosis: the server data also fits). "
             "Knobs are chosen on validation.", "",
             f"Command: `{payload['command']}`", "",
             f"Machine: {payload['machine']}. Wall time {payload['seconds'] / 60:.1f} min.", "",
             "| merge | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for n in names:
        cells = [f"{100 * r['merges'][n]['test_accuracy']:.1f} ({100 * r['merges'][n]['validation_accuracy']:.1f})"
                 if n in r["merges"] else "–" for r in rows]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += ["", "## The weight alignment against the activation alignment", "",
              "Per hidden layer, the share of the non-reference clients' units that FedFiOT's weight matching puts "
              "where the activation matching puts them; the cosine between trained and initial weights (mean over "
              "clients) beside it.", "",
              "| cell | neurons moved by the weight alignment | same place as activation alignment, per layer | "
              "cosine to the initialisation, per tensor |", "|---|---|---|---|"]
    for c, r in zip(cols, rows):
        w = r["merges"]["FedFiOT weight alignment"]
        agree = ", ".join(f"{p} {100 * v:.0f} %" for p, v in w["agreement_with_activation"].items())
        cos = ", ".join(f"{t} {v:.2f}" for t, v in r["cosine_to_init"].items())
        lines.append(f"| {c} | {100 * w['moved']:.1f} % | {agree} | {cos} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run every cell and seed of the command line; returns the payload written to the results files."""
    return H.run_cell_analysis(argv, __doc__, "long_epochs_gap", len(KNOBS), run_setting, markdown, writing_here())


if __name__ == "__main__":
    main()
