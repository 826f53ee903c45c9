"""The NKI meta-programming language, checked the way the 0.6 compiler reads a kernel.

"While the NKI meta-programming language looks and feels like Python, it is not actually
Python code" (aws-neuron-sdk@81ce03ae ``nki/deep-dives/nki-compiler.rst`` L23): the compiler
parses the kernel and every function, method and class it reaches into an AST and evaluates
it at specialization time (``nki/get-started/nki-language-guide.rst`` L78–97), and "using
Python features within NKI kernels that are not supported will result in useful errors from
the NKI Compiler" (nki-compiler.rst L38). AWS's own simulator runs any Python
(``nki/guides/nki_simulator.rst`` L281–288); this front-end does not.

Before a 0.6 kernel runs, :func:`check_kernel` reads the source of the kernel and of every
function, class and method it reaches — names resolved through the function's closure cells,
module globals, builtins and attributes of modules; calls followed into user code, never into
``nki`` (the simulator) or libraries — and raises one :class:`NkiLanguageError` for the first
construct outside the language: the construct, ``file:line``, the doc's words and citation.
Values that cross into kernel code from module globals and closures are checked too
(:func:`simulate.nki06.classes.offending_value`). Results are cached per code object.

The legal set is what the 0.6 docs document, or what AWS's nki-library kernels (the corpus of
known-compiling 0.x code, ``aws-neuron/nki-library@d2ad3a5``) do in kernel code; every rule
carries its citation in :data:`RULES`, and ``docs/nki_language.md`` lists them with the
ambiguous readings.

``NKI_SIM_LANGUAGE_CHECK=0`` turns the check off: a debugging aid only.

``python -m simulate.nki06 module:function ...`` (:func:`report`) lists every violation the
static check finds in a kernel and everything it reaches, without launching it.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import enum
import inspect
import os
import sys
import sysconfig
import textwrap
import threading
import types

from ..core.scoping import parse_source
from .classes import offending_value
from .context import LANGUAGE_CHECK_SWITCH, language_check_enabled
from .errors import NkiValidationError
from .language import NKIObject

GUIDE = "aws-neuron-sdk@81ce03ae nki/get-started/nki-language-guide.rst"
COMPILER = "aws-neuron-sdk@81ce03ae nki/deep-dives/nki-compiler.rst"
NKILIB = "aws-neuron/nki-library@d2ad3a5 src/nkilib_src/nkilib"
#: The doc's words for every construct the language does not document.
NOT_NKI = (
    '"not all Python constructs and libraries are supported within a NKI function" '
    f'({GUIDE} L55); "Using Python features within NKI kernels that are not supported will '
    f'result in useful errors from the NKI Compiler" ({COMPILER} L38)'
)
ENV_SWITCH = LANGUAGE_CHECK_SWITCH


class NkiLanguageError(NkiValidationError):
    """Kernel code outside the NKI meta-programming language (raised at specialization,
    before any instruction runs)."""


class NkiLanguageTypeError(NkiLanguageError, TypeError):
    """A value or class outside the language (also a ``TypeError``, as the launch-time value
    checks of :mod:`.classes` are)."""


_TYPE_RULES = frozenset({"value", "class_base"})


@dataclasses.dataclass(frozen=True)
class Rule:
    """One language rule: what is rejected, and the documentation behind the verdict."""

    construct: str
    citation: str


R = Rule
RULES: dict[str, Rule] = {
    "comprehension": R(
        "a list/set/dict comprehension",
        f"{NOT_NKI}; lists are built with .append ({GUIDE} L158–181; AWS kernels: "
        "explicit .append loops, no comprehension in kernel code)",
    ),
    "generator": R(
        "a generator expression",
        f"{NOT_NKI}; control flow is for-loops over ranges, lists or tuples ({GUIDE} L458)",
    ),
    "lambda": R("a lambda", f"{NOT_NKI}; functions are values as named defs ({GUIDE} L663–730)"),
    "try": R("try/except", f"{NOT_NKI}; AWS kernels check with assert/kernel_assert"),
    "raise": R(
        "raise",
        f"{NOT_NKI}; checks are assert statements ({GUIDE} L24–31) or AWS's kernel_assert "
        f"({NKILIB}/core/utils/kernel_assert.py L17)",
    ),
    "with": R(
        "a with-statement other than `with nl.no_reorder():`",
        f"{NOT_NKI}; the only documented context manager is nl.no_reorder() "
        "(aws-neuron-sdk@81ce03ae nki/api/nki/language/__init__.py L2246: "
        '"Use as a context manager (``with nl.no_reorder():``)")',
    ),
    "global": R("a global/nonlocal declaration", f"{NOT_NKI}; kernels are pure ({GUIDE} L116)"),
    "import": R("an import inside kernel code", NOT_NKI),
    "set": R(
        "a set",
        f"{NOT_NKI}; the containers are tuples, lists, string-keyed dicts and NKIObject "
        f"classes ({GUIDE} L152–156)",
    ),
    "yield": R("yield (a generator function)", NOT_NKI),
    "async": R("async/await", NOT_NKI),
    "walrus": R("an assignment expression (:=)", NOT_NKI),
    "star_call": R(
        "*args/**kwargs forwarding at a call site",
        f"{NOT_NKI}; AWS kernels pass arguments by name, `**` only in host launchers",
    ),
    "star_signature": R(
        "a *args/**kwargs parameter", f"{NOT_NKI}; AWS kernel functions have fixed parameters"
    ),
    "star_unpack": R("star-unpacking (a, *b = ...)", NOT_NKI),
    "keyword_only": R(
        "a keyword-only separator (`*`) in a signature",
        '"The NKI 0.3.0 compiler does not support the ``*`` separator in kernel function '
        'signatures. Move all parameters with defaults to the end of the signature" '
        "(aws-neuron-sdk@81ce03ae nki/migration/index.rst L683-697); AWS's kernel code has "
        f"none ({NKILIB}: only its PyTorch reference, "
        "experimental/transformer/attention_block_tkg_torch.py L71)",
    ),
    "loop_else": R(
        "an `else` clause on a for/while loop",
        f"{NOT_NKI}; the documented loops are for-loops over ranges, lists or tuples and "
        f"while loops ({GUIDE} L455-500), none with `else`; AWS kernel code: none",
    ),
    "slots": R(
        "`__slots__` in an NKIObject class",
        '"the NKI kernel will ... convert the Python class instance to a NKI instance using '
        "the objects dictionary. Currently, NKI does not look at slots or other object "
        f'features, only the object dictionary" ({GUIDE} L604); AWS kernel code: none',
    ),
    "not_api": R(
        "a name of the simulator's front-end that the NKI 0.6 API does not have",
        "not in the API reference (aws-neuron-sdk@81ce03ae nki/api/nki/__init__.py, "
        "nki/api/nki/language/__init__.py, nki/api/nki/isa/__init__.py): the real `nki` "
        "has no such attribute",
    ),
    "legacy_namespace": R(
        "the legacy `neuronxcc.nki` namespace in a 0.6 kernel",
        '"Using the deprecated ``neuronxcc.nki.*`` namespace inside NKI kernels now raises a '
        '**compilation error**" (aws-neuron-sdk@81ce03ae nki/migration/index.rst L224-228, '
        "L800)",
    ),
    "literal": R(
        "a bytes or complex literal",
        f"NKI values are None, booleans, 32-bit integers and floats, string literals and "
        f"tensors ({GUIDE} L141-150)",
    ),
    "delete": R("del", NOT_NKI),
    "match": R("a match statement", NOT_NKI),
    "decorator": R(
        "a decorator other than @nki.jit, @dataclass, @property, @staticmethod",
        f"{NOT_NKI}; documented decorators: @nki.jit ({GUIDE} L17), @dataclass ({GUIDE} "
        "L576, L590); @property and @staticmethod appear in the 0.6 API stubs "
        "(nki/api/nki/language/__init__.py)",
    ),
    "range_slice": R(
        "slicing a range",
        f"{NOT_NKI}; range is a loop bound: for-loops over ranges, lists or tuples ({GUIDE} L458)",
    ),
    "enumerate": R(
        "enumerate()",
        f"{NOT_NKI}; loops index with range(len(...)) ({GUIDE} L464–470; AWS kernels do the same)",
    ),
    "zip": R("zip()", f"{NOT_NKI}; loops index with range(len(...)) ({GUIDE} L464–470)"),
    "builtin": R("a Python builtin the language does not have", NOT_NKI),
    "is": R(
        "`is`/`is not` other than against None",
        f"{NOT_NKI}; equality is structural, with == and != ({GUIDE} L661); `is None` is "
        f"accepted as AWS's kernels use it ({NKILIB}/core/attention/attention_cte.py L680)",
    ),
    "library_call": R(
        "a call into a non-NKI library (NumPy, ...) from kernel code",
        f"{NOT_NKI}; only nki.isa calls run on the device and kernel values are NKI values "
        f"({GUIDE} L141–156); AWS builds NumPy data on the host "
        f"({NKILIB}/core/topk/rotational_topk_utils.py L216–277)",
    ),
    "library_module": R(
        "a non-NKI module used in kernel code",
        f"{NOT_NKI}; namespaces are nki, nki.language, nki.isa, nki.collectives "
        f"({GUIDE} L118–126), and AWS kernels use `math` ({NKILIB}/core/qkv/qkv_cte.py L707)",
    ),
    "class_base": R(
        "a class that does not inherit from NKIObject (or Enum) alone",
        f'"the class must inherit from NKIObject and no other classes" ({GUIDE} L572); '
        f"enumerations ({GUIDE} L629)",
    ),
    "value": R("a value that is not an NKI value", f"{GUIDE} L141–156"),
    "source": R(
        "kernel code whose source cannot be read",
        f"the compiler parses the kernel into an AST ({COMPILER} L18)",
    ),
}

#: Builtins the language has: documented (len, range, print, dict, list, tuple, min, max,
#: the value constructors: guide L141–201, L455–500) or used by AWS's kernel code (each
#: with its first use, nki-library@d2ad3a5).
ALLOWED_BUILTINS = frozenset(
    {
        "len",  # guide L164
        "range",  # guide L466
        "print",  # guide L27
        "dict",  # guide L183
        "slice",  # nki/migration/index.rst L1077; nki/examples/layout-loop.py L20
        "list",  # AWS: core/cumsum/cumsum.py L86
        "tuple",  # AWS: core/attention/attention_bwd.py L161
        "min",  # AWS: core/attention/attention_bwd.py L153
        "max",  # AWS: core/attention/attention_cte.py L1834
        "int",  # AWS: core/attention/attention_cte.py L507
        "float",  # AWS: core/attention/attention_bwd.py L152
        "str",  # AWS: core/attention/attention_cte.py L419
        "divmod",  # AWS: core/moe/moe_cte/bwmm_shard_on_I_mx.py L1355
        "isinstance",  # AWS: core/moe/moe_cte/moe_cte_utils.py L272
        "hash",  # AWS: core/topk/rotational_topk_utils.py L349-L351 (a config's __hash__)
        "NotImplemented",  # AWS: core/topk/rotational_topk_utils.py L375-L377 (its __eq__)
    }
)
#: Modules whose functions kernel code may call or read besides nki and user code.
ALLOWED_MODULES = frozenset({"math"})  # AWS: core/qkv/qkv_cte.py L20, L707
ALLOWED_DECORATORS = frozenset({"jit", "dataclass", "property", "staticmethod"})
#: Names the front-end's modules hold for the simulator itself (helpers, error classes,
#: imports) that are not NKI API: kernel code naming them would fail on the real ``nki``.
NOT_API = {
    "simulate.nki06": frozenset(
        {
            "Kernel",
            "NkiValidationError",
            "annotations",
            "classes",
            "context",
            "cpu_simulate",
            "dtypes",
            "errors",
            "importlib",
            "install",
            "language_check",
            "last_trace",
            "launch_ranks",
            "real_nki_available",
            "release",
            "runtime",
            "simulate_kernel",
            "sys",
        }
    ),
    "simulate.nki06.language": frozenset(
        {
            "NkiTypeError",
            "NkiValidationError",
            "NkiValueError",
            "PMAX",
            "allocate",
            "annotations",
            "is_number",
        }
    ),
    "simulate.nki06.isa": frozenset(
        {
            "PMAX",
            "RAW_INT_ENUMS",
            "RAW_STRING_ENUMS",
            "dma_trace_fields",
            "enforce",
            "initialized_mask",
            "is_number",
            "run_bytes",
        }
    ),
}

_SIMULATOR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_LIBRARY_DIRS = tuple(
    {
        os.path.abspath(sysconfig.get_path(key)) + os.sep
        for key in ("stdlib", "platstdlib", "purelib", "platlib")
    }
)
#: Packages that are NKI itself (this front-end, or the real one when installed).
_NKI_PACKAGES = frozenset({"nki", "simulate", "neuronxcc"})


@dataclasses.dataclass(frozen=True)
class Violation:
    rule: str
    detail: str
    filename: str
    line: int

    def short(self) -> str:
        return f"{self.filename}:{self.line}: {self.detail}: {RULES[self.rule].construct}"

    def message(self) -> str:
        rule = RULES[self.rule]
        return (
            f"{self.filename}:{self.line}: {self.detail} is not NKI: {rule.construct} is "
            f"outside the NKI meta-programming language — {rule.citation}"
        )


def enabled() -> bool:
    """The check is on unless ``NKI_SIM_LANGUAGE_CHECK=0`` (a debugging aid)."""
    return language_check_enabled()


# --- what is kernel code -----------------------------------------------------------------------
def _top_module(obj) -> str:
    return (getattr(obj, "__module__", None) or "").partition(".")[0]


def _file_of(obj) -> str | None:
    code = getattr(obj, "__code__", None)
    if code is not None:
        return code.co_filename
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    return getattr(module, "__file__", None)


def is_nki_object(obj) -> bool:
    """Part of NKI itself (the simulator's modules, or a real ``nki`` package)."""
    if isinstance(obj, types.ModuleType):
        name = obj.__name__.partition(".")[0]
    else:
        name = _top_module(obj)
    return name in _NKI_PACKAGES


def is_legacy_nki(obj) -> bool:
    """Part of the legacy ``neuronxcc.nki`` dialect: the real one, or this simulator's legacy
    front-end that ``neuronxcc.nki`` is aliased to (``simulate`` and ``simulate.legacy.*``;
    not ``simulate.core``, which serves both front-ends)."""
    name = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", None)
    name = name or ""
    return (
        name == "simulate"
        or name.startswith("simulate.legacy")
        or name.partition(".")[0] == "neuronxcc"
    )


def is_user_code(obj) -> bool:
    """A function or class the compiler would parse: Python source outside NKI, the
    standard library and installed libraries (the kernel's own package may be installed:
    what counts is that it is not a library the kernel imports as a namespace)."""
    if isinstance(obj, (types.FunctionType, type)):
        if is_nki_object(obj):
            return False
        path = _file_of(obj)
        if path is None:
            return False
        path = os.path.abspath(path)
        if path.startswith(_SIMULATOR_DIR):
            return False
        if path.startswith(_LIBRARY_DIRS):
            return _top_module(obj) in _user_packages
        return True
    return False


#: Installed packages that hold kernel code: the top-level package of every kernel checked
#: (a kernel package may be pip-installed into site-packages, where libraries live too).
_user_packages: set[str] = set()


def _is_user_module(module: types.ModuleType) -> bool:
    name = module.__name__.partition(".")[0]
    if name in _NKI_PACKAGES:
        return False
    path = getattr(module, "__file__", None)
    if path is None:
        return False
    path = os.path.abspath(path)
    if path.startswith(_SIMULATOR_DIR):
        return False
    return not path.startswith(_LIBRARY_DIRS) or name in _user_packages


# --- source --------------------------------------------------------------------------------------
def _parse(obj) -> tuple[ast.AST, str] | None:
    """The AST of a function or class, with line numbers of its file (a lambda: a Lambda
    node on its line, as its source is only the line around it)."""
    try:
        lines, first = inspect.getsourcelines(obj)
        filename = inspect.getsourcefile(obj) or inspect.getfile(obj)
    except (OSError, TypeError):
        return None
    code = getattr(obj, "__code__", obj)
    if getattr(code, "co_name", None) == "<lambda>":
        node = ast.Lambda(args=None, body=None, lineno=code.co_firstlineno)
        return node, filename
    try:
        tree = parse_source(textwrap.dedent("".join(lines)))
    except SyntaxError:
        return None
    ast.increment_lineno(tree, max(first - 1, 0))
    node = tree.body[0] if tree.body else tree
    return node, filename


# --- the checker --------------------------------------------------------------------------------
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp)
_NODE_RULES: dict[type, str] = {
    ast.GeneratorExp: "generator",
    ast.Lambda: "lambda",
    ast.Try: "try",
    ast.Raise: "raise",
    ast.Global: "global",
    ast.Nonlocal: "global",
    ast.Import: "import",
    ast.ImportFrom: "import",
    ast.Set: "set",
    ast.Yield: "yield",
    ast.YieldFrom: "yield",
    ast.Await: "async",
    ast.AsyncFunctionDef: "async",
    ast.AsyncFor: "async",
    ast.AsyncWith: "async",
    ast.NamedExpr: "walrus",
    ast.Delete: "delete",
    ast.Match: "match",
}
if hasattr(ast, "TryStar"):
    _NODE_RULES[ast.TryStar] = "try"


def _dotted(node) -> str:
    try:
        return ast.unparse(node)
    except Exception:  # noqa: BLE001 - only for messages
        return type(node).__name__


#: A library module's attribute that is a plain Python number or string is an NKI value read
#: at specialization: AWS's kernel code writes ``nisa.memset(bufs.qk, value=-np.inf)``
#: (aws-neuron/nki-library@d2ad3a5 ``src/nkilib_src/nkilib/core/attention/attention_tkg.py``
#: L1040; 2.28 branch L1001). Calls into the library and its other objects stay illegal.
LIBRARY_CONSTANTS = (int, float, str, bool)


def _is_plain_constant(value) -> bool:
    return type(value) in LIBRARY_CONSTANTS and offending_value(value) is None


def _is_numpy_array(value) -> bool:
    return type(value).__module__ == "numpy" and type(value).__name__ == "ndarray"


class _Scope:
    """How names of one function (or class body) resolve: its locals shadow, then closure
    cells, module globals and builtins."""

    def __init__(self, globals_: dict, closure: dict, local_names: set[str]):
        self.globals = globals_
        self.closure = closure
        self.locals = local_names

    _MISSING = object()

    def resolve(self, name: str):
        if name in self.locals:
            return self._MISSING, "local"
        if name in self.closure:
            return self.closure[name], "closure"
        if name in self.globals:
            return self.globals[name], "global"
        if hasattr(builtins, name):
            return getattr(builtins, name), "builtin"
        return self._MISSING, "unknown"


def _local_names(node) -> set[str]:
    names: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, (ast.Store, ast.Del)):
            names.add(sub.id)
        elif isinstance(sub, ast.arg):
            names.add(sub.arg)
        elif isinstance(sub, (ast.FunctionDef, ast.ClassDef)) and sub is not node:
            names.add(sub.name)
    return names


class _Visitor(ast.NodeVisitor):
    """Collects violations and the objects a piece of kernel code reaches."""

    def __init__(self, filename: str, scope: _Scope, report):
        self.filename = filename
        self.scope = scope
        self.report = report  # (rule, detail, line) -> None
        self.reached: list = []
        self.range_names: set[str] = set()
        self._root = None  # the function or class read; classes nested in it are checked here
        self._shared_constant_args: set[int] = set()  # nodes passed to nl.shared_constant

    def visit(self, node):
        if self._root is None:
            self._root = node
        return super().visit(node)

    def flag(self, rule: str, node, detail: str | None = None) -> None:
        self.report(rule, detail or f"`{_dotted(node)[:80]}`", getattr(node, "lineno", 0))

    # annotations are never evaluated by the kernel: skip them
    def visit_arguments(self, node: ast.arguments) -> None:
        for default in (*node.defaults, *node.kw_defaults):
            if default is not None:
                self.visit(default)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.visit(node.target)
        if node.value is not None:
            self.visit(node.value)

    def _function(self, node) -> None:
        args = node.args
        if args.vararg is not None:
            self.flag("star_signature", node, f"`*{args.vararg.arg}` in `def {node.name}`")
        if args.kwarg is not None:
            self.flag("star_signature", node, f"`**{args.kwarg.arg}` in `def {node.name}`")
        if args.kwonlyargs and args.vararg is None:
            self.flag("keyword_only", node, f"`*` in `def {node.name}`")
        for decorator in node.decorator_list:
            self._decorator(decorator)
        self.visit(args)
        for statement in node.body:
            self.visit(statement)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._function(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for decorator in node.decorator_list:
            self._decorator(decorator)
        for statement in node.body:
            targets = getattr(statement, "targets", None) or [getattr(statement, "target", None)]
            if any(isinstance(t, ast.Name) and t.id == "__slots__" for t in targets):
                self.flag("slots", statement, f"`__slots__` of class `{node.name}`")
        if node is not self._root and not self._nki_class_bases(node):
            bases = ", ".join(_dotted(base) for base in node.bases)
            self.flag("class_base", node, f"class `{node.name}({bases})` defined in kernel code")
        for statement in node.body:
            self.visit(statement)

    def _decorator(self, node) -> None:
        target = node.func if isinstance(node, ast.Call) else node
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name not in ALLOWED_DECORATORS:
            self.flag("decorator", node, f"`@{_dotted(node)}`")
        if isinstance(node, ast.Call):  # @dataclass(frozen=True): the keywords are plain
            for keyword in node.keywords:
                self.visit(keyword.value)

    def _nki_class_bases(self, node: ast.ClassDef) -> bool:
        """A class statement inside a function: its bases must be NKIObject classes alone (or
        an Enum), as :meth:`Checker._class_bases` requires of module-level classes."""
        if node.keywords or not node.bases:
            return False
        for base in node.bases:
            value = self._value_of(base)
            if not isinstance(value, type):
                return False  # a base the static pass cannot name: a local class, ...
            if not (issubclass(value, NKIObject) or issubclass(value, enum.Enum)):
                return False
        return True

    def visit_For(self, node) -> None:
        if node.orelse:
            self.flag("loop_else", node, f"`{type(node).__name__.lower()} ... else:`")
        self.generic_visit(node)

    visit_While = visit_For

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, (bytes, complex)):
            self.flag("literal", node)

    def generic_visit(self, node) -> None:
        rule = _NODE_RULES.get(type(node))
        if rule is not None:
            self.flag(rule, node, f"`{_dotted(node).splitlines()[0][:80]}`")
        elif isinstance(node, _COMPREHENSIONS):
            self.flag("comprehension", node)
        super().generic_visit(node)

    def visit_With(self, node: ast.With) -> None:
        for item in node.items:
            expr = item.context_expr
            if not (
                isinstance(expr, ast.Call)
                and not expr.args
                and not expr.keywords
                and self._is_nki_name(expr.func, "no_reorder")
            ):
                self.flag("with", node, f"`with {_dotted(expr)}`")
            self.visit(expr)
        for statement in node.body:
            self.visit(statement)

    def _is_nki_name(self, node, name: str) -> bool:
        value = self._value_of(node)
        return getattr(value, "__name__", None) == name and is_nki_object(value)

    def visit_Starred(self, node: ast.Starred) -> None:
        if isinstance(node.ctx, ast.Store):
            self.flag("star_unpack", node)
        self.visit(node.value)

    def visit_Call(self, node: ast.Call) -> None:
        for arg in node.args:
            if isinstance(arg, ast.Starred):
                self.flag("star_call", arg, f"`{_dotted(arg)}` in `{_dotted(node)[:60]}`")
        for keyword in node.keywords:
            if keyword.arg is None:
                self.flag("star_call", node, f"`**{_dotted(keyword.value)}`")
        callee = self._value_of(node.func)
        if getattr(callee, "__name__", None) == "shared_constant" and is_nki_object(callee):
            self._shared_constant_args.update(id(arg) for arg in node.args)
            self._shared_constant_args.update(id(k.value) for k in node.keywords)
        if callee is builtins.enumerate:
            self.flag("enumerate", node)
        elif callee is builtins.zip:
            self.flag("zip", node)
        elif callee is builtins.set or callee is builtins.frozenset:
            self.flag("set", node)
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        if isinstance(node.value, ast.Call) and self._value_of(node.value.func) is builtins.range:
            for target in node.targets:
                if isinstance(target, ast.Name):
                    self.range_names.add(target.id)
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        base = node.value
        is_range = (isinstance(base, ast.Call) and self._value_of(base.func) is builtins.range) or (
            isinstance(base, ast.Name) and base.id in self.range_names
        )
        if is_range and isinstance(node.slice, ast.Slice):
            self.flag("range_slice", node)
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        operands = [node.left, *node.comparators]
        for i, op in enumerate(node.ops):
            if isinstance(op, (ast.Is, ast.IsNot)):
                pair = (operands[i], operands[i + 1])
                if not any(isinstance(o, ast.Constant) and o.value is None for o in pair):
                    self.flag("is", node)
        self.generic_visit(node)

    # --- names: resolve, follow user code, check values crossing in ---
    def _value_of(self, node):
        """The object an expression names (Name, or attributes of a module), else MISSING."""
        if isinstance(node, ast.Name):
            return self.scope.resolve(node.id)[0]
        if isinstance(node, ast.Attribute):
            base = self._value_of(node.value)
            if isinstance(base, (types.ModuleType, type)) or (isinstance(base, enum.EnumMeta)):
                return getattr(base, node.attr, _Scope._MISSING)
        return _Scope._MISSING

    def visit_Name(self, node: ast.Name) -> None:
        if not isinstance(node.ctx, ast.Load):
            return
        value, where = self.scope.resolve(node.id)
        if where in ("local", "unknown"):
            return
        if id(node) in self._shared_constant_args and _is_numpy_array(value):
            return  # "Can be a numpy array or a file path" (language/__init__.py L2630)
        if where == "builtin":
            if node.id not in ALLOWED_BUILTINS and node.id not in ("enumerate", "zip", "set"):
                if not (isinstance(value, type) and issubclass(value, BaseException)):
                    self.flag("builtin", node, f"`{node.id}`")
            return
        self._reached(value, f"{where} `{node.id}`", node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        base = self._value_of(node.value)
        if isinstance(base, types.ModuleType):
            if is_legacy_nki(base):
                self.flag("legacy_namespace", node, f"`{_dotted(node)}` (module `{base.__name__}`)")
                return
            if is_nki_object(base):
                if node.attr in NOT_API.get(base.__name__, ()):
                    self.flag("not_api", node, f"`{_dotted(node)}`")
                return
            value = getattr(base, node.attr, _Scope._MISSING)
            if base.__name__ in ALLOWED_MODULES or _is_user_module(base):
                if value is not _Scope._MISSING and _is_user_module(base):
                    self._reached(value, f"`{base.__name__}.{node.attr}`", node)
                return
            if _is_plain_constant(value):
                return  # `-np.inf`: a float constant of a library (AWS, LIBRARY_CONSTANTS)
            self.flag("library_module", node, f"`{_dotted(node)}` (module `{base.__name__}`)")
            return
        self.visit(node.value)

    def _reached(self, value, what: str, node, depth: int = 0) -> None:
        if value is _Scope._MISSING:
            return
        if type(value) in (tuple, list, dict) and depth < 3:
            items = value.values() if type(value) is dict else value
            for item in items:  # functions and classes kept in containers are reached too
                if isinstance(item, (types.FunctionType, type, tuple, list, dict)):
                    self._reached(item, what, node, depth + 1)
        if isinstance(value, (types.ModuleType, types.FunctionType, type)) and is_legacy_nki(value):
            self.flag("legacy_namespace", node, f"{what} (`{getattr(value, '__name__', value)}`)")
            return
        if isinstance(value, types.ModuleType):
            if not (is_nki_object(value) or value.__name__ in ALLOWED_MODULES):
                if not _is_user_module(value):
                    self.flag("library_module", node, f"{what} (module `{value.__name__}`)")
            return
        if is_user_code(value):
            self.reached.append(value)
            return
        if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type)):
            if is_nki_object(value) or isinstance(value, enum.EnumMeta):
                return
            top = _top_module(value)
            if top in ALLOWED_MODULES or top in ("builtins", "dataclasses", "typing", "enum"):
                return
            self.flag("library_call", node, f"{what} (`{top}`)")
            return
        if is_nki_object(type(value)):
            return
        problem = offending_value(value)
        if problem is not None:
            self.flag("value", node, f"{what}, {problem}")


def cache_key(obj):
    """A function's code object, and what its closure cells hold (a closure over another
    function reaches other code); a class itself."""
    code = getattr(obj, "__code__", None)
    if code is None:
        return obj
    if not obj.__closure__:
        return code
    contents = []
    for cell in obj.__closure__:
        try:
            contents.append(cell.cell_contents)
        except ValueError:  # an empty cell
            contents.append(None)
    return (code, *(id(c) for c in contents))  # the cache keeps obj, so the ids stay unique


class Checker:
    """Reads kernel code from its roots, following what it reaches; caches per object."""

    def __init__(self):
        self._done: dict[object, tuple[list[Violation], list, object]] = {}
        self._lock = threading.Lock()

    def _check_one(self, obj) -> tuple[list[Violation], list]:
        key = cache_key(obj)
        cached = self._done.get(key)
        if cached is not None:
            return cached[0], cached[1]
        violations: list[Violation] = []
        reached: list = []
        parsed = _parse(obj)
        if parsed is None:
            path = _file_of(obj) or "?"
            violations.append(
                Violation("source", f"`{getattr(obj, '__qualname__', obj)}`", path, 0)
            )
        else:
            node, filename = parsed
            if isinstance(obj, type):
                module = sys.modules.get(obj.__module__, sys)
                scope = _Scope(vars(module), {}, _local_names(node))
                self._class_bases(obj, filename, node, violations)
            else:
                closure = {}
                if obj.__closure__:
                    for name, cell in zip(obj.__code__.co_freevars, obj.__closure__):  # noqa: B905
                        try:
                            closure[name] = cell.cell_contents
                        except ValueError:  # an empty cell: a not-yet-assigned name
                            pass
                scope = _Scope(obj.__globals__, closure, _local_names(node) - set(closure))
            visitor = _Visitor(
                filename,
                scope,
                lambda rule, detail, line: violations.append(
                    Violation(rule, detail, filename, line)
                ),
            )
            visitor.visit(node)
            reached = visitor.reached
        self._done[key] = (violations, reached, obj)  # obj pins what the key's ids name
        return violations, reached

    @staticmethod
    def _class_bases(cls, filename, node, violations) -> None:
        if issubclass(cls, enum.Enum):
            return
        if not issubclass(cls, NKIObject) or not all(
            base is object or issubclass(base, NKIObject) for base in cls.__mro__
        ):
            bases = ", ".join(base.__name__ for base in cls.__bases__)
            violations.append(
                Violation(
                    "class_base", f"class `{cls.__qualname__}({bases})`", filename, node.lineno
                )
            )

    def violations(self, roots) -> list[Violation]:
        """Every violation in ``roots`` and everything they reach (kernel code order)."""
        seen: set = set()
        found: list[Violation] = []
        queue = list(roots)
        _user_packages.update(_top_module(root) for root in roots)
        with self._lock:
            while queue:
                obj = queue.pop(0)
                key = cache_key(obj)
                if key in seen:
                    continue
                seen.add(key)
                violations, reached = self._check_one(obj)
                found.extend(violations)
                queue.extend(reached)
        return found


_checker = Checker()
_verified: dict = {}


def _roots(func, arguments) -> list:
    roots = [func]

    def add(value, depth=0):
        if isinstance(value, NKIObject):
            # NKI's own classes (a ReplicaGroup argument) are not kernel code
            if is_user_code(type(value)):
                roots.append(type(value))
        elif is_user_code(value):
            roots.append(value)
        elif isinstance(value, (tuple, list)) and depth < 3:
            for item in value:
                add(item, depth + 1)
        elif isinstance(value, dict) and depth < 3:
            for item in value.values():
                add(item, depth + 1)

    for value in (arguments or {}).values():
        add(value)
    return roots


def check_kernel(func, arguments=None) -> None:
    """Raise :class:`NkiLanguageError` for the first construct of ``func`` (and of what it or
    its arguments reach) outside the NKI language. Cached: a repeated launch costs a lookup."""
    if not enabled():
        return
    roots = _roots(func, arguments)
    key = tuple(cache_key(r) for r in roots)
    if key in _verified:
        return
    found = _checker.violations(roots)
    if found:
        first = found[0]
        more = f" (and {len(found) - 1} more: python -m simulate.nki06 module:function)"
        kind = NkiLanguageTypeError if first.rule in _TYPE_RULES else NkiLanguageError
        raise kind(first.message() + (more if len(found) > 1 else ""))
    _verified[key] = True


_checked_codes: dict[types.CodeType, list[Violation]] = {}


def check_code_object(code: types.CodeType, globals_: dict) -> None:
    """The rules for one function of kernel code first met while the kernel runs (reached
    through a value the static pass cannot see, e.g. a method of an object built in the
    kernel), before its body runs. What it reaches is checked as it is called in turn;
    closure cells are not looked into (the frame does not say which closure it runs)."""
    if not enabled():
        return
    found = _checked_codes.get(code)
    if found is None:
        found = []
        parsed = _parse(code)
        if parsed is not None:
            node, filename = parsed
            scope = _Scope(globals_, {}, _local_names(node) | set(code.co_freevars))
            visitor = _Visitor(
                filename,
                scope,
                lambda rule, detail, line: found.append(Violation(rule, detail, filename, line)),
            )
            visitor.visit(node)
            found.extend(_checker.violations(visitor.reached))
        _checked_codes[code] = found
    if found:
        kind = NkiLanguageTypeError if found[0].rule in _TYPE_RULES else NkiLanguageError
        raise kind(found[0].message())


def find_violations(func) -> list[Violation]:
    """Every violation of the static check in ``func`` (a function or ``@nki.jit`` kernel) and
    in everything it reaches; nothing runs."""
    return _checker.violations([getattr(func, "func", func)])


def report(targets: list[str]) -> int:
    """The CLI: every violation of each ``module:function`` target, one per line."""
    import importlib

    from . import install

    install()
    status = 0
    for target in targets:
        module_name, _, attr = target.partition(":")
        module = importlib.import_module(module_name)
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
        found = find_violations(obj)
        for violation in found:
            print(violation.short())
        print(f"{target}: {len(found)} violation(s)")
        status |= bool(found)
    return status


if __name__ == "__main__":  # the first-published spelling; ``python -m simulate.nki06`` is quieter
    sys.exit(report(sys.argv[1:]))
