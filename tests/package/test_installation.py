"""No silent fallback: an installed but unsupported NKI (an ``nki`` newer than 0.6, a legacy
SDK outside 2.21 - 2.29) is named once in a warning with what runs instead; a simulated launch
logs once at INFO where a framework binding is loaded; ``NKI_RMSNORM_REQUIRE_DEVICE=1`` makes
simulation an error; ``nki-rmsnorm doctor`` says all of it. The SDKs are faked with a package
and its ``*.dist-info`` on a temporary ``sys.path`` entry."""

from __future__ import annotations

import logging
import sys
import warnings

import numpy as np
import pytest

from nki_rmsnorm import bench, dialect, doctor, kernels, ops


@pytest.fixture(autouse=True)
def _fresh_announcements(monkeypatch):
    monkeypatch.setattr(dialect, "_announced", set())
    monkeypatch.setattr(dialect, "_installations", {})


def _fake_distribution(root, package: str, dist: str, version: str, subpackage=None):
    """``package`` (and ``package.subpackage``) with a ``dist``-``version`` dist-info."""
    (root / package).mkdir()
    (root / package / "__init__.py").write_text("")
    if subpackage:
        (root / package / subpackage).mkdir()
        (root / package / subpackage / "__init__.py").write_text("")
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")


def _sdk_modules():
    return {m: sys.modules[m] for m in list(sys.modules) if m.split(".")[0] in SDK_PACKAGES}


SDK_PACKAGES = ("nki", "neuronxcc")


@pytest.fixture
def fake_sdk(tmp_path, monkeypatch):
    """Install fake SDK packages on a fresh ``sys.path`` entry; the loaded (simulated) ``nki``
    and ``neuronxcc`` modules are hidden meanwhile, so the lookups find the fakes, and put
    back afterwards (the fakes a lookup imported are dropped)."""
    saved = _sdk_modules()
    for name in saved:
        del sys.modules[name]
    monkeypatch.syspath_prepend(str(tmp_path))

    def install(package, dist, version, subpackage=None):
        _fake_distribution(tmp_path, package, dist, version, subpackage)

    yield install
    for name in _sdk_modules():
        del sys.modules[name]
    sys.modules.update(saved)


def test_a_newer_nki_is_named_once_with_what_runs_instead(fake_sdk):
    fake_sdk("nki", "nki", "0.7.0")
    assert dialect.real_nki_version() == (0, 7)
    assert dialect.hardware_dialect() is None and dialect.simulated()
    message = dialect.unsupported_sdk()
    assert "nki 0.7 is installed" in message and "support nki 0.5 - 0.6" in message
    assert "CPU simulator" in message
    with pytest.warns(RuntimeWarning, match="nki 0.7 is installed"):
        dialect.check_launch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dialect.check_launch()  # once per process: no second warning


def test_a_newer_nki_beside_a_supported_legacy_sdk_runs_the_legacy_kernels(fake_sdk):
    fake_sdk("nki", "nki", "0.7.1")
    fake_sdk("neuronxcc", "neuronx-cc", "2.19.0", subpackage="nki")  # SDK 2.24
    assert dialect.hardware_dialect() == dialect.LEGACY
    assert "the legacy neuronxcc.nki kernels will run instead" in dialect.unsupported_sdk()


def test_a_legacy_sdk_outside_the_supported_releases_is_named(fake_sdk):
    fake_sdk("neuronxcc", "neuronx-cc", "2.14.0", subpackage="nki")  # SDK 2.19
    assert dialect.hardware_dialect() == dialect.LEGACY
    message = dialect.unsupported_sdk()
    assert "Neuron SDK 2.19 (neuronx-cc) is installed" in message
    assert "support SDK 2.21 - 2.29" in message and "raises RuntimeError" in message


@pytest.mark.parametrize(
    ("package", "dist", "version", "subpackage", "dialect_name"),
    [
        ("nki", "nki", "0.6.0", None, dialect.NKI06),
        ("neuronxcc", "neuronx-cc", "2.24.1", "nki", dialect.LEGACY),  # SDK 2.29
    ],
)
def test_a_supported_sdk_raises_no_warning(
    fake_sdk, package, dist, version, subpackage, dialect_name
):
    fake_sdk(package, dist, version, subpackage)
    assert dialect.hardware_dialect() == dialect_name
    assert dialect.unsupported_sdk() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dialect.check_launch()


def test_no_sdk_at_all_is_not_an_unsupported_sdk():
    assert dialect.simulated() and dialect.unsupported_sdk() is None


def test_every_kernel_resolution_checks_the_installation(monkeypatch):
    calls = []
    monkeypatch.setattr(dialect, "check_launch", lambda: calls.append(1))
    kernels.kernel("rmsnorm_fwd", dialect.NKI06)
    ops.rms_norm(np.ones((2, 8), np.float32), np.ones(8, np.float32))
    assert len(calls) == 2


def test_require_device_makes_simulation_an_error(monkeypatch):
    x, w = np.ones((2, 8), np.float32), np.ones(8, np.float32)
    monkeypatch.setenv(dialect.REQUIRE_DEVICE_ENV, "1")
    with pytest.raises(RuntimeError, match="NKI_RMSNORM_REQUIRE_DEVICE is set.*CPU simulator"):
        ops.rms_norm(x, w)
    monkeypatch.setenv(dialect.REQUIRE_DEVICE_ENV, "0")
    np.testing.assert_allclose(ops.rms_norm(x, w), np.ones((2, 8)), rtol=1e-6)


def test_simulation_under_a_framework_binding_is_logged_once_at_info(caplog, monkeypatch):
    x, w = np.ones((2, 8), np.float32), np.ones(8, np.float32)
    monkeypatch.delitem(sys.modules, "nki_rmsnorm.torch", raising=False)
    monkeypatch.delitem(sys.modules, "nki_rmsnorm.jax", raising=False)
    monkeypatch.delitem(sys.modules, "nki_rmsnorm.hf", raising=False)
    with caplog.at_level(logging.INFO, logger="nki_rmsnorm.dialect"):
        ops.rms_norm(x, w)  # plain NumPy use: no framework, no note
        assert not caplog.records
        monkeypatch.setitem(sys.modules, "nki_rmsnorm.torch", object())
        ops.rms_norm(x, w)
        ops.rms_norm(x, w)
    notes = [r for r in caplog.records if "CPU simulator" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == logging.INFO
    assert "nki_rmsnorm.torch" in notes[0].getMessage()


def test_doctor_says_what_runs_here(capsys):
    assert bench.main(["doctor"]) == 0
    text = capsys.readouterr().out
    assert "nki (NKI 0.5 - 0.6, SDK 2.31 - 2.32): not installed" in text
    assert "neuronxcc.nki (legacy, SDK 2.21 - 2.29): not installed" in text
    assert f"kernel dialect: {dialect.current()} now" in text
    assert "per target: trn1 legacy, inf2 legacy, trn2 " in text  # the hardware decides
    assert "kernels run: SIMULATED on the CPU" in text
    assert "unsupported SDK: none found" in text
    for framework in ("torch", "jax"):
        assert any(
            line.startswith(f"{framework} ") or line.startswith(f"{framework}:")
            for line in text.splitlines()
        )


def test_doctor_names_an_unsupported_nki_and_the_require_device_setting(fake_sdk, monkeypatch):
    fake_sdk("nki", "nki", "0.7.0")
    monkeypatch.setenv(dialect.REQUIRE_DEVICE_ENV, "1")
    text = doctor.report()
    assert "nki (NKI 0.5 - 0.6, SDK 2.31 - 2.32): 0.7" in text
    assert "unsupported SDK: nki 0.7 is installed" in text
    assert "NKI_RMSNORM_REQUIRE_DEVICE is set, so launches will raise" in text


def test_device_bench_without_an_sdk_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.setattr(bench, "run_case", lambda *a, **k: pytest.fail("a case ran"))
    assert bench.main(["bench", "--device", "--quick"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--device needs the Neuron SDK" in err and len(err.splitlines()) == 1


def test_nki_0_4_is_named_unsupported(fake_sdk):
    """SDK 2.30's nki 0.4 lacks the view methods and chained slicing the 0.6 kernels use
    (NKI 0.5, release-notes/components/nki.rst L127-132): named, and simulated instead."""
    fake_sdk("nki", "nki", "0.4.0")
    assert dialect.hardware_dialect() is None
    assert "nki 0.4 is installed" in dialect.unsupported_sdk()
    assert "support nki 0.5 - 0.6" in dialect.unsupported_sdk()
