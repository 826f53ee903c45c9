"""nki 0.6 front-end: user classes must inherit from ``nl.NKIObject`` and no other classes
(nki/get-started/nki-language-guide.rst@81ce03ae, L572), in kernel arguments and in the
kernel's own code; every rejected case has a legal twin that runs."""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pytest

import simulate.nki06 as nki
from simulate.nki06 import language as nl

DOC = "nki-language-guide.rst@81ce03ae, L572"


@pytest.fixture(autouse=True)
def _trn2(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)


class ScalePair(NamedTuple):
    scale: float
    shift: float


class PlainScale:
    def __init__(self, scale, shift):
        self.scale, self.shift = scale, shift


@dataclass(frozen=True)
class Scale(nl.NKIObject):
    scale: float
    shift: float


class Mixin:
    pass


@dataclass
class MixedScale(nl.NKIObject, Mixin):
    scale: float
    shift: float


class Mode(enum.Enum):
    AFFINE = 1


def affine(x, params):
    """A kernel: x · scale + shift, the pair taken from any object with those attributes."""
    t = nl.load(x)
    o = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nl.store(o, value=nl.add(nl.multiply(t, params.scale), params.shift))
    return o


def _x(rng):
    return rng.standard_normal((4, 8)).astype(np.float32)


def _expected(x):
    return x * np.float32(3.0) + np.float32(0.5)


@pytest.mark.parametrize(
    "params, name",
    [
        (ScalePair(3.0, 0.5), "ScalePair"),
        (PlainScale(3.0, 0.5), "PlainScale"),
        (MixedScale(3.0, 0.5), "MixedScale"),
    ],
)
def test_kernel_arguments_of_non_nkiobject_classes_are_rejected(rng, params, name):
    with pytest.raises(TypeError, match=rf"argument `params`.*`{name}`.*NKIObject.*{DOC}"):
        nki.jit(affine)(_x(rng), params)


def test_nkiobject_arguments_run(rng):
    x = _x(rng)
    np.testing.assert_array_equal(nki.jit(affine)(x, Scale(3.0, 0.5)), _expected(x))


def test_tuples_and_dicts_are_looked_into(rng):
    def kernel(x, pairs):
        return affine(x, pairs[0]["p"])

    x = _x(rng)
    with pytest.raises(TypeError, match="ScalePair"):
        nki.jit(kernel)(x, ({"p": ScalePair(3.0, 0.5)},))
    np.testing.assert_array_equal(nki.jit(kernel)(x, ({"p": Scale(3.0, 0.5)},)), _expected(x))


def _make_plain():
    return PlainScale(3.0, 0.5)


def _make_pair():
    return ScalePair(3.0, 0.5)


def _make_nkiobject():
    return Scale(3.0, 0.5)


@pytest.mark.parametrize(
    "make, message",
    [
        (_make_plain, r"class `PlainScale\(object\)`.*must inherit from NKIObject"),
        (_make_pair, r"class `ScalePair\(tuple\)`.*must inherit from NKIObject"),
    ],
)
def test_instances_built_in_the_kernel_body_are_rejected(rng, make, message):
    def kernel(x, mode):
        assert mode == Mode.AFFINE
        return affine(x, make())

    def legal(x, mode):
        assert mode == Mode.AFFINE
        return affine(x, _make_nkiobject())

    x = _x(rng)
    with pytest.raises(TypeError, match=rf"{message}.*nki-language-guide.rst L572"):
        nki.jit(kernel)(x, Mode.AFFINE)
    np.testing.assert_array_equal(nki.jit(legal)(x, Mode.AFFINE), _expected(x))


def _kernel_with_local(pair_class):
    """A kernel that builds its scale pair of ``pair_class`` and never passes it on."""

    def kernel(x):
        pair = pair_class(3.0, 0.5)
        t = nl.load(x)
        o = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nl.store(o, value=nl.add(nl.multiply(t, pair.scale), pair.shift))
        return o

    return kernel


def test_a_namedtuple_used_only_locally_is_rejected(rng):
    x = _x(rng)
    with pytest.raises(TypeError, match=r"class `ScalePair\(tuple\)`.*must inherit from NKIObject"):
        nki.jit(_kernel_with_local(ScalePair))(x)
    np.testing.assert_array_equal(nki.jit(_kernel_with_local(Scale))(x), _expected(x))


def test_the_body_is_checked_on_every_core_of_an_lnc2_launch(rng):
    def kernel(x):
        return affine(x, _make_plain())

    def legal(x):
        return affine(x, _make_nkiobject())

    x = _x(rng)
    with pytest.raises(TypeError, match="PlainScale"):
        nki.jit(kernel)[2](x)
    np.testing.assert_array_equal(nki.jit(legal)[2](x), _expected(x))


def test_the_thread_trace_function_is_restored(rng):
    def tracer(frame, event, arg):
        return None

    def kernel(x):
        return affine(x, _make_plain())

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        with pytest.raises(TypeError, match="PlainScale"):
            nki.jit(kernel)(_x(rng))
        assert sys.gettrace() is tracer
        nki.jit(affine)(_x(rng), Scale(3.0, 0.5))
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(previous)


def test_the_planners_containers_are_nkiobject_classes_only():
    """What the 0.6 kernels build from the shared planners compiles: every class there is a
    dataclass whose bases all derive from the 0.6 kernels' ``nl.NKIObject``."""
    import dataclasses
    import inspect

    from nki_rmsnorm.kernels.nki06._nki import nl as kernels_nl
    from nki_rmsnorm.plan import backward, forward

    classes = [
        cls
        for module in (forward, backward)
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if cls.__module__ == module.__name__
    ]
    assert len(classes) >= 13
    for cls in classes:
        assert dataclasses.is_dataclass(cls), cls
        assert all(
            base is object or issubclass(base, kernels_nl.NKIObject) for base in cls.__mro__
        ), cls
