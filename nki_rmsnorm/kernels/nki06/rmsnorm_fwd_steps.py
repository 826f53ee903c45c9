"""On-chip steps of the forward kernel in the ``nki`` 0.6 dialect: the legacy
``rmsnorm_fwd_steps`` (see its docstring for the three ways of forming y = h·rstd·w and the
rounding of each casting mode) with the same arithmetic, instruction by instruction, written
in 0.6 idioms: every ``nisa`` instruction writes a ``dst`` given first (its dtype is the
output dtype), DMA is ``nisa.dma_copy``, tiles are ``nl.ndarray(..., buffer=nl.sbuf /
nl.psum)`` and ragged tiles are slices, not masks (nki/migration/index.rst, 0.1→0.2).

Two steps differ from the legacy ones because 0.6 has no equivalent instruction:

* a row broadcast across partitions (legacy ``broadcast_to``, one Vector
  ``partition_broadcast``) is a ones-row matmul into PSUM per 512-column bank and a copy out
  (exact: every product is 1·w), done once per kernel;
* the Tensor-engine accumulation of several matmuls into one PSUM tile says so with
  ``accumulate=True`` (0.3; the legacy ``+=``).
"""

from __future__ import annotations

from nki_rmsnorm.kernels.nki06._nki import nisa, nl
from nki_rmsnorm.plan.forward import (
    FP32_MAX,
    FP32_TINY,
    NEWTON_STEPS,
    PSUM_COLS,
    RSQRT_MIN_INPUT,
    RSQRT_POSTSCALE,
    RSQRT_PRESCALE,
    RSQRT_ROOT_SCALE,
    RSQRT_SPLIT,
    group_width,
)
from nki_rmsnorm.plan.kernel_assert import kernel_assert


def sbuf(shape, dtype):
    """A new SBUF tile."""
    return nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf)


def core_tiles(total, P):
    """(start, count) of this core's tiles of ``total`` partition rows (rows, row groups or
    row segments), ``P`` a tile: under LNC=2 (``nl.num_programs(0)``) each core takes a
    contiguous block of the full tiles (``nl.program_id(0)``), the last core the ragged one."""
    full = total // P
    cores = nl.num_programs(0)
    core = nl.program_id(0)
    per_core = -(-full // cores)
    tiles = []
    for t in range(core * per_core, min(full, (core + 1) * per_core)):
        tiles.append((t * P, P))
    if total % P and core == cores - 1:
        tiles.append((full * P, total % P))
    return tiles


def load_h(h_tile, x_tile, x_src, residual_src, h_dst):
    """h = x (+ residual) into ``h_tile``: the x load, or the residual load into ``h_tile``
    and the x load into ``x_tile``, added by the Vector engine (fp32 add, one rounding to
    h's dtype) and stored to ``h_dst`` unless it is None (the two-pass regime's second
    pass, which stored h already)."""
    if residual_src is None:
        nisa.dma_copy(dst=h_tile, src=x_src)
        return
    nisa.dma_copy(dst=h_tile, src=residual_src)
    nisa.dma_copy(dst=x_tile, src=x_src)
    nisa.tensor_tensor(dst=h_tile, data1=x_tile, data2=h_tile, op=nl.add)
    if h_dst is not None:
        nisa.dma_copy(dst=h_dst, src=h_tile)


def store_y(plan, y_dst, y_tile):
    """Store y, converted to the output dtype first when the last step rounded to another
    (Vector copy, "none" mode with an ``out_dtype``)."""
    if plan.result_dtype != plan.out_dtype:
        converted = sbuf(y_tile.shape, plan.out_dtype)
        nisa.tensor_copy(dst=converted, src=y_tile)
        y_tile = converted
    nisa.dma_copy(dst=y_dst, src=y_tile)


def store_rows_y(plan, views, first, count, y_tile):
    """Store y of a tile holding rows ``first`` … ``first + count`` of ``views`` (each whole
    rows of y, or whole rows' segments, in row-major order). With ``views.y_transposed``
    (P, M, K = N / P), rmsnorm_tkg's layout: ``y_t[p, m, k] = y[m, p·K + k]``
    (nki-library@d2ad3a5 src/nkilib_src/nkilib/core/subkernels/rmsnorm_tkg.py L58-L86, one
    core's H), the same tile goes out through one DMA whose HBM access pattern walks rows,
    partitions and K-element runs: the DMA pairs elements in order and needs only equal
    counts (nki/api/nki/isa/__init__.py@81ce03ae L289), so y is written once, not
    stored and transposed afterwards."""
    if views.y_transposed is None:
        store_y(plan, views.y[first : first + count, :], y_tile)
        return
    P, M, K = views.y_transposed.shape
    N = P * K
    width = y_tile.shape[1]
    kernel_assert(
        (first * width) % N == 0 and (count * width) % N == 0,
        f"a transposed y is stored by whole rows; this tile holds {count} x {width} elements",
    )
    row0 = first * width // N
    rows = count * width // N
    dst = views.y_transposed.ap(pattern=[[K, rows], [M * K, P], [1, K]], offset=row0 * K)
    store_y(plan, dst, y_tile)


def store_columns_y(plan, hbm, row0, row1, c0, c1, y_chunk):
    """Store y of rows ``row0 … row1`` and columns ``c0 … c1`` ("long", "two_pass" chunks);
    with ``hbm.y_transposed`` (:func:`store_rows_y`'s layout) the chunk's columns split at
    the K-element runs: a partial run at each end (one DMA each) and the whole runs between
    (one DMA)."""
    y_t = hbm.y_transposed
    if y_t is None:
        store_y(plan, hbm.y[row0:row1, c0:c1], y_chunk)
        return
    P, M, K = y_t.shape
    rows = row1 - row0
    first_whole = min(c1, (c0 + K - 1) // K * K)
    last_whole = max(first_whole, c1 // K * K)
    pieces = [(c0, first_whole), (first_whole, last_whole), (last_whole, c1)]
    for a, b in pieces:
        if b > a:
            if a % K == 0 and b % K == 0:
                pattern = [[K, rows], [M * K, (b - a) // K], [1, K]]
            else:  # within one run
                pattern = [[K, rows], [1, b - a]]
            offset = (a // K) * M * K + row0 * K + a % K
            store_y(plan, y_t.ap(pattern=pattern, offset=offset), y_chunk[:, a - c0 : b - c0])


def identity(parts, dtype):
    """A (parts, parts) identity for Tensor-engine transposes, built on chip (GpSimd iota of
    f − p, Vector compare with 0) rather than read from HBM."""
    offsets = sbuf((parts, parts), nl.int32)
    nisa.iota(offsets, pattern=[[1, parts]], offset=0, channel_multiplier=-1)
    ident = sbuf((parts, parts), dtype)
    # an arithmetic operand is float32 (nki/api/nki/isa/__init__.py@81ce03ae L1114)
    nisa.tensor_scalar(dst=ident, data=offsets, op0=nl.equal, operand0=0.0)
    return ident


def rstd_from_sum(sum_sq, eps, n, on_scalar=True):
    """rstd = 1 / sqrt(Σh² / n + eps), fp32, for a (parts, k) tile of row sums: the legacy
    chain (Scalar rsqrt refined by ``NEWTON_STEPS`` Newton steps, on the Scalar engine unless
    it carries the product or eps < 2⁻⁵⁵). An infinite Σh² gives rstd = 0 exactly (y is NaN
    at the infinite elements, 0 elsewhere, as the float64 reference and torch), a zero
    mean square with eps = 0 gives +inf, NaN stays NaN, and every finite v > 0 reaches rsqrt
    through exact power-of-two scalings (no clamping)."""
    if on_scalar and eps >= RSQRT_MIN_INPUT / RSQRT_PRESCALE:
        return _rstd_on_scalar(sum_sq, eps, n)
    return _rstd_on_vector(sum_sq, eps, n)


def rstd_on_gpsimd(sum_sq, eps, n, mean_on_scalar=True):
    """rstd = 1 / sqrt(Σh² / n + eps), fp32, for a (parts, k) tile of row sums, in two
    instructions for all k rows: v = Σh²·(1/n) + eps on the Scalar engine (``activation``
    copy with a per-partition bias), then the GpSimd engine's ``tensor_scalar`` rsqrt, which
    "performs reverse square root at a higher precision compared to Scalar Engine"
    (aws-neuron-sdk@8a38e733 general/nki/api/nki.api.shared.rst L444-448; the GpSimd engine
    runs ``tensor_scalar`` only for rsqrt, nki/api/nki/isa/__init__.py@81ce03ae L1157). No
    Newton refinement and no range scaling: the Scalar engine's Valid Input Range
    (nki.api.shared.rst L180) is not GpSimd's, and IEEE rsqrt already gives rstd = +inf for
    v = 0 (eps = 0, an all-zero row), 0 for v = +inf and NaN for NaN, as the float64
    reference. Neither the Vector engine (the product) nor the Scalar engine's Σh² stream
    waits behind a per-row chain. ``mean_on_scalar=False``: v on the Vector engine
    (``tensor_scalar``), for a chain whose other steps run there, so that no step waits
    behind a whole-tile Σh² on ACT."""
    parts, k = sum_sq.shape
    if mean_on_scalar:
        v = _activation((parts, k), nl.copy, sum_sq, scale=1.0 / n, bias=_column(parts, eps))
    else:
        v = sbuf((parts, k), nl.float32)
        nisa.tensor_scalar(
            dst=v, data=sum_sq, op0=nl.multiply, operand0=1.0 / n, op1=nl.add, operand1=float(eps)
        )
    rstd = sbuf((parts, k), nl.float32)
    nisa.tensor_scalar(dst=rstd, data=v, op0=nl.rsqrt, operand0=0.0, engine=nisa.gpsimd_engine)
    return rstd


def _activation(shape, op, data, scale=1.0, bias=None):
    out = sbuf(shape, nl.float32)
    nisa.activation(dst=out, op=op, data=data, scale=scale, bias=bias)
    return out


def _rstd_on_scalar(sum_sq, eps, n):
    """rstd on the Scalar engine alone: rsqrt of u = v·2⁻³² (exact scaling into rsqrt's valid
    range), Newton on u, rstd = r·2⁻¹⁶.

    An infinite Σh² (u = +inf, outside rsqrt's range) is taken out without leaving the
    engine: s = sign(FP32_MAX − u) is +1 for every finite u and −1 for +inf (Sign and Relu
    are valid on [−inf, inf] and exact: nki/api/nki.api.shared.rst@81ce03ae, lines 160 and
    202); relu(u·s) is u itself or 0, plus (1 − s)/2 it reaches rsqrt as u or 1, and the
    final scale (1 + s)/2·2⁻¹⁶ makes that row's rstd exactly 0. NaN stays NaN."""
    parts, k = sum_sq.shape
    u = _activation(
        (parts, k),
        nl.copy,
        sum_sq,
        scale=RSQRT_PRESCALE / n,
        bias=_column(parts, eps * RSQRT_PRESCALE),
    )
    sign = _activation((parts, k), nl.sign, u, scale=-1.0, bias=_column(parts, FP32_MAX))
    shift = _activation((parts, k), nl.copy, sign, scale=-0.5, bias=_column(parts, 0.5))
    post_scale = _activation(
        (parts, k),
        nl.copy,
        sign,
        scale=0.5 * RSQRT_POSTSCALE,
        bias=_column(parts, 0.5 * RSQRT_POSTSCALE),
    )
    finite_u = sbuf((parts, k), nl.float32)
    for j in range(k):  # ACT's scale and bias operands are (parts, 1) columns
        kept = _activation((parts, 1), nl.relu, u[:, j : j + 1], scale=sign[:, j : j + 1])
        nisa.activation(dst=finite_u[:, j : j + 1], op=nl.copy, data=kept, bias=shift[:, j : j + 1])
    r = _activation((parts, k), nl.rsqrt, finite_u)
    minus_half_u = _activation((parts, k), nl.copy, finite_u, scale=-0.5)
    three_halves = _column(parts, 1.5)
    for _ in range(NEWTON_STEPS):
        for j in range(k):
            r_j = r[:, j : j + 1]
            square = _activation((parts, 1), nl.copy, r_j, scale=r_j)
            factor = _activation(
                (parts, 1), nl.copy, square, scale=minus_half_u[:, j : j + 1], bias=three_halves
            )
            nisa.activation(dst=r_j, op=nl.copy, data=factor, scale=r_j)
    rstd = sbuf((parts, k), nl.float32)
    for j in range(k):
        nisa.activation(
            dst=rstd[:, j : j + 1], op=nl.copy, data=r[:, j : j + 1], scale=post_scale[:, j : j + 1]
        )
    return rstd


def _column(parts, value):
    """A (parts, 1) fp32 column of ``value`` (GpSimd memset), an ``activation`` bias."""
    column = sbuf((parts, 1), nl.float32)
    nisa.memset(dst=column, value=float(value), engine=nisa.gpsimd_engine)
    return column


def _rstd_on_vector(sum_sq, eps, n):
    """rstd with the mean square v = Σh²/n + eps formed on the Vector engine and brought into
    rsqrt's valid range [2⁻⁸⁷, 2⁹⁷] (nki/api/nki.api.shared.rst@81ce03ae, line 198) by exact
    power-of-two scalings, the Scalar engine's rsqrt, the Newton steps on the Vector engine,
    and rstd times 0 where v = +inf (NaN stays NaN). With eps ≥ 2⁻⁵⁵ every v is in
    [2⁻⁵⁵, 2¹²⁸]: u = min(v, FP32_MAX)·2⁻³², rstd = r·2⁻¹⁶. Below, every finite v > 0 is
    scaled per row (:func:`_scaled_per_row`). Vector-engine operators only (Min, Max,
    Is Less than, Is Less than or Equal, Multiply, Add: lines 92-112)."""
    shape = sum_sq.shape
    v = sbuf(shape, nl.float32)
    nisa.tensor_scalar(
        dst=v,
        data=sum_sq,
        op0=nl.multiply,
        operand0=1.0 / n,
        op1=nl.add,
        operand1=float(eps),
    )
    # one helper per range of eps, as the legacy kernel must (a tile made under an ``if``
    # may not be used after the block there)
    rstd = (
        _rstd_prescaled(v) if eps >= RSQRT_MIN_INPUT / RSQRT_PRESCALE else _rstd_scaled_per_row(v)
    )
    return _infinite_where_zero(rstd, v) if eps == 0.0 else rstd


def _rstd_prescaled(v):
    """rstd of every v in [2⁻⁵⁵, +inf]: u = min(v, FP32_MAX)·2⁻³², rstd = r·2⁻¹⁶ times
    (v ≤ FP32_MAX), 0 for an infinite v."""
    u = sbuf(v.shape, nl.float32)
    nisa.tensor_scalar(
        dst=u,
        data=v,
        op0=nl.minimum,
        operand0=FP32_MAX,
        op1=nl.multiply,
        operand1=RSQRT_PRESCALE,
    )
    rstd = _refined_rsqrt(u)
    post_scale = sbuf(v.shape, nl.float32)
    nisa.tensor_scalar(
        dst=post_scale,
        data=v,
        op0=nl.less_equal,
        operand0=FP32_MAX,
        op1=nl.multiply,
        operand1=RSQRT_POSTSCALE,
    )
    nisa.tensor_tensor(dst=rstd, data1=rstd, data2=post_scale, op=nl.multiply)
    return rstd


def _rstd_scaled_per_row(v):
    """rstd of every v in [0, +inf] through the per-row power of two of
    :func:`_scaled_per_row`, times (v ≤ FP32_MAX): 0 for an infinite v."""
    u, root_scale = _scaled_per_row(v)
    rstd = _refined_rsqrt(u)
    post_scale = sbuf(v.shape, nl.float32)
    nisa.scalar_tensor_tensor(
        dst=post_scale,
        data=v,
        op0=nl.less_equal,
        operand0=FP32_MAX,
        op1=nl.multiply,
        operand1=root_scale,
    )
    nisa.tensor_tensor(dst=rstd, data1=rstd, data2=post_scale, op=nl.multiply)
    return rstd


def _refined_rsqrt(u):
    """The Scalar engine's rsqrt of u (in its valid range) refined by ``NEWTON_STEPS``
    Newton steps on the Vector engine."""
    rstd = _activation(u.shape, nl.rsqrt, u)
    for _ in range(NEWTON_STEPS):
        newton_rsqrt_step(rstd, u)
    return rstd


def _scaled_per_row(v):
    """``(u, p)``: u = v·p² in rsqrt's valid range for every v in [0, +inf], p = 2³² where
    v < 2⁻²⁰ else 2⁻³² (``RSQRT_SPLIT``), so that rsqrt(u)·p = rsqrt(v). v is first kept in
    [2⁻¹⁴⁹, FP32_MAX] (a zero row's rstd becomes +inf later, an infinite one's 0). The
    selector q = (v < 2⁻²⁰) + 2⁻³² is 1 or 2⁻³² exactly (1 + 2⁻³² rounds to 1), so p = q·2³²·q
    and p² are exact powers of two."""
    shape = v.shape
    finite_v = sbuf(shape, nl.float32)
    nisa.tensor_scalar(
        dst=finite_v,
        data=v,
        op0=nl.minimum,
        operand0=FP32_MAX,
        op1=nl.maximum,
        operand1=FP32_TINY,
    )
    selector = sbuf(shape, nl.float32)
    nisa.tensor_scalar(
        dst=selector,
        data=finite_v,
        op0=nl.less,
        operand0=RSQRT_SPLIT,
        op1=nl.add,
        operand1=1.0 / RSQRT_ROOT_SCALE,
    )
    root_scale = sbuf(shape, nl.float32)
    nisa.scalar_tensor_tensor(
        dst=root_scale,
        data=selector,
        op0=nl.multiply,
        operand0=RSQRT_ROOT_SCALE,
        op1=nl.multiply,
        operand1=selector,
    )
    scale = sbuf(shape, nl.float32)
    nisa.tensor_tensor(dst=scale, data1=root_scale, data2=root_scale, op=nl.multiply)
    u = sbuf(shape, nl.float32)
    nisa.tensor_tensor(dst=u, data1=finite_v, data2=scale, op=nl.multiply)
    return u, root_scale


def newton_rsqrt_step(rstd, v):
    """One Newton step towards 1/sqrt(v), in place: r·(1.5 − 0.5·v·r²)."""
    square = sbuf(rstd.shape, nl.float32)
    nisa.tensor_tensor(dst=square, data1=rstd, data2=rstd, op=nl.multiply)
    half_error = sbuf(rstd.shape, nl.float32)
    nisa.scalar_tensor_tensor(
        dst=half_error,
        data=square,
        op0=nl.multiply,
        operand0=-0.5,
        op1=nl.multiply,
        operand1=v,
    )
    nisa.scalar_tensor_tensor(
        dst=rstd, data=half_error, op0=nl.add, operand0=1.5, op1=nl.multiply, operand1=rstd
    )


def _infinite_where_zero(rstd, v):
    """rstd + (v == 0 ? 2·FP32_MAX : 0): +inf where the mean square is zero."""
    huge = sbuf(v.shape, nl.float32)
    nisa.tensor_scalar(
        dst=huge,
        data=v,
        op0=nl.equal,
        operand0=0.0,
        op1=nl.multiply,
        operand1=FP32_MAX,
    )
    infinite = sbuf(v.shape, nl.float32)
    nisa.scalar_tensor_tensor(
        dst=infinite,
        data=huge,
        op0=nl.multiply,
        operand0=2.0,
        op1=nl.add,
        operand1=rstd,
    )
    return infinite


def weight_rows(plan, row_hbm, offset=0.0):
    """The weight row ``row_hbm`` (1, F) as the Tensor engine's moving operand:
    ``plan.rstd_pieces`` copies of its finite part (weight + offset in the scale dtype, ±Inf
    and NaN zeroed), then its non-finite part (zero where finite), against the rstd pieces
    and the high piece again (:func:`rstd_rows`): a zero piece or a masked zero times an
    infinite weight would be NaN (0·Inf), a positive high piece times the non-finite part
    is what IEEE gives for rstd·w (the "long" regime's: :func:`weight_rows_in_hbm`)."""
    pieces = plan.rstd_pieces
    rows = sbuf((pieces + 1, row_hbm.shape[1]), plan.scale_dtype)
    parts = finite_parts(row_hbm, plan.scale_dtype, offset)
    copy_parts(rows[0:1, :], parts, 0)
    copy_parts(rows[pieces : pieces + 1, :], parts, 1)
    for piece in range(1, pieces):
        nisa.dma_copy(dst=rows[piece : piece + 1, :], src=rows[0:1, :])
    return rows


def finite_parts(weight_hbm, dtype, offset=0.0):
    """weight + offset in ``dtype`` as its finite part (±Inf and NaN zeroed) and its
    non-finite part (zero where finite), in SBUF tiles short enough for the Vector engine:
    the first p·q elements as (p, q) tiles, p = min(128, size), q = size // p, and the
    remaining size − p·q < p elements as (1, r) tiles (an odd hidden size has no partition
    split that divides it: as one (1, size) row, each of the split's Vector instructions
    cost a cycle per element, 29 × 17389 bf16 on trn2 64.8 -> 121.3 µs). Returns the pieces
    as (first column, finite, non-finite), which :func:`copy_parts` moves into the callers'
    row layouts by DMA. Each piece is loaded by a DMA from the columns of the weight as one
    row (a DMA moves elements in order, so any two shapes of one size), then converted.
    Vector engine: v·0 == 0 holds exactly where v is finite; a predicated copy selects;
    −(finite part − v) leaves the rest."""
    size = 1
    for extent in weight_hbm.shape:
        size = size * extent
    row = weight_hbm.reshape((1, size))
    p = min(nl.tile_size.pmax, size)
    q = size // p
    pieces = []
    for start, rows, columns in ((0, p, q), (p * q, 1, size - p * q)):
        if columns:
            staged = _load_as(row[:, start : start + rows * columns], (rows, columns))
            values = convert_row(staged, dtype, offset)
            finite = sbuf(values.shape, dtype)
            nonfinite = sbuf(values.shape, dtype)
            split_finite(values, finite, nonfinite)
            pieces.append((start, finite, nonfinite))
    return pieces


def copy_parts(dst_row, pieces, which):
    """DMA the finite (``which`` 0) or non-finite (1) parts of :func:`finite_parts` into
    the (1, size) row ``dst_row``."""
    for piece in pieces:
        start = piece[0]
        tile = piece[1 + which]
        count = tile.shape[0] * tile.shape[1]
        nisa.dma_copy(dst=dst_row[:, start : start + count], src=tile)


def weight_rows_in_hbm(plan, weight_hbm, offset=0.0):
    """:func:`weight_rows`' (pieces + 1, N) layout in private HBM, for the "long" regime,
    whose rows leave no room on chip for it: the weight split once per kernel
    (:func:`finite_parts`, 128 partitions and a tail), each column chunk then one DMA.
    ``nl.private_hbm`` (aws-neuron-sdk@81ce03ae nki/api/nki.language.rst L270) for a
    kernel's scratch, as AWS's kernels use it
    (nki-library@d2ad3a5 src/nkilib_src/nkilib/core/subkernels/indexed_flatten.py L123)."""
    pieces = plan.rstd_pieces
    size = 1
    for extent in weight_hbm.shape:
        size = size * extent
    rows = nl.ndarray((pieces + 1, size), dtype=plan.scale_dtype, buffer=nl.private_hbm)
    parts = finite_parts(weight_hbm, plan.scale_dtype, offset)
    for piece in range(pieces):
        copy_parts(rows[piece : piece + 1, :], parts, 0)
    copy_parts(rows[pieces : pieces + 1, :], parts, 1)
    return rows


def _load_as(src, shape):
    tile = sbuf(shape, src.dtype)
    nisa.dma_copy(dst=tile, src=src)
    return tile


def split_finite(values, finite, nonfinite):
    """Write the finite part of ``values`` (an SBUF tile; ±Inf and NaN zeroed, −0 made +0 as
    :func:`signed_zeros_positive` does) into ``finite`` and its non-finite part (−0 where
    finite, so that adding its products changes no sum) into ``nonfinite``, tiles of its
    shape and dtype (see :func:`finite_parts`)."""
    is_finite = sbuf(values.shape, nl.uint8)
    nisa.tensor_scalar(
        dst=is_finite, data=values, op0=nl.multiply, operand0=0.0, op1=nl.equal, operand1=0.0
    )
    nisa.memset(dst=finite, value=0.0)
    nisa.tensor_copy_predicated(dst=finite, src=values, predicate=is_finite)
    signed_zeros_positive(finite)
    nisa.tensor_tensor(dst=nonfinite, data1=finite, data2=values, op=nl.subtract)
    nisa.tensor_scalar(dst=nonfinite, data=nonfinite, op0=nl.multiply, operand0=-1.0)


def signed_zeros_positive(weights):
    """−0 made +0 in place (v + 0; Vector engine): the Tensor engine's rstd ⊗ w sums
    products of rstd pieces of either sign and its ones-row broadcast starts from +0, so a
    −0 weight (or bias) is +0 in the "rows" regime; the "split" regime's per-row weights
    must be the same to stay bitwise equal."""
    nisa.tensor_scalar(dst=weights, data=weights, op0=nl.add, operand0=0.0)


def scale_row(plan, row_hbm, offset=0.0):
    """Load a (1, F) HBM row, add ``offset`` and convert to the plan's scale dtype."""
    return convert_row(_load(row_hbm), plan.scale_dtype, offset)


def _load(src):
    tile = sbuf(src.shape, src.dtype)
    nisa.dma_copy(dst=tile, src=src)
    return tile


def load_converted(dst, src, offset=0.0):
    """``dst = src + offset`` in dst's dtype: the DMA straight into ``dst`` when there is
    nothing to convert, else a load and one Vector instruction (:func:`convert_row`) writing
    ``dst``."""
    if not offset and src.dtype == dst.dtype:
        nisa.dma_copy(dst=dst, src=src)
    elif offset:
        nisa.tensor_scalar(dst=dst, data=_load(src), op0=nl.add, operand0=offset)
    else:
        nisa.tensor_copy(dst=dst, src=_load(src))


def convert_row(row, dtype, offset=0.0):
    """``row + offset`` in ``dtype`` (Vector engine; nothing when there is nothing to do)."""
    if offset:
        out = sbuf(row.shape, dtype)
        nisa.tensor_scalar(dst=out, data=row, op0=nl.add, operand0=offset)
        return out
    if row.dtype != dtype:
        out = sbuf(row.shape, dtype)
        nisa.tensor_copy(dst=out, src=row)
        return out
    return row


def broadcast_row(row_hbm, partitions, dtype, offset=0.0):
    """Load a (1, F) HBM row, add ``offset``, convert to ``dtype`` and broadcast it to
    ``partitions`` partitions: per PSUM bank, a ones row (1, partitions) against it on the
    Tensor engine (exact) and a Vector copy out of PSUM."""
    row = convert_row(_load(row_hbm), dtype, offset)
    if partitions == 1:
        return row
    width = row.shape[1]
    ones = sbuf((1, partitions), row.dtype)
    nisa.memset(dst=ones, value=1.0)
    out = sbuf((partitions, width), dtype)
    for c0 in range(0, width, PSUM_COLS):
        c1 = min(width, c0 + PSUM_COLS)
        bank = nl.ndarray((partitions, c1 - c0), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=bank, stationary=ones, moving=row[:, c0:c1], accumulate=False)
        nisa.tensor_copy(dst=out[:, c0:c1], src=bank)
    return out


def split_rstd(plan, rstd, batched=False, spare=0):
    """rstd (parts, k) fp32 as the Tensor engine's operand dtype: for three pieces,
    (parts, w·k) bf16 with row j's hi, mid, lo in columns w·j … w·j + 2, w = 3 + ``spare``
    (columns left for the caller), as in the legacy kernel (whose docstring gives the
    arithmetic): per row on the Scalar engine, or with ``batched`` for all k rows at once,
    the two roundings to bf16 on the GpSimd engine and the two subtractions on the Vector
    engine; for one piece, rstd, or with ``spare`` rstd in columns w·j (GpSimd copy),
    w = 1 + ``spare``."""
    pieces = plan.rstd_pieces
    if pieces != 3 and not spare:
        return rstd
    parts, k = rstd.shape
    width = pieces + spare
    split = sbuf((parts, width * k), plan.scale_dtype)
    if pieces != 3:
        nisa.tensor_copy(dst=split[:, 0 : width * k : width], src=rstd, engine=nisa.gpsimd_engine)
        return split
    if batched:
        # all k rows per instruction (strided destinations: piece p of row j is column
        # w·j + p): the roundings on GpSimd, the exact subtractions on DVE
        end = width * k
        hi = split[:, 0:end:width]
        mid = split[:, 1:end:width]
        nisa.tensor_copy(dst=hi, src=rstd, engine=nisa.engine.gpsimd)
        rest = sbuf((parts, k), nl.float32)
        nisa.tensor_tensor(dst=rest, data1=rstd, data2=hi, op=nl.subtract)
        nisa.tensor_copy(dst=mid, src=rest, engine=nisa.engine.gpsimd)
        nisa.tensor_tensor(dst=split[:, 2:end:width], data1=rest, data2=mid, op=nl.subtract)
        return split
    for j in range(k):
        r_j = rstd[:, j : j + 1]
        hi = split[:, width * j : width * j + 1]
        mid = split[:, width * j + 1 : width * j + 2]
        nisa.activation(dst=hi, op=nl.copy, data=r_j)
        rest = _activation((parts, 1), nl.copy, hi, scale=-1.0, bias=r_j)
        nisa.activation(dst=mid, op=nl.copy, data=rest)
        nisa.activation(
            dst=split[:, width * j + 2 : width * j + 3],
            op=nl.copy,
            data=mid,
            scale=-1.0,
            bias=rest,
        )
    return split


def rstd_rows(plan, rstd, ident, batched=False):
    """rstd (parts, k) fp32 as Tensor-engine stationary operands, (pieces + 1, k, parts):
    the ``plan.rstd_pieces`` pieces of row j's rstd for partition p in column p of block j,
    then the high piece again (a K = pieces + 1 matmul against :func:`weight_rows`' finite
    copies and its non-finite part). Pieces from :func:`split_rstd` (``batched``: all k
    rows per instruction), transposes on the Tensor engine (exact), the PSUM → SBUF copy
    on the Vector engine."""
    parts, k = rstd.shape
    pieces = plan.rstd_pieces
    dtype = plan.scale_dtype
    stacked_pieces = split_rstd(plan, rstd, batched, spare=1)
    blocks = stacked_pieces.reshape((parts, k, pieces + 1))
    nisa.tensor_copy(
        dst=blocks[:, :, pieces : pieces + 1], src=blocks[:, :, 0:1], engine=nisa.gpsimd_engine
    )
    transposed = nl.ndarray((pieces + 1, k, parts), dtype=dtype, buffer=nl.psum)
    for j in range(k):
        nisa.nc_matmul(
            dst=transposed[:, j, :],
            stationary=stacked_pieces[:, (pieces + 1) * j : (pieces + 1) * (j + 1)],
            moving=ident,
            is_transpose=True,
        )
    stationary = sbuf(transposed.shape, dtype)
    nisa.tensor_copy(dst=stationary, src=transposed)
    return stationary


def outer_normalize(y_row, h_row, stationaries, moving, shift, product_row):
    """y = h · (rstd ⊗ w) [+ bias] for one row of the tile: per PSUM bank, the Tensor engine
    writes rstd ⊗ w (the sum over ``stationaries`` (K, parts) against the ``moving`` (K, F)
    weight rows, accumulated in PSUM) and the Vector engine multiplies h by it; the bias is
    added in fp32 after."""
    target = y_row if shift is None else product_row
    parts, width = h_row.shape
    for c0 in range(0, width, PSUM_COLS):
        c1 = min(width, c0 + PSUM_COLS)
        outer = nl.ndarray((parts, c1 - c0), dtype=nl.float32, buffer=nl.psum)
        for i in range(len(stationaries)):
            nisa.nc_matmul(
                dst=outer, stationary=stationaries[i], moving=moving[:, c0:c1], accumulate=i > 0
            )
        nisa.tensor_tensor(dst=target[:, c0:c1], data1=h_row[:, c0:c1], data2=outer, op=nl.multiply)
    add_shift(y_row, product_row, shift)


def scaled_normalize(plan, y_row, h_row, rstd_col, ones, weight_row, shift, product_row):
    """y = (h · rstd) · w [+ bias] for one row of the tile: per PSUM bank, the Scalar engine
    scales h by rstd (fp32, or x̂ rounded to x's dtype in llama / none), the Tensor engine
    broadcasts the weight row into PSUM and the Vector engine multiplies the two."""
    target = y_row if shift is None else product_row
    scaled_dtype = plan.in_dtype if plan.rounds_xhat else nl.float32
    parts, width = h_row.shape
    for c0 in range(0, width, PSUM_COLS):
        c1 = min(width, c0 + PSUM_COLS)
        weight = nl.ndarray((parts, c1 - c0), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=weight, stationary=ones, moving=weight_row[:, c0:c1], accumulate=False)
        scaled = sbuf((parts, c1 - c0), scaled_dtype)
        nisa.activation(dst=scaled, op=nl.copy, data=h_row[:, c0:c1], scale=rstd_col)
        nisa.tensor_tensor(dst=target[:, c0:c1], data1=scaled, data2=weight, op=nl.multiply)
    add_shift(y_row, product_row, shift)


def add_shift(y_row, product_row, shift):
    """y = product + bias, fp32, one rounding (Vector engine); nothing without a bias."""
    if shift is not None:
        nisa.tensor_tensor(dst=y_row, data1=product_row, data2=shift, op=nl.add)


def normalize(plan, y_tile, h_tile, rstd_col, xhat_tile, scale, shift, product):
    """Write ``h · rstd · scale + shift`` into ``y_tile`` (Vector engine), rounding as the
    casting mode says: llama / none round x̂ = h·rstd to x's dtype first, in ``xhat_tile``."""
    if plan.rounds_xhat:
        nisa.tensor_scalar(dst=xhat_tile, data=h_tile, op0=nl.multiply, operand0=rstd_col)
        data, row_scale = xhat_tile, None
    else:
        data, row_scale = h_tile, rstd_col

    if scale is not None and shift is not None:
        _multiply(product, data, row_scale, scale)
        nisa.tensor_tensor(dst=y_tile, data1=product, data2=shift, op=nl.add)
    elif scale is not None:
        _multiply(y_tile, data, row_scale, scale)
    elif shift is not None and row_scale is not None:
        nisa.scalar_tensor_tensor(
            dst=y_tile,
            data=data,
            op0=nl.multiply,
            operand0=row_scale,
            op1=nl.add,
            operand1=shift,
        )
    elif shift is not None:
        nisa.tensor_tensor(dst=y_tile, data1=data, data2=shift, op=nl.add)
    elif row_scale is not None:
        nisa.tensor_scalar(dst=y_tile, data=data, op0=nl.multiply, operand0=row_scale)
    else:
        nisa.tensor_copy(dst=y_tile, src=data)


def _multiply(dst, data, row_scale, scale):
    """``dst = data · row_scale · scale``: one ``scalar_tensor_tensor``, or a
    ``tensor_tensor`` when there is no per-row factor."""
    if row_scale is None:
        nisa.tensor_tensor(dst=dst, data1=data, data2=scale, op=nl.multiply)
    else:
        nisa.scalar_tensor_tensor(
            dst=dst,
            data=data,
            op0=nl.multiply,
            operand0=row_scale,
            op1=nl.multiply,
            operand1=scale,
        )


def grouped_sum(squares, h, groups, sum_sq):
    """Σh² of each partition's row ``h`` (parts, n) into ``sum_sq`` (parts, 1), grouped
    (``nki_rmsnorm.plan.forward.GROUP_MIN_COLUMNS``): ACT Σ of each of the ``groups``
    column groups (the squares go to ``squares``, discarded), DVE their sum in group order:
    the instructions the "split" regime runs on a row's segments. Odd n: the last group is
    narrower (``group_width``) and is summed, as the "split" regime sums it, over its
    columns copied (GpSimd) into ``width`` zero-padded columns: the first ones of the
    squares tile where it holds h exactly (``squares_hold_h``; that group then goes first,
    before the others' squares overwrite them), else a tile of its own."""
    parts, n = h.shape
    width = group_width(n, groups)
    last = n - (groups - 1) * width
    sums = sbuf((parts, groups), nl.float32)
    full = groups
    if last < width:
        full = groups - 1
        if squares.dtype == h.dtype or squares.dtype == nl.float32:
            padded = squares[:, 0:width]
            dst = padded
        else:
            padded = sbuf((parts, width), h.dtype)
            # the squares are discarded; bf16 holds any square's exponent
            dst = sbuf((parts, width), nl.bfloat16)
        nisa.memset(dst=padded[:, last:width], value=0.0, engine=nisa.engine.gpsimd)
        nisa.tensor_copy(
            dst=padded[:, 0:last], src=h[:, full * width : n], engine=nisa.engine.gpsimd
        )
        nisa.activation_reduce(
            dst=dst, op=nl.square, data=padded, reduce_op=nl.add, reduce_res=sums[:, full:groups]
        )
    for g in range(full):
        columns = slice(g * width, (g + 1) * width)
        nisa.activation_reduce(
            dst=squares[:, columns],
            op=nl.square,
            data=h[:, columns],
            reduce_op=nl.add,
            reduce_res=sums[:, g : g + 1],
        )
    nisa.tensor_reduce(dst=sum_sq, op=nl.add, data=sums, axis=1)
