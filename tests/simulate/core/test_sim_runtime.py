"""Entry points, both calling conventions, SPMD grids, kernel arguments and the trace."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import BF16, poison, random_array

import simulate
import simulate as nki
import simulate.language as nl
from simulate import runtime


def scale_kernel(x, factor):
    """Return convention: ``x * factor`` in a new shared_hbm tensor."""
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=nl.multiply(nl.load(x), factor))
    return out


def scale_into(x, out, factor=2.0):
    """Output-parameter convention: writes ``x * factor`` into ``out``."""
    nl.store(out, value=nl.multiply(nl.load(x), factor))


def test_jit_forms_and_runners_agree(rng):
    x = random_array(rng, (64, 32), np.float32)
    expected = x * np.float32(3)

    @nki.jit
    def bare(x, factor):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nl.store(out, value=nl.multiply(nl.load(x), factor))
        return out

    @nki.jit(mode="simulation")
    def with_args(x, factor):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nl.store(out, value=nl.multiply(nl.load(x), factor))
        return out

    results = [
        bare(x, 3.0),
        with_args(x, 3.0),
        nki.jit(scale_kernel, mode="baremetal")(x, 3.0),
        nki.baremetal(scale_kernel)(x, 3.0),
        nki.baremetal()(scale_kernel)(x, 3.0),
        nki.simulate_kernel(scale_kernel, x, 3.0),
        nki.simulate_kernel(bare, x, 3.0),
        nki.simulate_kernel(nki.baremetal(scale_kernel), x, 3.0),
    ]
    for result in results:
        np.testing.assert_array_equal(result, expected)
    assert bare.__name__ == "bare" and bare.mode == "auto" and with_args.mode == "simulation"


def test_benchmark_runs_once_and_reports_modeled_latency(rng):
    x = random_array(rng, (128, 64), np.float32)
    kernel = nki.benchmark(warmup=2, iters=5)(scale_kernel)
    out = kernel(x, 2.0)
    np.testing.assert_array_equal(out, 2 * x)
    assert kernel.benchmark_result.nc_latency.get_latency_percentile(50) > 0
    assert kernel.last_trace is not None and len(kernel.last_trace) == 3


def test_output_parameter_convention_writes_in_place(rng):
    x = random_array(rng, (64, 32), BF16)
    out = poison(x.shape, BF16)
    assert nki.baremetal(scale_into)(x, out) is None
    np.testing.assert_array_equal(out, (x.astype(np.float32) * 2).astype(BF16))
    strided = poison((64, 64), BF16)[:, ::2]  # not contiguous: written back after the run
    nki.simulate_kernel(scale_into, x, strided, factor=-1.0)
    np.testing.assert_array_equal(strided, -x.astype(np.float32))


def test_return_convention_leaves_inputs_alone(rng):
    x = random_array(rng, (64, 32), np.float32)
    before = x.copy()

    def two_outputs(x):
        a = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        b = nl.ndarray((64, 1), nl.float32, buffer=nl.shared_hbm)
        t = nl.load(x)
        nl.store(a, value=nl.exp(t))
        nl.store(b, value=nl.sum(t, axis=1))
        return a, b

    a, b = nki.simulate_kernel(two_outputs, x)
    np.testing.assert_array_equal(x, before)
    np.testing.assert_allclose(a, np.exp(x), rtol=1e-6)
    np.testing.assert_allclose(b[:, 0], x.sum(axis=1), rtol=1e-5)
    a[...] = 0  # the outputs belong to the caller
    np.testing.assert_array_equal(x, before)


def test_spmd_grid_program_ids_and_shared_outputs(rng):
    x = random_array(rng, (6, 8, 16), np.float32)
    seen = []

    @nki.jit
    def kernel(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        counts = nl.ndarray((6, 1), nl.int32, buffer=nl.shared_hbm)
        i, j = nl.program_id(0), nl.program_id(1)
        seen.append(
            (
                i,
                j,
                nl.num_programs(),
                nl.num_programs(1),
                nl.num_programs((0, 1)),
                nl.program_ndim(),
            )
        )
        scratch = nl.ndarray((8, 16), x.dtype, buffer=nl.hbm)  # private to the instance
        b = 3 * i + j
        nl.store(scratch, value=nl.load(x[b]))
        nl.store(out[b], value=nl.add(nl.load(scratch), float(b)))
        nl.store(counts[b : b + 1, :], value=b)
        return out, counts

    out, counts = kernel[2, 3](x)
    np.testing.assert_array_equal(out, x + np.arange(6, dtype=np.float32)[:, None, None])
    np.testing.assert_array_equal(counts[:, 0], np.arange(6))
    assert seen == [(i, j, 6, 3, 6, 2) for i in range(2) for j in range(3)]
    _, trace = nki.trace_kernel(kernel[2, 3], x)
    stored = {i.writes[0].storage for i in trace if i.opcode == "store"}
    assert len(stored) == 2 + 6  # two shared outputs, one private scratch per instance
    assert {i.program for i in trace} == {(a, b) for a in range(2) for b in range(3)}


def test_spmd_output_parameters_and_spmd_dim(rng):
    x = random_array(rng, (4, 16), np.float32)
    out = poison(x.shape)

    def kernel(x, out):
        p = nl.program_id(0)
        nl.store(out[p : p + 1, :], value=nl.multiply(nl.load(x[p : p + 1, :]), 2.0))

    nki.jit(kernel)[nl.spmd_dim(nl.nc(2), 2)](x, out)
    np.testing.assert_array_equal(out, 2 * x)

    def single(x):
        assert (nl.program_id(0), nl.num_programs(), nl.program_ndim()) == (0, 1, 0)
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nl.store(out, value=nl.load(x))
        return out

    np.testing.assert_array_equal(nki.simulate_kernel(single, x), x)


def test_constants_lists_kwargs_and_optional_inputs(rng):
    xs = [random_array(rng, (8, 4), np.float32) for _ in range(3)]
    bias = random_array(rng, (8, 4), np.float32)

    def kernel(tiles, *, bias=None, scale=1.0, op=nl.add, dtype=nl.float32, tag="x"):
        assert isinstance(tiles, (list, tuple)) and tag == "sum"
        out = nl.ndarray((8, 4), dtype, buffer=nl.shared_hbm)
        acc = nl.zeros((8, 4), nl.float32)
        for t in tiles:
            acc[...] = op(acc, nl.load(t))
        if bias is not None:
            acc[...] = nl.add(acc, nl.load(bias))
        nl.store(out, value=nl.multiply(acc, scale))
        return out

    total = sum(xs)
    got = nki.simulate_kernel(kernel, xs, bias=bias, scale=0.5, tag="sum")
    np.testing.assert_allclose(got, (total + bias) * 0.5, rtol=1e-6)
    got = nki.simulate_kernel(kernel, tuple(xs), bias=None, tag="sum", dtype=nl.bfloat16)
    assert got.dtype == BF16
    np.testing.assert_allclose(got.astype(np.float32), total, rtol=2**-8)


@pytest.mark.parametrize("dtype", [np.float64, np.int64, np.complex64])
def test_unsupported_dtypes_are_rejected_naming_the_argument(rng, dtype):
    good = random_array(rng, (4, 4), np.float32)
    with pytest.raises(TypeError, match="`weights`.*" + np.dtype(dtype).name):
        nki.simulate_kernel(lambda x, weights: None, good, np.zeros((4, 4), dtype))
    with pytest.raises(TypeError, match=r"`xs\[1\]`"):
        nki.simulate_kernel(lambda xs: None, [good, np.zeros(4, dtype)])


def test_non_numpy_arrays_are_rejected_naming_the_argument(rng):
    class ForeignArray:
        def __array__(self, dtype=None, copy=None):
            return np.zeros((4, 4), np.float32)

    with pytest.raises(TypeError, match="`x` must be a NumPy array"):
        nki.simulate_kernel(scale_kernel, ForeignArray(), 1.0)


def test_expected_outputs_must_be_written(rng):
    x = random_array(rng, (4, 4), np.float32)
    out_a, out_b = poison((4, 4)), poison((4, 4))

    def writes_first(x, a, b):
        nl.store(a, value=nl.load(x))

    with pytest.raises(ValueError, match="err_tensor_output_not_written_to.*`b`"):
        runtime.run(writes_first, (x, out_a, out_b), {}, expected_outputs=2)
    runtime.run(writes_first, (x, out_a, out_b), {}, expected_outputs=None)
    np.testing.assert_array_equal(out_a, x)


def test_sub_kernels_inline_and_trace_is_queryable(rng):
    x = random_array(rng, (32, 16), np.float32)

    @nki.jit(mode="trace")
    def double(tile):
        return nl.multiply(tile, 2.0)

    def kernel(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nl.store(out, value=double(nl.load(x)))
        return out

    np.testing.assert_array_equal(nki.simulate_kernel(kernel, x), 2 * x)
    trace = simulate.last_trace()
    assert [(i.engine, i.opcode) for i in trace] == [
        ("dma", "load"),
        ("dve", "tensor_scalar"),
        ("dma", "store"),
    ]
    assert trace.count() == {"pe": 0, "act": 0, "dve": 1, "pool": 0, "dma": 2}
    assert trace.hbm_bytes() == (x.nbytes, x.nbytes)
    assert "3 instructions" in trace.summary()
    load = trace.instructions[0]
    assert (load.partitions, load.free_size, load.dma_direction) == (32, 64, "hbm->sbuf")
    assert load.in_dtypes == ("float32",) and load.out_dtype == "float32"


def test_install_does_nothing_when_the_real_compiler_is_present(monkeypatch):
    monkeypatch.setattr(simulate, "real_nki_available", lambda: True)
    assert simulate.install() is False


def test_torch_tensors_in_and_out(rng):
    torch = pytest.importorskip("torch")
    x = random_array(rng, (16, 8), np.float32)
    got = nki.jit(scale_kernel)(torch.from_numpy(x).to(torch.bfloat16), 2.0)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16
    np.testing.assert_array_equal(got.float().numpy(), 2 * x.astype(BF16).astype(np.float32))
    out = torch.full((16, 8), float("nan"))
    nki.jit(scale_into)(torch.from_numpy(x), out)
    np.testing.assert_array_equal(out.numpy(), 2 * x)


def test_jax_arrays_in_and_out(rng):
    jnp = pytest.importorskip("jax.numpy")
    x = random_array(rng, (16, 8), np.float32)
    got = nki.jit(scale_kernel)(jnp.asarray(x), 2.0)
    assert type(got).__module__.startswith("jax")
    np.testing.assert_array_equal(np.asarray(got), 2 * x)


def test_compiler_directives_allocation_and_views_are_accepted(rng):
    import simulate.compiler as ncc
    import simulate.isa as nisa

    x = random_array(rng, (128, 16), np.float32)

    @nki.jit(platform_target="trn2", kernel_return=True)
    @ncc.skip_middle_end_transformations
    def kernel(x):
        out = nl.ndarray((128, 16), nl.float32, buffer=nl.shared_hbm)
        bits = nl.ndarray((128, 16), nl.int32, buffer=nl.shared_hbm)
        buf = nl.ndarray((nl.par_dim(128), 16), nl.float32, buffer=ncc.sbuf.mod_alloc(base_addr=0))
        buf[...] = nl.load(x)
        assert nisa.get_nc_version() >= nisa.nc_version.gen3
        assert (
            nl.tile_size.pmax,
            nl.tile_size.psum_fmax,
            nl.tile_size.gemm_moving_fmax,
            nl.tile_size.bn_stats_fmax,
        ) == (128, 512, 512, 512)
        assert nl.tile_size.total_available_sbuf_size == 212984  # the trn2 target
        for _ in nl.sequential_range(1, directives=ncc.multi_buffer(2)):
            nl.store(out, value=nl.multiply(buf, 2.0))
        nl.store(bits, value=nl.copy(buf).view(nl.int32))
        return out, bits

    out, bits = kernel(x)
    np.testing.assert_array_equal(out, 2 * x)
    np.testing.assert_array_equal(bits, x.view(np.int32))
