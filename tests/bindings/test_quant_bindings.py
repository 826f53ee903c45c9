"""The quantized forward through the torch custom op and the JAX binding: the same bytes as
the NumPy launcher, the fake (meta) implementation's shapes, and bad input rejected before a
launch."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from nki_rmsnorm import dialect, ops

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(autouse=True)
def _trn2_nki06(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    with dialect.use_dialect("nki06"):
        yield


def _data(rng, shape=(2, 70, 384)):
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


def _torch_bytes(t) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


@pytest.mark.parametrize("scale_mode", ["row", "block"])
def test_torch_matches_numpy(rng, scale_mode):
    from nki_rmsnorm import torch as nt

    x, weight, residual = _data(rng)
    kwargs = dict(scale_mode=scale_mode, block=64, return_y=True, return_amax=True)
    want = ops.rms_norm_quant(x, weight, residual=residual, **kwargs)
    got = nt.rms_norm_quant(_torch(x), _torch(weight), residual=_torch(residual), **kwargs)
    assert got.y_q.dtype == torch.float8_e4m3fn  # the trn2 e4m3 values, same bits
    np.testing.assert_array_equal(_torch_bytes(got.y_q), _bytes(want.y_q))
    np.testing.assert_array_equal(got.y_q.float().numpy(), want.y_q.astype(np.float32))
    for name in ("scales", "y", "h", "amax"):
        np.testing.assert_array_equal(_torch_bytes(getattr(got, name)), _bytes(getattr(want, name)))


def test_torch_static_packed_and_e5m2(rng):
    from nki_rmsnorm import torch as nt

    x, weight, _ = _data(rng)
    got = nt.rms_norm_quant(
        _torch(x),
        _torch(weight),
        quant_dtype=torch.float8_e5m2,
        scale_mode="static",
        static_scale=torch.tensor([0.01]),
    )
    want = ops.rms_norm_quant(
        x, weight, quant_dtype="float8_e5m2", scale_mode="static", static_scale=0.01
    )
    assert got.y_q.dtype == torch.float8_e5m2 and got.scales is None
    np.testing.assert_array_equal(_torch_bytes(got.y_q), _bytes(want.y_q))
    packed = nt.rms_norm_quant(_torch(x), _torch(weight), packed=True)
    assert packed.y_q.shape == (2, 70, 388)
    np.testing.assert_array_equal(
        _torch_bytes(packed.y_q), _bytes(ops.rms_norm_quant(x, weight, packed=True).y_q)
    )


def test_torch_fake_shapes():
    from nki_rmsnorm import torch as nt

    x = torch.empty((3, 5, 256), dtype=torch.bfloat16, device="meta")
    got = nt.rms_norm_quant(
        x,
        None,
        scale_mode="block",
        block=128,
        return_y=True,
        return_amax=True,
        residual=torch.empty_like(x),
    )
    assert got.y_q.shape == (3, 5, 256) and got.y_q.dtype == torch.float8_e4m3fn
    assert got.scales.shape == (3, 5, 2) and got.scales.dtype == torch.float32
    assert got.y.shape == got.h.shape == (3, 5, 256) and got.amax.shape == (3, 5)
    out = torch.library.opcheck(
        torch.ops.nki_rmsnorm.rms_norm_quant,
        (
            torch.randn(4, 128, dtype=torch.bfloat16),
            None,
            None,
            None,
            1e-6,
            "float8_e4m3",
            "row",
            128,
            None,
            1e-6,
            False,
            True,
            False,
            False,
        ),
        test_utils=("test_schema", "test_faketensor"),
    )
    assert all(v == "SUCCESS" for v in out.values())


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        (dict(quant_dtype=torch.float16), TypeError, "quant_dtype"),
        (dict(quant_dtype="float8_e4m3fn"), ValueError, "quant_dtype"),
        (
            dict(scale_mode="static", static_scale=torch.tensor([1.0], dtype=torch.float64)),
            TypeError,
            "static_scale",
        ),
        (dict(scale_mode="block", block=100), ValueError, "block=100"),
        (dict(return_amax="yes"), TypeError, "return_amax"),
    ],
)
def test_torch_bad_input(monkeypatch, kwargs, error, words):
    from nki_rmsnorm import torch as nt
    from nki_rmsnorm.kernels.nki06 import rmsnorm_quant as module

    def launched(*args, **kwargs):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(module, "rmsnorm_quant", launched)
    with pytest.raises(error, match=words):
        nt.rms_norm_quant(torch.zeros(4, 256, dtype=torch.bfloat16), None, **kwargs)


# --- JAX -----------------------------------------------------------------------------------
def test_jax_matches_numpy_under_jit(rng):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from nki_rmsnorm import jax as nj

    x, weight, residual = _data(rng)
    kwargs = dict(scale_mode="row", return_y=True, return_amax=True)
    want = ops.rms_norm_quant(x, weight, residual=residual, **kwargs)

    @jax.jit
    def run(x, weight, residual):
        return nj.rms_norm_quant(x, weight, residual=residual, **kwargs)

    got = run(jnp.asarray(x), jnp.asarray(weight), jnp.asarray(residual))
    assert got.y_q.dtype == jnp.float8_e4m3
    for name in ("y_q", "scales", "y", "h", "amax"):
        np.testing.assert_array_equal(_bytes(getattr(got, name)), _bytes(getattr(want, name)))


def test_jax_bad_input_at_trace_time():
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from nki_rmsnorm import jax as nj

    x = jnp.zeros((4, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="block=96"):
        nj.rms_norm_quant(x, scale_mode="block", block=96)
    with pytest.raises(TypeError, match="static_scale"):
        nj.rms_norm_quant(x, scale_mode="static", static_scale=jnp.ones(1))
    with pytest.raises(TypeError, match="return_transposed"):
        nj.rms_norm_quant(x, return_transposed=None)


# --- the transposed output -----------------------------------------------------------------
@pytest.mark.parametrize("scale_mode", ["row", "static"])
def test_torch_transposed_matches_numpy(rng, scale_mode):
    from nki_rmsnorm import torch as nt

    x, weight, _ = _data(rng, (2, 100, 256))
    static = dict(static_scale=0.01) if scale_mode == "static" else {}
    kwargs = dict(scale_mode=scale_mode, return_transposed=True, **static)
    want = ops.rms_norm_quant(x, weight, **kwargs)
    got = nt.rms_norm_quant(_torch(x), _torch(weight), **kwargs)
    assert got.y_q_t.shape == (256, 200) and got.y_q_t.dtype == torch.float8_e4m3fn
    np.testing.assert_array_equal(_torch_bytes(got.y_q_t), _bytes(want.y_q_t))
    if scale_mode == "static":
        assert got.scales_t is None and want.scales_t is None
    else:
        np.testing.assert_array_equal(got.scales_t.numpy(), want.scales_t)
    fake = nt.rms_norm_quant(torch.empty((2, 100, 256), device="meta"), None, **kwargs)
    assert fake.y_q_t.shape == got.y_q_t.shape
    assert (fake.scales_t is None) == (scale_mode == "static")
    if fake.scales_t is not None:
        assert fake.scales_t.shape == (256, 2)


def test_torch_transposed_opcheck():
    args = (torch.randn(130, 128, dtype=torch.bfloat16), None, None, None, 1e-6)
    args += ("float8_e4m3", "row", 128, None, 1e-6, False, False, False, True)
    out = torch.library.opcheck(
        torch.ops.nki_rmsnorm.rms_norm_quant, args, test_utils=("test_schema", "test_faketensor")
    )
    assert all(v == "SUCCESS" for v in out.values())


def test_jax_transposed_matches_numpy_under_jit(rng):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from nki_rmsnorm import jax as nj

    x, weight, _ = _data(rng, (3, 50, 384))
    kwargs = dict(scale_mode="block", block=128, return_amax=True, return_transposed=True)
    want = ops.rms_norm_quant(x, weight, **kwargs)

    @jax.jit
    def run(x, weight):
        return nj.rms_norm_quant(x, weight, **kwargs)

    got = run(jnp.asarray(x), jnp.asarray(weight))
    assert got.y_q_t.shape == (384, 150) and got.scales_t.shape == (384, 2)
    for name in ("y_q", "scales", "amax", "y_q_t", "scales_t"):
        np.testing.assert_array_equal(_bytes(getattr(got, name)), _bytes(getattr(want, name)))
