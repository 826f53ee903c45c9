"""``neuronxcc.nki.isa`` (``nisa``): one function per hardware instruction.

Each instruction computes in float32 and rounds its output to ``dtype`` (default: the input
dtype; the promoted type for two-input ops). Per-partition operands (``(P, 1)`` tiles or
Python scalars) broadcast along the free axes; nothing broadcasts along the partition axis.
"""

from __future__ import annotations

import enum

import numpy as np

from . import dtypes as dt
from . import functions as fn
from .errors import NKITypeError, NKIValueError
from .instructions import (
    allocate,
    check_free_size,
    compute_result,
    emit,
    finish,
    is_tile,
    resolve_mask,
    result_tile,
    scalar_or_tile,
    tile_operand,
    write_into,
)
from .runtime import current
from .tensor import Access, Tensor


class engine(enum.Enum):  # noqa: N801 - the NKI name
    """Engines an instruction may be placed on."""

    tensor = "pe"
    vector = "dve"
    scalar = "act"
    gpsimd = "pool"
    sync = "sync"
    unknown = "unknown"


tensor_engine = engine.tensor
vector_engine = engine.vector
scalar_engine = engine.scalar
gpsimd_engine = engine.gpsimd
unknown_engine = engine.unknown
dma_engine = engine.sync


class reduce_cmd(enum.Enum):  # noqa: N801
    """State changes of the Scalar engine's per-partition accumulator."""

    idle = 0
    reset = 1
    reset_reduce = 2
    reduce = 3


class dge_mode(enum.Enum):  # noqa: N801
    """How DMA descriptors are generated."""

    none = 0
    swdge = 1
    hwdge = 2
    unknown = 3


class oob_mode(enum.Enum):  # noqa: N801
    """What an indirect DMA does with out-of-bounds indices."""

    error = 0
    skip = 1


class nc_version(enum.IntEnum):  # noqa: N801
    """NeuronCore generations."""

    gen2 = 2
    gen3 = 3
    gen4 = 4


def get_nc_version() -> nc_version:
    """``nisa.get_nc_version()``: the NeuronCore generation of the kernel's target."""
    return nc_version(current("nisa.get_nc_version").target.nc_version)


def _engine_name(requested, default: str) -> str:
    if requested is None or requested is engine.unknown:
        return default
    if isinstance(requested, engine):
        return requested.value
    raise NKIValueError(f"engine={requested!r} is not a nisa.engine", "err_unsupported_engine")


def _same_partitions(api, *operands):
    counts = {op.partitions for op in operands if op is not None}
    if len(counts) > 1:
        raise NKIValueError(f"{api}: operands have different partition counts {sorted(counts)}",
                            "err_num_partition_mismatch")


def _mask_or_skip(mask, shape, dtype):
    m = resolve_mask(mask, shape)
    if m is False:
        return m, allocate(shape, dtype, fill=dt.uninitialised(dtype))
    return m, None


# --- Scalar engine ---------------------------------------------------------------------------

def activation(op, data, *, bias=None, scale=1.0, reduce_op=None, reduce_res=None,
               reduce_cmd=reduce_cmd.idle, mask=None, dtype=None, **kwargs):
    """``nisa.activation(op, data, *, bias=None, scale=1.0, reduce_op=None, reduce_res=None,
    reduce_cmd=idle, mask=None, dtype=None)``: ``out = op(data * scale + bias)`` on the Scalar
    engine. ``scale`` is a float or a ``(P, 1)`` fp32 tile, ``bias`` a ``(P, 1)`` tile
    (fp32/bf16/fp16). With ``reduce_op``/``reduce_res`` the fp32 values of ``out`` are also
    reduced over all free axes into ``reduce_res[:, 0]``."""
    spec = fn.lookup(op, "op")
    if not spec.is_activation:
        raise NKIValueError(f"op={spec.name} is not an activation function",
                            "err_unsupported_activation")
    src = tile_operand(data, "data", "activation")
    check_free_size(src, "nisa.activation")
    if is_tile(scale):
        if scale.dtype != dt.float32:
            raise NKITypeError("activation scale must be a Python float or an fp32 (P, 1) tile",
                               "err_activation_scale_invalid_type")
    scale_v, scale_op = scalar_or_tile(scale, "scale", "activation", src.partitions)
    bias_v, bias_op = (np.float32(0.0), None)
    if bias is not None:
        if not is_tile(bias):
            raise NKITypeError("activation bias must be a (P, 1) tile",
                               "err_activation_bias_invalid_type")
        if dt.name(bias.dtype) not in ("float32", "bfloat16", "float16"):
            raise NKITypeError("activation bias must be fp32, bf16 or fp16",
                               "err_activation_bias_invalid_type")
        bias_v, bias_op = scalar_or_tile(bias, "bias", "activation", src.partitions)
    x = src.f32()
    if isinstance(scale_v, np.ndarray):
        scale_v = scale_v.reshape((src.partitions,) + (1,) * (x.ndim - 1))
    if isinstance(bias_v, np.ndarray):
        bias_v = bias_v.reshape((src.partitions,) + (1,) * (x.ndim - 1))
    pre = x * scale_v + bias_v if (scale_op or scale_v != 1.0 or bias_op) else x
    values = spec.apply(pre.astype(np.float32, copy=False))
    out_dtype = dt.as_dtype(dtype or src.dtype)
    m, skipped = _mask_or_skip(mask, src.shape, out_dtype)
    if skipped is not None:
        return skipped
    details = {"op": spec.name}
    inputs = [src, scale_op, bias_op]
    if reduce_op is not None or reduce_res is not None or reduce_cmd is not reduce_cmd.idle:
        _activation_reduce_into(values, m, reduce_op, reduce_res, reduce_cmd, src.partitions)
        details["reduce"] = True
    tile = result_tile(values, out_dtype, m)
    writes = [tile.region()]
    if reduce_res is not None:
        writes.append(reduce_res.region())
    inst = emit("act", "activation", inputs=inputs, outputs=writes, partitions=src.partitions,
                free_size=src.free_size, out_dtype=out_dtype, details=details)
    return finish(tile, inst, m, values)


def _activation_reduce_into(values, m, reduce_op, reduce_res, cmd, partitions):
    ctx = current("activation")
    spec = fn.lookup(reduce_op or np.add, "reduce_op")
    if spec.name not in ("add", "maximum", "minimum", "multiply"):
        raise NKIValueError(f"reduce_op={spec.name} cannot reduce on the Scalar engine",
                            "err_unsupported_reduce_op")
    if spec.name != "add" and ctx.target.nc_version == 2:
        raise NKIValueError("on NeuronCore-v2 the activation reduce_op must be add",
                            "err_unsupported_reduce_op")
    axes = tuple(range(1, values.ndim))
    identity = {"add": 0.0, "multiply": 1.0, "maximum": -np.inf, "minimum": np.inf}[spec.name]
    masked = values if m is None else np.where(m, values, np.float32(identity))
    reduced = spec.reduce(masked.astype(np.float32), axes).reshape(partitions, 1)
    acc = ctx.act_accumulator
    if cmd in (reduce_cmd.idle, reduce_cmd.reset_reduce) or acc is None or \
            acc.shape != reduced.shape:
        acc = reduced  # idle with a reduce_res behaves as reset_reduce (spec decision)
    elif cmd is reduce_cmd.reset:
        acc = np.full_like(reduced, identity)
    else:
        acc = spec.apply(acc, reduced).astype(np.float32)
    ctx.act_accumulator = acc
    if reduce_res is not None:
        _write_column(reduce_res, acc, "reduce_res")


def _write_column(dst, values, argname):
    if not is_tile(dst) or not dst.on_chip:
        raise NKITypeError(f"`{argname}` must be an SBUF/PSUM tile", "err_unsupported_memory")
    shape = dst.shape
    if shape[0] != values.shape[0]:
        raise NKIValueError(f"`{argname}` has {shape[0]} partitions, the data has "
                            f"{values.shape[0]}", "err_num_partition_mismatch")
    column = dst[:, 0:1] if isinstance(dst, Tensor) and len(shape) == 2 and shape[1] > 1 else dst
    write_into(column, values.reshape(column.shape), None)


def activation_reduce(op, data, *, reduce_op, reduce_res, bias=None, scale=1.0, mask=None,
                      dtype=None, **kwargs):
    """``nisa.activation_reduce(op, data, *, reduce_op, reduce_res, bias=None, scale=1.0)``:
    ``activation`` plus a reduction of its fp32 output over the free axes into
    ``reduce_res[:, 0]`` (reset first). NeuronCore-v2 only reduces with add."""
    out = activation(op, data, bias=bias, scale=scale, reduce_op=reduce_op,
                     reduce_res=reduce_res, reduce_cmd=reduce_cmd.reset_reduce, mask=mask,
                     dtype=dtype)
    out.fresh[0].opcode = "activation_reduce"
    return out


# --- Vector engine ---------------------------------------------------------------------------
def _apply_alu(spec, a, b, reverse):
    if spec.unary and spec.name not in fn.BINARY:  # unary ALU op: the operand is a dummy
        return spec.apply(a)
    return spec.apply(b, a) if reverse else spec.apply(a, b)


def _alu_inputs(spec, op):
    if spec.bitvec:
        if not dt.is_int(op.dtype):
            raise NKITypeError(f"bit operation {spec.name} needs integer data", "err_bitvec_dtype")
        return op.values
    return op.f32()


def tensor_scalar(data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  *, dtype=None, mask=None, engine=None, **kwargs):
    """``nisa.tensor_scalar(data, op0, operand0, reverse0=False, op1=None, operand1=None,
    reverse1=False)``: ``out = op1(op0(data, operand0), operand1)`` with per-partition
    scalars (a Python number or a ``(P, 1)`` tile) broadcast along the free axes."""
    src = tile_operand(data, "data", "tensor_scalar")
    check_free_size(src, "nisa.tensor_scalar")
    spec0 = fn.lookup(op0, "op0")
    spec1 = fn.lookup(op1, "op1") if op1 is not None else None
    if spec1 is not None and spec0.bitvec != spec1.bitvec:
        raise NKIValueError("op0 and op1 must both be arithmetic or both bitvec operators",
                            "err_mixed_operator_kinds")
    s0, s0_op = scalar_or_tile(operand0, "operand0", "tensor_scalar", src.partitions)
    values = _alu_inputs(spec0, src)
    shape_p = (src.partitions,) + (1,) * (values.ndim - 1)
    s0 = s0.reshape(shape_p) if isinstance(s0, np.ndarray) else s0
    if spec0.bitvec:
        s0 = np.asarray(s0).astype(values.dtype)
    values = _apply_alu(spec0, values, s0, reverse0)
    inputs = [src, s0_op]
    if spec1 is not None:
        s1, s1_op = scalar_or_tile(operand1, "operand1", "tensor_scalar", src.partitions)
        s1 = s1.reshape(shape_p) if isinstance(s1, np.ndarray) else s1
        if spec1.bitvec:
            s1 = np.asarray(s1).astype(values.dtype)
        values = _apply_alu(spec1, values, s1, reverse1)
        inputs.append(s1_op)
    out_dtype = dt.as_dtype(dtype or src.dtype)
    m, skipped = _mask_or_skip(mask, src.shape, out_dtype)
    if skipped is not None:
        return skipped
    ops = [spec0.name] + ([spec1.name] if spec1 else [])
    return compute_result(_engine_name(engine, "dve"), "tensor_scalar", values, out_dtype, m,
                          inputs, details={"op": ops})


def tensor_tensor(data1, data2, op, *, dtype=None, mask=None, engine=None, **kwargs):
    """``nisa.tensor_tensor(data1, data2, op)``: elementwise ``op(data1, data2)`` of two tiles
    with the same partition count and elements per partition (not both in PSUM)."""
    a = tile_operand(data1, "data1", "tensor_tensor")
    b = tile_operand(data2, "data2", "tensor_tensor")
    for o in (a, b):
        check_free_size(o, "nisa.tensor_tensor")
    _same_partitions("tensor_tensor", a, b)
    if a.free_size != b.free_size:
        raise NKIValueError(f"tensor_tensor operands have {a.free_size} and {b.free_size} "
                            "elements per partition", "err_num_partition_mismatch")
    if a.memory == "psum" and b.memory == "psum":
        raise NKITypeError("tensor_tensor: at most one input may be in PSUM",
                           "err_unsupported_memory")
    spec = fn.lookup(op, "op")
    av, bv = _alu_inputs(spec, a), _alu_inputs(spec, b).reshape(a.shape)
    default_engine = "dve"
    if spec.name == "power" or (dt.is_int(a.dtype) and dt.is_int(b.dtype)
                                and spec.name in ("add", "subtract", "multiply")):
        default_engine = "pool"
        if "psum" in (a.memory, b.memory):
            raise NKITypeError("GpSimd instructions cannot read PSUM", "err_unsupported_memory")
        if not spec.bitvec and dt.is_int(a.dtype) and dt.is_int(b.dtype):
            av, bv = a.values.astype(np.int64), b.values.astype(np.int64).reshape(a.shape)
    values = spec.apply(av, bv)
    out_dtype = dt.as_dtype(dtype or dt.promote(a.dtype, b.dtype))
    m, skipped = _mask_or_skip(mask, a.shape, out_dtype)
    if skipped is not None:
        return skipped
    return compute_result(_engine_name(engine, default_engine), "tensor_tensor", values,
                          out_dtype, m, [a, b], details={"op": spec.name})


def scalar_tensor_tensor(*, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False,
                         dtype=None, mask=None, **kwargs):
    """``nisa.scalar_tensor_tensor(*, data, op0, operand0, op1, operand1)``:
    ``out = op1(op0(data, operand0), operand1)`` with ``operand0`` a scalar or ``(P, 1)`` tile
    and ``operand1`` a tile shaped like ``data`` (Vector engine)."""
    src = tile_operand(data, "data", "scalar_tensor_tensor")
    other = tile_operand(operand1, "operand1", "scalar_tensor_tensor")
    for o in (src, other):
        check_free_size(o, "nisa.scalar_tensor_tensor")
    _same_partitions("scalar_tensor_tensor", src, other)
    if src.free_size != other.free_size:
        raise NKIValueError("scalar_tensor_tensor: operand1 must have the shape of data",
                            "err_num_partition_mismatch")
    if src.memory == "psum" and other.memory == "psum":
        raise NKITypeError("scalar_tensor_tensor: data and operand1 cannot both be in PSUM",
                           "err_unsupported_memory")
    spec0, spec1 = fn.lookup(op0, "op0"), fn.lookup(op1, "op1")
    s0, s0_op = scalar_or_tile(operand0, "operand0", "scalar_tensor_tensor", src.partitions)
    values = src.f32()
    s0 = s0.reshape((src.partitions,) + (1,) * (values.ndim - 1)) if isinstance(
        s0, np.ndarray) else s0
    values = _apply_alu(spec0, values, s0, reverse0)
    values = _apply_alu(spec1, values, other.f32().reshape(src.shape), reverse1)
    out_dtype = dt.as_dtype(dtype or dt.promote(src.dtype, other.dtype))
    m, skipped = _mask_or_skip(mask, src.shape, out_dtype)
    if skipped is not None:
        return skipped
    return compute_result("dve", "scalar_tensor_tensor", values, out_dtype, m,
                          [src, s0_op, other], details={"op": [spec0.name, spec1.name]})


def tensor_reduce(op, data, axis, *, negate=False, keepdims=False, mask=None, dtype=None,
                  **kwargs):
    """``nisa.tensor_reduce(op, data, axis, *, negate=False, keepdims=False)``: reduce along
    free ``axis`` (int or list; NumPy numbering, must include the last axis) on the Vector
    engine; ``negate`` multiplies the result by -1."""
    src = tile_operand(data, "data", "tensor_reduce")
    check_free_size(src, "nisa.tensor_reduce")
    spec = fn.lookup(op, "op")
    if spec.name not in fn.REDUCIBLE:
        raise NKIValueError(f"op={spec.name} cannot reduce", "err_unsupported_reduce_op")
    axes = tuple(axis) if isinstance(axis, (list, tuple)) else (axis,)
    ndim = src.values.ndim
    axes = tuple(sorted(a % ndim for a in axes))
    if 0 in axes or (ndim - 1) not in axes:
        raise NKIValueError(f"tensor_reduce axis={axis}: the axes must be free axes including "
                            "the last (most minor) one", "err_reduce_axis")
    if len(axes) > 4:
        raise NKIValueError("tensor_reduce reduces at most 4 free axes", "err_reduce_axis")
    m = resolve_mask(mask, src.shape)
    values = _alu_inputs(spec, src)
    if isinstance(m, np.ndarray):
        identity = {"add": 0, "subtract": 0, "multiply": 1, "maximum": -np.inf,
                    "minimum": np.inf}.get(spec.name, 0)
        values = np.where(m, values, np.asarray(identity, values.dtype))
    if spec.name == "subtract":
        first = np.take(values, [0], axis=axes[-1])
        result = first.squeeze(axes[-1]) - np.sum(values, axis=axes) + first.squeeze(axes[-1])
    else:
        result = spec.reduce(values, axes)
    if negate:
        result = -result
    if keepdims:
        result = np.expand_dims(result, axes)
    out_dtype = dt.as_dtype(dtype or src.dtype)
    return compute_result("dve", "tensor_reduce", np.asarray(result), out_dtype, None, [src],
                          free_size=src.free_size, details={"op": spec.name})


def tensor_scalar_reduce(*, data, op0, operand0, reduce_op, reduce_res, reverse0=False,
                         dtype=None, mask=None, **kwargs):
    """``nisa.tensor_scalar_reduce(*, data, op0, operand0, reduce_op, reduce_res)``:
    ``out = op0(data, operand0)``; ``reduce_res[:, 0] = reduce_op(out over free axes)``."""
    if reverse0:
        raise NKIValueError("tensor_scalar_reduce does not support reverse0", "err_reverse0")
    out = tensor_scalar(data, op0, operand0, dtype=dtype, mask=mask)
    spec = fn.lookup(reduce_op, "reduce_op")
    if spec.name not in ("add", "subtract", "multiply", "maximum", "minimum"):
        raise NKIValueError(f"reduce_op={spec.name} is not supported", "err_unsupported_reduce_op")
    inst, m, values = out.fresh
    if isinstance(m, np.ndarray):
        identity = {"add": 0.0, "multiply": 1.0, "maximum": -np.inf, "minimum": np.inf}
        values = np.where(m, values, np.float32(identity.get(spec.name, 0.0)))
    axes = tuple(range(1, values.ndim))
    reduced = spec.reduce(values.astype(np.float32), axes).reshape(values.shape[0], 1)
    _write_column(reduce_res, reduced, "reduce_res")
    inst.opcode = "tensor_scalar_reduce"
    inst.writes = inst.writes + (reduce_res.region(),)
    return out


def tensor_tensor_scan(data0, data1, initial, op0, op1, reverse0=False, reverse1=False, *,
                       dtype=None, mask=None, **kwargs):
    """``nisa.tensor_tensor_scan(data0, data1, initial, op0, op1)``: per partition,
    ``r[:, i] = op1(op0(data0[:, i], r[:, i-1]), data1[:, i])`` with ``r[:, -1] = initial``."""
    a = tile_operand(data0, "data0", "tensor_tensor_scan")
    b = tile_operand(data1, "data1", "tensor_tensor_scan")
    _same_partitions("tensor_tensor_scan", a, b)
    spec0, spec1 = fn.lookup(op0, "op0"), fn.lookup(op1, "op1")
    init, init_op = scalar_or_tile(initial, "initial", "tensor_tensor_scan", a.partitions)
    av = a.f32().reshape(a.partitions, -1)
    bv = b.f32().reshape(a.partitions, -1)
    out = np.empty_like(av)
    prev = np.broadcast_to(np.asarray(init, np.float32).reshape(-1), (a.partitions,)).copy()
    for i in range(av.shape[1]):  # a true recurrence: the hardware also walks the free axis
        t = _apply_alu(spec0, av[:, i], prev, reverse0)
        prev = _apply_alu(spec1, t, bv[:, i], reverse1).astype(np.float32)
        out[:, i] = prev
    out_dtype = dt.as_dtype(dtype or dt.promote(a.dtype, b.dtype))
    m = resolve_mask(mask, a.shape)
    return compute_result("dve", "tensor_tensor_scan", out.reshape(a.shape), out_dtype,
                          m if m is not False else None, [a, b, init_op])


def tensor_copy(src, *, mask=None, dtype=None, engine=None, **kwargs):
    """``nisa.tensor_copy(src, *, dtype=None, engine=...)``: copy with a cast (Vector by
    default; Scalar or GpSimd on request; GpSimd cannot touch PSUM)."""
    op = tile_operand(src, "src", "tensor_copy")
    check_free_size(op, "nisa.tensor_copy")
    eng = _engine_name(engine, "dve")
    if eng == "pool" and op.memory == "psum":
        raise NKITypeError("GpSimd instructions cannot read PSUM", "err_unsupported_memory")
    out_dtype = dt.as_dtype(dtype or op.dtype)
    m, skipped = _mask_or_skip(mask, op.shape, out_dtype)
    if skipped is not None:
        return skipped
    return compute_result(eng, "tensor_copy", op.values, out_dtype, m, [op])


def reciprocal(data, *, dtype=None, mask=None, **kwargs):
    """``nisa.reciprocal(data)``: ``1 / data`` on the Vector engine."""
    op = tile_operand(data, "data", "reciprocal")
    out_dtype = dt.as_dtype(dtype or op.dtype)
    m, skipped = _mask_or_skip(mask, op.shape, out_dtype)
    if skipped is not None:
        return skipped
    with np.errstate(divide="ignore"):
        values = np.float32(1.0) / op.f32()
    return compute_result("dve", "reciprocal", values, out_dtype, m, [op])


def bn_stats(data, *, mask=None, dtype=None, **kwargs):
    """``nisa.bn_stats(data)``: per partition over the flattened free axis (≤ 512 elements),
    ``[n_even, mean_even, M2_even, n_odd, mean_odd, M2_odd]`` of the even- and odd-indexed
    elements (population statistics; a masked-off element does not count)."""
    op = tile_operand(data, "data", "bn_stats")
    if op.free_size > 512:
        raise NKIValueError(f"bn_stats reads at most 512 elements per partition "
                            f"(bn_stats_fmax), got {op.free_size}",
                            "err_size_of_dimension_exceed_arch_limit")
    m = resolve_mask(mask, op.shape)
    x = op.f32().reshape(op.partitions, -1)
    valid = np.ones_like(x, bool) if m is None or m is False else m.reshape(op.partitions, -1)
    out = np.zeros((op.partitions, 6), np.float32)
    for k, start in enumerate((0, 1)):
        v, w = x[:, start::2], valid[:, start::2]
        n = w.sum(axis=1).astype(np.float32)
        safe = np.maximum(n, 1)
        mean = np.where(w, v, 0).sum(axis=1, dtype=np.float32) / safe
        m2 = np.where(w, (v - mean[:, None]) ** 2, 0).sum(axis=1, dtype=np.float32)
        out[:, 3 * k], out[:, 3 * k + 1], out[:, 3 * k + 2] = n, mean, m2
    return compute_result("dve", "bn_stats", out, dt.as_dtype(dtype or dt.float32), None, [op],
                          free_size=op.free_size)


def bn_aggr(data, *, mask=None, dtype=None, **kwargs):
    """``nisa.bn_aggr(data)``: combine ``(count, mean, M2)`` triples (free size a multiple of 3)
    into ``[mean, var]`` per partition (population variance)."""
    op = tile_operand(data, "data", "bn_aggr")
    stats = op.f32().reshape(op.partitions, -1)
    if stats.shape[1] % 3:
        raise NKIValueError("bn_aggr input free size must be a multiple of 3",
                            "err_bn_aggr_shape")
    n, mu, m2 = stats[:, 0::3], stats[:, 1::3], stats[:, 2::3]
    total = n.sum(axis=1)
    safe = np.maximum(total, 1)
    mean = (n * mu).sum(axis=1) / safe
    var = (m2 + n * (mu - mean[:, None]) ** 2).sum(axis=1) / safe
    out = np.stack([mean, var], axis=1).astype(np.float32)
    return compute_result("dve", "bn_aggr", out, dt.as_dtype(dtype or dt.float32), None, [op],
                          free_size=op.free_size)


def memset(shape, value, dtype, *, mask=None, engine=None, **kwargs):
    """``nisa.memset(shape, value, dtype)``: a new SBUF tile filled with ``value`` (the first
    axis is the partition axis)."""
    dtype = dt.as_dtype(dtype)
    tile = allocate(tuple(shape), dtype, "sbuf", fill=dt.cast(np.asarray(value), dtype))
    inst = emit(_engine_name(engine, "dve"), "memset", outputs=[tile.region()],
                partitions=tile.shape[0], free_size=int(np.prod(tile.shape[1:])),
                out_dtype=dtype, details={"value": float(value)})
    return finish(tile, inst, None, None)


def iota(expr, dtype, *, mask=None, **kwargs):
    """``nisa.iota(expr, dtype)``: materialise an index expression as a tile (GpSimd; values
    computed in int32, then cast)."""
    from .indexing import IndexExpr

    if not isinstance(expr, IndexExpr):
        raise NKITypeError("iota takes an index expression (nl.arange / nl.mgrid)",
                           "err_iota_expr")
    values = expr.values.astype(np.int32)
    if values.ndim == 1:
        values = values[:, None]
    return compute_result("pool", "iota", values, dt.as_dtype(dtype), None, [])


def affine_select(pred, on_true_tile, on_false_value, *, mask=None, dtype=None, **kwargs):
    """``nisa.affine_select(pred, on_true_tile, on_false_value)``: ``where(pred, on_true,
    on_false_value)`` with an affine predicate (GpSimd)."""
    from .indexing import Predicate

    op = tile_operand(on_true_tile, "on_true_tile", "affine_select", allow_psum=False)
    if not isinstance(pred, Predicate):
        raise NKITypeError("affine_select pred must be an affine predicate",
                           "err_unsupported_expression_in_mask")
    values = np.where(np.broadcast_to(pred.values, op.shape), op.f32(),
                      np.float32(on_false_value))
    return compute_result("pool", "affine_select", values, dt.as_dtype(dtype or op.dtype), None,
                          [op])


def tensor_partition_reduce(op, data, *, mask=None, dtype=None, **kwargs):
    """``nisa.tensor_partition_reduce(op, data)``: reduce across the partition axis (GpSimd)."""
    src = tile_operand(data, "data", "tensor_partition_reduce", allow_psum=False)
    spec = fn.lookup(op, "op")
    if spec.name not in ("add", "maximum", "bitwise_or", "bitwise_and"):
        raise NKIValueError(f"op={spec.name} cannot reduce across partitions",
                            "err_unsupported_reduce_op")
    values = spec.reduce(_alu_inputs(spec, src), 0)[None, ...]
    return compute_result("pool", "tensor_partition_reduce", values,
                          dt.as_dtype(dtype or src.dtype), None, [src], free_size=src.free_size)


# --- Tensor engine ---------------------------------------------------------------------------
def nc_matmul(stationary, moving, *, is_stationary_onezero=False, is_moving_onezero=False,
              is_transpose=False, tile_position=(), tile_size=(), mask=None, **kwargs):
    """``nisa.nc_matmul(stationary, moving)``: ``stationary.T @ moving`` on the Tensor engine
    into a new fp32 PSUM tile (products and accumulation in fp32). Stationary ``(K ≤ 128,
    M ≤ 128)``, moving ``(K ≤ 128, N ≤ 512)``, both in SBUF. ``is_transpose=True`` means
    ``moving`` is an identity and the result is ``stationary.T`` (input dtype allowed on
    NeuronCore-v3+). Accumulate with ``psum_tile += nisa.nc_matmul(...)``."""
    st = tile_operand(stationary, "stationary", "nc_matmul", allow_psum=False)
    mv = tile_operand(moving, "moving", "nc_matmul", allow_psum=False)
    if st.partitions != mv.partitions:
        raise NKIValueError(f"nc_matmul contraction mismatch: stationary has {st.partitions} "
                            f"partitions, moving {mv.partitions}", "err_num_partition_mismatch")
    if st.free_size > 128:
        raise NKIValueError(f"nc_matmul stationary free size {st.free_size} exceeds "
                            "gemm_stationary_fmax = 128",
                            "err_size_of_dimension_exceed_arch_limit")
    if mv.free_size > 512:
        raise NKIValueError(f"nc_matmul moving free size {mv.free_size} exceeds "
                            "gemm_moving_fmax = 512", "err_size_of_dimension_exceed_arch_limit")
    for op in (st, mv):
        if dt.is_int(op.dtype):
            raise NKITypeError("nc_matmul takes fp8/bf16/fp16/tf32/fp32 inputs",
                               "err_matmul_dtype")
    if tile_position or tile_size:
        if not (tile_position and tile_size):
            raise NKIValueError("tile_position and tile_size must be given together",
                                "err_tile_position")
        if any(int(v) % 32 for v in tuple(tile_position) + tuple(tile_size)):
            raise NKIValueError("tile_position/tile_size must be multiples of 32",
                                "err_tile_position")
    a = st.f32().reshape(st.partitions, -1)
    b = mv.f32().reshape(mv.partitions, -1)
    result = (a.astype(np.float64).T @ b.astype(np.float64)).astype(np.float32)
    out_dtype = dt.float32
    if is_transpose and current("nc_matmul").target.nc_version >= 3:
        out_dtype = st.dtype
    m = resolve_mask(mask, result.shape)
    return compute_result("pe", "nc_matmul", result, out_dtype, m if m is not False else None,
                          [st, mv], partitions=st.partitions, free_size=mv.free_size,
                          buffer="psum",
                          details={"stationary_free": st.free_size, "transpose": is_transpose,
                                   "fp32": "float32" in (dt.name(st.dtype), dt.name(mv.dtype))})


def nc_transpose(data, *, mask=None, dtype=None, engine=None, **kwargs):
    """``nisa.nc_transpose(data, engine=...)``: transpose partition and free axes (free axes
    collapsed). Tensor engine: ≤ 128×128 into PSUM; Vector engine: ≤ 32×32."""
    op = tile_operand(data, "data", "nc_transpose")
    eng = _engine_name(engine, "pe")
    limit = 32 if eng == "dve" else 128
    if op.partitions > limit or op.free_size > limit:
        raise NKIValueError(f"nc_transpose on the {eng} engine takes at most {limit}×{limit}, "
                            f"got {op.shape}", "err_size_of_dimension_exceed_arch_limit")
    if eng == "pe" and op.memory == "psum":
        raise NKITypeError("Tensor-engine inputs must be in SBUF", "err_unsupported_memory")
    values = op.values.reshape(op.partitions, -1).T
    out_dtype = dt.as_dtype(dtype or op.dtype)
    return compute_result(eng, "nc_transpose", values, out_dtype, None, [op],
                          partitions=op.partitions, free_size=op.free_size,
                          buffer="psum" if eng == "pe" else "sbuf")


# --- DMA -------------------------------------------------------------------------------------
def dma_copy(*, dst, src, mask=None, dst_rmw_op=None, oob_mode=oob_mode.error,
             dge_mode=dge_mode.unknown, **kwargs):
    """``nisa.dma_copy(*, dst, src, mask=None, dst_rmw_op=None, oob_mode=error)``: copy (and
    cast) between HBM and SBUF in any direction; ``dst_rmw_op=np.add`` accumulates into dst.
    Indirect indices address the first axis; ``oob_mode=skip`` drops out-of-range rows."""
    from .language import _contiguous_row_bytes, dma_record

    for name, t in (("dst", dst), ("src", src)):
        if not is_tile(t):
            raise NKITypeError(f"`{name}` of dma_copy must be a tensor", "err_unsupported_memory")
        if t.storage.memory == "psum":
            raise NKITypeError(f"`{name}` of dma_copy cannot be in PSUM",
                               "err_unsupported_memory")
    if dst_rmw_op is not None and oob_mode is not globals()["oob_mode"].error:
        raise NKIValueError("dst_rmw_op requires oob_mode=error", "err_dma_rmw_oob")
    m = resolve_mask(mask, dst.shape)
    if m is False:
        return None
    if isinstance(src, Access):
        values, _ = src.read(None if m is None else np.broadcast_to(m, src.shape))
    else:
        values = src.data
    if int(np.prod(values.shape)) != int(np.prod(dst.shape)):
        raise NKIValueError(f"dma_copy src {tuple(src.shape)} and dst {tuple(dst.shape)} hold "
                            "different numbers of elements", "err_dma_shape_mismatch")
    values = values.reshape(dst.shape)
    if oob_mode is globals()["oob_mode"].skip and isinstance(dst, Access) and dst.indirect:
        axis, idx_tile = dst.indirect
        rows = idx_tile.data.reshape(-1).astype(np.int64)
        keep = (rows >= 0) & (rows < dst.tensor.shape[axis])
        keep = keep.reshape((-1,) + (1,) * (len(dst.shape) - 1))
        m = np.broadcast_to(keep, dst.shape) if m is None else (m & keep)
    if dst_rmw_op is not None:
        spec = fn.lookup(dst_rmw_op, "dst_rmw_op")
        current_values = dst.read(m)[0] if isinstance(dst, Access) else dst.data
        values = spec.apply(dt.compute(current_values), dt.compute(values))
    write_into(dst, dt.compute(values) if dt.is_float(dst.dtype) else values, m,
               accumulate=dst_rmw_op is not None)
    src_mem, dst_mem = src.storage.memory, dst.storage.memory
    direction = f"{src_mem}->{dst_mem}"
    hbm_side = src if src_mem == "hbm" else dst
    if isinstance(hbm_side, Access):
        row = hbm_side.shape[-1] * hbm_side.tensor.itemsize
    else:
        row = _contiguous_row_bytes(hbm_side.data)
    count = int(np.prod(dst.shape)) if m is None else int(np.broadcast_to(m, dst.shape).sum())
    nbytes = count * src.dtype.itemsize
    src_region = src.region() if isinstance(src, Tensor) else src.region(None)
    dst_region = dst.region() if isinstance(dst, Tensor) else dst.region(None)
    from .language import _indirect_inputs

    dma_record("dma_copy", src_region, dst_region, dst.shape[0] if dst.on_chip else
               src.shape[0], nbytes, row, direction, src.dtype, dst.dtype,
               inputs=_indirect_inputs(src) + _indirect_inputs(dst),
               details={"dge_mode": dge_mode.name, "rmw": dst_rmw_op is not None})
    return None


