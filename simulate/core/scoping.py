"""Language rules that need the kernel's source: block scopes, kernel-level ``range`` loops
and annotations of local variables.

Before a kernel runs, its function is recompiled from its source with small hooks added
(line numbers kept, so tracebacks point at the user's lines), and so is every helper
function it calls, when it is called (:meth:`Hooks.call`):

- every ``if``/``else`` body and every iteration of a ``for``/``while`` body is a scope:
  "control blocks in if/else/for statements will introduce their own scope for tensors. A
  tensor defined in if/else/for control blocks are not allowed to be used outside of the
  scope" (``general/nki/api/nki.errors.rst@8a38e733``, L417-L474). The manual exempts no
  function, so the rule holds in the kernel and in every helper it calls (the stricter
  reading; :data:`CHECK_HELPER_SCOPES`). When a block ends, the on-chip tiles it created and
  bound to a name are marked, and any later use of them raises
  ``err_local_variable_used_out_of_scope``. A ``return`` inside the block uses its tiles
  inside the block: they go to the caller, which binds them in its own scope. The same
  hook tells ``nl.ndarray(..., buffer=nl.shared_hbm)`` that it runs "under if condition"
  or "inside a loop" (``err_shared_hbm_must_in_kernel_level``, L581-L615);
- ``for v in range(...)`` statements of the kernel function become ``sequential_range``
  loops whose variable is a symbolic :class:`~simulate.core.loop_index.LoopIndex`
  (``general/nki/api/nki/language/__init__.py@8a38e733``, L1416-L1417); helpers the kernel
  calls keep Python's ``range`` (nki-samples ``rmsnorm_quant.py``, "NKI-917");
- ``name: nt.tensor[...] = value`` checks the shape (``err_annotation_shape_mismatch``,
  L126-L141);
- ``target = nl.loop_reduce(...)`` passes ``target`` (a thunk reading it) to the call as
  :data:`DESTINATION_KEYWORD`: "The destination tile is also the rhs input to ``op``"
  (``general/nki/api/nki/language/__init__.py@8a38e733``, L990-L1020).

A kernel whose source is unavailable (e.g. defined in an interactive session) runs as it
is, without these checks; so do functions nested in another (recompiled at every call, they
would cost more than they check), library functions (NumPy, the standard library, the
simulator) and decorated functions.
"""

from __future__ import annotations
import __future__

import ast
import builtins
import copy
import inspect
import itertools
import sysconfig
import textwrap
import threading
import types
import weakref

from . import memory, rules
from .errors import NKIValueError
from .loop_index import LoopIndex
from .tensor import Tensor

_PREFIX = "__nki_"

#: The keyword through which ``target = nl.loop_reduce(...)`` hands the call its target.
DESTINATION_KEYWORD = f"{_PREFIX}destination__"

#: The block-scope rule holds in the helpers a kernel calls, not only in its own body (the
#: errors manual has no helper exemption). The one switch of that reading.
CHECK_HELPER_SCOPES = True

# Modules whose functions are library code, never kernel helpers.
_LIBRARY_ROOTS = frozenset({"simulate", "numpy", "ml_dtypes"})
_STDLIB_DIRS = tuple(
    {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib") if key in sysconfig.get_paths()}
)
_BUILTIN_NAMES = frozenset(dir(builtins))


def _is_helper(func) -> bool:
    """A plain module-level Python function of user code (a kernel helper)."""
    if not isinstance(func, types.FunctionType) or func.__closure__:
        return False
    if "<locals>" in func.__qualname__ or hasattr(func, "__wrapped__"):
        return False
    if (func.__module__ or "").split(".")[0] in _LIBRARY_ROOTS:
        return False
    return not func.__code__.co_filename.startswith(_STDLIB_DIRS)


def _storage_ids(value, depth=0) -> set[int]:
    """Storage ids of the on-chip tiles in ``value`` (a tile, or containers and objects
    holding tiles)."""
    if isinstance(value, Tensor):
        return {value.storage.id} if value.on_chip else set()
    if depth > 3:
        return set()
    if isinstance(value, dict):
        items = value.values()
    elif isinstance(value, (tuple, list)):
        items = value
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        items = vars(value).values()
    else:
        return set()
    found: set[int] = set()
    for item in items:
        found |= _storage_ids(item, depth + 1)
    return found


class Hooks:
    """The callbacks the recompiled kernel calls. The run module hands in its context lookup
    ``current(what)`` and its loop-frame class (this module sits below it: no import cycle)."""

    def __init__(self, current, loop_frame):
        self._current = current
        self._loop_frame = loop_frame

    def enter(self, kind: str, line: int):
        ctx = self._current("kernel block")
        ctx.blocks.append((kind, line))
        return (next(memory._storage_ids), kind, line)

    def exit(self, token, values: dict, names: tuple) -> None:
        ctx = self._current("kernel block")
        if ctx.blocks:
            ctx.blocks.pop()
        first_id, kind, line = token
        for name in names:
            value = values.get(name)
            if (
                isinstance(value, Tensor)
                and value.on_chip
                and value.storage.id > first_id
                and not value.storage.out_of_scope
                and value.storage.id not in ctx.returning
            ):
                value.storage.out_of_scope = (
                    f"'{name}' (a tile created in the {kind} block at line {line})"
                )

    def returned(self, value):
        """``return value`` inside a block: the tiles in it leave with the return."""
        self._current("kernel block").returning.update(_storage_ids(value))
        return value

    def call(self, func):
        """``func`` as kernel code calls it: a helper recompiled with these hooks (its blocks
        scoped, its calls followed), or ``func`` itself."""
        if not CHECK_HELPER_SCOPES:
            return func
        target = func.__func__ if inspect.ismethod(func) else func
        if not _is_helper(target):
            return func
        prepared = prepare(target, self, helper=True)
        if prepared is target:
            return func
        bound = prepared.__get__(func.__self__) if inspect.ismethod(func) else prepared
        current = self._current

        def helper(*args, **kwargs):
            try:
                return bound(*args, **kwargs)
            finally:
                current("kernel block").returning.clear()

        return helper

    @staticmethod
    def annotation(value, annotation_thunk, name: str, line: int) -> None:
        try:
            annotation = annotation_thunk()
        except Exception:  # noqa: BLE001 - an annotation the simulator cannot evaluate
            return
        shape = getattr(annotation, "__nki_shape__", None)
        actual = getattr(value, "shape", None)
        if shape is not None and actual is not None and tuple(actual) != tuple(shape):
            raise NKIValueError(
                f"Tensor shape and the annotated shape mismatch: `{name}` (line {line}) has "
                f"shape {list(actual)}, the annotation expects {list(shape)} "
                "(general/nki/api/nki.errors.rst@8a38e733, L126-L141)",
                "err_annotation_shape_mismatch",
            )

    @staticmethod
    def while_entry(condition_thunk, line: int) -> None:
        condition = condition_thunk()
        rules.check_while_entry(
            bool(condition), line, runtime=getattr(condition, "__nki_runtime__", False)
        )

    def range(self, name: str, line: int):
        def sequential(*args):
            import operator

            ctx = self._current("range")
            bounds = range(*(operator.index(a) for a in args))
            frame = self._loop_frame("sequential_range")
            ctx.loops.append(frame)
            try:
                for i in bounds:
                    frame.iteration = i
                    yield LoopIndex(i, name)
            finally:
                frame.active = False
                ctx.loops.remove(frame)

        return sequential


def _bound_names(statements) -> list[str]:
    """Names a list of statements binds (not inside nested functions, classes, lambdas or
    comprehensions)."""
    names: list[str] = []

    class Collector(ast.NodeVisitor):
        def visit_Name(self, node):
            if (
                isinstance(node.ctx, ast.Store)
                and node.id not in names
                and not node.id.startswith(_PREFIX)
            ):
                names.append(node.id)

        def _skip(self, node):
            return None

        visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = visit_Lambda = _skip
        visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _skip

    collector = Collector()
    for statement in statements:
        collector.visit(statement)
    return names


class _Rewriter(ast.NodeTransformer):
    """Adds the hooks to the statements of a kernel function (``helper=False``: its
    ``range`` loops become ``sequential_range``) or of a helper it calls."""

    def __init__(self, helper=False):
        self.counter = itertools.count()
        self.root = None
        self.helper = helper
        self.depth = 0  # blocks around the statement being rewritten

    def _body(self, statements):
        out = []
        for statement in statements:
            result = self.visit(statement)
            out.extend(result if isinstance(result, list) else [result])
        return out

    def _hook(self, name, args):
        return ast.Call(
            func=ast.Attribute(
                value=ast.Name(f"{_PREFIX}hooks__", ast.Load()), attr=name, ctx=ast.Load()
            ),
            args=args,
            keywords=[],
        )

    def _scoped(self, body, kind, line):
        """``tok = enter(); try: body finally: exit(tok, locals(), names)``."""
        self.depth += 1
        body = self._body(body)
        self.depth -= 1
        token = f"{_PREFIX}token_{next(self.counter)}"
        names = _bound_names(body)
        enter = ast.Assign(
            targets=[ast.Name(token, ast.Store())],
            value=self._hook("enter", [ast.Constant(kind), ast.Constant(line)]),
        )
        leave = ast.Expr(
            self._hook(
                "exit",
                [
                    ast.Name(token, ast.Load()),
                    ast.Call(func=ast.Name("locals", ast.Load()), args=[], keywords=[]),
                    ast.Tuple([ast.Constant(n) for n in names], ast.Load()),
                ],
            )
        )
        return [enter, ast.Try(body=body, handlers=[], orelse=[], finalbody=[leave])]

    def visit_FunctionDef(self, node):
        if self.root is None:
            self.root = node
            node.decorator_list = []
            node.body = self._body(node.body)
        return node  # nested functions are helpers: left alone

    def visit_AsyncFunctionDef(self, node):
        return node

    visit_ClassDef = visit_Lambda = visit_AsyncFunctionDef

    def visit_Return(self, node):
        """A ``return`` inside a block hands its tiles to the caller (:meth:`Hooks.returned`)."""
        if node.value is not None:
            node.value = self.visit(node.value)
            if self.depth:
                node.value = self._hook("returned", [node.value])
        return node

    def visit_Call(self, node):
        """Calls go through :meth:`Hooks.call`, so the helpers they reach are checked too
        (builtins are called directly)."""
        self.generic_visit(node)
        func = node.func
        if isinstance(func, ast.Name) and (
            func.id in _BUILTIN_NAMES or func.id.startswith(_PREFIX)
        ):
            return node
        node.func = self._hook("call", [func])
        return node

    def visit_If(self, node):
        node.test = self.visit(node.test)
        node.body = self._scoped(node.body, "if", node.lineno)
        if node.orelse:
            line = node.orelse[0].lineno
            node.orelse = self._scoped(node.orelse, "else", line)
        return node

    def visit_For(self, node):
        node.iter = self.visit(node.iter)
        call = node.iter
        if (
            not self.helper
            and isinstance(call, ast.Call)
            and isinstance(call.func, ast.Name)
            and call.func.id == "range"
        ):
            maker = self._hook(
                "range", [ast.Constant(ast.unparse(node.target)), ast.Constant(node.lineno)]
            )
            node.iter = ast.Call(func=maker, args=call.args, keywords=call.keywords)
        node.body = self._scoped(node.body, "for", node.lineno)
        node.orelse = self._body(node.orelse)
        return node

    def visit_While(self, node):
        node.test = self.visit(node.test)
        thunk = ast.Lambda(
            args=ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[]),
            body=node.test,
        )
        entry = ast.Expr(self._hook("while_entry", [thunk, ast.Constant(node.lineno)]))
        node.body = self._scoped(node.body, "while", node.lineno)
        node.orelse = self._body(node.orelse)
        return [entry, node]

    def visit_Assign(self, node):
        """``target = nl.loop_reduce(...)``: the call also gets ``lambda: target``."""
        call = node.value
        reduces = (
            len(node.targets) == 1
            and isinstance(call, ast.Call)
            and _called_name(call.func) == "loop_reduce"
        )
        self.generic_visit(node)
        if reduces:
            target = _as_load(node.targets[0])
            call.keywords.append(ast.keyword(arg=DESTINATION_KEYWORD, value=_thunk(target)))
        return node

    def visit_AnnAssign(self, node):
        if node.value is None or not isinstance(node.target, ast.Name):
            return node
        thunk = ast.Lambda(
            args=ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[]),
            body=node.annotation,
        )
        check = ast.Expr(
            self._hook(
                "annotation",
                [
                    ast.Name(node.target.id, ast.Load()),
                    thunk,
                    ast.Constant(node.target.id),
                    ast.Constant(node.lineno),
                ],
            )
        )
        return [node, check]


def _called_name(func) -> str:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def _as_load(target):
    """A copy of an assignment target that reads it."""
    target = copy.deepcopy(target)
    for node in ast.walk(target):
        if hasattr(node, "ctx"):
            node.ctx = ast.Load()
    return target


def _thunk(body):
    return ast.Lambda(
        args=ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[]),
        body=body,
    )


_prepared: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_prepared_helpers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def prepare(func, hooks: Hooks, helper=False):
    """The kernel function (or, with ``helper``, a helper it calls) recompiled to call
    ``hooks`` (``func`` itself when its source is not available). A function is recompiled
    once per role; the run module always passes the same hooks."""
    cache = _prepared_helpers if helper else _prepared
    try:
        return cache[func]
    except (KeyError, TypeError):
        pass
    prepared = _compile(func, hooks, helper) or func
    try:
        cache[func] = prepared
    except TypeError:
        pass
    return prepared


#: Held around every conversion between Python AST objects and CPython's internal AST
#: (``ast.parse``, ``compile`` of an AST): on CPython before 3.12.1 / 3.11.8 that conversion
#: keeps its recursion depth in interpreter-wide state, so two threads converting at once fail
#: with "SystemError: AST constructor recursion depth mismatch" (CPython gh-106905), as kernels
#: launched from several JAX device threads at once did.
AST_LOCK = threading.RLock()


def parse_source(source: str) -> ast.Module:
    """``ast.parse`` of ``source`` under :data:`AST_LOCK`."""
    with AST_LOCK:
        return ast.parse(source)


def _compile(func, hooks, helper=False):
    code = getattr(func, "__code__", None)
    if code is None or code.co_name == "<lambda>":
        return None
    try:
        lines, first = inspect.getsourcelines(func)
    except (OSError, TypeError):
        return None
    try:
        tree = parse_source(textwrap.dedent("".join(lines)))
    except SyntaxError:
        return None
    if not tree.body or not isinstance(tree.body[0], ast.FunctionDef):
        return None
    ast.increment_lineno(tree, first - 1)
    kernel = _Rewriter(helper).visit(tree.body[0])
    free = list(code.co_freevars)
    factory = ast.FunctionDef(
        name=f"{_PREFIX}factory__",
        args=ast.arguments(
            posonlyargs=[],
            args=[ast.arg(f"{_PREFIX}hooks__")] + [ast.arg(n) for n in free],
            kwonlyargs=[],
            kw_defaults=[],
            defaults=[],
        ),
        body=[kernel, ast.Return(ast.Name(kernel.name, ast.Load()))],
        decorator_list=[],
        returns=None,
    )
    if "type_params" in ast.FunctionDef._fields:
        factory.type_params = []
    module = ast.Module(body=[factory], type_ignores=[])
    ast.copy_location(factory, kernel)
    ast.fix_missing_locations(module)
    flags = code.co_flags & __future__.annotations.compiler_flag
    try:
        with AST_LOCK:
            compiled = compile(module, code.co_filename, "exec", flags=flags, dont_inherit=True)
        namespace: dict = {}
        exec(compiled, func.__globals__, namespace)  # noqa: S102 - the kernel's own source
        cells = [cell.cell_contents for cell in (func.__closure__ or ())]
        new = namespace[f"{_PREFIX}factory__"](hooks, *cells)
    except Exception:  # noqa: BLE001 - anything unusual: run the kernel unchanged
        return None
    new.__defaults__ = func.__defaults__
    new.__kwdefaults__ = func.__kwdefaults__
    new.__annotations__ = dict(getattr(func, "__annotations__", {}))
    new.__doc__, new.__module__ = func.__doc__, func.__module__
    new.__qualname__ = func.__qualname__
    return new
