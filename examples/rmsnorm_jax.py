"""RMSNorm through the NKI kernels from JAX, checked against a float64 NumPy RMSNorm.

Two ways in:

1. the Neuron RMSNorm tutorial's launch, ``jax_neuronx.nki_call(kernel, x, w, out_shape=...)``
   with the output-parameter kernel ``rmsnorm_fwd_out`` (jax-neuronx of Neuron SDK 2.20 -
   2.22; on CPU, ``simulate.install()`` provides a simulated ``nki_call``);
2. the high-level API, ``nki_rmsnorm.jax.rms_norm``, differentiable, under ``jax.jit``.

On a Neuron JAX backend (``jax.default_backend() == "neuron"``) the kernels are compiled
into the XLA program; on any other backend they run in the NKI simulator inside a host
callback. Prints the largest error of each output and gradient against the plain formula
evaluated in float64 and against ``jax.numpy``, and the time per jitted call.

    python examples/rmsnorm_jax.py [--rows 256] [--hidden 1024] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from nki_rmsnorm import jax as nki_jax
from nki_rmsnorm import kernels, nki

if nki.SIMULATED:  # no Neuron compiler: kernels and jax_neuronx.nki_call are simulated
    import simulate

    simulate.install()
try:
    from jax_neuronx import nki_call
except ImportError:  # Neuron SDK >= 2.23: nki_call is gone, kernels are called directly
    nki_call = None


def reference(x, w, dy, eps):
    """y, dx, dweight of ``y = x·rsqrt(mean(x²) + eps)·w`` in float64 NumPy."""
    x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
    rstd = 1 / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)
    xhat = x * rstd
    g = dy * w
    dx = rstd * (g - xhat * np.mean(g * xhat, -1, keepdims=True))
    return xhat * w, dx, (dy * xhat).reshape(-1, x.shape[-1]).sum(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rows", type=int, default=256, help="sequence length")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()
    dtype = jnp.dtype(args.dtype)
    eps = 1e-6

    kx, kw, kd = jax.random.split(jax.random.PRNGKey(0), 3)
    shape = (args.batch, args.rows, args.hidden)
    x = jax.random.normal(kx, shape).astype(dtype)
    w = (1 + 0.1 * jax.random.normal(kw, (args.hidden,))).astype(dtype)
    dy = jax.random.normal(kd, shape).astype(dtype)

    eps_dtype = float(jnp.finfo(dtype).eps)

    def max_err(a, b):
        """Largest error, and that error relative to max |reference| in units of the dtype's
        epsilon (≈ 1 for a correctly rounded result at the largest value)."""
        err = float(np.max(np.abs(np.asarray(a, np.float64) - b)))
        scale = float(np.max(np.abs(b))) or 1.0
        return f"{err:.3e}  ({err / scale / eps_dtype:.2f} eps of max |ref|)"

    def jnp_rms_norm(x, w):
        """The formula in jax.numpy, float32 math on upcast inputs, one rounding."""
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps) * w
        return y.astype(x.dtype)

    print(
        f"backend: {jax.default_backend()} "
        f"({'NKI on device' if jax.default_backend() == 'neuron' else 'kernels simulated'});"
        f" x {shape} {args.dtype}; launch path: {nki_jax.launch_path()}"
    )

    # 1. The tutorial's launch: an output-parameter kernel, outputs described by out_shape.
    if nki_call is None:
        print("jax_neuronx.nki_call: not in this Neuron SDK (removed in 2.23), skipped")
    else:
        # nki_call exists in the legacy SDKs only (2.20 - 2.22): the legacy kernels
        kernel = functools.partial(
            kernels.kernel("rmsnorm_fwd_out", "legacy"), eps=eps, offset=0.0, casting_mode="gemma"
        )
        x2d = x.reshape(-1, args.hidden)
        y_call, _ = nki_call(
            kernel,
            x2d,
            w,
            None,
            out_shape=(
                jax.ShapeDtypeStruct(x2d.shape, x2d.dtype),
                jax.ShapeDtypeStruct(x2d.shape[:1], jnp.float32),
            ),
        )
        y_call = y_call.reshape(shape)
        print(
            f"nki_call(rmsnorm_fwd_out, x, w, out_shape=...):"
            f" max |y - reference| = {max_err(y_call, reference(x, w, dy, eps)[0])}, "
            f"max |y - jnp| = {max_err(y_call, np.asarray(jnp_rms_norm(x, w), np.float64))}"
        )

    # 2. The high-level API.
    @jax.jit
    def forward_backward(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: nki_jax.rms_norm(x, w, eps), x, w)
        return (y, *vjp(dy))

    forward = jax.jit(lambda x, w: nki_jax.rms_norm(x, w, eps))

    y, dx, dw = forward_backward(x, w, dy)
    y_ref, dx_ref, dw_ref = reference(x, w, dy, eps)

    print("nki_rmsnorm.jax.rms_norm (jit, vjp):")
    print(f"max |y - reference|        = {max_err(y, y_ref)}")
    print(f"max |y - jnp|              = {max_err(y, np.asarray(jnp_rms_norm(x, w), np.float64))}")
    print(f"max |dx - reference|       = {max_err(dx, dx_ref)}")
    print(
        f"max |dweight - reference|  = {max_err(dw, dw_ref)}"
        f"  (sum over {args.batch * args.rows} rows)"
    )

    def timed(fn, *a):
        jax.block_until_ready(fn(*a))  # compile outside the timing
        start = time.perf_counter()
        for _ in range(args.iters):
            jax.block_until_ready(fn(*a))
        return (time.perf_counter() - start) / args.iters * 1e3

    print(
        f"time per jitted call: forward {timed(forward, x, w):.1f} ms, forward+backward "
        f"{timed(forward_backward, x, w, dy):.1f} ms ({args.iters} iterations)"
    )


if __name__ == "__main__":
    main()
