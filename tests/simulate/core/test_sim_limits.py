"""Every hardware limit and compiler rule the simulator checks raises the documented error:
an ``NKIError`` that is also the builtin exception the spec names, with the ``err_*`` key of
the Neuron error manual in its message."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import simulate as nki
import simulate.isa as nisa
import simulate.language as nl
import simulate.typing as nt
from simulate.errors import CapacityError, NKIError, SpillWarning

X = np.zeros((128, 64), np.float32)


def k_partitions(x):
    nl.zeros((256, 4), nl.float32)


def k_load_partitions(x):
    nl.load(nl.shared_constant(np.zeros((200, 4), np.float32)))


def k_rank1(x):
    nl.zeros((128,), nl.float32)


def k_sbuf_capacity(x):
    nl.ndarray((128, 180224 // 4 + 1), nl.float32)


def k_psum_tile(x):
    nl.zeros((128, 513), nl.float32, buffer=nl.psum)


def k_stationary(x):
    nisa.nc_matmul(nl.zeros((64, 129), nl.bfloat16), nl.zeros((64, 32), nl.bfloat16))


def k_moving(x):
    nisa.nc_matmul(nl.zeros((64, 32), nl.bfloat16), nl.zeros((64, 513), nl.bfloat16))


def k_contraction(x):
    nisa.nc_matmul(nl.zeros((64, 32), nl.bfloat16), nl.zeros((32, 32), nl.bfloat16))


def k_matmul_int(x):
    nisa.nc_matmul(nl.zeros((64, 32), nl.int8), nl.zeros((64, 32), nl.int8))


def k_matmul_psum_input(x):
    nisa.nc_matmul(nl.zeros((64, 32), nl.float32, buffer=nl.psum), nl.zeros((64, 32), nl.float32))


def k_transpose_size(x):
    nl.transpose(nl.zeros((128, 512), nl.float32))


def k_transpose_rank(x):
    nl.transpose(nl.zeros((64, 32, 2), nl.float32))


def k_bn_stats(x):
    nisa.bn_stats(nl.zeros((128, 513), nl.float32))


def k_free_size(x):
    nl.exp(nl.zeros((1, 70_000), nl.bfloat16))


def k_immutable(x):
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nl.store(x, value=nl.load(x))
    return out


def k_mutable_not_returned(x: nt.mutable_tensor):
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    t = nl.load(x)
    nl.store(out, value=t)
    nl.store(x, value=t)
    return out


def k_not_written(x):
    return nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)


def k_param_not_written(x, out):
    nl.load(x)


def k_shared_in_loop(x):
    for _ in nl.affine_range(2):
        nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm)


def _make_shared():
    return nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm)


def k_shared_in_helper(x):
    return _make_shared()


def k_affine_dependency(x):
    a = nl.ndarray((4, nl.par_dim(128), 64), nl.float32)
    for _ in nl.affine_range(4):
        a[0] = nl.load(x)


def k_hbm_init(x):
    nl.full((3, 128), 1.0, nl.float32, buffer=nl.shared_hbm)


def k_load_sbuf(x):
    nl.load(nl.zeros((4, 4), nl.float32))


def k_exp_hbm(x):
    nl.exp(x)


def k_gpsimd_psum(x):
    i = nl.arange(4)[:, None]
    nisa.affine_select(i > 1, nl.zeros((4, 4), nl.float32, buffer=nl.psum), 0.0)


def k_dma_psum(x):
    nisa.dma_copy(dst=nl.zeros((128, 64), nl.float32, buffer=nl.psum), src=x)


def k_partition_mismatch(x):
    nisa.tensor_tensor(nl.zeros((128, 512), nl.float32), nl.zeros((1, 512), nl.float32), op=nl.add)


def k_operator_partition_broadcast(x):
    return nl.zeros((128, 512), nl.float32) + nl.zeros((1, 512), nl.float32)


def k_block_dim_operand(x):
    nl.add(nl.zeros((4, nl.par_dim(8), 8), nl.float32), 32)


def k_dst_smaller(x):
    y = nl.zeros((128, 1), nl.float32)
    y[...] = nl.zeros((128, 512), nl.float32)


def k_bias_type(x):
    nisa.activation(op=nl.exp, data=nl.load(x), bias=nisa.memset((128, 1), 1, nl.int8))


def k_scale_type(x):
    nisa.activation(op=nl.exp, data=nl.load(x), scale=nisa.memset((128, 1), 1.2, nl.float16))


def k_scale_shape(x):
    nisa.activation(op=nl.exp, data=nl.load(x), scale=nisa.memset((128, 128), 1.2, nl.float32))


def k_reciprocal_bias(x):
    nisa.activation(op=nl.reciprocal, data=nl.load(x), bias=nl.zeros((128, 1), nl.float32))


def k_not_an_activation(x):
    nisa.activation(op=nl.cos, data=nl.load(x))


@nki.jit
def _gridded(x):
    return None


def k_nested_grid(x):
    _gridded[2](x)


def k_annotation(x: nt.tensor[128, 32]):
    nl.load(x)


def k_truth(x):
    if nl.load(x):
        pass


def k_truth_scalar(x):
    if nl.load(x[0:1, 0:1]):
        pass


def k_indirect_free(x):
    idx = nl.zeros((128, 1), nl.int32)
    nl.load(x[nl.arange(128)[:, None], idx])


def k_operand_mask(x):
    i = nl.arange(64)[None, :]
    t = nl.load(x)
    nl.exp(t[nl.arange(128)[:, None], i][i < 10])


def k_reduce_axis(x):
    nisa.tensor_reduce(np.add, nl.zeros((8, 4, 4), nl.float32), axis=1)


def k_reduce_partition(x):
    nl.sum(nl.load(x), axis=0)


def k_transpose_indirect(x):
    idx = nl.zeros((64, 1), nl.int32)
    nl.load_transpose2d(x[idx, nl.arange(64)[None, :]])


def k_nc_transpose_pe(x):
    nisa.nc_transpose(nl.zeros((128, 129), nl.float32))


def k_nc_transpose_dve(x):
    nisa.nc_transpose(nl.zeros((33, 8), nl.float32), engine=nisa.vector_engine)


def k_two_psum_inputs(x):
    a = nl.zeros((8, 8), nl.float32, buffer=nl.psum)
    nisa.tensor_tensor(a, nl.zeros((8, 8), nl.float32, buffer=nl.psum), op=nl.add)


def k_indirect_on_chip(x):
    tile = nl.load(x)
    idx = nl.zeros((128, 1), nl.int32)
    nl.exp(tile[idx, nl.arange(64)[None, :]])


def k_mask_or(x):
    i = nl.arange(128)[:, None]
    nl.load(x[i, nl.arange(64)[None, :]], mask=(i < 2) | (i > 5))


CASES = [  # (kernel, exception, key, target)
    (k_nc_transpose_pe, ValueError, "err_size_of_dimension_exceed_arch_limit", None),
    (k_nc_transpose_dve, ValueError, "err_size_of_dimension_exceed_arch_limit", None),
    (k_two_psum_inputs, TypeError, "err_unsupported_memory", None),
    (
        k_indirect_on_chip,
        IndexError,
        "err_copy_dynamic_indirect_indices_not_natively_supported",
        None,
    ),
    (k_mask_or, ValueError, "err_unsupported_expression_in_mask", None),
    (k_partitions, SyntaxError, "err_num_partition_exceed_arch_limit", None),
    (k_load_partitions, SyntaxError, "err_num_partition_exceed_arch_limit", None),
    (k_rank1, AssertionError, "Insufficient rank!", None),
    (k_sbuf_capacity, CapacityError, "err_sbuf_capacity_exceeded", "trn1"),
    (k_psum_tile, ValueError, "err_size_of_dimension_exceed_arch_limit", None),
    (k_stationary, ValueError, "gemm_stationary_fmax", None),
    (k_moving, ValueError, "gemm_moving_fmax", None),
    (k_contraction, ValueError, "err_num_partition_mismatch", None),
    (k_matmul_int, TypeError, "err_matmul_dtype", None),
    (k_matmul_psum_input, TypeError, "err_unsupported_memory", None),
    (k_transpose_size, ValueError, "err_size_of_dimension_exceed_arch_limit", None),
    (k_transpose_rank, ValueError, "err_exceed_max_supported_dimension", None),
    (k_bn_stats, ValueError, "err_size_of_dimension_exceed_arch_limit", None),
    (k_free_size, ValueError, "err_size_of_dimension_exceed_arch_limit", None),
    (k_immutable, ValueError, "err_cannot_update_immutable_parameter", None),
    (k_mutable_not_returned, ValueError, "err_mutable_parameter_not_returned", None),
    (k_not_written, ValueError, "err_tensor_output_not_written_to", None),
    (k_param_not_written, ValueError, "err_tensor_output_not_written_to", None),
    (k_shared_in_loop, ValueError, "err_shared_hbm_must_in_kernel_level", None),
    (k_shared_in_helper, ValueError, "err_shared_hbm_must_in_kernel_level", None),
    (k_affine_dependency, ValueError, "err_unexpected_output_dependencies", None),
    (k_hbm_init, ValueError, "err_hbm_tensor_with_init_value_not_supported", None),
    (k_load_sbuf, TypeError, "err_unsupported_memory", None),
    (k_exp_hbm, TypeError, "err_unsupported_memory", None),
    (k_gpsimd_psum, TypeError, "err_unsupported_memory", None),
    (k_dma_psum, TypeError, "err_unsupported_memory", None),
    (k_partition_mismatch, ValueError, "err_num_partition_mismatch", None),
    (k_operator_partition_broadcast, ValueError, "err_num_partition_mismatch", None),
    (k_block_dim_operand, TypeError, "err_failed_to_infer_tile_from_local_tensor", None),
    (k_dst_smaller, ValueError, "err_store_dst_shape_smaller_than_other_shape", None),
    (k_bias_type, TypeError, "err_activation_bias_invalid_type", None),
    (k_scale_type, TypeError, "err_activation_scale_invalid_type", None),
    (k_scale_shape, ValueError, "err_activation_scale_scalar_or_vector", None),
    (k_reciprocal_bias, ValueError, "err_unsupported_activation", "trn1"),
    (k_not_an_activation, ValueError, "err_unsupported_activation", None),
    (k_nested_grid, RuntimeError, "err_nested_kernel_with_spmd_grid", None),
    (k_annotation, ValueError, "err_annotation_shape_mismatch", None),
    (k_truth, ValueError, "err_ambiguous_tensor_truth_value", None),
    (k_truth_scalar, TypeError, "err_dynamic_control_flow_not_supported", None),
    (k_indirect_free, IndexError, "err_indirect_indices_free_dim", None),
    (k_operand_mask, ValueError, "err_unsupported_operand_mask", None),
    (k_reduce_axis, ValueError, "err_reduce_axis", None),
    (k_reduce_partition, ValueError, "err_reduce_partition_axis", None),
    (k_transpose_indirect, IndexError, "err_indirect_indices_are_not_supported_with_nki_api", None),
]


@pytest.mark.parametrize("kernel, exc, key, target", CASES, ids=[c[0].__name__ for c in CASES])
def test_limit_raises_the_documented_error(kernel, exc, key, target):
    args = (X,) if kernel is not k_param_not_written else (X, np.zeros_like(X))
    with pytest.raises(exc, match=key) as info:
        nki.jit(kernel, platform_target=target)(*args)
    assert isinstance(info.value, NKIError)


def test_limits_follow_the_target():
    """The same tile fits trn2's SBUF but not trn1's."""

    def kernel(x):
        big = nl.ndarray((128, 200_000), nl.int8)
        out = nl.ndarray((1, 1), nl.int8, buffer=nl.shared_hbm)
        nl.store(out, value=big[0:1, 0:1])
        return out

    nki.jit(kernel, platform_target="trn2")(X)
    nki.jit(kernel, platform_target="trn3")(X)
    with pytest.raises(CapacityError, match="180224"):
        nki.jit(kernel, platform_target="trn1")(X)


def test_tiles_of_finished_iterations_do_not_count_but_operands_beyond_capacity_raise():
    """A tile created in an earlier loop iteration is dead once that iteration has used it,
    so a loop reuses the space; tiles one instruction uses together beyond the target's SBUF
    cannot be spilled: an error naming the limit."""

    def kernel(x):
        out = nl.ndarray((128, 1), nl.int8, buffer=nl.shared_hbm)
        for _ in nl.sequential_range(4):
            big = nl.zeros((128, 100_000), nl.int8)
            nl.store(out, value=big[:, 0:1])
        return out

    _, trace = nki.trace_kernel(kernel, X, target="trn1")
    assert trace.sbuf_peak_bytes_per_partition == 100_000

    def too_much(x):
        out = nl.ndarray((128, 1), nl.int8, buffer=nl.shared_hbm)
        both = [nl.zeros((128, 100_000), nl.int8) for _ in range(2)]
        nl.store(out, value=nl.add(both[0][:, 0:1], both[1][:, 0:1]))
        return out

    with pytest.raises(CapacityError, match="err_sbuf_capacity_exceeded.*180224"):
        nki.trace_kernel(too_much, X, target="trn1")
    nki.trace_kernel(too_much, X, target="trn3")  # 245,752 bytes per partition hold both

    def in_loop(x):
        out = nl.ndarray((128, 1), nl.int8, buffer=nl.shared_hbm)
        keep = nl.zeros((128, 90_000), nl.int8)
        for _ in nl.sequential_range(2):
            tmp = nl.zeros((128, 95_000), nl.int8)
            nl.store(out, value=nl.add(keep[:, 0:1], tmp[:, 0:1]))
        return out

    with pytest.raises(CapacityError, match="SBUF over capacity"):
        nki.trace_kernel(in_loop, X, target="trn1")


def test_a_tile_is_live_from_its_first_to_its_last_use_and_spills_beyond_capacity():
    """The compiler frees a tile after its last use (general/nki/programming_model.rst
    L172-L175 "live data"): `first` is still bound to a name but unused when `second` is
    filled, so the two never need 2 x 100,000 bytes at once. Used once more at the end,
    `first` keeps its space, the two no longer fit trn1's 180,224 bytes, and the compiler
    "inserts the necessary spills or refills" (same lines): `first`, whose next use is the
    farther, goes to HBM before `second` is filled and comes back before its last store --
    128 partitions x 100,000 bytes each way, charged as two more DMAs."""

    def kernel(x, use_first_again=False):
        out = nl.ndarray((128, 1), nl.int8, buffer=nl.shared_hbm)
        first = nl.zeros((128, 100_000), nl.int8)
        nl.store(out, value=first[:, 0:1])
        second = nl.zeros((128, 100_000), nl.int8)
        nl.store(out, value=second[:, 0:1])
        if use_first_again:
            nl.store(out, value=first[:, 0:1])
        return out

    _, trace = nki.trace_kernel(kernel, X, target="trn1")
    assert trace.sbuf_peak_bytes_per_partition == 100_000
    assert trace.spill_save_bytes == trace.spill_reload_bytes == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", SpillWarning)
        _, fits = nki.trace_kernel(kernel, X, True, target="trn3")  # 245,752 B hold both
    assert fits.spill_save_bytes == fits.spill_reload_bytes == 0
    with pytest.warns(SpillWarning, match="200000 of the target's 180224 .* spill 12800000 "):
        _, trace = nki.trace_kernel(kernel, X, True, target="trn1")
    assert trace.sbuf_peak_bytes_per_partition == 200_000
    assert trace.spill_save_bytes == trace.spill_reload_bytes == 128 * 100_000
    spills = [(i.dma_direction, i.dma_bytes) for i in trace.instructions if "spill" in i.details]
    assert spills == [("sbuf->hbm", 12_800_000), ("hbm->sbuf", 12_800_000)]
    assert [i.index for i in trace.instructions] == list(range(len(trace.instructions)))
    # the spill DMAs take at least their bytes at every DMA engine's peak rate
    table = nki.cost.CostTable("trn1")
    peak_bytes_per_us = table.dma_engines * table.dma_engine_peak_gbps * 1e3
    unspilled = nki.cost.schedule(fits, target="trn1").latency_us
    spilled = nki.cost.schedule(trace).latency_us
    assert spilled > unspilled + 2 * 12_800_000 / peak_bytes_per_us


def test_blocks_of_a_tensor_are_live_one_by_one():
    """Each (P, F) block of a (B, P, F) tensor is a physical tile with its own live range
    (general/nki/nki_block_dimension_migration_guide.rst L31-L50): 16 PSUM blocks of one
    bank each fit the 8 banks when each is used right after it is written, and are spilled
    when all are written before any is read."""

    def kernel(x, all_at_once=False):
        out = nl.ndarray((128, 16), nl.float32, buffer=nl.shared_hbm)
        ones = nl.full((128, 128), 1.0, nl.bfloat16)
        acc = nl.ndarray((16, nl.par_dim(128), 512), nl.float32, buffer=nl.psum)
        total = nl.ndarray((128, 16), nl.float32)
        for b in nl.affine_range(16):
            acc[b] = nisa.nc_matmul(ones, nl.full((128, 512), 1.0, nl.bfloat16))
            if not all_at_once:
                total[:, b] = nl.sum(acc[b], axis=1)
        if all_at_once:
            for b in nl.affine_range(16):
                total[:, b] = nl.sum(acc[b], axis=1)
        nl.store(out, value=total)
        return out

    out, trace = nki.trace_kernel(kernel, X, target="trn1")
    np.testing.assert_array_equal(out, np.full((128, 16), 128 * 512, np.float32))
    assert trace.psum_peak_bytes_per_partition == 2048
    # all at once: when block 8 is written the eight banks hold blocks 0-7, read back in
    # that order, so block 7 (next used last) is spilled; blocks 9 ... 15 each push out the
    # one written just before (8 ... 14): 8 blocks x 128 partitions x 2048 B saved, and
    # reloaded when the second loop reaches them
    with pytest.warns(SpillWarning, match="PSUM .* 32768 of the target's 16384 .* spill 2097152"):
        out, trace = nki.trace_kernel(kernel, X, True, target="trn1")
    np.testing.assert_array_equal(out, np.full((128, 16), 128 * 512, np.float32))
    assert trace.spill_save_bytes == trace.spill_reload_bytes == 8 * 128 * 2048


def test_legal_patterns_do_not_raise():
    """What the checks must allow: accumulation in affine_range, the same writes in
    sequential_range, mutable inputs that are returned."""

    def kernel(x: nt.mutable_tensor):
        acc = nl.zeros((128, 64), nl.float32)
        buf = nl.ndarray((128, 64), nl.float32)
        for _ in nl.affine_range(3):
            acc += nl.load(x)
        for _ in nl.sequential_range(3):
            buf[...] = nl.load(x)
        nl.store(x, value=nl.add(acc, buf))
        return x

    x = np.ones((128, 64), np.float32)
    out = nki.jit(kernel)(x)
    np.testing.assert_array_equal(out, 4 * np.ones_like(x))
    np.testing.assert_array_equal(x, 1)  # the caller's array is not modified


def test_api_outside_a_kernel_and_bad_targets():
    with pytest.raises(RuntimeError, match="err_nki_api_outside_of_nki_kernel"):
        nl.zeros((4, 4), nl.float32)
    with pytest.raises(ValueError, match="err_unknown_platform_target"):
        nki.jit(k_rank1, platform_target="trn9")(X)
    with pytest.raises(ValueError, match="err_unsupported_mode"):
        nki.jit(k_rank1, mode="gpu")


def test_tiles_a_kernel_places_itself_are_not_spilled():
    """Spilling is the compiler allocator's (general/nki/nki_direct_allocation_guide.rst L97):
    a kernel that places its tiles itself (ncc.sbuf.mod_alloc) side by side past the
    target's usable SBUF is an error naming the limit ("byte_addr ... from 0 (inclusive) to
    192KiB-16KiB", L151-L157), not a spill."""
    import simulate.compiler as ncc

    def kernel(x):
        out = nl.ndarray((128, 1), nl.float32, buffer=nl.shared_hbm)
        tiles = [
            nl.ndarray((128, 25_000), nl.float32, buffer=ncc.sbuf.mod_alloc(base_addr=i * 100_000))
            for i in range(2)
        ]
        for t in tiles:
            t[...] = nl.full((128, 25_000), 1.0, nl.float32)
        for t in tiles:
            nl.store(out, value=t[:, 0:1])
        return out

    nki.trace_kernel(kernel, X, target="trn3")  # 245,752 B hold both
    with pytest.raises(
        ValueError, match="100000 bytes from byte_addr 100000 must lie within the 180224"
    ):
        nki.trace_kernel(kernel, X, target="trn1")
