"""Forward regimes for rows too long to keep two row tiles (and the weight) on chip, where
the "split" regime does not apply (NeuronCore-v2, or N without a usable power-of-two factor).

"long": one 128-row tile of h stays on chip, in a single buffer that every row tile
rewrites. Per row tile, a statistics pass loads it in column chunks (Σh² per chunk into an
fp32 partial column, summed by one ``tensor_reduce`` in chunk order), then an output pass
normalises it in chunks twice as wide where SBUF allows (the column chunks of one row tile
share an HBM address range, so each store waits for the previous one, and wider stores
amortise that) and stores them, loading the matching weight (and bias) chunk: x and
the residual are read once, the weight once per row tile (N·e bytes per 128 rows; the
Tensor-engine product's four split rows, 4·N·e, after one split that writes them).
Dependencies are tracked per chunk of the buffer, so the statistics pass of the next row
tile refills chunk c as soon as the output pass of this one has read it. The row loop is a
``static_range``: its iterations rewrite the same buffer, which ``affine_range`` iterations
may not do. The product runs as the plan says ("scalar" on v2, "tensor" with one K = 4
matmul per PSUM bank against the chunk of the weight rows, split into their finite copies
and non-finite part once per kernel and kept in HBM: ``steps.weight_rows_in_hbm``), except
that an fp32 weight on v3+ falls back to "vector": converting its chunk per row tile would
cost as much as the product.

"two_pass": not even one row tile fits (fp32 rows of 65 K with options): the output pass
loads every chunk of x (and the residual) again, about 1.5× the minimal HBM traffic, and
multiplies on the Vector engine.
"""

from __future__ import annotations

import math

from nki_rmsnorm.kernels.legacy import rmsnorm_fwd_steps as steps
from nki_rmsnorm.nki import nisa, nl


def long_rows(plan, chunk, output_chunk, hbm, eps, offset):
    """One row tile of h kept on chip, reduced in chunks of ``chunk`` columns and normalised
    and stored in chunks of ``output_chunk``."""
    M, N = hbm.x.shape
    P = nl.tile_size.pmax
    parts = min(P, M)
    h_rows = nl.ndarray((parts, N), dtype=plan.h_dtype)
    engine = plan.product_engine if hbm.weight is not None else "vector"
    engine = "vector" if engine == "tensor" and plan.rstd_pieces != 3 else engine
    helper = (
        steps.identity(parts, plan.scale_dtype)
        if engine == "tensor"
        else nl.full((1, parts), 1.0, dtype=plan.scale_dtype)
        if engine == "scalar"
        else None
    )
    weight_rows = steps.weight_rows_in_hbm(plan, hbm.weight, offset) if engine == "tensor" else None
    resident = (helper, weight_rows)
    for t in nl.static_range(M // P):
        _long_tile(
            plan, engine, (chunk, output_chunk), hbm, offset, h_rows, eps, resident, t * P, P
        )
    if M % P:
        _long_tile(
            plan,
            engine,
            (chunk, output_chunk),
            hbm,
            offset,
            h_rows,
            eps,
            resident,
            M - M % P,
            M % P,
        )


def _long_tile(plan, engine, chunks, hbm, offset, h_rows, eps, resident, row0, parts):
    """Rows ``row0 … row0 + parts − 1``: statistics pass, then output pass. ``resident``:
    the engine's helper (identity or ones row) and, for the Tensor engine, the weight rows
    (``steps.weight_rows_in_hbm``), against which the stacked rstd pieces run one matmul per
    PSUM bank as in the "rows" regime."""
    M, N = hbm.x.shape
    helper, weight_rows = resident
    chunk, output_chunk = chunks
    n_chunks = math.ceil(N / chunk)
    i_0 = nl.arange(1)[:, None]
    rows = row0 + nl.arange(parts)[:, None]

    # Statistics pass. DMA in (with a residual: DVE h = x + residual, DMA h out); ACT Σh² of
    # the chunk.
    partial_sq = nl.ndarray((parts, n_chunks), dtype=nl.float32)
    for c in nl.static_range(n_chunks):
        c0 = c * chunk
        width = min(chunk, N - c0)
        cols = c0 + nl.arange(width)[None, :]
        h_chunk = h_rows[:parts, c0 : c0 + width]
        x_chunk = None if hbm.residual is None else nl.ndarray((parts, width), dtype=plan.in_dtype)
        steps.load_h(
            h_chunk,
            x_chunk,
            hbm.x[rows, cols],
            None if hbm.residual is None else hbm.residual[rows, cols],
            None if hbm.h is None else hbm.h[rows, cols],
        )
        squares = nl.ndarray((parts, width), dtype=nl.bfloat16)
        squares[...] = nisa.activation_reduce(
            op=nl.square,
            data=h_chunk,
            reduce_op=nl.add,
            reduce_res=partial_sq[:, c : c + 1],
            dtype=squares.dtype,
        )
    sum_sq = nisa.tensor_reduce(nl.add, partial_sq, axis=1, keepdims=True, dtype=nl.float32)
    rstd_tile = steps.rstd_from_sum(sum_sq, eps, N, on_scalar=engine != "scalar")
    # rstd (M,) viewed as (M, 1) and indexed 2-D, as the tutorial reshapes a 1-D tensor
    # before a 2-D index (general/nki/tutorials/rmsnorm.rst@8a38e733, L65-L68;
    # general/nki/examples/rmsnorm/rmsnorm_nki_kernels.py@8a38e733, L35)
    nl.store(hbm.rstd.reshape((M, 1))[rows, nl.arange(1)[None, :]], value=rstd_tile)
    stationary = (
        steps.rstd_rows(plan, rstd_tile, helper[:parts, :parts]) if engine == "tensor" else None
    )

    # Output pass: the weight (and bias) chunk, y = h · rstd · w (+ bias), DMA y out.
    for c in nl.static_range(math.ceil(N / output_chunk)):
        c0 = c * output_chunk
        width = min(output_chunk, N - c0)
        cols = c0 + nl.arange(width)[None, :]
        h_chunk = h_rows[:parts, c0 : c0 + width]
        y_chunk = nl.ndarray((parts, width), dtype=plan.result_dtype)
        product = (
            None
            if plan.product_dtype is None
            else nl.ndarray((parts, width), dtype=plan.product_dtype)
        )
        shift = (
            None
            if hbm.bias is None
            else steps.broadcast_row(hbm.bias.reshape((1, N))[i_0, cols], parts, plan.bias_dtype)
        )
        weight_cols = None if hbm.weight is None else hbm.weight.reshape((1, N))[i_0, cols]
        if engine == "tensor":
            moving = nl.load(weight_rows[nl.arange(plan.rstd_pieces + 1)[:, None], cols])
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
            scale = (
                None
                if weight_cols is None
                else steps.broadcast_row(weight_cols, parts, plan.scale_dtype, offset)
            )
            xhat = nl.ndarray((parts, width), dtype=plan.in_dtype) if plan.rounds_xhat else None
            steps.normalize(plan, y_chunk, h_chunk, rstd_tile, xhat, scale, shift, product)
        steps.store_y(plan, hbm.y[rows, cols], y_chunk)


def two_pass(plan, chunk, hbm, eps, offset):
    """Rows too long for SBUF: per row tile, Σh² over column chunks of width ``chunk``, then
    a second pass over the same chunks to scale them. x (and the residual) are read twice."""
    M, N = hbm.x.shape
    P = min(nl.tile_size.pmax, M)
    n_chunks = math.ceil(N / chunk)
    i_p = nl.arange(P)[:, None]
    i_c = nl.arange(chunk)[None, :]
    i_0 = nl.arange(1)[:, None]
    i_1 = nl.arange(1)[None, :]
    rstd_col = hbm.rstd.reshape((M, 1))

    for t in nl.affine_range(math.ceil(M / P)):
        rows = t * P + i_p
        in_rows = rows < M

        # Statistics pass: one partial Σh² column per chunk, summed once at the end so the
        # reduction order never depends on M.
        partial_sq = nl.ndarray((P, n_chunks), dtype=nl.float32)
        for c in nl.affine_range(n_chunks):
            cols = c * chunk + i_c
            inside = in_rows & (cols < N)
            h_chunk = nl.ndarray((P, chunk), dtype=plan.h_dtype)
            x_chunk = None if hbm.residual is None else nl.ndarray((P, chunk), dtype=plan.in_dtype)
            steps.load_h(
                h_chunk,
                x_chunk,
                hbm.x[rows, cols],
                None if hbm.residual is None else hbm.residual[rows, cols],
                None if hbm.h is None else hbm.h[rows, cols],
                mask=inside,
            )
            squares = nl.ndarray((P, chunk), dtype=nl.bfloat16)
            squares[...] = nisa.activation_reduce(
                op=nl.square,
                data=h_chunk,
                reduce_op=nl.add,
                reduce_res=partial_sq[:, nl.ds(c, 1)],
                dtype=squares.dtype,
                mask=inside,
            )
        sum_sq = nisa.tensor_reduce(
            nl.add, partial_sq, axis=1, keepdims=True, dtype=nl.float32, mask=in_rows
        )
        rstd_tile = steps.rstd_from_sum(sum_sq, eps, N, mask=in_rows)
        nl.store(rstd_col[rows, i_1], value=rstd_tile, mask=in_rows)

        # Scale pass: reload each chunk (recomputing h, which is cheaper to trust than a
        # read-back of the h just stored) and normalise it.
        for c in nl.affine_range(n_chunks):
            cols = c * chunk + i_c
            in_cols = cols < N
            inside = in_rows & in_cols
            h_chunk = nl.ndarray((P, chunk), dtype=plan.h_dtype)
            x_chunk = None if hbm.residual is None else nl.ndarray((P, chunk), dtype=plan.in_dtype)
            steps.load_h(
                h_chunk,
                x_chunk,
                hbm.x[rows, cols],
                None if hbm.residual is None else hbm.residual[rows, cols],
                None,
                mask=inside,
            )
            # llama / none round x̂ into x's tile (h itself when there is no residual)
            xhat = h_chunk if x_chunk is None else x_chunk
            scale = (
                None
                if hbm.weight is None
                else steps.broadcast_row(
                    hbm.weight.reshape((1, N))[i_0, cols], P, plan.scale_dtype, offset, mask=in_cols
                )
            )
            shift = (
                None
                if hbm.bias is None
                else steps.broadcast_row(
                    hbm.bias.reshape((1, N))[i_0, cols], P, plan.bias_dtype, mask=in_cols
                )
            )
            y_chunk = nl.ndarray((P, chunk), dtype=plan.result_dtype)
            product = (
                None
                if plan.product_dtype is None
                else nl.ndarray((P, chunk), dtype=plan.product_dtype)
            )
            steps.normalize(plan, y_chunk, h_chunk, rstd_tile, xhat, scale, shift, product, inside)
            steps.store_y(plan, hbm.y[rows, cols], y_chunk, mask=inside)
