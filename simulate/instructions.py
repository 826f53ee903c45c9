"""Shared machinery of every instruction: reading operands, making result tiles, writing
results under masks, and appending the instruction to the trace.

``language`` (``nl``) and ``isa`` (``nisa``) are thin layers over these helpers.
"""

from __future__ import annotations

import numpy as np

from . import dtypes as dt
from .errors import NKITypeError, NKIValueError
from .indexing import mask_values
from .memory import Storage
from .runtime import current, record_write
from .targets import MAX_FREE_ELEMENTS_PSUM, MAX_FREE_ELEMENTS_SBUF
from .tensor import Access, Tensor, _check_partitions, check_tile_shape


class Operand:
    """A tile operand read by an instruction: values in the storage dtype plus provenance."""

    __slots__ = ("values", "dtype", "memory", "region", "shape", "source")

    def __init__(self, values, dtype, memory, region, source):
        if values.ndim == 1:  # a (P,) reduction result acts as (P, 1)
            values = values[:, None]
        self.values = values
        self.dtype = dtype
        self.memory = memory
        self.region = region
        self.shape = values.shape
        self.source = source

    @property
    def partitions(self) -> int:
        return self.shape[0]

    @property
    def free_size(self) -> int:
        return int(np.prod(self.shape[1:])) if len(self.shape) > 1 else 1

    def f32(self) -> np.ndarray:
        return dt.compute(self.values)


def is_tile(value) -> bool:
    return isinstance(value, (Tensor, Access))


def tile_operand(value, argname: str, api: str, mask=None, allow_psum=True) -> Operand:
    """Read an SBUF/PSUM tile argument of a compute instruction."""
    if not is_tile(value):
        raise NKITypeError(f"`{argname}` of {api} must be a tile, got {type(value).__name__}",
                           "err_failed_to_infer_tile_from_local_tensor")
    if not value.on_chip:
        raise NKITypeError(
            f"Expected operand '{argname}' of '{api}' to be in address space 'sbuf' or 'psum', "
            f"but got a tensor in 'hbm' (`{value.name}`): load it with nl.load first",
            "err_unsupported_memory")
    if value.storage.memory == "psum" and not allow_psum:
        raise NKITypeError(f"operand '{argname}' of '{api}' cannot be in PSUM",
                           "err_unsupported_memory")
    if isinstance(value, Access):
        values, _ = value.read(mask if isinstance(mask, np.ndarray) else None)
        region = value.region()
    else:
        if value.par_axis != 0:
            raise NKITypeError(
                f"operand '{argname}' of '{api}' has block dimensions before its partition "
                "dimension: index them away first (t[i])",
                "err_failed_to_infer_tile_from_local_tensor")
        values, region = value.data, value.region()
    return Operand(values, value.dtype, value.storage.memory, region, value)


def scalar_or_tile(value, argname, api, partitions=None) -> tuple[object, Operand | None]:
    """A Python scalar, or a per-partition ``(P, 1)`` tile broadcast along the free axes."""
    if is_tile(value):
        op = tile_operand(value, argname, api)
        if op.free_size != 1:
            raise NKIValueError(
                f"`{argname}` of {api} must be a scalar or a (P, 1) per-partition tile, got shape "
                f"{op.shape}", "err_scalar_or_vector")
        if partitions is not None and op.partitions != partitions:
            raise NKIValueError(
                f"`{argname}` of {api} has {op.partitions} partitions, the data has {partitions}",
                "err_num_partition_mismatch")
        return op.f32().reshape(op.partitions, 1), op
    if isinstance(value, (int, float, np.number, bool, np.bool_)):
        return np.float32(value) if not isinstance(value, (bool, np.bool_)) else np.float32(
            bool(value)), None
    raise NKITypeError(f"`{argname}` of {api} must be a scalar or a tile, got "
                       f"{type(value).__name__}", "err_scalar_or_vector")


def allocate(shape, dtype, buffer: str = "sbuf", name: str = "", fill=None) -> Tensor:
    """Allocate a tensor in SBUF, PSUM or (private/shared) HBM within the running kernel."""
    ctx = current("allocation")
    dtype = dt.as_dtype(dtype)
    shape, par_axis = _shape_and_par_axis(shape)
    if buffer in ("sbuf", "psum"):
        check_tile_shape(shape[par_axis:], f"tile `{name or 'tile'}` of shape {shape}")
        per_partition = int(np.prod(shape[:par_axis] + shape[par_axis + 1:])) * dtype.itemsize
        storage = Storage(buffer, buffer, name)
        if buffer == "psum" and per_partition > 2048:
            raise NKIValueError(
                f"PSUM tile `{name or 'tile'}` of shape {shape} needs {per_partition} bytes per "
                "partition; one PSUM tile holds at most 2 KiB per partition (psum_fmax = 512 "
                "fp32)", "err_size_of_dimension_exceed_arch_limit")
        (ctx.sbuf if buffer == "sbuf" else ctx.psum).allocate(
            storage, per_partition, f"tile `{name or 'tile'}` of shape {shape} "
                                    f"{dt.name(dtype)}")
    else:
        storage = Storage("hbm", buffer, name)
    if fill is None:
        data = np.empty(shape, dtype=dtype)
    else:
        data = np.full(shape, fill, dtype=dtype) if not isinstance(fill, np.ndarray) else fill
    return Tensor(data, dtype, storage, par_axis=par_axis, loops=tuple(ctx.loops))


def _shape_and_par_axis(shape):
    from .tensor import par_dim

    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    par_axis = next((i for i, s in enumerate(shape) if isinstance(s, par_dim)), 0)
    return tuple(int(s) for s in shape), par_axis


def result_tile(values: np.ndarray, dtype, mask, buffer="sbuf", name="") -> Tensor:
    """A fresh result tile holding ``values`` (fp32 or any) cast to ``dtype``; masked-off
    points are uninitialised (the NaN / 4 sentinel)."""
    if values.ndim == 1:
        values = values[:, None]
    _check_partitions(values.shape[0], f"result of shape {values.shape}")
    tile = allocate(values.shape, dtype, buffer, name)
    if mask is None:
        tile.data[...] = dt.cast(values, dtype)
    else:
        mask = np.broadcast_to(mask, values.shape)
        tile.data[...] = dt.uninitialised(dtype)
        tile.data[mask] = dt.cast(values[mask], dtype)
    return tile


def emit(engine: str, opcode: str, *, inputs=(), outputs=(), partitions: int, free_size: int,
         out_dtype, details=None, dma=None):
    """Append one instruction to the trace of the running kernel."""
    ctx = current(opcode)
    reads = tuple(op.region for op in inputs if op is not None)
    writes = tuple(outputs)
    fields = dict(
        engine=engine, opcode=opcode, partitions=int(partitions), free_size=int(free_size),
        in_dtypes=tuple(dt.name(op.dtype) for op in inputs if op is not None),
        out_dtype=dt.name(out_dtype) if out_dtype is not None else "",
        reads=reads, writes=writes, loops=ctx.loops_key(), program=ctx.program_id,
        details=details or {},
    )
    if dma is not None:
        fields.update(dma)
    return ctx.trace.add(**fields)


def check_free_size(op: Operand, api: str) -> None:
    """One Vector/Scalar instruction reads at most 64K elements per partition from SBUF, 4K
    from PSUM."""
    limit = MAX_FREE_ELEMENTS_PSUM if op.memory == "psum" else MAX_FREE_ELEMENTS_SBUF
    if op.free_size > limit:
        raise NKIValueError(
            f"{api} reads {op.free_size} elements per partition from {op.memory.upper()}; one "
            f"instruction reads at most {limit}: split the free dimension",
            "err_size_of_dimension_exceed_arch_limit")


def finish(ctx_tile: Tensor, instruction, mask, fp32_values) -> Tensor:
    """Mark ``tile`` as the fresh result of ``instruction`` so that assigning it into another
    tile retargets the instruction instead of adding a copy."""
    ctx_tile.fresh = (instruction, mask, fp32_values)
    return ctx_tile


def compute_result(engine, opcode, values, dtype, mask, inputs, *, partitions=None,
                   free_size=None, details=None, buffer="sbuf") -> Tensor:
    """Common tail of a compute instruction producing a new tile."""
    tile = result_tile(values, dtype, mask, buffer)
    inst = emit(engine, opcode, inputs=inputs, outputs=[tile.region()],
                partitions=partitions if partitions is not None else tile.shape[0],
                free_size=free_size if free_size is not None else
                int(np.prod(tile.shape[1:])), out_dtype=dtype, details=details)
    return finish(tile, inst, mask, values)


def resolve_mask(mask, shape):
    """A ``mask=`` argument as None (all), False (nothing) or a bool array of ``shape``."""
    values = mask_values(mask)
    if values is None or values is False:
        return values
    try:
        return np.broadcast_to(values, shape)
    except ValueError as exc:
        raise NKIValueError(f"mask of shape {values.shape} does not fit the instruction's "
                            f"shape {shape}", "err_mask_shape") from exc


def write_into(dst, values: np.ndarray, mask, accumulate=False) -> None:
    """Write ``values`` (fp32 or storage-typed) into a tile or HBM view under ``mask``."""
    ctx = current("write")
    target_shape = dst.shape
    if values.shape != tuple(target_shape):
        try:
            values = np.broadcast_to(_align(values, target_shape), target_shape)
        except ValueError as exc:
            raise NKIValueError(
                f"cannot write a value of shape {values.shape} into `{dst.name or 'tile'}"
                f"[...]` of shape {tuple(target_shape)}: the destination is smaller or not "
                "broadcast-compatible", "err_store_dst_shape_smaller_than_other_shape") from exc
    if mask is not None:
        mask = np.broadcast_to(_align(mask, target_shape), target_shape)
    cast = dt.cast(values, dst.dtype)
    if isinstance(dst, Access):
        box = dst.box(mask)
        dst.write(cast, mask)
    else:
        box = dst.box()
        if mask is None:
            dst.data[...] = cast
        else:
            dst.data[mask] = np.broadcast_to(cast, target_shape)[mask]
    dst.storage.written = True
    tensor = dst.tensor if isinstance(dst, Access) else dst
    record_write(ctx, tensor, box, accumulate)


def _align(values: np.ndarray, shape) -> np.ndarray:
    """Partition-aligned broadcasting: pad a lower-rank shape with 1s on the right."""
    if values.ndim < len(shape):
        values = values.reshape(values.shape + (1,) * (len(shape) - values.ndim))
    elif values.ndim > len(shape):
        squeezed = values.reshape(values.shape[: len(shape) - 1] + (-1,))
        if squeezed.shape[-1] == shape[-1] or squeezed.shape[-1] == 1:
            return squeezed
    return values


def align_shapes(a: np.ndarray, b: np.ndarray):
    """Partition-aligned broadcasting of two operands (the lower rank padded on the right)."""
    if a.ndim < b.ndim:
        a = a.reshape(a.shape + (1,) * (b.ndim - a.ndim))
    elif b.ndim < a.ndim:
        b = b.reshape(b.shape + (1,) * (a.ndim - b.ndim))
    return a, b
