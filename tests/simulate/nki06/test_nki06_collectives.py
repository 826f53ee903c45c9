"""``nki.collectives`` (aws-neuron-sdk@81ce03ae nki/api/nki/collectives/__init__.py): on one
rank the documented names import (AWS's single-rank kernels import the module) and every
collective raises, naming what it needs; under ``launch_ranks`` all_reduce, all_gather,
reduce_scatter and rank_id compute across the ranks, with the documented operand rules."""

from __future__ import annotations

import numpy as np
import pytest

import simulate.nki06 as nki
from simulate.nki06.errors import NkiDeadlockError, NkiRuntimeError, NkiValueError

nl, nisa, ncc = nki.language, nki.isa, nki.collectives


@pytest.fixture(autouse=True)
def _trn2(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)


def test_documented_names_exist():
    for name in (
        "all_reduce",
        "all_gather",
        "all_gather_v",
        "reduce_scatter",
        "all_to_all",
        "all_to_all_v",
        "collective_permute",
        "collective_permute_implicit",
        "collective_permute_implicit_reduce",
        "collective_permute_implicit_current_processing_rank_id",
        "rank_id",
        "ReplicaGroup",
    ):
        assert callable(getattr(ncc, name))


def test_replica_sub_groups_must_not_overlap():
    assert ncc.ReplicaGroup([[0, 1], [2, 3]]).groups == [[0, 1], [2, 3]]
    with pytest.raises(NkiRuntimeError, match="must not overlap"):
        ncc.ReplicaGroup([[0, 1], [1, 2]])


def test_a_collective_in_a_kernel_needs_several_ranks(rng):
    @nki.jit
    def reduce(x):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        group = ncc.ReplicaGroup([[0, 1]])
        ncc.all_reduce(srcs=[x], dsts=[out], replica_group=group, op=nl.add)
        return out

    with pytest.raises(NkiRuntimeError, match="all_reduce needs several ranks"):
        reduce(rng.standard_normal((4, 8)).astype(np.float32))


def _per_rank(arrays, *extra):
    return [((a, *extra), {}) for a in arrays]


def _through_sbuf(x, collective, shape):
    """Load x, run ``collective(src, dst)`` on SBUF tiles, store dst of ``shape``."""
    src = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=src, src=x)
    dst = nl.ndarray(shape, dtype=x.dtype, buffer=nl.sbuf)
    collective(src, dst)
    out = nl.ndarray(shape, dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=dst)
    return out


@pytest.mark.parametrize("op, reduce", [("add", np.add), ("maximum", np.maximum)])
def test_all_reduce_across_ranks_on_sbuf(rng, op, reduce):
    ranks = 4
    group = ncc.ReplicaGroup([list(range(ranks))])
    op_fn = getattr(nl, op)

    @nki.jit
    def kernel(x, group):
        def collective(src, dst):
            ncc.all_reduce(srcs=[src], dsts=[dst], replica_group=group, op=op_fn)

        return _through_sbuf(x, collective, x.shape)

    xs = [rng.standard_normal((16, 32)).astype(np.float32) for _ in range(ranks)]
    expected = xs[0]
    for x in xs[1:]:
        expected = reduce(expected, x)
    for out in nki.launch_ranks(kernel, _per_rank(xs, group)):
        np.testing.assert_array_equal(out, expected)


def test_all_reduce_in_sub_groups_and_coalesced_on_hbm(rng):
    """Sub-groups [0, 2] and [1, 3] reduce apart; two HBM tensors in one call (L20-26)."""
    group = ncc.ReplicaGroup([[0, 2], [1, 3]])

    @nki.jit
    def kernel(x, y, group):
        out_x = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        out_y = nl.ndarray(y.shape, dtype=y.dtype, buffer=nl.shared_hbm)
        ncc.all_reduce(srcs=[x, y], dsts=[out_x, out_y], replica_group=group, op=nl.add)
        return out_x, out_y

    xs = [rng.standard_normal((4, 8)).astype(np.float32) for _ in range(4)]
    ys = [rng.standard_normal((2, 3)).astype(np.float32) for _ in range(4)]
    results = nki.launch_ranks(kernel, [((xs[r], ys[r], group), {}) for r in range(4)])
    for rank, (out_x, out_y) in enumerate(results):
        partner = (rank + 2) % 4
        np.testing.assert_array_equal(out_x, xs[rank] + xs[partner])
        np.testing.assert_array_equal(out_y, ys[rank] + ys[partner])


def test_all_gather_concatenates_in_group_order(rng):
    """HBM along dim 0; SBUF along dim 1 (L43-49), as the docs' example: rank 0's rows first."""
    ranks = 3
    group = ncc.ReplicaGroup([list(range(ranks))])

    @nki.jit
    def gather_hbm(x, group):
        out = nl.ndarray((x.shape[0] * ranks, x.shape[1]), dtype=x.dtype, buffer=nl.shared_hbm)
        ncc.all_gather(srcs=[x], dsts=[out], replica_group=group, collective_dim=0)
        return out

    @nki.jit
    def gather_sbuf(x, group):
        def collective(src, dst):
            ncc.all_gather(srcs=[src], dsts=[dst], replica_group=group, collective_dim=1)

        return _through_sbuf(x, collective, (x.shape[0], x.shape[1] * ranks))

    xs = [rng.standard_normal((8, 4)).astype(np.float32) for _ in range(ranks)]
    for out in nki.launch_ranks(gather_hbm, _per_rank(xs, group)):
        np.testing.assert_array_equal(out, np.concatenate(xs, axis=0))
    for out in nki.launch_ranks(gather_sbuf, _per_rank(xs, group)):
        np.testing.assert_array_equal(out, np.concatenate(xs, axis=1))


def test_reduce_scatter_gives_each_rank_its_chunk_of_the_sum(rng):
    ranks = 2
    group = ncc.ReplicaGroup([[0, 1]])

    @nki.jit
    def kernel(x, group):
        out = nl.ndarray((x.shape[0] // ranks, x.shape[1]), dtype=x.dtype, buffer=nl.shared_hbm)
        ncc.reduce_scatter(srcs=[x], dsts=[out], replica_group=group, collective_dim=0, op=nl.add)
        return out

    xs = [rng.standard_normal((4, 3)).astype(np.float32) for _ in range(ranks)]
    total = xs[0] + xs[1]
    results = nki.launch_ranks(kernel, _per_rank(xs, group))
    np.testing.assert_array_equal(results[0], total[:2])
    np.testing.assert_array_equal(results[1], total[2:])


def test_rank_id_selects_each_ranks_slice(rng):
    """rank_id as a scalar_offset, as AWS's own test kernel uses it (test/integration/nkilib/
    experimental/collectives/test_collectives.py L127-143)."""

    @nki.jit
    def kernel(table):
        rows, width = table.shape[1], table.shape[2]
        tile = nl.ndarray((rows, width), dtype=table.dtype, buffer=nl.sbuf)
        nisa.dma_copy(
            dst=tile,
            src=table.ap(
                pattern=[[width, rows], [1, width]], scalar_offset=ncc.rank_id(), indirect_dim=0
            ),
        )
        out = nl.ndarray((rows, width), dtype=table.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=tile)
        return out

    table = rng.standard_normal((3, 2, 5)).astype(np.float32)
    for rank, out in enumerate(nki.launch_ranks(kernel, [((table,), {})] * 3)):
        np.testing.assert_array_equal(out, table[rank])


def test_documented_operand_rules(rng):
    group = ncc.ReplicaGroup([[0, 1]])
    x = rng.standard_normal((4, 8)).astype(np.float32)

    def run(body):
        @nki.jit
        def kernel(x, group):
            return body(x, group)

        return nki.launch_ranks(kernel, _per_rank([x, x], group))

    def mixed(x, group):  # one HBM and one SBUF tensor (L23-25)
        dst = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        ncc.all_reduce(srcs=[x], dsts=[dst], replica_group=group, op=nl.add)

    def hbm_dim1(x, group):  # HBM gathers along dim 0 only (L46-49)
        dst = nl.ndarray((x.shape[0], 2 * x.shape[1]), dtype=x.dtype, buffer=nl.shared_hbm)
        ncc.all_gather(srcs=[x], dsts=[dst], replica_group=group, collective_dim=1)

    def multiply(x, group):  # nl.add, nl.minimum or nl.maximum (L30)
        dst = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        ncc.all_reduce(srcs=[x], dsts=[dst], replica_group=group, op=nl.multiply)

    def coalesced_sbuf(x, group):  # several tensors on HBM only (L25-26)
        a = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        b = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=a, src=x)
        nisa.dma_copy(dst=b, src=x)
        ncc.all_reduce(srcs=[a, b], dsts=[b, a], replica_group=group, op=nl.add)

    for body, message in (
        (mixed, "mixing memory spaces"),
        (hbm_dim1, "collective_dim=1"),
        (multiply, "nl.add, nl.minimum or nl.maximum"),
        (coalesced_sbuf, "only supported on HBM"),
    ):
        with pytest.raises(NkiValueError, match=message):
            run(body)


def test_a_rank_that_skips_a_collective_is_a_deadlock(rng):
    group = ncc.ReplicaGroup([[0, 1]])

    @nki.jit
    def kernel(x, group, reduce):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        if reduce:
            ncc.all_reduce(srcs=[x], dsts=[out], replica_group=group, op=nl.add)
        else:
            nisa.dma_copy(dst=out, src=x)
        return out

    x = rng.standard_normal((2, 2)).astype(np.float32)
    with pytest.raises(NkiDeadlockError, match="ended or wait elsewhere"):
        nki.launch_ranks(kernel, [((x, group, True), {}), ((x, group, False), {})])


def test_ranks_waiting_on_each_other_in_a_cycle_is_a_deadlock(rng):
    """Rank 0 reduces with rank 1, rank 1 with rank 2, rank 2 with rank 0: every rank waits
    for one that waits elsewhere; found when the last one waits, without a timeout."""

    @nki.jit
    def kernel(x, group):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        ncc.all_reduce(srcs=[x], dsts=[out], replica_group=group, op=nl.add)
        return out

    x = rng.standard_normal((2, 2)).astype(np.float32)
    groups = ([[0, 1], [2]], [[1, 2], [0]], [[0, 2], [1]])
    inputs = [((x, ncc.ReplicaGroup(g)), {}) for g in groups]
    with pytest.raises(NkiDeadlockError, match="wait elsewhere"):
        nki.launch_ranks(kernel, inputs)


def test_ranks_run_at_lnc1_only():
    with pytest.raises(NkiValueError, match="LNC=1 ranks"):
        nki.launch_ranks(nki.jit(lambda x: x)[2], [((np.zeros((2, 2), np.float32),), {})])
