"""Forward regime "packed" in the ``nki`` 0.6 dialect: short rows (QK-norm heads, N·bytes ≤
``PACKED_MAX_ROW_BYTES``), many rows per partition, each instruction covering all of them
where the arithmetic allows (see the legacy ``rmsnorm_fwd_packed`` for the design; the
instructions are the same).

A tile is (parts, k·N): partition p holds k consecutive rows (the tensors viewed as
(M / k, k·N)), so one DMA moves k·N elements per partition. Per tile: the Scalar engine's
Σh² per row (``activation_reduce`` over each row's N columns, one instruction a row:
its reduction is over the whole free axis of its input, aws-neuron-sdk@81ce03ae
nki/api/nki/isa/__init__.py L1461-1476), rstd once on the (parts, k) sums (the mean square on
the Vector engine, the reverse square root on the GpSimd engine:
``rmsnorm_fwd_steps.rstd_on_gpsimd``), h·rstd per row on the Scalar engine (``activation``
with a (parts, 1) ``scale`` tile, L1336; every other row a Vector ``tensor_scalar``, L1081),
then one Vector instruction per ``PRODUCT_COLUMNS`` columns multiplying by the weight
replicated along the free axis in a PSUM bank (built once), and one adding the bias,
replicated likewise. The tiles run as a two-stage software pipeline (``packed_rows``).

k divides M (the planner picks the largest such k up to its target), so every tile is whole
row groups. A per-head weight (heads, N) (QK-norm with a weight per head; the rows are
tokens × heads, row r of head r mod heads): k is a multiple of heads, so that row j of
every partition is of head j mod heads, and the weight is replicated as the (heads·N,) row
of all heads (one PSUM bank per ``PSUM_COLS`` columns, :func:`_weight_banks`); a (N,)
weight is the case heads = 1, with the same instructions as before.

LNC: the tiles are split between the cores as the "rows" regime splits them
(``rmsnorm_fwd_steps.core_tiles``); a row's instructions do not depend on its tile or core.
"""

from __future__ import annotations

from nki_rmsnorm.kernels.nki06 import rmsnorm_fwd_steps as steps
from nki_rmsnorm.kernels.nki06._nki import nisa, nl
from nki_rmsnorm.plan.forward import PMAX, PSUM_COLS, RowViews

#: The Tensor engine's row tiles on NeuronCore-v3+: "4x 32 row tiles" (aws-neuron-sdk@81ce03ae
#: nki/api/nki/isa/__init__.py L515-526). A row's rstd pieces sit at the start of one row
#: tile, so that its matmul contracts over its own pieces alone (see ``_outer_output``).
ROW_TILE = 32
#: ... four rows' pieces to one transposed tile.
ROWS_PER_TRANSPOSE = PMAX // ROW_TILE

#: Every this many rows, x̂ = h·rstd is formed on the Vector engine rather than the Scalar
#: engine, which also reduces every row: every other row balances the two (the Vector
#: engine multiplies every row by the weight too, at 0.96 GHz against the Scalar engine's
#: 1.2 GHz on trn2; modeled trn2 bf16 16384 × 128: every third row 38.6 µs, every other
#: 37.0 µs).
XHAT_ON_VECTOR_EVERY = 2

#: The Vector engine's products (y = h · (rstd ⊗ w) of the Tensor-engine product, x̂ · w
#: and + b against the replicated banks) run per this many columns rather than per PSUM
#: bank: the next tile's short steps (the rstd chain, passing between the Vector, GpSimd
#: and Tensor engines) then wait behind at most one such slice each time they come back to
#: the Vector engine (modeled bf16 4096 × 128: trn2 13.4 -> 12.5 µs, trn3 11.7 -> 11.1 µs;
#: 64 columns gain under 1 %).
PRODUCT_COLUMNS = 128


def packed_rows(plan, k, heads, hbm, eps, offset):
    """Every row read once and written once; tiles of ``k`` rows per partition (k divides
    M; a multiple of ``heads``, the first dimension of a per-head weight, else 1)."""
    M, N = hbm.x.shape
    P = nl.tile_size.pmax
    groups = M // k
    parts = min(P, groups)
    # as many rows as one PSUM bank of fp32 holds
    reps = max(1, min(k, PSUM_COLS // N))
    outer = hbm.weight is not None and plan.product_engine == "tensor"
    scale = None
    ident = None
    if outer:
        scale = _stacked(plan, hbm.weight.reshape((heads * N,)), offset)
        ident = steps.identity(parts, plan.scale_dtype)
    elif hbm.weight is not None:
        scale = _weight_banks(hbm.weight.reshape((heads * N,)), N, k // heads, parts, plan, offset)
    shift = None
    if hbm.bias is not None:
        shift = _replicated(hbm.bias, reps, parts, plan.bias_dtype, 0.0)

    def grouped(t):
        return None if t is None else t.reshape((groups, k * N))

    views = RowViews(
        x=grouped(hbm.x),
        residual=grouped(hbm.residual),
        y=grouped(hbm.y),
        h=grouped(hbm.h),
        rstd=hbm.rstd.reshape((groups, k)),
        y_transposed=hbm.y_transposed,
    )
    tiles = steps.core_tiles(groups, P)
    if outer:
        _outer_pipeline(plan, views, tiles, k, heads, N, eps, scale, shift, ident)
        return
    # Software pipeline: the statistics of tile t + 1 are issued before the output of tile
    # t, so that the Scalar engine, whose in-order stream looks only a few instructions
    # ahead, reduces the next tile while the Vector engine turns this tile's sums into rstd.
    ahead = None
    if tiles:
        ahead = _statistics(plan, views, tiles[0][0], tiles[0][1], k, N, eps)
    for t in range(len(tiles)):
        current = ahead
        if t + 1 < len(tiles):
            ahead = _statistics(plan, views, tiles[t + 1][0], tiles[t + 1][1], k, N, eps)
        _output(plan, views, k, heads, N, scale, shift, current)


def _outer_pipeline(plan, views, tiles, k, heads, N, eps, stacked, shift, ident):
    """The tiles of the Tensor-engine product as a three-stage software pipeline: the
    statistics of tile t + 2, then the transposed rstd pieces of tile t + 1, then the
    output of tile t. The pieces pass between the Vector, GpSimd and Tensor engines several
    times; issued a tile ahead, they are ready when the Vector engine reaches the tile's
    products, which then run back to back (modeled trn2 bf16 16384 × 128: two stages 34.8
    µs, three 32.0 µs)."""
    count = len(tiles)
    statistics = []
    for t in range(min(2, count)):
        statistics.append(_statistics(plan, views, tiles[t][0], tiles[t][1], k, N, eps))
    prepared = None
    if count:
        prepared = _transposed_rstd(plan, k, ident, statistics[0])
    for t in range(count):
        if t + 2 < count:
            group0, parts = tiles[t + 2]
            statistics.append(_statistics(plan, views, group0, parts, k, N, eps))
        following = None
        if t + 1 < count:
            following = _transposed_rstd(plan, k, ident, statistics[t + 1])
        _outer_output(plan, views, k, heads, N, stacked, shift, prepared)
        prepared = following


def _replicated(vector_hbm, reps, parts, dtype, offset):
    """``vector_hbm`` (N,) + ``offset`` in ``dtype``, ``reps`` times along the free axis,
    broadcast to ``parts`` partitions in one PSUM bank (reps·N ≤ 512 fp32), where it stays
    for the whole kernel: one load, then one ones-row matmul per replica into its columns
    of the bank (exact: every product is 1·w). One DMA, not one per replica: each DMA pays
    a fixed cost on its queue, and the first output waits for the bank. The Vector engine
    reads a PSUM operand of ``tensor_tensor`` at one element a cycle, twice the rate of two
    SBUF fp32 operands."""
    n = vector_hbm.shape[0]
    row = steps.sbuf((1, n), vector_hbm.dtype)
    nisa.dma_copy(dst=row, src=vector_hbm.reshape((1, n)))
    row = steps.convert_row(row, dtype, offset)
    ones = steps.sbuf((1, parts), dtype)
    nisa.memset(dst=ones, value=1.0)
    bank = nl.ndarray((parts, reps * n), dtype=nl.float32, buffer=nl.psum)
    for j in range(reps):
        nisa.nc_matmul(
            dst=bank[:, j * n : (j + 1) * n], stationary=ones, moving=row, accumulate=False
        )
    return bank


def _weight_banks(weight_row, n, tokens, parts, plan, offset):
    """The weight + offset in the scale dtype, broadcast to ``parts`` partitions in PSUM
    banks for the Vector engine's products (:func:`_segments` says which columns of a tile
    each bank multiplies). ``weight_row``: the (heads·n,) rows of all heads one after the
    other. Up to ``PSUM_COLS`` columns, one bank holding it ``min(tokens, PSUM_COLS //
    (heads·n))`` times (``tokens``: rows per partition / heads); longer, one bank per
    ``PSUM_COLS // n`` heads (one load, one ones-row matmul per bank, exact)."""
    period = weight_row.shape[0]
    if period <= PSUM_COLS:
        reps = max(1, min(tokens, PSUM_COLS // period))
        return [_replicated(weight_row, reps, parts, plan.scale_dtype, offset)]
    row = steps.sbuf((1, period), weight_row.dtype)
    nisa.dma_copy(dst=row, src=weight_row.reshape((1, period)))
    row = steps.convert_row(row, plan.scale_dtype, offset)
    ones = steps.sbuf((1, parts), plan.scale_dtype)
    nisa.memset(dst=ones, value=1.0)
    per_bank = (PSUM_COLS // n) * n
    banks = []
    for c0 in range(0, period, per_bank):
        c1 = min(period, c0 + per_bank)
        bank = nl.ndarray((parts, c1 - c0), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=bank, stationary=ones, moving=row[:, c0:c1], accumulate=False)
        banks.append(bank)
    return banks


def _segments(width, period, n, tokens):
    """(c0, c1, bank) per Vector-engine product of a tile row of ``width`` columns against
    the banks of :func:`_weight_banks` (``period`` = heads·n; without a weight, n): columns
    c0 … c1 − 1 of the tile times columns 0 … c1 − c0 − 1 of bank ``bank``. Every segment
    starts at a row, and at head 0 of a token when the whole period fits a bank."""
    segments = []
    if period <= PSUM_COLS:
        chunk = period * max(1, min(tokens, PSUM_COLS // period))
        for c0 in range(0, width, chunk):
            segments.append((c0, min(width, c0 + chunk), 0))
        return segments
    per_bank = (PSUM_COLS // n) * n
    for t0 in range(0, width, period):
        bank = 0
        for c0 in range(0, period, per_bank):
            segments.append((t0 + c0, t0 + min(period, c0 + per_bank), bank))
            bank = bank + 1
    return segments


def _slices(segment):
    """(c0, c1, b0, bank) per Vector-engine instruction of a :func:`_segments` segment:
    ``PRODUCT_COLUMNS`` columns at a time, tile columns c0 … c1 − 1 against bank columns
    b0 … b0 + c1 − c0 − 1."""
    start, end, bank = segment
    slices = []
    for c0 in range(start, end, PRODUCT_COLUMNS):
        slices.append((c0, min(end, c0 + PRODUCT_COLUMNS), c0 - start, bank))
    return slices


def _statistics(plan, views, group0, parts, k, N, eps):
    """Row groups ``group0 … group0 + parts − 1`` of ``views``, k rows per partition: load
    (and h = x + residual), Σh², rstd (stored); returns the tile's state for
    :func:`_output`."""
    x_v, residual_v, h_v, rstd_v = views.x, views.residual, views.h, views.rstd
    g1 = group0 + parts
    width = k * N
    residual = residual_v is not None
    h_tile = steps.sbuf((parts, width), plan.h_dtype)
    x_tile = steps.sbuf((parts, width), plan.in_dtype) if residual else h_tile
    steps.load_h(
        h_tile,
        x_tile,
        x_v[group0:g1, :],
        residual_v[group0:g1, :] if residual else None,
        h_v[group0:g1, :] if residual else None,
    )

    # ACT: Σh² per row; the squares are discarded into a bf16 scratch (fp32's exponent
    # range: the square of any input fits).
    squares = steps.sbuf((parts, N), nl.bfloat16)
    sum_sq = steps.sbuf((parts, k), nl.float32)
    for j in range(k):
        nisa.activation_reduce(
            dst=squares,
            op=nl.square,
            data=h_tile[:, j * N : (j + 1) * N],
            reduce_op=nl.add,
            reduce_res=sum_sq[:, j : j + 1],
        )
    rstd = steps.rstd_on_gpsimd(sum_sq, eps, N, mean_on_scalar=False)
    nisa.dma_copy(dst=rstd_v[group0:g1, :], src=rstd)
    return group0, h_tile, rstd


def _output(plan, views, k, heads, N, scale, shift, state):
    """y of the tile whose statistics :func:`_statistics` returned, stored."""
    group0, h_tile, rstd = state
    parts = h_tile.shape[0]
    width = k * N
    y_tile = steps.sbuf((parts, width), plan.result_dtype)
    # x̂ = h·rstd: rounded to x's dtype (llama / none), straight into y without a weight or
    # bias, else kept in fp32 for the one rounding of y (gemma)
    direct = not plan.rounds_xhat and scale is None and shift is None
    if plan.rounds_xhat:
        xhat = steps.sbuf((parts, width), plan.in_dtype)
    elif direct:
        xhat = y_tile
    else:
        xhat = steps.sbuf((parts, width), nl.float32)
    for j in range(k):
        dst = xhat[:, j * N : (j + 1) * N]
        data = h_tile[:, j * N : (j + 1) * N]
        if j % XHAT_ON_VECTOR_EVERY == XHAT_ON_VECTOR_EVERY - 1:
            nisa.tensor_scalar(dst=dst, data=data, op0=nl.multiply, operand0=rstd[:, j : j + 1])
        else:
            nisa.activation(dst=dst, op=nl.copy, data=data, scale=rstd[:, j : j + 1])
    # DVE: y = x̂ · w [+ b], per segment of the replicated weight's PSUM banks
    for segment in _segments(width, heads * N, N, k // heads):
        for c0, c1, b0, bank in _slices(segment):
            x_c = xhat[:, c0:c1]
            y_c = y_tile[:, c0:c1]
            if scale is not None and shift is not None:
                product = steps.sbuf((parts, c1 - c0), plan.product_dtype)
                w_c = scale[bank][:parts, b0 : b0 + c1 - c0]
                nisa.tensor_tensor(dst=product, data1=x_c, data2=w_c, op=nl.multiply)
                b_c = shift[:parts, b0 : b0 + c1 - c0]
                nisa.tensor_tensor(dst=y_c, data1=product, data2=b_c, op=nl.add)
            elif scale is not None:
                w_c = scale[bank][:parts, b0 : b0 + c1 - c0]
                nisa.tensor_tensor(dst=y_c, data1=x_c, data2=w_c, op=nl.multiply)
            elif shift is not None:
                b_c = shift[:parts, b0 : b0 + c1 - c0]
                nisa.tensor_tensor(dst=y_c, data1=x_c, data2=b_c, op=nl.add)
            elif not direct:
                nisa.tensor_copy(dst=y_c, src=x_c)
    steps.store_rows_y(plan, views, group0, parts, y_tile)


def _stacked(plan, weight_hbm, offset):
    """w + offset in the scale dtype, (128, heads·N) in SBUF (the rows of a per-head weight
    one after the other): the Tensor engine's moving operand, of which each matmul reads the
    partitions of one row tile and the columns of one head, against the rstd pieces
    (:func:`_rstd_slots`). Three pieces (bf16 weight): the first partition of each row tile
    (0, 32, 64, 96) holds the weight as it is, against the high piece, the next two its
    finite part (±Inf and NaN zeroed), against the middle and low pieces, which may be zero
    (0·Inf is NaN; see ``steps.weight_rows``). The high piece is bf16(rstd): positive, so
    that hi·w is the ±Inf or NaN IEEE gives rstd·w, or itself 0 / Inf / NaN for a row whose
    y is NaN in that column anyway (an infinite element, a zero row with eps = 0, a NaN).
    One piece (fp32 rstd against an fp32 weight + offset): every partition holds w + offset.
    −0 is made +0 throughout (the "rows" regime's ones-row broadcast starts from +0;
    ``steps.signed_zeros_positive``).

    Built once: one load of the weight as a row, then per ``PSUM_COLS`` columns a ones-row
    matmul broadcasting it to every partition (exact, one product 1·w per element, ±Inf and
    NaN included) and, on the Vector engine reading that bank, w + offset, the non-finite
    elements set to 0 by a predicated copy (v·0 == 0 exactly where v is finite) and the four
    raw rows put back."""
    n = weight_hbm.shape[0]
    row = steps.sbuf((1, n), weight_hbm.dtype)
    nisa.dma_copy(dst=row, src=weight_hbm.reshape((1, n)))
    ones = steps.sbuf((1, PMAX), weight_hbm.dtype)
    nisa.memset(dst=ones, value=1.0)
    stacked = steps.sbuf((PMAX, n), plan.scale_dtype)
    finite = None
    if plan.rstd_pieces > 1:
        finite = steps.sbuf((PMAX, n), nl.uint8)
    for c0 in range(0, n, PSUM_COLS):
        c1 = min(n, c0 + PSUM_COLS)
        raw = nl.ndarray((PMAX, c1 - c0), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=raw, stationary=ones, moving=row[:, c0:c1], accumulate=False)
        part = stacked[:, c0:c1]
        nisa.tensor_scalar(dst=part, data=raw, op0=nl.add, operand0=float(offset))
        if finite is None:
            continue
        mask = finite[:, c0:c1]
        nisa.tensor_scalar(
            dst=mask, data=part, op0=nl.multiply, operand0=0.0, op1=nl.equal, operand1=0.0
        )
        nisa.tensor_copy_predicated(dst=part, src=0.0, predicate=mask, reverse_pred=True)
        for start in range(0, PMAX, ROW_TILE):
            nisa.tensor_scalar(
                dst=part[start : start + 1, :],
                data=raw[start : start + 1, :],
                op0=nl.add,
                operand0=float(offset),
            )
    return stacked


def _rstd_slots(plan, rstd):
    """rstd (parts, k) fp32 as the Tensor engine's operand, (parts, k·32): row j's pieces
    in columns 32·j … 32·j + pieces − 1 (the rest unused), so that four rows transpose into
    one (128, parts) tile with each row's pieces at the start of a row tile. Three pieces
    (bf16 weight): hi = bf16(rstd), mid = bf16(rstd − hi), lo = bf16(rstd − hi − mid), whose
    sum is rstd exactly (each difference is exact in fp32); the copies on the GpSimd engine,
    the differences on the Vector engine, each instruction covering all k rows. One piece:
    rstd itself (an fp32 matmul against an fp32 weight + offset)."""
    parts, k = rstd.shape
    slots = steps.sbuf((parts, k * ROW_TILE), plan.scale_dtype)
    pieces = slots.reshape((parts, k, ROW_TILE))
    nisa.tensor_copy(dst=pieces[:, :, 0], src=rstd, engine=nisa.gpsimd_engine)
    if plan.rstd_pieces == 3:
        rest = steps.sbuf((parts, k), nl.float32)
        nisa.tensor_tensor(dst=rest, data1=rstd, data2=pieces[:, :, 0], op=nl.subtract)
        nisa.tensor_copy(dst=pieces[:, :, 1], src=rest, engine=nisa.gpsimd_engine)
        nisa.tensor_tensor(dst=pieces[:, :, 2], data1=rest, data2=pieces[:, :, 1], op=nl.subtract)
    return slots


def _transposed_rstd(plan, k, ident, state):
    """The tile's rstd pieces as the Tensor engine's stationary operands: per four rows,
    their pieces (:func:`_rstd_slots`) transposed at once (PE, exact) into a (128, parts)
    PSUM tile, row j's pieces starting at partition 32·(j mod 4), and copied to SBUF (one
    Vector instruction of 128 elements a partition); returns the state for
    :func:`_outer_output`."""
    group0, h_tile, rstd = state
    parts = h_tile.shape[0]
    pieces = plan.rstd_pieces
    slots = _rstd_slots(plan, rstd)
    transposed_rows = []
    for q0 in range(0, k, ROWS_PER_TRANSPOSE):
        q1 = min(k, q0 + ROWS_PER_TRANSPOSE)
        height = (q1 - q0 - 1) * ROW_TILE + pieces
        transposed = nl.ndarray((height, parts), dtype=slots.dtype, buffer=nl.psum)
        nisa.nc_matmul(
            dst=transposed,
            stationary=slots[:, q0 * ROW_TILE : q0 * ROW_TILE + height],
            moving=ident[:parts, :parts],
            is_transpose=True,
        )
        stationary = steps.sbuf((height, parts), slots.dtype)
        nisa.tensor_copy(dst=stationary, src=transposed)
        transposed_rows.append(stationary)
    return group0, h_tile, transposed_rows


def _outer_output(plan, views, k, heads, N, stacked, shift, state):
    """y of the tile whose rstd :func:`_transposed_rstd` transposed, stored, with the
    Tensor engine forming rstd ⊗ w (gemma with a weight on NeuronCore-v3+, as the "rows"
    regime's ``tensor`` product), so that the Scalar engine only reduces and the Vector
    engine makes one pass over h: per row, one matmul of its pieces against the weight, in
    the row tile its pieces start (contracting over that row's pieces alone: a NaN or
    infinite rstd stays in its own row) and its head's columns of the weight, into its
    columns of a PSUM bank; per ``PRODUCT_COLUMNS`` columns of the bank, one Vector
    multiply y = h · (rstd ⊗ w) reading PSUM (one element a cycle); the bias is added in
    fp32 after."""
    group0, h_tile, transposed_rows = state
    parts = h_tile.shape[0]
    width = k * N
    pieces = plan.rstd_pieces
    y_tile = steps.sbuf((parts, width), plan.result_dtype)
    product = None
    if shift is not None:
        product = steps.sbuf((parts, width), plan.product_dtype)
    target = y_tile if shift is None else product
    rows_per_bank = max(1, min(k, PSUM_COLS // N))
    for j0 in range(0, k, rows_per_bank):
        j1 = min(k, j0 + rows_per_bank)
        outer = nl.ndarray((parts, (j1 - j0) * N), dtype=nl.float32, buffer=nl.psum)
        for j in range(j0, j1):
            start = (j % ROWS_PER_TRANSPOSE) * ROW_TILE
            nisa.nc_matmul(
                dst=outer[:, (j - j0) * N : (j - j0 + 1) * N],
                stationary=transposed_rows[j // ROWS_PER_TRANSPOSE][start : start + pieces, :],
                moving=stacked[start : start + pieces, (j % heads) * N : (j % heads + 1) * N],
                accumulate=False,
                tile_position=(start, 0),
                tile_size=(ROW_TILE, PMAX),
            )
        c0, c1 = j0 * N, j1 * N
        for p0 in range(c0, c1, PRODUCT_COLUMNS):
            p1 = min(c1, p0 + PRODUCT_COLUMNS)
            nisa.tensor_tensor(
                dst=target[:, p0:p1],
                data1=h_tile[:, p0:p1],
                data2=outer[:, p0 - c0 : p1 - c0],
                op=nl.multiply,
            )
        if shift is not None:
            nisa.tensor_tensor(
                dst=y_tile[:, c0:c1],
                data1=product[:, c0:c1],
                data2=shift[:parts, : c1 - c0],
                op=nl.add,
            )
    steps.store_rows_y(plan, views, group0, parts, y_tile)
