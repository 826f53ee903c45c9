"""AWS's nki-library kernels, unmodified, on the NKI 0.6 simulator against float64 NumPy
references written here from each kernel's docstring (aws-neuron/nki-library@d2ad3a5). The
checkout comes from ``NKI_LIBRARY_PATH`` (:mod:`nkilib_corpus`); without it every test
here skips. AWS's norm kernels (rmsnorm_tkg, layernorm_tkg, rmsnorm_quant) are driven by
``test_nki06_aws_library.py``; this file covers the rest of the single-NeuronCore corpus, and
the kernels that use nki.collectives on several LNC=1 ranks (``nki.launch_ranks``). The mlp
entry and transformer_tkg import core/mlp/mlp.py, which does not parse at d2ad3a5: their
cases skip there, naming the error, and run against a 2.29_release checkout (ddbca35)."""

from __future__ import annotations

import functools
import math

import ml_dtypes
import numpy as np
import pytest
from helpers import poison
from nkilib_corpus import import_library, library_module, requires_library

import simulate.nki06 as nki
from simulate.core.dtypes import pack_x4

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


def _check(actual, expected, dtype, scale=1.0, precision=None):
    """``actual`` is ``dtype`` and within the tolerance of ``precision`` (default: ``dtype``;
    bf16 for kernels that compute in bf16 whatever their output dtype)."""
    rtol, atol = TOLERANCE[np.dtype(precision or dtype)]
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


# --- attention_cte (core/attention/attention_cte.py) -------------------------------------------
def _attention_reference(q, k, v, scale, causal, window=0, sink=None, prior_len=0):
    """softmax(q·kᵀ·scale + mask)·v over [B, S_q, d] q and [B, S_kv, d] k, v (the caller
    repeats k, v for GQA and prepends the used prior); the mask compares query i, shifted by
    the prior length, with key j: causal keeps j <= i, a window keeps j > i − window; a sink
    joins every row's softmax as one more logit whose value is dropped."""
    logits = np.einsum("bqd,bkd->bqk", q, k) * scale
    query = np.arange(q.shape[1])[:, None] + prior_len
    key = np.arange(k.shape[1])[None, :]
    keep = np.ones((q.shape[1], k.shape[1]), bool)
    if causal:
        keep &= key <= query
    if window:
        keep &= key > query - window
    logits = np.where(keep, logits, -np.inf)
    top = logits.max(axis=-1, keepdims=True)
    if sink is not None:
        top = np.maximum(top, sink[:, :, None])
    weights = np.exp(logits - top)
    total = weights.sum(axis=-1, keepdims=True)
    if sink is not None:
        total = total + np.exp(sink[:, :, None] - top)
    return np.einsum("bqk,bkd->bqd", weights / total, v)


@pytest.mark.parametrize(
    "lnc, batch, kv_batch, seq_q, seq_kv, d, options, dtype",
    [
        (1, 1, 1, 128, 128, 64, {}, np.float32),
        (1, 1, 1, 128, 256, 64, {"causal_mask": False}, np.float32),
        (2, 4, 2, 256, 256, 64, {}, np.float32),  # GQA: 2 query sequences per KV sequence
        (1, 2, 2, 128, 128, 128, {"tp_k": True, "tp_out": True}, np.float32),
        (1, 1, 1, 128, 128, 64, {"tp_q": False}, np.float32),
        (1, 1, 1, 200, 200, 64, {}, BF16),  # a partial Q tile
        (1, 2, 1, 128, 128, 64, {"sink": True}, np.float32),
        (1, 1, 1, 256, 256, 64, {"sliding_window": 64}, np.float32),
        (2, 2, 2, 256, 256, 64, {"sliding_window": 100}, BF16),
        (1, 1, 1, 128, 128, 64, {"prior": (256, 100)}, np.float32),  # prefix caching
        (1, 1, 1, 128, 128, 64, {"prior": (256, 100), "sliding_window": 150}, np.float32),
        (1, 1, 1, 128, 1088, 64, {"causal_mask": False}, np.float32),  # K/V tiles of 512
    ],
)
def test_attention_cte(rng, lnc, batch, kv_batch, seq_q, seq_kv, d, options, dtype):
    """Docstring: softmax(q @ k) @ v with q [B, S_q, d] (tp_q, else [B, d, S_q]), k [B_kv, d,
    S_kv] (tp_k: [B_kv, S_kv, d]), v [B_kv, S_kv, d]; GQA repeats each KV sequence for
    B / B_kv query sequences; prefix caching prepends the first prior_used_len of k_prior,
    v_prior; a sink [B, 1] is one more logit per row; out [B, S_q, d] (tp_out: [B, d, S_q]).
    "float32 for softmax and bfloat16 for other operations": bf16-level tolerance."""
    attention_cte = library_module("core.attention.attention_cte").attention_cte
    options = dict(options)
    tp_q, tp_k = options.get("tp_q", True), options.get("tp_k", False)
    # logits ~ N(0, 1) whatever the scale the kernel applies (it requires 1.0 with a window,
    # a sink or a prior)
    scale = 1.0 if {"sink", "sliding_window", "prior"} & options.keys() else 1.0 / math.sqrt(d)
    q = (_random(rng, (batch, seq_q, d), np.float32) / math.sqrt(d) / scale).astype(dtype)
    k = _random(rng, (kv_batch, seq_kv, d), dtype)
    v = _random(rng, (kv_batch, seq_kv, d), dtype)
    kwargs = {"scale": scale, "causal_mask": options.get("causal_mask", True)}
    kwargs.update(tp_q=tp_q, tp_k=tp_k, tp_out=options.get("tp_out", False))
    kwargs["sliding_window"] = options.get("sliding_window", 0)
    sink = None
    if options.get("sink"):
        sink = _random(rng, (batch, 1), np.float32)
        kwargs["sink"] = sink
    prior_len = 0
    k_all, v_all = k.astype(np.float64), v.astype(np.float64)
    if "prior" in options:
        prior_seq, prior_len = options["prior"]
        k_prior = _random(rng, (kv_batch, prior_seq, d), dtype)
        v_prior = _random(rng, (kv_batch, prior_seq, d), dtype)
        kwargs.update(
            k_prior=k_prior if tp_k else k_prior.transpose(0, 2, 1).copy(),
            v_prior=v_prior,
            prior_used_len=np.array([prior_len], np.int32),
        )
        k_all = np.concatenate([k_prior[:, :prior_len].astype(np.float64), k_all], axis=1)
        v_all = np.concatenate([v_prior[:, :prior_len].astype(np.float64), v_all], axis=1)
    q_in = q if tp_q else q.transpose(0, 2, 1).copy()
    k_in = k if tp_k else k.transpose(0, 2, 1).copy()
    out = np.asarray(_launch(attention_cte, lnc, q_in, k_in, v, **kwargs))
    if kwargs["tp_out"]:
        out = out.transpose(0, 2, 1)
    group = batch // kv_batch
    expected = _attention_reference(
        q.astype(np.float64),
        np.repeat(k_all, group, axis=0),
        np.repeat(v_all, group, axis=0),
        scale,
        kwargs["causal_mask"],
        kwargs["sliding_window"],
        None if sink is None else sink.astype(np.float64),
        prior_len,
    )
    _check(out, expected, dtype, scale=np.abs(v_all).max(), precision=BF16)


def test_attention_cte_softmax_cache(rng):
    """Docstring: with cache_softmax the kernel also returns −max and 1/sum of each row's
    softmax, as [B, 128, ceil(S_q / 128)] (row t·128 + p at [:, p, t])."""
    attention_cte = library_module("core.attention.attention_cte").attention_cte
    q = _random(rng, (1, 256, 64), np.float32) / 8
    k, v = _random(rng, (1, 64, 256), np.float32), _random(rng, (1, 256, 64), np.float32)
    out, neg_max, recip = attention_cte(q, k, v, cache_softmax=True)
    logits = q[0].astype(np.float64) @ k[0].astype(np.float64)
    logits = np.where(np.tri(256, dtype=bool), logits, -np.inf)
    top = logits.max(axis=1)
    total = np.exp(logits - top[:, None]).sum(axis=1)
    # the logits come from bf16 operands (fp32 softmax)
    tiles = (1, 2, 128)
    _check(neg_max, (-top).reshape(tiles).transpose(0, 2, 1), np.float32, 4.0, BF16)
    _check(recip, (1 / total).reshape(tiles).transpose(0, 2, 1), np.float32, 0.0, BF16)
    expected = np.exp(logits - top[:, None]) / total[:, None] @ v[0].astype(np.float64)
    _check(out, expected[None], np.float32, scale=4.0, precision=BF16)


@pytest.mark.parametrize("causal", [True, False])
def test_attention_cte_sequence_packing(rng, causal):
    """Docstring: query i attends only to keys bound_min[i] <= j < bound_max[i] ([S_q, 1];
    the kernel reads them in 128-row tiles), with the causal mask on top when asked; scale
    1.0 (the range_select path)."""
    attention_cte = library_module("core.attention.attention_cte").attention_cte
    q = _random(rng, (1, 256, 64), np.float32) / 8
    k, v = _random(rng, (1, 64, 256), np.float32), _random(rng, (1, 256, 64), np.float32)
    starts = np.repeat([0, 100, 180], [100, 80, 76])[:, None].astype(np.int32)
    ends = np.repeat([100, 180, 256], [100, 80, 76])[:, None].astype(np.int32)
    out = attention_cte(q, k, v, scale=1.0, causal_mask=causal, bound_min=starts, bound_max=ends)
    logits = q[0].astype(np.float64) @ k[0].astype(np.float64)
    key, query = np.arange(256)[None, :], np.arange(256)[:, None]
    keep = (key >= starts) & (key < ends) & ((key <= query) if causal else True)
    logits = np.where(keep, logits, -np.inf)
    weights = np.exp(logits - logits.max(axis=1, keepdims=True))
    expected = (weights / weights.sum(axis=1, keepdims=True)) @ v[0].astype(np.float64)
    _check(out, expected[None], np.float32, scale=4.0, precision=BF16)


# --- attention_bwd (core/attention/attention_bwd.py) -------------------------------------------
@pytest.mark.parametrize(
    "lnc, batch, heads, kv_heads, d, seq, causal, window, dtype",
    [
        (1, 1, 1, 1, 64, 128, False, None, np.float32),
        (1, 1, 2, 1, 64, 256, True, None, np.float32),  # GQA: dK, dV summed over the group
        (1, 1, 2, 2, 128, 256, True, None, BF16),
        (2, 1, 2, 1, 64, 512, True, 100, np.float32),
    ],
)
def test_attention_bwd(rng, lnc, batch, heads, kv_heads, d, seq, causal, window, dtype):
    """Docstring: q, o, dy [B, H, d, S], k, v [B, H_kv, d, S], lse [B, H, 128, S / 128]
    (query t·128 + p at [..., p, t]); P = softmax(qᵀk·scale), scale 1/√d; dV = Pᵀ·dy,
    dS = P ∘ (dyᵀv − rowsum(dy ∘ o)), dQ = dS·k·scale, dK = dSᵀ·q·scale."""
    attention_bwd = library_module("core.attention.attention_bwd").attention_bwd
    q, dy = _random(rng, (batch, heads, d, seq), dtype), _random(rng, (batch, heads, d, seq), dtype)
    k, v = (_random(rng, (batch, kv_heads, d, seq), dtype) for _ in range(2))
    group = heads // kv_heads
    q64, dy64 = q.astype(np.float64), dy.astype(np.float64)
    k64 = np.repeat(k.astype(np.float64), group, axis=1)
    v64 = np.repeat(v.astype(np.float64), group, axis=1)
    scale = 1.0 / math.sqrt(d)
    logits = np.einsum("bhdq,bhdk->bhqk", q64, k64) * scale
    query, key = np.arange(seq)[:, None], np.arange(seq)[None, :]
    keep = (key <= query) if causal else np.ones((seq, seq), bool)
    if window:
        keep &= key > query - window
    logits = np.where(keep, logits, -np.inf)
    top = logits.max(axis=-1, keepdims=True)
    total = np.exp(logits - top).sum(axis=-1, keepdims=True)
    weights = np.exp(logits - top) / total
    lse = (top + np.log(total))[..., 0]
    o = np.einsum("bhqk,bhdk->bhdq", weights, v64).astype(dtype)
    lse_tiles = lse.reshape(batch, heads, seq // 128, 128).transpose(0, 1, 3, 2)
    dq, dk, dv = _launch(
        attention_bwd,
        lnc,
        q,
        k,
        v,
        o,
        dy,
        lse_tiles.astype(np.float32),
        use_causal_mask=causal,
        sliding_window=window,
        mixed_precision=dtype == BF16,
    )
    row_term = (dy64 * o.astype(np.float64)).sum(axis=2)[..., None]
    d_logits = weights * (np.einsum("bhdq,bhdk->bhqk", dy64, v64) - row_term)
    expected_dq = np.einsum("bhqk,bhdk->bhdq", d_logits, k64) * scale
    expected_dk = np.einsum("bhqk,bhdq->bhdk", d_logits, q64) * scale
    expected_dv = np.einsum("bhqk,bhdq->bhdk", weights, dy64)
    per_kv = (batch, kv_heads, group, d, seq)
    # fp32 runs agree to fp32 accuracy; bf16 ones (mixed precision: fp32 intermediates) to bf16
    _check(dq, expected_dq, dtype, scale=np.abs(expected_dq).max())
    _check(dk, expected_dk.reshape(per_kv).sum(axis=2), dtype, scale=np.abs(expected_dk).max())
    _check(dv, expected_dv.reshape(per_kv).sum(axis=2), dtype, scale=np.abs(expected_dv).max())


# --- qkv_cte (core/qkv/qkv_cte.py) -------------------------------------------------------------
@pytest.mark.parametrize(
    "lnc, batch, seq, hidden, q_heads, kv_heads, d_head, bias, norm, dtype, dma_transpose",
    [
        (1, 1, 128, 256, 2, 1, 64, False, None, np.float32, True),
        (2, 2, 256, 512, 4, 2, 64, True, None, BF16, True),
        (1, 1, 128, 256, 2, 1, 64, False, "RMS_NORM", np.float32, True),  # fused RMSNorm
        (1, 1, 128, 256, 2, 1, 64, True, "RMS_NORM", np.float32, False),
        (1, 2, 100, 384, 1, 1, 128, False, "LAYER_NORM", BF16, True),
    ],
)
def test_qkv_cte(
    rng, lnc, batch, seq, hidden, q_heads, kv_heads, d_head, bias, norm, dtype, dma_transpose
):
    """Docstring: input [B, S, H], fused weights [H, I], I = (q + 2·kv heads)·d_head →
    norm(input) @ weights + bias as [B, S, I]; RMSNorm x·γ/√(mean(x²) + eps), LayerNorm
    (x − mean)/√(var + eps)·γ (+ β); "fp32 inputs are internally converted to bf16": bf16
    tolerance."""
    qkv_cte = nki.jit(library_module("core.qkv.qkv_cte").qkv_cte)
    norm_type = library_module("core.utils.common_types").NormType
    fused = (q_heads + 2 * kv_heads) * d_head
    x = _random(rng, (batch, seq, hidden), dtype)
    w = (_random(rng, (hidden, fused), np.float32) / math.sqrt(hidden)).astype(dtype)
    kwargs = {"load_input_with_DMA_transpose": dma_transpose}
    x64 = x.astype(np.float64)
    if norm:
        gamma = _random(rng, (1, hidden), dtype)
        kwargs.update(fused_norm_type=getattr(norm_type, norm), gamma_norm_weights=gamma)
        if norm == "RMS_NORM":
            x64 = x64 / np.sqrt((x64**2).mean(axis=-1, keepdims=True) + 1e-6)
        else:
            centred = x64 - x64.mean(axis=-1, keepdims=True)
            x64 = centred / np.sqrt((centred**2).mean(axis=-1, keepdims=True) + 1e-6)
        x64 = x64 * gamma.astype(np.float64)
    expected = x64 @ w.astype(np.float64)
    if bias:
        kwargs["bias"] = _random(rng, (1, fused), dtype)
        expected = expected + kwargs["bias"].astype(np.float64)
    out = _launch(qkv_cte, lnc, x, w, **kwargs)
    _check(out, expected, dtype, scale=4.0, precision=BF16)


# --- gen_mask_tkg (core/attention/gen_mask_tkg.py) ---------------------------------------------
def _mask_rows(s_prior, block_len):
    """The key position of each row of gen_mask_tkg_hbm's [s_prior, ...] output: n_tile =
    s_prior / 128 rows of 128, row f·128 + p holds key p·n_tile + f (strided layout), or with a
    block KV cache of (resized) block length L, key fold·L·128 + p·L + f mod L, fold = f // L
    (the kernel's docstring, "token_idx = fold_idx * block_len * P_MAX + partition * block_len
    + blk_offset")."""
    tiles = s_prior // 128
    if not block_len:
        return (np.arange(128)[None, :] * tiles + np.arange(tiles)[:, None]).reshape(-1)
    folds = tiles // block_len
    fold = np.arange(folds)[:, None, None]
    return (
        fold * block_len * 128
        + np.arange(128)[None, None, :] * block_len
        + np.arange(block_len)[None, :, None]
    ).reshape(-1)


@pytest.mark.parametrize(
    "lnc, batch, heads, active, s_prior, options",
    [
        (1, 2, 2, 1, 256, {}),
        (2, 2, 4, 4, 512, {}),
        (1, 2, 2, 2, 256, {"window": True}),
        (2, 4, 2, 2, 1024, {"window": True}),
        (1, 2, 2, 3, 256, {"active_mask": True}),
        (2, 2, 2, 3, 512, {"active_mask": True}),
        (1, 2, 2, 1, 1024, {"block_len": 16}),  # resized to 8 for this bucket (kernel's log)
    ],
)
def test_gen_mask_tkg(rng, lnc, batch, heads, active, s_prior, options):
    """Docstring (gen_mask_tkg_hbm): pos_ids [1, B·s_active] → mask [s_prior, B, H, s_active]
    in the kernel's key order: key < the batch's cache length (its first position id), or
    with SWA start positions start <= key < pos (wrapping: start <= key or key < pos); an
    active mask [s_active(key), B, H, s_active] overwrites the last s_active keys."""
    gen_mask = nki.jit(library_module("core.attention.gen_mask_tkg").gen_mask_tkg_hbm)
    positions = rng.integers(active, s_prior, (1, batch * active)).astype(np.int32)
    kwargs = {}
    key = np.arange(s_prior)[:, None, None, None]
    per_query = positions.reshape(1, batch, 1, active)
    if options.get("window"):
        starts = (positions - rng.integers(1, s_prior // 2, positions.shape)).clip(0)
        kwargs["start_pos_hbm"] = starts.astype(np.int32)
        start = starts.reshape(1, batch, 1, active)
        expected = (key >= start) & (key < per_query)
    else:
        expected = key < positions.reshape(batch, active)[:, :1].reshape(1, batch, 1, 1)
    expected = np.broadcast_to(expected, (s_prior, batch, heads, active)).astype(np.float64)
    if options.get("active_mask"):
        tail = (rng.random((active, batch, heads, active)) < 0.5).astype(np.float32)
        kwargs["active_mask"] = tail
        expected = expected.copy()
        expected[s_prior - active :] = tail
    block_len = options.get("block_len", 0)
    if block_len:
        kwargs["block_len"] = block_len
    mask = _launch(gen_mask, lnc, positions, batch, heads, active, s_prior, **kwargs)
    resized = block_len // 2 if block_len else 0
    np.testing.assert_array_equal(mask, expected[_mask_rows(s_prior, resized)])


# --- output_projection_cte (core/output_projection/output_projection_cte/) -----------------------
@pytest.mark.parametrize(
    "lnc, batch, heads, d_head, seq, hidden, bias, dtype",
    [
        (1, 1, 2, 64, 128, 256, True, np.float32),
        (2, 2, 3, 128, 512, 512, False, BF16),
        (1, 1, 1, 32, 100, 200, True, np.float32),  # partial S and H tiles
    ],
)
def test_output_projection_cte(rng, lnc, batch, heads, d_head, seq, hidden, bias, dtype):
    """Docstring: attention [B, N, D, S], weight [N·D, H], bias [1, H] → attention @ weight
    + bias as [B, S, H] in the attention's dtype."""
    project = library_module(
        "core.output_projection.output_projection_cte.output_projection_cte"
    ).output_projection_cte
    attention = _random(rng, (batch, heads, d_head, seq), dtype)
    weight = (_random(rng, (heads * d_head, hidden), np.float32) / 16).astype(dtype)
    b = _random(rng, (1, hidden), dtype) if bias else None
    out = _launch(project, lnc, attention, weight, b)
    expected = np.einsum(
        "bnds,ndh->bsh",
        attention.astype(np.float64),
        weight.astype(np.float64).reshape(heads, d_head, hidden),
    )
    if bias:
        expected = expected + b.astype(np.float64)
    _check(out, expected, dtype, scale=4.0)


@pytest.mark.parametrize(
    "lnc, batch, heads, d_head, seq, hidden", [(1, 1, 2, 64, 128, 256), (2, 1, 4, 128, 512, 512)]
)
def test_output_projection_cte_fp8_static(rng, lnc, batch, heads, d_head, seq, hidden):
    """Docstring: QuantizationType.STATIC, fp8 weights [N·D, H], input_scales and
    weight_scales [128, 1]: out = (q(attention) @ weight) · input_scale · weight_scale with
    q(x) the fp8 (e4m3) of x · (1 / input_scale), which the kernel scales in place in the
    attention's bf16 tile and clamps to ±240 before the cast
    (output_projection_cte_quantization.py L441-456); pairs of heads go through the
    double-FP8 matmul (perf_mode=double_row)."""
    project = library_module(
        "core.output_projection.output_projection_cte.output_projection_cte"
    ).output_projection_cte
    quantization = library_module("core.utils.common_types").QuantizationType.STATIC
    fp8 = np.dtype(ml_dtypes.float8_e4m3)
    attention = _random(rng, (batch, heads, d_head, seq), BF16)
    weight = (_random(rng, (heads * d_head, hidden), np.float32) * 8).astype(fp8)
    input_scale, weight_scale = np.float32(0.05), np.float32(0.01)
    out = _launch(
        project,
        lnc,
        attention,
        weight,
        None,
        quantization_type=quantization,
        input_scales=np.full((128, 1), input_scale, np.float32),
        weight_scales=np.full((128, 1), weight_scale, np.float32),
    )
    scaled = (attention.astype(np.float32) * (np.float32(1) / input_scale)).astype(BF16)
    quantized = np.clip(scaled.astype(np.float64), -240, 240).astype(fp8).astype(np.float64)
    w = weight.astype(np.float64).reshape(heads, d_head, hidden)
    expected = np.einsum("bnds,ndh->bsh", quantized, w) * float(input_scale * weight_scale)
    _check(out, expected, BF16, scale=4.0)


@pytest.mark.parametrize(
    "lnc, batch, heads, d_head, seq, hidden", [(1, 1, 2, 64, 128, 512), (2, 2, 4, 128, 256, 1024)]
)
def test_output_projection_cte_static_mx(rng, monkeypatch, lnc, batch, heads, d_head, seq, hidden):
    """Docstring (QuantizationType.STATIC_MX on Trn3: FP8 weights through the MX engine):
    as STATIC, out = (q(attention) @ W) · input_scale · weight_scale with q(x) the
    float8_e4m3fn of x / input_scale clamped to its range (±448), the weight [N·D, H]
    float8_e4m3fn handed over "pre-shuffled" with each 4 consecutive rows interleaved
    (AWS's reference undoes it: output_projection_cte_torch.py L189-194, L203-206). The
    attention is scaled so that some values pass 448 (the clamp) and many pass 240 (STATIC's
    e4m3 limit, which would be off by ~11 % of the output's rms)."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    project = library_module(
        "core.output_projection.output_projection_cte.output_projection_cte"
    ).output_projection_cte
    quantization = library_module("core.utils.common_types").QuantizationType.STATIC_MX
    fp8 = np.dtype(ml_dtypes.float8_e4m3fn)
    attention = (_random(rng, (batch, heads, d_head, seq), np.float32) * 6).astype(BF16)
    weight = (_random(rng, (heads * d_head, hidden), np.float32) * 8).astype(fp8)
    rows = heads * d_head
    shuffled = weight.reshape(rows // 4, 4, hidden).transpose(0, 2, 1).reshape(rows, hidden)
    input_scale, weight_scale = np.float32(0.05), np.float32(0.01)
    out = _launch(
        nki.jit(project),
        lnc,
        attention,
        shuffled,
        None,
        quantization_type=quantization,
        input_scales=np.full((128, 1), input_scale, np.float32),
        weight_scales=np.full((128, 1), weight_scale, np.float32),
    )
    scaled = (attention.astype(np.float32) * (np.float32(1) / input_scale)).astype(BF16)
    quantized = np.clip(scaled.astype(np.float64), -448, 448).astype(fp8).astype(np.float64)
    w = weight.astype(np.float64).reshape(heads, d_head, hidden)
    expected = np.einsum("bnds,ndh->bsh", quantized, w) * float(input_scale * weight_scale)
    assert np.asarray(out).dtype == BF16
    _check_mx_output(out, expected)


# --- mlp_cte, mlp_tkg (core/mlp/) --------------------------------------------------------------
def _mlp_kernel(token_generation, norm, activation, fused_add):
    """A kernel around AWS's MLPParameters and mlp_cte / mlp_tkg, allocating the outputs
    as AWS's entry point does (core/mlp/mlp.py, which does not parse at d2ad3a5: its
    docstring is pasted twice, L203). mlp_tkg's own default SbufManager is an undefined
    name (mlp_tkg.py L132), so the kernel passes one as mlp.py does."""
    parameters = library_module("core.mlp.mlp_parameters").MLPParameters
    mlp_cte = library_module("core.mlp.mlp_cte.mlp_cte").mlp_cte
    mlp_tkg = library_module("core.mlp.mlp_tkg.mlp_tkg").mlp_tkg
    sbuf_manager = library_module("core.utils.allocator").SbufManager
    logger = library_module("core.utils.logging").Logger
    nl = nki.language

    def mlp(x, gate, up, down, gamma, residual):
        params = parameters(
            hidden_tensor=x,
            gate_proj_weights_tensor=gate,
            up_proj_weights_tensor=up,
            down_proj_weights_tensor=down,
            normalization_weights_tensor=gamma,
            normalization_type=norm,
            activation_fn=activation,
            fused_add_tensor=residual,
            store_fused_add_result=fused_add,
            force_cte_mode=not token_generation,
        )
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        added = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm) if fused_add else None
        if token_generation:
            mlp_tkg(params, out, added, sbm=sbuf_manager(0, 200 * 1024, logger("mlp")))
        else:
            mlp_cte(params, out, added)
        if fused_add:
            return out, added
        return out

    return nki.jit(mlp)


@pytest.mark.parametrize(
    "lnc, tkg, batch, seq, hidden, inter, norm, activation, fused_add, dtype",
    [
        (1, False, 1, 128, 256, 512, "NO_NORM", "SiLU", False, np.float32),
        (2, False, 1, 256, 512, 512, "RMS_NORM", "SiLU", False, BF16),
        (1, False, 2, 64, 256, 384, "RMS_NORM", "GELU", True, BF16),
        (1, True, 2, 1, 256, 512, "NO_NORM", "SiLU", False, np.float32),
        (2, True, 4, 1, 512, 1024, "RMS_NORM", "SiLU", False, BF16),
        (1, True, 2, 4, 256, 256, "RMS_NORM", "SiLU", True, np.float32),
    ],
)
def test_mlp(rng, lnc, tkg, batch, seq, hidden, inter, norm, activation, fused_add, dtype):
    """Docstring (MLPParameters, mlp_cte, mlp_tkg): x [B, S, H] (+ the fused-add tensor,
    stored when asked), RMSNorm x·γ/√(mean(x²) + eps), then down(act(x @ gate) · (x @ up))
    with gate, up [H, I], down [I, H]. The CTE path computes in bf16 for fp32 inputs
    (mlp_cte_constants.py L124-125): bf16 tolerance there."""
    act_type = library_module("core.utils.common_types").ActFnType
    norm_type = library_module("core.utils.common_types").NormType
    kernel = _mlp_kernel(tkg, getattr(norm_type, norm), getattr(act_type, activation), fused_add)
    x = _random(rng, (batch, seq, hidden), dtype)
    gate, up = (
        (_random(rng, (hidden, inter), np.float32) / math.sqrt(hidden)).astype(dtype)
        for _ in range(2)
    )
    down = (_random(rng, (inter, hidden), np.float32) / math.sqrt(inter)).astype(dtype)
    gamma = _random(rng, (1, hidden), dtype) if norm != "NO_NORM" else None
    residual = _random(rng, (batch, seq, hidden), dtype) if fused_add else None
    result = _launch(kernel, lnc, x, gate, up, down, gamma, residual)
    x64 = x.astype(np.float64)
    if fused_add:
        x64 = x64 + residual.astype(np.float64)
        out, added = result
        _check(added, x64, dtype, scale=4.0)
    else:
        out = result
    if gamma is not None:
        x64 = x64 / np.sqrt((x64**2).mean(axis=-1, keepdims=True) + 1e-6)
        x64 = x64 * gamma.astype(np.float64)
    a = x64 @ gate.astype(np.float64)
    act = _silu(a) if activation == "SiLU" else 0.5 * a * (1 + _erf(a / math.sqrt(2.0)))
    expected = (act * (x64 @ up.astype(np.float64))) @ down.astype(np.float64)
    _check(out, expected, dtype, scale=4.0, precision=None if tkg else BF16)


def _erf(x):
    return np.vectorize(math.erf)(x)


# --- qkv (core/qkv/qkv.py: qkv_tkg for B·S <= 128 and S <= 96, qkv_cte otherwise) -------------
def _rotate_heads(qkv, cos, sin, q_heads, kv_heads, d_head):
    """Docstring (qkv_cte): each Q and K head X = [X1, X2] becomes X·cos + [−X2, X1]·sin
    with cos, sin [B, S, d_head]; V heads are left as they are."""
    batch, seq, _ = qkv.shape
    heads = qkv.reshape(batch, seq, -1, d_head).copy()
    rotated = heads[:, :, : q_heads + kv_heads]
    c, s = cos.astype(np.float64)[:, :, None], sin.astype(np.float64)[:, :, None]
    heads[:, :, : q_heads + kv_heads] = rotated * c + _rotate_half(rotated) * s
    return heads.reshape(batch, seq, -1)


@pytest.mark.parametrize(
    "lnc, batch, seq, hidden, q_heads, kv_heads, d_head, options, dtype",
    [
        (1, 2, 1, 256, 2, 1, 64, {}, np.float32),  # qkv_tkg
        (2, 4, 1, 512, 4, 2, 64, {"bias": True, "norm": "RMS_NORM"}, BF16),
        (1, 2, 4, 256, 2, 1, 128, {"norm": "LAYER_NORM", "residual": True}, np.float32),
        (1, 2, 2, 256, 2, 1, 128, {"layout": "NBSd"}, np.float32),
        (1, 1, 128, 256, 2, 1, 64, {"rope": True}, np.float32),  # qkv_cte (RoPE is CTE only)
        (1, 1, 128, 256, 2, 1, 128, {"layout": "NBSd", "residual": True, "norm": "RMS_NORM"}, BF16),
    ],
)
def test_qkv(rng, lnc, batch, seq, hidden, q_heads, kv_heads, d_head, options, dtype):
    """Docstring (qkv, qkv_tkg): x [B, S, H] (+ mlp_prev + attention_prev), normalised
    (RMSNorm or LayerNorm with γ), @ weights [H, I] + bias, RoPE on the Q and K heads;
    out [B, S, I] (BSD) or [heads, B, S, d_head] (NBSd); qkv_tkg with the fused add also
    returns the sum x + mlp_prev + attention_prev. CTE computes fp32 inputs in bf16."""
    qkv = library_module("core.qkv.qkv").qkv
    types = library_module("core.utils.common_types")
    heads = q_heads + 2 * kv_heads
    x = _random(rng, (batch, seq, hidden), dtype)
    w = (_random(rng, (hidden, heads * d_head), np.float32) / math.sqrt(hidden)).astype(dtype)
    kwargs = {}
    x64 = x.astype(np.float64)
    if options.get("residual"):
        mlp_prev, attention_prev = (_random(rng, x.shape, dtype) for _ in range(2))
        kwargs.update(fused_residual_add=True, mlp_prev=mlp_prev, attention_prev=attention_prev)
        x64 = x64 + mlp_prev.astype(np.float64) + attention_prev.astype(np.float64)
    summed = x64
    norm = options.get("norm")
    if norm:
        gamma = _random(rng, (1, hidden), dtype)
        kwargs.update(fused_norm_type=getattr(types.NormType, norm), gamma_norm_weights=gamma)
        centred = x64 - x64.mean(axis=-1, keepdims=True) if norm == "LAYER_NORM" else x64
        x64 = centred / np.sqrt((centred**2).mean(axis=-1, keepdims=True) + 1e-6)
        x64 = x64 * gamma.astype(np.float64)
    expected = x64 @ w.astype(np.float64)
    if options.get("bias"):
        kwargs["bias"] = _random(rng, (1, heads * d_head), dtype)
        expected = expected + kwargs["bias"].astype(np.float64)
    head_counts = {"d_head": d_head, "num_q_heads": q_heads, "num_kv_heads": kv_heads}
    if options.get("rope"):
        angle = rng.uniform(-math.pi, math.pi, (batch, seq, d_head // 2))
        angle = np.concatenate([angle, angle], axis=-1)
        cos, sin = np.cos(angle).astype(dtype), np.sin(angle).astype(dtype)
        kwargs.update(fused_rope=True, cos_cache=cos, sin_cache=sin, **head_counts)
        expected = _rotate_heads(expected, cos, sin, q_heads, kv_heads, d_head)
    if options.get("layout") == "NBSd":
        kwargs.update(output_layout=types.QKVOutputLayout.NBSd, **head_counts)
        expected = expected.reshape(batch, seq, heads, d_head).transpose(2, 0, 1, 3)
    out = _launch(qkv, lnc, x, w, **kwargs)
    cte = seq > 96 or batch * seq > 128
    if options.get("residual") and not cte:
        out, fused_hidden = out
        _check(fused_hidden, summed, dtype, scale=4.0)
    _check(out, expected, dtype, scale=4.0, precision=BF16 if cte else None)


# --- attention_tkg (core/attention/attention_tkg.py) -------------------------------------------
def _attention_tkg_kernel(config, fuse_rope):
    """A kernel around AWS's attention_tkg: an SbufManager as AWS's own harness makes one
    (test/integration/nkilib/core/attention/test_attention_tkg.py L120), q and k_active
    copied into SBUF when RoPE is not fused (the kernel asserts ``qk_in_sb`` then), the
    output [B, H, d, s_active] (and the rotated k_active [B, 1, d, s_active]) in HBM."""
    attention_tkg = library_module("core.attention.attention_tkg").attention_tkg
    sbuf_manager = library_module("core.utils.allocator").SbufManager
    logger = library_module("core.utils.logging").Logger
    nl, nisa = nki.language, nki.isa

    def attention(q, k_active, v_active, k_prior, v_prior, mask, sink, positions, inv_freqs):
        sbm = sbuf_manager(0, nl.tile_size.sbuf_fmax_bytes - 16 * 1024, logger("attention"))
        sbm.open_scope()
        shape = (config.bs, config.q_head, config.d_head, config.s_active)
        out = nl.ndarray(shape, dtype=q.dtype, buffer=nl.shared_hbm)
        k_out = None
        if fuse_rope:
            k_shape = (config.bs, 1, config.d_head, config.s_active)
            k_out = nl.ndarray(k_shape, dtype=q.dtype, buffer=nl.shared_hbm)
        else:
            q_sb = sbm.alloc_stack(q.shape, dtype=q.dtype, buffer=nl.sbuf)
            k_sb = sbm.alloc_stack(k_active.shape, dtype=k_active.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=q_sb, src=q)
            nisa.dma_copy(dst=k_sb, src=k_active)
            q, k_active = q_sb, k_sb
        out, k_out = attention_tkg(
            q,
            k_active,
            v_active,
            k_prior,
            v_prior,
            mask,
            out,
            config,
            sbm,
            inv_freqs=inv_freqs,
            rope_pos_ids=positions,
            sink=sink,
            k_out=k_out,
        )
        sbm.close_scope()
        if fuse_rope:
            return out, k_out
        return out

    return nki.jit(attention)


def _rope_rows(x, positions, inv_freqs):
    """RoPE over the first axis (d) of x [d, B, ..., s] at positions [B, s]: angle
    inv_freq·pos repeated for both halves, x·cos + [−x2, x1]·sin."""
    angle = inv_freqs.astype(np.float64)[:, 0, None, None] * positions[None]
    angle = np.concatenate([angle, angle])
    extra = (slice(None), slice(None)) + (None,) * (x.ndim - 3) + (slice(None),)
    cos, sin = np.cos(angle)[extra], np.sin(angle)[extra]
    half = x.shape[0] // 2
    return x * cos + np.concatenate([-x[half:], x[:half]]) * sin


@pytest.mark.parametrize(
    "lnc, batch, heads, active, s_prior, d, options, dtype",
    [
        (1, 2, 2, 1, 256, 64, {}, np.float32),
        (1, 2, 4, 2, 512, 128, {"tp_k_prior": True}, np.float32),
        (2, 2, 2, 1, 1024, 64, {}, np.float32),  # s_prior sharded over the two cores
        (1, 1, 2, 1, 256, 64, {"sink": True}, np.float32),
        (1, 2, 2, 3, 512, 64, {}, BF16),
        (1, 1, 2, 1, 8704, 64, {}, np.float32),  # flash-attention tiles over s_prior
        (1, 2, 2, 2, 256, 64, {"use_pos_id": True}, np.float32),
        (2, 2, 4, 1, 1024, 128, {"use_pos_id": True, "tp_k_prior": True}, np.float32),
        (1, 2, 2, 2, 256, 64, {"use_pos_id": True, "fuse_rope": True}, np.float32),
        (2, 4, 2, 1, 512, 128, {"use_pos_id": True, "fuse_rope": True}, BF16),
    ],
)
def test_attention_tkg(rng, lnc, batch, heads, active, s_prior, d, options, dtype):
    """Docstring: the keys are k_prior's first s_prior with the last s_active replaced by
    k_active (v likewise); per query, softmax over the keys the mask keeps ([s_prior, B, H,
    s_active]; with use_pos_id the prior keys below the batch's position id and an active
    mask [s_active(key), B, H, s_active] on the tail), plus a sink [H, 1] logit; with
    fuse_rope, q and k_active are rotated (inv_freqs [d/2, 1], positions [B, s_active]) and q
    is scaled by 1/√d, and the rotated k_active is returned; out [B, H, d, s_active].
    In HBM the kernel reads q as [B, H, s_active, d] and k_active as [B, 1, s_active, d]
    (_apply_rope's docstring, attention_tkg.py L3109, and AWS's harness, test_attention_tkg.py
    L250-255), not the [B, d, H, s_active] / [B, d, s_active] of the entry docstring (L89-98)."""
    config_type = library_module("core.attention.attention_tkg_utils").AttnTKGConfig
    fuse_rope = options.get("fuse_rope", False)
    config = config_type(
        bs=batch,
        q_head=heads,
        s_active=active,
        curr_sprior=s_prior,
        full_sprior=s_prior,
        d_head=d,
        tp_k_prior=options.get("tp_k_prior", False),
        use_pos_id=options.get("use_pos_id", False),
        fuse_rope=fuse_rope,
        qk_in_sb=not fuse_rope,
    )
    q = _random(rng, (batch, d, heads, active), np.float32)
    q = (q if fuse_rope else q / math.sqrt(d)).astype(dtype)
    k_active = _random(rng, (batch, d, active), dtype)
    v_active = _random(rng, (batch, 1, active, d), dtype)
    k_prior = _random(rng, (batch, 1, d, s_prior), dtype)
    v_prior = _random(rng, (batch, 1, s_prior, d), dtype)
    lengths = rng.integers(1, s_prior - active, batch)
    key = np.arange(s_prior)[:, None, None, None]
    causal = np.tri(active, dtype=bool).T[:, None, None, :]  # [key, 1, 1, query]
    keep = np.broadcast_to(key < lengths[None, :, None, None], (s_prior, batch, heads, active))
    keep = keep.copy()
    keep[s_prior - active :] = causal
    positions = (lengths[:, None] + np.arange(active)).astype(np.float32)
    if config.use_pos_id:
        mask = np.broadcast_to(causal, (active, batch, heads, active)).astype(np.uint8)
    else:
        mask = keep.astype(np.uint8)
    sink = _random(rng, (heads, 1), np.float32) if options.get("sink") else None
    inv_freqs = (1e4 ** (-np.arange(d // 2) / (d // 2)))[:, None].astype(np.float32)
    if fuse_rope:  # HBM q [B, H, s_active, d], k_active [B, 1, s_active, d] (see above)
        q_in = q.transpose(0, 2, 3, 1).copy()
        k_in = k_active.transpose(0, 2, 1)[:, None].copy()
    else:  # SBUF q [d, B·H·s_active], k_active [d, B·s_active]
        q_in = q.transpose(1, 0, 2, 3).reshape(d, -1).copy()
        k_in = k_active.transpose(1, 0, 2).reshape(d, -1).copy()
    k_prior_in = k_prior.transpose(0, 1, 3, 2).copy() if config.tp_k_prior else k_prior
    kernel = _attention_tkg_kernel(config, fuse_rope)
    args = (q_in, k_in, v_active, k_prior_in, v_prior, mask, sink, positions, inv_freqs)
    result = _launch(kernel, lnc, *args)

    q64, k_new = q.astype(np.float64), k_active.astype(np.float64)
    if fuse_rope:
        q64 = _rope_rows(q64.transpose(1, 0, 2, 3), positions, inv_freqs).transpose(1, 0, 2, 3)
        q64 = q64 / math.sqrt(d)
        k_new = _rope_rows(k_new.transpose(1, 0, 2), positions, inv_freqs).transpose(1, 0, 2)
        out, k_out = result
        _check(k_out, k_new[:, None], dtype, scale=2.0)
    else:
        out = result
    keys, values = k_prior[:, 0].astype(np.float64), v_prior[:, 0].astype(np.float64)
    keys[:, :, s_prior - active :] = k_new
    values[:, s_prior - active :] = v_active[:, 0]
    logits = np.einsum("bdhq,bdk->bhkq", q64, keys)
    logits = np.where(keep.transpose(1, 2, 0, 3), logits, -np.inf)
    top = logits.max(axis=2, keepdims=True)
    if sink is not None:
        top = np.maximum(top, sink.astype(np.float64)[None, :, :, None])
    weights = np.exp(logits - top)
    total = weights.sum(axis=2, keepdims=True)
    if sink is not None:
        total = total + np.exp(sink.astype(np.float64)[None, :, :, None] - top)
    expected = np.einsum("bhkq,bkd->bhdq", weights / total, values)
    _check(out, expected, dtype, scale=4.0)


# --- moe_tkg (core/moe/moe_tkg/moe_tkg.py) -----------------------------------------------------
@pytest.mark.parametrize(
    "lnc, tokens, hidden, inter, experts, top_k, all_expert, scaling, mask_unselected",
    [
        (1, 4, 256, 256, 4, 2, False, "NO_SCALE", False),  # selective: local_gather
        (1, 4, 256, 256, 4, 2, False, "POST_SCALE", False),
        (2, 8, 512, 256, 4, 2, False, "POST_SCALE", False),
        (1, 4, 256, 256, 2, 1, True, "NO_SCALE", False),
        (1, 4, 256, 256, 4, 2, True, "POST_SCALE", False),
        # the masking reads expert_index from SBUF unless it is in shared HBM, which kernel
        # arguments are at LNC=2 (nki/guides/nki_simulator.rst L198-199, L208)
        (2, 8, 256, 256, 4, 2, True, "POST_SCALE", True),
    ],
)
def test_moe_tkg(
    rng, lnc, tokens, hidden, inter, experts, top_k, all_expert, scaling, mask_unselected
):
    """Docstring: hidden [T, H] bf16, gate/up [E, H, 2, I], down [E, I, H], affinities [T, E],
    top-k expert_index [T, K] → Σ over the token's K experts (all E with is_all_expert) of
    w·down(SiLU(x @ gate) · (x @ up)), w the affinity with POST_SCALE (all-expert masking:
    0 for the experts the token did not pick), else 1. AWS's harness passes fp32
    affinities to the selective path and bf16 to the all-expert one
    (test/integration/nkilib/core/moe/moe_tkg/test_moe_tkg_utils.py L244-247)."""
    moe_tkg = library_module("core.moe.moe_tkg.moe_tkg").moe_tkg
    scale_mode = library_module("core.utils.common_types").ExpertAffinityScaleMode
    x = _random(rng, (tokens, hidden), BF16)
    gate_up = (_random(rng, (experts, hidden, 2, inter), np.float32) / 16).astype(BF16)
    down = (_random(rng, (experts, inter, hidden), np.float32) / 16).astype(BF16)
    affinities = rng.random((tokens, experts)).astype(BF16 if all_expert else np.float32)
    index = np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens)]).astype(np.int32)
    kwargs = {
        "expert_affinities_scaling_mode": getattr(scale_mode, scaling),
        "mask_unselected_experts": mask_unselected,
    }
    if all_expert and scaling != "NO_SCALE":
        kwargs["rank_id"] = np.zeros((1, 1), np.int32)
    out = _launch(nki.jit(moe_tkg), lnc, x, gate_up, down, affinities, index, all_expert, **kwargs)
    x64 = x.astype(np.float64)
    gate = np.einsum("th,ehi->eti", x64, gate_up[:, :, 0].astype(np.float64))
    up = np.einsum("th,ehi->eti", x64, gate_up[:, :, 1].astype(np.float64))
    per_expert = np.einsum("eti,eih->eth", _silu(gate) * up, down.astype(np.float64))
    chosen = np.zeros((experts, tokens), bool)
    chosen[index.T, np.arange(tokens)] = True
    weight = np.ones((experts, tokens)) if all_expert else chosen.astype(np.float64)
    if scaling == "POST_SCALE":
        weight = weight * affinities.astype(np.float64).T
    if mask_unselected:
        weight = weight * chosen
    expected = np.einsum("et,eth->th", weight, per_expert)
    _check(out, expected, BF16, scale=4.0)


# --- moe_cte (core/moe/moe_cte/moe_cte.py: blockwise matmul) -----------------------------------
def _moe_blocks(rng, tokens, experts, top_k, block, blocks_per_iteration):
    """Each token's top-k experts; per expert its tokens in blocks of ``block`` slots padded
    with the pad token T, expert by expert, then padding blocks of the last expert up to
    N = ceil((T·K − (E − 1)) / B) + E − 1 rounded to a multiple of ``blocks_per_iteration``
    (the layout of AWS's harness, test/integration/nkilib/core/moe/moe_cte/
    test_moe_cte_common.py L95-98, L199-249)."""
    chosen = np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens)])
    count = math.ceil((tokens * top_k - (experts - 1)) / block) + experts - 1
    count = blocks_per_iteration * math.ceil(count / blocks_per_iteration)
    slots, owners = [], []
    for expert in range(experts):
        mine = [t for t in range(tokens) if expert in chosen[t]]
        for start in range(0, len(mine), block):
            part = mine[start : start + block]
            slots.append(part + [tokens] * (block - len(part)))
            owners.append(expert)
    while len(owners) < count:
        slots.append([tokens] * block)
        owners.append(experts - 1)
    return chosen, np.array(slots, np.int32).reshape(-1), np.array(owners, np.int32)


@pytest.mark.parametrize(
    "implementation, tokens, hidden, inter, experts, top_k, block",
    [
        ("shard_on_block", 128, 512, 256, 4, 2, 128),  # per-core partial outputs, summed
        ("shard_on_block", 128, 1024, 384, 4, 1, 256),
        ("shard_on_i", 128, 512, 512, 4, 2, 256),
        ("shard_on_i_hybrid", 128, 512, 512, 4, 2, 256),
    ],
)
def test_moe_cte(rng, implementation, tokens, hidden, inter, experts, top_k, block):
    """Docstring: hidden [T+1, H] (row T the pad token), affinities [(T+1)·E, 1], gate/up
    [E, H, 2, I], down [E, I, H], token_position_to_id [N·B], block_to_expert [N]: every
    block slot's token goes through its block's expert and adds affinity ·
    down(SiLU(x·gate) · (x·up)) (POST_SCALE, the default) to its output row; out [T+1, H],
    or [T+1, 2, H] (one partial sum per core) for shard_on_block with top-k > 1;
    shard_on_i_hybrid also takes conditions [N+1] (1 for a block holding tokens, AWS's
    harness, test_moe_cte_common.py L251-254). The implementations shard over the two cores
    of LNC=2 (AWS's cases for them are LNC=2 only; at LNC=1 shard_on_i indexes the other
    core's blocks, bwmm_shard_on_I.py L1685)."""
    moe = library_module("core.moe.moe_cte.moe_cte")
    per_iteration = 2 if implementation == "shard_on_block" else 1
    chosen, positions, owners = _moe_blocks(rng, tokens, experts, top_k, block, per_iteration)
    x = np.concatenate([_random(rng, (tokens, hidden), BF16), np.zeros((1, hidden), BF16)])
    affinities = np.zeros((tokens + 1, experts), np.float32)
    np.put_along_axis(affinities[:tokens], chosen, rng.random(chosen.shape), axis=1)
    affinities = affinities.astype(BF16)
    gate_up = (_random(rng, (experts, hidden, 2, inter), np.float32) / 16).astype(BF16)
    down = (_random(rng, (experts, inter, hidden), np.float32) / 16).astype(BF16)
    spec = moe.MoECTESpec(implementation=getattr(moe.MoECTEImplementation, implementation))
    args = (x, affinities.reshape(-1, 1), gate_up, down, positions, owners, block, spec)
    conditions = None
    if implementation == "shard_on_i_hybrid":  # [N+1]: 1 for the blocks holding tokens
        used = (positions.reshape(-1, block) < tokens).any(axis=1)
        conditions = np.append(used, False).astype(np.int32)
    out = np.asarray(moe.moe_cte[2](*args, conditions=conditions))
    if out.ndim == 3:
        out = out.astype(np.float64).sum(axis=1).astype(BF16)
    expected = _moe_forward_reference(x, affinities, gate_up, down, tokens)
    _check(out[:tokens], expected, BF16, scale=4.0)


# --- attention_block_tkg (experimental/transformer/attention_block_tkg.py) ---------------------
def _rotate_contiguous(x, cos, sin):
    """RoPE with contiguous halves over the last axis: [a·cos − b·sin, b·cos + a·sin]."""
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def _attention_block_reference(x, gamma, w_qkv, cos, sin, k_cache, v_cache, keep, w_out, lengths):
    """float64 attention_block_tkg (KVDP=1) from its docstring's pseudocode: (out, K_out,
    V_out); ``lengths`` the cache rows the new K, V are written at (update_cache), or None."""
    batch, tokens, _ = x.shape
    s_ctx, _, heads, _ = keep.shape
    d = w_qkv.shape[1] // (heads + 2)
    x64 = x.astype(np.float64)
    x64 = x64 / np.sqrt((x64**2).mean(axis=-1, keepdims=True) + 1e-6) * gamma.astype(np.float64)
    qkv = (x64 @ w_qkv.astype(np.float64)).reshape(batch, tokens, heads + 2, d)
    c = cos.astype(np.float64).transpose(1, 2, 0)
    s = sin.astype(np.float64).transpose(1, 2, 0)
    q = _rotate_contiguous(qkv[:, :, :heads], c[:, :, None], s[:, :, None])
    k_new, v_new = _rotate_contiguous(qkv[:, :, heads], c, s), qkv[:, :, heads + 1]
    if lengths is not None:
        expected_k, expected_v = k_cache.astype(np.float64), v_cache.astype(np.float64)
        for b, first in enumerate(lengths):
            expected_k[b, first : first + tokens] = k_new[b]
            expected_v[b, first : first + tokens] = v_new[b]
    else:
        expected_k, expected_v = k_new.transpose(2, 0, 1), v_new[:, None]
    keys, values = k_cache[:, :s_ctx].astype(np.float64), v_cache[:, :s_ctx].astype(np.float64)
    keys[:, s_ctx - tokens :], values[:, s_ctx - tokens :] = k_new, v_new
    logits = np.einsum("bshd,bkd->bhks", q, keys) / math.sqrt(d)
    logits = np.where(keep.transpose(1, 2, 0, 3), logits, -np.inf)
    weights = np.exp(logits - logits.max(axis=2, keepdims=True))
    attention = np.einsum("bhks,bkd->bhds", weights / weights.sum(axis=2, keepdims=True), values)
    if w_out is None:
        return attention, expected_k, expected_v
    w = w_out.astype(np.float64).reshape(heads, d, -1)
    out = np.einsum("bhds,hdo->bso", attention, w).reshape(batch * tokens, -1)
    return out, expected_k, expected_v


@pytest.mark.parametrize(
    "lnc, batch, tokens, hidden, heads, d, s_ctx, project, update_cache",
    [
        (1, 2, 1, 256, 2, 64, 256, True, False),
        (1, 2, 2, 256, 4, 64, 512, False, False),
        (2, 2, 1, 512, 2, 128, 512, True, False),
        (1, 2, 2, 256, 2, 64, 256, True, True),
    ],
)
def test_attention_block_tkg(
    rng, lnc, batch, tokens, hidden, heads, d, s_ctx, project, update_cache
):
    """Docstring (pseudocode): X [B, S, H] → RMSNorm(γ) → @ W_qkv [H, d·(q_heads + 2)] →
    Q, K, V heads; RoPE (cos, sin [d/2, B, S], contiguous halves) on Q and K; attention_tkg
    of Q/√d over the first S_ctx cache rows with the last S rows the new K, V, under the
    mask [S_ctx, B, q_heads, S]; @ W_out [q_heads·d, H] as [B·S, H] (or [B, q_heads, d, S]
    without W_out). K_out, V_out: the new K [d, B, S] and V [B, 1, S, d], or with
    update_cache the caches with them written at kv_cache_update_idx [B, 1]. One rank
    (KVDP=1: no collectives)."""
    block = library_module("experimental.transformer.attention_block_tkg").attention_block_tkg
    none = library_module("core.utils.common_types").QuantizationType.NONE
    x = _random(rng, (batch, tokens, hidden), BF16)
    gamma = _random(rng, (1, hidden), BF16)
    w_qkv = (_random(rng, (hidden, d * (heads + 2)), np.float32) / math.sqrt(hidden)).astype(BF16)
    angle = rng.uniform(-math.pi, math.pi, (d // 2, batch, tokens))
    cos, sin = np.cos(angle).astype(BF16), np.sin(angle).astype(BF16)
    k_cache = _random(rng, (batch, s_ctx + 64, d), BF16)
    v_cache = _random(rng, (batch, s_ctx + 64, d), BF16)
    lengths = rng.integers(1, s_ctx - tokens, batch)
    keep = np.arange(s_ctx)[:, None, None, None] < lengths[None, :, None, None]
    keep = np.broadcast_to(keep, (s_ctx, batch, heads, tokens)).copy()
    keep[s_ctx - tokens :] = np.tri(tokens, dtype=bool).T[:, None, None, :]
    w_out = (_random(rng, (heads * d, hidden), np.float32) / math.sqrt(heads * d)).astype(BF16)
    where = (lengths[:, None] + 0).astype(np.uint32) if update_cache else None
    kernel = block[lnc] if lnc == 2 else block
    out, k_out, v_out = kernel(
        x, None, True, 1e-6, gamma, w_qkv, None, none, None, None,
        False, 0.0, None, None, cos, sin, True, False, 0.0, None, None,
        False, None, k_cache, v_cache, keep.astype(BF16), None,
        update_cache, where, w_out if project else None, None, none, None, None, False, False,
    )  # fmt: skip

    expected, expected_k, expected_v = _attention_block_reference(
        x, gamma, w_qkv, cos, sin, k_cache, v_cache, keep, w_out if project else None,
        lengths if update_cache else None,
    )  # fmt: skip
    _check(k_out, expected_k, BF16, scale=4.0)
    _check(v_out, expected_v, BF16, scale=4.0)
    _check(out, expected, BF16, scale=1.0)


@pytest.mark.parametrize(
    "ranks, batch_per_rank, tokens, hidden, heads, d, s_ctx, project, update_cache",
    [
        (2, 1, 1, 256, 2, 64, 256, True, False),
        (2, 2, 2, 256, 1, 64, 256, False, True),
        (4, 1, 1, 256, 2, 64, 256, True, True),
    ],
)
def test_attention_block_tkg_kv_data_parallel(
    rng, ranks, batch_per_rank, tokens, hidden, heads, d, s_ctx, project, update_cache
):
    """Docstring (KVDP > 1, attention_block_tkg.py L235-246; attention_block_tkg_sharding.py
    L1-10): the KV cache is split over KVDP ranks along the batch, each rank holding
    B/KVDP batches; each rank projects its own q_heads Q heads (its slice of W_qkv's Q
    columns, the one K/V head shared) and its row slice of W_out; Q heads are all-gathered,
    each rank attends its batches with every head, and the outputs are all-gathered back.
    So rank r's out is the single-rank block with its own heads over the whole batch, and
    its K_out, V_out are the single-rank ones of its batches (AWS's harness slices the same
    way: test/integration/nkilib/experimental/transformer/test_attention_block_tkg.py
    L173-286, L300-348). Run on KVDP LNC=1 ranks by launch_ranks."""
    block = library_module("experimental.transformer.attention_block_tkg").attention_block_tkg
    none = library_module("core.utils.common_types").QuantizationType.NONE
    group = nki.collectives.ReplicaGroup([list(range(ranks))])
    batch, all_heads = ranks * batch_per_rank, ranks * heads
    x = _random(rng, (batch, tokens, hidden), BF16)
    gamma = _random(rng, (1, hidden), BF16)
    w_q = (_random(rng, (hidden, all_heads * d), np.float32) / math.sqrt(hidden)).astype(BF16)
    w_kv = (_random(rng, (hidden, 2 * d), np.float32) / math.sqrt(hidden)).astype(BF16)
    angle = rng.uniform(-math.pi, math.pi, (d // 2, batch, tokens))
    cos, sin = np.cos(angle).astype(BF16), np.sin(angle).astype(BF16)
    k_cache = _random(rng, (batch, s_ctx + 64, d), BF16)
    v_cache = _random(rng, (batch, s_ctx + 64, d), BF16)
    lengths = rng.integers(1, s_ctx - tokens, batch)
    keep = np.arange(s_ctx)[:, None, None, None] < lengths[None, :, None, None]
    keep = np.broadcast_to(keep, (s_ctx, batch, all_heads, tokens)).copy()
    keep[s_ctx - tokens :] = np.tri(tokens, dtype=bool).T[:, None, None, :]
    w_out = (_random(rng, (all_heads * d, hidden), np.float32) / math.sqrt(hidden)).astype(BF16)
    where = lengths[:, None].astype(np.uint32)
    inputs, expected = [], []
    for rank in range(ranks):
        mine = slice(rank * batch_per_rank, (rank + 1) * batch_per_rank)
        w_qkv = np.concatenate([w_q[:, rank * heads * d : (rank + 1) * heads * d], w_kv], axis=1)
        w_o = w_out[rank * heads * d : (rank + 1) * heads * d] if project else None
        args = (
            x, None, True, 1e-6, gamma, w_qkv, None, none, None, None,
            False, 0.0, None, None, cos, sin, True, False, 0.0, None, None,
            False, None, k_cache[mine], v_cache[mine], keep[:, mine].astype(BF16), None,
            update_cache, where[mine] if update_cache else None, w_o, None, none, None, None,
            False, False,
        )  # fmt: skip
        inputs.append((args, {"KVDP": ranks, "KVDP_replica_group": group}))
        out, k_out, v_out = _attention_block_reference(
            x, gamma, w_qkv, cos, sin, k_cache, v_cache, keep[:, :, :heads], w_o,
            lengths if update_cache else None,
        )  # fmt: skip
        k_out = k_out[mine] if update_cache else k_out[:, mine]
        expected.append((out, k_out, v_out[mine]))
    for result, reference in zip(nki.launch_ranks(block, inputs), expected):
        out, k_out, v_out = result
        _check(k_out, reference[1], BF16, scale=4.0)
        _check(v_out, reference[2], BF16, scale=4.0)
        if not project:
            # the docstring's [B, q_heads, d, S] (L259-260) is, under KVDP, the SBUF tile
            # [d, B·q_heads·S] copied out as it is (attention_block_tkg.py L455, L567-576)
            out = np.asarray(out).reshape(d, batch, heads, tokens).transpose(1, 2, 0, 3)
        _check(out, reference[0], BF16, scale=1.0)


@pytest.mark.parametrize(
    "lnc, batch, heads, active, s_prior, d, block_len, dtype",
    [
        (1, 2, 2, 1, 1024, 64, 16, np.float32),
        (2, 2, 2, 2, 2048, 64, 16, np.float32),
        (1, 1, 2, 1, 4096, 128, 32, np.float32),
        # bf16 with d_head 128: K blocks load by an indirect dma_transpose
        (1, 2, 2, 1, 1024, 128, 16, BF16),
        (2, 2, 2, 1, 2048, 128, 16, BF16),
    ],
)
def test_attention_tkg_block_kv(rng, lnc, batch, heads, active, s_prior, d, block_len, dtype):
    """Docstring (block KV cache): k_prior, v_prior [blocks, block_len, d], the batch's
    keys the blocks active_blocks_table [B, s_prior / block_len] (uint32) names, in order;
    the mask is in the kernel's block layout, per core's share of s_prior: row f·128 + p
    holds key fold·L·128 + p·L + f mod L, fold = f // L, L the block length the kernel
    resizes to (AWS's resize_cache_block_len_for_attention_tkg_kernel, the gen_mask_tkg
    docstring); not strided MM1 ("Block KV requires MM1 to not be strided"). bf16 blocks
    with d_head 128 load through dma_transpose from a vector_offset source
    (attention_tkg.py L821, L1642-1664)."""
    utils = library_module("core.attention.attention_tkg_utils")
    config = utils.AttnTKGConfig(
        bs=batch,
        q_head=heads,
        s_active=active,
        curr_sprior=s_prior,
        full_sprior=s_prior,
        d_head=d,
        block_len=block_len,
        tp_k_prior=True,
        qk_in_sb=True,
        strided_mm1=False,
    )
    per_batch = s_prior // block_len
    spare = batch * per_batch + 3
    q = (_random(rng, (batch, d, heads, active), np.float32) / math.sqrt(d)).astype(dtype)
    k_active = _random(rng, (batch, d, active), dtype)
    v_active = _random(rng, (batch, 1, active, d), dtype)
    k_blocks = _random(rng, (spare, block_len, d), dtype)
    v_blocks = _random(rng, (spare, block_len, d), dtype)
    table = np.stack([rng.permutation(spare)[:per_batch] for _ in range(batch)]).astype(np.uint32)
    lengths = rng.integers(1, s_prior - active, batch)
    keep = np.arange(s_prior)[:, None, None, None] < lengths[None, :, None, None]
    keep = np.broadcast_to(keep, (s_prior, batch, heads, active)).copy()
    keep[s_prior - active :] = np.tri(active, dtype=bool).T[:, None, None, :]
    resized, _ = utils.resize_cache_block_len_for_attention_tkg_kernel(
        per_batch, block_len, lnc, 128, batch, heads, active, full_sprior=s_prior
    )
    share = s_prior // lnc
    rows = np.concatenate([core * share + _mask_rows(share, resized) for core in range(lnc)])
    mask = keep[rows].astype(np.uint8)

    attention_tkg = library_module("core.attention.attention_tkg").attention_tkg
    sbuf_manager = library_module("core.utils.allocator").SbufManager
    logger = library_module("core.utils.logging").Logger
    nl, nisa = nki.language, nki.isa

    def attention(q, k_active, v_active, k_prior, v_prior, mask, table):
        sbm = sbuf_manager(0, nl.tile_size.sbuf_fmax_bytes - 16 * 1024, logger("attention"))
        sbm.open_scope()
        q_sb = sbm.alloc_stack(q.shape, dtype=q.dtype, buffer=nl.sbuf)
        k_sb = sbm.alloc_stack(k_active.shape, dtype=k_active.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=q_sb, src=q)
        nisa.dma_copy(dst=k_sb, src=k_active)
        shape = (config.bs, config.q_head, config.d_head, config.s_active)
        out = nl.ndarray(shape, dtype=q.dtype, buffer=nl.shared_hbm)
        out, _ = attention_tkg(
            q_sb, k_sb, v_active, k_prior, v_prior, mask, out, config, sbm,
            active_blocks_table=table,
        )  # fmt: skip
        sbm.close_scope()
        return out

    q_in = q.transpose(1, 0, 2, 3).reshape(d, -1).copy()
    k_in = k_active.transpose(1, 0, 2).reshape(d, -1).copy()
    args = (q_in, k_in, v_active, k_blocks, v_blocks, mask, table)
    out = _launch(nki.jit(attention), lnc, *args)
    keys = k_blocks[table].reshape(batch, s_prior, d).astype(np.float64)
    values = v_blocks[table].reshape(batch, s_prior, d).astype(np.float64)
    keys[:, s_prior - active :] = k_active.transpose(0, 2, 1)
    values[:, s_prior - active :] = v_active[:, 0]
    logits = np.einsum("bdhq,bkd->bhkq", q.astype(np.float64), keys)
    logits = np.where(keep.transpose(1, 2, 0, 3), logits, -np.inf)
    weights = np.exp(logits - logits.max(axis=2, keepdims=True))
    expected = np.einsum("bhkq,bkd->bhdq", weights / weights.sum(axis=2, keepdims=True), values)
    _check(out, expected, dtype, scale=4.0)


# --- find_nonzero_indices_with_count (experimental/benchmark/) ---------------------------------
@pytest.mark.parametrize("length, dtype", [(64, np.float32), (500, np.int32), (2048, np.float32)])
def test_find_nonzero_indices_with_count(rng, length, dtype):
    """Docstring: input [1, T] (float32 or int32) → int32 [1, T + 1]: the indices of the
    nonzero elements, then −1, and the count in the last position."""
    find = library_module("experimental.benchmark.find_nonzero_indices_with_count")
    x = np.where(rng.random((1, length)) < 0.3, rng.integers(1, 5, (1, length)), 0).astype(dtype)
    out = np.asarray(find.find_nonzero_indices_with_count(x))
    hits = np.flatnonzero(x[0])
    expected = np.full((1, length + 1), -1, np.int32)
    expected[0, : hits.size] = hits
    expected[0, length] = hits.size
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, expected)


# --- moe_block_tkg (core/moe_block/moe_block_tkg.py) -------------------------------------------
@pytest.mark.parametrize(
    "batch, hidden, inter, experts, top_k, router_act",
    [(2, 256, 256, 8, 2, "SOFTMAX"), (4, 512, 256, 8, 2, "SIGMOID")],
)
def test_moe_block_tkg(rng, batch, hidden, inter, experts, top_k, router_act):
    """Docstring (pseudocode): RMSNorm(x [B, S, H], γ) → router logits @ W [H, E] (bf16
    matmul), affinities act(logits) (softmax or sigmoid), top-k; out [T, H] = Σ over the
    token's k experts of affinity · down(SiLU(x·gate) · (x·up)) (POST_SCALE); LNC=2 ("Requires
    LNC-2 sharding configuration"). The experts are chosen from the kernel's own logits
    (checked against the reference first), so a near tie cannot flip the choice."""
    moe_block_tkg = library_module("core.moe_block.moe_block_tkg").moe_block_tkg
    types = library_module("core.utils.common_types")
    x = _random(rng, (batch, 1, hidden), BF16)
    gamma = _random(rng, (1, hidden), BF16)
    router = (_random(rng, (hidden, experts), np.float32) / math.sqrt(hidden)).astype(BF16)
    gate_up = (_random(rng, (experts, hidden, 2, inter), np.float32) / 16).astype(BF16)
    down = (_random(rng, (experts, inter, hidden), np.float32) / 16).astype(BF16)
    out, logits = moe_block_tkg[2](
        x,
        gamma,
        router,
        gate_up,
        down,
        top_k=top_k,
        router_act_fn=getattr(types.RouterActFnType, router_act),
        expert_affinities_scaling_mode=types.ExpertAffinityScaleMode.POST_SCALE,
    )
    x64 = x.astype(np.float64).reshape(batch, hidden)
    x64 = x64 / np.sqrt((x64**2).mean(axis=-1, keepdims=True) + 1e-6) * gamma.astype(np.float64)
    _check(logits, x64 @ router.astype(np.float64), BF16, scale=4.0)
    chosen_logits = np.asarray(logits).astype(np.float64)
    if router_act == "SOFTMAX":
        affinity = _softmax(chosen_logits)
    else:
        affinity = 1.0 / (1.0 + np.exp(-chosen_logits))
    top = np.argsort(-affinity, axis=1, kind="stable")[:, :top_k]
    weight = np.zeros((experts, batch))
    for token, picked in enumerate(top):
        weight[picked, token] = affinity[token, picked]
    gate = np.einsum("th,ehi->eti", x64, gate_up[:, :, 0].astype(np.float64))
    up = np.einsum("th,ehi->eti", x64, gate_up[:, :, 1].astype(np.float64))
    per_expert = np.einsum("eti,eih->eth", _silu(gate) * up, down.astype(np.float64))
    _check(out, np.einsum("et,eth->th", weight, per_expert), BF16, scale=4.0)


def _moe_forward_reference(x, affinities, gate_up, down, tokens):
    """Σ over each token's experts of affinity · down(SiLU(x·gate) · (x·up)), [T, H]."""
    x64 = x[:tokens].astype(np.float64)
    gate = np.einsum("th,ehi->eti", x64, gate_up[:, :, 0].astype(np.float64))
    up = np.einsum("th,ehi->eti", x64, gate_up[:, :, 1].astype(np.float64))
    per_expert = np.einsum("eti,eih->eth", _silu(gate) * up, down.astype(np.float64))
    return np.einsum("te,eth->th", affinities[:tokens].astype(np.float64), per_expert)


def test_moe_cte_dropping(rng):
    """Docstring (shard_on_i_dropping): one block per expert (N = E, block_to_expert =
    0..E−1), each B token ids, every (token, expert) affinity live (AWS's harness,
    test_moe_cte_common.py L109-138, L166-171); out as moe_cte's. The kernel walks each block
    in 1024-token tiles ("Used for training with large block sizes (B >= 1024)",
    bwmm_shard_on_I.py L1890-1893, MAX_BLOCK_TILE_SIZE L44): a smaller block computes
    nothing, so B = 1024 here."""
    moe = library_module("core.moe.moe_cte.moe_cte")
    tokens, hidden, inter, experts, block = 1024, 512, 512, 2, 1024
    slots = np.stack([rng.permutation(tokens)[:block] for _ in range(experts)]).astype(np.int32)
    x = np.concatenate([_random(rng, (tokens, hidden), BF16), np.zeros((1, hidden), BF16)])
    affinities = np.concatenate([rng.random((tokens, experts)), np.zeros((1, experts))])
    affinities = affinities.astype(BF16)
    gate_up = (_random(rng, (experts, hidden, 2, inter), np.float32) / 16).astype(BF16)
    down = (_random(rng, (experts, inter, hidden), np.float32) / 16).astype(BF16)
    spec = moe.MoECTESpec(implementation=moe.MoECTEImplementation.shard_on_i_dropping)
    owners = np.arange(experts, dtype=np.int32)
    out = moe.moe_cte[2](
        x, affinities.reshape(-1, 1), gate_up, down, slots.reshape(-1), owners, block, spec
    )[0]
    chosen = np.zeros((tokens + 1, experts), bool)
    for expert, tokens_of in enumerate(slots):
        chosen[tokens_of, expert] = True
    live = np.where(chosen, affinities.astype(np.float64), 0.0)
    expected = _moe_forward_reference(x, live, gate_up, down, tokens)
    _check(np.asarray(out)[:tokens], expected, BF16, scale=4.0)


@pytest.mark.parametrize(
    "tokens, hidden, inter, experts, top_k, block",
    [(128, 512, 256, 4, 2, 128), (256, 1024, 256, 2, 1, 256)],
)
def test_blockwise_mm_shard_hidden(rng, tokens, hidden, inter, experts, top_k, block):
    """Docstring (experimental/moe/forward/bwmm_shard_on_H.py): moe_cte's blockwise MLP with
    H sharded over the two cores of LNC=2; the same inputs and output [T+1, H]."""
    forward = library_module("experimental.moe.forward.bwmm_shard_on_H")
    chosen, positions, owners = _moe_blocks(rng, tokens, experts, top_k, block, 1)
    x = np.concatenate([_random(rng, (tokens, hidden), BF16), np.zeros((1, hidden), BF16)])
    affinities = np.zeros((tokens + 1, experts), np.float32)
    np.put_along_axis(affinities[:tokens], chosen, rng.random(chosen.shape), axis=1)
    affinities = affinities.astype(BF16)
    gate_up = (_random(rng, (experts, hidden, 2, inter), np.float32) / 16).astype(BF16)
    down = (_random(rng, (experts, inter, hidden), np.float32) / 16).astype(BF16)
    out = forward.blockwise_mm_baseline_shard_hidden[2](
        x, affinities.reshape(-1, 1), gate_up, down, block, positions, owners.reshape(-1, 1)
    )
    expected = _moe_forward_reference(x, affinities, gate_up, down, tokens)
    _check(np.asarray(out)[:tokens], expected, BF16, scale=4.0)


# --- blockwise_mm_bwd (experimental/moe/bwd/blockwise_mm_backward.py) --------------------------
@pytest.mark.parametrize(
    "tokens, hidden, inter, experts, top_k, block", [(256, 256, 128, 2, 1, 256)]
)
def test_blockwise_mm_bwd(rng, tokens, hidden, inter, experts, top_k, block):
    """Docstring: the backward of moe_cte's blockwise MLP (POST_SCALE affinities) from the
    checkpointed gate/up activations [N, 2, I, B] (before the activation, transposed) and
    down activations [N, B, H] (before the affinity), as AWS's harness builds them
    (test/integration/nkilib/experimental/moe/test_bwmm_bwd_common.py L103-191): with
    h = SiLU(g)·u, dV = a·dy, dH = dV·Wdᵀ, dg = dH·u·SiLU'(g), du = dH·SiLU(g):
    d hidden = dg·Wgᵀ + du·Wuᵀ, dWd = hᵀ·dV, dWg/dWu = xᵀ·dg / xᵀ·du. LNC=2 (AWS's cases).
    The affinity gradient is not checked: core 1 zeroes it expert-major
    (bwmm_bwd_dropless.py L120-127) with no barrier after core 0 has scattered its tiles
    token-major (L686-696), a race the simulator's schedule (core 0 first) loses."""
    backward = library_module("experimental.moe.bwd.blockwise_mm_backward").blockwise_mm_bwd
    chosen, positions, owners = _moe_blocks(rng, tokens, experts, top_k, block, 1)
    slots = positions.reshape(-1, block)
    x = np.concatenate([_random(rng, (tokens, hidden), BF16), np.zeros((1, hidden), BF16)])
    affinities = np.zeros((tokens + 1, experts), np.float32)
    np.put_along_axis(affinities[:tokens], chosen, rng.random(chosen.shape), axis=1)
    affinities = affinities.astype(BF16)
    gate_up = (_random(rng, (experts, hidden, 2, inter), np.float32) / 16).astype(BF16)
    down = (_random(rng, (experts, inter, hidden), np.float32) / 16).astype(BF16)
    dy = np.concatenate([_random(rng, (tokens, hidden), BF16), np.zeros((1, hidden), BF16)])
    x64, dy64, a64 = (v.astype(np.float64) for v in (x, dy, affinities))
    pre = np.einsum("nbh,nhci->ncib", x64[slots], gate_up[owners].astype(np.float64))
    g, u = pre[:, 0].transpose(0, 2, 1), pre[:, 1].transpose(0, 2, 1)  # [N, B, I]
    down_act = np.einsum("nbi,nih->nbh", _silu(g) * u, down[owners].astype(np.float64))
    dx, _, d_gate_up, d_down = backward[2](
        x,
        affinities.reshape(-1, 1),
        gate_up,
        down,
        pre.astype(BF16),
        down_act.astype(BF16),
        positions,
        owners.reshape(-1, 1),
        dy,
        block,
    )
    weight = a64[slots, owners[:, None]][..., None]  # [N, B, 1]
    d_value = dy64[slots] * weight
    d_hidden = np.einsum("nbh,nih->nbi", d_value, down[owners].astype(np.float64))
    sig = 1.0 / (1.0 + np.exp(-g))
    dg, du = d_hidden * u * sig * (1 + g * (1 - sig)), d_hidden * g * sig
    w_gate = gate_up[owners, :, 0].astype(np.float64)
    w_up = gate_up[owners, :, 1].astype(np.float64)
    expected_dx = np.zeros((tokens + 1, hidden))
    np.add.at(
        expected_dx,
        slots,
        np.einsum("nbi,nhi->nbh", dg, w_gate) + np.einsum("nbi,nhi->nbh", du, w_up),
    )
    expected_gate_up = np.zeros((experts, hidden, 2, inter))
    expected_down = np.zeros((experts, inter, hidden))
    for n, expert in enumerate(owners):
        rows = x64[slots[n]]
        expected_gate_up[expert, :, 0] += rows.T @ dg[n]
        expected_gate_up[expert, :, 1] += rows.T @ du[n]
        expected_down[expert] += (_silu(g[n]) * u[n]).T @ d_value[n]
    _check(np.asarray(dx)[:tokens], expected_dx[:tokens], BF16, scale=4.0)
    # bf16 sums over a block's 256 tokens
    _check(d_gate_up, expected_gate_up, BF16, scale=np.abs(expected_gate_up).max())
    _check(d_down, expected_down, BF16, scale=np.abs(expected_down).max())


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


# --- interleave_copy (core/utils/interleave_copy.py) -------------------------------------------
@pytest.mark.parametrize("index", [0, 1])  # even: Scalar engine, odd: Vector engine
@pytest.mark.parametrize("with_scale, with_bias", [(False, False), (True, False), (True, True)])
def test_interleave_copy(rng, index, with_scale, with_bias):
    """Docstring: dst = src (· scale) (+ bias), scale and bias per-partition [P, 1] views,
    on the Scalar engine for an even ``index`` and the Vector engine for an odd one."""
    interleave_copy = library_module("core.utils.interleave_copy").interleave_copy
    tensor_view = library_module("core.utils.tensor_view").TensorView
    nl, nisa = nki.language, nki.isa

    def copy(src, scale, bias):
        tiles = []
        for t in (src, scale, bias):
            tile = nl.ndarray(t.shape, dtype=t.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=tile, src=t)
            tiles.append(tile)
        dst = nl.ndarray(src.shape, dtype=src.dtype, buffer=nl.sbuf)
        interleave_copy(
            dst,
            tiles[0],
            scale=tensor_view(tiles[1]) if with_scale else None,
            bias=tensor_view(tiles[2]) if with_bias else None,
            index=index,
        )
        return _store_tile(dst)

    src = _random(rng, (64, 96), np.float32)
    scale, bias = _random(rng, (64, 1), np.float32), _random(rng, (64, 1), np.float32)
    expected = src.astype(np.float64)
    if with_scale:
        expected = expected * scale
    if with_bias:
        expected = expected + bias
    _check(nki.jit(copy)(src, scale, bias), expected, np.float32, scale=4.0)


# --- qkv_cte FP8 KV cache (core/qkv/qkv_cte.py _quantize_and_store_kv) ------------------------
@pytest.mark.parametrize(
    "lnc, batch, seq, hidden, q_heads, kv_heads, d_head, block_size",
    [
        (1, 1, 128, 256, 2, 1, 64, None),
        (1, 2, 128, 256, 2, 1, 64, 32),
        (2, 1, 256, 256, 4, 2, 64, 64),
    ],
)
def test_qkv_fp8_kv_cache(rng, lnc, batch, seq, hidden, q_heads, kv_heads, d_head, block_size):
    """Docstring (qkv_cte, _quantize_and_store_kv): with k_scale and v_scale [128, 1] the
    kernel returns Q [B, S, q_dim] and writes K, V of each token as
    clamp(value / scale, fp8_min, fp8_max) in ``kv_dtype`` (default range ±240 for
    float8_e4m3, kernel_helpers.get_max_positive_value_for_dtype) into k_cache, v_cache
    [B, max_seq_len, kv_dim] at positions 0..S-1, or, with use_block_kv, into the cache row
    slot_mapping[b, s] of [num_blocks, block_size, kv_dim] (indirect DMA on the slot)."""
    qkv = library_module("core.qkv.qkv").qkv
    fp8 = np.dtype(ml_dtypes.float8_e4m3)
    q_dim, kv_dim = q_heads * d_head, kv_heads * d_head
    x = _random(rng, (batch, seq, hidden), BF16)
    w = (_random(rng, (hidden, q_dim + 2 * kv_dim), np.float32) / math.sqrt(hidden)).astype(BF16)
    k_scale, v_scale = np.float32(0.02), np.float32(0.01)
    kwargs = {
        "k_scale": np.full((128, 1), k_scale, np.float32),
        "v_scale": np.full((128, 1), v_scale, np.float32),
        "kv_dtype": nki.language.float8_e4m3,
        "d_head": d_head,
        "num_q_heads": q_heads,
        "num_kv_heads": kv_heads,
    }
    if block_size is None:
        cache_shape = (batch, seq + 64, kv_dim)
        rows = np.arange(batch * seq).reshape(batch, seq) // seq * (seq + 64) + np.arange(seq)
    else:
        blocks = 2 * batch * seq // block_size
        cache_shape = (blocks, block_size, kv_dim)
        slots = rng.permutation(blocks * block_size)[: batch * seq].astype(np.int32)
        rows = slots.reshape(batch, seq)
        kwargs.update(use_block_kv=True, block_size=block_size, slot_mapping=rows.copy())
    initial = rng.uniform(-8, 8, cache_shape).astype(fp8)
    k_cache, v_cache = initial.copy(), initial.copy()
    q, k_out, v_out = _launch(qkv, lnc, x, w, k_cache=k_cache, v_cache=v_cache, **kwargs)
    projected = x.astype(np.float64) @ w.astype(np.float64)
    _check(q, projected[:, :, :q_dim], BF16, scale=4.0)
    written = np.zeros(initial.shape[0] * initial.shape[1], bool)
    written[rows.ravel()] = True
    for cache, offset, scale in ((k_out, q_dim, k_scale), (v_out, q_dim + kv_dim, v_scale)):
        cache = np.asarray(cache)
        assert cache.dtype == fp8 and cache.shape == initial.shape
        flat = cache.reshape(-1, kv_dim)
        expected = np.clip(projected[:, :, offset : offset + kv_dim] / float(scale), -240, 240)
        actual = flat[rows.ravel()].astype(np.float64).reshape(expected.shape)
        # e4m3 keeps 3 fraction bits (half an ulp: 2^-4 relative) on top of the bf16 product
        assert np.allclose(actual, expected, rtol=0.08, atol=0.02 / float(scale)), np.abs(
            actual - expected
        ).max()
        untouched = initial.reshape(-1, kv_dim)[~written]
        assert (flat[~written].view(np.uint8) == untouched.view(np.uint8)).all()


# --- attention_tkg with an FP8 KV cache (core/attention/attention_tkg.py L749-821) ------------
@pytest.mark.parametrize(
    "lnc, batch, heads, active, s_prior, d, tp_k_prior",
    [
        (1, 2, 2, 1, 256, 64, False),
        (1, 2, 4, 2, 512, 128, True),
        (2, 2, 2, 1, 1024, 64, False),
    ],
)
def test_attention_tkg_fp8_kv(rng, lnc, batch, heads, active, s_prior, d, tp_k_prior):
    """Docstring (AttnTKGConfig, is_fp8_kv): k_active, v_active, k_prior, v_prior all
    float8_e4m3 (no scales: the fp8 values are the keys and values), q bf16 in SBUF, no
    fused RoPE; the prior keys are loaded as bf16 (L820). Same attention as the bf16 case:
    softmax over the masked keys [s_prior, B, H, s_active] with the last s_active keys
    replaced by k_active."""
    config_type = library_module("core.attention.attention_tkg_utils").AttnTKGConfig
    fp8 = np.dtype(ml_dtypes.float8_e4m3)
    config = config_type(
        bs=batch,
        q_head=heads,
        s_active=active,
        curr_sprior=s_prior,
        full_sprior=s_prior,
        d_head=d,
        tp_k_prior=tp_k_prior,
        qk_in_sb=True,
    )
    q = (_random(rng, (batch, d, heads, active), np.float32) / math.sqrt(d)).astype(BF16)
    k_active = _random(rng, (batch, d, active), fp8)
    v_active = _random(rng, (batch, 1, active, d), fp8)
    k_prior = _random(rng, (batch, 1, d, s_prior), fp8)
    v_prior = _random(rng, (batch, 1, s_prior, d), fp8)
    lengths = rng.integers(1, s_prior - active, batch)
    key = np.arange(s_prior)[:, None, None, None]
    keep = np.broadcast_to(key < lengths[None, :, None, None], (s_prior, batch, heads, active))
    keep = keep.copy()
    keep[s_prior - active :] = np.tri(active, dtype=bool).T[:, None, None, :]
    q_in = q.transpose(1, 0, 2, 3).reshape(d, -1).copy()
    k_in = k_active.transpose(1, 0, 2).reshape(d, -1).copy()
    k_prior_in = k_prior.transpose(0, 1, 3, 2).copy() if tp_k_prior else k_prior
    kernel = _attention_tkg_kernel(config, fuse_rope=False)
    mask = keep.astype(np.uint8)
    out = _launch(kernel, lnc, q_in, k_in, v_active, k_prior_in, v_prior, mask, None, None, None)

    keys, values = k_prior[:, 0].astype(np.float64), v_prior[:, 0].astype(np.float64)
    keys[:, :, s_prior - active :] = k_active.astype(np.float64)
    values[:, s_prior - active :] = v_active[:, 0].astype(np.float64)
    logits = np.einsum("bdhq,bdk->bhkq", q.astype(np.float64), keys)
    logits = np.where(keep.transpose(1, 2, 0, 3), logits, -np.inf)
    weights = np.exp(logits - logits.max(axis=2, keepdims=True))
    expected = np.einsum("bhkq,bkd->bhdq", weights / weights.sum(axis=2, keepdims=True), values)
    _check(out, expected, BF16, scale=4.0)


# --- mlp_cte, mlp_tkg with FP8 quantization (core/mlp/, QuantizationType STATIC and ROW) ------
def _mlp_fp8_kernel(token_generation, quantization):
    """_mlp_kernel's harness with the FP8 quantization parameters of MLPParameters and a
    bf16 output (output_dtype, mlp.py L150) whatever the input dtype."""
    parameters = library_module("core.mlp.mlp_parameters").MLPParameters
    mlp_cte = library_module("core.mlp.mlp_cte.mlp_cte").mlp_cte
    mlp_tkg = library_module("core.mlp.mlp_tkg.mlp_tkg").mlp_tkg
    sbuf_manager = library_module("core.utils.allocator").SbufManager
    logger = library_module("core.utils.logging").Logger
    act_type = library_module("core.utils.common_types").ActFnType
    nl = nki.language

    def mlp(x, gate, up, down, gate_scale, up_scale, down_scale, in_scale, down_in_scale):
        params = parameters(
            hidden_tensor=x,
            gate_proj_weights_tensor=gate,
            up_proj_weights_tensor=up,
            down_proj_weights_tensor=down,
            activation_fn=act_type.SiLU,
            quantization_type=quantization,
            gate_w_scale=gate_scale,
            up_w_scale=up_scale,
            down_w_scale=down_scale,
            gate_up_in_scale=in_scale,
            down_in_scale=down_in_scale,
            output_dtype=nl.bfloat16,
            force_cte_mode=not token_generation,
        )
        out = nl.ndarray(x.shape, dtype=nl.bfloat16, buffer=nl.shared_hbm)
        if token_generation:
            mlp_tkg(params, out, None, sbm=sbuf_manager(0, 200 * 1024, logger("mlp")))
        else:
            mlp_cte(params, out, None)
        return out

    return nki.jit(mlp)


@pytest.mark.parametrize(
    "lnc, tkg, batch, seq, hidden, inter, quantization",
    [
        (1, False, 1, 128, 256, 512, "STATIC"),
        (2, False, 1, 256, 512, 512, "STATIC"),
        (1, True, 2, 1, 256, 512, "STATIC"),
        (1, True, 2, 1, 256, 512, "ROW"),
        (2, True, 4, 1, 512, 1024, "ROW"),
        # FP8 through the MX engine (Trn3): 256-token tiles at least per core
        (1, False, 1, 256, 512, 512, "STATIC_MX"),
        (2, False, 1, 512, 1024, 1024, "STATIC_MX"),
    ],
)
def test_mlp_fp8(rng, monkeypatch, lnc, tkg, batch, seq, hidden, inter, quantization):
    """Docstring (mlp.py L123-149, MLPParameters._validate_shapes): float8_e4m3 gate, up
    [H, I] and down [I, H] weights with dequantization scales: STATIC [128, 1] (the same
    value on every partition), ROW [128, I] ([128, H] for down) per output column. Token
    generation keeps the bf16 input: out = down(silu(x @ gate · s_g) · (x @ up · s_u)) · s_d.
    Context encoding (STATIC) takes an already quantized fp8 input with its [128, 1]
    dequantization scale s_in, dequantizes each projection by s_w · s_in and quantizes the
    intermediate h as fp8(clamp(h / s_down_in, ±240)) (±240: get_max_positive_value_for_
    dtype; mlp_cte_quantization.py L52-101) before the down projection, dequantized by
    s_d · s_down_in. STATIC_MX (context encoding) computes the same with the gate/up weights
    handed over swizzled as w.reshape(2, H/512, 128, 2, I/512, 128, 4).transpose(2, 1, 4, 6,
    5, 0, 3) and the down weights as w.reshape(I/512, 128, 4, H).transpose(1, 0, 3, 2) (the
    mlp entry's docstring, core/mlp/mlp.py@ddbca35 L127-134)."""
    if quantization == "STATIC_MX":
        monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    quantization_type = getattr(
        library_module("core.utils.common_types").QuantizationType, quantization
    )
    fp8 = np.dtype(ml_dtypes.float8_e4m3)
    x = _random(rng, (batch, seq, hidden), BF16 if tkg else fp8)
    weights = [
        (_random(rng, (hidden, inter), np.float32) * 16).astype(fp8),
        (_random(rng, (hidden, inter), np.float32) * 16).astype(fp8),
        (_random(rng, (inter, hidden), np.float32) * 16).astype(fp8),
    ]
    if quantization.startswith("STATIC"):
        w_scales = [
            np.full((128, 1), s / 16 / math.sqrt(n), np.float32)
            for s, n in ((1.0, hidden), (2.0, hidden), (0.5, inter))
        ]
        in_scales = [np.full((128, 1), s, np.float32) for s in (0.5, 0.01)]
        columns = [float(s[0, 0]) for s in w_scales]
    else:
        w_scales = [
            np.broadcast_to(rng.uniform(0.5, 1.5, (1, n)) / 16 / math.sqrt(k), (128, n))
            .astype(np.float32)
            .copy()
            for n, k in ((inter, hidden), (inter, hidden), (hidden, inter))
        ]
        in_scales = [None, None]
        columns = [s[0].astype(np.float64) for s in w_scales]
    kernel = _mlp_fp8_kernel(tkg, quantization_type)
    passed = weights
    if quantization == "STATIC_MX":
        gate_w, up_w, down_w = weights
        passed = [
            w.reshape(2, hidden // 512, 128, 2, inter // 512, 128, 4)
            .transpose(2, 1, 4, 6, 5, 0, 3)
            .reshape(hidden, inter)
            for w in (gate_w, up_w)
        ]
        passed.append(
            down_w.reshape(inter // 512, 128, 4, hidden)
            .transpose(1, 0, 3, 2)
            .reshape(inter, hidden)
        )
    out = _launch(kernel, lnc, x, *passed, *w_scales, *in_scales)

    gate, up, down = (w.astype(np.float64) * c for w, c in zip(weights, columns))
    x64 = x.astype(np.float64)
    if not tkg:
        gate, up = gate * float(in_scales[0][0, 0]), up * float(in_scales[0][0, 0])
    hidden_act = _silu(x64 @ gate) * (x64 @ up)
    if not tkg:
        down_in = float(in_scales[1][0, 0])
        quantized = np.clip(hidden_act / down_in, -240, 240).astype(fp8).astype(np.float64)
        hidden_act = quantized * down_in
    expected = hidden_act @ down
    if tkg:
        _check(out, expected, BF16, scale=4.0)
        return
    # The kernel rounds the intermediate to bf16 before its fp8 cast, so a few percent of the
    # intermediate elements land one fp8 ulp (2^-3 relative) away from the float64 ones:
    # measured 1.9 % of the output's rms (rms of the error), 14 % at worst. Bounded in rms
    # and in max; a missing scale or quantization step is off by ~100 % of the rms.
    rms = float(np.sqrt((expected**2).mean()))
    actual = np.asarray(out).astype(np.float64)
    assert np.asarray(out).dtype == BF16 and np.isfinite(actual).all()
    error = np.abs(actual - expected)
    assert np.sqrt((error**2).mean()) <= 0.04 * rms and error.max() <= 0.3 * rms


# --- attention_cte context parallel (core/attention/attention_cte.py L266-288) ----------------
@pytest.mark.parametrize(
    "lnc, seq_q, cp_degree, rank, strided, dtype",
    [
        (1, 128, 2, 1, False, np.float32),
        (1, 128, 4, 2, True, np.float32),
        (2, 256, 2, 0, False, BF16),
        (1, 128, 3, 1, True, BF16),
    ],
)
def test_attention_cte_context_parallel(rng, lnc, seq_q, cp_degree, rank, strided, dtype):
    """Docstring (Context Parallel Support): one rank's Q slice of seq_q queries against the
    full K/V of cp_degree·seq_q keys, in causal order; contiguous slicing: the queries are
    positions cp_offset + i with cp_offset = rank·seq_q; strided slicing: positions
    rank + i·cp_degree with cp_offset = rank. cp_offset is a (1, 1) HBM tensor."""
    attention_cte = library_module("core.attention.attention_cte").attention_cte
    d, seq_kv = 64, cp_degree * seq_q
    scale = 1.0  # "SWA/Prefix Caching/CP only support scale=1.0" (attention_cte.py L946)
    q = (_random(rng, (1, seq_q, d), np.float32) / math.sqrt(d)).astype(dtype)
    k = _random(rng, (1, seq_kv, d), dtype)
    v = _random(rng, (1, seq_kv, d), dtype)
    offset = rank if strided else rank * seq_q
    positions = rank + np.arange(seq_q) * cp_degree if strided else offset + np.arange(seq_q)
    out = _launch(
        attention_cte,
        lnc,
        q,
        k.transpose(0, 2, 1).copy(),
        v,
        scale=scale,
        causal_mask=True,
        cp_offset=np.array([[offset]], np.int32),
        global_cp_deg=cp_degree,
        cp_strided_q_slicing=strided,
    )
    logits = np.einsum("bqd,bkd->bqk", q.astype(np.float64), k.astype(np.float64)) * scale
    logits = np.where(np.arange(seq_kv)[None, :] <= positions[:, None], logits, -np.inf)
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    weights = weights / weights.sum(axis=-1, keepdims=True)
    expected = np.einsum("bqk,bkd->bqd", weights, v.astype(np.float64))
    _check(out, expected, dtype, scale=np.abs(v.astype(np.float64)).max(), precision=BF16)


# --- moe_tkg, all-expert MX (core/moe/moe_tkg/all_expert_mx_impl.py) -------------------------
def _mx_dequantize_layout(values, scale):
    """[128, tiles, X, 4] MX values with [16, tiles, X] e8m0 scales (one per 8 partitions and
    the 4 lanes) as float64."""
    factor = np.ldexp(1.0, scale.astype(np.int64) - 127)
    return values.astype(np.float64) * np.repeat(factor, 8, axis=0)[..., None]


def _mx_round_trip(layout):
    """quantize_mx (e4m3fn, 8 partitions x 4 lanes per scale) of a [128, tiles, X, 4] array,
    dequantized (the ISA reference's scale, as _mx_quantize_reference)."""
    values, exponent = _mx_quantize_reference(layout.reshape(128, -1), emax=8)
    scale = np.repeat(np.repeat(np.ldexp(1.0, exponent), 8, 0), 4, 1)
    return (values.astype(np.float64) * scale).reshape(layout.shape)


def _moe_mx_expert_output(
    x, gate_up, gate_up_scale, down, down_scale, gate_up_bias=None, clamps=None
):
    """One MX expert on bf16 tokens x [T, H] (float64): down(silu(x @ gate) · (x @ up)), x
    quantized online to MXFP8 e4m3fn with H split as [4, H/512, 128] onto (lane, tile,
    partition) (AWS's own torch reference, core/moe/moe_tkg/moe_tkg_torch.py L366), and the
    bf16 intermediate in its [128, I/512, T, 4] layout with I = 512c + 128q + p
    (gate_up_projection_mx_shard_H.py L165-170). gate_up [128, 2, H/512, I, 4] and down
    [128, I/512, H, 4] are the unpacked MXFP4 values with their e8m0 scales; the gate/up
    bias, when given, is [I_p, 2, I/512, 4] in the same I layout."""
    tokens, hidden = x.shape
    h_tiles, i_tiles = hidden // 512, down.shape[1]
    x_q = _mx_round_trip(
        x.astype(np.float64).reshape(tokens, 4, h_tiles, 128).transpose(3, 2, 0, 1)
    )
    gate, up = (
        np.einsum("pjtq,pjiq->ti", x_q, _mx_dequantize_layout(gate_up[:, g], gate_up_scale[:, g]))
        for g in (0, 1)
    )
    if gate_up_bias is not None:  # [I_p, 2, I/512, 4], I = 512c + 128q + p
        bias = gate_up_bias.astype(np.float64).transpose(1, 2, 3, 0).reshape(2, -1)
        gate, up = gate + bias[0], up + bias[1]
    if clamps is not None:  # (gate's upper limit, up's lower and upper limits)
        gate, up = np.minimum(gate, clamps[0]), np.clip(up, clamps[1], clamps[2])
    inter_values = (_silu(gate) * up).astype(BF16).astype(np.float64)  # bf16 compute
    layout = inter_values.reshape(tokens, i_tiles, 4, 128).transpose(3, 1, 0, 2)
    return np.einsum(
        "pctq,pchq->th", _mx_round_trip(layout), _mx_dequantize_layout(down, down_scale)
    )


def _check_mx_output(out, expected):
    """MX quantization of bf16 values the kernel rounds differently from float64 moves a few
    elements by one e4m3 ulp (2^-3): measured 1.5 % of the output's rms (rms of the error),
    17 % at worst; wrong layouts or scales are off by ~100 %."""
    rms = float(np.sqrt((expected**2).mean()))
    actual = np.asarray(out).astype(np.float64)
    assert np.isfinite(actual).all()
    error = np.abs(actual - expected)
    assert np.sqrt((error**2).mean()) <= 0.04 * rms and error.max() <= 0.3 * rms, (
        np.sqrt((error**2).mean()) / rms,
        error.max() / rms,
    )


def _moe_mx_weights(rng, local_experts, hidden, inter):
    """MXFP4 gate/up [E_L, 128, 2, H/512, I, 4] and down [E_L, 128, I/512, H, 4] values over
    their whole range, with e8m0 scales [E_L, 16, 2, H/512, I] and [E_L, 16, I/512, H]."""
    shape = (local_experts, 128, 2, hidden // 512, inter)
    gate_up = _mx_values(rng, shape + (4,), ml_dtypes.float4_e2m1fn)
    gate_up_scale = rng.integers(118, 122, (local_experts, 16) + shape[2:]).astype(np.uint8)
    down_shape = (local_experts, 128, inter // 512, hidden)
    down = _mx_values(rng, down_shape + (4,), ml_dtypes.float4_e2m1fn)
    down_scale = rng.integers(118, 122, (local_experts, 16) + down_shape[2:]).astype(np.uint8)
    return gate_up, gate_up_scale, down, down_scale


def _pack_moe_mx_weights(gate_up, down):
    return (
        pack_x4(gate_up.reshape(gate_up.shape[:-2] + (-1,)), "float4_e2m1fn_x4"),
        pack_x4(down.reshape(down.shape[:-2] + (-1,)), "float4_e2m1fn_x4"),
    )


@pytest.mark.parametrize(
    "tokens, hidden, inter, local_experts, rank",
    [(32, 512, 512, 1, 0), (64, 1024, 512, 2, 1)],
)
def test_moe_tkg_all_expert_mx(rng, monkeypatch, tokens, hidden, inter, local_experts, rank):
    """Docstring (moe_tkg, all-expert MX, LNC=2 on Trn3): hidden [T, H] bf16, MXFP4 gate/up
    [E_L, 128, 2, H/512, I] x4 with e8m0 scales [E_L, 16, 2, H/512, I], down [E_L, I_p,
    I/512, H] x4 with scales [E_L, I_p/8, I/512, H]; out = Σ_e a[t, E_L·rank_id + e] ·
    down(silu(x @ gate) · (x @ up)) (POST_SCALE)."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    moe_tkg = library_module("core.moe.moe_tkg.moe_tkg").moe_tkg
    scale_mode = library_module("core.utils.common_types").ExpertAffinityScaleMode
    experts = 2 * local_experts
    x = _random(rng, (tokens, hidden), BF16)
    gate_up, gate_up_scale, down, down_scale = _moe_mx_weights(rng, local_experts, hidden, inter)
    affinities = rng.random((tokens, experts)).astype(BF16)
    index = rng.integers(0, experts, (tokens, 1)).astype(np.int32)
    out = nki.jit(moe_tkg)[2](
        x,
        *_pack_moe_mx_weights(gate_up, down),
        affinities,
        index,
        True,
        rank_id=np.full((1, 1), rank, np.int32),
        expert_gate_up_weights_scale=gate_up_scale,
        expert_down_weights_scale=down_scale,
        expert_affinities_scaling_mode=scale_mode.POST_SCALE,
    )
    expected = np.zeros((tokens, hidden))
    for e in range(local_experts):
        weight = affinities[:, local_experts * rank + e].astype(np.float64)[:, None]
        expected += weight * _moe_mx_expert_output(
            x, gate_up[e], gate_up_scale[e], down[e], down_scale[e]
        )
    assert np.asarray(out).dtype == BF16
    _check_mx_output(out, expected)


@pytest.mark.parametrize(
    "tokens, hidden, inter, block, routed_share",
    [
        (64, 512, 1024, 32, 1.0),  # every token routed: the one dynamic block runs
        (64, 512, 1024, 16, 0.3),  # blocks without routed tokens are skipped
        (128, 1024, 1024, 32, 0.6),
    ],
)
def test_moe_tkg_all_expert_mx_dynamic(
    rng, monkeypatch, tokens, hidden, inter, block, routed_share
):
    """Docstring (moe_tkg, is_all_expert_dynamic, core/moe/moe_tkg/moe_tkg.py L133-138 and
    all_expert_mx_impl.py L109-125): one local expert; its routed tokens (nonzero affinity)
    are found with nonzero_with_count and processed in blocks of block_size, the first block
    always, the others in a dynamic loop while they hold routed tokens; each block gathers
    its tokens, runs the MX expert and scatters a·expert(x) to their rows. Rows of tokens
    not routed are never written (their indices are the -1 padding the scatter skips,
    oob_mode.skip), so they keep the fresh output's contents: the simulator's NaN.

    E = E_L = 1 and I >= 1024 at LNC=2, as every dynamic case of AWS's harness
    (test/integration/nkilib/core/moe/moe_tkg/test_moe_tkg.py L274-296: expert 1, I 3072).
    Beyond that AWS's code at d2ad3a5 (and 2.29_release) computes wrong results, by its
    docstring and by the docs: with E > 1 the LNC=2 affinity slice reads core 1's half from
    `offset=T_offset` elements of the [T, E] affinities, row T_offset/E, where `.ap`'s
    offset counts elements (nki/deep-dives/nki-aps.rst L73;
    core/moe/moe_tkg/moe_tkg_affinity_masking.py L188-190); with I < 1024 the I-sharding
    is off (all_expert_mx_utils.py L99), both cores compute the whole expert, yet the
    dynamic blocks call _compute_expert_mlp with its default shard_on_I=True
    (all_expert_mx_impl.py L974-987), whose LNC reduction then adds the two copies
    (down_projection_mx.py L399-441): every row twice the reference."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    moe_tkg = library_module("core.moe.moe_tkg.moe_tkg").moe_tkg
    scale_mode = library_module("core.utils.common_types").ExpertAffinityScaleMode
    x = _random(rng, (tokens, hidden), BF16)
    gate_up, gate_up_scale, down, down_scale = _moe_mx_weights(rng, 1, hidden, inter)
    routed = rng.random(tokens) < routed_share
    routed[rng.integers(tokens)] = True
    affinities = np.where(routed, rng.uniform(0.05, 1.0, tokens), 0.0)[:, None].astype(BF16)
    out = nki.jit(moe_tkg)[2](
        x,
        *_pack_moe_mx_weights(gate_up, down),
        affinities,
        np.zeros((tokens, 1), np.int32),
        True,
        rank_id=np.zeros((1, 1), np.int32),
        expert_gate_up_weights_scale=gate_up_scale,
        expert_down_weights_scale=down_scale,
        expert_affinities_scaling_mode=scale_mode.POST_SCALE,
        is_all_expert_dynamic=True,
        block_size=block,
    )
    expected = affinities.astype(np.float64) * _moe_mx_expert_output(
        x, gate_up[0], gate_up_scale[0], down[0], down_scale[0]
    )
    actual = np.asarray(out)
    assert actual.dtype == BF16 and actual.shape == (tokens, hidden)
    assert np.isnan(actual[~routed].astype(np.float64)).all()
    _check_mx_output(actual[routed], expected[routed])


# --- qkv and output_projection_cte, MX (QuantizationType.MX) ----------------------------------
def _mx_weights(rng, contraction, width, element):
    """MX weights over the element type's whole range: values [K/4, F, 4] (lane q of x4 row r
    is contraction index 4r + q, QKVWeightLayout.MX_CONTIGUOUS, core/utils/common_types.py
    L75-78) and e8m0 scales [K/32, F], one per 8 rows x 4 lanes."""
    values = _mx_values(rng, (contraction // 4, width, 4), element)
    scale = rng.integers(120, 126, (contraction // 32, width)).astype(np.uint8)
    return values, scale


def _mx_dequantize_rows(values, scale, axis):
    """float64 MX values with their e8m0 scales, one scale per 8 x4 rows along ``axis``."""
    factor = np.ldexp(1.0, np.repeat(scale.astype(np.int64) - 127, 8, axis=axis))
    return values.astype(np.float64) * factor[..., None]


def _mx_online_matmul(x, values, scale):
    """x [T, K] (float64) quantized online to MXFP8 e4m3fn, 32 consecutive K entries of a token
    per scale (quantize_mx on [K/4, T x4], isa L2776-2780), @ the MX weights [K/4, F, 4]."""
    tokens, contraction = x.shape
    layout = x.reshape(tokens, contraction // 4, 4).transpose(1, 0, 2).reshape(contraction // 4, -1)
    quantized, exponent = _mx_quantize_reference(layout, emax=8)
    factor = np.repeat(np.repeat(np.ldexp(1.0, exponent), 8, 0), 4, 1)
    x_q = (quantized.astype(np.float64) * factor).reshape(contraction // 4, tokens, 4)
    return np.einsum("rtq,rfq->tf", x_q, _mx_dequantize_rows(values, scale, axis=0))


@pytest.mark.parametrize(
    "lnc, batch, seq, hidden, q_heads, kv_heads, norm, swizzled, bias, residual",
    [
        (
            2,
            4,
            1,
            1024,
            2,
            1,
            "NO_NORM",
            True,
            False,
            False,
        ),  # qkv_tkg MX (AWS's cases: LNC=2, d_head 128)
        (2, 8, 1, 2048, 6, 3, "RMS_NORM", True, False, False),
        (1, 4, 1, 512, 2, 1, "NO_NORM", True, True, False),
        (1, 1, 128, 512, 2, 1, "NO_NORM", False, False, False),  # S > 96: qkv_cte MX
        (2, 2, 128, 512, 2, 1, "NO_NORM", True, True, False),
        (2, 1, 128, 1024, 2, 1, "RMS_NORM", False, False, False),
        # the fused add on qkv_cte only (the TKG MX path: "fused_add is not supported")
        (2, 1, 128, 1024, 2, 1, "RMS_NORM", False, True, True),
    ],
)
def test_qkv_mx(
    rng, monkeypatch, lnc, batch, seq, hidden, q_heads, kv_heads, norm, swizzled, bias, residual
):
    """Docstring (qkv, QuantizationType.MX, Trn3; core/qkv/qkv.py L134-144, L189-198): x [B, S,
    H] bf16, optionally RMS-normalised with γ, quantized online to MXFP8 and multiplied by
    MXFP8 weights [H/4, I] x4 (MX_CONTIGUOUS) with scales [H/32, I]: out [B, S, I] bf16. With
    is_h_dim_4h_transposed (required by qkv_tkg's MX path, qkv_tkg_mx_impl.py L70) x and γ
    come pre-shuffled from [.., H/512, 128, 4] to [.., 4, H/512, 128]; qkv_cte takes either
    (is_input_swizzled, qkv_cte.py L204-208) but normalises unswizzled input only
    (qkv_cte_utils.py L546). Optional bias [1, I] and, on qkv_cte, the fused residual add
    x + mlp_prev + attention_prev (rounded to bf16) before the norm."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    qkv = library_module("core.qkv.qkv").qkv
    types = library_module("core.utils.common_types")
    d_head = 128
    width = (q_heads + 2 * kv_heads) * d_head
    x = _random(rng, (batch, seq, hidden), BF16)
    values, scale = _mx_weights(rng, hidden, width, ml_dtypes.float8_e4m3fn)

    def shuffle(a):
        split = a.reshape(a.shape[:-1] + (hidden // 512, 128, 4))
        return np.moveaxis(split, -1, -3).reshape(a.shape) if swizzled else a

    kwargs = {"fused_norm_type": getattr(types.NormType, norm)}
    x64 = x.astype(np.float64).reshape(batch * seq, hidden)
    if residual:
        mlp_prev, attention_prev = (_random(rng, x.shape, BF16) for _ in range(2))
        kwargs.update(
            fused_residual_add=True,
            mlp_prev=shuffle(mlp_prev),
            attention_prev=shuffle(attention_prev),
        )
        summed = x64 + sum(
            t.astype(np.float64).reshape(x64.shape) for t in (mlp_prev, attention_prev)
        )
        x64 = summed.astype(BF16).astype(np.float64)
    if norm == "RMS_NORM":
        gamma = _random(rng, (1, hidden), BF16)
        kwargs["gamma_norm_weights"] = shuffle(gamma)
        x64 = x64 / np.sqrt((x64**2).mean(axis=-1, keepdims=True) + 1e-6)
        # the kernels round the normalised x to bf16 before quantize_mx
        x64 = (x64 * gamma.astype(np.float64)).astype(BF16).astype(np.float64)
    if bias:
        kwargs["bias"] = _random(rng, (1, width), BF16)
    out = _launch(
        qkv,
        lnc,
        shuffle(x),
        pack_x4(values.reshape(hidden // 4, 4 * width), "float8_e4m3fn_x4"),
        quantization_type=types.QuantizationType.MX,
        qkv_w_scale=scale,
        is_h_dim_4h_transposed=swizzled,
        weight_layout=types.QKVWeightLayout.MX_CONTIGUOUS,
        d_head=d_head,
        num_q_heads=q_heads,
        num_kv_heads=kv_heads,
        **kwargs,
    )
    expected = _mx_online_matmul(x64, values, scale).reshape(batch, seq, width)
    if bias:
        expected = expected + kwargs["bias"].astype(np.float64)
    assert np.asarray(out).dtype == BF16 and np.asarray(out).shape == expected.shape
    _check_mx_output(out, expected)


@pytest.mark.parametrize(
    "lnc, batch, heads, d_head, seq, hidden, bias, prequantized",
    [
        (1, 1, 2, 64, 128, 512, False, False),
        (2, 2, 4, 64, 256, 1024, True, False),
        (1, 1, 1, 512, 128, 512, False, True),  # pre-quantized MXFP8 input, [B, 1, K/4, S] x4
        (2, 2, 1, 1024, 256, 1024, True, True),
    ],
)
def test_output_projection_cte_mx(
    rng, monkeypatch, lnc, batch, heads, d_head, seq, hidden, bias, prequantized
):
    """Docstring (output_projection_cte, QuantizationType.MX, Trn3; output_projection_cte.py
    L64-71, output_projection_cte_quantization.py L478-513): out [B, S, H] bf16 = attention
    [B, N, D, S] contracted over K = N·D with MXFP4 weights [K/4, H] x4 (scales [K/32, H]) +
    bias. A bf16 attention is quantized online to MXFP8 (32 consecutive K entries of a token
    per scale); a pre-quantized one comes as float8_e4m3fn_x4 [B, 1, K/4, S] with scales
    [B, K/32, S] (AWS's harness: test/integration/nkilib/core/output_projection/
    test_output_proj_cte.py L116-135), lane q of row r being K index 4r + q."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    module = library_module("core.output_projection.output_projection_cte.output_projection_cte")
    types = library_module("core.utils.common_types")
    contraction = heads * d_head
    values, scale = _mx_weights(rng, contraction, hidden, ml_dtypes.float4_e2m1fn)
    weights = pack_x4(values.reshape(contraction // 4, 4 * hidden), "float4_e2m1fn_x4")
    kwargs = {"quantization_type": types.QuantizationType.MX, "weight_scales": scale}
    if prequantized:
        act = _mx_values(rng, (batch, contraction // 4, seq, 4), ml_dtypes.float8_e4m3fn)
        act_scale = rng.integers(120, 126, (batch, contraction // 32, seq)).astype(np.uint8)
        attention = pack_x4(act.reshape(batch, 1, contraction // 4, 4 * seq), "float8_e4m3fn_x4")
        kwargs["input_scales"] = act_scale
        expected = np.einsum(
            "brsq,rhq->bsh",
            _mx_dequantize_rows(act, act_scale, axis=1),
            _mx_dequantize_rows(values, scale, axis=0),
        )
    else:
        attention = _random(rng, (batch, heads, d_head, seq), BF16)
        tokens = attention.astype(np.float64).reshape(batch, contraction, seq).transpose(0, 2, 1)
        expected = np.stack([_mx_online_matmul(t, values, scale) for t in tokens])
    if bias:
        kwargs["bias"] = _random(rng, (1, hidden), BF16)
        expected = expected + kwargs["bias"].astype(np.float64)
    out = _launch(nki.jit(module.output_projection_cte), lnc, attention, weights, **kwargs)
    assert np.asarray(out).dtype == BF16 and np.asarray(out).shape == expected.shape
    _check_mx_output(out, expected)


# --- mlp_tkg_mx and the mlp entry (core/mlp/) ---------------------------------------------------
def _mlp_entry():
    """AWS's ``mlp`` entry, or a skip naming why the checkout cannot import it: at d2ad3a5
    core/mlp/mlp.py does not parse (the end of its docstring is pasted a second time after
    it, L203-213); 2.29_release (ddbca35) holds the same kernels with a parsable entry."""
    try:
        return library_module("core.mlp.mlp").mlp
    except SyntaxError as error:
        pytest.skip(f"this nki-library checkout's core/mlp/mlp.py does not parse: {error}")


def _mlp_mx_case(rng, batch, seq, hidden, inter, rms):
    """Inputs and float64 reference of an MX MLP (docstring of mlp_tkg_mx,
    core/mlp/mlp_tkg/mlp_tkg_mx.py L58-110): bf16 x [B, S, H], optionally RMS-normalised with
    γ (rounded to bf16 before quantize_mx), MXFP4 gate and up [128, H/512, I] x4 with scales
    [16, H/512, I], down [128, I/512, H] x4 with scales [16, I/512, H]; one expert of the MX
    MoE's computation (same layouts, gate_up_projection_mx_shard_H.py L165-170)."""
    gate_up, gate_up_scale, down, down_scale = (
        a[0] for a in _moe_mx_weights(rng, 1, hidden, inter)
    )
    x = _random(rng, (batch, seq, hidden), BF16)
    gamma = _random(rng, (1, hidden), BF16) if rms else None
    x64 = x.astype(np.float64).reshape(batch * seq, hidden)
    if rms:
        x64 = x64 / np.sqrt((x64**2).mean(axis=-1, keepdims=True) + 1e-6)
        x64 = (x64 * gamma.astype(np.float64)).astype(BF16).astype(np.float64)
    expected = _moe_mx_expert_output(x64, gate_up, gate_up_scale, down, down_scale)

    def pack(values):
        return pack_x4(values.reshape(values.shape[:-2] + (-1,)), "float4_e2m1fn_x4")

    weights = (pack(gate_up[:, 0]), pack(gate_up[:, 1]), pack(down))
    scales = tuple(np.ascontiguousarray(s) for s in (gate_up_scale[:, 0], gate_up_scale[:, 1]))
    return x, weights, gamma, scales + (down_scale,), expected.reshape(x.shape)


@pytest.mark.parametrize(
    "lnc, batch, seq, hidden, inter, rms",
    [
        (1, 4, 1, 512, 512, False),
        (2, 2, 2, 1024, 1024, True),  # LNC=2 shards H: at least one 512-tile per core
        (2, 8, 1, 1024, 2048, False),
    ],
)
def test_mlp_tkg_mx(rng, monkeypatch, lnc, batch, seq, hidden, inter, rms):
    """mlp_tkg_mx through MLPParameters (QuantizationType.MX), the output allocated as the
    mlp entry does (core/mlp/mlp.py, which does not parse at d2ad3a5)."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    types = library_module("core.utils.common_types")
    parameters = library_module("core.mlp.mlp_parameters").MLPParameters
    mlp_tkg_mx = library_module("core.mlp.mlp_tkg.mlp_tkg_mx").mlp_tkg_mx
    norm = types.NormType.RMS_NORM if rms else types.NormType.NO_NORM
    mx = types.QuantizationType.MX
    nl = nki.language

    def mlp(x, gate, up, down, gamma, gate_scale, up_scale, down_scale):
        params = parameters(
            hidden_tensor=x,
            gate_proj_weights_tensor=gate,
            up_proj_weights_tensor=up,
            down_proj_weights_tensor=down,
            normalization_weights_tensor=gamma,
            normalization_type=norm,
            quantization_type=mx,
            gate_w_scale=gate_scale,
            up_w_scale=up_scale,
            down_w_scale=down_scale,
        )
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        mlp_tkg_mx(params, out, None)
        return out

    x, weights, gamma, scales, expected = _mlp_mx_case(rng, batch, seq, hidden, inter, rms)
    out = _launch(nki.jit(mlp), lnc, x, *weights, gamma, *scales)
    assert np.asarray(out).dtype == BF16
    _check_mx_output(out, expected)


@pytest.mark.parametrize("lnc, rms", [(1, False), (2, True)])
def test_mlp_entry_mx(rng, monkeypatch, lnc, rms):
    """The mlp entry (core/mlp/mlp.py@ddbca35 L80-201) with QuantizationType.MX dispatches to
    mlp_tkg_mx (TKG only, no column tiling) and returns [out]."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    mlp = _mlp_entry()
    types = library_module("core.utils.common_types")
    x, weights, gamma, scales, expected = _mlp_mx_case(rng, 2, 2, 1024, 1024, rms)
    result = _launch(
        mlp,
        lnc,
        x,
        *weights,
        normalization_weights_tensor=gamma,
        normalization_type=types.NormType.RMS_NORM if rms else types.NormType.NO_NORM,
        quantization_type=types.QuantizationType.MX,
        gate_w_scale=scales[0],
        up_w_scale=scales[1],
        down_w_scale=scales[2],
        use_tkg_gate_up_proj_column_tiling=False,
        use_tkg_down_proj_column_tiling=False,
    )
    assert isinstance(result, list) and len(result) == 1
    assert result[0].dtype == BF16
    _check_mx_output(result[0], expected)


@pytest.mark.parametrize(
    "lnc, batch, seq, store_fused_add", [(1, 2, 1, False), (2, 4, 1, True), (1, 1, 128, True)]
)
def test_mlp_entry(rng, lnc, batch, seq, store_fused_add):
    """The mlp entry (core/mlp/mlp.py@ddbca35 L80-201): x (+ fused_add_tensor) RMS-normalised
    with γ, down(SiLU(x @ gate) · (x @ up)); TKG for B·S <= 96, CTE beyond (L186-189); with
    store_fused_add_result it returns [out, x + fused_add_tensor] (L183-184)."""
    mlp = _mlp_entry()
    types = library_module("core.utils.common_types")
    hidden, inter = 512, 512
    x = _random(rng, (batch, seq, hidden), BF16)
    residual = _random(rng, x.shape, BF16)
    gamma = _random(rng, (1, hidden), BF16)
    gate, up = ((_random(rng, (hidden, inter), np.float32) / 24).astype(BF16) for _ in range(2))
    down = (_random(rng, (inter, hidden), np.float32) / 24).astype(BF16)
    result = _launch(
        mlp,
        lnc,
        x,
        gate,
        up,
        down,
        normalization_weights_tensor=gamma,
        normalization_type=types.NormType.RMS_NORM,
        fused_add_tensor=residual,
        store_fused_add_result=store_fused_add,
    )
    summed = x.astype(np.float64) + residual.astype(np.float64)
    normed = summed / np.sqrt((summed**2).mean(axis=-1, keepdims=True) + 1e-6)
    normed = normed * gamma.astype(np.float64)
    expected = (_silu(normed @ gate.astype(np.float64)) * (normed @ up.astype(np.float64))) @ (
        down.astype(np.float64)
    )
    assert isinstance(result, list) and len(result) == (2 if store_fused_add else 1)
    _check(result[0], expected, BF16, scale=4.0)
    if store_fused_add:
        _check(result[1], summed, BF16, scale=4.0)


# --- collectives: allgather_sb2sb (experimental/collectives/sb2sb_allgather.py) ----------------
@pytest.mark.parametrize(
    "tiled, rows, width, ranks, dtype",
    [
        (False, 64, 256, 4, BF16),
        (False, 128, 96, 8, np.float32),
        (True, 256, 128, 4, BF16),  # two 128-row tiles, LNC=1
        (True, 96, 64, 2, np.float32),
    ],
)
def test_allgather_sb2sb(rng, tiled, rows, width, ranks, dtype):
    """Docstring (sb2sb_allgather.py L30-79, L100-126): each rank's [H, W] input, gathered
    over the ranks of the replica group along the last dimension: every rank's output
    [H, W·tp_degree] = [x_0 | x_1 | …] (AWS's harness: one ReplicaGroup of all ranks,
    test/integration/nkilib/experimental/collectives/test_sb2sb_allgather.py L66-79). Run
    on ``ranks`` LNC=1 ranks by ``launch_ranks``."""
    module = library_module("experimental.collectives.sb2sb_allgather")
    kernel = module.allgather_sb2sb_tiled if tiled else module.allgather_sb2sb
    group = nki.collectives.ReplicaGroup([list(range(ranks))])
    inputs = [_random(rng, (rows, width), dtype) for _ in range(ranks)]
    results = nki.launch_ranks(kernel, [((x, group, ranks), {}) for x in inputs])
    expected = np.concatenate(inputs, axis=1)
    for out in results:
        assert out.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(out, expected)


# --- collectives: transformer_tkg (experimental/transformer/transformer_tkg.py) ----------------
@pytest.mark.parametrize("ranks, batch, tokens", [(2, 2, 1), (4, 1, 2)])
def test_transformer_tkg_tensor_parallel(rng, ranks, batch, tokens):
    """Docstring (transformer_tkg.py@ddbca35 L118-182), one layer on ``ranks`` tensor-parallel
    LNC=1 ranks (HBM path): each rank runs attention_block_tkg with its own heads, K/V head,
    caches and W_out rows (K cache [B, 1, d, S_ctx], transposed); the partial outputs are
    all-reduced over the replica group and added to X; then the RMSNorm-ed sum goes through
    each rank's MLP slice (SiLU, gate/up columns, down rows), all-reduced and added again.
    Every rank returns the same [B, S, H]. The kernel imports core/mlp/mlp.py, which does
    not parse at d2ad3a5: run against 2.29_release."""
    _mlp_entry()
    try:
        module = library_module("experimental.transformer.transformer_tkg")
    except SyntaxError as error:
        pytest.skip(f"transformer_tkg does not import from this checkout: {error}")
    transformer = module.transformer_tkg
    hidden, heads, d, s_ctx, inter = 256, 2, 64, 256, 256

    def layer(x, w_qkv, w_out, w_gate, w_up, w_down, g_qkv, g_mlp, k, v, cos, sin, mask, groups):
        return transformer(
            x, [w_qkv], [w_out], [w_gate], [w_up], [w_down], [g_qkv], [g_mlp], [k], [v],
            cos, sin, mask, None, None, 1, replica_groups=groups,
        )  # fmt: skip

    x = _random(rng, (batch, tokens, hidden), BF16)
    g_qkv, g_mlp = (_random(rng, (1, hidden), BF16) for _ in range(2))
    angle = rng.uniform(-math.pi, math.pi, (d // 2, batch, tokens))
    cos, sin = np.cos(angle).astype(BF16), np.sin(angle).astype(BF16)
    lengths = rng.integers(1, s_ctx - tokens, batch)
    keep = np.arange(s_ctx)[:, None, None, None] < lengths[None, :, None, None]
    keep = np.broadcast_to(keep, (s_ctx, batch, heads, tokens)).copy()
    keep[s_ctx - tokens :] = np.tri(tokens, dtype=bool).T[:, None, None, :]

    def weight(rows, cols, fan_in):
        return (_random(rng, (rows, cols), np.float32) / math.sqrt(fan_in)).astype(BF16)

    shards = []
    for _ in range(ranks):
        w_qkv = weight(hidden, d * (heads + 2), hidden)
        w_out = weight(heads * d, hidden, heads * d * ranks)
        w_gate, w_up = weight(hidden, inter, hidden), weight(hidden, inter, hidden)
        w_down = weight(inter, hidden, inter * ranks)
        k = _random(rng, (batch, 1, d, s_ctx), BF16)
        v = _random(rng, (batch, 1, s_ctx, d), BF16)
        shards.append((w_qkv, w_out, w_gate, w_up, w_down, k, v))
    group = (tuple(range(ranks)),)
    inputs = [
        ((x, *s[:5], g_qkv, g_mlp, s[5], s[6], cos, sin, keep.astype(BF16), group), {})
        for s in shards
    ]
    results = nki.launch_ranks(nki.jit(layer), inputs)

    attention = sum(
        _attention_block_reference(
            x, g_qkv, s[0], cos, sin, s[5][:, 0].transpose(0, 2, 1), s[6][:, 0], keep, s[1], None
        )[0]
        for s in shards
    )
    current = x.astype(np.float64).reshape(batch * tokens, hidden) + attention
    normed = current / np.sqrt((current**2).mean(axis=-1, keepdims=True) + 1e-6)
    normed = normed * g_mlp.astype(np.float64)
    mlp = sum(
        (_silu(normed @ s[2].astype(np.float64)) * (normed @ s[3].astype(np.float64)))
        @ s[4].astype(np.float64)
        for s in shards
    )
    expected = (current + mlp).reshape(batch, tokens, hidden)
    for out in results:
        _check(out, expected, BF16, scale=2.0)


@pytest.mark.parametrize(
    "lnc, tokens, hidden, inter, experts, top_k",
    [(1, 4, 512, 512, 4, 2), (2, 8, 1024, 1024, 4, 2), (2, 4, 1024, 512, 8, 4)],
)
def test_moe_tkg_selective_mx(rng, monkeypatch, lnc, tokens, hidden, inter, experts, top_k):
    """Docstring (moe_tkg, selective experts with MXFP4, selective_expert_mx_impl.py L38-87):
    out[t] = Σ over the token's K experts e of a[t, e] · (expert_e(x[t]) + down_bias[e]), an
    MX expert with gate/up bias [E, I_p, 2, I/512, 4] and AWS's clamps (gate <= 7, up in
    [-6, 8], the values of AWS's harness, test/integration/nkilib/core/moe/moe_tkg/
    test_moe_tkg_utils.py L234-237). The affinities are nonzero at the chosen experts only,
    as the harness builds them (L98-115). Without clamps the kernel calls tensor_scalar with
    op0=None (gate_up_projection_mx_shard_H.py L429-436), which the ISA reference does not
    allow (op0 has no default, isa L1081) and AWS's harness never runs (every selective MX
    case clamps, test_moe_tkg.py L257-262)."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    moe_tkg = library_module("core.moe.moe_tkg.moe_tkg").moe_tkg
    scale_mode = library_module("core.utils.common_types").ExpertAffinityScaleMode
    x = _random(rng, (tokens, hidden), BF16)
    gate_up, gate_up_scale, down, down_scale = _moe_mx_weights(rng, experts, hidden, inter)
    gate_up_scale += 3  # gate/up outputs of std ~8: the clamps act on a good share of them
    gate_up_bias = _random(rng, (experts, 128, 2, inter // 512, 4), BF16)
    down_bias = _random(rng, (experts, hidden), BF16)
    index = np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens)]).astype(np.int32)
    affinities = np.zeros((tokens, experts), np.float32)
    for t in range(tokens):
        affinities[t, index[t]] = rng.uniform(0.05, 1.0, top_k)
    clamps = (7.0, -6.0, 8.0)
    out = _launch(
        nki.jit(moe_tkg),
        lnc,
        x,
        *_pack_moe_mx_weights(gate_up, down),
        affinities,
        index,
        False,
        expert_gate_up_weights_scale=gate_up_scale,
        expert_down_weights_scale=down_scale,
        expert_gate_up_bias=gate_up_bias,
        expert_down_bias=down_bias,
        expert_affinities_scaling_mode=scale_mode.POST_SCALE,
        gate_clamp_upper_limit=clamps[0],
        up_clamp_lower_limit=clamps[1],
        up_clamp_upper_limit=clamps[2],
    )
    expected = np.zeros((tokens, hidden))
    for e in range(experts):
        expert = _moe_mx_expert_output(
            x, gate_up[e], gate_up_scale[e], down[e], down_scale[e], gate_up_bias[e], clamps
        )
        expected += affinities[:, e, None] * (expert + down_bias[e].astype(np.float64))
    assert np.asarray(out).dtype == BF16
    _check_mx_output(out, expected)


def _padding_conditions(positions, block, tokens, extra):
    """1 for each block holding a token, then 0 for the padding blocks and ``extra`` more
    slots: the conditions vector of AWS's harness (test/integration/nkilib/core/moe/moe_cte/
    test_moe_cte_common.py L251-262: N+1 entries for shard-on-I, N+2 for the MX
    shard-on-block)."""
    used = (positions.reshape(-1, block) < tokens).any(axis=1)
    return np.concatenate([used, np.zeros(extra, bool)]).astype(np.int32)


@pytest.mark.parametrize(
    "tokens, hidden, inter, experts, top_k, block, dynamic",
    [
        (128, 512, 512, 4, 2, 128, False),
        (128, 1024, 1024, 4, 2, 128, False),
        (128, 512, 512, 4, 2, 128, True),  # the dynamic loop over the conditions
    ],
)
def test_moe_cte_shard_on_block_mx(
    rng, monkeypatch, tokens, hidden, inter, experts, top_k, block, dynamic
):
    """Docstring (bwmm_shard_on_block_mx.py L103-229, LNC=2 on Trn3): the blockwise MoE of
    test_moe_cte with MXFP4 weights in the MX MoE layouts (gate/up [E, 128, 2, H/512, I] x4,
    down [E, I_p, I/512, H] x4, e8m0 scales, gate/up bias [E, I_p, 2, I/512, 4], down bias
    [E, H]; AWS's harness, test/integration/nkilib/core/moe/moe_cte/test_utils.py L374-445)
    and AWS's clamps (test_moe_bwmm_mx_cte.py L61: gate <= 7, up in [-7, 7]): out[t] =
    Σ over the token's experts of a[t, e] · (expert_e(x[t]) + down_bias[e]). With top-k > 1
    (the only supported) the output is [2, T+1, H]: the cores' partial sums, reduced into
    [0] with [1] zeroed (moe_cte_utils.py reduce_outputs, L639-668); T a multiple of 128
    (the reduction's tiles, bwmm_shard_on_block_mx.py L495-503). ``dynamic``: the conditions
    vector drives the blocks past the static ones through the dynamic loop (L208-218); the
    padding blocks it stops at hold only the pad token, so the result is the same."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    module = library_module("core.moe.moe_cte.bwmm_shard_on_block_mx")
    chosen, positions, owners = _moe_blocks(rng, tokens, experts, top_k, block, 2)
    x = np.concatenate([_random(rng, (tokens, hidden), BF16), np.zeros((1, hidden), BF16)])
    affinities = np.zeros((tokens + 1, experts), np.float32)
    np.put_along_axis(affinities[:tokens], chosen, rng.uniform(0.05, 1.0, chosen.shape), axis=1)
    affinities = affinities.astype(BF16)
    gate_up, gate_up_scale, down, down_scale = _moe_mx_weights(rng, experts, hidden, inter)
    gate_up_scale += 3  # gate/up outputs of std ~8: the clamps act on a good share of them
    gate_up_bias = _random(rng, (experts, 128, 2, inter // 512, 4), BF16)
    down_bias = _random(rng, (experts, hidden), BF16)
    clamps = (7.0, -7.0, 7.0)
    out = module.bwmm_shard_on_block_mx[2](
        x,
        affinities.reshape(-1, 1),
        *_pack_moe_mx_weights(gate_up, down),
        positions,
        owners.reshape(-1, 1),
        gate_and_up_proj_bias=gate_up_bias,
        down_proj_bias=down_bias,
        gate_up_proj_scale=gate_up_scale,
        down_proj_scale=down_scale,
        block_size=block,
        is_tensor_update_accumulating=True,
        gate_clamp_upper_limit=clamps[0],
        up_clamp_lower_limit=clamps[1],
        up_clamp_upper_limit=clamps[2],
        weight_dtype=nki.language.float4_e2m1fn_x4,
        conditions=_padding_conditions(positions, block, tokens, 2) if dynamic else None,
    )
    expected = np.zeros((tokens, hidden))
    for e in range(experts):
        expert = _moe_mx_expert_output(
            x[:tokens],
            gate_up[e],
            gate_up_scale[e],
            down[e],
            down_scale[e],
            gate_up_bias[e],
            clamps,
        )
        expected += affinities[:tokens, e, None].astype(np.float64) * (
            expert + down_bias[e].astype(np.float64)
        )
    out = np.asarray(out)
    assert out.shape == (2, tokens + 1, hidden) and out.dtype == BF16
    assert not out[1, :tokens].any()
    _check_mx_output(out[0, :tokens], expected)


@pytest.mark.parametrize(
    "tokens, hidden, inter, experts, top_k, block, hybrid",
    [
        (128, 512, 1024, 4, 2, 256, False),
        (128, 1024, 1024, 4, 2, 256, False),
        (128, 512, 1024, 4, 2, 256, True),  # blockwise_mm_shard_intermediate_mx_hybrid
    ],
)
def test_moe_cte_shard_on_i_mx(
    rng, monkeypatch, tokens, hidden, inter, experts, top_k, block, hybrid
):
    """Docstring (bwmm_shard_on_I_mx.py blockwise_mm_shard_intermediate_mx, L119-219, LNC=2
    on Trn3): the blockwise MX MoE of test_moe_cte_shard_on_block_mx with I split over the
    two cores (I a multiple of 1024, blocks of 256: two 128-token tiles, one per core);
    POST_SCALE as AWS's harness passes it (the kernel's default is PRE_SCALE); out [T+1, H].
    The down bias is zero here: each core adds the whole bias to its half-I partial sum
    (L1045-1049, loaded on both cores L1388-1398) and the cores' partials are then added
    (L1409-1422), so a nonzero bias comes out twice, where the docstring (L204) and AWS's own
    golden (test/integration/nkilib/core/moe/moe_cte/test_utils.py L594-595, L681-687) add it
    once. The kernel needs the tensor (it reads its dtype). ``hybrid``: the static/dynamic
    variant (L401-430), its conditions [N+1] 0 from the first padding block on."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    module = library_module("core.moe.moe_cte.bwmm_shard_on_I_mx")
    scale_mode = library_module("core.utils.common_types").ExpertAffinityScaleMode
    chosen, positions, owners = _moe_blocks(rng, tokens, experts, top_k, block, 1)
    x = np.concatenate([_random(rng, (tokens, hidden), BF16), np.zeros((1, hidden), BF16)])
    affinities = np.zeros((tokens + 1, experts), np.float32)
    np.put_along_axis(affinities[:tokens], chosen, rng.uniform(0.05, 1.0, chosen.shape), axis=1)
    affinities = affinities.astype(BF16)
    gate_up, gate_up_scale, down, down_scale = _moe_mx_weights(rng, experts, hidden, inter)
    gate_up_scale += 3  # gate/up outputs of std ~8: the clamps act on a good share of them
    gate_up_bias = _random(rng, (experts, 128, 2, inter // 512, 4), BF16)
    clamps = (7.0, -7.0, 7.0)
    if hybrid:
        conditions = _padding_conditions(positions, block, tokens, 1)
        kernel = functools.partial(module.blockwise_mm_shard_intermediate_mx_hybrid[2], conditions)
    else:
        kernel = module.blockwise_mm_shard_intermediate_mx[2]
    out = kernel(
        x,
        affinities.reshape(-1, 1),
        *_pack_moe_mx_weights(gate_up, down),
        positions,
        owners.reshape(-1, 1),
        gate_and_up_proj_bias=gate_up_bias,
        down_proj_bias=np.zeros((experts, hidden), BF16),
        gate_up_proj_scale=gate_up_scale,
        down_proj_scale=down_scale,
        block_size=block,
        is_tensor_update_accumulating=True,
        expert_affinities_scaling_mode=scale_mode.POST_SCALE,
        gate_clamp_upper_limit=clamps[0],
        up_clamp_lower_limit=clamps[1],
        up_clamp_upper_limit=clamps[2],
        weight_dtype=nki.language.float4_e2m1fn_x4,
    )
    expected = np.zeros((tokens, hidden))
    for e in range(experts):
        expert = _moe_mx_expert_output(
            x[:tokens],
            gate_up[e],
            gate_up_scale[e],
            down[e],
            down_scale[e],
            gate_up_bias[e],
            clamps,
        )
        expected += affinities[:tokens, e, None].astype(np.float64) * expert
    out = np.asarray(out)
    assert out.shape == (tokens + 1, hidden) and out.dtype == BF16
    _check_mx_output(out[:tokens], expected)


@pytest.mark.parametrize(
    "all_expert, tokens, hidden, inter, experts, top_k",
    [(False, 8, 1024, 512, 8, 2), (False, 4, 1024, 1024, 16, 4), (True, 32, 1024, 1024, 8, 4)],
)
def test_moe_block_tkg_mx(rng, monkeypatch, all_expert, tokens, hidden, inter, experts, top_k):
    """Docstring (moe_block_tkg with MXFP4 experts, core/moe_block/moe_block_tkg.py L76-169,
    LNC=2 on Trn3): RMSNorm(x, γ) → router logits @ W [H, E]; top-k of the logits, softmax
    over the chosen ones (router_pre_norm=False, as every MX case of AWS's harness,
    test/integration/nkilib/core/moe_block/test_moe_block_tkg.py L371-418); out = Σ over the
    token's experts of a · (expert_e(x) + down_bias[e]) with the MX experts of
    test_moe_tkg_selective_mx (bias, AWS's clamps), selective or all-expert (rank 0, every
    expert local: the fused RMSNorm + MX quantization of rmsnorm_mx_quantize_tkg). With the
    default router_pre_norm=True the selective MX path reads top-k affinities the router
    never writes (core/router_topk/router_topk.py L739, L1140: NaN here)."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    moe_block_tkg = library_module("core.moe_block.moe_block_tkg").moe_block_tkg
    types = library_module("core.utils.common_types")
    x = _random(rng, (tokens, 1, hidden), BF16)
    gamma = _random(rng, (1, hidden), BF16)
    router = (_random(rng, (hidden, experts), np.float32) / math.sqrt(hidden)).astype(BF16)
    gate_up, gate_up_scale, down, down_scale = _moe_mx_weights(rng, experts, hidden, inter)
    gate_up_scale += 3  # gate/up outputs of std ~8: the clamps act on a good share of them
    gate_up_bias = _random(rng, (experts, 128, 2, inter // 512, 4), BF16)
    down_bias = _random(rng, (experts, hidden), BF16)
    clamps = (7.0, -6.0, 8.0)
    extra = {"is_all_expert": True, "rank_id": np.zeros((1, 1), np.int32)} if all_expert else {}
    out, logits = moe_block_tkg[2](
        x,
        gamma,
        router,
        *_pack_moe_mx_weights(gate_up, down),
        expert_gate_up_weights_scale=gate_up_scale,
        expert_down_weights_scale=down_scale,
        expert_gate_up_bias=gate_up_bias,
        expert_down_bias=down_bias,
        top_k=top_k,
        router_act_fn=types.RouterActFnType.SOFTMAX,
        router_pre_norm=False,
        expert_affinities_scaling_mode=types.ExpertAffinityScaleMode.POST_SCALE,
        gate_clamp_upper_limit=clamps[0],
        up_clamp_lower_limit=clamps[1],
        up_clamp_upper_limit=clamps[2],
        **extra,
    )
    x64 = x.astype(np.float64).reshape(tokens, hidden)
    x64 = x64 / np.sqrt((x64**2).mean(axis=-1, keepdims=True) + 1e-6) * gamma.astype(np.float64)
    _check(logits, x64 @ router.astype(np.float64), BF16, scale=4.0)
    chosen_logits = np.asarray(logits).astype(np.float64)  # the kernel's own: no near-tie flips
    weight = np.zeros((tokens, experts))
    for t, picked in enumerate(np.argsort(-chosen_logits, axis=1, kind="stable")[:, :top_k]):
        weight[t, picked] = _softmax(chosen_logits[t, picked][None])[0]
    normed = x64.astype(BF16).astype(np.float64)  # the kernels quantize the bf16 RMSNorm output
    expected = np.zeros((tokens, hidden))
    for e in range(experts):
        expert = _moe_mx_expert_output(
            normed, gate_up[e], gate_up_scale[e], down[e], down_scale[e], gate_up_bias[e], clamps
        )
        expected += weight[:, e, None] * (expert + down_bias[e].astype(np.float64))
    assert np.asarray(out).dtype == BF16
    _check_mx_output(np.asarray(out).reshape(tokens, hidden), expected)


# --- topk_reduce (experimental/collectives/topk_reduce.py; experimental/subkernels/ before) ---
def _topk_reduce_module():
    """topk_reduce moved from experimental/subkernels (2.29_release) to experimental/
    collectives (d2ad3a5)."""
    try:
        return library_module("experimental.collectives.topk_reduce")
    except ModuleNotFoundError:
        return library_module("experimental.subkernels.topk_reduce")


@pytest.mark.parametrize(
    "lnc, src_ranks, tokens, k, hidden",
    [(1, 8, 4, 4, 256), (2, 8, 16, 8, 512), (2, 4, 128, 2, 256)],
)
def test_topk_reduce(rng, lnc, src_ranks, tokens, k, hidden):
    """Docstring (topk_reduce.py L33-61): a sparse all_to_all_v output [ranks·T, H + 2]
    holding the T·K expert outputs at scattered rows, each with its global token index
    packed as an int32 in its last two 16-bit columns; out[t] = Σ of the rows of token t.
    The other rows hold -1 everywhere (AWS's harness, test/integration/nkilib/experimental/
    subkernels/test_topk_reduce.py L29-49), an index no token has."""
    topk_reduce = _topk_reduce_module().topk_reduce
    rows = src_ranks * tokens
    buffer = np.full((rows, hidden + 2), -1, BF16)
    values = _random(rng, (tokens * k, hidden), BF16)
    ids = np.arange(tokens, dtype=np.int32).repeat(k)[:, None].view(BF16)
    buffer[rng.permutation(rows)[: tokens * k]] = np.concatenate([values, ids], axis=1)
    out = _launch(topk_reduce, lnc, buffer, tokens, k)
    expected = values.astype(np.float64).reshape(tokens, k, hidden).sum(axis=1)
    _check(out, expected, BF16, scale=4.0)
