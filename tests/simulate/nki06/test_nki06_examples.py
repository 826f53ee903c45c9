"""Kernels in the nki 0.6 dialect built from the constructs of AWS's 0.6 examples (tensor
addition, tiled matmul, average pool, fused mamba; aws-neuron-sdk ``nki/examples/`` at
``81ce03ae``), checked against float64 NumPy; and, when the SDK docs mirror is on this
machine, AWS's unmodified example files themselves (they are never copied into the
project)."""

from __future__ import annotations

import os
import runpy
import subprocess
from pathlib import Path

import numpy as np
import pytest

import simulate.nki06 as nki
from simulate.nki06 import isa as nisa
from simulate.nki06 import language as nl

P = 128


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    monkeypatch.delenv("NKI_PRECISE_FP", raising=False)


@nki.jit
def tiled_add(a, b):
    """dma_copy into SBUF tiles, tensor_tensor, dma_copy out; ragged last row tile."""
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    rows, cols = a.shape
    for r0 in range(0, rows, P):
        n = min(P, rows - r0)
        ta = nl.ndarray((P, cols), dtype=a.dtype, buffer=nl.sbuf)
        tb = nl.ndarray((P, cols), dtype=b.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=ta[0:n], src=a[r0 : r0 + n])
        nisa.dma_copy(dst=tb[0:n], src=b[r0 : r0 + n])
        tc = nl.ndarray((P, cols), dtype=a.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=tc[0:n], data1=ta[0:n], data2=tb[0:n], op=nl.add)
        nisa.dma_copy(dst=out[r0 : r0 + n], src=tc[0:n])
    return out


def test_tiled_add(rng):
    a = rng.standard_normal((300, 96)).astype(np.float32)
    b = rng.standard_normal((300, 96)).astype(np.float32)
    np.testing.assert_array_equal(tiled_add(a, b), a + b)


@nki.jit
def tiled_matmul(lhs_t, rhs):
    """K-tiled PSUM accumulation with nc_matmul(accumulate=k > 0), copy out through SBUF."""
    k_total, m_total = lhs_t.shape
    _, n_total = rhs.shape
    out = nl.ndarray((m_total, n_total), dtype=nl.float32, buffer=nl.shared_hbm)
    tile_n = nl.tile_size.gemm_moving_fmax
    for m0 in range(0, m_total, P):
        for n0 in range(0, n_total, tile_n):
            acc = nl.ndarray((P, tile_n), nl.float32, buffer=nl.psum)
            for k in range(k_total // P):
                st = nl.ndarray((P, P), lhs_t.dtype, buffer=nl.sbuf)
                mv = nl.ndarray((P, tile_n), rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=st, src=lhs_t[k * P : (k + 1) * P, m0 : m0 + P])
                nisa.dma_copy(dst=mv, src=rhs[k * P : (k + 1) * P, n0 : n0 + tile_n])
                nisa.nc_matmul(dst=acc, stationary=st, moving=mv, accumulate=k > 0)
            res = nl.ndarray((P, tile_n), nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=res, src=acc)
            nisa.dma_copy(dst=out[m0 : m0 + P, n0 : n0 + tile_n], src=res)
    return out


def test_tiled_matmul_bf16_inputs(rng):
    import ml_dtypes

    lhs_t = rng.standard_normal((384, 256)).astype(ml_dtypes.bfloat16)
    rhs = rng.standard_normal((384, 1024)).astype(ml_dtypes.bfloat16)
    result = tiled_matmul(lhs_t, rhs)
    ref = lhs_t.astype(np.float64).T @ rhs.astype(np.float64)
    np.testing.assert_allclose(result, ref, rtol=1e-5, atol=1e-4)
    counts = nki.last_trace().count()
    assert counts["pe"] == 2 * 2 * 3


@nki.jit
def average_pool(x, pool):
    """Pooling windows as an .ap() view of the SBUF tile, nl.sum over two axes, scale."""
    c, h, w = x.shape
    out = nl.ndarray((c, h // pool, w // pool), dtype=x.dtype, buffer=nl.shared_hbm)
    tile = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=x)
    windows = tile.ap([[h * w, c], [pool * w, h // pool], [pool, w // pool], [w, pool], [1, pool]])
    total = nl.sum(windows, axis=[3, 4], dtype=nl.float32)
    scaled = nl.ndarray(total.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=scaled, data=total, op0=nl.multiply, operand0=1.0 / (pool * pool))
    nisa.dma_copy(dst=out, src=scaled)
    return out


def test_average_pool(rng):
    x = rng.standard_normal((64, 12, 18)).astype(np.float32)
    ref = x.astype(np.float64).reshape(64, 4, 3, 6, 3).mean(axis=(2, 4))
    np.testing.assert_allclose(average_pool(x, 3), ref, rtol=1e-5, atol=1e-6)


@nki.jit
def selective_scan(delta, u, a, b, c):
    """Mamba-style scan: exp(delta*A) on the Scalar engine, partition broadcast of B/C rows,
    tensor_tensor_scan over sequence chunks chained through a (P, 1) carry."""
    channels, seq = delta.shape
    _, states = a.shape
    chunk = 64
    out = nl.ndarray((channels, seq), dtype=delta.dtype, buffer=nl.shared_hbm)
    d_sb = nl.load(delta)
    du = nl.multiply(d_sb, nl.load(u))
    acc = nl.zeros((channels, seq), dtype=nl.float32)
    for s in range(states):
        a_col = nl.load(a[:, s : s + 1])
        carry = nl.zeros((channels, 1), dtype=nl.float32)
        b_row = nl.broadcast_to(nl.load(b[s : s + 1, :]), (channels, seq))
        c_row = nl.broadcast_to(nl.load(c[s : s + 1, :]), (channels, seq))
        for t0 in range(0, seq, chunk):
            cols = slice(t0, t0 + chunk)
            decay = nl.ndarray((channels, chunk), nl.float32)
            nisa.activation(dst=decay, op=nl.exp, data=d_sb[:, cols], scale=a_col)
            drive = nl.ndarray((channels, chunk), nl.float32)
            nisa.tensor_tensor(dst=drive, data1=du[:, cols], data2=b_row[:, cols], op=nl.multiply)
            state = nl.ndarray((channels, chunk), nl.float32)
            nisa.tensor_tensor_scan(
                dst=state, data0=decay, data1=drive, initial=carry, op0=nl.multiply, op1=nl.add
            )
            nisa.tensor_copy(dst=carry, src=state[:, chunk - 1 : chunk])
            contribution = nl.ndarray((channels, chunk), nl.float32)
            nisa.tensor_tensor(dst=contribution, data1=state, data2=c_row[:, cols], op=nl.multiply)
            nisa.tensor_tensor(dst=acc[:, cols], data1=acc[:, cols], data2=contribution, op=nl.add)
    nisa.dma_copy(dst=out, src=acc)
    return out


def test_selective_scan(rng):
    channels, seq, states = 96, 192, 3
    delta = rng.uniform(0.01, 0.2, (channels, seq)).astype(np.float32)
    u = rng.standard_normal((channels, seq)).astype(np.float32)
    a = -rng.uniform(0.5, 2.0, (channels, states)).astype(np.float32)
    b = rng.standard_normal((states, seq)).astype(np.float32)
    c = rng.standard_normal((states, seq)).astype(np.float32)
    ref = np.zeros((channels, seq))
    for s in range(states):
        decay = np.exp(delta.astype(np.float64) * a[:, s : s + 1])
        drive = delta.astype(np.float64) * u * b[s]
        h = np.zeros(channels)
        for t in range(seq):
            h = decay[:, t] * h + drive[:, t]
            ref[:, t] += h * c[s, t]
    np.testing.assert_allclose(selective_scan(delta, u, a, b, c), ref, rtol=2e-4, atol=2e-5)


# --- AWS's own examples, only where the SDK docs mirror exists (never in CI) ---
MIRROR = Path("/work/.mirror/aws-neuron+aws-neuron-sdk/repo")
EXAMPLES = {
    "getting_started_baremetal.py": (),
    "simulate/nki_simulate_example.py": (),
    "average_pool2d/average_pool2d_nki_kernels.py": (),
    "transpose2d/transpose2d_nki_kernels.py": (),
    "fused_mamba/mamba_nki_kernels.py": ("--seq_len", "512", "--state_size", "4"),
}


@pytest.mark.skipif(not MIRROR.is_dir(), reason="the aws-neuron-sdk docs mirror is not here")
@pytest.mark.parametrize("path", sorted(EXAMPLES))
def test_unmodified_aws_example_runs(path, tmp_path, monkeypatch):
    source = subprocess.run(
        ["git", "-C", str(MIRROR), "show", f"HEAD:nki/examples/{path}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    script = tmp_path / Path(path).name
    script.write_text(source)
    import simulate

    simulate.install()
    monkeypatch.setattr("sys.argv", [str(script), *EXAMPLES[path]])
    saved = dict(os.environ)
    try:
        runpy.run_path(str(script), run_name="__main__")  # each asserts against NumPy
    finally:
        os.environ.clear()
        os.environ.update(saved)
