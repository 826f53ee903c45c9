"""RMSNorm with OCP Microscaling (MXFP8) output in the ``nki`` 0.6 dialect, trn3 only: one
pass that reads x (and a residual) and writes y quantized by ``nisa.quantize_mx`` in the
layout ``nisa.nc_matmul_mx`` consumes, with its e8m0 block scales, and optionally
``h = x + residual``.

Only this dialect has the kernel: the MX instructions and dtypes are NeuronCore-v4 only
("Available only on NeuronCore-v4 and newer", aws-neuron-sdk@81ce03ae
``nki/api/nki/isa/__init__.py`` L2744-2746) and the legacy dtype table has no packed x4 or
e8m0 type (aws-neuron-sdk@8a38e733 ``general/nki/api/nki.api.shared.rst``).

Math (per row of N elements; float32 unless it says otherwise)::

    h     = x + residual                          (rounded once to the residual's dtype)
    rstd  = 1 / sqrt(max(Σ(h / √N)² + eps, 2⁻⁸⁷))  (GpSimd rsqrt)
    y1    = RNE_bf16(h · rstd)                    (bfloat16, or float16 for float16 x)
    y     = RNE_bf16(y1 · w)                      (y1 itself without a weight)
    y_q, scales = quantize_mx(y)                  (32-value blocks along the row)

``quantize_mx`` reads only bfloat16/float16 (isa L2767), so y is rounded to that type
before it quantizes, and rounding it in two steps (y1, then y) keeps every elementwise pass
on the engines' fast 16-bit modes. The quantization is the instruction's: per block of 32
values the scale ``X = 2^(⌊log2 max|y|⌋ − (E_max − 1))`` (E_max 8 for e4m3fn, 15 for
e5m2; 2⁻¹²⁷ for an all-zero block), ``y_q = RNE(y / X)``, which never saturates; a block
holding Inf or NaN gets the NaN scale 0xFF (see :func:`simulate.core.semantics.quantize_mx`).

Output layout (documented choice). A block is 32 consecutive values of one row, the OCP
MX convention (scales along the contraction axis of the next matmul). The kernel writes the
transposed, hidden-major form a matmul consumes:

* ``y_q`` (N / 4, M) in ``float8_e4m3fn_x4`` / ``float8_e5m2_x4``: element ``[k, m]`` packs
  ``y[m, 4k : 4k + 4]``, the first value in the lowest byte;
* ``scales`` (N / 32, M) in ``float8_e8m0fnu`` (or ``uint8``, the same bytes): ``[b, m]`` is
  the scale of ``y[m, 32b : 32b + 32]``.

Rows 128c … 128c + 127 of ``y_q`` (512 values of each row) load as one (128, M) moving or
stationary tile of ``nc_matmul_mx`` (K = 512 on 128 partitions × 4); their scales are rows
16c … 16c + 15 of ``scales``, which go to partitions 0-3 of each 32-partition quadrant of the
scale tile (the layout ``quantize_mx`` writes and ``nc_matmul_mx`` reads, trainium3_arch.rst
L105) — four 4-row DMAs, as AWS's ``load_scales_scattered`` does (aws-neuron-sdk@81ce03ae
``nki/deep-dives/src/mxfp-matmul/mx_kernel_utils.py`` L18-48).

Engines, per tile of up to 128 rows (whole rows on chip; under ``kernel[2]`` the tiles are
split between the two physical cores by ``nl.program_id(0)``):

* DMA: x (residual) in, in four column parts; h, y_q (a column part at a time) and the
  scales out; the weight once, as (N / 512, 512) rows;
* Scalar: Σ(h / √N)² (``activation_reduce``, square with an add reduction, over two load
  parts at a time), and with a residual y1 (``tensor_scalar`` with the per-row rstd
  column, 16-bit at 2x);
* GpSimd: the rsqrt (``tensor_scalar`` runs on GpSimd "only for rsqrt", isa L1138-1140);
* Vector: the partial sums plus eps (one ``tensor_scalar_reduce``); h = x + residual;
  y1 = h · rstd without a residual (16-bit in and out: the fast mode); per chunk the four
  lane copies out of PSUM, each times its per-partition weight column; ``quantize_mx`` (4
  values per partition per cycle, trainium3_arch.rst L172);
* Tensor: per 512-column chunk, four ``nc_transpose`` of y1's columns 4p + q (q = 0…3), the
  x4 lanes, to (128, rows) PSUM tiles: in the transposed domain w is a per-partition scalar
  (the weight's own columns 4p + q come the same way, once).

The Scalar and Vector engines carry about the same work per tile, so the statistics run one
tile ahead: tile i + 1's loads and Σh² are issued before tile i's chunks and its rstd just
before tile i's last chunk, and the Vector engine never waits for the rsqrt. In each core's
last tile, whose work is the kernel's tail, the Scalar engine (done with Σh² by then) takes
the odd y1 parts and the lane copies of the odd chunks. Every row gets the same steps and
roundings in every tile (the Scalar and Vector engines' ``tensor_scalar`` both compute in
float32 with one rounding to the output dtype, isa L1115-1117), so a row's bits do not
depend on how many rows come with it.

The arguments are validated by :func:`nki_rmsnorm.mx.rms_norm_mx_quant` before launch;
the kernel only asserts them.
"""

from __future__ import annotations

from nki_rmsnorm.kernels.nki06._nki import nisa, nki, nl
from nki_rmsnorm.kernels.nki06.rmsnorm_fwd_steps import core_tiles
from nki_rmsnorm.kernels.nki06.rmsnorm_fwd_steps import sbuf as _sbuf
from nki_rmsnorm.plan.forward import RSQRT_MIN_INPUT

__all__ = ["MX_CHUNK", "MX_BLOCK", "rmsnorm_mx_quant"]

#: Values a scale covers (8 partitions x 4 lanes of quantize_mx, 32 consecutive values of a
#: row in this kernel's layout).
MX_BLOCK = 32
#: Values of a row per transposed chunk: 128 partitions x 4 lanes of an x4 element.
MX_CHUNK = 512
#: Column parts a row tile is loaded and reduced in (fewer when N / 512 is smaller).
_LOAD_PARTS = 4
#: Lanes of an x4 element.
_LANES = 4
#: Scale rows quantize_mx writes per 32-partition quadrant, and the quadrants of a chunk.
_SCALE_ROWS = 4
_QUADRANTS = 4


def _weight_columns(weight, chunks):
    """(128, chunks, 4) float32: ``[p, c, q] = w[512c + 4p + q]``, the weight of the row value
    partition p holds in lane q of chunk c. The weight comes in as (chunks, 512) in one DMA
    of whole 1 KB rows (loaded into that layout directly it would be 8-byte pieces, whose
    descriptors would hold the DMA engines the first x load needs), then each lane's columns
    go through the Tensor engine's transpose (bit-accurate from NeuronCore-v3, isa L840-841)
    and are copied to float32."""
    parts = nl.tile_size.pmax
    by_chunk = _sbuf((chunks, MX_CHUNK), weight.dtype)
    nisa.dma_copy(dst=by_chunk, src=weight.reshape((chunks, MX_CHUNK)))
    columns = _sbuf((parts, chunks, _LANES), nl.float32)
    for q in range(_LANES):
        lane = nl.ndarray((parts, chunks), dtype=weight.dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=lane, data=by_chunk[:, q:MX_CHUNK:_LANES])
        nisa.tensor_copy(dst=columns[:, :, q], src=lane)
    return columns


def _parts(N):
    """Column parts of a row tile: whole 512-value chunks, at most ``_LOAD_PARTS``."""
    parts = _LOAD_PARTS
    while (N // MX_CHUNK) % parts != 0:
        parts = parts - 1
    return parts


def _load_h(x, residual, h_out, row0, rows, inv_sqrt_n):
    """The tile's h (rows, N) and its partial sums Σ(h / √N)² (rows, parts) over column
    parts of 512 · k values: each part's load, add and store, and its square-and-add
    reduction on the Scalar engine (the elementwise squares discarded), start as soon as that
    part is in, so the first tile's statistics do not wait for its whole load."""
    N = x.shape[1]
    parts = _parts(N)
    width = N // parts
    x_tile = _sbuf((rows, N), x.dtype)
    h = x_tile
    if residual is not None:
        r_tile = _sbuf((rows, N), residual.dtype)
        h = _sbuf((rows, N), residual.dtype)
    squares = _sbuf((rows, N), h.dtype)
    sums = (parts + 1) // 2  # Σh² over two parts at a time: one accumulator read each
    partial = _sbuf((rows, sums), nl.float32)
    for part in range(parts):
        c0 = part * width
        c1 = c0 + width
        nisa.dma_copy(dst=x_tile[:, c0:c1], src=x[row0 : row0 + rows, c0:c1])
        if residual is not None:
            nisa.dma_copy(dst=r_tile[:, c0:c1], src=residual[row0 : row0 + rows, c0:c1])
            nisa.tensor_tensor(
                dst=h[:, c0:c1], data1=x_tile[:, c0:c1], data2=r_tile[:, c0:c1], op=nl.add
            )
            nisa.dma_copy(dst=h_out[row0 : row0 + rows, c0:c1], src=h[:, c0:c1])
        if part % 2 == 1 or part == parts - 1:
            s0 = (part // 2) * 2 * width
            nisa.activation_reduce(
                dst=squares[:, s0:c1],
                op=nl.square,
                data=h[:, s0:c1],
                reduce_op=nl.add,
                reduce_res=partial[:, part // 2 : part // 2 + 1],
                scale=inv_sqrt_n,
            )
    return h, partial


def _rstd(partial, eps):
    """rstd = 1 / sqrt(max(Σ partial + eps, 2⁻⁸⁷)) of the (rows, parts) partial sums: one
    Vector ``tensor_scalar_reduce`` adds eps / parts to each part and sums them (isa
    L2515-2535; the Scalar engine, which binds, keeps only the squares), a Vector clamp when
    it matters, the GpSimd rsqrt (GpSimd runs ``tensor_scalar`` "only for rsqrt", isa
    L1138-1140)."""
    rows, parts = partial.shape
    shape = (rows, 1)
    v = _sbuf(shape, nl.float32)
    nisa.tensor_scalar_reduce(
        dst=_sbuf((rows, parts), nl.float32),
        data=partial,
        op0=nl.add,
        operand0=float(eps) / parts,
        reduce_op=nl.add,
        reduce_res=v,
    )
    if eps < RSQRT_MIN_INPUT:
        nisa.tensor_scalar(dst=v, data=v, op0=nl.maximum, operand0=RSQRT_MIN_INPUT)
    rstd = _sbuf(shape, nl.float32)
    nisa.tensor_scalar(dst=rstd, data=v, op0=nl.rsqrt, operand0=None, engine=nisa.gpsimd_engine)
    return rstd


def _lanes(y1, rows, chunk, w_columns, y_dtype, engine):
    """The (128, rows, 4) source of ``quantize_mx`` for chunk ``chunk`` (512 values of each
    row) of the tile ``y1``: lanes q = 0…3 are y1's columns 512·chunk + 4p + q (p the
    partition they land on), transposed by the Tensor engine into one PSUM bank and copied
    out lane by lane (times the lane's weight column) by ``engine``, the Vector or the
    Scalar engine (both read PSUM from NeuronCore-v3 on, isa L399-403, and compute
    ``tensor_scalar`` in float32 with one rounding to the output dtype, L1115-1117; a
    16-bit ``tensor_copy`` through float32 is exact for every finite value, L396-397)."""
    parts = nl.tile_size.pmax
    c0 = chunk * MX_CHUNK
    lanes = nl.ndarray((parts, _LANES, rows), dtype=y_dtype, buffer=nl.psum)
    source = _sbuf((parts, rows, _LANES), y_dtype)
    for q in range(_LANES):
        nisa.nc_transpose(dst=lanes[:, q, 0:rows], data=y1[0:rows, c0 + q : c0 + MX_CHUNK : _LANES])
        if w_columns is None:
            nisa.tensor_copy(dst=source[:, 0:rows, q], src=lanes[:, q, 0:rows], engine=engine)
        else:
            nisa.tensor_scalar(
                dst=source[:, 0:rows, q],
                data=lanes[:, q, 0:rows],
                op0=nl.multiply,
                operand0=w_columns[:, chunk, q : q + 1],
                engine=engine,
            )
    return source


def _scaled(y1, h, rstd, part, width, residual, last):
    """Column part ``part`` of y1 = h · rstd (the first transposes do not wait for the whole
    tile). With a residual the Vector engine has the add: y1 on the Scalar engine, whose
    ``tensor_scalar`` runs 16-bit data at 2x (trainium3_arch.rst L218); in the last tile
    the odd parts go to the Scalar engine too, idle by then."""
    engine = nisa.vector_engine
    if residual is not None or (last and part % 2 == 1):
        engine = nisa.scalar_engine
    c0 = part * width
    c1 = c0 + width
    nisa.tensor_scalar(
        dst=y1[:, c0:c1], data=h[:, c0:c1], op0=nl.multiply, operand0=rstd, engine=engine
    )


def _quantize(source, packed, scale_tile, chunk, rows):
    nisa.quantize_mx(
        dst=packed[:, chunk, 0:rows], src=source, dst_scale=scale_tile[:, chunk, 0:rows]
    )


def _store_values(y_q, packed, first, count, row0, rows, M):
    """Chunks ``first`` … ``first + count - 1`` of the tile's packed values (128, chunks,
    rows) to ``y_q`` (N / 4, M) rows 128c + p, in one DMA (rows · count · 4 bytes per
    partition: per-chunk stores would each pay the DMA's fixed cost; a column part's at a
    time, the last tile's store does not wait for all its chunks)."""
    parts = nl.tile_size.pmax
    nisa.dma_copy(
        dst=y_q.ap(
            pattern=[[M, parts], [parts * M, count], [1, rows]],
            offset=first * parts * M + row0,
        ),
        src=packed[:, first : first + count, 0:rows],
    )


def _store_scales(scales, scale_tile, chunks, row0, rows, M):
    """The tile's scales, rows 0-3 of each quadrant of ``scale_tile`` (128, chunks, rows),
    to ``scales`` (N / 32, M): scale row 16c + 4·quadrant + i is partition 32·quadrant + i
    of chunk c (one DMA per quadrant)."""
    per_chunk = _SCALE_ROWS * _QUADRANTS
    for quadrant in range(_QUADRANTS):
        p0 = quadrant * 32
        nisa.dma_copy(
            dst=scales.ap(
                pattern=[[M, _SCALE_ROWS], [per_chunk * M, chunks], [1, rows]],
                offset=quadrant * _SCALE_ROWS * M + row0,
            ),
            src=scale_tile[p0 : p0 + _SCALE_ROWS, :, 0:rows],
        )


@nki.jit
def rmsnorm_mx_quant(x, residual, weight, eps, quant_dtype, scale_dtype):
    """MX-quantized RMSNorm of ``x`` (M, N) (plus ``residual``, or None) with ``weight``
    (N,) or None; N a multiple of 512. Returns y_q (N / 4, M) in ``quant_dtype``
    (``float8_e4m3fn_x4`` / ``float8_e5m2_x4``), the scales (N / 32, M) in ``scale_dtype``
    (``float8_e8m0fnu`` / ``uint8``), and h (M, N) in the residual's dtype with a residual
    (layout in the module docstring)."""
    M, N = x.shape
    assert nisa.get_nc_version() == nisa.nc_version.gen4, "MX quantization needs trn3"
    assert N % MX_CHUNK == 0, "N must be a multiple of 512"
    assert quant_dtype == nl.float8_e4m3fn_x4 or quant_dtype == nl.float8_e5m2_x4
    parts = nl.tile_size.pmax
    chunks = N // MX_CHUNK
    y_q = nl.ndarray((N // _LANES, M), dtype=quant_dtype, buffer=nl.shared_hbm)
    scales = nl.ndarray((N // MX_BLOCK, M), dtype=scale_dtype, buffer=nl.shared_hbm)
    outputs = [y_q, scales]
    h_out = None
    if residual is not None:
        h_out = nl.ndarray((M, N), dtype=residual.dtype, buffer=nl.shared_hbm)
        outputs.append(h_out)
    y_dtype = nl.float16 if x.dtype == nl.float16 else nl.bfloat16
    w_columns = None if weight is None else _weight_columns(weight, chunks)
    inv_sqrt_n = 1.0 / (N**0.5)
    column_parts = _parts(N)
    part_width = N // column_parts
    part_chunks = chunks // column_parts
    tiles = core_tiles(M, parts)
    # statistics one tile ahead: tile i + 1's load and Σh² are issued before tile i's
    # chunks, and its partial sums are combined and its rstd computed just before tile i's
    # last chunk, so the Vector engine goes from tile i to tile i + 1 without waiting for
    # the GpSimd rsqrt (in the program order of each engine the same steps as one tile at a
    # time: the rounding of every row is that of its tile alone)
    if len(tiles) > 0:
        h_next, partial = _load_h(x, residual, h_out, tiles[0][0], tiles[0][1], inv_sqrt_n)
        rstd_next = _rstd(partial, eps)
    for i in range(len(tiles)):
        row0, rows = tiles[i]
        h = h_next
        rstd = rstd_next
        y1 = _sbuf((rows, N), y_dtype)
        last = i + 1 == len(tiles)
        for part in range(column_parts):
            _scaled(y1, h, rstd, part, part_width, residual, last)
        if not last:
            h_next, partial = _load_h(
                x, residual, h_out, tiles[i + 1][0], tiles[i + 1][1], inv_sqrt_n
            )
        packed = _sbuf((parts, chunks, rows), quant_dtype)
        scale_tile = _sbuf((parts, chunks, rows), scale_dtype)
        # quantize chunk c after the lane copies of chunk c + 1: a Vector instruction that
        # reads the one just before it waits for it to drain (the cost model's dependent
        # overhead, dependent_overhead_cycles); this order keeps them apart
        previous = None
        for chunk in range(chunks):
            if chunk == chunks - 1 and not last:
                rstd_next = _rstd(partial, eps)
            # the last tile's chunks alternate between the Vector engine and the Scalar
            # engine, idle once the last Σh² is done: the kernel's tail is that tile
            copier = nisa.vector_engine
            if last and chunk % 2 == 1 and residual is None:
                copier = nisa.scalar_engine
            source = _lanes(y1, rows, chunk, w_columns, y_dtype, copier)
            if previous is not None:
                _quantize(previous, packed, scale_tile, chunk - 1, rows)
                if chunk % part_chunks == 0:  # chunk - 1 ends a column part
                    _store_values(y_q, packed, chunk - part_chunks, part_chunks, row0, rows, M)
            previous = source
        _quantize(previous, packed, scale_tile, chunks - 1, rows)
        _store_values(y_q, packed, chunks - part_chunks, part_chunks, row0, rows, M)
        _store_scales(scales, scale_tile, chunks, row0, rows, M)
    return tuple(outputs)
