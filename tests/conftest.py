"""Shared test helpers: a reproducible per-test random generator and NaN-poisoned outputs."""

from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture
def rng(request):
    """A generator seeded from the test id: reproducible, and different for every test."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def poison(shape, dtype=np.float32) -> np.ndarray:
    """An output buffer whose every element a kernel must overwrite: NaN for floats, the
    largest value for integers, True for bool."""
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        return np.full(shape, np.iinfo(dtype).max, dtype)
    if dtype.kind == "b":
        return np.ones(shape, dtype)
    return np.full(shape, np.nan, dtype)


def random_array(rng, shape, dtype, low=-4.0, high=4.0) -> np.ndarray:
    """Uniform random data in ``dtype`` (integers: the whole range clipped to [low, high]
    for small types, never all equal)."""
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        lo, hi = max(info.min, int(low)), min(info.max, int(high))
        return rng.integers(lo, hi + 1, size=shape).astype(dtype)
    return rng.uniform(low, high, size=shape).astype(np.float32).astype(dtype)


@pytest.fixture(name="poison")
def poison_fixture():
    """The :func:`poison` helper as a fixture."""
    return poison


@pytest.fixture
def no_launch(monkeypatch):
    """Make any kernel launch through :mod:`nki_rmsnorm.ops` fail loudly: the bindings' errors
    must come before it."""
    from nki_rmsnorm import ops

    def launched(*args, **kwargs):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(ops, "rms_norm_fwd", launched)
    monkeypatch.setattr(ops, "rms_norm_bwd", launched)
