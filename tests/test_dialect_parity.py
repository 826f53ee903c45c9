"""The forward kernel in the two NKI dialects, trace against trace, and the nki06 kernel at
LNC = 1 against LNC = 2.

Both dialects plan with ``nki_rmsnorm.plan.forward`` and emit the same arithmetic, so their
outputs are bitwise equal and their HBM traffic is the same. Their instruction streams are
the same per engine but for one documented step: the nki06 dialect has no partition
broadcast instruction, so a row broadcast across the partitions (the weight of the
"vector" plan, the bias) is a ones-row matmul per 512-column PSUM bank and a Vector copy out
of it, plus one memset of the ones row, where the legacy kernel has one Vector
``partition_broadcast``: per broadcast row, one more Tensor-engine instruction per bank and
as many more Vector instructions (copies + memset − broadcast).
"""

from __future__ import annotations

import collections
import math

import numpy as np
import pytest
from conftest import BF16, poison, trace_launch

import simulate
from nki_rmsnorm import kernels
from nki_rmsnorm.plan.forward import PSUM_COLS, make_plan

FP32 = np.dtype(np.float32)

# (target, M, N, x dtype, weight, bias, residual, casting mode): one per product engine
# ("scalar" on trn1, "tensor" for gemma with a weight on trn2 / trn3, "vector" otherwise),
# ragged last tiles, several rows per partition (4096 × 1024 on trn2: k = 2).
CASES = [
    ("trn1", 300, 640, FP32, True, True, False, "gemma"),
    ("trn2", 4096, 1024, BF16, True, False, True, "gemma"),
    ("trn3", 130, 768, BF16, True, True, False, "llama"),
    ("trn2", 257, 512, BF16, False, True, True, "none"),
]


def _launch(dialect, target, x, residual, weight, bias, casting_mode, lnc=None):
    common = (weight, bias, 1e-6, 0.0 if weight is None else 0.5, casting_mode, None)
    if residual is None:
        kernel = kernels.kernel("rmsnorm_fwd", dialect)
        return trace_launch(kernel, x, *common, target=target, lnc=lnc)
    kernel = kernels.kernel("rmsnorm_add_fwd", dialect)
    return trace_launch(kernel, x, residual, *common, target=target, lnc=lnc)


def _inputs(rng, M, N, dtype, weight, bias, residual):
    x = rng.standard_normal((M, N)).astype(dtype)
    w = rng.normal(1.0, 0.2, N).astype(dtype) if weight else None
    b = rng.normal(0.0, 0.5, N).astype(FP32) if bias else None
    r = rng.standard_normal((M, N)).astype(FP32) if residual else None
    return x, r, w, b


def _bitwise(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))


def _engine_counts(trace):
    return collections.Counter(i.engine for i in trace.instructions)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}-{c[7]}")
def test_dialects_agree_bitwise_with_the_same_traffic(rng, case):
    target, M, N, dtype, weight, bias, residual, mode = case
    x, r, w, b = _inputs(rng, M, N, dtype, weight, bias, residual)
    legacy, legacy_trace = _launch("legacy", target, x, r, w, b, mode)
    nki06, nki06_trace = _launch("nki06", target, x, r, w, b, mode)
    _bitwise(nki06, legacy)
    assert nki06_trace.hbm_bytes() == legacy_trace.hbm_bytes()

    spec = simulate.get_target(target)
    plan = make_plan(x.dtype, None if w is None else w.dtype, None if b is None else b.dtype,
                     None if r is None else r.dtype, 0.5 if weight else 0.0, mode, None,
                     tensor_engine=spec.nc_version >= 3)
    broadcasts = int(weight and plan.product_engine == "vector") + int(bias)
    banks = math.ceil(N / PSUM_COLS)
    expected = _engine_counts(legacy_trace)
    expected["pe"] += broadcasts * banks
    expected["dve"] += broadcasts * banks
    assert _engine_counts(nki06_trace) == expected


@pytest.mark.parametrize("target", ["trn2", "trn3"])
@pytest.mark.parametrize(
    "M,N,residual",
    [(4100, 256, True), (3 * 128 + 5, 1000, False), (1, 512, False)],
    ids=["k2-ragged", "odd-tiles", "one-row"],
)
def test_lnc2_is_bitwise_lnc1(rng, target, M, N, residual):
    """Under ``kernel[2]`` the row tiles are split between the two physical cores, each
    issuing its own instructions, and every output bit is the one LNC = 1 gives."""
    x, r, w, b = _inputs(rng, M, N, BF16, True, True, residual)
    one, _ = _launch("nki06", target, x, r, w, b, "gemma", lnc=1)
    two, trace = _launch("nki06", target, x, r, w, b, "gemma", lnc=2)
    _bitwise(two, one)
    cores = collections.Counter(i.program for i in trace.instructions if i.engine == "dma")
    assert set(cores) == {(0,), (1,)}
    if M > 128:  # both cores move rows, not only the weight and bias
        assert min(cores.values()) > 4


def test_lnc2_output_parameters(rng):
    x, _, w, _ = _inputs(rng, 600, 384, BF16, True, False, False)
    want, _ = _launch("nki06", "trn2", x, None, w, None, "gemma")
    y, rstd = poison((600, 384), BF16), poison((600,), FP32)
    kernel = kernels.kernel("rmsnorm_fwd_out", "nki06")
    trace_launch(kernel, x, w, None, y, rstd, 1e-6, 0.5, "gemma", target="trn2", lnc=2)
    _bitwise((y, rstd), want)


def test_lnc2_needs_a_two_core_target(rng):
    x, _, w, _ = _inputs(rng, 8, 64, BF16, True, False, False)
    with pytest.raises(ValueError, match="LNC=2 needs trn2 or trn3"):
        _launch("nki06", "trn1", x, None, w, None, "gemma", lnc=2)
