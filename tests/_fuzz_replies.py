"""Corrupted FedFiOT replies for the fuzz and property tests.

Every reply starts as an honest one built with the real packing (:func:`fedfiot_flwr.client.pack_reply`)
and is then corrupted at the byte, record or message level. Each corruption says whether the
result must still be accepted under the documented reply rules (``docs/robustness.md``): always,
never, or only by a server that caps the Fishers (:data:`WHEN_CAPPED`: a finite Fisher above
``MAX_FISHER_MAGNITUDE``); the tests check that the strategy merges exactly the valid replies.

The wire layout used to corrupt scales and codes is the documented one: a parameter's Array holds
a float32 weight scale, a float32 Fisher scale, then int16 weight codes and int16 Fisher codes; a
floating-point buffer holds one float32 scale and its int16 codes.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict
from torch import nn

from fedfiot_flwr.client import pack_reply
from fedfiot_flwr.reply_limits import MAX_FISHER_MAGNITUDE, MAX_INTEGER_BUFFER, MAX_NUM_EXAMPLES, MAX_WEIGHT_MAGNITUDE

F32_MAX = float(np.finfo(np.float32).max)
WHEN_CAPPED = "valid when capped"
"""Validity of a reply that a capping server must merge (with its Fisher capped) and a server
without the cap must exclude: a finite Fisher above ``MAX_FISHER_MAGNITUDE``."""
Validity = bool | str


class TinyMLP(nn.Module):
    """4 -> 6 -> 5 -> 3 with biases."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(4, 6), nn.Linear(6, 5), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class TinyBN(nn.Module):
    """4 -> 6 (BatchNorm) -> 3: running statistics and an integer ``num_batches_tracked``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn1, self.fc2 = nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn1(self.fc1(x))))


@dataclass
class Honest:
    """An honest client's upload before packing."""

    state: dict[str, np.ndarray]
    fisher: dict[str, np.ndarray]
    num_examples: int

    def pack(self, **changes: object) -> RecordDict:
        state = changes.get("state", self.state)
        fisher = changes.get("fisher", self.fisher)
        n = changes.get("num_examples", self.num_examples)
        return pack_reply(state, fisher, n, {"train-loss": 0.5, "train-accuracy": 0.9})  # type: ignore[arg-type]


def honest_upload(model: nn.Module, rng: np.random.Generator) -> Honest:
    """Random weights (BatchNorm variances positive) and a random non-negative Fisher."""
    params = {n for n, _ in model.named_parameters()}
    state: dict[str, np.ndarray] = {}
    for name, t in model.state_dict().items():
        if not t.is_floating_point():
            state[name] = np.asarray(int(rng.integers(1, 50)), dtype=np.int64).reshape(tuple(t.shape))
        elif name.endswith("running_var"):
            state[name] = rng.uniform(0.5, 2.0, size=tuple(t.shape)).astype(np.float32)
        else:
            state[name] = rng.normal(size=tuple(t.shape)).astype(np.float32)
    fisher = {n: (rng.random(size=state[n].shape) ** 2).astype(np.float32) for n in state if n in params}
    return Honest(state, fisher, int(rng.integers(20, 200)))


# ----------------------------------------------------------------------- record-level helpers


def arrays_of(content: RecordDict) -> ArrayRecord:
    (rec,) = content.array_records.values()
    return rec


def metrics_of(content: RecordDict) -> MetricRecord:
    (rec,) = content.metric_records.values()
    return rec


def with_fisher(content: RecordDict) -> list[str]:
    """Names of the Arrays carrying a Fisher (the layout with two scales)."""
    return [k for k, a in arrays_of(content).items() if a.stype.endswith("wf.v1")]


def float_buffers(content: RecordDict) -> list[str]:
    return [k for k, a in arrays_of(content).items() if a.dtype == "int16" and not a.stype.endswith("wf.v1")]


def int_buffers(content: RecordDict) -> list[str]:
    return [k for k, a in arrays_of(content).items() if a.dtype != "int16"]


def _rewrite(content: RecordDict, name: str, data: bytes | None = None, **meta: object) -> RecordDict:
    arr = arrays_of(content)[name]
    arrays_of(content)[name] = Array(
        dtype=str(meta.get("dtype", arr.dtype)),
        shape=tuple(meta.get("shape", tuple(arr.shape))),  # type: ignore[arg-type]
        stype=str(meta.get("stype", arr.stype)),
        data=arr.data if data is None else data,
    )
    return content


def set_scale(content: RecordDict, name: str, which: int, value: float) -> RecordDict:
    """Overwrite scale ``which`` (0: weight, 1: Fisher) of tensor ``name``."""
    data = arrays_of(content)[name].data
    return _rewrite(content, name, data[: 4 * which] + struct.pack("<f", value) + data[4 * which + 4 :])


def set_codes(content: RecordDict, name: str, which: int, codes: np.ndarray) -> RecordDict:
    """Overwrite the weight (0) or Fisher (1) codes of parameter ``name``."""
    arr = arrays_of(content)[name]
    n = int(np.prod(arr.shape))
    data = arr.data
    start = 8 + 2 * n * which
    new = np.broadcast_to(np.asarray(codes, dtype="<i2"), (n,)).tobytes()
    return _rewrite(content, name, data[:start] + new + data[start + 2 * n :])


def set_num_examples(content: RecordDict, value: object) -> RecordDict:
    rec = metrics_of(content)
    rec["num-examples"] = value  # type: ignore[assignment]
    return content


# ------------------------------------------------------------------------------ corruptions

Corruption = Callable[[Honest, np.random.Generator], tuple[RecordDict, Validity]]
"""``(honest upload, rng) -> (reply content, whether the server must merge it)``: ``True``,
``False`` or :data:`WHEN_CAPPED`. A corruption labelled "(ignored)" adds something the server
must ignore: it must merge the reply exactly as the honest reply without the addition."""


def _huge_fisher_validity(largest: float) -> Validity:
    return True if largest <= MAX_FISHER_MAGNITUDE else WHEN_CAPPED


def _scaled_fisher(factor: float) -> Corruption:
    def make(up: Honest, rng: np.random.Generator) -> tuple[RecordDict, Validity]:
        fisher = {k: (v.astype(np.float64) / max(float(v.max()), 1e-12) * factor) for k, v in up.fisher.items()}
        return up.pack(fisher=fisher), _huge_fisher_validity(factor)
    return make


def _fisher_scale(value: float, valid: Validity = False) -> Corruption:
    def make(up: Honest, rng: np.random.Generator) -> tuple[RecordDict, Validity]:
        content = up.pack()
        return set_scale(content, str(rng.choice(with_fisher(content))), 1, value), valid
    return make


def _weight_scale(value: float, buffer: bool = False) -> Corruption:
    def make(up: Honest, rng: np.random.Generator) -> tuple[RecordDict, bool]:
        content = up.pack()
        names = float_buffers(content) if buffer else with_fisher(content)
        if not names:  # a model without float buffers: corrupt a parameter instead
            names = with_fisher(content)
        return set_scale(content, str(rng.choice(names)), 0, value), False
    return make


def _num_examples(value: object, valid: bool) -> Corruption:
    def make(up: Honest, rng: np.random.Generator) -> tuple[RecordDict, bool]:
        return set_num_examples(up.pack(), value), valid
    return make


def _all_fisher_at_float32_max(up: Honest, rng: np.random.Generator) -> tuple[RecordDict, Validity]:
    fisher = {k: np.full(v.shape, F32_MAX, np.float32) for k, v in up.fisher.items()}
    return up.pack(fisher=fisher), WHEN_CAPPED


def _scaled_weights(factor: float) -> Corruption:
    def make(up: Honest, rng: np.random.Generator) -> tuple[RecordDict, bool]:
        name = str(rng.choice(list(up.fisher)))
        state = dict(up.state)
        w = state[name].astype(np.float64)
        state[name] = w / max(float(np.abs(w).max()), 1e-12) * factor
        return up.pack(state=state), factor <= MAX_WEIGHT_MAGNITUDE
    return make


def _negative_fisher_codes(up: Honest, rng: np.random.Generator) -> tuple[RecordDict, bool]:
    content = up.pack()
    return set_codes(content, str(rng.choice(with_fisher(content))), 1, np.array(-7)), False


def _min_int16_codes(up: Honest, rng: np.random.Generator) -> tuple[RecordDict, bool]:
    content = up.pack()
    return set_codes(content, str(rng.choice(with_fisher(content))), 0, np.array(-32768)), False


def _zero_scale_nonzero_codes(up: Honest, rng: np.random.Generator) -> tuple[RecordDict, bool]:
    content = up.pack()
    return set_scale(content, str(rng.choice(with_fisher(content))), 0, 0.0), False


def _wrong_declared_shape(up: Honest, rng: np.random.Generator) -> tuple[RecordDict, bool]:
    content = up.pack()
    name = str(rng.choice(with_fisher(content)))
    shape = tuple(arrays_of(content)[name].shape)
    return _rewrite(content, name, shape=(int(np.prod(shape)),) if len(shape) > 1 else (1, shape[0])), False


def _wrong_shape_repacked(up: Honest, rng: np.random.Generator) -> tuple[RecordDict, bool]:
    name = str(rng.choice(list(up.fisher)))
    shape = tuple(up.state[name].shape)
    bigger = (shape[0] + 1, *shape[1:])
    state = {**up.state, name: np.ones(bigger, np.float32)}
    fisher = {**up.fisher, name: np.ones(bigger, np.float32)}
    return up.pack(state=state, fisher=fisher), False


def _wrong_dtype(up: Honest, rng: np.random.Generator) -> tuple[RecordDict, bool]:
    content = up.pack()
    return _rewrite(content, str(rng.choice(with_fisher(content))), dtype="float32"), False


def _unknown_stype(up: Honest, rng: np.random.Generator) -> tuple[RecordDict, bool]:
    content = up.pack()
    return _rewrite(content, str(rng.choice(with_fisher(content))), stype="fedfiot.q8.v9"), False


def _truncated(up: Honest, rng: np.random.Generator) -> tuple[RecordDict, bool]:
    content = up.pack()
    name = str(rng.choice(list(arrays_of(content))))
    data = arrays_of(content)[name].data
    return _rewrite(content, name, data[: int(rng.integers(0, max(1, len(data))))]), False


def _extra_bytes(up: Honest, rng: np.random.Generator) -> tuple[RecordDict, bool]:
    content = up.pack()
    name = str(rng.choice(with_fisher(content)))
    return _rewrite(content, name, arrays_of(content)[name].data + b"\x00\x00"), False


def _missing_tensor(up: Honest, rng: np.random.Generator) -> tuple[RecordDict, bool]:
    content = up.pack()
    del arrays_of(content)[str(rng.choice(list(arrays_of(content))))]
    return content, False


def _extra_tensor(up: Honest, rng: np.random.Generator) -> tuple[RecordDict, bool]:
    extra = {"extra.weight": np.ones((2, 2), np.float32)}
    return pack_reply({**up.state, **extra}, {**up.fisher, **extra}, up.num_examples), False


def _fisher_on_buffer(up: Honest, rng: np.random.Generator) -> tuple[RecordDict, bool]:
    floats = [k for k, v in up.state.items() if k not in up.fisher and np.issubdtype(v.dtype, np.floating)]
    name = str(rng.choice(floats)) if floats else None
    if name is None:  # no float buffer: drop a parameter's Fisher instead
        name = str(rng.choice(list(up.fisher)))
        return up.pack(fisher={k: v for k, v in up.fisher.items() if k != name}), False
    return up.pack(fisher={**up.fisher, name: np.ones(up.state[name].shape, np.float32)}), False


def _missing_fisher(up: Honest, rng: np.random.Generator) -> tuple[RecordDict, bool]:
    name = str(rng.choice(list(up.fisher)))
    return up.pack(fisher={k: v for k, v in up.fisher.items() if k != name}), False


def _unquantized_float(up: Honest, rng: np.random.Generator) -> tuple[RecordDict, bool]:
    content = up.pack()
    name = str(rng.choice(list(up.fisher)))
    arrays_of(content)[name] = Array(np.ascontiguousarray(up.state[name], dtype=np.float32))
    return content, False


def _huge_integer_buffer(up: Honest, rng: np.random.Generator) -> tuple[RecordDict, bool]:
    ints = [k for k, v in up.state.items() if not np.issubdtype(v.dtype, np.floating)]
    if not ints:
        return _missing_tensor(up, rng)
    name = str(rng.choice(ints))
    value = np.iinfo(np.int64).max if rng.random() < 0.5 else MAX_INTEGER_BUFFER + 1
    return up.pack(state={**up.state, name: np.full(up.state[name].shape, value, np.int64)}), False


def _extra_record(kind: str) -> Corruption:
    def make(up: Honest, rng: np.random.Generator) -> tuple[RecordDict, bool]:
        content = up.pack()
        if kind == "arrays":
            content["extra"] = ArrayRecord({"x": Array(np.ones(3, np.float32))})
        elif kind == "config":
            content["extra"] = ConfigRecord({"note": "hello"})
        else:
            content["extra"] = MetricRecord({"num-examples": 10**6})
        return content, True
    return make


def _extra_metric(value: object) -> Corruption:
    def make(up: Honest, rng: np.random.Generator) -> tuple[RecordDict, bool]:
        content = up.pack()
        metrics_of(content)["extra-metric"] = value  # type: ignore[assignment]
        return content, True
    return make


def _metric_value(value: float) -> Corruption:
    def make(up: Honest, rng: np.random.Generator) -> tuple[RecordDict, bool]:
        content = up.pack()
        metrics_of(content)["train-loss"] = value
        return content, True
    return make


def _drop_record(which: str) -> Corruption:
    def make(up: Honest, rng: np.random.Generator) -> tuple[RecordDict, bool]:
        content = up.pack()
        for key in list(content.array_records if which == "arrays" else content.metric_records):
            del content[key]
        return content, False
    return make


def _missing_num_examples(up: Honest, rng: np.random.Generator) -> tuple[RecordDict, bool]:
    content = up.pack()
    del metrics_of(content)["num-examples"]
    return content, False


CORRUPTIONS: dict[str, Corruption] = {
    "fisher x1e3 (valid)": _scaled_fisher(1e3),
    "fisher at the bound (valid)": _scaled_fisher(MAX_FISHER_MAGNITUDE),
    "fisher 1e30": _scaled_fisher(1e30),
    "fisher at float32 max": _scaled_fisher(F32_MAX),
    "every fisher entry at float32 max": _all_fisher_at_float32_max,
    "fisher scale NaN": _fisher_scale(float("nan")),
    "fisher scale inf": _fisher_scale(float("inf")),
    "fisher scale -1": _fisher_scale(-1.0),
    "fisher scale 1e30": _fisher_scale(1e30, WHEN_CAPPED),
    "fisher scale float32 max": _fisher_scale(F32_MAX, WHEN_CAPPED),
    "fisher scale 0 with codes": _fisher_scale(0.0),
    "negative fisher codes": _negative_fisher_codes,
    "int16 min codes": _min_int16_codes,
    "weight scale 1e30": _weight_scale(1e30),
    "weight scale NaN": _weight_scale(float("nan")),
    "weight scale -inf": _weight_scale(float("-inf")),
    "buffer scale 1e30": _weight_scale(1e30, buffer=True),
    "weight scale 0 with codes": _zero_scale_nonzero_codes,
    "weights x100 (valid)": _scaled_weights(100.0),
    "weights 1e7": _scaled_weights(1e7),
    "num-examples 1e20 float": _num_examples(1e20, False),
    "num-examples 2**62 int": _num_examples(2**62, False),
    "num-examples above the bound": _num_examples(MAX_NUM_EXAMPLES + 1, False),
    "num-examples at the bound (valid)": _num_examples(MAX_NUM_EXAMPLES, True),
    "num-examples integral float (valid)": _num_examples(57.0, True),
    "num-examples fraction": _num_examples(3.5, False),
    "num-examples 0": _num_examples(0, False),
    "num-examples negative": _num_examples(-5, False),
    "num-examples NaN": _num_examples(float("nan"), False),
    "num-examples inf": _num_examples(float("inf"), False),
    "num-examples list": _num_examples([10, 20], False),
    "num-examples missing": _missing_num_examples,
    "declared shape differs": _wrong_declared_shape,
    "shape differs (repacked)": _wrong_shape_repacked,
    "dtype float32": _wrong_dtype,
    "unknown stype": _unknown_stype,
    "truncated bytes": _truncated,
    "extra bytes": _extra_bytes,
    "missing tensor": _missing_tensor,
    "extra tensor": _extra_tensor,
    "fisher on a buffer": _fisher_on_buffer,
    "missing fisher": _missing_fisher,
    "unquantized float tensor": _unquantized_float,
    "huge integer buffer": _huge_integer_buffer,
    "extra ArrayRecord (ignored)": _extra_record("arrays"),
    "extra ConfigRecord (ignored)": _extra_record("config"),
    "extra MetricRecord (ignored)": _extra_record("metrics"),
    "extra metric (ignored)": _extra_metric(1e300),
    "extra list metric (ignored)": _extra_metric([1.0, 2.0]),
    "NaN train-loss (ignored)": _metric_value(float("nan")),
    "no ArrayRecord": _drop_record("arrays"),
    "no MetricRecord": _drop_record("metrics"),
}


# ----------------------------------------------------------------------------- messages


def instruction(node_id: int) -> Message:
    """A train instruction to ``node_id`` (its content does not matter to the reply)."""
    return Message(content=RecordDict({"config": ConfigRecord({"x": 1})}), dst_node_id=node_id,
                   message_type=MessageType.TRAIN)


def reply(node_id: int, content: RecordDict) -> Message:
    """A reply from ``node_id``, built the way Flower builds a ClientApp's reply."""
    return Message(content=content, reply_to=instruction(node_id))


def error_reply(node_id: int) -> Message:
    return Message(Error(code=1, reason="client crashed"), reply_to=instruction(node_id))


@dataclass
class Sent:
    """One reply of a fuzzed round and whether the server must merge it."""

    node: int
    content: RecordDict | None  # None: an error reply
    content_valid: Validity
    label: str
    clean: RecordDict | None = None  # what the server must merge instead, for "(ignored)" additions
    valid: bool = False  # set by mark_duplicates: valid content and the node's first reply

    def message(self) -> Message:
        return error_reply(self.node) if self.content is None else reply(self.node, self.content)

    def reference_message(self) -> Message:
        """The reply the server's merge must equal: without the additions it must ignore."""
        return reply(self.node, self.clean) if self.clean is not None else self.message()


def corrupt(label: str, up: Honest, rng: np.random.Generator, node: int) -> Sent:
    """Apply corruption ``label`` to an honest upload."""
    content, valid = CORRUPTIONS[label](up, rng)
    return Sent(node, content, valid, label, clean=up.pack() if label.endswith("(ignored)") else None)


def mark_duplicates(sent: list[Sent], capped: bool = False) -> list[Sent]:
    """Set ``valid``: valid content (for a server that caps the Fishers or not) and the node's
    first reply in the given order; later ones are duplicates."""
    seen: set[int] = set()
    for s in sent:
        content_valid = s.content_valid is True or (capped and s.content_valid == WHEN_CAPPED)
        s.valid = content_valid and s.node not in seen
        seen.add(s.node)
    return sent


def corrupted_round(model: nn.Module, rng: np.random.Generator, p_corrupt: float = 0.5,
                    capped: bool = False) -> list[Sent]:
    """3 to 5 nodes, some replies corrupted, some nodes replying twice, shuffled; ``capped``: the
    server caps the Fishers (see :data:`WHEN_CAPPED`)."""
    n_nodes = int(rng.integers(3, 6))
    names = list(CORRUPTIONS)
    sent: list[Sent] = []
    for node in range(1, n_nodes + 1):
        up = honest_upload(model, rng)
        u = rng.random()
        if u < p_corrupt:
            sent.append(corrupt(names[int(rng.integers(len(names)))], up, rng, node))
        elif u < p_corrupt + 0.05:
            sent.append(Sent(node, None, False, "error reply"))
        else:
            sent.append(Sent(node, up.pack(), True, "honest"))
        if rng.random() < 0.15:  # the node replies again: a replay or another upload
            again = up.pack() if rng.random() < 0.5 else honest_upload(model, rng).pack()
            sent.append(Sent(node, again, True, "second reply"))
    order = rng.permutation(len(sent))
    return mark_duplicates([sent[i] for i in order], capped)
