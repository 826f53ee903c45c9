"""The math behind every NKI operator name, in float32 NumPy.

``nl.exp`` and friends, and NumPy ufuncs such as ``np.add``, can be passed as ``op=`` to
``nisa`` instructions; :func:`lookup` maps any of them to an :class:`OpSpec`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_SQRT_HALF = np.float32(np.sqrt(0.5))
_TWO_OVER_SQRT_PI = 2.0 / np.sqrt(np.pi)


def _erf(x):
    # Abramowitz & Stegun 7.1.26 in float64: |error| < 1.5e-7, i.e. about 1 fp32 ulp
    x64 = np.asarray(x, np.float64)
    t = 1.0 / (1.0 + 0.3275911 * np.abs(x64))
    poly = t * (
        0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429)))
    )
    return (np.sign(x64) * (1.0 - poly * np.exp(-x64 * x64))).astype(np.float32)


def _sigmoid(x):
    with np.errstate(over="ignore"):
        return (1.0 / (1.0 + np.exp(-x))).astype(np.float32)


def _gelu(x):
    return x * np.float32(0.5) * (np.float32(1.0) + _erf(x * _SQRT_HALF))


def _gelu_dx(x):
    cdf = np.float32(0.5) * (np.float32(1.0) + _erf(x * _SQRT_HALF))
    pdf = np.exp(np.float32(-0.5) * x * x) * np.float32(1.0 / np.sqrt(2 * np.pi))
    return cdf + x * pdf


def _gelu_tanh(x):
    inner = np.float32(np.sqrt(2.0 / np.pi)) * (x + np.float32(0.044715) * x * x * x)
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(inner))


def _silu_dx(x):
    s = _sigmoid(x)
    return s + x * s * (np.float32(1.0) - s)


def _softplus(x):
    return np.logaddexp(np.float32(0.0), x).astype(np.float32)


def _rsqrt(x):
    with np.errstate(divide="ignore", invalid="ignore"):
        return (np.float32(1.0) / np.sqrt(x)).astype(np.float32)


def _reciprocal(x):
    with np.errstate(divide="ignore"):
        return (np.float32(1.0) / x).astype(np.float32)


def _logical_shift_right(a, b):
    a = np.asarray(a)
    unsigned = a.astype(a.dtype.str.replace("i", "u")) if a.dtype.kind == "i" else a
    return np.right_shift(unsigned, np.asarray(b).astype(unsigned.dtype)).astype(a.dtype)


def _abs_max(x, y):
    # the input of larger magnitude, signed; y on a tie (nki/api/nki/language/__init__.py
    # @81ce03ae, L838-L879)
    return np.where(np.abs(x) > np.abs(y), x, y)


def _abs_min(x, y):
    # the input of smaller magnitude, signed; y on a tie (same file, L882-L923)
    return np.where(np.abs(x) < np.abs(y), x, y)


UNARY = {
    "copy": lambda x: x,
    "identity": lambda x: x,
    "square": np.square,
    "abs": np.abs,
    "negative": np.negative,
    "sign": np.sign,
    "trunc": np.trunc,
    "floor": np.floor,
    "ceil": np.ceil,
    "exp": np.exp,
    "log": np.log,
    "sqrt": np.sqrt,
    "rsqrt": _rsqrt,
    "reciprocal": _reciprocal,
    "sin": np.sin,
    "cos": np.cos,
    "tan": np.tan,
    "tanh": np.tanh,
    "arctan": np.arctan,
    "sigmoid": _sigmoid,
    "relu": lambda x: np.maximum(x, np.float32(0)),
    "gelu": _gelu,
    "gelu_dx": _gelu_dx,
    "gelu_apprx_tanh": _gelu_tanh,
    "gelu_apprx_sigmoid": lambda x: x * _sigmoid(np.float32(1.702) * x),
    "silu": lambda x: x * _sigmoid(x),
    "silu_dx": _silu_dx,
    "erf": _erf,
    "erf_dx": lambda x: np.float32(_TWO_OVER_SQRT_PI) * np.exp(-x * x),
    "softplus": _softplus,
    "mish": lambda x: x * np.tanh(_softplus(x)),
    "logical_not": lambda x: (x == 0).astype(np.float32),
}
# what nisa.activation accepts (SHARED "Supported Activation Functions" plus the reciprocal
# and abs the ISA docs list); nl.* routes these and cos/tan to the Scalar engine
ACTIVATIONS = frozenset(UNARY) - {"negative", "trunc", "floor", "ceil", "logical_not", "cos", "tan"}
TRANSCENDENTAL = ACTIVATIONS | {"cos", "tan"}

BINARY = {
    "add": np.add,
    "subtract": np.subtract,
    "multiply": np.multiply,
    "divide": np.divide,
    "power": np.power,
    "maximum": np.maximum,
    "minimum": np.minimum,
    "mod": np.mod,
    "fmod": np.fmod,
    "abs_max": _abs_max,
    "abs_min": _abs_min,
    "equal": np.equal,
    "not_equal": np.not_equal,
    "greater": np.greater,
    "greater_equal": np.greater_equal,
    "less": np.less,
    "less_equal": np.less_equal,
    "logical_and": np.logical_and,
    "logical_or": np.logical_or,
    "logical_xor": np.logical_xor,
}
BITVEC = {
    "bitwise_and": np.bitwise_and,
    "bitwise_or": np.bitwise_or,
    "bitwise_xor": np.bitwise_xor,
    "left_shift": np.left_shift,
    "right_shift": _logical_shift_right,
    "invert": np.invert,
}
COMPARISONS = frozenset(
    {
        "equal",
        "not_equal",
        "greater",
        "greater_equal",
        "less",
        "less_equal",
        "logical_and",
        "logical_or",
        "logical_xor",
    }
)
_REDUCERS = {
    "add": np.sum,
    "multiply": np.prod,
    "maximum": np.max,
    "minimum": np.min,
    "bitwise_and": np.bitwise_and.reduce,
    "bitwise_or": np.bitwise_or.reduce,
    "bitwise_xor": np.bitwise_xor.reduce,
    "logical_and": np.all,
    "logical_or": np.any,
    "logical_xor": lambda v, axis: np.logical_xor.reduce(v != 0, axis=axis),
}

_UFUNC_NAMES = {
    np.add: "add",
    np.subtract: "subtract",
    np.multiply: "multiply",
    np.divide: "divide",
    np.true_divide: "divide",
    np.power: "power",
    np.maximum: "maximum",
    np.minimum: "minimum",
    np.max: "maximum",
    np.min: "minimum",
    np.amax: "maximum",
    np.amin: "minimum",
    np.mod: "mod",
    np.fmod: "fmod",
    np.equal: "equal",
    np.not_equal: "not_equal",
    np.greater: "greater",
    np.greater_equal: "greater_equal",
    np.less: "less",
    np.less_equal: "less_equal",
    np.logical_and: "logical_and",
    np.logical_or: "logical_or",
    np.logical_xor: "logical_xor",
    np.logical_not: "logical_not",
    np.bitwise_and: "bitwise_and",
    np.bitwise_or: "bitwise_or",
    np.bitwise_xor: "bitwise_xor",
    np.left_shift: "left_shift",
    np.right_shift: "right_shift",
    np.invert: "invert",
    np.exp: "exp",
    np.log: "log",
    np.sqrt: "sqrt",
    np.square: "square",
    np.abs: "abs",
    np.absolute: "abs",
    np.negative: "negative",
    np.tanh: "tanh",
    np.sin: "sin",
    np.cos: "cos",
    np.tan: "tan",
    np.arctan: "arctan",
    np.sign: "sign",
    np.reciprocal: "reciprocal",
    np.sum: "add",
    np.prod: "multiply",
}


@dataclass(frozen=True)
class OpSpec:
    name: str

    @property
    def unary(self) -> bool:
        return self.name in UNARY

    @property
    def bitvec(self) -> bool:
        return self.name in BITVEC

    def apply(self, *operands, out=None):
        """The op on NumPy operands. With ``out`` (a float32 work array the caller owns) a
        NumPy ufunc computes in float32 into it; the result may still be a new array."""
        if self.name in UNARY and self.name not in BINARY:
            fn, operands = UNARY[self.name], operands[:1]
        else:
            fn = BINARY.get(self.name) or BITVEC[self.name]
        with np.errstate(all="ignore"):
            if (
                out is not None
                and isinstance(fn, np.ufunc)
                and fn.nout == 1
                and (self.name not in COMPARISONS)
            ):
                return fn(*operands, out=out, dtype=np.float32, casting="unsafe")
            return np.asarray(fn(*operands))

    def reduce(self, values, axis):
        if self.name not in _REDUCERS:
            from .errors import NKIValueError

            raise NKIValueError(f"{self.name} cannot reduce", "err_unsupported_reduce_op")
        with np.errstate(all="ignore"):
            return _REDUCERS[self.name](values, axis=axis)


def lookup(op, argname: str = "op") -> OpSpec:
    """The :class:`OpSpec` of an NKI op (``nl.add``), a NumPy ufunc (``np.add``) or a name."""
    from .errors import NKIValueError

    name = getattr(op, "__nki_op__", None)
    if name is None and isinstance(op, str):
        name = op
    if name is None:
        try:
            name = _UFUNC_NAMES.get(op)
        except TypeError:
            name = None
    if name is None or (name not in UNARY and name not in BINARY and name not in BITVEC):
        raise NKIValueError(
            f"`{argname}`={op!r} is not an NKI operator", "err_unsupported_operator"
        )
    return OpSpec(name)
