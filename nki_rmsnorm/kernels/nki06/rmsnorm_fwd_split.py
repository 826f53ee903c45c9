"""Forward regime "split" in the ``nki`` 0.6 dialect: rows too long for whole-row tiles, each
spread over ``s`` partitions (NeuronCore-v3+). The legacy ``rmsnorm_fwd_split`` documents the
layout (segment q of row r on partition r·s + q, R = P / s whole rows per tile), the steps
and engines per tile, and the unrolled software pipeline over ``SPLIT_SLOTS`` buffer sets;
this module emits the same instructions in 0.6 idioms (dst-first ``nisa`` calls, slices and
step slices instead of index arithmetic, explicit PSUM tiles).

Written differently:

* gemma with a weight (the plan's "tensor" product): y = (w · rstd) · h against the
  per-row weight segments, not the legacy kernel's rstd pieces placed by a 0/1 mask and
  multiplied by the stacked weight segments on the Tensor engine. A masked zero times
  another segment's ±Inf or NaN weight is NaN there (0·Inf), in columns where IEEE gives a
  finite y. Per ``PSUM_COLS`` columns: the Scalar engine writes w · rstd (fp32) into a PSUM
  bank and the Vector engine multiplies h by it (one input in PSUM: N cycles, not the 2N
  of two SBUF inputs), except every fourth chunk (NeuronCore-v4, whose Vector engine is
  the faster: every second), which one Vector ``scalar_tensor_tensor`` computes from
  SBUF, so that neither engine carries the whole product (modeled bf16 256 × 65536: trn2
  317.7 µs all on DVE, 243.0 all through ACT, 226.5 so; trn3 255.8 all on DVE, 207.1 with
  every fourth chunk on DVE alone, 196.4 with every second).
  Both round as the "rows" regime's h · (rstd ⊗ w) (the rstd pieces sum exactly, so PSUM
  holds rstd·w rounded once to fp32, and fp32 w · rstd is that same rounding), with −0
  weights made +0 as there (``steps.signed_zeros_positive``): a row's y is bitwise the
  same in both regimes;
* on-chip containers are ``nl.NKIObject`` classes (the only user classes a kernel may use:
  nki/get-started/nki-language-guide.rst@81ce03ae, line 572).

LNC: under ``kernel[2]`` the row tiles are split between the two physical cores by
``nl.program_id(0)`` (core c a contiguous block, as ``rmsnorm_fwd_rows``); each core prepares
the weight and bias segments itself and runs its own pipeline. A row's instructions do not
depend on its tile or core, so results are bitwise those of LNC=1.
"""

from __future__ import annotations

from nki_rmsnorm.kernels.nki06 import rmsnorm_fwd_steps as steps
from nki_rmsnorm.kernels.nki06._nki import nisa, nl
from nki_rmsnorm.plan.forward import PSUM_COLS, SPLIT_SLOTS, RowViews


class _Resident(nl.NKIObject):
    """On-chip tiles every tile reads (see :func:`split_rows`)."""

    eps: float
    scale: object  # weight segments, (P, F) per row
    shift: object  # bias segments, (P, F) per row
    ident_f32: object  # fp32 identity: moves Σh² and rstd across partitions


class _Slot(nl.NKIObject):
    """One of the ``SPLIT_SLOTS`` sets of tile buffers the tiles rotate through."""

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
    mine = steps.core_tiles(segments, P)
    if not mine:
        return
    parts = min(P, segments)
    views = RowViews(
        x=_segmented(hbm.x, segments, F),
        residual=_segmented(hbm.residual, segments, F),
        y=_segmented(hbm.y, segments, F),
        h=_segmented(hbm.h, segments, F),
        rstd=hbm.rstd.reshape((M, 1)),
    )
    weight_segments = None if hbm.weight is None else hbm.weight.reshape((s, F))
    bias_segments = None if hbm.bias is None else hbm.bias.reshape((s, F))

    scale = shift = None
    if weight_segments is not None:
        scale = _segments_per_row(weight_segments, parts, plan.scale_dtype, offset)
    if bias_segments is not None:
        shift = _segments_per_row(bias_segments, parts, plan.bias_dtype)
    resident = _Resident(
        eps=eps,
        scale=scale,
        shift=shift,
        ident_f32=steps.identity(parts, nl.float32),
    )

    def buffer(dtype):
        return None if dtype is None else steps.sbuf((parts, F), dtype)

    xhat_dtype = plan.in_dtype if hbm.residual is not None else None
    squares_dtype = nl.bfloat16 if plan.squares_in == "scratch" else None
    slots = []
    for _ in range(SPLIT_SLOTS):
        slots.append(
            _Slot(
                x=buffer(xhat_dtype),
                h=buffer(plan.h_dtype),
                y=buffer(plan.result_dtype),
                product=buffer(plan.product_dtype),
                squares=buffer(squares_dtype),
                rstd=steps.sbuf((parts, 1), nl.float32),
            )
        )
    # Software pipeline, unrolled: the statistics of tile t + 1 are issued before the
    # output of tile t.
    seg0, count = mine[0]
    _split_statistics(plan, s, views, resident, slots[0], seg0, count)
    for t in range(len(mine)):
        if t + 1 < len(mine):
            seg0, count = mine[t + 1]
            _split_statistics(plan, s, views, resident, slots[(t + 1) % SPLIT_SLOTS], seg0, count)
        seg0, count = mine[t]
        _split_output(plan, views, resident, slots[t % SPLIT_SLOTS], seg0, count)


def _segmented(tensor, segments, width):
    """``tensor`` viewed as (segments, width), one row segment per row (None for an absent
    tensor)."""
    return None if tensor is None else tensor.reshape((segments, width))


def _segments_per_row(segments_hbm, parts, dtype, offset=0.0):
    """(parts, F): partition p holds segment p mod s, converted to ``dtype`` (+ offset),
    −0 made +0 (``steps.signed_zeros_positive``) as the "rows" regime's Tensor-engine
    product and ones-row broadcast make it. The s segments are loaded once and doubled on
    chip (:func:`_doubled`)."""
    s, F = segments_hbm.shape
    rows = steps.sbuf((parts, F), dtype)
    steps.load_converted(rows[0:s, :], segments_hbm, offset)
    steps.signed_zeros_positive(rows[0:s, :])
    _doubled(rows, s)
    return rows


def _doubled(rows, s):
    """Fill ``rows`` (parts, F) from its first s partitions, partition p taking p mod s's
    values, by SBUF-to-SBUF DMAs."""
    parts = rows.shape[0]
    filled = s
    # at most parts / s doublings (a bounded loop, as in the legacy kernel)
    for _ in range(parts // s):
        if filled < parts:
            count = min(filled, parts - filled)
            nisa.dma_copy(dst=rows[filled : filled + count, :], src=rows[0:count, :])
            filled += count


def _split_statistics(plan, s, views, resident, slot, seg0, parts):
    """Load segments ``seg0 … seg0 + parts − 1`` (rows ``seg0 / s …``) into ``slot``, store
    their rstd and leave in ``slot.rstd`` what :func:`_split_output` multiplies by."""
    x_v = views.x
    residual_v = views.residual
    h_v = views.h
    F = x_v.shape[1]
    N = F * s
    R = parts // s
    segs = slice(seg0, seg0 + parts)

    # DMA in (with a residual: DVE h = x + residual, DMA h out).
    h_tile = slot.h[:parts]
    steps.load_h(
        h_tile,
        None if slot.x is None else slot.x[:parts],
        x_v[segs, :],
        None if residual_v is None else residual_v[segs, :],
        None if h_v is None else h_v[segs, :],
    )
    if plan.squares_in == "product":
        squares = slot.product
    elif plan.squares_in == "y":
        squares = slot.y
    else:
        squares = slot.squares

    # ACT: Σh² per segment. PE: transposed to one row; DVE: each row's s sums added.
    segment_sq = steps.sbuf((parts, 1), nl.float32)
    nisa.activation_reduce(
        dst=squares[:parts], op=nl.square, data=h_tile, reduce_op=nl.add, reduce_res=segment_sq
    )
    sums = nl.ndarray((1, parts), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(
        dst=sums,
        stationary=segment_sq,
        moving=resident.ident_f32[:parts, :parts],
        is_transpose=True,
    )
    row_sq = steps.sbuf((1, R), nl.float32)
    nisa.tensor_reduce(dst=row_sq, op=nl.add, data=sums.reshape((1, R, s)), axis=2)

    # PE: the R sums transposed to one per partition; DVE: v = Σh²/N + eps, GpSimd: rsqrt
    # (no step of the chain on ACT, which is busy with the next whole-tile Σh²); rstd
    # stored. PE:
    # transposed back to a row; GpSimd: repeated for each segment of its row; PE: transposed
    # back to one rstd per partition. The transposes are exact (one 1·x product each).
    # Without a residual ACT carries the heavier load (Σh²) and the chain's small steps go
    # to DVE and GpSimd; with one DVE does (the add and the product) and they stay on ACT.
    # Either way the same values: v rounds twice in fp32 on both engines, and the pieces
    # are exact.
    fused = residual_v is not None
    rstd_by_row = steps.rstd_on_gpsimd(
        _transposed(row_sq, resident.ident_f32), resident.eps, N, mean_on_scalar=fused
    )
    row0 = seg0 // s
    nisa.dma_copy(dst=views.rstd[row0 : row0 + R, :], src=rstd_by_row)
    rstd_row = _transposed(rstd_by_row, resident.ident_f32)
    repeated = steps.sbuf((1, parts), nl.float32)
    for q in range(s):
        nisa.tensor_copy(dst=repeated[:, q:parts:s], src=rstd_row, engine=nisa.engine.gpsimd)
    column = nl.ndarray((parts, 1), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(
        dst=column, stationary=repeated, moving=resident.ident_f32[:1, :1], is_transpose=True
    )
    nisa.tensor_copy(dst=slot.rstd[:parts], src=column)


def _transposed(tile, ident):
    """An (a, b) fp32 SBUF tile as a (b, a) one: Tensor-engine transpose (exact), Vector
    copy out of PSUM."""
    a, b = tile.shape
    transposed = nl.ndarray((b, a), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=transposed, stationary=tile, moving=ident[:a, :a], is_transpose=True)
    out = steps.sbuf((b, a), nl.float32)
    nisa.tensor_copy(dst=out, src=transposed)
    return out


def _split_output(plan, views, resident, slot, seg0, parts):
    """y for the segments whose statistics :func:`_split_statistics` left in ``slot``."""
    y_v = views.y
    y_tile = slot.y[:parts]
    product = None if slot.product is None else slot.product[:parts]
    shift = None if resident.shift is None else resident.shift[:parts]
    scale = None if resident.scale is None else resident.scale[:parts]
    if plan.product_engine == "tensor" and scale is not None:
        # y = (w · rstd) · h, rounded as the "rows" regime's h · (rstd ⊗ w), [+ bias]: ACT
        # w · rstd into PSUM and DVE h · PSUM, one chunk in ``period`` DVE alone (module
        # docstring).
        period = 2 if nisa.get_nc_version() >= nisa.nc_version.gen4 else 4
        target = y_tile if shift is None else product
        h_tile = slot.h[:parts]
        F = h_tile.shape[1]
        for c0 in range(0, F, PSUM_COLS):
            c1 = min(F, c0 + PSUM_COLS)
            if (c0 // PSUM_COLS) % period == period - 1:
                nisa.scalar_tensor_tensor(
                    dst=target[:, c0:c1],
                    data=scale[:, c0:c1],
                    op0=nl.multiply,
                    operand0=slot.rstd[:parts],
                    op1=nl.multiply,
                    operand1=h_tile[:, c0:c1],
                )
            else:
                weighted = nl.ndarray((parts, c1 - c0), dtype=nl.float32, buffer=nl.psum)
                nisa.activation(
                    dst=weighted, op=nl.copy, data=scale[:, c0:c1], scale=slot.rstd[:parts]
                )
                nisa.tensor_tensor(
                    dst=target[:, c0:c1], data1=h_tile[:, c0:c1], data2=weighted, op=nl.multiply
                )
        if shift is not None:
            nisa.tensor_tensor(dst=y_tile, data1=product, data2=shift, op=nl.add)
    else:
        xhat = slot.h[:parts] if slot.x is None else slot.x[:parts]
        steps.normalize(
            plan, y_tile, slot.h[:parts], slot.rstd[:parts], xhat, scale, shift, product
        )
    steps.store_y(plan, y_v[seg0 : seg0 + parts, :], y_tile)
