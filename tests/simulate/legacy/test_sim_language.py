"""``nki.language`` operations in the simulator against NumPy: elementwise math, reductions,
creation, data movement, broadcasting, matmul/transpose, operators, masks and ragged tiles."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from helpers import BF16, poison, random_array

import simulate as nki
import simulate.dtypes as sdt
import simulate.language as nl

ROWS, COLS = 200, 48  # two tiles, the second ragged (72 rows)
FLOATS = {
    "fp32": np.float32,
    "bf16": BF16,
    "fp16": np.float16,
    "fp8_e4m3": np.dtype(ml_dtypes.float8_e4m3),
    "fp8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
}
# relative rounding of one write in each dtype, plus the fp32 math error
RTOL = {"fp32": 2e-6, "bf16": 2**-8, "fp16": 2**-11, "fp8_e4m3": 2**-4, "fp8_e5m2": 2**-3}


def _erf(x):
    return np.vectorize(math.erf)(x)


def _gelu(x):
    return 0.5 * x * (1 + _erf(x / np.sqrt(2)))


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


UNARY = {  # name: (float64 reference, input range)
    "exp": (np.exp, (-4, 4)),
    "log": (np.log, (0.1, 8)),
    "sqrt": (np.sqrt, (0.1, 8)),
    "rsqrt": (lambda x: 1 / np.sqrt(x), (0.1, 8)),
    "reciprocal": (lambda x: 1 / x, (0.5, 8)),
    "square": (np.square, (-4, 4)),
    "abs": (np.abs, (-4, 4)),
    "negative": (np.negative, (-4, 4)),
    "sign": (np.sign, (-4, 4)),
    "tanh": (np.tanh, (-4, 4)),
    "sigmoid": (_sigmoid, (-6, 6)),
    "relu": (lambda x: np.maximum(x, 0), (-4, 4)),
    "gelu": (_gelu, (-4, 4)),
    "gelu_apprx_tanh": (
        lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))),
        (-4, 4),
    ),
    "gelu_apprx_sigmoid": (lambda x: x * _sigmoid(1.702 * x), (-4, 4)),
    "gelu_dx": (
        lambda x: 0.5 * (1 + _erf(x / np.sqrt(2))) + x * np.exp(-x * x / 2) / np.sqrt(2 * np.pi),
        (-4, 4),
    ),
    "silu": (lambda x: x * _sigmoid(x), (-4, 4)),
    "silu_dx": (lambda x: _sigmoid(x) * (1 + x * (1 - _sigmoid(x))), (-4, 4)),
    "erf": (_erf, (-3, 3)),
    "erf_dx": (lambda x: 2 / np.sqrt(np.pi) * np.exp(-x * x), (-3, 3)),
    "softplus": (lambda x: np.log1p(np.exp(x)), (-4, 4)),
    "mish": (lambda x: x * np.tanh(np.log1p(np.exp(x))), (-4, 4)),
    "sin": (np.sin, (-3, 3)),
    "cos": (np.cos, (-3, 3)),
    "arctan": (np.arctan, (-1.5, 1.5)),
    "floor": (np.floor, (-4, 4)),
    "ceil": (np.ceil, (-4, 4)),
    "trunc": (np.trunc, (-4, 4)),
}


def tiled(op, out_dtype, *inputs, row_mask=True):
    """Apply ``op`` tile by tile (128 rows, the last ragged, masked everywhere) and return the
    result, with the output poisoned first."""
    rows = inputs[0].shape[0]
    out = poison(inputs[0].shape[:1] + (1,) * 0 + inputs[0].shape[1:], out_dtype)

    def kernel(*args):
        *ins, dst = args
        i_p = nl.arange(128)[:, None]
        i_f = nl.arange(ins[0].shape[1])[None, :]
        for t in nl.affine_range(math.ceil(rows / 128)):
            r = t * 128 + i_p
            tiles = [nl.load(x[r, i_f], mask=r < rows) for x in ins]
            result = op(*tiles, mask=r < rows) if row_mask else op(*tiles)
            nl.store(dst[r, i_f], value=result, mask=r < rows)

    nki.simulate_kernel(kernel, *inputs, out)
    return out


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name", UNARY)
def test_unary_ops_against_numpy(rng, name, dtype):
    reference, (low, high) = UNARY[name]
    x = random_array(rng, (ROWS, COLS), FLOATS[dtype], low, high)
    op = getattr(nl, name)
    out = tiled(lambda t, mask: op(t, mask=mask), FLOATS[dtype], x)
    expected = reference(x.astype(np.float64))
    tol = RTOL[dtype] + (2e-6 if name.startswith(("erf", "gelu")) else 0)
    atol = tol if not dtype.startswith("fp8") else 2.0**-8  # fp8 subnormal spacing
    np.testing.assert_allclose(out.astype(np.float64), expected, rtol=tol, atol=atol)


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.uint8])
@pytest.mark.parametrize("name", ["abs", "negative", "square", "sign"])
def test_unary_ops_on_integers(rng, name, dtype):
    if np.dtype(dtype).kind == "u" and name in ("negative", "sign"):
        x = random_array(rng, (ROWS, COLS), dtype, 0, 9)
    else:
        x = random_array(rng, (ROWS, COLS), dtype, -9, 9)
    out = tiled(lambda t, mask: getattr(nl, name)(t, mask=mask), dtype, x)
    expected = UNARY[name][0](x.astype(np.float64))
    info = np.iinfo(dtype)
    np.testing.assert_array_equal(out, np.clip(expected, info.min, info.max).astype(dtype))


BINARY = {
    "add": np.add,
    "subtract": np.subtract,
    "multiply": np.multiply,
    "divide": np.divide,
    "maximum": np.maximum,
    "minimum": np.minimum,
    "power": np.power,
    "mod": np.mod,
    "fmod": np.fmod,
}


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name", BINARY)
def test_binary_ops_against_numpy(rng, name, dtype):
    positive = name in ("power", "divide", "mod", "fmod")
    low = 0.5 if positive else -4
    x = random_array(rng, (ROWS, COLS), FLOATS[dtype], low, 4)
    y = random_array(rng, (ROWS, COLS), FLOATS[dtype], low, 2 if name == "power" else 4)
    out = tiled(lambda a, b, mask: getattr(nl, name)(a, b, mask=mask), FLOATS[dtype], x, y)
    # fp32 math, then one rounding to the tile dtype
    expected = BINARY[name](x.astype(np.float32), y.astype(np.float32))
    np.testing.assert_array_equal(out, expected.astype(FLOATS[dtype]))


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.uint16])
@pytest.mark.parametrize("name", ["add", "subtract", "multiply", "maximum", "minimum"])
def test_integer_arithmetic_is_exact_and_saturates(rng, name, dtype):
    x = random_array(rng, (ROWS, COLS), dtype, -200, 200)
    y = random_array(rng, (ROWS, COLS), dtype, -200, 200)
    out = tiled(lambda a, b, mask: getattr(nl, name)(a, b, mask=mask), dtype, x, y)
    info = np.iinfo(dtype)
    expected = BINARY[name](x.astype(np.int64), y.astype(np.int64))
    np.testing.assert_array_equal(out, np.clip(expected, info.min, info.max).astype(dtype))


@pytest.mark.parametrize(
    "name, ref",
    [
        ("bitwise_and", np.bitwise_and),
        ("bitwise_or", np.bitwise_or),
        ("bitwise_xor", np.bitwise_xor),
        ("left_shift", np.left_shift),
        ("right_shift", np.right_shift),
    ],
)
def test_bitwise_ops(rng, name, ref):
    x = random_array(rng, (ROWS, COLS), np.uint16, 0, 60000)
    y = random_array(rng, (ROWS, COLS), np.uint16, 0, 7 if "shift" in name else 60000)
    out = tiled(lambda a, b, mask: getattr(nl, name)(a, b, mask=mask), np.uint16, x, y)
    np.testing.assert_array_equal(out, ref(x, y).astype(np.uint16))


@pytest.mark.parametrize(
    "name, ref",
    [
        ("equal", np.equal),
        ("not_equal", np.not_equal),
        ("greater", np.greater),
        ("less", np.less),
        ("greater_equal", np.greater_equal),
        ("less_equal", np.less_equal),
        ("logical_and", np.logical_and),
        ("logical_or", np.logical_or),
        ("logical_xor", np.logical_xor),
    ],
)
def test_comparisons_and_logic(rng, name, ref):
    x = random_array(rng, (ROWS, COLS), np.int16, -2, 2)
    y = random_array(rng, (ROWS, COLS), np.int16, -2, 2)
    out = tiled(lambda a, b, mask: getattr(nl, name)(a, b, mask=mask), np.bool_, x, y)
    np.testing.assert_array_equal(out, ref(x, y))


def test_invert_and_logical_not(rng):
    x = random_array(rng, (ROWS, COLS), np.int32, -1000, 1000)
    np.testing.assert_array_equal(tiled(lambda a, mask: nl.invert(a, mask=mask), np.int32, x), ~x)
    out = tiled(lambda a, mask: nl.logical_not(a, mask=mask, dtype=nl.uint8), np.uint8, x % 3)
    np.testing.assert_array_equal(out, (x % 3 == 0).astype(np.uint8))


def test_tile_with_column_scalar_and_row_operands(rng):
    """Partition-aligned broadcasting: a (P,) reduction result acts as (P, 1); nl.* also
    broadcasts a one-partition row across partitions."""
    x = random_array(rng, (128, 64), np.float32)
    w = random_array(rng, (64,), np.float32)

    def kernel(x, w):
        outs = [nl.ndarray((128, 64), nl.float32, buffer=nl.shared_hbm) for _ in range(4)]
        t = nl.load(x)
        total = nl.sum(t, axis=1)  # (128,) acts as (128, 1)
        row = nl.load(w.reshape((1, 64)))
        nl.store(outs[0], value=nl.multiply(t, total))
        nl.store(outs[1], value=nl.subtract(t, nl.max(t, axis=[1])))
        nl.store(outs[2], value=nl.add(t, row))  # (1, 64) with (128, 64)
        nl.store(outs[3], value=nl.divide(3.0, t))
        return tuple(outs)

    a, b, c, d = nki.simulate_kernel(kernel, x, w)
    x32 = x.astype(np.float32)
    np.testing.assert_allclose(a, x32 * x32.sum(axis=1, keepdims=True), rtol=1e-5)
    np.testing.assert_array_equal(b, x32 - x32.max(axis=1, keepdims=True))
    np.testing.assert_array_equal(c, x32 + w)
    np.testing.assert_array_equal(d, np.float32(3.0) / x32)


def test_python_operators(rng):
    x = random_array(rng, (64, 32), BF16)
    y = random_array(rng, (64, 32), BF16, 0.5, 4)

    def kernel(x, y):
        outs = [nl.ndarray((64, 32), nl.float32, buffer=nl.shared_hbm) for _ in range(3)]
        a, b = nl.load(x), nl.load(y)
        acc = nl.zeros((64, 32), nl.float32)
        acc[...] = a + b * a - b / 2  # operators, then an assignment that casts to fp32
        acc += a
        acc -= 1.0
        acc *= 2.0
        acc /= b
        nl.store(outs[0], value=acc)
        nl.store(outs[1], value=-a)
        part = nl.zeros((64, 32), nl.float32)
        part[:, 0:16] = a[:, 16:32]
        part[:, 16:32] = 7.0
        nl.store(outs[2], value=part)
        return tuple(outs)

    acc, neg, part = nki.simulate_kernel(kernel, x, y)
    a, b = x.astype(np.float32), y.astype(np.float32)
    bf = lambda v: v.astype(BF16).astype(np.float32)  # noqa: E731 - one rounding per op
    # the last subtraction writes straight into the fp32 tile it is assigned to
    expected = bf(a + bf(b * a)) - bf(b / np.float32(2))
    expected = (((expected + a) - 1) * 2) / b
    np.testing.assert_allclose(acc, expected, rtol=1e-6)
    np.testing.assert_array_equal(neg, -a)
    np.testing.assert_array_equal(part[:, :16], a[:, 16:])
    assert (part[:, 16:] == 7).all()


REDUCTIONS = {
    "sum": np.sum,
    "mean": np.mean,
    "max": np.max,
    "min": np.min,
    "prod": np.prod,
    "var": np.var,
}


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("name", REDUCTIONS)
def test_reductions(rng, name, keepdims, dtype):
    low, high = (0.7, 1.3) if name == "prod" else (-4, 4)
    x = random_array(rng, (ROWS, COLS), FLOATS[dtype], low, high)
    out = tiled(
        lambda t, mask: getattr(nl, name)(
            t, axis=[1], mask=mask, keepdims=keepdims, dtype=nl.float32
        ),
        np.float32,
        x,
    )
    out = out[:, :1] if out.shape[1] != 1 else out
    expected = REDUCTIONS[name](x.astype(np.float64), axis=1, keepdims=True)
    np.testing.assert_allclose(out, expected, rtol=2e-5, atol=1e-5)


def test_reduction_shapes_axes_and_dtypes(rng):
    x = random_array(rng, (16, 4, 6), np.float32)
    ints = random_array(rng, (16, 6), np.int16, -50, 50)

    def kernel(x, ints):
        t = nl.load(x)
        a = nl.sum(t, axis=2)
        b = nl.max(t, axis=[1, 2], keepdims=True)
        c = nl.mean(nl.load(ints), axis=1)
        d = nl.sum(t, axis=(1, 2))
        assert a.shape == (16, 4) and b.shape == (16, 1, 1) and c.shape == (16, 1)
        assert d.shape == (16, 1) and c.dtype == nl.float32
        outs = []
        for r in (a, b, c, d):
            o = nl.ndarray(r.shape, r.dtype, buffer=nl.shared_hbm)
            nl.store(o, value=r)
            outs.append(o)
        return tuple(outs)

    a, b, c, d = nki.simulate_kernel(kernel, x, ints)
    np.testing.assert_allclose(a, x.sum(axis=2), rtol=1e-6)
    np.testing.assert_array_equal(b, x.max(axis=(1, 2), keepdims=True))
    np.testing.assert_allclose(c[:, 0], ints.mean(axis=1), rtol=1e-6)
    np.testing.assert_allclose(d[:, 0], x.sum(axis=(1, 2)), rtol=1e-5)


def test_masked_reduction_ignores_masked_off_elements(rng):
    x = random_array(rng, (128, 40), np.float32)

    def kernel(x):
        out = nl.ndarray((128, 3), nl.float32, buffer=nl.shared_hbm)
        i_p = nl.arange(128)[:, None]
        i_f = nl.arange(40)[None, :]
        t = nl.load(x)
        res = nl.zeros((128, 3), nl.float32)
        res[:, 0] = nl.sum(t, axis=1, mask=(i_f < 25) & (i_p < 100))
        res[:, 1] = nl.mean(t, axis=1, mask=i_f < 25)
        res[:, 2] = nl.max(t, axis=1, mask=i_f >= 30)
        nl.store(out, value=res)
        return out

    out = nki.simulate_kernel(kernel, x)
    np.testing.assert_allclose(out[:100, 0], x[:100, :25].sum(axis=1), rtol=1e-5)
    assert (out[100:, 0] == 0).all()  # not computed: the assigned tile keeps its zeros
    np.testing.assert_allclose(out[:, 1], x[:, :25].mean(axis=1), rtol=1e-5)
    np.testing.assert_array_equal(out[:, 2], x[:, 30:].max(axis=1))


def test_creation_ops(rng):
    x = random_array(rng, (32, 8), BF16)
    const = random_array(rng, (32, 8), np.float32)

    def kernel(x):
        outs = []
        tiles = [
            nl.zeros((32, 8), nl.float32),
            nl.ones((32, 8), nl.int8),
            nl.full((32, 8), 2.5, nl.bfloat16),
            nl.zeros_like(nl.load(x)),
            nl.full_like(nl.load(x), -1.0),
            nl.load(nl.shared_constant(const)),
            nl.load(nl.shared_identity_matrix(32)),
        ]
        empty = nl.empty_like(x, buffer=nl.sbuf)
        assert empty.shape == x.shape and empty.dtype == x.dtype and empty.buffer == "sbuf"
        for tile in tiles:
            out = nl.ndarray(tile.shape, tile.dtype, buffer=nl.shared_hbm)
            nl.store(out, value=tile)
            outs.append(out)
        return tuple(outs)

    zeros, ones, full, zl, fl, c, eye = nki.simulate_kernel(kernel, x)
    assert zeros.dtype == np.float32 and (zeros == 0).all()
    assert ones.dtype == np.int8 and (ones == 1).all()
    assert full.dtype == BF16 and (full.astype(np.float32) == 2.5).all()
    assert zl.dtype == BF16 and (zl.astype(np.float32) == 0).all()
    assert (fl.astype(np.float32) == -1).all()
    np.testing.assert_array_equal(c, const)
    np.testing.assert_array_equal(eye, np.eye(32, dtype=np.uint8))


def test_copy_static_cast_and_astype(rng):
    x = random_array(rng, (100, 16), np.float32)
    out = tiled(lambda t, mask: nl.copy(t, mask=mask, dtype=nl.bfloat16), BF16, x)
    np.testing.assert_array_equal(out, x.astype(BF16))
    out = tiled(lambda t: nl.static_cast(t, nl.float16), np.float16, x, row_mask=False)
    np.testing.assert_array_equal(out, x.astype(np.float16))
    out = tiled(lambda t: t.astype(nl.int32), np.int32, x * 10, row_mask=False)
    np.testing.assert_array_equal(out, np.rint(x * 10).astype(np.int32))


def test_broadcast_to_and_expand_dims(rng):
    row = random_array(rng, (1, 24), np.float32)
    col = random_array(rng, (64, 1), np.float32)

    def kernel(row, col):
        a = nl.ndarray((64, 24), nl.float32, buffer=nl.shared_hbm)
        b = nl.ndarray((64, 24), nl.float32, buffer=nl.shared_hbm)
        c = nl.ndarray((64, 1, 1), nl.float32, buffer=nl.shared_hbm)
        r = nl.load(row)
        nl.store(a, value=r.broadcast_to((64, 24)))
        nl.store(b, value=nl.broadcast_to(nl.load(col), shape=(64, 24)))
        same = nl.load(col)
        assert nl.broadcast_to(same, shape=(64, 1)) is same
        nl.store(c, value=nl.expand_dims(same, 2))
        return a, b, c

    a, b, c = nki.simulate_kernel(kernel, row, col)
    np.testing.assert_array_equal(a, np.broadcast_to(row, (64, 24)))
    np.testing.assert_array_equal(b, np.broadcast_to(col, (64, 24)))
    np.testing.assert_array_equal(c[:, :, 0], col)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_transpose_and_matmul(rng, dtype):
    x = random_array(rng, (96, 64), FLOATS[dtype])
    y = random_array(rng, (64, 200), FLOATS[dtype])
    xt = np.ascontiguousarray(x.T)

    def kernel(x, xt, y):
        t_out = nl.ndarray((64, 96), x.dtype, buffer=nl.shared_hbm)
        m_out = nl.ndarray((96, 200), nl.float32, buffer=nl.shared_hbm)
        m2_out = nl.ndarray((96, 200), nl.float32, buffer=nl.shared_hbm)
        tx = nl.transpose(nl.load(x))
        assert tx.buffer == "psum" and tx.shape == (64, 96)
        nl.store(t_out, value=tx)
        prod = nl.matmul(nl.load(x), nl.load(y))
        assert prod.buffer == "psum" and prod.dtype == nl.float32
        nl.store(m_out, value=prod)
        nl.store(m2_out, value=nl.matmul(nl.load(xt), nl.load(y), transpose_x=True))
        return t_out, m_out, m2_out

    t_out, m_out, m2_out = nki.simulate_kernel(kernel, x, xt, y)
    np.testing.assert_array_equal(t_out, x.T)
    expected = x.astype(np.float64) @ y.astype(np.float64)
    np.testing.assert_allclose(m_out, expected, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(m2_out, expected, rtol=1e-5, atol=1e-4)


def test_where_softmax_and_gather_flattened(rng):
    x = random_array(rng, (32, 16), np.float32)
    idx = rng.integers(0, 16, size=(32, 5)).astype(np.uint32)

    def kernel(x, idx):
        outs = [nl.ndarray((32, 16), nl.float32, buffer=nl.shared_hbm) for _ in range(2)]
        g = nl.ndarray((32, 5), nl.float32, buffer=nl.shared_hbm)
        t = nl.load(x)
        nl.store(outs[0], value=nl.where(nl.greater(t, 0.0), t, 0.5))
        nl.store(outs[1], value=nl.softmax(t, axis=1))
        nl.store(g, value=nl.gather_flattened(t, nl.load(idx)))
        return outs[0], outs[1], g

    w, s, g = nki.simulate_kernel(kernel, x, idx)
    np.testing.assert_array_equal(w, np.where(x > 0, x, np.float32(0.5)))
    e = np.exp(x - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(s, e / e.sum(axis=1, keepdims=True), rtol=1e-6)
    np.testing.assert_array_equal(g, np.take_along_axis(x, idx.astype(np.int64), axis=1))


def test_device_print(rng, capsys):
    x = random_array(rng, (2, 3), np.float32)

    def kernel(x, out):
        t = nl.load(x)
        nl.device_print("tile:", t)
        nl.store(out, value=t)

    out = poison((2, 3))
    nki.simulate_kernel(kernel, x, out)
    printed = capsys.readouterr().out
    assert printed.startswith("tile:") and f"{x[1, 2]:.4f}"[:5] in printed


def test_load_store_dtype_and_scalar_store(rng):
    x = random_array(rng, (64,), np.float32)

    def kernel(x, col_out, scalar_out):
        col = nl.load(x, dtype=nl.bfloat16)  # a 1-D source loads as (n, 1)
        assert col.shape == (64, 1) and col.dtype == nl.bfloat16
        nl.store(col_out, value=col)
        nl.store(scalar_out[1:3, :], value=5)

    col_out, scalar_out = poison((64,)), poison((4, 2), np.int32)
    nki.simulate_kernel(kernel, x, col_out, scalar_out)
    np.testing.assert_array_equal(col_out, x.astype(BF16).astype(np.float32))
    np.testing.assert_array_equal(scalar_out[1:3], 5)
    assert (scalar_out[[0, 3]] == np.iinfo(np.int32).max).all()
    assert sdt.name(nl.bfloat16) == "bfloat16"
