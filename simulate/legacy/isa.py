"""``neuronxcc.nki.isa`` (``nisa``): one function per hardware instruction.

Each instruction computes in float32 and rounds its output to ``dtype`` (default: the input
dtype; the promoted type for two-input ops). Per-partition operands (``(P, 1)`` tiles or
Python scalars) broadcast along the free axes; nothing broadcasts along the partition axis.
A ``mask=`` restricts the points the instruction computes: masked-off points of a new tile
are uninitialised, masked-off points of a tile it is assigned into keep their values.

The arithmetic is :mod:`simulate.core.semantics` and the rules :mod:`simulate.core.rules`,
shared with the ``nki`` 0.6 front-end; this module binds the legacy signatures to them.
"""

from __future__ import annotations

import enum
import sys

import numpy as np

from ..core import approx as approx_mode
from ..core import dtypes as dt
from ..core import functions as fn
from ..core import rules, sdk
from ..core import semantics as sem
from ..core.errors import NKIIndexError, NKITypeError, NKIValueError
from ..core.indexing import IndexExpr, Predicate, align_mask
from ..core.instructions import (
    allocate,
    check_free_size,
    check_in_scope,
    compute_result,
    dma_record,
    emit,
    extent,
    fill_masked_off,
    indirect_inputs,
    is_tile,
    resolve_mask,
    scalar_or_tile,
    shape_and_par_axis,
    tile_operand,
    work_f32,
    write_into,
)
from ..core.loop_index import LoopIndex, concrete
from ..core.runtime import current
from ..core.tensor import Access, contiguous_row_bytes


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


def _describe(op) -> str:
    """An operand for error messages: name, shape, dtype and memory."""
    source = getattr(op, "source", None)
    name = getattr(source, "name", "") or "tile"
    return f"`{name}` {tuple(op.shape)} {dt.name(op.dtype)} in {op.memory.upper()}"


def _nc_version(api) -> int:
    return current(api).target.nc_version


def _legacy_ops(api, names):
    """Operators of the 0.6 docs only (abs_max, abs_min) are not operators here."""
    for name in names:
        rules.check_alu_op(api, name, "legacy", _nc_version(api))


def _same_partitions(api, *operands):
    counts = {op.partitions for op in operands if op is not None}
    if len(counts) > 1:
        raise NKIValueError(
            f"number of partitions (dimension 0 size of a tile) mismatch in parameters of "
            f"'{api}': {sorted(counts)}",
            "err_num_partition_mismatch",
        )


def _two_tiles(api, a, b):
    """The rules of every two-tile Vector instruction: same partition count, same elements
    per partition, at most one operand in PSUM."""
    _same_partitions(api, a, b)
    if a.free_size != b.free_size:
        raise NKIValueError(
            f"{api} operands have {a.free_size} and {b.free_size} elements per partition",
            "err_num_partition_mismatch",
        )
    if a.memory == "psum" and b.memory == "psum":
        raise NKITypeError(
            f"{api}: at most one tile operand may be in PSUM", "err_unsupported_memory"
        )


def _skipped(shape, dtype):
    """The result of an instruction whose mask selects nothing: it does not run."""
    return allocate(shape, dtype, fill=dt.uninitialised(dtype))


def _check_float32_scalar(value, argname, api, lines):
    """A scalar the docs require in float32: a typed NumPy scalar of another dtype is
    rejected (a plain Python number is weakly typed and taken as float32)."""
    if (
        isinstance(value, (np.generic, np.ndarray))
        and not is_tile(value)
        and (np.asarray(value).dtype != np.float32)
    ):
        raise NKITypeError(
            f"{argname} of nisa.{api} is {np.asarray(value).dtype}: the docs require a float32 "
            f"scalar ({rules.ISA} {lines})",
            "err_unsupported_dtype",
        )


def _valid_partitions(mask, shape):
    """(P, 1) bool: partitions where the mask selects at least one point (None: all)."""
    if mask is None:
        return None
    m = np.broadcast_to(align_mask(mask, shape), shape)
    return m.reshape(shape[0], -1).any(axis=1)[:, None]


def _write_column(dst, values, rows, argname, api):
    """Write a per-partition ``(P, 1)`` result into ``dst``."""
    if not is_tile(dst) or not dst.on_chip:
        raise NKITypeError(
            f"`{argname}` of {api} must be an SBUF/PSUM tile", "err_unsupported_memory"
        )
    if dst.shape[0] != values.shape[0]:
        raise NKIValueError(
            f"`{argname}` of {api} has {dst.shape[0]} partitions, the data has {values.shape[0]}",
            "err_num_partition_mismatch",
        )
    if int(np.prod(dst.shape[1:])) > 1:
        # "a tile of shape (data.shape[0], 1)": activation, activation_reduce, select_reduce,
        # tensor_scalar_reduce; range_select takes the same (P, 1) accumulator read-out
        raise NKIValueError(
            f"`{argname}` of {api} must hold one element per partition (a (P, 1) tile), got "
            f"shape {tuple(dst.shape)} ({rules.ISA} L181, L211-212, L246, L1278, L1725-1726, "
            "L1751)",
            "err_reduce_res_shape",
        )
    write_into(
        dst,
        values.reshape((values.shape[0],) + (1,) * (len(dst.shape) - 1)),
        rows,
        accumulate=False,
    )
    return dst


# --- Scalar engine ---------------------------------------------------------------------------


def activation(
    op,
    data,
    *,
    bias=None,
    scale=1.0,
    reduce_op=None,
    reduce_res=None,
    reduce_cmd=reduce_cmd.idle,
    mask=None,
    dtype=None,
    **kwargs,
):
    """``nisa.activation(op, data, *, bias=None, scale=1.0, reduce_op=None, reduce_res=None,
    reduce_cmd=idle, mask=None, dtype=None)``: ``out = op(data * scale + bias)`` on the Scalar
    engine, in fp32. ``scale`` is a float or a ``(P, 1)`` fp32 tile, ``bias`` a ``(P, 1)`` tile
    (fp32/bf16/fp16). With ``reduce_op``/``reduce_res``/``reduce_cmd`` the engine's fp32
    per-partition accumulator folds in the reduction of ``out`` (its fp32 values) over all
    free axes and ``reduce_res`` receives the accumulator: ``reset`` clears it, ``reduce``
    folds into it, ``reset_reduce`` (and ``idle`` when a ``reduce_res`` is given) does both."""
    spec = fn.lookup(op, "op")
    rules.check_activation_op("nisa.activation", spec.name, "legacy")
    sdk.check_op("nisa.activation", spec.name)
    m = resolve_mask(mask)
    src = tile_operand(data, "data", "activation", mask=m)
    check_free_size(src, "nisa.activation")
    rules.check_allocated_bias("nisa.activation", current("activation").allocated, bias is not None)
    if is_tile(scale):
        if dt.name(scale.dtype) != "float32":
            raise NKITypeError(
                "Scale parameter of activation must be a scalar or vector of type float32",
                "err_activation_scale_invalid_type",
            )
        scale_v, scale_op = scalar_or_tile(
            scale,
            "scale",
            "activation",
            src.partitions,
            key="err_activation_scale_scalar_or_vector",
        )
    elif isinstance(scale, (int, float, np.number)) and not isinstance(scale, bool):
        scale_v, scale_op = np.float32(scale), None
    else:
        raise NKITypeError(
            "Scale parameter of activation must be a scalar or vector of type float32",
            "err_activation_scale_invalid_type",
        )
    bias_v, bias_op = None, None
    if bias is not None:
        if not is_tile(bias) or dt.name(bias.dtype) not in ("float32", "bfloat16", "float16"):
            raise NKITypeError(
                "Bias parameter of activation must be a vector of type float32, "
                "float16, or bfloat16",
                "err_activation_bias_invalid_type",
            )
        bias_v, bias_op = scalar_or_tile(
            bias, "bias", "activation", src.partitions, key="err_activation_bias_invalid_type"
        )
        if spec.name == "reciprocal" and current("activation").target.nc_version == 2:
            raise NKIValueError(
                "activation(nl.reciprocal) with a bias is not supported on NeuronCore-v2",
                "err_unsupported_activation",
            )
    out_dtype = dt.as_dtype(dtype or src.dtype)
    if m is False:
        return _skipped(src.shape, out_dtype)
    values = sem.activation(
        spec,
        work_f32(src, out_dtype),
        scale_v,
        bias_v if bias_op is not None else None,
        approximate=_approximation(),
    )
    details = {"op": spec.name}
    extra = ()
    if reduce_op is not None or reduce_res is not None or reduce_cmd is not reduce_cmd.idle:
        column = _accumulate(values, m, reduce_op, reduce_res, reduce_cmd, src.shape)
        details["reduce"] = True
        if column is not None:
            extra = (column.region(),)
    return compute_result(
        "act",
        "activation",
        values,
        out_dtype,
        m,
        [src, scale_op, bias_op],
        details=details,
        extra_writes=extra,
    )


def _approximation():
    """The Scalar engine's piece-wise polynomial approximation when the run asks for it."""
    return approx_mode.scalar_engine if approx_mode.approx_bound() else None


def _accumulate(values, m, reduce_op, reduce_res, cmd, shape):
    """Update the Scalar engine's accumulator with this instruction's reduction."""
    ctx = current("activation")
    spec = fn.lookup(reduce_op if reduce_op is not None else np.add, "reduce_op")
    if spec.name not in sem.REGISTER_REDUCE_OPS:
        raise NKIValueError(
            f"reduce_op={spec.name} cannot reduce on the Scalar engine", "err_unsupported_reduce_op"
        )
    if spec.name != "add" and ctx.target.nc_version == 2:
        raise NKIValueError(
            "on NeuronCore-v2 the activation reduce_op must be an addition (np.add or nl.add)",
            "err_unsupported_reduce_op",
        )
    valid = None if m is None else np.broadcast_to(align_mask(m, shape), shape)
    reduced = sem.fold_partitions(spec, values, valid)
    acc = ctx.act_accumulator[: shape[0]]
    # reset_reduce, or idle with a reduce_res (spec decision: treated as reset_reduce)
    command = cmd.name if cmd in (reduce_cmd.reset, reduce_cmd.reduce) else "reset_reduce"
    rows = _valid_partitions(m, shape)
    sem.update_registers(acc, spec, reduced, command, rows=None if rows is None else rows[:, 0])
    if reduce_res is None:
        return None
    return _write_column(reduce_res, acc.copy(), rows, "reduce_res", "activation")


def activation_reduce(
    op, data, *, reduce_op, reduce_res, bias=None, scale=1.0, mask=None, dtype=None, **kwargs
):
    """``nisa.activation_reduce(op, data, *, reduce_op, reduce_res, bias=None, scale=1.0)``:
    ``activation`` plus a reduction of its fp32 output over the free axes into
    ``reduce_res[:, 0]`` (reset first). NeuronCore-v2 only reduces with add."""
    if reduce_res is None:
        raise NKIValueError("activation_reduce needs a reduce_res tile", "err_reduce_res_shape")
    out = activation(
        op,
        data,
        bias=bias,
        scale=scale,
        reduce_op=reduce_op,
        reduce_res=reduce_res,
        reduce_cmd=reduce_cmd.reset_reduce,
        mask=mask,
        dtype=dtype,
    )
    if out.fresh is not None:
        out.fresh[0].opcode = "activation_reduce"
    return out


# --- Vector engine ---------------------------------------------------------------------------
def _alu_inputs(spec, op):
    if spec.bitvec:
        if not dt.is_int(op.dtype):
            raise NKITypeError(f"bit operation {spec.name} needs integer data", "err_bitvec_dtype")
        return op.values
    return op.f32()


def _alu_scalar(value, argname, api, src, spec):
    """A ``tensor_scalar``-style scalar operand, raw integers for bit operations."""
    if spec.bitvec:
        if is_tile(value):
            op = tile_operand(value, argname, api)
            if op.free_size != 1 or op.partitions != src.partitions:
                raise NKIValueError(
                    f"`{argname}` of {api} must be a scalar or a (P, 1) tile",
                    "err_scalar_or_vector",
                )
            return op.values.reshape(op.partitions, 1).astype(src.values.dtype), op
        return np.asarray(int(value)).astype(src.values.dtype), None
    return scalar_or_tile(value, argname, api, src.partitions)


def tensor_scalar(
    data,
    op0,
    operand0,
    reverse0=False,
    op1=None,
    operand1=None,
    reverse1=False,
    *,
    dtype=None,
    mask=None,
    engine=None,
    **kwargs,
):
    """``nisa.tensor_scalar(data, op0, operand0, reverse0=False, op1=None, operand1=None,
    reverse1=False)``: ``out = op1(op0(data, operand0), operand1)`` with per-partition
    scalars (a Python number or a ``(P, 1)`` tile) broadcast along the free axes; ``reverse``
    swaps an op's operands. Unary ALU ops (``rsqrt``, ``abs``) ignore their operand."""
    m = resolve_mask(mask)
    src = tile_operand(data, "data", "tensor_scalar", mask=m)
    check_free_size(src, "nisa.tensor_scalar")
    spec0 = fn.lookup(op0, "op0")
    spec1 = fn.lookup(op1, "op1") if op1 is not None else None
    if op1 is None and operand1 is not None:
        raise NKIValueError(
            f'nisa.tensor_scalar: operand1={operand1!r} without op1: "op1 and operand1 are '
            f'optional, but must be None (default values) when unused" ({rules.ISA} L1646)',
            "err_unused_operand",
        )
    if spec1 is not None and spec0.bitvec != spec1.bitvec:
        raise NKIValueError(
            "op0 and op1 must both be arithmetic or both bitvec operators",
            "err_mixed_operator_kinds",
        )
    names = (spec0.name,) + ((spec1.name,) if spec1 else ())
    _legacy_ops("nisa.tensor_scalar", names)
    for name in names:
        sdk.check_op("tensor instruction", name)
    eng = _engine_name(engine, "") or rules.default_engine(names) or "dve"
    rules.check_tensor_scalar_engine(eng, names, _nc_version("tensor_scalar"), _describe(src))
    rules.check_gpsimd_memory(
        "nisa.tensor_scalar",
        eng,
        [src.memory] + [getattr(o, "memory", "sbuf") for o in (operand0, operand1) if is_tile(o)],
        _describe(src),
    )
    out_dtype = dt.as_dtype(dtype or src.dtype)
    s0, s0_op = _alu_scalar(operand0, "operand0", "tensor_scalar", src, spec0)
    inputs = [src, s0_op]
    if m is False:
        return _skipped(src.shape, out_dtype)
    stages = [(spec0, s0, reverse0)]
    if spec1 is not None:
        s1, s1_op = _alu_scalar(operand1, "operand1", "tensor_scalar", src, spec1)
        stages.append((spec1, s1, reverse1))
        inputs.append(s1_op)
    work = None if spec0.bitvec else work_f32(src, out_dtype)
    values = sem.alu_stages(_alu_inputs(spec0, src) if work is None else work, stages, work)
    return compute_result(
        eng, "tensor_scalar", values, out_dtype, m, inputs, details={"op": list(names)}
    )


def tensor_tensor(data1, data2, op, *, dtype=None, mask=None, engine=None, **kwargs):
    """``nisa.tensor_tensor(data1, data2, op)``: elementwise ``op(data1, data2)`` of two tiles
    with the same partition count and elements per partition (not both in PSUM). ``power``
    and integer add/subtract/multiply run exactly on GpSimd."""
    m = resolve_mask(mask)
    a = tile_operand(data1, "data1", "tensor_tensor", mask=m)
    b = tile_operand(data2, "data2", "tensor_tensor", mask=m)
    for o in (a, b):
        check_free_size(o, "nisa.tensor_tensor")
    _two_tiles("tensor_tensor", a, b)
    spec = fn.lookup(op, "op")
    _legacy_ops("nisa.tensor_tensor", (spec.name,))
    exact_int = (
        dt.is_int(a.dtype) and dt.is_int(b.dtype) and spec.name in ("add", "subtract", "multiply")
    )
    sdk.check_op("tensor instruction", spec.name)
    default_engine = "pool" if spec.name == "power" or exact_int else "dve"
    eng = _engine_name(engine, default_engine)
    rules.check_tensor_tensor_engine(
        eng, spec.name, dt.is_int(a.dtype) and dt.is_int(b.dtype), _describe(a)
    )
    rules.check_gpsimd_memory("nisa.tensor_tensor", eng, (a.memory, b.memory), _describe(a))
    out_dtype = dt.as_dtype(dtype or dt.promote(a.dtype, b.dtype))
    if m is False:
        return _skipped(a.shape, out_dtype)
    if spec.bitvec:  # bit operations take the stored integers
        _alu_inputs(spec, a), _alu_inputs(spec, b)
    in_place = not (exact_int or spec.bitvec or spec.name in fn.COMPARISONS)
    values = sem.elementwise(
        spec,
        a.values,
        b.values.reshape(a.shape),
        exact_int=exact_int,
        work=work_f32(a, out_dtype) if in_place else None,
    )
    return compute_result(
        eng, "tensor_tensor", values, out_dtype, m, [a, b], details={"op": spec.name}
    )


def scalar_tensor_tensor(
    *,
    data,
    op0,
    operand0,
    op1,
    operand1,
    reverse0=False,
    reverse1=False,
    dtype=None,
    mask=None,
    **kwargs,
):
    """``nisa.scalar_tensor_tensor(*, data, op0, operand0, op1, operand1)``:
    ``out = op1(op0(data, operand0), operand1)`` with ``operand0`` a scalar or ``(P, 1)`` tile
    and ``operand1`` a tile shaped like ``data`` (Vector engine)."""
    m = resolve_mask(mask)
    src = tile_operand(data, "data", "scalar_tensor_tensor", mask=m)
    other = tile_operand(operand1, "operand1", "scalar_tensor_tensor", mask=m)
    for o in (src, other):
        check_free_size(o, "nisa.scalar_tensor_tensor")
    _two_tiles("scalar_tensor_tensor", src, other)
    spec0, spec1 = fn.lookup(op0, "op0"), fn.lookup(op1, "op1")
    _legacy_ops("nisa.scalar_tensor_tensor", (spec0.name, spec1.name))
    rules.check_alu_engine(
        "nisa.scalar_tensor_tensor",
        "dve",
        (spec0.name, spec1.name),
        _nc_version("scalar_tensor_tensor"),
        _describe(src),
    )
    s0, s0_op = scalar_or_tile(operand0, "operand0", "scalar_tensor_tensor", src.partitions)
    out_dtype = dt.as_dtype(dtype or dt.promote(src.dtype, other.dtype))
    if m is False:
        return _skipped(src.shape, out_dtype)
    work = work_f32(src, out_dtype)
    values = sem.scalar_tensor_tensor(
        spec0, s0, spec1, other.values.reshape(src.shape), work, reverse0, reverse1, work=work
    )
    return compute_result(
        "dve",
        "scalar_tensor_tensor",
        values,
        out_dtype,
        m,
        [src, s0_op, other],
        details={"op": [spec0.name, spec1.name]},
    )


def tensor_reduce(op, data, axis, *, negate=False, keepdims=False, mask=None, dtype=None, **kwargs):
    """``nisa.tensor_reduce(op, data, axis, *, negate=False, keepdims=False)``: reduce along
    ``axis`` (int or list), which must be every free axis of the tile, at most 4
    (:func:`simulate.core.rules.check_legacy_reduce_axes`), on the Vector engine;
    ``subtract`` gives ``x0 - x1 - x2 ...``; ``negate`` multiplies the result by -1."""
    m = resolve_mask(mask)
    src = tile_operand(data, "data", "tensor_reduce", mask=m)
    check_free_size(src, "nisa.tensor_reduce")
    spec = fn.lookup(op, "op")
    rules.check_reduce_op("nisa.tensor_reduce", spec.name, "legacy")
    rules.check_alu_engine(
        "nisa.tensor_reduce", "dve", (spec.name,), _nc_version("tensor_reduce"), _describe(src)
    )
    ndim = src.values.ndim
    axes = tuple(
        sorted({int(a) % ndim for a in (axis if isinstance(axis, (list, tuple)) else (axis,))})
    )
    rules.check_legacy_reduce_axes("nisa.tensor_reduce", axes, ndim, _describe(src))
    if negate and spec.bitvec:
        raise NKIValueError("negate applies to arithmetic reductions only", "err_reduce_negate")
    values = _alu_inputs(spec, src)
    out_dtype = dt.as_dtype(dtype or src.dtype)
    kept = src.shape[: axes[0]]
    if m is False:
        return _skipped(kept + (1,) * len(axes) if keepdims else kept, out_dtype)
    out_mask = valid = None
    flat = values.reshape(kept + (-1,))
    if m is not None:
        valid = np.broadcast_to(align_mask(m, src.shape), src.shape).reshape(flat.shape)
        out_mask = valid.any(axis=-1)
    result = sem.reduce_last(spec, flat, negate, valid)
    if keepdims:
        result = result.reshape(kept + (1,) * len(axes))
        out_mask = None if out_mask is None else out_mask.reshape(result.shape)
    partitions, free = extent(m, src.shape)
    return compute_result(
        "dve",
        "tensor_reduce",
        np.asarray(result),
        out_dtype,
        out_mask,
        [src],
        partitions=partitions,
        free_size=free,
        details={"op": spec.name},
    )


def tensor_scalar_reduce(
    *, data, op0, operand0, reduce_op, reduce_res, reverse0=False, dtype=None, mask=None, **kwargs
):
    """``nisa.tensor_scalar_reduce(*, data, op0, operand0, reduce_op, reduce_res)``:
    ``out = op0(data, operand0)``; ``reduce_res[:, 0] = reduce_op(out over free axes)`` on the
    fp32 values."""
    if reverse0:
        raise NKIValueError("tensor_scalar_reduce does not support reverse0", "err_reverse0")
    spec = fn.lookup(reduce_op, "reduce_op")
    if spec.name not in ("add", "subtract", "multiply", "maximum", "minimum"):
        raise NKIValueError(f"reduce_op={spec.name} is not supported", "err_unsupported_reduce_op")
    if fn.lookup(op0, "op0").bitvec:
        raise NKIValueError(
            f'op0={fn.lookup(op0, "op0").name} of nisa.tensor_scalar_reduce: "op0 can only be '
            'arithmetic operation ... Bitvec operators are not supported in this API" '
            "(general/nki/api/nki/isa/__init__.py@8a38e733 L1719-1721)",
            "err_unsupported_op0",
        )
    out = tensor_scalar(data, op0, operand0, dtype=dtype, mask=mask)
    if out.fresh is None:  # masked off entirely: the instruction does not run
        return out
    inst, m, values = out.fresh
    shape = values.shape
    valid = None if m is None else np.broadcast_to(align_mask(m, shape), shape)
    column = _write_column(
        reduce_res,
        sem.fold_partitions(spec, values, valid),
        _valid_partitions(m, shape),
        "reduce_res",
        "tensor_scalar_reduce",
    )
    inst.opcode = "tensor_scalar_reduce"
    inst.writes = inst.writes + (column.region(),)
    return out


def tensor_tensor_scan(
    data0,
    data1,
    initial,
    op0,
    op1,
    reverse0=False,
    reverse1=False,
    *,
    dtype=None,
    mask=None,
    **kwargs,
):
    """``nisa.tensor_tensor_scan(data0, data1, initial, op0, op1)``: per partition,
    ``r[:, i] = op1(op0(data0[:, i], r[:, i-1]), data1[:, i])`` with ``r[:, -1] = initial``."""
    m = resolve_mask(mask)
    a = tile_operand(data0, "data0", "tensor_tensor_scan")
    b = tile_operand(data1, "data1", "tensor_tensor_scan")
    _two_tiles("tensor_tensor_scan", a, b)
    spec0, spec1 = fn.lookup(op0, "op0"), fn.lookup(op1, "op1")
    for argname, spec in (("op0", spec0), ("op1", spec1)):
        if spec.bitvec:
            raise NKIValueError(
                f'nisa.tensor_tensor_scan: {argname}={spec.name} is a bitvec operator: "Both '
                f'op0 and op1 can be any binary arithmetic operator" ({rules.ISA} L1872-1873, '
                "L1898-1899)",
                "err_unsupported_op",
            )
    _check_float32_scalar(initial, "initial", "tensor_tensor_scan", "L1860-1862")
    _legacy_ops("nisa.tensor_tensor_scan", (spec0.name, spec1.name))
    rules.check_alu_engine(
        "nisa.tensor_tensor_scan",
        "dve",
        (spec0.name, spec1.name),
        _nc_version("tensor_tensor_scan"),
        _describe(a),
    )
    init, init_op = scalar_or_tile(initial, "initial", "tensor_tensor_scan", a.partitions)
    out = sem.scan(
        spec0,
        spec1,
        a.f32().reshape(a.partitions, -1),
        b.f32().reshape(a.partitions, -1),
        init,
        reverse0,
        reverse1,
    )
    out_dtype = dt.as_dtype(dtype or dt.promote(a.dtype, b.dtype))
    if m is False:
        return _skipped(a.shape, out_dtype)
    return compute_result(
        "dve",
        "tensor_tensor_scan",
        out.reshape(a.shape),
        out_dtype,
        m,
        [a, b, init_op],
        details={"op": [spec0.name, spec1.name]},
    )


def tensor_copy(src, *, mask=None, dtype=None, engine=None, **kwargs):
    """``nisa.tensor_copy(src, *, dtype=None, engine=...)``: copy with a cast (Vector by
    default; Scalar or GpSimd on request; GpSimd cannot touch PSUM). Same-dtype copies are
    bit-exact, except on the NeuronCore-v2 Scalar engine, which goes through fp32."""
    m = resolve_mask(mask)
    op = tile_operand(src, "src", "tensor_copy", mask=m)
    check_free_size(op, "nisa.tensor_copy")
    eng = _engine_name(engine, "dve")
    if eng == "pool" and op.memory == "psum":
        raise NKITypeError("GpSimd instructions cannot read PSUM", "err_unsupported_memory")
    out_dtype = dt.as_dtype(dtype or op.dtype)
    if m is False:
        return _skipped(op.shape, out_dtype)
    values = op.values
    if eng == "act" and current("tensor_copy").target.nc_version == 2:
        values = op.f32()
    return compute_result(eng, "tensor_copy", values, out_dtype, m, [op])


def reciprocal(data, *, dtype=None, mask=None, **kwargs):
    """``nisa.reciprocal(data)``: ``1 / data`` on the Vector engine."""
    m = resolve_mask(mask)
    op = tile_operand(data, "data", "reciprocal", mask=m)
    check_free_size(op, "nisa.reciprocal")
    out_dtype = dt.as_dtype(dtype or op.dtype)
    if m is False:
        return _skipped(op.shape, out_dtype)
    values = sem.reciprocal(op.f32())
    return compute_result("dve", "reciprocal", values, out_dtype, m, [op])


def bn_stats(data, *, mask=None, dtype=None, **kwargs):
    """``nisa.bn_stats(data)``: per partition over the flattened free axis (≤ 512 elements),
    ``[n_even, mean_even, M2_even, n_odd, mean_odd, M2_odd]`` of the even- and odd-indexed
    elements (M2 = variance · count). Masked-off elements do not count (an empty group gives
    count 0, mean 0, M2 0); a fully masked-off partition is not computed."""
    m = resolve_mask(mask)
    op = tile_operand(data, "data", "bn_stats", mask=m)
    rules.check_bn_stats_free("nisa.bn_stats", op.free_size, "legacy", _describe(op))
    if m is not None and m is not False:
        aligned = np.broadcast_to(align_mask(m, op.shape), op.shape)
        restricted = [
            axis
            for axis in range(aligned.ndim)
            if not aligned.any(axis=tuple(a for a in range(aligned.ndim) if a != axis)).all()
        ]
        rules.check_bn_stats_mask(restricted, _describe(op))
    out_dtype = dt.as_dtype(dtype or op.dtype)
    if m is False:
        return _skipped((op.partitions, 6), out_dtype)
    x = op.f32().reshape(op.partitions, -1)
    valid = (
        None if m is None else np.broadcast_to(align_mask(m, op.shape), op.shape).reshape(x.shape)
    )
    out = sem.batch_norm_stats(x, valid)
    rows = None if m is None else valid.any(axis=1)[:, None]
    partitions, free = extent(m, op.shape)
    return compute_result(
        "dve", "bn_stats", out, out_dtype, rows, [op], partitions=partitions, free_size=free
    )


def bn_aggr(data, *, mask=None, dtype=None, **kwargs):
    """``nisa.bn_aggr(data)``: combine ``(count, mean, M2)`` triples (free size a multiple of 3)
    into ``[mean, var]`` per partition (population variance)."""
    m = resolve_mask(mask)
    op = tile_operand(data, "data", "bn_aggr", mask=m)
    stats = op.f32().reshape(op.partitions, -1)
    if stats.shape[1] % 3:
        raise NKIValueError("bn_aggr input free size must be a multiple of 3", "err_bn_aggr_shape")
    out_dtype = dt.as_dtype(dtype or op.dtype)
    if m is False:
        return _skipped((op.partitions, 2), out_dtype)
    out = sem.batch_norm_aggregate(stats)
    rows = _valid_partitions(m, op.shape)
    return compute_result("dve", "bn_aggr", out, out_dtype, rows, [op], free_size=op.free_size)


def memset(shape, value, dtype, *, mask=None, engine=None, **kwargs):
    """``nisa.memset(shape, value, dtype)``: a new SBUF tile filled with ``value`` (cast to
    ``dtype``; the first axis is the partition axis, ``par_dim`` markers are ignored)."""
    dtype = dt.as_dtype(dtype)
    shape, _ = shape_and_par_axis(shape)
    m = resolve_mask(mask, shape)
    if m is False:
        return _skipped(shape, dtype)
    values = dt.full(shape, dt.cast(np.asarray(value), dtype), dtype)
    return compute_result(
        _engine_name(engine, "dve"), "memset", values, dtype, m, [], details={"value": float(value)}
    )


def iota(expr, dtype, *, mask=None, **kwargs):
    """``nisa.iota(expr, dtype)``: materialise an index expression (or a loop index) as a
    tile (GpSimd; values computed in int32, then cast). The shape is the expression's
    broadcast shape (a plain integer gives a ``(1, 1)`` tile)."""
    if isinstance(expr, LoopIndex):
        expr = expr.value
    if isinstance(expr, (int, np.integer)) and not isinstance(expr, bool):
        values = np.full((1, 1), int(expr), np.int32)
    elif isinstance(expr, IndexExpr):
        if expr.is_1d:
            raise NKIIndexError(
                "iota of a 1-D arange: give it a second axis (nl.arange(n)[:, None] or [None, :])",
                "err_1d_arange_not_supported",
            )
        values = expr.values.astype(np.int32)
    else:
        raise NKITypeError(
            "iota takes an index expression (nl.arange / nl.mgrid) or a loop index", "err_iota_expr"
        )
    dtype = dt.as_dtype(dtype)
    m = resolve_mask(mask)
    if m is False:
        return _skipped(values.shape, dtype)
    return compute_result("pool", "iota", values, dtype, m, [])


def affine_select(pred, on_true_tile, on_false_value, *, mask=None, dtype=None, **kwargs):
    """``nisa.affine_select(pred, on_true_tile, on_false_value)``: ``where(pred, on_true,
    on_false_value)`` with an affine predicate (GpSimd)."""
    if not isinstance(pred, Predicate):
        raise NKITypeError(
            "affine_select pred must be an affine predicate", "err_unsupported_expression_in_mask"
        )
    rules.check_affine_select_pred(
        len(pred.comparisons), f"on_true_tile `{getattr(on_true_tile, 'name', '') or 'tile'}`"
    )
    if isinstance(on_false_value, (np.generic, np.ndarray)) and on_false_value.dtype != np.float32:
        raise NKITypeError(
            f'on_false_value of nisa.affine_select is {on_false_value.dtype}: "the data type '
            "of on_false_value must be float32, regardless of the input/output tile data "
            'types" (general/nki/api/nki/isa/__init__.py@8a38e733 L286-287)',
            "err_unsupported_dtype",
        )
    m = resolve_mask(mask)
    op = tile_operand(on_true_tile, "on_true_tile", "affine_select", mask=m, allow_psum=False)
    out_dtype = dt.as_dtype(dtype or op.dtype)
    for argname, kind in (("on_true_tile", op.dtype), ("dtype", out_dtype)):
        if dt.is_int(kind) and np.dtype(kind).itemsize > 2:
            raise NKITypeError(
                f'{argname} of nisa.affine_select is {dt.name(kind)}: "This instruction allows '
                f'any float or 8-bit/16-bit integer data types" ({rules.ISA} L282-283)',
                "err_unsupported_dtype",
            )
    if m is False:
        return _skipped(op.shape, out_dtype)
    keep = np.broadcast_to(align_mask(pred.values, op.shape), op.shape)
    values = sem.select(keep, op.f32(), np.float32(on_false_value))
    return compute_result("pool", "affine_select", values, out_dtype, m, [op])


def tensor_partition_reduce(op, data, *, mask=None, dtype=None, **kwargs):
    """``nisa.tensor_partition_reduce(op, data)``: reduce across the partition axis (GpSimd)."""
    src = tile_operand(data, "data", "tensor_partition_reduce", allow_psum=False)
    spec = fn.lookup(op, "op")
    if spec.name not in ("add", "maximum", "bitwise_or", "bitwise_and"):
        raise NKIValueError(
            f"op={spec.name} cannot reduce across partitions", "err_unsupported_reduce_op"
        )
    values = spec.reduce(_alu_inputs(spec, src), 0)[None, ...]
    m = resolve_mask(mask)
    return compute_result(
        "pool",
        "tensor_partition_reduce",
        values,
        dt.as_dtype(dtype or src.dtype),
        None if m is False else m,
        [src],
        free_size=src.free_size,
    )


# --- top-8 search (Vector engine) -----------------------------------------------------------
def _check_top8_rank(api, argname, op, most):
    """ "The data tensor can be up to 5-dimensional, while the vals tensor must be up to
    3-dimensional" (ISA L663, L735-736, L781-782)."""
    if len(op.shape) > most:
        raise NKIValueError(
            f"{argname} of nisa.{api} is {len(op.shape)}-dimensional; at most "
            f"{most} ({rules.ISA} L663, L735-736, L781-782)",
            "err_exceed_max_supported_dimension",
        )


def _top8_data(api, data, m):
    """The data operand of max8 / nc_find_index8 as fp32 ``(P, F)``: 8 to 16,384 elements per
    partition (aws-neuron-sdk@8a38e733 general/nki/api/nki/isa/__init__.py L662, L735)."""
    op = tile_operand(data, "data" if api != "max8" else "src", api, mask=m)
    _check_top8_rank(api, "src" if api == "max8" else "data", op, 5)
    free = int(np.prod(op.shape[1:]))
    if not 8 <= free <= 16384:
        raise NKIValueError(
            f"{api} reads {free} elements per partition; 8 to 16384 are allowed",
            "err_unsupported_free_size",
        )
    return op, op.f32().reshape(op.shape[0], free)


def max8(*, src, mask=None, dtype=None, **kwargs):
    """``nisa.max8(src=...)``: the 8 largest values of each partition, descending, read as
    fp32; output ``[P, 8]`` in ``dtype`` or the input's (legacy ISA reference L655-681)."""
    m = resolve_mask(mask)
    op, values = _top8_data("max8", src, None if m is False else m)
    out_dtype = dt.as_dtype(dtype or op.dtype)
    if m is False:
        return _skipped((op.shape[0], 8), out_dtype)
    return compute_result(
        "dve", "max8", sem.max8(values), out_dtype, None, [op], free_size=values.shape[1]
    )


def nc_find_index8(*, data, vals, mask=None, dtype=None, **kwargs):
    """``nisa.nc_find_index8(data=..., vals=...)``: per partition, the index of the first
    occurrence of each of the 8 ``vals`` (duplicates take successive occurrences, a missing
    value all ones), uint32 unless ``dtype`` says uint16 (legacy ISA reference L727-765;
    aws-neuron-sdk@81ce03ae release-notes/components/nki.rst L75-77)."""
    m = resolve_mask(mask)
    op, values = _top8_data("nc_find_index8", data, None if m is False else m)
    wanted = tile_operand(vals, "vals", "nc_find_index8")
    _check_top8_rank("nc_find_index8", "vals", wanted, 3)
    if wanted.shape[0] != op.shape[0] or int(np.prod(wanted.shape[1:])) != 8:
        raise NKIValueError(
            f"nc_find_index8 vals must be [{op.shape[0]}, 8], got {tuple(wanted.shape)}",
            "err_unsupported_shape",
        )
    out_dtype = dt.as_dtype(dtype or dt.uint32)
    if out_dtype not in (dt.uint16, dt.uint32):
        raise NKITypeError(
            f"nc_find_index8 dtype must be uint16 or uint32, got {out_dtype}",
            "err_unsupported_dtype",
        )
    if m is False:
        return _skipped((op.shape[0], 8), out_dtype)
    missing = (1 << (8 * np.dtype(out_dtype).itemsize)) - 1
    index = sem.find_index8(values, wanted.f32().reshape(op.shape[0], 8), missing)
    return compute_result(
        "dve", "nc_find_index8", index, out_dtype, None, [op, wanted], free_size=values.shape[1]
    )


def nc_match_replace8(*, data, vals, imm, dst_idx=None, mask=None, dtype=None, **kwargs):
    """``nisa.nc_match_replace8(data=, vals=, imm=, dst_idx=None)``: the first not yet
    replaced occurrence of each of the 8 ``vals`` in each partition of ``data`` becomes
    ``imm`` in the returned tile, their indices (over the flattened free dims) go to
    ``dst_idx``; ``vals`` taken from the last (legacy ISA reference L767-800;
    aws-neuron-sdk@81ce03ae release-notes/components/nki.rst L73-74)."""
    api = "nc_match_replace8"
    m = resolve_mask(mask)
    op = tile_operand(data, "data", api, mask=None if m is False else m)
    _check_top8_rank(api, "data", op, 5)
    free = int(np.prod(op.shape[1:]))
    if free > 16384:
        raise NKIValueError(
            f"{api} data has {free} elements per partition; at most 16384",
            "err_unsupported_free_size",
        )
    wanted = tile_operand(vals, "vals", api)
    _check_top8_rank(api, "vals", wanted, 3)
    if wanted.shape[0] != op.shape[0] or int(np.prod(wanted.shape[1:])) != 8:
        raise NKIValueError(
            f"{api} vals must have 8 elements in each of the {op.shape[0]} "
            f"partitions of data, got {tuple(wanted.shape)}",
            "err_unsupported_shape",
        )
    out_dtype = dt.as_dtype(dtype or op.dtype)
    if m is False:
        return _skipped(op.shape, out_dtype)
    values = op.f32().reshape(op.shape[0], free)
    if m is not None:  # masked-off points take no part in the match
        keep = np.broadcast_to(align_mask(m, op.shape), op.shape).reshape(values.shape)
        values = np.where(keep, values, np.float32(np.nan))
    replaced, index = sem.match_replace8(
        values, wanted.f32().reshape(op.shape[0], 8), np.float32(imm), 0xFFFFFFFF
    )
    extra = ()
    if dst_idx is not None:
        write_into(dst_idx, index.reshape(tuple(dst_idx.shape)), None)
        extra = (dst_idx.region(),)
    return compute_result(
        "dve",
        api,
        replaced.reshape(op.shape),
        out_dtype,
        m,
        [op, wanted],
        free_size=free,
        extra_writes=extra,
    )


_RANGE_COMPARISONS = ("equal", "less", "less_equal", "greater", "greater_equal")
_FP32_MIN = float(np.finfo(np.float32).min)


def range_select(
    *,
    on_true_tile,
    comp_op0,
    comp_op1,
    bound0,
    bound1,
    reduce_cmd=reduce_cmd.idle,
    reduce_res=None,
    reduce_op=np.amax,
    range_start=0,
    on_false_value=_FP32_MIN,
    mask=None,
    dtype=None,
    **kwargs,
):
    """``nisa.range_select(...)``: ``on_true_tile`` where the free index + ``range_start``
    passes both comparisons with the per-partition fp32 bounds, else ``on_false_value``
    (FP32_MIN only); the row maxima fold into the Vector accumulator per ``reduce_cmd`` and
    reach ``reduce_res`` when given (legacy ISA reference L1084-1160; NeuronCore-v3+)."""
    api = "range_select"
    ctx = current(api)
    if ctx.target.nc_version < 3:
        raise NKIValueError(
            f"{api} is available only on NeuronCore-v3 and newer", "err_unsupported_target"
        )
    op = tile_operand(on_true_tile, "on_true_tile", api)
    if not dt.is_float(op.dtype):
        raise NKITypeError(
            f'on_true_tile of nisa.{api} is {dt.name(op.dtype)}: it "must be one '
            f'of the FP dtypes" ({rules.ISA} L1128)',
            "err_unsupported_dtype",
        )
    start = concrete(range_start)
    if isinstance(start, bool) or not isinstance(start, (int, np.integer)):
        raise NKITypeError(
            f'range_start of nisa.{api} is {range_start!r}: it "must be a '
            f'compiler time integer" ({rules.ISA} L1161-1162)',
            "err_unsupported_value",
        )
    partitions = op.shape[0]
    if abs(int(start)) + int(np.prod(op.shape[1:])) > 1 << 24:
        raise NKIValueError(
            f"nisa.{api}: range_start {start} + the free index leaves the "
            f"2^24 range the fp32 comparison is exact in ({rules.ISA} L1130-1131)",
            "err_unsupported_value",
        )
    specs = []
    for argname, compare in (("comp_op0", comp_op0), ("comp_op1", comp_op1)):
        spec = fn.lookup(compare, argname)
        if spec.name not in _RANGE_COMPARISONS:
            raise NKIValueError(
                f"{api} {argname} must be one of {', '.join(_RANGE_COMPARISONS)}, got {spec.name}",
                "err_unsupported_compare_op",
            )
        specs.append(spec)
    bounds = []
    for argname, bound in (("bound0", bound0), ("bound1", bound1)):
        b = tile_operand(bound, argname, api)
        if b.shape[0] != partitions or b.values.size != partitions:
            raise NKIValueError(
                f"{api} {argname} must hold one element per partition", "err_unsupported_shape"
            )
        if dt.name(b.dtype) != "float32":
            raise NKITypeError(
                f"{api} {argname} must be float32, got {dt.name(b.dtype)}", "err_unsupported_dtype"
            )
        bounds.append(b)
    if np.float32(on_false_value) != np.float32(_FP32_MIN):
        raise NKIValueError(
            f"{api} on_false_value must be fp32.min, got {on_false_value!r}",
            "err_unsupported_on_false_value",
        )
    spec = fn.lookup(reduce_op, "reduce_op")
    if spec.name != "maximum":
        raise NKIValueError(
            f"{api} reduce_op must be a maximum, got {spec.name}", "err_unsupported_reduce_op"
        )
    m = resolve_mask(mask)
    out_dtype = dt.as_dtype(dtype or op.dtype)
    if m is False:
        return _skipped(op.shape, out_dtype)
    values = sem.range_select(
        op.f32().reshape(partitions, -1),
        bounds[0].f32().reshape(partitions, 1),
        bounds[1].f32().reshape(partitions, 1),
        specs[0],
        specs[1],
        int(concrete(range_start)),
        on_false_value,
    )
    acc = ctx.vector_accumulator[:partitions]
    sem.update_registers(acc, spec, sem.fold_partitions(spec, values), reduce_cmd.name)
    extra = ()
    if reduce_res is not None:
        extra = (_write_column(reduce_res, acc.copy(), None, "reduce_res", api).region(),)
    return compute_result(
        "dve", api, values.reshape(op.shape), out_dtype, m, [op, *bounds], extra_writes=extra
    )


def nc_stream_shuffle(src, dst, shuffle_mask, *, dtype=None, mask=None, **kwargs):
    """``nisa.nc_stream_shuffle(src, dst, shuffle_mask)``: output partition ``i`` of each
    32-partition quadrant of ``dst`` takes partition ``shuffle_mask[i]`` of the same quadrant
    of ``src`` (255: unchanged); in place allowed; ``mask`` restricts what ``dst`` receives;
    same dtype and elements per partition (legacy ISA reference L959-1000)."""
    api = "nc_stream_shuffle"
    source = tile_operand(src, "src", api)
    target = tile_operand(dst, "dst", api)
    order = [int(concrete(k)) for k in shuffle_mask]
    if len(order) != sem.QUADRANT or any(
        not (0 <= k < sem.QUADRANT or k == sem.SHUFFLE_KEEP) for k in order
    ):
        raise NKIValueError(
            f"{api} shuffle_mask must be 32 partition numbers in [0, 32) or 255, got {order}",
            "err_unsupported_shuffle_mask",
        )
    if source.dtype != target.dtype:
        raise NKITypeError(
            f"{api} dst dtype {dt.name(target.dtype)} must equal src dtype {dt.name(source.dtype)}",
            "err_unsupported_dtype",
        )
    rows = [1 if op.values.ndim < 2 else op.shape[0] for op in (source, target)]
    active = -(-max(rows) // sem.QUADRANT) * sem.QUADRANT
    starts = {128: (0,), 96: (0,), 64: (0, 64), 32: (0, 32, 64, 96)}[active]
    for argname, op in (("src", source), ("dst", target)):
        first = op.region.partitions[0] if op.region is not None else 0
        if first not in starts:
            raise NKIValueError(
                f"nisa.{api}: {argname} starts at partition {first}; with {active} active "
                f"partitions the start partition must be one of {list(starts)} ({rules.ISA} "
                "L980-989)",
                "err_unsupported_start_partition",
            )
    per_row = [op.values.size // n for op, n in zip((source, target), rows)]
    if per_row[0] != per_row[1]:
        raise NKIValueError(
            f"{api} src has {per_row[0]} elements per partition, dst {per_row[1]}: they must match",
            "err_unsupported_shape",
        )
    try:
        values = sem.stream_shuffle(
            source.values.reshape(rows[0], -1), target.values.reshape(rows[1], -1), order
        )
    except IndexError as exc:
        raise NKIValueError(
            f"{api} shuffle_mask reads partition {exc.args[0]} of src, which "
            f"has {rows[0]} partitions",
            "err_unsupported_shuffle_mask",
        ) from None
    shape = tuple(dst.shape)
    m = resolve_mask(mask, shape)
    if m is False:
        return None
    write_into(dst, values.reshape(shape), m)
    emit(
        "dve",
        api,
        inputs=[source, target],
        outputs=[dst.region(m)],
        partitions=rows[1],
        free_size=per_row[1],
        out_dtype=target.dtype,
    )
    return None


def sequence_bounds(*, segment_ids, dtype=None, **kwargs):
    """``nisa.sequence_bounds(segment_ids=)``: per element the start and one-past-the-end
    of its run of equal segment ids (padding id 0: ``n`` and ``-1``), as ``(1, 2, n)`` on
    GpSimd; one partition; float32 or int32 in and out (legacy ISA reference
    sequence_bounds)."""
    api = "sequence_bounds"
    op = tile_operand(segment_ids, "segment_ids", api, allow_psum=False)
    if op.shape[0] != 1:
        raise NKIValueError(
            f"{api} segment_ids must have one partition, got {op.shape[0]}",
            "err_num_partition_mismatch",
        )
    out_dtype = dt.as_dtype(dtype or op.dtype)
    for argname, kind in (("segment_ids", op.dtype), ("dtype", out_dtype)):
        if dt.name(kind) not in ("float32", "int32"):
            raise NKITypeError(
                f"{api} {argname} must be float32 or int32, got {dt.name(kind)}",
                "err_unsupported_dtype",
            )
    ids = op.values.reshape(-1)
    values = sem.sequence_bounds(ids)[None].astype(np.float64)
    return compute_result(
        "pool", api, values, out_dtype, None, [op], partitions=1, free_size=ids.size
    )


# --- copies at a run-time offset, dropout, local gather --------------------------------------
_DYNAMIC_COPY_ENGINES = ("dve", "act", "pool")


def _dynamic_offset_access(value, argname, api):
    """The dynamically indexed side of a tensor_copy_dynamic_*: an SBUF/PSUM access whose
    one run-time offset is a one-element integer SBUF tile (legacy ISA reference L1428,
    L1461: "The dynamic offset must be a scalar value resided in SBUF"), on a free axis
    ("located at a dynamic offset within each partition", L1421, L1453)."""
    if not isinstance(value, Access) or value.dynamic is None:
        raise NKIValueError(
            f"`{argname}` of nisa.{api} must be a tile indexed at a run-time offset "
            "(t[ix, offset_tile[0, i] + iy]); for a static copy use nisa.tensor_copy",
            "err_unsupported_dynamic_access",
        )
    offset = value.dynamic[1]
    memory = offset.tile.storage.memory
    if not offset.scalar or memory != "sbuf":
        raise NKIValueError(
            f"the dynamic offset of `{argname}` of nisa.{api} must be a scalar value in SBUF "
            f"(a one-element tile), got shape {tuple(offset.tile.shape)} in "
            f"{memory.upper()} (aws-neuron-sdk@8a38e733 general/nki/api/nki/isa/"
            "__init__.py L1428, L1461)",
            "err_unsupported_dynamic_access",
        )
    return offset


def _dynamic_copy_engine(engine_arg, api, *operands):
    eng = _engine_name(engine_arg, "dve")
    if eng not in _DYNAMIC_COPY_ENGINES:
        raise NKIValueError(
            f"nisa.{api} runs on the Vector, Scalar or GpSimd engine, not {engine_arg}",
            "err_unsupported_engine",
        )
    if eng == "pool" and any(op.memory == "psum" for op in operands):
        raise NKITypeError(
            "GpSimd instructions cannot read or write PSUM", "err_unsupported_memory"
        )
    return eng


def tensor_copy_dynamic_src(src, *, mask=None, dtype=None, engine=None, **kwargs):
    """``nisa.tensor_copy_dynamic_src(src)``: copy an SBUF/PSUM tile whose free-axis index
    holds a run-time offset (a scalar SBUF value) into a new tile, with a cast to ``dtype``
    (legacy ISA reference L1450-1491). Cost ``max(MIN_II_DYNAMIC, N)``, MIN_II_DYNAMIC about
    600 engine cycles (L1467-1471)."""
    api = "tensor_copy_dynamic_src"
    offset = _dynamic_offset_access(src, "src", api)
    m = resolve_mask(mask)
    op = tile_operand(src, "src", api, mask=None if m is False else m, dynamic_offset=True)
    check_free_size(op, f"nisa.{api}")
    eng = _dynamic_copy_engine(engine, api, op)
    out_dtype = dt.as_dtype(dtype or op.dtype)
    if m is False:
        return _skipped(op.shape, out_dtype)
    values = op.values if out_dtype == op.dtype else op.f32()
    offset_operand = tile_operand(offset.tile, "offset", api)
    return compute_result(eng, "tensor_copy_dynamic", values, out_dtype, m, [op, offset_operand])


def tensor_copy_dynamic_dst(*, dst, src, mask=None, dtype=None, engine=None, **kwargs):
    """``nisa.tensor_copy_dynamic_dst(dst=, src=)``: write ``src`` into an SBUF/PSUM tile
    whose free-axis index holds a run-time offset (a scalar SBUF value); same partitions and
    elements per partition (legacy ISA reference L1418-1448). Returns None."""
    api = "tensor_copy_dynamic_dst"
    offset = _dynamic_offset_access(dst, "dst", api)
    m = resolve_mask(mask)
    source = tile_operand(src, "src", api, mask=None if m is False else m)
    target_memory = dst.storage.memory
    if not dst.on_chip:
        raise NKITypeError(f"`dst` of nisa.{api} must be in SBUF or PSUM", "err_unsupported_memory")
    dst_partitions = dst.shape[0]
    dst_free = int(np.prod(dst.shape[1:]))
    if source.partitions != dst_partitions or source.free_size != dst_free:
        raise NKIValueError(
            f"nisa.{api}: src {tuple(source.shape)} and dst {tuple(dst.shape)} need the same "
            "partitions and elements per partition (legacy ISA reference L1425-1426)",
            "err_num_partition_mismatch",
        )
    eng = _dynamic_copy_engine(engine, api, source)
    if eng == "pool" and target_memory == "psum":
        raise NKITypeError("GpSimd instructions cannot write PSUM", "err_unsupported_memory")
    if m is False:
        return None
    values = source.values.reshape(dst.shape)
    if dtype is not None:
        values = dt.cast(source.f32().reshape(dst.shape), dt.as_dtype(dtype))
    write_into(dst, values, m, dynamic_offset=True)
    emit(
        eng,
        "tensor_copy_dynamic",
        inputs=[source, tile_operand(offset.tile, "offset", api)],
        outputs=[dst.region(m)],
        partitions=dst_partitions,
        free_size=dst_free,
        out_dtype=dst.dtype,
    )
    return None


def dropout(data, prob, *, mask=None, dtype=None, **kwargs):
    """``nisa.dropout(data, prob)``: each element becomes 0 with its partition's drop
    probability ``prob`` (a number, or a ``(P, 1)`` float tile), on the Vector engine; an
    integer ``data`` needs an fp32 ``prob`` and keeps its dtype (legacy ISA reference
    L499-547). The draws come from the kernel's ``nl.random_seed`` stream."""
    api = "dropout"
    m = resolve_mask(mask)
    op = tile_operand(data, "data", api, mask=None if m is False else m)
    check_free_size(op, f"nisa.{api}")
    integer = dt.is_int(op.dtype)
    if is_tile(prob):
        prob_op = tile_operand(prob, "prob", api)
        if prob_op.shape != (op.partitions, 1) and prob_op.values.size != op.partitions:
            raise NKIValueError(
                f"`prob` of nisa.{api} is a number or a ({op.partitions}, 1) "
                f"tile, got {tuple(prob_op.shape)}",
                "err_unsupported_shape",
            )
        prob_dtype = dt.name(prob_op.dtype)
        if integer and prob_dtype != "float32" or not dt.is_float(prob_op.dtype):
            raise NKITypeError(
                f"`prob` of nisa.{api} must be float32 for integer data and a float type "
                f"otherwise, got {prob_dtype} with {dt.name(op.dtype)} data (legacy ISA "
                "reference L516-520)",
                "err_unsupported_dtype",
            )
        probability = prob_op.f32().reshape(op.partitions, *([1] * (len(op.shape) - 1)))
        inputs = [op, prob_op]
    else:
        probability = np.float32(concrete(prob))
        inputs = [op]
    out_dtype = dt.as_dtype(dtype or op.dtype)
    if integer and out_dtype != op.dtype:
        raise NKITypeError(
            f"nisa.{api} of {dt.name(op.dtype)} data must keep its dtype, got "
            f"dtype={dt.name(out_dtype)} (legacy ISA reference L522-525)",
            "err_unsupported_dtype",
        )
    if m is False:
        return _skipped(op.shape, out_dtype)
    uniform = current(f"nisa.{api}").rng.random(op.shape, dtype=np.float32)
    values = sem.dropout(op.values if integer else op.f32(), probability, uniform)
    return compute_result("dve", api, values, out_dtype, m, inputs)


_LOCAL_GATHER_CORES, _PARTITIONS_PER_GPSIMD_CORE = 8, sem.GPSIMD_CORE_PARTITIONS
_LOCAL_GATHER_ELEMENTS_PER_INDEX = (1, 2, 4, 8, 16, 32)
_LOCAL_GATHER_MAX_INDICES = 4096


def local_gather(src_buffer, index, num_elem_per_idx=1, num_valid_indices=None, *, mask=None):
    """``nisa.local_gather(src_buffer, index, num_elem_per_idx=1, num_valid_indices=None)``:
    each of the eight GpSimd cores gathers, for its 16 partitions, ``num_elem_per_idx``
    contiguous elements at each of its first ``num_valid_indices`` uint16 indices (element
    offsets into a partition's free axis), in ``src_buffer``'s dtype. Rules: partitions
    equal and a multiple of 16, ``num_elem_per_idx`` in 1..32 (powers of two), at most 4096
    indices per core, ``num_valid_indices`` at most the indices a core holds; an index past
    the partition is rejected (undefined on hardware) (legacy ISA reference L582-653)."""
    api = "nisa.local_gather"
    m = resolve_mask(mask)
    src = tile_operand(src_buffer, "src_buffer", api, allow_psum=False)
    idx = tile_operand(index, "index", api, allow_psum=False)
    if dt.name(idx.dtype) != "uint16":
        raise NKITypeError(
            f"`index` of {api} must be uint16, got {dt.name(idx.dtype)} "
            "(legacy ISA reference L618)",
            "err_unsupported_dtype",
        )
    if src.partitions != idx.partitions or src.partitions % _PARTITIONS_PER_GPSIMD_CORE:
        raise NKIValueError(
            f"{api}: src_buffer and index need the same partition count, a multiple of 16; "
            f"got {src.partitions} and {idx.partitions} (legacy ISA reference L622-623)",
            "err_num_partition_mismatch",
        )
    num_elem_per_idx = int(concrete(num_elem_per_idx))
    if num_elem_per_idx not in _LOCAL_GATHER_ELEMENTS_PER_INDEX:
        raise NKIValueError(
            f"num_elem_per_idx of {api} must be one of "
            f"{list(_LOCAL_GATHER_ELEMENTS_PER_INDEX)}, got {num_elem_per_idx} "
            "(legacy ISA reference L624-625)",
            "err_unsupported_value",
        )
    cores = src.partitions // _PARTITIONS_PER_GPSIMD_CORE
    per_core = idx.values.size // cores
    num_valid = per_core if num_valid_indices is None else int(concrete(num_valid_indices))
    if not 0 < num_valid <= per_core:
        raise NKIValueError(
            f"num_valid_indices of {api} must be 1 to the {per_core} indices "
            f"a core holds, got {num_valid} (legacy ISA reference L596-598)",
            "err_unsupported_value",
        )
    if num_valid > _LOCAL_GATHER_MAX_INDICES:
        raise NKIValueError(
            f"{api} gathers {num_valid} indices per core; at most 4096 (legacy ISA reference L626)",
            "err_unsupported_value",
        )
    flat = src.values.reshape(src.partitions, -1)
    indices = idx.values.reshape(idx.partitions, -1)
    if m is False:
        return _skipped((src.partitions, num_valid * num_elem_per_idx), src.dtype)
    used = np.concatenate(
        [
            indices[
                c * _PARTITIONS_PER_GPSIMD_CORE : (c + 1) * _PARTITIONS_PER_GPSIMD_CORE
            ].flatten(order="F")[:num_valid]
            for c in range(cores)
        ]
    )
    last = int(used.max()) + num_elem_per_idx
    if last > flat.shape[1]:
        raise IndexError(
            f"{api}: an index reads up to element {last - 1} of a partition of "
            f"{flat.shape[1]} elements (out-of-bound behaviour is undefined, "
            "legacy ISA reference L603)"
        )
    values = sem.local_gather(flat, indices, num_elem_per_idx, num_valid)
    if num_valid == per_core:
        # every index: (P, K, 16, E), index column-major over the core's 16 partitions, the
        # shape AWS's example annotates (general/nki/test/test_nki_isa_local_gather.py L32)
        values = values.reshape(
            src.partitions,
            per_core // _PARTITIONS_PER_GPSIMD_CORE,
            _PARTITIONS_PER_GPSIMD_CORE,
            num_elem_per_idx,
        )
    else:  # the docs give no shape; inferred: (P, num_valid_indices, E)
        values = values.reshape(src.partitions, num_valid, num_elem_per_idx)
    return compute_result(
        "pool",
        "local_gather",
        values,
        src.dtype,
        m,
        [src, idx],
        details={
            "gather_elements": num_valid * num_elem_per_idx,
            "elements_per_index": num_elem_per_idx,
        },
    )


_PREDICATE_DTYPES = ("uint8", "uint16", "uint32", "bool")


def tensor_copy_predicated(
    *, src, dst, predicate, reverse_pred=False, mask=None, dtype=None, **kwargs
):
    """``nisa.tensor_copy_predicated(src=, dst=, predicate=)``: ``dst`` takes ``src`` (a
    tile or a number) where ``predicate`` is nonzero (zero with ``reverse_pred``) and keeps its
    data elsewhere; same partitions and elements per partition, ``src`` and ``dst`` of one
    dtype, not both ``src`` and ``predicate`` in PSUM (legacy ISA reference L1493-1540). The
    predicate is uint8/16/32 by the docs; a bool tile is taken as uint8, as AWS's own example
    loads ``np.less_equal(a, 0.8)`` (general/nki/test/test_nki_isa_copypredicated.py L31,
    L51)."""
    api = "tensor_copy_predicated"
    pred = tile_operand(predicate, "predicate", api)
    target = tile_operand(dst, "dst", api)
    if dt.name(pred.dtype) not in _PREDICATE_DTYPES:
        raise NKITypeError(
            f"{api} predicate must be uint8, uint16 or uint32, got {dt.name(pred.dtype)}",
            "err_unsupported_dtype",
        )
    shape = tuple(dst.shape)
    rows, per_row = target.shape[0], target.values.size // target.shape[0]
    if pred.shape[0] != rows or pred.values.size // pred.shape[0] != per_row:
        raise NKIValueError(
            f"{api} predicate {tuple(pred.shape)} and dst {shape} need the same "
            "partitions and elements per partition",
            "err_unsupported_shape",
        )
    inputs = [pred, target]
    if is_tile(src):
        source = tile_operand(src, "src", api)
        if source.dtype != target.dtype:
            raise NKITypeError(
                f"{api} src and dst must share a dtype, got "
                f"{dt.name(source.dtype)} and {dt.name(target.dtype)}",
                "err_unsupported_dtype",
            )
        if source.memory == "psum" and pred.memory == "psum":
            raise NKIValueError(
                f"{api} src and predicate cannot both be in PSUM", "err_unsupported_memory"
            )
        if source.values.size != target.values.size:
            raise NKIValueError(
                f"{api} src {tuple(source.shape)} and dst {shape} differ in size",
                "err_unsupported_shape",
            )
        values = source.values.reshape(shape)
        inputs.insert(0, source)
    else:
        values = np.full(shape, concrete(src))
    keep = pred.values.reshape(shape) != 0
    if reverse_pred:
        keep = ~keep
    m = resolve_mask(mask, shape)
    if m is False:
        return None
    write_into(dst, np.where(keep, values, target.values.reshape(shape)), m)
    emit(
        "dve",
        "select",
        inputs=inputs,
        outputs=[dst.region(m)],
        partitions=rows,
        free_size=per_row,
        out_dtype=target.dtype,
    )
    return None


_SELECT_PREDICATE_DTYPES = ("int8", "uint8", "int16", "uint16", "bool")


def select_reduce(
    *,
    dst,
    predicate,
    on_true,
    on_false,
    reduce_res=None,
    reduce_cmd=reduce_cmd.idle,
    reduce_op=np.amax,
    reverse_pred=False,
    mask=None,
    dtype=None,
    **kwargs,
):
    """``nisa.select_reduce(...)``: ``dst = where(predicate, on_true, on_false)`` (``on_false``
    a number or a ``(P, 1)`` tile; ``reverse_pred`` flips the predicate), the row maxima
    folded into the Vector accumulator per ``reduce_cmd`` (shared with range_select) and
    written to ``reduce_res`` if given; predicate int8/uint8/int16/uint16 (a bool tile taken
    as uint8), ``on_true`` not tfloat32/int32/uint32, not both ``on_true`` and ``predicate``
    in PSUM, ``reduce_op`` max only (legacy ISA reference L1249-1320)."""
    api = "select_reduce"
    ctx = current(api)
    pred = tile_operand(predicate, "predicate", api)
    data = tile_operand(on_true, "on_true", api)
    if dt.name(pred.dtype) not in _SELECT_PREDICATE_DTYPES:
        raise NKITypeError(
            f"{api} predicate must be int8, uint8, int16 or uint16, got {dt.name(pred.dtype)}",
            "err_unsupported_dtype",
        )
    if dt.name(data.dtype) in ("tfloat32", "int32", "uint32"):
        raise NKITypeError(
            f"{api} on_true cannot be {dt.name(data.dtype)}", "err_unsupported_dtype"
        )
    if data.memory == "psum" and pred.memory == "psum":
        raise NKIValueError(
            f"{api} on_true and predicate cannot both be in PSUM", "err_unsupported_memory"
        )
    rows = data.shape[0]
    shape = tuple(dst.shape)
    if pred.values.size != data.values.size or data.values.size != int(np.prod(shape)):
        raise NKIValueError(
            f"{api} dst, predicate and on_true need the same shape", "err_unsupported_shape"
        )
    spec = fn.lookup(reduce_op, "reduce_op")
    if spec.name != "maximum":
        raise NKIValueError(
            f"{api} reduce_op must be a maximum, got {spec.name}", "err_unsupported_reduce_op"
        )
    if is_tile(on_false):
        other = tile_operand(on_false, "on_false", api)
        if other.values.size != rows:
            raise NKIValueError(
                f"{api} on_false must be a number or a ({rows}, 1) tile", "err_unsupported_shape"
            )
        fallback = other.f32().reshape(rows, 1)
    else:
        _check_float32_scalar(on_false, "on_false", api, "L1275")
        fallback = np.float32(concrete(on_false))
    if reduce_res is not None and is_tile(reduce_res) and not dt.is_float(reduce_res.dtype):
        raise NKITypeError(
            f'reduce_res of nisa.{api} is {dt.name(reduce_res.dtype)}: "reduce_res dtype must '
            f'of float type" ({rules.ISA} L1279)',
            "err_unsupported_dtype",
        )
    keep = pred.values.reshape(rows, -1) != 0
    if reverse_pred:
        keep = ~keep
    values = np.where(keep, data.f32().reshape(rows, -1), fallback).astype(np.float32)
    acc = ctx.vector_accumulator[:rows]
    sem.update_registers(acc, spec, sem.fold_partitions(spec, values), reduce_cmd.name)
    m = resolve_mask(mask, shape)
    if m is False:
        return None
    write_into(dst, values.reshape(shape), m)
    outputs = [dst.region(m)]
    if reduce_res is not None:
        outputs.append(_write_column(reduce_res, acc.copy(), None, "reduce_res", api).region())
    emit(
        "dve",
        "select",
        inputs=[data, pred],
        outputs=outputs,
        partitions=rows,
        free_size=values.shape[1],
        out_dtype=dt.as_dtype(dtype or data.dtype),
    )
    return None


# --- Tensor engine ---------------------------------------------------------------------------
def _operand_valid(op) -> np.ndarray:
    """(K, F) bool of the points of a matmul operand that were read (operand masks)."""
    shape = (op.partitions, op.free_size)
    if op.mask is None:
        return np.ones(shape, bool)
    return np.broadcast_to(align_mask(op.mask, op.shape), op.shape).reshape(shape)


_DOUBLE_ROW_DTYPES = ("float8_e4m3", "float8_e5m2")


def _double_row(perf_mode, st, mv, tiling) -> bool:
    """``perf_mode="double_row_gen3"``: Tensor Engine FP8 double-row mode. The legacy API
    reference does not list it; AWS's legacy example runs it on trn2
    (aws-neuron-sdk@8a38e733 general/nki/test/test_nki_isa_nc_matmul.py L83-98), and the 0.6
    reference states its rules (aws-neuron-sdk@81ce03ae nki/api/nki/isa/__init__.py
    L504-511, L582-600): NeuronCore-v3+, both inputs float8_e4m3/float8_e5m2, the first free
    axis of both tiles of size 2 (it joins the contraction), no PE tiling."""
    if perf_mode is None:
        return False
    if perf_mode != "double_row_gen3":
        raise NKIValueError(
            f"nc_matmul perf_mode={perf_mode!r}: the one mode is 'double_row_gen3'",
            "err_unsupported_perf_mode",
        )
    version = _nc_version("nc_matmul")
    kinds = {dt.name(st.dtype), dt.name(mv.dtype)}
    if version < 3 or not kinds <= set(_DOUBLE_ROW_DTYPES):
        raise NKITypeError(
            f"nc_matmul perf_mode='double_row_gen3' needs float8_e4m3/float8_e5m2 inputs on "
            f"NeuronCore-v3+, got {sorted(kinds)} on NeuronCore-v{version}",
            "err_unsupported_perf_mode",
        )
    if len(st.shape) < 3 or len(mv.shape) < 3 or st.shape[1] != 2 or mv.shape[1] != 2:
        raise NKIValueError(
            f"nc_matmul perf_mode='double_row_gen3' needs tiles [K, 2, ...], got stationary "
            f"{tuple(st.shape)} and moving {tuple(mv.shape)}",
            "err_unsupported_perf_mode",
        )
    if tiling:
        raise NKIValueError(
            "nc_matmul perf_mode='double_row_gen3' cannot be combined with PE "
            "tiling (tile_position / tile_size)",
            "err_unsupported_perf_mode",
        )
    return True


def nc_matmul(
    stationary,
    moving,
    *,
    is_stationary_onezero=False,
    is_moving_onezero=False,
    is_transpose=False,
    tile_position=(),
    tile_size=(),
    mask=None,
    **kwargs,
):
    """``nisa.nc_matmul(stationary, moving)``: ``stationary.T @ moving`` on the Tensor engine
    into a new fp32 PSUM tile (exact products, fp32 accumulation). Stationary ``(K ≤ 128,
    M ≤ 128)``, moving ``(K ≤ 128, N ≤ 512)``, both in SBUF. Operand masks
    (``moving[...][mask]``) drop the masked-off points from the contraction and leave the
    output rows/columns they produce uncomputed. ``is_transpose=True`` means ``moving`` is an
    identity and the result is ``stationary.T`` (exact and NaN-safe on NeuronCore-v3+).
    The result is float32 whatever the inputs, transposes included: "The matmul
    accumulation and results are always in float32" (general/nki/api/nki/isa/__init__.py@
    8a38e733, L876), so it may be assigned or accumulated only into a float32 PSUM tile
    (:func:`simulate.core.rules.check_legacy_matmul_result`). Accumulate with
    ``psum_tile += nisa.nc_matmul(...)``."""
    st = tile_operand(stationary, "stationary", "nc_matmul", allow_psum=False, operand_mask=True)
    mv = tile_operand(moving, "moving", "nc_matmul", allow_psum=False, operand_mask=True)
    if st.partitions != mv.partitions:
        raise NKIValueError(
            f"nc_matmul contraction mismatch: stationary has {st.partitions} "
            f"partitions, moving {mv.partitions}",
            "err_num_partition_mismatch",
        )
    double_row = _double_row(kwargs.pop("perf_mode", None), st, mv, tile_position or tile_size)
    rows = 2 if double_row else 1
    rules.check_matmul_free_sizes(
        "nisa.nc_matmul",
        st.free_size // rows,
        mv.free_size // rows,
        "legacy",
        _nc_version("nc_matmul"),
        tile=_describe(mv),
    )
    rules.check_matmul_inputs(
        "nisa.nc_matmul", dt.name(st.dtype), dt.name(mv.dtype), "legacy", _nc_version("nc_matmul")
    )
    if tile_position or tile_size:
        if not (tile_position and tile_size) or len(tile_position) != 2 or len(tile_size) != 2:
            raise NKIValueError(
                "tile_position and tile_size must both be (row, column) pairs", "err_tile_position"
            )
        if any(int(v) % 32 for v in (*tile_position, *tile_size)):
            raise NKIValueError(
                "tile_position/tile_size must be multiples of 32", "err_tile_position"
            )
        if _nc_version("nc_matmul") == 2 and 32 in (int(tile_size[0]), int(tile_size[1])):
            raise NKIValueError(
                f'tile_size {tuple(tile_size)}: "Both the row and column sizes in tile_size '
                'cannot be 32 for NeuronCore-v2" (general/nki/api/nki/isa/__init__.py@8a38e733'
                " L933; the PE array tiles into 2 x 64 rows there, aws-neuron-sdk@81ce03ae "
                "nki/api/nki/isa/__init__.py L517-518)",
                "err_tile_position",
            )
        if (
            int(tile_size[0]) < st.partitions
            or int(tile_size[1]) < st.free_size
            or any(int(p) + int(s) > 128 for p, s in zip(tile_position, tile_size))
        ):
            raise NKIValueError(
                "tile_size must cover the stationary tile and fit in the 128x128 "
                "array at tile_position",
                "err_tile_position",
            )
    version = current("nc_matmul").target.nc_version
    # double_row: the second axis (2) joins the contraction, [K, 2, M] x [K, 2, N]
    a = st.f32().reshape(st.partitions * rows, -1)
    b = mv.f32().reshape(mv.partitions * rows, -1)
    out_dtype = dt.float32
    if is_transpose:
        if not sem.is_identity(b):
            raise NKIValueError(
                "is_transpose=True needs an identity matrix as moving", "err_transpose_identity"
            )
        result = np.ascontiguousarray(a.T) if version >= 3 else None
    else:
        result = None
    valid_a, valid_b = _operand_valid(st), _operand_valid(mv)
    if result is None:
        a = np.where(valid_a, a, 0.0) if st.mask is not None else a
        b = np.where(valid_b, b, 0.0) if mv.mask is not None else b
        result = sem.matmul(a, b)
    out_mask = None
    if st.mask is not None or mv.mask is not None:
        out_mask = valid_a.any(axis=0)[:, None] & valid_b.any(axis=0)[None, :]
    m = resolve_mask(mask)
    if m is False:
        return _skipped(result.shape, out_dtype)
    if m is not None:
        m = align_mask(m, result.shape)
        out_mask = m if out_mask is None else out_mask & m
    return compute_result(
        "pe",
        "nc_matmul",
        result,
        out_dtype,
        out_mask,
        [st, mv],
        partitions=st.partitions,
        free_size=mv.free_size // rows,
        buffer="psum",
        details={
            "stationary_free": st.free_size,
            "transpose": is_transpose,
            "fp32": "float32" in (dt.name(st.dtype), dt.name(mv.dtype)),
        },
    )


def nc_transpose(data, *, mask=None, dtype=None, engine=None, **kwargs):
    """``nisa.nc_transpose(data, engine=...)``: transpose partition and free axes (free axes
    collapsed). Tensor engine: ≤ 128×128 into PSUM; Vector engine: ≤ 32×32."""
    op = tile_operand(data, "data", "nc_transpose")
    eng = _engine_name(engine, "pe")
    if eng == "pe":
        rules.check_allocated_transpose("nisa.nc_transpose", current("nc_transpose").allocated)
    rules.check_transpose_size(
        "nisa.nc_transpose", eng, op.partitions, op.free_size, "legacy", _describe(op)
    )
    if eng == "pe" and op.memory == "psum":
        raise NKITypeError("Tensor-engine inputs must be in SBUF", "err_unsupported_memory")
    values = sem.transpose(op.values)
    out_dtype = dt.as_dtype(dtype or op.dtype)
    m = resolve_mask(mask)
    return compute_result(
        eng,
        "nc_transpose",
        values,
        out_dtype,
        None if m is False else m,
        [op],
        partitions=op.partitions,
        free_size=op.free_size,
        buffer="psum" if eng == "pe" else "sbuf",
    )


# --- DMA -------------------------------------------------------------------------------------
def _dma_operand(t, name):
    if not is_tile(t):
        raise NKITypeError(
            f"`{name}` of dma_copy must be a tensor, got {type(t).__name__}",
            "err_unsupported_memory",
        )
    check_in_scope(t, f"operand '{name}' of 'dma_copy'")
    if t.storage.memory == "psum":
        raise NKITypeError(
            f"Expected operand '{name}' of 'dma_copy' to be in address space "
            "'hbm|sbuf', but got a tile in 'psum' instead",
            "err_unsupported_memory",
        )


def _in_range_rows(access, shape):
    """Mask (aligned to ``shape``) of the points whose indirect row index is in range."""
    if not isinstance(access, Access) or access.indirect is None:
        return None
    axis, index_tile = access.indirect
    rows = access._arrays()[axis]
    keep = (rows >= 0) & (rows < access.tensor.shape[axis])
    keep = np.broadcast_to(keep, access.shape)
    return keep.reshape(shape)


def _read_any(src, mask):
    """Values of an HBM or SBUF tensor / access where ``mask`` holds."""
    if isinstance(src, Access):
        return src.read(mask)[0]
    if mask is None:
        return src.data
    out = np.array(src.data, copy=True)
    fill_masked_off(out, align_mask(mask, out.shape), dt.uninitialised(src.dtype))
    return out


def dma_copy(
    *,
    dst,
    src,
    mask=None,
    dst_rmw_op=None,
    oob_mode=oob_mode.error,
    dge_mode=dge_mode.unknown,
    **kwargs,
):
    """``nisa.dma_copy(*, dst, src, mask=None, dst_rmw_op=None, oob_mode=error)``: copy (and
    cast) between HBM and SBUF in any direction; ``dst_rmw_op=np.add`` accumulates into dst.
    Indirect indices address the first axis; with ``oob_mode=skip`` out-of-range rows are
    not transferred (the destination keeps its data)."""
    _dma_operand(dst, "dst")
    _dma_operand(src, "src")
    rules.check_dst_rmw(
        None if dst_rmw_op is None else fn.lookup(dst_rmw_op, "dst_rmw_op").name,
        dst.storage.memory,
        f"dst `{dst.name or 'tensor'}`",
    )
    skip = oob_mode is globals()["oob_mode"].skip
    if dst_rmw_op is not None and skip:
        raise NKIValueError("dst_rmw_op requires oob_mode=error", "err_dma_rmw_oob")
    ctx = current("dma_copy")
    if dge_mode is globals()["dge_mode"].hwdge and ctx.target.nc_version < 3:
        raise NKIValueError("dge_mode=hwdge needs NeuronCore-v3 or later", "err_dge_mode")
    if src.size != dst.size:
        raise NKIValueError(
            f"dma_copy src {tuple(src.shape)} and dst {tuple(dst.shape)} hold "
            "different numbers of elements",
            "err_dma_shape_mismatch",
        )
    shape = tuple(dst.shape)
    m = resolve_mask(mask, shape)
    if m is False:
        return None
    if skip:
        for side in (dst, src):
            keep = _in_range_rows(side, shape)
            if keep is not None:
                full = keep if m is None else (np.broadcast_to(m, shape) & keep)
                m = None if full.all() else full
        if m is not None and not np.asarray(m).any():
            return None
    src_mask = None
    if m is not None:
        src_mask = np.broadcast_to(m, shape).reshape(src.shape)
    values = _read_any(src, src_mask).reshape(shape)
    if dst_rmw_op is not None:
        spec = fn.lookup(dst_rmw_op, "dst_rmw_op")
        values = sem.dma_accumulate(spec, _read_any(dst, m), values)
    write_into(dst, values, m, accumulate=dst_rmw_op is not None)
    src_mem, dst_mem = src.storage.memory, dst.storage.memory
    hbm_side = dst if dst_mem == "hbm" and src_mem != "hbm" else src
    full_m = None if m is None else np.broadcast_to(m, shape)
    count = dst.size if full_m is None else int(full_m.sum())
    side_mask = src_mask if hbm_side is src else m
    row = (
        hbm_side.row_bytes(side_mask)
        if isinstance(hbm_side, Access)
        else (contiguous_row_bytes(hbm_side.data))
    )
    chip_mask, chip = (m, dst) if dst.on_chip or not src.on_chip else (src_mask, src)
    dma_record(
        "dma_copy",
        src.region(src_mask),
        dst.region(m),
        extent(chip_mask, chip.shape)[0],
        count * hbm_side.itemsize,
        row,
        f"{src_mem}->{dst_mem}",
        src.dtype,
        dst.dtype,
        inputs=indirect_inputs(src) + indirect_inputs(dst),
        details={"dge_mode": dge_mode.name, "rmw": dst_rmw_op is not None},
    )
    return None


def dma_transpose(src, *, axes=None, mask=None, dtype=None, **kwargs):
    """``nisa.dma_transpose(src, *, axes=None)``: a transposed copy of an HBM or SBUF tile into
    a new SBUF tile (DMA); the permutation is (1, 0), (2, 1, 0) or (3, 1, 2, 0) by rank."""
    _dma_operand(src, "src")
    mode = kwargs.get("dge_mode", dge_mode.unknown)
    if mode is dge_mode.hwdge and current("dma_transpose").target.nc_version < 3:
        raise NKIValueError(
            f"nisa.dma_transpose: dge_mode=hwdge needs NeuronCore-v3 or later "
            f'("HWDGE is only supported for NeuronCore-v3+", {rules.ISA} L483)',
            "err_dge_mode",
        )
    if isinstance(src, Access) and src.indirect is not None:
        raise NKIIndexError(
            "dma_transpose does not support indirect indices",
            "err_indirect_indices_are_not_supported_with_nki_api",
        )
    default = sem.DMA_TRANSPOSE_AXES
    rank = len(src.shape)
    if rank not in default:
        raise NKIValueError(
            "dma_transpose takes a 2-D to 4-D tile", "err_exceed_max_supported_dimension"
        )
    perm = tuple(axes) if axes is not None else default[rank]
    if perm != default[rank]:
        raise NKIValueError(
            f"dma_transpose supports the permutation {default[rank]} for rank {rank}, got {perm}",
            "err_dma_transpose_axes",
        )
    values = np.transpose(_read_any(src, None), perm)
    out_dtype = dt.as_dtype(dtype or src.dtype)
    m = resolve_mask(mask)
    if m is False:
        return _skipped(values.shape, out_dtype)
    from ..core.instructions import finish, result_tile

    tile = result_tile(values, out_dtype, m)
    inst = dma_record(
        "dma_transpose",
        src.region(),
        tile.region(),
        tile.shape[0],
        src.size * src.itemsize,
        src.itemsize,
        f"{src.storage.memory}->sbuf",
        src.dtype,
        out_dtype,
    )
    return finish(tile, inst, m, None)


sdk.gate_module(sys.modules[__name__], "nisa")
