"""AWS's nki-library norm kernels, unmodified, under the 0.6 front-end with its language checker
on: the simulator must accept all of AWS's known-compiling code (its corpus of NKI 0.x kernels,
aws-neuron/nki-library). They run from a local checkout named by ``NKI_LIBRARY_PATH`` (the
repository root, holding ``src/nkilib_src``); without one these tests skip. Nothing of AWS's
code is copied here: the references are float64 NumPy written for these tests."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import numpy as np
import pytest

import simulate.nki06 as nki
from simulate.nki06 import language_check

LIBRARY = Path(os.environ.get("NKI_LIBRARY_PATH", "/nonexistent"))
SOURCES = LIBRARY / "src"

pytestmark = pytest.mark.skipif(
    not (SOURCES / "nkilib_src" / "nkilib").is_dir(),
    reason="NKI_LIBRARY_PATH does not name an aws-neuron/nki-library checkout",
)


@pytest.fixture(scope="module")
def nkilib():
    """``nkilib_src.nkilib`` imported from the checkout, with ``import nki`` bound to the
    simulator (AWS's kernels import ``nki``, ``nki.language``, ``nki.isa``)."""
    nki.install()
    sys.path.insert(0, str(SOURCES))
    try:
        yield importlib.import_module("nkilib_src.nkilib")
    finally:
        sys.path.remove(str(SOURCES))


@pytest.fixture(autouse=True)
def _trn2(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    monkeypatch.delenv(language_check.ENV_SWITCH, raising=False)  # the checker is on


def _module(name):
    return importlib.import_module(f"nkilib_src.nkilib.{name}")


def _tile_layout(y, lnc):
    """[B, S, H] → the [128, B·S, H/128] layout of AWS's tkg norms: hidden index h = p·F + f
    on one core; under LNC=2 each half of H is laid out so, the halves side by side along the
    free dimension (the layout AWS's tests expect of these kernels)."""
    b, s, h = y.shape
    rows = y.reshape(b * s, h)
    halves = [rows[:, k * h // lnc : (k + 1) * h // lnc] for k in range(lnc)]
    tiles = [half.reshape(b * s, 128, -1).transpose(1, 0, 2) for half in halves]
    return np.concatenate(tiles, axis=2)


def _rms_reference(x, gamma, eps):
    x64 = x.astype(np.float64)
    rms = np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return x64 / rms * gamma.astype(np.float64).reshape(-1)


def _layer_reference(x, gamma, beta, eps):
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=-1, keepdims=True)
    var = ((x64 - mean) ** 2).mean(axis=-1, keepdims=True)
    y = (x64 - mean) / np.sqrt(var + eps) * gamma.astype(np.float64).reshape(-1)
    return y + beta.astype(np.float64).reshape(-1)


def _launch(kernel, lnc, *args):
    return (kernel[lnc] if lnc == 2 else kernel)(*args)


@pytest.mark.parametrize("lnc, batch, seq, hidden", [(1, 1, 4, 2048), (2, 2, 8, 8192)])
def test_rmsnorm_tkg_runs_under_the_checker(nkilib, rng, lnc, batch, seq, hidden):
    rmsnorm_tkg = _module("core.subkernels.rmsnorm_tkg").rmsnorm_tkg

    def rmsnorm_tkg_into(x, gamma, out):  # AWS's harness passes `out` as a written input
        rmsnorm_tkg(x, gamma, out)

    x = rng.standard_normal((batch, seq, hidden)).astype(np.float16)
    gamma = rng.standard_normal((1, hidden)).astype(np.float16)
    out = np.full((128, batch * seq, hidden // 128), np.nan, np.float16)
    _launch(nki.jit(rmsnorm_tkg_into), lnc, x, gamma, out)
    expected = _tile_layout(_rms_reference(x, gamma, 1e-6), lnc)
    np.testing.assert_allclose(out.astype(np.float64), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("lnc, batch, seq, hidden", [(1, 1, 4, 2048), (2, 2, 8, 8192)])
def test_layernorm_tkg_runs_under_the_checker(nkilib, rng, lnc, batch, seq, hidden):
    layernorm_tkg = _module("core.subkernels.layernorm_tkg").layernorm_tkg

    def layernorm_tkg_into(x, gamma, beta, out):
        layernorm_tkg(x, gamma, out, beta=beta)

    x = rng.standard_normal((batch, seq, hidden)).astype(np.float16)
    gamma = rng.standard_normal((1, hidden)).astype(np.float16)
    beta = rng.standard_normal((1, hidden)).astype(np.float16)
    out = np.full((128, batch * seq, hidden // 128), np.nan, np.float16)
    _launch(nki.jit(layernorm_tkg_into), lnc, x, gamma, beta, out)
    expected = _tile_layout(_layer_reference(x, gamma, beta, 1e-6), lnc)
    np.testing.assert_allclose(out.astype(np.float64), expected, rtol=2e-2, atol=2e-2)


def test_rmsnorm_quant_runs_under_the_checker(nkilib, rng):
    quant = _module("core.rmsnorm.rmsnorm_quant")
    kargs = quant.RmsNormQuantKernelArgs(eps=1e-6)
    batch, seq, hidden = 1, 256, 512
    x = (
        rng.standard_normal((batch, seq, hidden))
        .astype(np.float32)
        .astype(nki.language.bfloat16.numpy)
    )
    gamma = rng.standard_normal((1, hidden)).astype(nki.language.bfloat16.numpy)
    packed = quant.rmsnorm_quant_kernel(x, gamma, kargs)
    assert packed.shape == (batch, seq, hidden + 4)  # fp8 values, then the fp32 scale's 4 bytes
    values = packed[..., :hidden].astype(np.float64)
    scale = np.ascontiguousarray(packed[..., hidden:]).view(np.float32).astype(np.float64)
    expected = _rms_reference(x, gamma, 1e-6)
    # fp8 e4m3 keeps 3 mantissa bits: half an ulp is 1/16 of the value, plus the bf16 inputs
    np.testing.assert_allclose(
        values * scale, expected, rtol=0.08, atol=0.08 * np.abs(expected).max()
    )


def test_every_importable_aws_kernel_passes_the_static_check(nkilib):
    """The static pass over every ``@nki.jit`` kernel of the checkout that imports here."""
    base = Path(nkilib.__path__[0])
    kernels = []
    for path in sorted(base.rglob("*.py")):
        if path.name == "__init__.py" or path.stem.endswith("_torch"):
            continue
        name = "nkilib_src.nkilib." + ".".join(path.relative_to(base).with_suffix("").parts)
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - APIs the simulator does not model (MX dtypes, ...)
            continue
        for value in vars(module).values():
            if isinstance(value, nki.Kernel) and value.func.__module__ == name:
                kernels.append(value)
    assert len(kernels) >= 10
    violations = [v.short() for k in kernels for v in language_check.find_violations(k)]
    assert violations == []
