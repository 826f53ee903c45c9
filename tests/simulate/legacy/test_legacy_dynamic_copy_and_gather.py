"""Legacy instructions the doc examples needed: ``tensor_copy_dynamic_src`` / ``_dst``,
``dropout``, ``local_gather``, ``nc_matmul(perf_mode="double_row_gen3")``, and the launcher
forms ``nki.trace``, ``nki.profile(...)`` and ``tensor[[shape], dtype]`` arguments. Each
rule of the ISA reference (aws-neuron-sdk@8a38e733 general/nki/api/nki/isa/__init__.py) has a
must-raise case next to its legal twin."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import simulate as nki
import simulate.isa as nisa
import simulate.language as nl
from simulate.core.errors import NKIError
from simulate.perf import cost


def _run(kernel, *args, target="trn1"):
    return nki.trace_kernel(kernel, *args, target=target)


# --- tensor_copy_dynamic_src / _dst --------------------------------------------------------
def _gather_columns(src, offsets):
    out = nl.ndarray((src.shape[0], offsets.shape[1]), dtype=src.dtype, buffer=nl.shared_hbm)
    tile = nl.load(src)
    where = nl.load(offsets)
    gathered = nl.ndarray((src.shape[0], offsets.shape[1]), dtype=src.dtype, buffer=nl.sbuf)
    ix, iy = nl.mgrid[0 : src.shape[0], 0:1]
    for i in nl.affine_range(offsets.shape[1]):
        gathered[ix, i + iy] = nisa.tensor_copy_dynamic_src(tile[ix, where[0, i] + iy])
    nl.store(out, value=gathered)
    return out


def test_copy_from_a_run_time_column(rng):
    src = rng.standard_normal((64, 100)).astype(np.float32)
    offsets = rng.integers(0, 100, (1, 12)).astype(np.int32)

    out, trace = _run(_gather_columns, src, offsets)

    np.testing.assert_array_equal(out, src[:, offsets[0]])
    assert sum(i.opcode == "tensor_copy_dynamic" for i in trace.instructions) == 12


def test_copy_into_a_run_time_column(rng):
    def scatter_columns(src, offsets):
        out = nl.ndarray((src.shape[0], 40), dtype=src.dtype, buffer=nl.shared_hbm)
        tile = nl.load(src)
        where = nl.load(offsets)
        dst = nl.zeros((src.shape[0], 40), dtype=src.dtype)
        ix, iy = nl.mgrid[0 : src.shape[0], 0:1]
        for i in nl.affine_range(src.shape[1]):
            nisa.tensor_copy_dynamic_dst(dst=dst[ix, where[0, i] + iy], src=tile[ix, i + iy])
        nl.store(out, value=dst)
        return out

    src = rng.standard_normal((32, 5)).astype(np.float32)
    offsets = rng.choice(40, (1, 5), replace=False).astype(np.int32)
    expected = np.zeros((32, 40), np.float32)
    expected[:, offsets[0]] = src

    out, _ = _run(scatter_columns, src, offsets)

    np.testing.assert_array_equal(out, expected)


def test_a_run_time_index_read_by_any_other_instruction_is_rejected(rng):
    """err_copy_dynamic_indirect_indices_not_natively_supported (nki.errors.rst L256-281)."""

    def exp_of_a_dynamic_column(src, offsets):
        out = nl.ndarray((src.shape[0], 1), dtype=src.dtype, buffer=nl.shared_hbm)
        tile = nl.load(src)
        where = nl.load(offsets)
        ix, iy = nl.mgrid[0 : src.shape[0], 0:1]
        nl.store(out, value=nl.exp(tile[ix, where[0, 0] + iy]))
        return out

    def assign_a_dynamic_column(src, offsets):
        out = nl.ndarray((src.shape[0], 1), dtype=src.dtype, buffer=nl.shared_hbm)
        tile = nl.load(src)
        where = nl.load(offsets)
        column = nl.ndarray((src.shape[0], 1), dtype=src.dtype, buffer=nl.sbuf)
        ix, iy = nl.mgrid[0 : src.shape[0], 0:1]
        column[ix, iy] = tile[ix, where[0, 0] + iy]
        nl.store(out, value=column)
        return out

    src = rng.standard_normal((8, 16)).astype(np.float32)
    offsets = np.array([[3]], np.int32)
    for kernel in (exp_of_a_dynamic_column, assign_a_dynamic_column):
        with pytest.raises(
            NKIError, match="err_copy_dynamic_indirect_indices_not_natively_supported"
        ):
            _run(kernel, src, offsets)
    out, _ = _run(_gather_columns, src, offsets)  # the legal twin
    np.testing.assert_array_equal(out, src[:, [3]])


def test_the_dynamic_offset_is_one_value_in_sbuf(rng):
    """ "The dynamic offset must be a scalar value resided in SBUF" (L1461)."""

    def offsets_per_partition(src, offsets):
        out = nl.ndarray((src.shape[0], 1), dtype=src.dtype, buffer=nl.shared_hbm)
        tile = nl.load(src)
        where = nl.load(offsets)
        ix, iy = nl.mgrid[0 : src.shape[0], 0:1]
        nl.store(out, value=nisa.tensor_copy_dynamic_src(tile[ix, where[ix, 0] + iy]))
        return out

    def static_source(src):
        out = nl.ndarray(src.shape, dtype=src.dtype, buffer=nl.shared_hbm)
        nl.store(out, value=nisa.tensor_copy_dynamic_src(nl.load(src)))
        return out

    src = rng.standard_normal((8, 16)).astype(np.float32)
    with pytest.raises(NKIError, match="err_unsupported_dynamic_access"):
        _run(offsets_per_partition, src, np.zeros((8, 1), np.int32))
    with pytest.raises(NKIError, match="err_unsupported_dynamic_access"):
        _run(static_source, src)


def test_dynamic_copy_cost_has_its_600_cycle_floor():
    """max(MIN_II_DYNAMIC, N), MIN_II_DYNAMIC roughly 600 cycles (L1467-1471)."""
    table = cost.CostTable("trn1")
    ops = cost.Operands(("float32", "float32"), (False,), False, 4)
    short, covered = cost.compute_cycles("tensor_copy_dynamic", "dve", 1, ops, {}, table)
    long, _ = cost.compute_cycles("tensor_copy_dynamic", "dve", 2048, ops, {}, table)
    assert covered and short == 600 and long == 2048


# --- dropout -------------------------------------------------------------------------------
def _dropout(x, prob):
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=nisa.dropout(nl.load(x), prob=nl.load(prob)))
    return out


def test_dropout_probability_zero_keeps_and_one_drops(rng):
    x = rng.uniform(1, 2, (4, 256)).astype(np.float32)
    prob = np.array([[0.0], [1.0], [0.0], [1.0]], np.float32)

    out, _ = _run(_dropout, x, prob)

    np.testing.assert_array_equal(out[::2], x[::2])
    assert not out[1::2].any()


def test_dropout_dtype_rules(rng):
    """Integer data: an fp32 ``prob`` and the data's own output dtype (L516-525)."""

    def integer_with_bf16_prob(x, prob):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        p = nl.load(prob, dtype=nl.bfloat16)
        nl.store(out, value=nisa.dropout(nl.load(x), prob=p))
        return out

    def integer_cast_to_float(x):
        out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        nl.store(out, value=nisa.dropout(nl.load(x), prob=0.5, dtype=nl.float32))
        return out

    x = rng.integers(1, 100, (4, 64)).astype(np.int32)
    prob = np.full((4, 1), 0.5, np.float32)
    with pytest.raises(NKIError, match="err_unsupported_dtype"):
        _run(integer_with_bf16_prob, x, prob)
    with pytest.raises(NKIError, match="err_unsupported_dtype"):
        _run(integer_cast_to_float, x)
    out, _ = _run(_dropout, x, prob)  # the legal twin: fp32 prob, int32 out
    assert out.dtype == np.int32
    assert np.isin(out, [0]).any() and np.all((out == 0) | (out == x))


# --- local_gather --------------------------------------------------------------------------
def _local_gather(src, index, per_index, valid):
    def kernel(src, index):
        tile = nisa.local_gather(nl.load(src), nl.load(index), per_index, valid)
        out = nl.ndarray(tile.shape, dtype=src.dtype, buffer=nl.shared_hbm)
        nl.store(out, value=tile)
        return out

    return _run(kernel, src, index)[0]


def _local_gather_reference(src, index, per_index, valid):
    flat = src.reshape(src.shape[0], -1)
    out = np.empty((src.shape[0], valid, per_index), src.dtype)
    for core in range(src.shape[0] // 16):
        rows = slice(16 * core, 16 * core + 16)
        starts = index[rows].flatten(order="F")[:valid].astype(int)
        for k, start in enumerate(starts):
            out[rows, k] = flat[rows, start : start + per_index]
    return out


@pytest.mark.parametrize("per_index, valid", [(1, 48), (4, 64), (2, 20)])
def test_local_gather_matches_its_numpy_semantics(rng, per_index, valid):
    src = rng.standard_normal((32, 128)).astype(np.float32)
    index = (rng.integers(0, 128 // per_index, (32, 4)) * per_index).astype(np.uint16)

    out = _local_gather(src, index, per_index, valid)

    expected = _local_gather_reference(src, index, per_index, valid)
    np.testing.assert_array_equal(out.reshape(expected.shape[0], -1), expected.reshape(32, -1))


@pytest.mark.parametrize(
    "partitions, index_dtype, per_index, valid, match",
    [
        (24, np.uint16, 1, None, "err_num_partition_mismatch"),  # a multiple of 16 (L622)
        (32, np.int32, 1, None, "err_unsupported_dtype"),  # uint16 indices (L618)
        (32, np.uint16, 3, None, "err_unsupported_value"),  # 1, 2, 4, ..., 32 (L625)
        (32, np.uint16, 1, 65, "err_unsupported_value"),  # at most a core's 64 (L596)
    ],
)
def test_local_gather_rules(rng, partitions, index_dtype, per_index, valid, match):
    src = rng.standard_normal((partitions, 64)).astype(np.float32)
    index = rng.integers(0, 60, (partitions, 4)).astype(index_dtype)
    with pytest.raises(NKIError, match=match):
        _local_gather(src, index, per_index, valid)


def test_local_gather_index_past_the_partition_is_an_error(rng):
    src = rng.standard_normal((16, 64)).astype(np.float32)
    index = np.full((16, 2), 62, np.uint16)
    with pytest.raises(IndexError, match="out-of-bound"):
        _local_gather(src, index, 4, None)


# --- nc_matmul double row ------------------------------------------------------------------
def _double_row(a, b):
    out = nl.ndarray((a.shape[2], b.shape[2]), dtype=nl.float32, buffer=nl.shared_hbm)
    nl.store(out, value=nisa.nc_matmul(nl.load(a), nl.load(b), perf_mode="double_row_gen3"))
    return out


def test_double_row_contracts_over_partitions_and_the_pair(rng):
    fp8 = np.dtype(ml_dtypes.float8_e5m2)
    a = rng.uniform(-2, 2, (128, 2, 16)).astype(fp8)
    b = rng.uniform(-2, 2, (128, 2, 512)).astype(fp8)

    out, _ = _run(_double_row, a, b, target="trn2")

    expected = np.einsum("kli,klj->ij", a.astype(np.float64), b.astype(np.float64))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-4)


def test_double_row_rules(rng):
    fp8 = np.dtype(ml_dtypes.float8_e5m2)
    a = rng.uniform(-2, 2, (128, 2, 16)).astype(fp8)
    b = rng.uniform(-2, 2, (128, 2, 64)).astype(fp8)
    with pytest.raises(NKIError, match="err_unsupported_perf_mode"):  # NeuronCore-v3+
        _run(_double_row, a, b, target="trn1")
    with pytest.raises(NKIError, match="err_unsupported_perf_mode"):  # fp8 only
        _run(_double_row, a.astype(np.float32), b.astype(np.float32), target="trn2")
    with pytest.raises(NKIError, match="err_unsupported_perf_mode"):  # a pair axis of 2
        _run(_double_row, a.reshape(128, 4, 8), b.reshape(128, 4, 32), target="trn2")


# --- launcher forms ------------------------------------------------------------------------
def test_trace_decorator_and_shape_placeholders():
    from simulate.typing import tensor

    @nki.trace
    def doubled(x):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        nl.store(out, value=nl.multiply(nl.load(x), 2.0))
        return out

    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(nki.simulate_kernel(doubled, x), 2 * x)
    placeholder = nki.simulate_kernel(doubled, tensor[[3, 4], nl.bfloat16])
    assert placeholder.shape == (3, 4) and placeholder.dtype == nl.bfloat16


def test_profile_decorator_runs_and_returns_none(tmp_path):
    @nki.profile(working_directory=str(tmp_path), save_neff_name="file.neff")
    def exp_kernel(x):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        nl.store(out, value=nl.exp(nl.load(x)))
        return out

    assert exp_kernel(np.zeros((128, 64), np.float32)) is None
    assert exp_kernel.last_profile.latency_us > 0
    assert not list(tmp_path.iterdir())  # no NEFF/NTFF: there is no device


def test_matmul_by_a_transposed_tile_copies_it_out_of_psum(rng):
    def x_times_transposed_y(x, y):
        out = nl.ndarray((x.shape[1], y.shape[0]), dtype=nl.float32, buffer=nl.shared_hbm)
        y_t = nl.transpose(nl.load(y))
        nl.store(out, value=nl.matmul(nl.load(x), y_t, transpose_x=True))
        return out

    x = rng.standard_normal((64, 32)).astype(np.float32)
    y = rng.standard_normal((48, 64)).astype(np.float32)

    out, trace = _run(x_times_transposed_y, x, y)

    np.testing.assert_allclose(out, x.T @ y.T, rtol=1e-5, atol=1e-5)
    assert [i.opcode for i in trace.instructions].count("tensor_copy") == 1


def test_the_emulated_release_gates_the_dynamic_copies():
    """tensor_copy_dynamic_dst arrives in 2.22 (isa L1034 @2ae3525e), the engine= of both
    in 2.23 (general/nki/nki_rn.rst@8a38e733 L66)."""
    with nki.use_sdk("2.21"):
        assert not hasattr(nisa, "tensor_copy_dynamic_dst")
    with nki.use_sdk("2.22"):
        assert hasattr(nisa, "tensor_copy_dynamic_dst")
        with pytest.raises(TypeError, match="2.23"):
            nisa.tensor_copy_dynamic_src(None, engine=nisa.vector_engine)


def test_psum_free_size_limit_is_per_block(rng):
    """TC#2 (programming_model.rst L346-347) bounds each (P, F) tile; block dimensions count
    tiles (nki_block_dimension_migration_guide.rst L31), as AWS's attention tutorial uses."""

    def two_banks(x):
        out = nl.ndarray((2, 128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
        acc = nl.ndarray((2, nl.par_dim(128), 512), dtype=nl.float32, buffer=nl.psum)
        for b in nl.affine_range(2):
            acc[b] = nisa.nc_matmul(nl.load(x[b, :, 0:128]), nl.load(x[b]))
            nl.store(out[b], value=nl.copy(acc[b]))
        return out

    def one_wide_tile(x):
        out = nl.ndarray((128, 1024), dtype=nl.float32, buffer=nl.shared_hbm)
        acc = nl.ndarray((128, 1024), dtype=nl.float32, buffer=nl.psum)
        acc[...] = 0.0
        nl.store(out, value=nl.copy(acc))
        return out

    x = rng.standard_normal((2, 128, 512)).astype(np.float32)
    out, _ = _run(two_banks, x)
    expected = np.einsum("bki,bkj->bij", x[:, :, :128].astype(np.float64), x)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-3)
    with pytest.raises(NKIError, match="err_size_of_dimension_exceed_arch_limit"):
        _run(one_wide_tile, x)


# --- nl.rms_norm, nl.dropout ------------------------------------------------------------------
def test_nl_rms_norm_matches_numpy(rng):
    """``x / RMS(x) * w``, RMS over ``axis`` with ``n`` values and ``epsilon`` (language
    L1375-1390)."""

    def kernel(x, w):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        weight = nl.load(w).broadcast_to((x.shape[0], x.shape[1]))
        nl.store(out, value=nl.rms_norm(nl.load(x), weight, axis=1, n=x.shape[1], epsilon=1e-5))
        return out

    x = rng.standard_normal((64, 96)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, (1, 96)).astype(np.float32)

    out, _ = _run(kernel, x, w)

    x64 = x.astype(np.float64)
    expected = x64 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(out, expected, rtol=2e-6, atol=1e-6)


def test_nl_dropout_takes_a_number_or_a_one_element_tile(rng):
    def kernel(x, rate):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        nl.store(out, value=nl.dropout(nl.load(x), rate=nl.load(rate)))
        return out

    x = rng.uniform(1, 2, (64, 256)).astype(np.float32)
    out, _ = _run(kernel, x, np.ones((1, 1), np.float32))
    assert not out.any()
    out, _ = _run(kernel, x, np.zeros((1, 1), np.float32))
    np.testing.assert_array_equal(out, x)
    with pytest.raises(NKIError, match="err_unsupported_shape"):
        _run(kernel, x, np.zeros((1, 2), np.float32))
