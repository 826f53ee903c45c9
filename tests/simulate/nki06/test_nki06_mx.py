"""The OCP Microscaling (MX) support of the 0.6 front-end: the packed ``_x4`` dtypes
(aws-neuron-sdk@81ce03ae nki/api/nki.api.shared.rst L49-53, L268)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import simulate.nki06 as nki
from simulate.core import dtypes as core_dtypes
from simulate.nki06 import dtypes as nki_dtypes
from simulate.nki06 import isa as nisa
from simulate.nki06 import language as nl
from simulate.nki06.errors import NkiTypeError

PACKED_FP8 = ("float8_e4m3fn_x4", "float8_e5m2_x4")
PACKED = (*PACKED_FP8, "float4_e2m1fn_x4")
ELEMENT = {
    "float8_e4m3fn_x4": ml_dtypes.float8_e4m3fn,
    "float8_e5m2_x4": ml_dtypes.float8_e5m2,
    "float4_e2m1fn_x4": ml_dtypes.float4_e2m1fn,
}


@pytest.fixture
def target(monkeypatch):
    def use(name):
        monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", name)

    monkeypatch.delenv("NKI_PRECISE_FP", raising=False)
    return use


@pytest.mark.parametrize("name", PACKED)
def test_packed_dtypes_hold_four_values_first_in_the_lowest_bits(rng, name):
    element = np.dtype(ELEMENT[name])
    values = rng.uniform(-6, 6, (16, 32)).astype(element)
    packed = core_dtypes.pack_x4(values, name)
    assert packed.shape == (16, 8)
    assert packed.dtype.itemsize == (2 if name == "float4_e2m1fn_x4" else 4)
    bits = values.view(np.uint8).astype(np.uint32)
    width = 4 if name == "float4_e2m1fn_x4" else 8
    want = sum((bits[:, k::4] & ((1 << width) - 1)) << (width * k) for k in range(4))
    np.testing.assert_array_equal(packed.astype(np.uint32), want)
    back = core_dtypes.unpack_x4(packed, name)
    np.testing.assert_array_equal(back.view(np.uint8), values.view(np.uint8))
    assert getattr(nl, name) == name and str(getattr(nl, name)) == name
    assert getattr(nl, name).itemsize == packed.dtype.itemsize
    plain = np.dtype(np.uint16 if name == "float4_e2m1fn_x4" else np.uint32)
    assert getattr(nl, name) != plain and nki_dtypes.as_dtype(packed.dtype) is getattr(nl, name)


@pytest.mark.parametrize("name", PACKED)
def test_packed_dtypes_move_as_bits_and_are_not_computed_on(rng, target, name):
    target("trn3")
    dtype = getattr(nl, name)
    bits = rng.integers(0, 1 << (8 * dtype.itemsize), (32, 16)).astype(dtype.numpy)

    @nki.jit
    def copy(x):
        tile = nl.ndarray(x.shape, dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=x)
        again = nl.ndarray(x.shape, dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=again, src=tile)
        out = nl.ndarray(x.shape, dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=again)
        return out

    out = copy(bits)
    assert nl.float32 != out.dtype and getattr(nl, name) == out.dtype
    np.testing.assert_array_equal(out.view(bits.dtype.str), bits.view(bits.dtype.str))

    @nki.jit
    def convert(x):
        tile = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=x)
        return tile

    with pytest.raises(NkiTypeError, match="moves as its bits only"):
        convert(bits)

    @nki.jit
    def arithmetic(x):
        tile = nl.ndarray(x.shape, dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=x)
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=out, data=tile, op0=nl.multiply, operand0=2.0)
        return out

    with pytest.raises(NkiTypeError, match="four packed values per element"):
        arithmetic(bits)


# --- nisa.quantize_mx -------------------------------------------------------------------------
# E_max and the largest finite value of each element type (isa L2798-2799; OCP e4m3fn 448,
# e5m2 57344)
EMAX = {"float8_e4m3fn_x4": 8, "float8_e5m2_x4": 15}
MAX_FINITE = {"float8_e4m3fn_x4": 448.0, "float8_e5m2_x4": 57344.0}


def reference_quantize_mx(x, packed):
    """float64 reference of the documented quantize_mx, written from the ISA reference
    (isa L2790-2812) without the simulator's code: per 8x4 group the scale exponent
    floor(log2 amax) - (E_max - 1) (floor(log2) by repeated halving), 2**-127 for zeros; the
    values x / 2**e rounded to nearest even by hand on the element grid."""
    p, f = x.shape
    element = ELEMENT[packed]
    mantissa_bits = 3 if packed == "float8_e4m3fn_x4" else 2
    min_normal_exp = -6 if packed == "float8_e4m3fn_x4" else -14
    exps = np.zeros((p // 8, f // 4), np.int64)
    q = np.zeros((p, f))
    for gp in range(p // 8):
        for gf in range(f // 4):
            block = x[8 * gp : 8 * gp + 8, 4 * gf : 4 * gf + 4].astype(np.float64)
            amax = np.max(np.abs(block))
            if amax == 0:
                e = -127
            else:
                floor_log2 = 0
                while 2.0**floor_log2 > amax:
                    floor_log2 -= 1
                while 2.0 ** (floor_log2 + 1) <= amax:
                    floor_log2 += 1
                e = max(floor_log2 - (EMAX[packed] - 1), -127)
            exps[gp, gf] = e
            scaled = block / 2.0**e
            # round to nearest even on the grid of the element type's binade
            mag = np.abs(scaled)
            binade = np.floor(np.log2(np.where(mag > 0, mag, 1.0)))
            step = 2.0 ** (np.maximum(binade, min_normal_exp) - mantissa_bits)
            rounded = np.sign(scaled) * np.round(mag / step) * step  # np.round: half to even
            q[8 * gp : 8 * gp + 8, 4 * gf : 4 * gf + 4] = rounded
    assert np.abs(q).max(initial=0) <= MAX_FINITE[packed]
    return q.astype(element), exps


def _quantize_kernel(packed, scale_dtype, scale_rows=None, src_dtype=nl.bfloat16):
    packed = getattr(nl, packed)

    @nki.jit
    def kernel(x):
        p, f = x.shape
        src = nl.ndarray((p, f), src_dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=src, src=x)
        data = nl.ndarray((p, f // 4), packed, buffer=nl.sbuf)
        rows = scale_rows if scale_rows is not None else (p if p > 32 else p // 8)
        scale = nl.ndarray((rows, f // 4), scale_dtype, buffer=nl.sbuf)
        nisa.memset(dst=scale, value=1)  # 2**0 in e8m0 (byte 127), 1 in uint8
        nisa.quantize_mx(dst=data, src=src, dst_scale=scale)
        data_out = nl.ndarray((p, f // 4), packed, buffer=nl.shared_hbm)
        scale_out = nl.ndarray((rows, f // 4), scale_dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=data_out, src=data)
        nisa.dma_copy(dst=scale_out, src=scale)
        return data_out, scale_out

    return kernel


def _dense(scale_bytes, p):
    """Scale rows 0-3 of each quadrant, in group order."""
    rows = [32 * q + r for q in range(max(1, p // 32)) for r in range(min(p, 32) // 8)]
    return scale_bytes[rows]


def _edge_input(rng, p, f):
    """bf16 values covering the format edges: random magnitudes over many binades, a zero
    group, a group of bf16 subnormals, a group at the bf16 maximum, groups whose largest
    value sits just below a power of two (rounds up to 2**E_max), exact midpoints."""
    x = rng.standard_normal((p, f)) * np.exp2(rng.integers(-20, 20, (p, 1)))
    x[0:8, 0:4] = 0.0
    x[8:16, 0:4] = rng.integers(-127, 128, (8, 4)) * 2.0**-133  # bf16 subnormals
    x[16:24, 0:4] = np.float64(ml_dtypes.finfo(ml_dtypes.bfloat16).max) * rng.choice(
        [-1, 1], (8, 4)
    )
    x[24:32, 0:4] = 1.9960938  # bf16 just below 2: rounds up to 2**E_max in the element
    x[0:8, 4:8] = np.array([1.0, 1.0625, 1.1875, -1.0625])  # e4m3fn midpoints at scale 2**-7
    return x.astype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("packed", PACKED_FP8)
@pytest.mark.parametrize("scale_dtype", ["float8_e8m0fnu", "uint8"])
@pytest.mark.parametrize("shape", [(32, 64), (128, 256), (96, 8)])
def test_quantize_mx_matches_the_documented_scale_and_rounding(
    rng, target, packed, scale_dtype, shape
):
    target("trn3")
    x = _edge_input(rng, *shape)
    data, scale = _quantize_kernel(packed, getattr(nl, scale_dtype))(x)
    want_q, want_e = reference_quantize_mx(x.astype(np.float64), packed)
    got_q = core_dtypes.unpack_x4(data.view(np.uint32), packed)
    np.testing.assert_array_equal(got_q.view(np.uint8), want_q.view(np.uint8))
    got_e = _dense(scale.view(np.uint8), shape[0]).astype(np.int64) - 127
    np.testing.assert_array_equal(got_e, want_e)
    assert (got_e[0, 0], got_e[1, 0]) == (-127, -127)  # zero group, subnormal group: the floor
    unused = np.setdiff1d(
        np.arange(scale.shape[0]), [32 * q + r for q in range(4) for r in range(4)]
    )
    filler = 127 if scale_dtype == "float8_e8m0fnu" else 1  # the memset: rows not 0-3 of a
    assert (scale.view(np.uint8)[unused] == filler).all()  # quadrant are left as they are
    # dequantized: within half a step of the element type at the group's largest binade
    deq = got_q.astype(np.float64) * np.repeat(np.repeat(2.0**got_e, 8, 0), 4, 1)
    ulp = 2.0 ** (
        np.repeat(np.repeat(got_e, 8, 0), 4, 1) + EMAX[packed] - 1 - (3 if "e4m3" in packed else 2)
    )
    assert np.all(np.abs(deq - x.astype(np.float64)) <= ulp / 2)


@pytest.mark.parametrize("packed", PACKED_FP8)
def test_quantize_mx_makes_non_finite_groups_nan(target, packed):
    target("trn3")
    x = np.ones((32, 16), np.float32)
    x[0, 0] = np.inf
    x[9, 5] = np.nan
    x[17, 9] = -np.inf
    data, scale = _quantize_kernel(packed, nl.float8_e8m0fnu)(x.astype(ml_dtypes.bfloat16))
    scale_bytes = _dense(scale.view(np.uint8), 32)
    assert scale_bytes[0, 0] == scale_bytes[1, 1] == scale_bytes[2, 2] == 0xFF
    assert np.isnan(scale[0, 0].astype(np.float32))  # e8m0fnu's NaN
    values = core_dtypes.unpack_x4(data.view(np.uint32), packed).astype(np.float32)
    assert np.isnan(values[0:8, 0:4]).all() and np.isnan(values[8:16, 4:8]).all()
    ok = np.ones_like(values, bool)
    ok[0:8, 0:4] = ok[8:16, 4:8] = ok[16:24, 8:12] = False
    assert np.isfinite(values[ok]).all() and scale_bytes[3, 3] == 127 - (EMAX[packed] - 1)


def test_quantize_mx_rules(target):
    x = np.ones((32, 16), ml_dtypes.bfloat16)
    target("trn2")
    with pytest.raises(AssertionError, match="only on NeuronCore-v4"):
        _quantize_kernel("float8_e4m3fn_x4", nl.uint8)(x)
    target("trn3")
    with pytest.raises(NkiTypeError, match="src must be float16 or bfloat16"):
        _quantize_kernel("float8_e4m3fn_x4", nl.uint8, src_dtype=nl.float32)(x)
    with pytest.raises(NkiTypeError, match="float8_e4m3fn_x4 or float8_e5m2_x4"):
        _quantize_kernel("float4_e2m1fn_x4", nl.uint8)(x)
    with pytest.raises(AssertionError, match="multiple of 32"):
        _quantize_kernel("float8_e4m3fn_x4", nl.uint8)(np.ones((16, 16), ml_dtypes.bfloat16))
    with pytest.raises(AssertionError, match="needs 36"):
        _quantize_kernel("float8_e4m3fn_x4", nl.uint8, scale_rows=32)(
            np.ones((64, 16), ml_dtypes.bfloat16)
        )
    with pytest.raises(NkiTypeError, match="float8_e8m0fnu or uint8"):
        _quantize_kernel("float8_e4m3fn_x4", nl.int8)(x)


# --- nisa.nc_matmul_mx ------------------------------------------------------------------------
def _matmul_mx_kernel(st_packed, mv_packed, dst_dtype=nl.float32, tile=None):
    st_packed, mv_packed = (nki_dtypes.as_dtype(d) for d in (st_packed, mv_packed))
    tile_position, tile_size = tile if tile is not None else (None, None)

    @nki.jit
    def kernel(st, st_scale, mv, mv_scale):
        k, m = st.shape
        n = mv.shape[1]
        tiles = []
        for hbm, dtype in (
            (st, st_packed),
            (st_scale, nl.uint8),
            (mv, mv_packed),
            (mv_scale, nl.uint8),
        ):
            t = nl.ndarray(hbm.shape, dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=hbm)
            tiles.append(t)
        acc = nl.ndarray((m, n), dst_dtype, buffer=nl.psum)
        nisa.nc_matmul_mx(
            dst=acc,
            stationary=tiles[0],
            moving=tiles[2],
            stationary_scale=tiles[1],
            moving_scale=tiles[3],
            tile_position=tile_position,
            tile_size=tile_size,
        )
        res = nl.ndarray((m, n), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=res, src=acc)
        out = nl.ndarray((m, n), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=res)
        return out

    return kernel


def _random_mx(rng, k, m, packed):
    element = ELEMENT[packed]
    top = float(ml_dtypes.finfo(element).max)
    values = (rng.uniform(-top, top, (k, 4 * m))).astype(element)
    dense = rng.integers(120, 135, (k // 8, m)).astype(np.uint8)
    hw = np.zeros((k if k > 32 else k // 8, m), np.uint8)
    hw[[32 * q + r for q in range(max(1, k // 32)) for r in range(min(k, 32) // 8)]] = dense
    return core_dtypes.pack_x4(values, packed), hw, values, dense


@pytest.mark.parametrize(
    "st_packed,mv_packed",
    [
        ("float8_e4m3fn_x4", "float8_e4m3fn_x4"),
        ("float8_e5m2_x4", "float4_e2m1fn_x4"),
        ("float4_e2m1fn_x4", "float4_e2m1fn_x4"),
    ],
)
@pytest.mark.parametrize("k", [32, 128])
def test_nc_matmul_mx_dequantizes_and_contracts_over_partitions_and_quads(
    rng, target, st_packed, mv_packed, k
):
    target("trn3")
    m, n = 64, 96
    st, st_hw, st_values, st_scale = _random_mx(rng, k, m, st_packed)
    mv, mv_hw, mv_values, mv_scale = _random_mx(rng, k, n, mv_packed)
    got = _matmul_mx_kernel(st_packed, mv_packed)(st, st_hw, mv, mv_hw)
    a = st_values.astype(np.float64) * np.repeat(np.repeat(2.0 ** (st_scale - 127.0), 8, 0), 4, 1)
    b = mv_values.astype(np.float64) * np.repeat(np.repeat(2.0 ** (mv_scale - 127.0), 8, 0), 4, 1)
    want = np.zeros((m, n))
    for i in range(m):  # contraction: partitions k and the 4 values of element i / j
        want[i] = (a[:, 4 * i : 4 * i + 4, None] * b.reshape(k, n, 4).transpose(0, 2, 1)).sum(
            axis=(0, 1)
        )
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-30)


def test_nc_matmul_mx_rules(rng, target):
    st, st_hw, _, _ = _random_mx(rng, 32, 64, "float8_e4m3fn_x4")
    mv, mv_hw, _, _ = _random_mx(rng, 32, 32, "float8_e4m3fn_x4")
    target("trn2")
    with pytest.raises(AssertionError, match="only on NeuronCore-v4"):
        _matmul_mx_kernel("float8_e4m3fn_x4", "float8_e4m3fn_x4")(st, st_hw, mv, mv_hw)
    target("trn3")
    with pytest.raises(NkiTypeError, match="stationary must be float8_e5m2_x4"):
        _matmul_mx_kernel(nl.uint32, "float8_e4m3fn_x4")(st.view(np.uint32), st_hw, mv, mv_hw)
    with pytest.raises(NkiTypeError, match="dst must be float32 or bfloat16"):
        _matmul_mx_kernel("float8_e4m3fn_x4", "float8_e4m3fn_x4", dst_dtype=nl.float16)(
            st, st_hw, mv, mv_hw
        )
    with pytest.raises(AssertionError, match="row tiling only"):
        _matmul_mx_kernel("float8_e4m3fn_x4", "float8_e4m3fn_x4", tile=((0, 0), (32, 64)))(
            st, st_hw, mv, mv_hw
        )
    got = _matmul_mx_kernel("float8_e4m3fn_x4", "float8_e4m3fn_x4", tile=((32, 0), (32, 128)))(
        st, st_hw, mv, mv_hw
    )
    np.testing.assert_array_equal(
        got, _matmul_mx_kernel("float8_e4m3fn_x4", "float8_e4m3fn_x4")(st, st_hw, mv, mv_hw)
    )
    with pytest.raises(AssertionError, match="start_row a multiple"):
        _matmul_mx_kernel("float8_e4m3fn_x4", "float8_e4m3fn_x4", tile=((16, 0), (32, 128)))(
            st, st_hw, mv, mv_hw
        )


def test_mx_cost_entries_follow_the_trn3_architecture_guide():
    """quantize_mx: 4 source elements per partition per cycle (trainium3_arch.rst L172);
    nc_matmul_mx: the matmul rule over the moving x4 elements (L79)."""
    from simulate.perf.cost import CostTable, Operands, compute_cycles

    table = CostTable("trn3")
    ops = Operands(
        dtypes=("bfloat16", "float8_e4m3fn_x4"), psum=(False,), out_psum=False, stride_bytes=2
    )
    assert compute_cycles("quantize_mx", "dve", 2048, ops, {}, table) == (512, True)
    assert compute_cycles("quantize_mx", "dve", 64, ops, {}, table) == (64, True)  # MIN_II
    mm = Operands(
        dtypes=("float8_e4m3fn_x4",) * 3, psum=(False, False), out_psum=True, stride_bytes=4
    )
    assert compute_cycles("nc_matmul_mx", "pe", 512, mm, {"stationary_free": 128}, table) == (
        512,
        True,
    )
    assert compute_cycles("nc_matmul_mx", "pe", 16, mm, {"stationary_free": 128}, table) == (
        64,
        True,
    )


def test_the_legacy_front_end_has_no_packed_types():
    """The legacy dtype table (aws-neuron-sdk@8a38e733 general/nki/api/nki.api.shared.rst) has
    no x4 type: the legacy front-end neither names nor accepts them."""
    import simulate.language as legacy_nl
    from simulate.core.errors import NKITypeError

    for name in PACKED:
        assert not hasattr(legacy_nl, name)
        with pytest.raises(NKITypeError, match="not supported"):
            core_dtypes.as_dtype(getattr(core_dtypes, name))


def test_quantize_mx_of_float16_and_matmul_of_a_nan_scale(rng, target):
    """float16 sources quantize like bfloat16 ones (isa L2767); a NaN scale byte (0xFF, the
    e8m0 NaN, L56-57 of the language stubs) makes its group's products NaN in nc_matmul_mx
    (every value of the group is times NaN)."""
    target("trn3")
    x = (rng.standard_normal((64, 32)) * np.exp2(rng.integers(-14, 14, (64, 1)))).astype(np.float16)
    data, scale = _quantize_kernel("float8_e4m3fn_x4", nl.uint8, src_dtype=nl.float16)(x)
    want_q, want_e = reference_quantize_mx(x.astype(np.float64), "float8_e4m3fn_x4")
    got_q = core_dtypes.unpack_x4(data.view(np.uint32), "float8_e4m3fn_x4")
    np.testing.assert_array_equal(got_q.view(np.uint8), want_q.view(np.uint8))
    np.testing.assert_array_equal(_dense(scale.view(np.uint8), 64).astype(np.int64) - 127, want_e)

    st, st_hw, _, _ = _random_mx(rng, 32, 16, "float8_e4m3fn_x4")
    mv, mv_hw, _, _ = _random_mx(rng, 32, 8, "float8_e4m3fn_x4")
    mv_hw[1, 3] = 0xFF  # the group of partitions 8-15, column 3 of moving
    got = _matmul_mx_kernel("float8_e4m3fn_x4", "float8_e4m3fn_x4")(st, st_hw, mv, mv_hw)
    assert np.isnan(got[:, 3]).all() and np.isfinite(np.delete(got, 3, axis=1)).all()
