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
* the rstd chain: v and rsqrt on the tile's row of R sums, rstd stored from that row, and
  one copy (GpSimd, from a broadcast view) and one transpose (PE) to a PSUM column the
  product reads directly (for one row: a K = 1 ones-row matmul), where the legacy kernel
  transposes the sums to a column, back to a row, repeats it with s copies, transposes it
  again and copies it to SBUF: a decode batch is one or two tiles, and its latency is that
  dependent chain (modeled trn2 bf16 1 × 4096: 7.9 → 4.7 µs);
* a batch of one tile (M·s ≤ 128: a decode batch where the statistics are grouped) reads
  the weight and bias once per row, by one DMA from a broadcast view, instead of doubling
  them on chip by log2(rows) dependent DMAs (:func:`_segments_per_row`), and forms y in k
  times the partitions (:func:`_output_spread`): Σh² and rstd keep the "rows" regime's
  groups, y is elementwise;
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
from nki_rmsnorm.plan.forward import PSUM_COLS, SPLIT_SLOTS, RowViews, group_width

#: The second layout of a one-tile batch keeps segments of at least this many columns
#: (:func:`_output_spread`).
SPREAD_MIN_COLUMNS = 32


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


def split_rows(plan, s, hbm, eps, offset):
    """Rows of N = s·F columns, segment q of row r on partition r·s + q. A batch of one
    tile whose segments are long (a decode batch) forms y in a second layout of k times the
    segments (:func:`_output_spread`)."""
    M, N = hbm.x.shape
    if N % s:
        _uneven_rows(plan, s, hbm, eps, offset)
        return
    P = nl.tile_size.pmax
    F = N // s
    segments = M * s
    mine = steps.core_tiles(segments, P)
    if not mine:
        return
    parts = min(P, segments)
    spread = _output_spread(segments, F, P)
    views = _views(hbm, s)
    # A batch of one tile reads the weight and bias once per row (:func:`_segments_per_row`),
    # and a spread one only where it forms y.
    weights = "once" if segments > P else "per_row"
    resident = _resident(plan, hbm, s, parts, eps, offset, weights if spread == 1 else None)
    slots = []
    for _ in range(SPLIT_SLOTS if len(mine) > 1 else 1):
        slots.append(_slot(plan, hbm, parts, F))
    if spread > 1:
        # One tile: Σh² and rstd from the s-segment layout (the "rows" regime's groups),
        # y from the same h moved on chip into s·k segments per row (:func:`_output_spread`).
        # Every step of the product is elementwise, so a row's y is the same bits in either
        # layout.
        wide = s * spread
        wide_parts = parts * spread
        # the rows' load first (its DMA engines then serve it before the weight's), then the
        # weight and bias (and their conversion), off the rstd chain
        _split_load(views, slots[0], 0, parts)
        wide_resident = _resident(plan, hbm, wide, wide_parts, eps, offset, "per_row", False)
        column = _split_statistics(plan, s, views, resident, slots[0], 0, parts, wide, True)
        _split_output(
            plan,
            _views(hbm, wide),
            wide_resident,
            _slot(plan, hbm, wide_parts, F // spread),
            column,
            0,
            wide_parts,
            slots[0].h[:parts],
        )
        return
    # Software pipeline, unrolled: the statistics of tile t + 1 are issued before the
    # output of tile t (each returns the PSUM column of its segments' rstd).
    seg0, count = mine[0]
    ahead = _split_statistics(plan, s, views, resident, slots[0], seg0, count, s)
    for t in range(len(mine)):
        current = ahead
        if t + 1 < len(mine):
            seg0, count = mine[t + 1]
            slot = slots[(t + 1) % SPLIT_SLOTS]
            ahead = _split_statistics(plan, s, views, resident, slot, seg0, count, s)
        seg0, count = mine[t]
        _split_output(plan, views, resident, slots[t % SPLIT_SLOTS], current, seg0, count, None)


def _output_spread(segments, F, P):
    """k: a batch of one tile of ``segments`` segments of F columns forms y in k·segments
    partitions of F / k columns, the largest power of two with k·segments ≤ P and F / k ≥
    ``SPREAD_MIN_COLUMNS`` (1: the batch takes more than one tile, or its segments are
    short). Its h moves there by one SBUF-to-SBUF DMA (a row is the same run of elements in
    both layouts), beside the rstd chain it would otherwise wait on, and the product and
    the store then run on k times the partitions and DMA engines."""
    spread = 1
    if segments <= P:
        for _ in range(7):
            wider = 2 * spread
            if wider * segments <= P and F % wider == 0 and F // wider >= SPREAD_MIN_COLUMNS:
                spread = wider
    return spread


def _views(hbm, s):
    """The HBM tensors as rows of s segments each (rstd as one row)."""
    M, N = hbm.x.shape
    segments = M * s
    F = N // s
    return RowViews(
        x=_segmented(hbm.x, segments, F),
        residual=_segmented(hbm.residual, segments, F),
        y=_segmented(hbm.y, segments, F),
        h=_segmented(hbm.h, segments, F),
        rstd=hbm.rstd.reshape((1, M)),
        y_transposed=hbm.y_transposed,
    )


def _resident(plan, hbm, s, parts, eps, offset, weights, statistics=True):
    """The fp32 identity (with ``statistics``: the layout takes Σh² and rstd) and the
    weight and bias segments of rows of s segments on ``parts`` partitions, read
    ``weights`` ("once" or "per_row": :func:`_segments_per_row`; None: neither)."""
    N = hbm.x.shape[1]
    F = N // s
    per_row = weights == "per_row"
    scale = shift = None
    if weights is not None and hbm.weight is not None:
        scale = _segments_per_row(
            hbm.weight.reshape((s, F)), parts, plan.scale_dtype, per_row, offset
        )
    if weights is not None and hbm.bias is not None:
        shift = _segments_per_row(hbm.bias.reshape((s, F)), parts, plan.bias_dtype, per_row)
    return _Resident(
        eps=eps,
        scale=scale,
        shift=shift,
        ident_f32=steps.identity(parts, nl.float32) if statistics else None,
    )


def _slot(plan, hbm, parts, F):
    """One set of tile buffers of (parts, F)."""

    def buffer(dtype):
        return None if dtype is None else steps.sbuf((parts, F), dtype)

    xhat_dtype = plan.in_dtype if hbm.residual is not None else None
    squares_dtype = nl.bfloat16 if plan.squares_in == "scratch" else None
    return _Slot(
        x=buffer(xhat_dtype),
        h=buffer(plan.h_dtype),
        y=buffer(plan.result_dtype),
        product=buffer(plan.product_dtype),
        squares=buffer(squares_dtype),
    )


def _segmented(tensor, segments, width):
    """``tensor`` viewed as (segments, width), one row segment per row (None for an absent
    tensor)."""
    return None if tensor is None else tensor.reshape((segments, width))


def _segments_per_row(segments_hbm, parts, dtype, per_row, offset=0.0):
    """(parts, F): partition p holds segment p mod s, converted to ``dtype`` (+ offset),
    −0 made +0 (``steps.signed_zeros_positive``) as the "rows" regime's Tensor-engine
    product and ones-row broadcast make it. The s segments are loaded once and doubled on
    chip (:func:`_doubled`), or with ``per_row`` (a batch of one tile) read once per row of
    the tile by one DMA from a broadcast view of them (``NkiTensor.broadcast`` of the HBM
    tensor's size-1 leading dim, a stride-0 source:
    nki/api/nki/language/__init__.py@81ce03ae L244-262; ``dma_copy`` needs only equal
    element counts, nki/api/nki/isa/__init__.py@81ce03ae L289): no chain of log2(rows)
    dependent SBUF-to-SBUF DMAs before the batch's only product, for the weight's bytes
    once per row (as many as x's)."""
    s, F = segments_hbm.shape
    rows = steps.sbuf((parts, F), dtype)
    if not per_row:
        steps.load_converted(rows[0:s, :], segments_hbm, offset)
        steps.signed_zeros_positive(rows[0:s, :])
        _doubled(rows, s)
        return rows
    repeats = segments_hbm.reshape((1, s, F)).broadcast(0, parts // s)
    if not offset and segments_hbm.dtype == dtype:
        nisa.dma_copy(dst=rows, src=repeats)
    else:
        staged = steps.sbuf((parts, F), segments_hbm.dtype)
        nisa.dma_copy(dst=staged, src=repeats)
        if offset:
            nisa.tensor_scalar(dst=rows, data=staged, op0=nl.add, operand0=offset)
        else:
            nisa.tensor_copy(dst=rows, src=staged)
    steps.signed_zeros_positive(rows)
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


def _split_load(views, slot, seg0, parts):
    """DMA segments ``seg0 … seg0 + parts − 1`` into ``slot`` (with a residual: DVE h = x +
    residual, DMA h out)."""
    segs = slice(seg0, seg0 + parts)
    steps.load_h(
        slot.h[:parts],
        None if slot.x is None else slot.x[:parts],
        views.x[segs, :],
        None if views.residual is None else views.residual[segs, :],
        None if views.h is None else views.h[segs, :],
    )


def _segment_sums(plan, resident, slot, parts):
    """Σh² of each of the ``parts`` segments in ``slot.h`` (ACT ``activation_reduce``),
    transposed by PE into one (1, ``parts``) PSUM row (exact: ``is_transpose`` moves the
    values)."""
    if plan.squares_in == "product":
        squares = slot.product
    elif plan.squares_in == "y":
        squares = slot.y
    else:
        squares = slot.squares
    segment_sq = steps.sbuf((parts, 1), nl.float32)
    nisa.activation_reduce(
        dst=squares[:parts],
        op=nl.square,
        data=slot.h[:parts],
        reduce_op=nl.add,
        reduce_res=segment_sq,
    )
    sums = nl.ndarray((1, parts), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(
        dst=sums,
        stationary=segment_sq,
        moving=resident.ident_f32[:parts, :parts],
        is_transpose=True,
    )
    return sums


def _split_statistics(plan, s, views, resident, slot, seg0, parts, repeat, loaded=False):
    """Load segments ``seg0 … seg0 + parts − 1`` (rows ``seg0 / s …``) into ``slot``
    (:func:`_split_load`, unless ``loaded``), store their rstd and return what
    :func:`_split_output` multiplies by: a PSUM column of R·``repeat`` rstd (R = parts / s
    rows), each row's rstd on ``repeat`` consecutive partitions (s, or the k·s segments of
    :func:`_output_spread`)."""
    residual_v = views.residual
    F = views.x.shape[1]
    N = F * s
    R = parts // s
    if not loaded:
        _split_load(views, slot, seg0, parts)
    # DVE: each row's s segment sums added.
    sums = _segment_sums(plan, resident, slot, parts)
    row_sq = steps.sbuf((1, R), nl.float32)
    nisa.tensor_reduce(dst=row_sq, op=nl.add, data=sums.reshape((1, R, s)), axis=2)

    # The rstd chain on that row of R sums (a short dependent chain: a decode batch is one
    # or two tiles, and each step is a semaphore hop): v = Σh²/N + eps on DVE or ACT, and
    # GpSimd's rsqrt (``steps.rstd_on_gpsimd``; elementwise: the same values as the "rows"
    # regime's per-partition chain); rstd stored from that row. In a pipeline of tiles
    # without a residual ACT carries the heavier load (the next Σh²) and v goes to DVE;
    # with one DVE does (the add and the product) and v stays on ACT; a tile alone
    # (``repeat`` != s, :func:`_output_spread`) takes ACT, idle by then and one semaphore
    # hop from DVE's reduce (a dependent DVE step waits longer). Either way the same values:
    # v rounds twice in fp32 on both engines.
    on_scalar = residual_v is not None or repeat != s
    rstd_row = steps.rstd_on_gpsimd(row_sq, resident.eps, N, on_scalar)
    row0 = seg0 // s
    nisa.dma_copy(dst=views.rstd[:, row0 : row0 + R], src=rstd_row)
    # Then one rstd per partition of the segments, in PSUM, where the product reads it
    # (``activation`` scale and ``scalar_tensor_tensor`` operand0 may be PSUM tiles:
    # nki/api/nki/isa/__init__.py@81ce03ae L1404-1405, L2478-2479): for one row a K = 1
    # matmul of a ones row against it (PE; exact, 1·rstd); for R rows GpSimd repeats each
    # rstd ``repeat`` times in a row by one copy from a broadcast view
    # (``NkiTensor.broadcast``, a stride-0 source: nki/api/nki/language/__init__.py@81ce03ae
    # L244-262) and PE transposes that row (exact: ``is_transpose`` moves the values).
    column = nl.ndarray((R * repeat, 1), dtype=nl.float32, buffer=nl.psum)
    if R == 1:
        ones = steps.sbuf((1, repeat), nl.float32)
        nisa.memset(dst=ones, value=1.0, engine=nisa.engine.gpsimd)
        nisa.nc_matmul(dst=column, stationary=ones, moving=rstd_row)
    else:
        repeated = steps.sbuf((1, R * repeat), nl.float32)
        nisa.tensor_copy(
            dst=repeated.reshape((1, R, repeat)),
            src=rstd_row.expand_dim(2).broadcast(2, repeat),
            engine=nisa.engine.gpsimd,
        )
        nisa.nc_matmul(
            dst=column, stationary=repeated, moving=resident.ident_f32[:1, :1], is_transpose=True
        )
    return column


def _split_output(plan, views, resident, slot, rstd, seg0, parts, h_from):
    """y for the segments whose statistics :func:`_split_statistics` left in ``slot``,
    ``rstd`` their (parts, 1) PSUM column; ``h_from``: the statistics layout's h tile, moved
    into ``slot`` first (the spread layout of :func:`_output_spread`), or None. Stored to
    ``views`` (None: the caller stores the returned y tile; odd N, whose y is never
    transposed: that layout needs N divisible by 128)."""
    if h_from is not None:
        nisa.dma_copy(dst=slot.h[:parts], src=h_from)
    y_tile = slot.y[:parts]
    product = None if slot.product is None else slot.product[:parts]
    shift = None if resident.shift is None else resident.shift[:parts]
    scale = None if resident.scale is None else resident.scale[:parts]
    if plan.product_engine == "tensor" and scale is not None:
        # y = (w · rstd) · h, rounded as the "rows" regime's h · (rstd ⊗ w), [+ bias]: ACT
        # w · rstd into PSUM and DVE h · PSUM, one chunk in ``period`` DVE alone (module
        # docstring).
        period = 2 if nisa.get_nc_version() >= nisa.nc_version.gen4 else 4
        if h_from is not None:
            # the spread layout's short segments: one Vector instruction per chunk (an ACT
            # step before it would add a semaphore hop to the batch's only tile)
            period = 1
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
                    operand0=rstd,
                    op1=nl.multiply,
                    operand1=h_tile[:, c0:c1],
                )
            else:
                weighted = nl.ndarray((parts, c1 - c0), dtype=nl.float32, buffer=nl.psum)
                nisa.activation(dst=weighted, op=nl.copy, data=scale[:, c0:c1], scale=rstd)
                nisa.tensor_tensor(
                    dst=target[:, c0:c1], data1=h_tile[:, c0:c1], data2=weighted, op=nl.multiply
                )
        if shift is not None:
            nisa.tensor_tensor(dst=y_tile, data1=product, data2=shift, op=nl.add)
    else:
        xhat = slot.h[:parts] if slot.x is None else slot.x[:parts]
        steps.normalize(plan, y_tile, slot.h[:parts], rstd, xhat, scale, shift, product)
    if views is not None:
        steps.store_rows_y(plan, views, seg0, parts, y_tile)
    return y_tile


def _uneven_rows(plan, s, hbm, eps, offset):
    """Odd N (``plan.forward.group_width``): s − 1 segments of F = ⌈N / s⌉ columns and a
    last one of ``last`` < F. A tile of R rows (at most R₀ = P / s) holds the F-wide
    segments row-major on partitions r·(s − 1) + q and the last segments on partitions
    R₀·(s − 1) + r, zero-padded to F columns (the pad is zeroed before each load: x̂ may be
    written over h in place): each block is one DMA, and every instruction covers the
    tile's partitions from 0. Σh² of a row is its s segment sums in segment order, the
    "rows" regime's groups (``steps.grouped_sum`` pads its last group alike), so a row's
    bits do not depend on the batch."""
    M, N = hbm.x.shape
    P = nl.tile_size.pmax
    F = group_width(N, s)
    last = N - (s - 1) * F
    rows_per_tile = P // s
    mine = steps.core_tiles(M, rows_per_tile)
    if not mine:
        return
    R0 = min(rows_per_tile, M)
    parts = R0 * s
    resident = _Resident(
        eps=eps,
        scale=None
        if hbm.weight is None
        else _uneven_weights(hbm.weight, s, F, last, R0, plan.scale_dtype, offset),
        shift=None
        if hbm.bias is None
        else _uneven_weights(hbm.bias, s, F, last, R0, plan.bias_dtype),
        ident_f32=steps.identity(parts, nl.float32),
    )
    slots = []
    for _ in range(SPLIT_SLOTS if len(mine) > 1 else 1):
        slot = _slot(plan, hbm, parts, F)
        # a ragged tile leaves partitions of an earlier one (or none) in place: all defined
        for buffer in (slot.h, slot.x):
            if buffer is not None:
                nisa.memset(dst=buffer, value=0.0, engine=nisa.engine.gpsimd)
        slots.append(slot)
    row0, R = mine[0]
    ahead = _uneven_statistics(plan, s, hbm, resident, slots[0], row0, R, R0, F, last)
    for t in range(len(mine)):
        current = ahead
        if t + 1 < len(mine):
            row0, R = mine[t + 1]
            slot = slots[(t + 1) % SPLIT_SLOTS]
            ahead = _uneven_statistics(plan, s, hbm, resident, slot, row0, R, R0, F, last)
        row0, R = mine[t]
        y_tile = _split_output(
            plan, None, resident, slots[t % SPLIT_SLOTS], current, 0, parts, None
        )
        if plan.result_dtype != plan.out_dtype:
            converted = steps.sbuf(y_tile.shape, plan.out_dtype)
            nisa.tensor_copy(dst=converted, src=y_tile)
            y_tile = converted
        _uneven_blocks(hbm.y, y_tile, row0, R, R0, s, F, last, True)


def _uneven_blocks(tensor, tile, row0, R, R0, s, F, last, store):
    """DMA rows ``row0 … row0 + R − 1`` of the HBM ``tensor`` into (or, with ``store``, out
    of) the uneven layout's ``tile``: the F-wide segments as one (R, s − 1, F) access
    pattern (``NkiTensor.ap``, "analogous to torch.as_strided":
    nki/api/nki/language/__init__.py@81ce03ae L486-509; ``dma_copy`` needs only equal
    element counts, nki/api/nki/isa/__init__.py@81ce03ae L289), the last segments as a
    column slice."""
    N = tensor.shape[1]
    segments = tensor.ap(pattern=[[N, R], [F, s - 1], [1, F]], offset=row0 * N)
    tails = tensor[row0 : row0 + R, (s - 1) * F : N]
    full = tile[0 : R * (s - 1), :]
    short = tile[R0 * (s - 1) : R0 * (s - 1) + R, 0:last]
    if store:
        nisa.dma_copy(dst=segments, src=full)
        nisa.dma_copy(dst=tails, src=short)
    else:
        nisa.dma_copy(dst=full, src=segments)
        nisa.dma_copy(dst=short, src=tails)


def _uneven_weights(vector_hbm, s, F, last, R0, dtype, offset=0.0):
    """The weight (or bias) of the uneven layout for R₀ rows, converted to ``dtype`` (+
    offset), −0 made +0 (``steps.signed_zeros_positive``), zero in the pad: read once per
    row by two DMAs from stride-0 views (``NkiTensor.broadcast``:
    nki/api/nki/language/__init__.py@81ce03ae L244-262; a stride-0 ``ap`` pair as AWS's
    nki-library@d2ad3a5 src/nkilib_src/nkilib/core/moe/moe_cte/moe_cte_mx_utils.py L709)."""
    N = vector_hbm.shape[0]
    parts = R0 * s
    rows = steps.sbuf((parts, F), dtype)
    converts = offset or vector_hbm.dtype != dtype
    staged = rows
    if converts:
        staged = steps.sbuf((parts, F), vector_hbm.dtype)
    nisa.memset(dst=staged, value=0.0, engine=nisa.engine.gpsimd)
    segments = vector_hbm.ap(pattern=[[0, R0], [F, s - 1], [1, F]], offset=0)
    tails = vector_hbm.reshape((1, N))[:, (s - 1) * F : N].broadcast(0, R0)
    nisa.dma_copy(dst=staged[0 : R0 * (s - 1), :], src=segments)
    nisa.dma_copy(dst=staged[R0 * (s - 1) : parts, 0:last], src=tails)
    if offset:
        nisa.tensor_scalar(dst=rows, data=staged, op0=nl.add, operand0=offset)
    elif converts:
        nisa.tensor_copy(dst=rows, src=staged)
    steps.signed_zeros_positive(rows)
    return rows


def _uneven_statistics(plan, s, hbm, resident, slot, row0, R, R0, F, last):
    """Load rows ``row0 … row0 + R − 1`` into ``slot`` (uneven layout, :func:`_uneven_rows`),
    store their rstd and return the (R₀·s, 1) PSUM column of each partition's rstd."""
    M, N = hbm.x.shape
    parts = R0 * s
    h_tile = slot.h[:parts]
    nisa.memset(dst=h_tile[:, last:F], value=0.0, engine=nisa.engine.gpsimd)
    if hbm.residual is None:
        _uneven_blocks(hbm.x, h_tile, row0, R, R0, s, F, last, False)
    else:
        x_tile = slot.x[:parts]
        nisa.memset(dst=x_tile[:, last:F], value=0.0, engine=nisa.engine.gpsimd)
        _uneven_blocks(hbm.residual, h_tile, row0, R, R0, s, F, last, False)
        _uneven_blocks(hbm.x, x_tile, row0, R, R0, s, F, last, False)
        nisa.tensor_tensor(dst=h_tile, data1=x_tile, data2=h_tile, op=nl.add)
        _uneven_blocks(hbm.h, h_tile, row0, R, R0, s, F, last, True)

    # DVE: the segment sums into segment order per row (the F-wide segments, then the last),
    # each row's s sums added in that order.
    sums = _segment_sums(plan, resident, slot, parts)
    ordered = steps.sbuf((1, R * s), nl.float32)
    by_row = ordered.reshape((1, R, s))
    nisa.tensor_copy(
        dst=by_row[:, :, 0 : s - 1], src=sums[:, 0 : R * (s - 1)].reshape((1, R, s - 1))
    )
    nisa.tensor_copy(
        dst=by_row[:, :, s - 1 : s],
        src=sums[:, R0 * (s - 1) : R0 * (s - 1) + R].reshape((1, R, 1)),
    )
    row_sq = steps.sbuf((1, R), nl.float32)
    nisa.tensor_reduce(dst=row_sq, op=nl.add, data=by_row, axis=2)
    rstd_row = steps.rstd_on_gpsimd(row_sq, resident.eps, N, True)
    nisa.dma_copy(dst=hbm.rstd.reshape((1, M))[:, row0 : row0 + R], src=rstd_row)
    # each partition's rstd in a row (GpSimd, from broadcast views), transposed by PE
    repeated = steps.sbuf((1, parts), nl.float32)
    if R < R0:
        nisa.memset(dst=repeated, value=0.0, engine=nisa.engine.gpsimd)
    nisa.tensor_copy(
        dst=repeated[:, 0 : R * (s - 1)].reshape((1, R, s - 1)),
        src=rstd_row.expand_dim(2).broadcast(2, s - 1),
        engine=nisa.engine.gpsimd,
    )
    nisa.tensor_copy(
        dst=repeated[:, R0 * (s - 1) : R0 * (s - 1) + R], src=rstd_row, engine=nisa.engine.gpsimd
    )
    column = nl.ndarray((parts, 1), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(
        dst=column, stationary=repeated, moving=resident.ident_f32[:1, :1], is_transpose=True
    )
    return column
