"""Kernel execution: the per-run context, loop iterators, SPMD grids, both calling
conventions, and the entry points ``nki.jit`` / ``simulate_kernel`` / ``baremetal`` /
``benchmark``.

Kernels run eagerly in Python (loop bodies execute concretely, like ``static_range``);
every NKI call appends the instructions it would issue to the context's trace.
"""

from __future__ import annotations

import functools
import inspect
import itertools

import numpy as np

from . import dtypes as dt
from .errors import NKIRuntimeError, NKITypeError, NKIValueError
from .memory import PartitionAllocator, Storage
from .targets import PSUM_BANK_BYTES, get_target
from .tensor import Tensor
from .trace import Trace

_context = None


class LoopFrame:
    """One running ``affine_range`` / ``sequential_range`` / ``static_range`` loop."""

    _ids = itertools.count(1)

    def __init__(self, kind: str):
        self.id = next(self._ids)
        self.kind = kind
        self.iteration = 0
        self.writes: dict[int, list] = {}  # storage id -> [(iteration, box)] (affine checker)


class Context:
    """State of one kernel run: target, trace, allocators, loops and SPMD position."""

    def __init__(self, target, kernel_code=None):
        self.target = get_target(target)
        self.trace = Trace(self.target.name)
        self.sbuf = PartitionAllocator("sbuf", self.target.sbuf_bytes_per_partition, 4,
                                       self.trace, "sbuf_peak_bytes_per_partition")
        self.psum = PartitionAllocator("psum", self.target.psum_bytes_per_partition,
                                       PSUM_BANK_BYTES, self.trace,
                                       "psum_peak_bytes_per_partition")
        self.loops: list[LoopFrame] = []
        self.program_id: tuple[int, ...] = ()
        self.grid: tuple[int, ...] = ()
        self.shared_hbm: list[Tensor] = []
        self.shared_hbm_cursor = 0
        self.kernel_code = kernel_code
        self.check_affine = True
        self.print_enabled = True
        self.act_accumulator = None  # the Scalar engine's per-partition reduce register

    def loops_key(self):
        return tuple((f.id, f.kind, f.iteration) for f in self.loops)


def current(api: str = "this API") -> Context:
    """The running kernel's context; NKI APIs outside a kernel are an error."""
    if _context is None:
        raise NKIRuntimeError(f"{api} can only be called inside an NKI kernel",
                              "err_nki_api_outside_of_nki_kernel")
    return _context


def active() -> Context | None:
    return _context


# --- loop iterators --------------------------------------------------------------------------
def _loop(kind: str, args):
    ctx = current(f"nl.{kind}")
    frame = LoopFrame(kind)
    ctx.loops.append(frame)
    try:
        for i in range(*args):
            frame.iteration = i
            yield i
    finally:
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


def record_write(ctx: Context, tensor: Tensor, box, accumulate: bool) -> None:
    """The ``affine_range`` output-dependency check (``err_unexpected_output_dependencies``):
    a plain write to elements another iteration of the same affine loop already wrote."""
    if accumulate or not ctx.check_affine:
        return
    for frame in ctx.loops:
        if frame.kind != "affine_range" or frame in tensor.loops:
            continue
        records = frame.writes.setdefault(tensor.storage.id, [])
        for iteration, other in records:
            if iteration != frame.iteration and _boxes_overlap(box, other):
                raise NKIValueError(
                    f"iterations {iteration} and {frame.iteration} of an affine_range both "
                    f"write the same elements of `{tensor.name or 'tensor'}`: iterations must "
                    "be independent; index the write with the loop variable or use "
                    "nl.sequential_range", "err_unexpected_output_dependencies")
        records.append((frame.iteration, box))


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
        raise NKIValueError(f"program_id axis {axis} outside a grid of rank {len(ctx.grid)}",
                            "err_invalid_program_axis")
    return ctx.program_id[axis]


def num_programs(axes=None) -> int:
    """``nl.num_programs(axes=None)``: grid size along ``axes`` (all axes when None)."""
    ctx = current("nl.num_programs")
    if axes is None:
        return int(np.prod(ctx.grid)) if ctx.grid else 1
    if isinstance(axes, int):
        return ctx.grid[axes] if ctx.grid else 1
    return int(np.prod([ctx.grid[a] for a in axes])) if ctx.grid else 1


def program_ndim() -> int:
    """``nl.program_ndim()``: rank of the launch grid (0 without a grid)."""
    return len(current("nl.program_ndim").grid)


class spmd_dim(int):  # noqa: N801 - the NKI name
    """``nl.spmd_dim(a, b)``: a grid dimension of size ``a*b`` (core placement is a hint)."""

    def __new__(cls, *sizes):
        return super().__new__(cls, int(np.prod([int(s) for s in sizes])))


class nc(int):  # noqa: N801 - the NKI name
    """``nl.nc(n)``: a logical-NeuronCore grid dimension of size n (Trn2 LNC=2)."""

    def __mul__(self, other):
        return spmd_dim(self, other)

    __rmul__ = __mul__


# --- launching -------------------------------------------------------------------------------
def _annotation_flags(func):
    flags = {}
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return flags
    for name, param in params.items():
        ann = param.annotation
        text = ann if isinstance(ann, str) else getattr(ann, "__nki_annotation__", "")
        flags[name] = text
    return flags


def _to_numpy(value, argname: str):
    """Convert a framework array to NumPy (torch CPU tensors, JAX arrays)."""
    module = type(value).__module__
    if module.startswith("torch"):
        import torch

        if value.dtype == torch.bfloat16:
            return value.detach().cpu().view(torch.int16).numpy().view(dt.bfloat16)
        return value.detach().cpu().numpy()
    if module.startswith(("jax", "jaxlib")):
        return np.asarray(value)
    raise NKITypeError(f"argument `{argname}` must be a NumPy array or a Python constant, got "
                       f"{type(value).__name__}", "err_unsupported_argument")


def _param_tensor(array: np.ndarray, argname: str, index: int, mutable: bool) -> Tensor:
    try:
        dtype = dt.as_dtype(array.dtype, argname)
    except NKITypeError as exc:
        raise NKITypeError(
            f"argument `{argname}` has dtype {array.dtype}, which NeuronCores do not support "
            "(expected float32, bfloat16, float16, tfloat32, float8_e4m3, float8_e5m2, int8/16/32,"
            " uint8/16/32 or bool)", "err_unsupported_dtype") from exc
    storage = Storage("hbm", "param", argname)
    storage.param_index = index
    storage.mutable = mutable
    return Tensor(np.array(array, dtype=array.dtype, order="C", copy=True), dtype, storage)


_CONSTANT_TYPES = (bool, int, float, str, type(None), np.generic, np.dtype, type)


def _convert_argument(value, argname, index, flags, converted_from_framework):
    if isinstance(value, np.ndarray):
        return _param_tensor(value, argname, index, "mutable_tensor" in flags.get(argname, ""))
    if isinstance(value, Tensor):
        return value
    if isinstance(value, _CONSTANT_TYPES) or callable(value):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, _CONSTANT_TYPES) for v in value):
        return value
    array = _to_numpy(value, argname)
    converted_from_framework.append(index)
    return _param_tensor(array, argname, index, "mutable_tensor" in flags.get(argname, ""))


def run(func, args, kwargs, *, grid=(), target=None, check_affine=True, expected_outputs=None):
    """Run a kernel in the simulator. Returns ``(result, trace, params)`` where ``result`` is
    the kernel's return value converted to NumPy (None in the output-parameter convention)."""
    global _context
    if _context is not None:
        raise NKIRuntimeError("a kernel cannot launch another kernel with a grid",
                              "err_nested_kernel_with_spmd_grid")
    grid = tuple(int(g) for g in (grid if isinstance(grid, tuple) else (grid,))) if grid else ()
    flags = _annotation_flags(func)
    try:
        names = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        names = []
    positional = []
    framework = []
    for i, value in enumerate(args):
        argname = names[i] if i < len(names) else f"arg{i}"
        positional.append(_convert_argument(value, argname, i, flags, framework))
    keywords = {k: _convert_argument(v, k, k, flags, framework) for k, v in kwargs.items()}
    _check_annotations(func, positional, keywords)
    ctx = Context(target, getattr(func, "__code__", None))
    ctx.check_affine = check_affine
    ctx.grid = grid
    _context = ctx
    try:
        result = None
        for pid in itertools.product(*map(range, grid)) if grid else [()]:
            ctx.program_id = pid
            ctx.shared_hbm_cursor = 0
            result = func(*positional, **keywords)
        params = [p for p in list(positional) + list(keywords.values()) if isinstance(p, Tensor)]
        outputs = _finish(result, params, expected_outputs)
    finally:
        _context = None
    return outputs, ctx.trace, params


def _finish(result, params, expected_outputs):
    """Apply the calling-convention checks and convert the result to NumPy."""
    if result is None:
        if expected_outputs:
            for tensor in params[-expected_outputs:]:
                _check_written(tensor)
        return None
    returned = result if isinstance(result, (tuple, list)) else (result,)
    returned_storages = set()
    for item in returned:
        if not isinstance(item, Tensor) or item.on_chip:
            raise NKITypeError(
                "a kernel returns HBM tensors (nl.ndarray(..., buffer=nl.shared_hbm)); "
                f"got {item!r}", "err_top_level_tensor_must_be_hbm")
        _check_written(item)
        returned_storages.add(item.storage.id)
    for tensor in params:
        if tensor.storage.written and tensor.storage.kind == "param":
            if not tensor.storage.mutable:
                raise NKIValueError(
                    f"kernel input `{tensor.name}` is written but inputs are immutable when the "
                    "kernel returns its outputs; annotate it nki.typing.mutable_tensor and return"
                    " it, or write into an nl.shared_hbm tensor",
                    "err_cannot_update_immutable_parameter")
            if tensor.storage.id not in returned_storages:
                raise NKIValueError(f"mutable parameter `{tensor.name}` is written but not "
                                    "returned", "err_mutable_parameter_not_returned")
    arrays = [np.array(item.data, copy=True) for item in returned]
    return tuple(arrays) if isinstance(result, (tuple, list)) else arrays[0]


def _check_written(tensor: Tensor) -> None:
    if not tensor.storage.written:
        raise NKIValueError(f"output tensor `{tensor.name}` is never written by the kernel",
                            "err_tensor_output_not_written_to")


def _check_annotations(func, positional, keywords) -> None:
    try:
        bound = inspect.signature(func).bind_partial(*positional, **keywords)
    except TypeError as exc:
        raise NKITypeError(f"kernel arguments do not match its signature: {exc}",
                           "err_kernel_signature") from exc
    for name, param in inspect.signature(func).parameters.items():
        shape = getattr(param.annotation, "__nki_shape__", None)
        value = bound.arguments.get(name)
        if shape is not None and isinstance(value, Tensor) and tuple(value.shape) != shape:
            raise NKIValueError(f"argument `{name}` has shape {value.shape}, the annotation "
                                f"says {shape}", "err_annotation_shape_mismatch")


def _write_back(args, params) -> None:
    """Output-parameter convention: copy what the kernel stored into the caller's arrays."""
    by_index = {p.storage.param_index: p for p in params if p.storage.kind == "param"}
    for i, value in enumerate(args):
        tensor = by_index.get(i)
        if isinstance(value, np.ndarray) and tensor is not None and tensor.storage.written:
            value[...] = tensor.data


class Kernel:
    """A kernel wrapped by ``nki.jit`` (or ``baremetal`` / ``benchmark``)."""

    def __init__(self, func, mode="auto", grid=(), **options):
        functools.update_wrapper(self, func)
        self.func = func
        self.mode = mode
        self.grid = grid
        self.options = options
        self.benchmark_result = None

    def __getitem__(self, grid):
        if active() is not None:
            raise NKIRuntimeError("a kernel with a launch grid cannot be called from a kernel",
                                  "err_nested_kernel_with_spmd_grid")
        return Kernel(self.func, self.mode, grid if isinstance(grid, tuple) else (grid,),
                      **self.options)

    def __call__(self, *args, **kwargs):
        if active() is not None:  # a sub-kernel (mode="trace") inlined into its caller
            return self.func(*args, **kwargs)
        target = self.options.get("platform_target")
        outputs, trace, params = run(self.func, args, kwargs, grid=self.grid, target=target)
        self.last_trace = trace
        if self.mode == "benchmark":
            from .profiler import benchmark_result_from_trace

            self.benchmark_result = benchmark_result_from_trace(trace)
        if outputs is None:
            _write_back(args, params)
        return _restore_framework(outputs, args)


def _restore_framework(outputs, args):
    """Return framework arrays when the kernel was called with them (torch / JAX)."""
    if outputs is None:
        return None
    sample = next((a for a in args if not isinstance(a, (np.ndarray, *_CONSTANT_TYPES))), None)
    if sample is None:
        return outputs
    module = type(sample).__module__
    convert = _from_numpy_torch if module.startswith("torch") else _from_numpy_jax
    if isinstance(outputs, tuple):
        return tuple(convert(o) for o in outputs)
    return convert(outputs)


def _from_numpy_torch(array):
    import torch

    if array.dtype == dt.bfloat16:
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


def _from_numpy_jax(array):
    import jax.numpy as jnp

    return jnp.asarray(array)


def jit(func=None, mode="auto", **options):
    """``nki.jit``: compile a kernel (here: prepare it for the simulator).

    Usable bare (``@nki.jit``), with arguments (``@nki.jit(mode="simulation")``), or as
    ``nki.jit(f, mode=...)``. Every mode runs in the simulator when the Neuron compiler is not
    installed; ``platform_target=`` picks the target whose limits are checked.
    """
    if func is None:
        return lambda f: jit(f, mode=mode, **options)
    if isinstance(func, Kernel):
        func = func.func
    return Kernel(func, mode, **options)


def simulate_kernel(kernel, *args, **kwargs):
    """``nki.simulate_kernel(kernel, *args, **kwargs)``: run on the CPU, return NumPy outputs."""
    func = kernel.func if isinstance(kernel, Kernel) else kernel
    grid = kernel.grid if isinstance(kernel, Kernel) else ()
    target = kernel.options.get("platform_target") if isinstance(kernel, Kernel) else None
    outputs, _, params = run(func, args, kwargs, grid=grid, target=target)
    if outputs is None:
        _write_back(args, params)
    return outputs


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
    return jit(kernel, mode="benchmark", **options)


def trace_kernel(kernel, *args, target=None, grid=None, **kwargs):
    """Run a kernel and return ``(outputs, trace)`` (outputs as :func:`simulate_kernel`)."""
    func = kernel.func if isinstance(kernel, Kernel) else kernel
    grid = grid if grid is not None else (kernel.grid if isinstance(kernel, Kernel) else ())
    if target is None and isinstance(kernel, Kernel):
        target = kernel.options.get("platform_target")
    outputs, trace, params = run(func, args, kwargs, grid=grid, target=target)
    if outputs is None:
        _write_back(args, params)
    return outputs, trace
