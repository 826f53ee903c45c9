"""``neuronxcc.nki.language`` (``nl``): tensor creation, data movement, elementwise math,
reductions, indexing helpers and iterators.

High-level ``nl`` calls lower to engine instructions as the NKI compiler does (tutorial
lowering): unary transcendental functions run on the Scalar engine (``activation``), tile ⊗
per-partition-scalar arithmetic on the Vector engine (``tensor_scalar``), tile ⊗ tile on the
Vector engine (``tensor_tensor``), reductions on the Vector engine (``tensor_reduce``),
``load``/``store`` on the DMA queues, ``matmul``/``transpose`` on the Tensor engine.
"""

from __future__ import annotations

import builtins

import numpy as np

from . import dtypes as dt
from . import functions as fn
from .dtypes import (  # noqa: F401 - re-exported NKI names
    bfloat16,
    bfp16,
    bool_,
    float8_e4m3,
    float8_e5m2,
    float16,
    float32,
    fp32,
    int8,
    int16,
    int32,
    tfloat32,
    uint8,
    uint16,
    uint32,
)
from .errors import NKITypeError, NKIValueError
from .indexing import arange, ds, mgrid  # noqa: F401
from .instructions import (
    Operand,
    align_shapes,
    allocate,
    check_free_size,
    compute_result,
    emit,
    finish,
    is_tile,
    resolve_mask,
    result_tile,
    tile_operand,
    write_into,
)
from .runtime import (  # noqa: F401
    affine_range,
    current,
    nc,
    num_programs,
    program_id,
    program_ndim,
    sequential_range,
    spmd_dim,
    static_range,
)
from .targets import tile_size  # noqa: F401
from .tensor import Access, Tensor, par_dim  # noqa: F401

# --- buffers ---------------------------------------------------------------------------------
sbuf = "sbuf"
psum = "psum"
hbm = "private_hbm"
private_hbm = "private_hbm"
shared_hbm = "shared_hbm"
_BUFFERS = {sbuf, psum, hbm, private_hbm, shared_hbm}


def _buffer(buffer) -> str:
    if buffer is None:
        return sbuf
    name = getattr(buffer, "__nki_buffer__", buffer)
    if name not in _BUFFERS:
        raise NKIValueError(f"buffer={buffer!r} is not one of nl.sbuf, nl.psum, nl.hbm, "
                            "nl.private_hbm, nl.shared_hbm", "err_unsupported_buffer")
    return name


# --- creation --------------------------------------------------------------------------------
def ndarray(shape, dtype, *, buffer=None, name="", **kwargs):
    """``nl.ndarray(shape, dtype, *, buffer=None, name="")``: an uninitialised tensor
    (SBUF by default; ``nl.shared_hbm`` for kernel outputs, created at the kernel's top level).
    """
    buffer = _buffer(buffer)
    ctx = current("nl.ndarray")
    if buffer == shared_hbm:
        return _shared_hbm(ctx, shape, dtype, name)
    fill = dt.uninitialised(dt.as_dtype(dtype))
    return allocate(shape, dtype, buffer, name, fill=fill)


def _shared_hbm(ctx, shape, dtype, name):
    import sys

    if ctx.loops:
        raise NKIValueError("shared_hbm tensors must be created at the kernel's top level, not "
                            "inside a loop", "err_shared_hbm_must_in_kernel_level")
    caller = sys._getframe(2).f_code
    if ctx.kernel_code is not None and caller is not ctx.kernel_code:
        raise NKIValueError(
            f"shared_hbm tensor `{name}` must be created in the kernel function itself, not in "
            f"helper `{caller.co_name}`", "err_shared_hbm_must_in_kernel_level")
    index = ctx.shared_hbm_cursor
    ctx.shared_hbm_cursor += 1
    if index < len(ctx.shared_hbm):  # every SPMD instance maps to the same output
        tensor = ctx.shared_hbm[index]
        if tensor.shape != tuple(int(s) for s in shape):
            raise NKIValueError("SPMD instances allocate different shared_hbm shapes",
                                "err_shared_hbm_shape")
        return tensor
    tensor = allocate(shape, dtype, shared_hbm, name, fill=dt.uninitialised(dt.as_dtype(dtype)))
    ctx.shared_hbm.append(tensor)
    return tensor


def _filled(shape, value, dtype, buffer, name, api):
    buffer = _buffer(buffer)
    if buffer not in (sbuf, psum):
        raise NKIValueError(f"{api} cannot create an HBM tensor with an initial value",
                            "err_hbm_tensor_with_init_value_not_supported")
    dtype = dt.as_dtype(dtype)
    tile = allocate(shape, dtype, buffer, name, fill=dt.cast(np.asarray(value), dtype))
    inst = emit("dve", "memset", outputs=[tile.region()], partitions=tile.shape[0],
                free_size=int(np.prod(tile.shape[1:])), out_dtype=dtype,
                details={"value": float(value)})
    tile.fresh = (inst, None, None)
    return tile


def zeros(shape, dtype, *, buffer=None, name="", **kwargs):
    """``nl.zeros``: a zero-filled SBUF/PSUM tensor (a Vector-engine memset)."""
    return _filled(shape, 0, dtype, buffer, name, "nl.zeros")


def ones(shape, dtype, *, buffer=None, name="", **kwargs):
    """``nl.ones``: a one-filled SBUF/PSUM tensor."""
    return _filled(shape, 1, dtype, buffer, name, "nl.ones")


def full(shape, fill_value, dtype, *, buffer=None, name="", **kwargs):
    """``nl.full``: an SBUF/PSUM tensor filled with ``fill_value``."""
    return _filled(shape, fill_value, dtype, buffer, name, "nl.full")


def empty_like(a, dtype=None, *, buffer=None, name="", **kwargs):
    """``nl.empty_like``: an uninitialised tensor of ``a``'s shape (and dtype unless given)."""
    return ndarray(a.shape, dtype or a.dtype, buffer=buffer, name=name)


def zeros_like(a, dtype=None, *, buffer=None, name="", **kwargs):
    """``nl.zeros_like``."""
    return zeros(a.shape, dtype or a.dtype, buffer=buffer, name=name)


def ones_like(a, dtype=None, *, buffer=None, name="", **kwargs):
    """``nl.ones_like``."""
    return ones(a.shape, dtype or a.dtype, buffer=buffer, name=name)


def full_like(a, fill_value, dtype=None, *, buffer=None, name="", **kwargs):
    """``nl.full_like``."""
    return full(a.shape, fill_value, dtype or a.dtype, buffer=buffer, name=name)


def shared_constant(constant, dtype=None, **kwargs):
    """``nl.shared_constant(np_array, dtype=None)``: a constant HBM tensor (load before use)."""
    array = np.asarray(constant)
    dtype = dt.as_dtype(dtype or array.dtype)
    tensor = allocate(array.shape, dtype, "constant", "constant",
                      fill=dt.cast(array, dtype).copy())
    tensor.storage.written = True
    return tensor


def shared_identity_matrix(n, dtype=uint8, **kwargs):
    """``nl.shared_identity_matrix(n, dtype=uint8)``: an identity matrix in HBM."""
    return shared_constant(np.identity(n), dtype)


_rng = np.random.default_rng(0)


def random_seed(seed, **kwargs):
    """``nl.random_seed(seed)``: seed ``nl.rand``."""
    global _rng
    _rng = np.random.default_rng(int(seed))


def rand(shape, dtype=float32, **kwargs):
    """``nl.rand(shape, dtype=float32)``: uniform [0, 1) in SBUF."""
    values = _rng.random(tuple(shape), dtype=np.float32)
    return compute_result("pool", "rand", values, dt.as_dtype(dtype), None, [])


# --- data movement ---------------------------------------------------------------------------
def _hbm_source(src, api):
    if not is_tile(src):
        raise NKITypeError(f"`src` of {api} must be an HBM tensor (indexed), got "
                           f"{type(src).__name__}", "err_unsupported_memory")
    if src.on_chip:
        raise NKITypeError(
            f"Expected operand 'src' of '{api}' to be in address space 'hbm', but got a tile in "
            f"'{src.storage.memory}'", "err_unsupported_memory")


def _contiguous_row_bytes(array: np.ndarray) -> int:
    """Contiguous bytes per partition row of an HBM access (one DMA descriptor)."""
    run = array.itemsize
    for n, stride in zip(reversed(array.shape[1:]), reversed(array.strides[1:]), strict=True):
        if stride != run and n > 1:
            break
        run *= n
    return run


def dma_record(opcode, src_region, dst_region, partitions, nbytes, row_bytes, direction,
               in_dtype, out_dtype, inputs=(), details=None):
    """Append a DMA transfer to the trace."""
    ops = [Operand.__new__(Operand)]
    ops[0].region, ops[0].dtype = src_region, in_dtype
    return emit("dma", opcode, inputs=ops + list(inputs), outputs=[dst_region],
                partitions=partitions, free_size=nbytes // builtins.max(1, partitions),
                out_dtype=out_dtype, details=details or {},
                dma={"dma_bytes": int(nbytes), "dma_direction": direction,
                     "dma_row_bytes": int(row_bytes)})


def load(src, *, mask=None, dtype=None, **kwargs):
    """``nl.load(src, *, mask=None, dtype=None)``: HBM → a new SBUF tile (DMA).

    The first axis of the access becomes the partition axis (≤ 128). Masked-off points are
    never read; they hold the uninitialised value in the result.
    """
    _hbm_source(src, "load")
    shape = tuple(src.shape)
    if len(shape) == 1:
        shape = shape + (1,)
    m = resolve_mask(mask, src.shape)
    out_dtype = dt.as_dtype(dtype or src.dtype)
    if m is False:
        return allocate(shape, out_dtype, fill=dt.uninitialised(out_dtype))
    if isinstance(src, Access):
        values, m = src.read(m)
        src_region = src.region(m)
        row_bytes = src.shape[-1] * src.tensor.itemsize if src.ndim > 1 else src.tensor.itemsize
    else:
        values = src.data
        src_region = src.region()
        row_bytes = _contiguous_row_bytes(src.data)
    tile = result_tile(values.reshape(shape) if values.shape != shape else values, out_dtype,
                       None if m is None else m.reshape(shape))
    count = values.size if m is None else int(m.sum())
    inst = dma_record("load", src_region, tile.region(), shape[0], count * src.tensor.itemsize
                      if isinstance(src, Access) else count * src.itemsize, row_bytes,
                      "hbm->sbuf", src.dtype, out_dtype,
                      inputs=_indirect_inputs(src))
    return finish(tile, inst, m, None)


def _indirect_inputs(access):
    if isinstance(access, Access) and access.indirect is not None:
        tile = access.indirect[1]
        return [Operand(tile.data, tile.dtype, tile.storage.memory, tile.region(), tile)]
    return []


def store(dst, value, *, mask=None, **kwargs):
    """``nl.store(dst, value, *, mask=None)``: write a tile (SBUF, or PSUM from 2.26) or a
    scalar into the HBM view ``dst`` (DMA). Masked-off points of ``dst`` are not written."""
    if not is_tile(dst) or dst.on_chip:
        raise NKITypeError("Expected operand 'dst' of 'store' to be in address space 'hbm'",
                           "err_unsupported_memory")
    if dst.storage.kind == "constant":
        raise NKIValueError("cannot store into a shared constant", "err_store_to_constant")
    m = resolve_mask(mask, dst.shape)
    if m is False:
        return None
    if is_tile(value):
        op = tile_operand(value, "value", "store")
        values, in_dtype, src_region = op.values, op.dtype, op.region
        partitions = op.partitions
    else:
        values = np.asarray(value, dtype=np.float32)
        in_dtype, src_region, partitions = dt.float32, None, dst.shape[0] if dst.shape else 1
    write_into(dst, values, m)
    count = int(np.prod(dst.shape)) if m is None else int(np.broadcast_to(m, dst.shape).sum())
    if isinstance(dst, Access):
        region, row = dst.region(m), dst.shape[-1] * dst.tensor.itemsize
    else:
        region, row = dst.region(), _contiguous_row_bytes(dst.data)
    nbytes = count * dst.dtype.itemsize
    src = src_region if src_region is not None else region
    direction = "psum->hbm" if is_tile(value) and value.storage.memory == "psum" else "sbuf->hbm"
    dma_record("store", src, region, partitions, nbytes, row, direction, in_dtype, dst.dtype,
               inputs=_indirect_inputs(dst))
    return None


def load_transpose2d(src, *, mask=None, dtype=None, **kwargs):
    """``nl.load_transpose2d(src)``: load a 2-D HBM block transposed (DMA)."""
    _hbm_source(src, "load_transpose2d")
    if len(src.shape) != 2:
        raise NKIValueError("load_transpose2d takes a 2-D access",
                            "err_exceed_max_supported_dimension")
    values, _ = src.read(None) if isinstance(src, Access) else (src.data, None)
    values = values.T
    out_dtype = dt.as_dtype(dtype or src.dtype)
    tile = result_tile(np.ascontiguousarray(values), out_dtype, None)
    itemsize = src.tensor.itemsize if isinstance(src, Access) else src.itemsize
    inst = dma_record("load_transpose2d", src.region(), tile.region(), tile.shape[0],
                      values.size * itemsize, itemsize, "hbm->sbuf", src.dtype, out_dtype)
    return finish(tile, inst, None, None)


def assign(dst, value) -> None:
    """``tile[...] = value``: write an instruction's result (or copy a tile, with a cast) into
    an SBUF/PSUM tile."""
    if not dst.on_chip:
        raise NKITypeError(
            f"cannot assign into HBM tensor `{dst.name}` with '=': use nl.store",
            "err_unsupported_memory")
    fresh = getattr(value, "fresh", None)
    ctx = current("assignment")
    if isinstance(value, Tensor) and value.storage is dst.storage and \
            value.data.__array_interface__ == dst.data.__array_interface__:
        return  # `t[...] += x` already updated t in place
    if fresh is not None and ctx.trace.instructions and fresh[0] is ctx.trace.instructions[-1]:
        inst, m, f32 = fresh
        values = f32 if f32 is not None else value.data
        if m is not None and values.shape != tuple(dst.shape):
            m = None if m.all() else m
        write_into(dst, values, m)
        inst.writes = (dst.region(),)
        inst.out_dtype = dt.name(dst.dtype)
        return
    if is_tile(value):
        op = tile_operand(value, "value", "assignment")
        write_into(dst, op.values, None)
        emit("dve", "tensor_copy", inputs=[op], outputs=[dst.region()], partitions=op.partitions,
             free_size=op.free_size, out_dtype=dst.dtype)
        return
    if isinstance(value, (int, float, np.number, bool)):
        write_into(dst, np.asarray(value, dtype=np.float32), None)
        emit("dve", "memset", outputs=[dst.region()], partitions=dst.shape[0],
             free_size=int(np.prod(dst.shape[1:])), out_dtype=dst.dtype)
        return
    raise NKITypeError(f"cannot assign {type(value).__name__} into a tile",
                       "err_unsupported_assignment")


def accumulate(dst, value, op_name: str) -> None:
    """``tile += value`` (and ``-=``, ``*=``, ``/=``): in place, in fp32. Accumulating a fresh
    ``nc_matmul`` result into a PSUM tile is the matmul's own PSUM accumulation."""
    ctx = current("in-place update")
    fresh = getattr(value, "fresh", None)
    spec = fn.lookup(op_name)
    if isinstance(value, Tensor) or isinstance(value, Access):
        src = tile_operand(value, "value", f"{op_name}=")
        rhs = src.f32()
    else:
        src, rhs = None, np.float32(value)
    current_values = dt.compute(dst.data)
    lhs, rhs_aligned = align_shapes(current_values, rhs) if src is not None else (current_values,
                                                                                   rhs)
    result = spec.apply(lhs, rhs_aligned)
    write_into(dst, result, None, accumulate=True)
    last = ctx.trace.instructions[-1] if ctx.trace.instructions else None
    if (fresh is not None and fresh[0] is last and last.opcode == "nc_matmul"
            and dst.storage.memory == "psum" and op_name == "add"):
        last.writes = (dst.region(),)
        last.details["accumulate"] = True
        return
    dst_op = Operand(dst.data, dst.dtype, dst.storage.memory, dst.region(), dst)
    emit("dve", "tensor_tensor" if src is not None else "tensor_scalar",
         inputs=[dst_op, src], outputs=[dst.region()], partitions=dst.shape[0],
         free_size=int(np.prod(dst.shape[1:])), out_dtype=dst.dtype,
         details={"op": op_name, "accumulate": True})


def copy(src, *, mask=None, dtype=None, **kwargs):
    """``nl.copy(src, *, mask=None, dtype=None)``: copy (and cast) a tile (Vector engine)."""
    op = tile_operand(src, "src", "copy")
    out_dtype = dt.as_dtype(dtype or op.dtype)
    m = resolve_mask(mask, op.shape)
    if m is False:
        return allocate(op.shape, out_dtype, fill=dt.uninitialised(out_dtype))
    check_free_size(op, "nl.copy")
    return compute_result("dve", "tensor_copy", op.values, out_dtype, m, [op])


def static_cast(data, dtype, **kwargs):
    """``nl.static_cast(data, dtype)``: cast a tile, or a NumPy array / scalar outside a
    kernel (round to nearest even)."""
    if is_tile(data):
        return copy(data, dtype=dtype)
    return dt.cast(np.asarray(data), dt.as_dtype(dtype))


def broadcast_to(src, *, shape, **kwargs):
    """``nl.broadcast_to(src, *, shape)``: NumPy broadcast of a tile, including the partition
    broadcast ``(1, F) → (P, F)``; returns ``src`` unchanged when the shape already matches."""
    shape = tuple(int(s) for s in shape)
    if tuple(src.shape) == shape:
        return src
    op = tile_operand(src, "src", "broadcast_to")
    try:
        values = np.broadcast_to(op.values, shape)
    except ValueError as exc:
        raise NKIValueError(f"cannot broadcast a tile of shape {op.shape} to {shape}",
                            "err_broadcast_shape") from exc
    engine_op = "partition_broadcast" if op.partitions != shape[0] else "tensor_copy"
    return compute_result("dve", engine_op, values, op.dtype, None, [op],
                          details={"from_partitions": op.partitions})


def expand_dims(data, axis, **kwargs):
    """``nl.expand_dims(data, axis)``: add a size-1 free axis after the last axis."""
    if axis not in (data.ndim, -1):
        raise NKIValueError("expand_dims adds an axis after the last axis only",
                            "err_expand_dims_axis")
    if isinstance(data, Tensor):
        return Tensor(data.data[..., None], data.dtype, data.storage, par_axis=data.par_axis,
                      loops=data.loops)
    raise NKITypeError("expand_dims takes a tile", "err_expand_dims_type")


def transpose(x, *, dtype=None, mask=None, **kwargs):
    """``nl.transpose(x)``: swap partition and free axes of a 2-D tile (Tensor engine, ≤128
    on both axes; result in PSUM)."""
    op = tile_operand(x, "x", "transpose", allow_psum=False)
    if len(op.shape) > 2:
        raise NKIValueError("transpose takes a 2-D tile", "err_exceed_max_supported_dimension")
    if op.shape[0] > 128 or op.shape[1] > 128:
        raise NKIValueError(f"transpose of a {op.shape} tile: both dims must be ≤ 128",
                            "err_size_of_dimension_exceed_arch_limit")
    out_dtype = dt.as_dtype(dtype or op.dtype)
    return compute_result("pe", "nc_transpose", op.values.T, out_dtype, None, [op],
                          partitions=op.shape[0], free_size=op.shape[1], buffer=psum)


def matmul(x, y, *, transpose_x=False, mask=None, **kwargs):
    """``nl.matmul(x, y, *, transpose_x=False)``: ``x @ y`` (or ``x.T @ y``) on the Tensor
    engine; x ≤ 128×128, y (K ≤ 128, ≤ 512); returns an fp32 PSUM tile."""
    from . import isa

    if transpose_x:
        return isa.nc_matmul(x, y, mask=mask)
    op = tile_operand(x, "x", "matmul", allow_psum=False)
    xt = transpose(x) if not transpose_x else x
    xt_sb = copy(xt, dtype=op.dtype)
    return isa.nc_matmul(xt_sb, y, mask=mask)


def where(condition, x, y, *, dtype=None, mask=None, **kwargs):
    """``nl.where(condition, x, y)``: elementwise select (Vector engine)."""
    c = tile_operand(condition, "condition", "where")
    xv = tile_operand(x, "x", "where") if is_tile(x) else None
    yv = tile_operand(y, "y", "where") if is_tile(y) else None
    xa = xv.f32() if xv else np.float32(x)
    ya = yv.f32() if yv else np.float32(y)
    out_dtype = dt.as_dtype(dtype or (xv.dtype if xv else yv.dtype if yv else float32))
    values = np.where(c.values.astype(bool), xa, ya)
    m = resolve_mask(mask, values.shape)
    return compute_result("dve", "select", values, out_dtype, m if m is not False else None,
                          [c, xv, yv])


# --- elementwise math ------------------------------------------------------------------------
def _operand_dtype(value):
    return value.dtype if is_tile(value) else dt.weak_scalar_dtype(value)


def elementwise_unary(name: str, x, dtype=None, mask=None):
    """One unary op over a tile: Scalar-engine ``activation`` for functions of the activation
    table, Vector engine otherwise."""
    op = tile_operand(x, "x", name)
    check_free_size(op, f"nl.{name}")
    spec = fn.lookup(name)
    m = resolve_mask(mask, op.shape)
    out_dtype = dt.as_dtype(dtype or op.dtype)
    if m is False:
        return allocate(op.shape, out_dtype, fill=dt.uninitialised(out_dtype))
    if spec.bitvec:
        if not dt.is_int(op.dtype):
            raise NKITypeError(f"nl.{name} is a bit operation and takes integer tiles",
                               "err_bitvec_dtype")
        values = spec.apply(op.values)
    else:
        values = spec.apply(op.f32())
    engine, opcode = ("act", "activation") if spec.is_activation else ("dve", "tensor_scalar")
    return compute_result(engine, opcode, values, out_dtype, m, [op], details={"op": name})


def _partition_broadcast_check(a: Operand, b: Operand, api: str, operator: bool):
    if a.partitions == b.partitions:
        return 0
    if operator:
        raise NKIValueError(
            f"operator {api} does not broadcast along the partition dimension ({a.partitions} vs "
            f"{b.partitions} partitions): use nl.{api} or broadcast_to first",
            "err_num_partition_mismatch")
    if 1 not in (a.partitions, b.partitions):
        raise NKIValueError(f"nl.{api}: operands have {a.partitions} and {b.partitions} "
                            "partitions", "err_num_partition_mismatch")
    return builtins.max(a.partitions, b.partitions)


def elementwise_binary(name, x, y, dtype=None, mask=None, operator=False):
    """One binary op: Vector ``tensor_scalar`` when one side is a scalar or a ``(P, 1)``
    per-partition column, ``tensor_tensor`` otherwise (``power`` runs on GpSimd)."""
    spec = fn.lookup(name)
    x_tile, y_tile = is_tile(x), is_tile(y)
    if not (x_tile or y_tile):
        raise NKITypeError(f"nl.{name} needs at least one tile operand",
                           "err_failed_to_infer_tile_from_local_tensor")
    xo = tile_operand(x, "x", name) if x_tile else None
    yo = tile_operand(y, "y", name) if y_tile else None
    for o in (xo, yo):
        if o is not None:
            check_free_size(o, f"nl.{name}")
    promoted = dt.promote(_operand_dtype(x), _operand_dtype(y))
    default = dt.bool_ if name in fn.COMPARISONS else promoted
    out_dtype = dt.as_dtype(dtype or default)
    if spec.bitvec:
        xv = xo.values if xo else np.asarray(x)
        yv = yo.values if yo else np.asarray(y)
        if (xo and not dt.is_int(xo.dtype)) or (yo and not dt.is_int(yo.dtype)):
            raise NKITypeError(f"nl.{name} is a bit operation and takes integer tiles",
                               "err_bitvec_dtype")
    elif xo is not None and yo is not None and dt.is_int(xo.dtype) and dt.is_int(yo.dtype) \
            and name in ("add", "subtract", "multiply", "maximum", "minimum"):
        xv, yv = xo.values.astype(np.int64), yo.values.astype(np.int64)
    else:
        xv = xo.f32() if xo else np.float32(x)
        yv = yo.f32() if yo else np.float32(y)
    inputs = [o for o in (xo, yo) if o is not None]
    extra = []
    if xo is not None and yo is not None:
        xv, yv = align_shapes(xv, yv)
        bcast = _partition_broadcast_check(xo, yo, name, operator)
        if bcast:
            small = xo if xo.partitions == 1 else yo
            extra.append(emit("dve", "partition_broadcast", inputs=[small], outputs=[],
                              partitions=bcast, free_size=small.free_size,
                              out_dtype=small.dtype))
        scalar_like = xo.free_size == 1 or yo.free_size == 1
    else:
        scalar_like = True
    try:
        values = spec.apply(xv, yv)
    except ValueError as exc:
        raise NKIValueError(f"nl.{name}: shapes {np.shape(xv)} and {np.shape(yv)} do not "
                            "broadcast", "err_broadcast_shape") from exc
    m = resolve_mask(mask, values.shape)
    if m is False:
        return allocate(values.shape, out_dtype, fill=dt.uninitialised(out_dtype))
    if name == "power":
        engine, opcode = "pool", "tensor_tensor"
    elif scalar_like:
        engine, opcode = "dve", "tensor_scalar"
    else:
        engine, opcode = "dve", "tensor_tensor"
    return compute_result(engine, opcode, values, out_dtype, m, inputs, details={"op": name})


def _unary(name, doc):
    def op(x, *, dtype=None, mask=None, **kwargs):
        return elementwise_unary(name, x, dtype, mask)

    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"``nl.{name}(x, *, dtype=None, mask=None)``: {doc}"
    op.__nki_op__ = name
    return op


def _binary(name, doc):
    def op(x, y, *, dtype=None, mask=None, **kwargs):
        return elementwise_binary(name, x, y, dtype, mask)

    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"``nl.{name}(x, y, *, dtype=None, mask=None)``: {doc}"
    op.__nki_op__ = name
    return op


abs = _unary("abs", "|x|")
negative = _unary("negative", "-x")
sign = _unary("sign", "sign of x")
trunc = _unary("trunc", "round toward zero")
floor = _unary("floor", "round down")
ceil = _unary("ceil", "round up")
exp = _unary("exp", "e**x")
log = _unary("log", "natural logarithm")
sqrt = _unary("sqrt", "square root")
rsqrt = _unary("rsqrt", "1/sqrt(x)")
reciprocal = _unary("reciprocal", "1/x")
square = _unary("square", "x*x")
sin = _unary("sin", "sine")
cos = _unary("cos", "cosine")
tan = _unary("tan", "tangent")
tanh = _unary("tanh", "hyperbolic tangent")
arctan = _unary("arctan", "inverse tangent")
sigmoid = _unary("sigmoid", "1/(1+exp(-x))")
relu = _unary("relu", "max(x, 0)")
gelu = _unary("gelu", "x·Φ(x)")
gelu_dx = _unary("gelu_dx", "derivative of gelu")
gelu_apprx_tanh = _unary("gelu_apprx_tanh", "tanh approximation of gelu")
gelu_apprx_sigmoid = _unary("gelu_apprx_sigmoid", "x·sigmoid(1.702x)")
silu = _unary("silu", "x·sigmoid(x)")
silu_dx = _unary("silu_dx", "derivative of silu")
erf = _unary("erf", "error function")
erf_dx = _unary("erf_dx", "derivative of erf")
softplus = _unary("softplus", "log(1+exp(x))")
mish = _unary("mish", "x·tanh(softplus(x))")
invert = _unary("invert", "bitwise not")
logical_not = _unary("logical_not", "1 where x == 0")
add = _binary("add", "x + y")
subtract = _binary("subtract", "x - y")
multiply = _binary("multiply", "x * y")
divide = _binary("divide", "x / y")
power = _binary("power", "x ** y (GpSimd)")
maximum = _binary("maximum", "max(x, y)")
minimum = _binary("minimum", "min(x, y)")
mod = _binary("mod", "remainder with the divisor's sign")
fmod = _binary("fmod", "remainder with the dividend's sign")
bitwise_and = _binary("bitwise_and", "x & y")
bitwise_or = _binary("bitwise_or", "x | y")
bitwise_xor = _binary("bitwise_xor", "x ^ y")
left_shift = _binary("left_shift", "x << y")
right_shift = _binary("right_shift", "logical x >> y")
equal = _binary("equal", "x == y")
not_equal = _binary("not_equal", "x != y")
greater = _binary("greater", "x > y")
greater_equal = _binary("greater_equal", "x >= y")
less = _binary("less", "x < y")
less_equal = _binary("less_equal", "x <= y")
logical_and = _binary("logical_and", "x and y")
logical_or = _binary("logical_or", "x or y")
logical_xor = _binary("logical_xor", "x xor y")
copy.__nki_op__ = "copy"
identity = _unary("identity", "x")


# --- reductions ------------------------------------------------------------------------------
def _reduce(name, reducer, x, axis, dtype, mask, keepdims):
    op = tile_operand(x, "x", name)
    check_free_size(op, f"nl.{name}")
    axes = tuple(axis) if isinstance(axis, (list, tuple)) else (axis,)
    axes = tuple(a % op.values.ndim for a in axes)
    if 0 in axes:
        raise NKIValueError(f"nl.{name} reduces free axes only; axis 0 is the partition axis "
                            "(use a matmul with a ones vector, or nisa.tensor_partition_reduce)",
                            "err_reduce_partition_axis")
    m = resolve_mask(mask, op.shape)
    values = op.f32()
    if m is not None and m is not False:
        identity_value = {"sum": 0.0, "mean": 0.0, "prod": 1.0, "max": -np.inf, "min": np.inf,
                          "all": 1.0, "var": 0.0}[name]
        values = np.where(m, values, np.float32(identity_value))
    result = reducer(values, axes)
    if keepdims:
        result = np.expand_dims(result, axes)
    default = dt.float32 if name in ("mean", "var") and dt.is_int(op.dtype) else op.dtype
    out_dtype = dt.as_dtype(dtype or (dt.bool_ if name == "all" else default))
    return compute_result("dve", "tensor_reduce", np.asarray(result, np.float32), out_dtype,
                          None, [op], free_size=op.free_size, details={"op": name})


def sum(x, axis, *, dtype=None, mask=None, keepdims=False, **kwargs):  # noqa: A001
    """``nl.sum(x, axis, *, dtype=None, mask=None, keepdims=False)``: sum over free axes."""
    return _reduce("sum", lambda v, a: np.sum(v, axis=a, dtype=np.float32), x, axis, dtype, mask,
                   keepdims)


def prod(x, axis, *, dtype=None, mask=None, keepdims=False, **kwargs):
    """``nl.prod``: product over free axes."""
    return _reduce("prod", lambda v, a: np.prod(v, axis=a), x, axis, dtype, mask, keepdims)


def max(x, axis, *, dtype=None, mask=None, keepdims=False, **kwargs):  # noqa: A001
    """``nl.max``: maximum over free axes."""
    return _reduce("max", lambda v, a: np.max(v, axis=a), x, axis, dtype, mask, keepdims)


def min(x, axis, *, dtype=None, mask=None, keepdims=False, **kwargs):  # noqa: A001
    """``nl.min``: minimum over free axes."""
    return _reduce("min", lambda v, a: np.min(v, axis=a), x, axis, dtype, mask, keepdims)


def mean(x, axis, *, dtype=None, mask=None, keepdims=False, **kwargs):
    """``nl.mean``: arithmetic mean over free axes (fp32 for integer input)."""
    return _reduce("mean", lambda v, a: np.mean(v, axis=a, dtype=np.float32), x, axis, dtype,
                   mask, keepdims)


def var(x, axis, *, dtype=None, mask=None, keepdims=False, **kwargs):
    """``nl.var``: population variance over free axes."""
    return _reduce("var", lambda v, a: np.var(v, axis=a, dtype=np.float32), x, axis, dtype,
                   mask, keepdims)


def all(x, axis, *, dtype=None, mask=None, keepdims=False, **kwargs):  # noqa: A001
    """``nl.all``: logical and over free axes."""
    return _reduce("all", lambda v, a: np.all(v != 0, axis=a).astype(np.float32), x, axis, dtype,
                   mask, keepdims)


def softmax(x, axis, *, dtype=None, compute_dtype=None, mask=None, **kwargs):
    """``nl.softmax(x, axis)``: exp(x - max) / sum(exp(x - max)) along free ``axis``."""
    shifted = subtract(x, max(x, axis=axis, keepdims=True, dtype=float32), dtype=float32)
    e = exp(shifted, dtype=float32)
    return divide(e, sum(e, axis=axis, keepdims=True, dtype=float32), dtype=dtype or x.dtype)


# --- misc ------------------------------------------------------------------------------------
def device_print(prefix, x, *, mask=None, **kwargs):
    """``nl.device_print(prefix, x)``: print a tile's values (simulation only)."""
    ctx = current("nl.device_print")
    if not ctx.print_enabled:
        return
    values = x.data if isinstance(x, Tensor) else (x.read()[0] if isinstance(x, Access) else x)
    print(prefix, np.asarray(values))
