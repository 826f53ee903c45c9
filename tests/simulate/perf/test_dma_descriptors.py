"""How long a DMA's descriptors make it: the contiguous bytes per descriptor (``dma_row_bytes``)
of an HBM access in any axis order, in both dialects, and the modeled transfer time they give.

A DMA transfer gathers contiguous source buffers and scatters them into contiguous destination
buffers (aws-neuron-sdk@8a38e733 general/nki/arch/trainium_inferentia2_arch.rst L616-617,
L653-655): a descriptor is the run of addressed elements that follow each other in HBM in the
order the on-chip side (contiguous along each partition) takes them. Each case writes the run
out by hand and derives the transfer time from the constants (``simulate/perf/cost.py``
``_dma_plan``: per DMA engine, the larger of its bytes at the engine rate and its descriptors
at ``dma_descriptor_ns`` each).
"""

from __future__ import annotations

import numpy as np
import pytest

import simulate
import simulate.language as nl
import simulate.nki06 as nki06
from simulate.cost import CostTable
from simulate.nki06 import isa as nisa06
from simulate.nki06 import language as nl06

R, P, K = 64, 128, 32  # x[R, P, K] fp32, loaded as a [P, R, K] tile
FP32 = 4


def _const(name, target):
    return CostTable(target).values[name]


def _dma_rows(prof):
    """(opcode, bytes, contiguous bytes per descriptor, modeled transfer us) of every DMA of
    the last kernel run, transfer time without the queue's fixed cost."""
    trace = simulate.last_trace()
    sched = prof.schedule
    fixed = _const("dma_fixed_us", prof.target)
    return [
        (
            inst.opcode,
            inst.dma_bytes,
            inst.dma_row_bytes,
            sched.end_us[i] - sched.start_us[i] - fixed,
        )
        for i, inst in enumerate(trace.instructions)
        if inst.engine == "dma"
    ]


def _transfer_us(nbytes, row_bytes, target, partitions=P):
    """The hand computation of one [partitions, ...] load: each of the 16 DMA engines serves 8
    partitions and moves its share of the bytes at its rate, or its share of the descriptors
    at ``dma_descriptor_ns`` each, whichever takes longer; all of it no faster than HBM gives
    (``hbm_efficiency`` of the core's share)."""
    group = _const("dma_partitions_per_engine", target)
    rate = _const("dma_engine_peak_gbps", target) * _const("dma_efficiency", target)
    hbm_rate = _const("hbm_share_gbps", target) * _const("hbm_efficiency", target)
    engine_bytes = nbytes / partitions * group
    engine_descriptors = engine_bytes / row_bytes
    return (
        max(
            engine_bytes / rate,
            engine_descriptors * _const("dma_descriptor_ns", target),
            nbytes / hbm_rate,
        )
        / 1e3
    )


# --- legacy kernels ---------------------------------------------------------------------------
@simulate.jit
def legacy_permuted_chunks(x):
    """tile[p, r, k] = x[r, p, k]: partitions on the second HBM axis, K contiguous elements
    per descriptor."""
    out = nl.ndarray((P, R, K), dtype=x.dtype, buffer=nl.shared_hbm)
    i_p = nl.arange(P)[:, None, None]
    i_r = nl.arange(R)[None, :, None]
    i_k = nl.arange(K)[None, None, :]
    tile = nl.load(x[i_r, i_p, i_k])
    nl.store(out[i_p, i_r, i_k], value=tile)
    return out


@simulate.jit
def legacy_transposed(x):
    """tile[p, r] = x[r, p]: neighbours along a partition are a whole HBM row apart."""
    out = nl.ndarray((P, R), dtype=x.dtype, buffer=nl.shared_hbm)
    i_p = nl.arange(P)[:, None]
    i_r = nl.arange(R)[None, :]
    tile = nl.load(x[i_r, i_p])
    nl.store(out[i_p, i_r], value=tile)
    return out


@simulate.jit
def legacy_free_axes_swapped(x):
    """tile[p, k, r] = x[r, p, k]: contiguous in HBM along k, but the tile takes r innermost."""
    out = nl.ndarray((P, K, R), dtype=x.dtype, buffer=nl.shared_hbm)
    i_p = nl.arange(P)[:, None, None]
    i_k = nl.arange(K)[None, :, None]
    i_r = nl.arange(R)[None, None, :]
    tile = nl.load(x[i_r, i_p, i_k])
    nl.store(out[i_p, i_k, i_r], value=tile)
    return out


@simulate.jit
def legacy_flat_rows(x):
    """A 1-D tensor addressed by one affine expression in both access axes: x[p * N + f]."""
    n = x.shape[0] // P
    out = nl.ndarray((P, n), dtype=x.dtype, buffer=nl.shared_hbm)
    i_p = nl.arange(P)[:, None]
    i_f = nl.arange(n)[None, :]
    tile = nl.load(x[i_p * n + i_f])
    nl.store(out[i_p, i_f], value=tile)
    return out


@simulate.jit
def legacy_permuted_chunks_masked(x):
    """The permuted load with its last 8 elements of k masked off: 24-element descriptors."""
    out = nl.ndarray((P, R, K), dtype=x.dtype, buffer=nl.shared_hbm)
    i_p = nl.arange(P)[:, None, None]
    i_r = nl.arange(R)[None, :, None]
    i_k = nl.arange(K)[None, None, :]
    tile = nl.load(x[i_r, i_p, i_k], mask=(i_k < K - 8))
    nl.store(out[i_p, i_r, i_k], value=tile, mask=(i_k < K - 8))
    return out


def _x(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("target", ["trn1", "trn2", "trn3"])
def test_legacy_permuted_access_runs_over_the_contiguous_inner_axis(rng, target):
    x = _x(rng, (R, P, K))
    out, prof = simulate.profile(legacy_permuted_chunks, x, target=target)
    np.testing.assert_array_equal(out, x.transpose(1, 0, 2))
    (load, nbytes, row, load_us), (store, _, store_row, _) = _dma_rows(prof)
    assert (load, nbytes, row) == ("load", R * P * K * FP32, K * FP32)
    assert (store, store_row) == ("store", R * K * FP32)  # the output is [P, R*K] row-major
    # trn2: 8 partitions x 8 KiB = 64 KiB per engine in 512 descriptors of 128 B:
    # 512 x 12 ns = 6.144 us (descriptor-bound; 64 KiB at 23.12 B/ns is 2.83 us)
    assert load_us == pytest.approx(_transfer_us(nbytes, K * FP32, target))
    if target == "trn2":
        assert load_us == pytest.approx(6.144)


@pytest.mark.parametrize("target", ["trn1", "trn2"])
def test_legacy_transposing_access_costs_one_descriptor_per_element(rng, target):
    x = _x(rng, (R, P))
    out, prof = simulate.profile(legacy_transposed, x, target=target)
    np.testing.assert_array_equal(out, x.T)
    (_, nbytes, row, load_us), (_, _, store_row, _) = _dma_rows(prof)
    assert (row, store_row) == (FP32, R * FP32)
    # 8 partitions x 64 elements = 512 descriptors of 4 B per engine: 6.144 us on every target
    assert load_us == pytest.approx(_transfer_us(nbytes, FP32, target)) == pytest.approx(6.144)
    assert prof.dma_small_transfers == 2  # 256 B per partition, both ways


def test_legacy_swapped_free_axes_stream_one_element_per_descriptor(rng):
    """Sorting the steps by size would give 128 B runs here; the on-chip side takes r
    innermost, so no two neighbours of a destination buffer are neighbours in HBM."""
    x = _x(rng, (R, P, K))
    out, prof = simulate.profile(legacy_free_axes_swapped, x, target="trn2")
    np.testing.assert_array_equal(out, x.transpose(1, 2, 0))
    (_, nbytes, row, load_us), _ = _dma_rows(prof)
    assert row == FP32
    assert load_us == pytest.approx(_transfer_us(nbytes, FP32, "trn2"))


def test_legacy_affine_expression_over_both_axes_is_a_row_per_partition(rng):
    x = _x(rng, (P * 256,))
    out, prof = simulate.profile(legacy_flat_rows, x, target="trn2")
    np.testing.assert_array_equal(out, x.reshape(P, 256))
    (_, nbytes, row, load_us), _ = _dma_rows(prof)
    assert row == 256 * FP32
    assert load_us == pytest.approx(_transfer_us(nbytes, 256 * FP32, "trn2"))


def test_legacy_masked_permuted_access_runs_over_the_unmasked_box(rng):
    x = _x(rng, (R, P, K))
    out, prof = simulate.profile(legacy_permuted_chunks_masked, x, target="trn2")
    np.testing.assert_array_equal(out[:, :, : K - 8], x.transpose(1, 0, 2)[:, :, : K - 8])
    (_, nbytes, row, load_us), _ = _dma_rows(prof)
    assert (nbytes, row) == (R * P * (K - 8) * FP32, (K - 8) * FP32)
    assert load_us == pytest.approx(_transfer_us(nbytes, (K - 8) * FP32, "trn2"))


# --- nki 0.6 kernels: the same accesses through views -------------------------------------
def nki06_permuted_chunks(x):
    tile = nl06.ndarray((P, R, K), nl06.float32)
    nisa06.dma_copy(dst=tile, src=x.permute((1, 0, 2)))
    out = nl06.ndarray((P, R, K), nl06.float32, buffer=nl06.shared_hbm)
    nisa06.dma_copy(dst=out, src=tile)
    return out


def nki06_permuted_chunks_ap(x):
    tile = nl06.ndarray((P, R, K), nl06.float32)
    nisa06.dma_copy(dst=tile, src=x.ap([[K, P], [P * K, R], [1, K]]))
    out = nl06.ndarray((P, R, K), nl06.float32, buffer=nl06.shared_hbm)
    nisa06.dma_copy(dst=out, src=tile)
    return out


def nki06_free_axes_swapped(x):
    tile = nl06.ndarray((P, K, R), nl06.float32)
    nisa06.dma_copy(dst=tile, src=x.permute((1, 2, 0)))
    out = nl06.ndarray((P, K, R), nl06.float32, buffer=nl06.shared_hbm)
    nisa06.dma_copy(dst=out, src=tile)
    return out


@pytest.mark.parametrize("target", ["trn2", "trn3"])
@pytest.mark.parametrize("kernel", [nki06_permuted_chunks, nki06_permuted_chunks_ap])
def test_nki06_permuted_view_matches_the_legacy_access(rng, kernel, target):
    x = _x(rng, (R, P, K))
    out, prof = simulate.profile(nki06.jit(kernel), x, target=target)
    np.testing.assert_array_equal(out, x.transpose(1, 0, 2))
    (_, nbytes, row, load_us), _ = _dma_rows(prof)
    assert (nbytes, row) == (R * P * K * FP32, K * FP32)
    assert load_us == pytest.approx(_transfer_us(nbytes, K * FP32, target))
    _, legacy = simulate.profile(legacy_permuted_chunks, x, target=target)
    assert prof.latency_us == pytest.approx(legacy.latency_us)


def test_nki06_swapped_free_axes_stream_one_element_per_descriptor(rng):
    x = _x(rng, (R, P, K))
    out, prof = simulate.profile(nki06.jit(nki06_free_axes_swapped), x, target="trn2")
    np.testing.assert_array_equal(out, x.transpose(1, 2, 0))
    (_, nbytes, row, load_us), _ = _dma_rows(prof)
    assert row == FP32
    assert load_us == pytest.approx(_transfer_us(nbytes, FP32, "trn2"))
