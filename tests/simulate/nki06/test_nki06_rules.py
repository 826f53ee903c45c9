"""Rules that live once in ``simulate.core`` (rules, dtypes, functions) and serve both
front-ends, parametrized by dialect where the 0.6 docs differ from the legacy ones: each
rule the nki06 front-end newly enforces has a must-raise test and a legal twin, and each
0.6-only operator or dtype is absent from the legacy front-end."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import simulate
import simulate.isa as lisa
import simulate.language as lnl
import simulate.nki06 as nki
from simulate.core import dtypes as core_dtypes
from simulate.core.errors import NKITypeError, NKIValueError
from simulate.nki06 import isa as nisa
from simulate.nki06 import language as nl
from simulate.nki06.errors import NkiTypeError, NkiValidationError


@pytest.fixture
def target(monkeypatch):
    def use(name):
        monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", name)

    monkeypatch.delenv("NKI_PRECISE_FP", raising=False)
    return use


def _abs_extreme_kernel(op):
    @nki.jit
    def kernel(a, b, c):
        out = nl.ndarray(a.shape, nl.float32, buffer=nl.shared_hbm)
        scalar_out = nl.ndarray(a.shape, nl.float32, buffer=nl.shared_hbm)
        at, bt, ct = nl.load(a), nl.load(b), nl.load(c)
        result = nl.ndarray(a.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=result, data1=at, data2=bt, op=op)
        nl.store(out, result)
        nl.store(scalar_out, op(at, ct))  # a (P, 1) column: a tensor_scalar
        return out, scalar_out

    return kernel


def _magnitude_pick(x, y, larger):
    pick_x = np.abs(x) > np.abs(y) if larger else np.abs(x) < np.abs(y)
    return np.where(pick_x, x, y)


@pytest.mark.parametrize("name, larger", [("abs_max", True), ("abs_min", False)])
def test_abs_max_and_abs_min_pick_the_signed_value_on_trn3(rng, target, name, larger):
    target("trn3")
    a = rng.uniform(-4, 4, (128, 96)).astype(np.float32)
    b = rng.uniform(-4, 4, (128, 96)).astype(np.float32)
    b[:, :8] = -a[:, :8]  # ties: the docs' examples return y
    c = rng.uniform(-4, 4, (128, 1)).astype(np.float32)
    with pytest.warns(UserWarning, match="broadcasting a"):
        out, scalar_out = _abs_extreme_kernel(getattr(nl, name))(a, b, c)
    np.testing.assert_array_equal(out, _magnitude_pick(a, b, larger))
    np.testing.assert_array_equal(out[:, :8], b[:, :8])
    np.testing.assert_array_equal(scalar_out, _magnitude_pick(a, c, larger))


@pytest.mark.parametrize("name", ["abs_max", "abs_min"])
def test_abs_max_and_abs_min_need_neuroncore_v4(rng, target, name):
    target("trn2")
    a = rng.uniform(-4, 4, (128, 32)).astype(np.float32)
    with pytest.raises(AssertionError, match=f"op={name} is available only on NeuronCore-v4"):
        _abs_extreme_kernel(getattr(nl, name))(a, a, a[:, :1])


def test_the_legacy_dialect_has_no_abs_max(rng):
    assert not hasattr(lnl, "abs_max") and not hasattr(lnl, "abs_min")
    x = rng.uniform(-4, 4, (128, 32)).astype(np.float32)

    def kernel_with(op):
        @simulate.jit
        def kernel(x):
            out = lnl.ndarray(x.shape, x.dtype, buffer=lnl.shared_hbm)
            t = lnl.load(x)
            lnl.store(out, lisa.tensor_tensor(t, t, op=op))
            return out

        return kernel

    with pytest.raises(NKIValueError, match="op=abs_max is not an operator of this NKI"):
        simulate.trace_kernel(kernel_with("abs_max"), x, target="trn3")
    np.testing.assert_array_equal(
        simulate.trace_kernel(kernel_with(np.maximum), x, target="trn3")[0], x
    )


def _activation_kernel(op):
    @nki.jit
    def kernel(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        y = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.activation(dst=y, op=op, data=nl.load(x))
        nl.store(out, y)
        return out

    return kernel


def test_activation_op_must_be_in_the_0_6_activation_table(rng, target):
    target("trn2")
    x = rng.standard_normal((64, 48)).astype(np.float32)
    # "identity" is an operator name of the simulator, not a 0.6 activation function
    with pytest.raises(AssertionError, match="op=identity is not an activation function"):
        _activation_kernel("identity")(x)
    np.testing.assert_array_equal(_activation_kernel(nl.copy)(x), x)


def test_tensor_reduce_op_must_be_a_legal_reduction(rng, target):
    target("trn2")
    x = rng.standard_normal((64, 48)).astype(np.float32)

    def kernel_with(op):
        @nki.jit
        def kernel(x):
            out = nl.ndarray((64, 1), nl.float32, buffer=nl.shared_hbm)
            r = nl.ndarray((64, 1), nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=r, op=op, data=nl.load(x), axis=1)
            nl.store(out, r)
            return out

        return kernel

    with pytest.raises(AssertionError, match="op=equal is not a legal reduction operator"):
        kernel_with(nl.equal)(x)
    np.testing.assert_allclose(kernel_with(nl.add)(x)[:, 0], x.sum(axis=1), rtol=1e-5)


# --- dtypes ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e8m0fnu"])
def test_ocp_fp8_dtypes_round_through_float32_in_the_core(rng, name):
    dtype = getattr(core_dtypes, name)
    values = rng.uniform(-600, 600, 4096)  # float64, beyond e4m3fn's 448: NaN (no inf)
    got = core_dtypes.cast(values, dtype)
    assert got.dtype == np.dtype(getattr(ml_dtypes, name))
    want = values.astype(np.float32).astype(getattr(ml_dtypes, name))
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    assert core_dtypes.promote(dtype, core_dtypes.float16) == core_dtypes.float16
    assert core_dtypes.promote(core_dtypes.int8, dtype) == core_dtypes.bfloat16


def test_nki06_stores_float8_e4m3fn_and_legacy_rejects_it(rng, target):
    target("trn3")
    x = rng.uniform(-300, 300, (32, 64)).astype(np.float32)

    @nki.jit
    def kernel(x):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        low = nl.ndarray(x.shape, nl.float8_e4m3fn, buffer=nl.sbuf)
        nisa.dma_copy(dst=low, src=x)
        nisa.dma_copy(dst=out, src=low)
        return out

    np.testing.assert_array_equal(kernel(x), x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
    assert not hasattr(lnl, "float8_e4m3fn") and not hasattr(lnl, "float8_e8m0fnu")

    @simulate.jit
    def legacy_kernel(x):
        out = lnl.ndarray(x.shape, x.dtype, buffer=lnl.shared_hbm)
        lnl.store(out, lnl.load(x, dtype=ml_dtypes.float8_e4m3fn))
        return out

    with pytest.raises(NKITypeError, match="dtype=float8_e4m3fn is not supported"):
        simulate.trace_kernel(legacy_kernel, x, target="trn3")


def _tensor_tensor_kernel(op, engine):
    @nki.jit
    def kernel(a, b):
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        result = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=result, data1=nl.load(a), data2=nl.load(b), op=op, engine=engine)
        nl.store(out, result)
        return out

    return kernel


def test_gpsimd_tensor_tensor_runs_power_or_integer_arithmetic_only(rng, target):
    target("trn2")
    a = rng.uniform(0.5, 2, (64, 32)).astype(np.float32)
    b = rng.uniform(0.5, 2, (64, 32)).astype(np.float32)
    with pytest.raises(AssertionError, match="op=add does not run on the gpsimd engine"):
        _tensor_tensor_kernel(nl.add, nisa.engine.gpsimd)(a, b)
    # legal twins: float power, int32 maximum (0.6: any arithmetic op on int32 tiles)
    np.testing.assert_allclose(
        _tensor_tensor_kernel(nl.power, nisa.engine.gpsimd)(a, b), a**b, rtol=1e-6
    )
    i = rng.integers(-(2**30), 2**30, (64, 32)).astype(np.int32)
    j = rng.integers(-(2**30), 2**30, (64, 32)).astype(np.int32)
    np.testing.assert_array_equal(
        _tensor_tensor_kernel(nl.maximum, nisa.engine.gpsimd)(i, j), np.maximum(i, j)
    )
    np.testing.assert_allclose(
        _tensor_tensor_kernel(nl.add, nisa.engine.vector)(a, b), a + b, rtol=1e-6
    )


def _scan_kernel(op0, op1):
    @nki.jit
    def kernel(a):
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        t = nl.load(a)
        result = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor_scan(dst=result, data0=t, data1=t, initial=0, op0=op0, op1=op1)
        nl.store(out, result)
        return out

    return kernel


def test_tensor_tensor_scan_takes_arithmetic_operators_only(target):
    """ "Both op0 and op1 can be any binary arithmetic operator" (isa L2028)."""
    target("trn2")
    a = np.arange(4 * 8, dtype=np.int32).reshape(4, 8) % 5
    with pytest.raises(NkiValidationError, match="bitvec operator"):
        _scan_kernel(nl.bitwise_and, nl.bitwise_or)(a)
    out = _scan_kernel(nl.maximum, nl.add)(a)
    expected = np.zeros_like(a)
    running = np.zeros(4, np.int64)
    for i in range(8):
        running = np.maximum(a[:, i], running) + a[:, i]
        expected[:, i] = running
    np.testing.assert_array_equal(out, expected)


def _range_select_kernel(range_start):
    @nki.jit
    def kernel(a, bound):
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        result = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
        b = nl.load(bound)
        nisa.range_select(
            dst=result,
            on_true_tile=nl.load(a),
            comp_op0=nl.greater_equal,
            comp_op1=nl.less,
            bound0=b,
            bound1=nl.add(b, 4.0),
            range_start=range_start,
        )
        nl.store(out, result)
        return out

    return kernel


def test_range_select_range_start_is_an_integer_inside_2_to_the_24(rng, target):
    """range_start "must be a compile-time integer" and range_start + the free index stays
    "within 2^24 range" (isa L2864, L2895-2896)."""
    target("trn2")
    a = rng.standard_normal((128, 64)).astype(np.float32)
    bound = np.full((128, 1), 10.0, np.float32)
    with pytest.raises(NkiTypeError, match="compile-time integer"):
        _range_select_kernel(1.5)(a, bound)
    with pytest.raises(NkiValidationError, match="2\\^24"):
        _range_select_kernel(1 << 24)(a, bound)
    out = _range_select_kernel(8)(a, bound)
    index = 8 + np.arange(64)
    keep = (index >= 10) & (index < 14)
    fp32_min = np.finfo(np.float32).min
    np.testing.assert_array_equal(out, np.where(keep[None, :], a, fp32_min))
