"""Launch conveniences shared with the legacy front-end: ``simulate.profile`` of 0.6 kernels,
NumPy scalars as scalar operands, and the documented default target of each dialect."""

from __future__ import annotations

import numpy as np
import pytest

import simulate
import simulate.isa as lisa
import simulate.language as lnl
import simulate.nki06 as nki
from simulate.core.targets import DIALECT_DEFAULT_TARGET, TARGETS
from simulate.nki06 import isa as nisa
from simulate.nki06 import language as nl


@nki.jit
def scaled_copy(x):
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    share = x.shape[0] // nl.num_programs()  # the rows of this physical core
    rows = slice(nl.program_id(0) * share, (nl.program_id(0) + 1) * share)
    t = nl.load(x[rows])
    y = nl.ndarray(t.shape, t.dtype, buffer=nl.sbuf)
    nisa.activation(dst=y, op=nl.copy, data=t, scale=2.0)
    nl.store(out[rows], y)
    return out


@pytest.mark.parametrize("lnc", [None, 2])
def test_profile_models_a_0_6_kernel_on_the_given_target(rng, monkeypatch, lnc):
    monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE", raising=False)
    x = rng.standard_normal((128 * (lnc or 1), 512)).astype(np.float32)
    kernel = scaled_copy if lnc is None else scaled_copy[lnc]
    outputs, profile = simulate.profile(kernel, x, target="trn2")
    np.testing.assert_array_equal(outputs, 2 * x)
    assert profile.target == "trn2" and profile.latency_us > 0
    # the same model as the trace of a direct launch on that target
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    kernel(x)
    direct = simulate.Profile.from_trace(nki.last_trace())
    assert profile.latency_us == direct.latency_us
    assert nki.last_trace().lnc == (lnc or 1)


def test_profile_still_models_legacy_kernels(rng):
    x = rng.standard_normal((128, 512)).astype(np.float32)

    @simulate.jit
    def kernel(x):
        out = lnl.ndarray(x.shape, x.dtype, buffer=lnl.shared_hbm)
        lnl.store(out, lisa.activation(lnl.copy, lnl.load(x), scale=2.0))
        return out

    outputs, profile = simulate.profile(kernel, x, target="trn2")
    np.testing.assert_array_equal(outputs, 2 * x)
    assert profile.target == "trn2" and profile.latency_us > 0


@nki.jit
def _scale_by(x, s):
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    t = nl.load(x)
    y = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=y, data=t, op0=nl.multiply, operand0=s)
    nl.store(out, nl.add(s, y))  # the scalar on the left of an nl.* op
    return out


@pytest.mark.parametrize(
    "scalar", [np.float32(1.5), np.float16(1.5), np.float64(1.5), np.int32(3), np.bool_(True)]
)
def test_numpy_scalars_are_not_nki_values(rng, monkeypatch, scalar):
    """NKI values are Python bool/int/float (nki-language-guide.rst@81ce03ae L141-156): a NumPy
    scalar argument is rejected before the kernel runs; the same number as a Python float runs."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    x = rng.standard_normal((64, 96)).astype(np.float32)
    with pytest.raises(TypeError, match=r"argument `s` .*NumPy scalar.*not an NKI value"):
        _scale_by(x, scalar)
    value = np.float32(float(scalar))
    np.testing.assert_array_equal(_scale_by(x, float(scalar)), value + x * value)


def test_each_dialect_runs_on_its_documented_default_target(monkeypatch):
    monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE", raising=False)
    assert DIALECT_DEFAULT_TARGET == {"legacy": "trn1", "nki06": "trn3"}
    seen = {}

    @nki.jit
    def nki06_kernel(x):
        seen["nki06"] = nisa.get_nc_version()
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nl.store(out, nl.load(x))
        return out

    @simulate.jit
    def legacy_kernel(x):
        seen["legacy"] = lisa.get_nc_version()
        out = lnl.ndarray(x.shape, x.dtype, buffer=lnl.shared_hbm)
        lnl.store(out, lnl.load(x))
        return out

    x = np.ones((4, 4), np.float32) * 3
    nki06_kernel(x)
    simulate.simulate_kernel(legacy_kernel, x)
    for dialect, version in seen.items():
        assert version.value == TARGETS[DIALECT_DEFAULT_TARGET[dialect]].nc_version
    assert (seen["legacy"].value, seen["nki06"].value) == (2, 4)
