"""Forward regime "decode" in the ``nki`` 0.6 dialect: batches of at most 128 rows
(``DECODE_MAX_ROWS``) whose statistics are grouped (``nki_rmsnorm.plan.forward``,
``GROUP_MIN_COLUMNS``; NeuronCore-v3+).

A row of a whole-row tile sits on one partition, so a batch of M rows keeps M partitions,
M / 8 of the 16 DMA engines, busy. Here each row is spread over all 128 partitions:
partition p holds columns p·w … p·w + w − 1 (w = N // 128) of every row of the tile, the
N mod 128 trailing columns sit in a second tile, one row per partition; a tile holds R rows
(``tile_rows``). Per tile:

* DMA in (with a residual: DVE h = x + residual, DMA h out);
* ACT squares h (fp32); DVE sums each row's w columns per partition: the 128 group sums of
  ``rmsnorm_fwd_steps.group_sums``, one per partition, and the trailing columns' sum;
* PE transposes the (128, R) group sums to one row per partition (exact, NaN-safe on
  NeuronCore-v3+); DVE sums each row's 128 (+1) group sums: the same reduce of the same
  values in the same order as the "rows" regime's grouped statistics, so Σh², and the rstd
  chain after it (``rstd_from_sum``, the same instructions), are bitwise those of "rows";
* PE transposes rstd to a row and broadcasts it to the 128 partitions (a K = 1 matmul
  against ones: every product is 1·rstd, exact);
* DVE forms y with the rounding of the "rows" regime's product plan, element for element
  (:func:`_normalized`), and DMA stores it.

Every instruction of a row reads only that row's values, so a row's y, h and rstd do not
depend on R, on M or on the other rows, and are those of the "rows" regime at the same N
(``tests/kernels/test_decode.py``).

LNC: under ``kernel[2]`` the row tiles are split between the two physical cores
(``rmsnorm_fwd_steps.core_tiles``); the planner halves R so that each core has a tile.
"""

from __future__ import annotations

from nki_rmsnorm.kernels.nki06 import rmsnorm_fwd_steps as steps
from nki_rmsnorm.kernels.nki06._nki import nisa, nl


class _Pieces(nl.NKIObject):
    """A tensor's columns as the regime holds them: ``main`` (128, ..., w), one group of
    w columns per partition, and ``tail`` (..., N mod 128), or None without trailing
    columns."""

    main: object
    tail: object


def decode_rows(plan, R, hbm, eps, offset):
    """Rows of N columns, spread over the 128 partitions, ``R`` rows a tile."""
    M, N = hbm.x.shape
    P = nl.tile_size.pmax
    width = N // P
    tail = N - P * width
    views = [_spread(hbm.x, P, width), None, _spread(hbm.y, P, width), None]
    if hbm.residual is not None:
        views[1] = _spread(hbm.residual, P, width)
        views[3] = _spread(hbm.h, P, width)
    rstd_view = hbm.rstd.reshape((M, 1))
    tile_rows = min(R, M)

    scale = None
    if hbm.weight is not None:
        scale = _resident(hbm.weight, P, width, tail, tile_rows, plan.scale_dtype, offset)
    shift = None
    if hbm.bias is not None:
        shift = _resident(hbm.bias, P, width, tail, tile_rows, plan.bias_dtype)
    ident = steps.identity(P, nl.float32)
    ones = steps.sbuf((1, P), nl.float32)
    nisa.memset(dst=ones, value=1.0)

    for r0, rows in steps.core_tiles(M, tile_rows):
        _decode_tile(plan, views, rstd_view, scale, shift, ident, ones, eps, r0, rows, N)


def _spread(tensor, P, width):
    """``tensor`` (M, N) as pieces: (P, M, w) with partition p on columns p·w …, and the
    trailing columns (M, N mod P)."""
    M, N = tensor.shape
    main = tensor[:, 0 : P * width].reshape_dim(1, (P, width)).permute((1, 0, 2))
    tail = tensor[:, P * width : N] if N % P else None
    return _Pieces(main=main, tail=tail)


def _resident(vector, P, width, tail, rows, dtype, offset=0.0):
    """The weight or bias (N,) on chip as pieces, converted to ``dtype`` (+ offset):
    (P, w), partition p holding its group's columns, and the trailing columns broadcast to
    ``rows`` partitions."""
    main = steps.sbuf((P, width), dtype)
    steps.load_converted(main, vector[0 : P * width].reshape_dim(0, (P, width)), offset)
    trailing = None
    if tail:
        row = vector[P * width : P * width + tail].reshape_dim(0, (1, tail))
        trailing = steps.broadcast_row(row, rows, dtype, offset)
    return _Pieces(main=main, tail=trailing)


def _decode_tile(plan, views, rstd_view, scale, shift, ident, ones, eps, r0, rows, N):
    """Rows ``r0 … r0 + rows − 1``: load, grouped Σh², rstd (stored), y (stored)."""
    P = nl.tile_size.pmax
    width = N // P
    tail = N - P * width
    x_v, residual_v, y_v, h_v = views
    r1 = r0 + rows
    group_count = steps.grouped_width(N)

    h_main, h_tail = _load(plan, x_v, residual_v, h_v, r0, r1, (P, rows, width), (rows, tail))

    # ACT: squares (fp32); DVE: one group sum per partition and row, the trailing sum.
    squares = steps.sbuf((P, rows, width), nl.float32)
    nisa.activation(dst=squares, op=nl.square, data=h_main)
    partial = steps.sbuf((P, rows), nl.float32)
    nisa.tensor_reduce(dst=partial, op=nl.add, data=squares, axis=2)
    sums = steps.sbuf((rows, group_count), nl.float32)
    if tail:
        tail_squares = steps.sbuf((rows, tail), nl.float32)
        nisa.activation(dst=tail_squares, op=nl.square, data=h_tail)
        nisa.tensor_reduce(dst=sums[:, P : P + 1], op=nl.add, data=tail_squares, axis=1)
    # PE: the group sums transposed to one row per partition; DVE: summed in group order.
    transposed = nl.ndarray((rows, P), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=transposed, stationary=partial, moving=ident, is_transpose=True)
    nisa.tensor_copy(dst=sums[:, 0:P], src=transposed)
    sum_sq = steps.sbuf((rows, 1), nl.float32)
    nisa.tensor_reduce(dst=sum_sq, op=nl.add, data=sums, axis=1)

    rstd = steps.rstd_from_sum(sum_sq, eps, N, on_scalar=plan.product_engine != "scalar")
    nisa.dma_copy(dst=rstd_view[r0:r1, :], src=rstd)
    factor_rstd = _product_rstd(plan, rstd, scale)

    # PE: rstd transposed to a row, broadcast to the 128 partitions (1·rstd, exact).
    rstd_row_psum = nl.ndarray((1, rows), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(
        dst=rstd_row_psum, stationary=factor_rstd, moving=ident[:rows, :rows], is_transpose=True
    )
    rstd_row = steps.sbuf((1, rows), nl.float32)
    nisa.tensor_copy(dst=rstd_row, src=rstd_row_psum)
    broadcast = nl.ndarray((P, rows), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=broadcast, stationary=ones, moving=rstd_row)
    rstd_spread = steps.sbuf((P, rows), nl.float32)
    nisa.tensor_copy(dst=rstd_spread, src=broadcast)

    main_scale = None if scale is None else scale.main.expand_dim(1).broadcast(1, rows)
    main_shift = None if shift is None else shift.main.expand_dim(1).broadcast(1, rows)
    y_main = _normalized(
        plan,
        scale,
        h_main,
        rstd_spread.expand_dim(2).broadcast(2, width),
        main_scale,
        main_shift,
    )
    steps.store_y(plan, y_v.main[:, r0:r1, :], y_main)
    if tail:
        tail_scale = None if scale is None else scale.tail[:rows]
        tail_shift = None if shift is None else shift.tail[:rows]
        y_tail = _normalized(
            plan, scale, h_tail, factor_rstd.broadcast(1, tail), tail_scale, tail_shift
        )
        steps.store_y(plan, y_v.tail[r0:r1, :], y_tail)


def _load(plan, x_v, residual_v, h_v, r0, r1, main_shape, tail_shape):
    """h = x (+ residual) of rows ``r0 … r1 − 1`` as (main, tail) tiles (tail None without
    trailing columns), h stored with a residual."""
    tiles = []
    for part in ("main", "tail"):
        shape = main_shape if part == "main" else tail_shape
        if part == "tail" and not shape[1]:
            tiles.append(None)
            continue
        h_tile = steps.sbuf(shape, plan.h_dtype)
        x_tile = None if residual_v is None else steps.sbuf(shape, plan.in_dtype)
        steps.load_h(
            h_tile,
            x_tile,
            _rows_of(x_v, part, r0, r1),
            _rows_of(residual_v, part, r0, r1),
            _rows_of(h_v, part, r0, r1),
        )
        tiles.append(h_tile)
    return tiles[0], tiles[1]


def _rows_of(view, part, r0, r1):
    """Rows ``r0 … r1 − 1`` of a ``_Pieces`` HBM view's ``part`` (None for an absent one)."""
    if view is None:
        return None
    if part == "main":
        return view.main[:, r0:r1, :]
    return view.tail[r0:r1, :]


def _product_rstd(plan, rstd, scale):
    """The rstd the product multiplies by. For the "tensor" plan with three bf16 pieces,
    the "rows" regime's Tensor engine forms rstd ⊗ w from hi + mid + lo (exactly rstd for
    every finite rstd, so its one fp32 rounding is the Vector engine's rstd·w); an infinite
    rstd splits into NaN pieces there, which (rstd − rstd) + rstd reproduces (DVE)."""
    if scale is None or plan.product_engine != "tensor" or plan.rstd_pieces != 3:
        return rstd
    rows = rstd.shape[0]
    same = steps.sbuf((rows, 1), nl.float32)
    nisa.scalar_tensor_tensor(
        dst=same, data=rstd, op0=nl.subtract, operand0=rstd, op1=nl.add, operand1=rstd
    )
    return same


def _normalized(plan, scale_pieces, h, rstd, scale, shift):
    """y of ``h`` with ``rstd``, ``scale`` and ``shift`` given as views of h's shape
    (broadcast along the axes they do not vary on), rounded step by step as the "rows"
    regime rounds (``rmsnorm_fwd_steps.outer_normalize`` for the "tensor" plan,
    ``normalize`` otherwise): every step is a Vector-engine ``tensor_tensor``, an fp32
    operation rounded to its destination's dtype, as the per-partition ``tensor_scalar`` /
    ``scalar_tensor_tensor`` steps of "rows" round."""
    shape = h.shape

    def tile(dtype):
        return steps.sbuf(shape, dtype)

    def multiply(dst, a, b):
        nisa.tensor_tensor(dst=dst, data1=a, data2=b, op=nl.multiply)

    y = tile(plan.result_dtype)
    if scale_pieces is not None and plan.product_engine == "tensor":
        # rstd ⊗ w in fp32 (the PSUM value), then h times it [+ bias].
        outer = tile(nl.float32)
        multiply(outer, rstd, scale)
        target = y if shift is None else tile(plan.product_dtype)
        multiply(target, h, outer)
        if shift is not None:
            nisa.tensor_tensor(dst=y, data1=target, data2=shift, op=nl.add)
        return y

    data = h
    row_scale = rstd
    if plan.rounds_xhat:
        data = tile(plan.in_dtype)
        multiply(data, h, rstd)
        row_scale = None
    scaled = data
    if row_scale is not None and (scale is not None or shift is not None):
        scaled = tile(nl.float32)
        multiply(scaled, data, row_scale)
        row_scale = None
    if scale is not None and shift is not None:
        product = tile(plan.product_dtype)
        multiply(product, scaled, scale)
        nisa.tensor_tensor(dst=y, data1=product, data2=shift, op=nl.add)
    elif scale is not None:
        multiply(y, scaled, scale)
    elif shift is not None:
        nisa.tensor_tensor(dst=y, data1=scaled, data2=shift, op=nl.add)
    elif row_scale is not None:
        multiply(y, data, row_scale)
    else:
        nisa.tensor_copy(dst=y, src=data)
    return y
