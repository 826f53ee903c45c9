"""AWS's nki-library kernels, unmodified, on the NKI 0.6 simulator against float64 NumPy
references written here from each kernel's docstring (aws-neuron/nki-library@d2ad3a5). The
checkout comes from ``NKI_LIBRARY_PATH`` (:mod:`nkilib_corpus`); without it every test
here skips. AWS's norm kernels (rmsnorm_tkg, layernorm_tkg, rmsnorm_quant) are driven by
``test_nki06_aws_library.py``; this file covers the rest of the single-NeuronCore corpus."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from helpers import poison
from nkilib_corpus import import_library, library_module, requires_library

import simulate.nki06 as nki

pytestmark = requires_library

BF16 = np.dtype(ml_dtypes.bfloat16)
#: fp32 kernels agree with float64 to a few fp32 ulps of the summed magnitudes; bf16 inputs
#: and outputs carry 8 significant bits (half an ulp: 2^-9 relative) per rounding
TOLERANCE = {np.dtype(np.float32): (2e-5, 2e-5), BF16: (2e-2, 2e-2)}


@pytest.fixture(scope="module", autouse=True)
def _library():
    import_library()


@pytest.fixture(autouse=True)
def _trn2(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)


def _launch(kernel, lnc, *args, **kwargs):
    return (kernel[lnc] if lnc == 2 else kernel)(*args, **kwargs)


def _random(rng, shape, dtype):
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def _check(actual, expected, dtype, scale=1.0):
    rtol, atol = TOLERANCE[np.dtype(dtype)]
    actual = np.asarray(actual)
    assert actual.shape == expected.shape
    assert actual.dtype == np.dtype(dtype)
    actual = actual.astype(np.float64)
    assert np.isfinite(actual).all(), "the kernel left elements unwritten (NaN poison) or inf"
    error = np.abs(actual - expected)
    bound = atol * np.asarray(scale) + rtol * np.abs(expected)
    worst = np.unravel_index(np.argmax(error - bound), error.shape)
    assert (error <= bound).all(), (
        f"{int((error > bound).sum())} of {error.size} off; worst at {worst}: "
        f"{actual[worst]} vs {expected[worst]}"
    )


# --- cumsum (core/cumsum/cumsum.py) ------------------------------------------------------------
@pytest.mark.parametrize(
    "shape, dtype, axis",
    [
        ((4, 300), np.float32, -1),
        ((130, 64), np.float32, 1),  # two partition tiles, axis given as the last index
        ((2, 3, 700), np.float32, -1),  # 3-D: [B, S, H]
        ((8, 1100), np.float32, -1),  # free tiles carried across
        ((16, 96), BF16, -1),
    ],
)
def test_cumsum(rng, shape, dtype, axis):
    """Docstring: the cumulative sum along the last dimension, same shape and dtype, fp32
    accumulation ("~1e-2 absolute error" for H > 5K)."""
    cumsum = library_module("core.cumsum.cumsum").cumsum
    x = _random(rng, shape, dtype)
    expected = np.cumsum(x.astype(np.float64), axis=-1)
    # fp32 partial sums: error grows with the running sum of magnitudes
    scale = np.cumsum(np.abs(x.astype(np.float64)), axis=-1)
    _check(cumsum(x, axis=axis), expected, dtype, scale=scale)


# --- RoPE (core/embeddings/rope.py) ------------------------------------------------------------
def _rope_reference(x, cos, sin, contiguous):
    """Docstring: x [d_head, B, n_heads, S], cos/sin [d_head/2, B, S]; each pair (first,
    second) is rotated by the angle whose cos/sin it is given: first·cos − second·sin,
    second·cos + first·sin. The pair is (i, i + d/2) in the contiguous layout and
    (2i, 2i + 1) in the interleaved one."""
    x = x.astype(np.float64)
    c = cos.astype(np.float64)[:, :, None, :]
    s = sin.astype(np.float64)[:, :, None, :]
    half = x.shape[0] // 2
    first, second = (x[:half], x[half:]) if contiguous else (x[0::2], x[1::2])
    out_first, out_second = first * c - second * s, second * c + first * s
    if contiguous:
        return np.concatenate([out_first, out_second])
    out = np.empty_like(x)
    out[0::2], out[1::2] = out_first, out_second
    return out


@pytest.mark.parametrize(
    "lnc, d_head, batch, heads, seq, contiguous, relayout, dtype",
    [
        (1, 64, 1, 2, 128, True, False, np.float32),
        (1, 128, 2, 1, 64, True, False, BF16),
        (1, 64, 1, 2, 32, False, False, np.float32),  # interleaved, strided DMA relayout
        (1, 64, 1, 2, 32, False, True, np.float32),  # interleaved, SBUF matmul relayout
        (2, 64, 1, 2, 128, True, False, np.float32),  # lnc_shard: S split across the cores
    ],
)
def test_rope(rng, lnc, d_head, batch, heads, seq, contiguous, relayout, dtype):
    rope = library_module("core.embeddings.rope").RoPE
    x = _random(rng, (d_head, batch, heads, seq), dtype)
    angle = rng.uniform(-math.pi, math.pi, (d_head // 2, batch, seq))
    cos, sin = np.cos(angle).astype(dtype), np.sin(angle).astype(dtype)
    out = _launch(
        rope,
        lnc,
        x,
        cos,
        sin,
        lnc_shard=lnc == 2,
        contiguous_layout=contiguous,
        relayout_in_sbuf=relayout,
    )
    _check(out, _rope_reference(x, cos, sin, contiguous), dtype, scale=2.0)


# --- rope_hf (core/embeddings/rope_hf.py) ------------------------------------------------------
def _rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _rope_hf_reference(x, cos, sin, backward):
    """Docstring: forward y = x·cos + rotate_half(x)·sin with rotate_half([x1, x2]) = [−x2, x1]
    (HuggingFace); backward is the gradient with respect to the input, the transposed map:
    dx = dy·cos + rotate_halfᵀ(dy·sin), rotate_halfᵀ([a1, a2]) = [a2, −a1]."""
    x = x.astype(np.float64)
    if not backward:
        return x * cos + _rotate_half(x) * sin
    a = x * sin
    half = x.shape[-1] // 2
    return x * cos + np.concatenate([a[..., half:], -a[..., :half]], axis=-1)


@pytest.mark.parametrize(
    "lnc, batch, q_heads, k_heads, seq, head_dim, table, backward, dtype",
    [
        (1, 1, 2, 1, 128, 64, "cos_sin", False, np.float32),
        (1, 2, 2, 2, 128, 64, "cos_sin_batched", False, np.float32),
        (1, 1, 1, 1, 256, 128, "cache", False, BF16),
        (1, 1, 2, 1, 128, 64, "cos_sin", True, np.float32),
        (2, 1, 2, 1, 256, 64, "cache_longer", False, np.float32),
    ],
)
def test_rope_hf(rng, lnc, batch, q_heads, k_heads, seq, head_dim, table, backward, dtype):
    rope_hf = library_module("core.embeddings.rope_hf").rope_hf
    q = _random(rng, (batch, q_heads, seq, head_dim), dtype)
    k = _random(rng, (batch, k_heads, seq, head_dim), dtype)
    table_seq = seq + 64 if table == "cache_longer" else seq
    lead = (batch,) if table == "cos_sin_batched" else ()
    angle = rng.uniform(-math.pi, math.pi, lead + (table_seq, head_dim // 2))
    angle = np.concatenate([angle, angle], axis=-1)  # HF tables repeat the half
    cos, sin = np.cos(angle).astype(dtype), np.sin(angle).astype(dtype)
    q_out, k_out = poison(q.shape, dtype), poison(k.shape, dtype)
    if table.startswith("cache"):
        tables = {"rope_cache": np.concatenate([cos, sin], axis=-1)}
    else:
        tables = {"cos": cos, "sin": sin}
    _launch(rope_hf, lnc, q, k, q_out, k_out, backward=backward, **tables)
    c = cos.astype(np.float64)[..., :seq, :]
    s = sin.astype(np.float64)[..., :seq, :]
    c, s = (c[:, None], s[:, None]) if lead else (c, s)
    _check(q_out, _rope_hf_reference(q, c, s, backward), dtype, scale=2.0)
    _check(k_out, _rope_hf_reference(k, c, s, backward), dtype, scale=2.0)


# --- conv1d (experimental/conv/conv1d.py) ------------------------------------------------------
def _silu(x):
    return x / (1.0 + np.exp(-x))


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _conv1d_reference(x, filters, bias, stride, padding, dilation, activation):
    """Docstring: x [B, C_in, L], filters [K, C_in, C_out], bias [C_out] →
    [B, C_out, L_out], L_out = (L + pad_l + pad_r − dilation·(K − 1) − 1) // stride + 1."""
    x = np.pad(x.astype(np.float64), ((0, 0), (0, 0), padding))
    taps, _, _ = filters.shape
    l_out = (x.shape[-1] - dilation * (taps - 1) - 1) // stride + 1
    y = 0.0
    for tap in range(taps):
        start = tap * dilation
        window = x[:, :, start : start + stride * (l_out - 1) + 1 : stride]
        y = y + np.einsum("bcl,co->bol", window, filters[tap].astype(np.float64))
    if bias is not None:
        y = y + bias.astype(np.float64)[None, :, None]
    return {None: lambda v: v, "SiLU": _silu, "GELU_Tanh_Approx": _gelu_tanh}[activation](y)


@pytest.mark.parametrize(
    "lnc, batch, c_in, c_out, length, taps, stride, padding, dilation, bias, activation",
    [
        (1, 1, 16, 8, 40, 3, 1, (0, 0), 1, False, None),
        (1, 2, 32, 24, 50, 5, 2, (2, 2), 1, True, None),
        (1, 1, 16, 16, 64, 3, 1, (1, 3), 2, True, "SiLU"),
        (1, 1, 200, 136, 30, 2, 1, (0, 0), 1, False, "GELU_Tanh_Approx"),  # C tiles > 128
        (2, 1, 16, 256, 24, 3, 1, (1, 1), 1, True, None),  # lnc_shard on C_out
    ],
)
def test_conv1d(
    rng, lnc, batch, c_in, c_out, length, taps, stride, padding, dilation, bias, activation
):
    conv1d = library_module("experimental.conv.conv1d").conv1d
    act_type = library_module("core.utils.common_types").ActFnType
    x = _random(rng, (batch, c_in, length), np.float32)
    filters = _random(rng, (taps, c_in, c_out), np.float32) / math.sqrt(taps * c_in)
    b = _random(rng, (c_out,), np.float32) if bias else None
    out = _launch(
        conv1d,
        lnc,
        x,
        filters,
        b,
        stride=stride,
        padding=padding,
        dilation=dilation,
        activation_fn=getattr(act_type, activation) if activation else None,
        lnc_shard=lnc == 2,
    )
    expected = _conv1d_reference(x, filters, b, stride, padding, dilation, activation)
    _check(out, expected, np.float32, scale=4.0)


# --- depthwise_conv1d (experimental/conv/depthwise_conv1d.py) ----------------------------------
@pytest.mark.parametrize(
    "batch, channels, width, taps, stride, padding",
    [
        (1, 4, 40, 3, 1, (0, 0)),
        (2, 8, 64, 5, 2, (2, 2)),
        (1, 2, 300, 130, 1, (1, 0)),  # kernel size above 128: S tiles accumulated
        (1, 260, 24, 4, 3, (0, 1)),  # channel tiles above 128 per core
    ],
)
def test_depthwise_conv1d(rng, batch, channels, width, taps, stride, padding):
    """Docstring: img [N, C, 1, W], filter [C, 1, 1, S], zero padding ((0, 0), (l, r)),
    stride (1, s), feature_group_count = C → [N, C, 1, Q], Q = (W + l + r − S) // s + 1;
    LNC=2 shards the channels."""
    depthwise = library_module("experimental.conv.depthwise_conv1d")
    kernel = depthwise.depthwise_conv1d_implicit_gemm
    img = _random(rng, (batch, channels, 1, width), np.float32)
    filt = _random(rng, (channels, 1, 1, taps), np.float32) / math.sqrt(taps)
    out = kernel[2](
        img, filt, padding=((0, 0), padding), stride=(1, stride), feature_group_count=channels
    )
    x = np.pad(img.astype(np.float64)[:, :, 0], ((0, 0), (0, 0), padding))
    q = (x.shape[-1] - taps) // stride + 1
    expected = sum(
        x[:, :, s : s + stride * (q - 1) + 1 : stride] * filt[None, :, 0, 0, s, None]
        for s in range(taps)
    )[:, :, None, :]
    _check(out, expected, np.float32, scale=2.0)


# --- dynamic_elementwise_add (experimental/dynamic_shapes/dynamic_elementwise_add.py) -----------
@pytest.mark.parametrize("rows, hidden, tiles", [(256, 512, 2), (384, 1024, 1), (128, 512, 0)])
def test_dynamic_elementwise_add(rng, rows, hidden, tiles):
    """Docstring: bf16 [M, H] inputs, the first num_m_tiles·128 rows hold a + b (the rest of
    the fresh output is not defined)."""
    add = library_module("experimental.dynamic_shapes.dynamic_elementwise_add")
    a, b = _random(rng, (rows, hidden), BF16), _random(rng, (rows, hidden), BF16)
    out = np.asarray(add.dynamic_elementwise_add(a, b, np.array([[tiles]], np.int32)))
    assert out.shape == (rows, hidden) and out.dtype == BF16
    done = tiles * 128
    expected = a[:done].astype(np.float64) + b[:done].astype(np.float64)
    if done:
        _check(out[:done], expected, BF16, scale=4.0)


# --- tp_broadcast (core/utils/tp_broadcast.py) -------------------------------------------------
def _broadcast_column_kernel(partitions, free, copies, column):
    """A kernel around AWS's SBUF-to-SBUF helper: HBM [P, F] in, HBM [B, P] out."""
    tp_broadcast = library_module("core.utils.tp_broadcast").tp_broadcast
    nl, nisa = nki.language, nki.isa

    def broadcast_column(src):
        src_sb = nl.ndarray((partitions, free), dtype=src.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=src_sb, src=src)
        dst_sb = nl.ndarray((copies, partitions), dtype=src.dtype, buffer=nl.sbuf)
        tp_broadcast(src_sb, dst_sb, column)
        out = nl.ndarray((copies, partitions), dtype=src.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=dst_sb)
        return out

    return nki.jit(broadcast_column)


@pytest.mark.parametrize(
    "partitions, free, copies, column", [(128, 4, 128, 2), (64, 3, 32, 0), (16, 8, 100, 7)]
)
def test_tp_broadcast(rng, partitions, free, copies, column):
    """Docstring: src [P, F] in SBUF → dst [B, P] in SBUF, every row of dst = src[:, col]."""
    src = _random(rng, (partitions, free), np.float32)
    out = _broadcast_column_kernel(partitions, free, copies, column)(src)
    expected = np.broadcast_to(src[:, column].astype(np.float64), (copies, partitions))
    _check(out, expected, np.float32)


def test_tp_broadcast_of_bf16_is_rejected(rng):
    """The helper transposes into an fp32 PSUM tile whatever the source dtype; nc_transpose's
    output "must have the same data type as that of data" (aws-neuron-sdk@81ce03ae
    nki/api/nki/isa/__init__.py L849-850), and AWS's one caller passes fp32 (attention_tkg.py
    L2308): a bf16 source is illegal by both."""
    src = _random(rng, (64, 3), BF16)
    with pytest.raises(TypeError, match="nc_transpose dst dtype float32 must equal"):
        _broadcast_column_kernel(64, 3, 32, 0)(src)


# --- cascaded_max (core/max/cascaded_max.py) ---------------------------------------------------
@pytest.mark.parametrize(
    "lnc, shape",
    [(1, (1, 1, 4096)), (1, (1, 1, 1000)), (2, (2, 4, 2048)), (2, (6, 3000))],
)
def test_cascaded_max(rng, lnc, shape):
    """Docstring: [B, S, V] or [B·S, V] → the maximum over V and its index, each [B, S, 1]
    (or [B·S, 1]); LNC=2 for B·S > 1."""
    cascaded_max = library_module("core.max.cascaded_max").cascaded_max
    x = _random(rng, shape, np.float32)
    values, indices = _launch(cascaded_max, lnc, x)
    values, indices = np.asarray(values), np.asarray(indices)
    expected_shape = shape[:-1] + (1,)
    assert values.shape == indices.shape == expected_shape
    np.testing.assert_array_equal(values, x.max(axis=-1, keepdims=True))
    np.testing.assert_array_equal(indices, x.argmax(axis=-1)[..., None])


# --- find_nonzero_indices (core/subkernels/find_nonzero_indices.py) ----------------------------
needs_api_surface = pytest.mark.skipif(
    not (hasattr(nki, "dtype") and hasattr(nki.isa, "constants")),
    reason="the kernel's module reads nki.dtype and nki.isa.constants (the language-checker "
    "branch adds them)",
)


@needs_api_surface
@pytest.mark.parametrize(
    "tokens, columns, chunk, start, count",
    [(256, 16, None, None, None), (512, 8, 256, None, None), (256, 20, None, 4, 8)],
)
def test_find_nonzero_indices(rng, tokens, columns, chunk, start, count):
    """Docstring: input [T, C]; per column the T-indices of its nonzero elements, then -1,
    and their count; with ``col_start_id``, the ``n_cols`` columns from there; LNC=2."""
    find = library_module("core.subkernels.find_nonzero_indices").find_nonzero_indices
    x = np.where(rng.random((tokens, columns)) < 0.3, rng.standard_normal((tokens, columns)), 0)
    x = x.astype(np.float32)
    kwargs = {"chunk_size": chunk}
    if start is not None:
        kwargs.update(col_start_id=np.array([start], np.int32), n_cols=count)
    indices, counts = find[2](x, **kwargs)
    chosen = x[:, start : start + count] if start is not None else x
    expected = np.full((chosen.shape[1], tokens), -1)
    for c in range(chosen.shape[1]):
        hits = np.flatnonzero(chosen[:, c])
        expected[c, : hits.size] = hits
    np.testing.assert_array_equal(indices, expected)
    np.testing.assert_array_equal(np.asarray(counts).reshape(-1), (chosen != 0).sum(axis=0))


# --- stream_shuffle_broadcast, cross_partition_copy (core/utils/) -------------------------------
def _load_pair(src, dst_init, src_shape, dst_shape):
    """``src`` and the initial ``dst`` from HBM into SBUF tiles."""
    nl, nisa = nki.language, nki.isa
    src_sb = nl.ndarray(src_shape, dtype=src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=src_sb, src=src)
    dst_sb = nl.ndarray(dst_shape, dtype=src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=dst_sb, src=dst_init)
    return src_sb, dst_sb


def _store_tile(tile):
    nl = nki.language
    out = nl.ndarray(tile.shape, dtype=tile.dtype, buffer=nl.shared_hbm)
    nki.isa.dma_copy(dst=out, src=tile)
    return out


@pytest.mark.parametrize("rows, free", [(32, 8), (128, 16), (70, 5)])
def test_stream_shuffle_broadcast(rng, rows, free):
    """Docstring: the first partition of src onto every partition of dst (2-D, same width)."""
    helper = library_module("core.utils.stream_shuffle_broadcast").stream_shuffle_broadcast

    def broadcast(src, dst_init):
        src_sb, dst_sb = _load_pair(src, dst_init, (4, free), (rows, free))
        helper(src=src_sb, dst=dst_sb)
        return _store_tile(dst_sb)

    src = _random(rng, (4, free), np.float32)
    out = nki.jit(broadcast)(src, poison((rows, free)))
    np.testing.assert_array_equal(out, np.broadcast_to(src[0], (rows, free)))


@pytest.mark.parametrize(
    "src_start, dst_start, count",
    [(0, 32, 40), (0, 5, 10), (3, 40, 20), (7, 20, 30), (33, 0, 64), (100, 1, 28)],
)
def test_cross_partition_copy(rng, src_start, dst_start, count):
    """Docstring: dst[dst_start : dst_start + n] = src[src_start : src_start + n] over the
    first ``free_dim_size`` elements; the other partitions of dst keep their data."""
    helper = library_module("core.utils.cross_partition_copy").cross_partition_copy
    free = 6
    src = _random(rng, (128, free), np.float32)
    dst = _random(rng, (128, free), np.float32)

    def copy(src, dst_init):
        src_sb, dst_sb = _load_pair(src, dst_init, (128, free), (128, free))
        helper(
            src=src_sb,
            dst=dst_sb,
            src_start_partition=src_start,
            dst_start_partition=dst_start,
            num_partitions_to_copy=count,
            free_dim_size=free,
        )
        return _store_tile(dst_sb)

    kernel = nki.jit(copy)
    expected = dst.copy()
    expected[dst_start : dst_start + count] = src[src_start : src_start + count]
    np.testing.assert_array_equal(kernel(src, dst), expected)


# --- rotational top-k (core/topk/rotational_topk.py) -------------------------------------------
@pytest.mark.parametrize(
    "lnc, shape, k, ordered",
    [
        (1, (1, 1, 8192), 8, True),
        (2, (2, 4, 4096), 16, True),
        (2, (1, 1, 32000), 24, True),
        (2, (3, 5, 1000), 5, True),  # k not a multiple of 8: padded internally
        (2, (130, 2048), 8, True),  # B·S above 128: tiled
        (2, (2, 2, 3000), 16, False),
    ],
)
def test_rotational_topk(rng, lnc, shape, k, ordered):
    """Docstring (``topk``, the entry point): [B, S, V] → the k largest values along V and
    their indices, [B, S, k] each, descending when ``sorted_flag``."""
    topk = library_module("core.topk.rotational_topk").topk
    x = _random(rng, shape, np.float32)
    values, indices = topk[lnc](x, k=k, sorted_flag=ordered)
    values, indices = np.asarray(values), np.asarray(indices)
    assert values.shape == indices.shape == shape[:-1] + (k,)
    best = np.argsort(-x, axis=-1, kind="stable")[..., :k]
    if not ordered:  # the same k elements in some order
        order = np.argsort(-values, axis=-1, kind="stable")
        values = np.take_along_axis(values, order, axis=-1)
        indices = np.take_along_axis(indices, order, axis=-1)
    np.testing.assert_array_equal(values, np.take_along_axis(x, best, axis=-1))
    np.testing.assert_array_equal(indices, best)


# --- indexed_flatten (core/subkernels/indexed_flatten.py) --------------------------------------
@pytest.mark.parametrize(
    "rows, length, block, out_len, offsets, start",
    [
        (2, 256, 16, 512, [0, 20], None),
        (4, 512, 16, 1024, [0, 40, 100, 72], None),  # rows past the end: skipped, partly or all
        (3, 512, 32, 1024, [5, 0, 16, 40, 0], 1),  # offsets read from row_offsets_start on
    ],
)
def test_indexed_flatten(rng, rows, length, block, out_len, offsets, start):
    """Docstring: input [E, T] as [E, T/f, f] blocks; row e's blocks go to output blocks
    row_offsets[e] + p while they fit in output_len / f, the rest of the output is
    ``padding_val``; LNC=2 (rows written by both cores meet in a max, so the offsets here do
    not overlap)."""
    flatten = library_module("core.subkernels.indexed_flatten").indexed_flatten
    x = rng.integers(0, 1000, (rows, length)).astype(np.int32)
    row_offsets = np.array(offsets, np.int32)
    extra = {} if start is None else {"row_offsets_start": np.array([start], np.int32)}
    out = np.asarray(flatten[2](x, block, out_len, row_offsets, **extra))
    expected = np.full((out_len // block, block), -1)
    used = row_offsets[(start or 0) : (start or 0) + rows]
    for e, first in enumerate(used):
        for p in range(length // block):
            if first + p < out_len // block:
                expected[first + p] = x[e, p * block : (p + 1) * block]
    np.testing.assert_array_equal(out, expected.reshape(-1))


# --- output_projection_tkg (core/output_projection/output_projection_tkg.py) --------------------
@needs_api_surface
@pytest.mark.parametrize(
    "lnc, d_head, batch, heads, seq, hidden, bias, dtype",
    [
        (1, 64, 2, 2, 4, 512, True, np.float32),
        (2, 128, 1, 4, 8, 1024, False, np.float32),
        (2, 64, 4, 2, 2, 768, True, BF16),
    ],
)
def test_output_projection_tkg(rng, lnc, d_head, batch, heads, seq, hidden, bias, dtype):
    """Docstring: attention [D, B, N, S], weight [N·D, H], bias [1, H] →
    attention @ weight + bias as [B·S, H] (TRANSPOSE_OUT=False)."""
    project = library_module("core.output_projection.output_projection_tkg")
    attention = _random(rng, (d_head, batch, heads, seq), dtype)
    weight = (_random(rng, (heads * d_head, hidden), np.float32) / 16).astype(dtype)
    b = _random(rng, (1, hidden), dtype) if bias else None
    out = _launch(project.output_projection_tkg, lnc, attention, weight, b)
    expected = np.einsum(
        "dbns,ndh->bsh",
        attention.astype(np.float64),
        weight.astype(np.float64).reshape(heads, d_head, hidden),
    ).reshape(batch * seq, hidden)
    if bias:
        expected = expected + b.astype(np.float64)
    _check(out, expected, dtype, scale=4.0)


# --- cross entropy (experimental/loss/cross_entropy.py) ----------------------------------------
@needs_api_surface
@pytest.mark.parametrize(
    "positions, vocab, batch, chunk, dtype",
    [
        (64, 4096, 32, 4096, "float32"),
        (128, 6144, 16, 2048, "float32"),
        (32, 2048, 8, 2048, "bfloat16"),
    ],
)
def test_cross_entropy_forward_and_backward(rng, positions, vocab, batch, chunk, dtype):
    """Docstring: logits [P, V], int32 targets [P] → per-position loss = lse − logit[target]
    and the lse; the backward's gradient (reduction 'mean') is (softmax − onehot) / P."""
    loss_module = library_module("experimental.loss.cross_entropy")
    np_dtype = np.float32 if dtype == "float32" else BF16
    logits = _random(rng, (positions, vocab), np_dtype)
    targets = rng.integers(0, vocab, positions).astype(np.int32)
    nl_dtype = getattr(nki.language, dtype)
    loss, lse = loss_module.cross_entropy_forward[2](
        logits, targets, positions_per_batch=batch, chunk_size=chunk, dtype=nl_dtype
    )
    x = logits.astype(np.float64)
    top = x.max(axis=1)
    expected_lse = top + np.log(np.exp(x - top[:, None]).sum(axis=1))
    rows = np.arange(positions)
    _check(lse, expected_lse, np_dtype, scale=4.0)
    _check(loss, expected_lse - x[rows, targets], np_dtype, scale=4.0)
    grad = loss_module.cross_entropy_backward[2](
        logits,
        targets,
        np.asarray(lse),
        positions_per_batch=batch,
        chunk_size=chunk,
        dtype=nl_dtype,
        inplace=False,
    )
    expected_grad = np.exp(x - expected_lse[:, None])
    expected_grad[rows, targets] -= 1.0
    _check(grad, expected_grad / positions, np_dtype, scale=1.0 / positions)


# --- router_topk (core/router_topk/router_topk.py) ---------------------------------------------
def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize(
    "tokens, hidden, experts, k, pre_norm, normalize",
    [
        (64, 256, 16, 4, True, False),
        (128, 512, 64, 8, True, True),
        (32, 128, 32, 2, False, False),
    ],
)
def test_router_topk(rng, tokens, hidden, experts, k, pre_norm, normalize):
    """Docstring: logits = x @ w + bias ([H, T] x, [H, E] w) → the k experts of largest
    affinity per token (descending) and the affinities: softmax of all logits (pre-norm),
    of the top-k only, L1-normalised over the top-k (norm_topk_prob), or softmax of the
    top-k logits scattered back (post-norm); LNC=2 (the kernel synchronises both cores)."""
    router = library_module("core.router_topk.router_topk").router_topk
    softmax = library_module("core.utils.common_types").RouterActFnType.SOFTMAX

    def route(x, w, bias, logits, affinities, index):
        router(
            x,
            w,
            bias,
            logits,
            affinities,
            index,
            softmax,
            k,
            0,
            0,
            router_pre_norm=pre_norm,
            norm_topk_prob=normalize,
        )

    x = _random(rng, (hidden, tokens), np.float32)
    w = _random(rng, (hidden, experts), np.float32) / math.sqrt(hidden)
    bias = _random(rng, (1, experts), np.float32)
    logits = poison((tokens, experts))
    affinities = poison((tokens, experts))
    index = poison((tokens, k), np.uint32)
    nki.jit(route)[2](x, w, bias, logits, affinities, index)

    expected_logits = x.T.astype(np.float64) @ w.astype(np.float64) + bias.astype(np.float64)
    top = np.argsort(-expected_logits, axis=1, kind="stable")[:, :k]
    _check(logits, expected_logits, np.float32, scale=4.0)
    np.testing.assert_array_equal(index, top)
    if pre_norm:
        expected = _softmax(expected_logits)
        if normalize:
            chosen = np.take_along_axis(expected, top, axis=1)
            expected = np.zeros_like(expected)
            np.put_along_axis(expected, top, chosen / chosen.sum(axis=1, keepdims=True), axis=1)
    else:
        expected = np.zeros_like(expected_logits)
        chosen = _softmax(np.take_along_axis(expected_logits, top, axis=1))
        np.put_along_axis(expected, top, chosen, axis=1)
    _check(affinities, expected, np.float32)


# === MX (OCP Microscaling) kernels and paths, trn3 =============================================
# AWS's MX code runs on NeuronCore-v4 only (nisa.quantize_mx / nc_matmul_mx, isa L2744-2746,
# L719). The scale checks below follow quantize_mx's documented semantics (isa
# L2790-2812): per 8-partition x 4-lane group X = 2^(floor(log2 amax) - (E_max - 1)).
def _mx_quantize_reference(values, emax):
    """float64 reference of quantize_mx on a (P, F) array: (fp8 e4m3fn values (P, F), scale
    exponents (P / 8, F / 4)); written here from the ISA reference."""
    p, f = values.shape
    groups = np.abs(values).reshape(p // 8, 8, f // 4, 4).max(axis=(1, 3))
    _, frexp_exponent = np.frexp(np.where(groups == 0, 1.0, groups))
    exponent = np.where(groups == 0, -127, np.maximum(frexp_exponent - 1 - (emax - 1), -127))
    scale = np.repeat(np.repeat(np.ldexp(1.0, exponent), 8, 0), 4, 1)
    return (values / scale).astype(ml_dtypes.float8_e4m3fn), exponent


def _rmsnorm_mx_quantize_tkg_launcher():
    """An LNC=2 kernel around AWS's subkernel (its outputs live in SBUF): allocates the SBUF
    outputs, calls it, and stores each core's half of the tokens to HBM; the scales only
    from partitions 0-3 of each quadrant, where quantize_mx writes them."""
    from nki_rmsnorm.kernels.nki06._nki import nisa, nl

    quantize_tkg = library_module("core.subkernels.rmsnorm_mx_quantize_tkg").rmsnorm_mx_quantize_tkg

    def launcher(x, gamma, residual):
        batch, seq, hidden = x.shape
        tokens = batch * seq
        h1 = hidden // 128
        out_sb = nl.ndarray((128, tokens, h1), dtype=x.dtype, buffer=nl.sbuf)
        quant_sb = nl.ndarray(
            (128, hidden // 512, tokens), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf
        )
        scale_sb = nl.ndarray((128, hidden // 512, tokens), dtype=nl.uint8, buffer=nl.sbuf)
        residual_out = None
        if residual is not None:
            residual_out = nl.ndarray((tokens, hidden), dtype=x.dtype, buffer=nl.shared_hbm)
        quantize_tkg(
            input=x,
            gamma=gamma,
            output=out_sb,
            output_quant=quant_sb,
            output_scale=scale_sb,
            residual=residual,
            output_residual=residual_out,
        )
        out = nl.ndarray((128, tokens, h1), dtype=x.dtype, buffer=nl.shared_hbm)
        quant = nl.ndarray(
            (128, hidden // 512, tokens), dtype=nl.float8_e4m3fn_x4, buffer=nl.shared_hbm
        )
        scale = nl.ndarray((16, hidden // 512, tokens), dtype=nl.uint8, buffer=nl.shared_hbm)
        half = tokens // 2
        t0 = nl.program_id(0) * half
        nisa.dma_copy(dst=out[:, t0 : t0 + half, :], src=out_sb[:, t0 : t0 + half, :])
        nisa.dma_copy(dst=quant[:, :, t0 : t0 + half], src=quant_sb[:, :, t0 : t0 + half])
        for quadrant in range(4):
            nisa.dma_copy(
                dst=scale[quadrant * 4 : quadrant * 4 + 4, :, t0 : t0 + half],
                src=scale_sb[quadrant * 32 : quadrant * 32 + 4, :, t0 : t0 + half],
            )
        if residual is not None:
            return out, quant, scale, residual_out
        return out, quant, scale

    return nki.jit(launcher)


@pytest.mark.parametrize(
    "batch, seq, hidden, with_residual",
    [(1, 8, 1024, False), (2, 4, 2048, False), (2, 128, 1024, True)],
)
def test_rmsnorm_mx_quantize_tkg(rng, monkeypatch, batch, seq, hidden, with_residual):
    """Docstring (core/subkernels/rmsnorm_mx_quantize_tkg.py L41-84): hidden = input (+
    residual); output = hidden · gamma / sqrt(mean(hidden²) + eps) as [H0, B·S, H1]
    (element [h0, t, h1] is value h1·128 + h0 of token t); output_quant, output_scale =
    quantize_mx of it, [H0, H/512, B·S], lane q of x4 element [h0, j, t] being output[h0, t,
    q·H/512 + j] (the kernel's swizzle, L246-251); LNC=2. The fp8 values and scales must be
    exactly quantize_mx's of the bf16 output the kernel wrote; that output matches the
    float64 RMSNorm to bf16 precision (x · gamma and the product with the rsqrt each rounded
    to bf16: two roundings)."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    x = _random(rng, (batch, seq, hidden), BF16)
    gamma = (1.0 + 0.25 * rng.standard_normal((1, hidden))).astype(BF16)
    residual = _random(rng, (batch, seq, hidden), BF16) if with_residual else None
    outputs = _rmsnorm_mx_quantize_tkg_launcher()[2](x, gamma, residual)
    out, quant, scale = (np.asarray(a) for a in outputs[:3])
    tokens, h1, chunks = batch * seq, hidden // 128, hidden // 512

    h = x.astype(np.float64)
    if with_residual:
        h_rounded = (x.astype(np.float32) + residual.astype(np.float32)).astype(BF16)
        np.testing.assert_array_equal(
            np.asarray(outputs[3]).view(np.uint16),
            h_rounded.reshape(tokens, hidden).view(np.uint16),
        )
        h = h_rounded.astype(np.float64)
    h = h.reshape(tokens, hidden)
    y = h * gamma.astype(np.float64) / np.sqrt(np.mean(h * h, axis=1, keepdims=True) + 1e-6)
    expected = y.reshape(tokens, h1, 128).transpose(2, 0, 1)
    _check(out, expected, BF16, scale=np.abs(y).max())

    # quantize_mx of the kernel's own bf16 output, in the kernel's swizzled layout
    source = out.astype(np.float64).reshape(128, tokens, 4, chunks).transpose(0, 3, 1, 2)
    values, exponent = _mx_quantize_reference(source.reshape(128, -1), emax=8)
    packed = np.ascontiguousarray(quant).view(np.uint32).reshape(128, -1)
    got_values = packed.view(np.uint8).view(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(got_values.view(np.uint8), values.view(np.uint8))
    got_exponent = np.asarray(scale).astype(np.int64).reshape(16, -1) - 127
    np.testing.assert_array_equal(got_exponent, exponent)


@pytest.mark.parametrize("k", [512, 1536])
def test_mxfp_load_and_quantize(rng, monkeypatch, k):
    """Docstring (experimental/mxfp_subkernels/mxfp_load_utils.py L32-58, L81-110): a bf16
    [128, K] tensor, per 512-column K block swizzled to [128, M·4] (partition p, free (m, q)
    holding block[m, 4p + q]) and quantized to MXFP8: data [128, M · K/512] float8_e4m3fn_x4,
    scales uint8 with 16 rows at partition offsets 0, 32, 64, 96 (the rest unspecified)."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    load = library_module("experimental.mxfp_subkernels.mxfp_load_utils")
    tensor = _random(rng, (128, k), BF16)
    data, scale = load.mxfp_load_performance_wrapper(tensor)
    for block in range(k // 512):
        columns = tensor[:, block * 512 : (block + 1) * 512].astype(np.float64)
        swizzled = columns.reshape(128, 128, 4).transpose(1, 0, 2).reshape(128, 512)
        values, exponent = _mx_quantize_reference(swizzled, emax=8)
        got = np.ascontiguousarray(np.asarray(data)[:, block * 128 : (block + 1) * 128])
        got_values = got.view(np.uint32).view(np.uint8).view(ml_dtypes.float8_e4m3fn)
        np.testing.assert_array_equal(got_values.view(np.uint8), values.view(np.uint8))
        rows = [32 * q + r for q in range(4) for r in range(4)]
        got_scale = np.asarray(scale)[rows, block * 128 : (block + 1) * 128].astype(np.int64)
        np.testing.assert_array_equal(got_scale - 127, exponent)


def _mx_values(rng, shape, element):
    """Random values of an MX element type over its whole range (bits of every exponent)."""
    top = float(ml_dtypes.finfo(element).max)
    return rng.uniform(-top, top, shape).astype(element)


def _gate_up_mx_launcher(H, I, BxS):
    """An LNC=2 kernel around AWS's MX gate/up projection (its inputs and output live in SBUF):
    each core loads its half of the H tiles of the hidden data and their scales (4 scale rows
    to partitions 0-3 of each quadrant), calls it, and core 0 stores the summed output."""
    from nki_rmsnorm.kernels.nki06._nki import nisa, nl

    projection = library_module("core.mlp.mlp_tkg.gate_up_projection_mx_shard_H")
    constants = library_module("core.mlp.mlp_tkg.projection_mx_constants")
    TensorView = library_module("core.utils.tensor_view").TensorView

    def launcher(hidden_qtz, hidden_scale, weight_qtz, weight_scale, bias):
        cores, core = nl.num_programs(0), nl.program_id(0)
        cfg = constants.ProjConfig(H=H, I=I, BxS=BxS, n_prgs=cores, prg_id=core)
        tiles = H // 512 // cores
        first = core * tiles
        hidden_sb = nl.ndarray((128, tiles, BxS), dtype=nl.float8_e5m2_x4, buffer=nl.sbuf)
        nisa.dma_copy(dst=hidden_sb, src=hidden_qtz[:, first : first + tiles, :])
        scale_sb = nl.ndarray((128, tiles, BxS), dtype=nl.uint8, buffer=nl.sbuf)
        for quadrant in range(4):
            nisa.dma_copy(
                dst=scale_sb[quadrant * 32 : quadrant * 32 + 4, :, :],
                src=hidden_scale[quadrant * 4 : quadrant * 4 + 4, first : first + tiles, :],
            )
        bias_sb = nl.ndarray((128, I // 512, 4), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=bias_sb, src=bias)
        out_sb = projection.gate_up_projection_mx_tp_shard_H(
            hidden_qtz_sb=TensorView(hidden_sb),
            hidden_scale_sb=TensorView(scale_sb),
            weight_qtz=TensorView(weight_qtz),
            weight_scale=TensorView(weight_scale),
            bias_sb=TensorView(bias_sb),
            cfg=cfg,
        )
        out = nl.ndarray(out_sb.shape, dtype=nl.bfloat16, buffer=nl.shared_hbm)
        if core == 0:
            nisa.dma_copy(dst=out, src=out_sb)
        return out

    return nki.jit(launcher)


@pytest.mark.parametrize("H, I, BxS", [(1024, 512, 8), (2048, 1024, 32)])
def test_gate_up_projection_mx(rng, monkeypatch, H, I, BxS):
    """Docstring (core/mlp/mlp_tkg/gate_up_projection_mx_shard_H.py L44-66): hidden (moving)
    [H, BxS] @ weight (stationary) [H, I] -> [I, BxS] + bias, MXFP8 (e5m2) hidden against
    MXFP4 weights on nc_matmul_mx, H sharded over LNC=2 and summed by sendrecv; the output
    bf16 [128, I/512, BxS, 4], element [p, c, t, q] the I index 512c + 128q + p (the matmuls'
    I128 tiles, L165-170). Each H512 tile contracts its 128 partitions and the 4 lanes of an
    x4 element, every value times its 8x4 group's scale 2^(s - 127) (isa L767-769,
    trainium3_arch.rst L99-105)."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    from simulate.core.dtypes import pack_x4

    tiles = H // 512
    hidden = _mx_values(rng, (128, tiles, BxS, 4), ml_dtypes.float8_e5m2)
    weight = _mx_values(rng, (128, tiles, I, 4), ml_dtypes.float4_e2m1fn)
    hidden_scale = rng.integers(118, 124, (16, tiles, BxS)).astype(np.uint8)
    weight_scale = rng.integers(122, 130, (16, tiles, I)).astype(np.uint8)
    bias = _random(rng, (128, I // 512, 4), BF16)
    out = _gate_up_mx_launcher(H, I, BxS)[2](
        pack_x4(hidden.reshape(128, tiles, 4 * BxS), "float8_e5m2_x4"),
        hidden_scale,
        pack_x4(weight.reshape(128, tiles, 4 * I), "float4_e2m1fn_x4"),
        weight_scale,
        bias,
    )

    def dequantized(values, scale):  # [128, tiles, X, 4] with scales of partition p // 8
        factor = np.ldexp(1.0, scale.astype(np.int64) - 127)
        return values.astype(np.float64) * np.repeat(factor, 8, axis=0)[..., None]

    product = np.einsum(
        "pjiq,pjtq->it", dequantized(weight, weight_scale), dequantized(hidden, hidden_scale)
    )
    bias_by_i = bias.astype(np.float64).transpose(1, 2, 0).reshape(I)  # [p, c, q] -> 512c+128q+p
    expected = (product + bias_by_i[:, None]).reshape(I // 512, 4, 128, BxS).transpose(2, 0, 3, 1)
    # the products are exact; the PSUM sum is float32, then bf16 per core, the two cores'
    # halves added in bf16: a few bf16 roundings of the partial sums
    magnitude = np.einsum(
        "pjiq,pjtq->it",
        np.abs(dequantized(weight, weight_scale)),
        np.abs(dequantized(hidden, hidden_scale)),
    )
    scale = (magnitude + np.abs(bias_by_i)[:, None]).reshape(I // 512, 4, 128, BxS)
    _check(out, expected, BF16, scale=scale.transpose(2, 0, 3, 1))


def _down_mx_launcher(H, I, BxS):
    """An LNC=2 kernel around AWS's MX down projection: loads the bf16 intermediate and this
    core's bias half into SBUF, calls it, and core 0 stores the [BxS, H] result."""
    from nki_rmsnorm.kernels.nki06._nki import nisa, nl

    projection = library_module("core.mlp.mlp_tkg.down_projection_mx_shard_H")
    constants = library_module("core.mlp.mlp_tkg.projection_mx_constants")

    def launcher(inter, weight_qtz, weight_scale, bias):
        cores, core = nl.num_programs(0), nl.program_id(0)
        cfg = constants.ProjConfig(H=H, I=I, BxS=BxS, n_prgs=cores, prg_id=core)
        half = H // cores
        inter_sb = nl.ndarray((128, I // 512, BxS, 4), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=inter_sb, src=inter)
        bias_sb = nl.ndarray((1, half), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=bias_sb, src=bias[:, core * half : (core + 1) * half])
        out_sb = projection.down_projection_mx_shard_H(
            inter_sb=inter_sb,
            weight=weight_qtz,
            weight_scale=weight_scale,
            bias_sb=bias_sb,
            cfg=cfg,
        )
        out = nl.ndarray((BxS, H), dtype=nl.bfloat16, buffer=nl.shared_hbm)
        if core == 0:
            for tile in range((BxS + 127) // 128):
                rows = min(128, BxS - tile * 128)
                nisa.dma_copy(
                    dst=out[tile * 128 : tile * 128 + rows, :], src=out_sb[0:rows, tile, :]
                )
        return out

    return nki.jit(launcher)


@pytest.mark.parametrize("H, I, BxS", [(1024, 512, 8), (2048, 1024, 40)])
def test_down_projection_mx(rng, monkeypatch, H, I, BxS):
    """Docstring (core/mlp/mlp_tkg/down_projection_mx_shard_H.py L212-240): weight [I, H] @
    intermediate [I, BxS] -> [BxS, H] + bias, the bf16 intermediate [128, I/512, BxS, 4]
    quantized online to MXFP8 e4m3fn by quantize_mx (8x4 groups on its partitions and
    lanes), then nc_matmul_mx against MXFP4 weights [128, I/512, H] x4 with scales
    [16, I/512, H]; LNC=2. The reference quantizes the intermediate as the ISA reference
    documents (isa L2790-2812) and contracts every (partition, tile, lane)."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    from simulate.core.dtypes import pack_x4

    tiles = I // 512
    inter = _random(rng, (128, tiles, BxS, 4), BF16)
    weight = _mx_values(rng, (128, tiles, H, 4), ml_dtypes.float4_e2m1fn)
    weight_scale = rng.integers(118, 126, (16, tiles, H)).astype(np.uint8)
    bias = _random(rng, (1, H), BF16)
    out = _down_mx_launcher(H, I, BxS)[2](
        inter, pack_x4(weight.reshape(128, tiles, 4 * H), "float4_e2m1fn_x4"), weight_scale, bias
    )

    values, exponent = _mx_quantize_reference(inter.astype(np.float64).reshape(128, -1), emax=8)
    inter_q = values.astype(np.float64) * np.repeat(np.repeat(np.ldexp(1.0, exponent), 8, 0), 4, 1)
    inter_q = inter_q.reshape(128, tiles, BxS, 4)
    weight_q = (
        weight.astype(np.float64)
        * np.repeat(np.ldexp(1.0, weight_scale.astype(np.int64) - 127), 8, axis=0)[..., None]
    )
    expected = np.einsum("pctq,pchq->th", inter_q, weight_q) + bias.astype(np.float64)
    magnitude = np.einsum("pctq,pchq->th", np.abs(inter_q), np.abs(weight_q))
    _check(out, expected, BF16, scale=magnitude + np.abs(bias.astype(np.float64)))
