"""Rows sharded over N host devices vs the same step on one device.

Run as a script by ``test_distributed.py`` in a fresh interpreter (``python
dist_jax_shard_map.py DEVICES``), because the host device count
(``XLA_FLAGS=--xla_force_host_platform_device_count``) must be set before JAX starts.
Exits non-zero (an AssertionError) on any mismatch; prints one line per case otherwise, with
its wall time.

Cases:
* user ``jax.shard_map`` steps (``check_vma`` on: JAX psums dweight; off: the step psums it),
  and ``grad`` taken outside a sharded forward, at 64×1024 float32 (the size at which the
  ``pure_callback`` binding deadlocked with ≥ 2 devices) and 64×64 bfloat16;
* a row-sharded input passed to ``jax.jit`` without ``shard_map`` (sharding in the types:
  ``jax.make_mesh``'s Explicit axes), up to 1024×4096 bfloat16 with ``grad``: outputs and
  ``dx`` keep the input's sharding and the compiled program has no all-gather;
* the same over ``Auto`` axes (GSPMD: the sharding is not in the types; the binding's
  ``custom_partitioning``), both entry points with ``grad``, inside ``use_dialect`` of the
  non-default dialect: outputs keep the input's sharding, no all-gather, every launch saw
  exactly one device's rows (each shard once per launch), and every kernel that ran, on
  XLA's threads, is the chosen dialect's.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
import zlib

DEVICES = int(sys.argv[1]) if len(sys.argv) > 1 else 8
# The host devices are threads that meet at each collective; every device's kernel runs in a
# simulator host callback, serialised by the GIL, so on a loaded 2-core machine the last one
# can arrive after XLA's default 40 s of waiting, which aborts the process. The test's own
# subprocess timeout bounds the run instead.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_force_host_platform_device_count={DEVICES}"
    + " --xla_cpu_collective_call_terminate_timeout_seconds=600"
).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from dialect_launches import other_dialect, record_launches  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from nki_rmsnorm import dialect, ops  # noqa: E402
from nki_rmsnorm import jax as nki_jax  # noqa: E402


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
            lambda w, x, r: loss(w, x, r)[1],
            mesh=mesh,
            in_specs=(P(), P("rows"), P("rows")),
            out_specs=P("rows"),
        )(w, x, r)
    return jnp.sum(y.astype(jnp.float32) ** 2)


def check_user_shard_map(dtype, step, check_vma, mesh, w, x, r, single):
    specs = dict(in_specs=(P(), P("rows"), P("rows")), out_specs=(P(), P(), P("rows"), P("rows")))
    sharded = jax.jit(jax.shard_map(step, mesh=mesh, check_vma=check_vma, **specs))
    start = time.perf_counter()
    loss_s, dw_s, dx_s, y_s = jax.block_until_ready(sharded(w, x, r))
    seconds = time.perf_counter() - start
    loss_1, dw_1, dx_1, y_1 = single
    assert len(y_s.sharding.device_set) == DEVICES
    # Row-wise results do not depend on how the rows are split: bit for bit.
    np.testing.assert_array_equal(np.asarray(y_s), np.asarray(y_1))
    np.testing.assert_array_equal(np.asarray(dx_s), np.asarray(dx_1))
    # Reductions over rows only change their summation order.
    np.testing.assert_allclose(np.asarray(dw_s), np.asarray(dw_1), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(float(loss_s), float(loss_1), rtol=1e-5)
    print(
        f"{x.shape[0]}x{x.shape[1]} {jnp.dtype(dtype).name} shard_map check_vma={check_vma}:"
        f" {DEVICES} shards match one device ({seconds:.2f} s)"
    )


def user_shard_map_cases(mesh, rows, hidden, dtype, rng):
    x = jnp.asarray(rng.standard_normal((rows, hidden)), dtype)
    r = jnp.asarray(rng.standard_normal((rows, hidden)), dtype)
    w = jnp.asarray(rng.standard_normal(hidden) * 0.1, jnp.float32)
    (loss_1, y_1), (dw_1, dx_1) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        w, x, r
    )
    single = (loss_1, dw_1, dx_1, y_1)
    row_sharding = NamedSharding(mesh, P("rows"))
    x_s, r_s = jax.device_put(x, row_sharding), jax.device_put(r, row_sharding)
    w_s = jax.device_put(w, NamedSharding(mesh, P()))
    check_user_shard_map(dtype, step_vma, True, mesh, w_s, x_s, r_s, single)
    check_user_shard_map(dtype, step_manual, False, mesh, w_s, x_s, r_s, single)
    # grad taken outside shard_map, through a sharded forward.
    dw_outer = jax.jit(jax.grad(functools.partial(y_loss, mesh)))(w_s, x_s, r_s)
    dw_ref = jax.grad(functools.partial(y_loss, None))(w, x, r)
    np.testing.assert_allclose(np.asarray(dw_outer), np.asarray(dw_ref), rtol=1e-5, atol=1e-4)
    print(f"{rows}x{hidden} {jnp.dtype(dtype).name}: grad outside shard_map matches one device")


def sharded_jit_case(mesh, rows, hidden, dtype, rng):
    """No shard_map in user code: the binding keeps the rows where they are."""
    x = jnp.asarray(rng.standard_normal((rows, hidden)), dtype)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(hidden), dtype)
    x_s = jax.device_put(x, NamedSharding(mesh, P("rows")))
    w_s = jax.device_put(w, NamedSharding(mesh, P()))

    def value(x, w):
        return jnp.sum(nki_jax.rms_norm(x, w).astype(jnp.float32) ** 2)

    forward = jax.jit(nki_jax.rms_norm)
    grads = jax.jit(jax.grad(value, argnums=(0, 1)))
    start = time.perf_counter()
    y_s = jax.block_until_ready(forward(x_s, w_s))
    dx_s, dw_s = jax.block_until_ready(grads(x_s, w_s))
    seconds = time.perf_counter() - start
    assert y_s.sharding.is_equivalent_to(x_s.sharding, 2), (y_s.sharding, x_s.sharding)
    assert dx_s.sharding.is_equivalent_to(x_s.sharding, 2), (dx_s.sharding, x_s.sharding)
    for name, compiled in (
        ("forward", forward.lower(x_s, w_s).compile()),
        ("grad", grads.lower(x_s, w_s).compile()),
    ):
        hlo = compiled.as_text()
        assert "all-gather" not in hlo, f"the {name} program gathers the rows"

    y_1 = jax.jit(nki_jax.rms_norm)(x, w)
    dx_1, dw_1 = jax.jit(jax.grad(value, argnums=(0, 1)))(x, w)
    np.testing.assert_array_equal(np.asarray(y_s), np.asarray(y_1))
    np.testing.assert_array_equal(np.asarray(dx_s), np.asarray(dx_1))
    # dweight: per-shard partial sums (rounded to the weight's dtype) psummed by JAX.
    np.testing.assert_allclose(
        np.asarray(dw_s, np.float32),
        np.asarray(dw_1, np.float32),
        rtol=2e-2,
        atol=2e-2 * float(jnp.max(jnp.abs(dw_1))),
    )
    print(
        f"{rows}x{hidden} {jnp.dtype(dtype).name} jit on a row-sharded input: stays sharded "
        f"over {DEVICES} devices, no all-gather, matches one device ({seconds:.2f} s)"
    )


def _record_blocks(patch, seen):
    """Record, for every launch, its kind and a checksum of the rows it was given."""
    for name, kind in (("rms_norm_fwd", "forward"), ("rms_norm_bwd", "backward")):
        original = getattr(ops, name)

        def launch(rows, *args, _original=original, _kind=kind, **kwargs):
            seen.append((_kind, rows.shape, zlib.crc32(np.ascontiguousarray(rows).tobytes())))
            return _original(rows, *args, **kwargs)

        patch.setattr(ops, name, launch)


def auto_axes_case(rows, hidden, dtype, rng):
    """Rows sharded over an Auto (GSPMD) axis, under jit, without shard_map."""
    import pytest

    mesh = jax.make_mesh((DEVICES,), ("rows",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jnp.asarray(rng.standard_normal((rows, hidden)), dtype)
    r = jnp.asarray(rng.standard_normal((rows, hidden)), dtype)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(hidden), dtype)
    x_s, r_s = (jax.device_put(a, NamedSharding(mesh, P("rows"))) for a in (x, r))
    w_s = jax.device_put(w, NamedSharding(mesh, P()))

    def value(x, r, w):
        y, h = nki_jax.fused_add_rms_norm(x, r, w)
        z = nki_jax.rms_norm(h, w)
        return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(jnp.sin(z.astype(jnp.float32)))

    forward = jax.jit(nki_jax.fused_add_rms_norm)
    grads = jax.jit(jax.grad(value, argnums=(0, 1, 2)))
    chosen = other_dialect()
    patch = pytest.MonkeyPatch()
    seen = []
    _record_blocks(patch, seen)
    launches = record_launches(patch)
    start = time.perf_counter()
    with dialect.use_dialect(chosen):
        y_s, h_s = jax.block_until_ready(forward(x_s, r_s, w_s))
        dx_s, dr_s, dw_s = jax.block_until_ready(grads(x_s, r_s, w_s))
        compiled = [f.lower(x_s, r_s, w_s).compile() for f in (forward, grads)]
    seconds = time.perf_counter() - start
    patch.undo()
    with dialect.use_dialect(chosen):
        y_eager = jax.block_until_ready(nki_jax.rms_norm(x_s, w_s))  # no jit: the binding's
    for out in (y_s, h_s, dx_s, dr_s, y_eager):
        assert out.sharding.is_equivalent_to(x_s.sharding, 2), (out.sharding, x_s.sharding)
    for program in compiled:
        assert "all-gather" not in program.as_text(), "the program gathers the rows"
    # Each launch got one device's rows: the forward launches over x's shards, each once.
    block = rows // DEVICES
    assert all(shape == (block, hidden) for _, shape, _ in seen), {s for _, s, _ in seen}
    x_blocks = sorted(
        zlib.crc32(np.ascontiguousarray(np.asarray(x)[i * block : (i + 1) * block]).tobytes())
        for i in range(DEVICES)
    )
    for kind in ("forward", "backward"):
        assert sum(k == kind for k, _, _ in seen) % DEVICES == 0, seen
    first_forward = sorted(c for k, _, c in seen[:DEVICES] if k == "forward")
    assert first_forward == x_blocks, "the first forward's launches are not x's shards"
    assert {launch.dialect for launch in launches} == {chosen}
    # The launches ran on XLA's device threads, where the caller's use_dialect is not set.
    off_main = {launch.thread for launch in launches} - {threading.get_ident()}
    assert off_main, "every launch ran on the calling thread"

    with dialect.use_dialect(chosen):
        y_1, h_1 = jax.jit(nki_jax.fused_add_rms_norm)(x, r, w)
        dx_1, dr_1, dw_1 = jax.jit(jax.grad(value, argnums=(0, 1, 2)))(x, r, w)
    with dialect.use_dialect(chosen):
        y_eager_1 = nki_jax.rms_norm(x, w)
    for got, want in ((y_s, y_1), (h_s, h_1), (dx_s, dx_1), (dr_s, dr_1), (y_eager, y_eager_1)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_allclose(
        np.asarray(dw_s, np.float32),
        np.asarray(dw_1, np.float32),
        rtol=2e-2,
        atol=2e-2 * float(jnp.max(jnp.abs(dw_1.astype(jnp.float32)))),
    )
    print(
        f"{rows}x{hidden} {jnp.dtype(dtype).name} Auto axes: stays sharded over {DEVICES} "
        f"devices, no all-gather, each launch one device's rows, {chosen} kernels on "
        f"{len(off_main)} XLA thread(s), matches one device ({seconds:.2f} s)"
    )


def main() -> None:
    assert len(jax.devices()) == DEVICES, jax.devices()
    mesh = jax.make_mesh((DEVICES,), ("rows",))
    rng = np.random.default_rng(DEVICES)
    user_shard_map_cases(mesh, 64, 1024, jnp.float32, rng)
    user_shard_map_cases(mesh, 64, 64, jnp.bfloat16, rng)
    sharded_jit_case(mesh, 64, 1024, jnp.float32, rng)
    sharded_jit_case(mesh, 1024, 4096, jnp.bfloat16, rng)
    auto_axes_case(64, 1024, jnp.float32, rng)
    auto_axes_case(1024, 4096, jnp.bfloat16, rng)


if __name__ == "__main__":
    main()
