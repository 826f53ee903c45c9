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
      GpSimd, subtracted on DVE
PE    "tensor" (gemma): rstd ⊗ w per PSUM bank from a K = 3·s matmul: the bf16 pieces of
      partition p's rstd sit in the rows of its own segment q = p mod s (zeros in the other
      segments' rows; DVE places them), the moving rows hold the s weight segments;
      DVE y = h · it. Otherwise DVE, against the weight segments laid out one per partition
      (row p holds segment p mod s), as the "vector" plan of ``rmsnorm_fwd_steps``.
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
    scale: object  # weight segments: (3s | s, F) moving rows ("tensor") or (P, F) per row
    shift: object  # bias segments, (P, F) per row
    segment_mask: object  # (P, s): 1 where q == p mod s ("tensor")
    nonfinite: object  # (P, F): the weight's non-finite part of segment p mod s ("tensor")
    ident: object  # identity in the Tensor engine's operand dtype ("tensor")
    ident_f32: object  # fp32 identity: moves Σh² and rstd across partitions


class _Slot(NamedTuple):
    """One of the two sets of tile buffers the tiles rotate through (tile t uses slot
    t mod 2), so the statistics of tile t + 1 can run while tile t is normalised."""

    x: object  # with a residual: x, then x̂ in llama / none
    h: object
    y: object
    product: object
    squares: object
    rstd: object  # (P, 1): each segment's rstd, or the stationary rows ("tensor")
    rstd_col: object  # (P, 1): each segment's rstd ("tensor", for the non-finite weights)


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
    tensor = weight_segments is not None and plan.product_engine == "tensor"

    # Conditional expressions, not if blocks: a tile created in an if block may not be used
    # after it (general/nki/api/nki.errors.rst@8a38e733, L417-L474).
    # "tensor": the weight's finite part under the masked Tensor-engine product (a masked
    # zero times ±Inf or NaN would be NaN in other segments), its non-finite part per row
    # on the Vector engine (steps.outer_normalize)
    finite, nonfinite = (
        steps.finite_parts(hbm.weight, plan.scale_dtype, offset) if tensor else (None, None)
    )
    scale = (
        _stacked_segments(plan, s, finite)
        if tensor
        else None
        if weight_segments is None
        else _segments_per_row(weight_segments, parts, plan.scale_dtype, offset)
    )
    mask = _segment_mask(parts, s, plan.scale_dtype) if tensor else None
    ident = steps.identity(parts, plan.scale_dtype) if tensor else None
    shift = (
        None if bias_segments is None else _segments_per_row(bias_segments, parts, plan.bias_dtype)
    )
    nonfinite_rows = None if nonfinite is None else _nonfinite_per_row(nonfinite, s, F, parts)
    resident = _Resident(
        eps, scale, shift, mask, nonfinite_rows, ident, steps.identity(parts, nl.float32)
    )

    def buffer(dtype):
        return None if dtype is None else nl.ndarray((parts, F), dtype=dtype)

    def rstd_buffer():
        if mask is None:
            return nl.ndarray((parts, 1), dtype=nl.float32)
        return nl.ndarray((plan.rstd_pieces * s, parts), dtype=plan.scale_dtype)

    xhat_dtype = plan.in_dtype if hbm.residual is not None else None
    slots = [
        _Slot(
            buffer(xhat_dtype),
            buffer(plan.h_dtype),
            buffer(plan.result_dtype),
            buffer(plan.product_dtype),
            buffer(nl.bfloat16 if plan.squares_in == "scratch" else None),
            rstd_buffer(),
            nl.ndarray((parts, 1), dtype=nl.float32) if tensor else None,
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


def _stacked_segments(plan, s, finite):
    """The weight's finite part ``finite`` (``steps.finite_parts``) as moving rows, each
    piece's copy moved in by an SBUF-to-SBUF DMA: for ``plan.rstd_pieces`` pieces row
    b·s + q holds segment q."""
    F = finite.shape[0] * finite.shape[1] // s
    rows = nl.ndarray((plan.rstd_pieces * s, F), dtype=plan.scale_dtype)
    for piece in nl.static_range(plan.rstd_pieces):
        nisa.dma_copy(dst=rows[piece * s : (piece + 1) * s, :], src=finite)
    return rows


def _segments_per_row(segments_hbm, parts, dtype, offset=0.0):
    """(parts, F): partition p holds segment p mod s, converted to ``dtype`` (+ offset).
    The s segments are loaded once and doubled on chip by SBUF-to-SBUF DMAs."""
    s, F = segments_hbm.shape
    i_s = nl.arange(s)[:, None]
    i_f = nl.arange(F)[None, :]
    rows = nl.ndarray((parts, F), dtype=dtype)
    rows[0:s, :] = steps.convert_row(nl.load(segments_hbm[i_s, i_f]), dtype, offset)
    return _doubled(rows, s, parts)


def _nonfinite_per_row(nonfinite, s, F, parts):
    """(parts, F): partition p holds segment p mod s of the weight's non-finite part
    ``nonfinite`` (``steps.finite_parts``), moved in and doubled on chip by SBUF-to-SBUF DMAs."""
    rows = nl.ndarray((parts, F), dtype=nonfinite.dtype)
    nisa.dma_copy(dst=rows[0:s, :], src=nonfinite)
    return _doubled(rows, s, parts)


def _doubled(rows, s, parts):
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


def _segment_mask(parts, s, dtype):
    """(parts, s): 1 in column p mod s of partition p, 0 elsewhere (s a power of two)."""
    i_p = nl.arange(parts)[:, None]
    i_q = nl.arange(s)[None, :]
    offset = nisa.tensor_scalar(
        nisa.iota(i_q - i_p + parts * s, nl.int32), op0=nl.bitwise_and, operand0=s - 1
    )
    return nisa.tensor_scalar(offset, op0=nl.equal, operand0=0, dtype=dtype)


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
    h_tile = slot.h[:parts]
    steps.load_h(
        h_tile,
        None if slot.x is None else slot.x[:parts],
        x_v[segs, i_f],
        None if residual_v is None else residual_v[segs, i_f],
        None if h_v is None else h_v[segs, i_f],
    )
    squares = {"product": slot.product, "y": slot.y}.get(plan.squares_in, slot.squares)

    # ACT: Σh² per segment. PE: transposed to one row; DVE: each row's s sums added.
    segment_sq = nl.ndarray((parts, 1), dtype=nl.float32)
    squares[:parts][...] = nisa.activation_reduce(
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
    if resident.segment_mask is None:
        slot.rstd[:parts][...] = nisa.tensor_copy(column, dtype=nl.float32)
    else:
        rstd_col = slot.rstd_col[:parts]
        rstd_col[...] = nisa.tensor_copy(column, dtype=nl.float32)
        _segment_stationary(
            plan,
            s,
            rstd_col,
            resident.segment_mask[:parts],
            resident.ident[:parts, :parts],
            slot.rstd[:, :parts],
            batched=not fused,
        )


def _split_output(plan, views, resident, slot, seg0, parts):
    """y for the segments whose statistics :func:`_split_statistics` left in ``slot``."""
    y_v = views[2]
    F = y_v.shape[1]
    segs = seg0 + nl.arange(parts)[:, None]
    i_f = nl.arange(F)[None, :]
    y_tile = slot.y[:parts]
    product = None if slot.product is None else slot.product[:parts]
    shift = None if resident.shift is None else resident.shift[:parts]
    if resident.segment_mask is not None:
        steps.outer_normalize(
            y_tile,
            slot.h[:parts],
            [slot.rstd[:, :parts]],
            resident.scale,
            shift,
            product,
            nonfinite_per_row=(resident.nonfinite[:parts], slot.rstd_col[:parts]),
        )
    else:
        scale = None if resident.scale is None else resident.scale[:parts]
        xhat = slot.h[:parts] if slot.x is None else slot.x[:parts]
        steps.normalize(
            plan, y_tile, slot.h[:parts], slot.rstd[:parts], xhat, scale, shift, product
        )
    steps.store_y(plan, y_v[segs, i_f], y_tile)


def _segment_stationary(plan, s, rstd_col, mask, ident, out, batched=True):
    """Write into ``out`` (pieces·s, parts): column p holds the pieces of partition p's rstd
    in the rows b·s + (p mod s), zeros elsewhere. Pieces from ``split_rstd`` (``batched``:
    on the GpSimd and Vector engines, else on the Scalar engine), masking on the Vector
    engine, the transpose on the Tensor engine, the PSUM → SBUF copy on the Vector engine
    (the masking multiply is a ``tensor_scalar``, which GpSimd may run only for rsqrt:
    general/nki/api/nki/isa/__init__.py@8a38e733, line 1699)."""
    parts = rstd_col.shape[0]
    pieces = plan.rstd_pieces
    dtype = plan.scale_dtype
    split = steps.split_rstd(plan, rstd_col, batched)
    placed = nl.ndarray((parts, pieces * s), dtype=dtype)
    for b in nl.static_range(pieces):
        placed[:, b * s : (b + 1) * s] = nisa.tensor_scalar(
            mask, op0=nl.multiply, operand0=split[:, b : b + 1], dtype=dtype
        )
    transposed = nisa.nc_matmul(placed, ident, is_transpose=True)
    out[...] = nisa.tensor_copy(transposed, dtype=dtype)
