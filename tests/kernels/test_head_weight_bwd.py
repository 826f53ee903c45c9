"""The backward kernel with a per-head weight ``(heads, N)`` in one launch (both dialects):
row r of the flattened ``(tokens·heads, N)`` rows is scaled by ``weight[r mod heads]`` and
dweight is ``(heads, N)``, head h's column sums over its own rows. Against the float64
reference applied head by head, with ``test_bwd.py``'s tolerances (dx: 1e-5 of the row's
largest term or 1 ulp; dweight: 1e-5 of its largest value or 1 ulp, llama / none plus the
exact effect of x̂'s double rounding); outputs are fresh ``shared_hbm`` tensors the simulator
fills with NaN, so an element never written fails the finiteness check. Also: non-finite
inputs and weights, LNC=2 bitwise LNC=1, a token's dx independent of the batch, and bad
input rejected before any launch."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest
from helpers import trace_launch

from nki_rmsnorm import kernels, ops, reference
from nki_rmsnorm.plan.backward import MAX_HEAD_HIDDEN, MAX_HEADS

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
FP32_REL = 1e-5
EPS = 1e-6

#: Run the test once per NKI dialect (the kernels of the dialect in effect)
both_dialects = pytest.mark.usefixtures("dialect")


def _inputs(rng, tokens, heads, n, dtype, w_dtype, offset, mode, with_dh=False):
    x = rng.standard_normal((tokens, heads, n)).astype(dtype)
    dy = rng.standard_normal((tokens, heads, n)).astype(dtype)
    w = (1.0 + 0.5 * rng.standard_normal((heads, n))).astype(w_dtype)
    dh = rng.standard_normal((tokens, heads, n)).astype(dtype) if with_dh else None
    rstd = np.empty((tokens, heads), F32)
    for h in range(heads):
        rstd[:, h] = reference.rms_norm_fwd(x[:, h], w[h], EPS, offset=offset, casting_mode=mode)[1]
    return dy, x, w, rstd, dh


def _launch(dy, x, w, rstd, dh, offset, mode, target=None, lnc=None, dialect_name=None):
    """The return-convention kernel of ``dialect_name`` (default: the dialect in effect) on
    the flattened rows."""
    tokens, heads, n = x.shape
    rows = tokens * heads
    flat = None if dh is None else dh.reshape(rows, n)
    (dx, dweight), _ = trace_launch(
        kernels.kernel("rmsnorm_bwd", dialect_name),
        dy.reshape(rows, n),
        x.reshape(rows, n),
        w,
        rstd.reshape(rows),
        flat,
        offset,
        False,
        mode,
        target=target,
        lnc=lnc,
    )
    return dx.reshape(x.shape), dweight


def _assert_close(out, ref, dtype, *, scale, extra=0.0, what=""):
    """test_bwd.py's rule: |err| ≤ 1e-5·scale (+ extra), or for narrow dtypes ≤ 1 ulp (after
    the allowed deviation); non-finite exactly where the reference is."""
    assert out.dtype == np.dtype(dtype) and out.shape == ref.shape, what
    out64, ref64 = out.astype(np.float64), ref.astype(np.float64)
    finite = np.isfinite(ref64)
    assert np.array_equal(np.isfinite(out64), finite), f"{what}: non-finite where ref is finite"
    err = np.where(finite, np.abs(out64 - ref64), 0.0)
    with np.errstate(invalid="ignore"):
        ok = ~finite | (err <= FP32_REL * scale + extra)
    if np.dtype(dtype) != F32:
        ok |= reference.ulp_distance(out64, ref64, dtype) <= 1
        ok |= err <= FP32_REL * scale + extra + np.abs(np.spacing(ref)).astype(np.float64)
    assert ok.all(), f"{what}: {(~ok).sum()} of {ok.size} off, worst {err[~ok].max():.3g}"


def _check(dx, dweight, dy, x, w, rstd, dh, offset, mode):
    """dx and dweight against the float64 reference of each head's rows."""
    for h in range(x.shape[1]):
        head_dh = None if dh is None else dh[:, h]
        ref_dx, ref_dw, _ = reference.rms_norm_bwd(
            dy[:, h], x[:, h], w[h], rstd[:, h], offset=offset, dh_out=head_dh, casting_mode=mode
        )
        with np.errstate(invalid="ignore", over="ignore"):
            r = rstd[:, h].astype(np.float64)[:, None]
            xhat = x[:, h].astype(np.float64) * r
            g = dy[:, h].astype(np.float64) * (w[h].astype(np.float64) + offset)
            c = np.abs(np.mean(g * xhat, axis=1, keepdims=True))
            terms = r * np.maximum(np.abs(g), np.abs(xhat) * c)
            if head_dh is not None:
                terms = np.maximum(terms, np.abs(head_dh.astype(np.float64)))
            row_scale = np.max(terms, axis=1, keepdims=True)
        _assert_close(dx[:, h], ref_dx, x.dtype, scale=row_scale, what=f"dx head {h}")
        extra = 0.0
        if mode != "gemma" and x.dtype != F32:  # x̂ rounded twice by the kernel, once here
            once = reference.round_to(xhat, x.dtype)
            twice = xhat.astype(np.float32).astype(x.dtype).astype(np.float64)
            extra = (np.abs(dy[:, h].astype(np.float64)) * np.abs(twice - once)).sum(axis=0)
        _assert_close(
            dweight[h],
            ref_dw,
            w.dtype,
            extra=extra,
            scale=np.abs(ref_dw.astype(np.float64)).max(),
            what=f"dweight {h}",
        )


# (tokens, heads, N, x dtype, weight dtype, offset, dh_out, mode): heads dividing 128 and
# not (12 heads: 120-row tiles), one or several row tiles with a ragged last one, head_dim
# 64 … 256, a width that 128-column sets do not divide (201), wider rows, the most heads
CASES = [
    (150, 4, 64, BF16, BF16, 0.0, False, "gemma"),
    (40, 12, 128, BF16, F32, 1.0, True, "llama"),
    (33, 8, 256, F32, F32, 0.0, False, "gemma"),
    (21, 3, 201, F16, F16, 0.5, False, "none"),
    (9, 16, 128, BF16, BF16, 0.0, True, "gemma"),
    (5, 2, 1000, BF16, BF16, 0.0, False, "llama"),
    (3, MAX_HEADS, 64, BF16, BF16, 0.0, False, "llama"),
    # the widest rows the launchers pass beside a per-head weight: fp32 with dh_out fits
    (2, 2, MAX_HEAD_HIDDEN, F32, F32, 1.0, True, "gemma"),
]


@both_dialects
@pytest.mark.parametrize("tokens, heads, n, dtype, w_dtype, offset, with_dh, mode", CASES)
def test_matches_the_reference_per_head(
    rng, tokens, heads, n, dtype, w_dtype, offset, with_dh, mode
):
    dy, x, w, rstd, dh = _inputs(rng, tokens, heads, n, dtype, w_dtype, offset, mode, with_dh)
    dx, dweight = _launch(dy, x, w, rstd, dh, offset, mode)
    assert dweight.shape == w.shape and dweight.dtype == w.dtype
    _check(dx, dweight, dy, x, w, rstd, dh, offset, mode)


@pytest.mark.parametrize("target", ["trn1", "trn2", "trn3"])
def test_other_targets(rng, dialect, target):
    """Every generation's engine choices (NeuronCore-v2: dy·x from SBUF; v3+: x through
    PSUM), both dialects where they run (conftest deselects nki06 on trn1)."""
    dy, x, w, rstd, _ = _inputs(rng, 70, 8, 128, BF16, BF16, 0.0, "gemma")
    dx, dweight = _launch(dy, x, w, rstd, None, 0.0, "gemma", target=target)
    _check(dx, dweight, dy, x, w, rstd, None, 0.0, "gemma")


@pytest.mark.parametrize("target, heads", [("trn2", 8), ("trn3", 12), ("trn2", 5)])
def test_two_cores_are_bitwise_one(rng, target, heads):
    """LNC=2 (NKI 0.6's ``kernel[2]``: each core half of the row tiles, column sums
    exchanged and added in a fixed order) gives the bits of LNC=1, dx and dweight, including
    a ragged last tile."""
    dy, x, w, rstd, _ = _inputs(rng, 301, heads, 128, BF16, BF16, 0.0, "gemma")
    one = _launch(dy, x, w, rstd, None, 0.0, "gemma", target=target, lnc=1, dialect_name="nki06")
    two = _launch(dy, x, w, rstd, None, 0.0, "gemma", target=target, lnc=2, dialect_name="nki06")
    assert one[0].tobytes() == two[0].tobytes()
    assert one[1].tobytes() == two[1].tobytes()
    _check(*two, dy, x, w, rstd, None, 0.0, "gemma")


@both_dialects
def test_deterministic_and_batch_invariant(rng):
    """Two runs give the same bits; a token's dx is the same in any batch (tiles hold whole
    tokens, so a sub-batch starting at a token changes no row's arithmetic)."""
    dy, x, w, rstd, _ = _inputs(rng, 200, 8, 64, BF16, BF16, 0.0, "gemma")
    first = _launch(dy, x, w, rstd, None, 0.0, "gemma")
    again = _launch(dy, x, w, rstd, None, 0.0, "gemma")
    assert first[0].tobytes() == again[0].tobytes() and first[1].tobytes() == again[1].tobytes()
    part = _launch(dy[3:90], x[3:90], w, rstd[3:90], None, 0.0, "gemma")
    assert part[0].tobytes() == first[0][3:90].tobytes()


@both_dialects
def test_one_head_matches_the_vector_weight(rng):
    """A (1, N) weight: dweight (1, N) and dx as the (N,) weight's within the tolerances."""
    dy, x, w, rstd, _ = _inputs(rng, 130, 1, 128, BF16, BF16, 0.0, "gemma")
    dx, dweight = _launch(dy, x, w, rstd, None, 0.0, "gemma")
    assert dweight.shape == (1, 128)
    _check(dx, dweight, dy, x, w, rstd, None, 0.0, "gemma")


@both_dialects
def test_non_finite_weight_stays_in_its_heads_rows(rng):
    """+Inf and NaN in one head's weight make that head's dx non-finite as in the reference
    and leave every other head's dx, and all of dweight (dy·x̂ needs no weight), bitwise
    those of the finite weight: ``a = rstd·w'`` takes no matmul (0·Inf)."""
    dy, x, w, rstd, _ = _inputs(rng, 60, 4, 128, F32, F32, 0.0, "gemma")
    clean = _launch(dy, x, w, rstd, None, 0.0, "gemma")
    bad = w.copy()
    bad[2, 5], bad[2, 70] = np.inf, np.nan
    dx, dweight = _launch(dy, x, bad, rstd, None, 0.0, "gemma")
    _check(dx, dweight, dy, x, bad, rstd, None, 0.0, "gemma")
    others = [0, 1, 3]
    assert dx[:, others].tobytes() == clean[0][:, others].tobytes()
    assert not np.isfinite(dx[:, 2]).any()
    assert dweight.tobytes() == clean[1].tobytes()


@both_dialects
def test_non_finite_inputs_stay_in_their_rows_and_columns(rng):
    """A NaN in x (row of head 1) and an Inf in dy (row of head 3, column 40): every other
    row's dx is bitwise the finite run's; dweight is non-finite where the reference is (all
    of head 1, head 3's column 40) and matches it elsewhere except column 40 and x's NaN
    column 9 of the other heads, which come back NaN: the per-head column sums multiply
    each row by its head's 0/1 mask on the Tensor engine, and 0·NaN = NaN (the folded 1-D
    regime spreads a NaN across its segments likewise)."""
    dy, x, w, rstd, _ = _inputs(rng, 50, 4, 128, BF16, BF16, 0.0, "gemma")
    clean = _launch(dy, x, w, rstd, None, 0.0, "gemma")
    x[7, 1, 9] = np.nan
    rstd[7, 1] = reference.rms_norm_fwd(x[7:8, 1], w[1], EPS)[1][0]
    dy[20, 3, 40] = np.inf
    dx, dweight = _launch(dy, x, w, rstd, None, 0.0, "gemma")
    assert np.isnan(dx[7, 1]).all() and not np.isfinite(dx[20, 3]).all()
    rows = np.ones(x.shape[:2], bool)
    rows[7, 1] = rows[20, 3] = False
    assert dx[rows].tobytes() == clean[0][rows].tobytes()
    ref_dw = np.stack(
        [reference.rms_norm_bwd(dy[:, h], x[:, h], w[h], rstd[:, h])[1] for h in range(4)]
    ).astype(np.float64)
    got = dweight.astype(np.float64)
    assert np.isnan(got[1]).all() and not np.isfinite(got[3, 40])
    assert np.isnan(got[:, 9]).all() and np.isnan(got[[0, 1, 2], 40]).all()
    keep = np.ones(got.shape, bool)
    keep[1] = False
    keep[:, [9, 40]] = False
    assert np.isfinite(ref_dw[keep]).all()
    _assert_close(
        dweight[keep],
        ref_dw[keep].astype(BF16),
        BF16,
        scale=np.abs(ref_dw[keep]).max(),
        what="dweight",
    )


@both_dialects
def test_launcher_is_one_launch(rng, monkeypatch):
    """``ops.rms_norm_bwd`` with a per-head weight launches the backward kernel once (with
    a bias once more, for dbias only) and matches the kernel."""
    dy, x, w, rstd, _ = _inputs(rng, 40, 8, 128, BF16, BF16, 0.0, "gemma")
    calls = []
    launch = kernels.rmsnorm_bwd

    def counted(*args):
        calls.append(args[2] is None)
        return launch(*args)

    monkeypatch.setattr(kernels, "rmsnorm_bwd", counted)
    dx, dweight, dbias = ops.rms_norm_bwd(dy, x, w, rstd)
    assert calls == [False] and dbias is None
    want = _launch(dy, x, w, rstd, None, 0.0, "gemma")
    assert dx.tobytes() == want[0].tobytes() and dweight.tobytes() == want[1].tobytes()
    ops.rms_norm_bwd(dy, x, w, rstd, has_bias=True)
    assert calls == [False, False, True]


@pytest.mark.parametrize(
    "x_shape, w_shape, message",
    [
        ((4, 8, 64), (4, 64), "weight must have shape"),
        ((4, 8, 64), (8, 32), "weight must have shape"),
        ((2, MAX_HEADS + 1, 8), (MAX_HEADS + 1, 8), f"heads <= {MAX_HEADS}"),
        ((2, 2, MAX_HEAD_HIDDEN + 1), (2, MAX_HEAD_HIDDEN + 1), f"N <= {MAX_HEAD_HIDDEN}"),
    ],
)
def test_bad_weight_is_rejected_before_a_launch(monkeypatch, x_shape, w_shape, message):
    def launched(*args, **kwargs):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(kernels, "rmsnorm_bwd", launched)
    monkeypatch.setattr(kernels, "kernel", launched)
    x = np.ones(x_shape, BF16)
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        ops.rms_norm_bwd(x, x, np.ones(w_shape, BF16), np.ones(x_shape[:-1], F32))
    assert "weight" in str(info.value)


@both_dialects
def test_kernel_refuses_a_per_head_weight_it_cannot_take(rng):
    """Called directly, the kernel asserts rather than computing something else: rows that
    are not whole sets of heads, and a dbias beside a per-head weight."""
    dy, x, w, rstd, _ = _inputs(rng, 4, 4, 64, BF16, BF16, 0.0, "gemma")
    rows = x.reshape(16, 64)
    with pytest.raises(Exception, match="whole sets of 4 heads"):
        trace_launch(
            kernels.kernel("rmsnorm_bwd"),
            rows[:15],
            rows[:15],
            w,
            rstd.reshape(16)[:15],
            None,
            0.0,
            False,
            "gemma",
        )
    with pytest.raises(Exception, match="no dbias beside a per-head weight"):
        trace_launch(
            kernels.kernel("rmsnorm_bwd"), rows, rows, w, rstd.reshape(16), None, 0.0, True, "gemma"
        )


@pytest.mark.parametrize("mode", ["gemma", "llama"])
def test_dialects_give_the_same_dx(rng, mode):
    """The legacy and the 0.6 kernel run the same per-row instructions (trn2, where both
    run): dx bitwise the same; dweight within the tolerances of both (the 0.6 kernel adds
    its two halves of row tiles, the legacy one sums them in one accumulator)."""
    dy, x, w, rstd, _ = _inputs(rng, 45, 12, 128, BF16, BF16, 0.5, mode)
    runs = []
    for name in ("legacy", "nki06"):
        rows = x.shape[0] * x.shape[1]
        (dx, dweight), _ = trace_launch(
            kernels.kernel("rmsnorm_bwd", name),
            dy.reshape(rows, 128),
            x.reshape(rows, 128),
            w,
            rstd.reshape(rows),
            None,
            0.5,
            False,
            mode,
            target="trn2",
        )
        runs.append((dx.reshape(x.shape), dweight))
        _check(*runs[-1], dy, x, w, rstd, None, 0.5, mode)
    assert runs[0][0].tobytes() == runs[1][0].tobytes()
