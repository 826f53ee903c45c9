"""Approximate transcendentals: the Scalar engine's activation functions carry a bounded,
deterministic relative error and give NaN outside their documented input range; the engines
documented as more precise stay exact."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import fresh_interpreter, random_array

import simulate as nki
import simulate.isa as nisa
import simulate.language as nl
from simulate.approx import DEFAULT_BOUND


def _activation(op):
    def kernel(x):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        nl.store(out, value=nisa.activation(op=op, data=nl.load(x), dtype=nl.float32))
        return out

    return kernel


def _exact(op, x):
    x64 = x.astype(np.float64)
    return {
        "exp": np.exp(x64),
        "rsqrt": 1 / np.sqrt(x64),
        "reciprocal": 1 / x64,
        "tanh": np.tanh(x64),
        "square": x64 * x64,
    }[op]


def test_exact_unless_enabled(rng):
    x = random_array(rng, (128, 64), np.float32, 0.5, 4.0)
    with nki.use_approx(False):
        got = nki.simulate_kernel(_activation(nl.exp), x)
    np.testing.assert_allclose(got, np.exp(x.astype(np.float64)), rtol=2e-7)


@pytest.mark.parametrize("op", ["exp", "rsqrt", "reciprocal", "tanh"])
def test_scalar_engine_error_is_bounded_deterministic_and_spread(rng, op):
    x = random_array(rng, (128, 256), np.float32, 0.5, 4.0)
    with nki.use_approx():
        got = nki.simulate_kernel(_activation(getattr(nl, op)), x)
        again = nki.simulate_kernel(_activation(getattr(nl, op)), x)
    np.testing.assert_array_equal(got, again)  # deterministic
    relative = got / _exact(op, x) - 1
    assert np.abs(relative).max() <= DEFAULT_BOUND * (1 + 1e-3) + 2**-23
    assert np.abs(relative).max() > DEFAULT_BOUND / 2  # the error is really there
    assert abs(relative.mean()) < DEFAULT_BOUND / 8  # and not biased


def test_nl_functions_on_the_scalar_engine_are_approximated_too(rng):
    x = random_array(rng, (128, 256), np.float32, 0.5, 4.0)

    def kernel(x):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        nl.store(out, value=nl.rsqrt(nl.load(x)))
        return out

    with nki.use_approx(bound=2**-6):
        got = nki.simulate_kernel(kernel, x)
    relative = got * np.sqrt(x.astype(np.float64)) - 1
    assert 2**-7 < np.abs(relative).max() <= 2**-6 * (1 + 1e-3)


def test_outside_the_valid_input_range_is_nan():
    x = np.array([[0.0, 2.0**-90, 2.0**-80, 1.0, 2.0**96, 2.0**98, -1.0, 4.0]], np.float32)
    with nki.use_approx():
        got = nki.simulate_kernel(_activation(nl.rsqrt), x)[0]
        recip = nki.simulate_kernel(
            _activation(nl.reciprocal),
            np.array([[2.0**43, -(2.0**43), 2.0**-43, 3.0, -3.0]], np.float32),
        )[0]
    assert np.isnan(got[[0, 1, 5, 6]]).all()
    assert np.isfinite(got[[2, 3, 4, 7]]).all()
    assert np.isnan(recip[:3]).all() and np.isfinite(recip[3:]).all()
    with nki.use_approx(False):  # exact mode: 1/sqrt(0) is inf, as NumPy computes it
        assert np.isinf(nki.simulate_kernel(_activation(nl.rsqrt), x)[0][0])


def test_piecewise_exact_functions_and_precise_engines_stay_exact(rng):
    x = random_array(rng, (128, 64), np.float32, 0.5, 4.0)

    def precise(x):
        out = nl.ndarray((128, 128), nl.float32, buffer=nl.shared_hbm)
        t = nl.load(x)
        nl.store(
            out[:, 0:64], value=nisa.tensor_scalar(t, nl.rsqrt, 0.0, engine=nisa.gpsimd_engine)
        )
        nl.store(out[:, 64:128], value=nisa.reciprocal(t))
        return out

    with nki.use_approx():
        squares = nki.simulate_kernel(_activation(nl.square), x)
        got = nki.simulate_kernel(precise, x)
    np.testing.assert_array_equal(squares, x * x)
    np.testing.assert_allclose(got[:, :64], 1 / np.sqrt(x.astype(np.float64)), rtol=2e-7)
    np.testing.assert_allclose(got[:, 64:], 1 / x.astype(np.float64), rtol=2e-7)


def test_set_approx_and_bound_validation():
    with nki.use_approx(False):
        assert nki.approx_bound() == 0.0
        assert nki.set_approx(True) == 0.0
        assert nki.approx_bound() == DEFAULT_BOUND
        nki.set_approx(False)
    with pytest.raises(ValueError):
        nki.set_approx(True, bound=0.7)


def test_environment_variable_turns_it_on():
    code = "import simulate; print(simulate.approx_bound())"
    assert float(fresh_interpreter(code, NKI_SIM_APPROX="1")) == DEFAULT_BOUND
    assert float(fresh_interpreter(code)) == 0.0
