"""The MX-quantized forward (trn3) through the torch custom op and the JAX binding: the same
bytes as the NumPy launcher, the fake (meta) implementation's shapes and dtypes, and bad
input rejected before a launch."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from nki_rmsnorm import dialect, mx

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(autouse=True)
def _trn3_nki06(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    with dialect.use_dialect("nki06"):
        yield


@pytest.fixture
def no_mx_launch(monkeypatch):
    from nki_rmsnorm.kernels.nki06 import rmsnorm_mx_quant as module

    def launched(*args, **kwargs):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(module, "rmsnorm_mx_quant", launched)


def _data(rng, shape=(2, 70, 1024)):
    x = rng.standard_normal(shape).astype(BF16)
    weight = (1 + 0.2 * rng.standard_normal(shape[-1])).astype(BF16)
    residual = rng.standard_normal(shape).astype(BF16)
    return x, weight, residual


def _bytes(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a)).view(np.uint8)


# --- torch ---------------------------------------------------------------------------------
torch = pytest.importorskip("torch")


def _torch(a):
    from nki_rmsnorm.torch import _from_numpy

    return _from_numpy(a)


@pytest.mark.parametrize("scale_dtype", ["float8_e8m0fnu", "uint8"])
def test_torch_matches_numpy(rng, scale_dtype):
    from nki_rmsnorm import torch as nt

    x, weight, residual = _data(rng)
    want = mx.rms_norm_mx_quant(x, weight, residual=residual, scale_dtype=scale_dtype)
    got = nt.rms_norm_mx_quant(
        _torch(x), _torch(weight), residual=_torch(residual), scale_dtype=scale_dtype
    )
    assert got.y_q.dtype == torch.uint32 and got.y_q.shape == (256, 140)
    assert (
        got.scales.dtype
        == {"float8_e8m0fnu": torch.float8_e8m0fnu, "uint8": torch.uint8}[scale_dtype]
    )
    np.testing.assert_array_equal(got.y_q.numpy(), want.y_q)
    np.testing.assert_array_equal(got.scales.view(torch.uint8).numpy(), _bytes(want.scales))
    np.testing.assert_array_equal(got.h.view(torch.int16).numpy(), want.h.view(np.int16))


def test_torch_fake_shapes_and_opcheck():
    from nki_rmsnorm import torch as nt

    x = torch.empty((3, 5, 1024), dtype=torch.bfloat16, device="meta")
    got = nt.rms_norm_mx_quant(x, None, residual=torch.empty_like(x), scale_dtype=torch.uint8)
    assert got.y_q.shape == (256, 15) and got.y_q.dtype == torch.uint32
    assert got.scales.shape == (32, 15) and got.scales.dtype == torch.uint8
    assert got.h.shape == (3, 5, 1024)
    out = torch.library.opcheck(
        torch.ops.nki_rmsnorm.rms_norm_mx_quant,
        (
            torch.randn(4, 512, dtype=torch.bfloat16),
            None,
            None,
            1e-6,
            "float8_e5m2_x4",
            "float8_e8m0fnu",
        ),
        test_utils=("test_schema", "test_faketensor"),
    )
    assert all(v == "SUCCESS" for v in out.values())


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        (dict(quant_dtype=torch.float8_e4m3fn), TypeError, "quant_dtype"),
        (dict(quant_dtype="float4_e2m1fn_x4"), TypeError, "quant_dtype"),
        (dict(scale_dtype=torch.float32), TypeError, "scale_dtype"),
        (dict(eps="small"), TypeError, "eps"),
    ],
)
def test_torch_bad_input(no_mx_launch, kwargs, error, words):
    from nki_rmsnorm import torch as nt

    with pytest.raises(error, match=words):
        nt.rms_norm_mx_quant(torch.zeros(4, 512, dtype=torch.bfloat16), None, **kwargs)


def test_torch_needs_trn3_and_whole_chunks(monkeypatch, no_mx_launch):
    from nki_rmsnorm import torch as nt

    with pytest.raises(ValueError, match="multiple of 512"):
        nt.rms_norm_mx_quant(torch.zeros(4, 640, dtype=torch.bfloat16))
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    with pytest.raises(ValueError, match="needs trn3"):
        nt.rms_norm_mx_quant(torch.zeros(4, 512, dtype=torch.bfloat16))


# --- JAX -----------------------------------------------------------------------------------
def test_jax_matches_numpy_under_jit(rng):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from nki_rmsnorm import jax as nj

    x, weight, residual = _data(rng)
    want = mx.rms_norm_mx_quant(x, weight, residual=residual, quant_dtype="float8_e5m2_x4")

    @jax.jit
    def run(x, weight, residual):
        return nj.rms_norm_mx_quant(x, weight, residual=residual, quant_dtype="float8_e5m2_x4")

    got = run(jnp.asarray(x), jnp.asarray(weight), jnp.asarray(residual))
    assert got.y_q.dtype == jnp.uint32 and got.scales.dtype == jnp.float8_e8m0fnu
    for name in ("y_q", "scales", "h"):
        np.testing.assert_array_equal(_bytes(getattr(got, name)), _bytes(getattr(want, name)))


def test_jax_bad_input_at_trace_time(no_mx_launch):
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from nki_rmsnorm import jax as nj

    with pytest.raises(ValueError, match="multiple of 512"):
        nj.rms_norm_mx_quant(jnp.zeros((4, 256), jnp.bfloat16))
    with pytest.raises(TypeError, match="scale_dtype"):
        nj.rms_norm_mx_quant(jnp.zeros((4, 512), jnp.bfloat16), scale_dtype="float32")
