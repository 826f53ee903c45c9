"""The kernels' contracts beyond the numbers test_fwd.py / test_bwd.py check.

* Output-parameter entry points (``rmsnorm_fwd_out``, ``rmsnorm_add_fwd_out``,
  ``rmsnorm_bwd_out``) write the caller's NaN-poisoned buffers in place, return nothing and
  give bitwise the results of the return-convention kernels, for every option.
* Both SDK paths of the SBUF budget (``total_available_sbuf_size`` from 2.26, the documented
  per-generation constant before) give the same plan and results.
* rstd stays as accurate as test_fwd.py claims when the Scalar engine's rsqrt carries a
  relative error up to 2⁻⁹ (the Newton steps), and a zero row with eps = 0 gives rstd = inf.
* The planners: every accepted (N, dtypes, options, target) fits the target's SBUF
  (hypothesis over the pure-Python planners), and their byte budgets bound what the kernels
  really allocate (the simulator's peak) for the tightest cases.
* No spills: the tiles every regime keeps live fit SBUF and PSUM on every target.
* dbias comes back in the bias's dtype, summed in fp32 and rounded once (a regression test),
  and the backward no longer runs out of SBUF for an fp32 dy beside a 2-byte x (defect 4).
"""

from __future__ import annotations

import contextlib
import warnings

import ml_dtypes
import numpy as np
import pytest
from helpers import poison, trace_launch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import simulate
import simulate.functions
import simulate.nki06 as nki06
from nki_rmsnorm import kernels, ops
from nki_rmsnorm import nki as nki_module
from nki_rmsnorm import reference as ref
from nki_rmsnorm.dialect import use_dialect
from nki_rmsnorm.plan import backward as bwd_plan
from nki_rmsnorm.plan.forward import choose_layout, layout_bytes, make_plan
from simulate.errors import SpillWarning

FP32, FP16 = np.dtype(np.float32), np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
KERNEL_DTYPES = (FP32, BF16, FP16)
TARGETS = tuple(simulate.TARGETS)
EPS = 1e-6


def _data(rng, shape, dtype):
    rows = np.exp(rng.uniform(-1.5, 1.5, size=shape[:-1] + (1,)))
    return (rows * (rng.standard_normal(shape) + 0.3)).astype(dtype)


def _param(rng, n, dtype, centre=1.0):
    return None if dtype is None else rng.normal(centre, 0.3, n).astype(dtype)


def _nki_dtype(dtype, kernel_dialect):
    """``dtype`` (a NumPy dtype or None) as the kernels of ``kernel_dialect`` take a dtype
    argument: an NKI 0.6 kernel takes only NKI values (docs/nki_language.md)."""
    return kernels.nki_dtype(None if dtype is None else dtype.name, kernel_dialect)


# ---------------------------------------------------------------------------------------------
# Output-parameter entry points
# ---------------------------------------------------------------------------------------------

FWD_OPTIONS = {
    "plain": dict(weight=None, bias=None, offset=0.0),
    "w_bf16": dict(weight=BF16, bias=None, offset=0.0),
    "w_fp32_offset_bias": dict(weight=FP32, bias=FP32, offset=1.0),
    "bias_only": dict(weight=None, bias=BF16, offset=0.0),
}


def _assert_bitwise(got, want, what):
    assert got.dtype == want.dtype, what
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=what)


@pytest.mark.parametrize("target", ["trn1", "trn2"])
@pytest.mark.parametrize("casting_mode", ref.CASTING_MODES)
@pytest.mark.parametrize("options", FWD_OPTIONS, ids=list(FWD_OPTIONS))
@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add"])
def test_forward_output_parameters_match_return_convention(
    rng, options, casting_mode, residual, target, kernel_dialect
):
    M, N = 130, 384
    opts = FWD_OPTIONS[options]
    x = _data(rng, (M, N), BF16)
    w, b = _param(rng, N, opts["weight"]), _param(rng, N, opts["bias"], 0.0)
    # y's dtype follows the buffer; the return convention takes the dialect's nl dtype
    out_dtype = FP32 if options == "plain" else None
    nl_out_dtype = None if out_dtype is None else kernels.nki_dtype("float32", kernel_dialect)
    y = poison((M, N), out_dtype or BF16)
    rstd = poison((M,), FP32)
    common = (EPS, opts["offset"], casting_mode)
    if residual:
        r = _data(rng, (M, N), FP32)
        h = poison((M, N), FP32)
        want, _ = trace_launch(
            kernels.rmsnorm_add_fwd, x, r, w, b, *common, nl_out_dtype, target=target
        )
        got, _ = trace_launch(
            kernels.rmsnorm_add_fwd_out, x, r, w, b, y, h, rstd, *common, target=target
        )
        outputs = (y, h, rstd)
    else:
        want, _ = trace_launch(kernels.rmsnorm_fwd, x, w, b, *common, nl_out_dtype, target=target)
        got, _ = trace_launch(kernels.rmsnorm_fwd_out, x, w, b, y, rstd, *common, target=target)
        outputs = (y, rstd)
    assert got is None, "an output-parameter kernel returns nothing"
    for name, buffer, expected in zip(
        ("y", "h", "rstd")[-len(outputs) :] if residual else ("y", "rstd"), outputs, want
    ):
        _assert_bitwise(buffer, expected, name)


def test_forward_output_parameters_long_rows(rng, kernel_dialect):
    """A row too long for whole-row tiles (the "split" regime on trn2) through the
    output-parameter entry point."""
    M, N = 6, 40000
    x, w = _data(rng, (M, N), BF16), _param(rng, N, BF16)
    y, rstd = poison((M, N), BF16), poison((M,), FP32)
    want, _ = trace_launch(kernels.rmsnorm_fwd, x, w, None, EPS, 0.0, "gemma", None, target="trn2")
    trace_launch(kernels.rmsnorm_fwd_out, x, w, None, y, rstd, EPS, 0.0, "gemma", target="trn2")
    _assert_bitwise(y, want[0], "y")
    _assert_bitwise(rstd, want[1], "rstd")


WRONG_OUTPUTS = {
    # output -> (kernel, the message); each case gives that one output a wrong dtype
    "int32 y": ("rmsnorm_fwd_out", "y must be float32, bfloat16 or float16"),
    "bf16 rstd": ("rmsnorm_fwd_out", "rstd must be float32"),
    "bf16 h of an fp32 residual": ("rmsnorm_add_fwd_out", "h must have the residual's dtype"),
    "fp32 dx of a bf16 x": ("rmsnorm_bwd_out", "dx must have x's dtype"),
    "fp16 dweight of a bf16 weight": ("rmsnorm_bwd_out", "dweight must be float32 or"),
    "int32 dbias": ("rmsnorm_bwd_out", "dbias must be float32 or x's dtype"),
}


@pytest.mark.parametrize("case", WRONG_OUTPUTS)
def test_output_parameter_dtypes_are_checked_before_anything_runs(rng, kernel_dialect, case):
    """An output buffer of a wrong dtype would be written truncated: each output-parameter
    kernel asserts its outputs' dtypes (as AWS's kernels check their arguments) before any
    instruction, whichever launcher calls it (nki_jit, nki_call, TorchNeuron)."""
    name, message = WRONG_OUTPUTS[case]
    x, r, w = _data(rng, (4, 64), BF16), _data(rng, (4, 64), FP32), _param(rng, 64, BF16)
    rstd = poison((4,), BF16 if case == "bf16 rstd" else FP32)
    y = poison((4, 64), np.dtype(np.int32) if case == "int32 y" else BF16)
    if name == "rmsnorm_fwd_out":
        args = (x, w, None, y, rstd, EPS, 0.0, "gemma")
    elif name == "rmsnorm_add_fwd_out":
        args = (x, r, w, None, y, poison((4, 64), BF16), rstd, EPS, 0.0, "gemma")
    else:
        dx = poison((4, 64), FP32 if case.startswith("fp32 dx") else BF16)
        dweight = poison((64,), FP16 if case.startswith("fp16 dweight") else FP32)
        dbias = poison((64,), np.dtype(np.int32) if case == "int32 dbias" else FP32)
        args = (
            _data(rng, (4, 64), BF16),
            x,
            w,
            np.ones(4, np.float32),
            None,
            dx,
            dweight,
            dbias,
            0.0,
            "gemma",
        )
    with pytest.raises(AssertionError, match=message):
        trace_launch(kernels.kernel(name), *args, target="trn2")


BWD_OPTIONS = {
    "no_weight": dict(weight=None, bias=None, dh=None, offset=0.0),
    "w_bf16_bias_fp32": dict(weight=BF16, bias=FP32, dh=None, offset=0.0),
    "w_fp32_offset_dh": dict(weight=FP32, bias=None, dh=BF16, offset=0.5),
    "w_bf16_bias_dh_fp32": dict(weight=BF16, bias=BF16, dh=FP32, offset=0.0),
}


def _launch_backward(kernel_dialect, name, monkeypatch, *args):
    """Run backward entry point ``name`` of ``kernel_dialect`` on trn2: its outputs."""
    kernel = kernels.kernel(name, kernel_dialect)
    if kernel_dialect == "legacy":
        return simulate.trace_kernel(kernel, *args, target="trn2")[0]
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    return nki06.simulate(kernel)(*args)


@pytest.mark.parametrize("N", [200, 30001], ids=["folded", "streamed"])
@pytest.mark.parametrize("casting_mode", ["gemma", "llama"])
@pytest.mark.parametrize("options", BWD_OPTIONS, ids=list(BWD_OPTIONS))
def test_backward_output_parameters_match_return_convention(
    rng, monkeypatch, options, casting_mode, N, kernel_dialect
):
    M = 3 if N > 1000 else 130
    opts = BWD_OPTIONS[options]
    x, dy = _data(rng, (M, N), BF16), _data(rng, (M, N), FP32)
    w = _param(rng, N, opts["weight"])
    dh = None if opts["dh"] is None else _data(rng, (M, N), opts["dh"])
    rstd = ref.rms_norm_fwd(x, w, EPS)[1]
    has_bias = opts["bias"] is not None
    want = _launch_backward(
        kernel_dialect,
        "rmsnorm_bwd",
        monkeypatch,
        dy,
        x,
        w,
        rstd,
        dh,
        opts["offset"],
        has_bias,
        casting_mode,
        _nki_dtype(opts["bias"], kernel_dialect),
    )
    dx = poison((M, N), BF16)
    dweight = None if w is None else poison((N,), w.dtype)
    dbias = poison((N,), opts["bias"]) if has_bias else None
    got = _launch_backward(
        kernel_dialect,
        "rmsnorm_bwd_out",
        monkeypatch,
        dy,
        x,
        w,
        rstd,
        dh,
        dx,
        dweight,
        dbias,
        opts["offset"],
        casting_mode,
    )
    assert got is None
    buffers = [dx] + [b for b in (dweight, dbias) if b is not None]
    assert len(want) == len(buffers)
    for name, buffer, expected in zip(("dx", "dweight/dbias", "dbias"), buffers, want):
        _assert_bitwise(buffer, expected, name)


# ---------------------------------------------------------------------------------------------
# SDK releases: the SBUF budget's two sources
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _emulated_sdk(monkeypatch, release):
    """Emulate legacy SDK ``release`` for the kernels: the simulator's own SDK emulation
    where it has one; else ``nki.sdk_version`` is patched and, before 2.26, reading
    ``nl.tile_size.total_available_sbuf_size`` raises, as it would on such a release."""
    if hasattr(simulate, "use_sdk"):
        with simulate.use_sdk(f"{release[0]}.{release[1]}"):
            assert nki_module.sdk_version() == release
            yield
        return
    monkeypatch.setattr(nki_module, "sdk_version", lambda: release)
    if release < nki_module.SBUF_SIZE_API_SDK:

        def missing(_cls):
            raise AttributeError("total_available_sbuf_size first appears in SDK 2.26")

        monkeypatch.setattr(
            type(nki_module.nl.tile_size), "total_available_sbuf_size", property(missing)
        )
    yield


@pytest.mark.parametrize("target", TARGETS)
def test_sbuf_constant_before_2_26_matches_the_api(target):
    """The documented per-generation figure the kernels use before SDK 2.26 equals what
    ``total_available_sbuf_size`` reports from 2.26 on."""
    spec = simulate.get_target(target)
    assert nki_module.SBUF_BYTES_BY_NC_VERSION[spec.nc_version] == spec.sbuf_bytes_per_partition


@pytest.mark.parametrize("release", [(2, 21), (2, 29)], ids=["sdk2.21", "sdk2.29"])
def test_kernels_run_on_oldest_and_newest_sdk(rng, monkeypatch, release):
    """The legacy kernels on the oldest and newest legacy SDK they support (the 0.6 kernels
    do not read the legacy release)."""
    M, N = 130, 40000  # long rows: the regime choice depends on the SBUF budget
    x, w = _data(rng, (M, N), BF16), _param(rng, N, BF16)
    r = _data(rng, (M, N), BF16)
    want_y, want_h, want_rstd = ref.rms_norm_fwd(x, w, EPS, residual=r)
    with use_dialect("legacy"), _emulated_sdk(monkeypatch, release):
        y, h, rstd = ops.rms_norm_fwd(x, w, EPS, residual=r)
        dx, dw, _ = ops.rms_norm_bwd(_data(rng, (M, N), BF16), h, w, rstd)
    np.testing.assert_array_equal(h, want_h)
    assert ref.ulp_distance(y.astype(np.float64), want_y.astype(np.float64), BF16).max() <= 1
    np.testing.assert_allclose(rstd, want_rstd, rtol=1e-5)
    assert np.isfinite(dx.astype(np.float32)).all() and np.isfinite(dw.astype(np.float32)).all()


def test_sdk_version_parses_releases():
    assert nki_module._release("2.24") == (2, 24)
    assert nki_module._release("2.24.0") == (2, 24)
    assert nki_module._release((2, 21)) == (2, 21)
    assert nki_module.OLDEST_SDK <= nki_module.sdk_version() <= nki_module.NEWEST_SDK


# ---------------------------------------------------------------------------------------------
# An approximate Scalar-engine rsqrt
# ---------------------------------------------------------------------------------------------

RSQRT_ERROR = 2.0**-9


def _hash_unit(values):
    """A deterministic value in [-1, 1) per fp32 input (a 32-bit integer mix)."""
    h = np.ascontiguousarray(values, np.float32).view(np.uint32).astype(np.uint64)
    h = (h ^ (h >> np.uint64(16))) * np.uint64(0x7FEB352D) & np.uint64(0xFFFFFFFF)
    h = (h ^ (h >> np.uint64(15))) * np.uint64(0x846CA68B) & np.uint64(0xFFFFFFFF)
    return (h ^ (h >> np.uint64(16))).astype(np.float64) / 2.0**31 - 1.0


@pytest.fixture
def approximate_rsqrt(monkeypatch):
    """The Scalar engine's rsqrt with a deterministic relative error up to 2⁻⁹ and NaN
    outside its valid input range [2⁻⁸⁷, 2⁹⁷] (general/nki/api/nki.api.shared.rst@8a38e733,
    line 180): the simulator's own approximate mode where it has one, else the same model
    patched into the simulator's function table for this test only."""
    if hasattr(simulate, "use_approx"):
        with simulate.use_approx(True, RSQRT_ERROR):
            yield
        return
    exact = simulate.functions.UNARY["rsqrt"]

    def approximate(x):
        x32 = np.asarray(x, np.float32)
        out = exact(x32).astype(np.float64) * (1.0 + RSQRT_ERROR * _hash_unit(x32))
        out[~((x32 >= 2.0**-87) & (x32 <= 2.0**97))] = np.nan
        return out.astype(np.float32)

    monkeypatch.setitem(simulate.functions.UNARY, "rsqrt", approximate)
    yield


def test_the_approximate_rsqrt_is_in_force(approximate_rsqrt):
    """Guard for the tests below: the perturbation really reaches the Scalar engine."""
    import simulate.isa as nisa
    import simulate.language as nl

    @simulate.jit
    def rsqrt_kernel(v):
        out = nl.ndarray(v.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        nl.store(out, value=nisa.activation(op=nl.rsqrt, data=nl.load(v)))
        return out

    v = np.linspace(0.5, 4.0, 128 * 64, dtype=np.float32).reshape(128, 64)
    got = rsqrt_kernel(v).astype(np.float64)
    err = np.abs(got * np.sqrt(v.astype(np.float64)) - 1.0)
    assert err.max() > 2.0**-12, "rsqrt is still exact"
    assert err.max() <= RSQRT_ERROR * 1.01


@pytest.mark.parametrize("casting_mode", ref.CASTING_MODES)
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize(
    "shape,target",
    [((257, 512), "trn1"), ((130, 512), "trn2"), ((6, 40000), "trn2"), ((130, 20000), "trn1")],
    ids=["rows-trn1", "rows-trn2", "split-trn2", "long-trn1"],
)
def test_forward_accuracy_with_approximate_rsqrt(
    rng, approximate_rsqrt, shape, target, dtype, casting_mode, kernel_dialect
):
    """test_fwd.py's bounds (≤ 1 ulp gemma / 2 ulp llama, none; ≤ 1 % inexact points;
    fp32 1e-5; rstd 1e-5) hold with the approximate rsqrt: the Newton steps bring rstd to
    fp32 rounding noise."""
    from test_fwd import check_forward

    x_dtype = {"bf16": BF16, "fp16": FP16, "fp32": FP32}[dtype]
    M, N = shape
    inputs = dict(
        x=_data(rng, (M, N), x_dtype),
        weight=_param(rng, N, x_dtype),
        bias=_param(rng, N, x_dtype, 0.0),
        residual=None,
        offset=0.0,
    )
    check_forward(inputs, casting_mode, target=target)


@pytest.mark.parametrize("target", ["trn1", "trn2"])
@pytest.mark.parametrize("eps", [0.0, 2.0**-50], ids=["vector-chain", "scalar-chain"])
def test_rstd_within_a_few_fp32_ulp_with_approximate_rsqrt(
    rng, approximate_rsqrt, target, eps, kernel_dialect
):
    """Two Newton steps from a 2⁻⁹ estimate: rstd within 4 fp32 ulp of the exact value, over
    mean squares spread across 2⁻⁶⁰ … 2⁶⁰, on both chains (the Vector-engine one, which eps
    = 0 takes, and the Scalar-engine one with its 2⁻³² prescaling)."""
    M, N = 256, 64
    scales = np.exp2(rng.uniform(-30, 30, size=(M, 1)))
    x = (scales * rng.standard_normal((M, N))).astype(np.float32)
    (_, rstd), _ = trace_launch(
        kernels.rmsnorm_fwd, x, None, None, eps, 0.0, "gemma", None, target=target
    )
    exact = 1.0 / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=1) + eps)
    ulps = np.abs(rstd - exact) / np.spacing(exact.astype(np.float32)).astype(np.float64)
    assert ulps.max() <= 4, f"rstd off by {ulps.max():.1f} fp32 ulp"


@pytest.mark.parametrize("target", ["trn1", "trn2"])
def test_zero_row_with_zero_eps(rng, approximate_rsqrt, target, kernel_dialect):
    """eps = 0 and an all-zero row: the mean square 0 is outside rsqrt's valid range, so
    the kernel raises it to the smallest fp32 before scaling and then sets rstd = +inf,
    y = 0·inf = NaN for that row only, as reference.py says; the other rows are unaffected."""
    x = _data(rng, (130, 256), BF16)
    x[7] = 0
    w = _param(rng, 256, BF16)
    (y, rstd), _ = trace_launch(
        kernels.rmsnorm_fwd, x, w, None, 0.0, 0.0, "gemma", None, target=target
    )
    want_y, want_rstd = ref.rms_norm_fwd(x, w, 0.0)
    assert np.isposinf(rstd[7]) and np.isposinf(want_rstd[7])
    assert np.isnan(y[7].astype(np.float32)).all()
    others = np.arange(130) != 7
    np.testing.assert_allclose(rstd[others], want_rstd[others], rtol=1e-5)
    assert (
        ref.ulp_distance(
            y[others].astype(np.float64), want_y[others].astype(np.float64), BF16
        ).max()
        <= 1
    )


@pytest.mark.parametrize("target", ["trn1", "trn2"])
def test_backward_accuracy_with_approximate_rsqrt(rng, approximate_rsqrt, target, kernel_dialect):
    """The forward's rstd feeds the backward: dx, dweight against the float64 reference."""
    M, N = 130, 512
    x, w = _data(rng, (M, N), BF16), _param(rng, N, BF16)
    dy = _data(rng, (M, N), BF16)
    _, rstd = ops.rms_norm_fwd(x, w, EPS)
    dx, dw, _ = ops.rms_norm_bwd(dy, x, w, rstd)
    want_dx, want_dw, _ = ref.rms_norm_bwd(dy, x, w, ref.rms_norm_fwd(x, w, EPS)[1])
    scale = np.abs(want_dx.astype(np.float64)).max(axis=1, keepdims=True)
    assert (np.abs(dx.astype(np.float64) - want_dx) <= 8 * 2.0**-8 * scale).all()
    np.testing.assert_allclose(
        dw.astype(np.float64),
        want_dw.astype(np.float64),
        rtol=2.0**-7,
        atol=2.0**-7 * np.abs(want_dw).max(),
    )


# ---------------------------------------------------------------------------------------------
# Planners: every accepted input fits, and the budgets bound the real allocations
# ---------------------------------------------------------------------------------------------

OPTIONAL_DTYPES = st.sampled_from((None,) + KERNEL_DTYPES)


def _forward_budget(target, m, n, x, weight, bias, residual, offset, casting_mode, out_dtype):
    spec = simulate.get_target(target)
    plan = make_plan(
        x,
        weight,
        bias,
        residual,
        offset,
        casting_mode,
        out_dtype,
        FP32,
        BF16,
        tensor_engine=spec.nc_version >= 3,
    )
    layout = choose_layout(plan, m, n, spec.sbuf_bytes_per_partition)
    return layout, layout_bytes(plan, layout, n), spec.sbuf_bytes_per_partition


def _backward_budget(target, n, x, dy, weight, dh_out, offset, casting_mode):
    spec = simulate.get_target(target)
    dtypes = bwd_plan.BwdDtypes(x, dy, weight, dh_out)
    plan = bwd_plan.make_plan(n, dtypes, offset, casting_mode, spec.sbuf_bytes_per_partition)
    if plan is not None:
        return "folded", bwd_plan.plan_bytes(plan, dtypes), spec.sbuf_bytes_per_partition
    streamed = bwd_plan.make_streamed_plan(
        n, x, dy, weight, casting_mode, spec.sbuf_bytes_per_partition
    )
    return (
        "streamed",
        bwd_plan.streamed_plan_bytes(streamed, n, x, dy, weight),
        spec.sbuf_bytes_per_partition,
    )


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    target=st.sampled_from(TARGETS),
    m=st.integers(1, 1 << 16),
    n=st.integers(1, bwd_plan.MAX_HIDDEN),
    x=st.sampled_from(KERNEL_DTYPES),
    weight=OPTIONAL_DTYPES,
    bias=OPTIONAL_DTYPES,
    residual=OPTIONAL_DTYPES,
    offset=st.sampled_from((0.0, 1.0)),
    casting_mode=st.sampled_from(ref.CASTING_MODES),
    out_dtype=OPTIONAL_DTYPES,
)
def test_forward_plan_fits_every_accepted_input(
    target, m, n, x, weight, bias, residual, offset, casting_mode, out_dtype
):
    if weight is None:
        offset = 0.0
    _, planned, capacity = _forward_budget(
        target, m, n, x, weight, bias, residual, offset, casting_mode, out_dtype
    )
    assert planned <= capacity


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    target=st.sampled_from(TARGETS),
    n=st.integers(1, bwd_plan.MAX_HIDDEN),
    x=st.sampled_from(KERNEL_DTYPES),
    dy=st.sampled_from(KERNEL_DTYPES),
    weight=OPTIONAL_DTYPES,
    dh_out=OPTIONAL_DTYPES,
    offset=st.sampled_from((0.0, 0.5)),
    casting_mode=st.sampled_from(ref.CASTING_MODES),
)
def test_backward_plan_fits_every_accepted_input(
    target, n, x, dy, weight, dh_out, offset, casting_mode
):
    if weight is None:
        offset = 0.0
    _, planned, capacity = _backward_budget(target, n, x, dy, weight, dh_out, offset, casting_mode)
    assert planned <= capacity


# The tightest cases: near the regime boundaries, the widest dtypes, every option.
TIGHT_FORWARD = [
    ("trn2", 130, 20000, FP16, FP16, FP16, None, 0.0, "llama", FP32),
    ("trn2", 130, 65536, BF16, FP32, FP32, FP32, 0.0, "none", FP32),
    ("trn1", 130, 65536, BF16, BF16, None, BF16, 0.0, "gemma", None),
    ("trn1", 130, 20000, FP32, FP32, FP32, FP32, 1.0, "gemma", FP32),
    ("trn2", 3, 130944, FP32, FP32, FP32, FP32, 0.0, "gemma", FP32),
    # the widest odd N of "rows" with uneven groups, the last zero-padded in the squares
    # tile (fp32 squares; 16 of 1319) and in a tile of its own (bf16 squares; 8 of 1647)
    ("trn2", 130, 21093, BF16, BF16, None, None, 0.0, "gemma", None),
    ("trn3", 130, 13173, FP16, FP16, None, FP16, 0.0, "llama", None),
]
TIGHT_BACKWARD = [
    ("trn1", 19967, FP16, FP16, FP16, None, 0.0, "gemma"),
    ("trn2", 20225, FP16, FP32, FP32, FP16, 0.5, "llama"),
    ("trn1", 30001, FP32, FP32, FP32, FP32, 0.0, "gemma"),
    ("trn1", 24576, FP32, FP32, FP32, FP32, 0.0, "gemma"),
]


# (the target is a parameter of its own, so that conftest runs only the pairs of target and
# dialect the hardware has: no nki06 on trn1)
@pytest.mark.parametrize(
    ("target", "case"),
    [(c[0], c[1:]) for c in TIGHT_FORWARD],
    ids=[f"{c[0]}-{c[2]}-{c[8]}" for c in TIGHT_FORWARD],
)
def test_forward_plan_bounds_the_allocation(rng, target, case, kernel_dialect):
    m, n, x_dtype, w_dtype, b_dtype, r_dtype, offset, mode, out_dtype = case
    layout, planned, capacity = _forward_budget(
        target, m, n, x_dtype, w_dtype, b_dtype, r_dtype, offset, mode, out_dtype
    )
    assert planned <= capacity
    x, w, b = _data(rng, (m, n), x_dtype), _param(rng, n, w_dtype), _param(rng, n, b_dtype)
    common = (w, b, 1e-6, offset, mode, _nki_dtype(out_dtype, kernel_dialect))
    if r_dtype is None:
        _, trace = trace_launch(kernels.rmsnorm_fwd, x, *common, target=target)
    else:
        _, trace = trace_launch(
            kernels.rmsnorm_add_fwd, x, _data(rng, (m, n), r_dtype), *common, target=target
        )
    assert trace.sbuf_peak_bytes_per_partition <= planned, layout
    assert trace.spill_save_bytes == trace.spill_reload_bytes == 0


@pytest.mark.parametrize(
    ("target", "case"),
    [(c[0], c[1:]) for c in TIGHT_BACKWARD],
    ids=[f"{c[0]}-{c[1]}-{c[3]}" for c in TIGHT_BACKWARD],
)
def test_backward_plan_bounds_the_allocation(rng, target, case, kernel_dialect):
    n, x_dtype, dy_dtype, w_dtype, dh_dtype, offset, mode = case
    regime, planned, capacity = _backward_budget(
        target, n, x_dtype, dy_dtype, w_dtype, dh_dtype, offset, mode
    )
    assert planned <= capacity
    m = 130
    x, dy = _data(rng, (m, n), x_dtype), _data(rng, (m, n), dy_dtype)
    dh = None if dh_dtype is None else _data(rng, (m, n), dh_dtype)
    rstd = rng.uniform(0.5, 2.0, m).astype(np.float32)
    _, trace = trace_launch(
        kernels.rmsnorm_bwd,
        dy,
        x,
        _param(rng, n, w_dtype),
        rstd,
        dh,
        offset,
        True,
        mode,
        target=target,
    )
    assert trace.sbuf_peak_bytes_per_partition <= planned, regime
    assert trace.spill_save_bytes == trace.spill_reload_bytes == 0


# ---------------------------------------------------------------------------------------------
# Regressions
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("x_dtype,n", [(BF16, 30001), (FP16, 20225)])
def test_backward_with_fp32_dy_fits(rng, x_dtype, n, kernel_dialect):
    """Defect 4: an fp32 dy (after ``out_dtype=float32``) beside a 2-byte x used to overflow
    SBUF (the planners budgeted dy in x's dtype)."""
    x = _data(rng, (2, n), x_dtype)
    w = np.ones(n, x_dtype)
    _, rstd = ops.rms_norm_fwd(x, w, out_dtype=np.float32)
    dy = _data(rng, (2, n), FP32)
    dx, dw, _ = ops.rms_norm_bwd(dy, x, w, rstd)
    want_dx, want_dw, _ = ref.rms_norm_bwd(dy, x, w, rstd)
    scale = np.abs(want_dx.astype(np.float64)).max(axis=1, keepdims=True)
    ulp = 2.0**-8 if x_dtype == BF16 else 2.0**-11
    assert (np.abs(dx.astype(np.float64) - want_dx) <= 8 * ulp * scale).all()
    np.testing.assert_allclose(
        dw.astype(np.float64),
        want_dw.astype(np.float64),
        rtol=4 * ulp,
        atol=4 * ulp * np.abs(want_dw).max(),
    )


def test_dbias_in_the_bias_dtype(rng, kernel_dialect):
    """Defect 3: an fp32 bias beside a bf16 weight gets an fp32 gradient, summed in fp32 and
    rounded once (it used to be rounded to the weight's bf16)."""
    M, N = 512, 64
    x, w = _data(rng, (M, N), BF16), _param(rng, N, BF16)
    gy = _data(rng, (M, N), BF16)
    _, rstd = ops.rms_norm_fwd(x, w, bias=np.zeros(N, np.float32))
    _, _, dbias = ops.rms_norm_bwd(gy, x, w, rstd, has_bias=True, bias_dtype=np.float32)
    assert dbias.dtype == FP32
    exact = gy.astype(np.float64).sum(axis=0)
    np.testing.assert_allclose(dbias, exact, rtol=1e-6, atol=1e-6 * np.abs(exact).max())
    assert (
        np.abs(dbias.astype(np.float64) - exact).max()
        < np.abs(exact.astype(BF16).astype(np.float64) - exact).max()
    )
    # default: the weight's dtype, as before
    _, _, dbias_default = ops.rms_norm_bwd(gy, x, w, rstd, has_bias=True)
    assert dbias_default.dtype == BF16


def test_bias_dtype_validation(rng):
    x, w = _data(rng, (4, 8), BF16), _param(rng, 8, BF16)
    rstd = ops.rms_norm_fwd(x, w)[1]
    with pytest.raises(TypeError, match="bias_dtype"):
        ops.rms_norm_bwd(x, x, w, rstd, has_bias=True, bias_dtype=np.float16)
    with pytest.raises(ValueError, match="has_bias"):
        ops.rms_norm_bwd(x, x, w, rstd, bias_dtype=np.float32)


# ---------------------------------------------------------------------------------------------
# No spills
# ---------------------------------------------------------------------------------------------
#: (kind, rows, hidden size): each regime the entry points pick at a cheap shape: the row-tile
#: forward, fused add, backward (whole rows and streamed), fp8 quantization, short rows packed
#: several to a partition, a decode batch of a few rows, and long rows
NO_SPILL_CASES = [
    ("fwd", 130, 8192),
    ("add", 130, 8192),
    ("bwd", 130, 8192),
    ("bwd", 3, 30001),
    ("quant", 130, 4096),
    ("fwd", 1024, 64),
    ("fwd", 8, 8192),
    ("fwd", 3, 65536),
]


@pytest.mark.parametrize("target", ["trn1", "trn2", "trn3"])
@pytest.mark.parametrize(
    ("kind", "m", "n"), NO_SPILL_CASES, ids=[f"{c[0]}-{c[1]}x{c[2]}" for c in NO_SPILL_CASES]
)
def test_our_kernels_never_spill(rng, monkeypatch, kind, m, n, target, kernel_dialect):
    """The tiles our kernels keep live fit SBUF and PSUM: the compiler would insert no spills
    (general/nki/programming_model.rst L172-L175), which the simulator reports as a
    SpillWarning and as ``spill_save_bytes`` / ``spill_reload_bytes`` on the trace."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", target)
    x, weight = _data(rng, (m, n), BF16), _param(rng, n, BF16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SpillWarning)  # any launch that spills fails here
        if kind == "bwd":
            _, rstd = ops.rms_norm_fwd(x, weight)
            ops.rms_norm_bwd(_data(rng, (m, n), BF16), x, weight, rstd)
        elif kind == "quant":
            ops.rms_norm_quant(x, weight, quant_dtype="float8_e4m3")
        else:
            residual = _data(rng, (m, n), BF16) if kind == "add" else None
            ops.rms_norm_fwd(x, weight, residual=residual)
    trace = simulate.last_trace()
    assert trace.spill_save_bytes == trace.spill_reload_bytes == 0
