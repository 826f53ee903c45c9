"""Helpers the tests share: NaN-poisoned outputs, random inputs, fresh interpreters, and
kernel launches on a dialect's default target (fixtures and hooks live in conftest.py)."""

from __future__ import annotations

import os
import sys
import threading

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)


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


def fresh_interpreter(code: str, **env: str) -> str:
    """stdout of ``python -c code`` in a new interpreter whose environment has no NKI_SIM_*
    variables except ``env`` (the simulator modes are read at import)."""
    import subprocess

    environment = {k: v for k, v in os.environ.items() if not k.startswith("NKI_SIM_")}
    environment.update(env, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return result.stdout.strip()


#: Targets the nki06 kernels never run on (NKI 0.x supports Trn2/Trn3 only,
#: aws-neuron-sdk@81ce03ae nki/nki_faq.rst L23-27).
LEGACY_ONLY_TARGETS = ("trn1", "inf2")


#: Serialises the nki06 front-end's target environment variable between threads.
_TARGET_LOCK = threading.Lock()


#: The target a kernel test runs on when it names none, per dialect: the legacy simulator's
#: default (trn1), and for nki06 trn2, the oldest NeuronCore NKI 0.x supports
#: (aws-neuron-sdk@81ce03ae nki/nki_faq.rst L23-27; trn1 and inf2 run the legacy kernels only).
DEFAULT_TARGETS = {"legacy": "trn1", "nki06": "trn2"}


def default_target(dialect_name: str | None = None) -> str:
    """:data:`DEFAULT_TARGETS` of ``dialect_name`` (default: the dialect in effect)."""
    from nki_rmsnorm import dialect

    return DEFAULT_TARGETS[dialect_name or dialect.current()]


def runnable_target(target: str | None, dialect_name: str | None = None) -> str | None:
    """The target a test that draws ``target`` runs ``dialect_name``'s kernels on (default:
    the dialect in effect): ``target`` itself, except that the nki06 kernels never run on
    trn1 / inf2 and take trn2 there (a randomized test keeps its draw for legacy)."""
    from nki_rmsnorm import dialect

    if target in LEGACY_ONLY_TARGETS and (dialect_name or dialect.current()) == "nki06":
        return "trn2"
    return target


def trace_launch(kernel, *args, target=None, lnc=None, **kwargs):
    """Simulate ``kernel`` (either dialect) on ``target`` (default: its dialect's
    :data:`DEFAULT_TARGETS`): ``(outputs, trace)``. ``lnc``: the nki06 launch's LNC degree
    (``kernel[lnc]``); None launches without a bracket."""
    import simulate
    import simulate.nki06 as nki06

    if not isinstance(kernel, nki06.Kernel):
        if lnc is not None:
            raise ValueError("lnc applies to nki06 kernels only")
        return simulate.trace_kernel(kernel, *args, target=target, **kwargs)
    name = target or DEFAULT_TARGETS["nki06"]
    with _TARGET_LOCK:
        saved = os.environ.get(_TARGET_ENV)
        os.environ[_TARGET_ENV] = name
        try:
            outputs = (kernel if lnc is None else kernel[lnc])(*args, **kwargs)
        finally:
            if saved is None:
                del os.environ[_TARGET_ENV]
            else:
                os.environ[_TARGET_ENV] = saved
    return outputs, nki06.last_trace()


_TARGET_ENV = "NEURON_PLATFORM_TARGET_OVERRIDE"
