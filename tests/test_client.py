"""The client reply: packing, wire round trip, size, validation, and one client round."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict
from flwr.serverapp.strategy.strategy_utils import validate_message_reply_consistency
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.wire_bytes import reply_num_bytes
from fedfiot_flwr.client import (
    ARRAYS_RECORD,
    METRICS_RECORD,
    STYPE_WEIGHT,
    STYPE_WEIGHT_FISHER,
    ClientUpload,
    fedavg_reply,
    pack_reply,
    train_and_pack,
    train_round,
    unpack_reply,
)
from fedfiot_flwr.models import build_model
from fedfiot_flwr.quantize import LEVELS


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3)
        self.bn1 = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn1(self.conv1(x))).flatten(1))


def _bn_model() -> BNNet:
    torch.manual_seed(0)
    model = BNNet()
    model.train()
    model(torch.randn(16, 1, 8, 8))  # non-trivial running stats and num_batches_tracked
    with torch.no_grad():
        model.bn1.weight.uniform_(0.5, 1.5)
        model.bn1.bias.uniform_(-0.5, 0.5)
    return model


def _fisher(model: nn.Module) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {n: torch.rand(p.shape, generator=gen) ** 4 for n, p in model.named_parameters()}


def _wire(content: RecordDict) -> RecordDict:
    proto = ProtoRecordDict()
    proto.ParseFromString(recorddict_to_proto(content).SerializeToString())
    return recorddict_from_proto(proto)


def _shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_round_trip_through_the_wire_with_buffers() -> None:
    model = _bn_model()
    state, fisher = model.state_dict(), _fisher(model)
    content = pack_reply(state, fisher, 123, {"train-loss": 0.5, "train-accuracy": 0.75})
    arrays = content[ARRAYS_RECORD]
    assert list(arrays) == list(state)
    assert arrays["conv1.weight"].stype == STYPE_WEIGHT_FISHER
    assert arrays["bn1.running_var"].stype == STYPE_WEIGHT
    assert arrays["bn1.num_batches_tracked"].numpy().dtype == np.int64

    params = [n for n, _ in model.named_parameters()]
    upload = unpack_reply(_wire(content), _shapes(model), client="c7", parameters=params)
    assert isinstance(upload, ClientUpload)
    assert upload.num_examples == 123
    assert upload.metrics == {"train-loss": 0.5, "train-accuracy": 0.75}
    assert list(upload.fisher) == params
    assert upload.buffers == ["bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked"]
    assert int(upload.weights["bn1.num_batches_tracked"]) == 1
    for name, value in state.items():
        got, ref = upload.weights[name], value.numpy()
        assert got.shape == ref.shape
        if name in fisher:
            f, fref = upload.fisher[name], fisher[name].numpy()
            assert f.dtype == np.float32 and (f >= 0).all()
            assert np.abs(f - fref).max() <= fref.max() / (2 * LEVELS) * 1.001
        if np.issubdtype(ref.dtype, np.floating):
            assert np.abs(got - ref).max() <= np.abs(ref).max() / (2 * LEVELS) * 1.001
            assert np.abs(got - ref).max() > 0  # really quantized


def test_reply_is_no_larger_than_float32_fedavg_plus_64_bits_per_tensor() -> None:
    model = build_model("fednet", (3, 32, 32), 10, seed=0)
    state = model.state_dict()
    metrics = {"train-loss": 1.0, "train-accuracy": 0.5}
    ours = pack_reply(state, _fisher(model), 500, metrics)
    fedavg = fedavg_reply(state, 500, metrics)
    n_tensors = len(state)
    d = sum(v.numel() for v in state.values())
    for arrays_only in (True, False):
        ours_b = reply_num_bytes(ours, arrays_only=arrays_only)
        fedavg_b = reply_num_bytes(fedavg, arrays_only=arrays_only)
        assert ours_b <= fedavg_b + 8 * n_tensors, (ours_b, fedavg_b)
    # the payload is exactly 32 d + 64 L bits plus the key names
    keys = sum(len(k) for k in state)
    assert reply_num_bytes(ours, arrays_only=True) == 4 * d + 8 * n_tensors + keys
    # and really on the wire: the serialised proto of ours is not larger than FedAvg's
    assert recorddict_to_proto(ours).ByteSize() <= recorddict_to_proto(fedavg).ByteSize() + 8 * n_tensors


def test_reply_has_flowers_one_arrayrecord_one_metricrecord_shape() -> None:
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    contents = [pack_reply(model.state_dict(), _fisher(model), n, {"train-loss": 1.0}) for n in (5, 9)]
    validate_message_reply_consistency(contents, "num-examples", check_arrayrecord=True)
    assert contents[0][METRICS_RECORD]["num-examples"] == 5


def test_pack_reply_validates() -> None:
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    state, fisher = model.state_dict(), _fisher(model)
    with pytest.raises(ValueError, match="positive integer"):
        pack_reply(state, fisher, 0)
    with pytest.raises(ValueError, match="not in the state dict"):
        pack_reply(state, {**fisher, "ghost": torch.ones(1)}, 3)
    with pytest.raises(ValueError, match="non-negative"):
        pack_reply(state, {**fisher, "fc1.bias": -torch.ones(128)}, 3)
    with pytest.raises(ValueError, match="shape"):
        pack_reply(state, {**fisher, "fc1.bias": torch.ones(3)}, 3)
    bad = dict(state)
    bad["fc2.bias"] = torch.full((64,), float("nan"))
    with pytest.raises(ValueError, match="fc2.bias"):
        pack_reply(bad, fisher, 3)
    with pytest.raises(ValueError, match="num-examples"):
        pack_reply(state, fisher, 3, {"num-examples": 3})


def _good() -> tuple[BNNet, RecordDict]:
    model = _bn_model()
    return model, pack_reply(model.state_dict(), _fisher(model), 10, {"train-loss": 1.0})


def _replace(content: RecordDict, name: str, array: Array) -> RecordDict:
    arrays = ArrayRecord({k: (array if k == name else v) for k, v in content[ARRAYS_RECORD].items()})
    return RecordDict({ARRAYS_RECORD: arrays, METRICS_RECORD: content[METRICS_RECORD]})


def _raw(shape: tuple[int, ...], scales: tuple[float, ...], codes: np.ndarray, stype: str = STYPE_WEIGHT_FISHER) -> Array:
    data = struct.pack(f"<{len(scales)}f", *scales) + codes.astype("<i2").tobytes()
    return Array(dtype="int16", shape=shape, stype=stype, data=data)


def test_unpack_rejects_malformed_replies() -> None:
    model, good = _good()
    shapes = _shapes(model)
    params = [n for n, _ in model.named_parameters()]
    w = (4, 1, 3, 3)
    cases: list[tuple[RecordDict, str]] = [
        (RecordDict({METRICS_RECORD: good[METRICS_RECORD]}), "no ArrayRecord"),
        (RecordDict({ARRAYS_RECORD: good[ARRAYS_RECORD]}), "no MetricRecord"),
        (RecordDict({ARRAYS_RECORD: good[ARRAYS_RECORD], METRICS_RECORD: MetricRecord({"x": 1.0})}), "num-examples"),
        (RecordDict({ARRAYS_RECORD: good[ARRAYS_RECORD], METRICS_RECORD: MetricRecord({"num-examples": 0})}), "positive"),
        (RecordDict({ARRAYS_RECORD: good[ARRAYS_RECORD], METRICS_RECORD: MetricRecord({"num-examples": 2.5})}), "positive"),
        (RecordDict({ARRAYS_RECORD: good[ARRAYS_RECORD], METRICS_RECORD: MetricRecord({"num-examples": -3})}), "positive"),
        (_replace(good, "conv1.weight", _raw((4, 1, 2, 2), (1.0, 1.0), np.zeros((2, 4, 1, 2, 2)))), "has shape"),
        (_replace(good, "conv1.weight", _raw(w, (1.0, 1.0), np.full((2, *w), -32768))), "out of range"),
        (_replace(good, "conv1.weight", _raw(w, (1.0, 1.0), np.concatenate([np.ones(w), -np.ones(w)]))), "negative Fisher"),
        (_replace(good, "conv1.weight", _raw(w, (float("nan"), 1.0), np.ones((2, *w)))), "bad weight scale"),
        (_replace(good, "conv1.weight", _raw(w, (1.0, -2.0), np.ones((2, *w)))), "bad Fisher scale"),
        (_replace(good, "conv1.weight", _raw(w, (0.0, 1.0), np.ones((2, *w)))), "scale 0"),
        (_replace(good, "conv1.weight", _raw(w, (1.0, 1.0), np.ones((1, *w)))), "data bytes"),
        (_replace(good, "conv1.weight", Array(dtype="float32", shape=w, stype=STYPE_WEIGHT_FISHER, data=b"")), "dtype"),
        (_replace(good, "conv1.weight", Array(dtype="int16", shape=w, stype="pickle", data=b"")), "unknown stype"),
        (_replace(good, "conv1.weight", Array(np.zeros(w, np.float32))), "must be quantized"),
        (_replace(good, "conv1.weight", _raw(w, (1.0,), np.ones(w), STYPE_WEIGHT)), "carries no Fisher"),
        (_replace(good, "bn1.running_var", _raw((4,), (1.0, 1.0), np.ones((2, 4)))), "not a parameter"),
    ]
    for content, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            unpack_reply(content, shapes, client="c3", parameters=params)
        assert "client c3" in str(info.value)
    arrays = dict(good[ARRAYS_RECORD])
    missing = RecordDict({ARRAYS_RECORD: ArrayRecord({k: v for k, v in arrays.items() if k != "fc.bias"}),
                          METRICS_RECORD: good[METRICS_RECORD]})
    with pytest.raises(ValueError, match=r"missing \['fc.bias'\]"):
        unpack_reply(missing, shapes, client="c3")
    extra = RecordDict({ARRAYS_RECORD: ArrayRecord({**arrays, "ghost": arrays["fc.bias"]}),
                        METRICS_RECORD: good[METRICS_RECORD]})
    with pytest.raises(ValueError, match=r"extra \['ghost'\]"):
        unpack_reply(extra, shapes, client="c3")
    wrong = dict(shapes)
    wrong["fc.bias"] = (4,)
    with pytest.raises(ValueError, match="'fc.bias' has shape"):
        unpack_reply(good, wrong, client="c3")
    with pytest.raises(ValueError, match="not a RecordDict"):
        unpack_reply({"fedfiot": 1}, client="c3")  # type: ignore[arg-type]
    # the good reply passes, also with extra unrelated records
    content = RecordDict({**good, "config": ConfigRecord({"a": 1})})
    assert unpack_reply(content, shapes, client="c3", parameters=params).num_examples == 10


def test_train_and_pack_one_client_round_on_digits() -> None:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images[:400] / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(data.target[:400])
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    fisher_loader = DataLoader(TensorDataset(x, y), batch_size=128)
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    content = train_and_pack(model, loader, 2, device="cpu", fisherloader=fisher_loader, progress=False)
    upload = unpack_reply(_wire(content), _shapes(model), client="digits")
    assert upload.num_examples == 400
    assert set(upload.metrics) == {"train-loss", "train-accuracy"}
    assert set(upload.fisher) == {n for n, _ in model.named_parameters()}
    assert all(float(f.max()) > 0 for f in upload.fisher.values())
    for name, value in model.state_dict().items():
        ref = value.numpy()
        assert np.abs(upload.weights[name] - ref).max() <= np.abs(ref).max() / (2 * LEVELS) * 1.001


def _digits_round(fn, seed: int = 3):  # noqa: ANN001, ANN202
    """``fn`` (train_and_pack or train_round) on 200 digits images, seeded, Fisher over the same images unshuffled."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images[:200] / 16.0, dtype=torch.float32).unsqueeze(1)
    data_set = TensorDataset(x, torch.tensor(data.target[:200]))
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    loader = DataLoader(data_set, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(seed))
    torch.manual_seed(seed)
    out = fn(model, loader, 1, device="cpu", fisherloader=DataLoader(data_set, batch_size=100), lr=0.05,
             progress=False)
    return model, out


def _payload(content: RecordDict) -> dict[str, bytes]:
    return {k: bytes(a.data) for k, a in content[ARRAYS_RECORD].items()}


def test_train_round_is_train_and_pack_with_the_float32_upload_and_timings() -> None:
    _, packed = _digits_round(train_and_pack)
    model, got = _digits_round(train_round)
    assert _payload(got.reply) == _payload(packed)
    assert dict(got.reply[METRICS_RECORD]) == dict(packed[METRICS_RECORD])
    # The float32 weights and Fisher are what was packed: packing them again gives the same bytes.
    metrics = {k: v for k, v in got.reply[METRICS_RECORD].items() if k != "num-examples"}
    again = pack_reply(got.weights, got.fisher, int(got.reply[METRICS_RECORD]["num-examples"]), metrics)
    assert _payload(again) == _payload(got.reply)
    assert list(got.weights) == list(model.state_dict()) and set(got.fisher) == {n for n, _ in model.named_parameters()}
    assert all(a.dtype == np.float32 for a in [*got.weights.values(), *got.fisher.values()])
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(got.weights[name], value.numpy())
    first, tensor = next(iter(model.state_dict().items()))
    with torch.no_grad():  # copies: the model may go on training
        tensor.add_(1.0)
    assert not np.array_equal(got.weights[first], tensor.numpy())
    assert got.train_seconds > 0 and got.fisher_seconds > 0


def test_a_client_written_from_the_documented_format_is_byte_identical() -> None:
    """The README recipe (NumPy + struct only) must produce exactly what pack_reply does."""

    def q(x: np.ndarray) -> tuple[np.ndarray, float]:
        s = np.float32(np.abs(x).max()) if x.size else np.float32(0)
        if s == 0:
            return np.zeros(x.shape, "<i2"), 0.0
        return np.clip(np.rint(x.astype(np.float64) / float(s) * LEVELS), -LEVELS, LEVELS).astype("<i2"), float(s)

    model = build_model("lenet", (1, 28, 28), 10, seed=3, bias=True)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    fisher = {k: v.numpy() for k, v in _fisher(model).items()}
    external = {}
    for name, w in state.items():
        (cw, sw), (cf, sf) = q(w), q(fisher[name])
        data = struct.pack("<ff", sw, sf) + cw.tobytes() + cf.tobytes()
        external[name] = Array(dtype="int16", shape=tuple(w.shape), stype="fedfiot.q16wf.v1", data=data)
    ours = pack_reply(state, fisher, 7)[ARRAYS_RECORD]
    for name in state:
        assert ours[name].data == external[name].data and ours[name].stype == external[name].stype


def test_fisher_reply_packs_the_users_own_model_and_metric_names_unchanged() -> None:
    from fedfiot_flwr.client import fisher_reply
    from fedfiot_flwr.fisher import diagonal_fisher

    torch.manual_seed(0)
    x, y = torch.randn(48, 6), torch.randint(0, 3, (48,))
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)  # the user's own loop
    for xb, yb in loader:
        optim.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        optim.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    content = fisher_reply(model, loader, {"train_loss": 0.25, "steps": 3})
    assert dict(content[METRICS_RECORD]) == {"num-examples": 48, "train_loss": 0.25, "steps": 3}
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])  # the model is left as trained
    upload = unpack_reply(_wire(content), _shapes(model), client="own")
    expected = diagonal_fisher(model, loader, "empirical", device="cpu")
    for name, f in expected.items():
        ref = f.numpy()
        assert np.abs(upload.fisher[name] - ref).max() <= ref.max() / (2 * LEVELS) * 1.001 + 1e-12


def test_the_wire_is_torch_free_and_client_and_server_do_not_import_each_other() -> None:
    import ast
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = "import sys, fedfiot_flwr.wire; assert 'torch' not in sys.modules, 'wire imports torch'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)

    def imported(path: Path) -> set[str]:
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        return names

    pkg = root / "fedfiot_flwr"
    client_side = [pkg / "client.py", pkg / "curvature.py", pkg / "fisher.py", *(pkg / "wire").glob("*.py"),
                   root / "client_app.py"]
    for path in client_side:
        assert not any(m.startswith("fedfiot_flwr.server") for m in imported(path)), path.name
    for path in (pkg / "server").glob("*.py"):
        bad = {m for m in imported(path) if m in ("fedfiot_flwr.client", "fedfiot_flwr.curvature", "fedfiot_flwr.task")}
        assert not bad, (path.name, bad)
