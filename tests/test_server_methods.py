"""Benchmark rows that use server data: fold split, the comparison table, and combining result files."""

from __future__ import annotations

import numpy as np

from benchmarks import combine_results
from benchmarks import server_methods as S


def test_the_benchmark_folds_are_the_strategys_folds() -> None:
    from types import SimpleNamespace

    import torch
    from torch.utils.data import TensorDataset

    from fedfiot_flwr.refine.stage import split_folds

    split = SimpleNamespace(validation=TensorDataset(torch.arange(500)))
    fit_loader, sel_loader = S.fold_loaders(split)  # type: ignore[arg-type]
    fit, sel = split_folds(500)
    assert fit_loader.dataset.indices == fit.tolist() and sel_loader.dataset.indices == sel.tolist()
    assert len(fit) == len(sel) == 250
    assert not set(fit.tolist()) & set(sel.tolist())
    assert sorted(np.concatenate([fit, sel]).tolist()) == list(range(500))


def _rec(method: str, acc: float, seed: int = 0, init: str = "shared") -> dict:
    return {"method": method, "dataset": "fashion-mnist", "alpha": 0.1, "init": init, "epochs": 5, "seed": seed,
            "test_accuracy": acc, "validation_accuracy": acc, "knobs": {}}


def test_default_comparison_gives_the_margin_and_the_seeds_above_the_best_client() -> None:
    recs = [_rec("fedfiot-refined", 0.80), _rec("regmean", 0.79), _rec("best-single-client", 0.70),
            _rec("fedfiot-refined", 0.80, init="independent"), _rec("regmean", 0.70, init="independent"),
            _rec("best-single-client", 0.81, init="independent")]
    table = S.default_comparison({"records": recs})
    rows = [line for line in table.splitlines() if line.startswith("| fashion")]
    shared, independent = rows
    assert shared.endswith("| RegMean | +1.0 | 1/1 |")  # one point above RegMean, above the best client
    assert independent.endswith("| -1.0 | 0/1 |")  # the best single client is the best rival here
    assert "met" not in table and "**no**" not in table and "yes" not in table


def _payload(method: str, acc: float) -> dict:
    """A one_shot.py result file with one record of ``method`` in one setting."""
    return {"command": "x", "machine": "m", "started": "t", "grids": {}, "skipped": [],
            "records": [{**_rec(method, acc), "test_loss": 1.0, "fraction_permuted": 0.0}],
            "settings": [{"dataset": "fashion-mnist", "alpha": 0.1, "init": "shared", "epochs": 5, "seed": 0,
                          "merge_sweep_seconds": 1.0, "test_seconds": 2.0, "train_seconds": 3.0,
                          "fisher_seconds": 4.0, "cached": True, "client_sizes": [1]}],
            "timing": {"wall_seconds": 5.0}}


def test_combine_keeps_the_later_record_of_a_duplicate() -> None:
    out = combine_results.combine([_payload("fedavg", 0.5), _payload("fedavg", 0.6), _payload("fedfiot-refined", 0.7)])
    accs = {r["method"]: r["test_accuracy"] for r in out["records"]}
    assert accs == {"fedavg": 0.6, "fedfiot-refined": 0.7}
    assert out["settings"][0]["merge_sweep_seconds"] == 3.0
    assert out["methods"] == ["fedavg", "fedfiot-refined"]


def test_combine_drops_the_methods_it_is_told_to_and_the_page_loses_their_section(tmp_path) -> None:
    import json

    files = []
    for i, p in enumerate([_payload("fedavg", 0.5), _payload("fedfiot-refined", 0.8)]):
        files.append(tmp_path / f"{i}.json")
        files[-1].write_text(json.dumps(p))
    kept = combine_results.main([*map(str, files), "--out", str(tmp_path), "--name", "all", "--no-plots"])
    dropped = combine_results.main([*map(str, files), "--out", str(tmp_path), "--name", "some", "--no-plots",
                                    "--drop", "fedfiot-refined"])
    assert {r["method"] for r in kept["records"]} == {"fedavg", "fedfiot-refined"}
    assert [r["method"] for r in dropped["records"]] == ["fedavg"] and dropped["methods"] == ["fedavg"]
    assert "without the records of fedfiot-refined" in dropped["command"] and "without" not in kept["command"]
    section = "against every selection-only rival"
    assert section in (tmp_path / "all.md").read_text() and section not in (tmp_path / "some.md").read_text()
