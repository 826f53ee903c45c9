"""Concurrent calls from 8 threads through the NumPy, PyTorch and JAX front ends.

Run by ``test_concurrency.py`` in a fresh interpreter, under a timeout: a deadlocked thread
cannot be stopped, only its process. Each thread owns one set of inputs and calls every
front end (forward and backward) ``CALLS`` times, interleaved with the other threads; every
result must be bitwise equal to the serial result for the same inputs. Prints ``OK`` and the
number of calls on success; raises on the first mismatch or error.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch

from nki_rmsnorm import jax as nki_jax
from nki_rmsnorm import ops
from nki_rmsnorm import torch as nki_torch

THREADS, CALLS = 8, 20
M, N = 32, 96
RESULT_TIMEOUT_S = 200


def _inputs(seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((M, N)) + 0.3).astype(ml_dtypes.bfloat16)
    w = rng.normal(1.0, 0.2, N).astype(np.float32)
    dy = rng.standard_normal((M, N)).astype(ml_dtypes.bfloat16)
    return x, w, dy


def _numpy_call(x, w, dy):
    y, rstd = ops.rms_norm_fwd(x, w, 1e-6, casting_mode="llama")
    dx, dw, _ = ops.rms_norm_bwd(dy, x, w, rstd, casting_mode="llama")
    return y, dx, dw


def _torch_call(x, w, dy):
    xt = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).requires_grad_()
    wt = torch.from_numpy(w.copy()).requires_grad_()
    y = nki_torch.rms_norm(xt, (N,), wt, 1e-6)
    y.backward(torch.from_numpy(dy.view(np.int16)).view(torch.bfloat16))
    return tuple(t.detach().float().numpy() for t in (y, xt.grad, wt.grad))


def _jax_loss(x, w, dy):
    return (nki_jax.rms_norm(x, w, 1e-6).astype(jnp.float32) * dy.astype(jnp.float32)).sum()


_jax_forward = jax.jit(lambda x, w: nki_jax.rms_norm(x, w, 1e-6))
_jax_grads = jax.jit(jax.grad(_jax_loss, argnums=(0, 1)))


def _jax_call(x, w, dy):
    y = _jax_forward(x, w)
    dx, dw = _jax_grads(x, w, dy)
    return tuple(np.asarray(a) for a in (y, dx, dw))


FRONT_ENDS = {"numpy": _numpy_call, "torch": _torch_call, "jax": _jax_call}


def _bits(arrays):
    return [np.ascontiguousarray(a).view(np.uint8).tobytes() for a in arrays]


def _thread(seed, serial):
    inputs = _inputs(seed)
    for call in range(CALLS):
        for name, front_end in FRONT_ENDS.items():
            if _bits(front_end(*inputs)) != serial[name]:
                raise AssertionError(
                    f"thread {seed}, call {call}: {name} result differs from the serial one"
                )
    return CALLS * len(FRONT_ENDS)


def main():
    serial = [
        {name: _bits(f(*_inputs(seed))) for name, f in FRONT_ENDS.items()}
        for seed in range(THREADS)
    ]
    with ThreadPoolExecutor(max_workers=THREADS) as pool:
        futures = [pool.submit(_thread, seed, serial[seed]) for seed in range(THREADS)]
        calls = sum(f.result(timeout=RESULT_TIMEOUT_S) for f in futures)
    print(f"OK {calls} calls")


if __name__ == "__main__":
    sys.exit(main())
