"""RMSNorm forward kernel: ``y = h · rstd · (weight + offset) + bias`` over the last axis.

Math, per row of length ``N`` (statistics in fp32 whatever the input dtype)::

    h    = x + residual                         optional; added in fp32, rounded to the
                                                residual's dtype and written out; the rest
                                                uses that rounded h (as reference.py does)
    rstd = 1 / sqrt(Σ h² / N + eps)             fp32, one per row, written out for backward
    y    = h · rstd · (weight + offset) + bias  weight, bias optional

Casting modes (``casting_mode``):

* ``gemma``: every product in fp32, one rounding at the end (HF GemmaRMSNorm).
* ``llama``: ``x̂ = h·rstd`` rounded to x's dtype first, then ``x̂·(weight + offset) + bias``
  in fp32, rounded once (HF LlamaRMSNorm).
* ``none``: every step rounded to x's dtype: x̂, ``weight + offset``, the product, the
  bias and the sum.

Shapes and dtypes: ``x`` (M, N) in float32 / bfloat16 / float16; ``weight``, ``bias`` (N,)
in float32 or x's dtype, or None; ``residual`` (M, N) or None; ``eps``, ``offset`` Python
floats; ``out_dtype`` y's dtype (None: x's dtype); ``rstd`` is (M,) float32, ``h`` in the
residual's dtype.

Entry points (all share ``forward_body``, so results are bitwise the same):

============================ ==================================================================
``rmsnorm_fwd``              return convention: ``(y, rstd)``
``rmsnorm_add_fwd``          return convention, fused residual add: ``(y, h, rstd)`` (its own
                             kernel, so every ``shared_hbm`` output is created unconditionally
                             at the kernel's top level: general/nki/api/nki.errors.rst
                             @8a38e733, lines 583-617)
``rmsnorm_fwd_out``          output parameters: writes the caller's ``y`` (its dtype is the
                             output dtype) and ``rstd`` in place, returns nothing
``rmsnorm_add_fwd_out``      output parameters, fused residual add: ``y``, ``h``, ``rstd``
============================ ==================================================================

Supported legacy Neuron SDK releases: 2.21-2.29 for every entry point and regime (the return
convention and ``activation_reduce`` / ``scalar_tensor_tensor`` / ``get_nc_version`` appear in
2.21; the SBUF budget is ``nl.tile_size.total_available_sbuf_size`` from 2.26 and the
documented per-generation figure before, ``nki_rmsnorm.nki.usable_sbuf_bytes``).

Regimes (``rmsnorm_fwd_plan.choose_layout``; decided from N, the dtypes, the options and the
target, never from the data; M only sets the rows per partition of "rows" and "packed" and
sends a batch of ≤ 32 rows to "spread", which computes each row as "rows" does; the nki06
kernel's grouped statistics and decode batches in "split" are not used here: this
kernel's row tiles run one after the other, and grouping would cost every large shape,
see ``plan.forward.choose_layout``):

======== =====================================================================================
rows     whole rows, double-buffered, with the weight (and bias) on chip for the whole kernel:
         ``N · (resident + 2 · k · per-row bytes) + 2 KiB`` ≤ usable SBUF. A tile holds
         ``k`` consecutive rows per partition (``rmsnorm_fwd_rows``): ``k`` grows while a
         tile moves ≤ 32 KiB per partition and stream, ≥ 16 tiles remain, k divides M and
         one PSUM tile holds the transposed rstd (k ≤ 4). One DMA per stream and tile.
packed   short rows (N · h's bytes ≤ 512, QK-norm heads), before "rows": k rows per
         partition, k the largest divisor of M keeping a tile ≤ 4 KiB of x per partition
         and ≥ 4 tiles per core; per-row Scalar Σh² and x̂, one Vector rstd chain per tile,
         the weight and bias replicated in a PSUM bank (``rmsnorm_fwd_packed``).
split    NeuronCore-v3+ only, rows too long for "rows": each row spread over s partitions
         (s a power of two ≤ 32 dividing N, the smallest that makes a segment ≤ 8 KiB of h),
         so a tile is R = 128 / s whole rows, one contiguous DMA (``rmsnorm_fwd_split``).
         Σh² per segment, combined across partitions by exact Tensor-engine transposes.
spread   decode batches, every target: ≤ 32 rows (with or without a residual), N with an
         even divisor, the whole-row tile fits: whole-row statistics as "rows" on a
         whole-row tile, and the product, h and y on a second load of the rows spread as
         in "split" (s segments per row, R·s ≤ 128 partitions); rstd moves there by a
         Vector transpose, a K = 1 ones-row matmul and a select, never a matmul transpose
         (not NaN-safe on v2) (``rmsnorm_fwd_spread``). Bitwise "rows".
long     one 128-row tile of h kept on chip, in column chunks of 4 KiB of h
         (``rmsnorm_fwd_long``): NeuronCore-v2, or N with no usable power-of-two factor.
two_pass not even one row tile fits: x (and the residual) are read twice.
======== =====================================================================================

HBM traffic: every regime but two_pass and spread (twice, for ≤ 32 rows) reads x and the
residual once and writes y, h and rstd
once; the weight and bias are read once ("rows"), three times at most ("split": the Tensor
engine's moving rows, 2·N·e bytes) or once per row tile ("long": N·e bytes per 128 rows).

Engine plan per row (``Plan.product_engine``; DMA moves everything):

======== ==================================================================================
DVE      h = x + residual (``tensor_tensor``, fp32, one rounding to the residual's dtype)
ACT      Σh² (``activation_reduce(square)``, fp32 accumulation)
rstd     ACT ``activation(rsqrt)`` of the mean square brought into its valid range
         [2⁻⁸⁷, 2⁹⁷] by exact powers of two (v·2⁻³²; on DVE with eps < 2⁻⁵⁵, v·2^±64
         chosen per row: every finite v > 0 is covered; an infinite v gives rstd = 0
         exactly), refined by two Newton steps
         (``rmsnorm_fwd_steps.rstd_from_sum``): within ≈ 2.5 fp32 ulp of 1/sqrt(v) even when
         ACT's rsqrt is off by 2⁻⁹. The chain runs on ACT unless ACT carries the product
         ("scalar" plan) or eps < 2⁻⁵⁵. On NeuronCore-v3+ the "rows" and "split" regimes
         instead take v (ACT or DVE) and GpSimd's more precise rsqrt
         (``rmsnorm_fwd_steps.rstd_on_gpsimd``), a few instructions per tile for all its rows
tensor   gemma with a weight on NeuronCore-v3+ (trn2, trn3): rstd is split into three
         bf16 pieces (hi, mid, lo; their sum is rstd within 2⁻²⁴), the Tensor engine
         transposes them exactly into a row (``is_transpose``) and forms rstd ⊗ w per
         512-column PSUM bank with a K = 3 matmul (bf16 products are exact, the sum is
         fp32), the Vector engine multiplies h by it with one PSUM operand (1 cycle per
         element instead of the 2 of a two-SBUF-input ``scalar_tensor_tensor``): one
         rounding into a bf16/fp16 y, gemma-exact. With an fp32 y the fp32 products
         h·(rstd ⊗ w) and the "scalar" plan's (h·rstd)·w round differently, so fp32
         outputs differ between NeuronCore generations in the last bit (both dialects
         agree on one target). An fp32 weight or weight + offset pairs with fp32 rstd
         instead (K = 1, a quarter of the matmul rate).
scalar   a weight on NeuronCore-v2 (trn1, inf2), every casting mode: ACT scales h by rstd
         (fp32, or x̂ rounded to x's dtype), the Tensor engine broadcasts the weight row into
         PSUM (a ones-row matmul, exact), the Vector engine multiplies the two (1 cycle per
         element). (v2's Tensor-engine transpose is not NaN-safe, so rstd stays a column.)
vector   no weight, or llama / none on NeuronCore-v3+, where the bf16 fast modes make the
         Vector engine alone cheap: x̂ = h·rstd (``tensor_scalar``), x̂·w (``tensor_tensor``),
         or h·rstd·w in one ``scalar_tensor_tensor``.
DVE      + bias (fp32, one rounding), and a final conversion in "none" mode when y's dtype
         differs from x's.
======== ==================================================================================

A row with an infinite element has Σh² = inf and rstd = 0 exactly: y is NaN at the infinite
elements and 0 elsewhere, as the float64 reference and torch give. The one data-dependent
limit: Σh² is an fp32 sum of fp32 squares, so a finite row whose Σh² reaches 2¹²⁸ (bf16/fp32
elements near 1.8·10¹⁹ and beyond) or, with eps = 0, whose mean square falls below 2⁻¹²⁵
(subnormal squares) cannot be exact; the NumPy launcher (``nki_rmsnorm.ops``, which the
torch CPU and JAX host paths use) raises ``ValueError`` for such rows, and on a device they
behave as torch's fp32 arithmetic does (rstd = 0, y = 0).
A row whose statistics come out NaN (a NaN input) or infinite (``eps = 0`` and an all-zero
row: rstd = inf, y = 0 · inf = NaN) affects only its own outputs: rstd moves between partitions
only through exact transposes, and the zeros of the Tensor engine's operands only meet values
of the same row. (In "split", the weight segments share one contraction, so a non-finite
*weight* element also reaches the same offset of the other segments; a finite weight is
exact.) The reductions have a fixed order that depends on N only (the whole row, chunk
partials in chunk order, or segment sums in segment order), so a row's outputs are bitwise
the same whatever batch it is part of.
"""

from __future__ import annotations

from nki_rmsnorm.kernels.legacy.rmsnorm_fwd_long import long_rows, two_pass
from nki_rmsnorm.kernels.legacy.rmsnorm_fwd_packed import packed_rows
from nki_rmsnorm.kernels.legacy.rmsnorm_fwd_rows import rows_resident
from nki_rmsnorm.kernels.legacy.rmsnorm_fwd_split import split_rows
from nki_rmsnorm.kernels.legacy.rmsnorm_fwd_spread import spread_rows
from nki_rmsnorm.nki import nisa, nki, nl, usable_sbuf_bytes
from nki_rmsnorm.plan.forward import (
    CASTING_MODES,
    Layout,
    Plan,
    Tensors,
    choose_layout,
    make_plan,
    weight_heads,
)
from nki_rmsnorm.plan.kernel_assert import kernel_assert

__all__ = [
    "CASTING_MODES",
    "Layout",
    "Plan",
    "choose_layout",
    "forward_body",
    "make_plan",
    "rmsnorm_add_fwd",
    "rmsnorm_add_fwd_out",
    "rmsnorm_fwd",
    "rmsnorm_fwd_out",
    "rmsnorm_qk_fwd",
]


def _plan(x, weight, bias, h_dtype, offset, casting_mode, out_dtype):
    """The :class:`Plan` for these HBM tensors on the running target."""
    return make_plan(
        x.dtype,
        None if weight is None else weight.dtype,
        None if bias is None else bias.dtype,
        h_dtype,
        offset,
        casting_mode,
        out_dtype,
        nl.float32,
        nl.bfloat16,
        tensor_engine=nisa.get_nc_version() != nisa.nc_version.gen2,
    )


def forward_body(plan, hbm, eps, offset):
    """Write y, rstd (and h) of ``hbm`` (a ``Tensors``): the code every entry point shares."""
    M, N = hbm.x.shape
    # whole-row statistics (its row tiles run one after the other: grouped statistics would
    # cost whole-row tiles, plan.forward.choose_layout), decode batches in "spread"; a
    # per-head weight (heads, N): "packed" only, k rows per partition a multiple of heads
    heads = weight_heads(plan, None if hbm.weight is None else hbm.weight.shape, M, N)
    layout = choose_layout(plan, M, N, usable_sbuf_bytes(), grouped=False, heads=heads)
    if layout.regime == "rows":
        rows_resident(plan, layout.rows_per_partition, hbm, eps, offset)
    elif layout.regime == "packed":
        packed_rows(plan, layout.rows_per_partition, heads, hbm, eps, offset)
    elif layout.regime == "split":
        split_rows(plan, layout.segments, hbm, eps, offset)
    elif layout.regime == "spread":
        spread_rows(plan, layout.segments, hbm, eps, offset)
    elif layout.regime == "long":
        long_rows(plan, layout.chunk, layout.output_chunk, hbm, eps, offset)
    else:
        two_pass(plan, layout.chunk, hbm, eps, offset)


@nki.jit
def rmsnorm_fwd(x, weight, bias, eps, offset, casting_mode, out_dtype):
    """RMSNorm forward of ``x`` (M, N), return convention: ``(y, rstd)``, y in
    ``out_dtype`` (None: x's dtype), rstd (M,) fp32. See the module docstring."""
    M, N = x.shape
    plan = _plan(x, weight, bias, None, offset, casting_mode, out_dtype)
    y = nl.ndarray((M, N), dtype=plan.out_dtype, buffer=nl.shared_hbm)
    rstd = nl.ndarray((M,), dtype=nl.float32, buffer=nl.shared_hbm)
    forward_body(plan, Tensors(x, None, weight, bias, y, None, rstd), eps, offset)
    return y, rstd


@nki.jit
def rmsnorm_fwd_out(x, weight, bias, y, rstd, eps, offset, casting_mode):
    """RMSNorm forward of ``x`` (M, N), output-parameter convention: writes the caller's
    ``y`` (M, N; its dtype is the output dtype) and ``rstd`` (M,) float32 in place and
    returns nothing (``torch_neuronx.nki_jit`` / ``jax_neuronx.nki_call``). Same code and
    results as :func:`rmsnorm_fwd`. The outputs must not alias the inputs."""
    check_outputs(y, rstd)
    plan = _plan(x, weight, bias, None, offset, casting_mode, y.dtype)
    forward_body(plan, Tensors(x, None, weight, bias, y, None, rstd), eps, offset)


@nki.jit
def rmsnorm_add_fwd(x, residual, weight, bias, eps, offset, casting_mode, out_dtype):
    """Fused residual add and RMSNorm, return convention: ``h = x + residual`` (in the
    residual's dtype), ``(y, h, rstd)`` of h. See the module docstring."""
    M, N = x.shape
    plan = _plan(x, weight, bias, residual.dtype, offset, casting_mode, out_dtype)
    y = nl.ndarray((M, N), dtype=plan.out_dtype, buffer=nl.shared_hbm)
    h = nl.ndarray((M, N), dtype=residual.dtype, buffer=nl.shared_hbm)
    rstd = nl.ndarray((M,), dtype=nl.float32, buffer=nl.shared_hbm)
    forward_body(plan, Tensors(x, residual, weight, bias, y, h, rstd), eps, offset)
    return y, h, rstd


@nki.jit
def rmsnorm_add_fwd_out(x, residual, weight, bias, y, h, rstd, eps, offset, casting_mode):
    """Fused residual add and RMSNorm, output-parameter convention: writes the caller's
    ``y`` (its dtype is the output dtype), ``h`` (the residual's dtype) and ``rstd`` (M,)
    float32 in place, returns nothing. Same code and results as :func:`rmsnorm_add_fwd`."""
    check_outputs(y, rstd, residual, h)
    plan = _plan(x, weight, bias, residual.dtype, offset, casting_mode, y.dtype)
    forward_body(plan, Tensors(x, residual, weight, bias, y, h, rstd), eps, offset)


@nki.jit
def rmsnorm_qk_fwd(q, k, q_weight, k_weight, eps, offset, casting_mode, out_dtype):
    """The query and key norms of an attention (QK-norm: Qwen3, Gemma 3; Megatron's fused
    call) in one launch: q (Mq, Nq) and k (Mk, Nk) (rows: tokens × heads, Nq and Nk the head
    sizes), each with its own weight (or None) and the same eps, offset, casting mode and
    output dtype; return convention: ``(y_q, y_k, rstd_q, rstd_k)``. Each is planned and
    normalised exactly as :func:`rmsnorm_fwd` would (the same bits), one after the other:
    the launch is paid once, and k's first loads overlap q's last stores."""
    Mq, Nq = q.shape
    Mk, Nk = k.shape
    plan_q = _plan(q, q_weight, None, None, offset, casting_mode, out_dtype)
    plan_k = _plan(k, k_weight, None, None, offset, casting_mode, out_dtype)
    y_q = nl.ndarray((Mq, Nq), dtype=plan_q.out_dtype, buffer=nl.shared_hbm)
    y_k = nl.ndarray((Mk, Nk), dtype=plan_k.out_dtype, buffer=nl.shared_hbm)
    rstd_q = nl.ndarray((Mq,), dtype=nl.float32, buffer=nl.shared_hbm)
    rstd_k = nl.ndarray((Mk,), dtype=nl.float32, buffer=nl.shared_hbm)
    forward_body(plan_q, Tensors(q, None, q_weight, None, y_q, None, rstd_q), eps, offset)
    forward_body(plan_k, Tensors(k, None, k_weight, None, y_k, None, rstd_k), eps, offset)
    return y_q, y_k, rstd_q, rstd_k


def check_outputs(y, rstd, residual=None, h=None):
    """The output parameters' dtypes, before anything runs: y in a kernel dtype, rstd fp32,
    h in the residual's dtype (a wrong one would be written truncated); the package's
    launchers raise ``TypeError`` for the same first (``validation.check_forward_outputs``)."""
    kernel_assert(
        y.dtype == nl.float32 or y.dtype == nl.bfloat16 or y.dtype == nl.float16,
        f"y must be float32, bfloat16 or float16 (the output dtype), got {y.dtype}",
    )
    kernel_assert(rstd.dtype == nl.float32, f"rstd must be float32, got {rstd.dtype}")
    if h is not None:
        kernel_assert(
            h.dtype == residual.dtype,
            f"h must have the residual's dtype ({residual.dtype}), got {h.dtype}",
        )
