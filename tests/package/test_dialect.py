"""``nki_rmsnorm.dialect``: which NKI dialect the kernels resolve to (the target hardware and
the SDK decide; the simulator's override only on trn2/trn3), and ``nki_rmsnorm.kernels``
resolving the entry points in it."""

from __future__ import annotations

import sys
import threading
import types

import numpy as np
import pytest

from nki_rmsnorm import dialect, kernels


@pytest.fixture
def no_setting(monkeypatch):
    """No environment variable (dialect or target) and no process-wide choice."""
    monkeypatch.delenv(dialect.ENV_VAR, raising=False)
    monkeypatch.delenv(dialect.TARGET_ENV_VAR, raising=False)
    monkeypatch.setattr(dialect, "_chosen", None)


def _fake_package(monkeypatch, name, **attributes):
    module = types.ModuleType(name)
    module.__path__ = []
    for key, value in attributes.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def test_simulator_uses_the_current_nki_without_a_setting(no_setting):
    """With no real NKI and no target named, the simulator runs the current NKI (0.6)."""
    assert dialect.simulated()
    assert dialect.target() is None
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
    [("0.5.0", "nki06"), ("0.6.1", "nki06"), ("0.4.0", None), ("0.3.0", None), ("0.7.0", None)],
)
def test_real_nki_in_the_supported_range_wins(no_setting, monkeypatch, version, expected):
    monkeypatch.setitem(sys.modules, "neuronxcc", None)  # no real legacy compiler either
    monkeypatch.setitem(sys.modules, "neuronxcc.nki", None)
    _fake_package(monkeypatch, "nki", __version__=version)
    assert dialect.real_nki_version() == tuple(int(p) for p in version.split(".")[:2])
    assert dialect.hardware_dialect() == expected
    with dialect.use_dialect("legacy" if expected == "nki06" else "nki06"):
        # The installed SDK decides; the override only chooses the simulator's dialect.
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
        assert kernels.kernel("rmsnorm_quant").__module__.endswith("legacy.rmsnorm_quant")
    assert set(kernels.available("legacy")) == set(kernels.MODULES) - set(kernels.NKI06_ONLY)
    assert set(kernels.available("nki06")) == set(kernels.MODULES)
    with pytest.raises(NotImplementedError, match="rmsnorm_mx_quant is not written"):
        kernels.kernel("rmsnorm_mx_quant", "legacy")


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
    assert launched == [
        ("rmsnorm_fwd", kernel_dialect),
        ("rmsnorm_bwd", kernel_dialect),
        ("rmsnorm_add_fwd", kernel_dialect),
    ]


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


# --- the dialect follows the hardware ---------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("trn1", "trn1"),
        ("INF2", "inf2"),
        (" trn2 ", "trn2"),
        ("trn3", "trn3"),
        ("gen2", "trn1"),
        ("gen4", "trn3"),
    ],
)
def test_the_target_is_the_one_neuron_platform_target_override_names(
    no_setting, monkeypatch, name, expected
):
    monkeypatch.setenv(dialect.TARGET_ENV_VAR, name)
    assert dialect.target() == expected


def test_an_unknown_target_names_the_variable(no_setting, monkeypatch):
    monkeypatch.setenv(dialect.TARGET_ENV_VAR, "trn9")
    with pytest.raises(
        ValueError,
        match=r"NEURON_PLATFORM_TARGET_OVERRIDE must name one of.*"
        r"'trn9'",
    ):
        dialect.current()


@pytest.mark.parametrize("target", ["trn1", "inf2"])
def test_trn1_and_inf2_always_run_the_legacy_kernels(no_setting, monkeypatch, target):
    """NeuronCore-v2 runs the legacy dialect whatever the default (nki06) is."""
    monkeypatch.setenv(dialect.TARGET_ENV_VAR, target)
    assert dialect.current() == "legacy"
    assert kernels.rmsnorm_fwd.__module__ == "nki_rmsnorm.kernels.legacy.rmsnorm_fwd"
    assert kernels.kernel("rmsnorm_quant").__module__.endswith("legacy.rmsnorm_quant")
    with dialect.use_dialect("legacy") as chosen:
        assert chosen == "legacy"


@pytest.mark.parametrize("target", ["trn1", "inf2", "gen2"])
def test_asking_for_nki06_on_trn1_or_inf2_is_refused(no_setting, monkeypatch, target):
    """Every way of asking the simulator for the 0.6 kernels on NeuronCore-v2 (the context,
    the process-wide hook, the environment variable) is a ValueError naming the request and
    the target, before any kernel is resolved."""
    monkeypatch.setenv(dialect.TARGET_ENV_VAR, target)
    refused = r"asks for the nki06 kernels, but the target is (trn1|inf2).*Trn1 and Inf2 run "
    with pytest.raises(ValueError, match="use_dialect " + refused):
        with dialect.use_dialect("nki06"):
            pass
    dialect.set_dialect("nki06")
    try:
        with pytest.raises(ValueError, match="set_dialect " + refused):
            kernels.kernel("rmsnorm_fwd")
    finally:
        dialect.set_dialect(None)
    monkeypatch.setenv(dialect.ENV_VAR, "nki06")
    with pytest.raises(ValueError, match="NKI_RMSNORM_DIALECT " + refused):
        dialect.current()


@pytest.mark.parametrize("target", ["trn2", "trn3", "gen3"])
def test_trn2_and_trn3_run_nki06_unless_the_simulator_override_says_legacy(
    no_setting, monkeypatch, target
):
    monkeypatch.setenv(dialect.TARGET_ENV_VAR, target)
    assert dialect.current() == "nki06"
    with dialect.use_dialect("legacy"):
        assert dialect.current() == "legacy"
    monkeypatch.setenv(dialect.ENV_VAR, "legacy")
    assert dialect.current() == "legacy"


def test_for_target_names_each_targets_dialect(no_setting, monkeypatch):
    monkeypatch.setenv(dialect.ENV_VAR, "legacy")
    assert [dialect.for_target(t) for t in ("trn1", "inf2", "trn2", "trn3", None)] == ["legacy"] * 5
    monkeypatch.setenv(dialect.ENV_VAR, "nki06")
    assert [dialect.for_target(t) for t in ("trn2", "trn3", None)] == ["nki06"] * 3
    with pytest.raises(ValueError, match="target is trn1"):
        dialect.for_target("trn1")


def test_a_real_sdk_with_only_nki_0x_refuses_trn1(no_setting, monkeypatch):
    """SDK >= 2.30 without neuronxcc.nki cannot compile for Trn1/Inf2: a RuntimeError names
    the target and the SDK; on trn2 the same SDK runs nki06 whatever the override says."""
    monkeypatch.setitem(sys.modules, "neuronxcc", None)
    monkeypatch.setitem(sys.modules, "neuronxcc.nki", None)
    _fake_package(monkeypatch, "nki", __version__="0.6.0")
    monkeypatch.setenv(dialect.TARGET_ENV_VAR, "trn1")
    with pytest.raises(RuntimeError, match=r"target is trn1.*only nki 0\.6.*Trn2 and Trn3"):
        dialect.current()
    monkeypatch.setenv(dialect.TARGET_ENV_VAR, "trn2")
    with dialect.use_dialect("legacy"):
        assert dialect.current() == "nki06"


def test_a_real_sdk_with_both_runs_legacy_on_trn1_and_nki06_on_trn2(no_setting, monkeypatch):
    _fake_package(monkeypatch, "neuronxcc")
    _fake_package(monkeypatch, "neuronxcc.nki")
    _fake_package(monkeypatch, "nki", __version__="0.5.0")
    for target, expected in (
        ("trn1", "legacy"),
        ("inf2", "legacy"),
        ("trn2", "nki06"),
        ("trn3", "nki06"),
    ):
        monkeypatch.setenv(dialect.TARGET_ENV_VAR, target)
        assert dialect.current() == expected, target


@pytest.mark.parametrize(
    ("target", "expected"),
    [("trn1", "legacy"), ("inf2", "legacy"), ("trn2", "nki06"), ("trn3", "nki06")],
)
def test_the_numpy_launchers_run_the_targets_dialect_on_the_target(
    no_setting, monkeypatch, rng, target, expected
):
    """Through ``nki_rmsnorm.ops`` every kernel that runs is the target's dialect's and runs
    on that target (a legacy kernel gets it as its platform_target), with correct results."""
    from dialect_launches import record_launches

    import simulate
    from nki_rmsnorm import ops, reference

    monkeypatch.setenv(dialect.TARGET_ENV_VAR, target)
    launches = record_launches(monkeypatch)
    x = rng.standard_normal((5, 96)).astype(np.float32)
    weight = rng.standard_normal(96).astype(np.float32)
    y, rstd = ops.rms_norm_fwd(x, weight)
    trace = simulate.last_trace()
    want_y, want_rstd = reference.rms_norm_fwd(x, weight, 1e-6)
    np.testing.assert_allclose(y, want_y, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(rstd, want_rstd, rtol=2e-6)
    assert {launch.dialect for launch in launches} == {expected}
    assert trace.target == target


def test_the_simulator_override_chooses_legacy_on_trn2_and_runs_it_there(
    no_setting, monkeypatch, rng
):
    import simulate
    from nki_rmsnorm import ops

    monkeypatch.setenv(dialect.TARGET_ENV_VAR, "trn2")
    monkeypatch.setenv(dialect.ENV_VAR, "legacy")
    assert kernels.kernel("rmsnorm_fwd").options == {"platform_target": "trn2"}
    ops.rms_norm(rng.standard_normal((3, 64)).astype(np.float32))
    assert simulate.last_trace().target == "trn2"
