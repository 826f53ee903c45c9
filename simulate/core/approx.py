"""Approximate transcendentals: the Scalar engine's activation functions as the hardware
promises them, not as NumPy computes them.

The docs promise little: the Scalar engine's activation functions "are approximated with
piece-wise polynomials", and "if input values fall outside the supported Valid Input Range
... the Scalar Engine will generate invalid output results"
(``general/nki/api/nki.api.shared.rst@8a38e733``, L127-L130, table L137-L187). No accuracy
figure is published; the same page only says that the GpSimd engine computes ``rsqrt``
(L447) and the Vector engine computes ``reciprocal`` (L419) "at a higher precision compared
to Scalar Engine".

In approximate mode (``NKI_SIM_APPROX=1``, :func:`set_approx` or :func:`use_approx`):

- every transcendental activation result of the Scalar engine is multiplied by ``1 + e``,
  where ``e`` in ``[-bound, bound]`` is a deterministic hash of the input's float32 bits
  (the same input always gets the same error, so runs are reproducible, and neighbouring
  inputs get unrelated errors, as a table-driven polynomial's would). The default bound is
  2⁻⁹, half an ulp of bfloat16: the weakest accuracy a kernel producing bf16 outputs could
  tolerate, and the least the hardware plausibly offers, since the engine is fed fp32;
- an input outside the function's documented Valid Input Range gives NaN ("invalid output").

Modeled exact: the piece-wise linear/quadratic functions a polynomial reproduces exactly
(identity/copy, square, relu, sign, abs); the Vector engine's arithmetic and ``reciprocal``
and the GpSimd engine's ``rsqrt`` (documented as the more precise engines; no bound is
published for them either, so exact is the only reading that is not invented).
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import numpy as np

DEFAULT_BOUND = 2.0**-9

_EXACT = frozenset({"copy", "identity", "square", "relu", "sign", "abs"})

# nki.api.shared.rst@8a38e733, table "Supported Activation Functions by NKI ISA": (lo, hi)
# of the Valid Input Range; symmetric=True means ±[lo, hi]
VALID_RANGES = {
    "log": (2.0**-64, 2.0**64, False),  # L172
    "sin": (-np.pi, np.pi, False),  # L174
    "arctan": (-np.pi / 2, np.pi / 2, False),  # L176
    "sqrt": (2.0**-116, 2.0**118, False),  # L178
    "rsqrt": (2.0**-87, 2.0**97, False),  # L180
    "reciprocal": (2.0**-42, 2.0**42, True),  # L182
}


def _from_env() -> float:
    value = os.environ.get("NKI_SIM_APPROX", "")
    if value.lower() in ("", "0", "false", "no", "off"):
        return 0.0
    return DEFAULT_BOUND


_ENV_BOUND = _from_env()
_bound: contextvars.ContextVar[float] = contextvars.ContextVar("nki_sim_approx", default=_ENV_BOUND)


def approx_bound() -> float:
    """The relative error bound in force (0.0: exact transcendentals)."""
    return _bound.get()


def _check(bound: float) -> float:
    bound = float(bound)
    if not 0.0 <= bound < 0.5:
        raise ValueError(f"approximation bound must be in [0, 0.5), got {bound}")
    return bound


def set_approx(enabled: bool = True, bound: float = DEFAULT_BOUND) -> float:
    """Turn approximate transcendentals on (relative error up to ``bound``) or off in the
    current context; returns the previous bound."""
    previous = _bound.get()
    _bound.set(_check(bound) if enabled else 0.0)
    return previous


@contextlib.contextmanager
def use_approx(enabled: bool = True, bound: float = DEFAULT_BOUND):
    """``with simulate.use_approx(): ...`` approximates inside the block only."""
    token = _bound.set(_check(bound) if enabled else 0.0)
    try:
        yield _bound.get()
    finally:
        _bound.reset(token)


def _unit_hash(x: np.ndarray) -> np.ndarray:
    """A uniform value in [-1, 1) from each element's float32 bits (a 32-bit integer mix)."""
    h = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    h = (h ^ (h >> np.uint64(16))) * np.uint64(0x7FEB352D) & np.uint64(0xFFFFFFFF)
    h = (h ^ (h >> np.uint64(15))) * np.uint64(0x846CA68B) & np.uint64(0xFFFFFFFF)
    h = h ^ (h >> np.uint64(16))
    return (h.astype(np.float64) / 2.0**31 - 1.0).astype(np.float32)


def scalar_engine(name: str, inputs: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The Scalar engine's result of activation ``name`` on fp32 ``inputs`` given the exact
    fp32 ``values``: unchanged when approximation is off or the function is exact."""
    bound = _bound.get()
    if not bound or name in _EXACT:
        return values
    out = np.array(values, np.float32, copy=True)
    with np.errstate(all="ignore"):
        out *= np.float32(1.0) + np.float32(bound) * _unit_hash(inputs)
        valid = VALID_RANGES.get(name)
        if valid is not None:
            lo, hi, symmetric = valid
            magnitude = np.abs(inputs) if symmetric else inputs
            out[~((magnitude >= lo) & (magnitude <= hi))] = np.nan
    return out
