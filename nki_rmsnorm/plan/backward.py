"""The backward kernel's static choices: pure Python (no NKI instruction), shared by both
dialects' kernels (``nki_rmsnorm.kernels.legacy`` and ``nki_rmsnorm.kernels.nki06``).

Two regimes (see ``rmsnorm_bwd.py`` and ``rmsnorm_bwd_streamed.py`` in either dialect):
the folded one (:func:`make_plan`: a row folded over a power-of-two number of partitions,
read from HBM once) and, when no fold of N fits SBUF, the streamed one
(:func:`make_streamed_plan`: column chunks, rows re-read when they do not stay resident).
Every choice depends on N, the dtypes, the options and the SBUF budget, never on M.

The planners run inside the kernels, so they are written in the NKI meta-language the 0.6
compiler evaluates (aws-neuron-sdk@81ce03ae nki/get-started/nki-language-guide.rst L54-56,
L141-201): NKI dtypes compared with ``==`` (never a NumPy dtype), ``for`` loops instead of
generator expressions, dataclasses over ``NKIObject`` built by keyword (L569-640).
"""

from __future__ import annotations

from dataclasses import dataclass

from nki_rmsnorm.kernels.nki06._nki import nl
from nki_rmsnorm.plan.nki_object import NKIObject

#: Columns of one fp32 PSUM bank: the width of every instruction with a PSUM operand.
CHUNK = 512
#: Column-group widths tried, widest first (wider groups amortise the per-instruction cost
#: of the Scalar reduction and the per-group loads; narrower ones need less SBUF).
GROUP_WIDTHS = (2048, 1024, 512)
#: Column groups of look-ahead the ring may hold beyond two row tiles.
MAX_SLACK = 2
#: Group slots of dy: the loads of dy run at most this many groups ahead of the statistic
#: pass, so that the small per-tile loads of the rstd operands never queue behind a long
#: backlog of data loads on the DMA engines (which serve transfers in issue order).
DY_SLOTS = 2
#: NeuronCore-v4: one 128-column block in this many keeps the Vector engine's row dot (see
#: make_plan); blocks rather than CHUNKs, so that a row of a few chunks gets its share too.
VECTOR_ROW_DOT_EVERY = 6
#: Columns of one block of the Tensor-engine row dot: one transpose, the PE's 128 rows.
ROW_DOT_BLOCK = 128
#: Folds tried (partitions per row), smallest first.
FOLDS = (1, 2, 4, 8, 16, 32)
#: bf16 parts of an fp32 value (8 + 8 + 8 mantissa bits).
SPLIT = 3
#: SBUF bytes per partition kept for the constants and per-tile columns.
RESERVED_BYTES = 4 * 1024
#: fp32 columns in one 2 KiB PSUM bank.
PSUM_BANK_COLS = 512
#: PSUM banks each parameter-gradient accumulator may use (2 each for dweight and dbias, the
#: rest for the chunk operands a, −k·x and llama's x copy).
ACC_BANKS = 2
#: Largest hidden size: one accumulator column per 128 columns of the row.
MAX_HIDDEN = ACC_BANKS * PSUM_BANK_COLS * 128
#: Most heads of a per-head weight: a row tile holds at least one row of each head.
MAX_HEADS = 128
#: Largest hidden size beside a per-head weight: its dweight accumulator holds the heads on
#: the partitions and a column per column of the row, in ``ACC_BANKS`` PSUM banks (unfolded
#: rows of that size fit every target's SBUF; tests run it).
MAX_HEAD_HIDDEN = ACC_BANKS * PSUM_BANK_COLS


def dtype_bytes(dtype) -> int:
    """Bytes per element of an NKI dtype, by ``==`` comparisons only (NKI values have no
    ``itemsize``; aws-neuron/nki-library@d2ad3a5 src/nkilib_src/nkilib/core/utils/allocator.py
    L32-47 sizes dtypes the same way)."""
    if dtype == nl.float32 or dtype == nl.int32 or dtype == nl.uint32:
        return 4
    if dtype == nl.bfloat16 or dtype == nl.float16 or dtype == nl.int16 or dtype == nl.uint16:
        return 2
    return 1


@dataclass(frozen=True)
class FoldedPlan(NKIObject):
    """Static choices of one launch; they depend on N, the dtypes and the target only."""

    fold: int  # partitions per row
    width: int  # L = N / fold: columns of a view row
    group: int  # G: columns per group
    n_groups: int
    ring: int  # group slots of p1 and x
    kw: int  # bf16 parts of w' (1: a bf16 weight without offset)
    round_xhat: bool  # llama / none with a 2-byte x: dweight uses round(x̂)
    # dy·x runs against x copied into PSUM by the Scalar engine (N Vector cycles, and the
    # Scalar engine's N-cycle copy), else from SBUF as (dy − 0)·x: N cycles for bf16 inputs
    # (general/nki/api/nki/isa/__init__.py@8a38e733, L1218-1226), 2N otherwise. NeuronCore-v2
    # and two bf16 tiles take SBUF: v2's Vector and Scalar engines share one PSUM port, so
    # the copy and the product would queue on it (modeled on trn1 at 8192×2048 bf16: 1.39×
    # the copy kernel from SBUF, 1.60× with one chunk in four through PSUM).
    x_from_psum: bool = True
    # contraction rows of ``a``'s matmuls: one per bf16 part of w' and fold segment (kw·fold)
    stationary_rows: int = 1
    # matmuls of ``a`` (one per bf16 part of rstd), or 1 when the parts are stacked along
    # the contraction (stationary_rows then counts SPLIT·kw·fold rows)
    rstd_parts: int = SPLIT
    # the row dot Σ_j (dy·x)·w' on the Tensor engine (see ``make_plan``):
    # bit-accurate fp32 transposes of dy·x, then a matrix-vector product against w'
    row_dot_on_pe: bool = False
    # with row_dot_on_pe: every n-th ROW_DOT_BLOCK of a row (block b with b mod n = n − 1)
    # takes the Vector engine's row dot instead (p1·x summed by the Scalar engine), 0 for none
    vector_row_dot_every: int = 0
    # a per-head weight (heads, N): row r takes weight row r mod heads (0: a 1-D weight).
    # Unfolded rows, ``heads · (128 // heads)`` rows per tile, so that partition p of every
    # tile holds head p mod heads; ``a = rstd · w'`` comes from the per-head w' tile
    # (``head_rows``) scaled by rstd on the Scalar engine, never through a matmul, where
    # 0 · Inf of one head's non-finite weight would reach the other heads' rows
    heads: int = 0


def make_plan(
    N,
    dtypes,
    offset,
    casting_mode,
    budget,
    nc_v3_or_newer=True,
    nc_v4_or_newer=False,
    heads=0,
):
    """The smallest fold, then the widest group and the longest ring, that fit ``budget``
    SBUF bytes per partition (``plan_bytes``). ``dtypes``: a ``BwdDtypes``;
    ``nc_v3_or_newer``: whether the target is NeuronCore-v3 or newer, which the kernel reads as
    ``nisa.get_nc_version() >= nisa.nc_version.gen3`` (an enum ordered only against its own
    members, as AWS's kernels compare it: aws-neuron/nki-library@d2ad3a5
    src/nkilib_src/nkilib/core/attention/attention_tkg.py L2332); it picks the engines of
    dy·x (``x_from_psum``) and of the row dot (``row_dot_on_pe``: NeuronCore-v3+, whose
    transposes are bit-accurate, so a NaN stays in its row; an unfolded 2-byte dy and x in
    gemma mode), and nothing in SBUF. The rstd parts of ``a`` are stacked into one matmul
    where they fit 128 contraction rows. ``nc_v4_or_newer``: NeuronCore-v4 (trn3), whose
    Vector engine runs at the Tensor engine's half clock (1.2 / 2.4 GHz; v3: 0.96 / 2.4):
    there a Tensor-engine row dot of a chunk (4 PE cycles per element and row: an fp32
    transpose and an fp32 matrix-vector product) outweighs the Vector one (1 DVE cycle) so
    one 128-column block in ``VECTOR_ROW_DOT_EVERY`` keeps the Vector row dot, which balances
    the two engines' floors (PE 7 − 4f against 2·(3 + f) half-clock cycles: f = 1/6). None when
    no power-of-two fold of N fits. Tests check every accepted input against the capacity.
    ``heads``: the rows of a per-head weight (``FoldedPlan.heads``), unfolded only, with the
    row dot on the Vector engine (a Tensor-engine row dot would need every head's w')."""
    e_x = dtype_bytes(dtypes.x)
    round_xhat = dtypes.weight is not None and casting_mode != "gemma" and e_x == 2
    bf16_weight = dtypes.weight is not None and dtypes.weight == nl.bfloat16
    kw = 1 if dtypes.weight is None or (bf16_weight and offset == 0.0) else SPLIT
    bf16_pair = dtypes.x == nl.bfloat16 and dtypes.dy == nl.bfloat16
    # (dy − 0)·x of two bf16 tiles from SBUF: the same N Vector cycles as against a PSUM
    # copy of x, without the Scalar engine's copy
    x_from_psum = round_xhat or (nc_v3_or_newer and not bf16_pair)
    two_byte = dtype_bytes(dtypes.x) == 2 and dtype_bytes(dtypes.dy) == 2
    if heads > 0:
        kw = 1  # w' comes from the per-head tile, not from bf16 parts
    for fold in FOLDS:
        stacked = SPLIT * kw * fold <= nl.tile_size.pmax
        row_dot_on_pe = nc_v3_or_newer and fold == 1 and two_byte and not round_xhat and heads == 0
        if N % fold != 0 or (heads > 0 and fold > 1):
            continue
        width = N // fold
        for widest in GROUP_WIDTHS:
            group = min(widest, width)
            n_groups = -(-width // group)
            for slack in range(n_groups + MAX_SLACK, 0, -1):
                plan = FoldedPlan(
                    fold=fold,
                    width=width,
                    group=group,
                    n_groups=n_groups,
                    ring=n_groups + slack,
                    kw=kw,
                    round_xhat=round_xhat,
                    x_from_psum=x_from_psum,
                    stationary_rows=kw * fold * (SPLIT if stacked else 1),
                    rstd_parts=1 if stacked else SPLIT,
                    row_dot_on_pe=row_dot_on_pe,
                    vector_row_dot_every=(
                        VECTOR_ROW_DOT_EVERY if row_dot_on_pe and nc_v4_or_newer else 0
                    ),
                    heads=heads,
                )
                if plan_bytes(plan, dtypes) <= budget:
                    return plan
    return None  # no fold fits: the streamed regime re-reads the rows instead


def plan_bytes(plan, dtypes) -> int:
    """SBUF bytes per partition the main regime allocates for ``plan``: the ring of p1 (fp32)
    and x slots, the ``DY_SLOTS`` dy slots, the bf16 moving rows of w', the working tiles of
    two column groups in flight (p1·x and dy·x in fp32, dx; round(x̂); with dh_out an fp32
    dx before the sum and dh_out itself) and ``RESERVED_BYTES`` for the constants and
    per-tile columns; with ``row_dot_on_pe`` also w' as fp32 columns (the transposed dy·x
    takes the place of p1·x); with ``heads`` the per-head w' (fp32 and the weight's dtype)."""
    e_x = dtype_bytes(dtypes.x)
    e_dy = dtype_bytes(dtypes.dy)
    per_group_column = 4 + 4 + e_x + (e_x if plan.round_xhat else 0)
    if dtypes.dh_out is not None:
        per_group_column += 4 + dtype_bytes(dtypes.dh_out)
    return (
        (4 * (-(-plan.width // 128)) if plan.row_dot_on_pe else 0)
        + ((4 + dtype_bytes(dtypes.weight)) * plan.width if plan.heads > 0 else 0)
        + plan.ring * plan.group * (4 + e_x)
        + DY_SLOTS * plan.group * e_dy
        + 2 * plan.width
        + 2 * plan.group * per_group_column
        + RESERVED_BYTES
    )


def tile_rows(plan) -> int:
    """Rows of one row tile: ``128 / fold``, or with a per-head weight the whole multiple of
    ``heads`` that fits 128 (partition p then holds head p mod heads in every tile)."""
    P = nl.tile_size.pmax
    if plan.heads > 0:
        return plan.heads * (P // plan.heads)
    return P // plan.fold


def operand_slots(plan) -> int:
    """Slots of the per-row-tile operands (rstd rows and columns, partials, −k): tile t uses
    slot t mod this. Two for a 1-D weight; four with a per-head weight, whose tiles' first
    instruction (``a = rstd · w'``) reads the tile's rstd column, so that the column's load
    runs a tile further ahead (modeled trn3 16384 × 128 bf16, 8 heads: 157.7 µs with two
    slots, 112.1 with four; the 1-D weight's kernel 111.2 and 111.0)."""
    return 4 if plan.heads > 0 else 2


def column_segments(plan) -> int:
    """Columns of dweight's moving operand: one per fold segment, or one per head of a
    per-head weight."""
    return plan.fold * max(1, plan.heads)


def vector_row_dot_block(plan, col0) -> bool:
    """Whether the ``ROW_DOT_BLOCK`` of a row starting at column ``col0`` takes the Vector
    engine's row dot (``vector_row_dot_every``); the same columns in every row, so a row's
    result never depends on where it sits."""
    n = plan.vector_row_dot_every
    return n > 0 and (col0 // ROW_DOT_BLOCK) % n == n - 1


def tensor_row_dot_end(plan, col0, hi) -> int:
    """The end (at most ``hi``) of the run of Tensor-engine row-dot blocks from ``col0``: the
    start of the next Vector-engine block."""
    n = plan.vector_row_dot_every
    if n == 0:
        return hi
    b = col0 // ROW_DOT_BLOCK
    return min(hi, (b + (n - 1 - b % n)) * ROW_DOT_BLOCK)


def has_vector_row_dot(plan) -> bool:
    """Whether a row has any Vector-engine row-dot block."""
    n = plan.vector_row_dot_every
    return n > 0 and -(-plan.width // ROW_DOT_BLOCK) >= n


def partial_columns(plan) -> int:
    """Columns of a row tile's partial row sums: one per column group, or with
    ``row_dot_on_pe`` one per Vector-engine block (at least 1)."""
    if not plan.row_dot_on_pe:
        return plan.n_groups
    n = plan.vector_row_dot_every
    return max(1, (-(-plan.width // ROW_DOT_BLOCK)) // n) if n > 0 else 1


@dataclass(frozen=True)
class BwdDtypes(NKIObject):
    """The dtypes the backward's SBUF plan depends on (None for an absent tensor)."""

    x: object
    dy: object
    weight: object
    dh_out: object


# The streamed regime.

#: Columns of one fp32 working tile: 8 KiB per partition, large enough to amortise the fixed
#: cost of an instruction and small enough to leave SBUF to the resident rows.
CHUNK_COLS = 2048
#: SBUF bytes per partition kept for the working tiles of one chunk next to the resident rows
#: and weight. The simulator measures at most ≈ 33 KiB live for them (fp32 rows with a streamed
#: fp32 weight); the rest is headroom for the compiler's extra buffers.
CHUNK_SCRATCH_BYTES = 48 * 1024


@dataclass(frozen=True)
class StreamedPlan(NKIObject):
    """Static choices of one launch. They depend on N and the dtypes only, never on M, so a
    row's arithmetic is the same whatever the batch."""

    rows_resident: bool  # dy and x rows stay in SBUF between the two passes
    weight_resident: bool  # the broadcast weight stays in SBUF for the whole kernel
    round_xhat: bool  # dweight uses x̂ rounded to the input dtype (llama / none, narrow x)
    n_chunks: int  # column chunks of CHUNK_COLS per row


def make_streamed_plan(N, x_dtype, dy_dtype, weight_dtype, casting_mode, sbuf_bytes):
    """Residency of the dy/x rows and of the broadcast weight in the SBUF left next to the
    chunk scratch (rows first: they save HBM traffic), and the llama/none rounding. The rows
    are budgeted in their own dtypes: dy may be wider than x (a y with an fp32
    ``out_dtype``)."""
    budget = sbuf_bytes - CHUNK_SCRATCH_BYTES
    rows_bytes = (dtype_bytes(x_dtype) + dtype_bytes(dy_dtype)) * N
    rows_resident = rows_bytes <= budget
    kept = rows_bytes if rows_resident else 0
    weight_resident = weight_dtype is not None and kept + dtype_bytes(weight_dtype) * N <= budget
    round_xhat = casting_mode != "gemma" and x_dtype != nl.float32
    return StreamedPlan(
        rows_resident=rows_resident,
        weight_resident=weight_resident,
        round_xhat=round_xhat,
        n_chunks=(N + CHUNK_COLS - 1) // CHUNK_COLS,
    )


def streamed_plan_bytes(plan, N, x_dtype, dy_dtype, weight_dtype) -> int:
    """SBUF bytes per partition the streamed regime allocates for ``plan``: the resident
    dy and x rows and broadcast weight, and ``CHUNK_SCRATCH_BYTES`` for a chunk's tiles."""
    rows = (dtype_bytes(x_dtype) + dtype_bytes(dy_dtype)) * N
    weight = 0 if weight_dtype is None else dtype_bytes(weight_dtype) * N
    return (
        (rows if plan.rows_resident else 0)
        + (weight if plan.weight_resident else 0)
        + CHUNK_SCRATCH_BYTES
    )


@dataclass(frozen=True)
class BwdConstants(NKIObject):
    """The backward's tiles built once, in either dialect: the moving rows of w', the fold
    masks (column-sum moving operands), the PSUM accumulators (one tile per bank, listed),
    the HBM tables of per-tile rstd operands."""

    w_rows: object  # (kw·fold, L) bf16
    w_lazy: object  # the bf16 weight (HBM) whose rows the first row tile loads, or None
    dweight_moving: object  # (P, fold) fp32 0/1 fold mask (llama / none), or None
    dbias_moving: object  # (P, fold) 0/1 in dy's dtype, or None
    dweight_acc: list | None
    dbias_acc: list | None
    table_rows: object  # HBM (tiles, kw·fold, SPLIT, P) bf16: each tile's stationary rows
    table_cols: object  # HBM (tiles, P, n_cols) fp32: each tile's rstd columns
    fold_scratch: object = None  # HBM (P,) fp32 where a fold's segment sums change layout
    pe: object = None  # PeConstants with ``row_dot_on_pe``, else None
    head_rows: object = None  # (P, N) fp32 w' of head p mod heads (a per-head weight)


@dataclass(frozen=True)
class PeConstants(NKIObject):
    """The constant tiles of ``row_dot_on_pe``: the fp32 identity the transposes move
    against and w' as fp32 columns (P, ⌈N/128⌉) (w'[b·128 + j] at partition j, column b),
    the moving operand of the row dot."""

    identity: object
    w_cols: object


@dataclass(frozen=True)
class BwdTileSlots(NKIObject):
    """Per-row-tile operands carried from a tile's statistic pass to its gradient pass, in
    ``operand_slots`` slots (tile t uses slot t mod that): the stationary rows of
    a = rstd · w' (kw·fold, SPLIT, P) bf16, the rstd columns (P, n_cols) fp32 (rstd,
    −rstd²/N, then with a gemma fold or a per-head weight rstd in the column of the
    partition's fold segment or head, the moving operand of dweight),
    the group partials of Σ p1·x (P, n_groups) and −k (P, 1)."""

    rows: object
    cols: object
    partials: object
    negk: object


@dataclass(frozen=True)
class BwdTile(NKIObject):
    """Row tile t: its first view row, its partitions and its slot's operands."""

    v0: int
    p: int
    rows: object
    cols: object
    partials: object
    negk: object


@dataclass(frozen=True)
class StreamedInputs(NKIObject):
    """The kernel's HBM operands and scalars, plus the resident weight broadcast (or None)."""

    dy: object
    x: object
    weight: object
    w_all: object
    rstd: object  # (M, 1) view
    dh_out: object
    offset: float


@dataclass(frozen=True)
class StreamedParamGrads(NKIObject):
    """PSUM column-sum accumulators (a tile, or in the 0.6 dialect a list of banks; None
    when not wanted) and the ones vectors that feed them to the Tensor engine."""

    dweight: list | None
    dbias: list | None
    ones_f32: object
    ones_dy: object
