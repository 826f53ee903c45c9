"""``nki.collectives`` on one rank: the documented names import (AWS's single-rank kernels
import the module), a ReplicaGroup's sub-groups must not overlap, and every collective
raises, naming what it needs (aws-neuron-sdk@81ce03ae nki/api/nki/collectives/__init__.py)."""

from __future__ import annotations

import numpy as np
import pytest

import simulate.nki06 as nki
from simulate.nki06.errors import NkiRuntimeError

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
