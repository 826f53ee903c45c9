"""The forward with y in rmsnorm_tkg's transposed layout (``rmsnorm_fwd_transposed``,
``rms_norm(..., output_layout="transposed")``): y_t (128, M, N / 128) with
``y_t[p, m, k] = y[m, p · (N / 128) + k]``, written by the kernel's output DMA. Checked
against the float64 reference and bitwise against the row-layout kernel's y rearranged, in
the "split" (decode batches), "rows", "packed", "two_pass" and "long" regimes, with the
fused residual add (h keeps x's layout), Inf/NaN rows and under LNC=2; the launcher's checks
come before any launch. The kernels allocate y_t uninitialised, which the simulator fills
with NaN: an element the output DMA missed is NaN and fails the comparison."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import BF16, trace_launch
from test_fwd import EPS, FP32, RSTD_RTOL, _inputs, _term_magnitude, assert_y_close

from nki_rmsnorm import dialect, kernels, ops
from nki_rmsnorm import reference as ref

TARGET_ENV = dialect.TARGET_ENV_VAR
P = 128


@pytest.fixture(autouse=True)
def _nki06():
    with dialect.use_dialect("nki06"):
        yield


def _rows_of(y_t):
    """The (M, N) y whose transposed layout ``y_t`` is."""
    parts, M, K = y_t.shape
    return y_t.transpose(1, 0, 2).reshape(M, parts * K)


def _launch_both(inputs, target, lnc=None, casting_mode="gemma"):
    """(transposed outputs, row-layout outputs) of the same inputs."""
    x, w, b, r, offset = (inputs[k] for k in ("x", "weight", "bias", "residual", "offset"))
    if r is None:
        names, args = ("rmsnorm_fwd_transposed", "rmsnorm_fwd"), (x,)
    else:
        names, args = ("rmsnorm_add_fwd_transposed", "rmsnorm_add_fwd"), (x, r)
    args = (*args, w, b, EPS, offset, casting_mode, None)
    transposed, _ = trace_launch(kernels.kernel(names[0]), *args, target=target, lnc=lnc)
    rows, _ = trace_launch(kernels.kernel(names[1]), *args, target=target)
    return [np.asarray(t) for t in transposed], [np.asarray(t) for t in rows]


def _assert_bitwise(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=what)


@pytest.mark.parametrize(
    "target, M, N",
    [
        ("trn2", 1, 4096),  # "split", one tile
        ("trn2", 8, 4096),
        ("trn3", 29, 8192),
        ("trn2", 200, 1024),  # "rows"
        ("trn2", 8, 128),  # "packed"
    ],
)
@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_matches_reference_and_row_layout(rng, target, M, N, dtype, residual):
    inputs = _inputs(rng, M, N, dtype, residual=residual, bias=residual, weight_dtype=dtype)
    transposed, rows = _launch_both(inputs, target)
    y_t = transposed[0]
    assert y_t.shape == (P, M, N // P)
    want = ref.rms_norm_fwd(
        inputs["x"], inputs["weight"], EPS, bias=inputs["bias"], residual=inputs["residual"]
    )
    x, w, b, r = (inputs[k] for k in ("x", "weight", "bias", "residual"))
    magnitude = None if b is None else _term_magnitude(x, w, b, r, 0.0, EPS)
    assert_y_close(_rows_of(y_t), want[0], dtype, "gemma", magnitude, x_dtype=dtype)
    _assert_bitwise(y_t, rows[0].reshape(M, P, N // P).transpose(1, 0, 2), "y_t")
    for got, same, name in zip(transposed[1:], rows[1:], ("h", "rstd")[-len(rows) + 1 :]):
        _assert_bitwise(got, same, name)  # h keeps x's (M, N) layout
    np.testing.assert_allclose(transposed[-1], want[-1], rtol=RSTD_RTOL)


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_inf_nan_and_zero_rows(rng, dtype):
    """Rows of +Inf, NaN, zeros and huge values next to ordinary ones: each element is the
    row layout's, and the reference's NaN positions."""
    M, N = 6, 2048
    inputs = _inputs(rng, M, N, dtype, weight_dtype=dtype)
    x = inputs["x"]
    x[0, 5] = np.inf
    x[1, 7] = np.nan
    x[2] = 0
    x[3, :3] = -np.inf
    x[4] = np.asarray(3e38 if dtype == FP32 else 1e38, dtype) / 1e3
    transposed, rows = _launch_both(inputs, "trn2")
    _assert_bitwise(transposed[0], rows[0].reshape(M, P, -1).transpose(1, 0, 2), "y_t")
    want = ref.rms_norm_fwd(x, inputs["weight"], EPS)[0]
    got = _rows_of(transposed[0]).astype(np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert_y_close(got[5:].astype(dtype), want[5:], dtype, "gemma", x_dtype=dtype)


def test_lnc2_is_lnc1(rng):
    inputs = _inputs(rng, 64, 8192, BF16, residual=True, weight_dtype=BF16)
    lnc2, _ = _launch_both(inputs, "trn2", lnc=2)
    lnc1, _ = _launch_both(inputs, "trn2")
    for got, want, name in zip(lnc2, lnc1, ("y_t", "h", "rstd")):
        _assert_bitwise(got, want, name)


def test_launcher_option(rng, monkeypatch):
    """``output_layout="transposed"`` through the NumPy launcher: leading dimensions are
    flattened into M, h keeps x's shape."""
    monkeypatch.setenv(TARGET_ENV, "trn2")
    x = rng.standard_normal((2, 3, 1024)).astype(BF16)
    r = rng.standard_normal((2, 3, 1024)).astype(BF16)
    w = rng.normal(1.0, 0.2, 1024).astype(BF16)
    y_t, h = ops.rms_norm(x, w, residual=r, output_layout="transposed")
    y, h_rows = ops.rms_norm(x, w, residual=r)
    assert y_t.shape == (P, 6, 8) and h.shape == x.shape
    _assert_bitwise(y_t, y.reshape(6, P, 8).transpose(1, 0, 2), "y_t")
    _assert_bitwise(h, h_rows, "h")
    empty = ops.rms_norm(np.zeros((0, 256), BF16), output_layout="transposed")
    assert empty.shape == (P, 0, 2)


@pytest.fixture
def no_kernel(monkeypatch):
    """Any kernel lookup fails: the launcher's errors must come first."""

    def looked_up(*args, **kwargs):
        raise AssertionError("a kernel was looked up")

    monkeypatch.setattr(kernels, "kernel", looked_up)


@pytest.mark.parametrize(
    "shape, weight_shape, option, match",
    [
        ((4, 1000), (1000,), "transposed", "x's last dimension N divisible by 128"),
        ((4, 256), (256,), "columns", "output_layout must be one of"),
        ((4, 256), (256,), None, "output_layout must be one of"),
        ((2, 4, 128), (4, 128), "transposed", "per-head weight"),
    ],
)
def test_bad_input_before_launch(no_kernel, monkeypatch, shape, weight_shape, option, match):
    monkeypatch.setenv(TARGET_ENV, "trn2")
    x = np.ones(shape, np.float32)
    with pytest.raises(ValueError, match=match):
        ops.rms_norm(x, np.ones(weight_shape, np.float32), output_layout=option)


def test_legacy_dialect_is_refused(no_kernel, monkeypatch):
    monkeypatch.setenv(TARGET_ENV, "trn1")
    with dialect.use_dialect("legacy"), pytest.raises(ValueError, match="NKI 0.6"):
        ops.rms_norm(np.ones((2, 256), np.float32), output_layout="transposed")


@pytest.mark.parametrize(
    "M, N, forced",
    [
        (1, 131072, None),  # "two_pass", K = 1024: whole runs per chunk
        (3, 128000, None),  # "two_pass", K = 1000: chunks end inside runs
        (5, 3840, ("long", 512, 1024)),  # K = 30: a run split between chunks
    ],
)
def test_column_chunks(rng, monkeypatch, M, N, forced):
    """The column-chunk regimes store each chunk's partial runs and whole runs separately;
    "long" is forced (N divisible by 128 is spread over partitions before it would run)."""
    from nki_rmsnorm.kernels.nki06 import rmsnorm_fwd as fwd_module
    from nki_rmsnorm.plan.forward import Layout

    inputs = _inputs(rng, M, N, FP32, residual=True, bias=True, weight_dtype=FP32)
    if forced is not None:
        regime, chunk, output_chunk = forced
        layout = Layout(regime, chunk=chunk, output_chunk=output_chunk)
        calls = []
        monkeypatch.setattr(fwd_module, "choose_layout", lambda *a, **k: calls.append(1) or layout)
    transposed, rows = _launch_both(inputs, "trn2")
    if forced is not None:
        assert calls, "the forced layout was not used"
    _assert_bitwise(transposed[0], rows[0].reshape(M, P, -1).transpose(1, 0, 2), "y_t")
    _assert_bitwise(transposed[1], rows[1], "h")
    want = ref.rms_norm_fwd(
        inputs["x"], inputs["weight"], EPS, bias=inputs["bias"], residual=inputs["residual"]
    )
    magnitude = _term_magnitude(
        inputs["x"], inputs["weight"], inputs["bias"], inputs["residual"], 0.0, EPS
    )
    assert_y_close(_rows_of(transposed[0]), want[0], FP32, "gemma", magnitude, x_dtype=FP32)
