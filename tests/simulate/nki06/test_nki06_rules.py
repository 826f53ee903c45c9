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


# --- documented-illegal instruction forms, each next to its legal twin ---------------------------
# Every case cites its line of the 0.6 ISA reference (aws-neuron-sdk@81ce03ae
# nki/api/nki/isa/__init__.py, "I Lnn"), the language reference (nki/api/nki/language/__init__.py,
# "L Lnn"), the shared operator page (nki/api/nki.api.shared.rst, "S Lnn") or the language guide
# (nki/get-started/nki-language-guide.rst, "G Lnn"). The twin differs in the one documented
# respect and its output is checked against NumPy.
def _sb(x, dtype=None):
    t = nl.ndarray(x.shape, dtype or x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    return t


def _out(t):
    if t.buffer == nl.psum:
        staged = nl.ndarray(t.shape, t.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=staged, src=t)
        t = staged
    o = nl.ndarray(t.shape, t.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=o, src=t)
    return o


def _tiled_matmul(position, size):
    def kernel(x):
        acc = nl.ndarray((32, 32), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(
            dst=acc,
            stationary=_sb(x[0:64, 0:32]),
            moving=_sb(x[0:64, 32:64]),
            tile_position=position,
            tile_size=size,
        )
        return _out(acc)

    return kernel


def _matmul_ref(x):
    return x[:64, :32].astype(np.float64).T @ x[:64, 32:]


def _scan(op1):
    def kernel(x):
        dst = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        t = _sb(x)
        nisa.tensor_tensor_scan(dst=dst, data0=t, data1=t, initial=0.0, op0=nl.add, op1=op1)
        return _out(dst)

    return kernel


def _tensor_scalar_reduce(op0, dtype):
    def kernel(x):
        data = _sb(x, dtype)
        dst = nl.ndarray(x.shape, dtype, buffer=nl.sbuf)
        total = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar_reduce(
            dst=dst, data=data, op0=op0, operand0=1, reduce_op=nl.add, reduce_res=total
        )
        return _out(total)

    return kernel


def _partition_reduce(op, dtype):
    def kernel(x):
        dst = nl.ndarray((1, x.shape[1]), dtype, buffer=nl.sbuf)
        nisa.tensor_partition_reduce(dst=dst, op=op, data=_sb(x, dtype))
        return _out(dst)

    return kernel


def _register_round_trip(into_loop_register):
    def kernel(x):
        one = _sb(x[0:1, 0:1], nl.int32)
        kept = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)

        def body(i):
            target = i if into_loop_register else nisa.register_alloc(0)
            nisa.register_load(target, one)
            nisa.register_store(kept, target)

        nl.fori_loop(0, 2, body)
        return _out(kept)

    return kernel


def _copy_in_no_reorder(loop):
    def kernel(x):
        t = _sb(x)
        doubled = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        with nl.no_reorder():
            for _ in loop(1):
                nisa.tensor_tensor(dst=doubled, data1=t, data2=t, op=nl.add)
        return _out(doubled)

    return kernel


def _doubled_in_fori_loop(declared_in_body):
    def kernel(x):
        t = _sb(x)
        outer = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        made = [outer]

        def body(i):
            dst = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf) if declared_in_body else outer
            nisa.tensor_tensor(dst=dst, data1=t, data2=t, op=nl.add)
            made.append(dst)

        nl.fori_loop(0, 1, body)
        return _out(made[-1])

    return kernel


def _edge_out_of_fori_loop(producer_in_loop):
    def kernel(x):
        t = _sb(x)
        doubled = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        made = []

        def body(i):
            made.append(nisa.tensor_tensor(dst=doubled, data1=t, data2=t, op=nl.add))

        if producer_in_loop:
            nl.fori_loop(0, 1, body)
        else:
            body(0)
        result = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=result, src=doubled).depends_on(made[0])
        return _out(result)

    return kernel


def _rows_in_dynamic_range(compare_loop_variable):
    def kernel(x):
        rows = nl.ndarray((4, x.shape[1]), x.dtype, buffer=nl.sbuf)
        for i in nl.dynamic_range(4):
            if compare_loop_variable and i == 0:
                continue
            nisa.dma_copy(dst=rows[i], src=x[i])  # a register indexes a tensor
        return _out(rows)

    return kernel


def _gather_accumulate(unique):
    def kernel(x):
        rows = nl.ndarray((x.shape[0], 1), nl.int32, buffer=nl.sbuf)
        nisa.iota(dst=rows, pattern=[[0, 1]], offset=x.shape[0] - 1, channel_multiplier=-1)
        acc = _sb(x)
        flipped = x.ap(pattern=[[x.shape[1], x.shape[0]], [1, x.shape[1]]], vector_offset=rows)
        nisa.dma_compute(dst=acc, srcs=[flipped, acc], reduce_op=nl.add, unique_indices=unique)
        return _out(acc)

    return kernel


def _iota(offset):
    def kernel(x):
        dst = nl.ndarray((x.shape[0], 8), nl.int32, buffer=nl.sbuf)
        nisa.iota(dst=dst, pattern=[[1, 8]], offset=offset, channel_multiplier=8)
        return _out(dst)

    return kernel


def _lower_triangle(on_false_value):
    def kernel(x):
        dst = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.affine_select(
            dst=dst,
            pattern=[[-1, x.shape[1]]],
            channel_multiplier=1,
            on_true_tile=_sb(x),
            on_false_value=on_false_value,
            cmp_op=nl.greater_equal,
        )
        return _out(dst)

    return kernel


def _cumsum_twice(x):
    return np.cumsum(2 * x.astype(np.float64), axis=1)


def _lower_triangle_ref(x):
    p, j = np.indices(x.shape)
    return np.where(p - j >= 0, x, 0.0)


INSTRUCTION_CASES = [
    # I L525-526: start_row a multiple of row_size (the legal twin uses the bottom half)
    (
        _tiled_matmul((32, 0), (64, 128)),
        _tiled_matmul((64, 0), (64, 128)),
        "start_row 32",
        _matmul_ref,
    ),
    # I L514-518: rows tile as 128 / 64 / 32
    (
        _tiled_matmul((0, 0), (96, 128)),
        _tiled_matmul((0, 0), (64, 128)),
        "row size 96",
        _matmul_ref,
    ),
    # I L525-526: the tile lies inside the 128-row array
    (
        _tiled_matmul((128, 0), (64, 128)),
        _tiled_matmul((64, 0), (64, 128)),
        "start_row",
        _matmul_ref,
    ),
    # I L520-526: column tiling (AWS's router_topk L428-437); start_column on a tile boundary
    (
        _tiled_matmul((0, 16), (128, 32)),
        _tiled_matmul((0, 32), (128, 32)),
        "start_column 16",
        _matmul_ref,
    ),
    # I L2024-2026: scan operators are arithmetic
    (_scan(nl.bitwise_and), _scan(nl.add), "op1=bitwise_and", _cumsum_twice),
    # I L2520-2522: tensor_scalar_reduce op0 is arithmetic, no bitvec
    (
        _tensor_scalar_reduce(nl.bitwise_or, nl.int32),
        _tensor_scalar_reduce(nl.add, nl.float32),
        "op0=bitwise_or",
        lambda x: (x.astype(np.float64) + 1).sum(axis=1, keepdims=True),
    ),
    # S L65-67: bitvec operators take integer data
    (
        _partition_reduce(nl.bitwise_or, nl.float32),
        _partition_reduce(nl.add, nl.float32),
        "op=bitwise_or on float32",
        lambda x: x.astype(np.float64).sum(axis=0, keepdims=True),
    ),
    # G L532: a loop's induction register is frozen
    (
        _register_round_trip(True),
        _register_round_trip(False),
        "read-only",
        lambda x: x[:1, :1].astype(np.int32),
    ),
    # L L2251-2254: no register-based dynamic loop inside no_reorder (static loops are fine)
    (
        _copy_in_no_reorder(nl.dynamic_range),
        _copy_in_no_reorder(nl.affine_range),
        "nl.dynamic_range cannot sit inside an nl.no_reorder",
        lambda x: 2 * x,
    ),
    # M L139-140: a tensor declared in a runtime loop's body is not used after the loop
    (
        _doubled_in_fori_loop(True),
        _doubled_in_fori_loop(False),
        "declared inside the body of an nl.fori_loop",
        lambda x: 2 * x,
    ),
    # I L158-162: no scheduling edge out of a runtime loop
    (
        _edge_out_of_fori_loop(True),
        _edge_out_of_fori_loop(False),
        "edge into or out of a dynamic loop",
        lambda x: 2 * x,
    ),
    # nki/deep-dives/nki-dynamic-loops.rst L110-113: the loop variable is a device register,
    # not a Python int; guide L518-521: it indexes tensors
    (
        _rows_in_dynamic_range(True),
        _rows_in_dynamic_range(False),
        "cannot be compared",
        lambda x: x[:4],
    ),
    # I L2686-2690: read-modify-write through vector_offset needs unique indices
    (
        _gather_accumulate(False),
        _gather_accumulate(True),
        "needs unique_indices=True",
        lambda x: x[::-1] + x,
    ),
    # I L1759-1761: iota immediates are int32 (no silent truncation of 0.5)
    (
        _iota(0.5),
        _iota(3),
        "offset must be an int32",
        lambda x: 3 + 8 * np.arange(x.shape[0])[:, None] + np.arange(8),
    ),
    # I L1813: on_false_value is float32
    (
        _lower_triangle(0),
        _lower_triangle(0.0),
        "on_false_value must be a float32",
        _lower_triangle_ref,
    ),
]


@pytest.mark.parametrize(
    "illegal, legal, match, reference",
    INSTRUCTION_CASES,
    ids=[f"{i}-{case[2].split()[0]}" for i, case in enumerate(INSTRUCTION_CASES)],
)
def test_documented_illegal_instruction_form_is_rejected_and_its_twin_runs(
    rng, target, illegal, legal, match, reference
):
    target("trn2")
    x = rng.uniform(-1, 1, (128, 64)).astype(np.float32)
    with pytest.raises(AssertionError, match=match):
        nki.simulate(illegal)(x)
    got = nki.simulate(legal)(x)
    if reference is not None:
        np.testing.assert_allclose(got, reference(x), rtol=1e-5, atol=1e-5)


def _two_addressed_tiles(second_offset, second_after_first):
    """Two SBUF tensors the kernel places with ``address=`` (aws-neuron-sdk@81ce03ae
    nki/migration/index.rst L1095-L1107), the second at byte ``second_offset``; both live at
    once unless ``second_after_first``."""

    @nki.jit
    def kernel(x):
        out = nl.ndarray((128, 512), x.dtype, buffer=nl.shared_hbm)
        first = nl.ndarray((128, 256), x.dtype, buffer=nl.sbuf, address=(0, 0))
        second = nl.ndarray((128, 256), x.dtype, buffer=nl.sbuf, address=(0, second_offset))
        nisa.dma_copy(dst=first, src=x[:, 0:256])
        if second_after_first:
            nisa.dma_copy(dst=out[:, 0:256], src=first)
        nisa.dma_copy(dst=second, src=x[:, 256:512])
        if not second_after_first:
            nisa.dma_copy(dst=out[:, 0:256], src=first)
        nisa.dma_copy(dst=out[:, 256:512], src=second)
        return out

    return kernel


def test_tensors_placed_at_overlapping_addresses_must_not_be_live_together(rng, target):
    """The kernel's ``address=`` is honoured: two tensors on overlapping bytes, both live,
    are a lifetime conflict; side by side, or one after the other at one address, they run."""
    target("trn2")
    x = rng.standard_normal((128, 512)).astype(np.float32)
    with pytest.raises(NKIValueError, match="err_allocation_lifetime_conflict.*overlapping"):
        _two_addressed_tiles(512, second_after_first=False)(x)
    for offset, after in ((1024, False), (0, True)):
        np.testing.assert_array_equal(_two_addressed_tiles(offset, after)(x), x)
