"""Local epochs chosen per method on validation (``one_shot.py --select-epochs``) and the per-cell diagnostics."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _fedfiot_helpers import one_torch_thread  # noqa: F401 - fixture

from benchmarks import epoch_selection as E
from benchmarks import harness as H
from benchmarks import one_shot

METHODS = ["fedavg", "fedfiot", "fedfiot-default", "best-single-client", "ensemble"]
CELL = ("dataset", "alpha", "init", "seed")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, one_torch_thread) -> tuple[dict[str, Any], Path]:  # noqa: ANN001, F811
    """A tiny real run: digits, 3 clients, E in {1, 2}, both inits, five methods; the JSON read back from disk."""
    root = tmp_path_factory.mktemp("select_epochs")
    one_shot.main(["--quick", "--clients", "3", "--epochs", "1", "2", "--select-epochs", "--methods", *METHODS,
                   "--out", str(root / "out"), "--cache-dir", str(root / "cache"), "--quiet"])
    return json.loads((root / "out" / "one_shot.json").read_text()), root / "out"


def _val(r: dict[str, Any]) -> float:
    return math.nan if r["validation_accuracy"] is None else r["validation_accuracy"]


def test_each_method_keeps_the_epochs_with_the_best_validation_accuracy(run: tuple[dict[str, Any], Path]) -> None:
    payload, out = run
    records, selected = payload["records"], payload["epoch_selection"]["selected"]
    methods = [*METHODS, "fedfiot-own"]
    assert sorted((s["method"], s["init"]) for s in selected) == sorted((m, i) for m in methods for i in H.INITS)
    for s in selected:
        per_e = sorted((r for r in records if r["method"] == s["method"] and all(r[f] == s[f] for f in CELL)),
                       key=lambda r: r["epochs"])
        assert [r["epochs"] for r in per_e] == [1, 2]
        vals = [_val(r) for r in per_e]
        assert all(math.isfinite(v) for v in vals), s["method"]  # every row, the ensemble too, can be chosen
        best = max(vals)
        expected = next(r for r in per_e if _val(r) == best)  # the smaller E on a tie
        assert s["epochs"] == expected["epochs"], s["method"]
        assert s["test_accuracy"] == expected["test_accuracy"] and s["validation_accuracy"] == best
    # The page names the E each method took.
    page = (out / "one_shot.md").read_text().split("## Test accuracy, local epochs chosen per method on validation")[1]
    for m in methods:
        row = next(line for line in page.splitlines() if line.startswith(f"| {H.METHOD_LABELS[m]} |"))
        assert row.count("(E=") == len(H.INITS), row


def test_the_rule_ignores_the_test_set_prefers_fewer_epochs_on_ties_and_never_picks_nan() -> None:
    def rec(method: str, epochs: int, val: float | None, test: float) -> dict[str, Any]:
        return {"method": method, "dataset": "d", "model": "m", "clients": 2, "alpha": 0.1, "init": "shared",
                "seed": 0, "partition_seed": 0, "validation_size": 10, "epochs": epochs,
                "validation_accuracy": val, "test_accuracy": test, "knobs": {}}

    records = [rec("a", 50, 0.7, 0.9), rec("a", 25, 0.8, 0.1),  # validation, not test, decides
               rec("b", 100, 0.6, 0.5), rec("b", 25, 0.6, 0.4), rec("b", 50, 0.5, 0.9),  # tie: smaller E
               rec("c", 25, None, 0.9), rec("c", 50, math.nan, 0.9), rec("c", 100, 0.2, 0.1)]  # NaN never wins
    got = {s["method"]: (s["epochs"], s["test_accuracy"]) for s in E.select_epochs(records)}
    assert got == {"a": (25, 0.1), "b": (25, 0.4), "c": (100, 0.1)}


def test_diagnostics_are_present_and_in_range(run: tuple[dict[str, Any], Path]) -> None:
    payload, out = run
    diagnostics = payload["diagnostics"]
    assert sorted((d["init"], d["epochs"]) for d in diagnostics) == sorted((i, e) for i in H.INITS for e in (1, 2))
    for d in diagnostics:
        assert d["init_cosine"] and all(-1.0 <= c <= 1.0 for c in d["init_cosine"].values())
        assert all(len(v) == 3 for v in d["init_cosine_per_client"].values())
        for m in ("fedfiot", "fedfiot-default"):
            x = d[m]
            assert 0.0 <= x["fraction_permuted"] <= 1.0 and 0.0 <= x["alignment_fraction_permuted"] <= 1.0
            assert x["kept"] in ("aligned", "identity", "fedavg")
            # The returned merge carries the alignment's permutation only when the aligned merge was kept.
            moved = x["alignment_fraction_permuted"] if x["kept"] == "aligned" else 0.0
            assert x["fraction_permuted"] == pytest.approx(moved)
        if d["init"] == "independent":
            # Each client ends nearer its own start than the other clients' starts: the recomputed
            # initialisations are the ones the clients trained from.
            other = d["init_cosine_other_inits"]
            assert all(d["init_cosine"][k] > other[k] + 0.5 for k in other)
            assert max(x["alignment_fraction_permuted"] for x in (d["fedfiot"], d["fedfiot-default"])) > 0.2
    page = (out / "one_shot.md").read_text()
    assert "## FedFiOT's alignment per cell and local epochs" in page
    assert "## Trained against initial weights, per layer" in page


def test_the_figure_is_written(run: tuple[dict[str, Any], Path]) -> None:
    _, out = run
    figure = out / "one_shot_select_epochs.png"
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("init", H.INITS)
def test_initial_weights_are_where_the_clients_training_starts(init: str, one_torch_thread) -> None:  # noqa: ANN001, F811
    # With a vanishing learning rate a client's trained weights are its starting weights.
    setting = H.Setting("digits", "mlp", 3, 0.1, init, 0, 1, validation_size=200, lr=1e-12)
    split = setting.app_config().split()
    initial = H.initial_weights(setting, split)
    again = H.initial_weights(setting, split)
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(initial, again) for k in a)  # deterministic
    for pid in (0, 2):
        trained = H.train_client(setting.app_config(), split, pid, H.shared_init(setting, split)).weights
        for k, v in trained.items():
            np.testing.assert_allclose(v, initial[pid][k], atol=1e-7, err_msg=k)
    same = all(np.array_equal(initial[0][k], initial[1][k]) for k in initial[0])
    assert same == (init == "shared")
