"""The layer-wise 16-bit quantizer (the paper's eq. 107)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from fedfiot_flwr.quantize import LEVELS, dequantize, quantize


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("magnitude", [1e-30, 1e-3, 1.0, 7.5, 1e20])
def test_error_bound_and_range(dtype: type, magnitude: float) -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 33)) * magnitude).astype(dtype)
    codes, scale = quantize(x)
    assert codes.dtype == np.int16 and codes.shape == x.shape
    assert isinstance(scale, np.float32)
    assert int(codes.min()) >= -LEVELS and int(codes.max()) <= LEVELS
    # the largest entry hits the extreme level exactly
    assert int(np.abs(codes).max()) == LEVELS
    x_hat = dequantize(codes, scale)
    amax = float(np.abs(x.astype(np.float64)).max())
    err = float(np.abs(x.astype(np.float64) - x_hat).max())
    assert err <= amax / (2 * LEVELS) * (1 + 1e-6)
    assert err > 0  # random data does not quantize exactly: the test can fail


@settings(max_examples=200, deadline=None)
@given(arrays(np.float32, st.integers(1, 40), elements=st.floats(-1e6, 1e6, width=32)))
def test_error_bound_property(x: np.ndarray) -> None:
    codes, scale = quantize(x)
    x_hat = dequantize(codes, scale)
    amax = float(np.abs(x).max())
    assert float(np.abs(x.astype(np.float64) - x_hat).max()) <= amax / (2 * LEVELS) * (1 + 1e-12)
    assert codes.dtype == np.int16 and np.abs(codes.astype(np.int32)).max() <= LEVELS


def test_float32_output_is_close() -> None:
    x = np.linspace(-3, 5, 101, dtype=np.float32)
    codes, scale = quantize(x)
    x32 = dequantize(codes, scale, dtype=np.float32)
    assert x32.dtype == np.float32
    assert np.abs(x - x32).max() <= 5 / (2 * LEVELS) * 1.01


def test_zero_and_empty_tensors_round_trip() -> None:
    for x in (np.zeros((3, 4), np.float32), np.zeros((0, 5), np.float32), np.array(0.0)):
        codes, scale = quantize(x)
        assert scale == 0.0 and codes.shape == x.shape and not np.any(codes)
        assert np.array_equal(dequantize(codes, scale), x)


@pytest.mark.parametrize("value", [3.25, -1e-7, 12345.678, -2.0**-140])
def test_single_nonzero_value_round_trips_exactly(value: float) -> None:
    x = np.zeros((5, 7), np.float32)
    x[2, 3] = value
    codes, scale = quantize(x)
    assert codes[2, 3] == (LEVELS if value > 0 else -LEVELS)
    assert np.array_equal(dequantize(codes, scale).astype(np.float32), x)


def test_torch_tensor_input() -> None:
    t = torch.randn(10, 3)
    codes, scale = quantize(t)
    assert np.abs(dequantize(codes, scale) - t.numpy()).max() <= float(t.abs().max()) / (2 * LEVELS) * (1 + 1e-6)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_is_an_error(bad: float) -> None:
    x = np.ones(4, np.float32)
    x[1] = bad
    with pytest.raises(ValueError, match="NaN or infinite"):
        quantize(x, name="fc1.weight")


def test_float32_overflow_and_bad_dtypes_are_errors() -> None:
    with pytest.raises(ValueError, match="overflows float32"):
        quantize(np.array([1e300, 1.0]))
    with pytest.raises(ValueError, match="not real-valued"):
        quantize(np.array([1 + 2j]))
    with pytest.raises(ValueError, match="not real-valued"):
        quantize(np.array([True, False]))


def test_float64_scale_rounds_up() -> None:
    x = np.array([1.0 + 2.0**-40, -0.5])  # max not representable in float32
    codes, scale = quantize(x)
    assert float(scale) >= float(np.abs(x).max())
    assert int(np.abs(codes).max()) <= LEVELS


def test_dequantize_validates() -> None:
    with pytest.raises(ValueError, match="out of range"):
        dequantize(np.array([-32768], np.int16), np.float32(1.0))
    with pytest.raises(ValueError, match="scale"):
        dequantize(np.array([1], np.int16), -1.0)
    with pytest.raises(ValueError, match="scale"):
        dequantize(np.array([1], np.int16), float("nan"))
    with pytest.raises(ValueError, match="dtype"):
        dequantize(np.array([1.0]), 1.0)


def test_round_trip_through_a_serialised_array_record() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((32, 3, 5, 5)).astype(np.float32)
    codes, scale = quantize(x)
    record = ArrayRecord({"codes": Array(codes), "scale": Array(np.array([scale], np.float32))})
    wire = recorddict_to_proto(RecordDict({"q": record})).SerializeToString()
    proto = ProtoRecordDict()
    proto.ParseFromString(wire)
    back = recorddict_from_proto(proto)["q"]
    codes_back = back["codes"].numpy()
    scale_back = back["scale"].numpy()[0]
    assert codes_back.dtype == np.int16 and np.array_equal(codes_back, codes)
    assert scale_back == scale
    assert np.array_equal(dequantize(codes_back, scale_back), dequantize(codes, scale))
    # 2 bytes per entry (+ the .npy header)
    assert record["codes"].data.__len__() - codes.size * 2 <= 128
