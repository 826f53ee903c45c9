"""Quantized RMSNorm forward in the ``nki`` 0.6 dialect (trn2 / trn3): one pass that reads
x (and a residual), and writes the fp8 quantized ``y`` with its dequantization scales, and
optionally ``y`` itself, ``h = x + residual`` and the per-row absolute maximum of ``y``.

Math (per row of N elements, every step float32 unless it says otherwise)::

    h     = x + residual                      (rounded once to the residual's dtype)
    rstd  = 1 / sqrt(max(Σ(h / √N)² + eps, 2⁻⁸⁷))    (GpSimd rsqrt)
    p     = h · w                             (exact products; h itself without a weight)
    y     = p · rstd
    amax  = max |y| = max |p| · rstd          (per row, or per block of ``block`` columns)
    scale = max(min(amax, lower_bound) · (1 / fp8_max), scale_floor)        dequant scale
    y_q   = RNE_fp8(clip(y, ±lower_bound) / scale)
          = RNE_fp8(clip(p, ±lower_bound · (1 / rstd)) · (rstd · (1 / scale)))

``1 / fp8_max`` and ``1 / scale`` are float32 (the ALU has no divide): ``1 / scale`` is
``(1 / √scale)²``, the GpSimd rsqrt squared (within 3 float32 ulps of the quotient).
``fp8_max`` is the largest finite value of the output dtype: 240 for ``float8_e4m3`` (the
NeuronCore's IEEE-style e4m3), 448 for the OCP ``float8_e4m3fn`` (trn3 only:
nki-library@d2ad3a5 ``src/nkilib_src/nkilib/core/utils/kernel_helpers.py`` L39-43,
L489-491) and 57344 for ``float8_e5m2``. With per-row or per-block scales ``|y / scale|``
never exceeds ``fp8_max`` (by construction, up to float32 rounding, which rounds back to
``fp8_max``). With a static input scale, ``y / scale`` is clipped to ``±fp8_max`` (p to
``±fp8_max / factor``) before the conversion, as AWS's ``rmsnorm_quant_kernel`` clips
(nki-library@d2ad3a5 ``core/rmsnorm/rmsnorm_quant.py`` ``_static_quantize_tile``): the docs
say nothing of how an engine converts an out-of-range value to fp8, so the kernel never
relies on it. The reductions (Σ of the squares, max of |p|) are those of the float32 results,
before their discarded elementwise outputs are rounded to fp8 (``nki/api/nki/isa/__init__.py``
@81ce03ae: the activation pseudo-code L1366-1380 reduces ``output`` before the write;
``tensor_scalar_reduce`` L2516-2530 reduces "the ``nisa.tensor_scalar`` result", the float32
computation result that L1112-1117 cast to ``dst.dtype``).

``scale_floor`` (default 1e-6, AWS's ``min_dequant_scale_value``,
``core/rmsnorm/rmsnorm_quant_constants.py``) keeps ``1 / scale`` finite: an all-zero row gets
the scale ``scale_floor`` and ``y_q = 0``. A row holding NaN or ±Inf gets a non-finite
``rstd`` or ``amax``, hence a non-finite scale, which flags it; its ``y_q`` is unspecified.
Σh² is float32, so rows must keep it finite (N · max h² < 3.4e38, e.g. |h| < 2⁶³ / √N).

Layout and engines (per tile of up to 128 rows, whole rows on chip; under ``kernel[2]`` the
tiles are split between the two physical cores by ``nl.program_id(0)``):

* DMA: x (residual) in, h / y / y_q / scales out;
* Scalar: Σh² (``activation_reduce``, square and add), the rsqrt, and the quantizing
  multiply (``activation`` copy with the per-row ``scale=`` column, converting to fp8 on
  write; ``nki/api/nki/isa/__init__.py@81ce03ae`` L1392-1398: any output dtype at no cost);
* Tensor: the weight row broadcast to the tile's partitions, one PSUM bank at a time (a
  ones-row matmul, exact);
* Vector: h · w against that PSUM bank (one PSUM input: N cycles), the per-row absolute
  maximum (``tensor_scalar_reduce`` with ``nl.abs`` and ``nl.maximum``, as AWS's
  ``_row_quantize_tile`` does; per block the same, or ``tensor_reduce`` max and negated min
  of a ``(rows, blocks, block)`` view for blocks under 128 columns) and the per-row
  arithmetic on (rows, 1) columns.

With row scales and a 16-bit weight of h's dtype (N a multiple of 128: the case of AWS's
``rmsnorm_quant_kernel``) the Vector engine's h · w pass goes to the Tensor engine, which
has time to spare, and Σh² is shared with it (:func:`_use_tensor_products`):

* Tensor: each 128-column block of h transposed into PSUM (``nc_transpose``); hᵀ copied
  to SBUF (16-bit, one side in PSUM: the Vector engine's 2× mode; a 3/8 share of the banks
  on the Scalar engine, ``tensor_copy``); p's block b = (hᵀ block b)ᵀ · diag(w block b), a
  matmul with hᵀ's block as the stationary and the weight's diagonal block as the moving
  operand, one PSUM bank (4 blocks) at a time — exact: one nonzero 16-bit product per
  float32 sum — formed twice, for the maximum of |p| and for the quantization, instead of
  being kept; and the Gram matrix (hᵀ)ᵀ · hᵀ of the last 7/10 of the blocks accumulated
  in one PSUM bank, whose diagonal is those columns' Σh² (:func:`_mean_square`);
* Scalar: Σ (h / √N)² of the first 3/10 of the columns, its hᵀ copies, the quantization
  from each PSUM bank of p;
* Vector: its hᵀ copies, max |p| per PSUM bank, the Gram diagonal (``range_select``).

The split of Σh² depends on N alone: y_q is the same with and without the y and
transposed outputs (those keep the Vector engine's product, whose NaN and Inf stay in
their columns: a row holding ±Inf gets NaN across its 128-column block from the
diagonal matmul's Inf · 0, harmless to y_q, whose row is flagged, but not to y; there
rstd is formed before the maxima, as y needs it).

Instructions and where the docs (aws-neuron-sdk@81ce03ae ``nki/api/nki/isa/__init__.py``)
or AWS's kernels (nki-library@d2ad3a5) allow each use:

* ``dma_copy`` (L246); the packed scale store reads the float32 column through
  ``.ap(pattern, dtype=<fp8>)`` as ``core/rmsnorm/rmsnorm_quant.py`` L396-402 does;
* ``activation`` / ``activation_reduce`` (L1336, L1461): square with an add reduction, copy
  with a float32 (rows, 1) ``scale`` (L1399-1401), a scalar ``bias`` from NeuronCore-v3 on
  (L1406-1407), any output dtype including fp8 (L1392-1398);
* ``tensor_tensor`` (L1019): the multiply against a PSUM bank;
* ``tensor_scalar`` (L1081): max/min/multiply/add with float32 operands, unary ``nl.abs``
  and ``nl.rsqrt`` with ``operand0`` None (L1147), ``rsqrt`` on GpSimd (L1157);
* ``tensor_scalar_reduce`` (L2515): ``nl.abs`` then a ``nl.maximum`` reduction, as
  ``core/rmsnorm/rmsnorm_quant.py`` L560-567;
* ``tensor_reduce`` (L1161): max and negated min over the last axis of a (rows, blocks,
  block) view; ``reciprocal`` (L2388); ``memset`` (L431); ``nc_matmul`` (L489): a ones
  row as the stationary operand broadcasts a row (or the static scale) to the partitions;
* ``nc_transpose`` (L829) on the Tensor engine, SBUF to PSUM, any dtype (L850-851), for the
  transposed output; its PSUM banks are read by ``tensor_scalar_reduce`` and ``activation``
  and its stores address y_qᵀ through ``.ap(pattern, offset)`` over the HBM tensor; and
  for hᵀ (16-bit, bit-accurate from NeuronCore-v3, L841);
* ``nc_matmul`` (L489) for p and the Gram matrix: SBUF operands, a float32 PSUM result
  (L571-573, L587-589), 16-bit operands of one dtype (L577-581), ``accumulate`` False then
  True into one PSUM tile (L541-545);
* ``tensor_copy`` (L384) out of PSUM on the Vector or Scalar engine (not GpSimd, which
  cannot read PSUM, L399-401; the Scalar engine has it from NeuronCore-v3, L403);
* ``iota`` (L1708) of the partition index; ``range_select`` (L2819, NeuronCore-v3+) of the
  Gram diagonal from PSUM (free index ≥ and ≤ the partition index, max reduction), as
  nki-library's ``core/attention/attention_cte.py`` L2738-2750 reads a PSUM tile.

The transposed output (``emit_transposed``) is for the weight-gradient GEMM, which contracts
y over its M rows (TransformerEngine's ``fp8_t``): a dequant scale can only be factored out
of that GEMM if it is constant along M, so y_q's per-row (or 1 × block) scales do not serve
it. y_qᵀ (N, M) gets its own scales, one per column of y and 128-row tile — 1 × 128 blocks
along the rows of yᵀ, TransformerEngine's column-wise blockwise scaling — computed in the
same pass from the tile on chip: scale_t[n, t] = max(min(max over the tile's rows of |y[:, n]|,
lower_bound) · (1 / fp8_max), scale_floor), y_qᵀ = RNE_fp8(clip(y, ±lower_bound) / scale_t).
With a static scale (per-tensor, TransformerEngine's delayed scaling) y_qᵀ uses that scale
and is the transpose of y_q, bit for bit. The transposes are the Tensor engine's
``nc_transpose`` of the float32 y, or of y_q with a static scale (:func:`_transposed`).

The packed layout (``packed=True``, row scales only) is nki-library's ``[..., N + 4]``: the
float32 scale's four bytes after each row of y_q, written through an ``.ap(..., dtype=)``
reinterpretation of the scale column as AWS's ``_store_tensor_tile_and_dequant_scales``
does. The arguments are validated by :func:`nki_rmsnorm.ops.rms_norm_quant` before launch;
the kernel only asserts them.
"""

from __future__ import annotations

import math

from nki_rmsnorm.kernels.nki06._nki import nisa, nki, nl, usable_sbuf_bytes
from nki_rmsnorm.plan.dtypes import dtype_bytes
from nki_rmsnorm.plan.forward import RSQRT_MIN_INPUT

__all__ = ["fp8_max", "rmsnorm_quant"]

#: Columns of one PSUM bank of float32 (2 KiB per partition).
_BANK_COLUMNS = 512
_BANK_BYTES = 2048
#: The share of a tile's columns whose Σh² the Tensor engine's Gram matrix sums.
_GRAM_SHARE = (7, 10)
#: The share of hᵀ's PSUM banks the Scalar engine copies out (the Vector engine the rest).
_ACT_COPY_SHARE = (3, 8)
#: NeuronCore-v4 (trn3): the Vector engine runs at the Scalar engine's clock, the Tensor
#: engine's share binds first; the Scalar engine copies hᵀ at 2×, but has Σh² to do.
_GRAM_SHARE_V4 = (2, 5)
_ACT_COPY_SHARE_V4 = (0, 8)
#: Column chunks of a row tile: at least this many bytes of x per partition, at most
#: this many chunks.
_CHUNK_BYTES = 4096
_MAX_CHUNKS = 4
#: Per-partition bytes set aside for the (rows, 1) columns and the ones row.
_SMALL_TILE_BYTES = 4096
#: Blocks at least this long get one max-of-|p| reduction each (cheaper than two passes).
_ONE_REDUCE_PER_BLOCK = 128
#: Bytes of the float32 scale appended to each row in the packed layout.
_SCALE_BYTES = 4
#: Transposed 128-column chunks per PSUM bank: (128, up to 128) float32 is a quarter bank.
_CHUNKS_PER_BANK = 4


def fp8_max(dtype):
    """The largest finite value of an fp8 output dtype."""
    if dtype == nl.float8_e4m3:
        return 240.0
    if dtype == nl.float8_e4m3fn:
        return 448.0
    assert dtype == nl.float8_e5m2, "quant_dtype must be float8_e4m3, float8_e4m3fn or e5m2"
    return 57344.0


def _sbuf(shape, dtype):
    return nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf)


def _two_tiles_fit(
    x, residual, weight, emit_y, emit_transposed, options, split=False, in_psum=False
):
    """Whether the software pipeline's two row tiles fit SBUF beside the weight row (or its
    diagonals) and the (rows, 1) columns, per partition, by the tiles' live ranges (first
    to last instruction touching each, as the compiler's allocator sees them): each tile
    keeps p (unless the Tensor engine forms it in PSUM, ``in_psum``, then hᵀ instead) and
    y_q from its front to its back; its front's h (and x, and hᵀ of the Gram share) are
    dead before the other tile's back begins, whose y, float32 y and y_qᵀ are created
    there."""
    eps, quant_dtype, scale_mode, block, lower_bound, scale_floor = options
    N = x.shape[1]
    x_bytes = dtype_bytes(x.dtype)
    h_bytes = x_bytes if residual is None else dtype_bytes(residual.dtype)
    kept = dtype_bytes(quant_dtype)
    front = 0
    if weight is None:
        kept = kept + h_bytes  # p is h itself
    elif in_psum:
        kept = kept + h_bytes  # hᵀ, whose blocks the Tensor engine multiplies at the back
        front = h_bytes
    else:
        kept = kept + 4
        front = h_bytes
    if residual is not None:
        front = front + x_bytes
    if split and not in_psum:
        front = front + h_bytes
    back = 0
    if emit_y:
        back = back + x_bytes
    if emit_transposed:  # the float32 y and y_qᵀ
        back = back + 4 + dtype_bytes(quant_dtype)
    if scale_mode == "static":  # the amax's discarded bf16 |p|, between front and back
        back = max(back, 2)
    resident = 0 if weight is None else dtype_bytes(weight.dtype)
    per_partition = N * (2 * kept + max(front, back) + resident)
    return per_partition + _SMALL_TILE_BYTES <= usable_sbuf_bytes()


def _core_tiles(rows):
    """(first row, row count) of this core's tiles of at most 128 rows: under LNC=2 each
    core takes a contiguous block of the full tiles, the last core also the ragged one."""
    parts = nl.tile_size.pmax
    full = rows // parts
    cores = nl.num_programs(0)
    core = nl.program_id(0)
    per_core = (full + cores - 1) // cores
    tiles = []
    last = min(full, (core + 1) * per_core)
    for t in range(core * per_core, last):
        tiles.append((t * parts, parts))
    if rows % parts != 0 and core == cores - 1:
        tiles.append((full * parts, rows % parts))
    return tiles


def _rstd(mean_sq, eps):
    """rstd = 1 / sqrt(max(mean(h²) + eps, 2⁻⁸⁷)) of a (rows, 1) column: the Scalar engine
    adds eps (the Vector engine, when eps < 2⁻⁸⁷ may leave an all-zero row at 0, clamps
    too), the GpSimd engine takes the
    reciprocal square root (``tensor_scalar`` runs on GpSimd "only for rsqrt",
    aws-neuron-sdk@81ce03ae ``nki/api/nki/isa/__init__.py`` L1138-L1140; computed there at a
    higher precision than on the Scalar engine, so no Newton steps follow)."""
    shape = mean_sq.shape
    v = _sbuf(shape, nl.float32)
    if eps >= RSQRT_MIN_INPUT:  # nothing to clamp: the Scalar engine adds eps
        nisa.activation(dst=v, op=nl.copy, data=mean_sq, bias=float(eps))
    else:
        nisa.tensor_scalar(
            dst=v,
            data=mean_sq,
            op0=nl.add,
            operand0=float(eps),
            op1=nl.maximum,
            operand1=RSQRT_MIN_INPUT,
        )
    rstd = _sbuf(shape, nl.float32)
    nisa.tensor_scalar(dst=rstd, data=v, op0=nl.rsqrt, operand0=None, engine=nisa.gpsimd_engine)
    return rstd


def _load_weight(weight):
    """The weight as a (1, N) SBUF row in its own dtype (the Tensor engine's moving operand)
    and a (1, 128) row of ones in the same dtype (the stationary one)."""
    N = weight.shape[0]
    row = _sbuf((1, N), weight.dtype)
    nisa.dma_copy(dst=row, src=weight.reshape((1, N)))
    ones = _sbuf((1, nl.tile_size.pmax), weight.dtype)
    nisa.memset(dst=ones, value=1.0)
    return row, ones


def _broadcast_scale(input_scale):
    """The caller's (1, 1) float32 dequantization scale as a (128, 1) column of its
    reciprocal: a ones-row matmul broadcasts it (exact), the Vector engine inverts it."""
    parts = nl.tile_size.pmax
    one = _sbuf((1, 1), nl.float32)
    nisa.dma_copy(dst=one, src=input_scale)
    ones = _sbuf((1, parts), nl.float32)
    nisa.memset(dst=ones, value=1.0)
    column = nl.ndarray((parts, 1), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=column, stationary=ones, moving=one, accumulate=False)
    inverse = _sbuf((parts, 1), nl.float32)
    nisa.reciprocal(dst=inverse, data=column)
    return inverse


def _column_chunks(n, itemsize):
    """(start, stop) of the column chunks a row tile is loaded, quantized and stored in: at
    least ``_CHUNK_BYTES`` per partition each (a DMA of ≥ 4 KiB per partition runs near full
    rate, aws-neuron-sdk@81ce03ae ``nki/deep-dives/nki-dma-bandwidth-guide.rst`` L84-85), so
    that a tile's first products start after part of its load and its last store starts
    before its whole quantization ends. The chunks are whole 128-column blocks (but the
    last), as the Tensor engine's products and PSUM banks of p take them."""
    pmax = nl.tile_size.pmax
    count = max(1, min(_MAX_CHUNKS, (n * itemsize) // _CHUNK_BYTES))
    blocks = -(-n // pmax)
    width = -(-blocks // count) * pmax
    chunks = []
    for c0 in range(0, n, width):
        chunks.append((c0, min(n, c0 + width)))
    return chunks


def _product(h_tile, weight_row, ones):
    """p = h · w (float32) for a tile: per PSUM bank, the weight broadcast to the tile's
    partitions by the Tensor engine and the Vector engine's multiply against it."""
    parts, N = h_tile.shape
    p = _sbuf((parts, N), nl.float32)
    for c0 in range(0, N, _BANK_COLUMNS):
        c1 = min(N, c0 + _BANK_COLUMNS)
        bank = nl.ndarray((parts, c1 - c0), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(
            dst=bank, stationary=ones[:, 0:parts], moving=weight_row[:, c0:c1], accumulate=False
        )
        nisa.tensor_tensor(dst=p[:, c0:c1], data1=h_tile[:, c0:c1], data2=bank, op=nl.multiply)
    return p


def _column(shape):
    return _sbuf(shape, nl.float32)


def _scale(amax_p, rstd, fp8max, lower_bound, scale_floor):
    """From the (rows, k) maxima of |p|: amax of y (Scalar engine) and the dequant scales
    (:func:`_dequant_scale`)."""
    amax_y = _column(amax_p.shape)
    nisa.activation(dst=amax_y, op=nl.copy, data=amax_p, scale=rstd)
    return amax_y, _dequant_scale(amax_y, fp8max, lower_bound, scale_floor)


def _dequant_scale(amax_y, fp8max, lower_bound, scale_floor, scale=None):
    """max(min(amax, lower_bound) · (1 / fp8_max), scale_floor) of a float32 column block
    (Vector engine), into ``scale`` if given."""
    shape = amax_y.shape
    capped = amax_y
    if lower_bound is not None:
        capped = _column(shape)
        nisa.tensor_scalar(dst=capped, data=amax_y, op0=nl.minimum, operand0=float(lower_bound))
    if scale is None:
        scale = _column(shape)
    nisa.tensor_scalar(
        dst=scale,
        data=capped,
        op0=nl.multiply,
        operand0=1.0 / fp8max,
        op1=nl.maximum,
        operand1=float(scale_floor),
    )
    return scale


def _inverse(scale):
    """1 / scale as (1 / √scale)²: the GpSimd rsqrt (the engine's one ``tensor_scalar`` op,
    see :func:`_rstd`) squared by the Scalar engine, which keeps these per-row steps off the
    Vector engine, the kernel's busiest."""
    root = _column(scale.shape)
    nisa.tensor_scalar(dst=root, data=scale, op0=nl.rsqrt, operand0=None, engine=nisa.gpsimd_engine)
    inverse = _column(scale.shape)
    nisa.activation(dst=inverse, op=nl.square, data=root)
    return inverse


def _factors(scale, rstd):
    """The quantizing factors rstd · (1 / scale)."""
    factor = _column(scale.shape)
    nisa.activation(dst=factor, op=nl.copy, data=_inverse(scale), scale=rstd)
    return factor


def _quantize(q, p, factor, on_vector=False):
    """q = RNE(p · factor) (Scalar engine, converting on write; the Vector engine's
    ``tensor_scalar`` if ``on_vector``)."""
    if on_vector:
        nisa.tensor_scalar(dst=q, data=p, op0=nl.multiply, operand0=factor)
    else:
        nisa.activation(dst=q, op=nl.copy, data=p, scale=factor)


def _clip(p, bound, dst=None):
    """p = clip(p, ±bound) in place (or into ``dst``), ``bound`` a (rows, 1) column in p's
    units (Vector
    engine, one instruction): every clip happens before the one rounding to fp8, so the
    kernel never converts an out-of-range value to fp8 (the docs do not say what that
    gives; the simulator's OCP e4m3fn makes it NaN)."""
    negative = _column(bound.shape)
    nisa.tensor_scalar(dst=negative, data=bound, op0=nl.multiply, operand0=-1.0)
    nisa.tensor_scalar(
        dst=p if dst is None else dst,
        data=p,
        op0=nl.minimum,
        operand0=bound,
        op1=nl.maximum,
        operand1=negative,
    )


def _scaled_inverse(column, value):
    """value / column for a (rows, 1) float32 column (Vector reciprocal, then a multiply)."""
    inverse = _column(column.shape)
    nisa.reciprocal(dst=inverse, data=column)
    out = _column(column.shape)
    nisa.tensor_scalar(dst=out, data=inverse, op0=nl.multiply, operand0=float(value))
    return out


def _block_maxima(p, q, block):
    """max |p| over each ``block`` columns of a tile: (rows, N / block), exact (a maximum of
    float32 values), on the Vector engine. Blocks of ``_ONE_REDUCE_PER_BLOCK`` columns or
    more: one ``tensor_scalar_reduce`` (``nl.abs``, max) per block, its discarded output in
    ``q``'s columns, 1 + 64 / block cycles per element; shorter ones: the maximum and the
    negated minimum of a (rows, blocks, block) view (``tensor_reduce``), 2 cycles per
    element. (``nl.abs_max`` keeps the sign of the larger input: no help here.)"""
    parts, N = p.shape
    blocks = N // block
    view = p.reshape((parts, blocks, block))
    high = _column((parts, blocks))
    if block >= _ONE_REDUCE_PER_BLOCK:
        for b in range(blocks):
            cols = slice(b * block, (b + 1) * block)
            nisa.tensor_scalar_reduce(
                dst=q[:, cols],
                data=p[:, cols],
                op0=nl.abs,
                operand0=0.0,
                reduce_op=nl.maximum,
                reduce_res=high[:, b : b + 1],
            )
        return high
    nisa.tensor_reduce(dst=high, op=nl.maximum, data=view, axis=2)
    low = _column((parts, blocks))
    nisa.tensor_reduce(dst=low, op=nl.minimum, data=view, axis=2, negate=True)
    nisa.tensor_tensor(dst=high, data1=high, data2=low, op=nl.maximum)
    return high


def _transpose_groups(N):
    """(first column, width, count) of the column chunks whose transposes share a PSUM bank:
    ``count`` chunks of ``width`` columns each, the full ones by ``_CHUNKS_PER_BANK``, the
    ragged last one (N not a multiple of 128) on its own."""
    pmax = nl.tile_size.pmax
    full = N // pmax
    groups = []
    for k0 in range(0, full, _CHUNKS_PER_BANK):
        groups.append((k0 * pmax, pmax, min(_CHUNKS_PER_BANK, full - k0)))
    if N % pmax != 0:
        groups.append((full * pmax, N % pmax, 1))
    return groups


def _transposed(hbm, options, p, rstd, r0):
    """y_qᵀ (and its scales) for the tile of rows r0 … r0 + parts − 1: y in float32, each
    chunk of up to 128 columns transposed by the Tensor engine into PSUM (``nc_transpose``,
    aws-neuron-sdk@81ce03ae ``nki/api/nki/isa/__init__.py`` L829-866: SBUF to PSUM, same
    dtype, up to 128 × 128; bit-accurate from NeuronCore-v3, L561-562), where a row of the
    bank is a column of y: its maximum |y| over the tile's rows (Vector engine) gives the
    column's scale for this tile, and the Scalar engine quantizes it from PSUM. The full
    128-column chunks gather in one SBUF tile each for y_qᵀ and the scales, stored with one
    DMA apiece through an access pattern over the HBM output (``.ap``, as nki-library's
    ``core/rmsnorm/rmsnorm_quant.py`` L396-402 addresses its packed output): one transfer
    per output and tile rather than one per chunk, each costing a DMA queue's fixed
    overhead; a ragged last chunk (N not a multiple of 128) is stored on its own. With a
    static scale ``p`` is the tile's y_q and ``rstd`` None: y_qᵀ is its transpose, bit for
    bit (``nc_transpose`` takes any dtype, L850-851)."""
    y_q_t, scales_t = hbm[8], hbm[9]
    eps, quant_dtype, scale_mode, block, lower_bound, scale_floor = options
    parts, N = p.shape
    M = y_q_t.shape[1]
    pmax = nl.tile_size.pmax
    full = N // pmax
    tile_index = r0 // pmax
    y32 = p
    if rstd is not None:
        y32 = _sbuf((parts, N), nl.float32)
        nisa.activation(dst=y32, op=nl.copy, data=p, scale=rstd)
    q_full = None
    scale_full = None
    if full > 0:
        q_full = _sbuf((pmax, full * parts), quant_dtype)
        scale_full = _column((pmax, full))
    for c0, width, count in _transpose_groups(N):
        k0 = c0 // pmax
        if width == pmax:
            q_t = q_full[:, k0 * parts : (k0 + count) * parts]
            scale_t = scale_full[:, k0 : k0 + count]
        else:
            q_t = _sbuf((width, parts), quant_dtype)
            scale_t = _column((width, 1))
        _transpose_group(y32, c0, width, count, q_t, scale_t, options)
        if width != pmax:
            nisa.dma_copy(dst=y_q_t[c0:N, r0 : r0 + parts], src=q_t)
            if scales_t is not None:
                nisa.dma_copy(dst=scales_t[c0:N, tile_index : tile_index + 1], src=scale_t)
    if full == 0:
        return
    # element (i, k, j) of a tile is y_qᵀ[k · 128 + i, r0 + j], its scale scales_t[k · 128 + i, t]
    nisa.dma_copy(
        dst=y_q_t.ap(pattern=[[M, pmax], [pmax * M, full], [1, parts]], offset=r0), src=q_full
    )
    if scales_t is not None:
        tiles_m = scales_t.shape[1]
        nisa.dma_copy(
            dst=scales_t.ap(pattern=[[tiles_m, pmax], [pmax * tiles_m, full]], offset=tile_index),
            src=scale_full,
        )


def _transpose_group(y32, c0, width, count, q_t, scale_t, options):
    """``count`` chunks of ``width`` columns of y from c0 on, through one PSUM bank: into
    ``q_t`` (width, count · rows) quantized, their scales into ``scale_t`` (width, count);
    with a static scale ``y32`` is y_q, copied through transposed."""
    eps, quant_dtype, scale_mode, block, lower_bound, scale_floor = options
    parts = y32.shape[0]
    fp8max = fp8_max(quant_dtype)
    bank = nl.ndarray((width, count * parts), dtype=y32.dtype, buffer=nl.psum)
    for k in range(count):
        nisa.nc_transpose(
            dst=bank[:, k * parts : (k + 1) * parts],
            data=y32[:, c0 + k * width : c0 + (k + 1) * width],
            engine=nisa.tensor_engine,
        )
    if scale_mode == "static":
        # a bit-accurate copy (same dtype on the Vector engine: isa L396-397); the Scalar
        # engine's activation computes copy(x + 0), which turns a -0 into +0
        nisa.tensor_copy(dst=q_t, src=bank, engine=nisa.vector_engine)
        return
    amax_t = _column((width, count))
    for k in range(count):
        nisa.tensor_scalar_reduce(
            dst=q_t[:, k * parts : (k + 1) * parts],
            data=bank[:, k * parts : (k + 1) * parts],
            op0=nl.abs,
            operand0=0.0,
            reduce_op=nl.maximum,
            reduce_res=amax_t[:, k : k + 1],
        )
    _dequant_scale(amax_t, fp8max, lower_bound, scale_floor, scale_t)
    inverse = _inverse(scale_t)
    if lower_bound is not None:
        nisa.tensor_scalar(
            dst=bank,
            data=bank,
            op0=nl.minimum,
            operand0=float(lower_bound),
            op1=nl.maximum,
            operand1=-float(lower_bound),
        )
    for k in range(count):
        nisa.activation(
            dst=q_t[:, k * parts : (k + 1) * parts],
            op=nl.copy,
            data=bank[:, k * parts : (k + 1) * parts],
            scale=inverse[:, k : k + 1],
        )


def _use_tensor_products(x, residual, weight, options):
    """Whether p = h · w comes from the Tensor engine (:func:`_weight_diagonals`): row
    scales, a 16-bit h and weight of one dtype (their products are exact in the float32
    PSUM), N a multiple of 128."""
    eps, quant_dtype, scale_mode, block, lower_bound, scale_floor = options
    if weight is None or scale_mode != "row":
        return False
    h_dtype = x.dtype if residual is None else residual.dtype
    if weight.dtype != h_dtype or (h_dtype != nl.bfloat16 and h_dtype != nl.float16):
        return False
    return x.shape[1] % nl.tile_size.pmax == 0


def _weight_diagonals(weight):
    """diag(w[b · 128 : (b + 1) · 128]) for every 128-column block b, side by side in a
    (128, N) SBUF tile of the weight's dtype: the moving operand that makes a Tensor-engine
    matmul of hᵀ's block b give p's block b. The weight's blocks are loaded as rows,
    transposed to columns by the Tensor engine, and each scales a 16-bit identity, exact:
    alternately the Scalar engine's ``activation`` with a per-partition ``scale`` and the
    Vector engine's ``tensor_scalar`` multiply by that column (both idle while the first
    tile loads; on one engine the diagonals delayed the first tile's copies of hᵀ)."""
    pmax = nl.tile_size.pmax
    N = weight.shape[0]
    blocks = N // pmax
    columns = _column((pmax, blocks))
    by_block = weight.reshape((blocks, pmax))
    for b0 in range(0, blocks, pmax):
        count = min(pmax, blocks - b0)
        rows = _sbuf((count, pmax), weight.dtype)
        nisa.dma_copy(dst=rows, src=by_block[b0 : b0 + count, :])
        bank = nl.ndarray((pmax, count), dtype=weight.dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=bank, data=rows, engine=nisa.tensor_engine)
        nisa.tensor_copy(dst=columns[:, b0 : b0 + count], src=bank, engine=nisa.vector_engine)
    offsets = _sbuf((pmax, pmax), nl.int32)
    nisa.iota(dst=offsets, pattern=[[1, pmax]], offset=0, channel_multiplier=-1)
    identity = _sbuf((pmax, pmax), weight.dtype)
    nisa.tensor_scalar(dst=identity, data=offsets, op0=nl.equal, operand0=0.0)
    diagonals = _sbuf((pmax, N), weight.dtype)
    for b in range(blocks):
        block = diagonals[:, b * pmax : (b + 1) * pmax]
        if b % 2 == 0:
            nisa.activation(dst=block, op=nl.copy, data=identity, scale=columns[:, b : b + 1])
        else:
            nisa.tensor_scalar(
                dst=block, data=identity, op0=nl.multiply, operand0=columns[:, b : b + 1]
            )
    return diagonals


def _transposed_rows(h_tile, first):
    """hᵀ of a (rows, N) tile's blocks from ``first`` on: (128, N / 128 · rows), block b at
    columns b · rows …; Tensor-engine transposes into one PSUM bank per group of blocks,
    copied out by the Vector engine (16-bit, one side in PSUM: its 2× mode) or, for a
    share of the banks, the Scalar engine."""
    parts, N = h_tile.shape
    pmax = nl.tile_size.pmax
    blocks = N // pmax
    per_bank = max(1, _BANK_BYTES // (dtype_bytes(h_tile.dtype) * parts))
    h_t = _sbuf((pmax, blocks * parts), h_tile.dtype)
    for b0 in range(first, blocks, per_bank):
        count = min(per_bank, blocks - b0)
        bank = nl.ndarray((pmax, count * parts), dtype=h_tile.dtype, buffer=nl.psum)
        for j in range(count):
            b = b0 + j
            nisa.nc_transpose(
                dst=bank[:, j * parts : (j + 1) * parts],
                data=h_tile[:, b * pmax : (b + 1) * pmax],
                engine=nisa.tensor_engine,
            )
        engine = nisa.vector_engine
        k = b0 // per_bank
        num, den = _ACT_COPY_SHARE
        if nisa.get_nc_version() == nisa.nc_version.gen4:
            num, den = _ACT_COPY_SHARE_V4
        if ((k + 1) * num) // den != (k * num) // den:
            engine = nisa.scalar_engine
        nisa.tensor_copy(dst=h_t[:, b0 * parts : (b0 + count) * parts], src=bank, engine=engine)
    return h_t


def _gram_first(N):
    """The first 128-column block whose Σh² the Tensor engine's Gram matrix sums."""
    blocks = N // nl.tile_size.pmax
    num, den = _GRAM_SHARE
    if nisa.get_nc_version() == nisa.nc_version.gen4:
        num, den = _GRAM_SHARE_V4
    return blocks - (blocks * num) // den


def _split_square_sums(h_tile, q):
    """The Scalar engine's share of Σh² of a tile whose hᵀ is on chip: Σ (h / √N)² over the
    columns before block ``first`` (:func:`_gram_first`); returns it and ``first``.
    :func:`_mean_square` adds the Tensor engine's share, the diagonal of the Gram matrix
    hᵀᵀ·hᵀ of the other columns. The split depends on N alone, so that every option's
    kernel computes the same rstd."""
    parts, N = h_tile.shape
    first = _gram_first(N)
    cut = first * nl.tile_size.pmax
    on_scalar = _column((parts, 1))
    nisa.activation_reduce(
        dst=q[:, 0:cut],
        op=nl.square,
        data=h_tile[:, 0:cut],
        reduce_op=nl.add,
        reduce_res=on_scalar,
        scale=1.0 / math.sqrt(N),  # as AWS's attention_tkg.py L1567 scales by 1 / sqrt(d)
    )
    return on_scalar, first


def _mean_square(sums, h_t, q):
    """mean(h²) from :func:`_split_square_sums`: over the columns from block ``first`` on,
    the Tensor engine's Gram matrix, issued here (after the tile's products, so that the
    products wait for no other engine's stream), whose diagonal the Vector engine's
    ``range_select`` picks out (free index == partition; a select, so the NaN or Inf of
    other rows' entries does not reach it), times 1 / N; plus the Scalar engine's part."""
    on_scalar, first = sums
    parts, N = q.shape
    blocks = N // nl.tile_size.pmax
    if first == blocks:
        return on_scalar
    gram = nl.ndarray((parts, parts), dtype=nl.float32, buffer=nl.psum)
    for b in range(first, blocks):
        block = h_t[:, b * parts : (b + 1) * parts]
        nisa.nc_matmul(dst=gram, stationary=block, moving=block, accumulate=b > first)
    index = _column((parts, 1))
    nisa.iota(dst=index, pattern=[[0, 1]], offset=0, channel_multiplier=1)
    diagonal = _column((parts, 1))
    nisa.range_select(
        dst=_column((parts, parts)),  # discarded; float32, so the reduction reads no downcast
        on_true_tile=gram,
        comp_op0=nl.greater_equal,
        comp_op1=nl.less_equal,
        bound0=index,
        bound1=index,
        reduce_res=diagonal,
        reduce_op=nl.maximum,
    )
    mean_sq = _column((parts, 1))
    nisa.tensor_scalar(
        dst=mean_sq,
        data=diagonal,
        op0=nl.multiply,
        operand0=1.0 / N,
        op1=nl.add,
        operand1=on_scalar,
    )
    return mean_sq


def _product_bank(h_t, diagonals, c0, c1):
    """p[:, c0:c1] (at most one PSUM bank of float32) on the Tensor engine: for each block,
    hᵀ's block as the stationary operand against the block's weight diagonal, exact (one
    nonzero product per sum)."""
    pmax = nl.tile_size.pmax
    parts = h_t.shape[1] // (diagonals.shape[1] // pmax)
    bank = nl.ndarray((parts, c1 - c0), dtype=nl.float32, buffer=nl.psum)
    for b in range(c0 // pmax, c1 // pmax):
        j = b - c0 // pmax
        nisa.nc_matmul(
            dst=bank[:, j * pmax : (j + 1) * pmax],
            stationary=h_t[:, b * parts : (b + 1) * parts],
            moving=diagonals[:, b * pmax : (b + 1) * pmax],
            accumulate=False,
        )
    return bank


def _tile_front(hbm, options, weight_row, ones, r0, parts, diagonals=None, split=False):
    """Rows r0 … r0 + parts − 1, up to p: load (and h = x + residual, stored), mean(h²),
    rstd and p = h · w — or, with the weight's ``diagonals`` (:func:`_weight_diagonals`),
    hᵀ, from which the Tensor engine forms p one PSUM bank at a time when it is read.
    Returns what :func:`_tile_scales` continues from."""
    x, residual, h = hbm[0], hbm[1], hbm[5]
    eps, quant_dtype, scale_mode, block, lower_bound, scale_floor = options
    N = x.shape[1]
    rows = slice(r0, r0 + parts)
    chunks = _column_chunks(N, dtype_bytes(x.dtype))
    if residual is None:
        h_tile = _sbuf((parts, N), x.dtype)
        for c0, c1 in chunks:
            nisa.dma_copy(dst=h_tile[:, c0:c1], src=x[rows, c0:c1])
    else:
        h_tile = _sbuf((parts, N), residual.dtype)
        x_tile = _sbuf((parts, N), x.dtype)
        for c0, c1 in chunks:
            nisa.dma_copy(dst=h_tile[:, c0:c1], src=residual[rows, c0:c1])
            nisa.dma_copy(dst=x_tile[:, c0:c1], src=x[rows, c0:c1])
            nisa.tensor_tensor(
                dst=h_tile[:, c0:c1], data1=x_tile[:, c0:c1], data2=h_tile[:, c0:c1], op=nl.add
            )
            nisa.dma_copy(dst=h[rows, c0:c1], src=h_tile[:, c0:c1])

    # The quantized tile is written last; until then it takes the discarded elementwise
    # results of the reductions.
    q = _sbuf((parts, N), quant_dtype)
    if split:
        h_t = _transposed_rows(h_tile, 0 if diagonals is not None else _gram_first(N))
        sums = _split_square_sums(h_tile, q)
        if diagonals is not None:
            return rows, chunks, q, h_tile, None, r0, (h_t, diagonals, sums)
        # the y / transposed outputs: rstd in the tile's front, as without the split (y
        # needs it), after the product, which waits on no other engine's copies of hᵀ
        p = _product(h_tile, weight_row, ones)
        rstd = _rstd(_mean_square(sums, h_t, q), eps)
        return rows, chunks, q, p, rstd, r0, (h_t, None, sums)
    # mean(h²) as Σ (h / √N)²: the Scalar engine's scale folds the 1 / N in
    mean_sq = _column((parts, 1))
    nisa.activation_reduce(
        dst=q,
        op=nl.square,
        data=h_tile,
        reduce_op=nl.add,
        reduce_res=mean_sq,
        scale=1.0 / math.sqrt(N),  # as AWS's attention_tkg.py L1567 scales by 1 / sqrt(d)
    )
    rstd = _rstd(mean_sq, eps)
    p = h_tile if weight_row is None else _product(h_tile, weight_row, ones)
    return rows, chunks, q, p, rstd, r0, None


def _tile_scales(hbm, options, loaded):
    """The maxima of |p| and the dequant scales of a tile :func:`_tile_front` loaded; returns
    the tile's state for :func:`_tile_back`."""
    eps, quant_dtype, scale_mode, block, lower_bound, scale_floor = options
    rows, chunks, q, p, rstd, r0, products = loaded
    parts, N = p.shape
    amax_p = None
    if products is not None and products[1] is not None:
        amax_p = _bank_maxima(q, products)
    elif scale_mode == "row":
        amax_p = _column((parts, 1))
        nisa.tensor_scalar_reduce(
            dst=q, data=p, op0=nl.abs, operand0=0.0, reduce_op=nl.maximum, reduce_res=amax_p
        )
    elif scale_mode == "block":
        amax_p = _block_maxima(p, q, block)
    elif hbm[6] is not None:
        amax_p = _column((parts, 1))
        junk = _sbuf((parts, N), nl.bfloat16)
        nisa.tensor_scalar_reduce(
            dst=junk, data=p, op0=nl.abs, operand0=0.0, reduce_op=nl.maximum, reduce_res=amax_p
        )
    if rstd is None:
        # after the maxima: the Gram diagonal is read once the Vector engine is done with them
        rstd = _rstd(_mean_square(products[2], products[0], q), eps)
    scaled = None
    if scale_mode != "static":
        scaled = _scale(amax_p, rstd, fp8_max(quant_dtype), lower_bound, scale_floor)
    return rows, chunks, q, p, rstd, r0, products, amax_p, scaled


def _bank_maxima(q, products):
    """max |p| per row, p formed by the Tensor engine one PSUM bank at a time: the Vector
    engine's ``tensor_scalar_reduce`` (``nl.abs``, max) of each bank (discarded output in
    q's columns), then the maximum of the banks' maxima."""
    h_t, diagonals, sums = products
    parts, N = q.shape
    banks = -(-N // _BANK_COLUMNS)
    maxima = _column((parts, banks))
    for g in range(banks):
        c0 = g * _BANK_COLUMNS
        c1 = min(N, c0 + _BANK_COLUMNS)
        nisa.tensor_scalar_reduce(
            dst=q[:, c0:c1],
            data=_product_bank(h_t, diagonals, c0, c1),
            op0=nl.abs,
            operand0=0.0,
            reduce_op=nl.maximum,
            reduce_res=maxima[:, g : g + 1],
        )
    if banks == 1:
        return maxima
    amax_p = _column((parts, 1))
    nisa.tensor_reduce(dst=amax_p, op=nl.maximum, data=maxima, axis=1)
    return amax_p


def _tile_back(hbm, options, static_inverse, state, last):
    """The rest of a tile :func:`_tile_front` began: the quantizing factors, y_q, the scales,
    amax and y, stored (``last``: this core's last tile)."""
    y_q, scales, y, amax, packed_scales = hbm[2], hbm[3], hbm[4], hbm[6], hbm[7]
    eps, quant_dtype, scale_mode, block, lower_bound, scale_floor = options
    rows, chunks, q, p, rstd, r0, products, amax_p, scaled = state
    parts, N = p.shape
    fp8max = fp8_max(quant_dtype)
    if products is not None and products[1] is not None:
        _tile_back_banks(hbm, options, state, last)
        return

    # y first: the clips below change p in place
    if y is not None:
        y_tile = _sbuf((parts, N), y.dtype)
        nisa.activation(dst=y_tile, op=nl.copy, data=p, scale=rstd)
        nisa.dma_copy(dst=y[rows, :], src=y_tile)
    if hbm[8] is not None and scale_mode != "static":
        _transposed(hbm, options, p, rstd, r0)

    if scale_mode == "static":
        factor = _column((parts, 1))
        nisa.tensor_scalar(
            dst=factor, data=rstd, op0=nl.multiply, operand0=static_inverse[0:parts, :]
        )
        # y / scale clipped to ±fp8_max: p clipped to ±fp8_max / factor
        _clip(p, _scaled_inverse(factor, fp8max))
        _quantize(q, p, factor)
        if hbm[8] is not None:
            _transposed(hbm, options, q, None, r0)
        nisa.dma_copy(dst=y_q[rows, :], src=q)
        if amax is not None:
            amax_y = _column((parts, 1))
            nisa.activation(dst=amax_y, op=nl.copy, data=amax_p, scale=rstd)
            nisa.dma_copy(dst=amax[rows, :], src=amax_y)
        return

    amax_y, scale = scaled
    factor = _factors(scale, rstd)
    if lower_bound is not None:
        # y clipped to ±lower_bound: p clipped to ±lower_bound / rstd
        _clip(p, _scaled_inverse(rstd, lower_bound))
    if scale_mode == "row":
        for c in range(len(chunks)):
            c0, c1 = chunks[c]
            # the Vector engine, done with its products, shares the last tile's quantization
            _quantize(q[:, c0:c1], p[:, c0:c1], factor, last and c % 2 == 1)
            nisa.dma_copy(dst=y_q[rows, c0:c1], src=q[:, c0:c1])
    else:
        for b in range(N // block):
            cols = slice(b * block, (b + 1) * block)
            _quantize(q[:, cols], p[:, cols], factor[:, b : b + 1])
        nisa.dma_copy(dst=y_q[rows, :], src=q)
    if packed_scales is not None:
        # the float32 column's bytes as four fp8 elements per row (AWS's packed layout)
        nisa.dma_copy(
            dst=packed_scales[rows, :],
            src=scale.ap(pattern=[[_SCALE_BYTES, parts], [1, _SCALE_BYTES]], dtype=quant_dtype),
        )
    else:
        nisa.dma_copy(dst=scales[rows, :], src=scale)
    if amax is not None and scale_mode == "row":
        nisa.dma_copy(dst=amax[rows, :], src=amax_y)
    elif amax is not None:
        row_amax = _column((parts, 1))
        nisa.tensor_reduce(dst=row_amax, op=nl.maximum, data=amax_y, axis=1)
        nisa.dma_copy(dst=amax[rows, :], src=row_amax)


def _tile_back_banks(hbm, options, state, last):
    """:func:`_tile_back` for a tile whose p the Tensor engine forms (row scales): per PSUM
    bank of p, y (Scalar engine), the float32 y of the transposed output, p clipped to
    ±lower_bound / rstd (Vector engine) and y_q (Scalar engine, ``scale=`` the row's
    factor; on this core's ``last`` tile every other bank on the Vector engine, then free),
    the stores per column chunk, the transposed output (:func:`_transposed`) last."""
    y_q, scales, y, amax, packed_scales = hbm[2], hbm[3], hbm[4], hbm[6], hbm[7]
    eps, quant_dtype, scale_mode, block, lower_bound, scale_floor = options
    rows, chunks, q, p, rstd, r0, products, amax_p, scaled = state
    h_t, diagonals, sums = products
    parts, N = q.shape
    amax_y, scale = scaled
    factor = _factors(scale, rstd)
    y_tile = None
    if y is not None:
        y_tile = _sbuf((parts, N), y.dtype)
    y32 = None
    if hbm[8] is not None:
        y32 = _sbuf((parts, N), nl.float32)
    bound = None
    if lower_bound is not None:
        bound = _scaled_inverse(rstd, lower_bound)
    for c0, c1 in chunks:
        for b0 in range(c0, c1, _BANK_COLUMNS):
            b1 = min(c1, b0 + _BANK_COLUMNS)
            bank = _product_bank(h_t, diagonals, b0, b1)
            if y_tile is not None:
                nisa.activation(dst=y_tile[:, b0:b1], op=nl.copy, data=bank, scale=rstd)
            if y32 is not None:
                nisa.activation(dst=y32[:, b0:b1], op=nl.copy, data=bank, scale=rstd)
            if bound is not None:
                clipped = _sbuf((parts, b1 - b0), nl.float32)
                _clip(bank, bound, clipped)
                bank = clipped
            _quantize(q[:, b0:b1], bank, factor, last and (b0 // _BANK_COLUMNS) % 2 == 1)
        nisa.dma_copy(dst=y_q[rows, c0:c1], src=q[:, c0:c1])
        if y_tile is not None:
            nisa.dma_copy(dst=y[rows, c0:c1], src=y_tile[:, c0:c1])
    if packed_scales is not None:
        nisa.dma_copy(
            dst=packed_scales[rows, :],
            src=scale.ap(pattern=[[_SCALE_BYTES, parts], [1, _SCALE_BYTES]], dtype=quant_dtype),
        )
    else:
        nisa.dma_copy(dst=scales[rows, :], src=scale)
    if amax is not None:
        nisa.dma_copy(dst=amax[rows, :], src=amax_y)
    if y32 is not None:
        _transposed(hbm, options, y32, None, r0)


@nki.jit
def rmsnorm_quant(
    x,
    residual,
    weight,
    input_scale,
    eps,
    quant_dtype,
    scale_mode,
    block,
    lower_bound,
    scale_floor,
    emit_y,
    emit_amax,
    packed,
    emit_transposed,
):
    """Quantized RMSNorm of ``x`` (M, N) (plus ``residual``, or None) with ``weight`` (N,)
    or None. ``scale_mode`` "row" | "block" (``block`` columns per scale) | "static"
    (``input_scale`` a (1, 1) float32 dequant scale). Returns, in this order: y_q (M, N) in
    ``quant_dtype`` — or, with ``packed`` (row scales), (M, N + 4) with each row's scale
    bytes at [N:N + 4]; the scales (M, 1) or (M, N / block) float32 (row / block, unpacked);
    y (M, N) in x's dtype if ``emit_y``; h (M, N) in the residual's dtype with a residual;
    the per-row amax of y (M, 1) float32 if ``emit_amax``; with ``emit_transposed`` y_qᵀ
    (N, M) in ``quant_dtype`` and, unless static, its scales (N, ⌈M / 128⌉) float32."""
    M, N = x.shape
    assert scale_mode == "row" or scale_mode == "block" or scale_mode == "static"
    assert quant_dtype != nl.float8_e4m3fn or nisa.get_nc_version() == nisa.nc_version.gen4
    assert not packed or scale_mode == "row"
    assert scale_mode != "block" or N % block == 0
    outputs = []
    packed_scales = None
    scales = None
    if packed:
        out = nl.ndarray((M, N + _SCALE_BYTES), dtype=quant_dtype, buffer=nl.shared_hbm)
        y_q = out[:, 0:N]
        packed_scales = out[:, N : N + _SCALE_BYTES]
        outputs.append(out)
    else:
        y_q = nl.ndarray((M, N), dtype=quant_dtype, buffer=nl.shared_hbm)
        outputs.append(y_q)
        if scale_mode == "row":
            scales = nl.ndarray((M, 1), dtype=nl.float32, buffer=nl.shared_hbm)
            outputs.append(scales)
        elif scale_mode == "block":
            scales = nl.ndarray((M, N // block), dtype=nl.float32, buffer=nl.shared_hbm)
            outputs.append(scales)
    y = None
    if emit_y:
        y = nl.ndarray((M, N), dtype=x.dtype, buffer=nl.shared_hbm)
        outputs.append(y)
    h = None
    if residual is not None:
        h = nl.ndarray((M, N), dtype=residual.dtype, buffer=nl.shared_hbm)
        outputs.append(h)
    amax = None
    if emit_amax:
        amax = nl.ndarray((M, 1), dtype=nl.float32, buffer=nl.shared_hbm)
        outputs.append(amax)
    y_q_t = None
    scales_t = None
    if emit_transposed:
        y_q_t = nl.ndarray((N, M), dtype=quant_dtype, buffer=nl.shared_hbm)
        outputs.append(y_q_t)
        if scale_mode != "static":
            tiles_m = (M + nl.tile_size.pmax - 1) // nl.tile_size.pmax
            scales_t = nl.ndarray((N, tiles_m), dtype=nl.float32, buffer=nl.shared_hbm)
            outputs.append(scales_t)

    weight_row = None
    ones = None
    diagonals = None
    options = (eps, quant_dtype, scale_mode, block, lower_bound, scale_floor)
    split = _use_tensor_products(x, residual, weight, options)
    if split and not emit_y and not emit_transposed:
        diagonals = _weight_diagonals(weight)
    elif weight is not None:
        weight_row, ones = _load_weight(weight)
    static_inverse = None
    if scale_mode == "static":
        static_inverse = _broadcast_scale(input_scale)
    hbm = (x, residual, y_q, scales, y, h, amax, packed_scales, y_q_t, scales_t)
    tiles = _core_tiles(M)
    fit = _two_tiles_fit(
        x, residual, weight, emit_y, emit_transposed, options, split, diagonals is not None
    )
    if not fit:
        for t in range(len(tiles)):
            loaded = _tile_front(
                hbm, options, weight_row, ones, tiles[t][0], tiles[t][1], diagonals, split
            )
            state = _tile_scales(hbm, options, loaded)
            _tile_back(hbm, options, static_inverse, state, t == len(tiles) - 1)
        return tuple(outputs)
    # A software pipeline: tile t + 1 is loaded and its p formed before tile t's maxima,
    # scales and quantization are issued, so that no engine's in-order stream waits on a
    # tile's short chain of per-row steps, and the Vector engine's max of |p| does not read
    # the instruction just before it (which costs a dependent instruction's overhead). The
    # first tile's maxima follow its own products directly (behind the next tile's, they
    # would wait for its load: the pipeline's fill), and so do the last tile's (behind the
    # products of the tile after, they would lengthen the drain).
    last = len(tiles) - 1
    pending = None  # a front whose maxima are not issued yet
    state = None
    following = None  # the last tile's state, when its maxima came before its turn
    if len(tiles) > 0:
        state = _tile_scales(
            hbm,
            options,
            _tile_front(hbm, options, weight_row, ones, tiles[0][0], tiles[0][1], diagonals, split),
        )
    for t in range(len(tiles)):
        if t + 1 < last:
            loaded = _tile_front(
                hbm, options, weight_row, ones, tiles[t + 1][0], tiles[t + 1][1], diagonals, split
            )
            if t > 0:
                state = _tile_scales(hbm, options, pending)
            pending = loaded
        elif t + 1 == last:
            if t > 0:
                state = _tile_scales(hbm, options, pending)
            loaded = _tile_front(
                hbm, options, weight_row, ones, tiles[t + 1][0], tiles[t + 1][1], diagonals, split
            )
            following = _tile_scales(hbm, options, loaded)
        elif t > 0:
            state = following
        _tile_back(hbm, options, static_inverse, state, t == last)
    return tuple(outputs)
