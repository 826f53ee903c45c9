"""Rows sharded over 8 host devices with ``jax.shard_map`` vs the same step on one device.

Run as a script by ``test_distributed.py`` in a fresh interpreter, because the host device
count (``XLA_FLAGS=--xla_force_host_platform_device_count=8``) must be set before JAX starts.
Exits non-zero (an AssertionError) on any mismatch; prints one line per case otherwise.
"""

from __future__ import annotations

import functools
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from nki_rmsnorm import jax as nki_jax  # noqa: E402

DEVICES = 8
ROWS, HIDDEN = 64, 64


def loss(w, x, r):
    """A pre-norm residual step: both outputs of the fused add feed the loss."""
    y, h = nki_jax.fused_add_rms_norm(x, r, w, offset=1.0)
    return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(jnp.sin(h.astype(jnp.float32))), y


def step_vma(w, x, r):
    """check_vma=True: w enters replicated, so JAX psums its gradient over the row shards."""
    (value, y), (dw, dx) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(w, x, r)
    return jax.lax.psum(value, "rows"), dw, dx, y


def step_manual(w, x, r):
    """check_vma=False: each shard has its partial dweight; the step psums it itself."""
    (value, y), (dw, dx) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(w, x, r)
    return jax.lax.psum(value, "rows"), jax.lax.psum(dw, "rows"), dx, y


def y_loss(mesh, w, x, r):
    """Σy² with the forward sharded over ``mesh`` (or on one device without a mesh)."""
    if mesh is None:
        y = loss(w, x, r)[1]
    else:
        y = jax.shard_map(
            lambda w, x, r: loss(w, x, r)[1], mesh=mesh,
            in_specs=(P(), P("rows"), P("rows")), out_specs=P("rows"),
        )(w, x, r)
    return jnp.sum(y.astype(jnp.float32) ** 2)


def check(dtype, step, check_vma, mesh, w, x, r, single):
    specs = dict(in_specs=(P(), P("rows"), P("rows")), out_specs=(P(), P(), P("rows"), P("rows")))
    sharded = jax.jit(jax.shard_map(step, mesh=mesh, check_vma=check_vma, **specs))
    loss_s, dw_s, dx_s, y_s = sharded(w, x, r)
    loss_1, dw_1, dx_1, y_1 = single
    assert len(y_s.sharding.device_set) == DEVICES
    # Row-wise results do not depend on how the rows are split: bit for bit.
    np.testing.assert_array_equal(np.asarray(y_s), np.asarray(y_1))
    np.testing.assert_array_equal(np.asarray(dx_s), np.asarray(dx_1))
    # Reductions over rows only change their summation order.
    np.testing.assert_allclose(np.asarray(dw_s), np.asarray(dw_1), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(float(loss_s), float(loss_1), rtol=1e-5)
    diff = float(jnp.max(jnp.abs(dw_s - dw_1)))
    print(f"{jnp.dtype(dtype).name} check_vma={check_vma}: {DEVICES} shards match one device "
          f"(max |dweight diff| {diff:.3g})")


def main() -> None:
    assert len(jax.devices()) == DEVICES, jax.devices()
    mesh = jax.make_mesh((DEVICES,), ("rows",))
    rows = NamedSharding(mesh, P("rows"))
    rng = np.random.default_rng(0)
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jnp.asarray(rng.standard_normal((ROWS, HIDDEN)), dtype)
        r = jnp.asarray(rng.standard_normal((ROWS, HIDDEN)), dtype)
        w = jnp.asarray(rng.standard_normal(HIDDEN) * 0.1, jnp.float32)

        # One device, no shard_map: the full batch in one launch.
        (loss_1, y_1), (dw_1, dx_1) = jax.jit(
            jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(w, x, r)
        single = (loss_1, dw_1, dx_1, y_1)

        x_s, r_s = jax.device_put(x, rows), jax.device_put(r, rows)
        w_s = jax.device_put(w, NamedSharding(mesh, P()))
        check(dtype, step_vma, True, mesh, w_s, x_s, r_s, single)
        check(dtype, step_manual, False, mesh, w_s, x_s, r_s, single)

        # grad taken outside shard_map, through a sharded forward.
        dw_outer = jax.jit(jax.grad(functools.partial(y_loss, mesh)))(w_s, x_s, r_s)
        dw_ref = jax.grad(functools.partial(y_loss, None))(w, x, r)
        np.testing.assert_allclose(np.asarray(dw_outer), np.asarray(dw_ref), rtol=1e-5, atol=1e-4)
        print(f"{jnp.dtype(dtype).name}: grad outside shard_map matches one device")


if __name__ == "__main__":
    main()
