"""nki 0.6 front-end: each ``nki.isa`` instruction against NumPy on random data, and each
documented error with a must-raise test and a legal twin."""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest

import simulate.nki06 as nki
from simulate.core.errors import SpillWarning
from simulate.nki06 import context
from simulate.nki06 import isa as nisa
from simulate.nki06 import language as nl
from simulate.nki06.errors import NkiValidationError

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(autouse=True)
def _trn2(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    monkeypatch.delenv("NKI_PRECISE_FP", raising=False)


def sbuf(x, dtype=None, buffer=None):
    """Kernel helper: an HBM input copied into a new SBUF (or PSUM via a copy) tile."""
    t = nl.ndarray(x.shape, dtype or x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    if buffer == nl.psum:
        p = nl.ndarray(x.shape, t.dtype, buffer=nl.psum)
        nisa.tensor_copy(dst=p, src=t)
        return p
    return t


def out(t):
    """Kernel helper: an SBUF/PSUM tile copied to a new shared_hbm output."""
    if t.buffer == nl.psum:
        staged = nl.ndarray(t.shape, t.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=staged, src=t)
        t = staged
    o = nl.ndarray(t.shape, t.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=o, src=t)
    return o


def run(kernel, *args, **kwargs):
    return nki.simulate(kernel)(*args, **kwargs)


def f32(rng, *shape, low=-3.0, high=3.0):
    return rng.uniform(low, high, shape).astype(np.float32)


# --- Vector engine elementwise ---
@pytest.mark.parametrize(
    "op, ref",
    [
        (nl.add, np.add),
        (nl.subtract, np.subtract),
        (nl.multiply, np.multiply),
        (nl.maximum, np.maximum),
    ],
)
def test_tensor_tensor_matches_numpy(rng, op, ref):
    a, b = f32(rng, 128, 96), f32(rng, 128, 96)

    def kernel(a, b):
        dst = nl.ndarray(a.shape, nl.float32)
        nisa.tensor_tensor(dst=dst, data1=sbuf(a), data2=sbuf(b), op=op)
        return out(dst)

    np.testing.assert_array_equal(run(kernel, a, b), ref(a, b))


def test_tensor_tensor_rounds_into_the_bf16_dst(rng):
    a, b = f32(rng, 64, 40), f32(rng, 64, 40)

    def kernel(a, b):
        dst = nl.ndarray(a.shape, nl.bfloat16)
        nisa.tensor_tensor(dst=dst, data1=sbuf(a), data2=sbuf(b), op=nl.multiply)
        return out(dst)

    result = run(kernel, a, b)
    assert result.dtype == BF16
    np.testing.assert_array_equal(result, (a * b).astype(BF16))


def test_tensor_tensor_int32_is_exact_on_gpsimd(rng):
    a = rng.integers(2**24, 2**28, (16, 8)).astype(np.int32)
    b = rng.integers(1, 1000, (16, 8)).astype(np.int32)

    def kernel(a, b):
        dst = nl.ndarray(a.shape, nl.int32)
        nisa.tensor_tensor(dst=dst, data1=sbuf(a), data2=sbuf(b), op=nl.add)
        return out(dst)

    np.testing.assert_array_equal(run(kernel, a, b), a + b)
    assert nki.last_trace().select(opcode="tensor_tensor")[0].engine == "pool"


def test_tensor_tensor_pairs_views_of_equal_elements_per_partition(rng):
    a, b = f32(rng, 32, 4, 8), f32(rng, 32, 32)

    def kernel(a, b):
        dst = nl.ndarray((32, 32), nl.float32)
        nisa.tensor_tensor(dst=dst, data1=sbuf(a), data2=sbuf(b), op=nl.add)
        return out(dst)

    np.testing.assert_array_equal(run(kernel, a, b), a.reshape(32, 32) + b)


def test_partition_dim_over_128_is_the_documented_assertion(rng):
    a = f32(rng, 256, 8)

    def kernel(a):
        tile = nl.ndarray((256, 8), nl.float32, buffer=nl.sbuf)
        dst = nl.ndarray((256, 8), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=dst, data1=tile, data2=tile, op=nl.add)
        return out(dst)

    with pytest.raises(
        AssertionError, match="tensor_tensor data1 partition dimension 256 exceeds maximum 128"
    ) as info:
        run(kernel, a)
    assert isinstance(info.value, NkiValidationError)


def test_two_psum_operands_are_rejected_one_is_legal(rng):
    a = f32(rng, 16, 8)

    def kernel(a, both):
        p1 = sbuf(a, buffer=nl.psum)
        other = sbuf(a, buffer=nl.psum) if both else sbuf(a)
        dst = nl.ndarray(a.shape, nl.float32)
        nisa.tensor_tensor(dst=dst, data1=p1, data2=other, op=nl.add)
        return out(dst)

    np.testing.assert_array_equal(run(kernel, a, False), a + a)
    with pytest.raises(AssertionError, match="cannot both be in PSUM"):
        run(kernel, a, True)


def test_mismatched_elements_per_partition_are_rejected(rng):
    def kernel(a, b):
        dst = nl.ndarray(a.shape, nl.float32)
        nisa.tensor_tensor(dst=dst, data1=sbuf(a), data2=sbuf(b), op=nl.add)
        return out(dst)

    with pytest.raises(AssertionError, match="tensor_tensor data2 has 16 partitions x 9"):
        run(kernel, f32(rng, 16, 8), f32(rng, 16, 9))


def test_tensor_scalar_with_scalar_and_per_partition_operands(rng):
    x, col = f32(rng, 64, 48), f32(rng, 64, 1)

    def kernel(x, col):
        dst = nl.ndarray(x.shape, nl.float32)
        nisa.tensor_scalar(
            dst=dst,
            data=sbuf(x),
            op0=nl.subtract,
            operand0=sbuf(col),
            reverse0=True,
            op1=nl.multiply,
            operand1=0.5,
        )
        return out(dst)

    np.testing.assert_allclose(run(kernel, x, col), (col - x) * np.float32(0.5), rtol=1e-6)


def test_tensor_scalar_operand_tile_must_be_float32(rng):
    x = f32(rng, 8, 4)

    def kernel(x, dtype):
        dst = nl.ndarray(x.shape, nl.float32)
        nisa.tensor_scalar(dst=dst, data=sbuf(x), op0=nl.add, operand0=sbuf(x[:, 0:1], dtype))
        return out(dst)

    run(kernel, x, nl.float32)
    with pytest.raises(TypeError, match="operand0 must be a float32 tile"):
        run(kernel, x, nl.bfloat16)


def test_tensor_scalar_on_gpsimd_only_for_rsqrt(rng):
    x = f32(rng, 8, 4, low=0.5, high=4.0)

    def kernel(x, op):
        dst = nl.ndarray(x.shape, nl.float32)
        nisa.tensor_scalar(
            dst=dst,
            data=sbuf(x),
            op0=op,
            operand0=None if op == nl.rsqrt else 1.0,
            engine=nisa.engine.gpsimd,
        )
        return out(dst)

    np.testing.assert_allclose(run(kernel, x, nl.rsqrt), 1 / np.sqrt(x), rtol=1e-6)
    with pytest.raises(AssertionError, match="gpsimd engine only for nl.rsqrt"):
        run(kernel, x, nl.add)


def test_raw_integer_enum_is_a_type_error(rng):
    x = f32(rng, 8, 4)

    def kernel(x, eng):
        dst = nl.ndarray(x.shape, nl.float32)
        nisa.tensor_copy(dst=dst, src=sbuf(x), engine=eng)
        return out(dst)

    np.testing.assert_array_equal(run(kernel, x, nisa.engine.vector), x)
    with pytest.raises(TypeError, match="raw integers are not accepted"):
        run(kernel, x, 5)


def test_scalar_tensor_tensor_matches_numpy(rng):
    x, g, r = f32(rng, 32, 64), f32(rng, 32, 64), f32(rng, 32, 1)

    def kernel(x, g, r):
        dst = nl.ndarray(x.shape, nl.float32)
        nisa.scalar_tensor_tensor(
            dst=dst,
            data=sbuf(x),
            op0=nl.multiply,
            operand0=sbuf(r),
            op1=nl.multiply,
            operand1=sbuf(g, buffer=nl.psum),
        )
        return out(dst)

    np.testing.assert_allclose(run(kernel, x, g, r), x * r * g, rtol=1e-6)


def test_reciprocal(rng):
    x = f32(rng, 16, 8, low=0.25, high=8.0)

    def kernel(x):
        dst = nl.ndarray(x.shape, nl.float32)
        nisa.reciprocal(dst=dst, data=sbuf(x))
        return out(dst)

    np.testing.assert_allclose(run(kernel, x), 1 / x, rtol=1e-6)


# --- Scalar engine ---
def test_activation_scale_tile_and_bias_tile(rng):
    x, s, b = f32(rng, 64, 32), f32(rng, 64, 1), f32(rng, 64, 1)

    def kernel(x, s, b):
        dst = nl.ndarray(x.shape, nl.float32)
        nisa.activation(dst=dst, op=nl.exp, data=sbuf(x), scale=sbuf(s), bias=sbuf(b))
        return out(dst)

    np.testing.assert_allclose(run(kernel, x, s, b), np.exp(x * s + b), rtol=2e-6)


def test_activation_reduce_sums_the_fp32_result(rng):
    x = f32(rng, 100, 200)

    def kernel(x):
        sq = nl.ndarray(x.shape, nl.bfloat16)
        ss = nl.ndarray((100, 1), nl.float32)
        nisa.activation_reduce(dst=sq, op=nl.square, data=sbuf(x), reduce_op=nl.add, reduce_res=ss)
        return out(sq), out(ss)

    sq, ss = run(kernel, x)
    np.testing.assert_array_equal(sq, (x * x).astype(BF16))
    np.testing.assert_allclose(ss[:, 0], (x.astype(np.float64) ** 2).sum(1), rtol=1e-5)


def test_activation_reduce_registers_follow_reduce_cmd(rng):
    x, y = f32(rng, 16, 8), f32(rng, 16, 8)

    def kernel(x, y):
        sink = nl.ndarray(x.shape, nl.float32)
        res = nl.ndarray((16, 1), nl.float32)
        nisa.activation(dst=sink, op=nl.copy, data=sbuf(x), reduce_cmd=nisa.reduce_cmd.reset)
        nisa.activation(
            dst=sink, op=nl.copy, data=sbuf(x), reduce_op=nl.add, reduce_cmd=nisa.reduce_cmd.reduce
        )
        nisa.activation(
            dst=sink,
            op=nl.copy,
            data=sbuf(y),
            reduce_op=nl.add,
            reduce_cmd=nisa.reduce_cmd.reduce,
            reduce_res=res,
        )
        return out(res)

    np.testing.assert_allclose(run(kernel, x, y)[:, 0], x.sum(1) + y.sum(1), rtol=1e-5)


def test_activation_reduce_res_may_alias_dst(rng):
    x = f32(rng, 8, 1)

    def kernel(x):
        t = sbuf(x)
        nisa.activation(
            dst=t,
            op=nl.square,
            data=t,
            reduce_op=nl.add,
            reduce_res=t,
            reduce_cmd=nisa.reduce_cmd.reset_reduce,
        )
        return out(t)

    np.testing.assert_allclose(run(kernel, x), x * x, rtol=1e-6)


def test_activation_bias_free_size_must_be_one(rng):
    x = f32(rng, 8, 4)

    def kernel(x, width):
        dst = nl.ndarray(x.shape, nl.float32)
        nisa.activation(dst=dst, op=nl.copy, data=sbuf(x), bias=sbuf(x[:, 0:width]))
        return out(dst)

    np.testing.assert_allclose(run(kernel, x, 1), x + x[:, 0:1])
    with pytest.raises(AssertionError, match="bias must have free size 1"):
        run(kernel, x, 2)


def test_activation_scale_tile_must_be_float32(rng):
    x = f32(rng, 8, 4)

    def kernel(x, dtype):
        dst = nl.ndarray(x.shape, nl.float32)
        nisa.activation(dst=dst, op=nl.copy, data=sbuf(x), scale=sbuf(x[:, 0:1], dtype))
        return out(dst)

    np.testing.assert_allclose(run(kernel, x, nl.float32), x * x[:, 0:1])
    with pytest.raises(TypeError, match="scale must be a float32 tile"):
        run(kernel, x, nl.bfloat16)


def test_activation_scalar_bias_needs_nc_v3(rng, monkeypatch):
    x = f32(rng, 8, 4)

    def kernel(x):
        dst = nl.ndarray(x.shape, nl.float32)
        nisa.activation(dst=dst, op=nl.copy, data=sbuf(x), bias=1.5)
        return out(dst)

    np.testing.assert_allclose(run(kernel, x), x + 1.5)
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn1")
    monkeypatch.setattr(context, "REJECT_NEURONCORE_V2", False)  # the v2 rule behind the gate
    with pytest.raises(AssertionError, match="scalar bias needs NeuronCore-v3"):
        run(kernel, x)


@pytest.mark.parametrize("target", ["trn2", "trn3"])
@pytest.mark.parametrize("api", [nisa.activation, nisa.activation_reduce])
def test_activation_reduces_only_by_addition(rng, monkeypatch, target, api):
    """The Scalar engine's Activate reduces by nl.add alone, on NeuronCore-v3 and v4 too
    (isa L1347-1348; trainium3_arch.rst L228: max/min are activate2's)."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", target)
    x = f32(rng, 8, 16)

    def kernel(x):
        sink = nl.ndarray(x.shape, nl.float32)
        res = nl.ndarray((8, 1), nl.float32)
        api(dst=sink, op=nl.abs, data=sbuf(x), reduce_op=nl.maximum, reduce_res=res)
        return out(res)

    with pytest.raises(NkiValidationError, match="reduce_op must be nl.add on every"):
        run(kernel, x)


# --- reductions and statistics ---
@pytest.mark.parametrize("axis, keepdims", [(2, False), ((1, 2), False), (2, True)])
def test_tensor_reduce_suffix_axes(rng, axis, keepdims):
    x = f32(rng, 32, 6, 10)
    axes = axis if isinstance(axis, tuple) else (axis,)
    ref = x.sum(axis=axes, keepdims=keepdims)
    shape = ref.shape if ref.ndim > 1 else ref.shape + (1,)

    def kernel(x):
        dst = nl.ndarray(shape, nl.float32)
        nisa.tensor_reduce(dst=dst, op=nl.add, data=sbuf(x), axis=axis, keepdims=keepdims)
        return out(dst)

    np.testing.assert_allclose(run(kernel, x).reshape(ref.shape), ref, rtol=1e-5, atol=1e-5)


def test_tensor_reduce_max_negate(rng):
    x = f32(rng, 16, 40)

    def kernel(x):
        dst = nl.ndarray((16, 1), nl.float32)
        nisa.tensor_reduce(dst=dst, op=nl.maximum, data=sbuf(x), axis=1, negate=True)
        return out(dst)

    np.testing.assert_array_equal(run(kernel, x)[:, 0], -x.max(1))


@pytest.mark.parametrize("axis", [0, 1])
def test_tensor_reduce_axis_must_end_at_the_last_dim(rng, axis):
    def kernel(x):
        dst = nl.ndarray((16, 1), nl.float32)
        nisa.tensor_reduce(dst=dst, op=nl.add, data=sbuf(x), axis=axis)
        return out(dst)

    with pytest.raises(AssertionError, match="contiguous run that ends at the last dim"):
        run(kernel, f32(rng, 16, 4, 5))


def test_tensor_scalar_reduce_abs_max(rng):
    x = f32(rng, 32, 50)

    def kernel(x):
        dst = nl.ndarray(x.shape, nl.float32)
        amax = nl.ndarray((32, 1), nl.float32)
        nisa.tensor_scalar_reduce(
            dst=dst, data=sbuf(x), op0=nl.abs, operand0=0.0, reduce_op=nl.maximum, reduce_res=amax
        )
        return out(dst), out(amax)

    dst, amax = run(kernel, x)
    np.testing.assert_array_equal(dst, np.abs(x))
    np.testing.assert_array_equal(amax[:, 0], np.abs(x).max(1))


def test_bn_stats_and_bn_aggr_give_mean_and_variance(rng):
    x = f32(rng, 64, 2, 384)

    def kernel(x):
        xs = sbuf(x)
        stats = nl.ndarray((64, 12), nl.float32)
        for j in range(2):
            nisa.bn_stats(dst=stats[:, 6 * j : 6 * j + 6], data=xs[:, j, :])
        mv = nl.ndarray((64, 2), nl.float32)
        nisa.bn_aggr(dst=mv, data=stats)
        return out(mv)

    mv = run(kernel, x)
    flat = x.reshape(64, -1).astype(np.float64)
    np.testing.assert_allclose(mv[:, 0], flat.mean(1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mv[:, 1], flat.var(1), rtol=1e-5)


def test_bn_stats_takes_at_most_512_elements_per_partition(rng):
    def kernel(x):
        stats = nl.ndarray((8, 6), nl.float32)
        nisa.bn_stats(dst=stats, data=sbuf(x))
        return out(stats)

    run(kernel, f32(rng, 8, 512))
    with pytest.raises(AssertionError, match="exceeds maximum 512"):
        run(kernel, f32(rng, 8, 513))


def test_tensor_tensor_scan_is_the_recurrence(rng):
    a, b, init = f32(rng, 16, 30, low=0.5, high=1.0), f32(rng, 16, 30), f32(rng, 16, 1)

    def kernel(a, b, init):
        dst = nl.ndarray(a.shape, nl.float32)
        nisa.tensor_tensor_scan(
            dst=dst, data0=sbuf(a), data1=sbuf(b), initial=sbuf(init), op0=nl.multiply, op1=nl.add
        )
        return out(dst)

    ref = np.empty_like(a, dtype=np.float64)
    prev = init[:, 0].astype(np.float64)
    for i in range(a.shape[1]):
        prev = a[:, i] * prev + b[:, i]
        ref[:, i] = prev
    np.testing.assert_allclose(run(kernel, a, b, init), ref, rtol=1e-5, atol=1e-6)


# --- copies, fills, iota ---
def test_tensor_copy_casts_and_copies_bits(rng):
    x = f32(rng, 32, 16)

    def kernel(x):
        narrow = nl.ndarray(x.shape, nl.float8_e4m3fn)
        nisa.tensor_copy(dst=narrow, src=sbuf(x))
        same = nl.ndarray(x.shape, nl.float8_e4m3fn)
        nisa.tensor_copy(dst=same, src=narrow)
        return out(same)

    np.testing.assert_array_equal(run(kernel, x), x.astype(ml_dtypes.float8_e4m3fn))


def test_tensor_copy_on_scalar_engine_needs_nc_v3(rng, monkeypatch):
    x = f32(rng, 8, 8)

    def kernel(x):
        dst = nl.ndarray(x.shape, nl.float32)
        nisa.tensor_copy(dst=dst, src=sbuf(x), engine=nisa.engine.scalar)
        return out(dst)

    np.testing.assert_array_equal(run(kernel, x), x)
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn1")
    monkeypatch.setattr(context, "REJECT_NEURONCORE_V2", False)  # the v2 rule behind the gate
    with pytest.raises(AssertionError, match="not available on the scalar engine"):
        run(kernel, x)


def test_gpsimd_cannot_read_psum(rng):
    x = f32(rng, 8, 8)

    def kernel(x, buffer):
        dst = nl.ndarray(x.shape, nl.float32)
        nisa.tensor_copy(dst=dst, src=sbuf(x, buffer=buffer), engine=nisa.engine.gpsimd)
        return out(dst)

    np.testing.assert_array_equal(run(kernel, x, nl.sbuf), x)
    with pytest.raises(AssertionError, match="gpsimd engine cannot access PSUM"):
        run(kernel, x, nl.psum)


def test_memset_value_type_must_fit_the_dtype():
    def kernel(value, dtype):
        t = nl.ndarray((4, 3), dtype)
        nisa.memset(dst=t, value=value)
        return out(t)

    np.testing.assert_array_equal(run(kernel, 7, nl.int32), np.full((4, 3), 7))
    np.testing.assert_array_equal(run(kernel, 2, nl.bfloat16), np.full((4, 3), 2))
    with pytest.raises(TypeError, match="value 2.0 is a float but dst is int32"):
        run(kernel, 2.0, nl.int32)


def test_iota_pattern_and_channel_multiplier():
    def kernel(dummy):
        t = nl.ndarray((8, 3, 4), nl.int32)
        nisa.iota(dst=t, pattern=[[10, 3], [1, 4]], offset=5, channel_multiplier=-2)
        return out(t)

    p, i, j = np.meshgrid(np.arange(8), np.arange(3), np.arange(4), indexing="ij")
    np.testing.assert_array_equal(run(kernel, np.zeros(1, np.float32)), 5 - 2 * p + 10 * i + j)


# --- Tensor engine ---
def test_nc_matmul_accumulates_over_k_tiles(rng):
    lhs_t, rhs = f32(rng, 256, 96), f32(rng, 256, 200)

    def kernel(lhs_t, rhs, explicit):
        acc = nl.ndarray((96, 200), nl.float32, buffer=nl.psum)
        for k in range(2):
            nisa.nc_matmul(
                dst=acc,
                stationary=sbuf(lhs_t[k * 128 : (k + 1) * 128]),
                moving=sbuf(rhs[k * 128 : (k + 1) * 128]),
                accumulate=(k > 0) if explicit else None,
            )
        return out(acc)

    ref = lhs_t.astype(np.float64).T @ rhs
    for explicit in (True, False):
        np.testing.assert_allclose(run(kernel, lhs_t, rhs, explicit), ref, rtol=1e-5, atol=1e-4)


def test_nc_matmul_accumulate_false_overwrites_and_true_warns_on_fresh_psum(rng):
    a, b = f32(rng, 32, 16), f32(rng, 32, 24)

    def kernel(a, b, first):
        acc = nl.ndarray((16, 24), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc, stationary=sbuf(a), moving=sbuf(b), accumulate=first)
        nisa.nc_matmul(dst=acc, stationary=sbuf(a), moving=sbuf(b), accumulate=False)
        return out(acc)

    ref = a.astype(np.float64).T @ b
    np.testing.assert_allclose(run(kernel, a, b, False), ref, rtol=1e-5, atol=1e-5)
    with pytest.warns(UserWarning, match="no instruction wrote.*undefined behavior on all"):
        run(kernel, a, b, True)


@pytest.mark.parametrize("target", ["trn2", "trn3"])
def test_nc_matmul_accumulate_onto_memset_psum_only_on_neuroncore_v4(rng, monkeypatch, target):
    # isa/__init__.py L552-555: unsupported on NeuronCore-v2/v3 only
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", target)
    a, b = f32(rng, 32, 16), f32(rng, 32, 24)

    def kernel(a, b):
        acc = nl.ndarray((16, 24), nl.float32, buffer=nl.psum)
        nisa.memset(dst=acc, value=2.0)
        nisa.nc_matmul(dst=acc, stationary=sbuf(a), moving=sbuf(b), accumulate=True)
        return out(acc)

    ref = a.astype(np.float64).T @ b + 2.0
    if target == "trn2":
        with pytest.warns(UserWarning, match="non-matmul instruction wrote.*NeuronCore-v2/v3"):
            run(kernel, a, b)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_allclose(run(kernel, a, b), ref, rtol=1e-5, atol=1e-5)


def test_nc_matmul_limits_and_dtypes(rng, monkeypatch):
    def kernel(a, b, dst_dtype):
        acc = nl.ndarray((a.shape[1], b.shape[1]), dst_dtype, buffer=nl.psum)
        nisa.nc_matmul(dst=acc, stationary=sbuf(a), moving=sbuf(b))
        return out(acc)

    a = f32(rng, 8, 4)
    run(kernel, a, f32(rng, 8, 512), nl.float32)
    with pytest.raises(AssertionError, match="moving free size 513 exceeds maximum 512"):
        run(kernel, a, f32(rng, 8, 513), nl.float32)
    with pytest.raises(TypeError, match="dst must be float32"):
        run(kernel, a, f32(rng, 8, 8), nl.bfloat16)
    with pytest.raises(TypeError, match="pair only with float32"):
        run(kernel, a, f32(rng, 8, 8).astype(BF16), nl.float32)
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    run(kernel, a, f32(rng, 8, 1024), nl.bfloat16)  # NC-v4: bf16 PSUM output, wider N


def test_nc_matmul_dst_must_be_psum(rng):
    def kernel(a, buffer):
        acc = nl.ndarray((4, 4), nl.float32, buffer=buffer)
        nisa.nc_matmul(dst=acc, stationary=sbuf(a), moving=sbuf(a))
        return out(acc)

    a = f32(rng, 8, 4)
    run(kernel, a, nl.psum)
    with pytest.raises(TypeError, match="dst must be in PSUM"):
        run(kernel, a, nl.sbuf)


def test_nc_matmul_transpose_mode_is_exact(rng):
    x = f32(rng, 64, 32).astype(BF16)

    def kernel(x):
        ident = nl.shared_identity_matrix(64, dtype=nl.bfloat16)
        t = nl.ndarray((32, 64), nl.bfloat16, buffer=nl.psum)
        nisa.nc_matmul(dst=t, stationary=sbuf(x), moving=ident, is_transpose=True)
        return out(t)

    np.testing.assert_array_equal(run(kernel, x), x.T)


@pytest.mark.parametrize(
    "engine_, buffer", [(nisa.engine.tensor, nl.psum), (nisa.engine.vector, nl.sbuf)]
)
def test_nc_transpose(rng, engine_, buffer):
    x = f32(rng, 32, 24)

    def kernel(x):
        t = nl.ndarray((24, 32), nl.float32, buffer=buffer)
        nisa.nc_transpose(dst=t, data=sbuf(x), engine=engine_)
        return out(t)

    np.testing.assert_array_equal(run(kernel, x), x.T)


def test_nc_transpose_vector_engine_limit_and_dtype(rng):
    def kernel(x, dtype):
        t = nl.ndarray((x.shape[1], x.shape[0]), dtype, buffer=nl.sbuf)
        nisa.nc_transpose(dst=t, data=sbuf(x))
        return out(t)

    with pytest.raises(AssertionError, match="exceeds 32 x 32 on the vector engine"):
        run(kernel, f32(rng, 40, 8), nl.float32)
    with pytest.raises(TypeError, match="must equal data dtype"):
        run(kernel, f32(rng, 8, 8), nl.bfloat16)


# --- DMA ---
def test_dma_copy_casts_through_fp32(rng):
    x = f32(rng, 40, 30)

    def kernel(x):
        t = nl.ndarray(x.shape, nl.bfloat16)
        nisa.dma_copy(dst=t, src=x)
        return out(t)

    np.testing.assert_array_equal(run(kernel, x), x.astype(BF16))


def test_dma_copy_cannot_read_psum(rng):
    x = f32(rng, 8, 8)

    def kernel(x, buffer):
        src = sbuf(x, buffer=buffer)
        o = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=o, src=src)
        return o

    np.testing.assert_array_equal(run(kernel, x, nl.sbuf), x)
    with pytest.raises(AssertionError, match="dma_copy src cannot be in PSUM"):
        run(kernel, x, nl.psum)


def test_dma_copy_element_counts_and_hwdge_dtypes(rng):
    x = f32(rng, 8, 8)

    def kernel(x, dtype, cols, mode):
        t = nl.ndarray((8, cols), dtype)
        nisa.dma_copy(dst=t, src=x, dge_mode=mode)
        return out(t)

    run(kernel, x, nl.float32, 8, nisa.dge_mode.hwdge)
    with pytest.raises(AssertionError, match="src has 64 elements"):
        run(kernel, x, nl.float32, 9, nisa.dge_mode.unknown)
    with pytest.raises(AssertionError, match="hwdge cannot cast"):
        run(kernel, x, nl.bfloat16, 8, nisa.dge_mode.hwdge)


def test_dma_compute_accumulates_into_hbm(rng):
    x, h = f32(rng, 16, 8), f32(rng, 16, 8)

    def kernel(x, h):
        nisa.dma_compute(dst=h, srcs=[sbuf(x), h], reduce_op=nl.add)

    run(kernel, x, h_copy := h.copy())
    np.testing.assert_allclose(h_copy, h + x, rtol=1e-6)


def test_dma_transpose_shape_must_be_the_permuted_shape(rng):
    x = f32(rng, 16, 8).astype(BF16)

    def kernel(x, shape):
        t = nl.ndarray(shape, nl.bfloat16)
        nisa.dma_transpose(dst=t, src=x)
        return out(t)

    np.testing.assert_array_equal(run(kernel, x, (8, 16)), x.T)
    with pytest.raises(AssertionError, match="must equal the permuted src shape"):
        run(kernel, x, (8, 16, 1))


@pytest.mark.parametrize(
    "shape, dtype, mode, match",
    [
        ((16, 8), BF16, "hwdge", None),
        ((4, 4, 128), BF16, "hwdge", None),  # 4 · 4 = 16
        ((2, 3, 8, 64), BF16, "hwdge", None),  # 2 · 8 = 16
        ((16, 8), BF16, "swdge", "takes dge_mode unknown or hwdge"),
        ((32, 8), BF16, "hwdge", r"src.shape\[0\] == 16"),
        ((3, 16, 8), BF16, "hwdge", r"src.shape\[0\] in \{1, 2, 4, 8, 16\}"),
        ((4, 2, 8), BF16, "hwdge", "a multiple of 16"),
        ((16, 256), BF16, "hwdge", "partition dimension 256 exceeds"),  # src.shape[-1] <= 128
        ((16, 8), np.float32, "hwdge", "2-byte src dtype"),
        ((32, 8), np.float32, "unknown", None),  # the hwdge limits bind hwdge only
        ((32, 8), np.float32, "none", None),  # AWS's mlp_tkg_gate_up_projection.py L386
    ],
)
def test_dma_transpose_direct_constraints(rng, shape, dtype, mode, match):
    """The reference's "DMA Direct Transpose Constraints" (isa ``__init__.py`` L878-888),
    plus dge_mode none as AWS's mlp_tkg passes it."""
    x = rng.standard_normal(shape).astype(dtype)
    perm = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}[len(shape)]
    transposed = tuple(shape[a] for a in perm)
    kind = nl.bfloat16 if dtype == BF16 else nl.float32
    dge = getattr(nisa.dge_mode, mode)

    def kernel(x):
        t = nl.ndarray(transposed, kind)
        nisa.dma_transpose(dst=t, src=x, dge_mode=dge)
        return out(t)

    if match is None:
        np.testing.assert_array_equal(run(kernel, x), np.transpose(x, perm))
    else:
        with pytest.raises((AssertionError, TypeError), match=match):
            run(kernel, x)


def test_broadcast_views_are_read_only(rng):
    col = f32(rng, 8, 1)

    def kernel(col, into_broadcast):
        c = sbuf(col)
        wide = nl.ndarray((8, 6), nl.float32)
        dst = c.broadcast(1, 6) if into_broadcast else wide
        nisa.tensor_copy(dst=dst, src=c.broadcast(1, 6))
        return out(wide if not into_broadcast else c)

    np.testing.assert_array_equal(run(kernel, col, False), np.repeat(col, 6, axis=1))
    with pytest.raises(AssertionError, match="broadcast"):
        run(kernel, col, True)


def test_psum_and_sbuf_capacity_count_tiles_live_together_and_spill_beyond():
    def kernel(x, banks, together):
        tiles = []
        for _ in range(banks):
            t = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
            nisa.memset(dst=t, value=0.0)
            if not together:  # last use right away: the next tile may take its bank
                nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=1.0)
            tiles.append(t)
        if together:  # all read at the end: every bank is live at once
            for t in tiles:
                nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=1.0)

    nki.simulate(kernel)(np.zeros(1, np.float32), 8, True)
    assert nki.last_trace().psum_peak_bytes_per_partition == 8 * 2048
    nki.simulate(kernel)(np.zeros(1, np.float32), 9, False)
    assert nki.last_trace().psum_peak_bytes_per_partition == 2048
    # nine banks live together: the compiler spills the one read last (the eighth: the
    # ninth takes its bank) and reloads it after the first seven are read and dead
    with pytest.warns(SpillWarning, match="PSUM over-subscribed on trn2: .* 18432 of .* 16384"):
        nki.simulate(kernel)(np.zeros(1, np.float32), 9, True)
    trace = nki.last_trace()
    assert trace.spill_save_bytes == trace.spill_reload_bytes == 128 * 2048


def test_sbuf_capacity_is_the_targets(rng):
    usable = 212984  # trn2 bytes per partition (nl.tile_size.sbuf_fmax_bytes)

    def kernel(x, columns):
        a = nl.ndarray((128, columns), nl.float32)
        nisa.memset(dst=a, value=1.0)
        b = nl.ndarray((128, 16), nl.float32)
        nisa.tensor_copy(dst=b, src=a[:, 0:16])
        return out(b)

    run(kernel, np.zeros(1, np.float32), (usable - 64) // 4)
    with pytest.raises(ValueError, match="SBUF over capacity"):
        run(kernel, np.zeros(1, np.float32), (usable - 64) // 4 + 1)


def test_the_cost_model_reads_norm_kernel_traces(rng):
    from simulate import cost

    x, w = f32(rng, 128, 256), f32(rng, 1, 256)

    def kernel(x, w):
        xs = sbuf(x)
        sq = nl.ndarray(x.shape, nl.float32)
        ss = nl.ndarray((128, 1), nl.float32)
        nisa.activation_reduce(dst=sq, op=nl.square, data=xs, reduce_op=nl.add, reduce_res=ss)
        nisa.activation(dst=ss, op=nl.rsqrt, data=ss, scale=1.0 / 256, bias=1e-6)
        ones = nl.ndarray((1, 128), nl.float32)
        nisa.memset(dst=ones, value=1.0)
        wb = nl.ndarray((128, 256), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=wb, stationary=ones, moving=sbuf(w))
        y = nl.ndarray(x.shape, nl.float32)
        nisa.scalar_tensor_tensor(
            dst=y, data=xs, op0=nl.multiply, operand0=ss, op1=nl.multiply, operand1=wb
        )
        return out(y)

    y = run(kernel, x, w)
    ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)
    schedule = cost.schedule(nki.last_trace())
    assert schedule.unmodeled == {} and schedule.latency_us > 0


def test_tensor_copy_predicated_keeps_dst_where_false(rng):
    x, y = f32(rng, 16, 10), f32(rng, 16, 10)
    mask = (rng.random((16, 10)) < 0.5).astype(np.uint8)

    def kernel(x, y, mask, reverse):
        dst = sbuf(y)
        nisa.tensor_copy_predicated(
            dst=dst, src=sbuf(x), predicate=sbuf(mask), reverse_pred=reverse
        )
        return out(dst)

    np.testing.assert_array_equal(run(kernel, x, y, mask, False), np.where(mask, x, y))
    np.testing.assert_array_equal(run(kernel, x, y, mask, True), np.where(mask, y, x))
    with pytest.raises(TypeError, match="predicate must be uint8"):
        run(kernel, x, y, mask.astype(np.float32), False)


def test_nc_matmul_tiling_and_perf_mode_rules(rng):
    a = f32(rng, 32, 32)

    def kernel(a, position, size, dtype, mode):
        st = sbuf(a, dtype)
        acc = nl.ndarray((32, 32), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(
            dst=acc,
            stationary=st,
            moving=st,
            tile_position=position,
            tile_size=size,
            perf_mode=mode,
        )
        return out(acc)

    none, double = nisa.matmul_perf_mode.none, nisa.matmul_perf_mode.double_row
    ref = a.astype(np.float64).T @ a
    np.testing.assert_allclose(
        run(kernel, a, (32, 0), (32, 32), nl.float32, none), ref, rtol=1e-5, atol=1e-5
    )
    # double_row: the contraction over (partition, a first free dimension of 2), isa L596-599
    paired = a.reshape(16, 2, 32)
    fp8 = paired.astype(ml_dtypes.float8_e4m3).astype(np.float64).reshape(32, 32)
    np.testing.assert_allclose(
        run(kernel, paired, (), (), nl.float8_e4m3, double), fp8.T @ fp8, rtol=1e-5, atol=1e-4
    )
    with pytest.raises(AssertionError, match="start_row 16 must be a multiple of the row size 32"):
        run(kernel, a, (16, 0), (32, 32), nl.float32, none)
    with pytest.raises(AssertionError, match="double_row needs fp8"):
        run(kernel, paired, (), (), nl.bfloat16, double)
    with pytest.raises(AssertionError, match="first free dimension of 2"):
        run(kernel, a, (), (), nl.float8_e4m3, double)
    # the stub's string values, as AWS passes them (mlp_cte_projection.py L1166)
    np.testing.assert_allclose(
        run(kernel, paired, (), (), nl.float8_e4m3, "double_row"), fp8.T @ fp8, rtol=1e-5
    )
    with pytest.raises(AssertionError, match="expected a nisa.matmul_perf_mode member"):
        run(kernel, a, (), (), nl.float32, "double")
    with pytest.raises(AssertionError, match="expected a nisa.matmul_perf_mode member"):
        run(kernel, a, (), (), nl.float32, 1)


def test_dma_oob_skip_needs_an_indirect_access(rng):
    x = f32(rng, 4, 4)

    def kernel(x, mode):
        t = nl.ndarray(x.shape, nl.float32)
        nisa.dma_copy(dst=t, src=x, oob_mode=mode)
        return out(t)

    run(kernel, x, nisa.oob_mode.error)
    with pytest.raises(AssertionError, match="oob_mode=skip needs an indirect"):
        run(kernel, x, nisa.oob_mode.skip)


def test_a_tile_allocated_per_loop_iteration_reuses_the_last_ones_space(rng):
    x = f32(rng, 128, 4)

    def kernel(x):
        total = nl.zeros((128, 4), nl.float32)
        for _ in range(3):  # each iteration's 120 KB tile is dead before the next one
            big = nl.ndarray((128, 30000), nl.float32)
            nisa.memset(dst=big, value=1.0)
            nisa.tensor_tensor(dst=total, data1=total, data2=big[:, 0:4], op=nl.add)
        return out(total)

    np.testing.assert_array_equal(run(kernel, x), np.full((128, 4), 3.0))
    assert nki.last_trace().sbuf_peak_bytes_per_partition == 120000 + 16
