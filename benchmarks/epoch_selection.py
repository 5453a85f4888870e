"""Local epochs as a per-method choice on validation, and what local training did to each cell.

``one_shot.py --select-epochs`` runs every method on the uploads of each local-epoch count E
(one cached set of uploads per E), then, per method and per (data set, alpha, init, seed),
keeps the E whose chosen model scores best on the server validation set (the test set is
never consulted; ties go to the smaller E) and reports that model's test accuracy. The
per-E records stay in the payload's ``records``; the choices are under ``epoch_selection``.

The diagnostics (payload key ``diagnostics``, one entry per cell, E and seed) say what the
local training did: the per-layer cosine between each client's trained weights and the
weights it started from, and, for FedFiOT (paper and default preset), how many neurons the
alignment moved, how many are moved in the returned merge and which merge was kept.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import harness as H
from fedfiot_flwr.choose import best_index
from fedfiot_flwr.options import Model

CELL_FIELDS = ("dataset", "model", "clients", "alpha", "init", "seed", "partition_seed", "validation_size")
"""The fields that identify a cell and seed apart from the local epochs."""
DIAGNOSED = ("fedfiot", "fedfiot-default")
"""The methods whose alignment is reported per cell."""
FIGURE_METHODS = ("fedfiot-default", "fedfiot", "regmean", "best-single-client")
"""The methods of the accuracy-against-epochs figure (those present in the run)."""
RULE = ("per method and per (data set, alpha, init, seed): the local epochs E whose chosen model has the best "
        "server validation accuracy (ties: the smaller E); the test set scores only that model")


def _number(value: Any) -> float:
    """A record's number, NaN for a missing or null one."""
    return math.nan if value is None else float(value)


def select_epochs(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per method and cell, the record of the local epochs that validation prefers.

    Parameters
    ----------
    records : sequence of dict
        The run's per-E records (``one_shot.py``'s ``records``).

    Returns
    -------
    list[dict]
        One entry per (method, cell, seed), in first-seen order: the cell's fields, ``method``,
        ``epochs`` (the chosen E), the chosen record's ``test_accuracy``,
        ``validation_accuracy`` and ``knobs``, and ``per_epoch`` (every E tried, ascending, with
        its validation and test accuracy). The chosen E is the first maximum of the validation
        accuracy over ascending E (:func:`fedfiot_flwr.choose.best_index`: a NaN never wins).
    """
    groups: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["method"], *(r[f] for f in CELL_FIELDS)), []).append(r)
    out = []
    for (method, *_), recs in groups.items():
        recs = sorted(recs, key=lambda r: r["epochs"])
        chosen = recs[best_index([_number(r["validation_accuracy"]) for r in recs])]
        out.append({
            **{f: chosen[f] for f in CELL_FIELDS}, "method": method, "epochs": chosen["epochs"],
            "test_accuracy": _number(chosen["test_accuracy"]),
            "validation_accuracy": _number(chosen["validation_accuracy"]), "knobs": chosen.get("knobs", {}),
            "per_epoch": [{"epochs": r["epochs"], "validation_accuracy": _number(r["validation_accuracy"]),
                           "test_accuracy": _number(r["test_accuracy"])} for r in recs],
        })
    return out


def selection_payload(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The payload's ``epoch_selection`` entry: the rule and :func:`select_epochs`'s choices."""
    return {"rule": RULE, "epochs": sorted({r["epochs"] for r in records}), "selected": select_epochs(records)}


def _column(r: Mapping[str, Any]) -> tuple[Any, ...]:
    return r["dataset"], r["alpha"], r["init"]


def selection_table(selected: Sequence[Mapping[str, Any]], methods: Sequence[str]) -> str:
    """Markdown: one row per method, one column per (data set, alpha, init), the chosen E in each cell.

    A cell reads ``81.2 (E=50)``: mean (± sample std) over seeds of the test accuracy at the
    chosen E, then the E chosen for each seed (seed order) when they differ.
    """
    cols = list(dict.fromkeys(_column(r) for r in selected))
    lines = ["| method | " + " | ".join(f"{d} α={a:g} {i}" for d, a, i in cols) + " |", "|---|" + "---|" * len(cols)]
    cells: dict[tuple[str, tuple[Any, ...]], tuple[float, str]] = {}
    best: dict[tuple[Any, ...], float] = {}
    for m in methods:
        for c in cols:
            rs = sorted((r for r in selected if r["method"] == m and _column(r) == c), key=lambda r: r["seed"])
            if not rs:
                continue
            mu, sd = H.mean_std([r["test_accuracy"] for r in rs])
            es = [r["epochs"] for r in rs]
            chosen = f"E={es[0]}" if len(set(es)) == 1 else "E=" + ", ".join(str(e) for e in es)
            cells[(m, c)] = (mu, f"{H.fmt_pct(mu, sd)} ({chosen})")
            if m != "fedfiot-fp32" and not math.isnan(mu):
                best[c] = max(best.get(c, -1.0), mu)
    for m in methods:
        row = []
        for c in cols:
            mu, text = cells.get((m, c), (math.nan, "–"))
            row.append(f"**{text}**" if m != "fedfiot-fp32" and mu == best.get(c) else text)
        if any(x != "–" for x in row):
            lines.append(f"| {H.METHOD_LABELS.get(m, m)} | " + " | ".join(row) + " |")
    seeds = sorted({r["seed"] for r in selected})
    lines += ["", f"Test accuracy (%) at the local epochs chosen on validation, mean ± sample std over seeds {seeds}; "
                  "E: the chosen local epochs (one per seed where they differ); bold: best per column."]
    return "\n".join(lines)


def layer_cosines(trained: Sequence[Model], initial: Sequence[Model], buffers: Sequence[str]) -> dict[str, list[float]]:
    """Per layer, each client's cosine between its trained weights and ``initial[k]``.

    Parameters
    ----------
    trained, initial : sequence of dict
        One state dict per client (same keys and shapes).
    buffers : sequence of str
        Entries that are not trained (left out).

    Returns
    -------
    dict[str, list[float]]
        ``{key: [cosine of client 0, ...]}`` for every weight with two or more dimensions (the
        layer's matrix or kernels; biases are left out), in float64; NaN where a norm is zero.
    """
    keys = [k for k, v in trained[0].items() if k not in buffers and np.asarray(v).ndim >= 2]
    out: dict[str, list[float]] = {}
    for k in keys:
        cos = []
        for w, w0 in zip(trained, initial):
            a, b = np.asarray(w[k], np.float64).ravel(), np.asarray(w0[k], np.float64).ravel()
            norm = float(np.linalg.norm(a) * np.linalg.norm(b))
            cos.append(float(a @ b) / norm if norm > 0 else math.nan)
        out[k] = cos
    return out


def cell_diagnostics(base: Mapping[str, Any], records: Sequence[Mapping[str, Any]], trained: Sequence[Model],
                     initial: Sequence[Model], buffers: Sequence[str]) -> dict[str, Any]:
    """One cell's diagnostics (an entry of the payload's ``diagnostics``).

    Parameters
    ----------
    base : dict
        The cell's identifying fields (:func:`benchmarks.harness.record_fields`).
    records : sequence of dict
        The cell's method records (FedFiOT's fractions and kept merge are read from them).
    trained : sequence of dict
        The clients' trained float32 weights.
    initial : sequence of dict
        The weights each client started from (:func:`benchmarks.harness.initial_weights`).
    buffers : sequence of str
        Untrained entries.

    Returns
    -------
    dict
        ``base`` plus ``init_cosine`` (per layer, mean over clients), ``init_cosine_per_client``,
        ``init_cosine_other_inits`` (independent init only: per layer, the mean cosine between a
        client's trained weights and the OTHER clients' initialisations, the level that
        unrelated starting points give) and, per method of :data:`DIAGNOSED` that ran,
        ``alignment_fraction_permuted``, ``fraction_permuted`` and ``kept``.
    """
    per_client = layer_cosines(trained, initial, buffers)
    out: dict[str, Any] = {**base, "init_cosine": {k: float(np.mean(v)) for k, v in per_client.items()},
                           "init_cosine_per_client": per_client}
    if base["init"] == "independent" and len(initial) > 1:
        n = len(initial)
        others = [layer_cosines(trained, [initial[(k + s) % n] for k in range(n)], buffers) for s in range(1, n)]
        out["init_cosine_other_inits"] = {k: float(np.mean([o[k] for o in others])) for k in per_client}
    for r in records:
        if r["method"] in DIAGNOSED:
            out[r["method"]] = {"alignment_fraction_permuted": float(r["alignment_fraction_permuted"]),
                                "fraction_permuted": float(r["fraction_permuted"]),
                                "kept": r["knobs"].get("variant")}
    return out


def _cell_label(d: Mapping[str, Any]) -> str:
    return H.column_label((d["dataset"], d["alpha"], d["init"], d["epochs"]))


def fedfiot_diagnostics_table(diagnostics: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: per cell, E and seed, FedFiOT's permuted fractions and kept merge (both presets)."""
    methods = [m for m in DIAGNOSED if any(m in d for d in diagnostics)]
    if not methods:
        return ""
    head = ["setting", "seed"]
    for m in methods:
        name = "paper" if m == "fedfiot" else "default"
        head += [f"{name}: permuted by the alignment (%)", f"{name}: permuted in the returned merge (%)",
                 f"{name}: kept"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for d in diagnostics:
        cells = [_cell_label(d), str(d["seed"])]
        for m in methods:
            x = d.get(m)
            cells += (["–"] * 3 if x is None else
                      [f"{100 * x['alignment_fraction_permuted']:.1f}", f"{100 * x['fraction_permuted']:.1f}",
                       str(x["kept"])])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cosine_table(diagnostics: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: per cell, E and seed, the per-layer cosine of trained to initial weights (mean over clients)."""
    if not diagnostics:
        return ""
    layers = list(dict.fromkeys(k for d in diagnostics for k in d["init_cosine"]))
    lines = ["| setting | seed | " + " | ".join(layers) + " |", "|---|---|" + "---|" * len(layers)]
    for d in diagnostics:
        other = d.get("init_cosine_other_inits", {})
        cells = [f"{d['init_cosine'][k]:.3f}" + (f" ({other[k]:.3f})" if k in other else "")
                 if k in d["init_cosine"] else "–" for k in layers]
        lines.append(f"| {_cell_label(d)} | {d['seed']} | " + " | ".join(cells) + " |")
    lines += ["", "Cosine between each client's trained weights and the weights it started from (the shared "
                  "initialisation, or the client's own), mean over clients; in parentheses (independent init): the "
                  "mean cosine to the other clients' initialisations, the level of an unrelated start."]
    return "\n".join(lines)


def selection_section(payload: Mapping[str, Any], methods: Sequence[str]) -> list[str]:
    """The page's section on the epochs chosen per method (empty without ``--select-epochs``)."""
    selection = payload.get("epoch_selection")
    if not selection:
        return []
    return ["## Test accuracy, local epochs chosen per method on validation", "",
            f"Local epochs tried: {selection['epochs']}. Rule: {selection['rule']}. The per-E accuracies are in "
            "the table \"Test accuracy\" (one column per E).", "", selection_table(selection["selected"], methods), ""]


def diagnostics_section(payload: Mapping[str, Any]) -> list[str]:
    """The page's sections on FedFiOT's alignment and on trained against initial weights, per cell and E."""
    diagnostics = payload.get("diagnostics") or []
    lines: list[str] = []
    fedfiot = fedfiot_diagnostics_table(diagnostics)
    if fedfiot:
        lines += ["## FedFiOT's alignment per cell and local epochs", "",
                  "Hidden neurons the alignment of the chosen knobs moved, those moved in the model returned (0 "
                  "when the identity merge or FedAvg was kept), and the merge kept (aligned / identity / fedavg).", "",
                  fedfiot, ""]
    cosines = cosine_table(diagnostics)
    if cosines:
        lines += ["## Trained against initial weights, per layer", "", cosines, ""]
    return lines


def plot_selection(payload: Mapping[str, Any], out: Path, name: str) -> Path | None:
    """``<name>_select_epochs.png``: test accuracy against local epochs of :data:`FIGURE_METHODS`.

    One panel per (data set, alpha); a colour per method, solid for shared and dashed for
    independent init; lines are means over seeds, stars the E each seed chose on validation.
    Returns None when the run has no epoch choice or none of the methods.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    selection = payload.get("epoch_selection")
    recs = [r for r in payload["records"] if r["method"] in FIGURE_METHODS]
    if not selection or not recs:
        return None
    chosen = [s for s in selection["selected"] if s["method"] in FIGURE_METHODS]
    groups = list(dict.fromkeys((r["dataset"], r["alpha"]) for r in recs))
    epochs = sorted({r["epochs"] for r in recs})
    colours = {m: f"C{i}" for i, m in enumerate(FIGURE_METHODS)}
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.5), squeeze=False)
    for ax, g in zip(axes[0], groups):
        for m in FIGURE_METHODS:
            for init, style in (("shared", "-"), ("independent", "--")):
                mine = [r for r in recs if r["method"] == m and r["init"] == init and (r["dataset"], r["alpha"]) == g]
                if not mine:
                    continue
                ys = [100 * H.mean_std([_number(r["test_accuracy"]) for r in mine if r["epochs"] == e])[0]
                      for e in epochs]
                ax.plot(epochs, ys, style, marker="o", color=colours[m], label=f"{H.METHOD_LABELS.get(m, m)}, {init}")
                picks = [s for s in chosen if s["method"] == m and s["init"] == init and (s["dataset"], s["alpha"]) == g]
                ax.plot([s["epochs"] for s in picks], [100 * s["test_accuracy"] for s in picks], "*", ms=14,
                        color=colours[m], markeredgecolor="k")
        ax.set_xscale("log", base=2)
        ax.set_xticks(epochs, [str(e) for e in epochs])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("local epochs E")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(f"{g[0]} α={g[1]:g} (stars: E chosen on validation)")
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    path = out / f"{name}_select_epochs.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
