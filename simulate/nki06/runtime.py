"""Launching ``nki`` 0.6 kernels: ``nki.jit``, ``kernel[lnc]``, ``nki.simulate``.

How a launch runs (SIM "How It Works", ``nki/guides/nki_simulator.rst@81ce03ae``): array
arguments become HBM tensors (``nl.hbm``; ``nl.shared_hbm`` under LNC=2), everything else
passes through; the body runs eagerly as Python in program order; returned tensors come back
as NumPy arrays and written input tensors are copied back into the caller's arrays.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
import warnings

import numpy as np

from simulate.core import jax_calls
from simulate.core import runtime as core_runtime

from . import classes, context, language_check
from . import dtypes as dt
from .errors import NkiRuntimeError, NkiTypeError, NkiValueError
from .tensor import Buffer, MemoryRegion, NkiTensor

JOIN_TIMEOUT_S = context.RENDEZVOUS_TIMEOUT_S
_last = threading.local()


def last_trace():
    """The instruction trace of this thread's most recent launch."""
    return getattr(_last, "trace", None)


class Kernel:
    """A ``@nki.jit`` kernel; ``kernel[n]`` launches it on a logical core of n physical
    cores (n in {1, 2}, STUB-NKI ``Kernel.__getitem__``)."""

    def __init__(self, func, lnc=None):
        while isinstance(func, Kernel):  # nested decorators unwrap (RN 0.2)
            func = func.func
        self.func = func
        self.lnc = lnc
        functools.update_wrapper(self, func)

    def __getitem__(self, lnc) -> Kernel:
        if isinstance(lnc, tuple) or isinstance(lnc, bool) or not isinstance(lnc, int):
            raise NkiValueError(
                f"kernel[{lnc!r}]: the launch bracket holds one int, the LNC "
                "degree (1 or 2); multi-dimensional SPMD grids are not NKI 0.6"
            )
        if lnc not in (1, 2):
            raise NkiValueError(f"kernel[{lnc}]: the LNC degree must be 1 or 2")
        return Kernel(self.func, lnc)

    def _inline(self, args, kwargs):
        """A jitted kernel called from inside a kernel runs as part of its caller, like any
        sub-kernel. The migration guide asks for the decorator to come off sub-kernels ("you
        will see an error about classes needing to inherit from ``nl.NKIObject``",
        aws-neuron-sdk@81ce03ae nki/migration/index.rst L1152-1165), but AWS's own kernels
        keep it: the ``moe_cte`` entry (``@nki.jit(mode="trace")``) calls the jitted
        ``bwmm_shard_on_block`` and ``blockwise_mm_baseline_shard_intermediate``
        (aws-neuron/nki-library@d2ad3a5 core/moe/moe_cte/moe_cte.py L252, L351, L380;
        bwmm_shard_on_block.py L71; bwmm_shard_on_I.py L86), and AWS's harness drives that
        entry (test/integration/nkilib/core/moe/moe_cte/test_moe_cte_unified.py L80-86).
        A bracket on the inner call (``sub[2](...)``) would relaunch: it stays an error."""
        if self.lnc is not None:
            raise NkiRuntimeError(
                f"@nki.jit kernel `{self.func.__name__}[{self.lnc}]` launched from inside a "
                "kernel: a sub-kernel runs on its caller's cores, without a launch bracket"
            )
        return self.func(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        if context.active() is not None:
            return self._inline(args, kwargs)
        if not args and not kwargs:
            raise NkiTypeError(f"kernel `{self.func.__name__}` called with no arguments")
        if jax_calls.is_traced(args, kwargs):  # one operation of the XLA program
            return jax_calls.call_traced(
                lambda a, k: launch(self.func, a, k, self.lnc), args, kwargs, self.func.__name__
            )
        return launch(self.func, args, kwargs, self.lnc)

    def __simulate_trace__(self, *args, target=None, **kwargs):
        """``(outputs, trace)`` of one launch on ``target`` (default: the environment's):
        what ``simulate.profile`` models, for kernels of either dialect."""
        outputs = launch(self.func, args, kwargs, self.lnc, target=target)
        return outputs, last_trace()

    def with_schedule(self, edges) -> Kernel:
        for edge in edges:
            if not isinstance(edge, tuple) or len(edge) != 2:
                raise NkiTypeError(
                    f"with_schedule edges are (consumer, producer(s)) pairs, got {edge!r}"
                )
        return self

    def __repr__(self):
        return f"nki.jit({self.func.__name__})" + (f"[{self.lnc}]" if self.lnc else "")


#: ``nki.jit`` keywords that only steer the real compiler's diagnostics, accepted and ignored
#: as AWS's kernels pass them (aws-neuron/nki-library@d2ad3a5
#: ``src/nkilib_src/nkilib/core/qkv/qkv.py`` L38–43).
COMPILER_KEYWORDS = frozenset({"debug_kernel", "show_compiler_tb", "experimental_flags"})


def jit(fn=None, **kwargs):
    """``@nki.jit`` / ``@nki.jit()``: ``mode=`` is ignored with a warning, the compiler's
    diagnostic keywords (:data:`COMPILER_KEYWORDS`) are ignored, ``platform_target=`` and
    other keywords raise ``TypeError`` (MIG 0.2->0.3; target via
    ``NEURON_PLATFORM_TARGET_OVERRIDE``)."""
    for key in kwargs:
        if key in COMPILER_KEYWORDS:
            continue
        if key == "mode":
            warnings.warn(
                "nki.jit(mode=...) is deprecated and ignored: the framework is "
                "detected from the argument types",
                DeprecationWarning,
                stacklevel=2,
            )
        elif key == "platform_target":
            raise NkiTypeError(
                "nki.jit(platform_target=...) was removed in NKI 0.3: set "
                "NEURON_PLATFORM_TARGET_OVERRIDE instead"
            )
        else:
            raise NkiTypeError(f"nki.jit() got an unexpected keyword argument '{key}'")
    if fn is None:
        return Kernel
    return Kernel(fn)


def simulate(kernel):
    """``nki.simulate(kernel)(*args)``: run a (jit or plain) kernel on the simulator;
    ``nki.simulate(kernel[2])`` runs LNC=2."""
    kernel = kernel if isinstance(kernel, Kernel) else Kernel(kernel)

    @functools.wraps(kernel.func)
    def run(*args, **kwargs):
        return kernel(*args, **kwargs)

    return run


# --- arguments --------------------------------------------------------------------------------
def _to_numpy(value):
    module = type(value).__module__
    if module.startswith("torch"):
        import torch

        tensor = value.detach().cpu()
        if tensor.dtype == torch.bfloat16:
            return tensor.view(torch.int16).numpy().view(dt.bfloat16.numpy), "torch"
        return tensor.numpy(), "torch"
    if isinstance(value, np.ndarray):
        return value, "numpy"
    return np.asarray(value), "other"


def _is_array(value) -> bool:
    if isinstance(value, type):  # e.g. the class np.float32: a (rejected) dtype, not an array
        return False
    return isinstance(value, np.ndarray) or (
        hasattr(value, "shape")
        and hasattr(value, "dtype")
        and hasattr(value, "__array__")
        and not isinstance(value, (NkiTensor, np.generic))
    )


class _Param:
    def __init__(self, original, array, kind, tensor):
        self.original, self.array, self.kind, self.tensor = original, array, kind, tensor


def _convert(value, argname, region, params):
    if isinstance(value, list):
        raise NkiTypeError(
            f"kernel argument `{argname}` is a list: pass a tuple (list arguments "
            "are rejected since NKI 0.3)"
        )
    if not _is_array(value):
        return value
    array, kind = _to_numpy(value)
    dtype = dt.as_dtype(array.dtype, argname)
    shape = array.shape if array.ndim else (1,)
    storage = Buffer(region, argname, dtype, 1, int(np.prod(shape)), None)
    storage.param_index = argname
    tensor = NkiTensor(shape, dtype, storage, region, argname)
    tensor.array()[...] = dt.cast(array.reshape(shape), dtype, storage.array.dtype)
    storage.written = False
    params.append(_Param(value, array, kind, tensor))
    return tensor


def _check_annotations(func, bound) -> None:
    from .typing import TensorAnnotation

    try:  # string annotations (``from __future__ import annotations``) are evaluated
        annotations = inspect.get_annotations(func, eval_str=True)
    except Exception:  # noqa: BLE001 - an annotation the kernel's module cannot evaluate
        annotations = {}
    for name, annotation in annotations.items():
        value = bound.get(name)
        if (
            isinstance(annotation, TensorAnnotation)
            and annotation.shape is not None
            and (isinstance(value, NkiTensor))
            and tuple(value.shape) != annotation.shape
        ):
            raise NkiValueError(
                f"argument `{name}` has shape {tuple(value.shape)}, the kernel "
                f"declares nt.tensor{list(annotation.shape)}"
            )


# --- launch ------------------------------------------------------------------------------------
def launch(func, args, kwargs, lnc, target=None):
    target = context.target_from_env(target)
    context.check_target_supported(target)
    degree = 1 if lnc is None else lnc
    if degree == 2 and target.nc_version < 3:
        raise NkiValueError(f"kernel[2]: LNC=2 needs trn2 or trn3, the target is {target.name}")
    configured = os.environ.get("NEURON_LOGICAL_NC_CONFIG")
    if lnc is not None and configured and int(configured) != degree:
        raise NkiValueError(f"kernel[{degree}] but NEURON_LOGICAL_NC_CONFIG={configured}")
    region = MemoryRegion.shared_hbm if degree == 2 else MemoryRegion.private_hbm
    params: list[_Param] = []
    try:
        names = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        names = []
    positional = [
        _convert(v, names[i] if i < len(names) else f"arg{i}", region, params)
        for i, v in enumerate(args)
    ]
    keywords = {k: _convert(v, k, region, params) for k, v in kwargs.items()}
    try:
        bound = inspect.signature(func).bind(*positional, **keywords).arguments
    except TypeError as exc:
        raise NkiTypeError(f"kernel `{func.__name__}`: {exc}") from exc
    _check_annotations(func, bound)
    classes.check_arguments(func, bound)
    language_check.check_kernel(func, bound)
    state = context.Launch(target, degree, 0 if lnc is None else 1)
    results = _run_programs(func, positional, keywords, state)
    for memory in ("sbuf", "psum"):  # live-range peaks replace the allocator's running ones
        setattr(
            state.trace,
            f"{memory}_peak_bytes_per_partition",
            max(peaks[memory] for peaks in state.peaks.values()),
        )
    _last.trace = state.trace
    core_runtime.record_trace(state.trace)  # simulate.last_trace() covers both dialects
    outputs = _outputs(results[0])
    for p in params:
        _hand_back(p)
    frameworks = {p.kind for p in params}
    return _as_framework(outputs, "torch" if "torch" in frameworks else "numpy")


def _run_programs(func, positional, keywords, state):
    if state.lnc == 1:
        return [_run_program(func, positional, keywords, context.Program(state, 0))]
    results: list = [None] * state.lnc
    errors: list = [None] * state.lnc

    def body(pid):
        failed = False
        try:
            state.turns.start(pid)
            results[pid] = _run_program(func, positional, keywords, context.Program(state, pid))
        except BaseException as exc:  # noqa: BLE001 - handed to the launching thread
            errors[pid] = exc
            failed = True
        finally:
            state.turns.finish(pid, failed)

    threads = [
        threading.Thread(target=body, args=(pid,), name=f"nki-program-{pid}", daemon=True)
        for pid in range(state.lnc)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT_S)
        if t.is_alive():
            raise NkiRuntimeError(f"{t.name} did not finish within {JOIN_TIMEOUT_S} s")
    first = next(
        (e for e in errors if e is not None and not isinstance(e, context.NkiDeadlockError)),
        next((e for e in errors if e is not None), None),
    )
    if first is not None:
        raise first
    return results


def _run_program(func, positional, keywords, program):
    """The kernel body as one program (its own code checked for classes the 0.6 compiler
    rejects, :mod:`.classes`), then its SBUF/PSUM capacity check."""
    previous = context.enter(program)
    try:
        with classes.checking_kernel_code(
            classes.kernel_code_root(func), language_check.check_code_object
        ):
            result = func(*positional, **keywords)
        program.check_capacity()
        return result
    finally:
        context.enter(previous)


def _outputs(result):
    """The kernel's results as arrays: one tensor, or a tuple or list of them (converted
    item by item, "On return, NkiTensor results are converted back to NumPy arrays",
    aws-neuron-sdk@81ce03ae nki/guides/nki_simulator.rst L204); AWS's ``mlp`` entry returns
    a list (aws-neuron/nki-library@ddbca35 src/nkilib_src/nkilib/core/mlp/mlp.py L183-184,
    L279-286)."""
    if result is None:
        return None
    several = isinstance(result, (tuple, list))
    items = result if several else (result,)
    arrays = []
    for item in items:
        if not isinstance(item, NkiTensor):
            arrays.append(item)
            continue
        if item.buffer is not MemoryRegion.shared_hbm and not _is_argument(item):
            raise NkiValueError(
                f"returned tensor `{item.name}` is in {item.buffer.value}: kernel "
                "outputs must be allocated with buffer=nl.shared_hbm (NKI 0.3)"
            )
        arrays.append(_array_out(item))
    if not several:
        return arrays[0]
    return arrays if isinstance(result, list) else tuple(arrays)


def _is_argument(tensor: NkiTensor) -> bool:
    """A kernel argument handed back as a result. The migration guide's rule covers tensors
    the kernel *allocates* for its results ("All kernel output (return) tensors must be
    allocated with buffer=nl.shared_hbm", aws-neuron-sdk@81ce03ae nki/migration/index.rst
    L608-612); AWS's ``rope_hf`` returns its written arguments ``q_out, k_out`` and runs at
    LNC=1, where arguments are private HBM (aws-neuron/nki-library@d2ad3a5
    src/nkilib_src/nkilib/core/embeddings/rope_hf.py L151)."""
    return getattr(tensor.storage, "param_index", None) is not None


def _array_out(tensor: NkiTensor) -> np.ndarray:
    values = tensor.values()
    if values.dtype != tensor.dtype.numpy:  # NKI_PRECISE_FP=0: round once on the way out
        values = dt.cast(values, tensor.dtype, tensor.dtype.numpy)
    return values


def _hand_back(p: _Param) -> None:
    """A written input is copied back into the caller's array (SIM step 4)."""
    if not p.tensor.storage.written:
        return
    values = _array_out(p.tensor).reshape(p.array.shape)
    if p.kind == "torch":
        p.original.copy_(_as_framework(values, "torch").to(p.original.device))
    elif p.kind == "numpy":
        p.array[...] = values


def _as_framework(outputs, kind):
    if kind != "torch" or outputs is None:
        return outputs
    import torch

    def convert(a):
        if not isinstance(a, np.ndarray):
            return a
        if a.dtype == dt.bfloat16.numpy:
            return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(a))

    if isinstance(outputs, list):
        return [convert(a) for a in outputs]
    return tuple(convert(a) for a in outputs) if isinstance(outputs, tuple) else convert(outputs)
