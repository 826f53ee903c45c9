"""On-chip steps the forward regimes share: loading h, rstd from Σh², the weight as the
Tensor engine's moving rows, rstd as its stationary rows, and the three ways of forming
``y = h · rstd · w`` (``Plan.product_engine``):

* "tensor" (:func:`outer_normalize`): the Tensor engine writes rstd[p]·w[j] into an fp32
  PSUM bank (a K = 3 matmul of rstd's bf16 pieces, transposed into a row, against three
  copies of the bf16 weight row: each product exact, the sum fp32, as accurate as fp32
  rstd·w; or K = 1 in fp32 for an fp32 weight) and the Vector engine multiplies h by it,
  one cycle per element with one input in PSUM.
* "scalar" (:func:`scaled_normalize`): the Scalar engine scales h by rstd, the Tensor engine
  broadcasts the weight row into PSUM, the Vector engine multiplies the two.
* "vector" (:func:`normalize`): the Vector engine alone, one ``scalar_tensor_tensor`` or
  x̂ = h·rstd then x̂·w (bf16 fast modes on NeuronCore-v3+).

All three compute in fp32 and round as the casting mode says: gemma once at the end, llama
and none x̂ first.
"""

from __future__ import annotations

from nki_rmsnorm.nki import nisa, nl
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
)


def load_h(h_tile, x_tile, x_src, residual_src, h_dst, mask=None):
    """h = x (+ residual) into ``h_tile``: the x load, or the residual load into ``h_tile``
    and the x load into ``x_tile``, added by the Vector engine (``tensor_tensor``: fp32
    add, one rounding to h's dtype, as reference.py does) and stored to ``h_dst`` unless
    it is None. (A DMA
    read-modify-write would spare the Vector engine, but legacy NKI documents
    ``dma_copy(dst_rmw_op=)`` neither into SBUF nor its arithmetic:
    general/nki/api/nki/isa/__init__.py@8a38e733, lines 405-466.)"""
    if residual_src is None:
        h_tile[...] = nl.load(x_src, mask=mask)
        return
    h_tile[...] = nl.load(residual_src, mask=mask)
    x_tile[...] = nl.load(x_src, mask=mask)
    h_tile[...] = nisa.tensor_tensor(x_tile, h_tile, op=nl.add, dtype=h_tile.dtype, mask=mask)
    if h_dst is not None:  # None: h was stored already (the two-pass regime's second pass)
        nl.store(h_dst, value=h_tile, mask=mask)


def store_y(plan, y_dst, y_tile, mask=None):
    """Store y, converted to the output dtype first when the last step rounded to another
    (Vector copy, "none" mode with an ``out_dtype``)."""
    converted = (
        y_tile
        if plan.result_dtype == plan.out_dtype
        else nisa.tensor_copy(y_tile, dtype=plan.out_dtype, mask=mask)
    )
    nl.store(y_dst, value=converted, mask=mask)


def identity(parts, dtype):
    """A (parts, parts) identity for Tensor-engine transposes, built on chip (GpSimd iota,
    Vector compare) rather than read from HBM."""
    i_p = nl.arange(parts)[:, None]
    i_f = nl.arange(parts)[None, :]
    return nisa.tensor_scalar(nisa.iota(i_f - i_p, nl.int32), op0=nl.equal, operand0=0, dtype=dtype)


def rstd_from_sum(sum_sq, eps, n, mask=None, on_scalar=True):
    """rstd = 1 / sqrt(Σh² / n + eps), fp32, for a (parts, k) tile of row sums.

    The Scalar engine's rsqrt is a piecewise-polynomial approximation, less precise than
    GpSimd's and valid only for inputs in [2⁻⁸⁷, 2⁹⁷] (general/nki/api/nki.api.shared.rst
    @8a38e733, lines 127-130, 180 and 444-448). So its estimate is refined by
    ``NEWTON_STEPS`` Newton steps r ← r·(1.5 − 0.5·v·r²): from a relative error ε ≤ 2⁻⁹
    each step leaves ≈ 1.5·ε², so two steps reach fp32 rounding noise (≈ 2.5 fp32 ulp
    measured) whatever the Scalar engine's accuracy within 2⁻⁹.

    ``on_scalar``: the whole chain on the Scalar engine (:func:`_rstd_on_scalar`), for plans
    whose long per-tile product runs on the Vector engine, so the chain does not wait behind
    it in the Vector engine's in-order stream; else on the Vector engine
    (:func:`_rstd_on_vector`), for the "scalar" plan, whose product keeps ACT busy, and for
    eps < 2⁻⁵⁵, where the Scalar-engine chain's fixed scaling cannot cover every row.

    A row with v = 0 (an all-zero row with eps = 0) gets rstd = +inf, so y = 0·inf = NaN,
    as reference.py says; a row with Σh² = +inf (an infinite h) gets rstd = 0 exactly, so y
    is NaN at the infinite elements and 0 elsewhere (IEEE rsqrt(+inf) = 0, as the float64
    reference and torch give); a NaN row stays NaN. Every finite v > 0 reaches rsqrt
    through exact power-of-two scalings, so no row is clamped.
    """
    if on_scalar and eps >= RSQRT_MIN_INPUT / RSQRT_PRESCALE:
        return _rstd_on_scalar(sum_sq, eps, n, mask)
    return _rstd_on_vector(sum_sq, eps, n, mask)


def rstd_on_gpsimd(sum_sq, eps, n, mean_on_scalar=True):
    """rstd = 1 / sqrt(Σh² / n + eps), fp32, for a (parts, k) tile of row sums, in two
    instructions for all k rows: v = Σh²·(1/n) + eps on the Scalar engine (``activation``
    copy with a per-partition bias), then the GpSimd engine's rsqrt
    (``tensor_scalar(op0=nl.rsqrt, operand0=0.0)``, which "performs reverse square root at a
    higher precision compared to Scalar Engine": general/nki/api/nki.api.shared.rst@8a38e733
    L444-448; GpSimd runs ``tensor_scalar`` only for rsqrt, isa L1699). No Newton refinement
    and no range scaling: the Scalar engine's Valid Input Range (L180) is not GpSimd's, and
    IEEE rsqrt already gives rstd = +inf for v = 0 (eps = 0, an all-zero row), 0 for
    v = +inf and NaN for NaN, as the float64 reference. Neither the Vector engine (the
    product) nor the Scalar engine's Σh² stream waits behind a per-row chain.
    ``mean_on_scalar=False``: v on the Vector engine (``tensor_scalar``), for a chain
    whose other steps run there, so that no step waits behind a whole-tile Σh² on ACT."""
    parts, k = sum_sq.shape
    v = (
        nisa.activation(
            op=nl.copy, data=sum_sq, scale=1.0 / n, bias=_column(parts, eps), dtype=nl.float32
        )
        if mean_on_scalar
        else nisa.tensor_scalar(
            sum_sq,
            op0=nl.multiply,
            operand0=1.0 / n,
            op1=nl.add,
            operand1=float(eps),
            dtype=nl.float32,
        )
    )
    # no ``engine`` argument: SDK 2.21 has none (general/nki/nki_rn.rst L94); rsqrt runs on
    # the GpSimd or Scalar engine only (nki.api.shared.rst L112), and the doc's GpSimd form
    # (L446) is this call without one
    return nisa.tensor_scalar(v, op0=nl.rsqrt, operand0=0.0, dtype=nl.float32)


def _rstd_on_scalar(sum_sq, eps, n, mask=None):
    """rstd on the Scalar engine alone (its ``activation`` computes f(data·scale + bias) in
    fp32, with per-partition scale and bias columns). The rsqrt input is u = v·2⁻³², an
    exact power-of-two scaling that brings every v in [2⁻⁵⁵, 2¹²⁹] — every finite row, as
    the caller guarantees eps ≥ 2⁻⁵⁵ — into the valid range; Newton runs on u, and
    rstd = r·2⁻¹⁶.

    An infinite Σh² (u = +inf, outside rsqrt's range) is taken out without leaving the
    engine: s = sign(FP32_MAX − u) is +1 for every finite u and −1 for +inf (Sign and Relu
    are valid on [−inf, inf] and exact: general/nki/api/nki.api.shared.rst@8a38e733, lines
    146 and 184); relu(u·s) is u itself or 0, plus (1 − s)/2 it reaches rsqrt as u or 1,
    and the final scale (1 + s)/2·2⁻¹⁶ makes that row's rstd exactly 0. NaN stays NaN."""
    parts, k = sum_sq.shape
    u = nisa.activation(
        op=nl.copy,
        data=sum_sq,
        scale=RSQRT_PRESCALE / n,
        bias=_column(parts, eps * RSQRT_PRESCALE),
        dtype=nl.float32,
        mask=mask,
    )
    sign = nisa.activation(
        op=nl.sign, data=u, scale=-1.0, bias=_column(parts, FP32_MAX), dtype=nl.float32, mask=mask
    )
    shift = nisa.activation(
        op=nl.copy, data=sign, scale=-0.5, bias=_column(parts, 0.5), dtype=nl.float32, mask=mask
    )
    post_scale = nisa.activation(
        op=nl.copy,
        data=sign,
        scale=0.5 * RSQRT_POSTSCALE,
        bias=_column(parts, 0.5 * RSQRT_POSTSCALE),
        dtype=nl.float32,
        mask=mask,
    )
    finite_u = nl.ndarray((parts, k), dtype=nl.float32)
    for j in nl.static_range(k):  # ACT's scale and bias operands are (parts, 1) columns
        kept = nisa.activation(
            op=nl.relu, data=u[:, j : j + 1], scale=sign[:, j : j + 1], dtype=nl.float32, mask=mask
        )
        finite_u[:, j : j + 1] = nisa.activation(
            op=nl.copy, data=kept, bias=shift[:, j : j + 1], dtype=nl.float32, mask=mask
        )
    r = nl.ndarray((parts, k), dtype=nl.float32)
    r[...] = nisa.activation(op=nl.rsqrt, data=finite_u, dtype=nl.float32, mask=mask)
    minus_half_u = nisa.activation(
        op=nl.copy, data=finite_u, scale=-0.5, dtype=nl.float32, mask=mask
    )
    three_halves = _column(parts, 1.5)
    for _ in nl.static_range(NEWTON_STEPS):
        for j in nl.static_range(k):
            r_j = r[:, j : j + 1]
            square = nisa.activation(op=nl.copy, data=r_j, scale=r_j, dtype=nl.float32, mask=mask)
            factor = nisa.activation(
                op=nl.copy,
                data=square,
                scale=minus_half_u[:, j : j + 1],
                bias=three_halves,
                dtype=nl.float32,
                mask=mask,
            )
            r_j[...] = nisa.activation(
                op=nl.copy, data=factor, scale=r_j, dtype=nl.float32, mask=mask
            )
    rstd = nl.ndarray((parts, k), dtype=nl.float32)
    for j in nl.static_range(k):
        rstd[:, j : j + 1] = nisa.activation(
            op=nl.copy,
            data=r[:, j : j + 1],
            scale=post_scale[:, j : j + 1],
            dtype=nl.float32,
            mask=mask,
        )
    return rstd


def _column(parts, value):
    """A (parts, 1) fp32 column of ``value`` (GpSimd memset: the engine is otherwise idle),
    an ``activation`` bias."""
    column = nl.ndarray((parts, 1), dtype=nl.float32)
    column[...] = nisa.memset((parts, 1), value, dtype=nl.float32, engine=nisa.gpsimd_engine)
    return column


def _rstd_on_vector(sum_sq, eps, n, mask=None):
    """rstd with the mean square v = Σh²/n + eps formed on the Vector engine and brought into
    rsqrt's valid range [2⁻⁸⁷, 2⁹⁷] (general/nki/api/nki.api.shared.rst@8a38e733, line 180)
    by exact power-of-two scalings, the Scalar engine's rsqrt, the Newton steps on the
    Vector engine, and rstd times 0 where v = +inf (NaN stays NaN). With eps ≥ 2⁻⁵⁵ every v
    is in [2⁻⁵⁵, 2¹²⁸]: u = min(v, FP32_MAX)·2⁻³², rstd = r·2⁻¹⁶. Below, every finite v > 0
    is scaled per row (:func:`_scaled_per_row`). Vector-engine operators only (Min, Max,
    Is Less than, Is Less than or Equal, Multiply, Add: lines 82-102)."""
    v = nisa.tensor_scalar(
        sum_sq,
        op0=nl.multiply,
        operand0=1.0 / n,
        op1=nl.add,
        operand1=float(eps),
        dtype=nl.float32,
        mask=mask,
    )
    # one helper per range of eps: a tile made under an ``if`` may not be used after the
    # block, in helpers too (general/nki/api/nki.errors.rst@8a38e733 L417-474)
    rstd = (
        _rstd_prescaled(v, mask)
        if eps >= RSQRT_MIN_INPUT / RSQRT_PRESCALE
        else _rstd_scaled_per_row(v, mask)
    )
    return _infinite_where_zero(rstd, v, mask) if eps == 0.0 else rstd


def _rstd_prescaled(v, mask=None):
    """rstd of every v in [2⁻⁵⁵, +inf]: u = min(v, FP32_MAX)·2⁻³², rstd = r·2⁻¹⁶ times
    (v ≤ FP32_MAX), 0 for an infinite v."""
    u = nisa.tensor_scalar(
        v,
        op0=nl.minimum,
        operand0=FP32_MAX,
        op1=nl.multiply,
        operand1=RSQRT_PRESCALE,
        dtype=nl.float32,
        mask=mask,
    )
    rstd = _refined_rsqrt(u, mask)
    post_scale = nisa.tensor_scalar(
        v,
        op0=nl.less_equal,
        operand0=FP32_MAX,
        op1=nl.multiply,
        operand1=RSQRT_POSTSCALE,
        dtype=nl.float32,
        mask=mask,
    )
    rstd[...] = nisa.tensor_tensor(rstd, post_scale, op=nl.multiply, dtype=nl.float32, mask=mask)
    return rstd


def _rstd_scaled_per_row(v, mask=None):
    """rstd of every v in [0, +inf] through the per-row power of two of
    :func:`_scaled_per_row`, times (v ≤ FP32_MAX): 0 for an infinite v."""
    u, root_scale = _scaled_per_row(v, mask)
    rstd = _refined_rsqrt(u, mask)
    post_scale = nisa.scalar_tensor_tensor(
        data=v,
        op0=nl.less_equal,
        operand0=FP32_MAX,
        op1=nl.multiply,
        operand1=root_scale,
        dtype=nl.float32,
        mask=mask,
    )
    rstd[...] = nisa.tensor_tensor(rstd, post_scale, op=nl.multiply, dtype=nl.float32, mask=mask)
    return rstd


def _refined_rsqrt(u, mask=None):
    """The Scalar engine's rsqrt of u (in its valid range) refined by ``NEWTON_STEPS``
    Newton steps on the Vector engine."""
    rstd = nl.ndarray(u.shape, dtype=nl.float32)
    rstd[...] = nisa.activation(op=nl.rsqrt, data=u, dtype=nl.float32, mask=mask)
    for _ in nl.static_range(NEWTON_STEPS):
        rstd[...] = newton_rsqrt_step(rstd, u, mask)
    return rstd


def _scaled_per_row(v, mask=None):
    """``(u, p)``: u = v·p² in rsqrt's valid range for every v in [0, +inf], p = 2³² where
    v < 2⁻²⁰ else 2⁻³² (``RSQRT_SPLIT``), so that rsqrt(u)·p = rsqrt(v). v is first kept in
    [2⁻¹⁴⁹, FP32_MAX] (a zero row's rstd becomes +inf later, an infinite one's 0). The
    selector q = (v < 2⁻²⁰) + 2⁻³² is 1 or 2⁻³² exactly (1 + 2⁻³² rounds to 1), so p = q·2³²·q
    and p² are exact powers of two."""
    finite_v = nisa.tensor_scalar(
        v,
        op0=nl.minimum,
        operand0=FP32_MAX,
        op1=nl.maximum,
        operand1=FP32_TINY,
        dtype=nl.float32,
        mask=mask,
    )
    selector = nisa.tensor_scalar(
        finite_v,
        op0=nl.less,
        operand0=RSQRT_SPLIT,
        op1=nl.add,
        operand1=1.0 / RSQRT_ROOT_SCALE,
        dtype=nl.float32,
        mask=mask,
    )
    root_scale = nisa.scalar_tensor_tensor(
        data=selector,
        op0=nl.multiply,
        operand0=RSQRT_ROOT_SCALE,
        op1=nl.multiply,
        operand1=selector,
        dtype=nl.float32,
        mask=mask,
    )
    scale = nisa.tensor_tensor(root_scale, root_scale, op=nl.multiply, dtype=nl.float32, mask=mask)
    u = nisa.tensor_tensor(finite_v, scale, op=nl.multiply, dtype=nl.float32, mask=mask)
    return u, root_scale


def newton_rsqrt_step(rstd, v, mask=None):
    """One Newton step towards 1/sqrt(v): r·(1.5 − 0.5·v·r²), three fp32 Vector
    instructions on the small (parts, k) tile."""
    square = nisa.tensor_tensor(rstd, rstd, op=nl.multiply, dtype=nl.float32, mask=mask)
    half_error = nisa.scalar_tensor_tensor(
        data=square,
        op0=nl.multiply,
        operand0=-0.5,
        op1=nl.multiply,
        operand1=v,
        dtype=nl.float32,
        mask=mask,
    )
    return nisa.scalar_tensor_tensor(
        data=half_error,
        op0=nl.add,
        operand0=1.5,
        op1=nl.multiply,
        operand1=rstd,
        dtype=nl.float32,
        mask=mask,
    )


def _infinite_where_zero(rstd, v, mask=None):
    """rstd + (v == 0 ? 2·FP32_MAX : 0): +inf where the mean square is zero (fp32 overflow
    of 2·FP32_MAX), rstd elsewhere (Vector engine; compare then multiply-add)."""
    huge = nisa.tensor_scalar(
        v,
        op0=nl.equal,
        operand0=0.0,
        op1=nl.multiply,
        operand1=FP32_MAX,
        dtype=nl.float32,
        mask=mask,
    )
    return nisa.scalar_tensor_tensor(
        data=huge,
        op0=nl.multiply,
        operand0=2.0,
        op1=nl.add,
        operand1=rstd,
        dtype=nl.float32,
        mask=mask,
    )


def weight_rows(plan, weight_hbm, offset=0.0):
    """The weight ``weight_hbm`` (N,) as the Tensor engine's moving operand:
    ``plan.rstd_pieces`` copies of its finite part (weight + offset in the
    scale dtype, ±Inf and NaN zeroed), then its non-finite part (zero where finite), against
    the rstd pieces and the high piece again (:func:`rstd_rows`): a zero piece times an
    infinite weight would be NaN (0·Inf), a positive high piece times the non-finite part is
    what IEEE gives for rstd·w (the "long" regime's: :func:`weight_rows_in_hbm`)."""
    pieces = plan.rstd_pieces
    rows = nl.ndarray((pieces + 1, weight_hbm.shape[0]), dtype=plan.scale_dtype)
    parts = finite_parts(weight_hbm, plan.scale_dtype, offset)
    copy_parts(rows[0:1, :], parts, 0)
    copy_parts(rows[pieces : pieces + 1, :], parts, 1)
    for piece in nl.static_range(1, pieces):
        nisa.dma_copy(dst=rows[piece : piece + 1, :], src=rows[0:1, :])
    return rows


def weight_rows_in_hbm(plan, weight_hbm, offset=0.0):
    """:func:`weight_rows`' (pieces + 1, N) layout in HBM (``nl.hbm``, a buffer
    ``nl.ndarray`` documents: general/nki/api/nki/language/__init__.py@8a38e733 L1200), for
    the "long" regime, whose rows leave no room on chip for it: the weight split once per
    kernel (:func:`finite_parts`), each column chunk then one load."""
    pieces = plan.rstd_pieces
    rows = nl.ndarray((pieces + 1, weight_hbm.shape[0]), dtype=plan.scale_dtype, buffer=nl.hbm)
    parts = finite_parts(weight_hbm, plan.scale_dtype, offset)
    for piece in nl.static_range(pieces):
        copy_parts(rows[piece : piece + 1, :], parts, 0)
    copy_parts(rows[pieces : pieces + 1, :], parts, 1)
    return rows


def finite_parts(weight_hbm, dtype, offset=0.0):
    """weight + offset in ``dtype`` as its finite part (±Inf and NaN zeroed) and its
    non-finite part (zero where finite), in SBUF tiles short enough for the Vector engine:
    the first p·q elements as (p, q) tiles, p = min(128, size), q = size // p, and the
    remaining size − p·q < p elements as (1, r) tiles (an odd size has no partition split
    that divides it, and as one (1, size) row each Vector instruction of the split costs a
    cycle per element). Returns the pieces as (first element, finite, non-finite), which
    :func:`copy_parts` moves into the callers' layouts by DMA. Each piece is loaded by a
    DMA from the elements of the weight as one row (a DMA moves elements in order, so any
    two shapes of one size)."""
    size = 1
    for extent in weight_hbm.shape:
        size = size * extent
    row = weight_hbm.reshape((1, size))
    p = min(nl.tile_size.pmax, size)
    q = size // p
    # conditional expressions, not ``if`` blocks: a tile created in a block may not be used
    # after it (general/nki/api/nki.errors.rst@8a38e733, L417-L474)
    head = _finite_piece(row, 0, (p, q), dtype, offset)
    return [head] + (
        [_finite_piece(row, p * q, (1, size - p * q), dtype, offset)] if size % p else []
    )


def _finite_piece(row, start, shape, dtype, offset):
    """(start, finite, non-finite) of the elements start … start + rows·columns − 1 of the
    (1, size) HBM ``row``, loaded as a (rows, columns) tile."""
    rows, columns = shape
    staged = nl.ndarray(shape, dtype=row.dtype)
    nisa.dma_copy(
        dst=staged, src=row[nl.arange(1)[:, None], start + nl.arange(rows * columns)[None, :]]
    )
    finite, nonfinite = split_finite(convert_row(staged, dtype, offset), dtype)
    return start, finite, nonfinite


def copy_parts(dst_row, pieces, which):
    """DMA the finite (``which`` 0) or non-finite (1) parts of :func:`finite_parts` into
    the (1, size) row ``dst_row``."""
    for piece in pieces:
        start = piece[0]
        tile = piece[1 + which]
        count = tile.shape[0] * tile.shape[1]
        nisa.dma_copy(dst=dst_row[:, start : start + count], src=tile)


def split_finite(values, dtype):
    """The finite part of the SBUF tile ``values`` (±Inf and NaN zeroed, −0 made +0 as
    :func:`signed_zeros_positive` does) and its non-finite part (−0 where finite, so that
    adding its products changes no sum), tiles of its shape in ``dtype``. Vector engine:
    v·0 == 0 holds exactly where v is finite; ``nl.where`` selects (no arithmetic on the
    rejected value); −(finite part − v) leaves the rest."""
    is_finite = nisa.tensor_scalar(
        values, op0=nl.multiply, operand0=0.0, op1=nl.equal, operand1=0.0, dtype=nl.uint8
    )
    finite = signed_zeros_positive(nl.where(is_finite, values, 0.0, dtype=dtype))
    difference = nisa.tensor_tensor(finite, values, op=nl.subtract, dtype=dtype)
    nonfinite = nisa.tensor_scalar(difference, op0=nl.multiply, operand0=-1.0, dtype=dtype)
    return finite, nonfinite


def signed_zeros_positive(weights):
    """−0 made +0 (v + 0; Vector engine), returned as a new tile: the Tensor engine's
    rstd ⊗ w sums products of rstd pieces of either sign, so a −0 weight is +0 there."""
    return nisa.tensor_scalar(weights, op0=nl.add, operand0=0.0, dtype=weights.dtype)


def scale_row(plan, row_hbm, offset=0.0, mask=None):
    """Load a (1, F) HBM row, add ``offset`` and convert to the plan's scale dtype (one
    Vector instruction, fp32 arithmetic, one rounding)."""
    return convert_row(nl.load(row_hbm, mask=mask), plan.scale_dtype, offset, mask)


def convert_row(row, dtype, offset=0.0, mask=None):
    """``row + offset`` in ``dtype`` (Vector engine; nothing when there is nothing to do)."""
    if offset:
        return nisa.tensor_scalar(row, op0=nl.add, operand0=offset, dtype=dtype, mask=mask)
    if row.dtype != dtype:
        return nisa.tensor_copy(row, dtype=dtype, mask=mask)
    return row


def broadcast_row(row_hbm, partitions, dtype, offset=0.0, mask=None):
    """Load a (1, F) HBM row, add ``offset``, convert to ``dtype`` and broadcast it to
    ``partitions`` partitions (the compiler's ones-vector matmul). The tile method
    ``broadcast_to`` is documented in SDK 2.21 (general/nki/api/nki/__init__.py@752349fd,
    L425; the RMSNorm tutorial kernel, examples/rmsnorm/rmsnorm_nki_kernels.py@752349fd,
    L64); the function ``nl.broadcast_to`` only from 2.22 (nki_rn.rst@8a38e733, L87)."""
    row = convert_row(nl.load(row_hbm, mask=mask), dtype, offset, mask)
    return row.broadcast_to((partitions, row.shape[1]))


def split_rstd(plan, rstd, batched=False, spare=0):
    """rstd (parts, k) fp32 as the Tensor engine's operand dtype: for three pieces,
    (parts, 3k) bf16 with row j's hi, mid, lo in columns 3j, 3j + 1, 3j + 2; for one piece,
    rstd. hi = bf16(r), rest = r − hi (exact: hi is r rounded), mid = bf16(rest),
    lo = bf16(rest − mid), whatever the rounding mode. By default per row on the Scalar
    engine, whose ``activation`` adds a per-partition bias column (GpSimd may not subtract:
    its ``tensor_scalar`` runs only rsqrt and its ``tensor_tensor`` only power and integer
    arithmetic, general/nki/api/nki/isa/__init__.py@8a38e733 lines 1699 and 1767). With
    ``batched``, all k rows per instruction through strided destinations: the roundings by
    GpSimd ``tensor_copy`` (an fp32 cast when the dtypes differ, isa L1375-1395), the
    subtractions on the Vector engine, which then carries two small instructions per tile
    instead of the Scalar engine's 4·k behind its Σh² stream.
    ``spare`` columns per row are left after its pieces (width w = pieces + spare; with
    one piece, rstd is copied into columns w·j on GpSimd)."""
    pieces = plan.rstd_pieces
    if pieces != 3 and not spare:
        return rstd
    parts, k = rstd.shape
    dtype = plan.scale_dtype
    width = pieces + spare
    end = width * k
    split = nl.ndarray((parts, end), dtype=dtype)
    if pieces != 3:
        split[:, 0:end:width] = nisa.tensor_copy(rstd, dtype=dtype, engine=nisa.gpsimd_engine)
        return split
    if batched:
        # all k rows per instruction (strided destinations: piece p of row j is column
        # w·j + p): the roundings on GpSimd, the exact subtractions on DVE
        split[:, 0:end:width] = nisa.tensor_copy(rstd, dtype=dtype, engine=nisa.gpsimd_engine)
        rest = nisa.tensor_tensor(rstd, split[:, 0:end:width], op=nl.subtract, dtype=nl.float32)
        split[:, 1:end:width] = nisa.tensor_copy(rest, dtype=dtype, engine=nisa.gpsimd_engine)
        split[:, 2:end:width] = nisa.tensor_tensor(
            rest, split[:, 1:end:width], op=nl.subtract, dtype=dtype
        )
        return split
    for j in nl.static_range(k):
        r_j = rstd[:, j : j + 1]
        hi = split[:, width * j : width * j + 1]
        mid = split[:, width * j + 1 : width * j + 2]
        hi[...] = nisa.activation(op=nl.copy, data=r_j, dtype=dtype)
        rest = nisa.activation(op=nl.copy, data=hi, scale=-1.0, bias=r_j, dtype=nl.float32)
        mid[...] = nisa.activation(op=nl.copy, data=rest, dtype=dtype)
        split[:, width * j + 2 : width * j + 3] = nisa.activation(
            op=nl.copy, data=mid, scale=-1.0, bias=rest, dtype=dtype
        )
    return split


def rstd_rows(plan, rstd, ident, batched=False):
    """rstd (parts, k) fp32, one column per row of the tile, as Tensor-engine stationary
    operands, (pieces + 1, k, parts): the ``plan.rstd_pieces`` pieces of row j's rstd for
    partition p in column p of block j, then the high piece again (a K = pieces + 1 matmul
    against :func:`weight_rows`' finite copies and its non-finite part). Pieces from
    :func:`split_rstd` (``batched``: all k rows per instruction), transposes on the Tensor
    engine (exact) into float32 PSUM (a legacy matmul's result is always float32:
    general/nki/api/nki/isa/__init__.py@8a38e733, L876), the PSUM → SBUF copy to the
    operand dtype on the Vector engine (exact: every piece is a bf16 value)."""
    parts, k = rstd.shape
    pieces = plan.rstd_pieces
    dtype = plan.scale_dtype
    width = pieces + 1
    split = split_rstd(plan, rstd, batched, spare=1)
    split[:, pieces : width * k : width] = nisa.tensor_copy(
        split[:, 0 : width * k : width], dtype=dtype, engine=nisa.gpsimd_engine
    )
    transposed = nl.ndarray((width, k, parts), dtype=nl.float32, buffer=nl.psum)
    for j in nl.static_range(k):
        transposed[:, j, :] = nisa.nc_matmul(
            split[:, width * j : width * (j + 1)], ident, is_transpose=True
        )
    return nisa.tensor_copy(transposed, dtype=dtype)


def outer_normalize(y_row, h_row, stationaries, moving, shift, product_row):
    """y = h · (rstd ⊗ w) [+ bias] for one row of the tile: per PSUM bank of columns, the
    Tensor engine writes rstd ⊗ w (the sum over ``stationaries`` (K, parts) against the
    ``moving`` (K, F) weight rows) and the Vector engine multiplies h by it; the bias is
    added in fp32 after (``product_row`` holds the pre-bias product)."""
    target = y_row if shift is None else product_row
    parts = h_row.shape[0]
    for c0, c1 in _banks(h_row.shape[-1]):
        # a declared fp32 PSUM tile the first matmul writes and the others accumulate into
        # (general/nki/examples/attention/attention_kernels.py@8a38e733, L148 and L237)
        outer = nl.ndarray((parts, c1 - c0), dtype=nl.float32, buffer=nl.psum)
        outer[...] = nisa.nc_matmul(stationaries[0], moving[:, c0:c1])
        for stationary in stationaries[1:]:
            outer += nisa.nc_matmul(stationary, moving[:, c0:c1])
        target[:, c0:c1] = nisa.tensor_tensor(
            h_row[:, c0:c1], outer, op=nl.multiply, dtype=target.dtype
        )
    add_shift(y_row, product_row, shift)


def scaled_normalize(plan, y_row, h_row, rstd_col, ones, weight_row, shift, product_row):
    """y = (h · rstd) · w [+ bias] for one row of the tile: per PSUM bank of columns, the
    Scalar engine scales h by rstd (fp32, or x̂ rounded to x's dtype in llama / none), the
    Tensor engine broadcasts the weight row into PSUM (``ones`` (1, parts) against it) and
    the Vector engine multiplies the two."""
    target = y_row if shift is None else product_row
    scaled_dtype = plan.in_dtype if plan.rounds_xhat else nl.float32
    for c0, c1 in _banks(h_row.shape[-1]):
        weight = nisa.nc_matmul(ones, weight_row[:, c0:c1])
        scaled = nisa.activation(
            op=nl.copy, data=h_row[:, c0:c1], scale=rstd_col, dtype=scaled_dtype
        )
        target[:, c0:c1] = nisa.tensor_tensor(scaled, weight, op=nl.multiply, dtype=target.dtype)
    add_shift(y_row, product_row, shift)


def _banks(width):
    """(start, stop) of the PSUM-bank-wide column blocks of ``width`` columns."""
    return [(c0, min(width, c0 + PSUM_COLS)) for c0 in range(0, width, PSUM_COLS)]


def add_shift(y_row, product_row, shift):
    """y = product + bias, fp32, one rounding (Vector engine); nothing without a bias."""
    if shift is not None:
        y_row[...] = nisa.tensor_tensor(product_row, shift, op=nl.add, dtype=y_row.dtype)


def normalize(plan, y_tile, h_tile, rstd_col, xhat_tile, scale, shift, product, mask=None):
    """Write ``h · rstd · scale + shift`` into ``y_tile`` (Vector engine), rounding as the
    casting mode says. llama / none round x̂ = h·rstd to x's dtype first, in ``xhat_tile``
    (a tile of x's dtype that is no longer needed)."""
    if plan.rounds_xhat:
        xhat_tile[...] = nisa.tensor_scalar(
            h_tile, op0=nl.multiply, operand0=rstd_col, dtype=xhat_tile.dtype, mask=mask
        )
        data, row_scale = xhat_tile, None
    else:
        data, row_scale = h_tile, rstd_col

    if scale is not None and shift is not None:
        _multiply(product, data, row_scale, scale, mask)
        y_tile[...] = nisa.tensor_tensor(product, shift, op=nl.add, dtype=y_tile.dtype, mask=mask)
    elif scale is not None:
        _multiply(y_tile, data, row_scale, scale, mask)
    elif shift is not None and row_scale is not None:
        y_tile[...] = nisa.scalar_tensor_tensor(
            data=data,
            op0=nl.multiply,
            operand0=row_scale,
            op1=nl.add,
            operand1=shift,
            dtype=y_tile.dtype,
            mask=mask,
        )
    elif shift is not None:
        y_tile[...] = nisa.tensor_tensor(data, shift, op=nl.add, dtype=y_tile.dtype, mask=mask)
    elif row_scale is not None:
        y_tile[...] = nisa.tensor_scalar(
            data, op0=nl.multiply, operand0=row_scale, dtype=y_tile.dtype, mask=mask
        )
    else:
        y_tile[...] = nisa.tensor_copy(data, dtype=y_tile.dtype, mask=mask)


def _multiply(dst, data, row_scale, scale, mask):
    """``dst = data · row_scale · scale``: one ``scalar_tensor_tensor``, or a
    ``tensor_tensor`` when there is no per-row factor."""
    if row_scale is None:
        dst[...] = nisa.tensor_tensor(data, scale, op=nl.multiply, dtype=dst.dtype, mask=mask)
    else:
        dst[...] = nisa.scalar_tensor_tensor(
            data=data,
            op0=nl.multiply,
            operand0=row_scale,
            op1=nl.multiply,
            operand1=scale,
            dtype=dst.dtype,
            mask=mask,
        )
