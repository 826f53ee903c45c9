"""RMSNorm backward in the NKI 0.6 dialect (``import nki``, Neuron SDK 2.31-2.32).

The same kernel as the legacy ``nki_rmsnorm.kernels.legacy.rmsnorm_bwd`` (see its module
docstring for the math, the engines, the tiling and the software pipeline): the same plan,
the same instructions on the same engines but for the differences below, the same HBM
traffic and the same numerics; only the instruction-emitting code differs, written to the
0.6 API (destination-first ``nki.isa`` calls without ``dtype``/``mask``, slices instead of
``nl.arange`` and masks, Python lists of tiles instead of block dimensions;
``nki/migration/index.rst@81ce03ae``).

Differences from the legacy code, all forced or allowed by 0.6:

* PSUM accumulation is explicit: every ``nc_matmul`` passes ``accumulate=`` (False for the
  first product into an element, True after), so the column-sum accumulators need no memset
  ("The first matmul targeting a PSUM location must use this overwrite mode",
  nki/api/nki/isa/__init__.py@81ce03ae, lines 538-547).
* LNC=2 (``kernel[2]`` on trn2/trn3): the row tiles (of ``128 / fold`` rows) are split in
  two halves (the first ``⌈T/2⌉`` row tiles, then the rest) and core ``nl.program_id(0)``
  runs one half; each core's column sums of dweight/dbias are exchanged with
  ``nisa.sendrecv`` (both cores of an LNC, ranks 0 and 1: nki/api/nki/isa/__init__.py@81ce03ae,
  lines 2971-2996) and every core adds the two halves (addition of two fp32 values is
  commutative, so both orders give the same bits) and stores its share of the column
  groups. Under LNC=1 the one core accumulates the two halves separately too (the first
  half's sums are copied to SBUF at the boundary, and the final sums add the halves instead
  of copying one accumulator), so dweight and dbias are bitwise the same at LNC=1 and
  LNC=2; dx is row-local and the row tiles start at the same rows either way.
* A per-head weight's w' tile (see the legacy docstring) is one DMA whose HBM source repeats
  the weight with a stride-0 outer dimension (``.ap``); the legacy kernel fills the tile by
  doubling on-chip copies.
* Kernel code is the NKI meta-language (nki/get-started/nki-language-guide.rst@81ce03ae
  L54-56): NKI dtypes, ``for``/``.append`` loops, ``assert`` checks, no NumPy; the fold masks
  are built on chip (GpSimd ``iota``, Vector compare and reductions) instead of NumPy arrays
  fed to ``nl.shared_constant``.

Both regimes are ported: the main one (rows on the partitions, folded over ``plan.fold``
partitions when too long for SBUF) here, the streamed one (rows that fit neither way) in
:mod:`nki_rmsnorm.kernels.nki06.rmsnorm_bwd_streamed`.
"""

from __future__ import annotations

from nki_rmsnorm.kernels.nki06._nki import nisa, nki, nl, usable_sbuf_bytes
from nki_rmsnorm.kernels.nki06.rmsnorm_bwd_streamed import (
    column_sum_partials,
    copy_column_sums,
    exchange_column_sums,
    streamed_backward,
)
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

#: ``sendrecv`` pipe of the LNC=2 column-sum exchange (any id both cores agree on).
COLUMN_SUM_PIPE = 0


@nki.jit
def rmsnorm_bwd(dy, x, weight, rstd, dh_out, offset, has_bias, casting_mode, bias_dtype=None):
    """RMSNorm backward, return convention: ``(dx,) + ((dweight,) if weight is not None) +
    ((dbias,) if has_bias)``, as the legacy kernel. The outputs are created at the kernel's
    top level as ``shared_hbm`` tensors (kernel outputs must be ``shared_hbm`` since NKI 0.3,
    nki/migration/index.rst@81ce03ae)."""
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
    """RMSNorm backward, output-parameter convention: writes ``dx`` and (when not None)
    ``dweight``/``dbias`` in place and returns nothing, as the legacy kernel."""
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
    """Write dx (and dweight / dbias when not None): the code both entry points share. Under
    LNC=2 core ``nl.program_id(0)`` takes one half of the row tiles. A 2-D weight
    ``(heads, N)`` is per head: row r is normalised with ``weight[r mod heads]`` and
    dweight is ``(heads, N)``, each head's column sums over its own rows."""
    M, N = x.shape
    # a kernel_assert-style check (AWS: nki-library@d2ad3a5
    # src/nkilib_src/nkilib/core/utils/kernel_assert.py L17); the bindings raise ValueError
    # before any launch
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
    n_tiles = -(-M // (nl.tile_size.pmax if plan is None else tile_rows(plan)))
    half = -(-n_tiles // 2)  # row tiles of the first half; the second has the rest
    halves = ((0, half), (half, n_tiles)) if n_tiles > 1 else ((0, n_tiles),)
    share = None  # this core runs every half and adds them itself
    idle = False
    if nl.num_programs(0) == 2 and len(halves) == 2:
        share = nl.program_id(0)
        halves = (halves[share],)
    elif nl.num_programs(0) == 2 and nl.program_id(0) == 1:
        idle = True  # one row tile: core 1 has no rows and nothing to add
    if not idle and plan is None:
        streamed_backward(
            dy, x, weight, rstd, dh_out, offset, casting_mode, dx, dweight, dbias, halves, share
        )
    elif not idle:
        _rows_backward(plan, dy, x, weight, rstd, dh_out, dx, dweight, dbias, offset, halves, share)


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


def _rows_backward(plan, dy, x, weight, rstd, dh_out, dx, dweight, dbias, offset, halves, share):
    """The pipelined backward over the row tiles ``halves[0][0] … halves[-1][1] − 1``.
    ``share``: None when this core runs every half (it adds them itself), else the core's
    index under LNC=2 (it exchanges its column sums with the other core)."""
    M, N = x.shape
    P = nl.tile_size.pmax
    f, L = plan.fold, plan.width
    R = tile_rows(plan)
    TP = R * f  # partitions of a full row tile
    t_first, t_end = halves[0][0], halves[-1][1]
    r0, r1 = t_first * R, min(M, t_end * R)
    rows = r1 - r0
    want_dweight, want_dbias = dweight is not None, dbias is not None
    consts = _constants(plan, rows, N, dy, weight, rstd[r0:r1], offset, want_dweight, want_dbias)
    # row r of the slice spreads over partitions r·f … r·f + f − 1 (a free HBM reshape)
    views = (
        _folded_view(dy, r0, r1, f, L),
        _folded_view(x, r0, r1, f, L),
        _folded_view(dx, r0, r1, f, L),
        _folded_view(dh_out, r0, r1, f, L),
    )
    rings = (
        _tiles(plan.ring, (P, plan.group), nl.float32),
        _tiles(plan.ring, (P, plan.group), x.dtype),
        _tiles(DY_SLOTS, (P, plan.group), dy.dtype),
    )
    n_slots = operand_slots(plan)
    slots = BwdTileSlots(
        rows=_tiles(n_slots, (plan.stationary_rows, plan.rstd_parts, P), nl.bfloat16),
        cols=_tiles(n_slots, (P, consts.table_cols.shape[2]), nl.float32),
        partials=_tiles(n_slots, (P, partial_columns(plan)), nl.float32),
        negk=_tiles(n_slots, (P, 1), nl.float32),
    )
    # with two halves on this core, the first half's column sums wait here (fp32, SBUF)
    accumulators = (consts.dweight_acc, consts.dbias_acc)
    used = _column_sum_columns(plan)
    first_half = None
    if share is None and len(halves) == 2:
        first_half = column_sum_partials(accumulators, used)
    # the tile (local index) where each half starts: its first products overwrite PSUM
    starts = []
    for h in range(len(halves)):
        starts.append(halves[h][0] - t_first)
    n_local = t_end - t_first
    final_outputs = (dweight, dbias) if share is None else (None, None)

    # Software pipeline: statistic pass of tile t next to the gradient pass of tile t − 1.
    for t in range(n_local + 1):
        tile = _tile_view(slots, t, TP, min(TP, rows * f - t * TP)) if t < n_local else None
        previous = _tile_view(slots, t - 1, TP, min(TP, rows * f - (t - 1) * TP)) if t > 0 else None
        row_dot = None
        if tile is not None:
            _load_tile_operands(consts, tile, t)
            if plan.row_dot_on_pe:  # Σ_j (dy·x)·w' of the tile's rows
                row_dot = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.psum)
        for g in range(plan.n_groups):
            if tile is None:
                _gradient_group(plan, views, rings, previous, t - 1, g)
            else:
                dy_g, dydx = _statistic_group(plan, consts, views, rings, tile, t, g, row_dot)
                if previous is not None:
                    _gradient_group(plan, views, rings, previous, t - 1, g)
                last = t == n_local - 1
                _column_sums_group(
                    plan,
                    consts,
                    tile,
                    g,
                    dy_g,
                    dydx,
                    t in starts,
                    final_outputs if last else (None, None),
                    first_half if last else None,
                )
        if tile is not None:
            if plan.row_dot_on_pe:
                _finish_row_dot(plan, tile, row_dot)
            else:
                _finish_statistic(plan, consts, tile)
            if first_half is not None and t + 1 in starts:
                copy_column_sums(accumulators, first_half, used)
    if share is not None:
        _exchange_and_store(plan, consts, dweight, dbias, share)


def _tiles(count, shape, dtype):
    """``count`` SBUF tiles of one shape and dtype, in a list (slots of a ring)."""
    tiles = []
    for _ in range(count):
        tiles.append(nl.ndarray(shape, dtype=dtype))
    return tiles


def _folded_view(t, r0, r1, f, L):
    """Rows r0 … r1 of the HBM tensor ``t`` (None passes through), row r on the f rows
    r·f … r·f + f − 1 of L columns."""
    if t is None:
        return None
    return t[r0:r1, :].reshape(((r1 - r0) * f, L))


def _exchange_and_store(plan, consts, dweight, dbias, core):
    """LNC=2: swap this core's column sums with the other core's (``sendrecv``), then store
    the groups ``g ≡ core (mod 2)`` of ``own + other``."""
    accumulators = (consts.dweight_acc, consts.dbias_acc)
    other = exchange_column_sums(accumulators, _column_sum_columns(plan), core, COLUMN_SUM_PIPE)
    for g in range(core, plan.n_groups, 2):
        if consts.dweight_acc is not None and dweight is not None and plan.heads > 0:
            _store_head_sums(plan, dweight, consts.dweight_acc, g, other[0])
        elif consts.dweight_acc is not None and dweight is not None:
            _store_column_sums(plan, dweight, consts.dweight_acc, g, other[0])
        if consts.dbias_acc is not None and dbias is not None:
            _store_column_sums(plan, dbias, consts.dbias_acc, g, other[1])


def _column_sum_columns(plan):
    """Accumulator columns in use: ``⌈G/128⌉ · fold`` per column group, or with a
    per-head weight one per column of the row (heads on the partitions)."""
    if plan.heads > 0:
        return plan.width
    return plan.n_groups * (-(-plan.group // nl.tile_size.pmax)) * plan.fold


# --- setup ---------------------------------------------------------------------------------
def _constants(plan, M, N, dy, weight, rstd, offset, want_dweight, want_dbias):
    f = plan.fold
    segments = column_segments(plan)
    # llama / none: dweight sums dy·round(x̂) unscaled; gemma: the moving operand is the
    # tile's rstd column (masked per fold segment or head), from the table
    dweight_moving = _fold_mask(segments, nl.float32) if want_dweight and plan.round_xhat else None
    dbias_moving = _fold_mask(f, dy.dtype) if want_dbias else None
    n_cols = 2 + (segments if (want_dweight and not plan.round_xhat and segments > 1) else 0)
    if plan.row_dot_on_pe:
        n_cols = 3  # −rstd³/N last (fold 1)
    table_rows, table_cols = _rstd_tables(plan, M, N, rstd, n_cols)
    return BwdConstants(
        fold_scratch=_fold_scratch(f),
        w_rows=None if plan.heads > 0 else _weight_rows(plan, N, weight, offset),
        w_lazy=weight if plan.kw == 1 and plan.heads == 0 else None,
        dweight_moving=dweight_moving,
        dbias_moving=dbias_moving,
        dweight_acc=_column_sum_accumulators(plan) if want_dweight else None,
        dbias_acc=_column_sum_accumulators(plan) if want_dbias else None,
        table_rows=table_rows,
        table_cols=table_cols,
        pe=_pe_constants(N, weight, offset) if plan.row_dot_on_pe else None,
        head_rows=_head_rows(plan, weight, offset) if plan.heads > 0 else None,
    )


def _head_rows(plan, weight, offset):
    """w' = weight[p mod heads] + offset in fp32 on partition p (``tile_rows`` partitions):
    one DMA whose source pattern repeats the (heads, N) weight ``128 // heads`` times (a
    stride-0 outer dimension over an HBM tensor, as AWS's attention backward loads its
    sinks: aws-neuron/nki-library@d2ad3a5 src/nkilib_src/nkilib/core/attention/
    attention_bwd.py L1362-1370; src and dst need equal element counts only:
    nki/api/nki/isa/__init__.py@81ce03ae L287-289), then shifted and widened once
    (Vector). One transfer: a DMA queue serves the transfers of one tensor in order."""
    P = nl.tile_size.pmax
    heads, N = weight.shape[0], weight.shape[1]
    R = heads * (P // heads)
    loaded = nl.ndarray((P, N), dtype=weight.dtype)
    nisa.dma_copy(dst=loaded[0:R, :], src=weight.ap(pattern=[[0, P // heads], [N, heads], [1, N]]))
    rows = nl.ndarray((P, N), dtype=nl.float32)
    nisa.tensor_scalar(dst=rows[0:R, :], data=loaded[0:R, :], op0=nl.add, operand0=float(offset))
    return rows


def _fold_scratch(f):
    """With a fold, a private HBM vector of P fp32 through which the segment sums of each
    row tile change layout (``_add_fold_segments``); None without one."""
    P = nl.tile_size.pmax
    return None if f == 1 else nl.ndarray((P,), dtype=nl.float32, buffer=nl.private_hbm)


def _fold_mask(f, dtype):
    """The (P, f) 0/1 mask ``[p mod f == h]`` in ``dtype``: an identity built on chip
    (GpSimd ``iota`` of column − partition, Vector compare with 0.0), then for each h the
    Vector sum of its columns h, h + f, … (a step slice: nki-language-guide.rst@81ce03ae
    L413-426). Exact: every sum has a single 1."""
    P = nl.tile_size.pmax
    offsets = nl.ndarray((P, P), dtype=nl.int32)
    nisa.iota(dst=offsets, pattern=[[1, P]], offset=0, channel_multiplier=-1)
    identity = nl.ndarray((P, P), dtype=nl.float32)
    nisa.tensor_scalar(dst=identity, data=offsets, op0=nl.equal, operand0=0.0)
    mask = nl.ndarray((P, f), dtype=dtype)
    for h in range(f):
        nisa.tensor_reduce(
            dst=mask[:, h : h + 1], op=nl.add, data=identity[:, h::f], axis=1, keepdims=True
        )
    return mask


def _bf16_parts(values):
    """Three bf16 tiles whose fp32 sum is ``values`` (fp32) to its last bit (Vector)."""
    shape = values.shape
    high = nl.ndarray(shape, dtype=nl.bfloat16)
    nisa.tensor_copy(dst=high, src=values)
    rest = nl.ndarray(shape, dtype=nl.float32)
    nisa.tensor_tensor(dst=rest, data1=values, data2=high, op=nl.subtract)
    middle = nl.ndarray(shape, dtype=nl.bfloat16)
    nisa.tensor_copy(dst=middle, src=rest)
    rest_low = nl.ndarray(shape, dtype=nl.float32)
    nisa.tensor_tensor(dst=rest_low, data1=rest, data2=middle, op=nl.subtract)
    low = nl.ndarray(shape, dtype=nl.bfloat16)
    nisa.tensor_copy(dst=low, src=rest_low)
    return [high, middle, low]


def _weight_rows(plan, N, weight, offset):
    """The moving operand of ``a = rstd · w'``: row (b, h) holds bf16 part b of w' over
    fold segment h (columns h·L … h·L + L − 1), once per stacked part of rstd (row
    (a·kw + b)·f + h, ``plan.rstd_parts == 1``). A bf16 weight is its own single part,
    loaded group by group by the first row tile."""
    f, L = plan.fold, plan.width
    rows = nl.ndarray((plan.stationary_rows, L), dtype=nl.bfloat16)
    if weight is None:
        nisa.memset(dst=rows, value=1.0)
    elif plan.kw > 1:
        # w' = weight + offset in fp32, split, on as many partitions as divide N
        lanes = 1
        for d in range(1, nl.tile_size.pmax + 1):
            if N % d == 0:
                lanes = d
        w = nl.load(weight.reshape((lanes, N // lanes)), dtype=nl.float32)
        shifted = nl.ndarray((lanes, N // lanes), dtype=nl.float32)
        nisa.tensor_scalar(dst=shifted, data=w, op0=nl.add, operand0=float(offset))
        parts = _bf16_parts(shifted)
        for a in range(plan.stationary_rows // (plan.kw * f)):
            for b in range(SPLIT):
                r0 = (a * plan.kw + b) * f
                nisa.dma_copy(dst=rows[r0 : r0 + f, :], src=parts[b])
    return rows


def _rstd_tables(plan, M, N, rstd, n_cols):
    """HBM tables, one entry per row tile: the stationary rows of ``a = rstd · w'`` (row
    (b, h) of part a: bf16 part a of rstd at the partitions of fold segment h, zero
    elsewhere) and the fp32 columns (rstd and −rstd²/N per partition; with a gemma fold also
    rstd masked per segment, the moving operand of dweight), built from rstd laid out with
    the row tiles on the partitions (no transposes)."""
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
    # rstd padded with zeros to whole row tiles, (tiles, R), as the legacy kernel does
    padded = nl.ndarray((n_tiles, R), dtype=nl.float32, buffer=nl.private_hbm)
    flat = padded.reshape((1, n_tiles * R))
    rstd_row = nl.ndarray((1, M), dtype=nl.float32)
    nisa.dma_copy(dst=rstd_row, src=rstd.reshape((1, M)))
    nisa.dma_copy(dst=flat[0:1, 0:M], src=rstd_row)
    if n_tiles * R > M:
        zeros = nl.zeros((1, n_tiles * R - M), dtype=nl.float32)
        nisa.dma_copy(dst=flat[0:1, M : n_tiles * R], src=zeros)
    for block in range(-(-n_tiles // P)):
        t0 = block * P
        nt = min(P, n_tiles - t0)
        r_t = nl.ndarray((nt, R), dtype=nl.float32)
        nisa.dma_copy(dst=r_t, src=padded[t0 : t0 + nt, :])
        if table_rows is not None:
            _store_stationary_rows(plan, table_rows, r_t, t0, nt)
        neg_scale = nl.ndarray((nt, R), dtype=nl.float32)
        nisa.scalar_tensor_tensor(
            dst=neg_scale,
            data=r_t,
            op0=nl.multiply,
            operand0=-1.0 / N,
            op1=nl.multiply,
            operand1=r_t,
        )
        cols = nl.zeros((nt, P, n_cols), dtype=nl.float32)
        if plan.heads > 0:  # one partition per row; rstd in the column of the row's head
            nisa.tensor_copy(dst=cols[:, 0:R, 0], src=r_t)
            nisa.tensor_copy(dst=cols[:, 0:R, 1], src=neg_scale)
            for h in range(n_cols - 2):
                nisa.tensor_copy(
                    dst=cols[:, h : R : plan.heads, 2 + h], src=r_t[:, h :: plan.heads]
                )
        for h in range(0 if plan.heads > 0 else f):
            nisa.tensor_copy(dst=cols[:, h::f, 0], src=r_t)
            nisa.tensor_copy(dst=cols[:, h::f, 1], src=neg_scale)
            if plan.row_dot_on_pe:
                neg_cube = nl.ndarray((nt, R), dtype=nl.float32)
                nisa.tensor_tensor(dst=neg_cube, data1=neg_scale, data2=r_t, op=nl.multiply)
                nisa.tensor_copy(dst=cols[:, :, 2], src=neg_cube)
            elif n_cols > 2:
                nisa.tensor_copy(dst=cols[:, h::f, 2 + h], src=r_t)
        nl.store(table_cols[t0 : t0 + nt], value=cols)
    return table_rows, table_cols


def _store_stationary_rows(plan, table_rows, r_t, t0, nt):
    """Row tiles t0 … t0 + nt − 1 of the stationary-rows table from their rstd ``r_t``."""
    P = nl.tile_size.pmax
    f, K = plan.fold, plan.stationary_rows
    rows = nl.zeros((nt, K, plan.rstd_parts, P), dtype=nl.bfloat16)
    parts = _bf16_parts(r_t)
    stacked = plan.rstd_parts == 1
    for a in range(SPLIT):
        for b in range(plan.kw):
            for h in range(f):
                row = ((a * plan.kw if stacked else 0) + b) * f + h
                part = 0 if stacked else a
                nisa.tensor_copy(dst=rows[:, row, part, h::f], src=parts[a])
    nl.store(table_rows[t0 : t0 + nt], value=rows)


def _pe_constants(N, weight, offset):
    """The constants of ``row_dot_on_pe`` (``PeConstants``): the fp32 identity the
    transposes move against, built on chip as in ``_fold_mask``, and w' + offset (fp32)
    with block b's 128 values down the partitions of column b (one strided DMA, the last
    partial block apart)."""
    P = nl.tile_size.pmax
    n_blocks = -(-N // P)
    offsets = nl.ndarray((P, P), dtype=nl.int32)
    nisa.iota(dst=offsets, pattern=[[1, P]], offset=0, channel_multiplier=-1)
    identity = nl.ndarray((P, P), dtype=nl.float32)
    nisa.tensor_scalar(dst=identity, data=offsets, op0=nl.equal, operand0=0.0)
    w_cols = nl.ndarray((P, n_blocks), dtype=nl.float32)
    if weight is None:
        nisa.memset(dst=w_cols, value=1.0)
    else:
        full, rest = N // P, N % P
        if rest:
            nisa.memset(dst=w_cols, value=0.0)  # the rows past N of the last block
            nisa.dma_copy(
                dst=w_cols[0:rest, full : full + 1],
                src=weight.ap(pattern=[[1, rest], [1, 1]], offset=full * P),
            )
        if full:
            nisa.dma_copy(dst=w_cols[:, 0:full], src=weight.ap(pattern=[[1, P], [P, full]]))
        if offset != 0.0:
            shifted = nl.ndarray((P, n_blocks), dtype=nl.float32)
            nisa.tensor_scalar(dst=shifted, data=w_cols, op0=nl.add, operand0=float(offset))
            w_cols = shifted
    return PeConstants(identity=identity, w_cols=w_cols)


def _column_sum_accumulators(plan):
    """fp32 PSUM banks for column sums, ``n_groups · ⌈G/128⌉ · fold`` columns in all (see
    ``_accumulate_column_sums``); not zeroed: the first products overwrite them."""
    banks = []
    for _ in range(-(-_column_sum_columns(plan) // PSUM_BANK_COLS)):
        banks.append(
            nl.ndarray((nl.tile_size.pmax, PSUM_BANK_COLS), dtype=nl.float32, buffer=nl.psum)
        )
    return banks


# --- the pipeline steps ---------------------------------------------------------------------
def _tile_view(slots, t, tile_partitions, p):
    slot = t % len(slots.negk)
    return BwdTile(
        v0=t * tile_partitions,
        p=p,
        rows=slots.rows[slot][:, :, 0:p],
        cols=slots.cols[slot][0:p, :],
        partials=slots.partials[slot][0:p, :],
        negk=slots.negk[slot][0:p, :],
    )


def _load_tile_operands(consts, tile, t):
    if consts.table_rows is not None:
        nisa.dma_copy(dst=tile.rows, src=consts.table_rows[t, :, :, 0 : tile.p])
    nisa.dma_copy(dst=tile.cols, src=consts.table_cols[t, 0 : tile.p, :])


def _group_slot(plan, rings, tile, t, g):
    p, g0 = tile.p, g * plan.group
    width = min(plan.group, plan.width - g0)
    slot = (t * plan.n_groups + g) % plan.ring
    return p, g0, width, rings[0][slot][0:p, 0:width], rings[1][slot][0:p, 0:width]


def _statistic_group(plan, consts, views, rings, tile, t, g, row_dot):
    """Statistic pass over column group g of row tile t (see the legacy kernel); with
    ``row_dot_on_pe`` the row dot goes to ``row_dot`` (``_row_dot_chunk``) instead of the
    group partials."""
    dy_v, x_v = views[0], views[1]
    p, g0, width, p1, xs = _group_slot(plan, rings, tile, t, g)
    dy_g = rings[2][(t * plan.n_groups + g) % DY_SLOTS][0:p, 0:width]
    nisa.dma_copy(dst=dy_g, src=dy_v[tile.v0 : tile.v0 + p, g0 : g0 + width])
    nisa.dma_copy(dst=xs, src=x_v[tile.v0 : tile.v0 + p, g0 : g0 + width])
    if t == 0 and consts.w_lazy is not None:
        f = plan.fold
        nisa.dma_copy(
            dst=consts.w_rows[0:f, g0 : g0 + width],
            src=consts.w_lazy.reshape((f, plan.width))[:, g0 : g0 + width],
        )
        for r0 in range(f, plan.stationary_rows, f):  # each further stacked part of rstd
            nisa.dma_copy(
                dst=consts.w_rows[r0 : r0 + f, g0 : g0 + width],
                src=consts.w_rows[0:f, g0 : g0 + width],
            )
    dydx = nl.ndarray((p, width), dtype=nl.float32)
    rounded = nl.ndarray((p, width), dtype=xs.dtype) if plan.round_xhat else None
    if plan.round_xhat:
        nisa.activation(dst=rounded, op=nl.copy, data=xs, scale=tile.cols[:, 0:1])
    p1x = nl.ndarray((p, width), dtype=nl.float32)
    for c in range(-(-width // CHUNK)):
        lo, hi = c * CHUNK, min(width, (c + 1) * CHUNK)
        if plan.heads > 0:
            a = _head_product(tile, consts.head_rows[0:p, g0 + lo : g0 + hi])
        else:
            a = _outer_product(tile.rows, consts.w_rows[:, g0 + lo : g0 + hi])
        # dy·x first, so that p1·x = (dy·x)·a does not read the output of the Vector
        # instruction just before it ("a static instruction overhead of 100 engine cycles":
        # nki/guides/architecture/trainium_inferentia2_arch.rst@81ce03ae, lines 402-403)
        if not plan.round_xhat:
            _dy_times_x(plan, dydx[:, lo:hi], dy_g[:, lo:hi], xs[:, lo:hi])
        nisa.tensor_tensor(dst=p1[:, lo:hi], data1=dy_g[:, lo:hi], data2=a, op=nl.multiply)
        if plan.round_xhat:  # dweight sums dy·round(x̂); p1·x is p1 times x itself
            nisa.tensor_tensor(
                dst=dydx[:, lo:hi], data1=dy_g[:, lo:hi], data2=rounded[:, lo:hi], op=nl.multiply
            )
            nisa.tensor_tensor(
                dst=p1x[:, lo:hi],
                data1=p1[:, lo:hi],
                data2=_psum_copy(xs[:, lo:hi]),
                op=nl.multiply,
            )
        elif row_dot is None:
            nisa.tensor_tensor(dst=p1x[:, lo:hi], data1=dydx[:, lo:hi], data2=a, op=nl.multiply)
        else:
            _row_dot_blocks(plan, consts.pe, tile, row_dot, dydx, a, p1x, g0, lo, hi)
    if row_dot is None:
        nisa.activation_reduce(
            dst=p1x,
            op=nl.copy,
            data=p1x,
            reduce_op=nl.add,
            reduce_res=tile.partials[:, g : g + 1],
        )
    return dy_g, dydx


def _row_dot_blocks(plan, pe, tile, row_dot, dydx, a, p1x, g0, lo, hi):
    """The row dot of the chunk ``lo:hi`` of column group ``g0``, block by block: each run of
    Tensor-engine blocks in one ``_row_dot_chunk``, each Vector-engine block
    (``vector_row_dot_block``) as ``p1·x = (dy·x)·a`` summed by the Scalar engine into its
    partial column (block index // n)."""
    for b0 in range(lo, hi, ROW_DOT_BLOCK):
        if vector_row_dot_block(plan, g0 + b0):
            b1 = min(hi, b0 + ROW_DOT_BLOCK)
            column = (g0 + b0) // (plan.vector_row_dot_every * ROW_DOT_BLOCK)
            nisa.tensor_tensor(
                dst=p1x[:, b0:b1],
                data1=dydx[:, b0:b1],
                data2=a[:, b0 - lo : b1 - lo],
                op=nl.multiply,
            )
            nisa.activation_reduce(
                dst=p1x[:, b0:b1],
                op=nl.copy,
                data=p1x[:, b0:b1],
                reduce_op=nl.add,
                reduce_res=tile.partials[:, column : column + 1],
            )
        elif b0 == lo or vector_row_dot_block(plan, g0 + b0 - ROW_DOT_BLOCK):
            end = tensor_row_dot_end(plan, g0 + b0, g0 + hi) - g0
            _row_dot_chunk(pe, row_dot, dydx[:, b0:end], g0 + b0, g0 + b0 == 0)


def _row_dot_chunk(pe, row_dot, dydx, col0, first):
    """``row_dot += Σ_j (dy·x)·w'`` over one chunk of columns starting at ``col0``, on the
    Tensor engine: each 128-column block of dy·x (fp32) transposed into PSUM with
    ``is_transpose`` (bit-accurate from NeuronCore-v3, NaN and Inf included, so nothing
    leaks between rows: nki/api/nki/isa/__init__.py@81ce03ae L558-564), copied to SBUF by
    the Scalar engine, then a matrix-vector product with w' (the block's column of
    ``w_cols``) summing over the columns of each row in fp32."""
    P = nl.tile_size.pmax
    p, width = dydx.shape[0], dydx.shape[1]
    n = -(-width // P)
    whole = width // P
    moved = nl.ndarray((P, n * p), dtype=nl.float32, buffer=nl.psum)
    for k in range(n):
        bw = min(P, width - k * P)
        nisa.nc_matmul(
            dst=moved[0:bw, k * p : (k + 1) * p],
            stationary=dydx[:, k * P : k * P + bw],
            moving=pe.identity[0:p, 0:p],
            is_transpose=True,
        )
    flipped = nl.ndarray((P, n * p), dtype=nl.float32)
    if whole:
        nisa.activation(dst=flipped[:, 0 : whole * p], op=nl.copy, data=moved[:, 0 : whole * p])
    if whole < n:
        bw = width - whole * P
        nisa.activation(
            dst=flipped[0:bw, whole * p : n * p], op=nl.copy, data=moved[0:bw, whole * p : n * p]
        )
    for k in range(n):
        bw, b = min(P, width - k * P), (col0 + k * P) // P
        nisa.nc_matmul(
            dst=row_dot[0:p, :],
            stationary=flipped[0:bw, k * p : (k + 1) * p],
            moving=pe.w_cols[0:bw, b : b + 1],
            accumulate=not (first and k == 0),
        )


def _finish_row_dot(plan, tile, row_dot):
    """``−k = −rstd³/N · Σ_j (dy·x)·w'`` per partition (Scalar engine), plus
    ``−rstd²/N · Σ p1·x`` of the Vector-engine blocks (``vector_row_dot_every``) as the
    bias."""
    bias = None
    if has_vector_row_dot(plan):
        bias = nl.ndarray((tile.p, 1), dtype=nl.float32)
        nisa.activation_reduce(
            dst=tile.partials,
            op=nl.copy,
            data=tile.partials,
            reduce_op=nl.add,
            reduce_res=bias,
            scale=tile.cols[:, 1:2],
        )
    nisa.activation(
        dst=tile.negk,
        op=nl.copy,
        data=row_dot[0 : tile.p, :],
        bias=bias,
        scale=tile.cols[:, 2:3],
    )


def _psum_copy(values):
    """``values`` copied to an fp32 PSUM tile by the Scalar engine (see the legacy kernel)."""
    copy = nl.ndarray(values.shape, dtype=nl.float32, buffer=nl.psum)
    nisa.activation(dst=copy, op=nl.copy, data=values)
    return copy


def _dy_times_x(plan, dst, dy_c, x_c):
    """``dst = dy·x`` of a chunk in fp32 on the Vector engine: against x copied into PSUM
    (``plan.x_from_psum``), else from SBUF as
    ``(dy − 0)·x``, a ``scalar_tensor_tensor`` (see the legacy kernel)."""
    if plan.x_from_psum:
        nisa.tensor_tensor(dst=dst, data1=dy_c, data2=_psum_copy(x_c), op=nl.multiply)
    else:
        nisa.scalar_tensor_tensor(
            dst=dst, data=dy_c, op0=nl.subtract, operand0=0.0, op1=nl.multiply, operand1=x_c
        )


def _outer_product(rstd_rows, w_rows):
    """``a = rstd ⊗ w'`` for one chunk into PSUM: one matmul per bf16 part of rstd, the
    first overwriting and the others accumulating in fp32."""
    a = nl.ndarray((rstd_rows.shape[2], w_rows.shape[1]), dtype=nl.float32, buffer=nl.psum)
    for part in range(rstd_rows.shape[1]):
        nisa.nc_matmul(dst=a, stationary=rstd_rows[:, part, :], moving=w_rows, accumulate=part > 0)
    return a


def _head_product(tile, w_rows):
    """``a = rstd · w'`` of a per-head weight for one chunk into PSUM: each partition's w'
    row (its head's) scaled by its rstd on the Scalar engine; no matmul, so a non-finite
    weight stays in its head's rows."""
    a = nl.ndarray(w_rows.shape, dtype=nl.float32, buffer=nl.psum)
    nisa.activation(dst=a, op=nl.copy, data=w_rows, scale=tile.cols[:, 0:1])
    return a


def _finish_statistic(plan, consts, tile):
    """``−k = −rstd²/N · s`` per partition once all groups of the tile are summed (Scalar
    engine); with a fold the segment sums of a row are added next."""
    segment_negk = tile.negk if plan.fold == 1 else nl.ndarray((tile.p, 1), dtype=nl.float32)
    nisa.activation_reduce(
        dst=tile.partials,
        op=nl.copy,
        data=tile.partials,
        reduce_op=nl.add,
        reduce_res=segment_negk,
        scale=tile.cols[:, 1:2],
    )
    if plan.fold > 1:
        _add_fold_segments(tile.negk, segment_negk, tile.p, plan.fold, consts.fold_scratch)


def _add_fold_segments(out, s, p, f, scratch):
    """Write into ``out`` the row sums of the per-partition sums ``s`` (p, 1), repeated on
    the f partitions of each row. The layout changes through the HBM ``scratch`` (P fp32),
    as in the legacy kernel: s stored as a column, loaded back with the f segments of a row
    on one partition (rows, f); the Vector engine adds them and copies the sum into each of
    the f columns (no broadcast view: ``NkiTensor.broadcast`` exists from NKI 0.5 only,
    release-notes/components/nki.rst@81ce03ae L127-132); stored, and loaded back as a
    column."""
    P = nl.tile_size.pmax
    rows = p // f
    column = scratch.reshape((P, 1))
    by_row = scratch.reshape((P // f, f))
    nisa.dma_copy(dst=column[0:p, :], src=s)
    segments = nl.ndarray((rows, f), dtype=nl.float32)
    nisa.dma_copy(dst=segments, src=by_row[0:rows, :])
    total = nl.ndarray((rows, 1), dtype=nl.float32)
    nisa.tensor_reduce(dst=total, op=nl.add, data=segments, axis=1, keepdims=True)
    repeated = nl.ndarray((rows, f), dtype=nl.float32)
    for h in range(f):
        nisa.tensor_copy(dst=repeated[:, h : h + 1], src=total)
    nisa.dma_copy(dst=by_row[0:rows, :], src=repeated)
    nisa.dma_copy(dst=out, src=column[0:p, :])


def _gradient_group(plan, views, rings, tile, t, g):
    """Gradient pass over column group g of row tile t: dx = p1 − k·x (+ dh_out)."""
    dx_v, dh_v = views[2], views[3]
    p, g0, width, p1, xs = _group_slot(plan, rings, tile, t, g)
    out_dtype = xs.dtype if dh_v is None else nl.float32
    dx_g = nl.ndarray((p, width), dtype=out_dtype)
    for c in range(-(-width // CHUNK)):
        lo, hi = c * CHUNK, min(width, (c + 1) * CHUNK)
        kx = nl.ndarray((p, hi - lo), dtype=nl.float32, buffer=nl.psum)
        nisa.activation(dst=kx, op=nl.copy, data=xs[:, lo:hi], scale=tile.negk)
        nisa.tensor_tensor(dst=dx_g[:, lo:hi], data1=p1[:, lo:hi], data2=kx, op=nl.add)
    dx_dst = dx_v[tile.v0 : tile.v0 + p, g0 : g0 + width]
    if dh_v is None:
        nl.store(dx_dst, value=dx_g)
    else:  # + dh_out (Vector engine, from SBUF), rounded once
        dh_g = nl.load(dh_v[tile.v0 : tile.v0 + p, g0 : g0 + width])
        total = nl.ndarray((p, width), dtype=xs.dtype)
        nisa.tensor_tensor(dst=total, data1=dx_g, data2=dh_g, op=nl.add)
        nl.store(dx_dst, value=total)


def _accumulate_head_sums(plan, acc, data, moving, g, first):
    """A per-head weight's ``acc[h, j] += Σ_rows moving[row, h] · data[row, j]`` for column
    group g (``data`` (p, width)): the (rows, heads) operand stationary and the data moving,
    one matmul per PSUM bank of columns, so that head h's sums of column j land on partition
    h, column j (a row of dweight per partition, stored whole)."""
    g0, width = g * plan.group, data.shape[1]
    heads = moving.shape[1]
    for lo in range(0, width, CHUNK):
        hi = min(width, lo + CHUNK)
        bank, c = (g0 + lo) // PSUM_BANK_COLS, (g0 + lo) % PSUM_BANK_COLS
        nisa.nc_matmul(
            dst=acc[bank][0:heads, c : c + hi - lo],
            stationary=moving,
            moving=data[:, lo:hi],
            accumulate=not first,
        )


def _store_head_sums(plan, dst, acc, g, other):
    """Round a per-head weight's sums of column group g (plus ``other``'s, the other half's
    fp32 sums in SBUF, when given) to ``dst``'s dtype once (Vector) and store them: dst
    (heads, N), one row per accumulator partition, one DMA per PSUM bank."""
    heads, g0 = dst.shape[0], g * plan.group
    width = min(plan.group, plan.width - g0)
    for lo in range(0, width, CHUNK):
        hi = min(width, lo + CHUNK)
        bank, c = (g0 + lo) // PSUM_BANK_COLS, (g0 + lo) % PSUM_BANK_COLS
        rounded = nl.ndarray((heads, hi - lo), dtype=dst.dtype)
        if other is None:
            nisa.tensor_copy(dst=rounded, src=acc[bank][0:heads, c : c + hi - lo])
        else:
            nisa.tensor_tensor(
                dst=rounded,
                data1=acc[bank][0:heads, c : c + hi - lo],
                data2=other[0:heads, g0 + lo : g0 + hi],
                op=nl.add,
            )
        nl.store(dst[:, g0 + lo : g0 + hi], value=rounded)


# --- parameter gradients --------------------------------------------------------------------
def _column_sums_group(plan, consts, tile, g, dy_g, dydx, first, outputs, first_half):
    """dweight and dbias column sums of group g of a row tile; ``first``: the tile starts a
    half (its products overwrite the accumulator); with ``outputs`` (the last row tile of a
    core that adds its own halves) the group's sums are final and stored at once."""
    p = tile.p
    dweight, dbias = outputs[0], outputs[1]
    halves = first_half if first_half is not None else (None, None)
    if consts.dweight_acc is not None:
        moving = (
            consts.dweight_moving[0:p, :]
            if consts.dweight_moving is not None
            else tile.cols[:, 0:1]
            if column_segments(plan) == 1
            else tile.cols[:, 2:]
        )
        if plan.heads > 0:
            _accumulate_head_sums(plan, consts.dweight_acc, dydx, moving, g, first)
        else:
            _accumulate_column_sums(plan, consts.dweight_acc, dydx, moving, g, first)
        if dweight is not None and plan.heads > 0:
            _store_head_sums(plan, dweight, consts.dweight_acc, g, halves[0])
        elif dweight is not None:
            _store_column_sums(plan, dweight, consts.dweight_acc, g, halves[0])
    if consts.dbias_acc is not None:
        _accumulate_column_sums(plan, consts.dbias_acc, dy_g, consts.dbias_moving[0:p, :], g, first)
        if dbias is not None:
            _store_column_sums(plan, dbias, consts.dbias_acc, g, halves[1])


def _accumulate_column_sums(plan, acc, data, moving, g, first):
    """``acc += dataᵀ · moving`` for column group g (``data`` (p, width)): the Tensor engine
    sums the partitions (rows), weighted by the moving columns (rstd and/or the fold-segment
    mask, one output column per segment h). Set b takes every n-th column of the group
    (n = ⌈width / 128⌉), so accumulator partition m collects the group's columns
    m·n … m·n + n − 1. Accumulator column ((g·⌈G/128⌉) + b)·fold + h."""
    P = nl.tile_size.pmax
    f = plan.fold
    width = data.shape[1]
    n = -(-width // P)
    for b in range(n):
        count = -(-(width - b) // n)
        column = (g * (-(-plan.group // P)) + b) * f
        bank, c = column // PSUM_BANK_COLS, column % PSUM_BANK_COLS
        nisa.nc_matmul(
            dst=acc[bank][0:count, c : c + f],
            stationary=data[:, b::n],
            moving=moving,
            accumulate=not first,
        )


def _store_column_sums(plan, dst, acc, g, other):
    """Round the column sums of group g (plus ``other``'s, the other half's fp32 sums in
    SBUF, when given) to ``dst``'s dtype once (Vector) and store them, one DMA per fold
    segment h: accumulator partition m, set b is ``dst[h·L + g·G + m·n + b]``. A group
    narrower than 128·n has ``width // n`` full partitions and one partial one, stored
    separately."""
    P = nl.tile_size.pmax
    f, L, G = plan.fold, plan.width, plan.group
    width = min(G, L - g * G)
    n = -(-width // P)
    column = g * (-(-G // P)) * f
    bank, c0 = column // PSUM_BANK_COLS, column % PSUM_BANK_COLS
    rounded = nl.ndarray((P, n * f), dtype=dst.dtype)  # column b·f + h: set b, segment h
    if other is None:
        nisa.tensor_copy(dst=rounded, src=acc[bank][:, c0 : c0 + n * f])
    else:
        k0 = bank * PSUM_BANK_COLS + c0
        nisa.tensor_tensor(
            dst=rounded,
            data1=acc[bank][:, c0 : c0 + n * f],
            data2=other[:, k0 : k0 + n * f],
            op=nl.add,
        )
    full, rest = width // n, width % n
    for h in range(f):
        g0 = h * L + g * G
        if full:
            nl.store(dst[g0 : g0 + full * n].reshape((full, n)), value=rounded[0:full, h::f])
        if rest:
            nl.store(
                dst[g0 + full * n : g0 + width].reshape((1, rest)),
                value=rounded[full : full + 1, h : h + (rest - 1) * f + 1 : f],
            )
