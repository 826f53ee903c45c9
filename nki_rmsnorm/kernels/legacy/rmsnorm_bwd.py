"""RMSNorm backward kernel: ``dx``, ``dweight`` and ``dbias`` from the saved ``rstd``.

Math (per row of length N; statistics and intermediates in fp32)::

    w' = weight + offset (1 without a weight)     a  = rstd · w'   (outer product per tile)
    p1 = dy · a                                   s  = Σ_j p1 · x
    −k = −rstd² · s / N                           dx = p1 + (−k) · x  (+ dh_out)
    dweight = Σ_rows rstd · (dy · x)              dbias = Σ_rows dy

which is the usual ``dx = rstd · (g − x̂ · mean(g · x̂))`` with ``g = dy · w'`` and
``x̂ = x · rstd``, rearranged so that every per-element step is one product or one sum.
``x`` is ``h`` when the forward pass added a residual; ``dh_out`` is the gradient flowing into
that ``h`` output. In the "llama" and "none" casting modes the forward multiplied the weight
by ``x̂`` rounded to the input dtype, so there ``dweight = Σ_rows dy · round(x̂)``; ``dx`` is
the same in every mode.

Shapes and dtypes: ``dy``, ``x``, ``dh_out``: (M, N) in float32 / bfloat16 / float16;
``weight``: (N,) float32 or x's dtype, or None; ``rstd``: (M,) float32. ``dx`` comes back in
x's dtype (one rounding of an fp32 value), ``dweight`` in the weight's dtype (float32
without a weight) and ``dbias`` in the bias's dtype (``bias_dtype``; the output buffer's
dtype in ``rmsnorm_bwd_out``), each summed in fp32 and rounded once. Rows M ≥ 1; hidden
sizes 1 ≤ N ≤ ``MAX_HIDDEN`` (131,072). A row too long for SBUF is folded over the
partitions when a power of two divides N (see Tiling); otherwise ``rmsnorm_bwd_streamed``
reads dy and x twice. Every N up to 19,967 (bf16) / 15,359 (fp32) on trn1 and inf2,
24,063 / 18,431 on trn2 and 28,159 / 22,015 on trn3 fits unfolded (dy in x's dtype).

Entry points and SDK releases: ``rmsnorm_bwd`` (return convention) and ``rmsnorm_bwd_out``
(output parameters) share ``backward_body``; both run on legacy Neuron SDK 2.21-2.29 (the
SBUF budget comes from ``nki_rmsnorm.nki.usable_sbuf_bytes``: the compiler's
``total_available_sbuf_size`` from 2.26, the documented per-generation figure before).

Engines. Per element the kernel needs four products of two tiles (q = dy · x, p1, the row
dot Σ_j q·w' and the dx sum). The Vector engine (DVE) takes N cycles (N = elements per
partition) for one of them when one operand is in PSUM, or for ``(dy − 0)·x`` of two bf16
tiles (``scalar_tensor_tensor``), and 2N otherwise; the Scalar engine (ACT) takes N for a
one-input pass and adds a row sum for free; the Tensor engine (PE) takes 1 cycle per bf16
element of its moving operand (4 for fp32, 2 for an fp32 transpose on NeuronCore-v3+; at
least 64 per matmul) at twice the Vector clock on trn2/trn3 (2.4 against 0.96 / 1.2 GHz).
GpSimd (Pool) stays out: its ``tensor_tensor`` runs only ``power`` and integer arithmetic
(general/nki/api/nki/isa/__init__.py@8a38e733, lines 1766-1767; 0.6: nki/api/nki/isa/
__init__.py@81ce03ae L1025-1036) and its ``tensor_scalar`` only rsqrt (line 1699). Per column
group of a row tile, in 512-column chunks (one fp32 PSUM bank each):

====  ===================================================================================
PE    ``a = rstd ⊗ w'`` into PSUM: the bf16 parts of the tile's rstd (stationary) against
      w' split likewise (moving, ``kw`` rows per fold segment; ``kw = 1`` for a bf16
      weight without offset), stacked along the contraction into one matmul where the
      3·kw·fold rows fit 128 (else one matmul per part of rstd); the bf16 products are
      exact and the sum is fp32, so ``a`` is fp32-accurate
DVE   ``q = dy · x``: two bf16 tiles from SBUF as ``(dy − 0) · x`` (N cycles by the
      documented rule, general/nki/api/nki/isa/__init__.py@8a38e733, lines 1218-1226; on
      every target); other 2-byte or fp32 inputs against x copied into PSUM by ACT on
      NeuronCore-v3+, from SBUF (2N) on NeuronCore-v2, whose DVE and ACT share one PSUM
      port; in llama / none ``q = dy · round(x̂)`` from SBUF, with ``round(x̂) = x · rstd``
      rounded by ACT
DVE   ``p1 = dy · a``, kept in SBUF for the gradient pass
row   ``row_dot_on_pe`` (NeuronCore-v3+, an unfolded 2-byte dy and x, gemma): PE
dot   transposes each 128-column block of q (fp32, ``is_transpose``: bit-accurate, NaN
      and Inf included, from NeuronCore-v3), ACT copies it to SBUF, PE multiplies it
      with w' (a matrix-vector product: the sum over the columns of one row, fp32);
      trn3 keeps one 128-column block in ``VECTOR_ROW_DOT_EVERY`` (6) on DVE as below, which
      balances PE against DVE there. Otherwise (trn1, inf2, folded rows, llama / none,
      fp32): DVE ``p1 · x = q · a`` (in llama / none ``p1`` times the PSUM copy of x),
      ACT row sums of it (``activation_reduce``)
ACT   at the end of the tile ``−k = −rstd³/N · Σ q·w'`` (or ``−rstd²/N · Σ p1·x``)
PE    ``dweight += qᵀ · rstd`` per 128 columns (the tile's rstd column as the moving
      operand gives the row scaling and the sum over rows for free) into an fp32 PSUM
      accumulator kept for the whole kernel; ``dbias += dyᵀ · 1`` likewise; a gradient
      the caller does not get back is not computed
ACT   ``−k · x`` into PSUM (gradient pass)
DVE   ``dx = p1 + (−k · x)`` rounded to x's dtype (DVE adds dh_out from SBUF); DMA stores
====  ===================================================================================

So per element and row the Vector engine runs three N-cycle passes on trn2 (q, p1, dx),
3 + ⌊B/6⌋/B on trn3 (B the 128-column blocks of a row) and four on trn1 / inf2 (q, p1,
p1·x, dx); PE runs 7 (trn2: 1 for ``a``, 2 each for dweight, the transpose and the
matrix-vector product; 7.5 with dbias) and ACT 2.
By the cost model's floors (8192×4096 bf16, µs, Vector / Scalar / Tensor / DMA / HBM):
trn2 822 / 440 / 765 / 561 / 655, trn3 692 / 464 / 696 / 396 / 388, trn1 (four Vector
passes) 939 / 386 / 281 / 737 / 579: the Vector engine still binds on trn2 and trn1,
the Tensor and Vector engines together on trn3.

What else was weighed, by the cost model's documented rules:

* A Tensor-engine copy of x (or dy) into PSUM, an identity matmul, would make every Vector
  product an N-cycle one at PE cost only, but a matmul multiplies every element by the
  zeros of the identity, and 0 · NaN (or 0 · Inf) would spread a NaN of one row to every
  row; ``is_transpose`` moves data exactly only as a transpose. No tile of data passes
  through a non-transposing matmul; q passes through the row dot's matrix-vector product,
  which sums over the columns of one row only.
* The row dot from transposed dy and x·w' in bf16 (PE transposes of 2-byte data, one
  cycle per element): x·w' rounded to bf16 puts up to 2⁻⁹ of each term into the row dot,
  about 2 bf16 ulps of dx at N = 1024 against the 1-ulp test bound; the fp32 q keeps it
  exact.
* dy·w' on PE (diagonal blocks of w' against transposed dy) and ``p1 = rstd·(dy·w')`` on
  ACT would take p1 off DVE, but PE then needs 8 cycles per element and row (more than
  DVE's 3 on trn2, at 2.5× the clock) and ACT 3.
* GpSimd's ``tensor_tensor`` does no float arithmetic (above); the 16-bit fast modes speed
  up only one-input Vector instructions, and a bf16 q or p1 would drop the fp32 accuracy of
  dx and dweight; the Scalar engine's ``scale``/``bias`` are one value per partition.

Tiling. Rows go on the partitions, 128 per row tile (a ragged last tile uses fewer), and the
row is worked through in column groups of ``G`` (2048, 1024 or 512) columns. A row whose
working set does not fit SBUF is folded: ``x`` is viewed as (M·f, N/f), a reshape, so each
row spreads over ``f`` consecutive partitions and one DMA still covers 128 partitions; the
row statistic then adds the f partial sums after a change of layout through a small HBM
scratch (four small DMAs per row tile, whole-tensor reshapes only; no arithmetic across
rows), and the parameter gradients keep one accumulator column per fold
segment. ``f`` (the smallest power of two ≤ 32 dividing N that fits), ``G`` and the ring
length depend on N, the dtypes and the target only, never on M. bf16 (gemma, bf16 weight)
folds at N ≥ 20,224 on trn1 / inf2, 24,320 on trn2 and 28,416 on trn3 (f = 2; f = 4 from
twice that, and so on).

The two passes of a row tile are software-pipelined: the loop body runs the statistic pass
of row tile t and the gradient pass of row tile t − 1 group by group (the instruction
streams interleave them, so every engine always has independent work). ``p1`` and ``x`` live
in a ring of group slots, up to two row tiles plus ``MAX_SLACK`` groups, so that loads run
ahead of the gradient pass that frees their slots, and dy in ``DY_SLOTS`` group slots, so
that its loads run no further ahead than the statistic pass needs (a DMA engine serves
transfers in issue order: an unbounded run of dy loads would hold back the small loads of
each row tile's rstd operands): each element of dy, x and dh_out is read
from HBM once and dx written once; the last row tile's column sums are stored group by group
as soon as they are final, during the last gradient pass. rstd's per-tile operands (the bf16
rows of ``a``'s stationary, the fp32 columns rstd and −rstd²/N) come from a small HBM table
built once at the start with the row tiles on the partitions (no transposes), two small
loads per row tile.

Determinism and batch invariance: every reduction has a fixed order that depends only on N
(group partials summed in group order, then the fold segments; PSUM accumulation in row-tile
order), so two runs give bitwise identical results, and a row's ``dx`` never depends on the
other rows or on M. A NaN in a row makes that row's ``dx`` NaN and, through the column sums,
``dweight``; the other rows' ``dx`` are untouched.

Per-head weight ``(heads, N)`` (QK-norm with a weight per head, ``FoldedPlan.heads``): row r
is of head r mod heads and ``dweight`` is ``(heads, N)``. Unfolded rows only, heads·⌊128 /
heads⌋ rows per tile, so partition p holds head p mod heads in every tile. ``a = rstd · w'``
is the Scalar engine's: the row's w' (a per-head fp32 tile built once) scaled by its rstd,
into PSUM, no matmul (0 · Inf of one head's non-finite weight would reach the other heads'
rows); the row dot is the Vector engine's. dweight is the same column-sum matmul with a
(rows, heads) operand, stationary this time (the row's rstd in its head's column, from the
per-tile table; the 0/1 head mask in llama / none) against the data moving, so that the
accumulator holds dweight itself, heads on the partitions (N ≤ 1024: two PSUM banks), stored
one row per partition; a non-finite dy or x element there also meets the zeros of the other
heads' columns, so its column of dweight is NaN for every head. No dbias beside a per-head
weight (the launchers take it from a second launch without the weight).
"""

from __future__ import annotations

from nki_rmsnorm.kernels.legacy.rmsnorm_bwd_streamed import streamed_backward
from nki_rmsnorm.nki import nisa, nki, nl, usable_sbuf_bytes
from nki_rmsnorm.plan.backward import (
    CHUNK,
    DY_SLOTS,
    MAX_HIDDEN,
    PSUM_BANK_COLS,
    ROW_DOT_BLOCK,
    SPLIT,
    BwdConstants,
    BwdDtypes,
    BwdTile,
    BwdTileSlots,
    PeConstants,
    column_segments,
    has_vector_row_dot,
    make_plan,
    operand_slots,
    partial_columns,
    tensor_row_dot_end,
    tile_rows,
    vector_row_dot_block,
)
from nki_rmsnorm.plan.kernel_assert import kernel_assert


@nki.jit
def rmsnorm_bwd(dy, x, weight, rstd, dh_out, offset, has_bias, casting_mode, bias_dtype=None):
    """RMSNorm backward, return convention. Returns ``(dx,) + ((dweight,) if weight is not
    None) + ((dbias,) if has_bias)``: dx in x's dtype, dweight in the weight's dtype, dbias
    in ``bias_dtype`` (None: the weight's dtype, float32 without a weight). All three are
    created and computed unconditionally (``shared_hbm`` tensors may be created only at
    the kernel's top level, not under ``if``: general/nki/api/nki.errors.rst@8a38e733,
    lines 583-617); the column sums nobody asked for cost a few Tensor-engine matmuls.
    See the module docstring for the math, the tiling and the engines."""
    M, N = x.shape
    param_dtype = nl.float32 if weight is None else weight.dtype
    dx = nl.ndarray((M, N), dtype=x.dtype, buffer=nl.shared_hbm)
    # (N,), or (heads, N) for a per-head weight
    dweight = nl.ndarray(
        (N,) if weight is None else weight.shape, dtype=param_dtype, buffer=nl.shared_hbm
    )
    dbias = nl.ndarray(
        (N,), dtype=param_dtype if bias_dtype is None else bias_dtype, buffer=nl.shared_hbm
    )
    # the gradients nobody asked for are not computed (None): not returned, never read
    wanted_dweight = dweight if weight is not None else None
    wanted_dbias = dbias if has_bias else None
    backward_body(
        dy, x, weight, rstd, dh_out, dx, wanted_dweight, wanted_dbias, offset, casting_mode
    )
    return (dx,) + ((dweight,) if weight is not None else ()) + ((dbias,) if has_bias else ())


@nki.jit
def rmsnorm_bwd_out(dy, x, weight, rstd, dh_out, dx, dweight, dbias, offset, casting_mode):
    """RMSNorm backward, output-parameter convention: writes the caller's ``dx`` (M, N),
    ``dweight`` (N,) and ``dbias`` (N,) in place (``dweight`` / ``dbias`` may be None: not
    computed) and returns nothing. Each gradient is computed in fp32 and rounded once to its
    buffer's dtype. Same code and results as :func:`rmsnorm_bwd`; the outputs must not alias
    the inputs."""
    check_gradients(x, weight, dx, dweight, dbias)
    backward_body(dy, x, weight, rstd, dh_out, dx, dweight, dbias, offset, casting_mode)


def check_gradients(x, weight, dx, dweight, dbias):
    """The output parameters' dtypes, before anything runs: dx in x's dtype, dweight fp32 or
    the weight's, dbias fp32 or x's (any kernel dtype beside an fp32 x, an fp32 residual
    stream); the package's launchers raise ``TypeError`` for the same first
    (``validation.check_backward_outputs``)."""
    kernel_assert(dx.dtype == x.dtype, f"dx must have x's dtype ({x.dtype}), got {dx.dtype}")
    if dweight is not None:
        own = weight is not None and dweight.dtype == weight.dtype
        kernel_assert(
            dweight.dtype == nl.float32 or own,
            f"dweight must be float32 or the weight's dtype, got {dweight.dtype}",
        )
    if dbias is not None:
        narrow = dbias.dtype == nl.bfloat16 or dbias.dtype == nl.float16
        wide_x = x.dtype == nl.float32
        kernel_assert(
            dbias.dtype == nl.float32 or dbias.dtype == x.dtype or (wide_x and narrow),
            f"dbias must be float32 or x's dtype ({x.dtype}), got {dbias.dtype}",
        )


def backward_body(dy, x, weight, rstd, dh_out, dx, dweight, dbias, offset, casting_mode):
    """Write dx (and dweight / dbias when not None): the code both entry points share. A 2-D
    weight ``(heads, N)`` is per head: row r is normalised with ``weight[r mod heads]`` and
    dweight is ``(heads, N)``, each head's column sums over its own rows."""
    M, N = x.shape
    # the bindings raise ValueError before any launch; the kernel only asserts
    assert N <= MAX_HIDDEN, f"rmsnorm_bwd: hidden size {N} exceeds the supported {MAX_HIDDEN}"
    heads = check_heads(M, N, weight, dbias)
    dtypes = BwdDtypes(
        x=x.dtype,
        dy=dy.dtype,
        weight=None if weight is None else weight.dtype,
        dh_out=None if dh_out is None else dh_out.dtype,
    )
    plan = make_plan(
        N,
        dtypes,
        offset,
        casting_mode,
        usable_sbuf_bytes(),
        nisa.get_nc_version() >= nisa.nc_version.gen3,
        nisa.get_nc_version() >= nisa.nc_version.gen4,
        heads,
    )
    kernel_assert(
        heads == 0 or plan is not None,
        f"rmsnorm_bwd: a per-head weight needs unfolded rows; N = {N} does not fit SBUF",
    )
    if plan is None:
        streamed_backward(dy, x, weight, rstd, dh_out, offset, casting_mode, dx, dweight, dbias)
    else:
        _folded_backward(plan, dy, x, weight, rstd, dh_out, dx, dweight, dbias, offset)


def check_heads(M, N, weight, dbias):
    """The heads of a per-head weight (0 for a 1-D weight or none), checked: ``(heads, N)``
    with heads ≤ 128 dividing the rows, and no dbias (the launchers compute it apart)."""
    if weight is None or len(weight.shape) == 1:
        return 0
    heads = weight.shape[0]
    kernel_assert(
        len(weight.shape) == 2 and weight.shape[1] == N and heads <= nl.tile_size.pmax,
        f"rmsnorm_bwd: a 2-D weight must be (heads <= 128, N = {N}), got {weight.shape}",
    )
    kernel_assert(M % heads == 0, f"rmsnorm_bwd: {M} rows are not whole sets of {heads} heads")
    kernel_assert(dbias is None, "rmsnorm_bwd: no dbias beside a per-head weight")
    return heads


def _folded_backward(plan, dy, x, weight, rstd, dh_out, dx, dweight, dbias, offset):
    """The main regime: rows (folded over ``plan.fold`` partitions) kept on chip between
    the two passes of a row tile."""
    M, N = x.shape
    consts = _constants(
        plan, M, N, dy, weight, rstd, offset, dweight is not None, dbias is not None
    )
    f, L = plan.fold, plan.width
    views = (
        dy.reshape((M * f, L)),
        x.reshape((M * f, L)),
        dx.reshape((M * f, L)),
        None if dh_out is None else dh_out.reshape((M * f, L)),
    )
    P = nl.tile_size.pmax
    # Every buffer that outlives one loop iteration is created here, before the loops, with
    # its slots in a free dimension after the partitions (the ring of group slots; the
    # ``operand_slots`` of per-tile operands; block dimensions are deprecated from SDK 2.23:
    # general/nki/nki_block_dimension_migration_guide.rst@8a38e733, "move the block
    # dimension into free dimension"), and written with ``[...] =`` inside them: a tile
    # created in a loop body may not be used after it (general/nki/api/nki.errors.rst
    # @8a38e733, lines 419-475).
    rings = (
        nl.ndarray((P, plan.ring, plan.group), dtype=nl.float32),
        nl.ndarray((P, plan.ring, plan.group), dtype=x.dtype),
        nl.ndarray((P, DY_SLOTS, plan.group), dtype=dy.dtype),
    )
    n_slots = operand_slots(plan)
    slots = BwdTileSlots(
        rows=nl.ndarray((plan.stationary_rows, n_slots, plan.rstd_parts, P), dtype=nl.bfloat16),
        cols=nl.ndarray((P, n_slots, consts.table_cols.shape[2]), dtype=nl.float32),
        partials=nl.ndarray((P, n_slots, partial_columns(plan)), dtype=nl.float32),
        negk=nl.ndarray((P, n_slots, 1), dtype=nl.float32),
    )

    # Software pipeline: statistic pass of tile t next to the gradient pass of tile t − 1.
    TP = tile_rows(plan) * f  # partitions of a full row tile
    n_tiles = -(-M * f // TP)
    for t in nl.static_range(n_tiles + 1):
        tile = _tile_view(slots, t, TP, min(TP, M * f - t * TP)) if t < n_tiles else None
        previous = _tile_view(slots, t - 1, TP, min(TP, M * f - (t - 1) * TP)) if t > 0 else None
        if tile is not None:
            _load_tile_operands(consts, tile, t)
        # Σ_j (dy·x)·w' of the tile's rows (``row_dot_on_pe``), made outside the ``if`` that
        # uses it (errors L417-474)
        row_dot = (
            nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.psum) if plan.row_dot_on_pe else None
        )
        for g in nl.static_range(plan.n_groups):
            # the tiles the statistic pass returns are used in the block that made them
            if tile is None:
                _gradient_group(plan, views, rings, previous, t - 1, g)
            else:
                dy_g, dydx = _statistic_group(plan, consts, views, rings, tile, t, g, row_dot)
                if previous is not None:
                    _gradient_group(plan, views, rings, previous, t - 1, g)
                _column_sums_group(
                    plan,
                    consts,
                    tile,
                    g,
                    dy_g,
                    dydx,
                    (dweight, dbias) if t == n_tiles - 1 else (None, None),
                )
        if tile is not None and row_dot is not None:
            _finish_row_dot(plan, tile, row_dot)
        elif tile is not None:
            _finish_statistic(plan, consts, tile)


# --- setup ---------------------------------------------------------------------------------
def _constants(plan, M, N, dy, weight, rstd, offset, want_dweight, want_dbias):
    """The kernel's constants and accumulators (see ``BwdConstants``)."""
    f = plan.fold
    segments = column_segments(plan)
    # llama / none: dweight sums dy·round(x̂) unscaled; gemma: the moving operand is the
    # tile's rstd column (masked per fold segment or head), from the table. Conditional
    # expressions, not ``if`` blocks: a tile made in a block may not be used after it
    # (errors L417-474).
    dweight_moving = _fold_mask(segments, nl.float32) if want_dweight and plan.round_xhat else None
    dbias_moving = _fold_mask(f, dy.dtype) if want_dbias else None
    n_cols = 2 + (segments if (want_dweight and not plan.round_xhat and segments > 1) else 0)
    n_cols = 3 if plan.row_dot_on_pe else n_cols  # −rstd³/N last (fold 1)
    table_rows, table_cols = _rstd_tables(plan, M, N, rstd, n_cols)
    return BwdConstants(
        w_rows=None if plan.heads > 0 else _weight_rows(plan, N, weight, offset),
        w_lazy=weight if plan.kw == 1 and plan.heads == 0 else None,
        dweight_moving=dweight_moving,
        dbias_moving=dbias_moving,
        dweight_acc=_column_sum_accumulators(plan) if want_dweight else None,
        dbias_acc=_column_sum_accumulators(plan) if want_dbias else None,
        table_rows=table_rows,
        table_cols=table_cols,
        fold_scratch=_fold_scratch(f),
        pe=_pe_constants(N, weight, offset) if plan.row_dot_on_pe else None,
        head_rows=(_head_rows(plan, weight, offset) if plan.heads > 0 else None),
    )


def _head_rows(plan, weight, offset):
    """w' = weight[p mod heads] + offset in fp32 on partition p (``tile_rows`` partitions):
    the weight loaded once (partitions 0 … heads − 1), the rows filled so far copied after
    themselves by on-chip DMA until ``tile_rows`` partitions hold it (⌈log2(128/heads)⌉
    copies: the transfers of one queue run in order, so few large ones beat a load per
    set of heads; the partition index p mod heads is no affine index for one load), then
    shifted and widened once (Vector)."""
    P = nl.tile_size.pmax
    heads, N = weight.shape[0], weight.shape[1]
    R = heads * (P // heads)
    loaded = nl.ndarray((P, N), dtype=weight.dtype)
    loaded[0:heads, :] = nl.load(weight)
    filled = heads
    # at most log2(128) doublings; a ``for`` loop: a ``while`` loop must enter unconditionally
    # (general/nki/api/nki.errors.rst@8a38e733, L902-L947)
    for _ in nl.static_range(7):
        if filled < R:
            count = min(filled, R - filled)
            nisa.dma_copy(dst=loaded[filled : filled + count, :], src=loaded[0:count, :])
            filled += count
    rows = nl.ndarray((P, N), dtype=nl.float32)
    rows[0:R, :] = nisa.tensor_scalar(loaded[0:R, :], nl.add, float(offset), dtype=nl.float32)
    return rows


def _fold_scratch(f):
    """With a fold, a private HBM vector of P fp32 through which the segment sums of each
    row tile change layout (``_add_fold_segments``); None without one."""
    P = nl.tile_size.pmax
    return None if f == 1 else nl.ndarray((P,), dtype=nl.float32, buffer=nl.private_hbm)


def _fold_mask(f, dtype):
    """The (P, f) 0/1 mask ``[p mod f == h]`` in ``dtype``, built on chip: an identity
    (GpSimd ``iota`` of column − partition, Vector compare with 0.0), then for each h the
    Vector sum of its columns h, h + f, … (an affine ``nl.arange`` stride on the free
    dimension: general/nki/programming_model.rst@8a38e733, lines 531-577). Exact: every sum
    has a single 1."""
    P = nl.tile_size.pmax
    i_p = nl.arange(P)[:, None]
    identity = nisa.tensor_scalar(
        nisa.iota(nl.arange(P)[None, :] - i_p, dtype=nl.int32),
        op0=nl.equal,
        operand0=0.0,
        dtype=nl.float32,
    )
    i_r = nl.arange(P // f)[None, :]
    mask = nl.ndarray((P, f), dtype=dtype)
    for h in nl.static_range(f):
        mask[:, h : h + 1] = nisa.tensor_reduce(
            nl.add, identity[i_p, h + f * i_r], axis=[1], dtype=dtype, keepdims=True
        )
    return mask


def _bf16_parts(values):
    """Three bf16 tiles whose fp32 sum is ``values`` (fp32) to its last bit (Vector)."""
    high = nisa.tensor_copy(values, dtype=nl.bfloat16)
    rest = nisa.tensor_tensor(values, high, op=nl.subtract, dtype=nl.float32)
    middle = nisa.tensor_copy(rest, dtype=nl.bfloat16)
    rest_low = nisa.tensor_tensor(rest, middle, op=nl.subtract, dtype=nl.float32)
    return [high, middle, nisa.tensor_copy(rest_low, dtype=nl.bfloat16)]


def _weight_rows(plan, N, weight, offset):
    """The moving operand of ``a = rstd · w'``: row (b, h) holds bf16 part b of w' over
    fold segment h (columns h·L … h·L + L − 1), once per stacked part a of rstd (row
    (a·kw + b)·f + h when ``plan.rstd_parts == 1``). A bf16 weight is its own single part
    and is loaded group by group as the first row tile needs it (``_load_weight_group``);
    otherwise w' is computed and split here."""
    f, L = plan.fold, plan.width
    K = plan.stationary_rows
    rows = nl.ndarray((K, L), dtype=nl.bfloat16)
    if weight is None:
        rows[...] = nisa.memset((K, L), 1.0, dtype=nl.bfloat16)
    elif plan.kw > 1:
        # w' = weight + offset in fp32, split, on as many partitions as divide N
        lanes = 1
        for d in range(1, nl.tile_size.pmax + 1):
            lanes = d if N % d == 0 else lanes
        w = nl.load(weight.reshape((lanes, N // lanes)), dtype=nl.float32)
        w_parts = _bf16_parts(nisa.tensor_scalar(w, nl.add, float(offset), dtype=nl.float32))
        for a in nl.static_range(K // (plan.kw * f)):
            for b in nl.static_range(SPLIT):
                r0 = (a * plan.kw + b) * f
                nisa.dma_copy(dst=rows[r0 : r0 + f, :], src=w_parts[b])
    return rows


def _load_weight_group(plan, rows, weight, g0, width):
    """Columns g0 … g0+width of the bf16 weight rows (one row per fold segment, once per
    stacked part of rstd)."""
    f, L = plan.fold, plan.width
    rows[0:f, g0 : g0 + width] = nl.load(weight.reshape((f, L))[:, g0 : g0 + width])
    for r0 in nl.static_range(f, plan.stationary_rows, f):  # on-chip copies, one HBM read
        nisa.dma_copy(dst=rows[r0 : r0 + f, g0 : g0 + width], src=rows[0:f, g0 : g0 + width])


def _rstd_tables(plan, M, N, rstd, n_cols):
    """HBM tables, one entry per row tile: the stationary rows of ``a = rstd · w'`` (row
    (b, h) of part a: bf16 part a of rstd at the partitions of fold segment h, zero
    elsewhere, repeated for each part b of w') and the fp32 columns (rstd and −rstd²/N per
    partition; with a gemma fold also rstd masked per segment, the moving operand of
    dweight). Built from rstd laid out with the row tiles on the partitions, so every step
    stays within one row."""
    P = nl.tile_size.pmax
    f, K = plan.fold, plan.stationary_rows
    R = tile_rows(plan)
    n_tiles = -(-M // R)
    # a per-head weight takes no stationary rows (``a`` comes from ``head_rows``)
    table_rows = (
        None
        if plan.heads > 0
        else nl.ndarray((n_tiles, K, plan.rstd_parts, P), dtype=nl.bfloat16, buffer=nl.private_hbm)
    )
    table_cols = nl.ndarray((n_tiles, P, n_cols), dtype=nl.float32, buffer=nl.private_hbm)
    # rstd padded with zeros to whole row tiles: (tiles, R) by reshaping whole HBM tensors
    # only (general/nki/tutorials/..., the tutorial reshapes the tensor, never a slice)
    padded = nl.ndarray((n_tiles, R), dtype=nl.float32, buffer=nl.private_hbm)
    flat = padded.reshape((1, n_tiles * R))
    nl.store(flat[0:1, 0:M], value=nl.load(rstd.reshape((1, M))))
    if n_tiles * R > M:
        nl.store(flat[0:1, M : n_tiles * R], value=nl.zeros((1, n_tiles * R - M), dtype=nl.float32))
    i_r = nl.arange(R)[None, :]
    for block in nl.static_range(-(-n_tiles // P)):
        t0 = block * P
        nt = min(P, n_tiles - t0)
        i_t = nl.arange(nt)[:, None]
        r_t = nl.load(padded[t0 : t0 + nt, :])
        if table_rows is not None:
            _store_stationary_rows(plan, table_rows, r_t, t0, nt)
        neg_scale = nisa.scalar_tensor_tensor(
            data=r_t,
            op0=nl.multiply,
            operand0=-1.0 / N,
            op1=nl.multiply,
            operand1=r_t,
            dtype=nl.float32,
        )
        cols = nl.zeros((nt, P, n_cols), dtype=nl.float32)
        if plan.heads > 0:  # one partition per row; rstd in the column of the row's head
            cols[i_t, i_r, 0] = nisa.tensor_copy(r_t)
            cols[i_t, i_r, 1] = nisa.tensor_copy(neg_scale)
            i_h = nl.arange(R // plan.heads)[None, :]
            for h in nl.static_range(n_cols - 2):
                cols[i_t, h + plan.heads * i_h, 2 + h] = nisa.tensor_copy(
                    r_t[i_t, h + plan.heads * i_h]
                )
        for h in nl.static_range(0 if plan.heads > 0 else f):
            cols[i_t, h + f * i_r, 0] = nisa.tensor_copy(r_t)
            cols[i_t, h + f * i_r, 1] = nisa.tensor_copy(neg_scale)
            if plan.row_dot_on_pe:
                neg_cube = nisa.tensor_tensor(neg_scale, r_t, op=nl.multiply, dtype=nl.float32)
                cols[i_t, i_r, 2] = nisa.tensor_copy(neg_cube)
            elif n_cols > 2:
                cols[i_t, h + f * i_r, 2 + h] = nisa.tensor_copy(r_t)
        nl.store(table_cols[t0 : t0 + nt], value=cols)
    return table_rows, table_cols


def _store_stationary_rows(plan, table_rows, r_t, t0, nt):
    """Row tiles t0 … t0 + nt − 1 of the stationary-rows table from their rstd ``r_t``:
    partition p of segment h is h + f·r, an affine stride on the free dimension
    (general/nki/programming_model.rst@8a38e733, lines 531-577)."""
    P = nl.tile_size.pmax
    f, K = plan.fold, plan.stationary_rows
    i_t = nl.arange(nt)[:, None]
    i_r = nl.arange(P // f)[None, :]
    rows = nl.zeros((nt, K, plan.rstd_parts, P), dtype=nl.bfloat16)
    parts = _bf16_parts(r_t)
    stacked = plan.rstd_parts == 1
    for a in nl.static_range(SPLIT):
        for b in nl.static_range(plan.kw):
            for h in nl.static_range(f):
                row = ((a * plan.kw if stacked else 0) + b) * f + h
                rows[i_t, row, 0 if stacked else a, h + f * i_r] = nisa.tensor_copy(parts[a])
    nl.store(table_rows[t0 : t0 + nt], value=rows)


def _pe_constants(N, weight, offset):
    """The constants of ``row_dot_on_pe`` (``PeConstants``): the fp32 identity the
    transposes move against (built as in ``_fold_mask``) and w' + offset (fp32) with block
    b's 128 values down the partitions of column b (an affine index on the partition
    dimension of one load; the last partial block apart)."""
    P = nl.tile_size.pmax
    n_blocks = -(-N // P)
    i_p = nl.arange(P)[:, None]
    identity = nisa.tensor_scalar(
        nisa.iota(nl.arange(P)[None, :] - i_p, dtype=nl.int32),
        op0=nl.equal,
        operand0=0.0,
        dtype=nl.float32,
    )
    w_cols = nl.ndarray((P, n_blocks), dtype=nl.float32)
    full, rest = N // P, N % P
    if weight is None:
        w_cols[...] = nisa.memset((P, n_blocks), 1.0, dtype=nl.float32)
    else:
        w_row = weight.reshape((1, N))
        if rest:
            w_cols[...] = nisa.memset((P, n_blocks), 0.0, dtype=nl.float32)
            i_rest = nl.arange(rest)[:, None]
            w_cols[i_rest, full] = nl.load(w_row[0, full * P + i_rest], dtype=nl.float32)
        if full:
            i_b = nl.arange(full)[None, :]
            w_cols[i_p, i_b] = nl.load(w_row[0, i_p + P * i_b], dtype=nl.float32)
    # a conditional expression, not an ``if`` block (errors L417-474)
    shifted = (
        nisa.tensor_scalar(w_cols, nl.add, float(offset), dtype=nl.float32)
        if weight is not None and offset != 0.0
        else w_cols
    )
    return PeConstants(identity=identity, w_cols=shifted)


def _column_sum_accumulators(plan):
    """A zeroed fp32 PSUM tile for column sums, ``(banks, P, 512)``: ``n_groups · G/128 ·
    fold`` columns, one 2 KiB bank per block; see ``_accumulate_column_sums`` for the
    layout. PSUM keeps its block dimension: AWS's migration guide has no PSUM form yet
    ("the backend support for removing blocks in PSUM tensor is still in progress",
    general/nki/nki_block_dimension_migration_guide.rst@8a38e733, lines 176-180)."""
    P = nl.tile_size.pmax
    # a per-head weight's sums: heads on the partitions, a column per column of the row
    n = plan.width if plan.heads > 0 else plan.n_groups * (-(-plan.group // P)) * plan.fold
    return nl.zeros(
        (-(-n // PSUM_BANK_COLS), nl.par_dim(P), PSUM_BANK_COLS), dtype=nl.float32, buffer=nl.psum
    )


# --- the pipeline steps ---------------------------------------------------------------------
def _tile_view(slots, t, tile_partitions, p):
    """Row tile ``t`` of ``p`` partitions (``tile_partitions`` in a full one), its operands in
    slot t mod ``operand_slots``."""
    slot = t % slots.negk.shape[1]
    return BwdTile(
        v0=t * tile_partitions,
        p=p,
        rows=slots.rows[:, slot, :, 0:p],
        cols=slots.cols[0:p, slot, :],
        partials=slots.partials[0:p, slot, :],
        negk=slots.negk[0:p, slot, :],
    )


def _load_tile_operands(consts, tile, t):
    """Load row tile t's stationary rows and rstd columns from the HBM tables."""
    if consts.table_rows is not None:
        tile.rows[...] = nl.load(consts.table_rows[t, :, :, 0 : tile.p])
    tile.cols[...] = nl.load(consts.table_cols[t, 0 : tile.p, :])


def _slot(plan, t, g):
    return (t * plan.n_groups + g) % plan.ring


def _group_slot(plan, rings, tile, t, g):
    """Column group g of row tile t: its rows, first column, width, and the p1 and x ring
    slots the statistic pass fills and the gradient pass reads."""
    p, g0 = tile.p, g * plan.group
    width = min(plan.group, plan.width - g0)
    slot = _slot(plan, t, g)
    return p, g0, width, rings[0][0:p, slot, 0:width], rings[1][0:p, slot, 0:width]


def _statistic_group(plan, consts, views, rings, tile, t, g, row_dot):
    """Statistic pass over column group g of row tile t: p1 into the ring, the row-sum
    partial of p1·x (or with ``row_dot_on_pe`` the row dot into ``row_dot``:
    ``_row_dot_chunk``), and the products whose column sums give dweight (returned, with
    dy, for ``_column_sums_group``)."""
    dy_v, x_v = views[0], views[1]
    p, g0, width, p1, xs = _group_slot(plan, rings, tile, t, g)
    dy_g = rings[2][0:p, (t * plan.n_groups + g) % DY_SLOTS, 0:width]
    dy_g[...] = nl.load(dy_v[nl.ds(tile.v0, p), nl.ds(g0, width)])
    xs[...] = nl.load(x_v[nl.ds(tile.v0, p), nl.ds(g0, width)])
    if t == 0 and consts.w_lazy is not None:
        _load_weight_group(plan, consts.w_rows, consts.w_lazy, g0, width)
    # dy·x for dweight and for p1·x = (dy·x)·a (``_dy_times_x``); llama / none: dy·round(x̂)
    # from SBUF, round(x̂) = x·rstd rounded by the Scalar engine, and p1·x against x copied
    # into PSUM. (GpSimd would share the load, but its tensor_tensor runs only power and
    # integer arithmetic: general/nki/api/nki/isa/__init__.py@8a38e733, lines 1766-1767.)
    dydx = nl.ndarray((p, width), dtype=nl.float32)
    rounded = (
        nisa.activation(op=nl.copy, data=xs, scale=tile.cols[:, 0:1], dtype=xs.dtype)
        if plan.round_xhat
        else None
    )
    p1x = nl.ndarray((p, width), dtype=nl.float32)
    for c in nl.static_range(-(-width // CHUNK)):
        lo, hi = c * CHUNK, min(width, (c + 1) * CHUNK)
        a = (
            _head_product(tile, consts.head_rows[0:p, g0 + lo : g0 + hi])
            if plan.heads > 0
            else _outer_product(tile.rows, consts.w_rows[:, g0 + lo : g0 + hi])
        )
        if not plan.round_xhat:
            # dy·x before p1, so that p1·x = (dy·x)·a does not read the output of the
            # Vector instruction just before it ("a static instruction overhead of 100
            # engine cycles": general/nki/arch/trainium_inferentia2_arch.rst@8a38e733,
            # lines 400-401)
            dydx[:, lo:hi] = _dy_times_x(plan, dy_g[:, lo:hi], xs[:, lo:hi])
        p1[:, lo:hi] = nisa.tensor_tensor(dy_g[:, lo:hi], a, op=nl.multiply, dtype=nl.float32)
        if plan.round_xhat:  # dweight sums dy·round(x̂); p1·x is p1 times x itself
            dydx[:, lo:hi] = nisa.tensor_tensor(
                dy_g[:, lo:hi], rounded[:, lo:hi], op=nl.multiply, dtype=nl.float32
            )
            p1x[:, lo:hi] = nisa.tensor_tensor(
                p1[:, lo:hi], _psum_copy(xs[:, lo:hi]), op=nl.multiply, dtype=nl.float32
            )
        elif row_dot is None:
            p1x[:, lo:hi] = nisa.tensor_tensor(dydx[:, lo:hi], a, op=nl.multiply, dtype=nl.float32)
        else:
            _row_dot_blocks(plan, consts.pe, tile, row_dot, dydx, a, p1x, g0, lo, hi)
    if row_dot is None:
        nisa.activation_reduce(
            op=nl.copy,
            data=p1x,
            reduce_op=nl.add,
            reduce_res=tile.partials[:, g : g + 1],
            dtype=nl.float32,
        )
    return dy_g, dydx


def _row_dot_blocks(plan, pe, tile, row_dot, dydx, a, p1x, g0, lo, hi):
    """The row dot of the chunk ``lo:hi`` of column group ``g0``, block by block: each run of
    Tensor-engine blocks in one ``_row_dot_chunk``, each Vector-engine block
    (``vector_row_dot_block``) as ``p1·x = (dy·x)·a`` summed by the Scalar engine into its
    partial column (block index // n)."""
    for b0 in nl.static_range(lo, hi, ROW_DOT_BLOCK):
        if vector_row_dot_block(plan, g0 + b0):
            b1 = min(hi, b0 + ROW_DOT_BLOCK)
            column = (g0 + b0) // (plan.vector_row_dot_every * ROW_DOT_BLOCK)
            p1x[:, b0:b1] = nisa.tensor_tensor(
                dydx[:, b0:b1], a[:, b0 - lo : b1 - lo], op=nl.multiply, dtype=nl.float32
            )
            nisa.activation_reduce(
                op=nl.copy,
                data=p1x[:, b0:b1],
                reduce_op=nl.add,
                reduce_res=tile.partials[:, column : column + 1],
                dtype=nl.float32,
            )
        elif b0 == lo or vector_row_dot_block(plan, g0 + b0 - ROW_DOT_BLOCK):
            end = tensor_row_dot_end(plan, g0 + b0, g0 + hi) - g0
            _row_dot_chunk(pe, row_dot, dydx[:, b0:end], g0 + b0, g0 + b0 == 0)


def _row_dot_chunk(pe, row_dot, dydx, col0, first):
    """``row_dot += Σ_j (dy·x)·w'`` over one chunk of columns starting at ``col0``, on the
    Tensor engine: each 128-column block of dy·x (fp32) transposed into PSUM
    (``is_transpose``, exact and NaN-safe on NeuronCore-v3+: general/nki/api/nki/isa/
    __init__.py@8a38e733, L944; a NaN stays in its row), copied to SBUF by the Scalar
    engine, then a matrix-vector product against the block's column of w', summing the
    columns of each row in fp32."""
    P = nl.tile_size.pmax
    p, width = dydx.shape[0], dydx.shape[1]
    n = -(-width // P)
    whole = width // P
    moved = nl.ndarray((P, n * p), dtype=nl.float32, buffer=nl.psum)
    for k in nl.static_range(n):
        bw = min(P, width - k * P)
        moved[0:bw, k * p : (k + 1) * p] = nisa.nc_matmul(
            dydx[:, k * P : k * P + bw], pe.identity[0:p, 0:p], is_transpose=True
        )
    flipped = nl.ndarray((P, n * p), dtype=nl.float32)
    if whole:
        flipped[:, 0 : whole * p] = nisa.activation(
            op=nl.copy, data=moved[:, 0 : whole * p], dtype=nl.float32
        )
    if whole < n:
        bw = width - whole * P
        flipped[0:bw, whole * p : n * p] = nisa.activation(
            op=nl.copy, data=moved[0:bw, whole * p : n * p], dtype=nl.float32
        )
    for k in nl.static_range(n):
        bw, b = min(P, width - k * P), (col0 + k * P) // P
        if first and k == 0:
            row_dot[0:p, :] = nisa.nc_matmul(
                flipped[0:bw, k * p : (k + 1) * p], pe.w_cols[0:bw, b : b + 1]
            )
        else:
            row_dot[0:p, :] += nisa.nc_matmul(
                flipped[0:bw, k * p : (k + 1) * p], pe.w_cols[0:bw, b : b + 1]
            )


def _finish_row_dot(plan, tile, row_dot):
    """``−k = −rstd³/N · Σ_j (dy·x)·w'`` per partition (Scalar engine), plus
    ``−rstd²/N · Σ p1·x`` of the Vector-engine blocks (``vector_row_dot_every``) as the
    bias."""
    if has_vector_row_dot(plan):
        bias = nl.ndarray((tile.p, 1), dtype=nl.float32)
        nisa.activation_reduce(
            op=nl.copy,
            data=tile.partials,
            reduce_op=nl.add,
            reduce_res=bias,
            scale=tile.cols[:, 1:2],
            dtype=nl.float32,
        )
        tile.negk[...] = nisa.activation(
            op=nl.copy,
            data=row_dot[0 : tile.p, :],
            bias=bias,
            scale=tile.cols[:, 2:3],
            dtype=nl.float32,
        )
    else:
        tile.negk[...] = nisa.activation(
            op=nl.copy, data=row_dot[0 : tile.p, :], scale=tile.cols[:, 2:3], dtype=nl.float32
        )


def _psum_copy(values):
    """``values`` copied to an fp32 PSUM tile by the Scalar engine, so that a Vector-engine
    product with it takes N cycles instead of 2N with both operands in SBUF
    (general/nki/api/nki/isa/__init__.py@8a38e733, lines 1801-1814)."""
    copy = nl.ndarray(values.shape, dtype=nl.float32, buffer=nl.psum)
    copy[...] = nisa.activation(op=nl.copy, data=values, dtype=nl.float32)
    return copy


def _dy_times_x(plan, dy_c, x_c):
    """``dy·x`` of a chunk in fp32 (exact for 2-byte inputs), on the Vector engine: against
    x copied into PSUM by the Scalar engine (``plan.x_from_psum``: from NeuronCore-v3 on;
    NeuronCore-v2's Vector and Scalar engines share one PSUM port), else from SBUF as
    ``(dy − 0)·x``, a ``scalar_tensor_tensor``, documented at N cycles when ``data`` and
    ``operand1`` are bf16 and 2N otherwise (general/nki/api/nki/isa/__init__.py@8a38e733,
    lines 1218-1226), never more than the plain product from SBUF. Subtracting 0 changes
    no bit of dy."""
    if plan.x_from_psum:
        return nisa.tensor_tensor(dy_c, _psum_copy(x_c), op=nl.multiply, dtype=nl.float32)
    return nisa.scalar_tensor_tensor(
        data=dy_c, op0=nl.subtract, operand0=0.0, op1=nl.multiply, operand1=x_c, dtype=nl.float32
    )


def _column_sums_group(plan, consts, tile, g, dy_g, dydx, outputs):
    """dweight and dbias column sums of group g of a row tile (emitted after the gradient
    group that follows it, so that the Tensor engine's in-order stream reaches the gradient
    pass's matmuls first); with ``outputs`` (the last row tile) the group's sums are final
    and stored at once, overlapping the last gradient pass."""
    p = tile.p
    dweight, dbias = outputs
    if consts.dweight_acc is not None:
        segments = column_segments(plan)
        moving = (
            consts.dweight_moving[0:p, :]
            if consts.dweight_moving is not None
            else tile.cols[:, 0:1]
            if segments == 1
            else tile.cols[:, 2:]
        )
        if plan.heads > 0:
            _accumulate_head_sums(plan, consts.dweight_acc, dydx, moving, g)
        else:
            _accumulate_column_sums(plan, consts.dweight_acc, dydx, moving, g)
        if dweight is not None and plan.heads > 0:
            _store_head_sums(plan, dweight, consts.dweight_acc, g)
        elif dweight is not None:
            _store_column_sums(plan, dweight, consts.dweight_acc, g)
    if consts.dbias_acc is not None:
        _accumulate_column_sums(plan, consts.dbias_acc, dy_g, consts.dbias_moving[0:p, :], g)
        if dbias is not None:
            _store_column_sums(plan, dbias, consts.dbias_acc, g)


def _outer_product(rstd_rows, w_rows):
    """``a = rstd ⊗ w'`` for one chunk into PSUM: one matmul per bf16 part of rstd (the
    tile's stationary rows for that part against the rows of w'), accumulated in fp32."""
    a = nl.ndarray((rstd_rows.shape[2], w_rows.shape[1]), dtype=nl.float32, buffer=nl.psum)
    a[...] = nisa.nc_matmul(rstd_rows[:, 0, :], w_rows)
    for part in nl.static_range(1, rstd_rows.shape[1]):
        a[...] += nisa.nc_matmul(rstd_rows[:, part, :], w_rows)
    return a


def _head_product(tile, w_rows):
    """``a = rstd · w'`` of a per-head weight for one chunk into PSUM: each partition's w'
    row (its head's) scaled by its rstd on the Scalar engine; no matmul, so a non-finite
    weight stays in its head's rows."""
    a = nl.ndarray(w_rows.shape, dtype=nl.float32, buffer=nl.psum)
    a[...] = nisa.activation(op=nl.copy, data=w_rows, scale=tile.cols[:, 0:1], dtype=nl.float32)
    return a


def _finish_statistic(plan, consts, tile):
    """``−k = −rstd²/N · s`` per partition once all groups of the tile are summed (Scalar
    engine: the partials scaled by the tile's −rstd²/N column and added); with a fold the
    segment sums of a row are added next (on-chip DMAs, no arithmetic across rows)."""
    segment_negk = tile.negk if plan.fold == 1 else nl.ndarray((tile.p, 1), dtype=nl.float32)
    nisa.activation_reduce(
        op=nl.copy,
        data=tile.partials,
        reduce_op=nl.add,
        reduce_res=segment_negk,
        scale=tile.cols[:, 1:2],
        dtype=nl.float32,
    )
    if plan.fold > 1:
        _add_fold_segments(tile.negk, segment_negk, tile.p, plan.fold, consts.fold_scratch)


def _add_fold_segments(out, s, p, f, scratch):
    """Write into ``out`` the row sums of the per-partition sums ``s`` (p, 1), broadcast
    back to the f partitions of each row. The layout changes through the HBM ``scratch``
    (P fp32), reshaped whole (the only documented reshape): s stored as a column, loaded
    back with the f segments of a row on one partition (rows, f); the Vector engine adds
    them and copies the sum into each of the f columns; stored, and loaded back as a
    column."""
    P = nl.tile_size.pmax
    rows = p // f
    column = scratch.reshape((P, 1))
    by_row = scratch.reshape((P // f, f))
    nl.store(column[0:p, :], value=s)
    segments = nl.load(by_row[0:rows, :])
    total = nisa.tensor_reduce(nl.add, segments, axis=[1], dtype=nl.float32, keepdims=True)
    repeated = nl.ndarray((rows, f), dtype=nl.float32)
    for h in nl.static_range(f):  # the sum into each column, as the 0.6 kernel does
        repeated[:, h : h + 1] = nisa.tensor_copy(total, dtype=nl.float32)
    nl.store(by_row[0:rows, :], value=repeated)
    out[...] = nl.load(column[0:p, :])


def _gradient_group(plan, views, rings, tile, t, g):
    """Gradient pass over column group g of row tile t: dx = p1 − k·x (+ dh_out)."""
    dx_v, dh_v = views[2], views[3]
    p, g0, width, p1, xs = _group_slot(plan, rings, tile, t, g)
    out_dtype = xs.dtype if dh_v is None else nl.float32
    dx_g = nl.ndarray((p, width), dtype=out_dtype)
    for c in nl.static_range(-(-width // CHUNK)):
        lo, hi = c * CHUNK, min(width, (c + 1) * CHUNK)
        kx = nl.ndarray((p, hi - lo), dtype=nl.float32, buffer=nl.psum)
        kx[...] = nisa.activation(op=nl.copy, data=xs[:, lo:hi], scale=tile.negk, dtype=nl.float32)
        dx_g[:, lo:hi] = nisa.tensor_tensor(p1[:, lo:hi], kx, op=nl.add, dtype=out_dtype)
    dx_dst = dx_v[nl.ds(tile.v0, p), nl.ds(g0, width)]
    if dh_v is None:
        nl.store(dx_dst, value=dx_g)
    else:  # + dh_out (Vector engine, from SBUF), rounded once
        dh_g = nl.load(dh_v[nl.ds(tile.v0, p), nl.ds(g0, width)])
        nl.store(dx_dst, value=nisa.tensor_tensor(dx_g, dh_g, op=nl.add, dtype=xs.dtype))


# --- parameter gradients --------------------------------------------------------------------
def _accumulate_column_sums(plan, acc, data, moving, g):
    """``acc += dataᵀ · moving`` for column group g (``data`` (p, width)): the Tensor engine
    sums the partitions (rows), weighted by the moving columns (rstd and/or the fold-segment
    mask, one output column per segment h). Set b takes every n-th column of the group
    (n = ⌈width / 128⌉), so accumulator partition m collects the group's columns
    m·n … m·n + n − 1: contiguous in the output, which makes the final store one DMA row per
    partition and group. Accumulator column ((g·G/128) + b)·fold + h."""
    P = nl.tile_size.pmax
    f = plan.fold
    width = data.shape[1]
    n = -(-width // P)
    i_p = nl.arange(data.shape[0])[:, None]
    for b in nl.static_range(n):
        count = -(-(width - b) // n)
        bank, c = divmod((g * (-(-plan.group // P)) + b) * f, PSUM_BANK_COLS)
        # columns b, b + n, …: an affine stride on the free dimension (programming_model
        # L531-577)
        stationary = data[i_p, b + n * nl.arange(count)[None, :]]
        acc[bank, 0:count, c : c + f] += nisa.nc_matmul(stationary, moving)


def _accumulate_head_sums(plan, acc, data, moving, g):
    """A per-head weight's ``acc[h, j] += Σ_rows moving[row, h] · data[row, j]`` for column
    group g (``data`` (p, width)): the (rows, heads) operand stationary and the data moving,
    one matmul per PSUM bank of columns, so that head h's sums of column j land on partition
    h, column j (a row of dweight per partition, stored whole)."""
    g0, width = g * plan.group, data.shape[1]
    heads = moving.shape[1]
    for lo in nl.static_range(0, width, CHUNK):
        hi = min(width, lo + CHUNK)
        bank, c = divmod(g0 + lo, PSUM_BANK_COLS)
        acc[bank, 0:heads, c : c + hi - lo] += nisa.nc_matmul(moving, data[:, lo:hi])


def _store_head_sums(plan, dst, acc, g):
    """Round a per-head weight's sums of column group g to ``dst``'s dtype once (Vector copy)
    and store them: dst (heads, N), one row per accumulator partition, one DMA per PSUM
    bank."""
    heads, g0 = dst.shape[0], g * plan.group
    width = min(plan.group, plan.width - g0)
    for lo in nl.static_range(0, width, CHUNK):
        hi = min(width, lo + CHUNK)
        bank, c = divmod(g0 + lo, PSUM_BANK_COLS)
        nl.store(
            dst[:, g0 + lo : g0 + hi],
            value=nl.copy(acc[bank, 0:heads, c : c + hi - lo], dtype=dst.dtype),
        )


def _store_column_sums(plan, dst, acc, g):
    """Round the PSUM column sums of group g to ``dst``'s dtype once (Vector copy) and
    store them, one DMA per fold segment h: accumulator partition m, set b is
    ``dst[h·L + g·G + m·n + b]``, a contiguous run of n per partition. A group narrower than
    128·n has ``width // n`` full partitions and one partial one, stored separately: a mask
    may restrict each axis only to a range (general/nki/api/nki.api.shared.rst@8a38e733,
    lines 201-207), which the staircase ``m·n + b < width`` is not."""
    P = nl.tile_size.pmax
    f, L, G = plan.fold, plan.width, plan.group
    per_group = -(-G // P)
    width = min(G, L - g * G)
    n = -(-width // P)
    bank, c0 = divmod(g * per_group * f, PSUM_BANK_COLS)
    # column b·f + h: set b of segment h
    rounded = nl.copy(acc[bank, :, c0 : c0 + n * f], dtype=dst.dtype)
    full, rest = divmod(width, n)
    i_b = nl.arange(n)[None, :]
    # dst reshaped whole to a column (the tutorial's form), indexed by affine expressions:
    # never a slice of HBM reshaped
    column = dst.reshape((dst.shape[0], 1))
    for h in nl.static_range(f):
        g0 = h * L + g * G
        if full:
            i_m = nl.arange(full)[:, None]
            nl.store(column[g0 + n * i_m + i_b, 0], value=rounded[i_m, h + f * i_b])
        if rest:
            i_r = nl.arange(rest)[None, :]
            nl.store(column[g0 + full * n + i_r, 0], value=rounded[full, h + f * i_r])
