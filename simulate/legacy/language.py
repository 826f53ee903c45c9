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
import sys

import numpy as np

from ..core import approx as approx_mode
from ..core import dtypes as dt
from ..core import functions as fn
from ..core import rules, sdk
from ..core import semantics as sem
from ..core.dtypes import (  # noqa: F401 - re-exported NKI names
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
from ..core.errors import NKIIndexError, NKITypeError, NKIValueError
from ..core.indexing import align_mask, arange, ds, mask_box, mgrid  # noqa: F401
from ..core.instructions import (
    Operand,
    align_shapes,
    allocate,
    check_free_size,
    compute_result,
    dma_record,
    emit,
    extent,
    finish,
    indirect_inputs,
    is_tile,
    psum_blocks,
    resolve_mask,
    result_tile,
    tile_operand,
    work_f32,
    write_into,
)
from ..core.loop_index import LoopIndex, concrete
from ..core.memory import check_direct_placement
from ..core.runtime import (  # noqa: F401
    affine_range,
    current,
    nc,
    num_programs,
    program_id,
    program_ndim,
    sequential_range,
    spmd_dim,
    static_range,
    tile_size,
)
from ..core.scoping import DESTINATION_KEYWORD
from ..core.tensor import (  # noqa: F401
    Access,
    Tensor,
    contiguous_row_bytes,
    par_dim,
    register_operators,
)

# Tile operators (``a + b``, ``t[...] = v``, ``t.astype``) run this module's functions.
register_operators(sys.modules[__name__])

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
    ctx = current("allocation")
    if getattr(buffer, "__nki_place__", None) is not None:  # the kernel places its tiles
        ctx.allocated = True
    if name not in _BUFFERS:
        raise NKIValueError(
            f"buffer={buffer!r} is not one of nl.sbuf, nl.psum, nl.hbm, "
            "nl.private_hbm, nl.shared_hbm",
            "err_unsupported_buffer",
        )
    if name in (sbuf, psum):
        _check_one_allocation_kind(ctx, getattr(buffer, "__nki_place__", None) is not None)
    return name


def _check_one_allocation_kind(ctx, direct: bool) -> None:
    """ "All SBUF tensors in a kernel must either all be marked as ``auto_alloc()``, or all be
    allocated with ``alloc`` or ``mod_alloc``"; "programmers cannot mix NKI tensor
    declarations using automatic allocation (``ncc.sbuf.auto_alloc()`` or the PSUM variant)
    and direction allocation APIs ... in the same kernel", and ``buffer=nl.sbuf`` "is
    equivalent to ``buffer=ncc.sbuf.auto_alloc()``" (general/nki/api/nki/compiler/sbuf.py
    @8a38e733 L59-L61, L142-L145; psum.py L60-L62). Tiles that instructions return without
    a declaration are not declarations and are not counted."""
    kind = "direct" if direct else "automatic"
    ctx.declared_allocation_kinds.add(kind)
    if len(ctx.declared_allocation_kinds) > 1:
        raise NKIValueError(
            f"this {kind}ally allocated SBUF/PSUM tensor declaration joins declarations of the "
            "other kind: a kernel declares its on-chip tensors either all with automatic "
            "allocation (nl.sbuf, nl.psum, ncc.*.auto_alloc()) or all with direct allocation "
            "(ncc.sbuf/psum.alloc, mod_alloc) (general/nki/api/nki/compiler/sbuf.py@8a38e733 "
            "L59-L61, L142-L145; psum.py L60-L62)",
            "err_unsupported_buffer",
        )


# --- creation --------------------------------------------------------------------------------
def ndarray(shape, dtype, *, buffer=None, name="", **kwargs):
    """``nl.ndarray(shape, dtype, *, buffer=None, name="")``: an uninitialised tensor
    (SBUF by default; ``nl.shared_hbm`` for kernel outputs, created at the kernel's top level).
    """
    modulo = getattr(buffer, "__nki_modulo__", None)
    place = getattr(buffer, "__nki_place__", None)
    buffer = _buffer(buffer)
    ctx = current("nl.ndarray")
    if buffer == shared_hbm:
        return _shared_hbm(ctx, shape, dtype, name)
    if buffer == private_hbm:
        ctx.private_hbm_names.append(name or "tensor")
    fill = dt.uninitialised(dt.as_dtype(dtype))
    tensor = allocate(shape, dtype, buffer, name, fill=fill)
    if modulo is not None:
        ctx.modulo_tiles[tensor.storage.id] = (tensor.shape[: tensor.par_axis], modulo)
    if place is not None:
        ctx.placements[tensor.storage.id] = _placements(ctx, tensor, place, buffer, name)
    return tensor


def _placements(ctx, tensor, place, buffer, name):
    """Evaluate the kernel's allocation function over every logical block of ``tensor``
    ("the compiler will statically evaluate ``func`` over indices of all the logical tiles",
    general/nki/nki_direct_allocation_guide.rst@8a38e733 L160-L161) and check each location."""
    block_shape = tensor.shape[: tensor.par_axis]
    pdim_size = tensor.shape[tensor.par_axis]
    fdim_size = int(np.prod(tensor.shape[tensor.par_axis + 1 :])) * tensor.dtype.itemsize
    memory = "psum" if buffer == psum else "sbuf"
    capacity = (
        ctx.target.psum_bytes_per_partition
        if memory == "psum"
        else ctx.target.sbuf_bytes_per_partition
    )
    align = tile_size.psum_min_align if memory == "psum" else tile_size.sbuf_min_align
    what = f"{memory.upper()} tensor `{name or 'tile'}` of shape {tensor.shape}"
    return [
        check_direct_placement(
            memory,
            idx,
            place(idx, pdim_size, fdim_size),
            pdim_size,
            fdim_size,
            capacity,
            align,
            what,
        )
        for idx in np.ndindex(*block_shape)
    ]


_COMPREHENSIONS = ("<listcomp>", "<genexpr>", "<dictcomp>", "<setcomp>")


def _kernel_frame():
    """The code object of the innermost caller outside the simulator (comprehensions count
    as the scope they are written in, as Python 3.12 inlines them)."""
    frame = sys._getframe(1)
    while frame is not None and (
        frame.f_globals.get("__name__", "").startswith("simulate.")
        or frame.f_code.co_name in _COMPREHENSIONS
    ):
        frame = frame.f_back
    return frame.f_code if frame is not None else None


def _shared_hbm(ctx, shape, dtype, name):
    rules.check_shared_hbm_blocks(ctx.blocks, name)
    if ctx.loops:
        raise NKIValueError(
            "shared_hbm tensor can only be created in top level kernel scope, not inside a loop",
            "err_shared_hbm_must_in_kernel_level",
        )
    caller = _kernel_frame()
    if ctx.kernel_code is not None and caller is not ctx.kernel_code:
        raise NKIValueError(
            f"shared_hbm tensor `{name}` can only be created in top level kernel scope, not in "
            f"helper `{getattr(caller, 'co_name', '?')}`",
            "err_shared_hbm_must_in_kernel_level",
        )
    shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    index = ctx.shared_hbm_cursor
    ctx.shared_hbm_cursor += 1
    if index < len(ctx.shared_hbm):  # every SPMD instance maps to the same output
        tensor = ctx.shared_hbm[index]
        if tensor.shape != shape or tensor.dtype != dt.as_dtype(dtype):
            raise NKIValueError(
                "SPMD instances allocate different shared_hbm tensors", "err_shared_hbm_shape"
            )
        return tensor
    tensor = allocate(shape, dtype, shared_hbm, name, fill=dt.uninitialised(dt.as_dtype(dtype)))
    ctx.shared_hbm.append(tensor)
    return tensor


def _filled(shape, value, dtype, buffer, name, api):
    rules.check_allocated_init_value(api, hasattr(buffer, "__nki_buffer__"))
    buffer = _buffer(buffer)
    if buffer not in (sbuf, psum):
        raise NKIValueError(
            f"{api}: Creating HBM tensor with init value is not supported",
            "err_hbm_tensor_with_init_value_not_supported",
        )
    dtype = dt.as_dtype(dtype)
    tile = allocate(shape, dtype, buffer, name, fill=dt.cast(np.asarray(value), dtype))
    tile.storage.written = True
    inst = emit(
        "dve",
        "memset",
        outputs=[tile.region()],
        partitions=tile.shape[tile.par_axis],
        free_size=tile.data.size // builtins.max(1, tile.shape[tile.par_axis]),
        out_dtype=dtype,
        details={"value": float(value)},
    )
    return finish(tile, inst, None, None)


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
    """``nl.shared_constant(np_array, dtype=None)``: a constant HBM tensor (load before use).
    Without ``dtype`` a 64-bit array is stored in the 32-bit type of its kind."""
    array = np.asarray(constant)
    if dtype is None:
        dtype = (
            {"f": float32, "i": int32, "u": uint32}.get(array.dtype.kind, array.dtype)
            if (array.dtype.itemsize == 8)
            else array.dtype
        )
    dtype = dt.as_dtype(dtype)
    tensor = allocate(array.shape, dtype, "constant", "constant", fill=dt.cast(array, dtype).copy())
    tensor.storage.written = True
    return tensor


def shared_identity_matrix(n, dtype=uint8, **kwargs):
    """``nl.shared_identity_matrix(n, dtype=uint8)``: an identity matrix in HBM."""
    return shared_constant(np.identity(n), dtype)


def random_seed(seed, **kwargs):
    """``nl.random_seed(seed)``: seed ``nl.rand`` (per kernel run; a run starts at seed 0)."""
    current("nl.random_seed").rng = np.random.default_rng(int(seed))


def rand(shape, dtype=float32, **kwargs):
    """``nl.rand(shape, dtype=float32)``: uniform [0, 1) in SBUF."""
    values = current("nl.rand").rng.random(tuple(shape), dtype=np.float32)
    return compute_result("pool", "rand", values, dt.as_dtype(dtype), None, [])


# --- data movement ---------------------------------------------------------------------------
def _hbm_source(src, api):
    if not is_tile(src):
        raise NKITypeError(
            f"`src` of {api} must be an HBM tensor (indexed), got {type(src).__name__}",
            "err_unsupported_memory",
        )
    if src.on_chip:
        raise NKITypeError(
            f"Expected operand 'src' of '{api}' to be in address space 'hbm', but got a tile in "
            f"'{src.storage.memory}' instead",
            "err_unsupported_memory",
        )


def _tile_shape(shape) -> tuple[int, ...]:
    """The on-chip shape of an HBM access: rank ≥ 2, the first axis the partition axis."""
    shape = tuple(shape)
    return shape + (1,) * (2 - len(shape)) if len(shape) < 2 else shape


def hbm_access(view, mask):
    """(values read where ``mask`` holds (sentinel elsewhere), mask, addressed point count,
    region, contiguous row bytes) of an HBM tensor or access."""
    if isinstance(view, Access):
        values, mask = view.read(mask)
        return values, mask, view.count(mask), view.region(mask), view.row_bytes(mask)
    values = view.data
    count = values.size
    if mask is not None:
        full = np.broadcast_to(mask, values.shape)
        count = int(full.sum())
        values = np.where(full, values, np.asarray(dt.uninitialised(view.dtype), values.dtype))
    return values, mask, count, view.region(mask), contiguous_row_bytes(view.data)


def _check_indirect_arange(access, api):
    """ "Use nl.arange for indirect load/store access indexing, nl.mgrid won't work"
    (general/nki/nki_known_issues.rst@8a38e733 L31-32). nisa.dma_copy is not bound by it:
    AWS's indirect dma_copy example indexes with nl.mgrid (general/nki/test/
    test_nki_isa_dma_copy.py@8a38e733 L136-145)."""
    if isinstance(access, Access) and access.indirect is not None and access.from_mgrid:
        raise NKIIndexError(
            f'nl.{api} with indirect indexing built from nl.mgrid: "Use nl.arange for '
            "indirect load/store access indexing, nl.mgrid won't work\" "
            "(general/nki/nki_known_issues.rst@8a38e733 L31-32)",
            "err_indirect_indexing_with_mgrid",
        )


def load(src, *, mask=None, dtype=None, **kwargs):
    """``nl.load(src, *, mask=None, dtype=None)``: HBM → a new SBUF tile (DMA).

    The first axis of the access becomes the partition axis (≤ 128); a 1-D source gives a
    ``(n, 1)`` tile. Masked-off points are never read; they hold the uninitialised value in
    the result.
    """
    _hbm_source(src, "load")
    _check_indirect_arange(src, "load")
    shape = _tile_shape(src.shape)
    out_dtype = dt.as_dtype(dtype or src.dtype)
    m = resolve_mask(mask, src.shape)
    if m is False:
        return allocate(shape, out_dtype, fill=dt.uninitialised(out_dtype))
    values, m, count, region, row_bytes = hbm_access(src, m)
    tile_mask = None if m is None else align_mask(m.reshape(_tile_shape(m.shape)), shape)
    tile = result_tile(values.reshape(shape), out_dtype, tile_mask)
    inst = dma_record(
        "load",
        region,
        tile.region(tile_mask),
        extent(tile_mask, shape)[0],
        count * src.itemsize,
        row_bytes,
        "hbm->sbuf",
        src.dtype,
        out_dtype,
        inputs=indirect_inputs(src),
    )
    return finish(tile, inst, tile_mask, None)


def store(dst, value, *, mask=None, **kwargs):
    """``nl.store(dst, value, *, mask=None)``: write a tile (SBUF, or PSUM from 2.26) or a
    scalar into the HBM view ``dst`` (DMA). Masked-off points of ``dst`` are not written."""
    if not is_tile(dst) or dst.on_chip:
        raise NKITypeError(
            "Expected operand 'dst' of 'store' to be in address space 'hbm'",
            "err_unsupported_memory",
        )
    _check_indirect_arange(dst, "store")
    m = resolve_mask(mask, dst.shape)
    if m is False:
        return None
    if is_tile(value):
        op = tile_operand(value, "value", "store", mask=m)
        values, in_dtype, src_region = op.values, op.dtype, op.region
        partitions = extent(m, dst.shape)[0] if len(dst.shape) else 1
        direction = f"{op.memory}->hbm"
    else:
        # a loop variable is stored as its iteration's integer: ``nl.store(out, i, mask=i <
        # 4)`` in the errors manual's supported mask expressions (general/nki/api/
        # nki.errors.rst@8a38e733 L846-L856)
        value = concrete(value)
        values = np.asarray(value)
        in_dtype = dt.weak_scalar_dtype(value)
        src_region, partitions = None, dst.shape[0] if len(dst.shape) else 1
        direction = "sbuf->hbm"
    if isinstance(dst, Access):
        m = dst.combined_mask(m)
        count, region, row = dst.count(m), dst.region(m), dst.row_bytes(m)
    else:
        count = dst.size if m is None else int(np.broadcast_to(m, dst.shape).sum())
        region, row = dst.region(m), contiguous_row_bytes(dst.data)
    write_into(dst, values, m)
    dma_record(
        "store",
        src_region,
        region,
        partitions,
        count * dst.itemsize,
        row,
        direction,
        in_dtype,
        dst.dtype,
        inputs=indirect_inputs(dst),
    )
    return None


def load_transpose2d(src, *, mask=None, dtype=None, **kwargs):
    """``nl.load_transpose2d(src)``: load a 2-D HBM block transposed (DMA)."""
    _hbm_source(src, "load_transpose2d")
    if isinstance(src, Access) and src.indirect is not None:
        raise NKIIndexError(
            "load_transpose2d does not support indirect indices",
            "err_indirect_indices_are_not_supported_with_nki_api",
        )
    if len(src.shape) != 2:
        raise NKIValueError(
            "load_transpose2d takes a 2-D access", "err_exceed_max_supported_dimension"
        )
    m = resolve_mask(mask, src.shape)
    out_dtype = dt.as_dtype(dtype or src.dtype)
    if m is False:
        return allocate(src.shape[::-1], out_dtype, fill=dt.uninitialised(out_dtype))
    values, m, count, region, _ = hbm_access(src, m)
    tile_mask = None if m is None else m.T
    tile = result_tile(values.T, out_dtype, tile_mask)
    inst = dma_record(
        "load_transpose2d",
        region,
        tile.region(),
        tile.shape[0],
        count * src.itemsize,
        src.itemsize,
        "hbm->sbuf",
        src.dtype,
        out_dtype,
    )
    return finish(tile, inst, tile_mask, None)


def _same_target(value, dst) -> bool:
    return value.storage is dst.storage and value.region() == dst.region()


def assign(dst, value) -> None:
    """``tile[...] = value``: write an instruction's result (or copy a tile, with a cast) into
    an SBUF/PSUM tile. Assigning the result of the instruction just issued retargets that
    instruction's output (no copy), as the compiler does; masked-off points keep their old
    values."""
    if not dst.on_chip:
        raise NKITypeError(
            f"cannot assign into HBM tensor `{dst.name}` with '=': use nl.store",
            "err_unsupported_memory",
        )
    if getattr(value, "updated_in_place", False) and _same_target(value, dst):
        return  # `t[...] += x` already updated t in place
    ctx = current("assignment")
    fresh = getattr(value, "fresh", None)
    if fresh is not None and ctx.trace.instructions and fresh[0] is ctx.trace.instructions[-1]:
        inst, m, f32 = fresh
        rules.check_gpsimd_memory(
            f"{inst.opcode} (assigned into `{dst.name or 'tile'}`)",
            inst.engine,
            (dst.storage.memory,),
        )
        if inst.opcode == "nc_matmul" and dst.storage.memory == "psum":
            rules.check_legacy_matmul_result(
                "nisa.nc_matmul", dt.name(dst.dtype), f"assigned into `{dst.name or 'tile'}`"
            )
        write_into(dst, f32 if f32 is not None else value.data, m)
        inst.writes = (dst.region(),) + tuple(inst.writes[1:])
        inst.out_dtype = dt.name(dst.dtype)
        value.fresh = None
        return
    if is_tile(value):
        op = tile_operand(value, "value", "assignment")
        write_into(dst, op.values, None)
        emit(
            "dve",
            "tensor_copy",
            inputs=[op],
            outputs=[dst.region()],
            partitions=op.partitions,
            free_size=op.free_size,
            out_dtype=dst.dtype,
        )
        return
    if isinstance(value, (int, float, np.number, bool, np.bool_)):
        write_into(dst, np.asarray(value), None)
        emit(
            "dve",
            "memset",
            outputs=[dst.region()],
            partitions=dst.shape[0] if dst.shape else 1,
            free_size=int(np.prod(dst.shape[1:])),
            out_dtype=dst.dtype,
            details={"value": float(value)},
        )
        return
    raise NKITypeError(
        f"cannot assign {type(value).__name__} into a tile", "err_unsupported_assignment"
    )


def accumulate(dst, value, op_name: str) -> None:
    """``tile += value`` (and ``-=``, ``*=``, ``/=``): in place, in fp32, an associative
    update that ``affine_range`` allows. Adding the ``nc_matmul`` result just issued into a
    PSUM tile is the matmul's own PSUM accumulation (no Vector-engine instruction)."""
    ctx = current("in-place update")
    if not dst.on_chip:
        raise NKITypeError(
            f"cannot update HBM tensor `{dst.name}` in place: use nl.store",
            "err_unsupported_memory",
        )
    spec = fn.lookup(op_name)
    fresh = getattr(value, "fresh", None)
    last = ctx.trace.instructions[-1] if ctx.trace.instructions else None
    psum_accumulation = (
        fresh is not None
        and fresh[0] is last
        and last.opcode == "nc_matmul"
        and dst.storage.memory == "psum"
        and op_name == "add"
    )
    if psum_accumulation:
        rules.check_legacy_matmul_result(
            "nisa.nc_matmul", dt.name(dst.dtype), f"accumulated into `{dst.name or 'tile'}`"
        )
    if is_tile(value):
        src = tile_operand(value, "value", f"{op_name}=")
        rhs = fresh[2] if psum_accumulation and fresh[2] is not None else src.f32()
    else:
        src, rhs = None, np.float32(value)
    dst_op = tile_operand(dst, "dst", f"{op_name}=")
    lhs, rhs = align_shapes(dst_op.f32(), rhs)
    if psum_accumulation and not psum_blocks(ctx, dst.region()) & ctx.written_psum_blocks:
        # A PSUM tile no instruction has written yet: this matmul starts the accumulation
        # group, and "the first nki.isa.nc_matmul instruction overwrites the destination
        # PSUM bank with the instruction output" (aws-neuron-sdk@8a38e733
        # general/nki/arch/trainium_inferentia2_arch.rst L835-L837). Allocated kernels cannot
        # start from nl.zeros (errors manual, err_tensor_creation_on_scratchpad_with_init_
        # value_not_supported, L687-L697), so AWS's start from nl.ndarray
        # (general/nki/examples/attention/attention_kernels.py L846, L899).
        lhs = np.zeros_like(lhs)
    write_into(dst, spec.apply(lhs, rhs), fresh[1] if psum_accumulation else None, accumulate=True)
    if psum_accumulation:
        last.writes = (dst.region(),)
        last.details["accumulate"] = True
        value.fresh = None
        return
    emit(
        "dve",
        "tensor_tensor" if src is not None else "tensor_scalar",
        inputs=[dst_op, src],
        outputs=[dst.region()],
        partitions=dst_op.partitions,
        free_size=dst_op.free_size,
        out_dtype=dst.dtype,
        details={"op": op_name, "accumulate": True},
    )


def copy(src, *, mask=None, dtype=None, **kwargs):
    """``nl.copy(src, *, mask=None, dtype=None)``: copy (and cast) a tile (Vector engine)."""
    m = resolve_mask(mask)
    op = tile_operand(src, "src", "copy", mask=m)
    out_dtype = dt.as_dtype(dtype or op.dtype)
    if m is False:
        return allocate(op.shape, out_dtype, fill=dt.uninitialised(out_dtype))
    check_free_size(op, "nl.copy")
    return compute_result("dve", "tensor_copy", op.values, out_dtype, m, [op])


def static_cast(data, dtype, **kwargs):
    """``nl.static_cast(data, dtype)``: cast a tile, or a NumPy array / scalar outside a
    kernel (round to nearest even, saturating integers)."""
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
        raise NKIValueError(
            f"cannot broadcast a tile of shape {op.shape} to {shape}", "err_broadcast_shape"
        ) from exc
    engine_op = "partition_broadcast" if op.partitions != shape[0] else "tensor_copy"
    return compute_result(
        "dve", engine_op, values, op.dtype, None, [op], details={"from_partitions": op.partitions}
    )


def expand_dims(data, axis, **kwargs):
    """``nl.expand_dims(data, axis)``: add a size-1 free axis after the last axis (a view)."""
    if not isinstance(data, Tensor):
        raise NKITypeError("expand_dims takes a tile", "err_expand_dims_type")
    if axis not in (data.ndim, -1):
        raise NKIValueError(
            "expand_dims adds an axis after the last axis only", "err_expand_dims_axis"
        )
    return Tensor(
        data.data[..., None], data.dtype, data.storage, par_axis=data.par_axis, loops=data.loops
    )


def transpose(x, *, dtype=None, mask=None, **kwargs):
    """``nl.transpose(x)``: swap partition and free axes of a 2-D tile (Tensor engine, ≤128
    on both axes; result in PSUM)."""
    op = tile_operand(x, "x", "transpose", allow_psum=False)
    rules.check_allocated_transpose("nl.transpose", current("transpose").allocated)
    if len(op.shape) > 2:
        raise NKIValueError(
            f"parameter 'x{list(op.shape)}' of 'transpose' exceed max supported number of "
            "dimensions of 2",
            "err_exceed_max_supported_dimension",
        )
    for axis, n in enumerate(op.shape):
        if n > 128:
            raise NKIValueError(
                f"size of dimension {axis} in 'x{list(op.shape)}' of 'transpose' exceed "
                "architecture limitation of 128",
                "err_size_of_dimension_exceed_arch_limit",
            )
    out_dtype = dt.as_dtype(dtype or op.dtype)
    m = resolve_mask(mask)
    return compute_result(
        "pe",
        "nc_transpose",
        op.values.T,
        out_dtype,
        None if m is False else m,
        [op],
        partitions=op.shape[0],
        free_size=op.shape[1],
        buffer=psum,
    )


def matmul(x, y, *, transpose_x=False, mask=None, **kwargs):
    """``nl.matmul(x, y, *, transpose_x=False)``: ``x @ y`` (or ``x.T @ y``) on the Tensor
    engine; x ≤ 128×128, y (K ≤ 128, ≤ 512); returns an fp32 PSUM tile. Without
    ``transpose_x`` the compiler first transposes ``x`` on the Tensor engine."""
    from . import isa

    y = _in_sbuf(y)
    if transpose_x:
        return isa.nc_matmul(_in_sbuf(x), y, mask=mask)
    op = tile_operand(x, "x", "matmul")
    x_t = copy(transpose(_in_sbuf(x)), dtype=op.dtype)
    return isa.nc_matmul(x_t, y, mask=mask)


def _in_sbuf(tile):
    """An nl.matmul operand in PSUM, e.g. an nl.transpose result, is first copied to SBUF
    (one Vector copy), as the compiler lowers AWS's attention tutorial, which multiplies by
    ``nl.transpose(v_sbuf)`` (aws-neuron-sdk@8a38e733
    general/nki/examples/attention/attention_kernels.py L53-L56); the Tensor engine itself
    reads SBUF only (nisa.nc_matmul, general/nki/api/nki/isa/__init__.py L870-872)."""
    if is_tile(tile) and tile.on_chip and tile.storage.memory == "psum":
        return copy(tile)
    return tile


def where(condition, x, y, *, dtype=None, mask=None, **kwargs):
    """``nl.where(condition, x, y)``: elementwise select (Vector engine)."""
    m = resolve_mask(mask)
    c = tile_operand(condition, "condition", "where", mask=m)
    xv = tile_operand(x, "x", "where", mask=m) if is_tile(x) else None
    yv = tile_operand(y, "y", "where", mask=m) if is_tile(y) else None
    xa = xv.f32() if xv else np.float32(x)
    ya = yv.f32() if yv else np.float32(y)
    default = dt.promote(_operand_dtype(x), _operand_dtype(y))
    out_dtype = dt.as_dtype(dtype or default)
    cond, xa = align_shapes(c.values, xa)
    cond, ya = align_shapes(cond, ya)
    values = sem.select(cond.astype(bool), xa, ya)
    if m is False:
        return allocate(values.shape, out_dtype, fill=dt.uninitialised(out_dtype))
    return compute_result("dve", "select", values, out_dtype, m, [c, xv, yv])


# --- elementwise math ------------------------------------------------------------------------
def _operand_dtype(value):
    return value.dtype if is_tile(value) else dt.weak_scalar_dtype(value)


def elementwise_unary(name: str, x, dtype=None, mask=None):
    """One unary op over a tile: the Scalar engine's ``activation`` for transcendental
    functions, the Vector engine otherwise."""
    m = resolve_mask(mask)
    op = tile_operand(x, "x", name, mask=m)
    check_free_size(op, f"nl.{name}")
    spec = fn.lookup(name)
    out_dtype = dt.as_dtype(dtype or op.dtype)
    if m is False:
        return allocate(op.shape, out_dtype, fill=dt.uninitialised(out_dtype))
    if spec.bitvec:
        if not dt.is_int(op.dtype):
            raise NKITypeError(
                f"nl.{name} is a bit operation and takes integer tiles", "err_bitvec_dtype"
            )
        values = spec.apply(op.values)
    elif name in fn.COMPARISONS or name == "logical_not":
        values = spec.apply(op.f32())
    else:  # the Scalar engine approximates its transcendental functions when asked to
        approximate = name in fn.TRANSCENDENTAL and approx_mode.approx_bound()
        values = sem.activation(
            spec,
            work_f32(op, out_dtype),
            approximate=(approx_mode.scalar_engine if approximate else None),
        )
    engine, opcode = (
        ("act", "activation") if name in fn.TRANSCENDENTAL else ("dve", "tensor_scalar")
    )
    rules.check_allocated_bias(f"nl.{name}", engine == "act" and current(name).allocated, False)
    return compute_result(engine, opcode, values, out_dtype, m, [op], details={"op": name})


def _partition_broadcast_check(a: Operand, b: Operand, api: str, operator: bool):
    if a.partitions == b.partitions:
        return 0
    if operator:
        raise NKIValueError(
            f"operator {api} does not broadcast along the partition dimension ({a.partitions} vs "
            f"{b.partitions} partitions): use nl.{api} or broadcast_to first",
            "err_num_partition_mismatch",
        )
    if 1 not in (a.partitions, b.partitions):
        raise NKIValueError(
            f"number of partitions mismatch in parameters of '{api}' ({a.partitions} vs "
            f"{b.partitions})",
            "err_num_partition_mismatch",
        )
    return builtins.max(a.partitions, b.partitions)


_EXACT_INT_OPS = ("add", "subtract", "multiply", "maximum", "minimum")


def elementwise_binary(name, x, y, dtype=None, mask=None, operator=False):
    """One binary op: Vector ``tensor_scalar`` when one side is a scalar or a ``(P, 1)``
    per-partition column, ``tensor_tensor`` otherwise (``power`` and integer arithmetic run
    on GpSimd). Operands broadcast partition-aligned (a lower rank is padded on the right);
    the ``nl.*`` functions also broadcast a one-partition operand across partitions (an extra
    instruction), Python operators do not."""
    spec = fn.lookup(name)
    x_tile, y_tile = is_tile(x), is_tile(y)
    if not (x_tile or y_tile):
        raise NKITypeError(
            f"nl.{name} needs at least one tile operand",
            "err_failed_to_infer_tile_from_local_tensor",
        )
    m = resolve_mask(mask)
    xo = tile_operand(x, "x", name, mask=m) if x_tile else None
    yo = tile_operand(y, "y", name, mask=m) if y_tile else None
    for o in (xo, yo):
        if o is not None:
            check_free_size(o, f"nl.{name}")
    promoted = dt.promote(_operand_dtype(x), _operand_dtype(y))
    default = dt.bool_ if name in fn.COMPARISONS else promoted
    out_dtype = dt.as_dtype(dtype or default)
    both_int = builtins.all(dt.is_int(_operand_dtype(v)) for v in (x, y))
    if spec.bitvec:
        if not both_int:
            raise NKITypeError(
                f"nl.{name} is a bit operation and takes integer tiles", "err_bitvec_dtype"
            )
        mode = "raw"
        xv = xo.values if xo else np.asarray(x)
        yv = yo.values if yo else np.asarray(y)
    elif both_int and name in _EXACT_INT_OPS:
        mode = "raw"
        xv = xo.values.astype(np.int64) if xo else np.int64(x)
        yv = yo.values.astype(np.int64) if yo else np.int64(y)
    else:  # fp32 arithmetic; ufuncs convert the tiles' values to fp32 on the fly
        mode = "fp32"
        xv = xo.values if xo else np.float32(x)
        yv = yo.values if yo else np.float32(y)
    inputs = [o for o in (xo, yo) if o is not None]
    scalar_like = True
    if xo is not None and yo is not None:
        xv, yv = align_shapes(xv, yv)
        bcast = _partition_broadcast_check(xo, yo, name, operator)
        if bcast:
            small = xo if xo.partitions == 1 else yo
            emit(
                "dve",
                "partition_broadcast",
                inputs=[small],
                outputs=[],
                partitions=bcast,
                free_size=small.free_size,
                out_dtype=small.dtype,
            )
        scalar_like = xo.free_size == 1 or yo.free_size == 1
    try:
        shape = np.broadcast_shapes(np.shape(xv), np.shape(yv))
    except ValueError as exc:
        raise NKIValueError(
            f"nl.{name}: shapes {np.shape(xv)} and {np.shape(yv)} do not broadcast",
            "err_broadcast_shape",
        ) from exc
    # the fp32 result goes into a work copy of the operand that already has the result's shape
    full = next((o for o in (xo, yo) if o is not None and o.shape == shape), None)
    if mode == "raw":
        values = spec.apply(xv, yv)
    elif full is None or name in fn.COMPARISONS:
        values = spec.apply(dt.compute(xv), dt.compute(yv))
    else:
        work = work_f32(full, out_dtype)
        a, b = (work, yv) if full is xo else (xv, work)
        values = spec.apply(a, b, out=work)
    if m is False:
        return allocate(values.shape, out_dtype, fill=dt.uninitialised(out_dtype))
    if name == "power" or (both_int and name in _EXACT_INT_OPS and not scalar_like):
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
def _reduce(name, x, axis, dtype, mask, keepdims):
    """A reduction over free axes on the Vector engine (``tensor_reduce``), in fp32.

    Masked-off elements do not take part (``mean``/``var`` divide by the number of valid
    elements); an output point whose inputs are all masked off is not computed.
    """
    m = resolve_mask(mask)
    op = tile_operand(x, "x", name, mask=m)
    check_free_size(op, f"nl.{name}")
    axes = tuple(axis) if isinstance(axis, (list, tuple)) else (axis,)
    ndim = op.values.ndim
    axes = tuple(sorted({int(a) % ndim for a in axes}))
    if 0 in axes:
        raise NKIValueError(
            f"nl.{name} reduces free axes only; axis 0 is the partition axis "
            "(use a matmul with a ones vector, or nisa.tensor_partition_reduce)",
            "err_reduce_partition_axis",
        )
    default = dt.float32 if name in ("mean", "var") and dt.is_int(op.dtype) else op.dtype
    out_dtype = dt.as_dtype(dtype or (dt.bool_ if name == "all" else default))
    if m is False:
        shape = tuple(1 if a in axes else n for a, n in enumerate(op.shape))
        return allocate(
            shape if keepdims else tuple(n for a, n in enumerate(op.shape) if a not in axes),
            out_dtype,
            fill=dt.uninitialised(out_dtype),
        )
    valid = None if m is None else np.broadcast_to(align_mask(m, op.shape), op.shape)
    result, out_mask = sem.reduce_axes(name, op.f32(), axes, valid)
    if not keepdims:
        result = result.reshape(tuple(n for a, n in enumerate(result.shape) if a not in axes))
        if out_mask is not None:
            out_mask = out_mask.reshape(result.shape)
    partitions, free = extent(m, op.shape)
    return compute_result(
        "dve",
        "tensor_reduce",
        np.asarray(result, np.float32),
        out_dtype,
        out_mask,
        [op],
        partitions=partitions,
        free_size=free,
        details={"op": name},
    )


def _reduction(name, doc):
    def op(x, axis, *, dtype=None, mask=None, keepdims=False, **kwargs):
        return _reduce(name, x, axis, dtype, mask, keepdims)

    op.__name__ = op.__qualname__ = name
    op.__doc__ = (
        f"``nl.{name}(x, axis, *, dtype=None, mask=None, keepdims=False)``: {doc} over "
        "the free axes ``axis`` (int or list, NumPy numbering; never 0)."
    )
    return op


sum = _reduction("sum", "sum")  # noqa: A001
prod = _reduction("prod", "product")
max = _reduction("max", "maximum")  # noqa: A001
min = _reduction("min", "minimum")  # noqa: A001
mean = _reduction("mean", "arithmetic mean (fp32 for integer input)")
var = _reduction("var", "population variance")
all = _reduction("all", "logical and")  # noqa: A001
# the reductions also name their ALU operator when passed as ``op=`` / ``reduce_op=``
sum.__nki_op__, prod.__nki_op__ = "add", "multiply"
max.__nki_op__, min.__nki_op__ = "maximum", "minimum"


def softmax(x, axis, *, dtype=None, compute_dtype=None, mask=None, **kwargs):
    """``nl.softmax(x, axis)``: exp(x - max) / sum(exp(x - max)) along free ``axis``."""
    shifted = subtract(x, max(x, axis=axis, keepdims=True, dtype=float32), dtype=float32)
    e = exp(shifted, dtype=float32)
    return divide(e, sum(e, axis=axis, keepdims=True, dtype=float32), dtype=dtype or x.dtype)


def rms_norm(x, w, axis, n, epsilon=1e-06, *, dtype=None, compute_dtype=None, mask=None, **kwargs):
    """``nl.rms_norm(x, w, axis, n, epsilon=1e-6)``: ``x / RMS(x) * w`` with
    ``RMS(x) = sqrt(sum(x**2 along axis) / n + epsilon)``, ``n`` "the total number of values to
    calculate rms" (general/nki/api/nki/language/__init__.py@8a38e733 L1375-1390); "currently
    dtype and compute_dtype behave the same, both sets internal compute and return dtype"
    (L1385-1386), so the steps compute in that dtype (default: ``x``'s)."""
    work = compute_dtype or dtype or x.dtype
    total = sum(
        square(x, dtype=float32, mask=mask), axis=axis, keepdims=True, dtype=float32, mask=mask
    )
    rstd = rsqrt(
        add(multiply(total, 1.0 / concrete(n), dtype=float32), epsilon, dtype=float32),
        dtype=float32,
    )
    return multiply(multiply(x, rstd, dtype=work, mask=mask), w, dtype=dtype or work, mask=mask)


def dropout(x, rate, *, dtype=None, mask=None, **kwargs):
    """``nl.dropout(x, rate)``: zero elements of ``x`` with probability ``rate``, a number or
    a one-element tile (general/nki/api/nki/language/__init__.py@8a38e733 L496-506); the
    Vector engine's ``nisa.dropout``."""
    from . import isa

    if is_tile(rate):
        if int(np.prod(rate.shape)) != 1:
            raise NKIValueError(
                f"nl.dropout rate is a scalar or a tile with 1 element, got "
                f"shape {tuple(rate.shape)}",
                "err_unsupported_shape",
            )
        rate = broadcast_to(rate, shape=(x.shape[0], 1))
    return isa.dropout(x, rate, dtype=dtype, mask=mask)


# --- indexing helpers and misc ---------------------------------------------------------------
def gather_flattened(data, indices, *, mask=None, dtype=None, **kwargs):
    """``nl.gather_flattened(data, indices)``: per partition, gather elements of ``data``'s
    flattened free axes at the (uint32) ``indices`` (GpSimd). Out-of-range indices give
    garbage on the hardware; here they read the uninitialised value."""
    src = tile_operand(data, "data", "gather_flattened", allow_psum=False)
    idx = tile_operand(indices, "indices", "gather_flattened", allow_psum=False)
    rules.check_gather_indices(dt.name(idx.dtype), f"indices `{indices.name or 'tile'}`")
    for argname, op in (("data", src), ("indices", idx)):
        if not 2 <= len(op.shape) <= 4:
            raise NKIValueError(
                f'gather_flattened: {argname} is {len(op.shape)}-dimensional; "Both data and '
                'indices must be 2-, 3-, or 4-dimensional" (general/nki/api/nki/language/'
                "__init__.py@8a38e733 L667)",
                "err_exceed_max_supported_dimension",
            )
    if src.partitions != idx.partitions:
        raise NKIValueError(
            "gather_flattened: data and indices have different partition counts",
            "err_num_partition_mismatch",
        )
    flat = src.values.reshape(src.partitions, -1)
    positions = idx.values.reshape(idx.partitions, -1).astype(np.int64)
    inside = (positions >= 0) & (positions < flat.shape[1])
    gathered = np.take_along_axis(flat, np.where(inside, positions, 0), axis=1)
    values = np.where(inside, dt.compute(gathered), np.float32(dt.uninitialised(src.dtype)))
    out_dtype = dt.as_dtype(dtype or src.dtype)
    m = resolve_mask(mask)
    return compute_result(
        "pool",
        "gather_flattened",
        values.reshape(idx.shape),
        out_dtype,
        None if m is False else m,
        [src, idx],
    )


def atomic_rmw(dst, value, op=np.add, *, mask=None, **kwargs):
    """``nl.atomic_rmw(dst, value, op=np.add)``: ``dst = op(dst, value)`` on an HBM view
    (indirect indices allowed) by DMA read-modify-write."""
    from . import isa

    rules.check_atomic_rmw(
        fn.lookup(op, "op").name,
        isinstance(dst, Access) and dst.indirect is not None,
        f"dst `{getattr(dst, 'name', '') or 'tensor'}`",
    )
    if isinstance(value, (int, float, np.number)) and not isinstance(value, bool):
        # "tile or scalar value that is the operand to op" (general/nki/api/nki/language/
        # __init__.py@8a38e733 L346): the scalar is materialised as an SBUF tile of dst's shape
        value = isa.memset(tuple(dst.shape), value, dst.dtype)
    if is_tile(value):
        vars(isa)["dma_copy"](dst=dst, src=value, mask=mask, dst_rmw_op=op)
        return None
    raise NKITypeError("atomic_rmw value must be a tile or a scalar", "err_unsupported_memory")


def device_print(prefix, x, *, mask=None, **kwargs):
    """``nl.device_print(prefix, x)``: print a tile's values (simulation only)."""
    ctx = current("nl.device_print")
    if not ctx.print_enabled:
        return
    values = x.data if isinstance(x, Tensor) else (x.read()[0] if isinstance(x, Access) else x)
    print(prefix, np.asarray(values))


sdk.gate_module(sys.modules[__name__], "nl")


def loop_reduce(x, op, loop_indices, *, dtype=None, mask=None, **kwargs):
    """``nl.loop_reduce(x, op, loop_indices, *, dtype=None, mask=None)``: ``b =
    nl.loop_reduce(a, op=np.add, loop_indices=[k_i])`` inside a loop updates the tile ``b``
    already holds, as ``b = nisa.tensor_tensor(data1=b, data2=a, op=np.add)`` would ("The
    destination tile is also the rhs input to ``op``", aws-neuron-sdk@8a38e733
    general/nki/api/nki/language/__init__.py L990-L1020): one Vector-engine
    ``tensor_tensor`` reading and writing the destination, an associative update that
    ``affine_range`` iterations may share. The destination is the assignment's target, which
    the kernel's recompiled source passes in (:mod:`simulate.core.scoping`)."""
    api = "nl.loop_reduce"
    destination = kwargs.pop(DESTINATION_KEYWORD, None)
    ctx = current(api)
    if destination is None:
        raise NKIValueError(
            f"{api} updates the tile its result is assigned to (`b = nl.loop_reduce(a, ...)` "
            "with `b` a tile defined before the loop); use it in an assignment of a kernel "
            "whose source is available",
            "err_unsupported_expression",
        )
    try:
        dst = destination()
    except NameError as exc:
        raise NKIValueError(
            f"{api}: the tile assigned its result must exist before the loop ({exc})",
            "err_unsupported_expression",
        ) from exc
    if not is_tile(dst) or not dst.on_chip:
        raise NKITypeError(
            f"{api} updates an SBUF/PSUM tile, its destination is {type(dst).__name__}",
            "err_unsupported_memory",
        )
    indices = loop_indices if isinstance(loop_indices, (list, tuple)) else [loop_indices]
    if (
        not ctx.loops
        or not indices
        or not builtins.all(isinstance(i, (int, np.integer, LoopIndex)) for i in indices)
    ):
        raise NKIValueError(
            f"{api} reduces over running loops: `loop_indices` is a loop index or a list of "
            f"them, inside that loop (got {loop_indices!r})",
            "err_unsupported_expression",
        )
    spec = fn.lookup(op, "op")
    m = resolve_mask(mask)
    src = tile_operand(x, "x", api, mask=m)
    dst_op = tile_operand(dst, "destination", api, mask=m)
    check_free_size(src, api)
    if (src.partitions, src.free_size) != (dst_op.partitions, dst_op.free_size):
        raise NKIValueError(
            f"{api}: `x` has {src.partitions} x {src.free_size} elements per partition, its "
            f"destination {dst_op.partitions} x {dst_op.free_size}",
            "err_num_partition_mismatch",
        )
    if dtype is not None and dt.as_dtype(dtype) != dst.dtype:
        raise NKITypeError(
            f"{api}: dtype={dt.name(dt.as_dtype(dtype))} differs from its destination tile's "
            f"{dt.name(dst.dtype)}, which holds the result",
            "err_unsupported_dtype",
        )
    if m is False:
        return dst
    lhs, rhs = align_shapes(dst_op.f32(), src.f32().reshape(dst_op.f32().shape))
    write_into(dst, spec.apply(lhs, rhs), m, accumulate=True)
    partitions, free = extent(m, dst.shape)
    emit(
        "dve",
        "tensor_tensor",
        inputs=[dst_op, src],
        outputs=[dst.region(m)],
        partitions=partitions,
        free_size=free,
        out_dtype=dst.dtype,
        details={"op": spec.name, "accumulate": True},
    )
    return dst
