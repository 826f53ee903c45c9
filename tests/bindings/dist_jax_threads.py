"""Threads calling the jitted JAX binding at once, on 2 host devices, vs the same calls made
one after another.

Run as a script by ``test_distributed.py`` in a fresh interpreter under a timeout: with the
``pure_callback`` binding, four threads calling a jitted ``rms_norm`` deadlocked at
``np.asarray`` of a callback argument (a deadlock once), and a deadlock must fail the test
rather than hang it. Every thread checks its results bit for bit against the serial ones.
"""

from __future__ import annotations

import os
import sys
import threading
import time

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from nki_rmsnorm import jax as nki_jax  # noqa: E402

THREADS = int(sys.argv[1]) if len(sys.argv) > 1 else 8
CALLS = int(sys.argv[2]) if len(sys.argv) > 2 else 20
JOIN_TIMEOUT_S = 90


def loss(x, residual, w, b):
    y, h = nki_jax.fused_add_rms_norm(x, residual, w, bias=b)
    return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(jnp.cos(h.astype(jnp.float32)))


def main() -> None:
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    rng = np.random.default_rng(0)
    inputs = []
    for i in range(CALLS):
        rows = (64, 24, 130)[i % 3]  # different shapes: different compiled programs
        x = jnp.asarray(rng.standard_normal((rows, 1024)), (jnp.float32, jnp.bfloat16)[i % 2])
        residual = jnp.asarray(rng.standard_normal((rows, 1024)), jnp.float32)
        w = jnp.asarray(1 + 0.1 * rng.standard_normal(1024), x.dtype)
        b = jnp.asarray(rng.standard_normal(1024), jnp.float32)
        inputs.append((x, residual, w, b))
    serial = [jax.tree.map(np.asarray, step(*args)) for args in inputs]

    failures = []

    def worker(offset: int) -> None:
        try:
            for k in range(CALLS):
                i = (k + offset) % CALLS
                # Inputs computed on the spot, so that each call's arguments are still being
                # produced when its callbacks start (as in a training loop).
                x, residual, w, b = inputs[i]
                got = jax.tree.map(np.asarray, step(x * 1, residual, w, b))
                for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(serial[i])):
                    np.testing.assert_array_equal(a, b)
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            failures.append(repr(error))

    threads = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(THREADS)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    deadline = start + JOIN_TIMEOUT_S
    for thread in threads:
        thread.join(max(0.0, deadline - time.perf_counter()))
    alive = sum(thread.is_alive() for thread in threads)
    if alive:
        print(
            f"DEADLOCK: {alive} of {THREADS} threads still running after {JOIN_TIMEOUT_S} s",
            flush=True,
        )
        os._exit(3)  # the stuck callback threads would keep the interpreter from exiting
    assert not failures, failures
    print(
        f"{THREADS} threads x {CALLS} jitted value_and_grad calls match the serial results "
        f"bit for bit ({time.perf_counter() - start:.1f} s)"
    )


if __name__ == "__main__":
    main()
