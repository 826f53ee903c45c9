"""Shared machinery of every instruction: reading operands, making result tiles, writing
results under masks, and appending the instruction to the trace.

``language`` (``nl``) and ``isa`` (``nisa``) are thin layers over these helpers.
"""

from __future__ import annotations

import math
import threading
import weakref

import numpy as np

from . import dtypes as dt
from . import rules
from .errors import CapacityError, NKIIndexError, NKITypeError, NKIValueError
from .indexing import align_mask, mask_box, mask_values
from .memory import Storage, TileRecord, blocks_touched
from .runtime import check_writable, current, record_write
from .targets import MAX_FREE_ELEMENTS_PSUM, MAX_FREE_ELEMENTS_SBUF
from .tensor import Access, Tensor, _check_partitions, check_tile_shape, par_dim


class Operand:
    """A tile operand read by an instruction: values in the storage dtype plus provenance.

    ``mask`` marks the points that were read (None: all of them); it is set when an
    operand mask (``tile[...][mask]``) or the instruction's mask restricted the read.
    """

    __slots__ = ("values", "dtype", "memory", "region", "shape", "source", "mask")

    def __init__(self, values, dtype, memory, region, source, mask=None):
        if values.ndim == 1:  # a (P,) reduction result acts as (P, 1)
            values = values[:, None]
        self.values = values
        self.dtype = dtype
        self.memory = memory
        self.region = region
        self.shape = values.shape
        self.source = source
        self.mask = mask

    @classmethod
    def reference(cls, region, dtype):
        """A read of ``region`` whose values the instruction does not need (DMA sources)."""
        op = cls.__new__(cls)
        op.values, op.dtype, op.memory, op.region = None, dtype, region.memory, region
        op.shape, op.source, op.mask = (), None, None
        return op

    @property
    def partitions(self) -> int:
        return self.shape[0]

    @property
    def free_size(self) -> int:
        return int(np.prod(self.shape[1:])) if len(self.shape) > 1 else 1

    def f32(self) -> np.ndarray:
        return dt.compute(self.values)


# One set of work arrays per thread: kernels launched concurrently must not share them.
_SCRATCH = threading.local()


def _scratch_arrays() -> dict[tuple, np.ndarray]:
    arrays = getattr(_SCRATCH, "arrays", None)
    if arrays is None:
        arrays = _SCRATCH.arrays = {}
    return arrays


def _scratch(shape) -> np.ndarray:
    """A float32 work array of ``shape`` reused from instruction to instruction (fresh large
    arrays cost page faults on every instruction). Never the storage of a tile."""
    arrays = _scratch_arrays()
    buf = arrays.get(shape)
    if buf is None:
        if len(arrays) >= 8:
            arrays.clear()
        buf = arrays[shape] = np.empty(shape, np.float32)
    return buf


def is_scratch(values) -> bool:
    buf = _scratch_arrays().get(np.shape(values))
    return buf is not None and values is buf


def work_f32(op: Operand, out_dtype) -> np.ndarray:
    """A float32 copy of ``op``'s values that the instruction may compute in place: a fresh
    array when the result is float32 (it becomes the output tile), a reused scratch array
    otherwise (the result is rounded into a new tile of ``out_dtype``)."""
    if dt.name(out_dtype) in ("float32", "tfloat32") or op.values.size < 4096:
        return np.array(op.values, dtype=np.float32, copy=True)
    buf = _scratch(op.values.shape)
    np.copyto(buf, op.values, casting="unsafe")
    return buf


def is_tile(value) -> bool:
    return isinstance(value, (Tensor, Access))


def _fits(mask, shape) -> bool:
    try:
        align_mask(mask, shape)
    except NKIValueError:
        return False
    return True


def check_no_dynamic_offset(value, use: str) -> None:
    """Only nisa.tensor_copy_dynamic_src/_dst address a tile at a run-time offset."""
    if isinstance(value, Access) and value.dynamic is not None:
        raise NKIIndexError(
            f"{use} is indexed by a value known only at run time; copying such an on-chip "
            "access is not natively supported: use nisa.tensor_copy_dynamic_src (a dynamic "
            "source) or nisa.tensor_copy_dynamic_dst (a dynamic destination) "
            "(aws-neuron-sdk@8a38e733 general/nki/api/nki.errors.rst L256-281)",
            "err_copy_dynamic_indirect_indices_not_natively_supported",
        )


def tile_operand(
    value,
    argname: str,
    api: str,
    mask=None,
    allow_psum=True,
    operand_mask=False,
    dynamic_offset=False,
) -> Operand:
    """Read an SBUF/PSUM tile argument of a compute instruction.

    ``mask`` (a compact boolean array) restricts the read when it fits the operand's shape,
    so masked-off points of an access are never dereferenced. Operand masks
    (``tile[...][mask]``) are accepted only where the API supports them (matmul).
    """
    if not is_tile(value):
        raise NKITypeError(
            f"`{argname}` of {api} must be a tile, got {type(value).__name__}",
            "err_failed_to_infer_tile_from_local_tensor",
        )
    check_in_scope(value, f"operand '{argname}' of '{api}'")
    if not value.on_chip:
        raise NKITypeError(
            f"Expected operand '{argname}' of '{api}' to be in address space 'psum|sbuf', but "
            f"got a tensor in 'hbm' (`{value.name}`) instead: load it with nl.load first",
            "err_unsupported_memory",
        )
    if value.storage.memory == "psum" and not allow_psum:
        raise NKITypeError(
            f"Expected operand '{argname}' of '{api}' to be in address space 'sbuf', but got a "
            "tile in 'psum' instead",
            "err_unsupported_memory",
        )
    if isinstance(value, Access):
        if not dynamic_offset:
            check_no_dynamic_offset(value, f"operand '{argname}' of '{api}'")
        if value.operand_mask is not None and not operand_mask:
            raise NKIValueError(
                f"`{argname}` of {api} is operand-masked (tile[...][mask]); only the matmul "
                "APIs accept operand masks: pass mask= instead",
                "err_unsupported_operand_mask",
            )
        read_mask = mask if isinstance(mask, np.ndarray) and _fits(mask, value.shape) else None
        values, valid = value.read(read_mask)
        return Operand(
            values, value.dtype, value.storage.memory, value.region(read_mask), value, valid
        )
    if value.par_axis != 0:
        raise NKITypeError(
            f"Failed to infer tile from tensor `{value.name}`: operand '{argname}' of '{api}' "
            "has block dimensions before its partition dimension; index them away first "
            "(t[i])",
            "err_failed_to_infer_tile_from_local_tensor",
        )
    return Operand(value.data, value.dtype, value.storage.memory, value.region(), value)


def check_in_scope(value, use: str) -> None:
    """A tile created inside an if/else/for/while block of the kernel and bound to a name
    there is out of scope once the block (or that loop iteration) is over."""
    where = getattr(value.storage, "out_of_scope", None)
    if where:
        raise NKIValueError(
            f"Local variable {where} is referenced outside of its parent scope ({use}): "
            "tensors defined in if/else/for control blocks are not allowed to be used outside "
            "of the scope; create it before the block and assign into it with `t[...] = ...` "
            "(general/nki/api/nki.errors.rst@8a38e733, L417-L474)",
            "err_local_variable_used_out_of_scope",
        )


def scalar_or_tile(
    value,
    argname,
    api,
    partitions=None,
    key="err_scalar_or_vector",
) -> tuple[object, Operand | None]:
    """A Python scalar, or a per-partition ``(P, 1)`` tile broadcast along the free axes.
    Returns (float32 scalar or (P, 1) float32 array, the tile operand or None)."""
    if is_tile(value):
        op = tile_operand(value, argname, api)
        if op.free_size != 1:
            raise NKIValueError(
                f"`{argname}` of {api} must be a scalar or a (P, 1) per-partition tile, got shape "
                f"{op.shape}",
                key,
            )
        if partitions is not None and op.partitions != partitions:
            raise NKIValueError(
                f"`{argname}` of {api} has {op.partitions} partitions, the data has {partitions}",
                "err_num_partition_mismatch",
            )
        return op.f32().reshape(op.partitions, 1), op
    if isinstance(value, (int, float, np.number, bool, np.bool_)):
        return np.float32(value), None
    raise NKITypeError(
        f"`{argname}` of {api} must be a scalar or a tile, got {type(value).__name__}", key
    )


def allocate(shape, dtype, buffer: str = "sbuf", name: str = "", fill=None) -> Tensor:
    """Allocate a tensor in SBUF, PSUM or (private/shared) HBM within the running kernel.

    ``fill`` is a value to fill with, or an owned C-contiguous array of ``shape`` that
    becomes the backing store as it is.
    """
    ctx = current("allocation")
    dtype = dt.as_dtype(dtype)
    shape, par_axis = shape_and_par_axis(shape)
    if buffer in ("sbuf", "psum"):
        check_tile_shape(shape[par_axis:], f"tile `{name or 'tile'}` of shape {shape}")
        per_partition = int(np.prod(shape[:par_axis] + shape[par_axis + 1 :])) * dtype.itemsize
        storage = Storage(buffer, buffer, name)
        if buffer == "psum":  # TC#2 is a rule per (P, F) tile; each block is one tile
            # ("The block dimensions described how many physical (P, F) tiles the tensor
            # has", general/nki/nki_block_dimension_migration_guide.rst@8a38e733 L31)
            rules.check_psum_tile(
                int(np.prod(shape[par_axis + 1 :])),
                dtype.itemsize,
                f"PSUM tile `{name or 'tile'}` of shape {shape} {dt.name(dtype)}",
            )
        what = f"tile `{name or 'tile'}` of shape {shape} {dt.name(dtype)}"
        allocator = ctx.sbuf if buffer == "sbuf" else ctx.psum
        allocator.allocate(
            storage, per_partition, scope=tuple((frame, frame.iteration) for frame in ctx.loops)
        )
        ctx.tiles[storage.id] = _tile_record(ctx, storage, shape, par_axis, dtype, what)
    else:
        storage = Storage("hbm", buffer, name)
    if isinstance(fill, np.ndarray) and fill.shape == shape:
        data = fill
    else:
        data = np.empty(shape, dtype=dtype)
        if fill is not None:
            dt.fill(data, fill)
    storage.par_axis = par_axis
    storage.array = data
    return Tensor(data, dtype, storage, par_axis=par_axis, loops=tuple(ctx.loops))


def _tile_record(ctx, storage, shape, par_axis, dtype, what) -> TileRecord:
    """The tensor's (P, F) blocks for the live-range capacity check; one block that does
    not fit a partition can never be placed, so it is rejected here."""
    memory = storage.memory
    granule = ctx.psum.granule if memory == "psum" else ctx.sbuf.granule
    block_bytes = math.prod(shape[par_axis + 1 :]) * dtype.itemsize
    held = max(granule, -(-block_bytes // granule) * granule)
    capacity = (
        ctx.target.psum_bytes_per_partition
        if memory == "psum"
        else ctx.target.sbuf_bytes_per_partition
    )
    if held > capacity:
        unit = "PSUM" if memory == "psum" else "SBUF"
        raise CapacityError(
            f"{unit} over capacity: {what} needs {block_bytes} bytes per partition for one "
            f"tile, more than the target's {capacity} bytes per partition; tile the free "
            "dimension",
            f"err_{memory}_capacity_exceeded",
        )
    return TileRecord(memory, storage.address, block_bytes, math.prod(shape[:par_axis]), held, what)


def shape_and_par_axis(shape):
    """A shape as ints plus the index of its ``nl.par_dim`` axis (0 when unmarked)."""
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    par_axis = next((i for i, s in enumerate(shape) if isinstance(s, par_dim)), 0)
    return tuple(int(s) for s in shape), par_axis


def fill_masked_off(data: np.ndarray, mask, value) -> None:
    """Set the points of ``data`` where the (aligned, compact) ``mask`` is false."""
    box = mask_box(mask, data.shape)
    if box is None:
        data[~np.broadcast_to(mask, data.shape)] = value
        return
    for axis, sl in enumerate(box):  # the complement of a box is a union of slabs
        if sl.start is None:
            continue
        before = (slice(None),) * axis
        data[before + (slice(0, sl.start),)] = value
        data[before + (slice(sl.stop, None),)] = value


def result_tile(values: np.ndarray, dtype, mask, buffer="sbuf", name="", owned=False) -> Tensor:
    """A fresh result tile holding ``values`` (fp32 or any) rounded to ``dtype``; masked-off
    points are uninitialised (the NaN / 4 sentinel). ``owned`` says ``values`` is a
    temporary the tile may keep as its storage."""
    values = np.asarray(values)
    if values.ndim < 2:
        values = values.reshape(values.shape + (1,) * (2 - values.ndim))
    _check_partitions(values.shape[0], f"result of shape {values.shape}")
    data = dt.cast(values, dtype)
    if (data is values and not owned) or not data.flags.c_contiguous or data.base is not None:
        data = np.array(data, order="C", copy=True)
    if mask is not None:
        fill_masked_off(data, align_mask(mask, data.shape), dt.uninitialised(dtype))
    return allocate(data.shape, dtype, buffer, name, fill=data)


def emit(
    engine: str,
    opcode: str,
    *,
    inputs=(),
    outputs=(),
    partitions: int,
    free_size: int,
    out_dtype,
    details=None,
    dma=None,
):
    """Append one instruction to the trace of the running kernel."""
    ctx = current(opcode)
    reads = tuple(op.region for op in inputs if op is not None and op.region is not None)
    fields = dict(
        engine=engine,
        opcode=opcode,
        partitions=int(partitions),
        free_size=int(free_size),
        in_dtypes=tuple(dt.name(op.dtype) for op in inputs if op is not None),
        out_dtype=dt.name(out_dtype) if out_dtype is not None else "",
        reads=reads,
        writes=tuple(outputs),
        loops=ctx.loops_key(),
        program=ctx.program_id,
        core=ctx.core,
        details=details or {},
    )
    note_psum_writes(ctx, outputs)
    if dma is not None:
        fields.update(dma)
    else:  # the cost model halves the access rate of strided operands
        fields["details"].setdefault(
            "max_stride_bytes",
            max((_innermost_stride(op) for op in inputs if op is not None), default=0),
        )
    return ctx.trace.add(**fields)


def _innermost_stride(op) -> int:
    """Bytes between consecutive elements of an operand's innermost axis (0 if one element)."""
    values = getattr(op, "values", None)
    if not isinstance(values, np.ndarray) or values.ndim < 2 or values.shape[-1] < 2:
        return 0
    return abs(values.strides[-1])


def check_free_size(op: Operand, api: str) -> None:
    """One Vector/Scalar instruction reads at most 64K elements per partition from SBUF, 4K
    from PSUM."""
    limit = MAX_FREE_ELEMENTS_PSUM if op.memory == "psum" else MAX_FREE_ELEMENTS_SBUF
    if op.free_size > limit:
        raise NKIValueError(
            f"{api} reads {op.free_size} elements per partition from {op.memory.upper()}; one "
            f"instruction reads at most {limit}: split the free dimension",
            "err_size_of_dimension_exceed_arch_limit",
        )


def finish(tile: Tensor, instruction, mask, fp32_values) -> Tensor:
    """Mark ``tile`` as the fresh result of ``instruction`` so that assigning it into another
    tile retargets the instruction instead of adding a copy. Only the latest instruction's
    result is fresh: the previous one forgets its fp32 values."""
    ctx = current("instruction")
    previous = ctx.fresh_tile() if ctx.fresh_tile is not None else None
    if previous is not None:
        previous.fresh = None
    tile.fresh = (instruction, mask, fp32_values)
    ctx.fresh_tile = weakref.ref(tile)
    return tile


def extent(mask, shape) -> tuple[int, int]:
    """(partitions, elements per partition) an instruction over ``shape`` runs on once the
    compiler has shrunk it to its ``mask``."""
    shape = tuple(shape) if len(shape) else (1,)
    partitions, free = shape[0], int(np.prod(shape[1:]))
    if mask is None or mask is False:
        return partitions, free
    m = align_mask(mask, shape)
    box = mask_box(m, shape)
    if box is not None:
        sizes = [len(range(*b.indices(n))) for b, n in zip(box, shape)]
        return sizes[0], int(np.prod(sizes[1:]))
    full = np.broadcast_to(m, shape).reshape(partitions, -1)
    return int(full.any(axis=1).sum()), int(full.sum(axis=1).max())


def compute_result(
    engine,
    opcode,
    values,
    dtype,
    mask,
    inputs,
    *,
    partitions=None,
    free_size=None,
    details=None,
    buffer="sbuf",
    extra_writes=(),
) -> Tensor:
    """Common tail of a compute instruction producing a new tile from its fp32 ``values``
    (``extra_writes``: regions it also writes, e.g. a ``reduce_res``)."""
    values = np.asarray(values)
    rules.check_gpsimd_memory(opcode, engine, (buffer,))
    # a temporary the instruction computed (not an operand's own array) can become the tile
    owned = (
        values.base is None
        and not is_scratch(values)
        and all(op is None or op.values is not values for op in inputs)
    )
    tile = result_tile(values, dtype, mask, buffer, owned=owned)
    active_partitions, active_free = extent(mask, tile.shape)
    inst = emit(
        engine,
        opcode,
        inputs=inputs,
        outputs=[tile.region(mask), *extra_writes],
        partitions=active_partitions if partitions is None else partitions,
        free_size=active_free if free_size is None else free_size,
        out_dtype=dtype,
        details=details,
    )
    return finish(tile, inst, mask, values)


def resolve_mask(mask, shape=None):
    """A ``mask=`` argument as None (every point), False (no point) or a compact boolean
    array (aligned to ``shape`` when given)."""
    values = mask_values(mask)
    if values is None or values is False or shape is None:
        return values
    return align_mask(values, shape)


def fit_values(values: np.ndarray, shape, name: str) -> np.ndarray:
    """``values`` reshaped so that it broadcasts to ``shape`` (the destination of a write):
    partition-aligned (a lower rank is padded on the right), or the same elements with
    size-1 axes added or dropped, or NumPy broadcasting. A destination smaller than the
    value is an error."""
    shape = tuple(shape)
    if values.shape == shape:
        return values
    candidates = []
    if values.ndim < len(shape):
        candidates.append(values.reshape(values.shape + (1,) * (len(shape) - values.ndim)))
    if values.size == int(np.prod(shape)) and (
        [n for n in values.shape if n != 1] == [n for n in shape if n != 1]
        or (values.ndim and shape and values.shape[0] == shape[0])
    ):
        candidates.append(values.reshape(shape))
    candidates.append(values)
    for candidate in candidates:
        try:
            if np.broadcast_shapes(candidate.shape, shape) == shape:
                return candidate
        except ValueError:
            continue
    raise NKIValueError(
        f"Illegal assignment destination shape: `{name or 'tile'}` of shape {shape} is smaller "
        f"than the value of shape {values.shape} (or they do not broadcast)",
        "err_store_dst_shape_smaller_than_other_shape",
    )


def write_into(dst, values: np.ndarray, mask, accumulate=False, dynamic_offset=False) -> None:
    """Write ``values`` (fp32 or storage-typed) into a tile or HBM view where ``mask``
    holds, rounding to the destination dtype."""
    if not dynamic_offset:
        check_no_dynamic_offset(dst, f"destination `{dst.name or 'tile'}`")
    ctx = current("write")
    check_writable(ctx, dst.storage)
    check_in_scope(dst, f"destination `{dst.name or 'tile'}` of a write")
    shape = tuple(dst.shape)
    values = fit_values(np.asarray(values), shape, dst.name)
    cast = dt.cast(values, dst.dtype)
    m = None if mask is None else align_mask(mask, shape)
    if m is not None and m.all():
        m = None
    if isinstance(dst, Access):
        box = dst.box(m)
        dst.write(cast, m)
        tensor = dst.tensor
    else:
        tensor = dst
        if m is None:
            box = dst.box()
            dst.data[...] = cast
        else:
            sel = mask_box(m, shape)
            full = np.broadcast_to(cast, shape)
            if sel is None:
                box = dst.box()
                where = np.broadcast_to(m, shape)
                dst.data[where] = full[where]
            else:
                box = dst.box(
                    [s.start or 0 for s in sel], [(s.stop or n) - 1 for s, n in zip(sel, shape)]
                )
                dst.data[sel] = full[sel]
    dst.storage.written = True
    if dst.storage.memory == "psum":
        note_psum_writes(ctx, (dst.region(),))
    record_write(ctx, tensor, box, accumulate)


def psum_blocks(ctx, region) -> set[tuple[int, int]]:
    """(storage id, block) of the PSUM tiles (blocks of a ``(B, P, F)`` tensor) that
    ``region`` reaches into."""
    record = ctx.tiles.get(region.storage)
    if record is None or record.memory != "psum":
        return set()
    return {(region.storage, block) for block in blocks_touched(region, record)}


def note_psum_writes(ctx, regions) -> None:
    """Remember the PSUM tiles ``regions`` write (see ``Context.written_psum_blocks``)."""
    for region in regions:
        ctx.written_psum_blocks.update(psum_blocks(ctx, region))


def align_shapes(a: np.ndarray, b: np.ndarray):
    """Partition-aligned broadcasting of two operands (the lower rank padded on the right)."""
    if a.ndim < b.ndim:
        a = a.reshape(a.shape + (1,) * (b.ndim - a.ndim))
    elif b.ndim < a.ndim:
        b = b.reshape(b.shape + (1,) * (a.ndim - b.ndim))
    return a, b


def dma_record(
    opcode,
    src_region,
    dst_region,
    partitions,
    nbytes,
    row_bytes,
    direction,
    in_dtype,
    out_dtype,
    inputs=(),
    details=None,
):
    """Append a DMA transfer to the trace. ``nbytes`` counts the elements actually moved
    (masked-off points excluded) at the HBM side's itemsize."""
    src = [Operand.reference(src_region, in_dtype)] if src_region is not None else []
    fields = dma_trace_fields(nbytes, partitions, direction, row_bytes)
    return emit(
        "dma",
        opcode,
        inputs=src + list(inputs),
        outputs=[dst_region],
        partitions=partitions,
        free_size=fields["free_size"],
        out_dtype=out_dtype,
        details=details or {},
        dma=fields,
    )


def dma_trace_fields(nbytes, partitions, direction, row_bytes) -> dict:
    """The fields of a DMA's trace record, the same in both front-ends for the same
    transfer: ``nbytes`` moved (at the HBM side's itemsize), ``free_size`` the bytes per
    on-chip partition, ``direction`` ("hbm->sbuf" ...), ``row_bytes`` per descriptor."""
    return {
        "free_size": int(nbytes) // max(1, int(partitions)),
        "dma_bytes": int(nbytes),
        "dma_direction": direction,
        "dma_row_bytes": int(row_bytes),
    }


def indirect_inputs(access):
    """The index tile an indirect access reads, as an operand of the DMA."""
    if isinstance(access, Access) and access.indirect is not None:
        tile = access.indirect[1]
        return [Operand.reference(tile.region(), tile.dtype)]
    return []
