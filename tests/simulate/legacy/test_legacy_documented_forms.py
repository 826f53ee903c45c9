"""Forms the legacy NKI docs write as legal, run on the legacy simulator exactly as the docs
write them (aws-neuron-sdk@8a38e733 ``general/nki/api/nki.errors.rst``), with the illegal
twin each example stands beside still rejected."""

from __future__ import annotations

import numpy as np
import pytest

import simulate as nki
import simulate.isa as nisa
import simulate.language as nl
from simulate.core.errors import NKIError


def _run(kernel, *args):
    return nki.trace_kernel(kernel, *args, target="trn1")[0]


def test_if_on_a_range_variable_comparison(rng):
    """err_local_variable_used_out_of_scope's corrected example (L431-L443)."""

    def kernel(a, b, c):
        for i in range(4):
            tmp = nl.ndarray(shape=a.shape, dtype=a.dtype)
            if i < 2:
                tmp[...] = nl.load(a)
            else:
                tmp[...] = nl.load(b)
            nl.store(c, tmp)

    a, b = rng.standard_normal((2, 8, 16)).astype(np.float32)
    c = np.full_like(a, np.nan)
    nki.simulate_kernel(nki.jit(kernel), a, b, c)
    np.testing.assert_array_equal(c, b)  # the last iteration (i = 3) stores b


def test_if_scoped_tile_used_outside_is_still_rejected(rng):
    """The example it corrects (L425-L429): a tile created in the ``if`` block is out of
    scope after it."""

    def kernel(a, b, c):
        for i in range(4):
            if i < 2:
                tmp = nl.load(a)
            else:
                tmp = nl.load(b)
            nl.store(c, tmp)

    a = rng.standard_normal((8, 16)).astype(np.float32)
    with pytest.raises(NKIError, match="err_local_variable_used_out_of_scope"):
        nki.simulate_kernel(nki.jit(kernel), a, a, np.zeros_like(a))


def test_a_range_comparison_outside_a_branch_is_still_rejected():
    """Python computing with the symbolic loop index (``min``) stays illegal."""

    def kernel(x):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        for t in range(2):
            width = min(t * 8 + 8, 16)
            nl.store(out[:, 0:width], nl.load(x[:, 0:width]))
        return out

    with pytest.raises(NKIError, match="sequential_range_index"):
        _run(kernel, np.zeros((4, 16), np.float32))


def test_masks_of_loop_variables_and_a_stored_loop_variable():
    """err_unsupported_expression_in_mask's supported mask expressions (L846-L856), as
    written: a loop variable stored under ``mask=i < 4`` and ``(2*i + 3*j + 1) < 20``."""

    def first():
        out = nl.ndarray([8], dtype=nl.int32, buffer=nl.shared_hbm)
        for i in range(8):
            nl.store(out, i, mask=i < 4)
        return out

    def second():
        out = nl.ndarray([8], dtype=nl.int32, buffer=nl.shared_hbm)
        for i in range(8):
            for j in range(8):
                nl.store(out, i, mask=(2 * i + 3 * j + 1) < 20)
        return out

    np.testing.assert_array_equal(_run(first), np.full(8, 3))  # the last i with i < 4
    np.testing.assert_array_equal(_run(second), np.full(8, 7))  # 2*7 + 0 + 1 < 20


def test_item_assignment_into_an_iota_tile():
    """err_cannot_assign_to_index (L171-L175): ``y = nisa.iota(x); y[0, 5] = 1024`` works,
    while the index tensor ``x`` itself cannot be assigned."""

    def kernel():
        out = nl.ndarray([1, 8], dtype=nl.uint32, buffer=nl.shared_hbm)
        _, x = nl.mgrid[0:1, 0:8]
        y = nisa.iota(x, dtype=nl.uint32)
        y[0, 5] = 1024
        nl.store(out, y)
        return out

    expected = np.arange(8, dtype=np.uint32)[None]
    expected[0, 5] = 1024
    np.testing.assert_array_equal(_run(kernel), expected)

    def assigns_the_index():
        _, x = nl.mgrid[0:1, 0:8]
        x[0, 5] = 1024

    with pytest.raises((NKIError, TypeError)):
        _run(assigns_the_index)


def test_do_while_on_a_scalar_tile_condition(rng):
    """err_while_loop_requires_unconditional_entry's required pattern (L932-L941): enter with
    ``cond = scalar(True)``, recompute ``cond`` from a one-element tile at the end."""
    from simulate.typing import scalar

    def kernel(a):
        out = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.shared_hbm)
        a_tile = nl.load(a[0:1, 0:1])
        cond = scalar(True)
        while cond:
            a_tile[...] = nl.add(a_tile, 1.0)
            a_scalar = scalar(a_tile)
            cond = a_scalar < 10
        nl.store(out, value=a_tile)
        return out

    start = float(rng.integers(0, 5))
    np.testing.assert_array_equal(_run(kernel, np.full((1, 1), start, np.float32)), [[10.0]])
    # entered unconditionally: a start past the bound still runs the body once
    np.testing.assert_array_equal(_run(kernel, np.full((1, 1), 12.0, np.float32)), [[13.0]])


def test_atomic_rmw_with_a_scalar_value(rng):
    """nl.atomic_rmw's value is "a tile or a scalar" (general/nki/api/nki/language/
    __init__.py, atomic_rmw :param value:)."""

    def kernel(rows):
        out = nl.ndarray((16, 8), dtype=nl.float32, buffer=nl.shared_hbm)
        nl.store(out, value=0.0)
        idx = nl.load(rows)
        i_p, i_f = nl.arange(4)[:, None], nl.arange(8)[None, :]
        nl.atomic_rmw(out[idx[i_p, 0], i_f], value=2.5, op=np.add)
        return out

    rows = rng.choice(16, (4, 1), replace=False).astype(np.int32)
    expected = np.zeros((16, 8), np.float32)
    expected[rows[:, 0]] = 2.5
    np.testing.assert_array_equal(_run(kernel, rows), expected)


def test_masked_access_whose_masked_off_part_is_out_of_bound(rng):
    """err_tensor_access_out_of_bound (L679-L683): the mask keeps the access in bounds; only
    the points it masks off lie past the tensor."""

    def kernel(x):
        out = nl.ndarray((128, 1000), dtype=nl.float32, buffer=nl.shared_hbm)
        for i in nl.affine_range((1000 + 511) // 512):
            tile = nl.mgrid[0:128, 0:512]
            value = nl.load(x[tile.p, i * 512 + tile.x], mask=i * 512 + tile.x < 1000)
            nl.store(out[tile.p, i * 512 + tile.x], value=value, mask=i * 512 + tile.x < 1000)
        return out

    x = rng.standard_normal((128, 1000)).astype(np.float32)
    np.testing.assert_array_equal(_run(kernel, x), x)


def test_a_while_testing_a_run_time_scalar_on_entry_is_rejected():
    """The manual's unsupported twin (L917-L924): ``while a_scalar < 10`` tests a run-time
    value before the first iteration, even when it holds."""
    from simulate.typing import scalar

    def kernel(a):
        out = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.shared_hbm)
        a_tile = nl.load(a[0:1, 0:1])
        a_scalar = scalar(a_tile)
        while a_scalar < 10:
            a_tile[...] = nl.add(a_tile, 1.0)
            a_scalar = scalar(a_tile)
        nl.store(out, value=a_tile)
        return out

    with pytest.raises(NKIError, match="err_while_loop_requires_unconditional_entry"):
        _run(kernel, np.zeros((1, 1), np.float32))


def test_loop_reduce_updates_the_tile_it_is_assigned_to(rng):
    """nl.loop_reduce's own example (general/nki/api/nki/language/__init__.py L990-L1020):
    ``b = nl.loop_reduce(a, op=np.add, loop_indices=[k_i], dtype=nl.float32)`` in an
    affine_range is ``b = nisa.tensor_tensor(data1=b, data2=a, op=np.add)``: one Vector-engine
    instruction per iteration into ``b``, which stays usable after the loop."""

    def kernel(a, op):
        out = nl.ndarray((128, 64), nl.float32, buffer=nl.shared_hbm)
        b = nl.zeros((128, 64), dtype=nl.float32, buffer=nl.sbuf)
        for k_i in nl.affine_range(4):
            a_tile = nl.load(a[k_i])
            b = nl.loop_reduce(a_tile, op=op, loop_indices=[k_i], dtype=nl.float32)
        nl.store(out, value=b)
        return out

    a = rng.standard_normal((4, 128, 64)).astype(np.float32)
    out, trace = nki.trace_kernel(kernel, a, np.add, target="trn1")
    np.testing.assert_allclose(out, a.astype(np.float64).sum(0), rtol=1e-6, atol=1e-6)
    updates = [i for i in trace if i.opcode == "tensor_tensor"]
    assert len(updates) == 4 and all(i.engine == "dve" for i in updates)
    out = _run(kernel, a, np.maximum)
    np.testing.assert_array_equal(out, np.maximum(a.max(0), 0))


def test_loop_reduce_outside_an_assignment_or_loop_is_rejected(rng):
    """Without the assignment there is no destination tile; outside a loop nothing is
    reduced over."""

    def unassigned(a):
        out = nl.ndarray((128, 64), nl.float32, buffer=nl.shared_hbm)
        b = nl.zeros((128, 64), dtype=nl.float32)
        for k_i in nl.affine_range(2):
            nl.store(out, value=nl.loop_reduce(nl.load(a[k_i]), op=np.add, loop_indices=[k_i]))
        nl.store(out, value=b)
        return out

    def outside_a_loop(a):
        out = nl.ndarray((128, 64), nl.float32, buffer=nl.shared_hbm)
        b = nl.zeros((128, 64), dtype=nl.float32)
        b = nl.loop_reduce(nl.load(a[0]), op=np.add, loop_indices=[0])
        nl.store(out, value=b)
        return out

    a = rng.standard_normal((2, 128, 64)).astype(np.float32)
    with pytest.raises(ValueError, match="updates the tile its result is assigned to"):
        _run(unassigned, a)
    with pytest.raises(ValueError, match="reduces over running loops"):
        _run(outside_a_loop, a)


def test_a_matmul_accumulated_into_a_never_written_psum_tile_starts_the_group(rng):
    """ "The first nki.isa.nc_matmul instruction overwrites the destination PSUM bank"
    (general/nki/arch/trainium_inferentia2_arch.rst L835-L837): ``+=`` into an nl.ndarray
    PSUM tile (what allocated kernels must write, attention_kernels.py L846/L899) is the plain
    product sum; into a tile already holding values, it adds to them."""

    def kernel(x, y, start):
        out = nl.ndarray((2, 64, 32), nl.float32, buffer=nl.shared_hbm)
        acc = nl.ndarray((2, nl.par_dim(64), 32), nl.float32, buffer=nl.psum)
        if start:
            acc[1] = nl.full((64, 32), 1.0, nl.float32, buffer=nl.psum)
        for k in nl.affine_range(2):
            acc[1] += nisa.nc_matmul(nl.load(x[k]), nl.load(y[k]))
        for k in nl.affine_range(2):
            acc[0] += nisa.nc_matmul(nl.load(x[k]), nl.load(y[k]))
        nl.store(out[0], value=nl.copy(acc[0]))
        nl.store(out[1], value=nl.copy(acc[1]))
        return out

    x = rng.standard_normal((2, 128, 64)).astype(np.float32)
    y = rng.standard_normal((2, 128, 32)).astype(np.float32)
    product = np.einsum("kpm,kpn->mn", x.astype(np.float64), y.astype(np.float64))
    out = _run(kernel, x, y, False)
    np.testing.assert_allclose(out[0], product, rtol=2e-2, atol=2e-2 * np.abs(product).max())
    np.testing.assert_allclose(out[1], product, rtol=2e-2, atol=2e-2 * np.abs(product).max())
    out = _run(kernel, x, y, True)
    np.testing.assert_allclose(out[0], product, rtol=2e-2, atol=2e-2 * np.abs(product).max())
    np.testing.assert_allclose(out[1], product + 1, rtol=2e-2, atol=2e-2 * np.abs(product).max())


def test_modulo_allocated_logical_tiles_sharing_a_physical_tile_must_not_overlap(rng):
    """The direct-allocation guide's lifetime conflict (general/nki/nki_direct_allocation_guide.rst
    L397-L424): eight logical tiles over ``num_free_tiles=(2,)`` all loaded before any is used
    is an error; used one after another ("the correct way"), or with eight physical tiles,
    they fit."""
    import simulate.compiler as ncc

    def kernel(a, physical, all_loaded_first):
        out = nl.ndarray((8, 128, 512), nl.float32, buffer=nl.shared_hbm)
        t1 = nl.ndarray(
            (8, nl.par_dim(128), 512),
            nl.float32,
            buffer=ncc.sbuf.mod_alloc(base_addr=0, num_free_tiles=(physical,)),
        )
        if all_loaded_first:
            for i in nl.affine_range(8):
                t1[i] = nl.load(a[i])
            for i in nl.affine_range(8):
                nl.store(
                    out[i], value=nisa.tensor_scalar(data=t1[i], op0=nl.multiply, operand0=2.0)
                )
        else:
            for i in nl.affine_range(8):
                t1[i] = nl.load(a[i])
                nl.store(
                    out[i], value=nisa.tensor_scalar(data=t1[i], op0=nl.multiply, operand0=2.0)
                )
        return out

    a = rng.standard_normal((8, 128, 512)).astype(np.float32)
    with pytest.raises(ValueError, match="err_allocation_lifetime_conflict.*logical tiles"):
        _run(kernel, a, 2, True)
    for physical, all_loaded_first in ((2, False), (8, True)):
        out = _run(kernel, a, physical, all_loaded_first)
        np.testing.assert_array_equal(out, 2 * a)
