"""Local training and evaluation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

from fedfiot_flwr.models import build_model
from fedfiot_flwr.task import evaluate, random_crop_flip, split_batch, train


def digits_loaders(batch_size: int = 64) -> tuple[DataLoader, DataLoader]:
    data = load_digits()
    x = torch.tensor(data.images / 16.0, dtype=torch.float32).unsqueeze(1)
    x = (x - x.mean()) / x.std()
    y = torch.tensor(data.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    tr, te = perm[:1200], perm[1200:]
    gen = torch.Generator().manual_seed(0)
    train_dl = DataLoader(TensorDataset(x[tr], y[tr]), batch_size=batch_size, shuffle=True, generator=gen)
    test_dl = DataLoader(TensorDataset(x[te], y[te]), batch_size=256)
    return train_dl, test_dl


def test_one_training_call_improves_accuracy_on_digits() -> None:
    torch.manual_seed(0)
    train_dl, test_dl = digits_loaders()
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    loss0, acc0 = evaluate(model, test_dl, device="cpu")
    metrics = train(model, train_dl, epochs=3, device="cpu", progress=False)
    loss1, acc1 = evaluate(model, test_dl, device="cpu")
    assert set(metrics) == {"train-loss", "train-accuracy"}
    assert acc0 < 0.3 and acc1 > 0.85 and acc1 > acc0 + 0.5
    assert loss1 < loss0
    assert 0.0 <= metrics["train-accuracy"] <= 1.0 and metrics["train-loss"] > 0


def test_train_uses_the_paper_optimizer_and_cosine_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, object] = {}
    real_sgd, real_cos = torch.optim.SGD, torch.optim.lr_scheduler.CosineAnnealingLR

    def sgd(params, **kw):  # type: ignore[no-untyped-def]
        seen["sgd"] = kw
        opt = real_sgd(params, **kw)
        seen["opt"] = opt
        return opt

    def cos(opt, **kw):  # type: ignore[no-untyped-def]
        seen["cos"] = kw
        return real_cos(opt, **kw)

    monkeypatch.setattr(torch.optim, "SGD", sgd)
    monkeypatch.setattr(torch.optim.lr_scheduler, "CosineAnnealingLR", cos)
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    train(model, [(torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,)))], epochs=4, device="cpu", progress=False)
    assert seen["sgd"] == {"lr": 0.02, "momentum": 0.9, "weight_decay": 2e-3}
    assert seen["cos"] == {"T_max": 4}
    # after 4 of 4 epochs the schedule is at its minimum
    assert seen["opt"].param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)  # type: ignore[attr-defined]


def test_evaluate_restores_mode_and_counts_correctly() -> None:
    model = build_model("mlp", (1, 8, 8), 3, seed=0)
    model.train()
    x = torch.randn(10, 1, 8, 8)
    y = model.eval()(x).argmax(1)
    model.train()
    loss, acc = evaluate(model, [(x[:4], y[:4]), {"img": x[4:], "label": y[4:]}], device="cpu")
    assert acc == 1.0 and loss > 0 and model.training


def test_random_crop_flip_is_a_crop_of_the_padded_image() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 32, 32, generator=gen)
    out = random_crop_flip(x, generator=gen)
    assert out.shape == x.shape
    padded = torch.nn.functional.pad(x, (4, 4, 4, 4))
    flips = 0
    for i in range(x.shape[0]):
        windows = [
            (f, padded[i, :, t : t + 32, s : s + 32].flip(-1) if f else padded[i, :, t : t + 32, s : s + 32])
            for f in (False, True)
            for t in range(9)
            for s in range(9)
        ]
        matches = [f for f, w in windows if torch.equal(w, out[i])]
        assert matches, i
        flips += matches[0]
    assert 16 < flips < 48
    assert not torch.equal(out, x)


def test_train_with_batch_augmentation_runs_on_rgb() -> None:
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    model = build_model("lenet", (3, 32, 32), 10, seed=0)
    metrics = train(model, [(x, y)], epochs=1, device="cpu", progress=False, augment=True)
    assert np.isfinite(metrics["train-loss"])


def test_split_batch_and_errors() -> None:
    x, y = torch.zeros(2, 1), torch.zeros(2, dtype=torch.int64)
    assert split_batch((x, y))[0] is x
    assert split_batch({"image": x, "labels": y})[1] is y
    with pytest.raises(ValueError, match="expected one of"):
        split_batch({"pixels": x, "label": y})
    with pytest.raises(ValueError, match="cannot split"):
        split_batch(x)
    model = build_model("mlp", (1, 8, 8), 10)
    with pytest.raises(ValueError, match="epochs"):
        train(model, [], epochs=0)
    with pytest.raises(ValueError, match="no examples"):
        train(model, [], epochs=1, device="cpu")
    with pytest.raises(ValueError, match="no examples"):
        evaluate(model, [], device="cpu")
