"""IEEE edge semantics, output-buffer checks and bad arguments, as a hostile user tries them.

* An infinite element gives its row rstd = 0 exactly: y is NaN there and 0 (or the bias)
  elsewhere, as the float64 reference and ``torch.nn.functional.rms_norm`` give, in every
  regime (rows, split, long, two_pass) and dialect; the backward of such a row is the
  reference's too.
* Every finite mean square reaches rsqrt through exact power-of-two scalings: a row with a
  tiny mean square and ``eps = 0`` is exact; a finite row whose Σh² or mean square the fp32
  sum of squares cannot hold is a ``ValueError`` naming the limit, never a wrong number.
* A property test puts ±Inf, NaN, the largest finite value and the smallest subnormal of the
  input dtype into random rows and holds every output element to the float64 reference
  (NaN exactly where it is NaN), the other rows bitwise equal to a launch without them.
* Output buffers of a wrong dtype are refused before anything runs, by every launcher.
* An argument fuzz of every public entry point (NumPy, torch functional / module / custom
  operators, JAX), in a subprocess so that a crash fails the test instead of the run: each
  bad argument is a ``TypeError`` / ``ValueError`` naming it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest
from helpers import runnable_target
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_fwd import _run, _term_magnitude, assert_y_close
from test_properties import PROFILE

from nki_rmsnorm import ops, validation
from nki_rmsnorm import reference as ref

FP32, FP16 = np.dtype(np.float32), np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
EPS = 1e-6

# (target, x dtype, N) reaching each forward regime (plan.forward.choose_layout)
REGIMES = {
    "rows": ("trn2", BF16, 128),
    "rows-trn1": ("trn1", FP32, 1000),  # beyond 32 rows; up to 32: "spread" (s = 8)
    "spread": ("trn1", BF16, 4096),  # at most 32 rows (of the draws' 2-40)
    "split": ("trn2", FP32, 12288),
    "long": ("trn1", FP32, 12288),
    "two_pass": ("trn1", FP32, 40000),
}


def _finfo(dtype):
    return ml_dtypes.finfo(dtype) if dtype == BF16 else np.finfo(dtype)


def _data(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def _compare_ieee(got, want, dtype, mode="gemma", magnitude=None, what="y"):
    """NaN exactly where the reference has NaN; every other element within the dtype's
    tolerance of test_fwd.py (infinities and zeros equal; ``magnitude``: the size of the
    terms a bias may cancel)."""
    got64, want64 = got.astype(np.float64), np.asarray(want, np.float64)
    np.testing.assert_array_equal(np.isnan(got64), np.isnan(want64), err_msg=f"{what}: NaN")
    finite = ~np.isnan(want64)
    assert_y_close(
        np.where(finite, got, 0).astype(got.dtype),
        np.where(finite, want64, 0),
        dtype,
        mode,
        magnitude,
        what=what,
    )


# ---------------------------------------------------------------------------------------------
# ±Inf in a row, tiny mean squares, the fp32 range of Σh²
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    [
        # (target, dtype, M, N, mode, residual, bias, offset): the three reproductions,
        # then the split and two-pass regimes
        ("trn2", BF16, 130, 128, "gemma", False, False, 0.0),
        ("trn2", FP32, 5, 4096, "llama", False, False, 0.0),
        ("trn2", FP32, 3, 40000, "gemma", True, True, 1.0),
        ("trn2", FP32, 3, 12288, "gemma", False, True, 0.0),
        ("trn1", FP32, 3, 40000, "none", True, False, 1.0),
        ("trn1", BF16, 130, 256, "gemma", False, False, 0.0),
    ],
    ids=[
        "bf16-rows",
        "fp32-llama",
        "fp32-long-res-bias-offset",
        "fp32-split",
        "two_pass",
        "trn1-scalar-plan",
    ],
)
def test_infinite_element_is_nan_there_and_zero_elsewhere(rng, kernel_dialect, case):
    target, dtype, m, n, mode, residual, bias, offset = case
    target = runnable_target(target, kernel_dialect)  # nki06 runs trn1's cases on trn2
    x = _data(rng, (m, n), dtype)
    x[1, 3], x[m - 1, n // 2] = np.inf, -np.inf
    w = rng.normal(1.0 - offset, 0.2, n).astype(FP32)
    b = rng.normal(0.0, 0.5, n).astype(FP32) if bias else None
    r = _data(rng, (m, n), dtype) if residual else None
    outputs, _ = _run(x, w, b, r, EPS, offset, mode, None, target)
    want = ref.rms_norm_fwd(x, w, EPS, offset=offset, bias=b, residual=r, casting_mode=mode)
    magnitude = None
    if b is not None:  # the terms' size, from the finite part of each row
        finite_x = np.where(np.isfinite(x), x, 0).astype(dtype)
        magnitude = _term_magnitude(finite_x, w, b, r, offset, EPS)
    _compare_ieee(outputs[0], want[0], dtype, mode, magnitude)
    assert outputs[-1][1] == 0.0 and outputs[-1][m - 1] == 0.0, "rstd of an infinite row"
    assert np.isnan(outputs[0][1, 3]) and not np.isnan(outputs[0][1, 4])


def test_backward_of_an_infinite_row_follows_the_reference(rng, kernel_dialect):
    """rstd = 0 rows reach the backward: its NaNs are exactly the reference's and the other
    rows' gradients are unaffected."""
    x, dy = _data(rng, (6, 64), FP32), _data(rng, (6, 64), FP32)
    x[2, 9] = np.inf
    w = rng.normal(1.0, 0.2, 64).astype(FP32)
    _, rstd = ops.rms_norm_fwd(x, w, EPS)
    assert rstd[2] == 0.0
    dx, dw, db = ops.rms_norm_bwd(dy, x, w, rstd, has_bias=True)
    want = ref.rms_norm_bwd(dy, x, w, rstd, has_bias=True)
    for got, expected, name in zip((dx, dw, db), want, ("dx", "dweight", "dbias")):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(expected), err_msg=name)
    clean = [0, 1, 3, 4, 5]
    np.testing.assert_allclose(dx[clean], want[0][clean], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("target", ["trn1", "trn2"])
@pytest.mark.parametrize("scale", [1e-17, 1e-12, 1e-3])
def test_tiny_mean_square_with_zero_eps_is_exact(rng, kernel_dialect, target, scale):
    """eps = 0 and mean squares down to 10⁻³⁴ (below rsqrt's valid range, 2⁻⁸⁷): the Vector
    chain scales them by 2⁶⁴ exactly instead of clamping (which was 10⁹× off)."""
    x = (rng.standard_normal((4, 256)) * scale).astype(FP32)
    w = rng.normal(1.0, 0.2, 256).astype(FP32)
    (y, rstd), _ = _run(x, w, None, None, 0.0, 0.0, "gemma", None, target)
    want_y, want_rstd = ref.rms_norm_fwd(x, w, 0.0)
    np.testing.assert_allclose(rstd, want_rstd, rtol=4e-7)
    assert_y_close(y, want_y, FP32, "gemma")


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_sum_of_squares_beyond_fp32_is_a_value_error(dtype):
    x = np.ones((3, 64), dtype)
    x[1, 5] = _finfo(dtype).max
    with pytest.raises(ValueError, match=r"x row 1 .*2\*\*127"):
        ops.rms_norm(x)
    tiny = np.full((2, 64), 1e-25, dtype)
    with pytest.raises(ValueError, match=r"x row 0 .*2\*\*-125"):
        ops.rms_norm(tiny, eps=0.0)
    ops.rms_norm(tiny, eps=1e-6)  # eps dominates: exact
    np.testing.assert_array_equal(ops.rms_norm(np.ones((1, 8), FP16) * 65504), np.ones((1, 8)))


# ---------------------------------------------------------------------------------------------
# Property: IEEE specials in random rows, every regime and dialect
# ---------------------------------------------------------------------------------------------

SPECIALS = ("inf", "-inf", "nan", "max", "subnormal")


def _special(name, dtype):
    info = _finfo(dtype)
    return {
        "inf": np.inf,
        "-inf": -np.inf,
        "nan": np.nan,
        "max": float(info.max),
        "subnormal": float(info.smallest_subnormal),
    }[name]


@st.composite
def special_cases(draw):
    regime = draw(st.sampled_from(list(REGIMES) + ["rows"] * 3))  # mostly the cheap one
    target, dtype, n = REGIMES[regime]
    if regime == "rows":
        dtype = draw(st.sampled_from((FP32, BF16, FP16)))
        n = draw(st.integers(1, 300))
    m = draw(st.integers(2, 6 if n > 5000 else 40))
    rows = draw(st.lists(st.integers(0, m - 1), min_size=1, max_size=3, unique=True))
    cells = [(r, draw(st.integers(0, n - 1)), draw(st.sampled_from(SPECIALS))) for r in rows]
    return dict(
        target=target,
        dtype=dtype,
        m=m,
        n=n,
        cells=cells,
        mode=draw(st.sampled_from(("gemma", "llama", "none"))),
        weight=draw(st.booleans()),
        eps=draw(st.sampled_from((EPS, 0.0))),
        seed=draw(st.integers(0, 2**16)),
    )


def _regime_example(regime, cells, mode="gemma", eps=EPS):
    target, dtype, n = REGIMES[regime]
    return dict(
        target=target,
        dtype=dtype,
        m=3,
        n=n,
        cells=cells,
        mode=mode,
        weight=True,
        eps=eps,
        seed=len(regime),
    )


@settings(PROFILE, max_examples=max(1, PROFILE.max_examples // 8))
@given(case=special_cases())
# every regime at least once, whatever the draws
@example(case=_regime_example("split", [(0, 5, "inf"), (2, 7, "subnormal")]))
@example(case=_regime_example("long", [(1, 0, "-inf"), (2, 9, "nan")], mode="llama"))
@example(case=_regime_example("two_pass", [(0, 39999, "inf"), (1, 3, "subnormal")], eps=0.0))
@example(case=_regime_example("rows-trn1", [(1, 2, "max"), (2, 3, "inf")]))
@example(case=_regime_example("spread", [(0, 4095, "nan"), (2, 17, "-inf")], eps=0.0))
def test_ieee_specials_in_random_rows(kernel_dialect, case):
    rng = np.random.default_rng(case["seed"])
    dtype, m, n = case["dtype"], case["m"], case["n"]
    clean = _data(rng, (m, n), dtype)
    x = clean.copy()
    for row, col, name in case["cells"]:
        x[row, col] = _special(name, dtype)
    w = rng.normal(1.0, 0.2, n).astype(FP32) if case["weight"] else None
    eps, mode = case["eps"], case["mode"]
    try:
        validation.check_statistics_range(x, eps)
    except ValueError:
        # beyond the fp32 sum of squares: the launcher refuses, by name, before any kernel
        with pytest.raises(ValueError, match=r"2\*\*(127|-125)"):
            ops.rms_norm(x, w, eps, casting_mode=mode)
        return
    target = runnable_target(case["target"], kernel_dialect)  # nki06: trn1's cases on trn2
    (y, rstd), _ = _run(x, w, None, None, eps, 0.0, mode, None, target)
    want_y, want_rstd = ref.rms_norm_fwd(x, w, eps, casting_mode=mode)
    _compare_ieee(y, want_y, dtype, mode)
    np.testing.assert_array_equal(np.isnan(rstd), np.isnan(want_rstd), err_msg="rstd NaN")
    np.testing.assert_array_equal(rstd[want_rstd == 0], 0.0, err_msg="rstd of infinite rows")
    special_rows = sorted({row for row, _, _ in case["cells"]})
    others = [r for r in range(m) if r not in special_rows]
    (y_clean, rstd_clean), _ = _run(clean, w, None, None, eps, 0.0, mode, None, target)
    np.testing.assert_array_equal(y[others].view(np.uint8), y_clean[others].view(np.uint8))
    np.testing.assert_array_equal(rstd[others], rstd_clean[others])


# ---------------------------------------------------------------------------------------------
# Output buffers of a wrong dtype: the package's launchers and a direct nki_jit launch
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, name",
    [
        ((FP32, np.int32, FP32), "y"),
        ((FP32, FP32, BF16), "rstd"),
        ((BF16, BF16, FP32, FP32, BF16), "h"),
    ],
)
def test_forward_output_dtypes_are_checked(args, name):
    with pytest.raises(TypeError, match=rf"^{name} must be"):
        validation.check_forward_outputs(*args)


@pytest.mark.parametrize(
    "args, name",
    [
        ((BF16, BF16, FP32), "dx"),
        ((BF16, BF16, BF16, FP16), "dweight"),
        ((BF16, None, BF16, None, np.int32), "dbias"),
        ((BF16, BF16, BF16, None, FP16), "dbias"),
    ],
)
def test_backward_output_dtypes_are_checked(args, name):
    with pytest.raises(TypeError, match=rf"^{name} must be"):
        validation.check_backward_outputs(*args)
    validation.check_backward_outputs(FP32, BF16, FP32, BF16, FP16)  # fp32 h, bf16 bias


def test_nki_jit_launch_refuses_an_integer_y():
    """The issue's reproduction: ``torch_neuronx.nki_jit(rmsnorm_fwd_out)`` with an int32 y
    wrote truncated values; the kernel's own assertion now names the output first."""
    torch = pytest.importorskip("torch")
    from nki_rmsnorm import kernels
    from simulate.torch_neuronx import nki_jit

    x, w = torch.randn(4, 64), torch.ones(64)
    y, rstd = torch.zeros(4, 64, dtype=torch.int32), torch.zeros(4)
    with pytest.raises(AssertionError, match="y must be float32, bfloat16 or float16"):
        nki_jit(kernels.kernel("rmsnorm_fwd_out", "legacy"))(
            x, w, None, y, rstd, eps=1e-6, offset=0.0, casting_mode="gemma"
        )
    assert not y.any(), "y was written"


def test_jax_rejects_an_undifferentiable_hidden_size_at_trace_time():
    """N = 300000 is beyond the backward kernel: ``jax.grad`` is refused while tracing,
    naming the limit, before the forward runs (it failed inside XLA's buffer callback)."""
    jax = pytest.importorskip("jax")
    from nki_rmsnorm.jax import rms_norm

    x = jax.ShapeDtypeStruct((2, 300000), np.float32)
    with pytest.raises(ValueError, match=r"N=300000, above the backward kernel's limit"):
        jax.eval_shape(jax.grad(lambda a: rms_norm(a).sum()), x)
    jax.eval_shape(lambda a: rms_norm(a), x)  # the forward alone is fine


# ---------------------------------------------------------------------------------------------
# Argument fuzz of every public entry point, in a subprocess
# ---------------------------------------------------------------------------------------------

FUZZ = textwrap.dedent(
    r"""
    import json, sys, warnings
    import numpy as np, ml_dtypes
    warnings.simplefilter("ignore")
    results = []

    def case(label, argument, call, also=()):
        print("CASE", label, flush=True)  # the last one printed names a crash
        try:
            call()
        except (TypeError, ValueError) as error:
            ok = argument in str(error)
            results.append([label, ok, f"{type(error).__name__}: {error}"[:300]])
            return
        except RuntimeError as error:  # torch's schema parser: must name the argument too
            ok = bool(also) and isinstance(error, also) and argument in str(error)
            results.append([label, ok, f"RuntimeError: {error}"[:300]])
            return
        except BaseException as error:
            results.append([label, False, f"{type(error).__name__}: {error}"[:300]])
            return
        results.append([label, False, "no error"])

    BAD_OBJECTS = {"str": "x", "int": 3, "list": [[1.0]], "object": object(), "none": None}

    from nki_rmsnorm import ops
    x = np.ones((4, 8), np.float32)
    w = np.ones(8, np.float32)
    numpy_args = {
        "x": [np.ones((4, 8), np.int32), np.ones((4, 8)), np.ones(()), np.ones((4, 0), np.float32),
              "x", None, [[1.0]]],
        "weight": [np.ones(7, np.float32), np.ones(8, np.int64), "w", np.ones((1, 8), np.float32)],
        "bias": [np.ones(9, np.float32), np.ones(8, np.float64), 1.5],
        "residual": [np.ones((4, 7), np.float32), np.ones((4, 8), np.int8), 2.0],
        "eps": [float("nan"), -1.0, "1e-6", None, True, 10**400, np.ones(2)],
        "offset": [float("inf"), "1", None],
        "casting_mode": ["GEMMA", 64, None],
        "out_dtype": [np.int32, 64, "float64", object()],
    }
    for name, values in numpy_args.items():
        for i, value in enumerate(values):
            kwargs = {"x": x, "weight": w}
            kwargs[name] = value
            xx = kwargs.pop("x")
            case(f"numpy rms_norm {name}[{i}]", name if name != "x" else "x",
                 lambda: ops.rms_norm(xx, **kwargs))
    rstd = np.ones(4, np.float32)
    dy = np.ones((4, 8), np.float32)
    bwd_args = {
        "dy": [np.ones((4, 7), np.float32), np.ones((4, 8), np.int32), None],
        "x_or_h": [np.ones((4, 8), np.int32), np.ones((4, 300000), np.float32), "h"],
        "weight": [np.ones(3, np.float32), np.ones(8, np.int16)],
        "rstd": [np.ones(4, ml_dtypes.bfloat16), np.ones(5, np.float32), None],
        "dh_out": [np.ones((4, 8), np.int32), np.ones((3, 8), np.float32)],
        "has_bias": ["yes", 1],
        "bias_dtype": [np.int32, 64],
        "offset": [float("nan")],
        "casting_mode": [7],
    }
    for name, values in bwd_args.items():
        for i, value in enumerate(values):
            kwargs = {"dy": dy, "x_or_h": x, "weight": w, "rstd": rstd}
            if name in ("bias_dtype",):
                kwargs["has_bias"] = True
            kwargs[name] = value
            case(f"numpy rms_norm_bwd {name}[{i}]", name, lambda: ops.rms_norm_bwd(
                kwargs.pop("dy"), kwargs.pop("x_or_h"), kwargs.pop("weight"), kwargs.pop("rstd"),
                **kwargs))

    import torch
    from nki_rmsnorm import torch as nt
    tx, tw = torch.ones(4, 8), torch.ones(8)
    torch_args = {
        "input": [torch.ones(4, 8, dtype=torch.int32), torch.ones(4, 8, dtype=torch.float64),
                  np.ones((4, 8), np.float32), "x"],
        "normalized_shape": [(9,), "8", (0,), 8.0],
        "weight": [torch.ones(7), torch.ones(8, dtype=torch.int64), "w",
                   torch.ones(8, device="meta")],
        "bias": [torch.ones(9), torch.ones(8, dtype=torch.float64)],
        "eps": [float("nan"), -1.0, "1e-6", True],
        "offset": [float("inf"), "1"],
        "casting_mode": ["GEMMA", 64, None],
        "out_dtype": [torch.int32, 64, "float32", torch.float64],
    }
    for name, values in torch_args.items():
        for i, value in enumerate(values):
            kwargs = {"input": tx, "normalized_shape": (8,), "weight": tw}
            kwargs[name] = value
            case(f"torch rms_norm {name}[{i}]", name, lambda: nt.rms_norm(**kwargs))
    for i, value in enumerate([torch.ones(4, 7), torch.ones(4, 8, dtype=torch.int32), None]):
        case(f"torch fused_add_rms_norm residual[{i}]", "residual",
             lambda: nt.fused_add_rms_norm(tx, value, tw))
    for i, (args, name) in enumerate([((8,), "eps"), (("8",), "normalized_shape")]):
        kwargs = {"eps": float("nan")} if name == "eps" else {}
        case(f"torch RMSNorm {name}[{i}]", name, lambda: nt.RMSNorm(*args, **kwargs)(tx))
    module = nt.RMSNorm(8)
    case("torch RMSNorm input dtype", "input", lambda: module(torch.ones(4, 8, dtype=torch.int64)))
    case("torch RMSNorm input shape", "normalized_shape", lambda: module(torch.ones(4, 9)))

    quant_args = {
        "quant_dtype": [64, "int8", torch.int32],
        "scale_mode": ["rows", 3],
        "block": ["128", 1.5, True],
        "eps": [float("nan"), "1e-6"],
        "scale_floor": ["0"],
        "weight": [torch.ones(7)],
    }
    for name, values in quant_args.items():
        for i, value in enumerate(values):
            kwargs = {"input": tx, "weight": tw}
            kwargs[name] = value
            case(f"torch rms_norm_quant {name}[{i}]", name,
                 lambda: nt.rms_norm_quant(**kwargs))

    OPS = torch.ops.nki_rmsnorm
    good = {"x": tx, "weight": tw, "bias": None, "eps": 1e-6, "offset": 0.0,
            "casting_mode": "gemma", "out_dtype": None}
    op_args = {
        "x": [torch.ones(8), torch.ones(4, 8, dtype=torch.int32), torch.ones(2, 4, 8)],
        "weight": [torch.ones(7), torch.ones(8, dtype=torch.float64)],
        "eps": [float("nan"), -1.0],
        "offset": [float("inf")],
        "casting_mode": ["GEMMA", "64"],
        "out_dtype": [64, 1000, -1, "int32", torch.float32],
    }
    for name, values in op_args.items():
        for i, value in enumerate(values):
            kwargs = dict(good, **{name: value})
            case(f"op rms_norm_fwd {name}[{i}]", name, lambda: OPS.rms_norm_fwd(**kwargs),
                 also=(RuntimeError,))
    h, rs, dyt = torch.ones(4, 8), torch.ones(4), torch.ones(4, 8)
    add_bwd = {"dy": dyt, "h": h, "weight": tw, "rstd": rs, "dh": None, "x_dtype": "float32",
               "offset": 0.0, "has_bias": False, "bias_dtype": None, "casting_mode": "gemma"}
    add_bwd_args = {
        "x_dtype": [64, 1000, -1, 30, "int32", torch.float32],
        "bias_dtype": [64, 1000, "float64"],
        "rstd": [torch.ones(4, dtype=torch.bfloat16), torch.ones(5)],
        "dy": [torch.ones(4, 7), torch.ones(4, 8, dtype=torch.int64)],
        "h": [torch.ones(4, 8, dtype=torch.int32), torch.ones(4, 300000)],
        "dh": [torch.ones(3, 8)],
        "weight": [torch.ones(9)],
        "offset": [float("nan")],
        "casting_mode": ["x"],
    }
    for name, values in add_bwd_args.items():
        for i, value in enumerate(values):
            kwargs = dict(add_bwd, **{name: value})
            if name == "bias_dtype":
                kwargs["has_bias"] = True
            case(f"op rms_norm_add_bwd {name}[{i}]", name, lambda: OPS.rms_norm_add_bwd(**kwargs),
                 also=(RuntimeError,))
    bwd = {"dy": dyt, "x": h, "weight": tw, "rstd": rs, "offset": 0.0, "has_bias": True,
           "bias_dtype": None, "casting_mode": "gemma"}
    for name, value in [("bias_dtype", 1000), ("bias_dtype", "float64"), ("rstd", torch.ones(3))]:
        kwargs = dict(bwd, **{name: value})
        case(f"op rms_norm_bwd {name}", name, lambda: OPS.rms_norm_bwd(**kwargs),
             also=(RuntimeError,))

    import jax, jax.numpy as jnp
    from nki_rmsnorm import jax as nj
    jx, jw = jnp.ones((4, 8)), jnp.ones(8)
    jax_args = {
        "x": [jnp.ones((4, 8), jnp.int32), "x", jnp.ones(()), jnp.ones((4, 0))],
        "weight": [jnp.ones(7), jnp.ones(8, jnp.int32), "w"],
        "bias": [jnp.ones(9)],
        "eps": [float("nan"), -1.0, "1e-6"],
        "offset": [float("inf")],
        "casting_mode": ["GEMMA", 64],
    }
    for name, values in jax_args.items():
        for i, value in enumerate(values):
            kwargs = {"x": jx, "weight": jw}
            kwargs[name] = value
            case(f"jax rms_norm {name}[{i}]", name, lambda: nj.rms_norm(**kwargs))
    for i, value in enumerate([jnp.ones((4, 7)), jnp.ones((4, 8), jnp.int32)]):
        case(f"jax fused_add_rms_norm residual[{i}]", "residual",
             lambda: nj.fused_add_rms_norm(jx, value, jw))
    print("RESULTS " + json.dumps(results), flush=True)
    """
)


def test_argument_fuzz_of_every_entry_point_never_crashes():
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    done = subprocess.run(
        [sys.executable, "-c", FUZZ],
        capture_output=True,
        text=True,
        timeout=600,
        env=_fuzz_environment(),
    )
    lines = done.stdout.splitlines()
    assert done.returncode == 0, (
        f"the fuzz died with exit code {done.returncode} in "
        f"{next((ln for ln in reversed(lines) if ln.startswith('CASE')), '?')}: "
        f"{done.stderr[-2000:]}"
    )
    results = json.loads(next(ln for ln in lines if ln.startswith("RESULTS "))[8:])
    assert len(results) > 120
    bad = [f"{label}: {message}" for label, ok, message in results if not ok]
    assert not bad, "\n".join(bad)


def _fuzz_environment():
    import os

    environment = {k: v for k, v in os.environ.items() if not k.startswith("NKI_SIM_")}
    environment["PYTHONPATH"] = os.pathsep.join(sys.path)
    return environment
