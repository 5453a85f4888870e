"""Why the weight-space alignment fails with independent initialisations: what the weights still are.

FedFiOT aligns neurons by their weights. After a few local epochs a client's weights are still
mostly its random initialisation, and with independent initialisations that part differs from
client to client and says nothing about what a neuron computes. On cached one-shot uploads this
measures, per cell and seed:

- **how far training moved the weights**: per tensor, ``||w_T - w_0|| / ||w_0||`` and the cosine
  between the trained weights and the client's own initial weights (shared initialisation: the
  broadcast model; independent: the client's own init, rebuilt from its seed);
- **the weight-space merge**: FedFiOT's aligned merge (alternating Fisher-weighted weight
  matching, the largest client as the reference, no identity fallback) with its objective ``J``;
- **a functional alignment as a probe**: each client's hidden units matched to the reference's
  by the correlation of their post-ReLU activations on the server's *unlabelled* validation
  inputs (a linear assignment per layer), then FedFiOT's Fisher-weighted aggregation (and, for
  comparison, the size-weighted average) of the clients in that order, with ``J`` of that
  alignment; and the same start given back to FedFiOT's alternating minimisation, to see where
  its objective takes it.

The probe uses the server's inputs to align, so it is a diagnosis, not a protocol-1 method: it
asks whether the Fisher-weighted aggregation would work if the correspondence of the neurons were
known, and whether FedFiOT's objective can tell the right correspondence from the wrong one.

For every alignment, the knob setting (ρ, λ, Fisher scaling) is chosen on the validation fold
among the same settings; test accuracy is reported for the chosen one.

    .venv/bin/python research/alignment_cause.py --alphas 0.1 0.2 --inits independent shared --seeds 0 1 2

Writes ``research/results/alignment_cause.{md,json}``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import harness as H  # noqa: E402
from research import reference_choice, writing_here  # noqa: E402
from fedfiot_flwr.merge import MergeOptions, PermutationSpec, merge, prepare_clients  # noqa: E402
from fedfiot_flwr.merge.spec import apply_permutations  # noqa: E402

KNOBS = reference_choice.KNOBS
"""(rho, lam, Fisher scaling) settings; each alignment keeps the one with the best validation accuracy."""

Model = Mapping[str, np.ndarray]


def weight_movement(trained: Model, initial: Model) -> dict[str, dict[str, float]]:
    """Per weight tensor (two axes or more), ``{"relative_distance": ||w_T - w_0|| / ||w_0||, "cosine": cos(w_T, w_0)}``.

    Biases and other vectors are left out: they often start at zero, where both are undefined.

    >>> w0 = {"w": np.array([[3.0, 4.0]]), "b": np.zeros(1)}
    >>> weight_movement({"w": np.array([[3.0, 4.0]]) * 1.5, "b": np.ones(1)}, w0)["w"]
    {'relative_distance': 0.5, 'cosine': 1.0}
    """
    out = {}
    for name, w0 in initial.items():
        if np.ndim(w0) < 2:
            continue
        w0 = np.asarray(w0, dtype=np.float64).ravel()
        wt = np.asarray(trained[name], dtype=np.float64).ravel()
        n0, nt = float(np.linalg.norm(w0)), float(np.linalg.norm(wt))
        out[name] = {"relative_distance": round(float(np.linalg.norm(wt - w0)) / max(n0, 1e-30), 6),
                     "cosine": round(float(wt @ w0) / max(n0 * nt, 1e-30), 6)}
    return out


def hidden_activations(model: torch.nn.Module, spec: PermutationSpec, inputs: torch.Tensor) -> dict[str, np.ndarray]:
    """Post-ReLU activations of every hidden permutation's units, as ``(units, samples)`` arrays.

    A permutation's units are the outputs of the module owning its first neuron tensor (e.g.
    ``conv1`` for ``conv1.weight``); a convolution's spatial positions count as samples. The
    benchmark's models apply a ReLU after every hidden layer.
    """
    modules = {p: spec.neuron_tensors(p)[0].rsplit(".", 1)[0] for p in spec.perm_names}
    captured: dict[str, torch.Tensor] = {}
    hooks = [model.get_submodule(m).register_forward_hook(
        lambda _mod, _inp, out, p=p: captured.__setitem__(p, torch.relu(out))) for p, m in modules.items()]
    try:
        with torch.no_grad():
            model(inputs)
    finally:
        for h in hooks:
            h.remove()
    return {p: (a.transpose(0, 1).reshape(a.shape[1], -1) if a.dim() > 2 else a.T).double().numpy()
            for p, a in captured.items()}


def correlation_permutation(reference: np.ndarray, client: np.ndarray) -> np.ndarray:
    """The client units' order that maximises the summed activation correlation with the reference's.

    Returns ``p`` with global unit ``i`` <- client unit ``p[i]`` (the merge's convention).

    >>> ref = np.array([[1.0, 2.0, 3.0], [3.0, 1.0, 2.0]])
    >>> correlation_permutation(ref, ref[::-1]).tolist()
    [1, 0]
    """
    def standardise(a: np.ndarray) -> np.ndarray:
        return (a - a.mean(1, keepdims=True)) / (a.std(1, keepdims=True) + 1e-8)

    corr = standardise(reference) @ standardise(client).T / reference.shape[1]
    return linear_sum_assignment(-corr)[1]


def activation_alignment(activations: Sequence[Mapping[str, np.ndarray]], reference: int) -> dict[str, list[np.ndarray]]:
    """Per permutation, every client's units matched to the reference's by activation correlation.

    The reference keeps its own order. Units silent on every input correlate with nothing, so they
    are matched among themselves in no particular order.
    """
    ref = activations[reference]
    return {p: [np.arange(len(ref[p])) if k == reference else correlation_permutation(ref[p], a[p])
                for k, a in enumerate(activations)] for p in ref}


def permutation_agreement(first: Mapping[str, Sequence[np.ndarray]], second: Mapping[str, Sequence[np.ndarray]],
                          reference: int) -> dict[str, float]:
    """Per permutation of ``second``, the share of the non-reference clients' units both put in the same place.

    >>> permutation_agreement({"P": [np.arange(3), np.array([0, 2, 1])]}, {"P": [np.arange(3), np.arange(3)]}, 0)
    {'P': 0.3333333333333333}
    """
    return {p: float(np.mean([np.mean(np.asarray(first[p][k]) == np.asarray(second[p][k]))
                              for k in range(len(second[p])) if k != reference])) for p in second}


def permuted(models: Sequence[Model], spec: PermutationSpec, perms: Mapping[str, Sequence[np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """Every client model in the global order ``perms`` gives it."""
    return [apply_permutations(m, spec, {p: perms[p][k] for p in perms}) for k, m in enumerate(models)]


def run_setting(setting: H.Setting, args: argparse.Namespace, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Movement, the weight-space merge and the activation probe for one cell and seed."""
    cfg = setting.app_config()
    split = cfg.split()
    build, spec, buffers = H.model_tools(setting, split)
    ev = H.Evaluator(split, build)
    up = H.one_shot_uploads(setting, split, buffers, args.cache_dir, None, log).quantized
    k_clients = len(up.weights)
    ref = int(np.argmax(up.num_examples))
    if setting.init == "shared":
        initial = [H.state_numpy(cfg.build_model(split))] * k_clients
    else:
        initial = [H.state_numpy(cfg.build_model(split, seed=cfg.client_init_seed(k))) for k in range(k_clients)]
    movement = [weight_movement(w, w0) for w, w0 in zip(up.weights, initial)]
    inputs = torch.cat([x for x, _ in ev.validation]).cpu()  # the validation inputs, already stacked
    acts = [hidden_activations(H.load_numpy(build(), w), spec, inputs) for w in up.weights]
    perms = activation_alignment(acts, ref)
    act_w, act_f = permuted(up.weights, spec, perms), permuted(up.fishers, spec, perms)
    weight_clients = prepare_clients(up.weights, up.fishers, buffers=buffers, num_examples=up.num_examples, checked=True)
    act_clients = prepare_clients(act_w, act_f, buffers=buffers, num_examples=up.num_examples, checked=True)

    def scored(model: Model, objective: float | None) -> dict[str, Any]:
        return {"validation_accuracy": ev.validate(model)["accuracy"], "test_accuracy": ev.test(model)[1],
                "objective": objective}

    candidates: dict[str, list[dict[str, Any]]] = {m: [] for m in
                                                    ("weight", "activation", "activation-size", "activation-then-weight")}
    for rho, lam, scaling in KNOBS[:args.knobs]:
        knob = {"rho": rho, "lam": lam, "fisher_scaling": scaling}
        common = dict(lam=lam, rho=rho, reference=ref, fisher_scaling=scaling, fallback="none")
        wm = merge(weight_clients, None, spec, MergeOptions(**common))
        am = merge(act_clients, None, spec, MergeOptions(matching="none", **common))
        am_size = merge(act_clients, None, spec, MergeOptions(matching="none", aggregation="size", **common))
        again = merge(act_clients, None, spec, MergeOptions(**common))
        agreement = permutation_agreement(wm.permutations, perms, ref)
        candidates["weight"].append({**knob, **scored(wm.aligned_model, wm.aligned_objective),
                                     "identity_objective": wm.identity_objective, "agreement": agreement})
        candidates["activation"].append({**knob, **scored(am.model, am.objective)})
        candidates["activation-size"].append({**knob, **scored(am_size.model, None)})
        candidates["activation-then-weight"].append(
            {**knob, **scored(again.aligned_model, again.aligned_objective),
             "moved_from_activation": float(np.mean(again.fraction_permuted))})
        log(f"  rho={rho} lam={lam:g} {scaling}: weight {100 * candidates['weight'][-1]['test_accuracy']:.1f}% "
            f"(J {wm.aligned_objective:.4g}), activation {100 * candidates['activation'][-1]['test_accuracy']:.1f}% "
            f"(J {am.objective:.4g}), then weight {100 * candidates['activation-then-weight'][-1]['test_accuracy']:.1f}%")
    own = [(ev.validate(w)["accuracy"], ev.test(w)[1]) for w in up.weights]
    best = int(np.argmax([v for v, _ in own]))
    row = {**H.record_fields(setting), "reference": ref, "movement": movement,
           "best_single_client": {"client": best, "validation_accuracy": own[best][0], "test_accuracy": own[best][1]},
           "candidates": candidates,
           "chosen": {m: max(c, key=lambda r: r["validation_accuracy"]) for m, c in candidates.items()}}
    return [row]


def _mean_movement(row: Mapping[str, Any], tensor: str, key: str) -> float:
    return float(np.mean([m[tensor][key] for m in row["movement"]]))


def markdown(payload: Mapping[str, Any]) -> str:
    rows = payload["rows"]
    tensors = list(rows[0]["movement"][0]) if rows else []
    lines = [
        "# Why the alignment fails with independent initialisations",
        "",
        "Same cached one-shot uploads for every column; test accuracy in %. For each alignment the knob setting "
        f"(ρ, λ, Fisher scaling) is the one with the best accuracy on the {rows[0]['validation_size']} server validation "
        "examples. *Activation* columns align each client's hidden units to the reference client's by the correlation "
        f"of their activations on those {rows[0]['validation_size']} unlabelled inputs: a probe, not a protocol-1 "
        "method. J is FedFiOT's objective "
        "(lower is what the weight-space merge looks for); the per-seed J columns are at each alignment's chosen "
        "knobs, the last table compares the two alignments at the same knobs.",
        "",
        f"Command: `{payload['command']}`",
        "",
        f"Machine: {payload['machine']}. Wall time {payload['seconds'] / 60:.1f} min.",
        "",
        "## How far local training moved the weights",
        "",
        "Mean over the clients of the cosine between each client's trained weights and its initial weights "
        "(the relative distance ‖w_T − w_0‖ / ‖w_0‖ in brackets).",
        "",
        "| cell | seed | " + " | ".join(tensors) + " |",
        "|---|---|" + "---|" * len(tensors),
    ]
    for r in rows:
        cells = [f"{_mean_movement(r, t, 'cosine'):.2f} ({_mean_movement(r, t, 'relative_distance'):.2f})" for t in tensors]
        lines.append(f"| α={r['alpha']:g} {r['init']} | {r['seed']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## What each alignment gives",
        "",
        "| cell | seed | FedFiOT weight alignment | J | activation alignment + Fisher aggregation | J "
        "| activation alignment + size-weighted average | activation start, then FedFiOT's alternating "
        "minimisation | best single client | same order as weight alignment (fc layers, %) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = r["chosen"]
        fc = [p for p in c["weight"]["agreement"] if "fc" in p] or list(c["weight"]["agreement"])
        agree = np.mean([c["weight"]["agreement"][p] for p in fc])
        lines.append(
            f"| α={r['alpha']:g} {r['init']} | {r['seed']} | {100 * c['weight']['test_accuracy']:.1f} "
            f"| {c['weight']['objective']:.4g} | {100 * c['activation']['test_accuracy']:.1f} "
            f"| {c['activation']['objective']:.4g} | {100 * c['activation-size']['test_accuracy']:.1f} "
            f"| {100 * c['activation-then-weight']['test_accuracy']:.1f} "
            f"| {100 * r['best_single_client']['test_accuracy']:.1f} | {100 * agree:.1f} |")
    lines += ["", "## Mean over seeds", "",
              "| cell | seeds | weight alignment | activation + Fisher | activation + size | best single client "
              "| knob settings where J ranks the weight alignment lower | J weight / J activation, same knobs |",
              "|---|---|---|---|---|---|---|---|"]
    cells = dict.fromkeys((r["alpha"], r["init"]) for r in rows)
    for alpha, init in cells:
        group = [r for r in rows if (r["alpha"], r["init"]) == (alpha, init)]

        def stat(f: Callable[[Mapping[str, Any]], float]) -> str:
            v = np.array([f(r) for r in group]) * 100
            return f"{v.mean():.1f} ± {v.std(ddof=1):.1f}" if len(v) > 1 else f"{v.mean():.1f}"

        ratios = [w["objective"] / a["objective"] for r in group
                  for w, a in zip(r["candidates"]["weight"], r["candidates"]["activation"])]
        lines.append(f"| α={alpha:g} {init} | {len(group)} | {stat(lambda r: r['chosen']['weight']['test_accuracy'])} "
                     f"| {stat(lambda r: r['chosen']['activation']['test_accuracy'])} "
                     f"| {stat(lambda r: r['chosen']['activation-size']['test_accuracy'])} "
                     f"| {stat(lambda r: r['best_single_client']['test_accuracy'])} "
                     f"| {sum(x < 1 for x in ratios)} of {len(ratios)} | {min(ratios):.2f}-{max(ratios):.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run every cell and seed of the command line; returns the payload written to the results files."""
    return H.run_cell_analysis(argv, __doc__, "alignment_cause", len(KNOBS), run_setting, markdown, writing_here())


if __name__ == "__main__":
    main()
