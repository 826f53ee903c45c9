"""Kernel execution: the per-run context, loop iterators, SPMD grids, both calling
conventions, and the entry points ``nki.jit`` / ``simulate_kernel`` / ``baremetal`` /
``benchmark``.

Kernels run eagerly in Python (loop bodies execute concretely, like ``static_range``);
every NKI call appends the instructions it would issue to the context's trace.

The calling convention is read from the kernel's bytecode before it runs: a kernel with a
``return <value>`` uses the return convention (inputs are immutable and are passed to the
kernel as read-only views of the caller's arrays, so a store into one is rejected before
it touches data), any other kernel the output-parameter convention (the kernel writes the
caller's arrays directly).
"""

from __future__ import annotations

import contextvars
import dis
import functools
import inspect
import itertools
import operator
import threading

import numpy as np

from . import dtypes as dt
from . import jax_calls, rules, scoping, sdk
from .errors import NKIRuntimeError, NKITypeError, NKIValueError
from .memory import (
    PartitionAllocator,
    Storage,
    TileRecord,
    check_live_capacity,
    check_modulo_lifetimes,
    check_placement_clashes,
    with_transfers,
)
from .targets import DEFAULT_TARGET, PMAX, PSUM_BANK_BYTES, TARGETS, get_target
from .tensor import Tensor
from .trace import Trace

# The running kernel's context. A context variable, not a global: every thread launching
# kernels (torch / JAX bindings, thread pools) sees only its own run, and a sub-kernel
# (``mode="trace"``) called inside a kernel sees its caller's, which runs on the same thread.
_context: contextvars.ContextVar[Context | None] = contextvars.ContextVar(
    "simulate_context", default=None
)
_finished = threading.local()  # .trace: the calling thread's most recent run

# Turns a ``mode="benchmark"`` run's trace into ``kernel.benchmark_result``. The cost model
# sits in the layer above the core (``simulate.perf``), which registers it when imported.
_benchmark_reporter = None


def register_benchmark_reporter(reporter) -> None:
    """Make ``reporter(trace)`` the source of ``kernel.benchmark_result``."""
    global _benchmark_reporter
    _benchmark_reporter = reporter


MODES = ("auto", "jax", "torchxla", "baremetal", "benchmark", "simulation", "trace")


class LoopFrame:
    """One running ``affine_range`` / ``sequential_range`` / ``static_range`` loop."""

    _ids = itertools.count(1)

    def __init__(self, kind: str):
        self.id = next(self._ids)
        self.kind = kind
        self.iteration = 0
        self.active = True
        self.writes: dict[int, list] = {}  # storage id -> [(iteration, box)] (affine checker)


class Context:
    """State of one kernel run: target, trace, allocators, loops and SPMD position."""

    def __init__(self, target, kernel_code=None):
        self.target = get_target(target)
        self.trace = Trace(self.target.name)
        # placement only; capacity is checked on live ranges when the kernel ends
        self.sbuf = PartitionAllocator("sbuf", 4, self.trace, "sbuf_peak_bytes_per_partition")
        self.psum = PartitionAllocator(
            "psum", PSUM_BANK_BYTES, self.trace, "psum_peak_bytes_per_partition"
        )
        self.tiles: dict[int, TileRecord] = {}  # storage id -> the on-chip tensor
        # (storage id, block) of the PSUM tiles written so far: a matmul accumulated into
        # one never written starts its accumulation group
        self.written_psum_blocks: set[tuple[int, int]] = set()
        # storage id -> (block shape, (bank, partition, free) moduli per block dimension) of
        # the tensors placed by modulo allocation (ncc.sbuf/psum.mod_alloc)
        self.modulo_tiles: dict[int, tuple] = {}
        # storage id -> per logical block, where the kernel placed it (ncc.sbuf/psum.alloc)
        self.placements: dict[int, list] = {}
        # "automatic" / "direct": how the kernel's SBUF/PSUM tensor declarations are placed
        self.declared_allocation_kinds: set[str] = set()
        self.loops: list[LoopFrame] = []
        self.program_id: tuple[int, ...] = ()
        self.core = 0  # the physical core the running instance is placed on (LNC=2)
        self.grid: tuple[int, ...] = ()
        self.shared_hbm: list[Tensor] = []
        self.shared_hbm_cursor = 0
        self.kernel_code = kernel_code
        self.convention = None  # "return", "output" or None (unknown until the kernel returns)
        self.check_affine = True
        # storage id -> [previous instance, its boxes, running instance, its boxes] of the
        # writes into a shared HBM tensor (the SPMD output-dependency check)
        self.program_writes: dict[int, list] = {}
        self.print_enabled = True
        # the Scalar engine's fp32 reduce register, one per partition; its state before the
        # first reset is undefined (NaN)
        self.act_accumulator = np.full((PMAX, 1), np.nan, np.float32)
        self.vector_accumulator = np.full((PMAX, 1), np.nan, np.float32)  # range_select's
        self.fresh_tile = None  # weak reference to the latest instruction's result tile
        self.rng = np.random.default_rng(0)  # ``nl.rand`` state; ``nl.random_seed`` reseeds it
        # if/else/for/while blocks being run, of the kernel and the helpers it calls
        self.blocks: list[tuple[str, int]] = []
        # storage ids of the tiles a ``return`` inside a block is handing to the caller
        self.returning: set[int] = set()
        self.allocated = False  # the kernel places tiles itself (ncc.sbuf/psum allocators)
        self.private_hbm_names: list[str] = []  # nl.hbm / nl.private_hbm tensors created

    def check_capacity(self) -> None:
        """Insert the compiler's spills into the trace where the tiles live at once (first
        to last use, per (P, F) block) need more SBUF or PSUM per partition than the target
        has (:func:`check_live_capacity`); the trace's peaks become those of the live ranges
        and its ``spill_save_bytes`` / ``spill_reload_bytes`` the spill traffic."""
        check_modulo_lifetimes(self.trace.instructions, self.tiles, self.modulo_tiles)
        check_placement_clashes(self.trace.instructions, self.tiles, self.placements)
        peaks, plans, transfers = check_live_capacity(
            self.trace.instructions,
            self.tiles,
            {
                "sbuf": self.target.sbuf_bytes_per_partition,
                "psum": self.target.psum_bytes_per_partition,
            },
            self.target.name,
            placed_by_kernel=self.allocated,
        )
        self.trace.instructions = with_transfers(self.trace.instructions, transfers)
        self.trace.sbuf_peak_bytes_per_partition = peaks["sbuf"]
        self.trace.psum_peak_bytes_per_partition = peaks["psum"]
        self.trace.spill_save_bytes = sum(plan.save_bytes for plan in plans)
        self.trace.spill_reload_bytes = sum(plan.reload_bytes for plan in plans)

    def loops_key(self):
        return tuple((f.id, f.kind, f.iteration) for f in self.loops)


def current(api: str = "this API") -> Context:
    """The running kernel's context; NKI APIs outside a kernel are an error."""
    ctx = _context.get()
    if ctx is None:
        raise NKIRuntimeError(
            f"{api} can only be called inside an NKI kernel", "err_nki_api_outside_of_nki_kernel"
        )
    return ctx


def active() -> Context | None:
    return _context.get()


# What a kernel recompiled for its block scopes and kernel-level ``range`` loops calls.
_SCOPE_HOOKS = scoping.Hooks(current, LoopFrame)


def last_trace() -> Trace | None:
    """The instruction trace of the calling thread's most recent kernel run (any entry
    point, either dialect: the 0.6 front-end records its launches with
    :func:`record_trace`)."""
    return getattr(_finished, "trace", None)


def record_trace(trace: Trace) -> None:
    """Make ``trace`` the calling thread's :func:`last_trace` (a front-end's finished run)."""
    _finished.trace = trace


# --- the two dialects ------------------------------------------------------------------------
# A kernel of the ``nki`` 0.6 front-end (``simulate.nki06``) launches itself: it says so with
# a ``__simulate_trace__(*args, target=None, **kwargs) -> (outputs, trace)`` method. The
# entry points below dispatch such kernels to it (the core imports no front-end), and a plain
# function written against ``nki`` 0.6 gets a one-line error naming the way to launch it.
_NKI06_MODULES = ("nki", "simulate.nki06")


def dialect_of(kernel) -> str:
    """``"nki06"`` for a 0.6 kernel (an ``@nki.jit`` of the 0.6 front-end, or a plain function
    whose code uses an ``nki`` 0.6 module: the real ``nki`` or ``simulate.nki06``), else
    ``"legacy"``."""
    while isinstance(kernel, (Kernel, functools.partial)):
        kernel = kernel.func
    if hasattr(kernel, "__simulate_trace__"):
        return "nki06"
    code, names = getattr(kernel, "__code__", None), getattr(kernel, "__globals__", {})
    for name in code.co_names if code is not None else ():
        module = names.get(name)
        module_name = getattr(module, "__name__", "") if inspect.ismodule(module) else ""
        if module_name.partition(".")[0] == "nki" or module_name.startswith(_NKI06_MODULES[1]):
            return "nki06"
    return "legacy"


def check_legacy_kernel(kernel, entry_point: str | None = None) -> None:
    """A ``TypeError`` naming the way to launch ``kernel`` when it is an ``nki`` 0.6 kernel:
    ``entry_point`` (a launcher of legacy kernels only; None: the legacy runtime, which the
    entry points reach with plain functions) cannot run it."""
    if dialect_of(kernel) == "legacy":
        return
    name = getattr(kernel, "__name__", type(kernel).__name__)
    if entry_point is None:
        raise NKITypeError(
            f"{name!r} is written against nki 0.6, which the legacy (neuronxcc.nki) runtime "
            "cannot run: decorate it with the 0.6 nki.jit (simulate.nki06.jit); "
            "simulate.trace_kernel, simulate_kernel, profile, jit and benchmark take that kernel",
            "err_kernel_of_the_other_dialect",
        )
    raise NKITypeError(
        f"{entry_point} takes legacy (neuronxcc.nki) kernels, but {name!r} is an nki 0.6 "
        "kernel: call it directly with the arrays (the 0.6 launch convention)",
        "err_kernel_of_the_other_dialect",
    )


def _launch(func, args, kwargs, *, grid=(), target=None, simulation=False):
    """``(outputs, trace)`` of one run of ``func`` (either dialect) in the simulator."""
    own_launcher = getattr(func, "__simulate_trace__", None)
    if own_launcher is None:
        outputs, trace, _ = run(func, args, kwargs, grid=grid, target=target, simulation=simulation)
        return outputs, trace
    if grid:
        raise NKIValueError(
            f"an nki 0.6 kernel takes no SPMD grid {grid}: launch it on a logical core of "
            "two physical cores as kernel[2] instead",
            "err_grid_on_nki06_kernel",
        )
    return own_launcher(*args, target=target, **kwargs)


class _TileSizeMeta(type):
    @property
    def total_available_sbuf_size(cls) -> int:
        """Usable SBUF bytes per partition of the running kernel's target (the default
        target outside a kernel), as the compiler reports it for its compile target."""
        sdk.require("nl.tile_size.total_available_sbuf_size")
        ctx = active()
        return (ctx.target if ctx else TARGETS[DEFAULT_TARGET]).sbuf_bytes_per_partition


class tile_size(metaclass=_TileSizeMeta):  # noqa: N801 - the NKI name
    """``nl.tile_size``: architectural tile limits (PM "Tile size considerations")."""

    pmax = PMAX
    psum_fmax = 512
    gemm_stationary_fmax = 128
    gemm_moving_fmax = 512
    bn_stats_fmax = 512
    psum_min_align = 4
    sbuf_min_align = 1


# --- loop iterators --------------------------------------------------------------------------
def _loop_bounds(kind: str, args) -> tuple[int, ...]:
    """Loop bounds are compile-time integers: a bound read from a tensor is dynamic control
    flow, "currently not supported by NKI" (general/nki/api/nki.errors.rst@8a38e733 L285-294;
    the one run-time loop form is the do-while, L904-948)."""
    bounds = []
    for value in args:
        if isinstance(value, Tensor):
            raise NKITypeError(
                f"nl.{kind} bound `{value.name or 'tensor'}` is a tensor: dynamic control flow "
                "depending on tensor value is not supported (general/nki/api/nki.errors.rst"
                "@8a38e733 L285-294); a run-time loop is the do-while form (L904-948)",
                "err_dynamic_control_flow_not_supported",
            )
        try:
            bounds.append(operator.index(value))
        except TypeError:
            raise NKITypeError(
                f"nl.{kind} bounds are integers, got {value!r}", "err_loop_bound_not_integer"
            ) from None
    if len(bounds) == 3 and bounds[2] == 0:
        raise NKIValueError(f"nl.{kind} step must not be zero", "err_loop_bound_not_integer")
    return tuple(bounds)


def _loop(kind: str, args):
    bounds = _loop_bounds(kind, args)
    ctx = current(f"nl.{kind}")
    frame = LoopFrame(kind)
    ctx.loops.append(frame)
    try:
        for i in range(*bounds):
            frame.iteration = i
            yield i
    finally:
        frame.active = False
        ctx.loops.remove(frame)


def affine_range(*args, **kwargs):
    """``nl.affine_range([start,] stop[, step])``: iterations are independent (the compiler
    may reorder and pipeline them). Writing one element from two iterations is an error."""
    return _loop("affine_range", args)


def sequential_range(*args, **kwargs):
    """``nl.sequential_range(...)``: iterations run in order; loop-carried dependencies are
    allowed (``directives=`` are performance hints and ignored)."""
    return _loop("sequential_range", args)


def static_range(*args, **kwargs):
    """``nl.static_range(...)``: fully unrolled at trace time."""
    return _loop("static_range", args)


def check_writable(ctx: Context, storage) -> None:
    """Reject a write into a shared constant, or into a kernel input when the kernel uses the
    return convention and the input is not annotated ``nki.typing.mutable_tensor``."""
    if storage.kind == "constant":
        raise NKIValueError(
            f"cannot write into shared constant `{storage.name}`",
            "err_cannot_update_immutable_parameter",
        )
    if storage.kind == "param" and not storage.mutable and ctx.convention == "return":
        raise NKIValueError(
            f"Cannot update immutable parameter `{storage.name}`: inputs are immutable when the "
            "kernel returns its outputs; annotate it nki.typing.mutable_tensor and return it, "
            "or write into an nl.shared_hbm tensor",
            "err_cannot_update_immutable_parameter",
        )


def record_write(ctx: Context, tensor: Tensor, box, accumulate: bool) -> None:
    """The ``affine_range`` output-dependency check (``err_unexpected_output_dependencies``):
    a plain write to elements another iteration of the same affine loop already wrote.
    Accumulations (``+=``, PSUM matmul accumulation, DMA read-modify-write) are allowed."""
    if accumulate or box is None or not ctx.check_affine:
        return
    _record_program_write(ctx, tensor, box)
    for frame in ctx.loops:
        if frame.kind != "affine_range" or frame in tensor.loops:
            continue
        records = frame.writes.setdefault(tensor.storage.id, [])
        for iteration, other in records:
            if iteration != frame.iteration and _boxes_overlap(box, other):
                raise NKIValueError(
                    f"Unexpected output dependencies: iterations {iteration} and "
                    f"{frame.iteration} of an affine_range both write the same elements of "
                    f"`{tensor.name or 'tensor'}`; iterations must be independent: index the "
                    "write with the loop variable or use nl.sequential_range",
                    "err_unexpected_output_dependencies",
                )
        if not records or records[-1] != (frame.iteration, box):
            records.append((frame.iteration, box))


def _record_program_write(ctx: Context, tensor: Tensor, box) -> None:
    """Kernel instances of an SPMD grid run in parallel, so each must write its own part of
    a shared HBM tensor: "NKI assume kernel instances in the spmd grid and iteration between
    affine_range can be executed in parallel require synchronization on the output. As a
    result, each iteration of the loop will write to a different memory location"
    (general/nki/api/nki.errors.rst@8a38e733 L780-785). A write is compared with those of the
    instance launched before it (every instance writing one region is caught; the check stays
    linear in the writes)."""
    if len(ctx.grid) == 0 or int(np.prod(ctx.grid)) < 2:
        return
    if tensor.storage.kind not in ("shared_hbm", "param"):
        return
    record = ctx.program_writes.setdefault(tensor.storage.id, [None, [], ctx.program_id, []])
    if record[2] != ctx.program_id:  # the first write of the next instance
        record[:] = [record[2], record[3], ctx.program_id, []]
    previous, boxes = record[0], record[1]
    for other in boxes:
        if _boxes_overlap(box, other):
            raise NKIValueError(
                f"Unexpected output dependencies: SPMD instances {previous} and "
                f"{ctx.program_id} both write the same elements of "
                f"`{tensor.name or 'tensor'}`; the instances run in parallel, so each must "
                "write its own part (index the write with nl.program_id) "
                "(general/nki/api/nki.errors.rst@8a38e733 L780-785)",
                "err_unexpected_output_dependencies",
            )
    record[3].append(box)


def _boxes_overlap(a, b) -> bool:
    if a[0] != b[0]:  # different base layouts (reshaped views): no verdict
        return False
    for (lo1, hi1, st1), (lo2, hi2, st2) in zip(a[1], b[1], strict=True):
        if hi1 < lo2 or hi2 < lo1:
            return False
        if st1 == st2 and st1 > 1 and (lo1 - lo2) % st1:
            return False
    return True


# --- program ids -----------------------------------------------------------------------------
def program_id(axis: int) -> int:
    """``nl.program_id(axis)``: this instance's coordinate along a launch-grid axis."""
    ctx = current("nl.program_id")
    if not ctx.grid:
        return 0
    if not 0 <= axis < len(ctx.grid):
        raise NKIValueError(
            f"program_id axis {axis} outside a grid of rank {len(ctx.grid)}",
            "err_invalid_program_axis",
        )
    return ctx.program_id[axis]


def num_programs(axes=None) -> int:
    """``nl.num_programs(axes=None)``: grid size along ``axes`` (all axes when None)."""
    ctx = current("nl.num_programs")
    if not ctx.grid:
        return 1
    if axes is None:
        return int(np.prod(ctx.grid))
    if isinstance(axes, int):
        return ctx.grid[axes]
    return int(np.prod([ctx.grid[a] for a in axes]))


def program_ndim() -> int:
    """``nl.program_ndim()``: rank of the launch grid (0 without a grid)."""
    return len(current("nl.program_ndim").grid)


class spmd_dim(int):  # noqa: N801 - the NKI name
    """``nl.spmd_dim(a, b)``: a grid dimension of size ``a*b``, its index split over the
    factors with the first outermost (``factors`` keeps them for the core placement)."""

    def __new__(cls, *sizes):
        self = super().__new__(cls, int(np.prod([int(s) for s in sizes])))
        self.factors = sizes
        return self


class nc(int):  # noqa: N801 - the NKI name
    """``nl.nc(n)``: a logical-NeuronCore grid dimension of size n (Trn2 LNC=2);
    ``nl.nc(2) * 2`` is ``spmd_dim(nl.nc(2), 2)`` and ``2 * nl.nc(2)`` is
    ``spmd_dim(2, nl.nc(2))`` (general/nki/test/test_nki_spmd_grid.py@8a38e733, L52-65)."""

    def __mul__(self, other):
        return spmd_dim(self, other)

    def __rmul__(self, other):
        return spmd_dim(other, self)


def core_placement(grid, target):
    """How a legacy SPMD grid's instances map onto the two physical cores of a trn2/trn3
    logical core: a function of the program id, or None (all instances on one core, run one
    after another). Documented only for a grid dimension that is ``nl.nc(2)`` or an
    ``nl.spmd_dim`` with an ``nl.nc(2)`` factor: ``kernel[nl.nc(2), 2]`` puts ``kernel[0, *]``
    on core 0 and ``kernel[1, *]`` on core 1 (general/nki/api/nki/language/__init__.py
    @8a38e733, L72-91); ``spmd_dim(nl.nc(2), 2)`` puts instances 0-1 on core 0 and 2-3 on
    core 1, ``spmd_dim(2, nl.nc(2))`` the even ones on core 0 (test_nki_spmd_grid.py
    @8a38e733, L44-65). Without an ``nl.nc`` the compiler decides (same file, L77), which
    the simulator does not guess; NeuronCore-v2 has no logical cores of two."""
    if target.nc_version < 3:
        return None
    found = []
    for axis, size in enumerate(grid):
        factors = size.factors if isinstance(size, spmd_dim) else (size,)
        stride = 1
        for factor in reversed(factors):  # the last factor varies fastest
            if isinstance(factor, nc) and int(factor) == 2:
                found.append((axis, stride))
            stride *= int(factor)
    if len(found) != 1:
        return None
    axis, stride = found[0]
    return lambda program_id: (program_id[axis] // stride) % 2


# --- arguments -------------------------------------------------------------------------------
def returns_value(func) -> bool | None:
    """Whether ``func`` has a ``return <value>`` (the return convention), from its bytecode;
    None when it has no Python bytecode."""
    code = getattr(func, "__code__", None)
    if code is None:
        return None
    previous = None
    for ins in dis.get_instructions(code):
        if ins.opname == "RETURN_CONST" and ins.argval is not None:
            return True
        if ins.opname == "RETURN_VALUE" and not (
            previous is not None and previous.opname == "LOAD_CONST" and previous.argval is None
        ):
            return True
        previous = ins
    return False


def _annotations(func) -> dict:
    """Parameter annotations, evaluated when they are strings (``from __future__ import
    annotations``) and name something in the kernel's module."""
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return {}
    out = {}
    for name, param in params.items():
        ann = param.annotation
        if isinstance(ann, str):
            try:
                ann = eval(ann, getattr(func, "__globals__", {}))  # noqa: S307 - own source
            except Exception:  # noqa: BLE001 - an annotation the simulator does not know
                pass
        out[name] = ann
    return out


def _annotation_flags(func):
    flags = {}
    for name, ann in _annotations(func).items():
        flags[name] = ann if isinstance(ann, str) else getattr(ann, "__nki_annotation__", "")
    return flags


def _framework_to_numpy(value, argname: str):
    """A framework array (torch tensor, JAX array) as NumPy, or None for other objects."""
    module = type(value).__module__
    if module.startswith("torch"):
        import torch

        if not isinstance(value, torch.Tensor):
            return None
        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:
            return value.view(torch.int16).numpy().view(dt.bfloat16)
        return value.numpy()
    if module.startswith(("jax", "jaxlib")):
        return np.asarray(value)
    return None


def _looks_like_array(value) -> bool:
    return any(
        hasattr(value, a)
        for a in ("__array__", "__array_interface__", "__dlpack__", "__cuda_array_interface__")
    )


_CONSTANT_TYPES = (
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    type(None),
    np.generic,
    np.dtype,
    type,
    slice,
    range,
)


class _Arguments:
    """Converts kernel arguments to tensors and remembers how to hand results back."""

    def __init__(self, func, convention):
        self.flags = _annotation_flags(func)
        self.convention = convention
        self.params: list[Tensor] = []
        self.write_back: list[tuple[Tensor, object]] = []  # (tensor, caller's array)
        self.framework = None  # a framework argument, to convert results back

    def convert(self, value, argname, index, mutable=None):
        if mutable is None:
            mutable = "mutable_tensor" in self.flags.get(argname, "")
        if isinstance(value, Tensor):
            return value
        if isinstance(value, np.ndarray):
            return self._param(value, value, argname, index, mutable)
        spec = getattr(value, "__nki_argument_spec__", None)
        if spec is not None:  # a shape-and-dtype placeholder: an input of undefined values
            shape, dtype = spec
            dtype = dt.as_dtype(dtype, argname)
            array = dt.full(shape, dt.uninitialised(dtype), dtype)
            return self._param(array, array, argname, index, mutable)
        if isinstance(value, (list, tuple)) and not isinstance(value, str):
            items = [
                self.convert(v, f"{argname}[{i}]", (index, i), mutable) for i, v in enumerate(value)
            ]
            if all(a is b for a, b in zip(items, value)):
                return value
            return type(value)(items) if isinstance(value, list) else tuple(items)
        if isinstance(value, _CONSTANT_TYPES) or callable(value):
            return value
        array = _framework_to_numpy(value, argname)
        if array is not None:
            if self.framework is None:
                self.framework = value
            return self._param(array, value, argname, index, mutable)
        if _looks_like_array(value):
            raise NKITypeError(
                f"argument `{argname}` must be a NumPy array (or a torch / JAX array), got "
                f"{type(value).__module__}.{type(value).__name__}",
                "err_unsupported_argument",
            )
        return value  # any other object is a compile-time constant (e.g. a config object)

    def _param(self, array, original, argname, index, mutable) -> Tensor:
        try:
            dtype = dt.as_dtype(array.dtype, argname)
        except NKITypeError as exc:
            raise NKITypeError(
                f"argument `{argname}` has dtype {array.dtype}, which NeuronCores do not support "
                "(expected float32, bfloat16, float16, tfloat32, float8_e4m3, float8_e5m2, "
                "int8/16/32, uint8/16/32 or bool)",
                "err_unsupported_dtype",
            ) from exc
        contiguous = array.flags.c_contiguous
        hand_back = False
        if self.convention == "return" and not mutable and contiguous:
            data = array.view()
            data.flags.writeable = False  # inputs are immutable: no copy needed
        elif (
            self.convention == "output"
            and contiguous
            and array.flags.writeable
            and isinstance(original, np.ndarray)
        ):
            data = array  # output parameters are written in place
        else:
            data = np.array(array, order="C", copy=True)
            hand_back = self.convention != "return"
        storage = Storage("hbm", "param", argname)
        storage.param_index = index
        storage.mutable = mutable
        storage.array = data
        tensor = Tensor(data, dtype, storage)
        self.params.append(tensor)
        if hand_back:
            self.write_back.append((tensor, original))
        return tensor

    def hand_back(self) -> None:
        """Output-parameter convention: copy what the kernel wrote into arguments that could
        not be written in place (non-contiguous arrays, torch tensors)."""
        for tensor, original in self.write_back:
            if not tensor.storage.written:
                continue
            if isinstance(original, np.ndarray):
                original[...] = tensor.data
            elif type(original).__module__.startswith("torch"):
                import torch

                with torch.no_grad():
                    original.copy_(_from_numpy_torch(tensor.data).to(original.device))
            else:
                raise NKITypeError(
                    f"output parameter `{tensor.name}` is a {type(original).__name__}, which "
                    "cannot be written in place: return the output from the kernel instead",
                    "err_unsupported_argument",
                )


def run(
    func,
    args,
    kwargs,
    *,
    grid=(),
    target=None,
    check_affine=True,
    expected_outputs=None,
    simulation=False,
):
    """Run a kernel in the simulator. Returns ``(result, trace, params)`` where ``result`` is
    the kernel's return value converted to NumPy (None in the output-parameter convention,
    where the kernel has written the caller's arrays). ``expected_outputs=k`` says the last
    ``k`` array parameters are outputs that must be written (bindings pass it).
    ``simulation``: a legacy ``nki.jit(mode="simulation")`` kernel (see :func:`_finish`)."""
    if _context.get() is not None:
        raise NKIRuntimeError(
            "a kernel cannot launch another kernel with a grid", "err_nested_kernel_with_spmd_grid"
        )
    check_legacy_kernel(func)
    annotated = (grid if isinstance(grid, tuple) else (grid,)) if grid else ()
    grid = tuple(int(g) for g in annotated)
    returns = returns_value(func)
    convention = None if returns is None else ("return" if returns else "output")
    if convention is not None:
        sdk.require_convention(convention)
    arguments = _Arguments(func, convention)
    try:
        names = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        names = []
    positional = [
        arguments.convert(value, names[i] if i < len(names) else f"arg{i}", i)
        for i, value in enumerate(args)
    ]
    keywords = {k: arguments.convert(v, k, k) for k, v in kwargs.items()}
    _check_annotations(func, positional, keywords)
    func = scoping.prepare(func, _SCOPE_HOOKS)
    ctx = Context(target, getattr(func, "__code__", None))
    ctx.check_affine = check_affine
    ctx.grid = grid
    ctx.convention = convention
    core_of = core_placement(annotated, ctx.target)
    if core_of is not None:
        ctx.trace.lnc = 2
    token = _context.set(ctx)
    try:
        result = None
        for pid in itertools.product(*map(range, grid)) if grid else [()]:
            ctx.program_id = pid
            ctx.core = 0 if core_of is None else core_of(pid)
            ctx.shared_hbm_cursor = 0
            result = func(*positional, **keywords)
        ctx.check_capacity()
        if ctx.allocated:
            returned = {id(t.storage) for t in _flat_tensors(result)}
            rules.check_allocated_hbm(
                ctx.private_hbm_names,
                [t.name or "tensor" for t in ctx.shared_hbm if id(t.storage) not in returned],
            )
        outputs = _finish(result, arguments.params, expected_outputs, simulation)
    finally:
        _context.reset(token)
        _finished.trace = ctx.trace
    if outputs is None:
        arguments.hand_back()
    outputs = _restore_framework(outputs, arguments.framework)
    return outputs, ctx.trace, arguments.params


def _flat_tensors(result):
    if isinstance(result, Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [t for item in result for t in _flat_tensors(item)]
    return []


def _finish(result, params, expected_outputs, simulation=False):
    """Apply the calling-convention checks and convert the result to NumPy.

    A compiled kernel returns HBM tensors only: "We currently do not support using tensors
    stored in SBUF or PSUM as the input or output of the top-level kernel"
    (aws-neuron-sdk@8a38e733 general/nki/nki_known_issues.rst L11-15). A
    ``mode="simulation"`` kernel, which only the compiler's built-in CPU simulator runs
    (general/nki/api/nki/__init__.py L368-378, L463-467), may also hand back an SBUF/PSUM
    tile, as AWS's own examples do (general/nki/test/test_nki_isa_range_select.py L19-55,
    test_nki_isa_dma_transpose.py L24-38)."""
    if result is None:
        outputs = [p for p in params if isinstance(p.storage.param_index, int)]
        if expected_outputs:
            for tensor in outputs[-expected_outputs:]:
                _check_written(tensor)
        elif params and not any(p.storage.written for p in params):
            raise NKIValueError(
                "the kernel returned nothing and wrote none of its parameters: an output "
                "parameter must be written (or return the outputs)",
                "err_tensor_output_not_written_to",
            )
        return None
    returned = result if isinstance(result, (tuple, list)) else (result,)
    returned_storages = set()
    for item in returned:
        if isinstance(item, Tensor) and item.on_chip and simulation:
            continue  # an on-chip tile a simulation-mode kernel hands back
        if not isinstance(item, Tensor) or item.on_chip:
            raise NKITypeError(
                "a compiled kernel returns HBM tensors (nl.ndarray(..., buffer=nl.shared_hbm)),"
                " not SBUF/PSUM tiles (aws-neuron-sdk@8a38e733 general/nki/nki_known_issues.rst"
                f' L11-15; only a mode="simulation" kernel may); got {item!r}',
                "err_top_level_tensor_must_be_hbm",
            )
        _check_written(item)
        returned_storages.add(item.storage.id)
    for tensor in params:
        if tensor.storage.written and tensor.storage.kind == "param":
            if not tensor.storage.mutable:
                raise NKIValueError(
                    f"Cannot update immutable parameter `{tensor.name}`: inputs are immutable "
                    "when the kernel returns its outputs; annotate it "
                    "nki.typing.mutable_tensor and return it, or write into an nl.shared_hbm "
                    "tensor",
                    "err_cannot_update_immutable_parameter",
                )
            if tensor.storage.id not in returned_storages:
                raise NKIValueError(
                    f"Mutable kernel parameter `{tensor.name}` is written but "
                    "not returned by the kernel",
                    "err_mutable_parameter_not_returned",
                )
    arrays = [_result_array(item) for item in returned]
    return tuple(arrays) if isinstance(result, (tuple, list)) else arrays[0]


def _result_array(tensor: Tensor) -> np.ndarray:
    data = tensor.data
    if data is tensor.storage.array and data.flags.writeable and tensor.storage.kind != "param":
        return data  # the run is over: the kernel's output buffer is the caller's now
    return np.array(data, copy=True)


def _check_written(tensor: Tensor) -> None:
    if not tensor.storage.written:
        raise NKIValueError(
            f"output tensor `{tensor.name}` is never written by the kernel",
            "err_tensor_output_not_written_to",
        )


def _check_annotations(func, positional, keywords) -> None:
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return
    try:
        bound = signature.bind(*positional, **keywords)
    except TypeError as exc:
        raise NKITypeError(
            f"kernel arguments do not match its signature: {exc}", "err_kernel_signature"
        ) from exc
    annotations = _annotations(func)
    for name in signature.parameters:
        shape = getattr(annotations.get(name), "__nki_shape__", None)
        value = bound.arguments.get(name)
        if shape is not None and isinstance(value, Tensor) and tuple(value.shape) != shape:
            raise NKIValueError(
                f"argument `{name}` has shape {value.shape}, the annotation says {shape}",
                "err_annotation_shape_mismatch",
            )


def _restore_framework(outputs, sample):
    """Return framework arrays when the kernel was called with them (torch / JAX)."""
    if outputs is None or sample is None:
        return outputs
    module = type(sample).__module__
    convert = _from_numpy_torch if module.startswith("torch") else _from_numpy_jax
    if isinstance(outputs, tuple):
        return tuple(convert(o) for o in outputs)
    return convert(outputs)


def _from_numpy_torch(array):
    import torch

    if array.dtype == dt.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(array).view(np.int16).copy()).view(
            torch.bfloat16
        )
    return torch.from_numpy(np.array(array, copy=True))


def _from_numpy_jax(array):
    import jax.numpy as jnp

    return jnp.asarray(array)


# --- entry points ----------------------------------------------------------------------------
class Kernel:
    """A kernel wrapped by ``nki.jit`` (or ``baremetal`` / ``benchmark``)."""

    def __init__(self, func, mode="auto", grid=(), **options):
        if mode not in MODES:
            raise NKIValueError(
                f"mode={mode!r} is not one of {', '.join(MODES)}", "err_unsupported_mode"
            )
        functools.update_wrapper(self, func)
        self.func = func
        self.mode = mode
        self.grid = grid
        self.options = options
        self._finished = threading.local()  # per thread: .trace and .benchmark_result

    @property
    def last_trace(self) -> Trace | None:
        """The trace of this kernel's most recent run on the calling thread."""
        return getattr(self._finished, "trace", None)

    @property
    def benchmark_result(self):
        """``nki.benchmark`` result of this kernel's most recent run on the calling thread."""
        return getattr(self._finished, "benchmark_result", None)

    def __getitem__(self, grid):
        if active() is not None:
            raise NKIRuntimeError(
                "Calling a kernel with a SPMD grid from another NKI kernel is not supported",
                "err_nested_kernel_with_spmd_grid",
            )
        return Kernel(
            self.func, self.mode, grid if isinstance(grid, tuple) else (grid,), **self.options
        )

    def __call__(self, *args, **kwargs):
        if active() is not None:  # a sub-kernel (mode="trace") inlined into its caller
            return self.func(*args, **kwargs)
        target = self.options.get("platform_target")
        if jax_calls.is_traced(args, kwargs):  # one operation of the XLA program
            return jax_calls.call_traced(
                lambda a, k: _launch(self.func, a, k, grid=self.grid, target=target)[0],
                args,
                kwargs,
                self.func.__name__,
            )
        outputs, trace = _launch(
            self.func,
            args,
            kwargs,
            grid=self.grid,
            target=target,
            simulation=self.mode == "simulation",
        )
        self._finished.trace = trace
        if self.mode == "benchmark":
            if _benchmark_reporter is None:
                raise NKIRuntimeError(
                    "nki.benchmark needs the cost model: import simulate",
                    "err_benchmark_without_cost_model",
                )
            self._finished.benchmark_result = _benchmark_reporter(trace)
        return outputs

    def __repr__(self):
        return f"<nki kernel {self.func.__name__} mode={self.mode} grid={self.grid}>"


def jit(func=None, mode="auto", **options):
    """``nki.jit``: compile a kernel (here: prepare it for the simulator).

    Usable bare (``@nki.jit``), with arguments (``@nki.jit(mode="simulation")``), or as
    ``nki.jit(f, mode=...)``. Every mode runs in the simulator when the Neuron compiler is not
    installed; ``platform_target=`` picks the target whose limits are checked.
    """
    if func is None:
        return lambda f: jit(f, mode=mode, **options)
    if isinstance(func, Kernel):
        options = {**func.options, **options}
        func = func.func
    return Kernel(func, mode, **options)


def trace(func=None, **options):
    """``nki.trace``: the legacy decorator of a kernel that other kernels call or
    ``nki.simulate_kernel`` runs. The legacy API reference does not list it; the errors
    manual (aws-neuron-sdk@8a38e733 general/nki/api/nki.errors.rst L524-535) and AWS's
    own examples (general/nki/test/test_nki_isa_partition_reduce.py L14,
    test_psum_modulo_alloc.py L44) use it, so it is :func:`jit`."""
    return jit(func, **options)


def _unwrap(kernel):
    if isinstance(kernel, Kernel):
        return kernel.func, kernel.grid, kernel.options.get("platform_target")
    return kernel, (), None


def simulate_kernel(kernel, *args, **kwargs):
    """``nki.simulate_kernel(kernel, *args, **kwargs)``: run on the CPU, return NumPy outputs
    (None for an output-parameter kernel, whose output arrays are written in place)."""
    func, grid, target = _unwrap(kernel)
    return _launch(func, args, kwargs, grid=grid, target=target)[0]


def baremetal(kernel=None, **options):
    """``nki.baremetal``: on hardware, compile to a NEFF and run it; here, simulate."""
    if kernel is None:
        return lambda f: baremetal(f, **options)
    return jit(kernel, mode="baremetal", **options)


def benchmark(kernel=None, warmup=10, iters=100, **options):
    """``nki.benchmark``: run once in the simulator and fill ``benchmark_result.nc_latency``
    from the cost model (modeled microseconds, not a device measurement)."""
    if kernel is None:
        return lambda f: benchmark(f, warmup=warmup, iters=iters, **options)
    return jit(kernel, mode="benchmark", warmup=warmup, iters=iters, **options)


def trace_kernel(kernel, *args, target=None, grid=None, **kwargs):
    """Run a kernel and return ``(outputs, trace)`` (outputs as :func:`simulate_kernel`).
    ``kernel`` is of either dialect: an ``nki`` 0.6 kernel (``kernel[2]`` included) runs on its
    own front-end, on ``target`` or else the one ``NEURON_PLATFORM_TARGET_OVERRIDE`` names."""
    func, kernel_grid, kernel_target = _unwrap(kernel)
    return _launch(
        func,
        args,
        kwargs,
        grid=kernel_grid if grid is None else grid,
        target=target or kernel_target,
    )
