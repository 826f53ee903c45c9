"""Forward regime "rows": whole rows on chip, several consecutive rows per partition.

A tile is (parts, k·N): partition p holds rows ``row0 + p·k … row0 + p·k + k − 1``, which
are contiguous in HBM (the tensors are viewed as (M / k, k·N)), so each DMA moves k·N
elements per partition in one descriptor, and the per-tile fixed costs (a DMA's issue cost,
the small instructions that turn Σh² into rstd, the rstd store) are paid once per k rows.
Tiles cover consecutive row blocks, so their HBM ranges never overlap; the last one may
have fewer partitions, and nothing is masked. The weight (and bias) is loaded and prepared
once, before the row loop; the tiles are allocated in the loop body, so the compiler
double-buffers them (the SBUF budget counts two).
"""

from __future__ import annotations

from nki_rmsnorm.kernels.legacy import rmsnorm_fwd_steps as steps
from nki_rmsnorm.nki import nisa, nl
from nki_rmsnorm.plan.forward import RowsResident, RowViews


def rows_resident(plan, k, hbm, eps, offset):
    """Every row read once and written once; tiles of ``k`` rows per partition."""
    M, N = hbm.x.shape
    P = nl.tile_size.pmax
    parts = min(P, M)
    i_0 = nl.arange(1)[:, None]
    i_n = nl.arange(N)[None, :]

    weight = hbm.weight is not None
    weight_row = hbm.weight.reshape((1, N))[i_0, i_n] if weight else None
    engine = plan.product_engine if weight else None
    # PE's moving rows, ACT's scale row or DVE's broadcast weight, as the plan says
    scale = (
        steps.weight_rows(plan, hbm.weight, offset)
        if engine == "tensor"
        else steps.scale_row(plan, weight_row, offset)
        if engine == "scalar"
        else steps.broadcast_row(weight_row, parts, plan.scale_dtype, offset)
        if weight
        else None
    )
    ident = steps.identity(parts, plan.scale_dtype) if engine == "tensor" else None
    ones = nl.full((1, parts), 1.0, dtype=plan.scale_dtype) if engine == "scalar" else None
    shift = (
        steps.broadcast_row(hbm.bias.reshape((1, N))[i_0, i_n], parts, plan.bias_dtype)
        if hbm.bias is not None
        else None
    )
    resident = RowsResident(scale, shift, ident, ones)

    # k consecutive rows are one row of these views: one contiguous run per partition.
    views = RowViews(
        *(
            None if t is None else t.reshape((M // k, k * N))
            for t in (hbm.x, hbm.residual, hbm.y, hbm.h)
        ),
        hbm.rstd.reshape((M // k, k)),
    )
    groups = M // k
    full_tiles = groups // P
    for t in nl.affine_range(full_tiles):
        _row_tile(plan, views, resident, eps, t * P, P, k, N)
    if groups % P:
        _row_tile(plan, views, resident, eps, full_tiles * P, groups % P, k, N)


def _row_tile(plan, views, resident, eps, group0, parts, k, N):
    """Rows ``k·group0 … k·(group0 + parts) − 1``, k consecutive rows per partition."""
    i_p = nl.arange(parts)[:, None]
    groups = group0 + i_p
    i_f = nl.arange(k * N)[None, :]
    i_k = nl.arange(k)[None, :]

    def row(t, j):
        return None if t is None else t[:, j * N : (j + 1) * N]

    # DMA in (with a residual: DVE h = x + residual; DMA h out). Tiles that only some plans
    # need are created by conditional expressions, never inside an ``if`` block, whose
    # tiles could not be used after it (general/nki/api/nki.errors.rst@8a38e733, lines
    # 419-450, err_local_variable_used_out_of_scope).
    residual = views.residual is not None
    h_tile = nl.ndarray((parts, k * N), dtype=plan.h_dtype)
    x_tile = nl.ndarray((parts, k * N), dtype=plan.in_dtype) if residual else h_tile
    steps.load_h(
        h_tile,
        x_tile,
        views.x[groups, i_f],
        views.residual[groups, i_f] if residual else None,
        views.h[groups, i_f] if residual else None,
    )
    # llama / none round x̂ into a tile of x's dtype that is no longer needed
    xhat_tile = x_tile

    y_tile = nl.ndarray((parts, k * N), dtype=plan.result_dtype)
    product = (
        None if plan.product_dtype is None else nl.ndarray((parts, k * N), dtype=plan.product_dtype)
    )
    squares = {"product": product, "y": y_tile}.get(plan.squares_in)
    squares = nl.ndarray((parts, k * N), dtype=nl.bfloat16) if squares is None else squares

    # ACT: Σh² per row (the squares themselves are discarded), then rstd; DMA rstd out.
    sum_sq = nl.ndarray((parts, k), dtype=nl.float32)
    for j in nl.static_range(k):
        row(squares, j)[...] = nisa.activation_reduce(
            op=nl.square,
            data=row(h_tile, j),
            reduce_op=nl.add,
            reduce_res=sum_sq[:, j : j + 1],
            dtype=squares.dtype,
        )
    # NeuronCore-v3+ (``exact_transpose``): v = Σh²/n + eps on ACT, GpSimd's rsqrt of it
    # (two instructions for all k rows, off the Vector engine's product), with or without
    # a weight. NeuronCore-v2: the Newton-refined chain, on ACT unless ACT carries the product.
    rstd_tile = (
        steps.rstd_on_gpsimd(sum_sq, eps, N)
        if plan.exact_transpose
        else steps.rstd_from_sum(sum_sq, eps, N, on_scalar=plan.product_engine != "scalar")
    )
    nl.store(views.rstd[groups, i_k], value=rstd_tile)

    shift = None if resident.shift is None else resident.shift[:parts, :]
    if plan.product_engine == "tensor":
        # PE: rstd ⊗ w per PSUM bank; DVE: y = h · (rstd ⊗ w) [+ bias].
        stationary = steps.rstd_rows(plan, rstd_tile, resident.ident[:parts, :parts], batched=True)
        for j in nl.static_range(k):
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
        for j in nl.static_range(k):
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
        scale = None if resident.scale is None else resident.scale[:parts, :]
        for j in nl.static_range(k):
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
    steps.store_y(plan, views.y[groups, i_f], y_tile)
