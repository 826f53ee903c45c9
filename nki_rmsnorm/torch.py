"""PyTorch bindings: ``rms_norm``, ``fused_add_rms_norm`` and the ``RMSNorm`` module.

The functions follow ``torch.nn.functional.rms_norm`` (``normalized_shape`` names the
trailing dims that are normalised together; ``eps=None`` is PyTorch's default) and are
differentiable in every tensor argument through one ``torch.autograd.Function`` whose
forward and backward launch the NKI kernels:

* tensors on an XLA device (a NeuronCore, with ``torch_neuronx`` and the Neuron compiler
  installed) go straight to the ``nki.jit`` kernels, which the SDK (≥ 2.21) inserts into the
  XLA graph as custom calls;
* CPU tensors go through :mod:`nki_rmsnorm.ops`, which runs the same kernels in the NKI
  simulator on NumPy views of the tensors (bfloat16 is passed bit for bit).

Only ``x`` (``h = x + residual`` for the fused add) and the fp32 ``rstd`` are saved for the
backward pass, next to the weight it needs anyway.
"""

from __future__ import annotations

import numbers
import threading
from collections.abc import Sequence

import ml_dtypes
import numpy as np
import torch
from torch import nn

from nki_rmsnorm import ops
from nki_rmsnorm.reference import CASTING_MODES

__all__ = ["RMSNorm", "fused_add_rms_norm", "rms_norm"]

#: Input dtypes the kernels take (there is no float64 path on the NeuronCore engines).
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# Validation: everything a launch could trip over is rejected here, with PyTorch's names.
# ---------------------------------------------------------------------------------------------


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _as_shape(normalized_shape) -> tuple[int, ...]:
    if isinstance(normalized_shape, numbers.Integral):
        normalized_shape = (normalized_shape,)
    if not isinstance(normalized_shape, Sequence | torch.Size) or not all(
        isinstance(d, numbers.Integral) for d in normalized_shape
    ):
        raise TypeError(
            f"normalized_shape must be an int or a sequence of ints, got {normalized_shape!r}"
        )
    shape = tuple(int(d) for d in normalized_shape)
    if not shape or any(d <= 0 for d in shape):
        raise ValueError(f"normalized_shape must be non-empty and positive, got {shape}")
    return shape


def _check_tensor(name: str, t, expected_shape, input: torch.Tensor, dtypes) -> None:
    """``t`` is a tensor of ``expected_shape``, of one of ``dtypes``, on ``input``'s device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if tuple(t.shape) != tuple(expected_shape):
        raise ValueError(
            f"{name} must have shape {tuple(expected_shape)}, got {tuple(t.shape)}"
        )
    if t.dtype not in dtypes:
        allowed = " or ".join(_dtype_name(d) for d in dict.fromkeys(dtypes))
        raise TypeError(
            f"{name} must be {allowed} for a {_dtype_name(input.dtype)} input, "
            f"got {_dtype_name(t.dtype)}"
        )
    if t.device != input.device:
        raise ValueError(f"{name} is on {t.device} but input is on {input.device}")


def _check_args(input, normalized_shape, weight, bias, residual, eps, offset, casting_mode):
    """Validate the arguments; return ``(normalized_shape, hidden_size, eps)``."""
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"input must be a torch.Tensor, got {type(input).__name__}")
    if input.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"input dtype {_dtype_name(input.dtype)} is not supported by the NKI kernels; "
            "expected float32, float16 or bfloat16"
        )
    shape = _as_shape(normalized_shape)
    if input.dim() < len(shape) or tuple(input.shape[input.dim() - len(shape):]) != shape:
        raise ValueError(
            f"normalized_shape={list(shape)} must match the trailing dims of input, "
            f"expected input of shape [*, {', '.join(map(str, shape))}], "
            f"got {list(input.shape)}"
        )
    if eps is None:
        # PyTorch's default: the machine epsilon of the opmath type, which is float32 for
        # every dtype the kernels take (torch.nn.RMSNorm docs).
        eps = torch.finfo(torch.float32).eps
    eps, offset = ops.check_options(eps, offset, weight, casting_mode)

    param_dtypes = (torch.float32, input.dtype)
    if weight is not None:
        _check_tensor("weight", weight, shape, input, param_dtypes)
    if bias is not None:
        _check_tensor("bias", bias, shape, input, param_dtypes)
    if residual is not None:
        # An fp32 residual stream beside low-precision activations is allowed; h has its dtype.
        _check_tensor("residual", residual, input.shape, input, (input.dtype, torch.float32))
    return shape, int(np.prod(shape)), float(eps)


# ---------------------------------------------------------------------------------------------
# Launchers: the same two calls (forward, backward) on a NeuronCore or in the simulator.
# ---------------------------------------------------------------------------------------------


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor; bfloat16 is reinterpreted bit for bit."""
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _from_numpy(a: np.ndarray | None) -> torch.Tensor | None:
    if a is None:
        return None
    a = np.ascontiguousarray(a) if a.flags.writeable else a.copy()
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _to_numpy_or_none(t):
    return None if t is None else _to_numpy(t)


#: The simulator keeps one global kernel context: launches from several threads take turns.
_SIMULATOR_LOCK = threading.Lock()


class _SimulatorLaunch:
    """CPU tensors: the kernels run in the NKI simulator through :mod:`nki_rmsnorm.ops`."""

    @staticmethod
    def forward(x, weight, bias, residual, eps, offset, casting_mode):
        with _SIMULATOR_LOCK:
            outputs = ops.rms_norm_fwd(
                _to_numpy(x),
                _to_numpy_or_none(weight),
                eps,
                offset=offset,
                bias=_to_numpy_or_none(bias),
                residual=_to_numpy_or_none(residual),
                casting_mode=casting_mode,
            )
        return tuple(_from_numpy(a) for a in outputs)

    @staticmethod
    def backward(dy, x_or_h, weight, rstd, dh_out, offset, has_bias, casting_mode):
        with _SIMULATOR_LOCK:
            grads = ops.rms_norm_bwd(
                _to_numpy(dy),
                _to_numpy(x_or_h),
                _to_numpy_or_none(weight),
                _to_numpy(rstd),
                offset=offset,
                has_bias=has_bias,
                dh_out=_to_numpy_or_none(dh_out),
                casting_mode=casting_mode,
            )
        return tuple(_from_numpy(a) for a in grads)


class _NeuronLaunch:
    """XLA tensors on a NeuronCore: the ``nki.jit`` kernels are called with the XLA tensors.

    The kernels use the return convention (outputs allocated in ``shared_hbm`` and returned),
    which needs Neuron SDK ≥ 2.21; from that release on the documented way to put a kernel in
    a torch-xla graph is to call the ``nki.jit`` function directly (``torch_neuronx.nki_jit``,
    2.20 – 2.23, only takes output-parameter kernels). The kernels take 2-D ``(rows, hidden)``
    HBM tensors and ``None`` for absent optional tensors; constants are trace-time arguments.
    """

    @staticmethod
    def _kernels():
        try:
            import torch_neuronx  # noqa: F401  (registers the Neuron XLA backend)
            import torch_xla  # noqa: F401
        except ImportError as err:
            raise RuntimeError(
                "input is on an XLA device, but torch_xla/torch_neuronx are not importable; "
                "install the Neuron SDK or move the tensors to the CPU (simulated kernels)"
            ) from err
        from nki_rmsnorm import kernels, nki

        if nki.SIMULATED:
            raise RuntimeError(
                "input is on an XLA device, but the Neuron compiler (neuronxcc) is not "
                "installed, so the kernels can only run simulated, on CPU tensors"
            )
        return kernels.rmsnorm_fwd, kernels.rmsnorm_bwd

    @classmethod
    def forward(cls, x, weight, bias, residual, eps, offset, casting_mode):
        fwd_kernel, _ = cls._kernels()
        options = (eps, offset, casting_mode, None)
        if residual is None:
            return tuple(fwd_kernel(x, weight, bias, *options))
        from nki_rmsnorm import kernels

        return tuple(kernels.rmsnorm_add_fwd(x, residual, weight, bias, *options))

    @classmethod
    def backward(cls, dy, x_or_h, weight, rstd, dh_out, offset, has_bias, casting_mode):
        _, bwd_kernel = cls._kernels()
        grads = list(bwd_kernel(dy, x_or_h, weight, rstd, dh_out, offset, has_bias, casting_mode))
        dx = grads.pop(0)
        dweight = grads.pop(0) if weight is not None else None
        dbias = grads.pop(0) if has_bias else None
        return dx, dweight, dbias


def _launcher(x: torch.Tensor):
    if x.device.type == "cpu":
        return _SimulatorLaunch
    if x.device.type == "xla":
        return _NeuronLaunch
    raise ValueError(
        f"input is on {x.device}; the kernels run on a NeuronCore (XLA device) "
        "or, simulated, on the CPU"
    )


class _RMSNormFunction(torch.autograd.Function):
    """``y = h·rstd·(weight + offset) + bias`` over the rows of 2-D ``x`` (``h = x + residual``).

    Returns ``y``, or ``(y, h)`` with a residual. The gradient of ``h`` flows back into the
    backward kernel as ``dh_out``; ``x`` and ``residual`` receive the same gradient.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, residual, eps, offset, casting_mode):
        launch = _launcher(x)
        if x.shape[0] == 0:
            outputs = (torch.empty_like(x),) * (1 if residual is None else 2)
            rstd = torch.empty(0, dtype=torch.float32, device=x.device)
        else:
            *outputs, rstd = launch.forward(x, weight, bias, residual, eps, offset, casting_mode)
        x_or_h = x if residual is None else outputs[1]
        ctx.save_for_backward(x_or_h, weight, rstd)
        ctx.launch, ctx.offset, ctx.casting_mode = launch, offset, casting_mode
        ctx.has_bias, ctx.bias_dtype = bias is not None, None if bias is None else bias.dtype
        ctx.x_dtype = x.dtype
        ctx.set_materialize_grads(False)
        return outputs[0] if residual is None else tuple(outputs)

    @staticmethod
    def backward(ctx, dy, dh=None):
        x_or_h, weight, rstd = ctx.saved_tensors
        if dy is None:  # only h was used downstream
            dy = torch.zeros_like(x_or_h, dtype=ctx.x_dtype)
        if x_or_h.shape[0] == 0:
            dx = torch.zeros_like(x_or_h)
            dweight = None if weight is None else torch.zeros_like(weight)
            dbias = None
            if ctx.has_bias:
                dbias = torch.zeros(x_or_h.shape[1], dtype=ctx.bias_dtype, device=dx.device)
        else:
            dx, dweight, dbias = ctx.launch.backward(
                dy, x_or_h, weight, rstd, dh, ctx.offset, ctx.has_bias, ctx.casting_mode
            )
        dresidual = dx if ctx.needs_input_grad[3] else None
        return dx.to(ctx.x_dtype), dweight, dbias, dresidual, None, None, None


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def rms_norm(
    input: torch.Tensor,
    normalized_shape,
    weight: torch.Tensor | None = None,
    eps: float | None = None,
    *,
    offset: float = 0.0,
    bias: torch.Tensor | None = None,
    casting_mode: str = "gemma",
) -> torch.Tensor:
    """RMSNorm over the trailing ``normalized_shape`` dims, like ``torch.nn.functional.rms_norm``.

    ``y = x · rsqrt(mean(x²) + eps) · (weight + offset) + bias``, with the mean taken over the
    trailing dims (flattened into one hidden dim of ``prod(normalized_shape)``).

    Args:
        input: ``(*, *normalized_shape)``, float32, float16 or bfloat16, on the CPU
            (simulated kernels) or an XLA NeuronCore device.
        normalized_shape: int or tuple, the trailing dims to normalise over.
        weight: ``normalized_shape``, float32 or the input dtype, or None (no scale).
        eps: added to the mean square; None is PyTorch's default,
            ``torch.finfo(torch.float32).eps`` for every supported dtype.
        offset: added to the weight in fp32 (Gemma's ``1 + w``).
        bias: ``normalized_shape``, added after scaling, or None.
        casting_mode: "gemma" (fp32 math, one rounding), "llama" (``x·rstd`` rounded to the
            input dtype before the weight multiply, as HF LlamaRMSNorm) or "none".

    Returns:
        ``y`` of ``input``'s shape and dtype.
    """
    shape, hidden, eps = _check_args(
        input, normalized_shape, weight, bias, None, eps, offset, casting_mode
    )
    y = _RMSNormFunction.apply(
        input.reshape(-1, hidden),
        None if weight is None else weight.reshape(hidden),
        None if bias is None else bias.reshape(hidden),
        None,
        eps,
        float(offset),
        casting_mode,
    )
    return y.reshape(input.shape)


def fused_add_rms_norm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float | None = None,
    *,
    offset: float = 0.0,
    bias: torch.Tensor | None = None,
    casting_mode: str = "gemma",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = input + residual`` and ``y = rms_norm(h)`` over the last dim, in one kernel.

    The pre-norm transformer step: ``h`` is the new residual stream, ``y`` feeds the next
    block. Arguments as :func:`rms_norm` (``weight`` and ``bias`` of shape
    ``(input.shape[-1],)``); ``residual`` has ``input``'s shape and its dtype or float32
    (an fp32 residual stream).

    Returns:
        ``(y, h)`` of ``input``'s shape; ``y`` in ``input``'s dtype, ``h`` in the residual's.
        Gradients flow from both into ``input``, ``residual``, ``weight`` and ``bias``.
    """
    if not isinstance(input, torch.Tensor) or input.dim() == 0:
        raise TypeError("input must be a torch.Tensor with at least one dim")
    if residual is None:
        raise TypeError("residual must be a torch.Tensor, got None; use rms_norm without one")
    _, hidden, eps = _check_args(
        input, input.shape[-1:], weight, bias, residual, eps, offset, casting_mode
    )
    y, h = _RMSNormFunction.apply(
        input.reshape(-1, hidden),
        weight,
        bias,
        residual.reshape(-1, hidden),
        eps,
        float(offset),
        casting_mode,
    )
    return y.reshape(input.shape), h.reshape(input.shape)


class RMSNorm(nn.Module):
    """Drop-in for ``torch.nn.RMSNorm`` running the NKI kernels, with offset, bias and cast mode.

    Same constructor and ``state_dict`` (``weight``) as ``torch.nn.RMSNorm``, plus:

    Args:
        offset: added to the weight in fp32; ``weight`` is initialised to ``1 - offset`` so a
            fresh module scales by one (ones for ``offset=0``, zeros for Gemma's ``offset=1``).
        bias: add a learnable ``bias`` (initialised to zeros); needs ``elementwise_affine``.
        casting_mode: see :func:`rms_norm`; "llama" matches HF LlamaRMSNorm bit for bit.
    """

    __constants__ = ["normalized_shape", "eps", "elementwise_affine", "offset", "casting_mode"]

    def __init__(
        self,
        normalized_shape,
        eps: float | None = None,
        elementwise_affine: bool = True,
        *,
        offset: float = 0.0,
        bias: bool = False,
        casting_mode: str = "gemma",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if casting_mode not in CASTING_MODES:
            raise ValueError(f"casting_mode must be one of {CASTING_MODES}, got {casting_mode!r}")
        if (bias or offset) and not elementwise_affine:
            raise ValueError("bias and offset need elementwise_affine=True (they act on the "
                             "weight)")
        factory = {"device": device, "dtype": dtype}
        self.normalized_shape = _as_shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.offset = float(offset)
        self.casting_mode = casting_mode
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, **factory))
        else:
            self.register_parameter("weight", None)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.normalized_shape, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.constant_(self.weight, 1.0 - self.offset)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return rms_norm(
            input,
            self.normalized_shape,
            self.weight,
            self.eps,
            offset=self.offset,
            bias=self.bias,
            casting_mode=self.casting_mode,
        )

    def extra_repr(self) -> str:
        return (
            f"{self.normalized_shape}, eps={self.eps}, "
            f"elementwise_affine={self.elementwise_affine}, offset={self.offset}, "
            f"bias={self.bias is not None}, casting_mode={self.casting_mode!r}"
        )
