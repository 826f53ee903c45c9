"""``nki.collectives`` (aws-neuron-sdk@81ce03ae nki/api/nki.collectives.rst,
nki/api/nki/collectives/__init__.py): the names exist so that AWS's kernels that can run on
one NeuronCore import and run (``attention_block_tkg`` with ``KVDP=1`` and
``transformer_tkg`` without replica groups reach the module only to import it, aws-neuron/
nki-library@d2ad3a5 experimental/transformer/attention_block_tkg_sharding.py L25-28,
transformer_tkg.py L19). The simulator runs one rank: every collective, and ``rank_id``,
raises, naming what running it would take, instead of computing a one-rank answer that
no multi-rank program could check."""

from __future__ import annotations

from .errors import NkiRuntimeError
from .language import NKIObject

_DOC = "aws-neuron-sdk@81ce03ae nki/api/nki/collectives/__init__.py"


class ReplicaGroup(NKIObject):
    """ "Defines a group of ranks that participate in a collective operation. Sub-groups
    represented by lists of ranks should not have any overlap" (L10-13); built from the list
    of sub-groups, as AWS's code does (``ReplicaGroup([list(range(ranks))])``,
    test/integration/nkilib/experimental/collectives/test_collectives.py L325)."""

    def __init__(self, groups):
        ranks = [rank for group in groups for rank in group]
        if len(set(ranks)) != len(ranks):
            raise NkiRuntimeError(
                f"ReplicaGroup {groups!r}: sub-groups must not overlap ({_DOC} L13)"
            )
        self.groups = [list(group) for group in groups]


def _needs_ranks(name):
    def collective(*args, **kwargs):
        raise NkiRuntimeError(
            f"nki.collectives.{name} needs several ranks: the simulator runs one NeuronCore "
            "(LNC 1 or 2); a multi-rank launch with a shared-HBM model is not built"
        )

    collective.__name__ = name
    collective.__qualname__ = name
    return collective


all_reduce = _needs_ranks("all_reduce")
all_gather = _needs_ranks("all_gather")
all_gather_v = _needs_ranks("all_gather_v")
reduce_scatter = _needs_ranks("reduce_scatter")
all_to_all = _needs_ranks("all_to_all")
all_to_all_v = _needs_ranks("all_to_all_v")
collective_permute = _needs_ranks("collective_permute")
collective_permute_implicit = _needs_ranks("collective_permute_implicit")
collective_permute_implicit_reduce = _needs_ranks("collective_permute_implicit_reduce")
collective_permute_implicit_current_processing_rank_id = _needs_ranks(
    "collective_permute_implicit_current_processing_rank_id"
)
rank_id = _needs_ranks("rank_id")

__all__ = [
    "ReplicaGroup",
    "all_gather",
    "all_gather_v",
    "all_reduce",
    "all_to_all",
    "all_to_all_v",
    "collective_permute",
    "collective_permute_implicit",
    "collective_permute_implicit_current_processing_rank_id",
    "collective_permute_implicit_reduce",
    "rank_id",
    "reduce_scatter",
]
