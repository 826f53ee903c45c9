"""RMSNorm backward, streamed regime, in the NKI 0.6 dialect: rows that neither fit SBUF nor
fold evenly (see the legacy ``nki_rmsnorm.kernels.legacy.rmsnorm_bwd_streamed`` for the
math, the tiling, the residency rules and the engines; the plan is the same,
:func:`nki_rmsnorm.plan.backward.make_streamed_plan`).

Differences from the legacy code, forced or allowed by 0.6:

* The weight's partition broadcast is spelled out as the Tensor-engine idiom (a ones row as
  the stationary, the weight row as the moving operand, one 512-column PSUM bank per
  matmul), copied to SBUF by the Vector engine: what the
  legacy ``broadcast_to`` of a row wider than one bank costs in the model.
* Chunks of resident rows are loaded straight into them (one DMA each).
* PSUM accumulation is explicit (``accumulate=``), so the accumulators need no memset.
* LNC=2 and the two row halves: as the main regime (``rmsnorm_bwd``), the column sums of
  each half are kept apart and added once, so dweight and dbias do not depend on LNC.
"""

from __future__ import annotations

from nki_rmsnorm.kernels.nki06._nki import nisa, nl, usable_sbuf_bytes
from nki_rmsnorm.plan.backward import (
    CHUNK_COLS,
    PSUM_BANK_COLS,
    StreamedInputs,
    StreamedParamGrads,
    make_streamed_plan,
)

#: ``sendrecv`` pipe of the LNC=2 column-sum exchange.
COLUMN_SUM_PIPE = 1


def streamed_backward(
    dy, x, weight, rstd, dh_out, offset, casting_mode, dx, dweight, dbias, halves, share
):
    """Write ``dx`` of the row tiles ``halves[0][0] … halves[-1][1] − 1`` (128 rows each)
    and, as ``rmsnorm_bwd``'s main regime does, the column sums: ``share`` None when this
    core runs every half, else its index under LNC=2."""
    M, N = x.shape
    P = nl.tile_size.pmax
    plan = make_streamed_plan(
        N,
        x.dtype,
        dy.dtype,
        None if weight is None else weight.dtype,
        casting_mode,
        usable_sbuf_bytes(),
    )
    ones_w = None if weight is None else _ones_row(weight.dtype)
    w_all = _broadcast_weight(weight, ones_w) if plan.weight_resident else None
    inputs = StreamedInputs(
        dy=dy,
        x=x,
        weight=weight,
        w_all=w_all,
        rstd=rstd.reshape((M, 1)),
        dh_out=dh_out,
        offset=offset,
    )
    grads = StreamedParamGrads(
        dweight=_column_sum_accumulators(N) if dweight is not None else None,
        dbias=_column_sum_accumulators(N) if dbias is not None else None,
        ones_f32=nl.ones((P, 1), dtype=nl.float32),
        ones_dy=nl.ones((P, 1), dtype=dy.dtype),
    )
    blocks = -(-N // P)
    accumulators = (grads.dweight, grads.dbias)
    first_half = (
        column_sum_partials(accumulators, blocks) if share is None and len(halves) == 2 else None
    )
    starts = []
    for h in range(len(halves)):
        starts.append(halves[h][0])
    for t in range(halves[0][0], halves[-1][1]):
        r0 = t * P
        _row_tile(plan, inputs, grads, dx, r0, min(P, M - r0), t in starts, ones_w)
        if first_half is not None and t + 1 in starts:
            copy_column_sums(accumulators, first_half, blocks)
    n_banks = _bank_count(N)
    if dweight is None and dbias is None:
        n_banks = 0
    # LNC=2: core c stores banks ≡ c (mod 2) of both halves' sums
    first_bank = 0 if share is None else share
    bank_step = 1 if share is None else 2
    other = first_half if first_half is not None else (None, None)
    if share is not None:
        other = exchange_column_sums(accumulators, blocks, share, COLUMN_SUM_PIPE)
    for bank in range(first_bank, n_banks, bank_step):
        if dweight is not None:
            _store_column_sums(dweight, grads.dweight, bank, other[0])
        if dbias is not None:
            _store_column_sums(dbias, grads.dbias, bank, other[1])


def _bank_count(N):
    """PSUM banks of one column-sum accumulator: a column per 128 columns of the row."""
    blocks = -(-N // nl.tile_size.pmax)
    return -(-blocks // PSUM_BANK_COLS)


def _row_tile(plan, inputs, grads, dx, r0, rows, first, ones_w):
    """Both passes over rows r0 … r0+rows (one per partition), chunk by chunk; ``first``:
    the tile starts a half (its column sums overwrite the accumulators)."""
    N = inputs.x.shape[1]
    rstd_t = nl.load(inputs.rstd[r0 : r0 + rows, :], dtype=nl.float32)
    dy_row = nl.ndarray((rows, N), dtype=inputs.dy.dtype) if plan.rows_resident else None
    x_row = nl.ndarray((rows, N), dtype=inputs.x.dtype) if plan.rows_resident else None
    partials = nl.ndarray((rows, plan.n_chunks), dtype=nl.float32)
    for c in range(plan.n_chunks):
        c0 = c * CHUNK_COLS
        _statistic_chunk(
            plan,
            inputs,
            grads,
            r0,
            rows,
            c0,
            min(CHUNK_COLS, N - c0),
            rstd_t,
            dy_row,
            x_row,
            partials[:, c : c + 1],
            first,
            ones_w,
        )
    # k = rstd · mean(g·x̂), so that dx = rstd · (g − x·k).
    g_xhat_sum = partials
    if plan.n_chunks > 1:
        g_xhat_sum = nl.ndarray((rows, 1), dtype=nl.float32)
        nisa.tensor_reduce(dst=g_xhat_sum, op=nl.add, data=partials, axis=1, keepdims=True)
    k = nl.ndarray((rows, 1), dtype=nl.float32)
    nisa.tensor_scalar(
        dst=k, data=g_xhat_sum, op0=nl.multiply, operand0=rstd_t, op1=nl.multiply, operand1=1.0 / N
    )
    for c in range(plan.n_chunks):
        c0 = c * CHUNK_COLS
        _gradient_chunk(
            inputs, dx, r0, rows, c0, min(CHUNK_COLS, N - c0), rstd_t, k, dy_row, x_row, ones_w
        )


def _statistic_chunk(
    plan, inputs, grads, r0, rows, c0, width, rstd_t, dy_row, x_row, partial_col, first, ones_w
):
    """Pass 1 on one chunk: Σ g·x̂ into ``partial_col``; the dweight / dbias column sums."""
    dy_c = _load_chunk(inputs.dy, dy_row, r0, rows, c0, width)
    x_c = _load_chunk(inputs.x, x_row, r0, rows, c0, width)
    dy_xhat = nl.ndarray((rows, width), dtype=nl.float32)
    nisa.scalar_tensor_tensor(
        dst=dy_xhat, data=x_c, op0=nl.multiply, operand0=rstd_t, op1=nl.multiply, operand1=dy_c
    )
    _row_sum_g_xhat(
        dy_xhat, _weight_chunk(inputs, rows, c0, width, ones_w), inputs.offset, partial_col
    )
    if grads.dweight is not None:
        dw_terms = _dy_times_rounded_xhat(dy_c, x_c, rstd_t) if plan.round_xhat else dy_xhat
        _accumulate_column_sums(grads.dweight, dw_terms, grads.ones_f32, c0, first)
    if grads.dbias is not None:
        _accumulate_column_sums(grads.dbias, dy_c, grads.ones_dy, c0, first)


def _gradient_chunk(inputs, dx, r0, rows, c0, width, rstd_t, k, dy_row, x_row, ones_w):
    """Pass 2 on one chunk: dx from the resident rows (or loaded again), stored."""
    dy_c = _resident_or_loaded(inputs.dy, dy_row, r0, rows, c0, width)
    x_c = _resident_or_loaded(inputs.x, x_row, r0, rows, c0, width)
    dh_c = _resident_or_loaded(inputs.dh_out, None, r0, rows, c0, width)
    dx_c = _dx_chunk(
        dy_c,
        x_c,
        _weight_chunk(inputs, rows, c0, width, ones_w),
        dh_c,
        inputs.offset,
        rstd_t,
        k,
        inputs.x.dtype,
    )
    nl.store(dx[r0 : r0 + rows, c0 : c0 + width], value=dx_c)


def _resident_or_loaded(src, resident_row, r0, rows, c0, width):
    """Columns c0 … c0+width of a chunk for pass 2: the resident row's slice, else loaded
    from ``src`` (None for an absent ``src``)."""
    if src is None:
        return None
    if resident_row is not None:
        return resident_row[:, c0 : c0 + width]
    return _load_chunk(src, None, r0, rows, c0, width)


def _load_chunk(src, resident_row, r0, rows, c0, width):
    """Columns c0 … c0+width of rows r0 … r0+rows of ``src`` (DMA), into the resident row
    buffer's slice when one is given."""
    if resident_row is None:
        return nl.load(src[r0 : r0 + rows, c0 : c0 + width])
    chunk = resident_row[:, c0 : c0 + width]
    nisa.dma_copy(dst=chunk, src=src[r0 : r0 + rows, c0 : c0 + width])
    return chunk


def _ones_row(dtype):
    """A (1, 128) ones row in ``dtype``: the stationary operand of partition broadcasts."""
    ones = nl.ndarray((1, nl.tile_size.pmax), dtype=dtype)
    nisa.memset(dst=ones, value=1.0)
    return ones


def _broadcast_row(dst, row, ones_w):
    """``dst`` (rows, width) = the (1, width) SBUF ``row`` on every partition: ones ⊗ row on
    the Tensor engine (exact: one product by 1 per element), one PSUM bank at a time, copied
    out by the Vector engine."""
    rows, width = dst.shape
    for lo in range(0, width, PSUM_BANK_COLS):
        hi = min(width, lo + PSUM_BANK_COLS)
        spread = nl.ndarray((rows, hi - lo), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(
            dst=spread, stationary=ones_w[:, 0:rows], moving=row[:, lo:hi], accumulate=False
        )
        nisa.tensor_copy(dst=dst[:, lo:hi], src=spread)


def _broadcast_weight(weight, ones_w):
    """The weight replicated on every partition, (P, N) in its own dtype, chunk by chunk."""
    P = nl.tile_size.pmax
    N = weight.shape[0]
    w_row = weight.reshape((1, N))
    w_all = nl.ndarray((P, N), dtype=weight.dtype)
    for c0 in range(0, N, CHUNK_COLS):
        width = min(CHUNK_COLS, N - c0)
        _broadcast_row(w_all[:, c0 : c0 + width], nl.load(w_row[0:1, c0 : c0 + width]), ones_w)
    return w_all


def _weight_chunk(inputs, rows, c0, width, ones_w):
    """Columns c0 … c0+width of the weight on ``rows`` partitions (None without a weight): a
    slice of the resident broadcast, or loaded and broadcast here when it does not stay."""
    if inputs.weight is None:
        return None
    if inputs.w_all is not None:
        return inputs.w_all[0:rows, c0 : c0 + width]
    w_row = inputs.weight.reshape((1, inputs.weight.shape[0]))
    w_c = nl.ndarray((rows, width), dtype=inputs.weight.dtype)
    _broadcast_row(w_c, nl.load(w_row[0:1, c0 : c0 + width]), ones_w)
    return w_c


def _scaled_grad(dy_c, w_c, offset):
    """``g = (w + offset) · dy`` in fp32 (Vector); ``dy`` itself without a weight."""
    if w_c is None:
        return dy_c
    g = nl.ndarray(dy_c.shape, dtype=nl.float32)
    nisa.scalar_tensor_tensor(
        dst=g, data=w_c, op0=nl.add, operand0=float(offset), op1=nl.multiply, operand1=dy_c
    )
    return g


def _row_sum_g_xhat(dy_xhat, w_c, offset, partial_col):
    """``partial_col = Σ_chunk (w + offset)·(dy·x̂)``: the product on the Vector engine, the
    row sum by the Scalar engine's reduction (an fp32 identity ``activation``)."""
    g_xhat = _scaled_grad(dy_xhat, w_c, offset)
    nisa.activation_reduce(
        dst=g_xhat, op=nl.copy, data=g_xhat, reduce_op=nl.add, reduce_res=partial_col
    )


def _dy_times_rounded_xhat(dy_c, x_c, rstd_t):
    """``dy · round(x̂)`` in fp32 for llama/none mode (Scalar, then Vector)."""
    xhat_rounded = nl.ndarray(x_c.shape, dtype=x_c.dtype)
    nisa.activation(dst=xhat_rounded, op=nl.copy, data=x_c, scale=rstd_t)
    product = nl.ndarray(x_c.shape, dtype=nl.float32)
    nisa.tensor_tensor(dst=product, data1=dy_c, data2=xhat_rounded, op=nl.multiply)
    return product


def _dx_chunk(dy_c, x_c, w_c, dh_c, offset, rstd_t, k, out_dtype):
    """``dx = rstd · (g − x·k) (+ dh_out)`` for one chunk, rounded once to ``out_dtype``."""
    shape = x_c.shape
    t = nl.ndarray(shape, dtype=nl.float32)
    nisa.scalar_tensor_tensor(
        dst=t,
        data=x_c,
        op0=nl.multiply,
        operand0=k,
        op1=nl.subtract,
        operand1=_scaled_grad(dy_c, w_c, offset),
        reverse1=True,
    )
    dx_c = nl.ndarray(shape, dtype=out_dtype)
    if dh_c is None:
        nisa.activation(dst=dx_c, op=nl.copy, data=t, scale=rstd_t)
    else:
        nisa.scalar_tensor_tensor(
            dst=dx_c, data=t, op0=nl.multiply, operand0=rstd_t, op1=nl.add, operand1=dh_c
        )
    return dx_c


def _column_sum_accumulators(N):
    """fp32 PSUM banks (P, 512) holding the column sums of an (M, N) operand: column j
    (bank j // 512, column j % 512) accumulates the 128 columns 128·j … 128·j + 127."""
    P = nl.tile_size.pmax
    banks = []
    for _ in range(_bank_count(N)):
        banks.append(nl.ndarray((P, PSUM_BANK_COLS), dtype=nl.float32, buffer=nl.psum))
    return banks


def column_sum_partials(accumulators, used):
    """SBUF fp32 (P, used) tiles for the used columns of the two accumulators (lists of PSUM
    banks; None for an absent one gives None)."""
    P = nl.tile_size.pmax
    dweight, dbias = accumulators[0], accumulators[1]
    return (
        None if dweight is None else nl.ndarray((P, used), dtype=nl.float32),
        None if dbias is None else nl.ndarray((P, used), dtype=nl.float32),
    )


def copy_column_sums(accumulators, partials, used):
    """``partials = accumulators`` over the used columns (PSUM → SBUF, exact fp32 copies,
    Vector engine)."""
    for i in range(len(accumulators)):
        acc, partial = accumulators[i], partials[i]
        if acc is not None:
            for bank in range(len(acc)):
                k0 = bank * PSUM_BANK_COLS
                k1 = min(used, k0 + PSUM_BANK_COLS)
                nisa.tensor_copy(dst=partial[:, k0:k1], src=acc[bank][:, 0 : k1 - k0])


def exchange_column_sums(accumulators, used, core, pipe_id):
    """LNC=2: this core's column sums, copied out of PSUM, swapped with the other core's
    (``nisa.sendrecv``); returns the other core's fp32 sums (SBUF tiles)."""
    own = column_sum_partials(accumulators, used)
    copy_column_sums(accumulators, own, used)
    other = column_sum_partials(accumulators, used)
    for i in range(len(own)):
        if own[i] is not None:
            nisa.sendrecv(
                src=own[i],
                dst=other[i],
                send_to_rank=1 - core,
                recv_from_rank=1 - core,
                pipe_id=pipe_id,
            )
    return other


def _accumulate_column_sums(acc, data, ones, c0, first):
    """``acc += Σ_rows data`` for the chunk ``data`` (rows, width) starting at column c0 (a
    multiple of 128): per 128-column block, ``data_blockᵀ @ ones`` on the Tensor engine."""
    P = nl.tile_size.pmax
    rows, width = data.shape
    for lo in range(0, width, P):
        block = min(P, width - lo)
        block_index = (c0 + lo) // P
        bank, col = block_index // PSUM_BANK_COLS, block_index % PSUM_BANK_COLS
        nisa.nc_matmul(
            dst=acc[bank][0:block, col : col + 1],
            stationary=data[:, lo : lo + block],
            moving=ones[0:rows, :],
            is_moving_onezero=True,
            accumulate=not first,
        )


def _store_column_sums(dst, acc, bank, other):
    """Round bank ``bank`` of the PSUM column sums (plus ``other``'s, the other half's fp32
    sums in SBUF, when given) to ``dst``'s dtype once (Vector) and store them: element
    (p, j) is ``dst[(512·bank + j)·128 + p]`` (a transposed HBM view); the last partial
    block (N mod 128 columns) in its own store."""
    P = nl.tile_size.pmax
    N = dst.shape[0]
    full_blocks, rest = N // P, N % P
    first = bank * PSUM_BANK_COLS
    used = min(PSUM_BANK_COLS, -(-N // P) - first)
    full = max(0, min(PSUM_BANK_COLS, full_blocks - first))
    sums = nl.ndarray((P, used), dtype=dst.dtype)
    if other is None:
        nisa.tensor_copy(dst=sums, src=acc[bank][:, 0:used])
    else:
        nisa.tensor_tensor(
            dst=sums, data1=acc[bank][:, 0:used], data2=other[:, first : first + used], op=nl.add
        )
    if full:
        # element (p, j) at dst[(first + j)·P + p]: an explicit access pattern (``ap``, a
        # method NKI had before 0.5: release-notes/components/nki.rst@81ce03ae L127-133;
        # AWS: nki-library@d2ad3a5 experimental/collectives/fg_allgather.py L274)
        columns = dst.ap(pattern=[[1, P], [P, full]], offset=first * P)
        nl.store(columns, value=sums[:, 0:full])
    if rest and first <= full_blocks < first + PSUM_BANK_COLS:
        last = full_blocks - first
        start = full_blocks * P
        nl.store(dst[start : start + rest].reshape((rest, 1)), value=sums[0:rest, last : last + 1])
