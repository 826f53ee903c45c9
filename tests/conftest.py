"""Shared test helpers: a reproducible per-test random generator and NaN-poisoned outputs."""

from __future__ import annotations

import os
import sys
import threading
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


def fresh_interpreter(code: str, **env: str) -> str:
    """stdout of ``python -c code`` in a new interpreter whose environment has no NKI_SIM_*
    variables except ``env`` (the simulator modes are read at import)."""
    import subprocess

    environment = {k: v for k, v in os.environ.items() if not k.startswith("NKI_SIM_")}
    environment.update(env, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([sys.executable, "-c", code], env=environment,
                            capture_output=True, text=True, timeout=120, check=True)
    return result.stdout.strip()


@pytest.fixture(name="poison")
def poison_fixture():
    """The :func:`poison` helper as a fixture."""
    return poison


# --- simulator modes ---------------------------------------------------------------------
# The kernel suite can run under another emulated Neuron SDK release and with approximate
# Scalar-engine transcendentals: ``pytest --nki-sdk=2.21 --nki-approx`` (or the environment
# variables NKI_SIM_SDK / NKI_SIM_APPROX, which the options set for xdist workers too).
# The simulator's own tests (test_sim_*, the cost model and its calibration) always run on
# the newest release with exact math: they test the simulator, not the kernels.
_SIMULATOR_SUITES = ("test_sim_", "test_cost_model", "test_calibration")


def pytest_addoption(parser):
    group = parser.getgroup("nki simulator")
    group.addoption("--nki-sdk", default=None,
                    help="emulate this Neuron SDK release (2.20 ... 2.29) in the kernel tests")
    group.addoption("--nki-approx", action="store_true",
                    help="approximate the Scalar engine's transcendental functions")
    group.addoption("--nki-dialect", default=None, choices=("legacy", "nki06"),
                    help="run the kernel tests in this NKI dialect only (default: both where "
                         "a test is parametrized over them)")


def pytest_configure(config):
    release = config.getoption("--nki-sdk")
    if release:
        os.environ["NKI_SIM_SDK"] = release
    if config.getoption("--nki-approx"):
        os.environ["NKI_SIM_APPROX"] = "1"
    chosen = _only_dialect(config)
    if chosen is not None:
        os.environ["NKI_RMSNORM_DIALECT"] = chosen
    if "simulate" in sys.modules:  # imported already (a plugin): apply to this context too
        import simulate

        if release:
            simulate.set_sdk(release)
        if config.getoption("--nki-approx"):
            simulate.set_approx(True)


def pytest_report_header(config):
    import simulate
    from nki_rmsnorm import dialect

    return (f"nki simulator: Neuron SDK {simulate.sdk_version()}, approximate "
            f"transcendentals {'on' if simulate.approx_bound() else 'off'}; kernel dialect "
            f"{_only_dialect(config) or 'both'} where parametrized, else {dialect.current()}")


@pytest.fixture(autouse=True)
def _simulator_mode(request):
    """Pin the simulator's own tests to the newest release and exact math."""
    if not request.module.__name__.startswith(_SIMULATOR_SUITES):
        yield
        return
    import simulate

    with simulate.use_sdk(simulate.SDK_RELEASES[-1]), simulate.use_approx(False):
        yield


@pytest.fixture
def no_launch(monkeypatch):
    """Make any kernel launch through :mod:`nki_rmsnorm.ops` fail loudly: the bindings' errors
    must come before it."""
    from nki_rmsnorm import ops

    def launched(*args, **kwargs):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(ops, "rms_norm_fwd", launched)
    monkeypatch.setattr(ops, "rms_norm_bwd", launched)


# --- kernel dialect -----------------------------------------------------------------------
# Tests that take the ``kernel_dialect`` fixture run once per NKI dialect the kernels are
# written in. ``pytest --nki-dialect=nki06`` (or NKI_RMSNORM_TEST_DIALECT) runs the whole suite
# in one dialect: the other dialect's parametrizations are deselected and every other test
# runs in the chosen one (NKI_RMSNORM_DIALECT, read by nki_rmsnorm.dialect).
KERNEL_DIALECTS = ("legacy", "nki06")
_TEST_DIALECT_ENV = "NKI_RMSNORM_TEST_DIALECT"


@pytest.fixture(params=KERNEL_DIALECTS)
def kernel_dialect(request):
    """Run the test with the kernels of each NKI dialect: yields the dialect's name inside
    ``nki_rmsnorm.dialect.use_dialect``, so ``nki_rmsnorm.kernels`` and ``nki_rmsnorm.ops``
    resolve to it on the test's thread. The choice is a context variable: a thread the test
    starts itself does not see it (the bindings carry it to the threads they launch on)."""
    from nki_rmsnorm import dialect as dialects

    with dialects.use_dialect(request.param) as name:
        yield name


@pytest.fixture
def dialect(kernel_dialect):
    """The ``kernel_dialect`` fixture under the name test_fwd.py uses."""
    return kernel_dialect


def _only_dialect(config) -> str | None:
    chosen = config.getoption("--nki-dialect") or os.environ.get(_TEST_DIALECT_ENV) or None
    if chosen is not None and chosen not in KERNEL_DIALECTS:
        raise pytest.UsageError(f"--nki-dialect must be one of {KERNEL_DIALECTS}, got "
                                f"{chosen!r}")
    return chosen


#: Targets the nki06 kernels never run on (NKI 0.x supports Trn2/Trn3 only,
#: aws-neuron-sdk@81ce03ae nki/nki_faq.rst L23-27): a test parametrized over both a dialect
#: and a ``target`` runs only the pairs the hardware has.
_LEGACY_ONLY_TARGETS = ("trn1", "inf2")
_DIALECT_PARAMS = ("kernel_dialect", "dialect", "dialect_name")


def _runs_nki06_on_neuroncore_v2(item) -> bool:
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec else {}
    return params.get("target") in _LEGACY_ONLY_TARGETS and any(
        params.get(name) == "nki06" for name in _DIALECT_PARAMS)


def pytest_collection_modifyitems(config, items):
    impossible = [item for item in items if _runs_nki06_on_neuroncore_v2(item)]
    if impossible:
        config.hook.pytest_deselected(items=impossible)
        items[:] = [item for item in items if item not in impossible]
    chosen = _only_dialect(config)
    if chosen is None:
        return
    keep, drop = [], []
    for item in items:
        params = getattr(item, "callspec", None)
        params = params.params if params else {}
        # the fixture's name, or a test module's own ``dialect`` parametrization
        value = params.get("kernel_dialect", params.get("dialect", chosen))
        (keep if value not in KERNEL_DIALECTS or value == chosen else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


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

    if target in _LEGACY_ONLY_TARGETS and (dialect_name or dialect.current()) == "nki06":
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

