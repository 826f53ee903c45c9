"""The emulated Neuron SDK release: APIs and parameters appear in the release the docs give,
the choice is per context (thread), and the environment variable sets the default."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers import fresh_interpreter, random_array

import simulate as nki
import simulate.isa as nisa
import simulate.language as nl
from simulate import sdk


def test_default_is_the_newest_release():
    assert fresh_interpreter("import simulate; print(simulate.sdk_version())") == "2.29"
    assert nki.SDK_RELEASES[0] == "2.20" and nki.SDK_RELEASES[-1] == "2.29"


def test_every_table_row_cites_its_source():
    rows = (
        list(sdk.API_TABLE.values()) + list(sdk.PARAM_TABLE.values()) + list(sdk.OP_TABLE.values())
    )
    for release, citation in rows:
        assert release in sdk.RELEASES
        assert "@" in citation and ", L" in citation, citation


def test_apis_appear_in_their_release():
    with nki.use_sdk("2.25"):
        with pytest.raises(AttributeError, match="first appears in SDK 2.26"):
            nl.tile_size.total_available_sbuf_size  # noqa: B018 - the access is the test
        with pytest.raises(AttributeError, match="2.26"):
            nl.gelu_apprx_sigmoid  # noqa: B018
        assert callable(nl.gather_flattened)  # 2.24
    with nki.use_sdk("2.23"):
        with pytest.raises(AttributeError, match="first appears in SDK 2.24"):
            nl.gather_flattened  # noqa: B018
    with nki.use_sdk("2.20"):
        with pytest.raises(AttributeError, match="first appears in SDK 2.21"):
            nki.jit  # noqa: B018
        with pytest.raises(AttributeError, match="2.21"):
            nisa.tensor_copy  # noqa: B018
        assert callable(nki.baremetal) and callable(nisa.tensor_scalar)
    with nki.use_sdk("2.26"):
        assert nl.tile_size.total_available_sbuf_size > 0
        assert callable(nl.gelu_apprx_sigmoid)


def _rmw_kernel(x, base):
    out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=base)
    nisa.dma_copy(dst=out, src=nl.load(x), dst_rmw_op=np.add)
    return out


def test_parameters_appear_in_their_release(rng):
    x = random_array(rng, (128, 16), np.float32)
    base = random_array(rng, (128, 16), np.float32)
    with (
        nki.use_sdk("2.22"),
        pytest.raises(TypeError, match="dst_rmw_op.*first appears in SDK 2.23"),
    ):
        nki.simulate_kernel(_rmw_kernel, x, base)
    with nki.use_sdk("2.23"):
        np.testing.assert_allclose(nki.simulate_kernel(_rmw_kernel, x, base), x + base, rtol=1e-6)


def test_operators_appear_in_their_release(rng):
    x = random_array(rng, (128, 16), np.float32)

    def kernel(x):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        nl.store(out, value=nisa.activation(op=nl.abs, data=nl.load(x)))
        return out

    with nki.use_sdk("2.22"), pytest.raises(TypeError, match="op=abs.*2.23"):
        nki.simulate_kernel(kernel, x)
    with nki.use_sdk("2.23"):
        np.testing.assert_array_equal(nki.simulate_kernel(kernel, x), np.abs(x))


def test_tile_broadcast_to_predates_nl_broadcast_to(rng):
    """``tile.broadcast_to`` is an ``nki.tensor`` method from 2.20 on
    (general/nki/api/nki/__init__.py@72825d50, L317); ``nl.broadcast_to`` appears in 2.22."""
    column = random_array(rng, (128, 1), np.float32)

    def method(column):
        out = nl.ndarray((128, 8), nl.float32, buffer=nl.shared_hbm)
        nl.store(out, value=nl.load(column).broadcast_to((128, 8)))
        return out

    def function(column):
        out = nl.ndarray((128, 8), nl.float32, buffer=nl.shared_hbm)
        nl.store(out, value=nl.broadcast_to(nl.load(column), shape=(128, 8)))
        return out

    expected = np.broadcast_to(column, (128, 8))
    with nki.use_sdk("2.21"):
        np.testing.assert_array_equal(nki.simulate_kernel(method, column), expected)
        with pytest.raises(AttributeError, match="nl.broadcast_to.*first appears in SDK 2.22"):
            nki.simulate_kernel(function, column)
    with nki.use_sdk("2.22"):
        np.testing.assert_array_equal(nki.simulate_kernel(function, column), expected)


def test_return_convention_needs_2_21(rng):
    x = random_array(rng, (128, 16), np.float32)

    def returns(x):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        nl.store(out, value=nl.load(x))
        return out

    def writes(x, out):
        nl.store(out, value=nl.load(x))

    with nki.use_sdk("2.20"):
        with pytest.raises(TypeError, match="2.21"):
            nki.simulate_kernel(returns, x)
        out = np.full_like(x, np.nan)
        nki.baremetal(writes)(x, out)
        np.testing.assert_array_equal(out, x)
    with nki.use_sdk("2.21"):
        np.testing.assert_array_equal(nki.simulate_kernel(returns, x), x)


def test_set_sdk_validates_and_returns_the_previous_release():
    with nki.use_sdk("2.29"):
        assert nki.set_sdk("2.24.0") == "2.29"
        assert nki.sdk_version() == "2.24" and sdk.at_least("2.23") and not sdk.at_least("2.26")
        with pytest.raises(ValueError, match="2.19"):
            nki.set_sdk("2.19")
    with pytest.raises(ValueError):
        nki.use_sdk("3.0").__enter__()


def test_release_is_per_thread():
    seen = {}

    def worker():
        with nki.use_sdk("2.21"):
            seen["inside"] = nki.sdk_version()

    with nki.use_sdk("2.27"):
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join(timeout=30)
        assert not thread.is_alive()
        assert nki.sdk_version() == "2.27"
    assert seen["inside"] == "2.21"


def test_environment_variable_sets_the_default():
    code = "import simulate; print(simulate.sdk_version())"
    assert fresh_interpreter(code, NKI_SIM_SDK="2.24") == "2.24"


def test_strict_modules_live_in_the_core_under_their_old_names_too():
    """The strict modules moved into ``simulate.core``; ``simulate.<name>`` still imports."""
    import importlib

    import simulate.core as core

    for name in ("approx", "loop_index", "rules", "scoping", "sdk"):
        assert importlib.import_module(f"simulate.{name}") is getattr(core, name)
    assert nki.use_sdk is sdk.sdk and nki.set_approx is core.approx.set_approx
