"""NKI dtypes in the simulator: NKI (not NumPy) type promotion, weak scalars, fp32 arithmetic
with one round-to-nearest-even on write, saturating integer conversion."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from helpers import BF16, random_array

import simulate as nki
import simulate.dtypes as sdt
import simulate.language as nl

FP8_E4M3 = np.dtype(ml_dtypes.float8_e4m3)
FP8_E5M2 = np.dtype(ml_dtypes.float8_e5m2)
ALL_DTYPES = [
    np.float32,
    np.float16,
    BF16,
    FP8_E4M3,
    FP8_E5M2,
    np.int8,
    np.int16,
    np.int32,
    np.uint8,
    np.uint16,
    np.uint32,
    np.bool_,
]


def tile_op(op, *arrays):
    """Load each array as one tile, apply ``op`` to the tiles, return the result (NumPy)."""

    @nki.jit
    def kernel(*inputs):
        result = op(*[nl.load(t) for t in inputs])
        out = nl.ndarray(result.shape, result.dtype, buffer=nl.shared_hbm)
        nl.store(out, value=result)
        return out

    return kernel(*arrays)


# --- promotion ---------------------------------------------------------------------------------
PROMOTIONS = [  # (a, b, documented result) from the NKI type-promotion table
    (np.int32, np.float16, np.float16),
    (np.uint16, sdt.tfloat32, sdt.tfloat32),
    (np.float32, sdt.tfloat32, np.float32),
    (np.float32, BF16, np.float32),
    (np.float16, BF16, np.float32),
    (FP8_E4M3, np.float16, np.float16),
    (FP8_E4M3, BF16, BF16),
    (FP8_E4M3, FP8_E5M2, BF16),
    (np.int16, np.int32, np.int32),
    (np.uint8, np.uint16, np.uint16),
    (np.uint16, np.int32, np.int32),
    (np.int8, np.uint8, np.int16),
    (np.int8, np.uint16, np.int32),
    (np.int32, np.uint32, np.float32),
]


@pytest.mark.parametrize("a, b, expected", PROMOTIONS)
def test_promotion_table(a, b, expected):
    got = sdt.promote(a, b)
    assert sdt.name(got) == sdt.name(expected)
    assert sdt.name(sdt.promote(b, a)) == sdt.name(expected)


@pytest.mark.parametrize("a, b, expected", [p for p in PROMOTIONS if sdt.tfloat32 not in p[:2]])
def test_promotion_applies_to_tile_arithmetic(rng, a, b, expected):
    x = random_array(rng, (8, 4), a, 0, 3)
    y = random_array(rng, (8, 4), b, 0, 3)
    out = tile_op(nl.add, x, y)
    assert out.dtype == np.dtype(expected)
    exact = x.astype(np.float64) + y.astype(np.float64)
    np.testing.assert_array_equal(out.astype(np.float64), exact.astype(expected).astype(np.float64))


@pytest.mark.parametrize(
    "scalar, tile_dtype, expected",
    [
        (2.0, BF16, np.float32),  # weak float -> fp32
        (2, np.int8, np.int32),  # weak int -> int32
        (True, np.uint8, np.uint8),  # weak bool -> uint8
        (np.float16(2), np.float16, np.float16),  # a typed scalar keeps its type
        (1.2, np.float16, np.float32),
        (np.float64(0.5), np.float16, np.float32),  # NumPy arithmetic on Python floats stays weak
        (np.int8(3), np.int8, np.int8),
    ],
)
def test_weak_scalars(rng, scalar, tile_dtype, expected):
    x = random_array(rng, (4, 6), tile_dtype, 0, 3)
    out = tile_op(lambda t: t * scalar, x)
    assert out.dtype == np.dtype(expected)
    exact = x.astype(np.float32) * np.float32(scalar)  # the engine multiplies in fp32
    np.testing.assert_array_equal(out, exact.astype(expected))


def test_bf16_tile_times_two_is_fp32_and_exact(rng):
    x = random_array(rng, (16, 32), BF16)
    out = tile_op(lambda t: t * 2.0, x)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, x.astype(np.float32) * 2)


def test_explicit_dtype_overrides_promotion(rng):
    x = random_array(rng, (4, 8), BF16)
    y = random_array(rng, (4, 8), np.float16)
    out = tile_op(lambda a, b: nl.add(a, b, dtype=nl.bfloat16), x, y)
    assert out.dtype == BF16
    exact = x.astype(np.float32) + y.astype(np.float32)  # fp32 math, one rounding
    np.testing.assert_array_equal(out, exact.astype(BF16))


def test_comparisons_default_to_bool(rng):
    x = random_array(rng, (4, 8), np.float32)
    y = random_array(rng, (4, 8), np.float32)
    out = tile_op(nl.greater, x, y)
    assert out.dtype == np.bool_
    np.testing.assert_array_equal(out, x > y)


# --- rounding ---------------------------------------------------------------------------------
def _bits(values, dtype):
    return (
        np.asarray(values)
        .astype(dtype)
        .view(np.uint8 if np.dtype(dtype).itemsize == 1 else f"uint{8 * np.dtype(dtype).itemsize}")
    )


def test_bf16_rounds_ties_to_even():
    ulp = 2.0**-7  # bf16 spacing in [1, 2)
    ties = np.array([1 + ulp / 2, 1 + 3 * ulp / 2, -(1 + ulp / 2), 2 - ulp / 2], np.float32)
    expected = np.array([1.0, 1 + 2 * ulp, -1.0, 2.0])
    out = tile_op(lambda t: nl.copy(t, dtype=nl.bfloat16), ties.reshape(4, 1))
    np.testing.assert_array_equal(out.reshape(-1).astype(np.float64), expected)
    near = np.array([1 + ulp / 2 + 2.0**-20, 1 + ulp / 2 - 2.0**-20], np.float32)
    out = tile_op(lambda t: nl.copy(t, dtype=nl.bfloat16), near.reshape(2, 1))
    np.testing.assert_array_equal(out.reshape(-1).astype(np.float64), [1 + ulp, 1.0])


def test_fp16_rounds_ties_to_even_and_overflows_to_inf():
    ulp = 2.0**-10
    values = np.array([1 + ulp / 2, 1 + 3 * ulp / 2, 65520.0, 65519.0], np.float32)
    out = tile_op(lambda t: nl.copy(t, dtype=nl.float16), values.reshape(4, 1)).reshape(-1)
    np.testing.assert_array_equal(out.astype(np.float64), [1.0, 1 + 2 * ulp, np.inf, 65504.0])


def test_fp8_e4m3_is_the_ieee_flavour_with_max_240():
    values = np.array([240.0, 247.0, 248.0, 1.0625, 1.1875, -300.0], np.float32)
    out = tile_op(lambda t: nl.copy(t, dtype=nl.float8_e4m3), values.reshape(6, 1)).reshape(-1)
    assert out.dtype == FP8_E4M3
    np.testing.assert_array_equal(out.astype(np.float64), [240, 240, np.inf, 1.0, 1.25, -np.inf])


def test_fp8_e5m2_rounding():
    values = np.array([57344.0, 1.125, 1.375, 3e-5], np.float32)
    out = tile_op(lambda t: nl.copy(t, dtype=nl.float8_e5m2), values.reshape(4, 1)).reshape(-1)
    expected = values.astype(FP8_E5M2).astype(np.float64)  # ml_dtypes rounds to nearest even
    np.testing.assert_array_equal(out.astype(np.float64), expected)
    np.testing.assert_array_equal(out[:3].astype(np.float64), [57344.0, 1.0, 1.5])


def test_tfloat32_keeps_ten_mantissa_bits_rounding_to_even():
    ulp = 2.0**-10
    values = np.array([1 + ulp / 2, 1 + 3 * ulp / 2, 1 + ulp / 4, np.inf, -2.5], np.float32)
    out = tile_op(lambda t: nl.copy(t, dtype=nl.tfloat32), values.reshape(5, 1)).reshape(-1)
    np.testing.assert_array_equal(out, np.array([1, 1 + 2 * ulp, 1, np.inf, -2.5], np.float32))


def test_float_to_int_rounds_to_even_and_saturates():
    values = np.array([2.5, 3.5, -2.5, 300.0, -300.0, np.nan], np.float32).reshape(6, 1)
    np.testing.assert_array_equal(
        tile_op(lambda t: nl.copy(t, dtype=nl.int8), values).reshape(-1), [2, 4, -2, 127, -128, 0]
    )
    np.testing.assert_array_equal(
        tile_op(lambda t: nl.copy(t, dtype=nl.uint8), values).reshape(-1), [2, 4, 0, 255, 0, 0]
    )


def test_arithmetic_is_fp32_with_one_rounding(rng):
    a = random_array(rng, (32, 64), BF16)
    b = random_array(rng, (32, 64), BF16)
    c = random_array(rng, (32, 64), BF16)
    out = tile_op(
        lambda x, y, z: nl.add(nl.multiply(x, y, dtype=nl.float32), z, dtype=nl.bfloat16), a, b, c
    )
    f32 = lambda v: v.astype(np.float32)  # noqa: E731
    np.testing.assert_array_equal(out, (f32(a) * f32(b) + f32(c)).astype(BF16))
    # each instruction rounds its own output: bf16 products are rounded before the add
    out = tile_op(lambda x, y, z: nl.add(nl.multiply(x, y), z), a, b, c)
    np.testing.assert_array_equal(out, (f32((f32(a) * f32(b)).astype(BF16)) + f32(c)).astype(BF16))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: sdt.name(np.dtype(d)))
def test_every_dtype_round_trips_bit_exactly(rng, dtype):
    x = random_array(rng, (64, 24), dtype, -100, 100)
    out = tile_op(lambda t: t, x)
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(out.view(np.uint8), x.view(np.uint8))


@pytest.mark.parametrize("dtype", ALL_DTYPES[:-1], ids=lambda d: sdt.name(np.dtype(d)))
def test_every_dtype_adds_in_fp32(rng, dtype):
    x = random_array(rng, (16, 8), dtype, 0, 10)
    y = random_array(rng, (16, 8), dtype, 0, 10)
    out = tile_op(nl.add, x, y)
    assert out.dtype == np.dtype(dtype)
    exact = x.astype(np.float64) + y.astype(np.float64)
    if np.dtype(dtype).kind in "iu":
        expected = np.clip(exact, np.iinfo(dtype).min, np.iinfo(dtype).max).astype(dtype)
    else:
        expected = exact.astype(np.float32).astype(dtype)
    np.testing.assert_array_equal(out, expected)


def test_static_cast_outside_a_kernel():
    values = np.array([1 + 2.0**-8, 3.5, -7.25], np.float32)
    np.testing.assert_array_equal(
        nl.static_cast(values, nl.bfloat16).astype(np.float32), [1.0, 3.5, -7.25]
    )
    np.testing.assert_array_equal(nl.static_cast(np.array([2.5, 1e6]), nl.int16), [2, 32767])


def test_fp32_min_constants():
    assert nl.fp32.min == np.float32(-3.4028235e38)
    assert sdt.name(nl.bfloat16) == "bfloat16" and nl.bfloat16 == BF16
    assert nl.float8_e4m3 == FP8_E4M3 and nl.tfloat32 == np.float32
    with pytest.raises(TypeError, match="err_unsupported_dtype"):
        sdt.as_dtype(np.float64)
