"""The strict rules of the legacy NKI compiler the simulator enforces (``simulate.core.rules``,
``simulate.core.scoping``): each rule has a kernel that must be rejected with one error naming
the rule, and a legal twin that must run and give the right numbers."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import BF16, random_array

import simulate as nki
import simulate.isa as nisa
import simulate.language as nl
import simulate.typing as nt
from simulate.errors import NKIError


def run(kernel, *args, target="trn2"):
    """The kernel's outputs (return convention) on ``target``."""
    return nki.trace_kernel(kernel, *args, target=target)[0]


def rejects(rule, kernel, *args, target="trn2", match=None):
    """The kernel raises exactly one NKIError whose message names ``rule`` (and ``match``)."""
    with pytest.raises(NKIError) as info:
        run(kernel, *args, target=target)
    message = str(info.value)
    assert f"[{rule}]" in message, message
    assert "@8a38e733" in message, message  # the doc the rule comes from
    assert "Traceback" not in message
    if match:
        assert match in message, message
    return message


# --- engines and ALU operators -----------------------------------------------------------------
def _tensor_scalar_kernel(op0, engine, op1=None):
    def kernel(x):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        tile = nl.load(x)
        nl.store(
            out,
            value=nisa.tensor_scalar(
                tile,
                op0,
                2.0,
                op1=op1,
                operand1=1.0 if op1 else None,
                engine=engine,
                dtype=nl.float32,
            ),
        )
        return out

    return kernel


def test_gpsimd_tensor_scalar_is_only_for_rsqrt(rng):
    x = random_array(rng, (128, 64), np.float32, 0.5, 4.0)
    message = rejects(
        "unsupported_engine_for_operator",
        _tensor_scalar_kernel(nl.subtract, nisa.gpsimd_engine),
        x,
        match="only allowed for rsqrt",
    )
    assert "nisa.tensor_scalar" in message and "(128, 64) float32 in SBUF" in message
    rejects(
        "unsupported_engine_for_operator", _tensor_scalar_kernel(nl.multiply, nisa.gpsimd_engine), x
    )
    got = run(_tensor_scalar_kernel(nl.rsqrt, nisa.gpsimd_engine), x)
    np.testing.assert_allclose(got, 1 / np.sqrt(x.astype(np.float64)), rtol=1e-6)


def test_vector_engine_runs_the_vector_column_of_the_alu_table(rng):
    x = random_array(rng, (128, 64), np.float32, 0.5, 4.0)
    rejects(
        "unsupported_engine_for_operator",
        _tensor_scalar_kernel(nl.rsqrt, nisa.vector_engine),
        x,
        match="Vector",
    )
    got = run(_tensor_scalar_kernel(nl.subtract, nisa.vector_engine), x)
    np.testing.assert_array_equal(got, x - 2.0)
    # engine=unknown: the compiler picks an engine that has every op (rsqrt: GpSimd)
    got = run(_tensor_scalar_kernel(nl.rsqrt, None), x)
    np.testing.assert_allclose(got, 1 / np.sqrt(x.astype(np.float64)), rtol=1e-6)


def test_scalar_engine_tensor_scalar_combinations(rng):
    x = random_array(rng, (128, 64), np.float32)
    rejects(
        "unsupported_engine_for_operator",
        _tensor_scalar_kernel(nl.subtract, nisa.scalar_engine),
        x,
        match="trn2",
    )
    rejects(
        "unsupported_engine_for_operator",
        _tensor_scalar_kernel(nl.multiply, nisa.scalar_engine),
        x,
        target="trn1",
        match="NeuronCore-v3",
    )
    got = run(_tensor_scalar_kernel(nl.multiply, nisa.scalar_engine, nl.add), x)
    np.testing.assert_allclose(got, x * 2.0 + 1.0, rtol=1e-6)


def _tensor_tensor_kernel(op, engine, into_psum=False):
    def kernel(a, b):
        out = nl.ndarray(a.shape, nl.float32, buffer=nl.shared_hbm)
        ta, tb = nl.load(a), nl.load(b)
        result = nl.ndarray(a.shape, nl.float32, buffer=nl.psum if into_psum else nl.sbuf)
        result[...] = nisa.tensor_tensor(ta, tb, op=op, engine=engine, dtype=nl.float32)
        nl.store(out, value=result)
        return out

    return kernel


def test_gpsimd_tensor_tensor_runs_power_and_integer_arithmetic(rng):
    a = random_array(rng, (128, 32), np.float32, 0.5, 2.0)
    b = random_array(rng, (128, 32), np.float32, 0.5, 2.0)
    rejects(
        "unsupported_engine_for_operator",
        _tensor_tensor_kernel(nl.multiply, nisa.gpsimd_engine),
        a,
        b,
        match="power",
    )
    rejects(
        "unsupported_engine_for_operator", _tensor_tensor_kernel(nl.power, nisa.vector_engine), a, b
    )
    got = run(_tensor_tensor_kernel(nl.power, nisa.gpsimd_engine), a, b)
    np.testing.assert_allclose(got, a.astype(np.float64) ** b, rtol=1e-5)
    got = run(_tensor_tensor_kernel(nl.multiply, nisa.vector_engine), a, b)
    np.testing.assert_allclose(got, a * b, rtol=1e-6)


def test_power_into_psum_is_a_gpsimd_write_to_psum(rng):
    a = random_array(rng, (128, 32), np.float32, 0.5, 2.0)
    b = random_array(rng, (128, 32), np.float32, 0.5, 2.0)
    rejects(
        "err_unsupported_memory",
        _tensor_tensor_kernel(nl.power, None, True),
        a,
        b,
        match="cannot access PSUM",
    )
    got = run(_tensor_tensor_kernel(nl.add, None, True), a, b)  # Vector may write PSUM
    np.testing.assert_allclose(got, a + b, rtol=1e-6)


def test_gpsimd_reads_and_writes_no_psum(rng):
    x = random_array(rng, (128, 32), np.float32, 0.5, 2.0)

    def read_psum(x):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        acc = nl.ndarray(x.shape, nl.float32, buffer=nl.psum)
        acc[...] = nl.load(x)
        nl.store(out, value=nisa.tensor_scalar(acc, nl.rsqrt, 0.0, engine=nisa.gpsimd_engine))
        return out

    def write(x, buffer):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        acc = nl.ndarray(x.shape, nl.float32, buffer=buffer)
        acc[...] = nisa.memset(x.shape, 1.5, nl.float32, engine=nisa.gpsimd_engine)
        nl.store(out, value=acc)
        return out

    rejects("err_unsupported_memory", read_psum, x, match="GpSimd")
    rejects("err_unsupported_memory", write, x, nl.psum, match="GpSimd")
    np.testing.assert_array_equal(run(write, x, nl.sbuf), np.full(x.shape, 1.5, np.float32))


def test_vector_only_instructions_take_vector_operators(rng):
    x = random_array(rng, (128, 32), np.float32, 0.5, 2.0)

    def kernel(x, op):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        t = nl.load(x)
        nl.store(
            out,
            value=nisa.scalar_tensor_tensor(data=t, op0=op, operand0=2.0, op1=nl.add, operand1=t),
        )
        return out

    rejects("unsupported_engine_for_operator", kernel, x, nl.rsqrt)
    np.testing.assert_allclose(run(kernel, x, nl.multiply), 3 * x, rtol=1e-6)


# --- PSUM, masks, partition indexing ---------------------------------------------------------
def test_psum_tiles_hold_512_elements_per_partition_in_any_dtype(rng):
    x = random_array(rng, (128, 1024), BF16)

    def kernel(x, width):
        out = nl.ndarray((128, width), BF16, buffer=nl.shared_hbm)
        acc = nl.ndarray((128, width), nl.bfloat16, buffer=nl.psum)
        acc[...] = nl.load(x[:, 0:width])
        nl.store(out, value=acc)
        return out

    rejects("err_size_of_dimension_exceed_arch_limit", kernel, x, 1024, match="psum_fmax")
    np.testing.assert_array_equal(run(kernel, x, 512), x[:, :512])


def test_legacy_matmul_results_are_float32(rng):
    """ "The matmul accumulation and results are always in float32" (legacy isa L876): a
    matmul, transposes included, is assigned or accumulated only into a float32 PSUM tile."""
    x = random_array(rng, (32, 48), BF16)

    def transpose_into(x, psum_dtype, accumulate):
        out = nl.ndarray((48, 32), BF16, buffer=nl.shared_hbm)
        identity = nl.load(nl.shared_identity_matrix(32, dtype=nl.bfloat16))
        transposed = nl.ndarray((48, 32), psum_dtype, buffer=nl.psum)
        if accumulate:
            transposed[...] = nl.zeros((48, 32), psum_dtype, buffer=nl.psum)
            transposed += nisa.nc_matmul(nl.load(x), identity, is_transpose=True)
        else:
            transposed[...] = nisa.nc_matmul(nl.load(x), identity, is_transpose=True)
        nl.store(out, value=nisa.tensor_copy(transposed, dtype=nl.bfloat16))
        return out

    for accumulate in (False, True):
        message = rejects(
            "err_matmul_dtype",
            transpose_into,
            x,
            nl.bfloat16,
            accumulate,
            match="always in float32",
        )
        assert "bfloat16 PSUM tile" in message
        np.testing.assert_array_equal(run(transpose_into, x, nl.float32, accumulate), x.T)


def test_legacy_tensor_reduce_reduces_every_free_axis(rng):
    """Legacy ``nisa.tensor_reduce``: the axes contain axis 1 (isa L1586) and are the last
    contiguous dims (L1619), so every free axis; grouped sums over an inner axis are
    ``nl.sum`` over an indexed view (AWS's legacy average_pool2d example)."""
    x = random_array(rng, (1, 96), np.float32)
    groups, width = 12, 8

    def grouped(x, how):
        out = nl.ndarray((1, groups), nl.float32, buffer=nl.shared_hbm)
        t = nl.load(x)
        view = t[
            nl.arange(1)[:, None, None],
            nl.arange(groups)[None, :, None] * width + nl.arange(width)[None, None, :],
        ]
        sums = nl.ndarray((1, groups), nl.float32)
        if how == "isa_inner_axis":
            sums[...] = nisa.tensor_reduce(nl.add, view, axis=2, dtype=nl.float32)
        elif how == "isa_first_axis":
            sums[...] = nisa.tensor_reduce(nl.add, view, axis=[1], dtype=nl.float32)
        else:
            sums[...] = nl.sum(view, axis=[2], dtype=nl.float32)
        nl.store(out, value=sums)
        return out

    def whole(x):
        out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
        t = nl.load(x.reshape((1, groups, width)))
        nl.store(out, value=nisa.tensor_reduce(nl.add, t, axis=[1, 2], dtype=nl.float32))
        return out

    rejects("err_reduce_axis", grouped, x, "isa_inner_axis", match="must contain axis 1")
    rejects("err_reduce_axis", grouped, x, "isa_first_axis", match="last contiguous")
    expected = x.reshape(groups, width).sum(axis=1, dtype=np.float32)
    np.testing.assert_array_equal(run(grouped, x, "nl_sum")[0], expected)
    np.testing.assert_allclose(run(whole, x)[0, 0], x.sum(dtype=np.float64), rtol=1e-5)


def test_masks_are_boxes(rng):
    x = random_array(rng, (128, 64), np.float32)

    def kernel(x, staircase):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        nl.store(out, value=0.0)
        i_p, i_f = nl.mgrid[0:128, 0:64]
        mask = (i_p * 64 + i_f < 3000) if staircase else ((i_p < 40) & (i_f < 30))
        nl.store(out[i_p, i_f], value=nl.load(x[i_p, i_f], mask=mask), mask=mask)
        return out

    rejects("err_unsupported_expression_in_mask", kernel, x, True, match="one of the input")
    expected = np.zeros_like(x)
    expected[:40, :30] = x[:40, :30]
    np.testing.assert_array_equal(run(kernel, x, False), expected)


def test_partition_index_has_stride_one(rng):
    x = random_array(rng, (128, 64), np.float32)

    def sliced(x, step):
        out = nl.ndarray((64, 64), nl.float32, buffer=nl.shared_hbm)
        t = nl.load(x)
        nl.store(out, value=nl.copy(t[0:128:step, :] if step == 2 else t[0:64, :]))
        return out

    def ranged(x):
        out = nl.ndarray((64, 64), nl.float32, buffer=nl.shared_hbm)
        t = nl.load(x)
        i_p = 2 * nl.arange(64)[:, None]
        i_f = nl.arange(64)[None, :]
        nl.store(out, value=nl.copy(t[i_p, i_f]))
        return out

    def free_stride(x):
        out = nl.ndarray((128, 32), nl.float32, buffer=nl.shared_hbm)
        t = nl.load(x)
        nl.store(out, value=nl.copy(t[:, 0:64:2]))  # strided free axis: fine
        return out

    rejects("partition_stride", sliced, x, 2)
    rejects("partition_stride", ranged, x)
    np.testing.assert_array_equal(run(sliced, x, 1), x[:64])
    np.testing.assert_array_equal(run(free_stride, x), x[:, 0:64:2])


# --- instruction-specific rules --------------------------------------------------------------
def test_bn_stats_takes_no_mask_on_its_reduce_axis(rng):
    x = random_array(rng, (128, 512), np.float32)

    def kernel(x, mask_free):
        out = nl.ndarray((128, 6), nl.float32, buffer=nl.shared_hbm)
        nl.store(out, value=0.0)
        i_p, i_f = nl.mgrid[0:128, 0:512]
        t = nl.load(x)
        mask = (i_f < 300) if mask_free else (i_p < 64)
        i_q, i_s = nl.mgrid[0:128, 0:6]
        nl.store(
            out[i_q, i_s],
            value=nisa.bn_stats(t[i_p, i_f], mask=mask, dtype=nl.float32),
            mask=i_q < 64,
        )
        return out

    rejects("bn_stats_mask", kernel, x, True, match="reduce dimension")
    got = run(kernel, x, False)
    np.testing.assert_allclose(got[:64, 1], x[:64, 0::2].mean(axis=1), rtol=1e-5, atol=1e-6)


def test_dma_copy_read_modify_write_is_an_add_into_hbm(rng):
    x = random_array(rng, (128, 64), np.float32)
    base = random_array(rng, (128, 64), np.float32)

    def kernel(x, base, op, into_hbm):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=base)
        t = nl.load(x)
        if into_hbm:
            nisa.dma_copy(dst=out, src=t, dst_rmw_op=op)
        else:
            acc = nl.load(base)
            nisa.dma_copy(dst=acc, src=x, dst_rmw_op=op)
            nl.store(out, value=acc)
        return out

    rejects("dst_rmw_op", kernel, x, base, np.subtract, True, match="only np.add")
    rejects("err_unsupported_memory", kernel, x, base, np.add, False, match="SBUF")
    np.testing.assert_allclose(run(kernel, x, base, np.add, True), x + base, rtol=1e-6)


def test_atomic_rmw_adds_through_indirect_indices(rng):
    x = random_array(rng, (32, 16), np.float32)
    rows = rng.permutation(32).astype(np.int32)[:, None]

    def kernel(x, rows, op, indirect):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        nl.store(out, value=1.0)
        idx = nl.load(rows)
        i_p = nl.arange(32)[:, None]
        i_f = nl.arange(16)[None, :]
        value = nl.load(x)
        dst = out[idx[i_p, 0], i_f] if indirect else out[i_p, i_f]
        nl.atomic_rmw(dst, value=value, op=op)
        return out

    rejects("atomic_rmw_op", kernel, x, rows, np.subtract, True)
    rejects("atomic_rmw_dst", kernel, x, rows, np.add, False, match="indirect")
    expected = np.ones_like(x)
    expected[rows[:, 0]] += x
    np.testing.assert_allclose(run(kernel, x, rows, np.add, True), expected, rtol=1e-6)


def test_gather_flattened_takes_uint32_indices(rng):
    x = random_array(rng, (16, 64), np.float32)
    positions = rng.integers(0, 64, size=(16, 8))

    def kernel(x, positions):
        out = nl.ndarray((16, 8), nl.float32, buffer=nl.shared_hbm)
        nl.store(out, value=nl.gather_flattened(nl.load(x), nl.load(positions)))
        return out

    rejects("gather_indices_dtype", kernel, x, positions.astype(np.int32), match="uint32")
    got = run(kernel, x, positions.astype(np.uint32))
    np.testing.assert_array_equal(got, np.take_along_axis(x, positions, axis=1))


def test_affine_select_predicate_is_one_comparison(rng):
    x = random_array(rng, (64, 64), np.float32)

    def kernel(x, combined):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        i_p, i_f = nl.mgrid[0:64, 0:64]
        pred = ((i_p - i_f >= 0) & (i_f < 32)) if combined else (i_p - i_f >= 0)
        nl.store(out, value=nisa.affine_select(pred, nl.load(x), -1.0))
        return out

    rejects("err_unsupported_expression_in_mask", kernel, x, True, match="combined")
    np.testing.assert_array_equal(run(kernel, x, False), np.where(np.tri(64, dtype=bool), x, -1))


# --- scopes, shared_hbm placement, annotations ----------------------------------------------
def test_shared_hbm_is_created_unconditionally_at_kernel_level(rng):
    x = random_array(rng, (128, 32), np.float32)

    def under_if(x, flag):
        if flag:
            out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        else:
            out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        nl.store(out, value=nl.load(x))
        return out

    def top_level(x, flag):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        t = nl.load(x)
        if flag:
            nl.store(out, value=t)
        else:
            nl.store(out, value=nl.negative(t))
        return out

    rejects("err_shared_hbm_must_in_kernel_level", under_if, x, True, match="if block")
    rejects("err_shared_hbm_must_in_kernel_level", under_if, x, False, match="else block")
    np.testing.assert_array_equal(run(top_level, x, True), x)
    np.testing.assert_array_equal(run(top_level, x, False), -x)


def test_tiles_do_not_outlive_their_block(rng):
    x = random_array(rng, (128, 32), np.float32)

    def under_if(x, flag):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        if flag:
            tmp = nl.load(x)
        else:
            tmp = nl.negative(nl.load(x))
        nl.store(out, value=tmp)
        return out

    def hoisted(x, flag):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        tmp = nl.ndarray(x.shape, nl.float32)
        if flag:
            tmp[...] = nl.load(x)
        else:
            tmp[...] = nl.negative(nl.load(x))
        nl.store(out, value=tmp)
        return out

    message = rejects("err_local_variable_used_out_of_scope", under_if, x, True, match="'tmp'")
    assert "if block" in message
    rejects("err_local_variable_used_out_of_scope", under_if, x, False, match="else block")
    np.testing.assert_array_equal(run(hoisted, x, True), x)
    np.testing.assert_array_equal(run(hoisted, x, False), -x)


def _loaded_under_if(x, flag):
    """A helper whose tile is created in an if block and used after it."""
    if flag:
        tile = nl.load(x)
    else:
        tile = nl.negative(nl.load(x))
    return nl.add(tile, 1.0)


def _loaded_into_hoisted(x, flag):
    """The legal twin: the tile created before the block, assigned in it."""
    tile = nl.ndarray(x.shape, nl.float32)
    if flag:
        tile[...] = nl.load(x)
    else:
        tile[...] = nl.negative(nl.load(x))
    return nl.add(tile, 1.0)


def _returned_from_if(x, flag):
    """A ``return`` inside the block uses the tile there; the caller binds it."""
    if flag:
        tile = nl.load(x)
        return tile
    return nl.negative(nl.load(x))


def _outer_helper(x, flag):
    """Helpers reached through other helpers are checked too."""
    return _loaded_under_if(x, flag)


class _Holder:
    """Methods are helpers like functions."""

    def loaded(self, x, flag):
        if flag:
            tile = nl.load(x)
        else:
            tile = nl.negative(nl.load(x))
        return nl.add(tile, 1.0)


def test_tiles_do_not_outlive_their_block_in_helpers(rng):
    """The block-scope rule has no helper exemption (errors manual L417-L474): a helper the
    kernel calls, directly, through another helper or as a method, is held to it."""
    x = random_array(rng, (128, 32), np.float32)

    def kernel(x, helper, flag):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        nl.store(out, value=helper(x, flag))
        return out

    for helper in (_loaded_under_if, _outer_helper, _Holder().loaded):
        message = rejects(
            "err_local_variable_used_out_of_scope", kernel, x, helper, True, match="'tile'"
        )
        assert "if block" in message
    rejects(
        "err_local_variable_used_out_of_scope",
        kernel,
        x,
        _loaded_under_if,
        False,
        match="else block",
    )
    np.testing.assert_array_equal(run(kernel, x, _loaded_into_hoisted, True), x + 1.0)
    np.testing.assert_array_equal(run(kernel, x, _loaded_into_hoisted, False), 1.0 - x)
    np.testing.assert_array_equal(run(kernel, x, _returned_from_if, True), x)
    np.testing.assert_array_equal(run(kernel, x, _returned_from_if, False), -x)


def test_a_tile_shadowed_in_a_loop_is_out_of_scope_after_it(rng):
    x = random_array(rng, (128, 32), np.float32)

    def shadowed(x):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        data = nl.load(x)
        for _ in nl.sequential_range(3):
            data = nl.add(data, 1.0)
        nl.store(out, value=data)
        return out

    def updated(x):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        data = nl.load(x)
        for _ in nl.sequential_range(3):
            data[...] = nl.add(data, 1.0)
        nl.store(out, value=data)
        return out

    def created_in_range_body(x):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        for row in range(2):
            last = nl.load(x[:, row * 0 : 32])
        nl.store(out, value=last)
        return out

    rejects("err_local_variable_used_out_of_scope", shadowed, x, match="for block")
    rejects("err_local_variable_used_out_of_scope", created_in_range_body, x)
    np.testing.assert_allclose(run(updated, x), x + 3.0, rtol=1e-6)


def test_local_annotations_are_checked(rng):
    x = random_array(rng, (128, 32), np.float32)

    def kernel(x, width):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        tile: nt.tensor[128, 32] = nl.load(x[:, 0:width])
        nl.store(out[:, 0:width], value=tile)
        return out

    def unchecked(x):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        tile: int = nl.load(x)  # not an NKI shape annotation: nothing to check
        nl.store(out, value=tile)
        return out

    rejects("err_annotation_shape_mismatch", kernel, x, 16, match="[128, 16]")
    np.testing.assert_array_equal(run(kernel, x, 32), x)
    np.testing.assert_array_equal(run(unchecked, x), x)


# --- kernel-level range is sequential_range --------------------------------------------------
def _range_kernel(use):
    def kernel(x):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        widths = [8, 8, 16]
        for t in range(2):
            if use == "list index":
                w = widths[t]
            elif use == "min":
                w = min(t * 8 + 8, 16)
            elif use == "dict key":
                w = {0: 8, 1: 8}[t]
            elif use == "if":
                w = 8 if t else 8
            else:  # affine index arithmetic and masks: legal
                w = 8
            i_p = nl.arange(128)[:, None]
            i_f = nl.arange(16)[None, :]
            tile = nl.load(x[i_p, t * 16 + i_f], mask=t < 2)
            nl.store(out[i_p, t * 16 + i_f], value=nl.add(tile, 1.0), mask=i_f < w + 8)
            nl.store(out[:, nl.ds(t * 16 + 16, 16)], value=nl.load(x[:, t * 16 + 16 : t * 16 + 32]))
        return out

    return kernel


@pytest.mark.parametrize("use", ["list index", "min", "dict key", "if"])
def test_kernel_level_range_variable_is_not_a_python_int(rng, use):
    x = random_array(rng, (128, 64), np.float32)
    message = rejects("sequential_range_index", _range_kernel(use), x, match="t")
    assert "nl.static_range" in message


def test_kernel_level_range_variable_indexes_and_masks(rng):
    x = random_array(rng, (128, 48), np.float32)
    got = run(_range_kernel("arithmetic"), x)
    expected = x.copy()
    expected[:, 0:32] += 1.0
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def _helper_sum(x_tile, widths):
    """A helper's range loop is unrolled by Python (NKI-917): its variable is an int."""
    total = nl.copy(x_tile[:, 0 : widths[0]])
    for j in range(1, len(widths)):
        total[...] = nl.add(total, x_tile[:, sum(widths[:j]) : sum(widths[:j]) + widths[j]])
    return total


def test_helper_range_and_static_range_variables_are_python_ints(rng):
    x = random_array(rng, (128, 32), np.float32)

    def kernel(x):
        out = nl.ndarray((128, 8), nl.float32, buffer=nl.shared_hbm)
        widths = [8, 8, 8, 8]
        total = _helper_sum(nl.load(x), widths)
        for k in nl.static_range(len(widths)):
            if widths[k] != 8:  # a compile-time int: Python control flow is fine
                total[...] = nl.add(total, 0.0)
        nl.store(out, value=total)
        return out

    np.testing.assert_allclose(run(kernel, x), x.reshape(128, 4, 8).sum(axis=1), rtol=1e-5)


# --- allocated kernels and while loops -------------------------------------------------------
def test_allocated_kernels_rules(rng):
    import simulate.compiler as ncc

    x = random_array(rng, (128, 64), np.float32)

    def kernel(x, violation):
        out = nl.ndarray((128, 64), nl.float32, buffer=nl.shared_hbm)
        buf = nl.ndarray((128, 64), nl.float32, buffer=ncc.sbuf.mod_alloc(base_addr=0))
        buf[...] = nl.load(x)
        zero = nl.ndarray((128, 1), nl.float32, buffer=ncc.sbuf.mod_alloc(base_addr=512))
        zero[...] = nisa.memset((128, 1), 0.0, nl.float32)
        if violation == "init value":
            nl.zeros((128, 64), nl.float32, buffer=ncc.sbuf.mod_alloc(base_addr=1024))
        elif violation == "no bias":
            buf[...] = nisa.activation(op=nl.exp, data=buf)
        elif violation == "nl.exp":
            buf[...] = nl.exp(buf)
        elif violation == "transpose":
            nisa.nc_transpose(buf[0:64, 0:64])
        elif violation == "private hbm":  # known issues L47-L55
            scratch = nl.ndarray((128, 64), nl.float32, buffer=nl.private_hbm)
            nl.store(scratch, value=buf)
        else:
            buf[...] = nisa.activation(op=nl.exp, data=buf, bias=zero)
        nl.store(out, value=buf)
        return out

    rejects(
        "err_tensor_creation_on_scratchpad_with_init_value_not_supported", kernel, x, "init value"
    )
    rejects("err_bias_tensor_must_be_specified_in_allocation", kernel, x, "no bias")
    rejects("err_bias_tensor_must_be_specified_in_allocation", kernel, x, "nl.exp")
    rejects(
        "err_transpose_on_tensor_engine_not_allowed_in_allocated_kernel", kernel, x, "transpose"
    )
    rejects("err_non_io_hbm_tensor_in_allocated_kernel", kernel, x, "private hbm")
    np.testing.assert_allclose(run(kernel, x, "legal"), np.exp(x.astype(np.float64)), rtol=1e-6)

    def returns_one_of_two_outputs(x):
        out = nl.ndarray((128, 64), nl.float32, buffer=nl.shared_hbm)
        spare = nl.ndarray((128, 64), nl.float32, buffer=nl.shared_hbm)
        buf = nl.ndarray((128, 64), nl.float32, buffer=ncc.sbuf.mod_alloc(base_addr=0))
        buf[...] = nl.load(x)
        nl.store(out, value=buf)
        nl.store(spare, value=buf)
        return out

    rejects("err_non_io_hbm_tensor_in_allocated_kernel", returns_one_of_two_outputs, x)


def test_while_loops_enter_unconditionally(rng):
    x = random_array(rng, (128, 8), np.float32)

    def kernel(x, start):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        acc = nl.load(x)
        count = start
        while count < 3:
            acc[...] = nl.add(acc, 1.0)
            count += 1
        nl.store(out, value=acc)
        return out

    rejects("err_while_loop_requires_unconditional_entry", kernel, x, 5, match="do-while")
    np.testing.assert_allclose(run(kernel, x, 0), x + 3.0, rtol=1e-6)


def _added_while_below_three(acc, start):
    """A helper with a while loop: the kernel's rules hold in it too."""
    count = start
    while count < 3:
        acc[...] = nl.add(acc, 1.0)
        count += 1


def test_while_loops_in_helpers_enter_unconditionally(rng):
    x = random_array(rng, (128, 8), np.float32)

    def kernel(x, start):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        acc = nl.load(x)
        _added_while_below_three(acc, start)
        nl.store(out, value=acc)
        return out

    rejects("err_while_loop_requires_unconditional_entry", kernel, x, 5, match="do-while")
    np.testing.assert_allclose(run(kernel, x, 0), x + 3.0, rtol=1e-6)
