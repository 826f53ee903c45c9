"""``nki_rmsnorm.dialect``: which NKI dialect the kernels resolve to, and
``nki_rmsnorm.kernels`` resolving the entry points in it."""

from __future__ import annotations

import sys
import threading
import types

import numpy as np
import pytest

from nki_rmsnorm import dialect, kernels


@pytest.fixture
def no_setting(monkeypatch):
    """No environment variable and no process-wide choice."""
    monkeypatch.delenv(dialect.ENV_VAR, raising=False)
    monkeypatch.setattr(dialect, "_chosen", None)


def _fake_package(monkeypatch, name, **attributes):
    module = types.ModuleType(name)
    module.__path__ = []
    for key, value in attributes.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def test_simulator_uses_the_current_nki_without_a_setting(no_setting):
    """Issue 10: with no real NKI, the simulator runs the dialect a setting chooses, by
    default the current NKI (0.6)."""
    assert dialect.simulated()
    assert dialect.current() == dialect.DEFAULT == "nki06"
    assert kernels.rmsnorm_fwd.__module__ == "nki_rmsnorm.kernels.nki06.rmsnorm_fwd"


def test_environment_variable_then_set_dialect_then_context(no_setting, monkeypatch):
    monkeypatch.setenv(dialect.ENV_VAR, "nki06")
    assert dialect.current() == "nki06"
    dialect.set_dialect("legacy")
    assert dialect.current() == "legacy"
    with dialect.use_dialect("nki06") as chosen:
        assert chosen == dialect.current() == "nki06"
    assert dialect.current() == "legacy"
    dialect.set_dialect(None)
    assert dialect.current() == "nki06"


def test_context_is_per_thread(no_setting):
    seen = []
    with dialect.use_dialect("nki06"):
        worker = threading.Thread(target=lambda: seen.append(dialect.current()))
        worker.start()
        worker.join(timeout=30)
    assert seen == [dialect.DEFAULT]


@pytest.mark.parametrize("bad", ["nki", "", "Legacy"])
def test_unknown_dialect_names_are_rejected(no_setting, monkeypatch, bad):
    with pytest.raises(ValueError, match="dialect must be one of"):
        dialect.set_dialect(bad)
    with pytest.raises(ValueError, match="dialect must be one of"), dialect.use_dialect(bad):
        pass
    monkeypatch.setenv(dialect.ENV_VAR, bad)
    with pytest.raises(ValueError, match=f"{dialect.ENV_VAR} must be one of"):
        dialect.current()


@pytest.mark.parametrize(
    ("version", "expected"),
    [("0.4.0", "nki06"), ("0.6.1", "nki06"), ("0.3.0", None), ("0.7.0", None)],
)
def test_real_nki_in_the_supported_range_wins(no_setting, monkeypatch, version, expected):
    monkeypatch.setitem(sys.modules, "neuronxcc", None)  # no real legacy compiler either
    monkeypatch.setitem(sys.modules, "neuronxcc.nki", None)
    _fake_package(monkeypatch, "nki", __version__=version)
    assert dialect.real_nki_version() == tuple(int(p) for p in version.split(".")[:2])
    assert dialect.hardware_dialect() == expected
    with dialect.use_dialect("legacy" if expected == "nki06" else "nki06"):
        # The installed SDK decides; a setting only chooses the simulator's dialect.
        assert dialect.current() == (expected or "nki06")


def test_real_neuronxcc_means_legacy(no_setting, monkeypatch):
    monkeypatch.setitem(sys.modules, "nki", None)
    _fake_package(monkeypatch, "neuronxcc")
    _fake_package(monkeypatch, "neuronxcc.nki")
    assert dialect.hardware_dialect() == "legacy"
    with dialect.use_dialect("nki06"):
        assert dialect.current() == "legacy"


def test_the_simulators_front_ends_are_not_real(no_setting, monkeypatch):
    _fake_package(monkeypatch, "nki", __simulated__=True, __version__="0.6.0")
    _fake_package(monkeypatch, "neuronxcc", __simulated__=True)
    _fake_package(monkeypatch, "neuronxcc.nki")
    assert dialect.real_nki_version() is None
    assert dialect.hardware_dialect() is None


def test_entry_points_resolve_in_the_current_dialect(no_setting):
    from nki_rmsnorm.kernels.legacy import rmsnorm_fwd as legacy_fwd

    with dialect.use_dialect("legacy"):
        assert kernels.rmsnorm_fwd is legacy_fwd.rmsnorm_fwd
        assert kernels.kernel("rmsnorm_bwd_out").__module__.endswith("legacy.rmsnorm_bwd")
    assert set(kernels.available("legacy")) == set(kernels.MODULES)


def test_a_missing_entry_point_names_what_exists(no_setting, monkeypatch):
    monkeypatch.setitem(kernels.MODULES, "rmsnorm_future", "rmsnorm_future")
    with pytest.raises(
        NotImplementedError,
        match=r"rmsnorm_future is not written in the "
        r"'legacy' NKI dialect yet; it has \('rmsnorm_fwd'",
    ):
        kernels.kernel("rmsnorm_future", "legacy")
    with pytest.raises(ValueError, match="name must be one of"):
        kernels.kernel("rmsnorm")
    with pytest.raises(AttributeError, match="no attribute 'rmsnorm'"):
        kernels.rmsnorm  # noqa: B018


def test_legacy_kernels_refuse_an_sdk_outside_their_range():
    """The legacy kernels need the return convention (SDK 2.21) and end with 2.29: an
    emulated 2.20 is a clear error naming the range before anything launches."""
    import simulate
    from nki_rmsnorm import kernels, nki

    with simulate.use_sdk("2.20"), pytest.raises(RuntimeError, match=r"2\.21 to 2\.29.*2\.20"):
        kernels.kernel("rmsnorm_fwd", "legacy")
    with simulate.use_sdk("2.21"):
        assert nki.check_sdk() == (2, 21)
        assert callable(kernels.kernel("rmsnorm_fwd", "legacy"))


def test_numpy_launchers_run_the_chosen_dialect(no_setting, kernel_dialect, monkeypatch):
    from nki_rmsnorm import ops

    launched = []
    resolve = kernels.kernel

    def recording(name, dialect_name=None):
        launched.append((name, dialect_name or dialect.current()))
        return resolve(name, dialect_name)

    monkeypatch.setattr(kernels, "kernel", recording)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 3, 40)).astype(np.float32) + 0.5
    y, rstd = ops.rms_norm_fwd(x, np.ones(40, np.float32))
    ops.rms_norm_bwd(y, x, np.ones(40, np.float32), rstd)
    ops.rms_norm_fwd(x, residual=x)
    assert launched == [("rmsnorm_fwd", kernel_dialect), ("rmsnorm_bwd", kernel_dialect),
                        ("rmsnorm_add_fwd", kernel_dialect)]


def test_the_legacy_sdk_range_binds_only_the_legacy_kernels(no_setting, rng):
    """The legacy SDK check runs whenever the legacy kernels are chosen, also through the
    launchers, before anything launches; the 0.6 kernels (the default) do not read the
    legacy release."""
    import simulate
    from nki_rmsnorm import ops, reference

    x = rng.standard_normal((3, 64)).astype(np.float32)
    with simulate.use_sdk("2.20"):
        with dialect.use_dialect("legacy"), pytest.raises(RuntimeError, match=r"2\.21 to 2\.29"):
            ops.rms_norm(x)
        np.testing.assert_allclose(ops.rms_norm(x), reference.rms_norm(x), rtol=2e-6, atol=1e-6)
    with dialect.use_dialect("legacy"), simulate.use_sdk("2.24"):
        np.testing.assert_allclose(ops.rms_norm(x), reference.rms_norm(x), rtol=2e-6, atol=1e-6)
