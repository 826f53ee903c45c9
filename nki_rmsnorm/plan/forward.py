"""What the forward kernel keeps on chip and how it tiles, shared by both dialects' kernels
(``nki_rmsnorm.kernels.legacy`` and ``nki_rmsnorm.kernels.nki06``); no NKI instruction.

Where it runs: inside the kernel, during specialization. Each entry point calls
:func:`make_plan` and :func:`choose_layout` on its HBM tensors' dtypes and shapes, so the
kernels keep the signatures the bindings launch (tensors, eps, offset, casting mode, output
dtype) and one planner serves both dialects. The NKI 0.6 compiler therefore evaluates this
module's functions and classes as the NKI meta-programming language
(aws-neuron-sdk@81ce03ae nki/get-started/nki-language-guide.rst L54-56, L78-97), and they are
written in it: NKI values only (ints, floats, bools, strings, None, tuples, lists,
string-keyed dicts and frozen ``NKIObject`` dataclasses, L141-201, L569-640), explicit loops
instead of comprehensions and generator expressions, ``kernel_assert`` instead of ``raise``
(nki-library@d2ad3a5 src/nkilib_src/nkilib/core/utils/kernel_assert.py L17), no NumPy.
Running it as host Python and handing the kernel a plan object (guide L603-625) would have
needed a second, host-side signature per entry point and per dialect for the same decisions.

Dtypes are the dialect's own ``nki.language`` dtypes: the kernel passes its tensors' dtypes
and its ``nl.float32`` / ``nl.bfloat16`` (``float32`` / ``bfloat16`` of :func:`make_plan`), which
the plan hands back for the tiles it allocates; sizes come from :func:`dtype_bytes`, keyed by
the dtype's name, which is the same in both dialects. Host code (tests) may pass NumPy dtypes:
the legacy dialect's dtypes are NumPy dtypes.

Every decision here depends on N, the dtypes, the options and the NeuronCore generation,
never on the data. M only picks how many rows go into one tile (``rows_per_partition``), and
where the row statistics are grouped (``statistic_groups``) whether a decode batch runs
"split" or "rows", which compute each row alike; so a row's outputs are the same in any
batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nki_rmsnorm.plan.dtypes import dtype_bytes
from nki_rmsnorm.plan.kernel_assert import kernel_assert
from nki_rmsnorm.plan.nki_object import NKIObject

CASTING_MODES = ("gemma", "llama", "none")

#: Bytes of the two dtypes the planner itself picks for on-chip steps.
FLOAT32_BYTES = 4
BFLOAT16_BYTES = 2

#: Partitions of SBUF / PSUM (``nl.tile_size.pmax`` on every NeuronCore generation).
PMAX = 128

#: Per-partition bytes kept aside for the small tiles next to the rows: eps, Σh², rstd and
#: its pieces, the identity and the transposed rstd the Tensor engine works with.
RESERVED_BYTES = 2048
#: Columns of one Tensor-engine product: one 2 KiB PSUM bank of fp32.
PSUM_COLS = 512
#: A row tile moves at most this many bytes per partition and row stream in one DMA ...
TILE_TARGET_BYTES = 32 * 1024
#: ... while the kernel keeps at least this many row tiles to pipeline.
MIN_TILES = 16
#: Rows per partition of one tile at most (the transposed rstd of a tile, rows·128 elements
#: per partition, stays within one PSUM tile's 512 elements).
MAX_ROWS_PER_PARTITION = 4
#: Rows one Scalar/Vector instruction may cover at once is bounded by its 64 K free elements.
MAX_FREE_ELEMENTS = 65536
#: Column chunk of the long-row regimes, in bytes of the row dtype per partition: ≥ 4 KiB
#: saturates a DMA, and a smaller chunk shortens the pipeline bubble between row tiles.
CHUNK_BYTES = 4096
#: Column chunks kept in flight by the long-row regimes (double buffering).
CHUNKS_IN_FLIGHT = 2
#: The "long" output pass stores chunks up to this many times wider than it reduces, while
#: a row keeps at least ``MIN_OUTPUT_CHUNKS`` of them: the column chunks of one row tile
#: overlap in HBM address range, so each store waits for the one before it, and a wider
#: store amortises that wait (too wide, and the next row tile refills its buffer late).
MAX_OUTPUT_CHUNK_FACTOR = 2
#: ... tried widest first.
OUTPUT_CHUNK_FACTORS = (MAX_OUTPUT_CHUNK_FACTOR, 1)
MIN_OUTPUT_CHUNKS = 8
#: The "split" regime spreads a row over the fewest partitions (a power of two) that bring
#: its per-partition segment down to this many bytes of h.
SPLIT_SEGMENT_BYTES = 8 * 1024
#: ... and at most this many: a tile keeps at least 128 / 32 = 4 whole rows, and the
#: Tensor engine contracts 3 rstd pieces × 32 segments ≤ 128 rows.
MAX_SEGMENTS = 32
#: Segments per row tried, fewest first: the powers of two from 2 to ``MAX_SEGMENTS``.
SEGMENT_COUNTS = (2, 4, 8, 16, MAX_SEGMENTS)
#: Tiles the "split" regime keeps in flight (loading, reducing, normalising and storing).
SPLIT_SLOTS = 6
#: The "packed" regime takes rows of at most this many bytes of h (QK-norm heads: 256
#: bf16 columns): below it, a tile of one row per partition moves too few bytes per DMA to
#: amortise the DMA's fixed cost, and each instruction too few elements for its own.
PACKED_MAX_ROW_BYTES = 512
#: ... packing rows until a tile moves this many bytes of x per partition ...
PACKED_TILE_BYTES = 4096
#: ... while each core keeps at least this many tiles to pipeline.
PACKED_MIN_TILES = 4
#: Grouped row statistics (NeuronCore-v3+, rows the "rows" regime holds whole): Σh² of a
#: row is the sum, in order, of its G group sums, group g the Scalar engine's Σ over columns
#: g·n/G … (g + 1)·n/G − 1 (one ``activation_reduce`` each), added by one Vector reduce.
#: A decode batch (at most ``DECODE_MAX_ROWS`` rows) then runs the "split" regime with
#: s = G segments per row, whose per-segment Σ and in-order reduce over the segments are
#: the same instructions on the same values, so a row's Σh², rstd and y are bitwise the same
#: in a batch of one row and of thousands, while the batch uses G times the partitions (and
#: DMA engines). G is the largest power of two up to ``MAX_SEGMENTS`` dividing n (odd n:
#: any, with G − 1 groups of ⌈n / G⌉ and the rest in the last, :func:`group_width`) with groups
#: of at least ``GROUP_MIN_COLUMNS``: the whole-row tiles pay one more ACT instruction per
#: group and row, ``act_read_accumulator_cycles`` = 64 cycles each (simulate/perf/cost.py),
#: at most 64 / 1024 = 6.25 % of the row's n cycles (groups of 512 columns cost trn3, whose
#: forward is Scalar-bound, 7 % at 8192 × 4096 bf16; of 1024, 4 %).
GROUP_MIN_COLUMNS = 1024
#: ... and on NeuronCore-v3 (trn2), whose whole-row tiles are bound by HBM and the Vector
#: engine with the Scalar engine to spare, groups of at least 512 columns: twice the
#: partitions (and half the columns each) for a decode batch, no change to the large ones
#: (modeled trn2 bf16 forward, groups of 1024 / 512: 1 × 4096 4.66 / 4.24 µs, 8 × 4096
#: 5.76 / 5.00, 64 × 8192 16.8 / 16.0, 8192 × 4096 436.8 both; on trn3 8192 × 4096 268.2
#: / 281.7, so trn3 keeps 1024).
GROUP_MIN_COLUMNS_NC_V3 = 512
#: Batches of at most this many rows (per physical core: under LNC=2 the split tiles are
#: shared by the two cores) take the "split" regime where the statistics are grouped: the
#: "rows" regime would hold them in one tile of whole rows, which loads, reduces,
#: normalises and stores in turn, while the split tiles pipeline and each partition
#: works through N / G columns per tile (modeled trn2 bf16 forward, rows against split
#: after its short rstd chain: 64 × 8192 31.4 / 16.8 µs, 128 × 8192 33.7 / 23.3, 128 × 4096
#: 19.0 / 17.8, 256 × 8192 43.3 / 37.2 but 512 × 8192 61.1 / 65.5; trn3 128 × 8192 26.4 /
#: 21.1) ...
DECODE_MAX_ROWS = 128
#: ... and the same with a residual (fused add 128 × 8192: 49.2 / 31.4 µs; 256 × 2048
#: 20.5 / 22.1) ...
DECODE_MAX_ROWS_FUSED = 128
#: ... where the rows have at least this many groups, or all fit one split tile: with two,
#: the split tiles hold as many columns per partition as the one whole-row tile and add the
#: statistics' transposes (trn2 128 × 2048 12.1 / 16.4 µs, 96 × 2048 11.8 / 15.3; 64 × 2048,
#: one split tile, 11.8 / 8.9).
DECODE_MIN_GROUPS = 4
#: Where the statistics are not grouped (NeuronCore-v2, and the legacy kernels, whose row
#: tiles run one after the other: grouping costs them every large shape, modeled trn2
#: legacy bf16 forward 2048 x 4096 110.1 -> 114.6 µs, fused add 237.4 -> 241.6), batches of
#: at most this many rows of N that "rows" holds (whose whole-row statistics it repeats),
#: with or without a residual, run "spread": whole-row statistics,
#: the product and the stores spread over up to 128 partitions, in one tile (the Vector
#: engine transposes rstd, at most 32 x 32: general/nki/api/nki/isa/__init__.py@8a38e733
#: L1026-1029). Two tiles lose to "rows", which adds x and the residual in one pass
#: (modeled trn1 bf16 fused add 64 x 8192: 64.6 against 50.3 µs; 32 x 8192 43.0 / 50.3).
SPREAD_MAX_ROWS = 32
#: A per-head weight (heads, N) takes the "packed" regime only, replicated across partitions
#: in at most this many PSUM banks (``PSUM_COLS`` fp32 columns, whole heads each) of the
#: eight of a partition's 16 KiB PSUM (the bias and the Tensor engine's products keep the
#: rest): heads ≤ 4 · (512 // N), 16 heads of 128.
PACKED_MAX_HEAD_BANKS = 4


# The rstd chain's constants and the entry points' HBM tensors, shared by both dialects.
#: The Scalar engine's rsqrt is valid for inputs in [2⁻⁸⁷, 2⁹⁷]
#: (general/nki/api/nki.api.shared.rst@8a38e733, line 180).
RSQRT_MIN_INPUT = 2.0**-87
RSQRT_MAX_INPUT = 2.0**97
#: Power-of-two scalings around the Scalar engine's rsqrt
#: (``rmsnorm_fwd_steps._rstd_on_scalar`` of either dialect).
RSQRT_PRESCALE = 2.0**-32
RSQRT_POSTSCALE = 2.0**-16
#: Newton steps refining the Scalar engine's rsqrt (``rmsnorm_fwd_steps.rstd_from_sum``).
NEWTON_STEPS = 2
#: The largest finite float32.
FP32_MAX = 3.4028234663852886e38
#: The smallest positive fp32 (subnormal): an all-zero row's mean square is raised to it
#: before the Vector-engine chain's scaling, so that rsqrt stays in range (its rstd becomes
#: +inf afterwards when eps = 0).
FP32_TINY = 2.0**-149
#: The Vector-engine chain scales each row's mean square v by an exact power of two chosen
#: per row, so that every positive finite fp32 v lands in rsqrt's valid range: by 2⁶⁴ when
#: v < RSQRT_SPLIT (v ≥ 2⁻¹⁴⁹ → [2⁻⁸⁵, 2⁴⁴)), by 2⁻⁶⁴ otherwise (v < 2¹²⁸ → [2⁻⁸⁴, 2⁶⁴));
#: rstd is rescaled by the square root, 2³² or 2⁻³² (RSQRT_ROOT_SCALE).
RSQRT_SPLIT = 2.0**-20
RSQRT_ROOT_SCALE = 2.0**32


@dataclass(frozen=True)
class Tensors(NKIObject):
    """The kernel's HBM tensors: inputs x, residual (or None), weight, bias (or None);
    outputs y, h (None without a residual) and rstd; ``y_transposed`` (nki06 only) replaces y
    (then None) by rmsnorm_tkg's transposed layout (P, M, N / P)
    (``rmsnorm_fwd_transposed``)."""

    x: object
    residual: object
    weight: object
    bias: object
    y: object
    h: object
    rstd: object
    y_transposed: object = None


def _bytes_of(dtypes):
    """Bytes per element of the dtypes present in ``dtypes`` (None stands for an absent one)."""
    total = 0
    for dtype in dtypes:
        if dtype is not None:
            total += dtype_bytes(dtype)
    return total


@dataclass(frozen=True)
class Plan(NKIObject):
    """The dtype of every on-chip step and the engine of the weight product."""

    in_dtype: object  # x's dtype; x̂ is rounded to it in llama / none
    out_dtype: object  # y's dtype
    result_dtype: object  # dtype of the last arithmetic step (x's dtype in "none" mode)
    residual_dtype: object  # None without a residual
    h_dtype: object  # h = x (+ residual): the residual's dtype, or x's
    scale_dtype: object  # weight + offset on chip; None without a weight
    bias_dtype: object  # None without a bias
    product_dtype: object  # the pre-bias product, when there is a weight and a bias; or None
    rounds_xhat: bool  # llama / none: x̂ = round(h·rstd) before the weight multiply
    squares_in: str  # where activation_reduce's discarded squares go: product, y, scratch
    #: Who multiplies by rstd and the weight (see rmsnorm_fwd_steps): "tensor" (PE forms
    #: rstd ⊗ w in PSUM; gemma on NeuronCore-v3+), "scalar" (ACT scales h by rstd, PE
    #: broadcasts w into PSUM; NeuronCore-v2) or "vector" (DVE alone; no weight, or llama /
    #: none on v3+, where the bf16 fast modes make it cheap).
    product_engine: str
    #: "tensor" only: 3 bf16 pieces of rstd against a bf16 weight, or 1 fp32 rstd against
    #: an fp32 weight + offset (a matmul at a quarter of the bf16 rate).
    rstd_pieces: int
    #: The Tensor engine transposes exactly and NaN-safely (NeuronCore-v3+), which the
    #: "split" regime needs to move row statistics across partitions.
    exact_transpose: bool
    #: The narrowest column group of the grouped row statistics (``statistic_groups``).
    group_min_columns: int = GROUP_MIN_COLUMNS

    def resident_bytes(self) -> int:
        """Per column: the weight and bias kept on chip for the whole kernel."""
        return _bytes_of((self.scale_dtype, self.bias_dtype))

    def row_bytes(self) -> int:
        """Per column and row of a tile: x, the residual, y and their intermediates."""
        total = _bytes_of(
            (self.in_dtype, self.residual_dtype, self.result_dtype, self.product_dtype)
        )
        if self.result_dtype != self.out_dtype:
            total += dtype_bytes(self.out_dtype)
        if self.squares_in == "scratch":
            total += BFLOAT16_BYTES
        return total

    def rows_bytes(self, n: int, rows: int) -> int:
        """Regime "rows": the weight and bias once, two tiles of ``rows`` rows per
        partition in flight."""
        per_column = self.resident_bytes() + 2 * rows * self.row_bytes()
        return n * per_column + RESERVED_BYTES

    def fits_rows(self, n: int, rows: int, budget: int) -> bool:
        return self.rows_bytes(n, rows) <= budget

    def packed_bytes(self, n: int, rows: int) -> int:
        """Regime "packed", ``rows`` rows of ``n`` per partition: the weight and bias
        replicated ``rows`` times, two tiles in flight (h, x with a residual, fp32 x̂, y and
        the pre-bias product) and one row of discarded bf16 squares."""
        row = FLOAT32_BYTES + _bytes_of(
            (self.h_dtype, self.residual_dtype, self.result_dtype, self.product_dtype)
        )
        if self.result_dtype != self.out_dtype:
            row += dtype_bytes(self.out_dtype)
        per_column = self.resident_bytes() + 2 * row
        return rows * n * per_column + 2 * n * BFLOAT16_BYTES + RESERVED_BYTES

    def split_bytes(self, segment: int) -> int:
        """Regime "split", segments of ``segment`` columns: the weight and bias segments
        once (one row per partition, or 3·s moving rows) and as loaded (up to fp32, before
        the conversion), ``SPLIT_SLOTS`` tiles in flight."""
        staging = 0
        if self.scale_dtype is not None:
            staging += FLOAT32_BYTES
        if self.bias_dtype is not None:
            staging += FLOAT32_BYTES
        per_column = SPLIT_SLOTS * self.row_bytes() + self.resident_bytes() + staging
        return segment * per_column + RESERVED_BYTES

    def fits_split(self, segment: int, budget: int) -> bool:
        return self.split_bytes(segment) <= budget

    def spread_bytes(self, n: int, segments: int) -> int:
        """Regime "spread", rows of ``segments`` segments: the whole-row tile for the
        statistics (h, x with a residual, bf16 squares unless h's dtype holds them) and the
        result of one load into it (allocated before it is copied in), and, per partition,
        a segment of the spread tile (h, x, y and intermediates) and of the weight and bias
        (as loaded, then kept converted)."""
        whole = dtype_bytes(self.h_dtype)
        loaded = whole
        if self.residual_dtype is not None:
            whole += dtype_bytes(self.in_dtype)
            loaded = max(loaded, dtype_bytes(self.in_dtype))
        if str(self.h_dtype) == "float16":
            whole += BFLOAT16_BYTES
        segment = self.row_bytes() + self.resident_bytes() + 2 * FLOAT32_BYTES
        return n * (whole + loaded) + n // segments * segment + RESERVED_BYTES

    def fits_spread(self, n: int, segments: int, budget: int) -> bool:
        return self.spread_bytes(n, segments) <= budget

    def chunk_columns(self) -> int:
        """Column chunk of the long-row regimes."""
        return max(PSUM_COLS, CHUNK_BYTES // dtype_bytes(self.h_dtype))

    def long_bytes(self, n: int, output_chunk: int) -> int:
        """Regime "long": one tile of h rows stays on chip next to the chunks in flight:
        the statistics pass's squares (and x, with a residual) and the output pass's y,
        intermediates and weight and bias chunks."""
        output = _bytes_of(
            (self.result_dtype, self.product_dtype, self.scale_dtype, self.bias_dtype)
        )
        if self.result_dtype != self.out_dtype:
            output += dtype_bytes(self.out_dtype)
        if self.rounds_xhat:
            output += dtype_bytes(self.in_dtype)
        statistics = BFLOAT16_BYTES
        if self.residual_dtype is not None:
            statistics += dtype_bytes(self.in_dtype)
        chunks = CHUNKS_IN_FLIGHT * (self.chunk_columns() * statistics + output_chunk * output)
        return (
            n * dtype_bytes(self.h_dtype)
            + chunks
            + RESERVED_BYTES
            + 4 * math.ceil(n / self.chunk_columns())
        )

    def fits_one_row_tile(self, n: int, budget: int, output_chunk: int) -> bool:
        return self.long_bytes(n, output_chunk) <= budget

    def two_pass_bytes(self, chunk: int) -> int:
        """Regime "two_pass", column chunks of ``chunk``: two chunks in flight of the busier
        pass (statistics: x, residual, squares; scale: the tile's buffers plus the weight
        and bias chunks), and a weight or bias row with its converted copy."""
        stats = dtype_bytes(self.in_dtype) + BFLOAT16_BYTES
        if self.residual_dtype is not None:
            stats += dtype_bytes(self.residual_dtype)
        per_column = 2 * max(stats, self.row_bytes() + self.resident_bytes())
        per_column += 2 * FLOAT32_BYTES
        return chunk * per_column + RESERVED_BYTES

    def two_pass_chunk(self, n: int, budget: int) -> int:
        """Column chunk of the two-pass regime: the widest of 8192 … 512 columns that fits
        (512 when none does: the kernel then fails to allocate, which the planner's property
        test would show), evened out over the row."""
        width = 512
        for candidate in (1024, 2048, 4096, 8192):
            # two_pass_bytes grows with the width: the last that fits is the widest
            if self.two_pass_bytes(candidate) <= budget:
                width = candidate
        chunks = math.ceil(n / width)
        return min(width, PSUM_COLS * math.ceil(n / chunks / PSUM_COLS))


def make_plan(
    x_dtype,
    weight_dtype,
    bias_dtype,
    residual_dtype,
    offset,
    casting_mode,
    out_dtype,
    float32,
    bfloat16,
    tensor_engine=False,
    group_min_columns=GROUP_MIN_COLUMNS,
):
    """The :class:`Plan` for the given dtypes (None for an absent tensor; ``out_dtype`` None:
    x's) and options. ``tensor_engine``: the target is a NeuronCore-v3+ (trn2, trn3), whose
    exact, NaN-safe Tensor-engine transpose lets gemma form rstd ⊗ weight there, and whose
    bf16 Vector fast modes make llama / none cheap on the Vector engine alone.
    ``group_min_columns``: the narrowest group of the grouped row statistics
    (``GROUP_MIN_COLUMNS``, or ``GROUP_MIN_COLUMNS_NC_V3`` on NeuronCore-v3). ``float32``,
    ``bfloat16``: the calling dialect's ``nl.float32`` and ``nl.bfloat16``, the dtypes the
    planner picks for on-chip steps."""
    kernel_assert(
        casting_mode == "gemma" or casting_mode == "llama" or casting_mode == "none",
        "casting_mode must be one of gemma, llama, none",
    )
    in_dtype = x_dtype
    if out_dtype is None:
        out_dtype = in_dtype
    low_precision = casting_mode == "none"
    rstd_pieces = 0
    if weight_dtype is None:
        scale_dtype = None
        product_engine = "vector"
    elif casting_mode == "gemma" and tensor_engine:
        bf16_weight = weight_dtype == bfloat16 and not offset
        scale_dtype = bfloat16 if bf16_weight else float32
        product_engine = "tensor"
        rstd_pieces = 3 if bf16_weight else 1
    else:
        product_engine = "vector" if tensor_engine else "scalar"
        if low_precision:
            scale_dtype = in_dtype
        elif offset:
            # Multiplying by the weight as stored is exact in fp32; only an offset needs a
            # fp32 sum.
            scale_dtype = float32
        else:
            scale_dtype = weight_dtype
    if bias_dtype is not None and low_precision:
        bias_dtype = in_dtype
    product_dtype = None
    if scale_dtype is not None and bias_dtype is not None:
        product_dtype = in_dtype if low_precision else float32
    result_dtype = in_dtype if low_precision else out_dtype
    # fp32 and bf16 have fp32's 8 exponent bits: a square of any input fits.
    if product_dtype is not None and (product_dtype == float32 or product_dtype == bfloat16):
        squares_in = "product"
    elif result_dtype == float32 or result_dtype == bfloat16:
        squares_in = "y"
    else:
        squares_in = "scratch"
    return Plan(
        in_dtype=in_dtype,
        out_dtype=out_dtype,
        result_dtype=result_dtype,
        residual_dtype=residual_dtype,
        h_dtype=in_dtype if residual_dtype is None else residual_dtype,
        scale_dtype=scale_dtype,
        bias_dtype=bias_dtype,
        product_dtype=product_dtype,
        rounds_xhat=casting_mode != "gemma",
        squares_in=squares_in,
        product_engine=product_engine,
        rstd_pieces=rstd_pieces,
        exact_transpose=tensor_engine,
        group_min_columns=group_min_columns,
    )


@dataclass(frozen=True)
class Layout(NKIObject):
    """How the rows are tiled: ``regime`` is "rows" (whole rows, ``rows_per_partition``
    consecutive rows per partition in a tile), "packed" (short rows, ``rows_per_partition``
    of them per partition, segment-wise instructions), "split" (each row spread over ``segments``
    partitions), "long" (one row tile kept, column chunks of ``chunk`` columns, stored in
    chunks of ``output_chunk``) or "two_pass" (x read twice, column chunks of ``chunk``)."""

    regime: str
    rows_per_partition: int = 1
    segments: int = 1
    chunk: int = 0
    output_chunk: int = 0
    #: "rows": Σh² of each row from this many group sums (``statistic_groups``); 0: whole.
    groups: int = 0


def choose_layout(
    plan: Plan,
    m: int,
    n: int,
    budget: int,
    cores: int = 1,
    grouped: bool = True,
    heads: int = 1,
) -> Layout:
    """The regime for an (m, n) input within ``budget`` SBUF bytes per partition. ``cores``:
    the physical cores the row tiles are shared among (2 under LNC=2), each of which should
    keep ``MIN_TILES`` tiles to pipeline; only the rows per partition of "rows" and
    "packed" depend on it, and they change no row's arithmetic. m picks between "split" and
    "rows" only where the statistics are grouped (``statistic_groups``; ``grouped``: the
    dialect groups them, the nki06 kernels), and between "spread" and "rows" where they
    are not (NeuronCore-v2, the legacy kernels), where the two compute each row alike.
    ``heads`` > 1: a per-head weight (heads, n), row r using weight[r mod heads]; only
    "packed" takes it (:func:`packed_takes_heads`)."""
    if n * dtype_bytes(plan.h_dtype) <= PACKED_MAX_ROW_BYTES:
        return Layout(
            "packed",
            rows_per_partition=packed_rows_per_partition(plan, m, n, budget, cores, heads),
        )
    groups = statistic_groups(plan, n, budget) if grouped else 0
    decode_rows = DECODE_MAX_ROWS if plan.residual_dtype is None else DECODE_MAX_ROWS_FUSED
    if (
        groups
        and m <= decode_rows * cores
        and (groups >= DECODE_MIN_GROUPS or m * groups <= PMAX * cores)
    ):
        return Layout("split", segments=groups)
    segments = spread_segments(n, m)
    if (
        (not plan.exact_transpose or not grouped)
        and segments > 1
        and m <= SPREAD_MAX_ROWS
        and plan.fits_rows(n, 1, budget)
        and plan.fits_spread(n, segments, budget)
    ):
        return Layout("spread", segments=segments)
    if plan.fits_rows(n, 1, budget):
        rows = 1
        for k in range(2, MAX_ROWS_PER_PARTITION + 1):
            # A tile that moves less than CHUNK_BYTES per partition leaves its DMAs short of
            # saturation and pays the per-tile rstd chain for few rows: it may grow while
            # half of MIN_TILES tiles per core remain (4096 x 1024 bf16 at LNC=2: 2 rows,
            # 8 tiles a core, modeled 61.6 -> 52.7 µs on trn2).
            short = rows * n * dtype_bytes(plan.in_dtype) < CHUNK_BYTES
            min_tiles = MIN_TILES // 2 if short else MIN_TILES
            if _more_rows_help(plan, m, n, k, budget, cores, min_tiles):
                rows = k
        return Layout("rows", rows_per_partition=rows, groups=groups)
    # Bounded loops, not ``while``: the legacy dialect runs only do-while loops
    # (general/nki/api/nki.errors.rst@8a38e733, L902-L947), and this runs in its kernels too.
    if plan.exact_transpose:
        for segments in SEGMENT_COUNTS:
            # a power of two that does not divide n is followed by none that does
            segment = n // segments
            if (
                n % segments == 0
                and segment * dtype_bytes(plan.h_dtype) <= SPLIT_SEGMENT_BYTES
                and plan.fits_split(segment, budget)
            ):
                return Layout("split", segments=segments)
    chunk = plan.chunk_columns()
    for factor in OUTPUT_CHUNK_FACTORS:
        if (factor == 1 or n >= MIN_OUTPUT_CHUNKS * factor * chunk) and plan.fits_one_row_tile(
            n, budget, factor * chunk
        ):
            return Layout("long", chunk=chunk, output_chunk=factor * chunk)
    return Layout("two_pass", chunk=plan.two_pass_chunk(n, budget))


def statistic_groups(plan: Plan, n: int, budget: int) -> int:
    """G of the grouped row statistics (see ``GROUP_MIN_COLUMNS``; groups of at least
    ``plan.group_min_columns``) for rows of ``n``, or 0
    where Σh² is taken over the whole row: on NeuronCore-v3+ (the "split" regime's exact
    transposes), for rows the "rows" regime holds whole and the "split" regime can hold in
    G segments. A decision on n, the dtypes and the target alone, never on M."""
    if (
        not plan.exact_transpose
        or n * dtype_bytes(plan.h_dtype) <= PACKED_MAX_ROW_BYTES
        or not plan.fits_rows(n, 1, budget)
    ):
        return 0
    groups = 0
    for count in SEGMENT_COUNTS:
        # odd n (no power-of-two divisor): G − 1 groups of ⌈n / G⌉ and a narrower last one
        width = group_width(n, count)
        if (
            (n % count == 0 or n % 2 == 1)
            and n - (count - 1) * width > 0
            and plan.rows_bytes(n, 1) + padded_group_bytes(plan, n, count) <= budget
            and width >= plan.group_min_columns
            and plan.fits_split(width, budget)
        ):
            groups = count
    return groups


def padded_group_bytes(plan: Plan, n: int, groups: int) -> int:
    """Per partition and row: the "rows" regime's zero-padded copy of an uneven last group
    and its discarded bf16 squares (``group_width``); 0 for equal groups, and where the
    copy goes into the row's squares tile (``squares_hold_h``)."""
    if not groups or n % groups == 0 or squares_hold_h(plan):
        return 0
    return group_width(n, groups) * (dtype_bytes(plan.h_dtype) + BFLOAT16_BYTES)


def squares_hold_h(plan: Plan) -> bool:
    """Whether the tile of discarded squares (``plan.squares_in``) holds h exactly: h's
    dtype, or fp32 (which holds bf16, fp16 and fp32 values exactly; the only 4-byte float).
    Where it does, the "rows" regime copies an uneven last group there
    (``steps.grouped_sum``)."""
    if plan.squares_in == "product":
        squares = plan.product_dtype
    elif plan.squares_in == "y":
        squares = plan.result_dtype
    else:
        # a bf16 scratch tile: rare (a result in neither fp32 nor bf16), not used
        return False
    return squares == plan.h_dtype or dtype_bytes(squares) == FLOAT32_BYTES


def group_width(n: int, groups: int) -> int:
    """Columns of each of the first ``groups`` − 1 column groups of a row of ``n`` (all of
    them when ``groups`` divides n): ⌈n / groups⌉, the last group taking the n − (groups −
    1)·width columns left (odd n, whose rows have no equal power-of-two groups; the "split"
    regime holds that last group on its own partitions, zero-padded to ``width``, and the
    "rows" regime sums it from the same zero-padded columns, so both run the same
    instructions on the same values)."""
    return -(-n // groups)


def spread_segments(n: int, m: int) -> int:
    """Segments per row of the "spread" regime for m rows of n: the largest power of two
    dividing n that puts the m rows on at most 128 partitions (the tensors are viewed as
    (m·s, n / s))."""
    segments = 1
    for _ in range(7):
        if n % (2 * segments) == 0 and 2 * segments * m <= PMAX:
            segments = 2 * segments
    return segments


def packed_takes_heads(h_dtype_bytes: int, n: int, heads: int) -> bool:
    """Whether the "packed" regime takes a per-head weight (heads, n) for rows of h in a
    dtype of ``h_dtype_bytes`` bytes: rows of at most ``PACKED_MAX_ROW_BYTES`` and
    at most ``PACKED_MAX_HEAD_BANKS`` banks of whole heads (:func:`max_heads`)."""
    return n * h_dtype_bytes <= PACKED_MAX_ROW_BYTES and heads <= max_heads(n)


def max_heads(n: int) -> int:
    """The most heads of n a per-head weight may have: ``PACKED_MAX_HEAD_BANKS`` PSUM banks
    of ``PSUM_COLS // n`` heads each."""
    return PACKED_MAX_HEAD_BANKS * max(1, PSUM_COLS // n)


def weight_heads(plan: Plan, weight_shape, m: int, n: int) -> int:
    """The heads of a weight of ``weight_shape`` for (m, n) rows: 1 for (n,) (or no weight,
    None); ``heads`` for a per-head (heads, n), which the "packed" regime alone takes
    (:func:`packed_takes_heads`) and whose rows are tokens × heads (heads divides m)."""
    if weight_shape is None or len(weight_shape) == 1:
        return 1
    heads = weight_shape[0]
    kernel_assert(
        len(weight_shape) == 2 and weight_shape[1] == n and heads >= 1 and m % heads == 0,
        "a per-head weight must be (heads, N) with heads dividing the rows (tokens x heads)",
    )
    kernel_assert(
        packed_takes_heads(dtype_bytes(plan.h_dtype), n, heads),
        "a per-head weight (heads, N) needs N * bytes(h) <= "
        + str(PACKED_MAX_ROW_BYTES)
        + " and heads <= "
        + str(PACKED_MAX_HEAD_BANKS)
        + " * (512 // N)",
    )
    return heads


def packed_rows_per_partition(
    plan: Plan, m: int, n: int, budget: int, cores: int = 1, heads: int = 1
) -> int:
    """Rows per partition of the "packed" regime: the largest k dividing m (the kernel
    views the rows as (m / k, k·n)) whose tile moves at most ``PACKED_TILE_BYTES`` of x per
    partition, leaves ``PACKED_MIN_TILES`` tiles per core and fits SBUF; with a per-head
    weight, k is a multiple of ``heads`` (m is one: tokens × heads), so that every
    partition's row j is of head j mod heads."""
    target = max(heads, PACKED_TILE_BYTES // (n * dtype_bytes(plan.in_dtype)))
    tiles = max(heads, m // (PMAX * cores * PACKED_MIN_TILES))
    rows = heads
    for k in range(2 * heads, target + 1, heads):
        if k <= tiles and m % k == 0 and plan.packed_bytes(n, k) <= budget:
            rows = k
    return rows


def _more_rows_help(
    plan: Plan, m: int, n: int, rows: int, budget: int, cores: int = 1, min_tiles: int = MIN_TILES
) -> bool:
    """Whether tiles of ``rows`` rows per partition are still worth it: they move at most
    ``TILE_TARGET_BYTES`` per partition, leave ``min_tiles`` tiles per core to pipeline, fit SBUF,
    one instruction and one PSUM bank of transposed rstd, and divide m (the kernel views
    the rows as (m / rows, rows·n))."""
    pmax = PMAX
    # The transposed rstd pieces are one PSUM tile of rows·128 elements per partition: at
    # most psum_fmax = 512 whatever the dtype (general/nki/programming_model.rst@8a38e733,
    # lines 346-347), and one 2 KiB bank.
    transposed = rows * pmax * (2 if plan.rstd_pieces == 3 else 4)
    return (
        m % rows == 0
        and rows * pmax <= PSUM_COLS
        and rows * n * dtype_bytes(plan.in_dtype) <= TILE_TARGET_BYTES
        and m >= min_tiles * pmax * rows * cores
        and rows * n <= MAX_FREE_ELEMENTS
        and transposed <= PSUM_COLS * 4
        and plan.fits_rows(n, rows, budget)
    )


def layout_bytes(plan: Plan, layout: Layout, n: int) -> int:
    """SBUF bytes per partition the planner budgets for ``layout`` of rows of ``n``."""
    if layout.regime == "rows":
        padded = layout.rows_per_partition * padded_group_bytes(plan, n, layout.groups)
        return plan.rows_bytes(n, layout.rows_per_partition) + padded
    if layout.regime == "split":
        return plan.split_bytes(group_width(n, layout.segments))
    if layout.regime == "spread":
        return plan.spread_bytes(n, layout.segments)
    if layout.regime == "packed":
        return plan.packed_bytes(n, layout.rows_per_partition)
    if layout.regime == "long":
        return plan.long_bytes(n, layout.output_chunk)
    return plan.two_pass_bytes(layout.chunk)


@dataclass(frozen=True)
class RowsResident(NKIObject):
    """On-chip tiles every row tile reads: the weight (broadcast across the partitions
    for the Vector engine, or the Tensor engine's moving row(s)); the broadcast bias; the
    transpose identity ("tensor") or the ones row that broadcasts the weight ("scalar")."""

    scale: object
    shift: object
    ident: object
    ones: object


@dataclass(frozen=True)
class RowViews(NKIObject):
    """The HBM tensors viewed as the rows of the regime's tiles: (M / k, k·N) with k rows
    per partition ("rows", rstd as (M / k, k)); (M·s, N / s), a row segment per partition
    ("split", rstd as (M, 1))."""

    x: object
    residual: object
    y: object
    h: object
    rstd: object
    y_transposed: object = None  # Tensors.y_transposed, stored by whole rows
