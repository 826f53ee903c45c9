"""The NKI meta-programming language in the 0.6 front-end (``simulate/nki06/language_check.py``,
``docs/nki_language.md``): for every rule a kernel that breaks it, rejected before any
instruction runs with one error naming the construct and its ``file:line``, and a legal twin
that runs and computes the right numbers. Each illegal line carries a ``# rule:<name>`` marker
that the test uses to find the line the error must name."""

from __future__ import annotations

import contextlib
import enum
import math
import os
import subprocess
import sys
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import simulate.language as legacy_nl
import simulate.nki06 as nki
from simulate.nki06 import isa as nisa
from simulate.nki06 import language as nl
from simulate.nki06 import language_check, runtime
from simulate.nki06.language_check import NkiLanguageError

HERE = Path(__file__)
ROOT = HERE.parents[3]
SOURCE_LINES = HERE.read_text().splitlines()


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    monkeypatch.delenv(language_check.ENV_SWITCH, raising=False)


def _line(rule: str) -> int:
    """The line of this file marked ``# rule:<rule>`` (exactly one)."""
    marker = f"# rule:{rule}"
    found = [i + 1 for i, text in enumerate(SOURCE_LINES) if text.rstrip().endswith(marker)]
    assert len(found) == 1, (rule, found)
    return found[0]


def _scaled(x, factor):
    """Kernel helper: ``x · factor`` into a new HBM output."""
    t = nl.load(x)
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=nl.multiply(t, factor))
    return out


def _x():
    return np.random.default_rng(7).standard_normal((4, 8)).astype(np.float32)


def _rejects(kernel, rule: str, construct: str, *args, error=NkiLanguageError, static=True):
    """``kernel`` is rejected naming the marked line and the construct; ``static``: before
    its body starts (the launch never reaches the programs)."""
    where = rf"test_nki06_language\.py:{_line(rule)}: "
    with pytest.MonkeyPatch.context() as patch:
        if static:
            patch.setattr(runtime, "_run_programs", _must_not_run)
        with pytest.raises(error, match=where + r".*" + construct) as caught:
            nki.jit(kernel)(_x(), *args)
    assert "aws-neuron" in str(caught.value)  # the doc (or AWS kernel) behind the rule


def _must_not_run(*args):
    raise AssertionError("the kernel body ran before the language check rejected it")


def _runs(kernel, factor, *args) -> None:
    x = _x()
    np.testing.assert_allclose(nki.jit(kernel)(x, *args), x * np.float32(factor), rtol=1e-6)


# --- comprehensions and generators -----------------------------------------------------------
def list_comprehension(x):
    sizes = [n for n in range(3)]  # rule:comprehension
    return _scaled(x, float(len(sizes)))


def dict_comprehension(x):
    sizes = {str(n): n for n in range(3)}  # rule:dict_comprehension
    return _scaled(x, float(len(sizes)))


def append_loop(x):
    sizes = []
    for n in range(3):
        sizes.append(n)
    return _scaled(x, float(len(sizes)))


def generator_expression(x):
    largest = max(n for n in range(3))  # rule:generator
    return _scaled(x, float(largest))


def max_of_a_loop(x):
    largest = 0
    for n in range(3):
        largest = max(largest, n)
    return _scaled(x, float(largest))


def test_comprehensions_and_generators():
    _rejects(list_comprehension, "comprehension", "list/set/dict comprehension")
    _rejects(dict_comprehension, "dict_comprehension", "comprehension")
    _rejects(generator_expression, "generator", "generator expression")
    _runs(append_loop, 3)
    _runs(max_of_a_loop, 2)


# --- lambda, nested functions ------------------------------------------------------------------
def with_lambda(x):
    double = lambda v: v * 2  # noqa: E731 # rule:lambda
    return _scaled(x, double(1.5))


def with_nested_def(x):
    def double(v):
        return v * 2

    return _scaled(x, double(1.5))


def test_lambda_is_rejected_nested_def_runs():
    _rejects(with_lambda, "lambda", "a lambda")
    _runs(with_nested_def, 3.0)


# --- exceptions --------------------------------------------------------------------------------
def with_try(x):
    try:  # rule:try
        factor = 2.0
    except ValueError:
        factor = 1.0
    return _scaled(x, factor)


def with_raise(x):
    if x.shape[0] > 128:
        raise ValueError("too many rows")  # rule:raise
    return _scaled(x, 2.0)


def with_assert(x):
    assert x.shape[0] <= 128, f"too many rows: {x.shape[0]}"
    return _scaled(x, 2.0)


def test_try_and_raise_are_rejected_assert_runs():
    _rejects(with_try, "try", "try/except")
    _rejects(with_raise, "raise", "raise")
    _runs(with_assert, 2.0)


# --- with, global, import ------------------------------------------------------------------------
def with_nullcontext(x):
    with contextlib.nullcontext():  # rule:with
        out = _scaled(x, 2.0)
    return out


def with_no_reorder(x):
    with nl.no_reorder():
        out = _scaled(x, 2.0)
    return out


FACTOR = 2.0


def with_global(x):
    global FACTOR  # rule:global
    return _scaled(x, FACTOR)


def reading_a_module_constant(x):
    return _scaled(x, FACTOR)


def with_import(x):
    import math as m  # rule:import

    return _scaled(x, float(m.ceil(1.5)))


def with_module_math(x):
    return _scaled(x, float(math.ceil(1.5)))


def test_with_global_and_import():
    _rejects(with_nullcontext, "with", r"with-statement other than `with nl.no_reorder\(\):`")
    _rejects(with_global, "global", "global/nonlocal")
    _rejects(with_import, "import", "import inside kernel code")
    _runs(with_no_reorder, 2.0)
    _runs(reading_a_module_constant, 2.0)
    _runs(with_module_math, 2.0)


# --- sets, range slices, enumerate, zip, other builtins ----------------------------------------
def with_set_literal(x):
    seen = {1, 2}  # rule:set
    return _scaled(x, float(len(seen)))


def with_set_call(x):
    seen = set()  # rule:set_call
    return _scaled(x, float(len(seen) + 1))


def with_tuple(x):
    seen = (1, 2)
    return _scaled(x, float(len(seen)))


def with_range_slice(x):
    total = 0
    for i in range(8)[2:4]:  # rule:range_slice
        total += i
    return _scaled(x, float(total))


def with_range_bounds(x):
    total = 0
    for i in range(2, 4):
        total += i
    return _scaled(x, float(total))


def with_enumerate(x):
    total = 0
    for i, v in enumerate((1, 2)):  # rule:enumerate
        total += i * v
    return _scaled(x, float(total))


def with_zip(x):
    total = 0
    for a, b in zip((1, 2), (3, 4)):  # noqa: B905 # rule:zip
        total += a * b
    return _scaled(x, float(total))


def with_index_loops(x):
    values, others = (1, 2), (3, 4)
    total = 0
    for i in range(len(values)):
        total += i * values[i] + values[i] * others[i]
    return _scaled(x, float(total))


def with_sum(x):
    return _scaled(x, float(sum((1.0, 2.0))))  # rule:builtin


def with_documented_builtins(x):
    pieces = list((1.0, 2.0))
    rows, rest = divmod(len(pieces) + 5, 4)
    return _scaled(x, float(max(rows, rest) + min(1, 2) + int(str(0))))


def test_sets_range_slices_enumerate_zip_builtins():
    _rejects(with_set_literal, "set", "a set")
    _rejects(with_set_call, "set_call", "a set")
    _rejects(with_range_slice, "range_slice", "slicing a range")
    _rejects(with_enumerate, "enumerate", r"enumerate\(\)")
    _rejects(with_zip, "zip", r"zip\(\)")
    _rejects(with_sum, "builtin", "`sum`.*builtin the language does not have")
    _runs(with_tuple, 2.0)
    _runs(with_range_bounds, 5.0)
    _runs(with_index_loops, 1 * 3 + 2 + 2 * 4)
    _runs(with_documented_builtins, 4.0)


# --- yield, async, walrus, del, match ------------------------------------------------------------
def _factors():
    yield 2.0  # rule:yield


def with_generator_function(x):
    for factor in _factors():
        return _scaled(x, factor)


def _factor_list():
    return [2.0]


def with_list_function(x):
    for factor in _factor_list():
        return _scaled(x, factor)


def with_async(x):
    async def later():  # rule:async
        return 2.0

    return _scaled(x, 2.0)


def with_walrus(x):
    if (rows := x.shape[0]) > 0:  # rule:walrus
        return _scaled(x, float(rows))


def with_assignment(x):
    rows = x.shape[0]
    if rows > 0:
        return _scaled(x, float(rows))


def with_del(x):
    factor = 2.0
    spare = factor
    del spare  # rule:delete
    return _scaled(x, factor)


def with_match(x):
    match x.shape[0]:  # rule:match
        case 4:
            factor = 2.0
        case _:
            factor = 1.0
    return _scaled(x, factor)


def with_elif(x):
    if x.shape[0] == 4:
        factor = 2.0
    elif x.shape[0] == 8:
        factor = 3.0
    else:
        factor = 1.0
    return _scaled(x, factor)


def test_yield_async_walrus_del_match():
    _rejects(with_generator_function, "yield", "yield")
    _rejects(with_async, "async", "async/await")
    _rejects(with_walrus, "walrus", r"assignment expression \(:=\)")
    _rejects(with_del, "delete", "del")
    _rejects(with_match, "match", "match statement")
    _runs(with_list_function, 2.0)
    _runs(with_assignment, 4.0)
    _runs(with_elif, 2.0)


# --- star arguments and unpacking ---------------------------------------------------------------
def _scaled_by_all(x, *factors):  # rule:star_signature
    return _scaled(x, factors[0])


def with_star_signature(x):
    return _scaled_by_all(x, 2.0)


def with_star_call(x):
    arguments = (x, 2.0)
    return _scaled(*arguments)  # rule:star_call


def with_kwargs_call(x):
    arguments = {"factor": 2.0}
    return _scaled(x, **arguments)  # rule:kwargs_call


def with_named_arguments(x):
    return _scaled(x=x, factor=2.0)


def with_star_unpack(x):
    first, *rest = (2.0, 3.0, 4.0)  # rule:star_unpack
    return _scaled(x, first + len(rest) - 2)


def with_tuple_unpack(x):
    first, second, third = (2.0, 3.0, 4.0)
    return _scaled(x, first + second - third + 1)


def test_star_arguments_and_unpacking():
    _rejects(with_star_signature, "star_signature", r"\*args/\*\*kwargs parameter")
    _rejects(with_star_call, "star_call", r"\*args/\*\*kwargs forwarding")
    _rejects(with_kwargs_call, "kwargs_call", r"\*args/\*\*kwargs forwarding")
    _rejects(with_star_unpack, "star_unpack", "star-unpacking")
    _runs(with_named_arguments, 2.0)
    _runs(with_tuple_unpack, 2.0)


# --- decorators ------------------------------------------------------------------------------
def _unchanged(function):
    return function


def with_user_decorator(x):
    @_unchanged  # rule:decorator
    def factor():
        return 2.0

    return _scaled(x, factor())


@dataclass(frozen=True)
class Factor(nl.NKIObject):
    value: float

    @staticmethod
    def unit():
        return 1.0

    @property
    def doubled(self):
        return self.value * 2


def with_documented_decorators(x):
    return _scaled(x, Factor(1.0).doubled + Factor.unit())


def test_decorators():
    _rejects(with_user_decorator, "decorator", r"`@_unchanged`.*decorator other than")
    _runs(with_documented_decorators, 3.0)


# --- is ----------------------------------------------------------------------------------------
def with_is(x):
    if x.dtype is nl.float32:  # rule:is
        return _scaled(x, 2.0)
    return _scaled(x, 1.0)


def with_equality_and_is_none(x, bias=None):
    if x.dtype == nl.float32 and bias is None:
        return _scaled(x, 2.0)
    return _scaled(x, 1.0)


def test_is_only_against_none():
    _rejects(with_is, "is", "`is`/`is not` other than against None")
    _runs(with_equality_and_is_none, 2.0)


# --- libraries ---------------------------------------------------------------------------------
def with_numpy(x):
    return _scaled(x, float(np.float32(2.0)))  # rule:library_module


def with_stdlib_call(x):
    return _scaled(x, deepcopy(2.0))  # rule:library_call


def with_plain_float(x):
    return _scaled(x, 2.0)


def with_a_numpy_float_constant(x):
    """AWS: ``nisa.memset(..., value=-np.inf)`` (nki-library@d2ad3a5 attention_tkg.py L1040)."""
    return _scaled(x, np.pi)


def test_libraries_in_kernel_code():
    _rejects(with_numpy, "library_module", "`np.float32` \\(module `numpy`\\)")
    _rejects(with_stdlib_call, "library_call", "call into a non-NKI library")
    _runs(with_plain_float, 2.0)
    _runs(with_a_numpy_float_constant, np.pi)


# --- classes -----------------------------------------------------------------------------------
class PlainFactor:  # rule:class_base
    value = 2.0


def with_plain_class(x):
    return _scaled(x, PlainFactor.value)


class NkiFactor(nl.NKIObject):
    value = 2.0


def with_nki_class(x):
    return _scaled(x, NkiFactor.value)


@dataclass
class Sections(nl.NKIObject):
    """AWS's pattern: un-annotated attributes, built by keyword (nki-library@d2ad3a5
    core/attention/attention_cte.py L868-876)."""

    index = None
    offset = None


class Point(nl.NKIObject):
    """The guide's class (L575-586) without @dataclass: the compiler makes __init__."""

    x: int
    y: bool = False

    def toggle(self):
        self.y = not self.y


def with_generated_initializers(x):
    sections = Sections(index=1, offset=3)
    point = Point(2)
    point.toggle()
    assert point.y and Point(1, y=True).y
    return _scaled(x, float(sections.index + sections.offset + point.x))


def test_classes():
    _rejects(
        with_plain_class,
        "class_base",
        "class `PlainFactor\\(object\\)`.*must inherit from NKIObject",
        error=TypeError,
    )
    _runs(with_nki_class, 2.0)
    _runs(with_generated_initializers, 6.0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        Sections(colour=1)


# --- values crossing into kernel code ------------------------------------------------------------
NUMPY_DTYPE = np.dtype(np.float32)
NKI_DTYPE = nl.float32
NUMPY_SCALAR = np.float32(2.0)
NUMPY_ARRAY = np.arange(32, dtype=np.float32).reshape(4, 8)
A_SET = frozenset({2.0})
INT_KEYS = {2: 2.0}
STR_KEYS = {"two": 2.0}
HUGE = 1 << 40
HUGE_FLOAT = 1e300  # beyond float32: the guide's values are "32-bit IEEE floating-point" (L146)
A_COMPLEX = 2 + 0j  # none of the guide's six value types (L141-156)
FLOAT32_MIN = -3.4028235e38  # AWS spelling (nki-library@d2ad3a5 attention_cte.py L135)
DTYPE_SIZES = {nl.float32: 4, nl.bfloat16: 2}  # AWS: a module dict keyed by nl dtypes


def reads_numpy_dtype(x):
    t = nl.ndarray(x.shape, dtype=NUMPY_DTYPE, buffer=nl.sbuf)  # rule:numpy_dtype
    return _scaled(x, float(t.shape[0] // 2))


def reads_nki_dtype(x):
    t = nl.ndarray(x.shape, dtype=NKI_DTYPE, buffer=nl.sbuf)
    return _scaled(x, float(t.shape[0] // 2 * DTYPE_SIZES[NKI_DTYPE] // 4))


def reads_numpy_scalar(x):
    return _scaled(x, NUMPY_SCALAR)  # rule:numpy_scalar


def reads_a_set(x):
    return _scaled(x, float(len(A_SET)) * 2)  # rule:set_value


def reads_int_keys(x):
    return _scaled(x, INT_KEYS[2])  # rule:int_keys


def reads_str_keys(x):
    return _scaled(x, STR_KEYS["two"])


def reads_huge(x):
    return _scaled(x, float(HUGE // HUGE) * 2)  # rule:huge


def reads_huge_float(x):
    return _scaled(x, float(HUGE_FLOAT > 0) * 2)  # rule:huge_float


def reads_float32_min(x):
    return _scaled(x, float(FLOAT32_MIN < 0) * 2)


def reads_complex(x):
    return _scaled(x, A_COMPLEX.real)  # rule:complex_value


def reads_numpy_array(x):
    c = nl.load(nl.shared_constant(NUMPY_ARRAY))
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=nl.multiply(c, NUMPY_ARRAY[0, 2]))  # rule:numpy_array
    return out


def shared_constant_of_an_array(x):
    c = nl.load(nl.shared_constant(NUMPY_ARRAY))
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=nl.add(c, nl.multiply(nl.load(x), 2.0)))
    return out


def test_values_crossing_into_kernel_code():
    _rejects(
        reads_numpy_dtype, "numpy_dtype", "NumPy dtype `np.dtype\\('float32'\\)`", error=TypeError
    )
    _rejects(reads_numpy_scalar, "numpy_scalar", "NumPy scalar", error=TypeError)
    _rejects(reads_a_set, "set_value", "frozenset", error=TypeError)
    _rejects(reads_int_keys, "int_keys", "dict keyed by int", error=TypeError)
    _rejects(reads_huge, "huge", "outside 32 bits", error=TypeError)
    _rejects(reads_huge_float, "huge_float", "beyond the range of 32-bit IEEE", error=TypeError)
    _rejects(reads_complex, "complex_value", "complex", error=TypeError)
    _runs(reads_float32_min, 2.0)
    _rejects(reads_numpy_array, "numpy_array", "NumPy array", error=TypeError)
    _runs(reads_nki_dtype, 2.0)
    _runs(reads_str_keys, 2.0)
    x = _x()
    np.testing.assert_array_equal(nki.jit(shared_constant_of_an_array)(x), NUMPY_ARRAY + 2 * x)


def test_arguments_must_be_nki_values():
    def kernel(x, dtype):
        t = nl.ndarray(x.shape, dtype=dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        out = nl.ndarray(x.shape, dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out

    x = _x()
    with pytest.raises(TypeError, match=r"argument `dtype` .*NumPy dtype.*nki.api.shared.rst"):
        nki.jit(kernel)(x, np.dtype(np.float32))
    with pytest.raises(TypeError, match=r"argument `dtype` .*NumPy dtype class `numpy.float32`"):
        nki.jit(kernel)(x, np.float32)
    with pytest.raises(TypeError, match=r"argument `dtype` .*set"):
        nki.jit(kernel)(x, {1})
    np.testing.assert_array_equal(nki.jit(kernel)(x, nl.float32), x)


def test_numpy_dtypes_made_in_kernel_code_are_rejected_at_the_api():
    """A NumPy dtype the static pass cannot see (built by a host object's method) still
    cannot reach an nl dtype field."""

    def kernel(x, like):
        t = nl.ndarray(x.shape, dtype=like.dtype, buffer=nl.sbuf)
        return _scaled(x, float(t.shape[0] // 2))

    class Holder(nl.NKIObject):
        pass

    holder = Holder()
    holder.dtype = nl.float32
    _runs(kernel, 2.0, holder)
    holder.dtype = "float32"  # the 0.6 stubs type dtypes as str
    _runs(kernel, 2.0, holder)
    with pytest.raises(TypeError, match="not an nki.language dtype"):
        with nl_program():
            nl.ndarray((4, 8), dtype=np.dtype(np.float32), buffer=nl.sbuf)


@contextlib.contextmanager
def nl_program():
    """Run ``nl`` calls outside a launch, as one program of a trn2 launch."""
    from simulate.nki06 import context

    state = context.Launch(context.target_from_env("trn2"), 1, 0)
    previous = context.enter(context.Program(state, 0))
    try:
        yield
    finally:
        context.enter(previous)


# --- enums -------------------------------------------------------------------------------------
class Mode(enum.Enum):
    SCALE = 1
    SHIFT = 2


def compares_nc_version(x):
    newer = nisa.get_nc_version() >= nisa.nc_version.gen3
    same = nisa.get_nc_version() == nisa.nc_version.gen3
    return _scaled(x, 2.0 if newer and same else 1.0)


def compares_the_value_of_nc_version(x):
    """The guide's enum members carry ``name`` and ``value`` (L648-659): an int comparison."""
    return _scaled(x, 2.0 if nisa.get_nc_version().value >= 3 else 1.0)


def converts_nc_version(x):
    return _scaled(x, float(int(nisa.get_nc_version())))


def adds_to_nc_version(x):
    return _scaled(x, float(nisa.get_nc_version() + 1))


def orders_nc_version_against_an_int(x):
    return _scaled(x, 2.0 if nisa.get_nc_version() >= 3 else 1.0)


def orders_a_user_enum(x, mode):
    return _scaled(x, 2.0 if mode < Mode.SHIFT else 1.0)


def compares_a_user_enum(x, mode):
    return _scaled(x, 2.0 if mode == Mode.SCALE else 1.0)


def test_enums_compare_only_by_equality_nc_version_also_orders():
    x = _x()
    for kernel in (converts_nc_version, adds_to_nc_version, orders_nc_version_against_an_int):
        with pytest.raises(TypeError, match=r"test_nki06_language\.py:\d+: .*guide.rst L661"):
            nki.jit(kernel)(x)
    with pytest.raises(TypeError):
        nki.jit(orders_a_user_enum)(x, Mode.SCALE)
    _runs(compares_nc_version, 2.0)
    _runs(compares_the_value_of_nc_version, 2.0)
    _runs(compares_a_user_enum, 2.0, Mode.SCALE)
    assert not isinstance(nisa.get_nc_version, int) and not issubclass(nisa.nc_version, int)


# --- AWS's API surface: raw-int dge_mode, jit keywords, nki.isa.constants, nki.dtype ---
def copies_with_dge_mode(x, mode):
    t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x, dge_mode=mode)
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


def copies_with_engine(x, engine):
    t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    u = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=u, src=t, engine=engine)
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=u)
    return out


def test_raw_int_dge_mode_as_aws_passes_it():
    x = _x()
    np.testing.assert_array_equal(nki.jit(copies_with_dge_mode)(x, 3), x)  # dge_mode.none
    with pytest.raises(TypeError, match="dge_mode=7"):
        nki.jit(copies_with_dge_mode)(x, 7)
    with pytest.raises(TypeError, match="raw integers are not accepted"):
        nki.jit(copies_with_engine)(x, 5)  # other enums stay strict (migration guide L625)
    np.testing.assert_array_equal(nki.jit(copies_with_engine)(x, nisa.engine.vector), x)


def test_aws_api_surface():
    kernel = nki.jit(debug_kernel=True, show_compiler_tb=True, experimental_flags="x")(
        with_plain_float
    )
    x = _x()
    np.testing.assert_array_equal(kernel(x), x * 2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'optimise'"):
        nki.jit(optimise=True)
    from simulate.nki06 import constants

    assert constants.dge_mode is nisa.dge_mode and nisa.constants is constants
    assert nki.dtype is type(nl.float32)


# --- the checker itself: default on, one error, every reachable function, cache, switch, CLI ------
def _helper_with_comprehension(x):
    return [n for n in range(2)]  # rule:reached


class Holder(nl.NKIObject):
    def __init__(self, function):
        self.function = function


def calls_a_helper(x):
    return _scaled(x, float(len(_helper_with_comprehension(x))))


def calls_a_function_it_is_handed(x, holder):
    return _scaled(x, float(len(holder.function(x))))


def test_reachable_code_is_checked_before_anything_runs():
    _rejects(calls_a_helper, "reached", "comprehension")
    # a function only the running kernel reaches (an attribute of an argument): checked when
    # first called, before its body runs
    handed = Holder(_helper_with_comprehension)
    _rejects(calls_a_function_it_is_handed, "reached", "comprehension", handed, static=False)


def test_one_error_lists_how_many_more():
    with pytest.raises(
        NkiLanguageError, match=r"and \d+ more: python -m simulate.nki06 module:function"
    ):
        nki.jit(many_violations)(_x())


def many_violations(x):
    sizes = [n for n in range(2)]
    largest = max(n for n in sizes)
    for i, n in enumerate(sizes):
        largest += i * n
    return _scaled(x, float(largest))


def test_the_switch_turns_the_check_off(monkeypatch):
    monkeypatch.setenv(language_check.ENV_SWITCH, "0")
    _runs(list_comprehension, 3.0)
    _runs(reads_numpy_scalar, 2.0)


def test_repeated_launches_do_not_recheck(monkeypatch):
    kernel = nki.jit(with_plain_float)
    kernel(_x())
    calls = []
    original = language_check._checker.violations
    monkeypatch.setattr(
        language_check._checker, "violations", lambda roots: calls.append(roots) or original(roots)
    )
    kernel(_x())
    assert calls == []


def test_cli_lists_every_violation():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "simulate.nki06",
            "tests.simulate.nki06.test_nki06_language:many_violations",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 1, result.stderr
    assert "Warning" not in result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1].endswith("3 violation(s)")
    for construct in ("comprehension", "generator expression", "enumerate()"):
        assert any(construct in line for line in lines), (construct, lines)


def test_kernel_without_source_is_rejected():
    namespace = {"_scaled": _scaled}
    exec("def no_source(x):\n    return _scaled(x, 2.0)\n", namespace)  # noqa: S102
    with pytest.raises(NkiLanguageError, match="source cannot be read"):
        nki.jit(namespace["no_source"])(_x())


# --- AWS's 0.6 doc examples pass the static check -------------------------------------------
MIRROR = Path("/work/.mirror/aws-neuron+aws-neuron-sdk/repo")


@pytest.mark.skipif(not MIRROR.is_dir(), reason="the aws-neuron-sdk docs mirror is not here")
def test_aws_doc_examples_pass_the_static_check(tmp_path):
    import runpy

    listing = subprocess.run(
        ["git", "-C", str(MIRROR), "ls-tree", "-r", "--name-only", "HEAD", "nki/examples"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    nki.install()
    kernels = []
    for path in listing:
        if not path.endswith(".py") or "torch" in path or "jax" in path:
            continue
        source = subprocess.run(
            ["git", "-C", str(MIRROR), "show", f"HEAD:{path}"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        script = tmp_path / path.replace("/", "_")
        script.write_text(source)
        try:
            namespace = runpy.run_path(str(script), run_name="aws_example")
        except Exception:  # noqa: BLE001 - doc fragments, torch_neuronx launchers run at import
            continue
        kernels += [v for v in namespace.values() if isinstance(v, nki.Kernel)]
    assert len(kernels) >= 10
    assert [v.short() for k in kernels for v in language_check.find_violations(k)] == []


# --- the rest of the 0.6 docs' language statements ------------------------------------------------
def _scaled_by(x, factor, *, twice=False):  # rule:keyword_only
    return _scaled(x, factor * (2 if twice else 1))


def _scaled_by_default(x, factor, twice=False):
    return _scaled(x, factor * (2 if twice else 1))


def with_keyword_only(x):
    return _scaled_by(x, 1.5, twice=True)


def with_trailing_default(x):
    return _scaled_by_default(x, 1.5, twice=True)


def with_for_else(x):
    found = 0.0
    for n in range(3):  # rule:for_else
        found = float(n)
    else:
        found = found + 1.0
    return _scaled(x, found)


def with_while_else(x):
    n = 0
    while n < 3:  # rule:while_else
        n += 1
    else:
        n += 1
    return _scaled(x, float(n))


def with_loop_then_statement(x):
    found = 0.0
    for n in range(3):
        found = float(n)
    found = found + 1.0
    return _scaled(x, found)


def with_nested_plain_class(x):
    class Scale:  # rule:nested_class
        factor = 2.0

    return _scaled(x, Scale.factor)


def with_nested_nki_class(x):
    class Scale(nl.NKIObject):
        factor: float = 2.0

    return _scaled(x, Scale().factor)


def with_bytes(x):
    tag = b"rms"  # rule:bytes
    return _scaled(x, float(len(tag)))


def with_complex(x):
    z = 2j  # rule:complex
    return _scaled(x, z.imag)


def with_string(x):
    tag = "rms"
    return _scaled(x, float(len(tag)))


BEYOND_FLOAT32 = 1e39
FLOAT32_MAX = 3.4028234663852886e38


def reads_beyond_float32(x):
    return _scaled(x, BEYOND_FLOAT32 / BEYOND_FLOAT32)  # rule:beyond_float32


def reads_float32_max(x):
    return _scaled(x, FLOAT32_MAX / FLOAT32_MAX * 2.0)


def test_keyword_only_separator_loop_else_nested_classes_and_literals():
    # nki/migration/index.rst L683-697
    _rejects(with_keyword_only, "keyword_only", r"keyword-only separator .*L683-697")
    _runs(with_trailing_default, 3.0)
    # guide L455-500: the documented loops have no else clause
    _rejects(with_for_else, "for_else", "an `else` clause on a for/while loop")
    _rejects(with_while_else, "while_else", "an `else` clause on a for/while loop")
    _runs(with_loop_then_statement, 3.0)
    # guide L572: a class, also one defined in kernel code, inherits from NKIObject alone
    _rejects(with_nested_plain_class, "nested_class", "defined in kernel code", error=TypeError)
    _runs(with_nested_nki_class, 2.0)
    # guide L141-150: no bytes, no complex numbers; floats are 32-bit
    _rejects(with_bytes, "bytes", "a bytes or complex literal")
    _rejects(with_complex, "complex", "a bytes or complex literal")
    _runs(with_string, 3.0)
    _rejects(reads_beyond_float32, "beyond_float32", "beyond the range of 32-bit", error=TypeError)
    _runs(reads_float32_max, 2.0)


def with_legacy_namespace(x):
    t = nl.load(x)
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=legacy_nl.multiply(t, 2.0))  # rule:legacy_namespace
    return out


def with_nki_namespace(x):
    t = nl.load(x)
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=nl.multiply(t, 2.0))
    return out


def test_the_legacy_namespace_is_a_compilation_error():
    # nki/migration/index.rst L224-228: neuronxcc.nki.* inside a kernel is a compilation error
    _rejects(with_legacy_namespace, "legacy_namespace", r"neuronxcc.nki.*L224-228")
    _runs(with_nki_namespace, 2.0)


class SlottedFactor(nl.NKIObject):
    __slots__ = ("value",)  # rule:slots

    def __init__(self, value):
        self.value = value


class DictFactor(nl.NKIObject):
    def __init__(self, value):
        self.value = value


def scaled_by_factor_object(x, factor):
    return _scaled(x, factor.value)


def test_nkiobject_arguments_are_read_through_their_dictionary():
    # guide L604: "NKI does not look at slots or other object features, only the object
    # dictionary"
    _rejects(scaled_by_factor_object, "slots", "__slots__", SlottedFactor(2.0))
    _runs(scaled_by_factor_object, 2.0, DictFactor(2.0))


def with_simulator_helper(x):
    return _scaled(x, float(nl.PMAX // 64))  # rule:not_api


def with_tile_size_constant(x):
    return _scaled(x, float(nl.tile_size.pmax // 64))


def test_the_simulators_own_names_are_not_nki_api():
    # the 0.6 API reference (nki/api/nki/language/__init__.py) has no `PMAX`: the real `nki`
    # would fail on it
    _rejects(with_simulator_helper, "not_api", "the NKI 0.6 API does not have")
    _runs(with_tile_size_constant, 2.0)
