"""PyTorch bindings: ``rms_norm``, ``fused_add_rms_norm`` and the ``RMSNorm`` module.

The functions follow ``torch.nn.functional.rms_norm`` (``normalized_shape`` names the
trailing dims that are normalised together; ``eps=None`` is PyTorch's default). Underneath,
the forward and backward passes are four ``torch.library`` custom operators on
``(rows, hidden)`` matrices::

    nki_rmsnorm::rms_norm_fwd(x, weight?, bias?, eps, offset, casting_mode, out_dtype?)
        -> (y, rstd)
    nki_rmsnorm::rms_norm_add_fwd(x, residual, weight?, bias?, eps, offset, casting_mode,
                                  out_dtype?) -> (y, h, rstd)
    nki_rmsnorm::rms_norm_bwd(dy, x, weight?, rstd, offset, has_bias, bias_dtype?,
                              casting_mode) -> [dx, dweight?, dbias?]
    nki_rmsnorm::rms_norm_add_bwd(dy, h, weight?, rstd, dh?, x_dtype, offset, has_bias,
                                  bias_dtype?, casting_mode)
        -> [dx, dresidual, dweight?, dbias?]

and, for ``output_layout="transposed"`` (y as nki-library's ``rmsnorm_tkg`` writes it,
``(128, rows, hidden // 128)``), ``nki_rmsnorm::rms_norm_fwd_transposed`` and
``nki_rmsnorm::rms_norm_add_fwd_transposed`` with the forward operators' arguments and
outputs, whose backward is the row-layout one on the gradient rearranged back to rows.

Their dtype arguments are dtype names ("float32", "bfloat16", "float16"), not ``torch.dtype``:
a ``ScalarType`` in an operator schema reaches Python through the dispatcher's own conversion,
which crashes the process on an out-of-range integer before any check could run. Every
argument is checked in the operator (and its fake implementation) before anything launches.

Each has a fake (meta) implementation, so ``torch.compile`` (no graph breaks), ``torch.export``,
``FakeTensorMode`` and ``"meta"`` tensors see shapes and dtypes without running a kernel; the
forward operators get their backward through ``torch.library.register_autograd``. The device
kernel is picked by the input's device type (:data:`LAUNCHERS`):

* ``"cpu"``: :mod:`nki_rmsnorm.ops` runs the kernels in the NKI simulator on NumPy views of the
  tensors (bfloat16 passed bit for bit);
* ``"xla"`` (PyTorch/XLA on a NeuronCore): through ``torch_neuronx.nki_jit`` with the
  output-parameter kernels where the installed ``torch_neuronx`` has it (Neuron SDK 2.20 –
  2.23), else by calling the return-convention ``nki.jit`` kernels directly (SDK ≥ 2.21);
* ``"neuron"`` (TorchNeuron, SDK ≥ 2.31): the output-parameter kernels are called directly
  with the neuron tensors and preallocated outputs, as the TorchNeuron docs show.

The NKI dialect of the kernels is no argument: each launch resolves it where it runs
(:func:`nki_rmsnorm.dialect.current`: the target hardware and the installed SDK decide), so
eager calls, autograd's backward and ``torch.compile`` graphs all launch the target's kernels.

:data:`last_launch_path` names the path the latest launch took ("simulator", "nki_jit",
"nki.jit" or "neuron") and :data:`last_launch_dialect` its kernels' dialect; the module's
logger says the same at DEBUG level.
"""

from __future__ import annotations

from nki_rmsnorm._optional import require

require("torch", extra="torch")  # a missing torch is an ImportError naming the extra

import logging
import math
import numbers
from collections.abc import Sequence
from typing import NamedTuple

import ml_dtypes
import numpy as np
import torch
from torch import Tensor, nn

from nki_rmsnorm import dialect, kernels, mx, ops, validation

__all__ = [
    "LAUNCHERS",
    "RMSNorm",
    "fused_add_rms_norm",
    "last_launch_dialect",
    "last_launch_path",
    "patch_module",
    "rms_norm",
    "rms_norm_heads",
    "rms_norm_mx_quant",
    "rms_norm_qk",
    "rms_norm_quant",
]

logger = logging.getLogger(__name__)

#: Input dtypes the kernels take (there is no float64 path on the NeuronCore engines).
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: The launch path of the latest kernel launch: "simulator", "nki_jit", "nki.jit" or "neuron".
last_launch_path: str | None = None
#: The NKI dialect ("legacy" or "nki06") of the latest launch's kernels.
last_launch_dialect: str | None = None


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


def _check_tensor(name: str, t, expected_shape, input: Tensor, dtypes) -> None:
    """``t`` is a tensor of ``expected_shape``, of one of ``dtypes``, on ``input``'s device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if tuple(t.shape) != tuple(expected_shape):
        raise ValueError(f"{name} must have shape {tuple(expected_shape)}, got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = " or ".join(_dtype_name(d) for d in dict.fromkeys(dtypes))
        raise TypeError(
            f"{name} must be {allowed} for a {_dtype_name(input.dtype)} input, "
            f"got {_dtype_name(t.dtype)}"
        )
    if t.device != input.device:
        raise ValueError(f"{name} is on {t.device} but input is on {input.device}")


def _check_out_dtype(out_dtype) -> None:
    if out_dtype is not None and out_dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            "out_dtype must be None, torch.float32, torch.float16 or torch.bfloat16, "
            f"got {out_dtype!r}"
        )


#: A dtype argument of the custom operators, by name: a ``torch.dtype`` in an operator schema
#: is a ``ScalarType``, which the dispatcher converts back to Python before any of our code
#: runs, and an out-of-range integer there (``x_dtype=1000``) crashes the process.
_DTYPES_BY_NAME = {_dtype_name(d): d for d in SUPPORTED_DTYPES}
_DTYPE_NAMES = ", ".join(repr(n) for n in _DTYPES_BY_NAME)


def _dtype_arg(dtype: torch.dtype | None) -> str | None:
    """A ``torch.dtype`` (or None) as the custom operators take it: its name."""
    return None if dtype is None else _dtype_name(dtype)


def _op_dtype(value, name: str, optional: bool = True) -> torch.dtype | None:
    """A custom operator's dtype-name argument as the ``torch.dtype`` it names."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or value not in _DTYPES_BY_NAME:
        raise TypeError(
            f"{name} must be {'None or ' if optional else ''}one of {_DTYPE_NAMES} "
            f"(a dtype name), got {value!r}"
        )
    return _DTYPES_BY_NAME[value]


def _check_rows(name: str, t) -> None:
    """``t`` is a 2-D ``(rows, hidden)`` tensor of a kernel dtype on a device the kernels
    run on."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {_dtype_name(t.dtype)}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D (rows, hidden), got shape {tuple(t.shape)}")
    if t.device.type not in LAUNCHERS and t.device.type != "meta":
        raise ValueError(
            f"{name} is on {t.device}; the kernels run on a NeuronCore ('xla' or 'neuron' "
            "device), simulated on the CPU, or shape-only on 'meta'"
        )


def _check_forward_op(x, residual, weight, bias, eps, offset, casting_mode, out_dtype):
    """Every argument of a forward operator, before anything runs; returns
    ``(eps, offset, out_dtype)`` with ``out_dtype`` a ``torch.dtype`` or None."""
    _check_rows("x", x)
    hidden = x.shape[1]
    param_dtypes = (torch.float32, x.dtype)
    if weight is not None:
        _check_tensor("weight", weight, (hidden,), x, param_dtypes)
    if bias is not None:
        _check_tensor("bias", bias, (hidden,), x, param_dtypes)
    if residual is not None:
        _check_tensor("residual", residual, x.shape, x, (x.dtype, torch.float32))
    eps, offset = ops.check_options(eps, offset, weight, casting_mode)
    return eps, offset, _op_dtype(out_dtype, "out_dtype")


def _check_backward_op(
    dy, x_or_h, weight, rstd, dh, offset, has_bias, bias_dtype, casting_mode, name="x"
):
    """Every argument of a backward operator, before anything runs; returns
    ``(offset, bias_dtype)`` with ``bias_dtype`` a ``torch.dtype`` or None."""
    _check_rows(name, x_or_h)
    rows, hidden = x_or_h.shape
    validation.check_backward_hidden(hidden, name)
    _check_tensor("dy", dy, x_or_h.shape, x_or_h, SUPPORTED_DTYPES)
    # An fp32 h may be the residual stream beside parameters in x's narrower dtype.
    param_dtypes = (
        SUPPORTED_DTYPES if x_or_h.dtype == torch.float32 else (torch.float32, x_or_h.dtype)
    )
    if weight is not None:
        _check_tensor("weight", weight, (hidden,), x_or_h, param_dtypes)
    _check_tensor("rstd", rstd, (rows,), x_or_h, (torch.float32,))
    if dh is not None:
        _check_tensor("dh", dh, x_or_h.shape, x_or_h, SUPPORTED_DTYPES)
    offset = validation.offset_value(offset, weight)
    if not isinstance(has_bias, bool):
        raise TypeError(f"has_bias must be a bool, got {type(has_bias).__name__}")
    bias_dtype = _op_dtype(bias_dtype, "bias_dtype")
    if bias_dtype is not None and bias_dtype not in param_dtypes:
        raise TypeError(
            f"bias_dtype must be float32 or {name}'s dtype ({_dtype_name(x_or_h.dtype)}), "
            f"got {_dtype_name(bias_dtype)}"
        )
    validation.check_casting_mode(casting_mode)
    return offset, bias_dtype


def _check_args(
    input, normalized_shape, weight, bias, residual, eps, offset, casting_mode, out_dtype
):
    """Validate the arguments; return ``(normalized_shape, hidden_size, eps, offset)``."""
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"input must be a torch.Tensor, got {type(input).__name__}")
    if input.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"input dtype {_dtype_name(input.dtype)} is not supported by the NKI kernels; "
            "expected float32, float16 or bfloat16"
        )
    if input.device.type not in LAUNCHERS and input.device.type != "meta":
        raise ValueError(
            f"input is on {input.device}; the kernels run on a NeuronCore ('xla' or 'neuron' "
            "device), simulated on the CPU, or shape-only on 'meta'"
        )
    shape = _as_shape(normalized_shape)
    if input.dim() < len(shape) or tuple(input.shape[input.dim() - len(shape) :]) != shape:
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
    _check_out_dtype(out_dtype)

    param_dtypes = (torch.float32, input.dtype)
    if weight is not None:
        _check_tensor("weight", weight, shape, input, param_dtypes)
    if bias is not None:
        _check_tensor("bias", bias, shape, input, param_dtypes)
    if residual is not None:
        # An fp32 residual stream beside low-precision activations is allowed; h has its dtype.
        _check_tensor("residual", residual, input.shape, input, (input.dtype, torch.float32))
    hidden = math.prod(shape)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (input, weight, bias, residual)
    )
    if needs_grad and hidden > ops.MAX_HIDDEN_BWD:
        raise ValueError(
            f"normalized_shape={list(shape)} gives a hidden size of {hidden}, above the "
            f"backward kernel's limit N <= {ops.MAX_HIDDEN_BWD} (MAX_HIDDEN_BWD), and gradients "
            "are enabled; run the forward under torch.no_grad() or split the hidden dim"
        )
    return shape, hidden, eps, offset


# ---------------------------------------------------------------------------------------------
# Launchers: the same two calls (forward, backward) in the simulator or on a NeuronCore.
# ---------------------------------------------------------------------------------------------


def _require_cpu(tensor: Tensor, what: str, *, meta: bool = False) -> None:
    """``NotImplementedError`` unless ``tensor`` is a CPU tensor (or a meta one, with
    ``meta``): the serving operators run the simulated kernel there only so far."""
    allowed = ("cpu", "meta") if meta else ("cpu",)
    if tensor.device.type not in allowed:  # pragma: no cover - needs a NeuronDevice
        raise NotImplementedError(
            f"{what} runs the simulated kernel on CPU tensors only so far; got a tensor on "
            f"{tensor.device}"
        )


def _to_numpy(t: Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor; bfloat16 is reinterpreted bit for bit."""
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _from_numpy(a: np.ndarray) -> Tensor:
    a = np.ascontiguousarray(a) if a.flags.writeable else a.copy()
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _to_numpy_or_none(t):
    return None if t is None else _to_numpy(t)


_NUMPY_DTYPES = {
    torch.float32: np.dtype(np.float32),
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
}


def _numpy_dtype(dtype: torch.dtype | None):
    return None if dtype is None else _NUMPY_DTYPES[dtype]


def _record(path: str, dialect_name: str) -> None:
    global last_launch_path, last_launch_dialect
    last_launch_path, last_launch_dialect = path, dialect_name
    logger.debug("nki_rmsnorm launch path: %s, %s kernels", path, dialect_name)


class _ForwardOptions(NamedTuple):
    """A forward launch's constants."""

    eps: float
    offset: float
    casting_mode: str
    out_dtype: torch.dtype | None
    dialect: str


class _BackwardOptions(NamedTuple):
    """A backward launch's constants."""

    offset: float
    has_bias: bool
    bias_dtype: torch.dtype | None
    casting_mode: str
    dialect: str


class _SimulatorLaunch:
    """CPU tensors: the kernels run in the NKI simulator through :mod:`nki_rmsnorm.ops`, on
    the launching thread (which resolved ``options.dialect`` too)."""

    @staticmethod
    def forward(x, weight, bias, residual, options: _ForwardOptions):
        outputs = ops.rms_norm_fwd(
            _to_numpy(x),
            _to_numpy_or_none(weight),
            options.eps,
            offset=options.offset,
            bias=_to_numpy_or_none(bias),
            residual=_to_numpy_or_none(residual),
            casting_mode=options.casting_mode,
            out_dtype=_numpy_dtype(options.out_dtype),
        )
        _record("simulator", options.dialect)
        return tuple(_from_numpy(a) for a in outputs)

    @staticmethod
    def forward_transposed(x, weight, bias, residual, options: _ForwardOptions):
        """The forward with y in rmsnorm_tkg's transposed layout (NKI 0.6 kernels)."""
        outputs = ops.rms_norm_fwd(
            _to_numpy(x),
            _to_numpy_or_none(weight),
            options.eps,
            offset=options.offset,
            bias=_to_numpy_or_none(bias),
            residual=_to_numpy_or_none(residual),
            casting_mode=options.casting_mode,
            out_dtype=_numpy_dtype(options.out_dtype),
            output_layout="transposed",
        )
        _record("simulator", options.dialect)
        return tuple(_from_numpy(a) for a in outputs)

    @staticmethod
    def backward(dy, x_or_h, weight, rstd, dh_out, options: _BackwardOptions):
        dx, dweight, dbias = ops.rms_norm_bwd(
            _to_numpy(dy),
            _to_numpy(x_or_h),
            _to_numpy_or_none(weight),
            _to_numpy(rstd),
            offset=options.offset,
            has_bias=options.has_bias,
            bias_dtype=_numpy_dtype(options.bias_dtype),
            dh_out=_to_numpy_or_none(dh_out),
            casting_mode=options.casting_mode,
        )
        _record("simulator", options.dialect)
        return _from_numpy(dx), _from_numpy_or_none(dweight), _from_numpy_or_none(dbias)


def _from_numpy_or_none(a):
    return None if a is None else _from_numpy(a)


def _nki_dtype(dtype: torch.dtype | None, dialect_name: str):
    """The NKI dtype (``nl.float32`` ...) of ``dialect_name`` that a kernel's dtype argument
    takes."""
    return kernels.nki_dtype(None if dtype is None else _dtype_name(dtype), dialect_name)


def _allocate_forward(x, residual, out_dtype):
    rows = x.shape[0]
    y = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    h = None if residual is None else torch.empty(x.shape, dtype=residual.dtype, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    return y, h, rstd


def _allocate_backward(x_or_h, weight, has_bias, bias_dtype):
    n = x_or_h.shape[1]
    param_dtype = torch.float32 if weight is None else weight.dtype
    dx = torch.empty_like(x_or_h)
    dweight = None if weight is None else torch.empty(n, dtype=param_dtype, device=dx.device)
    dbias = None
    if has_bias:
        dbias = torch.empty(n, dtype=bias_dtype or param_dtype, device=dx.device)
    return dx, dweight, dbias


def _launch_output_kernels(launch, x, weight, bias, residual, options: _ForwardOptions):
    """Forward through an output-parameter kernel: allocate, launch, return the buffers."""
    y, h, rstd = _allocate_forward(x, residual, options.out_dtype)
    validation.check_forward_outputs(
        x.dtype, y.dtype, rstd.dtype, None if residual is None else residual.dtype,
        None if h is None else h.dtype,
    )  # fmt: skip
    constants = {"eps": options.eps, "offset": options.offset, "casting_mode": options.casting_mode}
    if residual is None:
        kernel = kernels.kernel("rmsnorm_fwd_out", options.dialect)
        launch(kernel)(x, weight, bias, y, rstd, **constants)
        return y, rstd
    kernel = kernels.kernel("rmsnorm_add_fwd_out", options.dialect)
    launch(kernel)(x, residual, weight, bias, y, h, rstd, **constants)
    return y, h, rstd


def _launch_output_bwd(launch, dy, x_or_h, weight, rstd, dh_out, options: _BackwardOptions):
    dx, dweight, dbias = _allocate_backward(x_or_h, weight, options.has_bias, options.bias_dtype)
    validation.check_backward_outputs(
        x_or_h.dtype, None if weight is None else weight.dtype, dx.dtype,
        None if dweight is None else dweight.dtype, None if dbias is None else dbias.dtype,
    )  # fmt: skip
    launch(kernels.kernel("rmsnorm_bwd_out", options.dialect))(
        dy, x_or_h, weight, rstd, dh_out, dx, dweight, dbias,
        offset=options.offset, casting_mode=options.casting_mode,
    )  # fmt: skip
    return dx, dweight, dbias


def _direct(kernel):
    return kernel


class _XlaLaunch:
    """PyTorch/XLA tensors on a NeuronCore.

    With ``torch_neuronx.nki_jit`` (Neuron SDK 2.20 – 2.23: the 2.23 end-of-support notice and
    the 2.24 removal notice under ``general/announcements/neuron2.x/``) the output-parameter
    kernels are wrapped by it and called with preallocated XLA outputs, as the RMSNorm tutorial
    does. Without it (SDK ≥ 2.24, and every SDK with ``nki`` 0.5 – 0.6), the
    return-convention ``nki.jit`` kernels are called directly with the XLA tensors and return
    their outputs, as ``nki/guides/framework_custom_op.rst`` (lines 52-64:
    ``c = nki_tensor_add(a, b)``) shows for the 0.6 kernels.
    """

    @staticmethod
    def _nki_jit(device_type, dialect_name):
        """``torch_neuronx.nki_jit`` when the launch goes through it, else None (the kernels
        are called directly). Only the legacy kernels can: ``nki_jit`` was removed in SDK
        2.24, before the first ``nki`` 0.4 release (SDK 2.30)."""
        nki_jit = None
        if dialect_name == dialect.LEGACY:
            try:
                import torch_neuronx
            except ImportError as err:
                raise RuntimeError(
                    "input is on an XLA device, but torch_neuronx is not importable; install "
                    "the Neuron SDK or move the tensors to the CPU (simulated kernels)"
                ) from err
            nki_jit = getattr(torch_neuronx, "nki_jit", None)
        if device_type == "xla" and dialect.simulated():
            raise RuntimeError(
                "input is on an XLA device, but neither the nki package (SDK >= 2.31) nor "
                "the Neuron compiler's neuronxcc.nki is installed, so the kernels can only run "
                "simulated, on CPU tensors"
            )
        return nki_jit

    @classmethod
    def forward(cls, x, weight, bias, residual, options: _ForwardOptions):
        nki_jit = cls._nki_jit(x.device.type, options.dialect)
        if nki_jit is not None:
            _record("nki_jit", options.dialect)
            return _launch_output_kernels(nki_jit, x, weight, bias, residual, options)
        _record("nki.jit", options.dialect)
        constants = (
            options.eps,
            options.offset,
            options.casting_mode,
            _nki_dtype(options.out_dtype, options.dialect),
        )
        if residual is None:
            kernel = kernels.kernel("rmsnorm_fwd", options.dialect)
            return tuple(kernel(x, weight, bias, *constants))
        kernel = kernels.kernel("rmsnorm_add_fwd", options.dialect)
        return tuple(kernel(x, residual, weight, bias, *constants))

    @classmethod
    def forward_transposed(cls, x, weight, bias, residual, options: _ForwardOptions):
        """The transposed forward: NKI 0.6 kernels only, so never through ``nki_jit``; the
        return-convention kernel is called with the XLA tensors."""
        cls._nki_jit(x.device.type, options.dialect)
        _record("nki.jit", options.dialect)
        constants = (
            options.eps,
            options.offset,
            options.casting_mode,
            _nki_dtype(options.out_dtype, options.dialect),
        )
        if residual is None:
            kernel = kernels.kernel("rmsnorm_fwd_transposed", options.dialect)
            return tuple(kernel(x, weight, bias, *constants))
        kernel = kernels.kernel("rmsnorm_add_fwd_transposed", options.dialect)
        return tuple(kernel(x, residual, weight, bias, *constants))

    @classmethod
    def backward(cls, dy, x_or_h, weight, rstd, dh_out, options: _BackwardOptions):
        nki_jit = cls._nki_jit(x_or_h.device.type, options.dialect)
        if nki_jit is not None:
            _record("nki_jit", options.dialect)
            return _launch_output_bwd(nki_jit, dy, x_or_h, weight, rstd, dh_out, options)
        _record("nki.jit", options.dialect)
        kernel = kernels.kernel("rmsnorm_bwd", options.dialect)
        bias_dtype = _nki_dtype(options.bias_dtype, options.dialect)
        constants = (options.offset, options.has_bias, options.casting_mode, bias_dtype)
        grads = list(kernel(dy, x_or_h, weight, rstd, dh_out, *constants))
        dx = grads.pop(0)
        dweight = grads.pop(0) if weight is not None else None
        dbias = grads.pop(0) if options.has_bias else None
        return dx, dweight, dbias


class _NeuronLaunch:
    """TorchNeuron (device ``"neuron"``): the ``nki.jit`` output-parameter kernels are called
    directly with neuron tensors and outputs preallocated by ``torch.empty``, the pattern of
    ``frameworks/torch/pytorch-native-overview.rst`` (the ``NKI_sin`` autograd example) and of
    the ``nki_op`` example in ``nki/get-started/about/index.rst`` (lines 285-304:
    ``out = torch.empty_like(x); my_kernel(x, out)``); this operator is the custom op that
    ``nki_op`` would register."""

    @staticmethod
    def forward(x, weight, bias, residual, options: _ForwardOptions):
        _record("neuron", options.dialect)
        return _launch_output_kernels(_direct, x, weight, bias, residual, options)

    @staticmethod
    def forward_transposed(x, weight, bias, residual, options: _ForwardOptions):
        raise NotImplementedError(
            "output_layout='transposed' on TorchNeuron ('neuron' device) needs an "
            "output-parameter form of rmsnorm_fwd_transposed, which is not written yet; "
            "use output_layout='rows', or an 'xla' device (the nki.jit kernel)"
        )

    @staticmethod
    def backward(dy, x_or_h, weight, rstd, dh_out, options: _BackwardOptions):
        _record("neuron", options.dialect)
        return _launch_output_bwd(_direct, dy, x_or_h, weight, rstd, dh_out, options)


#: Device type → launcher. Tests route CPU tensors through the XLA launch code by setting
#: ``LAUNCHERS["cpu"] = LAUNCHERS["xla"]`` (with the simulated ``torch_neuronx`` installed).
LAUNCHERS = {"cpu": _SimulatorLaunch, "xla": _XlaLaunch, "neuron": _NeuronLaunch}


def _launcher(device: torch.device):
    try:
        return LAUNCHERS[device.type]
    except KeyError:
        raise ValueError(
            f"input is on {device}; the kernels run on a NeuronCore ('xla' or 'neuron' "
            "device) or, simulated, on the CPU"
        ) from None


# ---------------------------------------------------------------------------------------------
# The custom operators. Shapes: x (M, N); weight, bias (N,); rstd (M,) float32.
# ---------------------------------------------------------------------------------------------


def _empty_forward(x, residual, out_dtype):
    """The forward's outputs for an input without rows (no launch)."""
    y, h, rstd = _allocate_forward(x, residual, out_dtype)
    return (y, rstd) if residual is None else (y, h, rstd)


def _forward(x, residual, weight, bias, eps, offset, casting_mode, out_dtype):
    """Both forward operators: launch on ``x``'s device, or nothing for an input without rows."""
    if x.shape[0] == 0:
        return _empty_forward(x, residual, out_dtype)
    options = _ForwardOptions(eps, offset, casting_mode, out_dtype, dialect.current())
    return _launcher(x.device).forward(x, weight, bias, residual, options)


@torch.library.custom_op("nki_rmsnorm::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    offset: float,
    casting_mode: str,
    out_dtype: str | None,
) -> tuple[Tensor, Tensor]:
    eps, offset, out_dtype = _check_forward_op(
        x, None, weight, bias, eps, offset, casting_mode, out_dtype
    )
    return _forward(x, None, weight, bias, eps, offset, casting_mode, out_dtype)


@_rms_norm_fwd.register_fake
def _(x, weight, bias, eps, offset, casting_mode, out_dtype):
    *_, out_dtype = _check_forward_op(x, None, weight, bias, eps, offset, casting_mode, out_dtype)
    return _empty_forward(x, None, out_dtype)


@torch.library.custom_op("nki_rmsnorm::rms_norm_add_fwd", mutates_args=())
def _rms_norm_add_fwd(
    x: Tensor,
    residual: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    offset: float,
    casting_mode: str,
    out_dtype: str | None,
) -> tuple[Tensor, Tensor, Tensor]:
    eps, offset, out_dtype = _check_forward_op(
        x, residual, weight, bias, eps, offset, casting_mode, out_dtype
    )
    return _forward(x, residual, weight, bias, eps, offset, casting_mode, out_dtype)


@_rms_norm_add_fwd.register_fake
def _(x, residual, weight, bias, eps, offset, casting_mode, out_dtype):
    *_, out_dtype = _check_forward_op(
        x, residual, weight, bias, eps, offset, casting_mode, out_dtype
    )
    return _empty_forward(x, residual, out_dtype)


def _batched_rows(op, n_row_args: int):
    """A vmap rule for a forward operator whose first ``n_row_args`` tensors are ``(M, N)``
    rows and the next two the ``(N,)`` weight and bias: with unbatched parameters the batch
    is folded into the rows (one launch); a batched weight or bias launches once per element."""

    def rule(info, in_dims, *args):
        rows, params, options = (
            args[:n_row_args],
            args[n_row_args : n_row_args + 2],
            args[n_row_args + 2 :],
        )
        size = info.batch_size

        def batch_first(t, dim):
            return t.expand(size, *t.shape) if dim is None else t.movedim(dim, 0)

        rows = [batch_first(t, d) for t, d in zip(rows, in_dims)]
        if all(d is None for d in in_dims[n_row_args : n_row_args + 2]):
            m, n = rows[0].shape[1:]
            outputs = op(*(t.reshape(size * m, n) for t in rows), *params, *options)
            return tuple(
                o.reshape(size, m, n) if o.dim() == 2 else o.reshape(size, m) for o in outputs
            ), (0,) * len(outputs)
        params = [
            None if t is None else batch_first(t, d) for t, d in zip(params, in_dims[n_row_args:])
        ]
        per_element = [
            op(*(t[i] for t in rows), *(None if t is None else t[i] for t in params), *options)
            for i in range(size)
        ]
        return tuple(torch.stack(o) for o in zip(*per_element)), (0,) * len(per_element[0])

    op.register_vmap(rule)


_batched_rows(_rms_norm_fwd, 1)
_batched_rows(_rms_norm_add_fwd, 2)


def _backward_kernel(dy, x_or_h, weight, rstd, dh_out, offset, has_bias, bias_dtype, casting_mode):
    """``(dx, dweight, dbias)``, launching only when there are rows (the sums over no rows
    are zeros)."""
    if x_or_h.shape[0] == 0:
        dx, dweight, dbias = _allocate_backward(x_or_h, weight, has_bias, bias_dtype)
        return (
            dx,
            None if dweight is None else dweight.zero_(),
            (None if dbias is None else dbias.zero_()),
        )
    options = _BackwardOptions(offset, has_bias, bias_dtype, casting_mode, dialect.current())
    return _launcher(x_or_h.device).backward(dy, x_or_h, weight, rstd, dh_out, options)


def _present(*tensors) -> list[Tensor]:
    return [t for t in tensors if t is not None]


@torch.library.custom_op("nki_rmsnorm::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd(
    dy: Tensor,
    x: Tensor,
    weight: Tensor | None,
    rstd: Tensor,
    offset: float,
    has_bias: bool,
    bias_dtype: str | None,
    casting_mode: str,
) -> list[Tensor]:
    offset, bias_dtype = _check_backward_op(
        dy, x, weight, rstd, None, offset, has_bias, bias_dtype, casting_mode
    )
    return _present(
        *_backward_kernel(dy, x, weight, rstd, None, offset, has_bias, bias_dtype, casting_mode)
    )


@_rms_norm_bwd.register_fake
def _(dy, x, weight, rstd, offset, has_bias, bias_dtype, casting_mode):
    _, bias_dtype = _check_backward_op(
        dy, x, weight, rstd, None, offset, has_bias, bias_dtype, casting_mode
    )
    return _present(*_allocate_backward(x, weight, has_bias, bias_dtype))


@torch.library.custom_op("nki_rmsnorm::rms_norm_add_bwd", mutates_args=())
def _rms_norm_add_bwd(
    dy: Tensor,
    h: Tensor,
    weight: Tensor | None,
    rstd: Tensor,
    dh: Tensor | None,
    x_dtype: str,
    offset: float,
    has_bias: bool,
    bias_dtype: str | None,
    casting_mode: str,
) -> list[Tensor]:
    offset, bias_dtype = _check_backward_op(
        dy, h, weight, rstd, dh, offset, has_bias, bias_dtype, casting_mode, name="h"
    )
    x_dtype = _op_dtype(x_dtype, "x_dtype", optional=False)
    dh_total, dweight, dbias = _backward_kernel(
        dy, h, weight, rstd, dh, offset, has_bias, bias_dtype, casting_mode
    )
    # x and residual receive the same gradient, as two tensors: autograd accumulates into
    # each one's .grad in place, so they must not share storage.
    dx = dh_total.to(x_dtype, copy=True)
    return _present(dx, dh_total, dweight, dbias)


@_rms_norm_add_bwd.register_fake
def _(dy, h, weight, rstd, dh, x_dtype, offset, has_bias, bias_dtype, casting_mode):
    _, bias_dtype = _check_backward_op(
        dy, h, weight, rstd, dh, offset, has_bias, bias_dtype, casting_mode, name="h"
    )
    x_dtype = _op_dtype(x_dtype, "x_dtype", optional=False)
    dresidual, dweight, dbias = _allocate_backward(h, weight, has_bias, bias_dtype)
    return _present(torch.empty_like(h, dtype=x_dtype), dresidual, dweight, dbias)


# ---------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output, residual: bool):
    if residual:
        x, _, weight, bias, eps, offset, casting_mode, _ = inputs
        _, x_or_h, rstd = output
        ctx.x_dtype = x.dtype
    else:
        x_or_h, weight, bias, eps, offset, casting_mode, _ = inputs
        rstd = output[1]
    ctx.save_for_backward(x_or_h, weight, bias, rstd)
    ctx.eps, ctx.offset, ctx.casting_mode = eps, offset, casting_mode
    ctx.bias_dtype = None if bias is None else bias.dtype


def _differentiable_backward(ctx, dy, dh):
    """The backward in differentiable torch ops (fp32), for a graph of the gradient itself
    (``create_graph=True``: double backward, ``torch.func`` transforms of a gradient). ``rstd``
    is recomputed from ``h`` so that its dependence on ``h`` is part of the graph."""
    x_or_h, weight, bias, _ = ctx.saved_tensors
    with torch.enable_grad():
        h = x_or_h.float()
        rstd = torch.rsqrt(h.square().mean(-1, keepdim=True) + ctx.eps)
        xhat = h * rstd
        g = dy.float() if dy is not None else torch.zeros_like(h)
        scale = None if weight is None else weight.float() + ctx.offset
        gs = g if scale is None else g * scale
        dx = rstd * (gs - xhat * (gs * xhat).mean(-1, keepdim=True))
        if dh is not None:
            dx = dx + dh.float()
        dweight = None if weight is None else (g * xhat).sum(0).to(weight.dtype)
        dbias = None if bias is None else g.sum(0).to(bias.dtype)
    return dx.to(x_or_h.dtype), dweight, dbias


def _graph_of_gradient_needed(ctx, *tensors) -> bool:
    saved = ctx.saved_tensors
    return torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (*tensors, *saved[:3])
    )


def _fwd_backward(ctx, dy, _drstd):
    x, weight, bias, rstd = ctx.saved_tensors
    if _graph_of_gradient_needed(ctx, dy):
        dx, dweight, dbias = _differentiable_backward(ctx, dy, None)
    else:
        grads = iter(
            _rms_norm_bwd(
                dy,
                x,
                weight,
                rstd,
                ctx.offset,
                bias is not None,
                _dtype_arg(ctx.bias_dtype),
                ctx.casting_mode,
            )
        )
        dx = next(grads)
        dweight = None if weight is None else next(grads)
        dbias = None if bias is None else next(grads)
    return dx, dweight, dbias, None, None, None, None


def _add_fwd_backward(ctx, dy, dh, _drstd):
    h, weight, bias, rstd = ctx.saved_tensors
    if _graph_of_gradient_needed(ctx, dy, dh):
        dres, dweight, dbias = _differentiable_backward(ctx, dy, dh)
        dx = dres.to(ctx.x_dtype)
    else:
        if dy is None:  # only h was used downstream
            dy = torch.zeros_like(h, dtype=ctx.x_dtype)
        grads = iter(
            _rms_norm_add_bwd(
                dy,
                h,
                weight,
                rstd,
                dh,
                _dtype_arg(ctx.x_dtype),
                ctx.offset,
                bias is not None,
                _dtype_arg(ctx.bias_dtype),
                ctx.casting_mode,
            )
        )
        dx, dres = next(grads), next(grads)
        dweight = None if weight is None else next(grads)
        dbias = None if bias is None else next(grads)
    return dx, dres, dweight, dbias, None, None, None, None


def _setup_fwd_context(ctx, inputs, output):
    _setup_context(ctx, inputs, output, residual=False)


def _setup_add_fwd_context(ctx, inputs, output):
    _setup_context(ctx, inputs, output, residual=True)


torch.library.register_autograd(
    "nki_rmsnorm::rms_norm_fwd", _fwd_backward, setup_context=_setup_fwd_context
)
torch.library.register_autograd(
    "nki_rmsnorm::rms_norm_add_fwd", _add_fwd_backward, setup_context=_setup_add_fwd_context
)


class _RMSNormFunction(torch.autograd.Function):
    """The forward operator with the same ``setup_context`` and backward as its
    ``register_autograd`` registration, as an ``autograd.Function`` that ``torch.func``
    transforms accept: PyTorch 2.13's ``register_autograd`` wrapper lacks ``setup_context``,
    so ``torch.func.grad`` rejects it (pytorch/pytorch#170834). The public functions use it."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, weight, bias, eps, offset, casting_mode, out_dtype):
        return _rms_norm_fwd(x, weight, bias, eps, offset, casting_mode, _dtype_arg(out_dtype))

    setup_context = staticmethod(_setup_fwd_context)
    backward = staticmethod(_fwd_backward)


class _RMSNormAddFunction(torch.autograd.Function):
    """:class:`_RMSNormFunction` for the fused residual add."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, residual, weight, bias, eps, offset, casting_mode, out_dtype):
        return _rms_norm_add_fwd(
            x, residual, weight, bias, eps, offset, casting_mode, _dtype_arg(out_dtype)
        )

    setup_context = staticmethod(_setup_add_fwd_context)
    backward = staticmethod(_add_fwd_backward)


# ---------------------------------------------------------------------------------------------
# The forward with y in rmsnorm_tkg's transposed layout (ops.rms_norm_fwd's output_layout)
# ---------------------------------------------------------------------------------------------


#: Partitions of a NeuronCore: the leading axis of y in the transposed layout.
_PARTITIONS = 128


def _check_transposed_op(x, residual, weight, bias, eps, offset, casting_mode, out_dtype):
    """:func:`_check_forward_op` plus the transposed layout's own requirements (N divisible
    by 128, the NKI 0.6 kernels), before anything runs."""
    checked = _check_forward_op(x, residual, weight, bias, eps, offset, casting_mode, out_dtype)
    ops.check_output_layout("transposed", x, weight)
    return checked


def _empty_transposed(x, residual, out_dtype):
    """The transposed forward's outputs, shapes only: y_t ``(128, M, N // 128)``, h like x."""
    rows, n = x.shape
    y_t = x.new_empty((_PARTITIONS, rows, n // _PARTITIONS), dtype=out_dtype or x.dtype)
    rstd = x.new_empty((rows,), dtype=torch.float32)
    if residual is None:
        return y_t, rstd
    return y_t, x.new_empty(x.shape, dtype=residual.dtype), rstd


def _forward_transposed(x, residual, weight, bias, eps, offset, casting_mode, out_dtype):
    """Both transposed operators: launch on ``x``'s device, or nothing without rows."""
    if x.shape[0] == 0:
        return _empty_transposed(x, residual, out_dtype)
    options = _ForwardOptions(eps, offset, casting_mode, out_dtype, dialect.current())
    return _launcher(x.device).forward_transposed(x, weight, bias, residual, options)


@torch.library.custom_op("nki_rmsnorm::rms_norm_fwd_transposed", mutates_args=())
def _rms_norm_fwd_transposed(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    offset: float,
    casting_mode: str,
    out_dtype: str | None,
) -> tuple[Tensor, Tensor]:
    eps, offset, out_dtype = _check_transposed_op(
        x, None, weight, bias, eps, offset, casting_mode, out_dtype
    )
    return _forward_transposed(x, None, weight, bias, eps, offset, casting_mode, out_dtype)


@_rms_norm_fwd_transposed.register_fake
def _(x, weight, bias, eps, offset, casting_mode, out_dtype):
    *_, out_dtype = _check_transposed_op(
        x, None, weight, bias, eps, offset, casting_mode, out_dtype
    )
    return _empty_transposed(x, None, out_dtype)


@torch.library.custom_op("nki_rmsnorm::rms_norm_add_fwd_transposed", mutates_args=())
def _rms_norm_add_fwd_transposed(
    x: Tensor,
    residual: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    offset: float,
    casting_mode: str,
    out_dtype: str | None,
) -> tuple[Tensor, Tensor, Tensor]:
    eps, offset, out_dtype = _check_transposed_op(
        x, residual, weight, bias, eps, offset, casting_mode, out_dtype
    )
    return _forward_transposed(x, residual, weight, bias, eps, offset, casting_mode, out_dtype)


@_rms_norm_add_fwd_transposed.register_fake
def _(x, residual, weight, bias, eps, offset, casting_mode, out_dtype):
    *_, out_dtype = _check_transposed_op(
        x, residual, weight, bias, eps, offset, casting_mode, out_dtype
    )
    return _empty_transposed(x, residual, out_dtype)


def _rows_of(y_t: Tensor) -> Tensor:
    """The ``(M, N)`` tensor whose transposed layout ``y_t`` ``(128, M, N // 128)`` is."""
    parts, rows, per_partition = y_t.shape
    return y_t.permute(1, 0, 2).reshape(rows, parts * per_partition)


def _fwd_transposed_backward(ctx, dy_t, drstd):
    """The row-layout backward on the gradient rearranged back to rows: the transposed
    forward computes the same y bits, only stored elsewhere."""
    return _fwd_backward(ctx, None if dy_t is None else _rows_of(dy_t), drstd)


def _add_fwd_transposed_backward(ctx, dy_t, dh, drstd):
    return _add_fwd_backward(ctx, None if dy_t is None else _rows_of(dy_t), dh, drstd)


# The inputs and the rstd/h outputs sit where the row-layout operators have them, so their
# setup_context applies unchanged.
torch.library.register_autograd(
    "nki_rmsnorm::rms_norm_fwd_transposed",
    _fwd_transposed_backward,
    setup_context=_setup_fwd_context,
)
torch.library.register_autograd(
    "nki_rmsnorm::rms_norm_add_fwd_transposed",
    _add_fwd_transposed_backward,
    setup_context=_setup_add_fwd_context,
)


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def rms_norm(
    input: Tensor,
    normalized_shape,
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    offset: float = 0.0,
    bias: Tensor | None = None,
    casting_mode: str = "gemma",
    out_dtype: torch.dtype | None = None,
    output_layout: str = "rows",
) -> Tensor:
    """RMSNorm over the trailing ``normalized_shape`` dims, like ``torch.nn.functional.rms_norm``.

    ``y = x · rsqrt(mean(x²) + eps) · (weight + offset) + bias``, with the mean taken over the
    trailing dims (flattened into one hidden dim of ``prod(normalized_shape)``).

    Args:
        input: ``(*, *normalized_shape)``, float32, float16 or bfloat16, on the CPU
            (simulated kernels), a NeuronCore (``"xla"`` or ``"neuron"``) or ``"meta"``.
        normalized_shape: int or tuple, the trailing dims to normalise over.
        weight: ``normalized_shape``, float32 or the input dtype, or None (no scale).
        eps: added to the mean square; None is PyTorch's default,
            ``torch.finfo(torch.float32).eps`` for every supported dtype.
        offset: added to the weight in fp32 (Gemma's ``1 + w``).
        bias: ``normalized_shape``, added after scaling, or None.
        casting_mode: "gemma" (fp32 math, one rounding), "llama" (``x·rstd`` rounded to the
            input dtype before the weight multiply, as HF LlamaRMSNorm) or "none".
        out_dtype: dtype of ``y`` (float32, float16 or bfloat16); None is input's dtype.
        output_layout: "rows" (default) or "transposed": y in the layout of nki-library's
            decode kernel ``rmsnorm_tkg``, ``(128, M, N // 128)`` with M the leading dims
            flattened, N the hidden size and ``y_t[p, m, k] = y[m, p · (N // 128) + k]``
            (:func:`nki_rmsnorm.ops.rms_norm_fwd`), the same bits as "rows". Needs N
            divisible by 128 and the NKI 0.6 kernels (trn2/trn3); runs on CPU (simulated),
            "xla" (the ``nki.jit`` kernel) and "meta", not yet on TorchNeuron's "neuron"
            device (no output-parameter form). Differentiable: the backward rearranges the
            gradient back to rows and runs the row-layout backward (through
            ``torch.autograd``; the ``torch.func`` transforms take the "rows" form only).

    Returns:
        ``y`` of ``input``'s shape, in ``out_dtype``; ``(128, M, N // 128)`` when transposed.
    """
    shape, hidden, eps, offset = _check_args(
        input, normalized_shape, weight, bias, None, eps, offset, casting_mode, out_dtype
    )
    rows = input.reshape(-1, hidden)
    weight = None if weight is None else weight.reshape(hidden)
    if ops.check_output_layout(output_layout, rows, weight, check_dialect=False):
        y_t, _ = _rms_norm_fwd_transposed(
            rows,
            weight,
            None if bias is None else bias.reshape(hidden),
            eps,
            offset,
            casting_mode,
            _dtype_arg(out_dtype),
        )
        return y_t
    y, _ = _RMSNormFunction.apply(
        rows,
        weight,
        None if bias is None else bias.reshape(hidden),
        eps,
        offset,
        casting_mode,
        out_dtype,
    )
    return y.reshape(input.shape)


def fused_add_rms_norm(
    input: Tensor,
    residual: Tensor,
    weight: Tensor | None,
    eps: float | None = None,
    *,
    offset: float = 0.0,
    bias: Tensor | None = None,
    casting_mode: str = "gemma",
    out_dtype: torch.dtype | None = None,
    output_layout: str = "rows",
) -> tuple[Tensor, Tensor]:
    """``h = input + residual`` and ``y = rms_norm(h)`` over the last dim, in one kernel.

    The pre-norm transformer step: ``h`` is the new residual stream, ``y`` feeds the next
    block. Arguments as :func:`rms_norm` (``weight`` and ``bias`` of shape
    ``(input.shape[-1],)``); ``residual`` has ``input``'s shape and its dtype or float32
    (an fp32 residual stream); ``output_layout="transposed"`` gives ``y`` in rmsnorm_tkg's
    ``(128, M, N // 128)`` layout as in :func:`rms_norm`, ``h`` keeping ``input``'s shape.

    Returns:
        ``(y, h)`` of ``input``'s shape; ``y`` in ``out_dtype`` (default ``input``'s dtype),
        ``h`` in the residual's. Gradients flow from both into ``input``, ``residual``,
        ``weight`` and ``bias``.
    """
    if not isinstance(input, torch.Tensor) or input.dim() == 0:
        raise TypeError("input must be a torch.Tensor with at least one dim")
    if residual is None:
        raise TypeError("residual must be a torch.Tensor, got None; use rms_norm without one")
    _, hidden, eps, offset = _check_args(
        input, input.shape[-1:], weight, bias, residual, eps, offset, casting_mode, out_dtype
    )
    if ops.check_output_layout(output_layout, input, weight, check_dialect=False):
        y_t, h, _ = _rms_norm_add_fwd_transposed(
            input.reshape(-1, hidden),
            residual.reshape(-1, hidden),
            weight,
            bias,
            eps,
            offset,
            casting_mode,
            _dtype_arg(out_dtype),
        )
        return y_t, h.reshape(input.shape)
    y, h, _ = _RMSNormAddFunction.apply(
        input.reshape(-1, hidden),
        residual.reshape(-1, hidden),
        weight,
        bias,
        eps,
        offset,
        casting_mode,
        out_dtype,
    )
    return y.reshape(input.shape), h.reshape(input.shape)


class RMSNorm(nn.RMSNorm):
    """Drop-in for ``torch.nn.RMSNorm`` running the NKI kernels, with offset, bias and cast mode.

    A subclass of ``torch.nn.RMSNorm`` (``isinstance`` checks, weight-init and weight-decay
    rules written for it apply), with the same constructor and ``state_dict`` (``weight``),
    plus:

    Args:
        offset: added to the weight in fp32; ``weight`` is initialised to ``1 - offset`` so a
            fresh module scales by one (ones for ``offset=0``, zeros for Gemma's ``offset=1``).
        bias: add a learnable ``bias`` (initialised to zeros); needs ``elementwise_affine``.
        casting_mode: see :func:`rms_norm`.
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
        # The call's checks, first, so that a bad eps, offset or casting_mode names itself at
        # construction (check_options only asks whether a weight exists; affine or not is
        # checked below with its own message).
        _, offset = ops.check_options(
            torch.finfo(torch.float32).eps if eps is None else eps,
            offset,
            "weight",
            casting_mode,
        )
        if (bias or offset) and not elementwise_affine:
            raise ValueError(
                "bias and offset need elementwise_affine=True (they act on the weight)"
            )
        shape = _as_shape(normalized_shape)
        # torch.nn.RMSNorm.__init__ calls reset_parameters, which reads the offset
        self.offset = offset
        self.casting_mode = casting_mode
        super().__init__(shape, eps, elementwise_affine, device=device, dtype=dtype)
        self.normalized_shape = shape
        if bias:
            self.bias = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.constant_(self.weight, 1.0 - self.offset)
        if getattr(self, "bias", None) is not None:  # None while torch's __init__ runs
            nn.init.zeros_(self.bias)

    def forward(self, input: Tensor) -> Tensor:
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


def _replacement(module: nn.Module) -> nn.Module | None:
    """The NKI module that computes what ``module`` computes, sharing its ``weight``
    Parameter; None for a module of another kind (or one that already runs the kernels)."""
    if isinstance(module, RMSNorm):
        return None
    if type(module).__module__.startswith("transformers."):
        from nki_rmsnorm import hf  # a transformers module: transformers is installed

        return hf._replacement(module)
    if not isinstance(module, nn.RMSNorm):
        return None
    new = RMSNorm(module.normalized_shape, module.eps, module.elementwise_affine, device="meta")
    if module.weight is not None:
        new.weight = module.weight  # the same Parameter: optimiser state and ties unchanged
    return new.train(module.training)


def patch_module(model: nn.Module) -> list[str]:
    """Replace, in place, every ``torch.nn.RMSNorm`` of ``model`` by :class:`RMSNorm` (same
    ``weight`` Parameter and ``eps``, ``casting_mode="gemma"``: bit for bit
    ``torch.nn.functional.rms_norm`` in bf16/fp16), and every Hugging Face RMSNorm
    :mod:`nki_rmsnorm.hf` knows by its family's module; returns the qualified names of the
    replaced modules. For any ``torch.nn.Module``, HF or not."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    swaps = [
        (name, new)
        for name, module in model.named_modules()
        if (new := _replacement(module)) is not None
    ]
    for name, new in swaps:
        if not name:
            raise ValueError(
                "model is itself an RMSNorm; wrap it in a parent module or build "
                "nki_rmsnorm.torch.RMSNorm directly"
            )
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
    return [name for name, _ in swaps]


# ---------------------------------------------------------------------------------------------
# Quantized forward (inference: not differentiable)
# ---------------------------------------------------------------------------------------------

#: torch dtype of each fp8 output. torch has no IEEE-style e4m3 (max 240); its finite values
#: (all |y_q| ≤ 240 the kernel writes) have the same bits in ``float8_e4m3fn``, so the
#: e4m3 result comes back as a ``float8_e4m3fn`` tensor holding the same values.
_TORCH_FP8 = {
    "float8_e4m3": torch.float8_e4m3fn,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
_TORCH_FP8_NAMES = {torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}


def _fp8_from_numpy(a: np.ndarray, name: str) -> Tensor:
    bits = torch.from_numpy(np.ascontiguousarray(a).view(np.uint8))
    return bits.view(_TORCH_FP8[name])


def _quant_shapes(x: Tensor, scale_mode: str, block: int, packed: bool):
    lead, n = tuple(x.shape[:-1]), x.shape[-1]
    q_shape = lead + ((n + 4,) if packed else (n,))
    if scale_mode == "static" or packed:
        scale_shape = None
    else:
        scale_shape = lead + ((n // block,) if scale_mode == "block" else ())
    return q_shape, scale_shape, lead


def _quant_fake(
    x, residual, quant_dtype, scale_mode, block, return_y, return_amax, packed, return_transposed
):
    q_shape, scale_shape, lead = _quant_shapes(x, scale_mode, block, packed)
    outputs = [x.new_empty(q_shape, dtype=_TORCH_FP8[quant_dtype])]
    if scale_shape is not None:
        outputs.append(x.new_empty(scale_shape, dtype=torch.float32))
    if return_y:
        outputs.append(torch.empty_like(x))
    if residual is not None:
        outputs.append(torch.empty_like(residual))
    if return_amax:
        outputs.append(x.new_empty(lead, dtype=torch.float32))
    if return_transposed:
        n, m = x.shape[-1], math.prod(lead)
        outputs.append(x.new_empty((n, m), dtype=_TORCH_FP8[quant_dtype]))
        if scale_mode != "static":
            outputs.append(x.new_empty((n, -(-m // 128)), dtype=torch.float32))
    return outputs


@torch.library.custom_op("nki_rmsnorm::rms_norm_quant", mutates_args=())
def _rms_norm_quant(
    x: Tensor,
    weight: Tensor | None,
    residual: Tensor | None,
    static_scale: Tensor | None,
    eps: float,
    quant_dtype: str,
    scale_mode: str,
    block: int,
    lower_bound: float | None,
    scale_floor: float,
    return_y: bool,
    return_amax: bool,
    packed: bool,
    return_transposed: bool,
) -> list[Tensor]:
    _require_cpu(x, "rms_norm_quant")
    result = ops.rms_norm_quant(
        _to_numpy(x),
        _to_numpy_or_none(weight),
        eps,
        residual=_to_numpy_or_none(residual),
        quant_dtype=quant_dtype,
        scale_mode=scale_mode,
        block=block,
        static_scale=None if static_scale is None else _to_numpy(static_scale),
        lower_bound=lower_bound,
        scale_floor=scale_floor,
        return_y=return_y,
        return_amax=return_amax,
        packed=packed,
        return_transposed=return_transposed,
    )
    outputs = [_fp8_from_numpy(result.y_q, quant_dtype)]
    for extra in (result.scales, result.y, result.h, result.amax):
        if extra is not None:
            outputs.append(_from_numpy(extra))
    if return_transposed:
        outputs.append(_fp8_from_numpy(result.y_q_t, quant_dtype))
        if result.scales_t is not None:
            outputs.append(_from_numpy(result.scales_t))
    return outputs


@_rms_norm_quant.register_fake
def _(
    x,
    weight,
    residual,
    static_scale,
    eps,
    quant_dtype,
    scale_mode,
    block,
    lower_bound,
    scale_floor,
    return_y,
    return_amax,
    packed,
    return_transposed,
):
    return _quant_fake(
        x,
        residual,
        quant_dtype,
        scale_mode,
        block,
        return_y,
        return_amax,
        packed,
        return_transposed,
    )


# ---------------------------------------------------------------------------------------------
# The query and key norms in one launch
# ---------------------------------------------------------------------------------------------


def _check_qk_op(q, k, q_weight, k_weight, eps, offset, casting_mode, out_dtype):
    """Every argument of the fused QK-norm operator, before anything runs; returns
    ``(eps, offset, out_dtype)`` with ``out_dtype`` a ``torch.dtype`` or None."""
    for name, t, weight in (("q", q, q_weight), ("k", k, k_weight)):
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            # a per-head weight: t is (tokens, heads, head_dim)
            _check_heads_op(t, weight, name, f"{name}_weight")
        else:
            _check_rows(name, t)
            if weight is not None:
                _check_tensor(f"{name}_weight", weight, (t.shape[1],), t, (torch.float32, t.dtype))
    if k.device != q.device:
        raise ValueError(f"k is on {k.device} but q is on {q.device}")
    out = _op_dtype(out_dtype, "out_dtype")
    if out is None and q.dtype != k.dtype:
        raise TypeError(
            f"q and k have different dtypes ({_dtype_name(q.dtype)}, {_dtype_name(k.dtype)}): "
            "pass out_dtype (the one launch writes both in it)"
        )
    if offset and (q_weight is None or k_weight is None):
        raise ValueError(
            f"offset={offset} shifts the weights (weight + offset): it needs q_weight and "
            "k_weight, got None"
        )
    eps, offset = ops.check_options(
        eps, offset, q_weight if q_weight is not None else k_weight, casting_mode
    )
    return eps, offset, out


@torch.library.custom_op("nki_rmsnorm::rms_norm_qk_fwd", mutates_args=())
def _rms_norm_qk_fwd(
    q: Tensor,
    k: Tensor,
    q_weight: Tensor | None,
    k_weight: Tensor | None,
    eps: float,
    offset: float,
    casting_mode: str,
    out_dtype: str | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    eps, offset, out = _check_qk_op(q, k, q_weight, k_weight, eps, offset, casting_mode, out_dtype)
    _require_cpu(q, "rms_norm_qk")
    outputs = ops.rms_norm_qk_fwd(
        _to_numpy(q),
        _to_numpy(k),
        _to_numpy_or_none(q_weight),
        _to_numpy_or_none(k_weight),
        eps,
        offset=offset,
        casting_mode=casting_mode,
        out_dtype=None if out is None else _NUMPY_DTYPES[out],
    )
    return tuple(_from_numpy(a) for a in outputs)


@_rms_norm_qk_fwd.register_fake
def _(q, k, q_weight, k_weight, eps, offset, casting_mode, out_dtype):
    *_, out = _check_qk_op(q, k, q_weight, k_weight, eps, offset, casting_mode, out_dtype)
    return (
        torch.empty_like(q, dtype=out or q.dtype),
        torch.empty_like(k, dtype=out or k.dtype),
        q.new_empty(q.shape[:-1], dtype=torch.float32),
        k.new_empty(k.shape[:-1], dtype=torch.float32),
    )


def _qk_setup_context(ctx, inputs, output):
    q, k, q_weight, k_weight, _eps, offset, casting_mode, _ = inputs
    ctx.save_for_backward(q, k, q_weight, k_weight, output[2], output[3])
    ctx.offset, ctx.casting_mode = offset, casting_mode


def _qk_backward(ctx, dy_q, dy_k, _drstd_q, _drstd_k):
    """Each tensor's gradient by the backward operator, as the separate forwards'."""
    q, k, q_weight, k_weight, rstd_q, rstd_k = ctx.saved_tensors
    grads = []
    for x, weight, rstd, dy in ((q, q_weight, rstd_q, dy_q), (k, k_weight, rstd_k, dy_k)):
        if dy is None:
            dy = torch.zeros_like(x)
        offset = ctx.offset if weight is not None else 0.0
        if x.dim() == 3:  # a per-head weight
            result = _rms_norm_heads_bwd(dy, x, weight, rstd, offset, ctx.casting_mode)
        else:
            result = _rms_norm_bwd(dy, x, weight, rstd, offset, False, None, ctx.casting_mode)
        grads.append((result[0], None if weight is None else result[1]))
    (dq, dq_weight), (dk, dk_weight) = grads
    return dq, dk, dq_weight, dk_weight, None, None, None, None


_rms_norm_qk_fwd.register_autograd(_qk_backward, setup_context=_qk_setup_context)


def _qk_rows(t: Tensor, weight) -> Tensor:
    """``t`` as the operator's rows: (tokens, heads, head_dim) for a per-head weight equal
    to its last two dims, else (rows, head_dim) (any other weight meets the operator's
    shape check)."""
    if isinstance(weight, Tensor) and weight.dim() == 2 and t.dim() >= 2:
        if tuple(t.shape[-2:]) == tuple(weight.shape):
            return t.reshape((-1,) + tuple(weight.shape))
    return t.reshape(-1, t.shape[-1])


def rms_norm_qk(
    q: Tensor,
    k: Tensor,
    q_weight: Tensor | None = None,
    k_weight: Tensor | None = None,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    casting_mode: str = "gemma",
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """The query and key norms of an attention (QK-norm, Qwen3 / Gemma 3; Megatron's fused
    call) in one kernel launch: ``(y_q, y_k)``, each normalised over its last dim with its
    own weight, bit for bit what :func:`rms_norm` gives each alone; differentiable (the
    backward runs the backward kernel per tensor). The arguments are those of
    :func:`nki_rmsnorm.ops.rms_norm_qk`, as tensors (``out_dtype`` a ``torch.dtype``;
    per-head ``(heads, head_dim)`` weights as :func:`rms_norm_heads` takes, then bit for bit
    what it gives); CPU tensors (the simulated kernels) and ``"meta"`` only so far."""
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() == 0 or t.shape[-1] == 0:
            raise ValueError(
                f"{name} must have a non-empty last (normalised) dimension, got shape "
                f"{tuple(t.shape)}"
            )
    y_q, y_k, _, _ = _rms_norm_qk_fwd(
        _qk_rows(q, q_weight),
        _qk_rows(k, k_weight),
        q_weight,
        k_weight,
        eps,
        offset,
        casting_mode,
        _dtype_arg(out_dtype),
    )
    return y_q.reshape(q.shape), y_k.reshape(k.shape)


def rms_norm_quant(
    input: Tensor,
    weight: Tensor | None = None,
    eps: float = 1e-6,
    *,
    residual: Tensor | None = None,
    quant_dtype: str | torch.dtype | None = None,
    scale_mode: str = "row",
    block: int = 128,
    static_scale: float | Tensor | None = None,
    lower_bound: float | None = None,
    scale_floor: float = 1e-6,
    return_y: bool = False,
    return_amax: bool = False,
    packed: bool = False,
    return_transposed: bool = False,
) -> ops.QuantizedRMSNorm:
    """RMSNorm over the last dim, quantized to fp8 in one pass (inference; no autograd).

    The arguments and outputs are those of :func:`nki_rmsnorm.ops.rms_norm_quant`, as
    tensors: ``quant_dtype`` a name or ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``
    (the IEEE-style trn2 e4m3 comes back as ``torch.float8_e4m3fn`` with the same bits and
    values, |y_q| ≤ 240); ``static_scale`` a float or a one-element float32 tensor. Returns
    an :class:`~nki_rmsnorm.ops.QuantizedRMSNorm` of tensors (None where absent).
    Launches ``torch.ops.nki_rmsnorm.rms_norm_quant`` (with a fake implementation for
    ``torch.compile`` / meta tensors).
    """
    for name, t in (("input", input), ("weight", weight), ("residual", residual)):
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if isinstance(quant_dtype, torch.dtype):
        if quant_dtype not in _TORCH_FP8_NAMES:
            raise TypeError(
                f"quant_dtype must be torch.float8_e4m3fn or torch.float8_e5m2 "
                f"(or a name), got {quant_dtype}"
            )
        quant_dtype = _TORCH_FP8_NAMES[quant_dtype]
    name = ops.quant_dtype_name(quant_dtype, ops.target_nc_version())
    if isinstance(static_scale, Tensor):
        if static_scale.dtype != torch.float32:
            raise TypeError(f"static_scale must be float32, got {static_scale.dtype}")
    elif static_scale is not None:
        static_scale = torch.tensor(ops._static_scale(static_scale)[0, 0])
    for flag, flag_name in (
        (return_y, "return_y"),
        (return_amax, "return_amax"),
        (packed, "packed"),
        (return_transposed, "return_transposed"),
    ):
        if not isinstance(flag, bool):
            raise TypeError(f"{flag_name} must be a bool, got {type(flag).__name__}")
    # the operator's schema would refuse these with a RuntimeError: name them first
    if not isinstance(scale_mode, str) or scale_mode not in ops.SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {ops.SCALE_MODES}, got {scale_mode!r}")
    if isinstance(block, bool) or not isinstance(block, int):
        raise TypeError(f"block must be an int, got {type(block).__name__}")
    eps, scale_floor = validation.real(eps, "eps"), validation.real(scale_floor, "scale_floor")
    if lower_bound is not None:
        lower_bound = validation.real(lower_bound, "lower_bound")
    if input.device.type == "meta":
        outputs = _quant_fake(
            input,
            residual,
            name,
            scale_mode,
            block,
            return_y,
            return_amax,
            packed,
            return_transposed,
        )
    else:
        outputs = torch.ops.nki_rmsnorm.rms_norm_quant(
            input,
            weight,
            residual,
            static_scale,
            eps,
            name,
            scale_mode,
            block,
            lower_bound,
            scale_floor,
            return_y,
            return_amax,
            packed,
            return_transposed,
        )
    outputs = list(outputs)
    y_q = outputs.pop(0)
    scales = None
    if not packed and scale_mode != "static":
        scales = outputs.pop(0)
    y = outputs.pop(0) if return_y else None
    h = outputs.pop(0) if residual is not None else None
    amax = outputs.pop(0) if return_amax else None
    y_q_t = outputs.pop(0) if return_transposed else None
    scales_t = outputs.pop(0) if return_transposed and scale_mode != "static" else None
    return ops.QuantizedRMSNorm(y_q, scales, y, h, amax, y_q_t, scales_t)


# --- MX-quantized forward (trn3) ---------------------------------------------------------------
_TORCH_MX_SCALES = {"float8_e8m0fnu": torch.float8_e8m0fnu, "uint8": torch.uint8}


def _mx_fake(x: Tensor, residual: Tensor | None, scale_dtype: str) -> list[Tensor]:
    n, m = x.shape[-1], math.prod(x.shape[:-1])
    outputs = [
        x.new_empty((n // 4, m), dtype=torch.uint32),
        x.new_empty((n // mx.MX_BLOCK, m), dtype=_TORCH_MX_SCALES[scale_dtype]),
    ]
    if residual is not None:
        outputs.append(torch.empty_like(residual))
    return outputs


@torch.library.custom_op("nki_rmsnorm::rms_norm_mx_quant", mutates_args=())
def _rms_norm_mx_quant(
    x: Tensor,
    weight: Tensor | None,
    residual: Tensor | None,
    eps: float,
    quant_dtype: str,
    scale_dtype: str,
) -> list[Tensor]:
    _require_cpu(x, "rms_norm_mx_quant")
    result = mx.rms_norm_mx_quant(
        _to_numpy(x),
        _to_numpy_or_none(weight),
        eps,
        residual=_to_numpy_or_none(residual),
        quant_dtype=quant_dtype,
        scale_dtype=scale_dtype,
    )
    scale_bits = torch.from_numpy(np.ascontiguousarray(result.scales).view(np.uint8))
    outputs = [torch.from_numpy(result.y_q), scale_bits.view(_TORCH_MX_SCALES[scale_dtype])]
    if result.h is not None:
        outputs.append(_from_numpy(result.h))
    return outputs


@_rms_norm_mx_quant.register_fake
def _(x, weight, residual, eps, quant_dtype, scale_dtype):
    return _mx_fake(x, residual, scale_dtype)


def rms_norm_mx_quant(
    input: Tensor,
    weight: Tensor | None = None,
    eps: float = 1e-6,
    *,
    residual: Tensor | None = None,
    quant_dtype: str = "float8_e4m3fn_x4",
    scale_dtype: str | torch.dtype = "float8_e8m0fnu",
) -> mx.MXQuantizedRMSNorm:
    """RMSNorm over the last dim, MXFP8-quantized in one pass on trn3 (inference; no
    autograd). The arguments and outputs are those of :func:`nki_rmsnorm.mx.rms_norm_mx_quant`,
    as tensors: ``y_q`` (N / 4, M) ``torch.uint32`` (the packed bits), ``scales`` (N / 32, M)
    ``torch.float8_e8m0fnu`` (``scale_dtype`` "float8_e8m0fnu" or that dtype) or
    ``torch.uint8``. Launches ``torch.ops.nki_rmsnorm.rms_norm_mx_quant`` (with a fake
    implementation for ``torch.compile`` / meta tensors)."""
    for name, t in (("input", input), ("weight", weight), ("residual", residual)):
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if isinstance(scale_dtype, torch.dtype):
        names = {v: k for k, v in _TORCH_MX_SCALES.items()}
        if scale_dtype not in names:
            raise TypeError(
                f"scale_dtype must be torch.float8_e8m0fnu or torch.uint8, got {scale_dtype}"
            )
        scale_dtype = names[scale_dtype]
    # the operator's schema would refuse these with a RuntimeError: name them first
    for value, argname, allowed in (
        (quant_dtype, "quant_dtype", mx.MX_QUANT_DTYPES),
        (scale_dtype, "scale_dtype", mx.MX_SCALE_DTYPES),
    ):
        if not isinstance(value, str) or value not in allowed:
            raise TypeError(f"{argname} must be one of {', '.join(allowed)}, got {value!r}")
    eps = validation.real(eps, "eps")
    mx.check_mx_target()
    if input.shape and input.shape[-1] % mx.MX_CHUNK:
        raise ValueError(
            f"input's last dimension N={input.shape[-1]} must be a multiple of {mx.MX_CHUNK} "
            "for MX quantization"
        )
    if input.device.type == "meta":
        outputs = _mx_fake(input, residual, scale_dtype)
    else:
        outputs = torch.ops.nki_rmsnorm.rms_norm_mx_quant(
            input, weight, residual, eps, quant_dtype, scale_dtype
        )
    return mx.MXQuantizedRMSNorm(
        outputs[0], outputs[1], outputs[2] if residual is not None else None
    )


# ---------------------------------------------------------------------------------------------
# A per-head weight (QK-norm with a weight per head)
# ---------------------------------------------------------------------------------------------


def _check_heads_op(x, weight, name="x", weight_name="weight"):
    """``x`` (tokens, heads, N) and ``weight`` (heads, N) of the per-head operators: shapes,
    dtypes, device and the kernels' "packed" limits, before anything runs."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {_dtype_name(x.dtype)}")
    if x.dim() != 3 or x.shape[2] == 0:
        raise ValueError(
            f"{name} must be 3-D (tokens, heads, head_dim) with head_dim > 0, got shape "
            f"{tuple(x.shape)}"
        )
    _require_cpu(x, "the per-head weight", meta=True)
    _check_tensor(weight_name, weight, tuple(x.shape[1:]), x, (torch.float32, x.dtype))
    validation.check_head_weight(weight_name, tuple(weight.shape), x.element_size())


@torch.library.custom_op("nki_rmsnorm::rms_norm_heads_fwd", mutates_args=())
def _rms_norm_heads_fwd(
    x: Tensor, weight: Tensor, eps: float, offset: float, casting_mode: str, out_dtype: str | None
) -> tuple[Tensor, Tensor]:
    _check_heads_op(x, weight)
    eps, offset = ops.check_options(eps, offset, weight, casting_mode)
    out = _op_dtype(out_dtype, "out_dtype")
    y, rstd = ops.rms_norm_fwd(
        _to_numpy(x),
        _to_numpy(weight),
        eps,
        offset=offset,
        casting_mode=casting_mode,
        out_dtype=None if out is None else _NUMPY_DTYPES[out],
    )
    return _from_numpy(y), _from_numpy(rstd)


@_rms_norm_heads_fwd.register_fake
def _(x, weight, eps, offset, casting_mode, out_dtype):
    _check_heads_op(x, weight)
    ops.check_options(eps, offset, weight, casting_mode)
    out = _op_dtype(out_dtype, "out_dtype")
    return torch.empty_like(x, dtype=out or x.dtype), x.new_empty(x.shape[:2], dtype=torch.float32)


@torch.library.custom_op("nki_rmsnorm::rms_norm_heads_bwd", mutates_args=())
def _rms_norm_heads_bwd(
    dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, offset: float, casting_mode: str
) -> tuple[Tensor, Tensor]:
    _check_heads_op(x, weight)
    _check_tensor("dy", dy, x.shape, x, SUPPORTED_DTYPES)
    _check_tensor("rstd", rstd, x.shape[:2], x, (torch.float32,))
    dx, dweight, _ = ops.rms_norm_bwd(
        _to_numpy(dy),
        _to_numpy(x),
        _to_numpy(weight),
        _to_numpy(rstd),
        offset=offset,
        casting_mode=casting_mode,
    )
    return _from_numpy(dx), _from_numpy(dweight)


@_rms_norm_heads_bwd.register_fake
def _(dy, x, weight, rstd, offset, casting_mode):
    _check_heads_op(x, weight)
    _check_tensor("dy", dy, x.shape, x, SUPPORTED_DTYPES)
    _check_tensor("rstd", rstd, x.shape[:2], x, (torch.float32,))
    return torch.empty_like(x), torch.empty_like(weight)


def _heads_setup_context(ctx, inputs, output):
    x, weight, _eps, offset, casting_mode, _ = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.offset, ctx.casting_mode = offset, casting_mode


def _heads_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dweight = _rms_norm_heads_bwd(dy, x, weight, rstd, ctx.offset, ctx.casting_mode)
    return dx, dweight, None, None, None, None


_rms_norm_heads_fwd.register_autograd(_heads_backward, setup_context=_heads_setup_context)


def rms_norm_heads(
    input: Tensor,
    weight: Tensor,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    casting_mode: str = "gemma",
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """RMSNorm over the last dim of ``input`` ``(..., heads, head_dim)`` with a per-head
    ``weight`` ``(heads, head_dim)`` (QK-norm with a weight per head, as Liger's and Quack's
    RMSNorm take): the row of head i is scaled by ``weight[i] + offset``. A separate
    function rather than :func:`rms_norm`'s ``normalized_shape``, where a 2-D weight means a
    norm over both dims. Differentiable: ``weight``'s gradient is per head (one launch of
    the backward kernel with the 2-D weight, :func:`nki_rmsnorm.ops.rms_norm_bwd`). Launches
    ``torch.ops.nki_rmsnorm.rms_norm_heads_fwd`` (with a fake implementation); head_dim ·
    bytes ≤ 512 and heads ≤ 4 · (512 // head_dim) (else a ``ValueError`` naming ``weight``); CPU
    tensors (the simulated kernels) and ``"meta"`` only so far."""
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"input must be a torch.Tensor, got {type(input).__name__}")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if input.dim() < 2 or weight.dim() != 2 or tuple(input.shape[-2:]) != tuple(weight.shape):
        raise ValueError(
            "weight must have shape (heads, head_dim) = input.shape[-2:], got weight "
            f"{tuple(weight.shape)} for input {tuple(input.shape)}"
        )
    heads, n = weight.shape
    y, _ = _rms_norm_heads_fwd(
        input.reshape(-1, heads, n), weight, eps, offset, casting_mode, _dtype_arg(out_dtype)
    )
    return y.reshape(input.shape)
