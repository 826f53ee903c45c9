"""The emulated NKI release of the 0.6 front-end (``simulate/nki06/release.py``): what 0.5 and
0.6 added (aws-neuron-sdk@81ce03ae ``release-notes/components/nki.rst``) raises under an older
release, naming the first release and the release-notes line; the same kernel runs under the
release that has it, and a kernel written for 0.4 runs under every release."""

from __future__ import annotations

import numpy as np
import pytest

import simulate.nki06 as nki
from simulate.nki06 import isa as nisa
from simulate.nki06 import language as nl
from simulate.nki06 import release
from simulate.nki06.release import NkiReleaseError, nki_release


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    monkeypatch.delenv(release.ENV, raising=False)


def _x():
    return np.random.default_rng(3).standard_normal((4, 8)).astype(np.float32)


def copy_through_a_permuted_view(x):
    t = nl.load(x)
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=t.permute((0, 1)))
    return out


def copy_through_chained_slices(x):
    t = nl.load(x)
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    rows = t[0:4, :]
    nl.store(out, value=rows[:, 0:8])
    return out


def copy_through_one_slice(x):
    t = nl.load(x)
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=t[0:4, 0:8])
    return out


def broadcast_to_is_04(x):
    t = nl.load(x[:, 0:1])
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=nl.broadcast_to(t, x.shape))
    return out


def counts_with_fori_loop(x):
    acc = nl.zeros((4, 1), nl.float32)

    def body(i):
        nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=1.0)

    nl.fori_loop(0, 3, body)
    out = nl.ndarray((4, 1), nl.float32, buffer=nl.shared_hbm)
    nl.store(out, value=acc)
    return out


@pytest.mark.parametrize(
    "kernel, name, first, line",
    [
        (copy_through_a_permuted_view, "NkiTensor.permute", "0.5", "L127-132"),
        (copy_through_chained_slices, "chained slicing", "0.5", "L860"),
        (counts_with_fori_loop, "nl.fori_loop", "0.6", "L29-32"),
    ],
)
def test_newer_apis_raise_under_older_releases(kernel, name, first, line):
    x = _x()
    older = release.RELEASES[release.RELEASES.index(first) - 1]
    with (
        nki_release(older),
        pytest.raises(NkiReleaseError, match=rf"{name}.*NKI {older}.*{first}.*{line}"),
    ):
        nki.jit(kernel)(x)
    with nki_release(first):
        result = nki.jit(kernel)(x)
    expected = np.full((4, 1), 3.0, np.float32) if kernel is counts_with_fori_loop else x
    np.testing.assert_array_equal(result, expected)


def test_04_kernels_run_under_every_release(monkeypatch):
    x = _x()
    for name in release.RELEASES:
        monkeypatch.setenv(release.ENV, name)
        np.testing.assert_array_equal(nki.jit(copy_through_one_slice)(x), x)
        np.testing.assert_array_equal(
            nki.jit(broadcast_to_is_04)(x), np.broadcast_to(x[:, :1], x.shape)
        )


def test_the_environment_selects_the_release(monkeypatch):
    assert release.current() == "0.6"
    monkeypatch.setenv(release.ENV, "0.4")
    assert release.current() == "0.4"
    with pytest.raises(NkiReleaseError, match="NkiTensor.permute is not in NKI 0.4"):
        nki.jit(copy_through_a_permuted_view)(_x())
    monkeypatch.setenv(release.ENV, "0.3")
    with pytest.raises(AssertionError, match="emulates NKI 0.4, 0.5, 0.6"):
        release.current()
