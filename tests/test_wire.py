"""Each reply rule at its one home: the wire decoder bounds every entry while it decodes, the
duplicate rule lives in ``FirstReplies``, and the server validates a decoded upload no second time."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from _fedfiot_helpers import task_identity  # noqa: F401 - autouse fixture
from _fedfiot_helpers import SPEC, client_uploads, packed, reply
from flwr.app import Array, RecordDict

from fedfiot_flwr.psd import InputGram, KFACFactors
from fedfiot_flwr.reply_limits import (
    MAX_CURVATURE_MAGNITUDE,
    MAX_FISHER_MAGNITUDE,
    MAX_INTEGER_BUFFER,
    MAX_WEIGHT_MAGNITUDE,
)
from fedfiot_flwr.server.uploads import DUPLICATE_REASON, FirstReplies, collect_uploads
from fedfiot_flwr.wire import (
    ARRAYS_RECORD,
    FACTOR_PREFIX,
    decode_reply,
    pack_gram_reply,
    pack_kfac_reply,
    pack_reply,
    unpack_curvature_reply,
    unpack_reply,
)

STATE = {"w": np.linspace(-1.0, 1.0, 6, dtype=np.float32).reshape(2, 3), "b": np.ones(2, np.float32),
         "bn.mean": np.zeros(2, np.float32), "count": np.array(3, np.int64)}
FISHER = {"w": np.full((2, 3), 0.5, np.float32), "b": np.full(2, 0.25, np.float32)}
SHAPES = {k: tuple(v.shape) for k, v in STATE.items()}
BUFFERS = ("bn.mean", "count")


def _reply() -> RecordDict:
    return pack_reply(STATE, FISHER, 12)


def _set_scale(content: RecordDict, name: str, which: int, value: float) -> RecordDict:
    arr = content[ARRAYS_RECORD][name]
    data = arr.data[: 4 * which] + struct.pack("<f", value) + arr.data[4 * which + 4 :]
    content[ARRAYS_RECORD][name] = Array(dtype=arr.dtype, shape=tuple(arr.shape), stype=arr.stype, data=data)
    return content


def _decode(content: RecordDict, **kw: object):  # noqa: ANN202
    return decode_reply(content, "fisher", client="c5", expected_shapes=SHAPES, buffers=BUFFERS, **kw)


# ------------------------------------------------------------- q16: the scale is the bound


@pytest.mark.parametrize("name, which, bound", [("w", 0, MAX_WEIGHT_MAGNITUDE), ("bn.mean", 0, MAX_WEIGHT_MAGNITUDE),
                                                ("b", 1, MAX_FISHER_MAGNITUDE)])
def test_a_scale_at_its_bound_decodes_within_it_and_one_above_is_rejected(name: str, which: int, bound: float) -> None:
    at = _decode(_set_scale(_reply(), name, which, bound))
    values = at.fisher[name] if which else at.weights[name]
    assert float(np.max(np.abs(values))) <= bound  # the codes never exceed l_q: the scale bounds the tensor
    above = float(np.nextafter(np.float32(bound), np.float32(np.inf)))
    with pytest.raises(ValueError, match=rf"client c5: tensor '{name}'.*exceeds the bound"):
        _decode(_set_scale(_reply(), name, which, above))


def test_a_capping_server_accepts_any_finite_fisher_scale_and_never_a_non_finite_one() -> None:
    big = float(np.finfo(np.float32).max)
    up = _decode(_set_scale(_reply(), "w", 1, big), fisher_bound=None)
    assert np.all(np.isfinite(up.fisher["w"])) and float(up.fisher["w"].max()) <= big
    for bad in (float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match="client c5: tensor 'w': bad Fisher scale"):
            _decode(_set_scale(_reply(), "w", 1, bad), fisher_bound=None)


def test_integer_buffers_are_bounded_and_booleans_are_not_sent() -> None:
    content = _reply()
    content[ARRAYS_RECORD]["count"] = Array(np.array(MAX_INTEGER_BUFFER + 1, np.int64))
    with pytest.raises(ValueError, match=r"client c5: tensor 'count': integer entries up to \d+ exceed"):
        _decode(content)
    content[ARRAYS_RECORD]["count"] = Array(np.array(True))
    with pytest.raises(ValueError, match="client c5: tensor 'count': unsupported dtype bool"):
        _decode(content)
    with pytest.raises(ValueError, match="tensor 'count': dtype bool cannot be sent"):
        pack_reply({**STATE, "count": np.array(True)}, FISHER, 12)


def test_decode_reply_is_unpack_reply_plus_what_the_strategy_needs() -> None:
    content = _reply()
    up = _decode(content)
    ref = unpack_reply(content, SHAPES, client="c5", parameters=["w", "b"])
    for got, want in ((up.weights, ref.weights), (up.fisher, ref.fisher)):
        assert list(got) == list(want) and all(np.array_equal(got[k], want[k]) for k in want)
    assert (up.num_examples, up.buffers) == (12, list(BUFFERS))
    with pytest.raises(ValueError, match="client c5: tensor 'bn.mean' is a parameter but carries no Fisher"):
        decode_reply(content, "fisher", client="c5", expected_shapes=SHAPES, buffers=("count",))
    weights_only = pack_reply(STATE, {}, 12)
    with pytest.raises(ValueError, match="client c5: reply carries no Fisher"):
        decode_reply(weights_only, "fisher", client="c5", expected_shapes=None)
    assert decode_reply(weights_only, "weights", client="c5", expected_shapes=SHAPES).fisher == {}


# ----------------------------------------------- psd8: a factor is bounded as it is rebuilt


def _curvature_state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"fc.weight": rng.normal(size=(3, 4)).astype(np.float32), "fc.bias": rng.normal(size=3).astype(np.float32)}


def _psd(n: int, scale: float) -> np.ndarray:
    m = np.random.default_rng(n).normal(size=(n, n))
    return scale * (m @ m.T) / np.max(np.diag(m @ m.T))


@pytest.mark.parametrize("method", ["kfac", "gram"])
def test_a_factor_above_the_curvature_bound_is_rejected_while_it_is_decoded(method: str) -> None:
    state = _curvature_state()
    shapes = {k: tuple(v.shape) for k, v in state.items()}

    def pack(scale: float) -> RecordDict:
        if method == "kfac":
            factors = {"fc": KFACFactors("fc.weight", "fc.bias", _psd(5, scale), _psd(3, 1.0))}
            return pack_kfac_reply(state, factors, 9, fisher_kind="empirical", rank=None)
        return pack_gram_reply(state, {"fc": InputGram("fc.weight", "fc.bias", _psd(5, scale))}, 9, rank=None)

    first = "A" if method == "kfac" else "gram"
    up = unpack_curvature_reply(pack(0.5 * MAX_CURVATURE_MAGNITUDE), shapes, client="c8")
    mats = up.factors["fc"].A if method == "kfac" else up.grams["fc"].gram
    assert np.all(np.isfinite(mats)) and float(np.max(np.abs(mats))) <= MAX_CURVATURE_MAGNITUDE
    pattern = rf"client c8: factor '{FACTOR_PREFIX}fc/{first}': magnitude .* is outside"
    with pytest.raises(ValueError, match=pattern):
        unpack_curvature_reply(pack(2.0 * MAX_CURVATURE_MAGNITUDE), shapes, client="c8")
    with pytest.raises(ValueError, match=pattern):
        decode_reply(pack(2.0 * MAX_CURVATURE_MAGNITUDE), method, client="c8", expected_shapes=shapes)


# ------------------------------------------------------------------- duplicates: one rule


def test_first_replies_counts_a_nodes_first_reply_and_names_every_later_one() -> None:
    first = FirstReplies()
    assert first.duplicate("3") is None and first.duplicate("4") is None
    assert first.duplicate("3") == DUPLICATE_REASON
    assert first.duplicate("4", "failure: TIMEOUT: late") == f"{DUPLICATE_REASON} (failure: TIMEOUT: late)"
    assert first.duplicate("3") == DUPLICATE_REASON  # and so on, for every later reply


def test_collect_uploads_excludes_a_replayed_reply_but_counts_its_bytes() -> None:
    (w, f, n), (w2, f2, n2) = client_uploads(2, seed=4)
    content = packed(w, f, n)
    shapes = {k: tuple(v.shape) for k, v in w.items()}
    out = collect_uploads([("1", content), ("2", packed(w2, f2, n2)), ("1", packed(w2, f2, n2))], shapes)
    assert out.client_ids == ["1", "2"]
    assert [(r.client, r.reason) for r in out.rejections] == [("1", DUPLICATE_REASON)]
    assert out.bytes_per_client["1"] == 2 * out.bytes_per_client["2"]


# ------------------------------------------- the server does not validate a decoded upload again


def test_a_server_round_decodes_each_tensor_once_and_runs_no_second_check(monkeypatch: pytest.MonkeyPatch) -> None:
    import fedfiot_flwr.merge.validate as merge_validate
    import fedfiot_flwr.wire.q16 as q16
    from fedfiot_flwr import FedFiOT, FedFiOTConfig

    calls: list[str] = []
    decode = q16._decode

    def counting(client: str, name: str, *args: object, **kw: object):  # noqa: ANN202
        calls.append(f"{client}/{name}")
        return decode(client, name, *args, **kw)

    def second_check(*args: object, **kw: object) -> None:
        raise AssertionError("a decoded upload was validated again")

    monkeypatch.setattr(q16, "_decode", counting)
    monkeypatch.setattr(merge_validate, "_check_tensors", second_check)
    replies = [reply(i + 1, packed(*up)) for i, up in enumerate(client_uploads(3, seed=6))]
    strategy = FedFiOT(spec=SPEC, config=FedFiOTConfig.paper(max_iters=2, sweep=None))
    strategy.aggregate_train(1, replies)
    assert strategy.server_metrics[1]["num-valid"] == 3
    assert len(calls) == len(set(calls)) == 3 * 6  # every tensor of every reply, once


@pytest.mark.parametrize("name, aggregator", [("fedfisher", "FedFisherAggregator"), ("regmean", "RegMeanAggregator")])
def test_the_baseline_aggregators_tell_their_merges_the_uploads_are_checked(
    monkeypatch: pytest.MonkeyPatch, name: str, aggregator: str
) -> None:
    from fedfiot_flwr.baselines import fedfisher, regmean
    from fedfiot_flwr.server import aggregators
    from fedfiot_flwr.server.aggregators import RoundContext
    from fedfiot_flwr.server.uploads import CollectedUploads

    seen: list[bool] = []

    def spy(*args: object, checked: bool = False, **kw: object) -> object:
        seen.append(checked)
        raise RuntimeError("stop")

    module, fn = (fedfisher, "fedfisher_kfac") if name == "fedfisher" else (regmean, "regmean_select")
    monkeypatch.setattr(module, fn, spy)
    agg = getattr(aggregators, aggregator)()
    with pytest.raises(RuntimeError, match="stop"):
        agg.aggregate(CollectedUploads(), RoundContext(server_round=1))
    assert seen == [True]
