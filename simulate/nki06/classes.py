"""The 0.6 rule on user classes: "When you declare a class for use in a NKI kernel, the class
must inherit from NKIObject and no other classes" (nki/get-started/nki-language-guide.rst@81ce03ae,
L572). The compiler rejects any other user class, a ``NamedTuple`` included; the official
simulator runs the kernel as Python and accepts them, so this front-end checks:

* every kernel argument at launch (:func:`check_arguments`);
* while the body runs, every call and return of the kernel's own code — the files of the
  kernel function's top-level package (or, for a top-level module, its directory), never
  the simulator, the standard library or site-packages: the arguments a function of that
  code receives, and its return value and local variables when it returns
  (:func:`checking_kernel_code`, a per-thread ``sys.settrace`` hook, so only the launch's
  own core threads are traced).

Allowed values: None, bool, int, float, str, ... (builtins), tuples, lists and dicts of allowed
values, instances of ``NKIObject`` subclasses whose every base is ``NKIObject``-derived,
enums, functions, classes, modules, and objects of the simulator, the standard library,
NumPy and ml_dtypes (tensors, views, dtypes).
"""

from __future__ import annotations

import contextlib
import enum
import gc
import inspect
import math
import os
import sys
import sysconfig
import types
from collections.abc import Iterator

from .context import language_check_enabled
from .errors import NkiTypeError
from .language import NKIObject

DOC = "nki/get-started/nki-language-guide.rst@81ce03ae, L572"

#: Top-level modules whose objects a kernel may hold: the simulator (tensors, views, dtypes),
#: the standard library and the array libraries it builds on.
_LIBRARIES = frozenset(sys.stdlib_module_names) | {"simulate", "numpy", "ml_dtypes", "builtins"}
#: Tuples, lists and dicts are looked into to this depth (kernel containers are shallow).
_MAX_DEPTH = 4
#: sysconfig paths of the standard library and site-packages (not ``data``: the prefix may
#: hold the project itself).
_LIBRARY_PATH_KEYS = ("stdlib", "platstdlib", "purelib", "platlib")
#: Kinds of values that are code or names, never data a class could smuggle in.
_CODE_KINDS = (
    type,
    enum.Enum,
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    types.ModuleType,
)
_SIMULATOR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_LIBRARY_DIRS = tuple(
    {os.path.abspath(sysconfig.get_path(key)) + os.sep for key in _LIBRARY_PATH_KEYS}
)

_type_allowed: dict[type, bool] = {}


def _is_allowed_type(kind: type) -> bool:
    allowed = _type_allowed.get(kind)
    if allowed is None:
        if issubclass(kind, NKIObject):
            allowed = all(base is object or issubclass(base, NKIObject) for base in kind.__mro__)
        elif issubclass(kind, tuple) and hasattr(kind, "_fields"):
            allowed = False  # a NamedTuple, wherever it is defined
        elif issubclass(kind, _CODE_KINDS):
            allowed = True
        else:
            allowed = kind.__module__.partition(".")[0] in _LIBRARIES
        _type_allowed[kind] = allowed
    return allowed


_INT32_MIN, _UINT32_END = -(1 << 31), 1 << 32
#: The smallest magnitude that rounds to infinity in float32: 2**128 * (1 - 2**-25).
_FLOAT32_OVERFLOW = 2.0**128 * (1 - 2.0**-25)
VALUES_DOC = (
    "NKI values are None, bool, 32-bit int and float, str and tensors, in tuples, lists, "
    "string-keyed dicts and NKIObject classes (nki/get-started/nki-language-guide.rst"
    "@81ce03ae, L141-156); a dtype is an nki.language dtype (nki/api/nki.api.shared.rst"
    "@81ce03ae, L11-12)"
)


def _fits_float32(value: float) -> bool:
    """A finite float that rounds to a finite float32, or an infinity or NaN: "32-bit IEEE
    floating-point values" (nki/get-started/nki-language-guide.rst@81ce03ae, L146)."""
    return not math.isfinite(value) or abs(value) < _FLOAT32_OVERFLOW


def _numpy_problem(value) -> str | None:
    """What a NumPy/ml_dtypes/torch value is, when ``value`` is one (never an NKI value)."""
    module = type(value).__module__.partition(".")[0]
    if isinstance(value, type):
        module = value.__module__.partition(".")[0]
        if module in ("numpy", "ml_dtypes"):
            return f"the NumPy dtype class `{value.__module__}.{value.__name__}`"
        return None
    if module not in ("numpy", "ml_dtypes", "torch", "jax", "jaxlib"):
        return None
    import numpy as np

    if isinstance(value, np.dtype):
        return f"the NumPy dtype `np.dtype({str(value)!r})`"
    if isinstance(value, np.ndarray):
        return f"a NumPy array (shape {value.shape}, dtype {value.dtype})"
    if isinstance(value, np.generic):
        return f"the NumPy scalar `{type(value).__name__}({value!r})`"
    if module == "torch" and type(value).__name__ == "dtype":
        return f"the torch dtype `{value}`"
    return None


def offending_value(value, depth: int = 0, arrays: bool = False) -> str | None:
    """Why ``value`` (or an element of its tuples, lists, dicts) is not an NKI value, or None.

    Rejected: NumPy / ml_dtypes / torch dtypes, NumPy arrays and scalars, sets, bytes and
    complex numbers, ints outside 32 bits (signed or unsigned: the guide says "32-bit integer
    values"), finite floats beyond the float32 range ("32-bit IEEE floating-point values"),
    dicts with non-string keys (nl dtypes are strings), and instances of classes that are not
    NKIObject classes (:func:`offending_type`). ``arrays=True`` lets NumPy arrays through: the one
    API documented to take one is ``nl.shared_constant`` ("Can be a numpy array or a file
    path", ``nki/api/nki/language/__init__.py@81ce03ae`` L2630), so a local may hold one."""
    if depth == 0 and not language_check_enabled():
        bad_class = offending_type(value)
        return None if bad_class is None else _class_problem(bad_class)
    kind = type(value)
    if kind in (tuple, list):
        if depth < _MAX_DEPTH:
            for item in value:
                found = offending_value(item, depth + 1, arrays)
                if found is not None:
                    return found
        return None
    if kind is dict:
        if depth < _MAX_DEPTH:
            for key, item in value.items():
                if not isinstance(key, str):
                    return f"a dict keyed by {type(key).__name__} {key!r} (keys must be strings)"
                found = offending_value(item, depth + 1, arrays)
                if found is not None:
                    return found
        return None
    if kind is int and not _INT32_MIN <= value < _UINT32_END:
        return f"the int {value}, outside 32 bits"
    if kind in (set, frozenset):
        return f"the {kind.__name__} {value!r}"
    if kind in (bytes, bytearray, complex):
        return f"the {kind.__name__} {value!r}"
    if kind is float and not _fits_float32(value):
        return f"the float {value!r}, beyond the range of 32-bit IEEE floats"
    problem = _numpy_problem(value)
    if problem is not None and not (arrays and problem.startswith("a NumPy array")):
        return problem
    bad_class = offending_type(value, depth)
    if bad_class is not None:
        return _class_problem(bad_class)
    return None


def offending_type(value, depth: int = 0) -> type | None:
    """The first class of ``value`` (or of an element of its tuples, lists, dicts) that a 0.6
    kernel may not use, or None."""
    kind = type(value)
    if kind in (tuple, list):
        if depth < _MAX_DEPTH:
            for item in value:
                found = offending_type(item, depth + 1)
                if found is not None:
                    return found
        return None
    if kind is dict:
        if depth < _MAX_DEPTH:
            for item in (*value.keys(), *value.values()):
                found = offending_type(item, depth + 1)
                if found is not None:
                    return found
        return None
    return None if _is_allowed_type(kind) else kind


def _class_problem(kind: type) -> str:
    bases = ", ".join(base.__name__ for base in kind.__bases__)
    return (
        f"an instance of class `{kind.__qualname__}` (bases: {bases}): a class used in an NKI "
        "kernel must inherit from nl.NKIObject and no other classes, and NamedTuples are not "
        f"NKI classes ({DOC})"
    )


def _reject(problem: str, where: str) -> None:
    raise NkiTypeError(f"{where} is {problem}: not an NKI value. {VALUES_DOC}")


def check_arguments(func, arguments: dict) -> None:
    """Kernel arguments at launch (``arguments``: name → value)."""
    for name, value in arguments.items():
        problem = offending_value(value)
        if problem is not None:
            _reject(problem, f"argument `{name}` of kernel `{func.__name__}`")


def kernel_code_root(func) -> str | None:
    """The directory whose files count as the kernel's own code: its top-level package's."""
    module = sys.modules.get(getattr(func, "__module__", None) or "")
    top = sys.modules.get(module.__name__.partition(".")[0]) if module is not None else None
    path = getattr(top, "__file__", None)
    return None if path is None else os.path.dirname(os.path.abspath(path)) + os.sep


#: Per kernel-code root: code object → whether it is the kernel's own code (kept across
#: launches: the trace hook runs on every Python call of the launch and must stay cheap).
_kernel_code_by_root: dict[str, dict[types.CodeType, bool]] = {}


def _is_kernel_file(root: str, filename: str) -> bool:
    path = os.path.abspath(filename)
    return (
        path.startswith(root)
        and not path.startswith(_SIMULATOR_DIR)
        and not path.startswith(_LIBRARY_DIRS)
    )


def _qualified_name(code: types.CodeType) -> str:
    """``code.co_qualname`` (Python 3.11+); on 3.10 the ``__qualname__`` of the function that
    owns ``code``. Only error messages call it, so the search of the referrers costs nothing
    on a legal kernel."""
    qualname = getattr(code, "co_qualname", None)
    if qualname is not None:
        return qualname
    owners = (
        f
        for f in gc.get_referrers(code)
        if isinstance(f, types.FunctionType) and f.__code__ is code
    )
    return next((f.__qualname__ for f in owners), code.co_name)


def _check_frame_values(pairs, what: str, code: types.CodeType, arrays=False) -> None:
    for name, value in pairs:
        problem = offending_value(value, arrays=arrays)
        if problem is not None:
            _reject(problem, f"{what} `{name}` of `{_qualified_name(code)}`")


def _kernel_code_tracer(root: str, on_new_code):
    """The ``sys.settrace`` hook of one core thread: checks the arguments of every function of
    the kernel's own code, and its return value and locals when it returns."""
    known = _kernel_code_by_root.setdefault(root, {})
    lookup = known.get

    def on_return(frame, event, arg):
        if event == "return":
            code = frame.f_code
            problem = offending_value(arg)
            if problem is not None:
                _reject(problem, f"the value `{_qualified_name(code)}` returns")
            _check_frame_values(frame.f_locals.items(), "local", code, arrays=True)
        return on_return

    def on_call(frame, event, arg):  # the global hook only sees "call" events
        code = frame.f_code
        kernel = lookup(code)
        if kernel is None:
            kernel = _is_kernel_file(root, code.co_filename)
            if kernel and on_new_code is not None:
                on_new_code(code, frame.f_globals)  # may raise: the code stays unknown
            known[code] = kernel
        if not kernel:
            return None
        count = code.co_argcount + code.co_kwonlyargcount
        count += bool(code.co_flags & inspect.CO_VARARGS)
        count += bool(code.co_flags & inspect.CO_VARKEYWORDS)
        values = frame.f_locals
        names = code.co_varnames[:count]
        _check_frame_values(((n, values[n]) for n in names if n in values), "argument", code)
        frame.f_trace_lines = False
        return on_return

    return on_call


@contextlib.contextmanager
def checking_kernel_code(root: str | None, on_new_code=None) -> Iterator[None]:
    """Trace this thread's calls into the files under ``root`` while the block runs;
    ``on_new_code(code, globals)`` sees each code object of kernel code when first called."""
    if root is None:
        yield
        return
    previous = sys.gettrace()
    sys.settrace(_kernel_code_tracer(root, on_new_code))
    try:
        yield
    finally:
        sys.settrace(previous)
