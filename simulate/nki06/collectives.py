"""``nki.collectives`` (aws-neuron-sdk@81ce03ae nki/api/nki.collectives.rst,
nki/api/nki/collectives/__init__.py, cited below by line).

Collectives need several ranks. :func:`launch_ranks` runs one kernel on R ranks, each an
LNC=1 launch of its own (private HBM, SBUF, PSUM and ``shared_hbm``: the docs give each
rank its own data, ``rank_id`` "of the current rank within the collective group", L393-397)
in a thread of its own. The k-th collective call of every rank of a replica sub-group meets
the k-th of the others; each rank then computes its destination from all the sources, so
the result does not depend on the order the threads run in. ``all_reduce``,
``all_gather``, ``reduce_scatter`` and ``rank_id`` are implemented; the other collectives
raise, naming what is missing. :func:`launch_ranks` is the simulator's (``simulate.nki06.
launch_ranks``), not an ``nki.collectives`` name. Outside it (a single NeuronCore, LNC 1 or
2) every collective raises too: AWS's kernels that reach the module only to import it
(``attention_block_tkg`` with ``KVDP=1``, ``transformer_tkg`` without replica groups,
aws-neuron/nki-library@d2ad3a5 experimental/transformer/attention_block_tkg_sharding.py
L25-28, transformer_tkg.py L19) still run there."""

from __future__ import annotations

import threading

import numpy as np

from simulate.core import functions as fn
from simulate.core.instructions import dma_trace_fields

from . import context
from .errors import NkiDeadlockError, NkiRuntimeError, NkiTypeError, NkiValueError
from .isa import _emit
from .language import NKIObject
from .tensor import NkiTensor, VirtualRegister, write

_DOC = "aws-neuron-sdk@81ce03ae nki/api/nki/collectives/__init__.py"
_local = threading.local()
#: "The reduction operation to perform (nl.add, nl.minimum, or nl.maximum)" (L30, L160)
_REDUCE_OPS = {"add": np.add, "minimum": np.minimum, "maximum": np.maximum}


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

    def group_of(self, rank: int) -> tuple[int, ...]:
        for group in self.groups:
            if rank in group:
                return tuple(group)
        raise NkiValueError(f"rank {rank} is in no sub-group of ReplicaGroup {self.groups}")


class _AnotherRankFailed(NkiDeadlockError):
    """A rank stopped because another one failed: never the error :func:`launch_ranks`
    reports when the cause is known."""


class _World:
    """The ranks of one :func:`launch_ranks` and their rendezvous: ``slots[(k, group)]``
    holds what each member deposited for its k-th collective."""

    def __init__(self, ranks: int):
        self.ranks = ranks
        self.cond = threading.Condition()
        self.slots: dict = {}
        self.reads: dict = {}  # members that took their results from a slot
        self.waiting: dict[int, tuple] = {}  # rank -> the slot it waits on
        self.finished: set[int] = set()
        self.failed = False

    def _stuck(self) -> bool:
        """Every rank has ended or waits on a slot that cannot fill."""
        if len(self.waiting) + len(self.finished) < self.ranks:
            return False
        return all(len(self.slots[key]) < len(key[1]) for key in self.waiting.values())

    def meet(self, rank, k, group, call):
        """Deposit this rank's ``call`` for its k-th collective and wait for the group's."""
        key = (k, group)
        with self.cond:
            slot = self.slots.setdefault(key, {})
            slot[rank] = call
            self.cond.notify_all()
            self.waiting[rank] = key
            try:
                while len(slot) < len(group):
                    missing = [r for r in group if r not in slot]
                    if self.failed:
                        raise _AnotherRankFailed(f"{call[0]}: another rank failed")
                    if any(r in self.finished for r in missing) or self._stuck():
                        raise NkiDeadlockError(
                            f"{call[0]} #{k} on rank {rank}: ranks {missing} of its group "
                            f"{list(group)} ended or wait elsewhere (every rank of a group "
                            "must make the same collective calls in the same order)"
                        )
                    if not self.cond.wait(context.RENDEZVOUS_TIMEOUT_S):
                        raise NkiDeadlockError(f"{call[0]}: ranks {missing} never arrived")
            finally:
                del self.waiting[rank]
                self.cond.notify_all()
            calls = [slot[r] for r in group]
            self.reads[key] = self.reads.get(key, 0) + 1
            if self.reads[key] == len(group):  # every member has its sources: free them
                del self.slots[key], self.reads[key]
        for other in calls:
            if other[0] != call[0] or other[1] != call[1]:
                raise NkiValueError(
                    f"collective #{k} of group {list(group)}: rank {rank} calls {call[0]} "
                    f"{call[1]}, another rank {other[0]} {other[1]}"
                )
        return [c[2] for c in calls]

    def end(self, rank: int, failed: bool) -> None:
        with self.cond:
            self.finished.add(rank)
            self.failed = self.failed or failed
            self.cond.notify_all()


def _current(api):
    """(world, rank, program) of the running rank, or the single-NeuronCore error."""
    world = getattr(_local, "world", None)
    if world is None:
        raise NkiRuntimeError(
            f"nki.collectives.{api} needs several ranks: launch the kernel with "
            "simulate.nki06.collectives.launch_ranks (one NeuronCore runs no collective)"
        )
    return world, _local.rank, context.current(f"nki.collectives.{api}")


def launch_ranks(kernel, inputs, target=None):
    """Run ``kernel`` on ``len(inputs)`` ranks, rank r with ``inputs[r] = (args, kwargs)``;
    each rank is an LNC=1 launch (``kernel`` or ``kernel[1]``). Returns the results, one per
    rank. A rank's error is raised after every rank has stopped; a collective some rank
    never reaches is a :class:`NkiDeadlockError`."""
    from .runtime import Kernel, launch

    lnc = kernel.lnc if isinstance(kernel, Kernel) else None
    func = kernel.func if isinstance(kernel, Kernel) else kernel
    if lnc == 2:
        raise NkiValueError(
            "launch_ranks runs LNC=1 ranks: collectives between the two cores of LNC=2 ranks "
            "need both cores' rendezvous joined with the ranks' (not built)"
        )
    world = _World(len(inputs))
    results: list = [None] * len(inputs)
    errors: list = [None] * len(inputs)

    def body(rank):
        args, kwargs = inputs[rank]
        _local.world, _local.rank, _local.calls = world, rank, 0
        try:
            results[rank] = launch(func, tuple(args), dict(kwargs), lnc, target)
        except BaseException as exc:  # noqa: BLE001 - raised by the launching thread
            errors[rank] = exc
        finally:
            world.end(rank, errors[rank] is not None)

    threads = [
        threading.Thread(target=body, args=(rank,), name=f"nki-rank-{rank}", daemon=True)
        for rank in range(len(inputs))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(context.RENDEZVOUS_TIMEOUT_S)
        if t.is_alive():
            raise NkiRuntimeError(f"{t.name} did not finish")
    raised = [e for e in errors if e is not None]
    if raised:  # the cause first: an error of the kernel, then the deadlock, then the rest
        raise next(
            (e for e in raised if not isinstance(e, NkiDeadlockError)),
            next((e for e in raised if not isinstance(e, _AnotherRankFailed)), raised[0]),
        )
    return results


def _tensors(api, argname, tensors) -> list[NkiTensor]:
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise NkiTypeError(f"{api} {argname} must be a non-empty list of tensors")
    for t in tensors:
        if not isinstance(t, NkiTensor):
            raise NkiTypeError(f"{api} {argname} holds {type(t).__name__}, not a tensor")
        if t.storage.memory == "psum":
            raise NkiValueError(f"{api} {argname}: tensors live on HBM or SBUF ({_DOC} L24)")
    return list(tensors)


def _operands(api, srcs, dsts, collective_dim=None):
    """The documented operand rules (L23-26, L43-52, L151-159)."""
    srcs, dsts = _tensors(api, "srcs", srcs), _tensors(api, "dsts", dsts)
    if len(srcs) != len(dsts):
        raise NkiValueError(f"{api}: {len(srcs)} srcs but {len(dsts)} dsts")
    on_chip = {t.on_chip for t in srcs + dsts}
    if len(on_chip) > 1:
        raise NkiValueError(
            f"{api}: all tensors must be on HBM or all on SBUF, mixing memory spaces is not "
            f"supported ({_DOC} L23-25)"
        )
    sbuf = on_chip.pop()
    if sbuf and len(srcs) > 1:
        raise NkiValueError(
            f"{api}: coalesced communication (several tensors) is only supported on HBM "
            f"({_DOC} L25-26)"
        )
    for s, d in zip(srcs, dsts):
        if s.dtype is not d.dtype:
            raise NkiTypeError(f"{api}: src {s.dtype} and dst {d.dtype} must match")
        if sbuf and (len(s.shape) != 2 or len(d.shape) != 2):
            raise NkiValueError(
                f"{api}: SBUF collectives operate on 2D tensors with a single free dimension "
                f"({_DOC} L46-49)"
            )
    return srcs, dsts, sbuf


def _position(world, rank, replica_group):
    if not isinstance(replica_group, ReplicaGroup):
        raise NkiTypeError(f"replica_group must be a ReplicaGroup, got {replica_group!r}")
    group = replica_group.group_of(rank)
    for r in group:
        if not 0 <= r < world.ranks:
            raise NkiValueError(f"ReplicaGroup {replica_group.groups}: no rank {r} launched")
    return group, group.index(rank)


def _reduce_op(api, op):
    name = fn.lookup(op, "op").name if op is not None else None
    if name not in _REDUCE_OPS:
        raise NkiValueError(f"{api} op must be nl.add, nl.minimum or nl.maximum ({_DOC} L30)")
    return name


def _collective(api, srcs, dsts, replica_group, signature, results, name):
    """Meet the group, write each dst from ``results(sources, position)`` and record one
    DMA per dst (the local transfer of its bytes; the docs give collectives DMA queues,
    "DMA quality-of-service priority level", L32-33, and no cost: inter-rank time is not
    modelled)."""
    world, rank, _ = _current(api)
    group, position = _position(world, rank, replica_group)
    k = _local.calls
    _local.calls += 1
    shapes = tuple((tuple(s.shape), tuple(d.shape), str(s.dtype)) for s, d in zip(srcs, dsts))
    sources = world.meet(rank, k, group, (api, signature + shapes, [s.values() for s in srcs]))
    for i, dst in enumerate(dsts):
        write(dst, results([source[i] for source in sources], position, i))
        direction = "sbuf->sbuf" if dst.on_chip else "hbm->hbm"
        _emit(
            "dma",
            api,
            name,
            reads=[srcs[i]],
            writes=[dst],
            partitions=dst.shape[0],
            out_dtype=dst.dtype,
            details={"group": list(group)},
            dma=dma_trace_fields(
                dst.size * dst.itemsize, dst.shape[0], direction, dst.size * dst.itemsize
            ),
        )


def all_reduce(srcs, dsts, replica_group, op, priority=None, name=None):
    """Each dst = op over the group's srcs (same shape), accumulated in fp32 in the group's
    order and rounded once into dst (inferred: the docs give no accumulation dtype)."""
    api = "all_reduce"
    srcs, dsts, _ = _operands(api, srcs, dsts)
    op_name = _reduce_op(api, op)
    for s, d in zip(srcs, dsts):
        if tuple(s.shape) != tuple(d.shape):
            raise NkiValueError(f"{api}: src {tuple(s.shape)} and dst {tuple(d.shape)} differ")

    def results(sources, position, i):
        reduce = _REDUCE_OPS[op_name]
        total = sources[0].astype(np.float32)
        for values in sources[1:]:
            total = reduce(total, values.astype(np.float32))
        return total

    _collective(api, srcs, dsts, replica_group, (op_name,), results, name)


def all_gather(srcs, dsts, replica_group, collective_dim, priority=None, name=None):
    """Each dst = the group's srcs concatenated along ``collective_dim`` in the sub-group's
    order (the order of the rank list: inferred, the docs' examples use
    ``list(range(n))``); ``collective_dim`` 0 on HBM, 0 or 1 on SBUF (L43-49)."""
    api = "all_gather"
    srcs, dsts, sbuf = _operands(api, srcs, dsts)
    allowed = (0, 1) if sbuf else (0,)
    if collective_dim not in allowed:
        raise NkiValueError(
            f"{api} collective_dim={collective_dim}: {'SBUF' if sbuf else 'HBM'} tensors take "
            f"{' or '.join(map(str, allowed))} ({_DOC} L46-49)"
        )
    world, rank, _ = _current(api)
    size = len(_position(world, rank, replica_group)[0])
    for s, d in zip(srcs, dsts):
        wanted = list(s.shape)
        wanted[collective_dim] *= size
        if list(d.shape) != wanted:
            raise NkiValueError(
                f"{api}: dst {tuple(d.shape)} must be src {tuple(s.shape)} with dim "
                f"{collective_dim} times the group's {size} ranks"
            )

    def results(sources, position, i):
        shape = srcs[i].shape
        return np.concatenate([v.reshape(shape) for v in sources], axis=collective_dim)

    _collective(api, srcs, dsts, replica_group, (collective_dim,), results, name)


def reduce_scatter(srcs, dsts, replica_group, collective_dim, op, priority=None, name=None):
    """The rank at position p of its sub-group gets chunk p (of the group's size, along dim
    0, the only one supported, L158-159) of op over the group's srcs, accumulated in fp32."""
    api = "reduce_scatter"
    srcs, dsts, _ = _operands(api, srcs, dsts)
    op_name = _reduce_op(api, op)
    if collective_dim != 0:
        raise NkiValueError(f"{api} collective_dim must be 0 ({_DOC} L158-159)")
    world, rank, _ = _current(api)
    size = len(_position(world, rank, replica_group)[0])
    for s, d in zip(srcs, dsts):
        if s.shape[0] % size or (s.shape[0] // size,) + tuple(s.shape[1:]) != tuple(d.shape):
            raise NkiValueError(
                f"{api}: src {tuple(s.shape)} must split along dim 0 into the group's {size} "
                f"chunks of dst {tuple(d.shape)}"
            )

    def results(sources, position, i):
        reduce = _REDUCE_OPS[op_name]
        shape = srcs[i].shape
        rows = shape[0] // size
        chunks = [v.reshape(shape)[position * rows : (position + 1) * rows] for v in sources]
        total = chunks[0].astype(np.float32)
        for chunk in chunks[1:]:
            total = reduce(total, chunk.astype(np.float32))
        return total

    _collective(api, srcs, dsts, replica_group, (collective_dim, op_name), results, name)


def rank_id(name=None):
    """The rank of the running rank (L393-397), in a register as AWS's code uses it
    (``scalar_offset=ncc.rank_id()``, test/integration/nkilib/experimental/collectives/
    test_collectives.py L137-140)."""
    _, rank, _ = _current("rank_id")
    return VirtualRegister(rank, read_only=True)


def _not_built(api):
    def collective(*args, **kwargs):
        _current(api)
        raise NkiRuntimeError(f"nki.collectives.{api} is not built in the simulator")

    collective.__name__ = api
    collective.__qualname__ = api
    return collective


all_gather_v = _not_built("all_gather_v")
all_to_all = _not_built("all_to_all")
all_to_all_v = _not_built("all_to_all_v")
collective_permute = _not_built("collective_permute")
collective_permute_implicit = _not_built("collective_permute_implicit")
collective_permute_implicit_reduce = _not_built("collective_permute_implicit_reduce")
collective_permute_implicit_current_processing_rank_id = _not_built(
    "collective_permute_implicit_current_processing_rank_id"
)

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
