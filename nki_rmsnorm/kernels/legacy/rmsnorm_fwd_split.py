"""Forward regime "split": rows too long for whole-row tiles, each spread over ``s`` partitions.

N = s·F. Row r's segment q (columns q·F … q·F + F − 1) sits on partition r·s + q of a tile,
so a tile of P partitions holds R = P / s whole rows and is one contiguous block of HBM: one
DMA in and one out per stream, x read once, and tiles of R rows keep the pipeline short where
the "long" regime's 128-row tiles would leave the first tile's statistics and the last tile's
output exposed. NeuronCore-v3+ only: statistics cross partitions by exact Tensor-engine
transposes (NaN-safe there, not on v2).

Per tile:

====  ===================================================================================
DMA   load the (P, F) segments of x (with a residual: load both, DVE adds them, store h)
ACT   Σh² per segment (``activation_reduce``) into an fp32 column
PE    transpose that column into one row; DVE: each row's s segment sums added
      (``nl.sum`` over the segment axis, segment order)
PE    the R row sums transposed to an (R, 1) column; DVE v = Σh²/N + eps, GpSimd rsqrt
      (``rmsnorm_fwd_steps.rstd_on_gpsimd``; no step on ACT, whose next Σh² would delay
      it); DMA rstd out; PE: transposed to a row; GpSimd: rstd repeated into each segment's
      place; PE: transposed back, one rstd per partition; its bf16 pieces rounded on
      (GpSimd)
DVE   against the weight segments laid out one per partition (row p holds segment p mod s,
      −0 made +0): "tensor" (gemma) y = (w · rstd) · h, one ``scalar_tensor_tensor``,
      rounded as the "rows" regime's h · (rstd ⊗ w) (its rstd pieces sum exactly, so PSUM
      holds rstd·w rounded once to fp32, which fp32 w · rstd is too), so a row's y is
      bitwise the same in both regimes; no masked Tensor-engine product, whose masked zeros
      times another segment's ±Inf or NaN weight would be NaN (0·Inf). Otherwise as the
      "vector" plan of ``rmsnorm_fwd_steps``.
DMA   store y
====  ===================================================================================

The tile loop is unrolled (``static_range``) into a software pipeline over ``SPLIT_SLOTS``
explicit buffer sets: the statistics of tile t + 1 are issued before the output of tile t,
so every engine finds the next tile's short steps ahead of its current long ones, and up to
``SPLIT_SLOTS`` tiles are loading, reducing, normalising and storing at once.
"""

from __future__ import annotations

from typing import NamedTuple

from nki_rmsnorm.kernels.legacy import rmsnorm_fwd_steps as steps
from nki_rmsnorm.nki import nisa, nl
from nki_rmsnorm.plan.forward import SPLIT_SLOTS


class _Resident(NamedTuple):
    """On-chip tiles every tile reads (see :func:`split_rows`)."""

    eps: float
    scale: object  # weight segments, (P, F) per row
    shift: object  # bias segments, (P, F) per row
    ident_f32: object  # fp32 identity: moves Σh² and rstd across partitions


class _Slot(NamedTuple):
    """One of the two sets of tile buffers the tiles rotate through (tile t uses slot
    t mod 2), so the statistics of tile t + 1 can run while tile t is normalised."""

    x: object  # with a residual: x, then x̂ in llama / none
    h: object
    y: object
    product: object
    squares: object
    rstd: object  # (P, 1): each segment's rstd


def split_rows(plan, s, hbm, eps, offset):
    """Rows of N = s·F columns, segment q of row r on partition r·s + q."""
    M, N = hbm.x.shape
    P = nl.tile_size.pmax
    F = N // s
    segments = M * s
    parts = min(P, segments)
    views = [
        None if t is None else t.reshape((segments, F)) for t in (hbm.x, hbm.residual, hbm.y, hbm.h)
    ]
    weight_segments = None if hbm.weight is None else hbm.weight.reshape((s, F))
    bias_segments = None if hbm.bias is None else hbm.bias.reshape((s, F))
    scale = (
        None
        if weight_segments is None
        else segments_per_row(weight_segments, parts, plan.scale_dtype, offset)
    )
    shift = (
        None if bias_segments is None else segments_per_row(bias_segments, parts, plan.bias_dtype)
    )
    resident = _Resident(eps, scale, shift, steps.identity(parts, nl.float32))

    def buffer(dtype):
        return None if dtype is None else nl.ndarray((parts, F), dtype=dtype)

    xhat_dtype = plan.in_dtype if hbm.residual is not None else None
    slots = [
        _Slot(
            buffer(xhat_dtype),
            buffer(plan.h_dtype),
            buffer(plan.result_dtype),
            buffer(plan.product_dtype),
            buffer(nl.bfloat16 if plan.squares_in == "scratch" else None),
            nl.ndarray((parts, 1), dtype=nl.float32),
        )
        for _ in range(SPLIT_SLOTS)
    ]
    # Software pipeline, unrolled: the statistics of tile t + 1 are issued before the
    # output of tile t, so each engine finds the next tile's small steps ahead of its
    # current long ones.
    tiles = [(seg0, min(P, segments - seg0)) for seg0 in range(0, segments, P)]
    _split_statistics(plan, s, views, hbm, resident, slots[0], *tiles[0])
    for t in nl.static_range(len(tiles)):
        if t + 1 < len(tiles):
            _split_statistics(
                plan, s, views, hbm, resident, slots[(t + 1) % SPLIT_SLOTS], *tiles[t + 1]
            )
        _split_output(plan, views, resident, slots[t % SPLIT_SLOTS], *tiles[t])


def segments_per_row(segments_hbm, parts, dtype, offset=0.0, positive_zeros=True):
    """(parts, F): partition p holds segment p mod s, converted to ``dtype`` (+ offset),
    −0 made +0 (``steps.signed_zeros_positive``; unless ``positive_zeros`` is False) as the
    "rows" regime's Tensor-engine product and ones-row broadcast make it. The s segments
    are loaded once and doubled on chip by SBUF-to-SBUF DMAs."""
    s, F = segments_hbm.shape
    i_s = nl.arange(s)[:, None]
    i_f = nl.arange(F)[None, :]
    rows = nl.ndarray((parts, F), dtype=dtype)
    converted = steps.convert_row(nl.load(segments_hbm[i_s, i_f]), dtype, offset)
    rows[0:s, :] = steps.signed_zeros_positive(converted) if positive_zeros else converted
    return doubled(rows, s, parts)


def doubled(rows, s, parts):
    """``rows`` with its first s partitions copied until all ``parts`` hold them."""
    filled = s
    # at most parts / s doublings; a bounded loop, as the dialect has only do-while loops
    # (general/nki/api/nki.errors.rst@8a38e733, L902-L947)
    for _ in nl.static_range(parts // s):
        if filled < parts:
            count = min(filled, parts - filled)
            nisa.dma_copy(dst=rows[filled : filled + count, :], src=rows[0:count, :])
            filled += count
    return rows


def _split_statistics(plan, s, views, hbm, resident, slot, seg0, parts):
    """Load segments ``seg0 … seg0 + parts − 1`` (rows ``seg0 / s …``) into ``slot``, store
    their rstd and leave in ``slot.rstd`` what :func:`_split_output` multiplies by."""
    x_v, residual_v, _, h_v = views
    F = x_v.shape[1]
    N = F * s
    R = parts // s
    i_p = nl.arange(parts)[:, None]
    i_f = nl.arange(F)[None, :]
    segs = seg0 + i_p

    # DMA in (with a residual: DVE h = x + residual, DMA h out).
    h_tile = slot.h[:parts, :]
    steps.load_h(
        h_tile,
        None if slot.x is None else slot.x[:parts, :],
        x_v[segs, i_f],
        None if residual_v is None else residual_v[segs, i_f],
        None if h_v is None else h_v[segs, i_f],
    )
    squares = {"product": slot.product, "y": slot.y}.get(plan.squares_in, slot.squares)

    # ACT: Σh² per segment. PE: transposed to one row; DVE: each row's s sums added.
    segment_sq = nl.ndarray((parts, 1), dtype=nl.float32)
    squares[:parts, :][...] = nisa.activation_reduce(
        op=nl.square, data=h_tile, reduce_op=nl.add, reduce_res=segment_sq, dtype=squares.dtype
    )
    sums = nisa.nc_matmul(segment_sq, resident.ident_f32[:parts, :parts], is_transpose=True)
    by_row = sums[
        nl.arange(1)[:, None, None], nl.arange(R)[None, :, None] * s + nl.arange(s)[None, None, :]
    ]
    # Vector: the s segment sums of each row added in segment order. nl.sum over the inner
    # axis of an indexed view, as AWS's legacy pooling example reduces inner axes
    # (general/nki/examples/average_pool2d/average_pool2d_nki_kernels.py@8a38e733, L49-L50);
    # nisa.tensor_reduce would have to reduce every free axis (isa L1586, L1619).
    row_sq = nl.sum(by_row, axis=[2], dtype=nl.float32)

    # PE: the R sums transposed to one per partition; DVE: v = Σh²/N + eps, GpSimd: rsqrt
    # (no step of the chain on ACT, which is busy with the next whole-tile Σh²); rstd
    # stored. PE:
    # transposed back to a row; GpSimd: repeated for each segment of its row; PE: transposed
    # back to one rstd per partition. The transposes are exact (one 1·x product each).
    row_sq_col = nisa.tensor_copy(
        nisa.nc_matmul(row_sq, resident.ident_f32[:1, :1], is_transpose=True), dtype=nl.float32
    )
    # Without a residual ACT carries the heavier load (Σh²) and the chain's small steps go
    # to DVE and GpSimd; with one DVE does (the add and the product) and they stay on ACT.
    # Either way the same values: v rounds twice in fp32 on both engines, and the pieces
    # are exact.
    fused = residual_v is not None
    rstd_by_row = steps.rstd_on_gpsimd(row_sq_col, resident.eps, N, mean_on_scalar=fused)
    nl.store(
        hbm.rstd.reshape((hbm.rstd.shape[0], 1))[
            seg0 // s + nl.arange(R)[:, None], nl.arange(1)[None, :]
        ],
        value=rstd_by_row,
    )
    rstd_row = nisa.tensor_copy(
        nisa.nc_matmul(rstd_by_row, resident.ident_f32[:R, :R], is_transpose=True), dtype=nl.float32
    )
    repeated = nl.ndarray((1, parts), dtype=nl.float32)
    i_r = nl.arange(R)[None, :]
    for q in nl.static_range(s):
        repeated[0, i_r * s + q] = nisa.tensor_copy(rstd_row, engine=nisa.gpsimd_engine)
    column = nisa.nc_matmul(repeated, resident.ident_f32[:1, :1], is_transpose=True)
    slot.rstd[:parts, :][...] = nisa.tensor_copy(column, dtype=nl.float32)


def _split_output(plan, views, resident, slot, seg0, parts):
    """y for the segments whose statistics :func:`_split_statistics` left in ``slot``."""
    y_v = views[2]
    F = y_v.shape[1]
    segs = seg0 + nl.arange(parts)[:, None]
    i_f = nl.arange(F)[None, :]
    y_tile = slot.y[:parts, :]
    product = None if slot.product is None else slot.product[:parts, :]
    shift = None if resident.shift is None else resident.shift[:parts, :]
    scale = None if resident.scale is None else resident.scale[:parts, :]
    if plan.product_engine == "tensor" and scale is not None:
        # DVE: y = (w · rstd) · h, rounded as the "rows" regime's h · (rstd ⊗ w) (see the
        # module docstring), [+ bias].
        target = y_tile if shift is None else product
        target[...] = nisa.scalar_tensor_tensor(
            data=scale,
            op0=nl.multiply,
            operand0=slot.rstd[:parts, :],
            op1=nl.multiply,
            operand1=slot.h[:parts, :],
            dtype=target.dtype,
        )
        if shift is not None:
            y_tile[...] = nisa.tensor_tensor(product, shift, op=nl.add, dtype=y_tile.dtype)
    else:
        xhat = slot.h[:parts, :] if slot.x is None else slot.x[:parts, :]
        steps.normalize(
            plan, y_tile, slot.h[:parts, :], slot.rstd[:parts, :], xhat, scale, shift, product
        )
    steps.store_y(plan, y_v[segs, i_f], y_tile)
