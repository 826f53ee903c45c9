"""RMSNorm forward kernel in the ``nki`` 0.6 dialect (NKI 0.5 – 0.6, Neuron SDK 2.31 – 2.32):
``y = h · rstd · (weight + offset) + bias`` over the last axis, with the optional fused
residual add ``h = x + residual``.

The math, casting modes, dtypes, engine plans, numerics and HBM traffic are those of the
legacy kernel (``nki_rmsnorm/kernels/legacy/rmsnorm_fwd.py``, whose docstring documents
them); both plan with :mod:`nki_rmsnorm.plan.forward`, so the same inputs give the same
regime, tiles and instructions, written in the 0.6 dialect (``rmsnorm_fwd_steps``).

Entry points (all share ``forward_body``): ``rmsnorm_fwd`` → ``(y, rstd)``,
``rmsnorm_add_fwd`` → ``(y, h, rstd)`` (outputs ``shared_hbm``, as 0.3+ requires of kernel
outputs: nki/migration/index.rst, 0.2→0.3), and the output-parameter twins
``rmsnorm_fwd_out`` / ``rmsnorm_add_fwd_out``; ``rmsnorm_fwd_transposed`` /
``rmsnorm_add_fwd_transposed`` (0.6 only) write y in rmsnorm_tkg's (P, M, N / P) layout.

Every regime of the legacy kernel exists here with the same file and function names:
"rows" (``rmsnorm_fwd_rows.rows_resident``), "packed" (``rmsnorm_fwd_packed.packed_rows``),
"split" (``rmsnorm_fwd_split.split_rows``),
"long" and "two_pass" (``rmsnorm_fwd_long.long_rows`` / ``two_pass``).

Launch with ``kernel[2]`` on trn2 / trn3 to split the row tiles of every regime across the
two physical cores of a logical core (``nl.program_id(0)``); results are bitwise the same as
LNC=1.
"""

from __future__ import annotations

from nki_rmsnorm.kernels.nki06._nki import nisa, nki, nl, usable_sbuf_bytes
from nki_rmsnorm.kernels.nki06.rmsnorm_fwd_long import long_rows, two_pass
from nki_rmsnorm.kernels.nki06.rmsnorm_fwd_packed import packed_rows
from nki_rmsnorm.kernels.nki06.rmsnorm_fwd_rows import rows_resident
from nki_rmsnorm.kernels.nki06.rmsnorm_fwd_split import split_rows
from nki_rmsnorm.plan.forward import (
    CASTING_MODES,
    GROUP_MIN_COLUMNS,
    GROUP_MIN_COLUMNS_NC_V3,
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
    "rmsnorm_add_fwd_transposed",
    "rmsnorm_fwd",
    "rmsnorm_fwd_out",
    "rmsnorm_fwd_transposed",
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
        group_min_columns=(
            GROUP_MIN_COLUMNS_NC_V3
            if nisa.get_nc_version() == nisa.nc_version.gen3
            else GROUP_MIN_COLUMNS
        ),
    )


def forward_body(plan, hbm, eps, offset):
    """Write y, rstd (and h) of ``hbm`` (a ``Tensors``): the code every entry point shares."""
    M, N = hbm.x.shape
    # Under LNC=2 each core should keep as many row tiles to pipeline as one core at LNC=1
    # (thinner tiles; no row's arithmetic changes).
    # a per-head weight (heads, N): "packed" only, k rows per partition a multiple of heads
    heads = weight_heads(plan, None if hbm.weight is None else hbm.weight.shape, M, N)
    layout = choose_layout(plan, M, N, usable_sbuf_bytes(), cores=nl.num_programs(0), heads=heads)
    if layout.regime == "rows":
        rows_resident(plan, layout.rows_per_partition, hbm, eps, offset, layout.groups)
    elif layout.regime == "packed":
        packed_rows(plan, layout.rows_per_partition, heads, hbm, eps, offset)
    elif layout.regime == "split":
        split_rows(plan, layout.segments, hbm, eps, offset)
    elif layout.regime == "long":
        long_rows(plan, layout.chunk, layout.output_chunk, hbm, eps, offset)
    else:
        two_pass(plan, layout.chunk, hbm, eps, offset)


@nki.jit
def rmsnorm_fwd(x, weight, bias, eps, offset, casting_mode, out_dtype):
    """RMSNorm forward of ``x`` (M, N), return convention: ``(y, rstd)``, y in
    ``out_dtype`` (None: x's dtype), rstd (M,) fp32."""
    M, N = x.shape
    plan = _plan(x, weight, bias, None, offset, casting_mode, out_dtype)
    y = nl.ndarray((M, N), dtype=plan.out_dtype, buffer=nl.shared_hbm)
    rstd = nl.ndarray((M,), dtype=nl.float32, buffer=nl.shared_hbm)
    forward_body(plan, Tensors(x, None, weight, bias, y, None, rstd), eps, offset)
    return y, rstd


@nki.jit
def rmsnorm_fwd_out(x, weight, bias, y, rstd, eps, offset, casting_mode):
    """RMSNorm forward of ``x`` (M, N), output-parameter convention: writes the caller's
    ``y`` (its dtype is the output dtype) and ``rstd`` (M,) float32 in place, returns
    nothing. Same code and results as :func:`rmsnorm_fwd`."""
    check_outputs(y, rstd)
    plan = _plan(x, weight, bias, None, offset, casting_mode, y.dtype)
    forward_body(plan, Tensors(x, None, weight, bias, y, None, rstd), eps, offset)


@nki.jit
def rmsnorm_add_fwd(x, residual, weight, bias, eps, offset, casting_mode, out_dtype):
    """Fused residual add and RMSNorm, return convention: ``h = x + residual`` (in the
    residual's dtype), ``(y, h, rstd)`` of h."""
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
    ``y``, ``h`` (the residual's dtype) and ``rstd`` (M,) float32 in place, returns nothing.
    Same code and results as :func:`rmsnorm_add_fwd`."""
    check_outputs(y, rstd, residual, h)
    plan = _plan(x, weight, bias, residual.dtype, offset, casting_mode, y.dtype)
    forward_body(plan, Tensors(x, residual, weight, bias, y, h, rstd), eps, offset)


def _transposed_output(M, N, dtype):
    """rmsnorm_tkg's output layout (P, M, N / P): ``y_t[p, m, k] = y[m, p·(N / P) + k]``
    (nki-library@d2ad3a5 src/nkilib_src/nkilib/core/subkernels/rmsnorm_tkg.py L58-L86,
    one core's H: the layout its docstring's pseudocode gives at LNC=1)."""
    P = nl.tile_size.pmax
    kernel_assert(N % P == 0, f"a transposed y needs N divisible by {P}, got N = {N}")
    return nl.ndarray((P, M, N // P), dtype=dtype, buffer=nl.shared_hbm)


@nki.jit
def rmsnorm_fwd_transposed(x, weight, bias, eps, offset, casting_mode, out_dtype):
    """:func:`rmsnorm_fwd` with y in rmsnorm_tkg's transposed layout ``(P, M, N / P)``,
    ready as the stationary/moving operand of the next matmul (``_transposed_output``):
    ``(y_t, rstd)``, the same bits as ``rmsnorm_fwd``'s y, rearranged by the output DMA."""
    M, N = x.shape
    plan = _plan(x, weight, bias, None, offset, casting_mode, out_dtype)
    y_t = _transposed_output(M, N, plan.out_dtype)
    rstd = nl.ndarray((M,), dtype=nl.float32, buffer=nl.shared_hbm)
    forward_body(plan, Tensors(x, None, weight, bias, None, None, rstd, y_t), eps, offset)
    return y_t, rstd


@nki.jit
def rmsnorm_add_fwd_transposed(x, residual, weight, bias, eps, offset, casting_mode, out_dtype):
    """:func:`rmsnorm_add_fwd` with y in rmsnorm_tkg's transposed layout (h keeps x's
    (M, N) layout): ``(y_t, h, rstd)``."""
    M, N = x.shape
    plan = _plan(x, weight, bias, residual.dtype, offset, casting_mode, out_dtype)
    y_t = _transposed_output(M, N, plan.out_dtype)
    h = nl.ndarray((M, N), dtype=residual.dtype, buffer=nl.shared_hbm)
    rstd = nl.ndarray((M,), dtype=nl.float32, buffer=nl.shared_hbm)
    forward_body(plan, Tensors(x, residual, weight, bias, None, h, rstd, y_t), eps, offset)
    return y_t, h, rstd


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
