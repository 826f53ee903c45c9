"""A CPU twin of ``torch_neuronx.nki_jit`` (Neuron SDK 2.20 – 2.23), on the simulator.

``nki_jit(kernel)`` wraps an output-parameter kernel (outputs are preallocated tensors passed
as arguments and written in place; the kernel returns nothing); calling the wrapper with CPU
torch tensors runs the kernel in the simulator and writes the outputs into the caller's
tensors, as the real one does with XLA tensors. Forms: ``nki_jit(kernel)``,
``nki_jit()(kernel)``, ``@nki_jit``, and a launch grid as ``nki_jit(kernel)[g0, g1](...)``;
non-tensor arguments (positional or keyword) are compile-time constants.

The kernel runs on NumPy copies of the tensors, so the caller's tensors are untouched unless
the whole launch succeeds. The tensors it wrote are its output parameters; before any is
copied back, each must be writable in place (contiguous, not requiring grad, not an inference
tensor outside inference mode) and must not share memory with another argument, else
``ValueError`` naming the argument. Arguments that are not CPU tensors of a NeuronCore dtype
are a ``TypeError`` before the launch.

:func:`install` registers this module as ``torch_neuronx`` when the real package is absent.
torch is imported only when a wrapped kernel is called.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import inspect
import sys
import types

import numpy as np

from .core import dtypes as dt
from .core.runtime import _unwrap, check_legacy_kernel, run

__all__ = ["install", "nki_jit"]


def nki_jit(kernel=None, **options):
    """Wrap an output-parameter kernel for CPU torch tensors (see the module docstring)."""
    if kernel is None:
        return lambda k: nki_jit(k, **options)
    return _SimulatedNkiJit(kernel, options.get("grid", ()))


class _SimulatedNkiJit:
    def __init__(self, kernel, grid, target=None):
        check_legacy_kernel(kernel, "torch_neuronx.nki_jit")
        self.func, kernel_grid, self.target = _unwrap(kernel)
        self.target = self.target or target
        self.grid = grid or kernel_grid
        self.__name__ = getattr(self.func, "__name__", "kernel")
        self.__doc__ = getattr(self.func, "__doc__", None)

    def __getitem__(self, grid):
        return _SimulatedNkiJit(
            self.func, grid if isinstance(grid, tuple) else (grid,), self.target
        )

    def __repr__(self):
        return f"<simulated torch_neuronx.nki_jit {self.__name__} grid={self.grid}>"

    def __call__(self, *args, **kwargs):
        import torch

        names = _parameter_names(self.func, len(args))
        copies = {}  # argument name → (caller's tensor, the NumPy copy the kernel sees)
        positional = [_numpy_copy(torch, v, names[i], copies) for i, v in enumerate(args)]
        keywords = {k: _numpy_copy(torch, v, k, copies) for k, v in kwargs.items()}
        returned, _, params = run(
            self.func, positional, keywords, grid=self.grid, target=self.target
        )
        if returned is not None:
            raise TypeError(
                f"nki_jit takes output-parameter kernels, but {self.__name__} "
                "returned its outputs; call a return-convention kernel directly"
            )
        written_names = {p.storage.name for p in params if p.storage.written}
        written = [name for name in copies if name in written_names]
        for name in written:
            _check_writable(torch, name, copies)
        with torch.no_grad():
            for name in written:
                tensor, copy = copies[name]
                tensor.copy_(_torch_from_numpy(torch, copy))


def _parameter_names(func, count: int) -> list[str]:
    try:
        names = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        names = []
    return names[:count] + [f"arg{i}" for i in range(len(names), count)]


def _numpy_copy(torch, value, name: str, copies: dict):
    """A torch tensor argument as a fresh NumPy array (anything else passes through)."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.device.type != "cpu":
        raise TypeError(
            f"argument `{name}` is on {value.device}; the simulated nki_jit takes CPU tensors"
        )
    detached = value.detach()
    if detached.dtype == torch.bfloat16:
        array = detached.view(torch.int16).numpy().view(dt.bfloat16)
    else:
        try:
            array = detached.numpy()
        except TypeError as err:
            raise TypeError(
                f"argument `{name}` has dtype {value.dtype}, which NeuronCores do not support"
            ) from err
    copy = np.array(array, order="C", copy=True)
    copies[name] = (value, copy)
    return copy


def _check_writable(torch, name: str, copies: dict) -> None:
    tensor, _ = copies[name]
    if not tensor.is_contiguous():
        raise ValueError(
            f"output `{name}` must be a contiguous tensor (the kernel writes it "
            f"in place), got strides {tensor.stride()} for shape "
            f"{tuple(tensor.shape)}"
        )
    if tensor.requires_grad:
        raise ValueError(
            f"output `{name}` requires grad, so it cannot be written in place; "
            "pass a buffer from torch.empty(...)"
        )
    if tensor.is_inference() and not torch.is_inference_mode_enabled():
        raise ValueError(
            f"output `{name}` is an inference tensor, which cannot be written in "
            "place outside torch.inference_mode()"
        )
    for other, (other_tensor, _) in copies.items():
        if other != name and _overlap(tensor, other_tensor):
            raise ValueError(
                f"output `{name}` shares memory with argument `{other}`; outputs "
                "must be separate buffers"
            )


def _overlap(a, b) -> bool:
    """Whether two tensors' byte ranges in one storage intersect."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    if a.numel() == 0 or b.numel() == 0:
        return False

    def extent(t):
        start = t.data_ptr()
        last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
        return start, start + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = extent(a), extent(b)
    return a0 < b1 and b0 < a1


def _torch_from_numpy(torch, array: np.ndarray):
    if array.dtype == dt.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def install() -> bool:
    """Register this module as ``torch_neuronx`` (``from torch_neuronx import nki_jit``) when
    the real package is not installed; never shadows a real one. Returns True when the
    simulated module is (now) registered."""
    registered = sys.modules.get("torch_neuronx")
    if registered is not None:
        return bool(getattr(registered, "__simulated__", False))
    if importlib.util.find_spec("torch_neuronx") is not None:
        return False
    # ``from torch_neuronx import nki_jit`` and, as the SDK 2.20 RMSNorm tutorial imports it,
    # ``from torch_neuronx.xla_impl.ops import nki_jit``.
    for name in ("torch_neuronx", "torch_neuronx.xla_impl", "torch_neuronx.xla_impl.ops"):
        module = types.ModuleType(name, __doc__)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__path__ = []
        module.__simulated__ = True
        module.nki_jit = nki_jit
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
        sys.modules[name] = module
    return True
