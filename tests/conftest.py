"""Fixtures and hooks: a reproducible per-test random generator, the simulator modes and the
kernel dialect a test runs in. Shared helper functions live in helpers.py."""

from __future__ import annotations

import os
import sys
import tempfile
import zlib

import numpy as np
import pytest
from helpers import LEGACY_ONLY_TARGETS, poison

# torch.compile's FX-graph cache lives under /tmp by default and outlives a run: a graph it
# compiled against an earlier schema of the package's custom operators would be served again.
# Each test run compiles into its own directory.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="nki_rmsnorm_inductor_"))


@pytest.fixture
def rng(request):
    """A generator seeded from the test id: reproducible, and different for every test. The id
    is taken as if the file sat directly in tests/ (file names are unique across tests/), so
    moving a test file between directories does not change the inputs it draws."""
    test = request.node.nodeid.split("::", 1)[1]
    return np.random.default_rng(zlib.crc32(f"tests/{request.node.path.name}::{test}".encode()))


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
    group.addoption(
        "--nki-sdk",
        default=None,
        help="emulate this Neuron SDK release (2.20 ... 2.29) in the kernel tests",
    )
    group.addoption(
        "--nki-approx",
        action="store_true",
        help="approximate the Scalar engine's transcendental functions",
    )
    group.addoption(
        "--nki-dialect",
        default=None,
        choices=("legacy", "nki06"),
        help="run the kernel tests in this NKI dialect only (default: both where "
        "a test is parametrized over them)",
    )


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

    return (
        f"nki simulator: Neuron SDK {simulate.sdk_version()}, approximate "
        f"transcendentals {'on' if simulate.approx_bound() else 'off'}; kernel dialect "
        f"{_only_dialect(config) or 'both'} where parametrized, else {dialect.current()}"
    )


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
        raise pytest.UsageError(f"--nki-dialect must be one of {KERNEL_DIALECTS}, got {chosen!r}")
    return chosen


#: A test parametrized over both a dialect and a ``target`` runs only the pairs the hardware
#: has (:data:`helpers.LEGACY_ONLY_TARGETS`).
_DIALECT_PARAMS = ("kernel_dialect", "dialect", "dialect_name")


def _runs_nki06_on_neuroncore_v2(item) -> bool:
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec else {}
    return params.get("target") in LEGACY_ONLY_TARGETS and any(
        params.get(name) == "nki06" for name in _DIALECT_PARAMS
    )


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
