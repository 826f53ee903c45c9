"""``nki.isa`` (0.6): one function per instruction, destination first.

Every instruction writes into a caller-supplied ``dst`` view and returns an opaque
:class:`NkiInstruction`; there are no ``dtype=`` or ``mask=`` parameters: the output type is
``dst.dtype`` (MIG 0.1->0.2, ``nki/migration/index.rst@81ce03ae``). Arithmetic runs in
float32 and rounds on write (SHARED ``nki/api/nki.api.shared.rst@81ce03ae``). Operands pair
element by element in row-major order when they have the same partition count and the same
number of elements per partition (ABOUT L200-202; RN L90-92). Constraint violations raise
:class:`NkiValidationError` (an ``AssertionError``) naming the instruction and operand, in
the wording of the official simulator (``nki/guides/nki_simulator.rst@81ce03ae``, line 269).
"""

from __future__ import annotations

import enum
import math
import sys
import warnings

import numpy as np

from simulate.core import dtypes as core_dtypes
from simulate.core import functions as fn
from simulate.core import rules
from simulate.core import semantics as sem
from simulate.core.dtypes import is_number
from simulate.core.instructions import dma_trace_fields
from simulate.core.tensor import run_bytes

from . import context
from . import dtypes as dt
from .errors import (
    NkiTypeError,
    NkiValidationError,
    enforce,
)
from .tensor import (
    NkiTensor,
    VirtualRegister,
    initialized_mask,
    matmul_mask,
    partition_start,
    region,
    write,
)

PMAX = 128


# --- enums (STUB-ISA) ---------------------------------------------------------------------------
class engine(enum.Enum):  # noqa: N801 - the NKI name
    unknown = 0
    tensor = 1
    scalar = 2
    gpsimd = 3
    dma = 4
    vector = 5
    sync = 6


tensor_engine, scalar_engine, gpsimd_engine = engine.tensor, engine.scalar, engine.gpsimd
vector_engine, unknown_engine = engine.vector, engine.unknown
_TRACE_ENGINE = {
    engine.tensor: "pe",
    engine.scalar: "act",
    engine.gpsimd: "pool",
    engine.vector: "dve",
    engine.dma: "dma",
    engine.sync: "dma",
}


class reduce_cmd(enum.Enum):  # noqa: N801
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class dge_mode(enum.Enum):  # noqa: N801
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class oob_mode(enum.Enum):  # noqa: N801
    error = 0
    skip = 1


class matmul_perf_mode(enum.Enum):  # noqa: N801
    # the stub's string values (aws-neuron-sdk@81ce03ae nki/api/nki/isa/__init__.py L100-107)
    none = "none"
    double_row = "double_row"


class dma_engine(enum.Enum):  # noqa: N801
    dma = 1
    gpsimd_dma = 2


_ENUM_DOC = (
    "enums support only == and != (aws-neuron-sdk@81ce03ae nki/get-started/"
    'nki-language-guide.rst L661: "No other binary operators on enum values are supported")'
)


def _caller() -> str:
    """``file:line`` of the kernel code that applied an operator to an enum."""
    frame = sys._getframe(2)
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _enum_operator(name, permissive):
    def reject(self, *other):
        if not context.language_check_enabled():  # the debugging switch: IntEnum behaviour
            return permissive(self.value, *other)
        raise NkiTypeError(
            f"{_caller()}: {name} on {self!r}: {_ENUM_DOC}; nc_version also orders against "
            "nc_version (<, <=, >, >=) as AWS's kernels compare it (aws-neuron/nki-library@d2ad3a5 "
            "src/nkilib_src/nkilib/core/attention/attention_tkg.py L2332)"
        )

    reject.__name__ = name
    return reject


def _version_order(name, compare):
    def order(self, other):
        if not isinstance(other, nc_version) and not context.language_check_enabled():
            return compare(self.value, other)
        if not isinstance(other, nc_version):
            raise NkiTypeError(
                f"{_caller()}: {self!r} {name} {other!r}: nc_version orders only against "
                f"nc_version members; {_ENUM_DOC}"
            )
        return compare(self.value, other.value)

    order.__name__ = name
    return order


class nc_version(enum.Enum):  # noqa: N801
    """A plain enum, as in the 0.6 stub (``nki/api/nki/isa/__init__.py@81ce03ae`` L111), with
    the ordering comparisons AWS's kernels make on ``get_nc_version()``
    (aws-neuron/nki-library@d2ad3a5 ``core/attention/attention_tkg.py`` L2332 ``>=``,
    ``core/topk/rotational_topk_utils.py`` L901 ``<=``); ``int()`` and arithmetic raise."""

    gen2 = 2
    gen3 = 3
    gen4 = 4

    __lt__ = _version_order("<", lambda a, b: a < b)
    __le__ = _version_order("<=", lambda a, b: a <= b)
    __gt__ = _version_order(">", lambda a, b: a > b)
    __ge__ = _version_order(">=", lambda a, b: a >= b)
    __int__ = __index__ = _enum_operator("int()", int)
    __float__ = _enum_operator("float()", float)
    __add__ = __radd__ = _enum_operator("+", lambda a, b: a + b)
    __sub__ = _enum_operator("-", lambda a, b: a - b)
    __rsub__ = _enum_operator("-", lambda a, b: b - a)
    __mul__ = __rmul__ = _enum_operator("*", lambda a, b: a * b)


def get_nc_version() -> nc_version:
    return nc_version(context.current("nisa.get_nc_version").target.nc_version)


def get_nc_sub_version() -> int:
    return 0


class NkiInstruction:
    """What every instruction returns: a handle for scheduling edges (SCHED)."""

    def __init__(self, opcode: str, name: str | None, loops: tuple = ()):
        self.opcode = opcode
        self.name = name
        self.loops = loops  # the runtime-loop bodies it sits in, outermost first

    def depends_on(self, *producers) -> NkiInstruction:
        """Edges from ``producers``. "both instructions must sit at the same dynamic-loop
        nesting (or the producer in an enclosing scope). You cannot wire an edge into or out
        of a dynamic loop" (aws-neuron-sdk@81ce03ae nki/api/nki/isa/__init__.py L158-162):
        the producer's runtime-loop bodies must be the consumer's or enclose them."""
        for p in producers:
            if not isinstance(p, NkiInstruction):
                raise NkiTypeError(f"depends_on takes NkiInstruction handles, got {p!r}")
            if self.loops[: len(p.loops)] != p.loops:
                raise NkiValidationError(
                    f"depends_on: the producer `{p.opcode}` sits in a runtime loop "
                    f"(nl.fori_loop / nl.while_loop) that does not enclose `{self.opcode}`: "
                    "'You cannot wire an edge into or out of a dynamic loop' "
                    "(aws-neuron-sdk@81ce03ae nki/api/nki/isa/__init__.py L158-162)"
                )
        return self


# --- operand checks ----------------------------------------------------------------------------
#: Enums whose raw integer values AWS's kernels pass, contrary to the migration guide
#: (aws-neuron-sdk@81ce03ae ``nki/migration/index.rst`` L625: "Raw integer values (e.g.,
#: ``dge_mode=2``) are no longer accepted"): ``dge_mode=_DGE_MODE_NONE`` with
#: ``_DGE_MODE_NONE = 3`` (aws-neuron/nki-library@d2ad3a5
#: ``src/nkilib_src/nkilib/core/subkernels/norm_tkg_utils.py`` L29, ``core/qkv/qkv_tkg.py``
#: L66; the same on 2.29_release). Known-compiling code wins; other enums stay strict.
RAW_INT_ENUMS = ("dge_mode",)
#: Enums whose member values (strings in the stub) AWS's kernels pass as is: the migration
#: guide's ban names raw integers and lists the five integer enums, not matmul_perf_mode
#: (L622-626), whose values are ``'none'`` / ``'double_row'`` (isa ``__init__.py`` L100-107);
#: AWS passes ``perf_mode=('double_row' if ... else 'none')`` (aws-neuron/nki-library@d2ad3a5
#: ``src/nkilib_src/nkilib/core/mlp/mlp_cte/mlp_cte_projection.py`` L1166,
#: ``core/qkv/qkv_cte.py`` L1382).
RAW_STRING_ENUMS = ("matmul_perf_mode",)


def _enum(value, cls, argname, api):
    if cls.__name__ in RAW_INT_ENUMS and type(value) is int:
        try:
            return cls(value)
        except ValueError:
            pass  # not a member's value: the error below
    if cls.__name__ in RAW_STRING_ENUMS and type(value) is str:
        try:
            return cls(value)
        except ValueError:
            pass  # not a member's value: the error below
    if not isinstance(value, cls):
        raise NkiTypeError(
            f"{api} {argname}={value!r}: expected a nisa.{cls.__name__} member "
            "(raw integers are not accepted since NKI 0.3)"
        )
    return value


def _tensor(api, argname, t) -> NkiTensor:
    if not isinstance(t, NkiTensor):
        raise NkiTypeError(f"{api} {argname} must be an NkiTensor, got {type(t).__name__}")
    return t


def _on_chip(api, argname, t, *, psum=True, sbuf=True) -> NkiTensor:
    """An SBUF/PSUM operand: <= 128 partitions, contiguous partitions, in the allowed memory."""
    _tensor(api, argname, t)
    memory = t.storage.memory
    if memory == "hbm":
        raise NkiTypeError(
            f"{api} {argname} must be in SBUF or PSUM, got a tensor in "
            f"{t.buffer.value} (`{t.name}`)"
        )
    if memory == "psum" and not psum:
        raise NkiTypeError(f"{api} {argname} cannot be in PSUM (`{t.name}`)")
    if memory == "sbuf" and not sbuf:
        raise NkiTypeError(f"{api} {argname} must be in PSUM, got a tensor in SBUF (`{t.name}`)")
    if t.shape[0] > PMAX:
        raise NkiValidationError(
            f"{api} {argname} partition dimension {t.shape[0]} exceeds maximum {PMAX}"
        )
    if t.shape[0] > 1 and t.strides[0] != t.free_units():
        raise NkiValidationError(
            f"{api} {argname} must access consecutive partitions (partition "
            f"stride {t.strides[0]}, partition size {t.free_units()})"
        )
    if partition_start(t) + t.shape[0] > PMAX:
        raise NkiValidationError(
            f"{api} {argname} reaches partition "
            f"{partition_start(t) + t.shape[0] - 1}, beyond {PMAX - 1}"
        )
    return t


def _free(t: NkiTensor) -> int:
    return t.size // t.shape[0]


def _pair(api, a_name, a, b_name, b) -> None:
    if a.shape[0] != b.shape[0] or _free(a) != _free(b):
        raise NkiValidationError(
            f"{api} {b_name} has {b.shape[0]} partitions x {_free(b)} elements, {a_name} has "
            f"{a.shape[0]} x {_free(a)}: operands need the same partitions and elements per "
            "partition"
        )


def _not_both_psum(api, a_name, a, b_name, b) -> None:
    if a.storage.memory == "psum" and b.storage.memory == "psum":
        raise NkiValidationError(f"{api} {a_name} and {b_name} cannot both be in PSUM")


def _two_tiles(api, first, second, dst) -> None:
    """The operand rules of a two-tile Vector instruction: all on chip, the two inputs and
    ``dst`` paired, the two inputs not both in PSUM (``first``/``second``: (name, tensor))."""
    (a_name, a), (b_name, b) = first, second
    for argname, t in (first, second, ("dst", dst)):
        _on_chip(api, argname, t)
    _pair(api, a_name, a, b_name, b)
    _pair(api, a_name, a, "dst", dst)
    _not_both_psum(api, a_name, a, b_name, b)


def _pf(t: NkiTensor, f32: bool = True) -> np.ndarray:
    """The operand's values as (partitions, elements per partition). The packed MX types are
    only copied (``f32=False``) or read by the MX instructions: no engine computes on them."""
    if f32 and t.dtype in dt.PACKED:
        raise NkiTypeError(
            f"`{t.name}` is {t.dtype}: four packed values per element, an operand of "
            "nisa.nc_matmul_mx only (or of a same-dtype copy / DMA) "
            "(aws-neuron-sdk@81ce03ae nki/api/nki.api.shared.rst L268)"
        )
    values = t.values().reshape(t.shape[0], -1)
    return values.astype(np.float32, copy=False) if f32 else values


def _version(api) -> int:
    return context.current(api).target.nc_version


def _engine_of(api, requested, default: engine, allowed) -> engine:
    requested = _enum(requested, engine, "engine", api)
    chosen = default if requested is engine.unknown else requested
    if chosen not in allowed:
        raise NkiValidationError(
            f"{api} cannot run on the {chosen.name} engine; allowed: "
            + ", ".join(e.name for e in allowed)
        )
    return chosen


def _no_gpsimd_psum(api, eng, *operands) -> None:
    """GpSimd cannot access PSUM (the core's rule, with the 0.6 docs)."""
    for name, t in operands:
        if t is not None:
            enforce(
                rules.check_gpsimd_memory,
                api,
                _TRACE_ENGINE.get(eng, ""),
                (t.storage.memory,),
                name,
                dialect="nki06",
            )


def _scalar(api, argname, value, partitions, *, f32_tile=False):
    """A compile-time scalar or a (P, 1) per-partition tile -> (fp32 scalar or (P, 1), tile)."""
    if isinstance(value, NkiTensor):
        _on_chip(api, argname, value)
        if _free(value) != 1 or value.shape[0] != partitions:
            raise NkiValidationError(
                f"{api} {argname} must be a scalar or a ({partitions}, 1) "
                f"tile, got shape {tuple(value.shape)}"
            )
        if f32_tile and value.dtype is not dt.float32:
            raise NkiTypeError(f"{api} {argname} must be a float32 tile, got {value.dtype}")
        return _pf(value), value
    if is_number(value):
        return np.float32(value), None
    raise NkiTypeError(
        f"{api} {argname} must be a scalar or a (P, 1) tile, got {type(value).__name__}"
    )


def _emit(
    engine_name,
    opcode,
    name,
    *,
    reads=(),
    writes=(),
    partitions,
    out_dtype,
    free_size=None,
    details=None,
    dma=None,
) -> NkiInstruction:
    """Append the instruction to the launch's trace (the cost model's input). A DMA's
    ``dma`` fields give its ``free_size`` (:func:`simulate.core.instructions.dma_trace_fields`)."""
    program = context.current(opcode)
    reads = [t for t in reads if isinstance(t, NkiTensor)]
    details = dict(details or {})
    fields = dict(
        engine=engine_name,
        opcode=opcode,
        partitions=int(partitions),
        free_size=0 if free_size is None else int(free_size),
        in_dtypes=tuple(str(t.dtype) for t in reads),
        out_dtype=str(out_dtype),
        reads=tuple(region(t) for t in reads),
        writes=tuple(region(t) for t in writes),
        loops=(),
        program=(program.program_id,) if program.launch.grid_ndim else (),
        core=program.program_id,
        details=details,
    )
    if dma is not None:
        fields.update(dma)
    else:  # the cost model slows strided operands down
        details.setdefault(
            "max_stride_bytes",
            max((abs(t.strides[-1]) * t.itemsize for t in reads if t.shape[-1] > 1), default=0),
        )
    with program.launch.lock:
        program.instructions.append(program.launch.trace.add(**fields))
    return NkiInstruction(opcode, name, tuple(program.loop_scopes))


def _write_and_emit(engine_name, api, name, dst, values, reads, details=None, dma=None):
    """Write an instruction's result into ``dst`` and record it over ``dst``'s extent."""
    write(dst, values)
    return _emit(
        engine_name,
        api,
        name,
        reads=reads,
        writes=[dst],
        partitions=dst.shape[0],
        free_size=_free(dst),
        out_dtype=dst.dtype,
        details=details,
        dma=dma,
    )


def _op(api, argname, op):
    """The operator ``op`` names, if this dialect has it on this target (core rules)."""
    try:
        spec = fn.lookup(op, argname)
    except Exception as exc:  # the core lookup's error carries a legacy error key
        raise NkiValidationError(f"{api} {argname}={op!r} is not an NKI operator") from exc
    enforce(rules.check_alu_op, api, spec.name, "nki06", _version(api), argname)
    return spec


# --- data movement -----------------------------------------------------------------------------
def _dma_side(api, argname, t) -> NkiTensor:
    _tensor(api, argname, t)
    if t.storage.memory == "psum":
        raise NkiValidationError(
            f"{api} {argname} cannot be in PSUM: DMA reads and writes HBM or SBUF only (NKI 0.3)"
        )
    if t.on_chip:
        _on_chip(api, argname, t)
    return t


def _row_bytes(t: NkiTensor) -> int:
    """Contiguous bytes per partition row of the HBM side (one DMA descriptor)."""
    return run_bytes(t.shape, [s * t.itemsize for s in t.strides], t.itemsize)


def _dma_fields(src, dst: NkiTensor, count: int, partitions: int, row_bytes=None) -> dict:
    """The DMA fields (``free_size`` included) of the trace record of ``count`` elements
    moved from ``src`` to ``dst`` over ``partitions`` on-chip partitions: the core's, so
    that the legacy front-end records the same transfer alike."""
    src_mem = "sbuf" if src is None else src.storage.memory
    dst_mem = dst.storage.memory
    hbm = dst if dst_mem == "hbm" and src_mem != "hbm" else (src if src is not None else dst)
    return dma_trace_fields(
        count * hbm.itemsize,
        partitions,
        f"{src_mem}->{dst_mem}",
        _row_bytes(hbm) if row_bytes is None else row_bytes,
    )


def _chip_partitions(dst, *srcs) -> int:
    """The partitions a DMA spreads over: the on-chip side's, or the destination's rows
    for an HBM-to-HBM copy (as the legacy front-end records it)."""
    return next((t.shape[0] for t in (dst, *srcs) if t is not None and t.on_chip), dst.shape[0])


def dma_copy(
    dst,
    src,
    priority=None,
    oob_mode=oob_mode.error,
    dge_mode=dge_mode.unknown,
    engine=engine.unknown,
    name=None,
):
    """``dst = src`` by DMA between HBM and SBUF (any direction; not PSUM since 0.3); equal
    element counts, different dtypes cast through float32; ``dge_mode.hwdge`` needs equal
    dtypes and NeuronCore-v3+."""
    api = "dma_copy"
    _dma_side(api, "dst", dst)
    _dma_side(api, "src", src)
    _enum(oob_mode, globals()["oob_mode"], "oob_mode", api)
    mode = _enum(dge_mode, globals()["dge_mode"], "dge_mode", api)
    _enum(engine, globals()["engine"], "engine", api)
    if dst.is_indirect() or src.is_indirect():
        return _indirect_dma_copy(dst, src, oob_mode is globals()["oob_mode"].skip, mode, name)
    dynamic = getattr(dst, "dynamic_start", False) or getattr(src, "dynamic_start", False)
    if oob_mode is globals()["oob_mode"].skip and not dynamic:
        raise NkiValidationError(
            f"{api} oob_mode=skip needs an indirect access (.ap with vector_offset or "
            "scalar_offset)"
        )
    if mode is globals()["dge_mode"].hwdge:
        if _version(api) < 3:
            raise NkiValidationError(f"{api} dge_mode=hwdge needs NeuronCore-v3 or later")
        if src.dtype is not dst.dtype:
            raise NkiValidationError(
                f"{api} with dge_mode=hwdge cannot cast: src is {src.dtype}, "
                f"dst is {dst.dtype} (use .view())"
            )
    if src.size != dst.size:
        raise NkiValidationError(
            f"{api} src has {src.size} elements {tuple(src.shape)}, dst has "
            f"{dst.size} {tuple(dst.shape)}"
        )
    values = src.values()
    if src.dtype is not dst.dtype:
        if src.dtype in dt.PACKED or dst.dtype in dt.PACKED:
            raise NkiTypeError(
                f"{api} cannot convert {src.dtype} to {dst.dtype}: a packed MX type moves "
                "as its bits only (reinterpret with .view() or .ap(dtype=))"
            )
        values = values.astype(np.float32)
    write(dst, values)
    return _emit(
        "dma",
        api,
        name,
        reads=[src],
        writes=[dst],
        partitions=_chip_partitions(dst, src),
        out_dtype=dst.dtype,
        details={"dge_mode": mode.name},
        dma=_dma_fields(src, dst, dst.size, _chip_partitions(dst, src)),
    )


def dma_compute(
    dst, srcs, reduce_op, scales=None, unique_indices=True, oob_mode=oob_mode.error, name=None
):
    """``dst = reduce_op(srcs[0] * scales[0], ...)`` in float32 on the DMA engine; only
    ``nl.add``; ``dst`` is read only when it is one of ``srcs`` (STUB-ISA L2661, L2677-L2685)."""
    api = "dma_compute"
    _dma_side(api, "dst", dst)
    if not isinstance(srcs, (list, tuple)) or not 1 <= len(srcs) <= 16:
        raise NkiValidationError(f"{api} srcs must be a list of 1 to 16 tensors")
    for i, s in enumerate(srcs):
        _dma_side(api, f"srcs[{i}]", s)
        if s.size != dst.size:
            raise NkiValidationError(f"{api} srcs[{i}] has {s.size} elements, dst {dst.size}")
    spec = _op(api, "reduce_op", reduce_op)
    if spec.name != "add":
        raise NkiValidationError(f"{api} reduce_op must be nl.add, got {spec.name}")
    if scales is not None and any(float(s) != 1.0 for s in scales):
        raise NkiValidationError(f"{api} scales must all be 1.0 (or None)")
    _enum(oob_mode, globals()["oob_mode"], "oob_mode", api)
    if dst.is_indirect() or any(s.is_indirect() for s in srcs):
        skip = oob_mode is globals()["oob_mode"].skip
        return _indirect_dma_compute(dst, list(srcs), unique_indices, skip, spec, name)
    if oob_mode is globals()["oob_mode"].skip:
        raise NkiValidationError(f"{api} oob_mode=skip needs an indirect (vector_offset) access")
    if len(srcs) == 1:
        warnings.warn(
            "dma_compute with one source is a copy: pass dst as a source too to accumulate into it",
            stacklevel=2,
        )
    total = sem.dma_accumulate(
        spec, np.zeros(dst.size, np.float32), *(s.values().reshape(-1) for s in srcs)
    )
    write(dst, total)
    return _emit(
        "dma",
        api,
        name,
        reads=list(srcs),
        writes=[dst],
        partitions=_chip_partitions(dst, *srcs),
        out_dtype=dst.dtype,
        details={"rmw": True},
        dma=_dma_fields(srcs[0], dst, dst.size * len(srcs), _chip_partitions(dst, *srcs)),
    )


def _same_view(a, b) -> bool:
    """``a`` and ``b`` address the same elements of the same storage."""
    if a.storage is not b.storage or tuple(a.shape) != tuple(b.shape):
        return False
    if a.is_indirect() or b.is_indirect():
        return a.is_indirect() and b.is_indirect() and a.index is b.index and a.offset == b.offset
    return a.offset == b.offset and tuple(a.strides) == tuple(b.strides)


def _indirect_rows_inside(api, label, access, skip):
    """The storage positions of an indirect (``vector_offset``) access, one row per index,
    and which rows lie wholly inside its tensor; with ``oob_mode=error`` (``skip`` False) a
    row reaching outside is an error naming ``label`` and the row."""
    positions = access.positions()
    inside = ((positions >= 0) & (positions < access.storage_values().size)).all(axis=1)
    if not inside.all() and not skip:
        row = int(np.flatnonzero(~inside)[0])
        raise NkiValidationError(
            f"{api} {label} row {row} (storage element {int(positions[row].min())}) reaches "
            f"outside `{access.name}` (oob_mode=error; oob_mode=skip skips such rows)"
        )
    return positions, inside


def _indirect_dma_compute(dst, srcs, unique_indices, skip, spec, name):
    """``dma_compute``'s read-modify-write with a ``vector_offset`` side, the two documented
    modes (nki/api/nki/isa/__init__.py L2672-2692): gather, ``dst(SB) = dst(SB) +
    src(HBM)[indices]``, and scatter, ``dst(HBM)[indices] = dst(HBM)[indices] + src(SB)``;
    exactly two sources, one of them ``dst`` itself, ``unique_indices=True``. Rows reaching
    outside the indexed tensor raise, or with ``oob_mode.skip`` are left as they were (the
    ``dma_copy`` rule). A scatter naming one row twice is rejected: with unique indices
    promised the docs do not say which update lands (inferred)."""
    api = "dma_compute"
    if len(srcs) != 2:
        raise NkiValidationError(
            f"{api} with a vector_offset access takes exactly 2 sources (isa L2687-2688)"
        )
    if not unique_indices:
        raise NkiValidationError(
            f"{api} with a vector_offset access needs unique_indices=True: non-unique indices "
            "are not yet supported (isa L2690)"
        )
    same = [i for i, s in enumerate(srcs) if _same_view(s, dst)]
    if not same:
        raise NkiValidationError(
            f"{api} read-modify-write: one source must be dst itself (isa L2677-2685)"
        )
    data = srcs[1 - same[0]]
    if dst.is_indirect():  # scatter: dst in HBM through its index, the other source in SBUF
        indexed, direction = dst, "scatter"
        if not data.on_chip or data.is_indirect():
            raise NkiValidationError(
                f"{api} scatter: the data source must be in SBUF (isa L2677-2680)"
            )
    else:  # gather: dst in SBUF, the other source in HBM through its index
        indexed, direction = data, "gather"
        if not dst.on_chip or not data.is_indirect():
            raise NkiValidationError(
                f"{api} gather: dst must be in SBUF and the other source an HBM access with "
                "vector_offset (isa L2682-2685)"
            )
    if indexed.index_columns() > 1:
        raise NkiValidationError(f"{api} takes a (P, 1) vector_offset index")
    positions, inside = _indirect_rows_inside(api, direction, indexed, skip)
    flat = indexed.storage_values()
    keep = np.repeat(inside, positions.shape[1])
    places = positions.reshape(-1)
    if direction == "scatter":
        if np.unique(places[keep]).size != int(keep.sum()):
            raise NkiValidationError(
                f"{api} scatter names an HBM element twice: unique_indices=True promises "
                "otherwise (isa L2690)"
            )
        current = flat[places[keep]]
        added = data.values().reshape(-1)[keep]
        flat[places[keep]] = dt.cast(
            sem.dma_accumulate(spec, current, added), dst.dtype, flat.dtype
        )
        dst.storage.written = True
    else:
        merged = dst.values().reshape(-1).astype(np.float32)
        merged[keep] = sem.dma_accumulate(spec, merged[keep], flat[places[keep]])
        write(dst, merged)
    return _emit(
        "dma",
        api,
        name,
        reads=list(srcs) + ([indexed.index] if indexed.index is not None else []),
        writes=[dst],
        partitions=_chip_partitions(dst, *srcs),
        out_dtype=dst.dtype,
        details={"rmw": True, "indirect": True},
        dma=_dma_fields(data, dst, dst.size * 2, _chip_partitions(dst, *srcs)),
    )


def dma_transpose(
    dst,
    src,
    axes=None,
    priority=None,
    dge_mode=dge_mode.unknown,
    oob_mode=oob_mode.error,
    name=None,
):
    """A transposing DMA into SBUF; permutations (1,0), (2,1,0), (3,1,2,0) by rank; ``dst``
    must have exactly the permuted shape and rank (0.4) and the same dtype. A direct
    transpose takes ``dge_mode`` unknown or hwdge ("The only valid dge_modes are unknown and
    hwdge", aws-neuron-sdk@81ce03ae nki/api/nki/isa/__init__.py L878-888), and none, which
    AWS's mlp_tkg passes as the raw ``_DGE_MODE_NONE = 3`` (aws-neuron/nki-library@d2ad3a5
    src/nkilib_src/nkilib/core/mlp/mlp_tkg/mlp_tkg_gate_up_projection.py L323, L386); hwdge
    (a Hardware DGE transpose) needs ``src.shape[0] == 16`` (2-d) or ``src.shape[0]`` in
    {1, 2, 4, 8, 16} with ``src.shape[0] * src.shape[-2]`` a multiple of 16 (3-d/4-d),
    ``src.shape[-1] <= 128`` and a 2-byte dtype (L880-887). No AWS call passes hwdge."""
    api = "dma_transpose"
    _dma_side(api, "src", src)
    _on_chip(api, "dst", dst, psum=False)
    mode = _enum(dge_mode, globals()["dge_mode"], "dge_mode", api)
    rank = src.ndim
    if rank not in sem.DMA_TRANSPOSE_AXES:
        raise NkiValidationError(f"{api} src must have rank 2 to 4, got {rank}")
    perm = sem.DMA_TRANSPOSE_AXES[rank] if axes is None else tuple(int(a) for a in axes)
    if perm != sem.DMA_TRANSPOSE_AXES[rank]:
        raise NkiValidationError(
            f"{api} axes {perm} unsupported for rank {rank}; "
            f"expected {sem.DMA_TRANSPOSE_AXES[rank]}"
        )
    expected = tuple(src.shape[a] for a in perm)
    if tuple(dst.shape) != expected:
        raise NkiValidationError(
            f"{api} dst shape {tuple(dst.shape)} must equal the permuted src shape {expected}"
        )
    if src.dtype is not dst.dtype:
        raise NkiValidationError(f"{api} dst dtype {dst.dtype} must equal src dtype {src.dtype}")
    if src.is_indirect():
        return _indirect_dma_transpose(dst, src, perm, dge_mode, oob_mode, name)
    _direct_transpose_rules(api, src, mode)
    return _write_and_emit(
        "dma",
        api,
        name,
        dst,
        np.transpose(src.values(), perm),
        [src],
        dma=_dma_fields(src, dst, dst.size, dst.shape[0], row_bytes=src.itemsize),
    )


def _direct_transpose_rules(api, src, mode):
    """The reference's "DMA Direct Transpose Constraints" (see ``dma_transpose``)."""
    modes = globals()["dge_mode"]
    if mode not in (modes.unknown, modes.hwdge, modes.none):
        raise NkiValidationError(
            f"{api} (direct) takes dge_mode unknown or hwdge (or none, as AWS's mlp_tkg "
            f"passes it), got {mode.name}; swdge is the indirect transpose's (a "
            ".ap(vector_offset=) source)"
        )
    if mode is not modes.hwdge:
        return
    shape = tuple(src.shape)
    if len(shape) == 2 and shape[0] != 16:
        raise NkiValidationError(
            f"{api} dge_mode=hwdge needs src.shape[0] == 16 for a 2-d src, got {shape}"
        )
    if len(shape) > 2 and (shape[0] not in (1, 2, 4, 8, 16) or (shape[0] * shape[-2]) % 16):
        raise NkiValidationError(
            f"{api} dge_mode=hwdge needs src.shape[0] in {{1, 2, 4, 8, 16}} and "
            f"src.shape[0] * src.shape[-2] a multiple of 16 for a {len(shape)}-d src, got {shape}"
        )
    # src.shape[-1] <= 128 is dst's partition count, checked for every transpose
    if src.itemsize != 2:
        raise NkiTypeError(f"{api} dge_mode=hwdge needs a 2-byte src dtype, got {src.dtype}")


def _indirect_dma_transpose(dst, src, perm, mode, oob, name):
    """``dma_transpose`` from a ``.ap(vector_offset=indices)`` source: the rows the indices
    name, gathered, then transposed ("``gathered = src[flat_indices, :]``, ``dst =
    gathered.T``"), under the reference's "DMA Indirect Transpose Constraints"
    (aws-neuron-sdk@81ce03ae nki/api/nki/isa/__init__.py L889-910): dge_mode unknown or
    swdge; a 4-D src with ``src.shape[1]`` or ``src.shape[2]`` 1; ``src.shape[-1] <= 128``;
    2-byte data; src in HBM; ``src.shape[0]`` a multiple of 16; uint32 indices in SBUF with
    ``indices.shape[0]`` in [16, 128] and a multiple of 16, exactly 128 when
    ``indices.shape[1] > 1``, ``indices.shape[0] * indices.shape[1] >= src.shape[0]``; Trn2
    and newer. The index is the ``(P, 1)`` tile the view takes, one row per pattern row
    (AWS's block KV cache load, aws-neuron/nki-library@d2ad3a5
    core/attention/attention_tkg.py L1642-1664), or a ``[128, N]`` tile read column by column
    (``flat_indices = indices.T.flatten()[:src.shape[0]]``, L907-908). A row the index sends
    outside ``src`` raises (``oob_mode.error``) or is not moved (``skip``)."""
    api = "dma_transpose"
    if _version(api) < 3:
        raise NkiValidationError(f"{api} from an indirect source needs Trn2 or newer")
    mode = _enum(mode, dge_mode, "dge_mode", api)
    if mode not in (dge_mode.unknown, dge_mode.swdge):
        raise NkiValidationError(
            f"{api} from an indirect source takes dge_mode unknown or swdge, got {mode.name}"
        )
    shape, index = tuple(src.shape), src.index
    if len(shape) == 4 and 1 not in (shape[1], shape[2]):
        raise NkiValidationError(f"{api} 4-D indirect src needs shape[1] or shape[2] of 1: {shape}")
    if shape[-1] > 128:
        raise NkiValidationError(f"{api} indirect src.shape[-1] must be <= 128, got {shape[-1]}")
    if src.itemsize != 2:
        raise NkiTypeError(f"{api} indirect src must be a 2-byte dtype, got {src.dtype}")
    if shape[0] % 16:
        raise NkiValidationError(f"{api} indirect src.shape[0] must divide by 16, got {shape[0]}")
    if index.dtype is not dt.uint32:
        raise NkiTypeError(f"{api} indices must be uint32, got {index.dtype}")
    if index.ndim != 2:
        raise NkiValidationError(f"{api} indices must be 2-d, got {tuple(index.shape)}")
    if not (16 <= index.shape[0] <= 128 and index.shape[0] % 16 == 0):
        raise NkiValidationError(
            f"{api} indices.shape[0] must be a multiple of 16 in [16, 128], got {index.shape[0]}"
        )
    if index.shape[1] > 1 and index.shape[0] != 128:
        raise NkiValidationError(
            f"{api} indices with {index.shape[1]} columns need indices.shape[0] = 128, "
            f"got {index.shape[0]}"
        )
    if index.size < shape[0]:
        raise NkiValidationError(
            f"{api} indices.shape[0] * indices.shape[1] = {index.size} must be >= "
            f"src.shape[0] = {shape[0]}"
        )
    skip = _enum(oob, oob_mode, "oob_mode", api) is oob_mode.skip
    positions, inside = _indirect_rows_inside(api, "src", src, skip)
    flat = src.storage_values()
    gathered = dst.values().transpose(np.argsort(perm)).reshape(shape[0], -1).copy()
    gathered[inside] = flat[positions[inside]]
    values = np.transpose(gathered.reshape(shape), perm)
    return _write_and_emit(
        "dma",
        api,
        name,
        dst,
        values,
        [src, index],
        details={"dge_mode": mode.name, "indirect": True},
        dma=_dma_fields(src, dst, dst.size, dst.shape[0], row_bytes=src.itemsize),
    )


def tensor_copy(dst, src, engine=engine.unknown, name=None):
    """Copy with a cast (Vector by default; Scalar or GpSimd on request). Same dtype: bit
    exact; the NeuronCore-v2 Scalar engine has no tensor_copy (use activation(nl.copy))."""
    api = "tensor_copy"
    _on_chip(api, "dst", dst)
    _on_chip(api, "src", src)
    _pair(api, "dst", dst, "src", src)
    eng = _engine_of(
        api,
        engine,
        globals()["engine"].vector,
        (globals()["engine"].vector, globals()["engine"].scalar, globals()["engine"].gpsimd),
    )
    if eng is globals()["engine"].scalar and _version(api) == 2:
        raise NkiValidationError(
            f"{api} is not available on the scalar engine of NeuronCore-v2; "
            "use activation(op=nl.copy)"
        )
    _no_gpsimd_psum(api, eng, ("dst", dst), ("src", src))
    values = _pf(src, f32=src.dtype is not dst.dtype)
    return _write_and_emit(_TRACE_ENGINE[eng], api, name, dst, values, [src])


def memset(dst, value, engine=engine.unknown, name=None):
    """Fill ``dst`` with a compile-time constant whose Python type fits the dtype: a float
    literal into an integer tensor is an error since 0.3 (aws-neuron-sdk@81ce03ae
    nki/migration/index.rst L497-512), except ``0.0``. AWS's ``cross_partition_copy`` clears
    its temporaries of the source's dtype with ``value=0.0`` (aws-neuron/nki-library@d2ad3a5
    core/utils/cross_partition_copy.py L188-191) and ``moe_block_tkg`` passes it uint32 expert
    indices; zero is the same all-zero fill in every dtype ("The ISA memset instruction fills
    the destination with a single u32 value", migration/index.rst L749-751)."""
    api = "memset"
    _on_chip(api, "dst", dst)
    eng = _engine_of(
        api,
        engine,
        globals()["engine"].vector,
        (globals()["engine"].vector, globals()["engine"].gpsimd),
    )
    _no_gpsimd_psum(api, eng, ("dst", dst))
    if isinstance(value, (float, np.floating)) and dt.is_int(dst.dtype) and value != 0.0:
        raise NkiTypeError(
            f"{api} value {value!r} is a float but dst is {dst.dtype}: the value "
            "type must match the dtype"
        )
    if not is_number(value):
        raise NkiTypeError(f"{api} value must be a number, got {type(value).__name__}")
    return _write_and_emit(
        _TRACE_ENGINE[eng],
        api,
        name,
        dst,
        np.full(dst.size, value, np.float64 if dt.is_float(dst.dtype) else np.int64),
        [],
        details={"value": float(value)},
    )


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    """``dst[p, (w,z,y,x)] = offset + p * channel_multiplier + w*s_w + z*s_z + y*s_y + x*s_x``
    in int32, cast to ``dst.dtype`` (GpSimd, SBUF)."""
    api = "iota"
    _on_chip(api, "dst", dst, psum=False)
    pairs = _int_pattern(api, pattern)
    if not 1 <= len(pairs) <= 4 or any(len(p) != 2 for p in pairs):
        raise NkiValidationError(f"{api} pattern must be 1 to 4 [step, num] pairs")
    if math.prod(n for _, n in pairs) != _free(dst):
        raise NkiValidationError(
            f"{api} pattern covers {math.prod(n for _, n in pairs)} "
            f"elements per partition, dst has {_free(dst)}"
        )
    start = offset.value if isinstance(offset, VirtualRegister) else _int32(api, "offset", offset)
    multiplier = _int32(api, "channel_multiplier", channel_multiplier)
    values = sem.iota_pattern(dst.shape[0], pairs, start, multiplier)
    return _write_and_emit("pool", api, name, dst, values, [])


def _int32(api, argname, value) -> int:
    """An int32 immediate of ``iota``/``affine_select``: "an int32 offset value", "an int32
    multiplier", pattern "[step, num]" pairs (aws-neuron-sdk@81ce03ae
    nki/api/nki/isa/__init__.py L1759-1761); a float is not silently truncated."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise NkiTypeError(
            f"{api} {argname} must be an int32 value ({_ISA} L1759-1761), got "
            f"{type(value).__name__} {value!r}"
        )
    if not -(2**31) <= value < 2**31:
        raise NkiValidationError(f"{api} {argname}={value} is outside int32 ({_ISA} L1759-1761)")
    return value


def _int_pattern(api, pattern) -> list[tuple[int, int]]:
    return [tuple(_int32(api, f"pattern[{i}]", v) for v in pair) for i, pair in enumerate(pattern)]


# --- Scalar engine -----------------------------------------------------------------------------
def activation(
    dst,
    op,
    data,
    bias=None,
    scale=1.0,
    reduce_op=None,
    reduce_res=None,
    reduce_cmd=reduce_cmd.idle,
    name=None,
):
    """``dst = op(data * scale + bias)`` on the Scalar engine in float32. ``scale``: a float
    or a float32 ``(P, 1)`` tile; ``bias``: a ``(P, 1)`` tile (any dtype but tfloat32; a
    scalar bias only on NeuronCore-v3+). The per-partition reduction of the float32 result
    folds into the Scalar engine's reduce registers per ``reduce_cmd`` (``idle`` leaves them
    unchanged; the docs are silent); ``reduce_res`` receives the registers after the update."""
    return _activation(
        "activation", dst, op, data, bias, scale, reduce_op, reduce_res, reduce_cmd, name
    )


def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None):
    """``activation`` with ``reduce_cmd=reset_reduce`` (kept for backward compatibility)."""
    if reduce_res is None:
        raise NkiValidationError("activation_reduce needs a reduce_res tile")
    return _activation(
        "activation_reduce",
        dst,
        op,
        data,
        bias,
        scale,
        reduce_op,
        reduce_res,
        globals()["reduce_cmd"].reset_reduce,
        name,
    )


def _activation(api, dst, op, data, bias, scale, reduce_op, reduce_res, cmd, name):
    _on_chip(api, "dst", dst)
    _on_chip(api, "data", data)
    _pair(api, "data", data, "dst", dst)
    cmd = _enum(cmd, reduce_cmd, "reduce_cmd", api)
    spec = _op(api, "op", op)
    enforce(rules.check_activation_op, api, spec.name, "nki06", "op")
    program = context.current(api)
    version = program.target.nc_version
    partitions = data.shape[0]
    if isinstance(scale, NkiTensor):
        scale_v, scale_t = _scalar(api, "scale", scale, partitions, f32_tile=True)
    elif isinstance(scale, (int, float, np.number)) and not isinstance(scale, bool):
        scale_v, scale_t = np.float32(scale), None
    else:
        raise NkiTypeError(f"{api} scale must be a float or a float32 (P, 1) tile")
    bias_v, bias_t = np.float32(0.0), None
    if bias is not None:
        if isinstance(bias, NkiTensor):
            if _free(bias) != 1:
                raise NkiValidationError(
                    f"{api} bias must have free size 1, got shape {tuple(bias.shape)}"
                )
            if bias.dtype is dt.tfloat32:
                raise NkiTypeError(f"{api} bias cannot be tfloat32")
        elif version == 2:
            raise NkiValidationError(
                f"{api} a scalar bias needs NeuronCore-v3 or later; pass a "
                "(P, 1) tile on NeuronCore-v2"
            )
        bias_v, bias_t = _scalar(api, "bias", bias, partitions)
        if spec.name == "reciprocal" and version == 2:
            raise NkiValidationError(
                f"{api} op=nl.reciprocal with a bias is not supported on NeuronCore-v2"
            )
    # the bias register is always added (0.0 without a bias: -0.0 comes out as +0.0)
    out = np.asarray(
        sem.activation(spec, np.array(_pf(data), np.float32), scale_v, bias_v), np.float32
    )
    reduced = None
    if reduce_op is not None or reduce_res is not None or cmd is not reduce_cmd.idle:
        reduced = _reduce_registers(api, program, out, reduce_op, cmd, reduce_res)
    write(dst, out)
    writes = [dst]
    if reduce_res is not None:  # written last: reduce_res may alias dst (RN 0.6 fix)
        _on_chip(api, "reduce_res", reduce_res)
        if reduce_res.shape[0] != partitions or _free(reduce_res) != 1:
            raise NkiValidationError(
                f"{api} reduce_res must be ({partitions}, 1), got {tuple(reduce_res.shape)}"
            )
        write(reduce_res, reduced)
        writes.append(reduce_res)
    return _emit(
        "act",
        api,
        name,
        reads=[data, scale_t, bias_t],
        writes=writes,
        partitions=partitions,
        free_size=_free(data),
        out_dtype=dst.dtype,
        details={"op": spec.name, "reduce": reduced is not None},
    )


def _reduce_registers(api, program, out, reduce_op, cmd, reduce_res):
    spec = _op(api, "reduce_op", reduce_op if reduce_op is not None else "add")
    if spec.name != "add":
        # nki/api/nki/isa/__init__.py@81ce03ae L1347-1348 ("``reduce_op`` must be
        # ``nl.add``") and nki/guides/architecture/trainium3_arch.rst@81ce03ae L228
        # ("Activation only supported add as a reduce command"; max, min, absmax and absmin
        # are activate2's, NeuronCore-v4): activation_reduce's "On NeuronCore-v2, the
        # reduce_op must be nl.add" (L1476) names no other op for a later core
        raise NkiValidationError(
            f"{api} reduce_op must be nl.add on every NeuronCore (the Scalar engine's "
            f"Activate reduces only by addition; max/min reductions are activate2's, "
            f"NeuronCore-v4), got {spec.name}"
        )
    if cmd is reduce_cmd.load_reduce:
        raise NkiValidationError(f"{api} reduce_cmd=load_reduce is a Vector-engine command")
    if cmd is reduce_cmd.idle and reduce_res is not None:
        warnings.warn(
            f"{api} reduce_res with reduce_cmd=idle reads the reduce registers "
            "unchanged (pass reduce_cmd=reset_reduce or use activation_reduce)",
            stacklevel=3,
        )
    regs = program.act_regs[: out.shape[0]]
    sem.update_registers(regs, spec, sem.fold_partitions(spec, out), cmd.name)
    return regs.copy()


# --- Vector engine -------------------------------------------------------------------------------
# GpSimd's native integer arithmetic "ensures exact results for all 32-bit integer values"
# (nki/api/nki/isa/__init__.py@81ce03ae, L1034-L1036)
_EXACT_INT32_OPS = ("add", "subtract", "multiply", "maximum", "minimum")


def tensor_tensor(dst, data1, data2, op, engine=engine.unknown, name=None):
    """``dst = op(data1, data2)`` elementwise. Vector engine; GpSimd for ``power`` and by
    default when every operand is (u)int32 and none is in PSUM (exact integer math)."""
    api = "tensor_tensor"
    _two_tiles(api, ("data1", data1), ("data2", data2), dst)
    spec = _op(api, "op", op)
    if spec.unary and spec.name not in fn.BINARY:
        raise NkiValidationError(f"{api} op={spec.name} is not a binary operator")
    int32s = all(t.dtype in (dt.int32, dt.uint32) for t in (data1, data2, dst))
    any_psum = any(t.storage.memory == "psum" for t in (data1, data2, dst))
    default = (
        globals()["engine"].gpsimd
        if (spec.name == "power" or int32s) and not any_psum
        else globals()["engine"].vector
    )
    eng = _engine_of(api, engine, default, (globals()["engine"].vector, globals()["engine"].gpsimd))
    enforce(
        rules.check_tensor_tensor_engine,
        _TRACE_ENGINE[eng],
        spec.name,
        int32s,
        "data1",
        dialect="nki06",
    )
    _no_gpsimd_psum(api, eng, ("data1", data1), ("data2", data2), ("dst", dst))
    if spec.bitvec and not (dt.is_int(data1.dtype) and dt.is_int(data2.dtype)):
        raise NkiValidationError(f"{api} bitvec op {spec.name} needs integer operands")
    exact_int = (
        not spec.bitvec
        and eng is globals()["engine"].gpsimd
        and int32s
        and spec.name in _EXACT_INT32_OPS
    )
    values = sem.elementwise(spec, _pf(data1, False), _pf(data2, False), exact_int=exact_int)
    return _write_and_emit(
        _TRACE_ENGINE[eng],
        api,
        name,
        dst,
        values,
        [data1, data2],
        details={"op": spec.name},
    )


def tensor_scalar(
    dst,
    data,
    op0,
    operand0,
    reverse0=False,
    op1=None,
    operand1=None,
    reverse1=False,
    engine=engine.unknown,
    name=None,
):
    """``dst = (data op0 operand0) op1 operand1`` with per-partition operands (scalars or
    ``(P, 1)`` tiles, float32 for arithmetic ops); unary ops take ``operand0`` None or 0.
    Vector by default; Scalar for (multiply), (add), (multiply, add) on NeuronCore-v3+;
    GpSimd only for ``rsqrt``."""
    api = "tensor_scalar"
    values, reads, eng, names = _tensor_scalar(
        api,
        dst,
        data,
        ((op0, operand0, reverse0),) + (((op1, operand1, reverse1),) if op1 is not None else ()),
        engine,
    )
    if op1 is None and operand1 is not None:
        raise NkiValidationError(f"{api} operand1 given without op1")
    return _write_and_emit(
        _TRACE_ENGINE[eng],
        api,
        name,
        dst,
        values,
        reads,
        details={"op": list(names)},
    )


def _tensor_scalar(api, dst, data, stages, requested_engine):
    """The float32 (or integer, for bitvec ops) result of ``tensor_scalar``'s stages."""
    _on_chip(api, "data", data)
    _on_chip(api, "dst", dst)
    _pair(api, "data", data, "dst", dst)
    specs = [_op(api, f"op{i}", op) for i, (op, _, _) in enumerate(stages)]
    if len({s.bitvec for s in specs}) > 1:
        raise NkiValidationError(f"{api} op0 and op1 must both be arithmetic or both bitvec")
    names = tuple(s.name for s in specs)
    bitvec = specs[0].bitvec
    vector, scalar_eng, gpsimd = engine.vector, engine.scalar, engine.gpsimd
    eng = _engine_of(api, requested_engine, vector, (vector, scalar_eng, gpsimd))
    enforce(
        rules.check_tensor_scalar_engine,
        _TRACE_ENGINE[eng],
        names,
        _version(api),
        "data",
        dialect="nki06",
    )
    if bitvec and (eng is not vector or not dt.is_int(data.dtype)):
        raise NkiValidationError(f"{api} bitvec ops run on the vector engine on integer data")
    _no_gpsimd_psum(api, eng, ("data", data), ("dst", dst))
    values = _pf(data, f32=not bitvec)
    reads = [data]
    alu_stages = []
    for i, (spec, (_, operand, reverse)) in enumerate(zip(specs, stages)):
        argname = f"operand{i}"
        if spec.unary and spec.name not in fn.BINARY:
            if operand is not None and not (is_number(operand) and operand == 0):
                raise NkiValidationError(
                    f"{api} {argname} of unary op {spec.name} must be None or 0"
                )
            alu_stages.append((spec, None, reverse))
            continue
        if bitvec and not isinstance(operand, NkiTensor):
            scalar, tile = np.asarray(int(operand)).astype(values.dtype), None
        elif bitvec:
            _scalar(api, argname, operand, data.shape[0])
            scalar, tile = _pf(operand, False).astype(values.dtype), operand
        else:
            scalar, tile = _scalar(api, argname, operand, data.shape[0], f32_tile=True)
        reads.append(tile)
        alu_stages.append((spec, scalar, reverse))
    return np.asarray(sem.alu_stages(values, alu_stages)), reads, eng, names


def scalar_tensor_tensor(
    dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, name=None
):
    """``dst = (data op0 operand0) op1 operand1``: ``operand0`` a scalar or ``(P, 1)`` tile,
    ``operand1`` a tile paired with ``data`` (Vector engine, arithmetic ops)."""
    api = "scalar_tensor_tensor"
    _two_tiles(api, ("data", data), ("operand1", operand1), dst)
    spec0, spec1 = _op(api, "op0", op0), _op(api, "op1", op1)
    if spec0.bitvec or spec1.bitvec:
        raise NkiValidationError(f"{api} takes arithmetic operators only")
    scalar, tile = _scalar(api, "operand0", operand0, data.shape[0])
    values = sem.scalar_tensor_tensor(
        spec0, scalar, spec1, _pf(operand1), _pf(data), reverse0, reverse1
    )
    return _write_and_emit(
        "dve",
        api,
        name,
        dst,
        values,
        [data, tile, operand1],
        details={"op": [spec0.name, spec1.name]},
    )


def tensor_copy_predicated(dst, src, predicate, reverse_pred=False, name=None):
    """Where ``predicate`` (uint8/16/32) is non-zero (zero with ``reverse_pred``), ``dst``
    takes ``src`` (a tile of ``dst``'s dtype or a number); elsewhere ``dst`` keeps its
    values. ``src`` and ``predicate`` not both in PSUM (Vector engine)."""
    api = "tensor_copy_predicated"
    _on_chip(api, "dst", dst)
    _on_chip(api, "predicate", predicate)
    _pair(api, "dst", dst, "predicate", predicate)
    if predicate.dtype not in (dt.uint8, dt.uint16, dt.uint32):
        raise NkiTypeError(
            f"{api} predicate must be uint8, uint16 or uint32, got {predicate.dtype}"
        )
    reads = [predicate, dst]
    if isinstance(src, NkiTensor):
        _on_chip(api, "src", src)
        _pair(api, "dst", dst, "src", src)
        _not_both_psum(api, "src", src, "predicate", predicate)
        if src.dtype is not dst.dtype:
            raise NkiTypeError(f"{api} src dtype {src.dtype} must equal dst dtype {dst.dtype}")
        values = _pf(src, f32=False)
        reads.append(src)
    elif is_number(src):
        values = np.full((dst.shape[0], _free(dst)), src)
    else:
        raise NkiTypeError(f"{api} src must be a tensor or a number, got {type(src).__name__}")
    take = (_pf(predicate, f32=False) != 0) != bool(reverse_pred)
    merged = sem.select(take, dt.cast(values, dst.dtype), _pf(dst, f32=False))
    return _write_and_emit("dve", api, name, dst, merged, reads)


def reciprocal(dst, data, name=None):
    """``dst = 1 / data`` in float32 (Vector engine)."""
    api = "reciprocal"
    _on_chip(api, "dst", dst)
    _on_chip(api, "data", data)
    _pair(api, "data", data, "dst", dst)
    return _write_and_emit("dve", api, name, dst, sem.reciprocal(_pf(data)), [data])


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    """Reduce ``data`` along ``axis`` (real dims since 0.3: a contiguous run of free dims
    ending at the last one, never dim 0) into ``dst`` (elements per partition = the kept
    dims); ``negate`` multiplies arithmetic results by -1 (Vector engine)."""
    api = "tensor_reduce"
    _on_chip(api, "data", data)
    _on_chip(api, "dst", dst)
    axes = tuple(
        sorted({int(a) % data.ndim for a in (axis if isinstance(axis, (list, tuple)) else (axis,))})
    )
    if not axes or axes[0] == 0 or axes != tuple(range(axes[0], data.ndim)):
        raise NkiValidationError(
            f"{api} axis={axis} must be free dims forming a contiguous run "
            f"that ends at the last dim (rank {data.ndim})"
        )
    kept = math.prod(data.shape[1 : axes[0]])
    if dst.shape[0] != data.shape[0] or _free(dst) != kept:
        raise NkiValidationError(
            f"{api} dst {tuple(dst.shape)} must hold {data.shape[0]} "
            f"partitions x {kept} elements (the dims kept by axis={axis})"
        )
    spec = _op(api, "op", op)
    enforce(rules.check_reduce_op, api, spec.name, "nki06", "op")
    if negate and spec.bitvec:
        raise NkiValidationError(f"{api} negate applies to arithmetic reductions only")
    values = data.values().reshape(data.shape[0], kept, -1)
    values = values if spec.bitvec else values.astype(np.float32)
    write(dst, sem.reduce_last(spec, values, negate))
    # costed by the elements it reads, as the legacy front-end does: the Vector engine streams
    # the input (the tensor_reduce cost rule counts input elements, N/2 cycles for bf16 add
    # and max: D S10 L1466-1480), whatever few it writes
    return _emit(
        "dve",
        api,
        name,
        reads=[data],
        writes=[dst],
        partitions=dst.shape[0],
        free_size=_free(data),
        out_dtype=dst.dtype,
        details={"op": spec.name},
    )


def tensor_scalar_reduce(
    dst,
    data,
    op0,
    operand0,
    reduce_op,
    reduce_res=None,
    reverse0=False,
    reduce_cmd=reduce_cmd.reset_reduce,
    reduce_init=None,
    reduce_res_negate=False,
    name=None,
):
    """``dst = data op0 operand0``; the per-partition ``reduce_op`` (add, multiply, max, min)
    of the float32 result folds into the Vector accumulators per ``reduce_cmd``; ``reduce_res``
    (``(P, 1)``, optional since 0.6) receives them, negated if ``reduce_res_negate``."""
    api = "tensor_scalar_reduce"
    if reverse0:
        raise NkiValidationError(f"{api} does not support reverse0")
    cmd = _enum(reduce_cmd, globals()["reduce_cmd"], "reduce_cmd", api)
    spec = _op(api, "reduce_op", reduce_op)
    if spec.name not in sem.REGISTER_REDUCE_OPS:
        raise NkiValidationError(
            f"{api} reduce_op must be add, multiply, maximum or minimum, got {spec.name}"
        )
    if _op(api, "op0", op0).bitvec:
        raise NkiValidationError(
            f"{api} op0={_op(api, 'op0', op0).name}: 'op0 can only be arithmetic operation ... "
            f"Bitvec operators are not supported in this API' ({_ISA} L2520-2522)"
        )
    values, reads, _, names = _tensor_scalar(
        api, dst, data, ((op0, operand0, False),), engine.vector
    )
    program = context.current(api)
    regs = program.vector_regs[: data.shape[0]]
    if cmd is globals()["reduce_cmd"].load_reduce and reduce_init is None:
        raise NkiValidationError(f"{api} reduce_cmd=load_reduce needs reduce_init")
    sem.update_registers(
        regs, spec, sem.fold_partitions(spec, values), cmd.name, initial=reduce_init
    )
    write(dst, values)
    writes = [dst]
    if reduce_res is not None:
        _on_chip(api, "reduce_res", reduce_res)
        if reduce_res.shape[0] != data.shape[0] or _free(reduce_res) != 1:
            raise NkiValidationError(
                f"{api} reduce_res must be ({data.shape[0]}, 1), got {tuple(reduce_res.shape)}"
            )
        write(reduce_res, -regs if reduce_res_negate else regs)
        writes.append(reduce_res)
    return _emit(
        "dve",
        api,
        name,
        reads=reads,
        writes=writes,
        partitions=dst.shape[0],
        free_size=_free(dst),
        out_dtype=dst.dtype,
        details={"op": list(names), "reduce": True},
    )


def tensor_tensor_scan(
    dst, data0, data1, initial, op0, op1, reverse0=False, reverse1=False, name=None
):
    """Per partition along the free elements: ``r[i] = (data0[i] op0 r[i-1]) op1 data1[i]``
    with ``r[-1] = initial`` (a scalar or ``(P, 1)`` tile); Vector engine."""
    api = "tensor_tensor_scan"
    _two_tiles(api, ("data0", data0), ("data1", data1), dst)
    reads = [data0, data1] + ([initial] if isinstance(initial, NkiTensor) else [])
    initial_values, _ = _scalar(api, "initial", initial, data0.shape[0])
    spec0, spec1 = _op(api, "op0", op0), _op(api, "op1", op1)
    for argname, spec in (("op0", spec0), ("op1", spec1)):
        if spec.bitvec:
            raise NkiValidationError(
                f"{api} {argname}={spec.name}: op0 and op1 'can be any binary arithmetic "
                f"operator' ({_ISA} L2024-2026); bitvec operators are not scan operators"
            )
    values = sem.scan(spec0, spec1, _pf(data0), _pf(data1), initial_values, reverse0, reverse1)
    return _write_and_emit(
        "dve", api, name, dst, values, reads, details={"op": [spec0.name, spec1.name]}
    )


def bn_stats(dst, data, name=None):
    """Per partition over at most 512 free elements (``bn_stats_fmax``): ``[count, mean,
    var*count]`` of the even- and of the odd-indexed elements (6 per partition)."""
    api = "bn_stats"
    _on_chip(api, "data", data)
    _on_chip(api, "dst", dst)
    enforce(rules.check_bn_stats_free, api, _free(data), "nki06", "data")
    if dst.shape[0] != data.shape[0] or _free(dst) != 6:
        raise NkiValidationError(f"{api} dst must be ({data.shape[0]}, 6), got {tuple(dst.shape)}")
    write(dst, sem.batch_norm_stats(_pf(data)))
    return _emit(  # costed by the elements it reads (the legacy front-end's bn_stats too)
        "dve",
        api,
        name,
        reads=[data],
        writes=[dst],
        partitions=dst.shape[0],
        free_size=_free(data),
        out_dtype=dst.dtype,
    )


def bn_aggr(dst, data, name=None):
    """Combine ``(count, mean, var*count)`` triples into ``[mean, var]`` per partition."""
    api = "bn_aggr"
    _on_chip(api, "data", data)
    _on_chip(api, "dst", dst)
    if _free(data) % 3:
        raise NkiValidationError(
            f"{api} data elements per partition ({_free(data)}) must be a multiple of 3"
        )
    if dst.shape[0] != data.shape[0] or _free(dst) != 2:
        raise NkiValidationError(f"{api} dst must be ({data.shape[0]}, 2), got {tuple(dst.shape)}")
    return _write_and_emit("dve", api, name, dst, sem.batch_norm_aggregate(_pf(data)), [data])


# --- Tensor engine --------------------------------------------------------------------------------
def nc_matmul(
    dst,
    stationary,
    moving,
    is_stationary_onezero=False,
    is_moving_onezero=False,
    is_transpose=False,
    accumulate=None,
    tile_position=(),
    tile_size=(),
    perf_mode=matmul_perf_mode.none,
    name=None,
):
    """``dst = stationary.T @ moving`` on the Tensor engine (SBUF inputs, PSUM ``dst``; free
    dims flattened). ``accumulate``: False overwrites, True adds to PSUM, None (default)
    overwrites the elements no matmul wrote since allocation and adds elsewhere (STUB-ISA,
    MIG 0.3). Products are exact and summed in float64, rounded once to float32 (spec
    decision), then added to PSUM in float32 and rounded to ``dst.dtype``."""
    api = "nc_matmul"
    _on_chip(api, "stationary", stationary, psum=False)
    _on_chip(api, "moving", moving, psum=False)
    _on_chip(api, "dst", dst, sbuf=False)
    perf_mode = _enum(perf_mode, matmul_perf_mode, "perf_mode", api)
    version = _version(api)
    k, m, n = stationary.shape[0], _free(stationary), _free(moving)
    double_row = perf_mode is matmul_perf_mode.double_row
    if double_row:
        m, n = _double_row_free_sizes(api, stationary, moving, is_transpose, tile_size)
    if moving.shape[0] != k:
        raise NkiValidationError(
            f"{api} moving has {moving.shape[0]} partitions, stationary "
            f"{k}: the contraction dims must match"
        )
    enforce(rules.check_matmul_free_sizes, api, m, n, "nki06", version, str(dst.dtype), "moving")
    if dst.shape[0] != m or _free(dst) != n:
        raise NkiValidationError(
            f"{api} dst {tuple(dst.shape)} must hold {m} partitions x {n} "
            "elements (stationary free size x moving free size)"
        )
    enforce(
        rules.check_matmul_inputs, api, str(stationary.dtype), str(moving.dtype), "nki06", version
    )
    kinds = {stationary.dtype, moving.dtype}
    if bool(tile_position) != bool(tile_size):
        raise NkiValidationError(f"{api} tile_position and tile_size go together")
    if tile_size:
        _pe_tiles(api, version, tile_position, tile_size)
    if tile_size and (int(tile_size[0]) < k or int(tile_size[1]) < m):
        raise NkiValidationError(
            f"{api} the stationary ({k} x {m}) does not fit tile_size {tuple(tile_size)}"
        )
    if double_row and (
        version < 3 or not kinds <= {dt.float8_e4m3, dt.float8_e5m2, dt.float8_e4m3fn}
    ):
        raise NkiValidationError(
            f"{api} perf_mode=double_row needs fp8 inputs on NeuronCore-v3+, got "
            f"{stationary.dtype} x {moving.dtype} on NeuronCore-v{version}"
        )
    a = _pf(stationary)
    b = _pf(moving)
    if double_row:  # contraction over (partition, pair): rows k·2 + j
        a, b = a.reshape(k * 2, m), b.reshape(k * 2, n)
    if is_transpose:
        if n != k or not sem.is_identity(b):
            raise NkiValidationError(f"{api} is_transpose=True needs an identity as moving")
        if dst.dtype is not stationary.dtype:
            raise NkiTypeError(
                f"{api} is_transpose=True needs dst dtype {stationary.dtype} (the "
                f"stationary dtype), got {dst.dtype}"
            )
        write(dst, sem.transpose(stationary.values()), accumulated_by_matmul=True)
        matmul_mask(dst)[...] = True
    else:
        if dst.dtype is not dt.float32 and not (version >= 4 and dst.dtype is dt.bfloat16):
            raise NkiTypeError(
                f"{api} dst must be float32 (or bfloat16 on NeuronCore-v4), got {dst.dtype}"
            )
        if stationary.dtype is dt.tfloat32 or moving.dtype is dt.tfloat32:
            a, b = dt.cast(a, dt.tfloat32), dt.cast(b, dt.tfloat32)
        _accumulate_product(api, dst, sem.matmul(a, b), accumulate)
    return _emit(
        "pe",
        api,
        name,
        reads=[stationary, moving],
        writes=[dst],
        partitions=k,
        free_size=n,
        out_dtype=dst.dtype,
        details={
            "stationary_free": m,
            "transpose": bool(is_transpose),
            "fp32": dt.float32 in kinds,
            "accumulate": accumulate,
        },
    )


def _pe_tiles(api, version, tile_position, tile_size) -> None:
    """Tensor Engine tiling mode: "Row tiling mode slices the 128 PE rows into 2x 64 row
    tiles (NeuronCore-v2 or newer), or 4x 32 row tiles (NeuronCore-v3 or newer). Column
    tiling mode slices the 128 PE columns in the same fashion" (aws-neuron-sdk@81ce03ae
    nki/api/nki/isa/__init__.py L514-518), so a row or column size is 128, 64 or (v3+) 32;
    "The ``start_row`` must be a multiple of ``row_size`` ... and must not exceed 128.
    Similarly, the ``start_column`` must be a multiple of ``column_size``" (L525-526): the
    tile starts on a tile boundary and lies inside the 128 x 128 array. Column tiling is
    accepted although the parameter list says "start_column must be 0" / "column_size must
    be 128" (L676-677): the body text documents it and AWS's kernels use it
    (aws-neuron/nki-library@d2ad3a5 src/nkilib_src/nkilib/core/router_topk/router_topk.py
    L428-437, core/qkv/qkv_tkg.py L1511-1512)."""
    sizes = (PMAX, 64) if version == 2 else (PMAX, 64, 32)
    if len(tile_position) != 2 or len(tile_size) != 2:
        raise NkiValidationError(
            f"{api} tile_position and tile_size are (row, column) pairs, got "
            f"{tuple(tile_position)} and {tuple(tile_size)}"
        )
    for axis, start, size in zip(("row", "column"), tile_position, tile_size):  # noqa: B905
        start, size = int(start), int(size)
        if size not in sizes:
            raise NkiValidationError(
                f"{api} tile_size {axis} size {size}: the PE array's {axis}s tile as "
                f"{' / '.join(map(str, sizes))} on NeuronCore-v{version} ({_ISA} L514-518)"
            )
        if start % size or not 0 <= start <= PMAX - size:
            raise NkiValidationError(
                f"{api} tile_position start_{axis} {start} must be a multiple of the {axis} "
                f"size {size} inside the 128-{axis} array ({_ISA} L525-526)"
            )


def _double_row_free_sizes(api, stationary, moving, is_transpose, tile_size):
    """The free sizes (M, N) of a ``double_row`` matmul: "the contraction dimension of the
    matmul is split between the partition dimension and the first free dimension after the
    partition dimension in both ``stationary`` and ``moving`` tiles. The first free
    dimension must be 2 ... the stationary tile is of shape ``[128, 2, 1]``, while the moving
    tile is of shape ``[128, 2, 3]``" (aws-neuron-sdk@81ce03ae nki/api/nki/isa/__init__.py
    L596-599); not with column tiling (L511) nor transpose mode
    (nki/guides/architecture/trainium2_arch.rst L124-128)."""
    for argname, t in (("stationary", stationary), ("moving", moving)):
        if t.ndim < 3 or t.shape[1] != 2:
            raise NkiValidationError(
                f"{api} perf_mode=double_row needs {argname} [K, 2, ...] (the contraction split "
                f"over the partitions and a first free dimension of 2), got {tuple(t.shape)}"
            )
    if is_transpose:
        raise NkiValidationError(f"{api} perf_mode=double_row cannot be combined with is_transpose")
    if tile_size and int(tile_size[1]) < PMAX:
        raise NkiValidationError(
            f"{api} perf_mode=double_row cannot be combined with column tiling "
            f"(tile_size {tuple(tile_size)})"
        )
    return _free(stationary) // 2, _free(moving) // 2


def _accumulate_product(api, dst, product, accumulate) -> None:
    """Write a matmul ``product`` into PSUM ``dst``: ``accumulate`` False overwrites, True
    adds, None adds where a matmul wrote since allocation and overwrites elsewhere.
    ``accumulate=True`` onto elements no instruction wrote is "undefined behavior on all
    targets"; onto elements a non-matmul instruction (``memset``, ``tensor_copy``, ...) wrote
    it "is not supported" on NeuronCore-v2 and NeuronCore-v3 only, so NeuronCore-v4 (trn3)
    adds to them (aws-neuron-sdk@81ce03ae nki/api/nki/isa/__init__.py L543-545, L552-555)."""
    flags = matmul_mask(dst).reshape(product.shape)
    if accumulate is None:
        add = flags.copy()
    elif accumulate is True:
        if not initialized_mask(dst).all():
            warnings.warn(
                f"{api} accumulate=True onto PSUM elements no instruction wrote "
                f"(`{dst.name}`): undefined behavior on all targets ({_ISA} L543-545)",
                stacklevel=3,
            )
        elif not flags.all() and _version(api) < 4:
            warnings.warn(
                f"{api} accumulate=True onto PSUM elements a non-matmul instruction wrote "
                f"(`{dst.name}`): not supported on NeuronCore-v2/v3, undefined on hardware "
                f"({_ISA} L552-555)",
                stacklevel=3,
            )
        add = np.ones_like(flags)
    elif accumulate is False:
        add = np.zeros_like(flags)
    else:
        raise NkiTypeError(f"{api} accumulate must be None, True or False")
    current_values = _pf(dst)
    result = np.where(add, current_values + product, product)
    write(dst, result, accumulated_by_matmul=True)
    matmul_mask(dst)[...] = True


def nc_transpose(dst, data, engine=engine.unknown, name=None):
    """Swap partitions and (flattened) free elements; ``dst.dtype == data.dtype``. Tensor
    engine (<= 128x128, SBUF -> PSUM) or Vector engine (<= 32x32); ``engine.unknown`` picks
    from the destination buffer (spec decision)."""
    api = "nc_transpose"
    _on_chip(api, "data", data)
    _on_chip(api, "dst", dst)
    eng = _enum(engine, globals()["engine"], "engine", api)
    if eng is globals()["engine"].unknown:
        eng = (
            globals()["engine"].tensor
            if dst.storage.memory == "psum"
            else globals()["engine"].vector
        )
    if eng not in (globals()["engine"].tensor, globals()["engine"].vector):
        raise NkiValidationError(f"{api} runs on the tensor or vector engine, not {eng.name}")
    p, f = data.shape[0], _free(data)
    enforce(rules.check_transpose_size, api, _TRACE_ENGINE[eng], p, f, "nki06", "data")
    if eng is globals()["engine"].tensor and (
        data.storage.memory != "sbuf" or dst.storage.memory != "psum"
    ):
        raise NkiValidationError(f"{api} on the tensor engine reads SBUF and writes PSUM")
    if dst.dtype is not data.dtype:
        raise NkiTypeError(f"{api} dst dtype {dst.dtype} must equal data dtype {data.dtype}")
    if dst.shape[0] != f or _free(dst) != p:
        raise NkiValidationError(f"{api} dst {tuple(dst.shape)} must be {f} x {p}")
    write(dst, sem.transpose(data.values()))
    return _emit(
        _TRACE_ENGINE[eng],
        api,
        name,
        reads=[data],
        writes=[dst],
        partitions=p,
        free_size=f,
        out_dtype=dst.dtype,
    )


# --- LNC: sendrecv, core_barrier ----------------------------------------------------------------
def _lnc2(api) -> context.Program:
    program = context.current(api)
    if program.target.nc_version < 3 or program.launch.lnc != 2:
        raise NkiValidationError(
            f"{api} needs an LNC=2 launch (kernel[2]) on NeuronCore-v3+ "
            f"(this launch: LNC={program.launch.lnc} on "
            f"{program.target.name})"
        )
    return program


def sendrecv(src, dst, send_to_rank, recv_from_rank, pipe_id, dma_engine=dma_engine.dma, name=None):
    """Send ``src`` to the peer core's ``dst`` while receiving the peer's ``src`` into this
    core's ``dst`` (SBUF, same dtype and shape); calls with the same ``pipe_id`` meet."""
    api = "sendrecv"
    program = _lnc2(api)
    _on_chip(api, "src", src, psum=False)
    _on_chip(api, "dst", dst, psum=False)
    _enum(dma_engine, globals()["dma_engine"], "dma_engine", api)
    if src.dtype is not dst.dtype or tuple(src.shape) != tuple(dst.shape):
        raise NkiValidationError(
            f"{api} src {tuple(src.shape)} {src.dtype} and dst "
            f"{tuple(dst.shape)} {dst.dtype} must match"
        )
    me = program.program_id
    for argname, rank in (("send_to_rank", send_to_rank), ("recv_from_rank", recv_from_rank)):
        if int(rank) not in (0, 1) or int(rank) == me:
            raise NkiValidationError(
                f"{api} {argname}={rank} must be the other core (this is core {me})"
            )
    launch = program.launch
    with launch.lock:
        launch.mailbox.setdefault((pipe_id, me, int(send_to_rank)), []).append(src.values())
    inbox = (pipe_id, int(recv_from_rank), me)
    launch.turns.block_until(me, lambda: bool(launch.mailbox.get(inbox)), api)
    with launch.lock:
        values = launch.mailbox[inbox].pop(0)
    return _write_and_emit(
        "dma",
        api,
        name,
        dst,
        values,
        [src],
        details={"pipe_id": pipe_id},  # the cost model pairs the cores' transfers by pipe
        dma=dma_trace_fields(
            src.size * src.itemsize, src.shape[0], "sbuf->sbuf", _free(src) * src.itemsize
        ),
    )


def core_barrier(data, cores, engine=engine.gpsimd, name=None):
    """Both cores wait here until both arrive (``cores=(0, 1)``; ``data`` the shared tensor
    they synchronise on)."""
    api = "core_barrier"
    program = _lnc2(api)
    _tensor(api, "data", data)
    if tuple(int(c) for c in cores) != (0, 1):
        raise NkiValidationError(f"{api} cores must be (0, 1), got {tuple(cores)}")
    launch = program.launch
    generation = program.barrier_cursor
    program.barrier_cursor += 1
    with launch.lock:
        launch.barrier_counts[generation] = launch.barrier_counts.get(generation, 0) + 1
    # recorded before the wait (on GpSimd, reading and writing ``data``): the cost model
    # joins the k-th barrier of each core and orders later accesses of ``data`` after it
    _emit(
        "pool",
        api,
        name,
        reads=[data],
        writes=[data],
        partitions=1,
        free_size=0,
        out_dtype=data.dtype,
    )
    launch.turns.block_until(
        program.program_id, lambda: launch.barrier_counts[generation] >= launch.lnc, api
    )
    return NkiInstruction(api, name)


# --- registers ----------------------------------------------------------------------------------
def register_alloc(x=None) -> VirtualRegister:
    """A register holding ``x``: None, an immediate int (aws-neuron-sdk@81ce03ae
    nki/api/nki/isa/__init__.py L3071-3074), or, beyond the docs, a 1-element SBUF/HBM tensor
    loaded as ``register_load`` would (the docs' "two-step" form, L3085-3087, in one call),
    which AWS's MX MoE passes (aws-neuron/nki-library@d2ad3a5
    src/nkilib_src/nkilib/core/moe/moe_tkg/all_expert_mx_impl.py L311)."""
    if isinstance(x, NkiTensor):
        register = VirtualRegister(0)
        register_load(register, x)
        return register
    return VirtualRegister(0 if x is None else int(x))


def register_move(dst, src) -> None:
    if not isinstance(dst, VirtualRegister):
        raise NkiTypeError("register_move dst must be a VirtualRegister")
    if dst.read_only:
        raise NkiValidationError(
            "register_move: the loop induction register is read-only: 'you cannot write to "
            "it with register_move or register_load' (aws-neuron-sdk@81ce03ae "
            "nki/get-started/nki-language-guide.rst L532)"
        )
    dst.value = src.value if isinstance(src, VirtualRegister) else int(src)


def register_load(dst, src) -> None:
    if not isinstance(dst, VirtualRegister):
        raise NkiTypeError("register_load dst must be a VirtualRegister")
    if dst.read_only:
        raise NkiValidationError(
            "register_load: the loop induction register is read-only: 'you cannot write to "
            "it with register_move or register_load' (aws-neuron-sdk@81ce03ae "
            "nki/get-started/nki-language-guide.rst L532)"
        )
    if not isinstance(src, NkiTensor) or src.size != 1 or src.storage.memory == "psum":
        raise NkiValidationError("register_load src must be a 1-element HBM or SBUF tensor")
    dst.value = int(src.array().reshape(-1)[0])


def register_store(dst, src) -> None:
    if not isinstance(src, VirtualRegister):
        raise NkiTypeError("register_store src must be a VirtualRegister")
    if not isinstance(dst, NkiTensor) or dst.size != 1 or dst.storage.memory == "psum":
        raise NkiValidationError("register_store dst must be a 1-element HBM or SBUF tensor")
    write(dst, np.asarray([src.value]))


__all__ = [
    n
    for n in dir()
    if not n.startswith("_")
    and n
    not in (
        "annotations",
        "enum",
        "math",
        "warnings",
        "np",
        "fn",
        "context",
        "sem",
        "dt",
        "core_dtypes",
        "NkiIndexError",
        "NkiTypeError",
        "NkiValueError",
        "partition_start",
        "region",
        "write",
        "matmul_mask",
    )
]


def _assign(self, key, value):
    """``t[key] = value`` (undocumented in 0.6; spec decision): a cast copy of a tensor
    (DMA when either side is in HBM, else a Vector ``tensor_copy``) or a ``memset`` fill.
    Defined here, with the instructions it issues, so that the tensor module does not import
    this one."""
    dst = self[key]
    if not isinstance(value, NkiTensor):
        memset(dst=dst, value=value)
    elif dst.on_chip and value.on_chip:
        tensor_copy(dst=dst, src=value)
    else:
        dma_copy(dst=dst, src=value)


NkiTensor.__setitem__ = _assign


# --- cross-partition shuffle and the top-8 instructions (Vector engine) ------------------------
_SHUFFLE_STARTS = {32: (0, 32, 64, 96), 64: (0, 64), 96: (0,), 128: (0,)}


def nc_stream_shuffle(dst, src, shuffle_mask, name=None):
    """Cross-partition move within each 32-partition quadrant on the Vector engine: output
    partition ``i`` of a quadrant takes input partition ``shuffle_mask[i]`` of the same
    quadrant, ``255`` keeps ``dst``'s data (aws-neuron-sdk@81ce03ae nki/api/nki/isa/__init__.py
    L2052-2081; release-notes/components/nki.rst L281). SBUF or PSUM; same dtype and elements
    per partition; the start partitions follow the active-partition rule of L2067-2077."""
    api = "nc_stream_shuffle"
    _on_chip(api, "dst", dst)
    _on_chip(api, "src", src)
    mask = [int(m) for m in shuffle_mask]
    if len(mask) != sem.QUADRANT or any(
        not (0 <= m < sem.QUADRANT or m == sem.SHUFFLE_KEEP) for m in mask
    ):
        raise NkiValidationError(
            f"{api} shuffle_mask must be 32 partition numbers in [0, 32) or 255, got {mask}"
        )
    if dst.dtype is not src.dtype:
        raise NkiTypeError(f"{api} dst dtype {dst.dtype} must equal src dtype {src.dtype}")
    if _free(dst) != _free(src):
        raise NkiValidationError(
            f"{api} dst has {_free(dst)} elements per partition, src {_free(src)}: they must match"
        )
    active = math.ceil(max(src.shape[0], dst.shape[0]) / sem.QUADRANT) * sem.QUADRANT
    for argname, t in (("src", src), ("dst", dst)):
        if partition_start(t) not in _SHUFFLE_STARTS[active]:
            raise NkiValidationError(
                f"{api} {argname} starts at partition {partition_start(t)}: with {active} "
                f"active partitions it must start at one of {_SHUFFLE_STARTS[active]}"
            )
    try:
        values = sem.stream_shuffle(_pf(src, f32=False), _pf(dst, f32=False), mask)
    except IndexError as exc:
        raise NkiValidationError(
            f"{api} shuffle_mask reads partition {exc.args[0]} of src, which has "
            f"{src.shape[0]} partitions"
        ) from None
    return _write_and_emit("dve", api, name, dst, values, [src, dst])


def _top8_operand(api, argname, t) -> np.ndarray:
    """A max8 / find_index8 / match_replace8 data operand: 8 to 16,384 elements per
    partition (nki/api/nki/isa/__init__.py L2422, L3178), read as fp32."""
    _on_chip(api, argname, t)
    if not 8 <= _free(t) <= 16384:
        raise NkiValidationError(
            f"{api} {argname} has {_free(t)} elements per partition; 8 to 16384 are allowed"
        )
    return _pf(t)


def _eight_per_partition(api, argname, t, partitions) -> None:
    _on_chip(api, argname, t)
    if t.shape[0] != partitions or _free(t) != 8:
        raise NkiValidationError(f"{api} {argname} must be [{partitions}, 8], got {tuple(t.shape)}")


def max8(dst, src, name=None):
    """The 8 largest values of each partition, descending, read as fp32 and written in
    ``dst.dtype`` (nki/api/nki/isa/__init__.py L2415-2432); a per-partition Vector-engine op
    (nki/library/api/gpsimd-topk.rst L47)."""
    api = "max8"
    values = _top8_operand(api, "src", src)
    _eight_per_partition(api, "dst", dst, src.shape[0])
    return _write_and_emit("dve", api, name, dst, sem.max8(values), [src])


def _index_dtype(api, argname, t):
    if t.dtype not in (dt.uint16, dt.uint32):
        raise NkiTypeError(f"{api} {argname} must be uint16 or uint32, got {t.dtype}")
    return (1 << (8 * t.itemsize)) - 1  # the all-ones "not found" sentinel


def nc_find_index8(dst, data, vals, name=None):
    """Per partition, the index of each of the 8 ``vals`` in ``data``; duplicate values take
    successive occurrences; not found: all ones; ``dst`` uint16 or uint32
    (nki/api/nki/isa/__init__.py L3169-3191; release-notes/components/nki.rst L75-77)."""
    api = "nc_find_index8"
    values = _top8_operand(api, "data", data)
    _eight_per_partition(api, "vals", vals, data.shape[0])
    _eight_per_partition(api, "dst", dst, data.shape[0])
    missing = _index_dtype(api, "dst", dst)
    index = sem.find_index8(values, _pf(vals), missing)
    return _write_and_emit("dve", api, name, dst, index, [data, vals])


def nc_match_replace8(dst, data, vals, imm, dst_idx=None, name=None):
    """Replace the first occurrence of each of the 8 ``vals`` in ``data`` with ``imm`` into
    ``dst`` (``vals`` taken from the last, so duplicates pair with matches in descending
    slots), their indices into ``dst_idx`` (nki/api/nki/isa/__init__.py L3193-3219). An
    unmatched ``dst_idx`` slot takes the all-ones sentinel of ``nc_find_index8`` (inferred:
    the docs do not say)."""
    api = "nc_match_replace8"
    values = _top8_operand(api, "data", data)
    _on_chip(api, "dst", dst)
    _pair(api, "data", data, "dst", dst)
    _eight_per_partition(api, "vals", vals, data.shape[0])
    if not is_number(imm):
        raise NkiTypeError(f"{api} imm must be a number, got {type(imm).__name__}")
    missing = 0
    if dst_idx is not None:
        _eight_per_partition(api, "dst_idx", dst_idx, data.shape[0])
        missing = _index_dtype(api, "dst_idx", dst_idx)
    replaced, index = sem.match_replace8(values, _pf(vals), np.float32(imm), missing)
    write(dst, replaced)
    if dst_idx is not None:
        write(dst_idx, index)
    return _emit(
        "dve",
        api,
        name,
        reads=[data, vals],
        writes=[dst] + ([dst_idx] if dst_idx is not None else []),
        partitions=dst.shape[0],
        free_size=_free(dst),
        out_dtype=dst.dtype,
    )


# --- nonzero_with_count (GpSimd, NeuronCore-v3+) -------------------------------------------------
_GPSIMD_CORE_PARTITIONS = 16  # each GpSimd core serves 16 partitions, reading its 0-th


def nonzero_with_count(dst, src, index_offset=0, padding_val=-1, name=None):
    """Per GpSimd core, the indices (+ ``index_offset``) of the nonzero elements of its 0-th
    partition, ``padding_val`` padding, then the count; partitions 0, 16, ..., 112 only, the
    others of ``dst`` untouched (nki/api/nki/isa/__init__.py L3221-3300). NeuronCore-v3+,
    SBUF; ``src`` float32/int32, ``dst`` int32 with one more element per partition."""
    api = "nonzero_with_count"
    if _version(api) < 3:
        raise NkiValidationError(f"{api} is available only on NeuronCore-v3 and newer")
    _on_chip(api, "src", src, psum=False)
    _on_chip(api, "dst", dst, psum=False)
    if src.dtype not in (dt.float32, dt.int32):
        raise NkiTypeError(f"{api} src must be float32 or int32, got {src.dtype}")
    if dst.dtype is not dt.int32:
        raise NkiTypeError(f"{api} dst must be int32, got {dst.dtype}")
    if dst.shape[0] != src.shape[0] or _free(dst) != _free(src) + 1:
        raise NkiValidationError(
            f"{api} dst must be [{src.shape[0]}, {_free(src) + 1}] (one more element than "
            f"src per partition), got {tuple(dst.shape)}"
        )
    for argname, value in (("index_offset", index_offset), ("padding_val", padding_val)):
        if not isinstance(value, (int, np.integer)) or not -(2**31) <= value < 2**31:
            raise NkiTypeError(f"{api} {argname} must be an int32, got {value!r}")
    values = _pf(src, f32=False)
    out = _pf(dst, f32=False).astype(np.int64)
    start = partition_start(src)
    for p in range(src.shape[0]):
        if (start + p) % _GPSIMD_CORE_PARTITIONS == 0:
            out[p] = sem.nonzero_with_count(values[p], int(index_offset), int(padding_val))
    return _write_and_emit("pool", api, name, dst, out, [src, dst])


# --- affine_select (GpSimd) ---------------------------------------------------------------------
def affine_select(
    dst, pattern, channel_multiplier, on_true_tile, on_false_value, cmp_op=None, offset=0, name=None
):
    """``dst = on_true_tile`` where ``cmp_op(offset + p·channel_multiplier + Σ step·i, 0)``
    holds, else the float32 ``on_false_value`` (nki/api/nki/isa/__init__.py L1764-1835):
    GpSimd, SBUF in and out, the pattern as ``iota``'s (1-4 [step, num] pairs covering the
    elements per partition), ``cmp_op`` a comparison (default ``nl.equal``)."""
    api = "affine_select"
    _on_chip(api, "dst", dst, psum=False)
    _on_chip(api, "on_true_tile", on_true_tile, psum=False)
    _pair(api, "dst", dst, "on_true_tile", on_true_tile)
    pairs = _int_pattern(api, pattern)
    if not 1 <= len(pairs) <= 4 or any(len(p) != 2 for p in pairs):
        raise NkiValidationError(f"{api} pattern must be 1 to 4 [step, num] pairs")
    if math.prod(n for _, n in pairs) != _free(dst):
        raise NkiValidationError(
            f"{api} pattern covers {math.prod(n for _, n in pairs)} "
            f"elements per partition, dst has {_free(dst)}"
        )
    if not isinstance(on_false_value, float):
        raise NkiTypeError(
            f"{api} on_false_value must be a float32 scalar, got "
            f"{type(on_false_value).__name__} {on_false_value!r}: 'The on_false_value must be "
            f"float32, regardless of the input/output tile data types' ({_ISA} L1813)"
        )
    spec = _op(api, "cmp_op", "equal" if cmp_op is None else cmp_op)
    if spec.name not in fn.COMPARISONS:
        raise NkiValidationError(f"{api} cmp_op must be a comparison, got {spec.name}")
    affine = sem.iota_pattern(
        dst.shape[0],
        pairs,
        _int32(api, "offset", offset),
        _int32(api, "channel_multiplier", channel_multiplier),
    )
    values = sem.affine_select(spec, affine, _pf(on_true_tile), on_false_value)
    return _write_and_emit("pool", api, name, dst, values, [on_true_tile])


# --- nc_n_gather (GpSimd) ---------------------------------------------------------------------
def nc_n_gather(dst, data, indices, name=None):
    """Per partition, ``dst[p, j] = data[p, indices[p, j]]`` over ``data``'s flattened free
    elements (nki/api/nki/isa/__init__.py nc_n_gather): GpSimd, all three in SBUF, ``dst``
    of ``data``'s dtype, ``indices`` uint32 with ``dst``'s elements per partition, every
    index in ``[0, data.size / data.shape[0])``."""
    api = "nc_n_gather"
    for argname, t in (("dst", dst), ("data", data), ("indices", indices)):
        _on_chip(api, argname, t, psum=False)
    if dst.dtype is not data.dtype:
        raise NkiTypeError(f"{api} dst dtype {dst.dtype} must equal data dtype {data.dtype}")
    if indices.dtype is not dt.uint32:
        raise NkiTypeError(f"{api} indices must be uint32, got {indices.dtype}")
    if not dst.shape[0] == data.shape[0] == indices.shape[0]:
        raise NkiValidationError(f"{api} dst, data and indices need the same partitions")
    _pair(api, "indices", indices, "dst", dst)
    index = _pf(indices, f32=False).astype(np.int64)
    if index.size and (index.min() < 0 or index.max() >= _free(data)):
        raise NkiValidationError(
            f"{api} indices must lie in [0, {_free(data)}), got {index.min()}..{index.max()}"
        )
    values = np.take_along_axis(_pf(data, f32=False), index, axis=1)
    return _write_and_emit("pool", api, name, dst, values, [data, indices])


# --- dma_copy through a vector_offset access pattern (gather / scatter) -------------------------
def _indirect_dma_copy(dst, src, skip, mode, name):
    """``dma_copy`` with a ``.ap(vector_offset=...)`` side: each row of the indexed side is the
    storage row its index names, read when the DMA runs. A row reaching outside the indexed
    tensor raises (``oob_mode.error``) or moves nothing (``oob_mode.skip``), leaving the
    other side's elements as they were; equal dtypes copy bits, others cast through float32
    (nki/api/nki/isa/__init__.py dma_copy "Indirect addressing" and ``oob_mode``;
    release-notes/components/nki.rst L280)."""
    api = "dma_copy"
    if src.size != dst.size:
        raise NkiValidationError(
            f"{api} src has {src.size} elements {tuple(src.shape)}, dst has "
            f"{dst.size} {tuple(dst.shape)}"
        )
    keep = np.ones(src.size, bool)
    places = {}
    for side, t in (("src", src), ("dst", dst)):
        if not t.is_indirect():
            continue
        if t.index_columns() > 1:  # documented for dma_transpose's indirect source only
            raise NkiValidationError(
                f"{api} {side} takes a (P, 1) vector_offset index; a [128, N] index is "
                "dma_transpose's (nki/api/nki/isa/__init__.py L897-908)"
            )
        positions, inside = _indirect_rows_inside(api, side, t, skip)
        keep &= np.repeat(inside, positions.shape[1])
        places[side] = positions.reshape(-1)
    if src.is_indirect():
        values = np.zeros(src.size, src.storage_values().dtype)
        values[keep] = src.storage_values()[places["src"][keep]]
    else:
        values = src.values().reshape(-1)
    if src.dtype is not dst.dtype:
        values = values.astype(np.float32)
    if dst.is_indirect():
        flat = dst.storage_values()
        flat[places["dst"][keep]] = dt.cast(values[keep], dst.dtype, flat.dtype)
        dst.storage.written = True
    else:
        merged = dst.values().reshape(-1)
        merged[keep] = dt.cast(values[keep], dst.dtype, merged.dtype)
        write(dst, merged)
    indirect = src if src.is_indirect() else dst
    return _emit(
        "dma",
        api,
        name,
        reads=[src] + ([indirect.index] if indirect.index is not None else []),
        writes=[dst],
        partitions=_chip_partitions(dst, src),
        out_dtype=dst.dtype,
        details={"dge_mode": mode.name, "indirect": True},
        dma=_dma_fields(src, dst, dst.size, _chip_partitions(dst, src)),
    )


# --- range_select (Vector, NeuronCore-v3+), tensor_partition_reduce (GpSimd) -------------------
_RANGE_COMPARISONS = ("equal", "less", "less_equal", "greater", "greater_equal")
_FP32_MIN = float(np.finfo(np.float32).min)


def range_select(
    dst,
    on_true_tile,
    comp_op0,
    comp_op1,
    bound0,
    bound1,
    reduce_cmd=reduce_cmd.reset_reduce,
    reduce_res=None,
    reduce_op=None,
    range_start=0,
    on_false_value=_FP32_MIN,
    name=None,
):
    """Keep ``on_true_tile``'s elements whose free index + ``range_start`` passes both
    comparisons with the per-partition fp32 bounds, else ``on_false_value`` (FP32_MIN, the
    only value the hardware takes); the row maxima fold into the Vector accumulators per
    ``reduce_cmd`` and go to ``reduce_res`` if given (nki/api/nki/isa/__init__.py
    range_select: NeuronCore-v3+, comparisons equal/less/less_equal/greater/greater_equal,
    floating-point data, fp32 bounds, reduce_op nl.maximum only)."""
    api = "range_select"
    if _version(api) < 3:
        raise NkiValidationError(f"{api} is available only on NeuronCore-v3 and newer")
    _on_chip(api, "on_true_tile", on_true_tile)
    _on_chip(api, "dst", dst)
    _pair(api, "on_true_tile", on_true_tile, "dst", dst)
    if not dt.is_float(on_true_tile.dtype):
        raise NkiTypeError(f"{api} on_true_tile must be floating point, got {on_true_tile.dtype}")
    specs = []
    for argname, op in (("comp_op0", comp_op0), ("comp_op1", comp_op1)):
        spec = _op(api, argname, op)
        if spec.name not in _RANGE_COMPARISONS:
            raise NkiValidationError(
                f"{api} {argname} must be one of {', '.join(_RANGE_COMPARISONS)}, got {spec.name}"
            )
        specs.append(spec)
    bounds = []
    for argname, bound in (("bound0", bound0), ("bound1", bound1)):
        _on_chip(api, argname, bound)
        if bound.shape[0] != on_true_tile.shape[0] or _free(bound) != 1:
            raise NkiValidationError(
                f"{api} {argname} must have one element per partition "
                f"({on_true_tile.shape[0]}, 1), got {tuple(bound.shape)}"
            )
        if bound.dtype is not dt.float32:
            raise NkiTypeError(f"{api} {argname} must be float32, got {bound.dtype}")
        bounds.append(_pf(bound))
    if not is_number(on_false_value) or np.float32(on_false_value) != np.float32(_FP32_MIN):
        raise NkiValidationError(
            f"{api} on_false_value must be FP32_MIN ({_FP32_MIN}), got {on_false_value!r}"
        )
    spec = _op(api, "reduce_op", "maximum" if reduce_op is None else reduce_op)
    if spec.name != "maximum":
        raise NkiValidationError(f"{api} reduce_op must be nl.maximum, got {spec.name}")
    if isinstance(range_start, bool) or not isinstance(range_start, (int, np.integer)):
        raise NkiTypeError(  # "must be a compiler time integer"
            f"{api} range_start must be a compile-time integer, got {range_start!r} "
            "(nki/api/nki/isa/__init__.py@81ce03ae L2895-2896)"
        )
    if abs(int(range_start)) + _free(on_true_tile) > 1 << 24:
        raise NkiValidationError(
            f"{api} range_start {range_start} + the free index leaves the 2^24 range the fp32 "
            "comparison is exact in (nki/api/nki/isa/__init__.py@81ce03ae L2864)"
        )
    cmd = _enum(reduce_cmd, globals()["reduce_cmd"], "reduce_cmd", api)
    values = sem.range_select(
        _pf(on_true_tile), bounds[0], bounds[1], specs[0], specs[1], range_start, on_false_value
    )
    program = context.current(api)
    regs = program.vector_regs[: dst.shape[0]]
    sem.update_registers(regs, spec, sem.fold_partitions(spec, values), cmd.name)
    write(dst, values)
    writes = [dst]
    if reduce_res is not None:
        _on_chip(api, "reduce_res", reduce_res)
        if reduce_res.shape[0] != dst.shape[0] or _free(reduce_res) != 1:
            raise NkiValidationError(
                f"{api} reduce_res must be ({dst.shape[0]}, 1), got {tuple(reduce_res.shape)}"
            )
        write(reduce_res, regs)
        writes.append(reduce_res)
    return _emit(
        "dve",
        api,
        name,
        reads=[on_true_tile, bound0, bound1],
        writes=writes,
        partitions=dst.shape[0],
        free_size=_free(dst),
        out_dtype=dst.dtype,
    )


_PARTITION_REDUCE_OPS = ("add", "maximum", "bitwise_or", "bitwise_and")


def tensor_partition_reduce(dst, op, data, name=None):
    """``dst[0, :] = op`` over the partitions of ``data`` on GpSimd (nki/api/nki/isa/__init__.py
    tensor_partition_reduce: add, average, max, bitwise_or, bitwise_and; GpSimd cannot access
    PSUM). ``dst`` has one partition and ``data``'s elements per partition. ``average`` has
    no ``nl`` operator in the 0.6 API, so it is not reachable here."""
    api = "tensor_partition_reduce"
    _on_chip(api, "data", data, psum=False)
    _on_chip(api, "dst", dst, psum=False)
    spec = _op(api, "op", op)
    if spec.name not in _PARTITION_REDUCE_OPS:
        raise NkiValidationError(
            f"{api} op must be one of add, maximum, bitwise_or, bitwise_and, got {spec.name}"
        )
    if dst.shape[0] != 1 or _free(dst) != _free(data):
        raise NkiValidationError(f"{api} dst must be (1, {_free(data)}), got {tuple(dst.shape)}")
    if spec.bitvec and not (dt.is_int(data.dtype) and dt.is_int(dst.dtype)):
        raise NkiValidationError(
            f"{api} op={spec.name} on {data.dtype} -> {dst.dtype}: 'instructions using bitvec "
            "operators expect integer data types' (aws-neuron-sdk@81ce03ae "
            "nki/api/nki.api.shared.rst L65-67)"
        )
    values = _pf(data, f32=spec.name in ("add", "maximum"))
    return _write_and_emit("pool", api, name, dst, sem.partition_reduce(spec.name, values), [data])


__all__ += [
    "nc_stream_shuffle",
    "max8",
    "nc_find_index8",
    "nc_match_replace8",
    "nonzero_with_count",
    "affine_select",
    "nc_n_gather",
    "range_select",
    "tensor_partition_reduce",
]


# --- local_gather (GpSimd gather within 16-partition blocks) -----------------------------------
_LOCAL_GATHER_ELEMENTS = (1, 2, 4, 8, 16, 32)
#: "The number of indices for gather per core must be less than or equal to 4096"
_LOCAL_GATHER_MAX_INDICES = 4096


def local_gather(dst, src_buffer, index, num_elem_per_idx=1, num_valid_indices=None, name=None):
    """Each 16-partition block of ``src_buffer`` gathered by its own block of ``index``
    (semantics: :func:`simulate.core.semantics.local_gather`). The rules are the ISA
    reference's (aws-neuron-sdk@81ce03ae nki/api/nki/isa/__init__.py L1838-1889): GpSimd,
    so SBUF only; ``dst`` of ``src_buffer``'s dtype ("no data type casting is allowed");
    ``index`` uint16; ``src_buffer.shape[0] == index.shape[0]``, a multiple of 16;
    ``num_elem_per_idx`` in 1, 2, 4, ..., 32; ``num_valid_indices`` at most the indices of a
    block (``index.size / (index.shape[0] / 16)``) and at most 4096. An index whose elements
    leave the row is rejected: "Behavior of out-of-bound index access is undefined"."""
    api = "local_gather"
    for argname, t in (("dst", dst), ("src_buffer", src_buffer), ("index", index)):
        _on_chip(api, argname, t, psum=False)
    if dst.dtype is not src_buffer.dtype:
        raise NkiTypeError(
            f"{api} dst dtype {dst.dtype} must equal src_buffer dtype {src_buffer.dtype} "
            "(no data type casting is allowed)"
        )
    if index.dtype is not dt.uint16:
        raise NkiTypeError(f"{api} index must be uint16, got {index.dtype}")
    partitions = src_buffer.shape[0]
    block = sem.GPSIMD_CORE_PARTITIONS
    if index.shape[0] != partitions or partitions % block:
        raise NkiValidationError(
            f"{api} src_buffer and index need the same partitions, a multiple of {block}; got "
            f"{partitions} and {index.shape[0]}"
        )
    if num_elem_per_idx not in _LOCAL_GATHER_ELEMENTS:
        raise NkiValidationError(
            f"{api} num_elem_per_idx must be one of {_LOCAL_GATHER_ELEMENTS}, got "
            f"{num_elem_per_idx!r}"
        )
    per_block = index.size // (partitions // block)
    valid = per_block if num_valid_indices is None else num_valid_indices
    if not isinstance(valid, int) or not 0 < valid <= min(per_block, _LOCAL_GATHER_MAX_INDICES):
        raise NkiValidationError(
            f"{api} num_valid_indices must be an int in [1, "
            f"{min(per_block, _LOCAL_GATHER_MAX_INDICES)}] (the indices of 16 partitions of "
            f"index, at most {_LOCAL_GATHER_MAX_INDICES}), got {num_valid_indices!r}"
        )
    if dst.shape[0] != partitions or _free(dst) != valid * num_elem_per_idx:
        raise NkiValidationError(
            f"{api} dst must hold {partitions} partitions x {valid * num_elem_per_idx} "
            f"elements (num_valid_indices x num_elem_per_idx), got {dst.shape[0]} x {_free(dst)}"
        )
    offsets = _pf(index, f32=False).astype(np.int64)
    row = _free(src_buffer)
    used = np.concatenate(
        [
            offsets[start : start + block].flatten(order="F")[:valid]
            for start in range(0, partitions, block)
        ]
    )
    if used.min() < 0 or used.max() + num_elem_per_idx > row:
        raise NkiValidationError(
            f"{api} an index reads elements {used.max()}..{used.max() + num_elem_per_idx - 1} "
            f"of rows of {row}: out-of-bound access is undefined"
        )
    values = sem.local_gather(_pf(src_buffer, f32=False), offsets, num_elem_per_idx, valid)
    details = {"num_elem_per_idx": num_elem_per_idx, "num_valid_indices": valid}
    return _write_and_emit("pool", api, name, dst, values, [src_buffer, index], details)


__all__ += ["local_gather"]


# --- OCP Microscaling (MX) ------------------------------------------------------------------
_ISA = "aws-neuron-sdk@81ce03ae nki/api/nki/isa/__init__.py"
_MX_SCALE_DTYPES = (dt.float8_e8m0fnu, dt.uint8)
_MX_FP8 = (dt.float8_e4m3fn_x4, dt.float8_e5m2_x4)


def _neuroncore_v4(api, line) -> None:
    if _version(api) < 4:
        raise NkiValidationError(
            f"{api} is available only on NeuronCore-v4 and newer (trn3), not on "
            f"NeuronCore-v{_version(api)} ({_ISA} L{line})"
        )


def _element(packed) -> str:
    return str(packed)[: -len("_x4")]


def _mx_data(api, argname, t, partitions_limit=PMAX) -> NkiTensor:
    """An MX data tile: SBUF, a multiple of 32 partitions up to 128."""
    _on_chip(api, argname, t, psum=False)
    if t.shape[0] % sem.QUADRANT or t.shape[0] > partitions_limit:
        raise NkiValidationError(
            f"{api} {argname} partition dimension {t.shape[0]} must be a multiple of 32 and "
            f"at most {partitions_limit} (scaling groups span 8 partitions; {_ISA} L2784, "
            "L779-780)"
        )
    return t


def _mx_scale(api, argname, scale, data_partitions, free) -> NkiTensor:
    """The scale tile of MX data of ``data_partitions`` x ``free`` x4 elements: SBUF,
    float8_e8m0fnu or uint8, ``free`` elements per partition (one scale per x4 element
    column of a group: quantize_mx's src free size is 4x its scale's, AWS's
    nki/deep-dives/src/mxfp-matmul/mx_kernels.py L236-238), and partitions reaching every
    group's row: rows 0-3 of each 32-partition quadrant (trainium3_arch.rst L105), all in the
    quadrant they start in."""
    _on_chip(api, argname, scale, psum=False)
    if scale.dtype not in _MX_SCALE_DTYPES:
        raise NkiTypeError(
            f"{api} {argname} must be float8_e8m0fnu or uint8, got {scale.dtype} "
            f"({_ISA} L2768-2769, L761-762)"
        )
    if _free(scale) != free:
        raise NkiValidationError(
            f"{api} {argname} has {_free(scale)} elements per partition: it needs {free}, one "
            "scale per x4 element of the data's partition rows"
        )
    rows = int(sem.mx_scale_rows(data_partitions)[-1]) + 1
    if scale.shape[0] < rows:
        raise NkiValidationError(
            f"{api} {argname} has {scale.shape[0]} partitions: {data_partitions} data "
            f"partitions put their scales on partitions 0-3 of each 32-partition quadrant, "
            f"which needs {rows} (aws-neuron-sdk@81ce03ae "
            "nki/guides/architecture/trainium3_arch.rst L105)"
        )
    if partition_start(scale) % sem.QUADRANT + sem.MX_SCALE_ROWS_PER_QUADRANT > sem.QUADRANT:
        raise NkiValidationError(
            f"{api} {argname} starts at partition {partition_start(scale)}: the 4 scale rows of "
            "a quadrant must stay in that quadrant (trainium3_arch.rst L105)"
        )
    return scale


def _scale_rows(scale: NkiTensor, data_partitions: int) -> list[NkiTensor]:
    """The views of ``scale`` that hold the scale rows of each data quadrant (4 partitions
    each, or fewer below 32 data partitions)."""
    per_quadrant = min(data_partitions, sem.QUADRANT) // sem.MX_GROUP_PARTITIONS
    views = []
    for quadrant in range(max(1, data_partitions // sem.QUADRANT)):
        start = scale.offset + quadrant * sem.QUADRANT * scale.strides[0]
        views.append(
            scale._derive((per_quadrant, *scale.shape[1:]), scale.strides, start)  # noqa: SLF001
        )
    return views


def _read_scale(scale: NkiTensor, data_partitions: int) -> np.ndarray:
    """The dense (data_partitions / 8, free) scale bytes of an MX scale tile."""
    rows = [
        v.values().reshape(v.shape[0], -1).view(np.uint8)
        for v in _scale_rows(scale, data_partitions)
    ]
    return np.concatenate(rows, axis=0)


def quantize_mx(dst, src, dst_scale, name=None):
    """Quantize float16/bfloat16 ``src`` (P, F) to MXFP8 on the Vector engine: ``dst``
    (P, F/4) ``float8_e4m3fn_x4`` / ``float8_e5m2_x4`` and one e8m0 scale per 32-value group
    of 8 partitions x 4 elements in ``dst_scale`` (``float8_e8m0fnu`` or ``uint8``), on
    partitions 0-3 of each 32-partition quadrant of the scale tile; its other partitions
    are left as they are (AWS packs two tensors' scales in one tile,
    nki/deep-dives/src/mxfp-matmul/mx_kernels.py L243-256). NeuronCore-v4 only; all tiles in
    SBUF; P a multiple of 32 up to 128, F a multiple of 4 (aws-neuron-sdk@81ce03ae
    nki/api/nki/isa/__init__.py L2741-2816). Values and scales:
    :func:`simulate.core.semantics.quantize_mx`."""
    api = "quantize_mx"
    _neuroncore_v4(api, 2746)
    _mx_data(api, "src", src)
    _on_chip(api, "dst", dst, psum=False)
    if src.dtype not in (dt.float16, dt.bfloat16):
        raise NkiTypeError(f"{api} src must be float16 or bfloat16, got {src.dtype} ({_ISA} L2767)")
    if dst.dtype not in _MX_FP8:
        raise NkiTypeError(
            f"{api} dst must be float8_e4m3fn_x4 or float8_e5m2_x4, got {dst.dtype} "
            f"({_ISA} L2767-2768; float4_e2m1fn_x4 is an nc_matmul_mx input only)"
        )
    free = _free(src)
    if free % sem.MX_GROUP_ELEMENTS:
        raise NkiValidationError(
            f"{api} src free size {free} must be a multiple of 4 ({_ISA} L2785)"
        )
    if dst.shape[0] != src.shape[0] or _free(dst) * sem.MX_GROUP_ELEMENTS != free:
        raise NkiValidationError(
            f"{api} dst has {dst.shape[0]} partitions x {_free(dst)} elements: it needs "
            f"{src.shape[0]} x {free // 4}, a quarter of src's free size ({_ISA} L2787-2788)"
        )
    _mx_scale(api, "dst_scale", dst_scale, src.shape[0], free // sem.MX_GROUP_ELEMENTS)
    values, scale_bytes = sem.quantize_mx(_pf(src), _element(dst.dtype))
    write(dst, core_dtypes.pack_x4(values, str(dst.dtype)).view(dst.dtype.numpy))
    per_quadrant = sem.MX_SCALE_ROWS_PER_QUADRANT
    for quadrant, view in enumerate(_scale_rows(dst_scale, src.shape[0])):
        rows = scale_bytes[quadrant * per_quadrant : quadrant * per_quadrant + view.shape[0]]
        write(view, rows.view(dst_scale.dtype.numpy) if dst_scale.dtype is not dt.uint8 else rows)
    return _emit(
        "dve",
        api,
        name,
        reads=[src],
        writes=[dst, dst_scale],
        partitions=src.shape[0],
        free_size=free,
        out_dtype=dst.dtype,
    )


def nc_matmul_mx(
    dst,
    stationary,
    moving,
    stationary_scale,
    moving_scale,
    tile_position=None,
    tile_size=None,
    accumulate=None,
    name=None,
):
    """MX matmul with dequantization on the Tensor engine (NeuronCore-v4 only):
    ``dst[i, j] = sum_k sum_q S[k, 4i+q] * s_S * M[k, 4j+q] * s_M``, the contraction over
    the partitions and the four values of each x4 element, every value times its group's
    scale (layout of :func:`quantize_mx`). ``stationary`` (K, M) and ``moving`` (K, N) in
    ``float8_e5m2_x4`` / ``float8_e4m3fn_x4`` / ``float4_e2m1fn_x4`` (mixed allowed,
    trainium3_arch.rst L77), SBUF; K a multiple of 32 up to 128, M even and <= 128, N <= 4096
    (float32 ``dst``) or 8192 (bfloat16); ``dst`` (M, N) in PSUM; row tiling only
    (``tile_size`` (32/64/128, 128), ``tile_position`` (a multiple of the row size, 0));
    ``accumulate`` as :func:`nc_matmul` (aws-neuron-sdk@81ce03ae nki/api/nki/isa/__init__.py
    L714-826). Values: :func:`simulate.core.semantics.matmul_mx`."""
    api = "nc_matmul_mx"
    _neuroncore_v4(api, 719)
    _mx_data(api, "stationary", stationary)
    _mx_data(api, "moving", moving)
    _on_chip(api, "dst", dst, sbuf=False)
    for argname, t in (("stationary", stationary), ("moving", moving)):
        if t.dtype not in dt.PACKED:
            raise NkiTypeError(
                f"{api} {argname} must be float8_e5m2_x4, float8_e4m3fn_x4 or float4_e2m1fn_x4, "
                f"got {t.dtype} ({_ISA} L760-761)"
            )
    if dst.dtype not in (dt.float32, dt.bfloat16):
        raise NkiTypeError(f"{api} dst must be float32 or bfloat16, got {dst.dtype} ({_ISA} L763)")
    k, m, n = stationary.shape[0], _free(stationary), _free(moving)
    if moving.shape[0] != k:
        raise NkiValidationError(
            f"{api} moving has {moving.shape[0]} partitions, stationary {k}: they must be "
            f"identical ({_ISA} L779-780)"
        )
    if m % 2 or m > 128:
        raise NkiValidationError(
            f"{api} stationary free size {m} must be even and at most 128 ({_ISA} L781)"
        )
    limit = 4096 if dst.dtype is dt.float32 else 8192
    if n > limit:
        raise NkiValidationError(
            f"{api} moving free size {n} exceeds {limit} for a {dst.dtype} dst ({_ISA} L782-783)"
        )
    if dst.shape[0] != m or _free(dst) != n:
        raise NkiValidationError(
            f"{api} dst {tuple(dst.shape)} must hold {m} partitions x {n} elements "
            f"(stationary free size x moving free size, {_ISA} L771-773)"
        )
    _mx_scale(api, "stationary_scale", stationary_scale, k, m)
    _mx_scale(api, "moving_scale", moving_scale, k, n)
    if (tile_position is None) != (tile_size is None):
        raise NkiValidationError(
            f"{api} tile_position and tile_size must both be set ({_ISA} L747-749)"
        )
    if tile_size is not None:
        rows, columns = (int(v) for v in tile_size)
        start_row, start_column = (int(v) for v in tile_position)
        if rows not in (32, 64, 128) or columns != 128:
            raise NkiValidationError(
                f"{api} tile_size {tuple(tile_size)}: row tiling only, (32, 64 or 128, 128) "
                f"({_ISA} L732-737)"
            )
        if start_column != 0 or start_row % rows or start_row + rows > 128 or k > rows:
            raise NkiValidationError(
                f"{api} tile_position {tuple(tile_position)} with tile_size {tuple(tile_size)} "
                f"and {k} stationary partitions: start_row a multiple of the row size, "
                f"start_column 0, the stationary inside its tile ({_ISA} L738-742)"
            )
    product = sem.matmul_mx(
        core_dtypes.unpack_x4(_pf(stationary, f32=False), str(stationary.dtype)),
        _read_scale(stationary_scale, k),
        core_dtypes.unpack_x4(_pf(moving, f32=False), str(moving.dtype)),
        _read_scale(moving_scale, k),
    )
    _accumulate_product(api, dst, product, accumulate)
    return _emit(
        "pe",
        api,
        name,
        reads=[stationary, moving, stationary_scale, moving_scale],
        writes=[dst],
        partitions=k,
        free_size=n,
        out_dtype=dst.dtype,
        details={"stationary_free": m, "accumulate": accumulate},
    )


__all__ += ["quantize_mx", "nc_matmul_mx"]
