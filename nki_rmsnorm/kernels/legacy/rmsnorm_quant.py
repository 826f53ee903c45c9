"""Quantized RMSNorm forward in the legacy ``neuronxcc.nki`` dialect (Neuron SDK 2.21-2.29:
trn1 / inf2, and trn2 before NKI 0.6): the twin of
:mod:`nki_rmsnorm.kernels.nki06.rmsnorm_quant`, with the same function, arguments, math and
outputs (that module documents them), within what the legacy docs allow.

The fp8 dtypes. The legacy docs list ``float8_e4m3`` and ``float8_e5m2`` among the NKI
dtypes with no restriction of target (aws-neuron-sdk-legacy@8a38e733
``general/nki/api/nki.api.shared.rst`` L33-35), and the instructions here take any NKI dtype
as their output ``dtype`` (``general/nki/api/nki/isa/__init__.py`` ``activation`` L107), so
the kernel runs on NeuronCore-v2 (trn1, inf2) and v3 (trn2). The OCP ``float8_e4m3fn`` is not
a legacy dtype (trn3 runs NKI 0.6 only).

Not in this dialect (the launcher, :func:`nki_rmsnorm.ops.rms_norm_quant`, refuses them first
with a ``ValueError``; the kernel asserts):

* ``packed``: nki-library's ``[..., N + 4]`` layout writes the float32 scale's bytes through an
  fp8 reinterpretation of the scale column (``.ap(..., dtype=)`` in NKI 0.6); legacy tiles
  have no access-pattern or reinterpreting view for that;
* ``emit_transposed``: the 0.6 kernel's one-DMA-per-tile store of y_qᵀ addresses the HBM
  output through ``.ap``, which legacy lacks.

Differences of code, not of results (within the float32 roundings the tests allow):

* rstd comes from the forward kernels' Scalar-engine rsqrt refined by Newton steps
  (:func:`nki_rmsnorm.kernels.legacy.rmsnorm_fwd_steps.rstd_from_sum`), as GpSimd's
  ``tensor_scalar`` rsqrt is a 0.6 instruction form; it is not clamped at 2⁻⁸⁷, so with
  ``eps`` below 2⁻⁸⁷ an all-zero row gets rstd = inf and a NaN scale here rather than the
  floor;
* 1 / scale is the Vector engine's ``reciprocal`` (``nisa.reciprocal``, isa L1183);
* p = h · w stays on the Vector engine (the 0.6 kernel forms it on the Tensor engine from
  hᵀ's blocks and shares Σh² with the Gram matrix of hᵀ): on NeuronCore-v2 the Tensor
  engine's transpose "is not bit-accurate if the input ``data`` contains NaN/Inf"
  (``nc_transpose``, isa L1038-1040), so one row holding Inf would put NaN into the other
  rows' hᵀ; and ``range_select``, which picks the Gram diagonal out of PSUM without
  touching the other rows' entries, is NeuronCore-v3+ and new in SDK 2.23 (isa L1091,
  ``general/nki/nki_rn.rst`` L61), after the 2.21 this kernel claims;
* ``shared_hbm`` outputs can be created only at the kernel's top level, never under an
  ``if`` (``general/nki/api/nki.errors.rst`` L583-617): every output is created; those not
  asked for are neither written nor returned.

One row tile at a time (whole rows on chip): h (and the residual add), Σh² on the Scalar
engine, rstd, p = h · w on the Vector engine against the weight that the Tensor engine
broadcasts into PSUM per bank, the maxima of |p| (``tensor_scalar_reduce`` with
``nl.abs`` and a max, both legal there: nki.api.shared.rst L88, L116), the scales, the clips
and the quantizing multiply on the Scalar engine (``activation`` copy with a per-row
``scale``, converting to fp8 on write).
"""

from __future__ import annotations

from nki_rmsnorm.kernels.legacy import rmsnorm_fwd_steps as steps
from nki_rmsnorm.nki import nisa, nki, nl
from nki_rmsnorm.plan.kernel_assert import kernel_assert

__all__ = ["fp8_max", "rmsnorm_quant"]

#: Columns of one PSUM bank of float32 (2 KiB per partition).
_BANK_COLUMNS = 512


def fp8_max(dtype):
    """The largest finite value of an fp8 output dtype."""
    if dtype == nl.float8_e4m3:
        return 240.0
    kernel_assert(dtype == nl.float8_e5m2, "quant_dtype must be float8_e4m3 or float8_e5m2")
    return 57344.0


def _load_h(hbm, r0, parts):
    """h = x (+ residual, stored) for rows r0 … r0 + parts − 1."""
    x, residual, h = hbm[0], hbm[1], hbm[5]
    N = x.shape[1]
    rows = r0 + nl.arange(parts)[:, None]
    cols = nl.arange(N)[None, :]
    h_tile = nl.ndarray((parts, N), dtype=x.dtype if residual is None else residual.dtype)
    x_tile = None if residual is None else nl.ndarray((parts, N), dtype=x.dtype)
    steps.load_h(
        h_tile,
        x_tile,
        x[rows, cols],
        None if residual is None else residual[rows, cols],
        None if residual is None else h[rows, cols],
    )
    return h_tile


def _abs_max(p, amax_p, column):
    """max |p| over the free axis of ``p`` into ``amax_p[:, column]`` (Vector engine); the
    elementwise result is discarded."""
    nisa.tensor_scalar_reduce(
        data=p,
        op0=nl.abs,
        operand0=0.0,
        reduce_op=nl.maximum,
        reduce_res=amax_p[:, column : column + 1],
        dtype=nl.bfloat16,
    )


def _product(h_tile, weight_row, ones):
    """p = h · w (float32) for a tile: per PSUM bank of columns, the Tensor engine broadcasts
    the weight row to the tile's partitions (``ones`` (1, 128) against it: exact) and the
    Vector engine multiplies h by that bank (one PSUM operand: one cycle per element rather
    than the two of two SBUF operands), as the legacy forward's "scalar" plan does."""
    parts, N = h_tile.shape
    p = nl.ndarray((parts, N), dtype=nl.float32)
    for c0 in range(0, N, _BANK_COLUMNS):
        c1 = min(N, c0 + _BANK_COLUMNS)
        bank = nisa.nc_matmul(ones[:, 0:parts], weight_row[:, c0:c1])
        p[:, c0:c1] = nisa.tensor_tensor(h_tile[:, c0:c1], bank, op=nl.multiply, dtype=nl.float32)
    return p


def _clip(p, bound):
    """clip(p, ±bound), ``bound`` a (rows, 1) float32 column (Vector engine)."""
    negative = nisa.tensor_scalar(bound, op0=nl.multiply, operand0=-1.0, dtype=nl.float32)
    return nisa.tensor_scalar(
        p, op0=nl.minimum, operand0=bound, op1=nl.maximum, operand1=negative, dtype=nl.float32
    )


def _scaled_inverse(column, value):
    """value / column for a (rows, 1) float32 column (Vector reciprocal, then a multiply)."""
    inverse = nisa.reciprocal(column, dtype=nl.float32)
    return nisa.tensor_scalar(inverse, op0=nl.multiply, operand0=float(value), dtype=nl.float32)


def _quant_tile(hbm, options, weight_rows, static_inverse, r0, parts):
    """Every requested output of rows r0 … r0 + parts − 1."""
    x, y_q, scales, y, amax = hbm[0], hbm[2], hbm[3], hbm[4], hbm[6]
    eps, quant_dtype, scale_mode, block, lower_bound, scale_floor, emit_y, emit_amax = options
    N = x.shape[1]
    rows = r0 + nl.arange(parts)[:, None]
    cols = nl.arange(N)[None, :]
    fp8max = fp8_max(quant_dtype)

    h_tile = _load_h(hbm, r0, parts)
    sum_sq = nl.ndarray((parts, 1), dtype=nl.float32)
    nisa.activation_reduce(
        op=nl.square, data=h_tile, reduce_op=nl.add, reduce_res=sum_sq, dtype=nl.bfloat16
    )
    rstd = steps.rstd_from_sum(sum_sq, eps, N)
    p = (
        nisa.tensor_copy(h_tile, dtype=nl.float32)
        if weight_rows is None
        else _product(h_tile, weight_rows[0], weight_rows[1])
    )

    blocks = N // block if scale_mode == "block" else 1
    width = block if scale_mode == "block" else N
    amax_p = nl.ndarray((parts, blocks), dtype=nl.float32)
    needs_amax = scale_mode != "static" or emit_amax
    if needs_amax:
        for b in range(blocks):
            _abs_max(p[:, b * width : (b + 1) * width], amax_p, b)
    amax_y = (
        nisa.activation(op=nl.copy, data=amax_p, scale=rstd, dtype=nl.float32)
        if needs_amax
        else None
    )

    if emit_y:  # before the clips below
        y_tile = nisa.activation(op=nl.copy, data=p, scale=rstd, dtype=x.dtype)
        nl.store(y[rows, cols], value=y_tile)

    q = nl.ndarray((parts, N), dtype=quant_dtype)
    if scale_mode == "static":
        factor = nisa.tensor_scalar(
            rstd, op0=nl.multiply, operand0=static_inverse[0:parts, :], dtype=nl.float32
        )
        clipped = _clip(p, _scaled_inverse(factor, fp8max))
        q[...] = nisa.activation(op=nl.copy, data=clipped, scale=factor, dtype=quant_dtype)
    else:
        capped = (
            amax_y
            if lower_bound is None
            else nisa.tensor_scalar(
                amax_y, op0=nl.minimum, operand0=float(lower_bound), dtype=nl.float32
            )
        )
        scale = nisa.tensor_scalar(
            capped,
            op0=nl.multiply,
            operand0=1.0 / fp8max,
            op1=nl.maximum,
            operand1=float(scale_floor),
            dtype=nl.float32,
        )
        inverse = nisa.reciprocal(scale, dtype=nl.float32)
        factor = nisa.tensor_scalar(inverse, op0=nl.multiply, operand0=rstd, dtype=nl.float32)
        clipped = p if lower_bound is None else _clip(p, _scaled_inverse(rstd, lower_bound))
        for b in range(blocks):
            q[:, b * width : (b + 1) * width] = nisa.activation(
                op=nl.copy,
                data=clipped[:, b * width : (b + 1) * width],
                scale=factor[:, b : b + 1],
                dtype=quant_dtype,
            )
        nl.store(scales[rows, nl.arange(blocks)[None, :]], value=scale)
    nl.store(y_q[rows, cols], value=q)
    if emit_amax:
        row_amax = (
            amax_y
            if blocks == 1
            else nisa.tensor_reduce(nl.maximum, amax_y, axis=1, keepdims=True, dtype=nl.float32)
        )
        nl.store(amax[rows, nl.arange(1)[None, :]], value=row_amax)


def _all_tiles(hbm, options, weight, input_scale):
    """The row tiles of up to 128 rows, one after another, after the per-kernel constants:
    the weight broadcast to the partitions in float32 and the static scale's reciprocal."""
    x = hbm[0]
    M, N = x.shape
    pmax = nl.tile_size.pmax
    parts = min(pmax, M)
    weight_rows = (
        None
        if weight is None
        else (
            nl.load(weight.reshape((1, N))[nl.arange(1)[:, None], nl.arange(N)[None, :]]),
            nl.full((1, parts), 1.0, dtype=weight.dtype),
        )
    )
    static_inverse = (
        None
        if input_scale is None
        else nisa.reciprocal(
            steps.broadcast_row(
                input_scale[nl.arange(1)[:, None], nl.arange(1)[None, :]], parts, nl.float32
            ),
            dtype=nl.float32,
        )
    )
    for r0 in range(0, M, pmax):
        _quant_tile(hbm, options, weight_rows, static_inverse, r0, min(pmax, M - r0))


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
    """Quantized RMSNorm of ``x`` (M, N), the legacy twin of
    :func:`nki_rmsnorm.kernels.nki06.rmsnorm_quant.rmsnorm_quant` (same arguments and
    outputs), without ``packed`` and ``emit_transposed`` (see the module docstring)."""
    M, N = x.shape
    kernel_assert(not packed, "packed=True needs NKI 0.6 (.ap(dtype=)); legacy has no such view")
    kernel_assert(not emit_transposed, "emit_transposed=True needs NKI 0.6 (.ap on HBM)")
    kernel_assert(
        scale_mode == "row" or scale_mode == "block" or scale_mode == "static",
        "scale_mode must be row, block or static",
    )
    kernel_assert(scale_mode != "block" or N % block == 0, "block must divide N")
    scale_columns = N // block if scale_mode == "block" else 1
    y_q = nl.ndarray((M, N), dtype=quant_dtype, buffer=nl.shared_hbm)
    scales = nl.ndarray((M, scale_columns), dtype=nl.float32, buffer=nl.shared_hbm)
    y = nl.ndarray((M, N), dtype=x.dtype, buffer=nl.shared_hbm)
    h = nl.ndarray(
        (M, N), dtype=x.dtype if residual is None else residual.dtype, buffer=nl.shared_hbm
    )
    amax = nl.ndarray((M, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    hbm = (x, residual, y_q, scales, y, h, amax)
    options = (eps, quant_dtype, scale_mode, block, lower_bound, scale_floor, emit_y, emit_amax)
    _all_tiles(hbm, options, weight, input_scale)
    outputs = [y_q]
    if scale_mode != "static":
        outputs.append(scales)
    if emit_y:
        outputs.append(y)
    if residual is not None:
        outputs.append(h)
    if emit_amax:
        outputs.append(amax)
    return tuple(outputs)
