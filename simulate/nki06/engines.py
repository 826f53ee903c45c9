"""Engine arithmetic on plain arrays that the core does not offer as functions yet.

The legacy front-end computes the same things inside its signature functions
(``simulate/legacy/isa.py``: ``tensor_reduce``, ``bn_stats``, ``bn_aggr``,
``tensor_tensor_scan``), which this front-end may not import (the import contract keeps the
two front-ends independent). These array-in, array-out versions are meant to move into
``simulate.core`` so that both front-ends share one copy.
"""

from __future__ import annotations

import numpy as np


def reduce_last(spec, values: np.ndarray, negate: bool) -> np.ndarray:
    """``spec`` folded over the last axis of ``values`` (float32 or integers for bit ops);
    ``subtract`` gives ``x0 - x1 - x2 ...``."""
    with np.errstate(all="ignore"):
        if spec.name == "subtract":
            result = 2 * values[..., 0] - values.sum(axis=-1, dtype=values.dtype)
        else:
            result = np.asarray(spec.reduce(values, -1))
    return -result if negate else result


def batch_norm_stats(x: np.ndarray) -> np.ndarray:
    """Per row of ``x`` (P, F): ``[count, mean, var*count]`` of the even- then of the
    odd-indexed elements, in float32 (an empty group gives zeros)."""
    out = np.zeros((x.shape[0], 6), np.float32)
    for parity in (0, 1):
        group = x[:, parity::2]
        if group.shape[1] == 0:
            continue
        mean = group.mean(axis=1, dtype=np.float32)
        deviation = group - mean[:, None]
        out[:, 3 * parity] = group.shape[1]
        out[:, 3 * parity + 1] = mean
        out[:, 3 * parity + 2] = (deviation * deviation).sum(axis=1, dtype=np.float32)
    return out


def batch_norm_aggregate(stats: np.ndarray) -> np.ndarray:
    """Rows of ``(count, mean, var*count)`` triples -> ``[mean, population variance]``."""
    count, mean, m2 = stats[:, 0::3], stats[:, 1::3], stats[:, 2::3]
    total = np.maximum(count.sum(axis=1), np.float32(1))
    grand = (count * mean).sum(axis=1) / total
    var = (m2 + count * (mean - grand[:, None]) ** 2).sum(axis=1) / total
    return np.stack([grand, var], axis=1).astype(np.float32)


def scan(alu, data0: np.ndarray, data1: np.ndarray, initial, op0, op1, reverse0, reverse1):
    """Per row: ``r[i] = op1(op0(data0[i], r[i-1]), data1[i])`` with ``r[-1] = initial``;
    ``alu(spec, a, b, reverse)`` applies one ALU stage."""
    out = np.empty_like(data0)
    previous = np.broadcast_to(
        np.asarray(initial, np.float32).reshape(-1), (data0.shape[0],)
    ).copy()
    for i in range(data0.shape[1]):  # a true recurrence: the engine walks the free axis too
        stage = alu(op0, data0[:, i], previous, reverse0)
        previous = np.asarray(alu(op1, stage, data1[:, i], reverse1), np.float32)
        out[:, i] = previous
    return out
