"""``nki.isa`` instructions in the simulator against NumPy."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from helpers import BF16, poison, random_array
from test_sim_language import UNARY

import simulate as nki
import simulate.isa as nisa
import simulate.language as nl

FLOATS = {
    "fp32": np.float32,
    "bf16": BF16,
    "fp16": np.float16,
    "fp8_e4m3": np.dtype(ml_dtypes.float8_e4m3),
}
RTOL = {"fp32": 2e-6, "bf16": 2**-8, "fp16": 2**-11, "fp8_e4m3": 2**-4}


def outputs_of(kernel, *args, target=None, with_trace=False):
    """Run a kernel that returns its results as on-chip tiles, stored for it (and the
    instruction trace when ``with_trace``)."""

    def wrapper(*inputs):
        tiles = kernel(*inputs)
        tiles = tiles if isinstance(tiles, tuple) else (tiles,)
        outs = []
        for tile in tiles:
            out = nl.ndarray(tile.shape, tile.dtype, buffer=nl.shared_hbm)
            nl.store(out, value=tile)
            outs.append(out)
        return tuple(outs)

    wrapper.__name__ = kernel.__name__
    result, trace = nki.trace_kernel(wrapper, *args, target=target)
    result = result if len(result) > 1 else result[0]
    return (result, trace) if with_trace else result


ACTIVATIONS = [n for n in UNARY if n not in ("negative", "cos", "floor", "ceil", "trunc")]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_activation_with_scale_and_bias(rng, name, dtype):
    reference, (low, high) = UNARY[name]
    x = random_array(rng, (128, 40), FLOATS[dtype], low / 2, high / 2)
    bias = random_array(rng, (128, 1), np.float32, 0, 0.1)
    scale = random_array(rng, (128, 1), np.float32, 1.0, 1.5)

    def kernel(x, bias, scale):
        t, b, s = nl.load(x), nl.load(bias), nl.load(scale)
        return (
            nisa.activation(op=getattr(nl, name), data=t, bias=b, scale=1.5),
            nisa.activation(op=getattr(nl, name), data=t, scale=s, dtype=nl.float32),
        )

    a, b = outputs_of(kernel, x, bias, scale, target="trn2")  # trn1 has no reciprocal + bias
    x32 = x.astype(np.float32)
    pre_a = (x32 * np.float32(1.5) + bias).astype(np.float64)
    pre_b = (x32 * scale).astype(np.float64)
    tol = RTOL[dtype] + 3e-6
    atol = tol if dtype != "fp8_e4m3" else 2.0**-9  # fp8 subnormal spacing
    assert a.dtype == np.dtype(FLOATS[dtype]) and b.dtype == np.float32
    np.testing.assert_allclose(a.astype(np.float64), reference(pre_a), rtol=tol, atol=atol)
    np.testing.assert_allclose(b, reference(pre_b), rtol=3e-6, atol=3e-6)


def test_activation_reduce_sums_fp32_values(rng):
    x = random_array(rng, (128, 300), BF16)

    def kernel(x):
        t = nl.load(x)
        sums = nl.ndarray((128, 1), nl.float32)
        squares = nisa.activation_reduce(
            op=nl.square, data=t, reduce_op=np.add, reduce_res=sums, scale=2.0
        )
        return squares, sums

    squares, sums = outputs_of(kernel, x)
    exact = np.square(2 * x.astype(np.float32))
    np.testing.assert_array_equal(squares, exact.astype(BF16))
    # the reduction sees the fp32 results, not the bf16 output
    np.testing.assert_allclose(sums[:, 0], exact.astype(np.float64).sum(axis=1), rtol=2e-6)


def test_activation_accumulator_commands(rng):
    x = random_array(rng, (64, 16), np.float32)
    y = random_array(rng, (64, 16), np.float32)

    def kernel(x, y):
        a, b = nl.load(x), nl.load(y)
        res = nl.zeros((64, 4), nl.float32)
        i_p = nl.arange(64)[:, None]
        nisa.activation(op=nl.copy, data=a, reduce_op=nl.add, reduce_res=res[:, 0])  # idle
        nisa.activation(
            op=nl.copy,
            data=b,
            reduce_op=nl.add,
            reduce_res=res[:, 1],
            reduce_cmd=nisa.reduce_cmd.reduce,
        )
        nisa.activation(
            op=nl.exp,
            data=a,
            reduce_op=nl.add,
            reduce_res=res[:, 2],
            reduce_cmd=nisa.reduce_cmd.reset,
        )
        nisa.activation(
            op=nl.copy,
            data=b,
            reduce_op=nl.add,
            reduce_res=res[:, 3],
            reduce_cmd=nisa.reduce_cmd.reduce,
            mask=i_p < 40,
        )
        return res

    res = outputs_of(kernel, x, y)
    np.testing.assert_allclose(res[:, 0], x.sum(axis=1), rtol=1e-5)
    np.testing.assert_allclose(res[:, 1], x.sum(axis=1) + y.sum(axis=1), rtol=1e-5, atol=1e-5)
    assert (res[:, 2] == 0).all()  # reset: the additive identity
    np.testing.assert_allclose(res[:40, 3], y[:40].sum(axis=1), rtol=1e-5, atol=1e-6)
    assert (res[40:, 3] == 0).all()  # masked-off partitions: not written


def test_activation_reduce_max_on_trn2_only(rng):
    x = random_array(rng, (32, 16), np.float32)

    def kernel(x):
        res = nl.ndarray((32, 1), nl.float32)
        nisa.activation_reduce(op=nl.abs, data=nl.load(x), reduce_op=np.max, reduce_res=res)
        return res

    np.testing.assert_array_equal(outputs_of(kernel, x, target="trn2")[:, 0], np.abs(x).max(axis=1))
    with pytest.raises(ValueError, match="err_unsupported_reduce_op"):
        outputs_of(kernel, x, target="trn1")


@pytest.mark.parametrize(
    "op, ref",
    [(np.add, np.sum), (nl.maximum, np.max), (nl.minimum, np.min), (nl.multiply, np.prod)],
)
@pytest.mark.parametrize("keepdims", [False, True])
def test_tensor_reduce(rng, op, ref, keepdims):
    x = random_array(rng, (96, 5, 12), np.float32, 0.8, 1.2)

    def kernel(x):
        t = nl.load(x)
        flat = t.reshape((96, 60))
        return (
            nisa.tensor_reduce(op, flat, axis=1, keepdims=keepdims),
            nisa.tensor_reduce(op, t, axis=[1, 2], negate=True, keepdims=keepdims),
        )

    last, both = outputs_of(kernel, x)
    np.testing.assert_allclose(last.reshape(96), ref(x.reshape(96, 60), axis=1), rtol=1e-5)
    np.testing.assert_allclose(both.reshape(96, 1), -ref(x, axis=(1, 2)).reshape(96, 1), rtol=1e-5)


def test_tensor_reduce_subtract_bitwise_and_mask(rng):
    x = random_array(rng, (32, 3, 8), np.float32)
    bits = random_array(rng, (32, 16), np.uint16, 0, 60000)

    def kernel(x, bits):
        t = nl.load(x)
        i_f = nl.arange(16)[None, :]
        return (
            nisa.tensor_reduce(np.subtract, t, axis=[1, 2]),
            nisa.tensor_reduce(nl.bitwise_or, nl.load(bits), axis=1),
            nisa.tensor_reduce(np.add, nl.load(bits), axis=1, mask=i_f < 5, dtype=nl.float32),
        )

    sub, ors, masked = outputs_of(kernel, x, bits)
    flat = x.reshape(32, -1).astype(np.float64)
    np.testing.assert_allclose(
        sub[:, 0], flat[:, 0] - flat[:, 1:].sum(axis=1), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_array_equal(ors[:, 0], np.bitwise_or.reduce(bits, axis=1))
    np.testing.assert_array_equal(masked[:, 0], bits[:, :5].sum(axis=1))


def test_tensor_scalar(rng):
    x = random_array(rng, (128, 32), BF16, 0.5, 4)
    col = random_array(rng, (128, 1), np.float32)
    ints = random_array(rng, (128, 32), np.int32, -1000, 1000)

    def kernel(x, col, ints):
        t, c = nl.load(x), nl.load(col)
        return (
            nisa.tensor_scalar(t, np.multiply, c, op1=np.add, operand1=2.0),
            nisa.tensor_scalar(
                t,
                np.subtract,
                c,
                reverse0=True,
                op1=np.divide,
                operand1=3.0,
                reverse1=True,
                dtype=nl.float32,
            ),
            nisa.tensor_scalar(t, nl.rsqrt, 0.0, dtype=nl.float32),  # unary: dummy operand
            nisa.tensor_scalar(nl.load(ints), nl.bitwise_and, 0xFF0, op1=nl.left_shift, operand1=2),
        )

    a, b, c, d = outputs_of(kernel, x, col, ints)
    x32 = x.astype(np.float32)
    np.testing.assert_array_equal(a, (x32 * col + np.float32(2)).astype(BF16))
    np.testing.assert_allclose(b, 3 / (col - x32), rtol=1e-6)
    np.testing.assert_allclose(c, 1 / np.sqrt(x32), rtol=1e-6)
    np.testing.assert_array_equal(d, (ints & 0xFF0) << 2)


@pytest.mark.parametrize(
    "op, ref",
    [
        (np.add, np.add),
        (np.subtract, np.subtract),
        (np.multiply, np.multiply),
        (np.maximum, np.maximum),
        (nl.power, np.power),
        (np.divide, np.divide),
    ],
)
def test_tensor_tensor(rng, op, ref):
    a = random_array(rng, (100, 40), np.float16, 0.5, 2)
    b = random_array(rng, (100, 40), BF16, 0.5, 2)

    def kernel(a, b):
        return nisa.tensor_tensor(nl.load(a), nl.load(b), op)

    out = outputs_of(kernel, a, b)
    assert out.dtype == np.float32  # fp16 with bf16 widens to fp32
    np.testing.assert_allclose(out, ref(a.astype(np.float32), b.astype(np.float32)), rtol=2e-6)


def test_tensor_tensor_integer_arithmetic_is_exact_on_gpsimd(rng):
    a = random_array(rng, (16, 8), np.int32, -(2**30), 2**30)
    b = random_array(rng, (16, 8), np.int32, -(2**30), 2**30)

    def kernel(a, b):
        return nisa.tensor_tensor(nl.load(a), nl.load(b), np.add)

    out, trace = outputs_of(kernel, a, b, with_trace=True)
    np.testing.assert_array_equal(out, np.clip(a.astype(np.int64) + b, -(2**31), 2**31 - 1))
    assert [i.engine for i in trace if i.opcode == "tensor_tensor"] == ["pool"]


def test_scalar_tensor_tensor_and_tensor_scalar_reduce(rng):
    x = random_array(rng, (64, 24), np.float32)
    y = random_array(rng, (64, 24), np.float32)
    col = random_array(rng, (64, 1), np.float32)

    def kernel(x, y, col):
        t, u, c = nl.load(x), nl.load(y), nl.load(col)
        stt = nisa.scalar_tensor_tensor(
            data=t, op0=np.multiply, operand0=c, op1=np.subtract, operand1=u, reverse1=True
        )
        res = nl.ndarray((64, 1), nl.float32)
        absmax = nisa.tensor_scalar_reduce(
            data=t, op0=nl.abs, operand0=0.0, reduce_op=nl.max, reduce_res=res
        )
        return stt, absmax, res

    stt, absmax, res = outputs_of(kernel, x, y, col)
    np.testing.assert_array_equal(stt, y - x * col)
    np.testing.assert_array_equal(absmax, np.abs(x))
    np.testing.assert_array_equal(res[:, 0], np.abs(x).max(axis=1))


def test_tensor_copy_reciprocal_affine_select_partition_reduce(rng):
    x = random_array(rng, (64, 64), np.float32, 0.5, 4)

    def kernel(x):
        t = nl.load(x)
        i_p = nl.arange(64)[:, None]
        i_f = nl.arange(64)[None, :]
        return (
            nisa.tensor_copy(t, dtype=nl.bfloat16, engine=nisa.scalar_engine),
            nisa.reciprocal(t),
            nisa.affine_select(i_p >= i_f, t, -9.0),
            nisa.tensor_partition_reduce(np.add, t),
        )

    copy, recip, select, partition_sum = outputs_of(kernel, x)
    np.testing.assert_array_equal(copy, x.astype(BF16))
    np.testing.assert_array_equal(recip, np.float32(1) / x)
    np.testing.assert_array_equal(select, np.where(np.tri(64, dtype=bool), x, np.float32(-9)))
    np.testing.assert_allclose(partition_sum[0], x.sum(axis=0), rtol=1e-5)


def test_tensor_tensor_scan(rng):
    a = random_array(rng, (8, 20), np.float32, 0.5, 1)
    b = random_array(rng, (8, 20), np.float32)

    def kernel(a, b):
        return nisa.tensor_tensor_scan(nl.load(a), nl.load(b), 1.0, np.multiply, np.add)

    out = outputs_of(kernel, a, b)
    expected = np.empty_like(a)
    prev = np.ones(8, np.float32)
    for i in range(20):
        prev = a[:, i] * prev + b[:, i]
        expected[:, i] = prev
    np.testing.assert_allclose(out, expected, rtol=1e-6)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp8_e4m3"])
def test_nc_matmul_accumulates_in_psum(rng, dtype):
    k_total, m, n = 384, 96, 200
    lhs_t = random_array(rng, (k_total, m), FLOATS[dtype])
    rhs = random_array(rng, (k_total, n), FLOATS[dtype])

    def kernel(lhs_t, rhs):
        acc = nl.zeros((m, n), nl.float32, buffer=nl.psum)
        i_k = nl.arange(128)[:, None]
        for k in nl.affine_range(k_total // 128):
            a = nl.load(lhs_t[k * 128 + i_k, nl.arange(m)[None, :]])
            b = nl.load(rhs[k * 128 + i_k, nl.arange(n)[None, :]])
            acc += nisa.nc_matmul(a, b)
        return acc

    out, trace = outputs_of(kernel, lhs_t, rhs, with_trace=True)
    expected = lhs_t.astype(np.float64).T @ rhs.astype(np.float64)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-4)
    matmuls = [i for i in trace if i.opcode == "nc_matmul"]
    assert len(matmuls) == 3 and all(i.details.get("accumulate") for i in matmuls)
    assert not any(i.engine == "dve" and i.details.get("accumulate") for i in trace)


def test_nc_matmul_operand_masks_and_transpose(rng):
    st = random_array(rng, (64, 32), BF16)
    mv = random_array(rng, (64, 100), BF16)
    square = random_array(rng, (32, 48), BF16)

    def kernel(st, mv, square):
        a, b = nl.load(st), nl.load(mv)
        i_f = nl.arange(100)[None, :]
        masked = nl.zeros((32, 100), nl.float32, buffer=nl.psum)
        masked[...] = nisa.nc_matmul(a, b[nl.arange(64)[:, None], i_f][i_f < 60])
        identity = nl.load(nl.shared_identity_matrix(32, dtype=nl.bfloat16))
        transposed = nisa.nc_matmul(nl.load(square), identity, is_transpose=True)
        return masked, transposed

    masked, transposed = outputs_of(kernel, st, mv, square, target="trn2")
    full = st.astype(np.float64).T @ mv.astype(np.float64)
    np.testing.assert_allclose(masked[:, :60], full[:, :60], rtol=1e-5, atol=1e-4)
    assert (masked[:, 60:] == 0).all()  # not computed: the PSUM tile keeps its zeros
    # NeuronCore-v3: exact; float32 like every legacy matmul result (legacy isa L876)
    assert transposed.dtype == np.float32
    np.testing.assert_array_equal(transposed, square.T)


def test_nc_transpose_on_both_engines(rng):
    x = random_array(rng, (100, 60), np.float32)
    small = random_array(rng, (32, 20), np.float32)

    def kernel(x, small):
        pe = nisa.nc_transpose(nl.load(x))
        dve = nisa.nc_transpose(nl.load(small), engine=nisa.vector_engine)
        assert pe.buffer == "psum" and dve.buffer == "sbuf"
        return pe, dve

    pe, dve = outputs_of(kernel, x, small)
    np.testing.assert_array_equal(pe, x.T)
    np.testing.assert_array_equal(dve, small.T)


def test_bn_stats_and_bn_aggr_with_a_masked_last_chunk(rng):
    hidden = 1300  # three 512-element chunks, the last one partial
    x = random_array(rng, (128, hidden), BF16)

    def kernel(x):
        t = nl.load(x)
        chunks = (hidden + 511) // 512
        stats = nl.ndarray((128, 6 * chunks), nl.float32)
        i_p = nl.arange(128)[:, None]
        i_f = nl.arange(512)[None, :]
        i_6 = nl.arange(6)[None, :]
        for j in nl.affine_range(chunks - 1):
            stats[i_p, j * 6 + i_6] = nisa.bn_stats(t[i_p, j * 512 + i_f], dtype=nl.float32)
        # bn_stats takes no mask on its reduce axis: the partial chunk is a narrower slice
        stats[:, 6 * (chunks - 1) : 6 * chunks] = nisa.bn_stats(
            t[:, 512 * (chunks - 1) : hidden], dtype=nl.float32
        )
        return stats, nisa.bn_aggr(stats)

    stats, mean_var = outputs_of(kernel, x)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(mean_var[:, 0], x64.mean(axis=1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mean_var[:, 1], x64.var(axis=1), rtol=1e-5)
    chunk = x64[:, 1024:]  # the partial chunk: 276 elements
    np.testing.assert_array_equal(stats[:, 12], 138)
    np.testing.assert_allclose(stats[:, 13], chunk[:, 0::2].mean(axis=1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats[:, 14], chunk[:, 0::2].var(axis=1) * 138, rtol=1e-5)


def test_memset_and_iota_masks():
    def kernel():
        m = nisa.memset((nl.par_dim(16), 8), 3.7, nl.int8)
        i_p = nl.arange(16)[:, None]
        partial = nisa.memset((16, 8), 1.5, nl.float32, mask=i_p < 10)
        return m, partial

    m, partial = outputs_of(kernel)
    assert m.shape == (16, 8) and m.dtype == np.int8 and (m == 4).all()
    assert (partial[:10] == 1.5).all() and np.isnan(partial[10:]).all()


def test_dma_copy_casts_accumulates_and_skips_out_of_range_rows(rng):
    x = random_array(rng, (64, 16), np.float32)
    idx = np.array([[3], [70], [5], [-1]], np.int32)

    def kernel(x, idx):
        cast = nl.ndarray((64, 16), nl.bfloat16, buffer=nl.shared_hbm)
        acc = nl.ndarray((64, 16), nl.float32, buffer=nl.shared_hbm)
        scattered = nl.ndarray((64, 16), nl.float32, buffer=nl.shared_hbm)
        tile = nl.ndarray((64, 16), nl.float32)
        nisa.dma_copy(dst=tile, src=x)
        nisa.dma_copy(dst=cast, src=tile)
        nisa.dma_copy(dst=acc, src=x)
        nisa.dma_copy(dst=acc, src=tile, dst_rmw_op=np.add)
        nl.store(scattered, value=0.0)
        rows = nl.load(idx)
        i_f = nl.arange(16)[None, :]
        nisa.dma_copy(dst=scattered[rows, i_f], src=tile[0:4, :], oob_mode=nisa.oob_mode.skip)
        return cast, acc, scattered

    out, trace = nki.trace_kernel(kernel, x, idx)
    cast, acc, scattered = out
    np.testing.assert_array_equal(cast, x.astype(BF16))
    np.testing.assert_array_equal(acc, 2 * x)
    expected = np.zeros_like(x)
    expected[3], expected[5] = x[0], x[2]
    np.testing.assert_array_equal(scattered, expected)
    dmas = [i for i in trace if i.opcode == "dma_copy"]
    assert [i.dma_direction for i in dmas] == [
        "hbm->sbuf",
        "sbuf->hbm",
        "hbm->hbm",
        "sbuf->hbm",
        "sbuf->hbm",
    ]
    assert dmas[1].dma_bytes == x.size * 2  # bytes at the HBM side's itemsize (bf16)
    assert dmas[-1].dma_bytes == 2 * 16 * 4  # the skipped rows move nothing


def test_dma_transpose_and_nc_version(rng):
    x = random_array(rng, (24, 40), np.float32)

    def kernel(x):
        assert nisa.get_nc_version() == nisa.nc_version.gen3
        return nisa.dma_transpose(x)

    np.testing.assert_array_equal(outputs_of(kernel, x, target="trn2"), x.T)

    def version(x):
        seen = nisa.get_nc_version()
        return nl.full((1, 1), int(seen), nl.int32)

    assert outputs_of(version, x, target="inf2")[0, 0] == 2
    assert outputs_of(version, x, target="trn3")[0, 0] == 4


def test_poisoned_output_is_fully_written(rng):
    x = random_array(rng, (8, 8), np.float32)
    out = poison((8, 8))

    def kernel(x, out):
        nl.store(out, value=nisa.activation(op=nl.exp, data=nl.load(x)))

    nki.simulate_kernel(kernel, x, out)
    np.testing.assert_allclose(out, np.exp(x), rtol=1e-6)


def test_in_place_updates_through_accesses_and_block_dims(rng):
    lhs_t = random_array(rng, (64, 32), np.float32)
    rhs = random_array(rng, (64, 48), np.float32)

    def kernel(lhs_t, rhs):
        a, b = nl.load(lhs_t), nl.load(rhs)
        i_p = nl.arange(32)[:, None]
        i_f = nl.arange(48)[None, :]
        banks = nl.zeros((2, nl.par_dim(32), 48), nl.float32, buffer=nl.psum)
        for _ in nl.affine_range(2):
            banks[1] += nisa.nc_matmul(a, b)
        acc = nl.zeros((32, 48), nl.float32)
        acc[i_p, i_f] += nisa.nc_matmul(a, b)
        acc[i_p, i_f] *= 3.0
        # an operand mask on a whole tile: only the first 16 columns of the stationary
        masked = nisa.nc_matmul(a[nl.arange(32)[None, :] < 16], b)
        return nl.copy(banks[1]), acc, masked

    twice, tripled, masked = outputs_of(kernel, lhs_t, rhs)
    product = lhs_t.astype(np.float64).T @ rhs
    np.testing.assert_allclose(twice, 2 * product, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(tripled, 3 * product, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(masked[:16], product[:16], rtol=1e-5, atol=1e-5)
    assert np.isnan(masked[16:]).all()  # rows from masked-off columns are not computed


def test_indirect_writes_in_affine_loops_are_not_flagged(rng):
    data = random_array(rng, (4, 8), np.float32)
    idx = np.array([[3], [1], [0], [2]], np.int32)

    def kernel(data, idx):
        out = nl.ndarray((4, 8), nl.float32, buffer=nl.shared_hbm)
        i_f = nl.arange(8)[None, :]
        for i in nl.affine_range(4):
            row = nl.load(idx[i : i + 1, :])
            nl.store(out[row, i_f], value=nl.load(data[i : i + 1, :]))
        return out

    out = nki.simulate_kernel(kernel, data, idx)
    np.testing.assert_array_equal(out[idx[:, 0]], data)


def test_loop_bounds_must_be_integers():
    def kernel(x):
        for _ in nl.affine_range(2.5):
            pass

    with pytest.raises(TypeError):
        nki.simulate_kernel(kernel, np.zeros((2, 2), np.float32))
