"""Forward regime "packed": short rows (QK-norm heads, N·bytes ≤ ``PACKED_MAX_ROW_BYTES``),
many rows per partition, each instruction covering as many of them as the arithmetic allows.

With one row per partition a tile of short rows moves a few hundred bytes per partition: a
DMA's fixed cost and every instruction's (the small rstd steps above all) are paid for a few
kilobytes. Here a tile is (parts, k·N), partition p holding k consecutive rows (the tensors
viewed as (M / k, k·N), k dividing M), so one DMA moves k·N elements per partition, and:

* Σh² per row on the Scalar engine: one ``activation_reduce`` a row, whose reduction runs
  along the whole free axis of its input (aws-neuron-sdk@8a38e733
  general/nki/api/nki/isa/__init__.py L197, the doc of ``activation_reduce``);
* rstd of all k rows at once: the mean square on the Vector engine, its reverse square root
  on the GpSimd engine (two instructions a tile, :func:`rmsnorm_fwd_steps.rstd_on_gpsimd`);
* x̂ = h·rstd per row on the Scalar engine (``activation`` with a (parts, 1) ``scale``
  tile, same file L107), every other row on the Vector engine (``tensor_scalar`` with a
  (parts, 1) operand, L1637), rounded
  to x's dtype in llama / none, fp32 in gemma (one rounding of y at the end);
* y = x̂·w (+ b) per ``PRODUCT_COLUMNS`` columns on the Vector engine against the weight
  (and bias) replicated along the free axis and broadcast across partitions in a PSUM bank
  once per kernel (a ones-row matmul: exact, every product 1·w); a ``tensor_tensor`` with
  one PSUM operand streams at one element a cycle.

The tiles run as a software pipeline (the statistics of tile t + 1 issued before the output
of tile t, :func:`packed_rows`), unrolled.

A per-head weight (heads, N) (QK-norm with a weight per head; the rows are tokens × heads,
row r of head r mod heads): k is a multiple of heads, so that row j of every partition is
of head j mod heads, and the weight is replicated as the (heads·N,) row of all heads, in
one PSUM bank per ``PSUM_COLS`` columns (:func:`_weight_banks`); a (N,) weight is the case
heads = 1, with the same instructions.

The arithmetic of a row does not depend on k or on the tile it is in, so the outputs are
batch-invariant; they are those of the "rows" regime up to rstd (GpSimd's reverse square
root instead of the Scalar engine's refined by Newton steps) and the gemma product's order
(x̂ in fp32, then ·w), both within the forward tests' tolerances.
"""

from __future__ import annotations

from nki_rmsnorm.kernels.legacy import rmsnorm_fwd_steps as steps
from nki_rmsnorm.nki import nisa, nl
from nki_rmsnorm.plan.forward import PSUM_COLS

#: Every this many rows, x̂ = h·rstd is formed on the Vector engine rather than the Scalar
#: engine, which also reduces every row: every other row balances the two (the Vector
#: engine multiplies every row by the weight too, at 0.96 GHz against the Scalar engine's
#: 1.2 GHz on trn2; modeled trn2 bf16 16384 × 128: every third row 38.6 µs, every other
#: 37.0 µs).
XHAT_ON_VECTOR_EVERY = 2

#: The Vector engine's products with the replicated weight (and bias) run per this many
#: columns rather than per PSUM bank, so that the next tile's short rstd steps wait behind
#: at most one such slice (modeled bf16, legacy kernels, with the unrolled pipeline: trn1
#: 4096 × 128 12.5 -> 12.0 µs, 16384 × 128 35.1 -> 32.5; trn2 13.1 -> 12.3, 38.7 -> 36.0).
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
    scale = (
        _weight_banks(hbm.weight.reshape((heads * N,)), N, k // heads, parts, plan, offset)
        if hbm.weight is not None
        else None
    )
    shift = (
        _replicated(hbm.bias, reps, parts, plan.bias_dtype, 0.0) if hbm.bias is not None else None
    )
    views = [
        None if t is None else t.reshape((groups, k * N))
        for t in (hbm.x, hbm.residual, hbm.y, hbm.h)
    ]
    views.append(hbm.rstd.reshape((groups, k)))
    tiles = []
    for group0 in range(0, groups, P):
        tiles.append((group0, min(P, groups - group0)))
    # Software pipeline, unrolled: the statistics of tile t + 1 are issued before the output
    # of tile t, so that the Scalar engine finds the next tile's Σh² ahead of this tile's
    # x̂ rows, which wait for its rstd.
    ahead = _statistics(plan, views, tiles[0][0], tiles[0][1], k, N, eps)
    for t in nl.static_range(len(tiles)):
        current = ahead
        if t + 1 < len(tiles):
            ahead = _statistics(plan, views, tiles[t + 1][0], tiles[t + 1][1], k, N, eps)
        _output(plan, views, k, heads, N, scale, shift, current)


def _replicated(vector_hbm, reps, parts, dtype, offset):
    """``vector_hbm`` (N,) + ``offset`` in ``dtype``, ``reps`` times along the free axis,
    broadcast to ``parts`` partitions in one fp32 PSUM bank that stays for the kernel: one
    load, then one ones-row matmul per replica into its columns of the bank (exact). One
    DMA, not one per replica: each DMA pays a fixed cost on its queue, and the first output
    waits for the bank."""
    n = vector_hbm.shape[0]
    moving = steps.convert_row(nl.load(vector_hbm.reshape((1, n))), dtype, offset)
    ones = nl.full((1, parts), 1.0, dtype=dtype)
    bank = nl.ndarray((parts, reps * n), dtype=nl.float32, buffer=nl.psum)
    for j in nl.static_range(reps):
        bank[:, j * n : (j + 1) * n] = nisa.nc_matmul(ones, moving)
    return bank


def _weight_banks(weight_row, n, tokens, parts, plan, offset):
    """The weight + offset in the scale dtype, broadcast to ``parts`` partitions in PSUM
    banks for the Vector engine's products (:func:`_segments` says which columns of a tile
    each bank multiplies). ``weight_row``: the (heads·n,) rows of all heads one after the
    other. Up to ``PSUM_COLS`` columns, one bank holding it ``min(tokens, PSUM_COLS //
    (heads·n))`` times (``tokens``: rows per partition / heads); longer, one bank per
    ``PSUM_COLS // n`` heads (one load, one ones-row matmul per bank, exact). The banks are
    ``PACKED_MAX_HEAD_BANKS`` tiles allocated before the loop that fills them: a tile
    created in a loop may not be used after it (general/nki/api/nki.errors.rst@8a38e733
    L417-L474)."""
    period = weight_row.shape[0]
    if period <= PSUM_COLS:
        reps = max(1, min(tokens, PSUM_COLS // period))
        return [_replicated(weight_row, reps, parts, plan.scale_dtype, offset)]
    moving = steps.convert_row(nl.load(weight_row.reshape((1, period))), plan.scale_dtype, offset)
    ones = nl.full((1, parts), 1.0, dtype=plan.scale_dtype)
    per_bank = (PSUM_COLS // n) * n
    banks = [
        nl.ndarray((parts, per_bank), dtype=nl.float32, buffer=nl.psum),
        nl.ndarray((parts, per_bank), dtype=nl.float32, buffer=nl.psum),
        nl.ndarray((parts, per_bank), dtype=nl.float32, buffer=nl.psum),
        nl.ndarray((parts, per_bank), dtype=nl.float32, buffer=nl.psum),
    ]
    for b in nl.static_range((period + per_bank - 1) // per_bank):
        c0 = b * per_bank
        c1 = min(period, c0 + per_bank)
        banks[b][:, : c1 - c0] = nisa.nc_matmul(ones, moving[:, c0:c1])
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
    x_v, residual_v, y_v, h_v, rstd_v = views
    width = k * N
    i_p = nl.arange(parts)[:, None]
    groups = group0 + i_p
    i_f = nl.arange(width)[None, :]
    i_k = nl.arange(k)[None, :]

    residual = residual_v is not None
    h_tile = nl.ndarray((parts, width), dtype=plan.h_dtype)
    x_tile = nl.ndarray((parts, width), dtype=plan.in_dtype) if residual else h_tile
    steps.load_h(
        h_tile,
        x_tile,
        x_v[groups, i_f],
        residual_v[groups, i_f] if residual else None,
        h_v[groups, i_f] if residual else None,
    )

    # ACT: Σh² per row; the squares are discarded into a bf16 scratch (fp32's exponent
    # range: the square of any input fits).
    squares = nl.ndarray((parts, N), dtype=nl.bfloat16)
    sum_sq = nl.ndarray((parts, k), dtype=nl.float32)
    for j in nl.static_range(k):
        squares[...] = nisa.activation_reduce(
            op=nl.square,
            data=h_tile[:, j * N : (j + 1) * N],
            reduce_op=nl.add,
            reduce_res=sum_sq[:, j : j + 1],
            dtype=nl.bfloat16,
        )
    rstd = steps.rstd_on_gpsimd(sum_sq, eps, N, mean_on_scalar=False)
    nl.store(rstd_v[groups, i_k], value=rstd)
    return group0, h_tile, rstd


def _output(plan, views, k, heads, N, scale, shift, state):
    """y of the tile whose statistics :func:`_statistics` returned, stored."""
    group0, h_tile, rstd = state
    parts = h_tile.shape[0]
    width = k * N
    y_v = views[2]
    groups = group0 + nl.arange(parts)[:, None]
    i_f = nl.arange(width)[None, :]
    # x̂ = h·rstd: rounded to x's dtype (llama / none), straight into y without a weight or
    # bias, else kept in fp32 for the one rounding of y (gemma)
    y_tile = nl.ndarray((parts, width), dtype=plan.result_dtype)
    direct = not plan.rounds_xhat and scale is None and shift is None
    xhat_dtype = plan.in_dtype if plan.rounds_xhat else nl.float32
    xhat = y_tile if direct else nl.ndarray((parts, width), dtype=xhat_dtype)
    for j in nl.static_range(k):
        data = h_tile[:, j * N : (j + 1) * N]
        xhat[:, j * N : (j + 1) * N] = (
            nisa.tensor_scalar(data, op0=nl.multiply, operand0=rstd[:, j : j + 1], dtype=xhat.dtype)
            if j % XHAT_ON_VECTOR_EVERY == XHAT_ON_VECTOR_EVERY - 1
            else nisa.activation(op=nl.copy, data=data, scale=rstd[:, j : j + 1], dtype=xhat.dtype)
        )
    # DVE: y = x̂ · w [+ b], per segment of the replicated weight's PSUM banks
    product = (
        nl.ndarray((parts, width), dtype=plan.product_dtype)
        if scale is not None and shift is not None
        else None
    )
    for segment in _segments(width, heads * N, N, k // heads):
        for c0, c1, b0, bank in _slices(segment):
            if scale is not None and shift is not None:
                product[:, c0:c1] = nisa.tensor_tensor(
                    xhat[:, c0:c1],
                    scale[bank][:parts, b0 : b0 + c1 - c0],
                    op=nl.multiply,
                    dtype=product.dtype,
                )
                y_tile[:, c0:c1] = nisa.tensor_tensor(
                    product[:, c0:c1],
                    shift[:parts, b0 : b0 + c1 - c0],
                    op=nl.add,
                    dtype=y_tile.dtype,
                )
            elif scale is not None:
                y_tile[:, c0:c1] = nisa.tensor_tensor(
                    xhat[:, c0:c1],
                    scale[bank][:parts, b0 : b0 + c1 - c0],
                    op=nl.multiply,
                    dtype=y_tile.dtype,
                )
            elif shift is not None:
                y_tile[:, c0:c1] = nisa.tensor_tensor(
                    xhat[:, c0:c1],
                    shift[:parts, b0 : b0 + c1 - c0],
                    op=nl.add,
                    dtype=y_tile.dtype,
                )
            elif not direct:
                y_tile[:, c0:c1] = nisa.tensor_copy(xhat[:, c0:c1], dtype=y_tile.dtype)
    steps.store_y(plan, y_v[groups, i_f], y_tile)
