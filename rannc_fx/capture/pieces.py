"""The model's own forward in pieces where capture fails inside it, as torch.compile's graph
breaks do, at the boundaries of the forward's statements.

A model often computes its loss in its own forward with code no tracer turns into graph ops
(``if labels.max() >= n: raise``, ``masked_select``, ``.tolist()``, ``F.ctc_loss``), or checks
or reshapes its inputs so before anything else. ``ForwardSource`` reads the forward's source
and cuts its statements in three: what comes before the traceable body (``pre``), the body,
and what comes after it (``post``). ``wrap`` makes the model an instance of a subclass of its
class, sharing its state, whose forward is the body with each outer piece replaced by the call
of a ``Piece``: a module kept whole by capture and run eagerly in its stage
(``capture/opaque``): ``pre`` where the inputs are, ``post`` with the body's outputs on the
last stage (once a step on the whole batch where it couples the samples, ``shapes/tail``).

Where the capture of a body fails at a statement, ``next_bounds`` moves the cut: the failing
statement joins ``pre`` when everything up to it reads no parameter or buffer (code that
runs eagerly on the inputs), else ``post`` starts there. A piece may not read the model's
parameters or buffers (its gradients would be no stage's), nor ``return`` early before the
body; no body left, or one with no state of the model's, is no pipeline: capture fails with
the line it failed at.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

from torch import nn

from .graph import CaptureError

__all__ = ["Cut", "ForwardSource", "Piece", "capture_in_pieces"]

T = TypeVar("T")

PRE, POST = "forward_pre", "forward_post"  # the pieces' names among the model's children


class Piece(nn.Module):
    """Statements of the model's forward, run eagerly as one node (no state of its own)."""

    fn: Any

    def __init__(self, model: nn.Module, fn: Any, lines: tuple[int, int], where: str) -> None:
        super().__init__()
        self.__dict__["model"] = model  # not a child: the model holds this piece
        self.__dict__["fn"] = fn
        self.lines, self.where = lines, where

    def forward(self, *args: Any) -> Any:
        return self.fn(self.model, *args)

    def extra_repr(self) -> str:
        return f"{self.where} lines {self.lines[0]}-{self.lines[1]}, run eagerly"


@dataclass(frozen=True)
class Cut:
    """Where the forward's statements are cut: ``[0, pre)`` before the body, ``[post, n)``
    after it."""

    pre: int
    post: int


class ForwardSource:
    """A model class's ``forward``, parsed: its statements, arguments and globals."""

    def __init__(self, fn: Any, fdef: ast.FunctionDef) -> None:
        self.fn, self.fdef = fn, fdef
        self.stmts: list[ast.stmt] = list(fdef.body)
        a = fdef.args
        self.self_name = (a.posonlyargs + a.args)[0].arg
        self.arg_names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)
                          if x.arg != self.self_name]
        self.arg_names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
        self.filename = inspect.getsourcefile(fn) or "<forward>"

    @classmethod
    def of(cls, model: nn.Module) -> ForwardSource | None:
        """The source of ``model``'s forward, or None where it cannot be cut (no source, a
        closure such as ``super()``, ``global`` statements)."""
        fn = getattr(type(model).forward, "__func__", type(model).forward)
        # a decorated forward (transformers wraps most): its own code, decorators re-applied
        fn = inspect.unwrap(fn) if inspect.isfunction(fn) else fn
        if fn is nn.Module.forward or not inspect.isfunction(fn) or fn.__code__.co_freevars:
            return None
        try:
            lines, first = inspect.getsourcelines(fn)
            tree = ast.parse(textwrap.dedent("".join(lines)))
        except (OSError, TypeError, SyntaxError):
            return None
        fdef = tree.body[0] if tree.body else None
        if not isinstance(fdef, ast.FunctionDef) or not (fdef.args.posonlyargs + fdef.args.args):
            return None
        if any(isinstance(n, (ast.Global, ast.Nonlocal)) for n in ast.walk(fdef)):
            return None
        ast.increment_lineno(tree, first - 1)
        return cls(fn, fdef)

    # -- where a capture failed --------------------------------------------------------------

    def failing_statement(self, e: BaseException) -> int | None:
        """The index of the statement of the forward running where ``e`` (or what caused
        it) was raised, innermost frame first."""
        first, last = self.fdef.lineno, self.fdef.end_lineno or self.fdef.lineno
        for exc in _chain(e):
            line = None
            tb: TracebackType | None = exc.__traceback__
            while tb is not None:
                code = tb.tb_frame.f_code
                if (code.co_filename == self.filename and code.co_name == self.fdef.name
                        and first <= tb.tb_lineno <= last):
                    line = tb.tb_lineno
                tb = tb.tb_next
            if line is not None:
                return next((i for i, s in enumerate(self.stmts)
                             if s.lineno <= line <= (s.end_lineno or s.lineno)), None)
        return None

    def lines(self, lo: int, hi: int) -> tuple[int, int]:
        return self.stmts[lo].lineno, self.stmts[hi - 1].end_lineno or self.stmts[hi - 1].lineno

    def next_cut(self, cut: Cut | None, failed: int, model: nn.Module) -> Cut | str:
        """The cut after the body ``cut`` failed at statement ``failed``, or why there is none."""
        cut = cut or Cut(0, len(self.stmts))
        if not cut.pre <= failed < cut.post:
            return "it failed outside the part it was tracing"
        line = self.stmts[failed].lineno
        upto = self.stmts[cut.pre:failed + 1]
        if not self._reads_state(upto, model) and not _returns(upto):
            cut = Cut(failed + 1, cut.post)  # code on the inputs: it runs before the body
        else:
            after = self.stmts[failed:]
            if self._reads_state(after, model):
                return (f"the code from line {line} on reads the model's parameters or "
                        "buffers, so it cannot run eagerly after the pipelined body")
            cut = Cut(cut.pre, failed)
        if cut.pre >= cut.post or not self._reads_state(self.stmts[cut.pre:cut.post], model):
            return f"no code that reads the model's parameters is left to pipeline around line {line}"
        return cut

    def _reads_state(self, stmts: list[ast.stmt], model: nn.Module) -> bool:
        """Whether ``stmts`` may read a parameter or buffer of ``model`` (calls of its methods
        and ``self`` passed on whole count)."""
        for chain, whole in _self_uses(stmts, self.self_name):
            if whole:
                return True
            value: Any = model
            for name in chain:
                try:
                    value = getattr(value, name)
                except Exception:
                    return True
                if isinstance(value, nn.Module):
                    if any(True for _ in value.parameters()) or any(True for _ in value.buffers()):
                        return True
                    continue
                if inspect.ismethod(value) and isinstance(value.__self__, nn.Module):
                    return True
                if isinstance(value, nn.Parameter) or (
                        name in model._buffers and value is model._buffers[name]):
                    return True
                break  # a plain attribute (a config, a size, a function)
        return False

    # -- the model in pieces -----------------------------------------------------------------

    def wrap(self, model: nn.Module, cut: Cut) -> nn.Module:
        """``model`` with its forward cut at ``cut``: the statements outside the body are the
        children ``forward_pre`` / ``forward_post``, run eagerly as one node each."""
        n, stmts = len(self.stmts), self.stmts
        pre, body, post = stmts[:cut.pre], stmts[cut.pre:cut.post], stmts[cut.post:]
        known = set(self.arg_names)
        pre_in = [a for a in self.arg_names if a in _loads(pre)]
        pre_out = [v for v in _ordered_stores(pre) if v in _loads(body + post)]
        bound = known | _stores(pre) | _stores(body)
        post_in = [v for v in [*self.arg_names, *_ordered_stores(pre + body)]
                   if v in bound and v in _loads(post)]
        post_in = list(dict.fromkeys(post_in))
        me, pieces = self.self_name, {}
        defs: list[ast.stmt] = []
        new_body: list[ast.stmt] = []
        if pre:
            defs.append(_def("_pre", [me, *pre_in], [*pre, _return_tuple(pre_out, pre[-1])], pre[0]))
            call = _call(me, PRE, pre_in, pre[0])
            new_body.append(ast.Assign(targets=[_tuple(pre_out, ast.Store(), pre[0])],
                                       value=call, lineno=pre[0].lineno))
        new_body += body
        if post:
            defs.append(_def("_post", [me, *post_in], post, post[0]))
            new_body.append(ast.Return(value=_call(me, POST, post_in, post[0]),
                                       lineno=post[0].lineno))
        fdef = _function(self.fdef.name, self.fdef.args, new_body, self.fdef)
        fdef.decorator_list = self.fdef.decorator_list
        base = type(model)
        # in a class of the model's name, so that decorators see the method they wrap
        holder = ast.ClassDef(name=base.__name__, bases=[], keywords=[], body=[fdef],
                              decorator_list=[], lineno=self.fdef.lineno)
        if "type_params" in ast.ClassDef._fields:  # Python 3.12 on
            holder.type_params = []  # type: ignore[attr-defined]
        module = _located(ast.Module(body=[*defs, holder], type_ignores=[]))
        space: dict[str, Any] = {}
        exec(compile(module, self.filename, "exec"), self.fn.__globals__, space)  # noqa: S102
        forward = space[base.__name__].__dict__[self.fdef.name]
        cls = type(f"{base.__name__}InPieces", (base,), {"forward": forward,
                                                          "__module__": base.__module__})
        wrapped: nn.Module = object.__new__(cls)
        state = dict(model.__dict__)
        children = dict(model._modules)
        qual = f"{base.__qualname__}.forward"
        if pre:
            pieces[PRE] = Piece(wrapped, space["_pre"], self.lines(0, cut.pre), f"{qual}'s")
        if post:
            pieces[POST] = Piece(wrapped, space["_post"], self.lines(cut.post, n), f"{qual}'s")
        state["_modules"] = {**children, **pieces}  # the model's children stay its
        wrapped.__dict__.update(state)
        return wrapped

    def describe(self, cut: Cut) -> str:
        out = []
        if cut.pre:
            a, b = self.lines(0, cut.pre)
            out.append(f"lines {a}-{b} before the graph")
        if cut.post < len(self.stmts):
            a, b = self.lines(cut.post, len(self.stmts))
            out.append(f"lines {a}-{b} after {'it' if cut.pre else 'the graph'}")
        name = f"{self.fn.__qualname__} ({self.filename.rpartition('/')[2]})"
        return f"ran {' and '.join(out)} of {name} eagerly, as one node each"


# -- the statements' names ---------------------------------------------------------------------


def _chain(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and cur not in out:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out[::-1]  # the original failure first


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.ListComp,
           ast.SetComp, ast.DictComp, ast.GeneratorExp)


def _walk(stmts: Iterable[ast.AST], scopes: bool = True) -> Iterator[ast.AST]:
    """Every node of ``stmts``; without ``scopes``, not those inside nested scopes (functions,
    lambdas, comprehensions), whose names are their own."""
    todo = list(stmts)
    while todo:
        node = todo.pop()
        yield node
        if not scopes and isinstance(node, _SCOPES):
            continue
        todo.extend(ast.iter_child_nodes(node))


def _loads(stmts: list[ast.stmt]) -> set[str]:
    return {n.id for n in _walk(stmts) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _stores(stmts: list[ast.stmt]) -> set[str]:
    return set(_ordered_stores(stmts))


def _ordered_stores(stmts: list[ast.stmt]) -> list[str]:
    found: dict[str, None] = {}
    for s in stmts:
        nodes = sorted(_walk([s], scopes=False), key=lambda x: (getattr(x, "lineno", 0),
                                                                getattr(x, "col_offset", 0)))
        for node in nodes:
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                found[node.id] = None
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found[node.name] = None
            elif isinstance(node, ast.alias):
                found[(node.asname or node.name).partition(".")[0]] = None
            elif isinstance(node, ast.ExceptHandler) and node.name:
                found[node.name] = None
    return list(found)


def _returns(stmts: list[ast.stmt]) -> bool:
    return any(isinstance(n, ast.Return) for n in _walk(stmts, scopes=False))


def _self_uses(stmts: list[ast.stmt], me: str) -> Iterator[tuple[list[str], bool]]:
    """Each use of ``me``: the attribute chain read from it, and whether it is used whole."""
    parents: dict[int, ast.AST] = {}
    for node in _walk(stmts):
        for child in ast.iter_child_nodes(node):
            parents[id(child)] = node
    for node in _walk(stmts):
        if not (isinstance(node, ast.Name) and node.id == me):
            continue
        chain: list[str] = []
        cur: ast.AST = node
        while isinstance(up := parents.get(id(cur)), ast.Attribute) and up.value is cur:
            chain.append(up.attr)
            cur = up
        yield chain, not chain


# -- building the new forward ------------------------------------------------------------------


def _located(module: ast.Module) -> ast.Module:
    """Positions for the nodes built here: the line of the statement they stand for."""
    ast.fix_missing_locations(module)
    for node in ast.walk(module):
        if isinstance(node, (ast.stmt, ast.expr, ast.arg)):
            if node.end_lineno is None or node.end_lineno < node.lineno:
                node.end_lineno = node.lineno
            if node.end_lineno == node.lineno and (node.end_col_offset or 0) < node.col_offset:
                node.end_col_offset = node.col_offset
    return module


def _def(name: str, args: list[str], body: list[ast.stmt], at: ast.stmt) -> ast.FunctionDef:
    return _function(name, ast.arguments(
        posonlyargs=[], args=[ast.arg(arg=a) for a in args], vararg=None, kwonlyargs=[],
        kw_defaults=[], kwarg=None, defaults=[]), body, at)


def _function(name: str, args: ast.arguments, body: list[ast.stmt],
              at: ast.stmt) -> ast.FunctionDef:
    fdef = ast.FunctionDef(name=name, args=args, body=body, decorator_list=[], returns=None,
                           type_comment=None, lineno=at.lineno)
    if "type_params" in ast.FunctionDef._fields:  # Python 3.12 on
        fdef.type_params = []  # type: ignore[attr-defined]
    return fdef


def _tuple(names: list[str], ctx: ast.expr_context, at: ast.stmt) -> ast.Tuple:
    return ast.Tuple(elts=[ast.Name(id=v, ctx=ctx, lineno=at.lineno) for v in names], ctx=ctx,
                     lineno=at.lineno)


def _return_tuple(names: list[str], at: ast.stmt) -> ast.Return:
    return ast.Return(value=_tuple(names, ast.Load(), at), lineno=at.end_lineno or at.lineno)


def _call(me: str, piece: str, args: list[str], at: ast.stmt) -> ast.Call:
    fn = ast.Attribute(value=ast.Name(id=me, ctx=ast.Load()), attr=piece, ctx=ast.Load())
    return ast.Call(func=fn, args=[ast.Name(id=a, ctx=ast.Load()) for a in args], keywords=[],
                    lineno=at.lineno)


# -- capture, in pieces where it fails in the forward itself -----------------------------------


def capture_in_pieces(model: nn.Module, capture: Callable[[nn.Module], T],
                      cut: Cut | None = None) -> tuple[T, Cut | None, str]:
    """``capture(model)``; where it fails in the model's own forward, ``capture`` of the model
    cut in pieces around a traceable body (``next_cut``), with a note saying which lines run
    eagerly. ``cut`` given (a capture of the model's other mode): the same pieces at once."""
    if cut is not None:
        source = ForwardSource.of(model)
        if source is None or cut.post > len(source.stmts):
            raise CaptureError(f"{type(model).__name__}'s forward cannot be cut as planned")
        return capture(source.wrap(model, cut)), cut, source.describe(cut)
    try:
        return capture(model), None, ""
    except CaptureError as e:
        first = e  # cut outside this handler, so that later failures do not chain to it
        source = ForwardSource.of(model)
        if source is None or source.failing_statement(first) is None:
            raise
    error = first
    for _ in range(len(source.stmts)):
        failed = source.failing_statement(error)
        nxt = ("capture of the pieces failed elsewhere: " + str(error).partition("\n")[0]
               if failed is None else source.next_cut(cut, failed, model))
        if isinstance(nxt, str):
            raise CaptureError(f"{first}\n  (the forward cannot run in pieces: {nxt})"
                               ) from error.__cause__ or error
        cut = nxt
        try:
            wrapped = source.wrap(model, cut)
        except Exception as e:  # a decorator that does not take the rebuilt forward
            raise CaptureError(f"{first}\n  (the forward cannot run in pieces: rebuilding its "
                               f"code failed: {type(e).__name__}: {e})") from e
        try:
            return capture(wrapped), cut, source.describe(cut)
        except CaptureError as e:
            error = e
    raise first
