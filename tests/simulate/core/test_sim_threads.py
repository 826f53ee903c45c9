"""Concurrent launches: every thread runs its own kernel context, so kernels launched from
several threads at once (the torch and JAX bindings, thread pools) give the serial results."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np

import simulate
import simulate.isa as nisa
import simulate.language as nl

THREADS = 8
LAUNCHES = 10


@simulate.jit(mode="trace")
def _scaled_exp(tile, scale):
    """A sub-kernel: inlined into its caller, it must see the caller's context."""
    return nisa.activation(op=nl.exp, data=tile, scale=scale)


@simulate.jit
def _row_softmax_like(x):
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    for i in nl.affine_range(x.shape[0] // 32):
        tile = nl.load(x[i * 32 : (i + 1) * 32, :])
        shifted = nl.subtract(tile, nl.max(tile, axis=1, keepdims=True))
        expo = _scaled_exp(shifted, 0.5)
        total = nisa.tensor_reduce(np.add, expo, axis=1, keepdims=True)
        nl.store(out[i * 32 : (i + 1) * 32, :], nl.divide(expo, total))
    return out


def _inputs():
    rng = np.random.default_rng(1234)
    shapes = [(32 * (1 + k % 4), 16 * (1 + k % 3)) for k in range(THREADS)]
    return [rng.standard_normal(shape).astype(np.float32) for shape in shapes]


def _launch_repeatedly(x):
    results = []
    for _ in range(LAUNCHES):
        out = _row_softmax_like(x)
        trace = simulate.last_trace()
        kernel_trace = _row_softmax_like.last_trace
        results.append((out, trace, kernel_trace))
    return results


def test_concurrent_launches_match_the_serial_results():
    inputs = _inputs()
    serial = [_row_softmax_like(x) for x in inputs]
    serial_lengths = []
    for x in inputs:
        _row_softmax_like(x)
        serial_lengths.append(len(simulate.last_trace()))
    with ThreadPoolExecutor(max_workers=THREADS) as pool:
        futures = [pool.submit(_launch_repeatedly, x) for x in inputs]
        results = [f.result(timeout=60) for f in futures]  # a deadlock fails, not hangs
    for expected, length, runs in zip(serial, serial_lengths, results):
        assert len(runs) == LAUNCHES
        for out, trace, kernel_trace in runs:
            assert out.shape == expected.shape
            assert np.array_equal(out.view(np.uint32), expected.view(np.uint32))
            # the calling thread's own run, not another thread's
            assert trace is kernel_trace
            assert len(trace) == length
    # the serial reference is right, so equality above means the right numbers
    x = inputs[0]
    shifted = x.astype(np.float64) - x.max(axis=1, keepdims=True)
    expo = np.exp(0.5 * shifted)
    np.testing.assert_allclose(serial[0], expo / expo.sum(axis=1, keepdims=True), rtol=1e-5)


def test_a_thread_without_launches_has_no_last_trace():
    _row_softmax_like(_inputs()[0])
    assert simulate.last_trace() is not None
    with ThreadPoolExecutor(max_workers=1) as pool:
        other = pool.submit(lambda: (simulate.last_trace(), _row_softmax_like.last_trace))
        assert other.result(timeout=60) == (None, None)
