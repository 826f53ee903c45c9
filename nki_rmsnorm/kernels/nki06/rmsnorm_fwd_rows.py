"""Forward regime "rows" in the ``nki`` 0.6 dialect: whole rows on chip, k consecutive rows
per partition (see the legacy ``rmsnorm_fwd_rows`` for the tiling; the arithmetic and the
HBM traffic are the same).

LNC: under ``kernel[2]`` (trn2 / trn3, two physical cores per logical core) the row tiles
are split between the cores by ``nl.program_id(0)``: core c takes a contiguous block of
tiles, and the last core the ragged tile. A row's instructions do not depend on which tile
or core it is in, so the results are bitwise the same as at LNC=1; each core loads and
prepares the weight (and bias) itself, so those are read once per core. The planner is told
the core count (``choose_layout(..., cores=2)``), so each core keeps as many tiles to
pipeline as one core at LNC=1 (fewer rows per partition; a row's arithmetic does not depend
on them). At LNC=1 and LNC=2 alike the tiles run as a two-stage software pipeline (the
statistics of tile t + 1 issued before the output of tile t), so each engine's in-order
stream finds the next tile's first steps ahead of this tile's products. The legacy kernel
runs the tiles one after the other (same instructions, another order): it could carry a
tile into the next iteration only in explicit buffers allocated before the loop
(general/nki/api/nki.errors.rst@8a38e733, L417-L474), and two such buffers, reused, make
the cost model slower than its loop-body tiles on trn1.
"""

from __future__ import annotations

from nki_rmsnorm.kernels.nki06 import rmsnorm_fwd_steps as steps
from nki_rmsnorm.kernels.nki06._nki import nisa, nl
from nki_rmsnorm.plan.forward import RowsResident, RowViews


def rows_resident(plan, k, hbm, eps, offset, groups=0):
    """Every row read once and written once; tiles of ``k`` rows per partition; Σh² of a
    row from ``groups`` group sums (``plan.forward.statistic_groups``; 0: the whole row)."""
    M, N = hbm.x.shape
    P = nl.tile_size.pmax
    parts = min(P, M)

    weight = hbm.weight is not None
    weight_row = hbm.weight.reshape((1, N)) if weight else None
    engine = plan.product_engine if weight else None
    # PE's moving rows, ACT's scale row or DVE's broadcast weight, as the plan says
    if engine == "tensor":
        scale = steps.weight_rows(plan, weight_row, offset)
    elif engine == "scalar":
        scale = steps.scale_row(plan, weight_row, offset)
    elif weight:
        scale = steps.broadcast_row(weight_row, parts, plan.scale_dtype, offset)
    else:
        scale = None
    ident = steps.identity(parts, plan.scale_dtype) if engine == "tensor" else None
    ones = None
    if engine == "scalar":
        ones = steps.sbuf((1, parts), plan.scale_dtype)
        nisa.memset(dst=ones, value=1.0)
    shift = None
    if hbm.bias is not None:
        shift = steps.broadcast_row(hbm.bias.reshape((1, N)), parts, plan.bias_dtype)
    resident = RowsResident(scale, shift, ident, ones)

    # k consecutive rows are one row of these views: one contiguous run per partition.
    views = RowViews(
        x=_grouped(hbm.x, M // k, k * N),
        residual=_grouped(hbm.residual, M // k, k * N),
        y=_grouped(hbm.y, M // k, k * N),
        h=_grouped(hbm.h, M // k, k * N),
        rstd=hbm.rstd.reshape((M // k, k)),
        y_transposed=hbm.y_transposed,
    )
    tiles = steps.core_tiles(M // k, P)
    # Software pipeline at LNC=1 and LNC=2: the statistics of tile t + 1 (load, add, Σh²,
    # rstd) issued before the output of tile t (two tiles in flight, as budgeted), so that
    # each engine's in-order stream finds the next tile's first steps ahead of this tile's
    # products, beyond the scheduler's look-ahead. The fused add gains most (its DVE add
    # would otherwise queue behind the previous tile's products): modeled bf16 8192 x 4096
    # on trn3 807 -> 526 µs; no bench shape is slower.
    ahead = None
    if tiles:
        group0, parts = tiles[0]
        ahead = _row_statistics(plan, views, resident, eps, group0, parts, k, N, groups)
    for t in range(len(tiles)):
        current = ahead
        if t + 1 < len(tiles):
            group0, parts = tiles[t + 1]
            ahead = _row_statistics(plan, views, resident, eps, group0, parts, k, N, groups)
        _row_output(plan, views, resident, k, N, current)


def _grouped(tensor, groups, width):
    """``tensor`` viewed as (groups, width) (None for an absent tensor)."""
    return None if tensor is None else tensor.reshape((groups, width))


def _row(t, j, N):
    """Row j of a tile of k rows per partition (None for an absent tile)."""
    return None if t is None else t[:, j * N : (j + 1) * N]


def _row_statistics(plan, views, resident, eps, group0, parts, k, N, groups):
    """Rows ``k·group0 … k·(group0 + parts) − 1``, k consecutive rows per partition: load
    (and h = x + residual), Σh², rstd (stored) and what the product multiplies by; returns
    the tile's state for :func:`_row_output`."""
    g1 = group0 + parts

    def row(t, j):
        return _row(t, j, N)

    residual = views.residual is not None
    h_tile = steps.sbuf((parts, k * N), plan.h_dtype)
    x_tile = steps.sbuf((parts, k * N), plan.in_dtype) if residual else h_tile
    steps.load_h(
        h_tile,
        x_tile,
        views.x[group0:g1, :],
        views.residual[group0:g1, :] if residual else None,
        views.h[group0:g1, :] if residual else None,
    )
    # llama / none round x̂ into a tile of x's dtype that is no longer needed
    xhat_tile = x_tile

    y_tile = steps.sbuf((parts, k * N), plan.result_dtype)
    product = None if plan.product_dtype is None else steps.sbuf((parts, k * N), plan.product_dtype)
    if plan.squares_in == "product":
        squares = product
    elif plan.squares_in == "y":
        squares = y_tile
    else:
        squares = steps.sbuf((parts, k * N), nl.bfloat16)

    # ACT: Σh² per row (the squares themselves are discarded), then rstd; DMA rstd out.
    # Grouped: ACT Σ per group, DVE the groups' sum (steps.grouped_sum).
    sum_sq = steps.sbuf((parts, k), nl.float32)
    for j in range(k):
        if groups:
            steps.grouped_sum(row(squares, j), row(h_tile, j), groups, sum_sq[:, j : j + 1])
        else:
            nisa.activation_reduce(
                dst=row(squares, j),
                op=nl.square,
                data=row(h_tile, j),
                reduce_op=nl.add,
                reduce_res=sum_sq[:, j : j + 1],
            )
    # NeuronCore-v3+ (``exact_transpose``): v = Σh²/n + eps on ACT, GpSimd's rsqrt of it
    # (two instructions for all k rows, off the Vector engine's product), with or without
    # a weight. NeuronCore-v2: the Newton-refined chain, on ACT unless ACT carries the product.
    rstd_tile = (
        steps.rstd_on_gpsimd(sum_sq, eps, N)
        if plan.exact_transpose
        else steps.rstd_from_sum(sum_sq, eps, N, on_scalar=plan.product_engine != "scalar")
    )
    nisa.dma_copy(dst=views.rstd[group0:g1, :], src=rstd_tile)

    stationary = None
    if plan.product_engine == "tensor":
        stationary = steps.rstd_rows(plan, rstd_tile, resident.ident[:parts, :parts], batched=True)
    return group0, h_tile, xhat_tile, y_tile, product, rstd_tile, stationary


def _row_output(plan, views, resident, k, N, state):
    """y of the tile whose statistics :func:`_row_statistics` returned, stored."""
    group0, h_tile, xhat_tile, y_tile, product, rstd_tile, stationary = state
    parts = h_tile.shape[0]

    def row(t, j):
        return _row(t, j, N)

    shift = None if resident.shift is None else resident.shift[:parts]
    if plan.product_engine == "tensor":
        # PE: rstd ⊗ w per PSUM bank; DVE: y = h · (rstd ⊗ w) [+ bias].
        for j in range(k):
            steps.outer_normalize(
                row(y_tile, j),
                row(h_tile, j),
                [stationary[:, j, :]],
                resident.scale,
                shift,
                row(product, j),
            )
    elif plan.product_engine == "scalar":
        # ACT: h · rstd; PE: w broadcast into PSUM; DVE: the product [+ bias].
        for j in range(k):
            steps.scaled_normalize(
                plan,
                row(y_tile, j),
                row(h_tile, j),
                rstd_tile[:, j : j + 1],
                resident.ones[:, :parts],
                resident.scale,
                shift,
                row(product, j),
            )
    else:
        scale = None if resident.scale is None else resident.scale[:parts]
        for j in range(k):
            steps.normalize(
                plan,
                row(y_tile, j),
                row(h_tile, j),
                rstd_tile[:, j : j + 1],
                row(xhat_tile, j),
                scale,
                shift,
                row(product, j),
            )
    steps.store_rows_y(plan, views, group0, parts, y_tile)
