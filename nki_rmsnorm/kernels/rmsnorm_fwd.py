"""RMSNorm forward kernel: ``y = h · rstd · (weight + offset) + bias`` over the last axis.

Math, per row of length ``N`` (statistics in fp32 whatever the input dtype)::

    h    = x + residual                         optional; added in fp32, rounded to the
                                                residual's dtype and written out; the rest
                                                uses that rounded h (as reference.py does)
    rstd = 1 / sqrt(Σ h² / N + eps)             fp32, one per row, written out for backward
    y    = h · rstd · (weight + offset) + bias  weight, bias optional

Casting modes (``casting_mode``):

* ``gemma``: every product in fp32, one rounding at the end (HF GemmaRMSNorm).
* ``llama``: ``x̂ = h·rstd`` rounded to x's dtype first, then ``x̂·(weight + offset) + bias``
  in fp32, rounded once (HF LlamaRMSNorm).
* ``none``: every step rounded to x's dtype: x̂, ``weight + offset``, the product, the
  bias and the sum.

Shapes and dtypes: ``x`` (M, N) in float32 / bfloat16 / float16; ``weight``, ``bias`` (N,)
in float32 or x's dtype, or None; ``residual`` (M, N) or None; ``eps``, ``offset`` Python
floats; ``out_dtype`` y's dtype (None: x's dtype). Returns ``(y, rstd)``, or
``(y, h, rstd)`` with a residual; ``rstd`` is (M,) float32, ``h`` in the residual's dtype.

Layout: rows on the partitions, up to ``P = 128`` rows per tile, the hidden dimension on
the free axis; a ragged last row tile is masked. Per row tile, the engine of each step:

====  ==========================================================================
DMA   load x (and the residual)
DVE   h = x + residual (``tensor_tensor``, fp32, rounded to the residual's dtype);
      DMA stores h
ACT   Σh² (``activation_reduce(square, reduce_op=add)`` into an fp32 (P, 1) column)
ACT   rstd = rsqrt(Σh² · 1/N + eps) (``activation``, scale 1/N, eps as the bias column);
      DMA stores rstd
DVE   gemma: y = (h · rstd) · w in one ``scalar_tensor_tensor``;
      llama / none: x̂ = h · rstd (``tensor_scalar``), then y = x̂ · w (``tensor_tensor``)
DVE   + bias (``tensor_tensor``) when there is a weight too; alone it fuses into the
      instruction above
DMA   store y
====  ==========================================================================

``weight + offset`` and ``bias`` are loaded once, converted once (DVE) and broadcast across
the partitions once (DVE), before the row loop. A row whose statistics come out NaN (a NaN
input) or infinite (``eps = 0`` and an all-zero row: rstd = inf, y = 0 · inf = NaN) affects
only its own outputs: every step is row-local. The reductions never depend on how many rows
share a tile, so a row's outputs are bitwise the same whatever batch it is part of.

SBUF budget and hidden-dimension tiling. Everything is decided from N and the dtypes, never
from M. A row tile's buffers are counted twice (the loop keeps two row tiles in flight so
the DMAs of one overlap the compute of the other), the broadcast weight and bias once::

    resident:  N · (size(weight + offset) + size(bias))
    per tile:  N · (size(x) + size(residual) + size(y) [+ 4 fp32 pre-bias product when there
               are both a weight and a bias] [+ 2 bf16 squares when y is fp16])

The discarded elementwise squares of ``activation_reduce`` land in the y buffer (overwritten
by the final multiply) or in the pre-bias buffer, in a dtype with fp32's exponent range so
that x² never overflows; only an fp16 y needs a scratch bf16 buffer for them. When
``resident + 2 · per tile`` exceeds ``nl.tile_size.total_available_sbuf_size`` (usable bytes
per partition: 180,224 on trn1/inf2, 212,984 on trn2, 245,752 on trn3) the kernel tiles the
hidden dimension instead: per row tile, a statistics pass over column chunks (Σh² per chunk
into an fp32 partial column, then one ``tensor_reduce``) and a scale pass that loads each
chunk again. Chunks are the largest of 8192 / 4096 / 2048 / 1024 / 512 columns that fit,
evened out over N in multiples of 512, well under the 64 K elements one Vector/Scalar
instruction may read per partition. That path reads x (and the residual, recomputing h
rather than reading it back) twice and broadcasts a weight chunk per row tile: the price of
rows that do not fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from nki_rmsnorm.nki import nisa, nki, nl

CASTING_MODES = ("gemma", "llama", "none")

#: Per-partition bytes kept aside for the small fp32 columns (eps, Σh², rstd, partials).
_RESERVED_BYTES = 1024
#: Column-chunk widths tried, widest first, when a row does not fit SBUF.
_CHUNK_WIDTHS = (8192, 4096, 2048, 1024, 512)
_CHUNK_ALIGN = 512


def _size(dtype) -> int:
    return np.dtype(dtype).itemsize


def _holds_squares(dtype) -> bool:
    """fp32 and bf16 have fp32's 8 exponent bits: a square of any input fits."""
    return np.dtype(dtype) in (np.dtype(nl.float32), np.dtype(nl.bfloat16))


@dataclass(frozen=True)
class Plan:
    """What the kernel keeps on chip for a given N, dtypes and options (pure Python)."""

    in_dtype: object  # x's dtype; x̂ is rounded to it in llama / none
    out_dtype: object  # y's dtype
    result_dtype: object  # dtype of the last arithmetic step (x's dtype in "none" mode)
    residual_dtype: object | None
    scale_dtype: object | None  # weight + offset, broadcast; None without a weight
    bias_dtype: object | None
    product_dtype: object | None  # the pre-bias product, when there is a weight and a bias
    rounds_xhat: bool  # llama / none: x̂ = round(h·rstd) before the weight multiply
    squares_in: str  # where activation_reduce's discarded squares go: product, y, scratch

    def resident_bytes(self) -> int:
        """Per column: the broadcast weight and bias."""
        return sum(_size(d) for d in (self.scale_dtype, self.bias_dtype) if d is not None)

    def tile_bytes(self) -> int:
        """Per column: the buffers of one row tile."""
        dtypes = [self.in_dtype, self.residual_dtype, self.result_dtype, self.product_dtype]
        if self.result_dtype != self.out_dtype:
            dtypes.append(self.out_dtype)
        if self.squares_in == "scratch":
            dtypes.append(nl.bfloat16)
        return sum(_size(d) for d in dtypes if d is not None)

    def fits_rows(self, n: int, budget: int) -> bool:
        """Whole rows fit: the weight and bias once, two row tiles in flight."""
        return n * (self.resident_bytes() + 2 * self.tile_bytes()) + _RESERVED_BYTES <= budget

    def chunk_width(self, n: int, budget: int) -> int:
        """Column-chunk width for rows that do not fit: two chunks in flight of the busier
        pass (statistics: x, residual, squares; scale: the row-tile buffers plus the weight
        and bias chunks), and a weight or bias row with its converted copy."""
        stats = _size(self.in_dtype) + _size(nl.bfloat16)
        if self.residual_dtype is not None:
            stats += _size(self.residual_dtype)
        per_column = 2 * max(stats, self.tile_bytes() + self.resident_bytes())
        per_column += 2 * _size(nl.float32)
        for width in _CHUNK_WIDTHS:
            if width * per_column + _RESERVED_BYTES <= budget:
                break
        chunks = math.ceil(n / width)
        return min(width, _CHUNK_ALIGN * math.ceil(n / chunks / _CHUNK_ALIGN))


def make_plan(x_dtype, weight_dtype, bias_dtype, residual_dtype, offset, casting_mode,
              out_dtype) -> Plan:
    """The :class:`Plan` for the given dtypes (None for an absent tensor) and options."""
    if casting_mode not in CASTING_MODES:
        raise ValueError(f"casting_mode must be one of {CASTING_MODES}, got {casting_mode!r}")
    in_dtype = np.dtype(x_dtype)
    out_dtype = in_dtype if out_dtype is None else np.dtype(out_dtype)
    low_precision = casting_mode == "none"
    # Multiplying by the weight as stored is exact in fp32; only an offset needs a fp32 sum.
    if weight_dtype is None:
        scale_dtype = None
    elif low_precision:
        scale_dtype = in_dtype
    else:
        scale_dtype = np.dtype(nl.float32) if offset else np.dtype(weight_dtype)
    if bias_dtype is not None:
        bias_dtype = in_dtype if low_precision else np.dtype(bias_dtype)
    product_dtype = None
    if scale_dtype is not None and bias_dtype is not None:
        product_dtype = in_dtype if low_precision else np.dtype(nl.float32)
    result_dtype = in_dtype if low_precision else out_dtype
    if product_dtype is not None and _holds_squares(product_dtype):
        squares_in = "product"
    elif _holds_squares(result_dtype):
        squares_in = "y"
    else:
        squares_in = "scratch"
    return Plan(in_dtype, out_dtype, result_dtype,
                None if residual_dtype is None else np.dtype(residual_dtype), scale_dtype,
                bias_dtype, product_dtype, casting_mode != "gemma", squares_in)


@nki.jit
def rmsnorm_fwd(x, weight, bias, residual, eps, offset, casting_mode, out_dtype):
    """RMSNorm forward of ``x`` (M, N); see the module docstring for math, engines and tiling.

    Returns ``(y, rstd)``, or ``(y, h, rstd)`` when ``residual`` is given.
    """
    M, N = x.shape
    plan = make_plan(x.dtype, None if weight is None else weight.dtype,
                     None if bias is None else bias.dtype,
                     None if residual is None else residual.dtype, offset, casting_mode,
                     out_dtype)
    y = nl.ndarray((M, N), dtype=plan.out_dtype, buffer=nl.shared_hbm)
    h = None
    if residual is not None:
        h = nl.ndarray((M, N), dtype=residual.dtype, buffer=nl.shared_hbm)
    rstd = nl.ndarray((M,), dtype=nl.float32, buffer=nl.shared_hbm)

    budget = nl.tile_size.total_available_sbuf_size
    if plan.fits_rows(N, budget):
        _rows_resident(plan, x, weight, bias, residual, eps, offset, y, h, rstd)
    else:
        _hidden_tiled(plan, plan.chunk_width(N, budget), x, weight, bias, residual, eps,
                      offset, y, h, rstd)
    return (y, rstd) if h is None else (y, h, rstd)


def _rows_resident(plan, x, weight, bias, residual, eps, offset, y, h, rstd):
    """Whole rows on chip: one HBM read of x (and the residual) and one write of each output;
    the weight and bias read and broadcast once."""
    M, N = x.shape
    P = min(nl.tile_size.pmax, M)
    i_p = nl.arange(P)[:, None]
    i_f = nl.arange(N)[None, :]
    i_0 = nl.arange(1)[:, None]  # the single partition of a (1, F) row
    i_1 = nl.arange(1)[None, :]  # the single column of an (M, 1) column
    rstd_col = rstd.reshape((M, 1))

    eps_col = nl.full((P, 1), eps, dtype=nl.float32)
    scale = None
    if weight is not None:
        scale = _broadcast_row(weight.reshape((1, N))[i_0, i_f], P, plan.scale_dtype,
                               offset)
    shift = None
    if bias is not None:
        shift = _broadcast_row(bias.reshape((1, N))[i_0, i_f], P, plan.bias_dtype)

    for t in nl.affine_range(math.ceil(M / P)):
        rows = t * P + i_p
        in_rows = rows < M

        x_tile = nl.load(x[rows, i_f], mask=in_rows)
        h_tile = x_tile
        if residual is not None:
            h_tile = nl.load(residual[rows, i_f], mask=in_rows)
            h_tile[...] = nisa.tensor_tensor(x_tile, h_tile, op=np.add, dtype=h_tile.dtype,
                                             mask=in_rows)
            nl.store(h[rows, i_f], value=h_tile, mask=in_rows)

        y_tile = nl.ndarray((P, N), dtype=plan.result_dtype)
        product = None
        if plan.product_dtype is not None:
            product = nl.ndarray((P, N), dtype=plan.product_dtype)
        if plan.squares_in == "product":
            squares = product
        elif plan.squares_in == "y":
            squares = y_tile
        else:
            squares = nl.ndarray((P, N), dtype=nl.bfloat16)

        sum_sq = nl.ndarray((P, 1), dtype=nl.float32)
        squares[...] = nisa.activation_reduce(op=nl.square, data=h_tile, reduce_op=np.add,
                                              reduce_res=sum_sq, dtype=squares.dtype,
                                              mask=in_rows)
        rstd_tile = nisa.activation(op=nl.rsqrt, data=sum_sq, bias=eps_col, scale=1.0 / N,
                                    mask=in_rows)
        nl.store(rstd_col[rows, i_1], value=rstd_tile, mask=in_rows)

        _normalize(plan, y_tile, h_tile, rstd_tile, x_tile, scale, shift, product, in_rows)
        if plan.result_dtype != plan.out_dtype:
            y_tile = nisa.tensor_copy(y_tile, dtype=plan.out_dtype, mask=in_rows)
        nl.store(y[rows, i_f], value=y_tile, mask=in_rows)


def _hidden_tiled(plan, C, x, weight, bias, residual, eps, offset, y, h, rstd):
    """Rows too long for SBUF: per row tile, Σh² over column chunks of width ``C``, then a
    second pass over the same chunks to scale them. x (and the residual) are read twice."""
    M, N = x.shape
    P = min(nl.tile_size.pmax, M)
    n_chunks = math.ceil(N / C)
    i_p = nl.arange(P)[:, None]
    i_c = nl.arange(C)[None, :]
    i_0 = nl.arange(1)[:, None]
    i_1 = nl.arange(1)[None, :]
    rstd_col = rstd.reshape((M, 1))
    eps_col = nl.full((P, 1), eps, dtype=nl.float32)

    for t in nl.affine_range(math.ceil(M / P)):
        rows = t * P + i_p
        in_rows = rows < M

        # Statistics pass: one partial Σh² column per chunk, summed once at the end so the
        # reduction order never depends on M.
        partial_sq = nl.ndarray((P, n_chunks), dtype=nl.float32)
        for c in nl.affine_range(n_chunks):
            cols = c * C + i_c
            inside = in_rows & (cols < N)
            x_chunk = nl.load(x[rows, cols], mask=inside)
            h_chunk = x_chunk
            if residual is not None:
                h_chunk = nl.load(residual[rows, cols], mask=inside)
                h_chunk[...] = nisa.tensor_tensor(x_chunk, h_chunk, op=np.add,
                                                  dtype=h_chunk.dtype, mask=inside)
                nl.store(h[rows, cols], value=h_chunk, mask=inside)
            squares = nl.ndarray((P, C), dtype=nl.bfloat16)
            squares[...] = nisa.activation_reduce(op=nl.square, data=h_chunk, reduce_op=np.add,
                                                  reduce_res=partial_sq[:, nl.ds(c, 1)],
                                                  dtype=squares.dtype, mask=inside)
        sum_sq = nisa.tensor_reduce(np.add, partial_sq, axis=1, keepdims=True,
                                    dtype=nl.float32, mask=in_rows)
        rstd_tile = nisa.activation(op=nl.rsqrt, data=sum_sq, bias=eps_col, scale=1.0 / N,
                                    mask=in_rows)
        nl.store(rstd_col[rows, i_1], value=rstd_tile, mask=in_rows)

        # Scale pass: reload each chunk (recomputing h, which is cheaper to trust than a
        # read-back of the h just stored) and normalise it.
        for c in nl.affine_range(n_chunks):
            cols = c * C + i_c
            in_cols = cols < N
            inside = in_rows & in_cols
            x_chunk = nl.load(x[rows, cols], mask=inside)
            h_chunk = x_chunk
            if residual is not None:
                h_chunk = nl.load(residual[rows, cols], mask=inside)
                h_chunk[...] = nisa.tensor_tensor(x_chunk, h_chunk, op=np.add,
                                                  dtype=h_chunk.dtype, mask=inside)
            scale = None
            if weight is not None:
                scale = _broadcast_row(weight.reshape((1, N))[i_0, cols], P,
                                       plan.scale_dtype, offset, mask=in_cols)
            shift = None
            if bias is not None:
                shift = _broadcast_row(bias.reshape((1, N))[i_0, cols], P,
                                       plan.bias_dtype, mask=in_cols)
            y_chunk = nl.ndarray((P, C), dtype=plan.result_dtype)
            product = None
            if plan.product_dtype is not None:
                product = nl.ndarray((P, C), dtype=plan.product_dtype)
            _normalize(plan, y_chunk, h_chunk, rstd_tile, x_chunk, scale, shift, product,
                       inside)
            if plan.result_dtype != plan.out_dtype:
                y_chunk = nisa.tensor_copy(y_chunk, dtype=plan.out_dtype, mask=inside)
            nl.store(y[rows, cols], value=y_chunk, mask=inside)


def _broadcast_row(row_hbm, partitions, dtype, offset=0.0, mask=None):
    """Load a (1, F) HBM row, add ``offset`` and convert to ``dtype`` (one DVE instruction,
    fp32 arithmetic, one rounding), and broadcast it to ``partitions`` partitions (DVE)."""
    row = nl.load(row_hbm, mask=mask)
    if offset:
        row = nisa.tensor_scalar(row, op0=np.add, operand0=offset, dtype=dtype, mask=mask)
    elif row.dtype != dtype:
        row = nisa.tensor_copy(row, dtype=dtype, mask=mask)
    return row.broadcast_to((partitions, row.shape[1]))


def _normalize(plan, y_tile, h_tile, rstd_tile, xhat_tile, scale, shift, product, mask):
    """Write ``h · rstd · scale + shift`` into ``y_tile`` (Vector engine), rounding as the
    casting mode says. llama / none round x̂ = h·rstd to x's dtype first, in ``xhat_tile``
    (the x tile, which is no longer needed)."""
    if plan.rounds_xhat:
        xhat_tile[...] = nisa.tensor_scalar(h_tile, op0=np.multiply, operand0=rstd_tile,
                                            dtype=xhat_tile.dtype, mask=mask)
        data, row_scale = xhat_tile, None
    else:
        data, row_scale = h_tile, rstd_tile

    if scale is not None and shift is not None:
        _multiply(product, data, row_scale, scale, mask)
        y_tile[...] = nisa.tensor_tensor(product, shift, op=np.add, dtype=y_tile.dtype,
                                         mask=mask)
    elif scale is not None:
        _multiply(y_tile, data, row_scale, scale, mask)
    elif shift is not None and row_scale is not None:
        y_tile[...] = nisa.scalar_tensor_tensor(data=data, op0=np.multiply, operand0=row_scale,
                                                op1=np.add, operand1=shift,
                                                dtype=y_tile.dtype, mask=mask)
    elif shift is not None:
        y_tile[...] = nisa.tensor_tensor(data, shift, op=np.add, dtype=y_tile.dtype, mask=mask)
    elif row_scale is not None:
        y_tile[...] = nisa.tensor_scalar(data, op0=np.multiply, operand0=row_scale,
                                         dtype=y_tile.dtype, mask=mask)
    else:
        y_tile[...] = nisa.tensor_copy(data, dtype=y_tile.dtype, mask=mask)


def _multiply(dst, data, row_scale, scale, mask):
    """``dst = data · row_scale · scale``: one ``scalar_tensor_tensor``, or a
    ``tensor_tensor`` when there is no per-row factor."""
    if row_scale is None:
        dst[...] = nisa.tensor_tensor(data, scale, op=np.multiply, dtype=dst.dtype, mask=mask)
    else:
        dst[...] = nisa.scalar_tensor_tensor(data=data, op0=np.multiply, operand0=row_scale,
                                             op1=np.multiply, operand1=scale, dtype=dst.dtype,
                                             mask=mask)
