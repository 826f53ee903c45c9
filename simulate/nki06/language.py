"""``nki.language`` (0.6): buffers, dtypes, tensor creation, the experimental ``nl.*``
convenience functions (each lowers to ``nki.isa`` instructions into a new tile), loops,
LNC program ids and ``nl.tile_size``.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import math
import warnings

import numpy as np

from simulate.core.dtypes import is_number
from simulate.core.memory import Placement
from simulate.core.targets import PMAX

from . import context, release
from . import dtypes as dt
from . import isa as nisa
from .dtypes import (  # noqa: F401 - the nl.* dtype names
    bfloat16,
    bool_,
    float4_e2m1fn_x4,
    float8_e4m3,
    float8_e4m3fn,
    float8_e4m3fn_x4,
    float8_e5m2,
    float8_e5m2_x4,
    float8_e8m0fnu,
    float16,
    float32,
    int8,
    int16,
    int32,
    tfloat32,
    uint8,
    uint16,
    uint32,
)
from .errors import NkiTypeError, NkiValidationError, NkiValueError
from .tensor import MemoryRegion, NkiTensor, allocate

sbuf = MemoryRegion.sbuf
psum = MemoryRegion.psum
private_hbm = MemoryRegion.private_hbm
hbm = MemoryRegion.private_hbm  # STUB-NL: nl.hbm is private_hbm
shared_hbm = MemoryRegion.shared_hbm


class NKIObject:
    """Base class of user objects a kernel may take (LG "Values").

    Classes "with and without the @dataclass decorator will be compiled in the same way" and
    "the compiler will create the initializer functions __init__ and __post_init__, if they
    are not provided by the user" (``nki/get-started/nki-language-guide.rst@81ce03ae``
    L590–602): a subclass without an ``__init__`` of its own gets :func:`_generated_init`
    (also under ``@dataclass``, whose own initializer it replaces), which takes the annotated
    fields positionally or by keyword, defaulting to the class value or None, and also the
    un-annotated class attributes by keyword, as AWS's kernels build them
    (aws-neuron/nki-library@d2ad3a5 ``src/nkilib_src/nkilib/core/attention/attention_cte.py``
    L868–876, built at L708)."""

    def __init__(self, **kwargs):
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        inherited = cls.__init__
        if "__init__" not in cls.__dict__ and (
            inherited is NKIObject.__init__ or getattr(inherited, "generated", False)
        ):
            cls.__init__ = _generated_init  # in the class dict: @dataclass keeps it


def _annotated_fields(cls) -> list[str]:
    names: list[str] = []
    for klass in reversed(cls.__mro__):
        for name, annotation in vars(klass).get("__annotations__", {}).items():
            if name not in names and "ClassVar" not in str(annotation):
                names.append(name)
    return names


def _default(cls, name):
    field = getattr(cls, "__dataclass_fields__", {}).get(name)
    if field is not None:
        if field.default_factory is not dataclasses.MISSING:
            return field.default_factory()
        if field.default is not dataclasses.MISSING:
            return field.default
        return None
    return getattr(cls, name, None)


def _generated_init(self, *args, **kwargs):
    """The compiler-made initializer of the language guide (L595–602)."""
    cls = type(self)
    fields = _annotated_fields(cls)
    if len(args) > len(fields):
        raise NkiTypeError(
            f"{cls.__name__}() takes {len(fields)} positional arguments (its annotated fields "
            f"{fields}) but {len(args)} were given"
        )
    values = dict(zip(fields, args))
    for key, value in kwargs.items():
        if key in values:
            raise NkiTypeError(f"{cls.__name__}() got multiple values for argument '{key}'")
        if key not in fields and (key.startswith("__") or not hasattr(cls, key)):
            raise NkiTypeError(
                f"{cls.__name__}() got an unexpected keyword argument '{key}': the generated "
                "__init__ takes the class's fields and class attributes"
            )
        values[key] = value
    for name in fields:
        if name not in values:
            values[name] = _default(cls, name)
    for key, value in values.items():
        object.__setattr__(self, key, value)  # frozen dataclasses are built the same way
    post_init = getattr(self, "__post_init__", None)
    if post_init is not None:
        post_init()


_generated_init.generated = True


def is_hbm(buffer) -> bool:
    return buffer in (private_hbm, shared_hbm)


def is_on_chip(buffer) -> bool:
    return buffer in (sbuf, psum)


def is_psum(buffer) -> bool:
    return buffer is psum


def is_sbuf(buffer) -> bool:
    return buffer is sbuf


# --- nl.tile_size (TS, nki/api/nki.language.tile_size.rst@81ce03ae) ------------------------------
class _TileSize:
    pmax = PMAX
    psum_bank_fmax = 512
    psum_bank_fmax_bytes = 2048
    gemm_stationary_fmax = 128
    gemm_moving_fmax = 512
    bn_stats_fmax = 512
    psum_min_align = 4
    sbuf_min_align = 1

    @property
    def psum_fmax(self) -> int:
        warnings.warn(
            "nl.tile_size.psum_fmax is deprecated since NKI 0.4: use psum_bank_fmax",
            DeprecationWarning,
            stacklevel=2,
        )
        return 512

    @property
    def psum_num_banks(self) -> int:
        release.require("nl.tile_size.psum_num_banks")
        import os

        as_pe = os.environ.get("NKI_DMA_TRANSPOSE_AS_PE_TRANSPOSE", "").lower() == "true"
        return 7 if as_pe and _target().nc_version >= 3 else 8

    @property
    def sbuf_fmax_bytes(self) -> int:
        return _target().sbuf_bytes_per_partition

    @property
    def sbuf_fmax(self) -> int:
        return self.sbuf_fmax_bytes // 4

    @property
    def sbuf_size_bytes(self) -> int:
        return PMAX * self.sbuf_fmax_bytes

    @property
    def total_available_sbuf_size(self) -> int:
        warnings.warn(
            "nl.tile_size.total_available_sbuf_size is deprecated since NKI 0.4: use "
            "sbuf_fmax_bytes",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.sbuf_fmax_bytes


def _target():
    program = context.active()
    return program.target if program is not None else context.target_from_env()


tile_size = _TileSize()


# --- creation -----------------------------------------------------------------------------------
def ndarray(shape, dtype, buffer=sbuf, name="", address=None) -> NkiTensor:
    """Uninitialised storage (the simulator fills floats with NaN, integers with 4).
    ``address=(partition, byte offset)`` is checked (PSUM: bank-aligned) and honoured: tensors
    the kernel places at overlapping addresses must not be live at once
    (:func:`simulate.core.memory.check_placement_clashes`). The offset is in bytes, as AWS's
    kernels compute it ("lists of virtual byte addresses", ``bank_id * PSUM_BANK_SIZE``:
    aws-neuron-sdk@81ce03ae nki/migration/index.rst L1117-L1121, L1144-L1150)."""
    if address is not None:
        part, offset = (int(a) for a in address)
        if buffer is psum and offset % 2048:
            raise NkiValidationError(
                f"ndarray address {address}: a PSUM tensor starts on a 2 KiB bank boundary"
            )
        if not 0 <= part < PMAX:
            raise NkiValidationError(f"ndarray address {address}: partition out of range")
    tensor = allocate(shape, dtype, buffer, name)
    if address is not None and tensor.storage.id in context.current("nl.ndarray").tiles:
        rows = tensor.shape[0] if tensor.shape else 1
        nbytes = math.prod(tensor.shape[1:]) * tensor.dtype.itemsize
        context.current("nl.ndarray").placements[tensor.storage.id] = [
            Placement(0, part, part + rows, offset, offset + nbytes)
        ]
    return tensor


def zeros(shape, dtype, buffer=sbuf, name="") -> NkiTensor:
    return full(shape, 0, dtype, buffer, name)


def ones(shape, dtype, buffer=sbuf, name="") -> NkiTensor:
    return full(shape, 1, dtype, buffer, name)


def full(shape, fill_value, dtype, buffer=sbuf, name="") -> NkiTensor:
    """A filled tensor: on chip a ``memset`` instruction, in HBM filled at allocation."""
    if is_hbm(buffer):
        return allocate(shape, dtype, buffer, name, fill=fill_value)
    out = allocate(shape, dtype, buffer, name)
    value = int(fill_value) if dt.is_int(out.dtype) else float(fill_value)
    nisa.memset(dst=out, value=value)
    return out


def zeros_like(x, dtype=None, buffer=None, name="") -> NkiTensor:
    return zeros(x.shape, dtype or x.dtype, buffer or sbuf, name)


def empty_like(x, dtype=None, buffer=None, name="") -> NkiTensor:
    return ndarray(x.shape, dtype or x.dtype, buffer or x.buffer, name)


def shared_constant(constant) -> NkiTensor:
    """A ``shared_hbm`` tensor initialised from a NumPy array or a ``.npy`` path."""
    array = np.load(constant) if isinstance(constant, str) else np.asarray(constant)
    t = allocate(array.shape, dt.as_dtype(array.dtype), shared_hbm, "shared_constant", fill=None)
    t.array()[...] = array
    return t


def shared_identity_matrix(n, dtype=uint8, dst=None) -> NkiTensor:
    """An n x n identity in SBUF (spec decision: SBUF, see its use with nl.transpose)."""
    out = dst if dst is not None else allocate((n, n), dtype, sbuf, "identity", fill=None)
    out.array()[...] = dt.cast(np.eye(n, dtype=np.float32), out.dtype, out.array().dtype)
    return out


# --- movement -------------------------------------------------------------------------------------
def ds(start, size):
    """``nl.ds(start, size)``: the slice ``start:start + size``."""
    return slice(start, start + size)


def load(src: NkiTensor, dtype=None) -> NkiTensor:
    """HBM view -> a new SBUF tile of the same shape (a rank-1 source gives ``(n, 1)``)."""
    shape = tuple(src.shape) if src.ndim > 1 else (src.shape[0], 1)
    tile = ndarray(shape, dtype or src.dtype, sbuf)
    nisa.dma_copy(dst=tile, src=src)
    return tile


def store(dst: NkiTensor, value: NkiTensor) -> None:
    """SBUF tile -> HBM view (equal element counts)."""
    if value.buffer is psum:
        warnings.warn("nl.store of a PSUM tile: may not compile (RN 0.3 known issue)", stacklevel=2)
        staged = ndarray(value.shape, value.dtype, sbuf)
        nisa.tensor_copy(dst=staged, src=value)
        value = staged
    nisa.dma_copy(dst=dst, src=value)


def copy(x, dtype=None) -> NkiTensor:
    """A new SBUF tile with the same layout (Vector ``tensor_copy``, stable since 0.6)."""
    out = ndarray(x.shape, dtype or x.dtype, sbuf)
    nisa.tensor_copy(dst=out, src=x)
    return out


def broadcast_to(x, shape, dtype=None) -> NkiTensor:
    """Expand size-1 dims (including the partition dim, as the fused-mamba example does)
    into a new tile; ``x`` itself when it already has ``shape``."""
    shape = tuple(int(n) for n in shape)
    if tuple(x.shape) == shape and dtype is None:
        return x
    if len(shape) != x.ndim or any(a not in (1, b) for a, b in zip(x.shape, shape)):
        raise NkiValidationError(f"broadcast_to: cannot broadcast {tuple(x.shape)} to {shape}")
    out = ndarray(shape, dtype or x.dtype, sbuf)
    view = x
    for dim in builtins.range(1, len(shape)):
        if x.shape[dim] == 1 and shape[dim] > 1:
            view = view.broadcast(dim, shape[dim])
    if x.shape[0] == shape[0]:
        nisa.tensor_copy(dst=out, src=view)
    else:  # a partition broadcast: one copy per partition (the compiler uses a DMA or PE)
        for p in builtins.range(shape[0]):
            nisa.tensor_copy(dst=out[p : p + 1], src=view)
    return out


def where(condition, x, y, dtype=None) -> NkiTensor:
    """``x`` where ``condition`` (1/0 values) is non-zero, else ``y``; ``x``/``y`` tiles or
    numbers (a copy of ``y`` and a predicated copy of ``x``)."""
    template = next(v for v in (x, y, condition) if isinstance(v, NkiTensor))
    out_dtype = dtype or (x.dtype if isinstance(x, NkiTensor) else template.dtype)
    out = ndarray(template.shape, out_dtype, sbuf)
    if isinstance(y, NkiTensor):
        nisa.tensor_copy(dst=out, src=y)
    else:
        nisa.memset(dst=out, value=y)
    predicate = ndarray(condition.shape, uint8, sbuf)
    nisa.tensor_scalar(dst=predicate, data=condition, op0=not_equal, operand0=0.0)
    source = copy(x, out_dtype) if isinstance(x, NkiTensor) and x.dtype is not out_dtype else x
    nisa.tensor_copy_predicated(dst=out, src=source, predicate=predicate)
    return out


def load_transpose2d(src, dtype=None) -> NkiTensor:
    """A 2-D HBM tensor -> its transpose in a new SBUF tile (DMA transpose)."""
    if src.ndim != 2:
        raise NkiValidationError(f"load_transpose2d takes a 2-D tensor, got {tuple(src.shape)}")
    out = ndarray((src.shape[1], src.shape[0]), src.dtype, sbuf)
    nisa.dma_transpose(dst=out, src=src)
    return out if dtype is None else copy(out, dtype)


def expand_dims(x, axis) -> NkiTensor:
    return x.expand_dim(axis)


def matmul(x, y, transpose_x=False) -> NkiTensor:
    """``x @ y`` (``x.T @ y`` with ``transpose_x``) into a new float32 PSUM tile."""
    if not transpose_x:
        warnings.warn(
            "nl.matmul without transpose_x=True fails on hardware (RN 0.3 known "
            "issue); simulated as x @ y",
            stacklevel=2,
        )
        xt = ndarray((x.shape[1], x.shape[0]), x.dtype, psum if x.shape[0] <= 32 else psum)
        nisa.nc_transpose(dst=xt, data=x)
        staged = ndarray(xt.shape, x.dtype, sbuf)
        nisa.tensor_copy(dst=staged, src=xt)
        x = staged
    out = ndarray((x.shape[1], y.shape[1]), float32, psum)
    nisa.nc_matmul(dst=out, stationary=x, moving=y)
    return out


def transpose(x, dtype=None) -> NkiTensor:
    """2-D partition <-> free swap into a new PSUM tile (Tensor engine)."""
    out = ndarray((x.shape[1], x.shape[0]), x.dtype, psum)
    nisa.nc_transpose(dst=out, data=x, engine=nisa.engine.tensor)
    return out if dtype is None else copy(out, dtype)


# --- elementwise math -----------------------------------------------------------------------------
def _binary(op, x, y, dtype, api):
    if is_number(x) and is_number(y):
        raise NkiTypeError(f"nl.{api} needs at least one tensor operand")
    if is_number(y) or (
        isinstance(y, NkiTensor)
        and isinstance(x, NkiTensor)
        and y.size // y.shape[0] == 1 < x.size // x.shape[0]
    ):
        tile, other, reverse = x, y, False
    elif is_number(x) or (x.size // x.shape[0] == 1 < y.size // y.shape[0]):
        tile, other, reverse = y, x, True
    else:
        if tuple(x.shape) != tuple(y.shape):
            raise NkiValidationError(
                f"nl.{api}: operands {tuple(x.shape)} and "
                f"{tuple(y.shape)} differ (nl.* binary ops do not "
                "broadcast)"
            )
        out = ndarray(x.shape, dtype or dt.promote(x.dtype, y.dtype), sbuf)
        nisa.tensor_tensor(dst=out, data1=x, data2=y, op=op)
        return out
    if isinstance(other, NkiTensor):
        warnings.warn(
            f"nl.{api} broadcasting a (P, 1) tile along the free dims may not compile", stacklevel=3
        )
        if other.dtype is not float32:
            other = copy(other, float32)
        out_dtype = dtype or dt.promote(tile.dtype, other.dtype)
    else:
        out_dtype = dtype or tile.dtype
    out = ndarray(tile.shape, out_dtype, sbuf)
    nisa.tensor_scalar(dst=out, data=tile, op0=op, operand0=other, reverse0=reverse)
    return out


def _named_binary(opname):
    def function(x, y, dtype=None):
        return _binary(_OPS[opname], x, y, dtype, opname)

    function.__name__ = function.__qualname__ = opname
    function.__nki_op__ = opname
    function.__doc__ = f"``nl.{opname}(x, y, dtype=None)`` elementwise into a new SBUF tile."
    return function


def _named_unary(opname, vector=False):
    def function(x, dtype=None):
        out = ndarray(x.shape, dtype or x.dtype, sbuf)
        if vector:
            nisa.tensor_scalar(dst=out, data=x, op0=function, operand0=None)
        else:
            nisa.activation(dst=out, op=function, data=x)
        return out

    function.__name__ = function.__qualname__ = opname
    function.__nki_op__ = opname
    function.__doc__ = f"``nl.{opname}(x, dtype=None)`` elementwise into a new SBUF tile."
    return function


_OPS: dict = {}


def _register(function):
    _OPS[function.__nki_op__] = function
    return function


add = _register(_named_binary("add"))
subtract = _register(_named_binary("subtract"))
multiply = _register(_named_binary("multiply"))
divide = _register(_named_binary("divide"))
maximum = _register(_named_binary("maximum"))
minimum = _register(_named_binary("minimum"))
power = _register(_named_binary("power"))
fmod = _register(_named_binary("fmod"))
mod = _register(_named_binary("mod"))
equal = _register(_named_binary("equal"))
not_equal = _register(_named_binary("not_equal"))
less = _register(_named_binary("less"))
less_equal = _register(_named_binary("less_equal"))
greater = _register(_named_binary("greater"))
greater_equal = _register(_named_binary("greater_equal"))
bitwise_and = _register(_named_binary("bitwise_and"))
bitwise_or = _register(_named_binary("bitwise_or"))
bitwise_xor = _register(_named_binary("bitwise_xor"))
left_shift = _register(_named_binary("left_shift"))
right_shift = _register(_named_binary("right_shift"))
logical_and = _register(_named_binary("logical_and"))
logical_or = _register(_named_binary("logical_or"))
logical_xor = _register(_named_binary("logical_xor"))
# NeuronCore-v4+ (nki/api/nki/language/__init__.py@81ce03ae, L838-L923; core.rules)
abs_max = _register(_named_binary("abs_max"))
abs_min = _register(_named_binary("abs_min"))
# Scalar-engine activations
exp = _register(_named_unary("exp"))
log = _register(_named_unary("log"))
sqrt = _register(_named_unary("sqrt"))
tanh = _register(_named_unary("tanh"))
sigmoid = _register(_named_unary("sigmoid"))
relu = _register(_named_unary("relu"))
gelu = _register(_named_unary("gelu"))
gelu_apprx_sigmoid = _register(_named_unary("gelu_apprx_sigmoid"))
gelu_apprx_tanh = _register(_named_unary("gelu_apprx_tanh"))
gelu_dx = _register(_named_unary("gelu_dx"))
silu = _register(_named_unary("silu"))
silu_dx = _register(_named_unary("silu_dx"))
softplus = _register(_named_unary("softplus"))
mish = _register(_named_unary("mish"))
erf = _register(_named_unary("erf"))
erf_dx = _register(_named_unary("erf_dx"))
sin = _register(_named_unary("sin"))
arctan = _register(_named_unary("arctan"))
sign = _register(_named_unary("sign"))
square = _register(_named_unary("square"))
abs = _register(_named_unary("abs"))  # noqa: A001 - the NKI name
# Vector-engine unary ALU ops
reciprocal = _register(_named_unary("reciprocal", vector=True))
negative = _register(_named_unary("negative", vector=True))
ceil = _register(_named_unary("ceil", vector=True))
floor = _register(_named_unary("floor", vector=True))
trunc = _register(_named_unary("trunc", vector=True))
cos = _register(_named_unary("cos", vector=True))
tan = _register(_named_unary("tan", vector=True))
logical_not = _register(_named_unary("logical_not", vector=True))


def rsqrt(x, dtype=None) -> NkiTensor:
    """``1/sqrt(x)`` on GpSimd since 0.5 (more precise than the Scalar engine; no PSUM)."""
    out = ndarray(x.shape, dtype or x.dtype, sbuf)
    nisa.tensor_scalar(dst=out, data=x, op0=rsqrt, operand0=None, engine=nisa.engine.gpsimd)
    return out


rsqrt.__nki_op__ = "rsqrt"
_register(rsqrt)
copy.__nki_op__ = "copy"


def invert(x, dtype=None) -> NkiTensor:
    """Bitwise NOT: XOR with all ones (STUB-NL)."""
    out = ndarray(x.shape, dtype or x.dtype, sbuf)
    nisa.tensor_scalar(dst=out, data=x, op0=bitwise_xor, operand0=-1)
    return out


invert.__nki_op__ = "invert"
_register(invert)


# --- reductions -----------------------------------------------------------------------------------
def _reduced_shape(x, axes, keepdims):
    kept = [n for d, n in enumerate(x.shape) if d not in axes or keepdims]
    kept = [1 if d in axes else n for d, n in enumerate(x.shape)] if keepdims else kept
    if x.on_chip and len(kept) < 2:  # spec decision: (P, F) reduced over F gives (P, 1)
        kept.append(1)
    return tuple(kept)


def _reduce(op, x, axis, dtype, keepdims, api):
    axes = tuple(
        sorted({int(a) % x.ndim for a in (axis if isinstance(axis, (list, tuple)) else (axis,))})
    )
    out = ndarray(_reduced_shape(x, axes, keepdims), dtype or x.dtype, sbuf)
    nisa.tensor_reduce(dst=out, op=op, data=x, axis=axes, keepdims=keepdims)
    return out


def sum(x, axis, dtype=None, keepdims=False):  # noqa: A001 - the NKI name
    return _reduce(add, x, axis, dtype, keepdims, "sum")


def max(x, axis, dtype=None, keepdims=False):  # noqa: A001
    return _reduce(maximum, x, axis, dtype, keepdims, "max")


def min(x, axis, dtype=None, keepdims=False):  # noqa: A001
    return _reduce(minimum, x, axis, dtype, keepdims, "min")


def prod(x, axis, dtype=None, keepdims=False):
    return _reduce(multiply, x, axis, dtype, keepdims, "prod")


def mean(x, axis, dtype=None, keepdims=False):
    """Sum in float32, times 1/n."""
    total = _reduce(add, x, axis, float32, keepdims, "mean")
    axes = axis if isinstance(axis, (list, tuple)) else (axis,)
    count = math.prod(x.shape[int(a) % x.ndim] for a in axes)
    out = ndarray(total.shape, dtype or x.dtype, sbuf)
    nisa.tensor_scalar(dst=out, data=total, op0=multiply, operand0=1.0 / count)
    return out


def var(x, axis, dtype=None, keepdims=False):
    """Population variance over free ``axis``; dims are always kept (STUB-NL)."""
    axes = tuple(
        sorted({int(a) % x.ndim for a in (axis if isinstance(axis, (list, tuple)) else (axis,))})
    )
    flat = x.flatten_dims(axes[0], x.ndim - 1) if len(axes) > 1 else x
    centred = ndarray(flat.shape, float32, sbuf)
    mu = mean(flat, axis=flat.ndim - 1, dtype=float32, keepdims=True)
    nisa.tensor_tensor(
        dst=centred, data1=flat, data2=mu.broadcast(flat.ndim - 1, flat.shape[-1]), op=subtract
    )
    squared = ndarray(flat.shape, float32, sbuf)
    nisa.activation(dst=squared, op=square, data=centred)
    result = mean(squared, axis=flat.ndim - 1, dtype=dtype or x.dtype, keepdims=True)
    kept = tuple(1 if d in axes else n for d, n in enumerate(x.shape))
    return result.reshape(kept)


def all(x, axis, dtype=None):  # noqa: A001 - the NKI name
    """1 where every element along ``axis`` is non-zero, else 0."""
    nonzero = ndarray(x.shape, float32, sbuf)
    nisa.tensor_scalar(dst=nonzero, data=x, op0=not_equal, operand0=0.0)
    return _reduce(minimum, nonzero, axis, dtype or x.dtype, False, "all")


# --- loops and control flow (STUB-NL, MIG 0.5->0.6) ------------------------------------------
def _range(start, stop=None, step=1):
    return builtins.range(start, stop, step) if stop is not None else builtins.range(start)


def affine_range(start, stop=None, step=1):
    """Deprecated alias of ``range`` (STUB-NL, ABOUT)."""
    return _range(start, stop, step)


sequential_range = static_range = affine_range
# ``nl.range``: not in the 0.6 API reference, but AWS's code loops with it as with
# affine_range (aws-neuron/nki-library@d2ad3a5
# src/nkilib_src/nkilib/experimental/mxfp_subkernels/mxfp_load_utils.py L123, L130), and the
# stubs call affine_range "an alias for Python's range()" (nki/api/nki/language/__init__.py
# @81ce03ae L2317-2322): the same unrolled loop
range = affine_range  # noqa: A001 - the NKI name


def dynamic_range(start, stop=None, step=1):
    warnings.warn(
        "nl.dynamic_range is deprecated in NKI 0.6: use nl.fori_loop",
        DeprecationWarning,
        stacklevel=2,
    )
    # "dynamic_range loops inside a nl.no_reorder() block are not currently supported"
    # (nki/deep-dives/nki-dynamic-loops.rst@81ce03ae L136-145; language/__init__.py L2251-2254)
    _runtime_loop("nl.dynamic_range")
    if isinstance(step, nisa.VirtualRegister) or not isinstance(step, int) or step < 1:
        raise NkiValidationError(
            f"dynamic_range step must be a compile-time positive int, got {step!r} "
            "(nki/api/nki/language/__init__.py@81ce03ae L2415)"
        )
    bounds = _range(_value(start), None if stop is None else _value(stop), step)
    return _induction_registers(bounds)


def _induction_registers(bounds):
    """The loop variable of a ``dynamic_range`` loop: "a device register, not a Python
    ``int``" (nki/deep-dives/nki-dynamic-loops.rst@81ce03ae L110-113), frozen
    (nki/get-started/nki-language-guide.rst L532), usable as a tensor index (L518-521)."""
    for i in bounds:
        yield nisa.VirtualRegister(i, read_only=True)


def _value(bound) -> int:
    """A loop bound: an int or the value a register holds when the simulation reaches it."""
    return bound.value if isinstance(bound, nisa.VirtualRegister) else int(bound)


def fori_loop(lower, upper, body_fun, step=1) -> None:
    """``for i in range(lower, upper, step): body_fun(i)`` on the device; ``i`` is a read-only
    register; the body returns nothing."""
    release.require("nl.fori_loop")
    _runtime_loop("nl.fori_loop")
    if not isinstance(step, int) or step < 1:
        raise NkiValidationError(f"fori_loop step must be a positive int, got {step!r}")
    with _loop_body("nl.fori_loop"):
        for i in builtins.range(_value(lower), _value(upper), step):
            if body_fun(nisa.VirtualRegister(i, read_only=True)) is not None:
                raise NkiValidationError(
                    "fori_loop body_fun must not return a value (carry state in SBUF/HBM)"
                )


def while_loop(init, body_fun) -> None:
    """``r = init; while r != 0: r = body_fun(r)`` on the device."""
    release.require("nl.while_loop")
    _runtime_loop("nl.while_loop")
    register = init
    with _loop_body("nl.while_loop"):
        while register.value if isinstance(register, nisa.VirtualRegister) else int(register):
            register = body_fun(register)
            if not isinstance(register, nisa.VirtualRegister):
                raise NkiValidationError(
                    "while_loop body_fun must return the next condition VirtualRegister"
                )


@contextlib.contextmanager
def _loop_body(api):
    """Tensors declared in a runtime loop's body "cannot be referenced outside of the loop"
    (nki/migration/index.rst@81ce03ae L139-140): they expire when the loop ends, and any
    later read or write of them raises (``NkiTensor._flat``)."""
    program = context.current(api)
    program.loop_body_storages.append([])
    program.loop_serial += 1
    program.loop_scopes.append(program.loop_serial)  # NkiInstruction.depends_on reads them
    try:
        yield
    finally:
        program.loop_scopes.pop()
        for storage in program.loop_body_storages.pop():
            storage.expired = api


@contextlib.contextmanager
def no_reorder():
    """Pins program order (the simulator runs in program order anyway); runtime loops may not
    sit inside (MIG 0.5->0.6, ``nki/migration/index.rst@81ce03ae``, line 141)."""
    program = context.current("nl.no_reorder")
    program.no_reorder_depth += 1
    try:
        yield
    finally:
        program.no_reorder_depth -= 1


def _runtime_loop(api):
    if context.current(api).no_reorder_depth:
        raise NkiValidationError(
            f"{api} cannot sit inside an nl.no_reorder() block: 'Register-based dynamic loops "
            "... are not supported inside a no_reorder block' (nki/api/nki/language/"
            "__init__.py@81ce03ae L2251-2254; nki/migration/index.rst L141)"
        )


# --- LNC / SPMD ------------------------------------------------------------------------------
def program_id(axis=0) -> int:
    """The physical core of an LNC launch (0 or 1); 0 without a launch grid."""
    program = context.current("nl.program_id")
    if int(axis) != 0:
        raise NkiValueError(f"nl.program_id(axis={axis}): an LNC launch has one axis")
    return program.program_id


def num_programs(axes=0) -> int:
    program = context.current("nl.num_programs")
    if int(axes) != 0:
        raise NkiValueError(f"nl.num_programs(axes={axes}): an LNC launch has one axis")
    return program.launch.lnc


def program_ndim() -> int:
    return context.current("nl.program_ndim").launch.grid_ndim


def device_print(print_prefix, tensor) -> None:
    print(
        print_prefix,
        np.asarray(tensor.values(), np.float64 if dt.is_float(tensor.dtype) else np.int64),
    )
