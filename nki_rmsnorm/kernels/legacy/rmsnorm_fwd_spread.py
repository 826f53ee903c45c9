"""Forward regime "spread": decode batches of the legacy kernels (trn1, inf2, and trn2 on SDK
<= 2.29), each row's columns spread over s partitions for its product and its stores, its
statistics taken whole.

One row per partition ("rows") keeps M of the 128 partitions, M / 8 of the 16 DMA engines,
busy and runs every step over a whole row on one lane. The nki06 kernel spreads a decode
batch in "split" with grouped statistics, which every "rows" tile then pays for too (this
kernel's row tiles run one after the other: trn2 bf16 2048 x 4096 110.1 -> 114.6 µs), and
NeuronCore-v2 cannot gather segment sums at all: its matmul transpose is not NaN-safe
("not bit-accurate if the input data contains NaN/Inf",
general/nki/api/nki/isa/__init__.py@8a38e733 L1036-1041; "isa" below). A row whose Σh²
were summed from segments on other lanes would not be bitwise the row of a large batch.
So the batch, R ≤ 32 rows (``SPREAD_MAX_ROWS``), is loaded twice, in two layouts:

* whole rows, one per partition, as "rows" has them: h (with a residual: x + residual,
  one Vector add), Σh² (``activation_reduce``), rstd (the chain "rows" runs on the target:
  GpSimd's rsqrt on v3+, the Newton-refined one on v2) and the rstd store are the "rows" regime's
  instructions on the same values, so every row's rstd is bitwise that of any batch;
* spread as in "split": segment q (columns q·F … q·F + F − 1, N = s·F) of row r on
  partition r·s + q, R·s ≤ 128 partitions, one contiguous DMA over up to 16 DMA engines
  (with a residual: h = x + residual there too, and h stored from there).

rstd reaches the spread layout without arithmetic on another row's value: the Vector
engine transposes the (R, 1) column into a row (``nc_transpose(engine=vector)``, a data
movement, at most 32 × 32: isa L1020-1041), a K = 1 matmul of a ones row against it gives
every partition all R values (1 · rstd: exact, Inf and NaN included, no zero meets them;
fp32 inputs, L874-876), ``nl.where`` keeps on partition r·s + q only column r (a select,
no arithmetic on the others: 0 elsewhere; general/nki/api/nki/language/__init__.py L1775) and
``nisa.tensor_reduce`` (isa L1565) adds those exact zeros to it. The 0/1 selector comes
from ``nisa.iota`` (isa L553) of p − s·r, compared with 0 and s. Every construct predates
SDK 2.21 (the simulator's release gating, ``simulate.core.sdk``, lists none of them).
The product then runs once over the (R·s, F) tile against the weight segments, as the
"rows" plan of the target rounds it: "scalar" (v2) the Scalar engine scales h by rstd
(fp32, or x̂ rounded to x's dtype) and the Vector engine multiplies by the weight (fp32,
one rounding), as "rows" multiplies by the weight the Tensor engine broadcasts into PSUM
(whose −0 comes out +0, so the segments' −0 is made +0); "tensor" (v3+ gemma) one Vector
(w · rstd) · h, rounded as "rows"' h · (rstd ⊗ w) (``rmsnorm_fwd_split`` says why);
"vector" ``rmsnorm_fwd_steps.normalize`` against the weight as loaded; [+ bias].
Elementwise, the same arithmetic on the same values: y and h are bitwise those of "rows".
"""

from __future__ import annotations

from nki_rmsnorm.kernels.legacy import rmsnorm_fwd_steps as steps
from nki_rmsnorm.kernels.legacy.rmsnorm_fwd_split import segments_per_row
from nki_rmsnorm.nki import nisa, nl
from nki_rmsnorm.plan.forward import SPREAD_MAX_ROWS
from nki_rmsnorm.plan.kernel_assert import kernel_assert


def spread_rows(plan, s, hbm, eps, offset):
    """R = M ≤ ``SPREAD_MAX_ROWS`` rows of N = s·F columns, segment q of row r on
    partition r·s + q of the spread tile."""
    R, N = hbm.x.shape
    F = N // s
    parts = R * s
    residual = hbm.residual is not None
    weight = hbm.weight is not None
    kernel_assert(R <= SPREAD_MAX_ROWS, "spread: at most 32 rows (one Vector transpose)")

    # Whole rows: h, Σh², rstd as "rows" computes them; rstd stored.
    i_rows = nl.arange(R)[:, None]
    i_n = nl.arange(N)[None, :]
    h_rows = nl.ndarray((R, N), dtype=plan.h_dtype)
    x_rows = nl.ndarray((R, N), dtype=plan.in_dtype) if residual else h_rows
    steps.load_h(
        h_rows,
        x_rows,
        hbm.x[i_rows, i_n],
        hbm.residual[i_rows, i_n] if residual else None,
        None,
    )
    # Spread: segment q of row r on partition r·s + q.
    segs = nl.arange(parts)[:, None]
    i_f = nl.arange(F)[None, :]

    def spread(t):
        return None if t is None else t.reshape((parts, F))[segs, i_f]

    h_spread = nl.ndarray((parts, F), dtype=plan.h_dtype)
    x_spread = nl.ndarray((parts, F), dtype=plan.in_dtype) if residual else h_spread
    steps.load_h(h_spread, x_spread, spread(hbm.x), spread(hbm.residual), spread(hbm.h))
    # the weight (−0 made +0) and bias segments, partition p segment p mod s
    scale = (
        segments_per_row(
            hbm.weight.reshape((s, F)),
            parts,
            plan.scale_dtype,
            offset,
            positive_zeros=plan.product_engine != "vector",
        )
        if weight
        else None
    )
    shift = (
        segments_per_row(hbm.bias.reshape((s, F)), parts, plan.bias_dtype, positive_zeros=False)
        if hbm.bias is not None
        else None
    )
    # p − s·r lies in [0, s) exactly where r is partition p's row
    offsets = nisa.iota(segs - s * nl.arange(R)[None, :], dtype=nl.int32)
    from_start = nisa.tensor_scalar(offsets, op0=nl.greater_equal, operand0=0, dtype=nl.uint8)
    before_end = nisa.tensor_scalar(offsets, op0=nl.less, operand0=s, dtype=nl.uint8)
    own_row = nisa.tensor_tensor(from_start, before_end, op=nl.multiply, dtype=nl.uint8)

    # the discarded squares overwrite h_rows where its dtype holds them (fp32's 8 exponent
    # bits), else a bf16 scratch tile, as "rows" keeps them (Plan.squares_in)
    squares = (
        h_rows
        if plan.h_dtype == nl.float32 or plan.h_dtype == nl.bfloat16
        else nl.ndarray((R, N), dtype=nl.bfloat16)
    )
    sum_sq = nl.ndarray((R, 1), dtype=nl.float32)
    squares[...] = nisa.activation_reduce(
        op=nl.square, data=h_rows, reduce_op=nl.add, reduce_res=sum_sq, dtype=squares.dtype
    )
    rstd = (
        steps.rstd_on_gpsimd(sum_sq, eps, N)
        if plan.exact_transpose
        else steps.rstd_from_sum(sum_sq, eps, N, on_scalar=plan.product_engine != "scalar")
    )
    nl.store(hbm.rstd.reshape((R, 1))[i_rows, nl.arange(1)[None, :]], value=rstd)

    # rstd to its row's partitions: Vector transpose, ones-row broadcast, select, sum.
    rstd_row = nisa.nc_transpose(rstd, engine=nisa.vector_engine)
    ones = nl.full((1, parts), 1.0, dtype=nl.float32)
    every_row = nisa.nc_matmul(ones, rstd_row)
    own = nl.where(own_row, every_row, 0.0, dtype=nl.float32)
    rstd_col = nisa.tensor_reduce(nl.add, own, axis=[1], dtype=nl.float32)

    # The product over the whole tile.
    y_spread = nl.ndarray((parts, F), dtype=plan.result_dtype)
    product = (
        None if plan.product_dtype is None else nl.ndarray((parts, F), dtype=plan.product_dtype)
    )
    if weight and plan.product_engine == "tensor":
        # DVE (w · rstd) · h, rounded as "rows"' h · (rstd ⊗ w) (rmsnorm_fwd_split says why)
        target = y_spread if shift is None else product
        target[...] = nisa.scalar_tensor_tensor(
            data=scale,
            op0=nl.multiply,
            operand0=rstd_col,
            op1=nl.multiply,
            operand1=h_spread,
            dtype=target.dtype,
        )
        steps.add_shift(y_spread, product, shift)
    elif weight and plan.product_engine == "scalar":
        # ACT h·rstd (fp32, or x̂ rounded); DVE ·w (fp32, one rounding) [+ bias]
        target = y_spread if shift is None else product
        scaled = nisa.activation(
            op=nl.copy,
            data=h_spread,
            scale=rstd_col,
            dtype=plan.in_dtype if plan.rounds_xhat else nl.float32,
        )
        target[...] = nisa.tensor_tensor(scaled, scale, op=nl.multiply, dtype=target.dtype)
        steps.add_shift(y_spread, product, shift)
    else:
        steps.normalize(plan, y_spread, h_spread, rstd_col, x_spread, scale, shift, product)
    steps.store_y(plan, spread(hbm.y), y_spread)
