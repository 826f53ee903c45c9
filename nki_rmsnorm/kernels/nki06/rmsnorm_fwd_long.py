"""Forward regimes "long" and "two_pass" in the ``nki`` 0.6 dialect, for rows too long to keep
two row tiles (and the weight) on chip where "split" does not apply. The legacy
``rmsnorm_fwd_long`` documents both (one 128-row tile of h kept on chip, a statistics pass in
column chunks and a wider output pass; or, when not even that fits, x read twice); this module
emits the same instructions in 0.6 idioms: dst-first ``nisa`` calls, slices instead of
``nl.arange`` indices, and ragged row tiles and column chunks as smaller slices instead of
masks (nki/migration/index.rst@81ce03ae, "Deprecation of masking").

The row loops are Python ``range`` loops, unrolled at specialization (the legacy
``static_range`` / ``affine_range``): "long" rewrites one h buffer in every row tile, and
dependencies are tracked per chunk of it.

LNC: under ``kernel[2]`` the 128-row tiles are split between the two physical cores by
``nl.program_id(0)`` (core c a contiguous block, the last core the ragged tile, as
``rmsnorm_fwd_rows``); each core keeps its own h buffer and splits the weight into its own
private HBM rows (``steps.weight_rows_in_hbm``).
A row's instructions do not depend on its tile or core, so results are bitwise those of
LNC=1.
"""

from __future__ import annotations

import math

from nki_rmsnorm.kernels.nki06 import rmsnorm_fwd_steps as steps
from nki_rmsnorm.kernels.nki06._nki import nisa, nl


def _chunk_squares(plan, hbm, r0, r1, c0, c1, h_chunk, partial_sq):
    """The statistics pass's step for one column chunk: DMA in h (with a residual: x and
    the residual, DVE h = x + residual, DMA h out) and ACT Σh² of the chunk into the fp32
    column ``partial_sq`` (the squares themselves are discarded into a bf16 scratch): rows
    ``r0 … r1 − 1``, columns ``c0 … c1 − 1``."""
    residual = hbm.residual is not None
    shape = h_chunk.shape
    steps.load_h(
        h_chunk,
        steps.sbuf(shape, plan.in_dtype) if residual else None,
        hbm.x[r0:r1, c0:c1],
        hbm.residual[r0:r1, c0:c1] if residual else None,
        hbm.h[r0:r1, c0:c1] if residual else None,
    )
    nisa.activation_reduce(
        dst=steps.sbuf(shape, nl.bfloat16),
        op=nl.square,
        data=h_chunk,
        reduce_op=nl.add,
        reduce_res=partial_sq,
    )


def _sum_of_chunks(partial_sq):
    """Σh² per row: the chunk partials summed in chunk order (DVE), so the reduction order
    depends on N only."""
    sum_sq = steps.sbuf((partial_sq.shape[0], 1), nl.float32)
    nisa.tensor_reduce(dst=sum_sq, op=nl.add, data=partial_sq, axis=1, keepdims=True)
    return sum_sq


def long_rows(plan, chunk, output_chunk, hbm, eps, offset):
    """One row tile of h kept on chip, reduced in chunks of ``chunk`` columns and normalised
    and stored in chunks of ``output_chunk``."""
    M, N = hbm.x.shape
    P = nl.tile_size.pmax
    tiles = steps.core_tiles(M, P)
    if not tiles:
        return
    parts = min(P, M)
    h_rows = steps.sbuf((parts, N), plan.h_dtype)
    engine = plan.product_engine if hbm.weight is not None else "vector"
    engine = "vector" if engine == "tensor" and plan.rstd_pieces != 3 else engine
    helper = weight_rows = None
    if engine == "tensor":
        helper = steps.identity(parts, plan.scale_dtype)
        weight_rows = steps.weight_rows_in_hbm(plan, hbm.weight, offset)
    elif engine == "scalar":
        helper = steps.sbuf((1, parts), plan.scale_dtype)
        nisa.memset(dst=helper, value=1.0)
    for row0, rows in tiles:
        _long_tile(
            plan,
            engine,
            (chunk, output_chunk),
            hbm,
            offset,
            h_rows,
            eps,
            (helper, weight_rows),
            row0,
            rows,
        )


def _long_tile(plan, engine, chunks, hbm, offset, h_rows, eps, resident, row0, parts):
    """Rows ``row0 … row0 + parts − 1``: statistics pass, then output pass. ``resident``:
    the engine's helper (identity or ones row) and, for the Tensor engine, the weight rows
    (``steps.weight_rows_in_hbm``), against which the stacked rstd pieces run one matmul per
    PSUM bank as in the "rows" regime."""
    M, N = hbm.x.shape
    chunk, output_chunk = chunks
    helper, weight_rows = resident
    n_chunks = math.ceil(N / chunk)
    row1 = row0 + parts

    # Statistics pass. DMA in (with a residual: DVE h = x + residual, DMA h out); ACT Σh² of
    # the chunk.
    partial_sq = steps.sbuf((parts, n_chunks), nl.float32)
    for c in range(n_chunks):
        c0 = c * chunk
        c1 = min(N, c0 + chunk)
        _chunk_squares(
            plan, hbm, row0, row1, c0, c1, h_rows[:parts, c0:c1], partial_sq[:, c : c + 1]
        )
    sum_sq = _sum_of_chunks(partial_sq)
    rstd_tile = steps.rstd_from_sum(sum_sq, eps, N, on_scalar=engine != "scalar")
    nisa.dma_copy(dst=hbm.rstd.reshape((M, 1))[row0:row1, :], src=rstd_tile)
    stationary = None
    if engine == "tensor":
        stationary = steps.rstd_rows(plan, rstd_tile, helper[:parts, :parts])

    # Output pass: the weight (and bias) chunk, y = h · rstd · w (+ bias), DMA y out.
    for c in range(math.ceil(N / output_chunk)):
        c0 = c * output_chunk
        c1 = min(N, c0 + output_chunk)
        width = c1 - c0
        h_chunk = h_rows[:parts, c0:c1]
        y_chunk = steps.sbuf((parts, width), plan.result_dtype)
        product = None
        if plan.product_dtype is not None:
            product = steps.sbuf((parts, width), plan.product_dtype)
        shift = None
        if hbm.bias is not None:
            bias_cols = hbm.bias.reshape((1, N))[:, c0:c1]
            shift = steps.broadcast_row(bias_cols, parts, plan.bias_dtype)
        weight_cols = None if hbm.weight is None else hbm.weight.reshape((1, N))[:, c0:c1]
        if engine == "tensor":
            moving = steps.sbuf((plan.rstd_pieces + 1, width), plan.scale_dtype)
            nisa.dma_copy(dst=moving, src=weight_rows[:, c0:c1])
            steps.outer_normalize(y_chunk, h_chunk, [stationary[:, 0, :]], moving, shift, product)
        elif engine == "scalar":
            steps.scaled_normalize(
                plan,
                y_chunk,
                h_chunk,
                rstd_tile,
                helper[:, :parts],
                steps.scale_row(plan, weight_cols, offset),
                shift,
                product,
            )
        else:
            scale = None
            if weight_cols is not None:
                scale = steps.broadcast_row(weight_cols, parts, plan.scale_dtype, offset)
            xhat = steps.sbuf((parts, width), plan.in_dtype) if plan.rounds_xhat else None
            steps.normalize(plan, y_chunk, h_chunk, rstd_tile, xhat, scale, shift, product)
        steps.store_columns_y(plan, hbm, row0, row1, c0, c1, y_chunk)


def two_pass(plan, chunk, hbm, eps, offset):
    """Rows too long for SBUF: per row tile, Σh² over column chunks of width ``chunk``, then
    a second pass over the same chunks to scale them. x (and the residual) are read twice."""
    M, N = hbm.x.shape
    n_chunks = math.ceil(N / chunk)
    rstd_col = hbm.rstd.reshape((M, 1))
    residual = hbm.residual is not None

    for row0, parts in steps.core_tiles(M, nl.tile_size.pmax):
        row1 = row0 + parts

        # Statistics pass: one partial Σh² column per chunk, summed once at the end so the
        # reduction order never depends on M.
        partial_sq = steps.sbuf((parts, n_chunks), nl.float32)
        for c in range(n_chunks):
            c0 = c * chunk
            c1 = min(N, c0 + chunk)
            h_chunk = steps.sbuf((parts, c1 - c0), plan.h_dtype)
            _chunk_squares(plan, hbm, row0, row1, c0, c1, h_chunk, partial_sq[:, c : c + 1])
        sum_sq = _sum_of_chunks(partial_sq)
        rstd_tile = steps.rstd_from_sum(sum_sq, eps, N)
        nisa.dma_copy(dst=rstd_col[row0:row1, :], src=rstd_tile)

        # Scale pass: reload each chunk (recomputing h, which is cheaper to trust than a
        # read-back of the h just stored) and normalise it.
        for c in range(n_chunks):
            c0 = c * chunk
            c1 = min(N, c0 + chunk)
            width = c1 - c0
            h_chunk = steps.sbuf((parts, width), plan.h_dtype)
            x_chunk = steps.sbuf((parts, width), plan.in_dtype) if residual else None
            steps.load_h(
                h_chunk,
                x_chunk,
                hbm.x[row0:row1, c0:c1],
                hbm.residual[row0:row1, c0:c1] if residual else None,
                None,
            )
            # llama / none round x̂ into x's tile (h itself when there is no residual)
            xhat = h_chunk if x_chunk is None else x_chunk
            scale = shift = None
            if hbm.weight is not None:
                weight_cols = hbm.weight.reshape((1, N))[:, c0:c1]
                scale = steps.broadcast_row(weight_cols, parts, plan.scale_dtype, offset)
            if hbm.bias is not None:
                bias_cols = hbm.bias.reshape((1, N))[:, c0:c1]
                shift = steps.broadcast_row(bias_cols, parts, plan.bias_dtype)
            y_chunk = steps.sbuf((parts, width), plan.result_dtype)
            product = None
            if plan.product_dtype is not None:
                product = steps.sbuf((parts, width), plan.product_dtype)
            steps.normalize(plan, y_chunk, h_chunk, rstd_tile, xhat, scale, shift, product)
            steps.store_columns_y(plan, hbm, row0, row1, c0, c1, y_chunk)
