"""Check a captured graph against the model: the same outputs on the example inputs.

torch.fx runs ``forward`` on Proxy objects, and a Proxy answers every question a Python
check can ask of it: ``hasattr(out, "sample")`` is true, ``isinstance(x, torch.Tensor)`` is
false. Code that inspects a value therefore traces without an error into a graph that is
not the model. Running both once on the example inputs shows it:

    model(*args, **kwargs)  ──┐
                              ├── same pytree, shapes, dtypes (and values, where weights are real)
    gm(*flat inputs)        ──┘

Both runs start from the same buffers and random state (dropout draws the same masks) under
``no_grad``, and everything is put back afterwards: batch norm's running statistics and the
random state are the user's again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch import fx, nn
from torch.fx.node import _get_qualified_name
from torch.utils import _pytree as pytree

from ..progress import note
from .graph import CapturedGraph, same_constant

__all__ = ["GraphMismatch", "check_capture"]

# The graph calls the model's own modules and ops in the model's order, so outputs agree
# bitwise except where a kernel is nondeterministic (atomics on GPUs); a traced branch the
# model does not take differs by far more. The absolute tolerance scales with the output.
_RTOL = 1e-3
_ATOL = 1e-4


class GraphMismatch(Exception):
    """The captured graph does not compute what the model does; the message says where."""


def check_capture(
    captured: CapturedGraph, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Literal["values", "shapes"] | None:
    """Compare ``captured.gm`` with ``model`` on one call ``model(*args, **kwargs)``.

    Returns what was compared: ``"values"``, or ``"shapes"`` (and dtypes) for a model with
    tensors on the meta device (both then run on meta copies of the inputs). Returns None, and
    logs why, when the model itself does not run on the inputs (nothing to compare with).
    Raises GraphMismatch naming the first output that differs, or the node where the graph
    fails.
    """
    on_meta = any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers()))
    if on_meta:
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
    cuda = sorted({
        t.device.index or 0
        for t in (*model.parameters(), *model.buffers(), *pytree.tree_leaves((args, kwargs)))
        if isinstance(t, torch.Tensor) and t.device.type == "cuda"
    })
    with torch.no_grad(), _same_start((model, captured.gm), cuda) as restart:
        try:
            # copied: an output may be a buffer that restart() writes back into
            expected = _copies(model(*_copies(args), **_copies(kwargs)))
        except Exception as e:
            note(
                "could not check torch.fx's graph of %s against the model: the model raised "
                "%s on the example inputs%s", type(model).__name__, _first_line(e),
                " on the meta device" if on_meta else "",
            )
            return None
        restart()
        got = _run_graph(captured, args, kwargs, restart)
    why = _difference(got, expected, values=not on_meta)
    if why:
        raise GraphMismatch(why)
    return "shapes" if on_meta else "values"


# -- running -----------------------------------------------------------------------------------


@contextlib.contextmanager
def _same_start(modules: tuple[nn.Module, ...], cuda: list[int]) -> Iterator[Callable[[], None]]:
    """Yields ``restart()``, which puts every buffer of ``modules`` and the random state back
    as they are now; it runs once more on exit."""
    slots: list[tuple[nn.Module, str, torch.Tensor]] = []
    copies: dict[int, torch.Tensor] = {}
    for root in modules:
        for m in root.modules():
            for name, b in m._buffers.items():
                if b is not None:
                    slots.append((m, name, b))
                    copies.setdefault(id(b), b.detach().clone())
    with torch.random.fork_rng(devices=cuda):
        cpu_rng = torch.random.get_rng_state()
        cuda_rng = [torch.cuda.get_rng_state(d) for d in cuda]

        def restart() -> None:
            with torch.no_grad():
                for m, name, b in slots:
                    m._buffers[name] = b  # a forward may have replaced it
                    b.copy_(copies[id(b)])
            torch.random.set_rng_state(cpu_rng)
            for d, state in zip(cuda, cuda_rng, strict=True):
                torch.cuda.set_rng_state(state, d)

        try:
            yield restart
        finally:
            restart()


def _copies(tree: Any) -> Any:
    """Fresh tensors: a forward that writes into its inputs cannot change the other run's."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.clone(), tree)


class _Run(fx.Interpreter):
    """The graph's run, remembering the node running when it raises (only after the graph's
    generated code raised, to say where)."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.extra_traceback = False
        self.node: fx.Node | None = None

    def run_node(self, n: fx.Node) -> Any:
        self.node = n
        return super().run_node(n)


def _run_graph(captured: CapturedGraph, args: tuple[Any, ...], kwargs: dict[str, Any],
               restart: Callable[[], None]) -> Any:
    """The graph's generated code on the example; only when it raises, the run again node by
    node (``_Run``) to name the node that fails."""
    flat = captured.flatten_inputs(args, kwargs)
    try:
        return captured.unflatten_outputs(list(captured.gm(*_copies(flat))))
    except Exception:
        pass
    restart()
    run = _Run(captured.gm)
    try:
        return captured.unflatten_outputs(list(run.run(*_copies(flat))))
    except Exception as e:
        n = run.node
        where = f"its node {n.name} ({_call_text(n)}){_module_of(n)}" if n else "the graph"
        raise GraphMismatch(
            f"{where} raises {_first_line(e)}, where the model runs without error"
        ) from e


def _call_text(n: fx.Node) -> str:
    """``getattr(inner_lin, 'sample')``: the node as the call it makes."""
    if n.op in ("placeholder", "get_attr", "output"):
        return f"{n.op} {n.target}"
    args = [repr(a) for a in n.args] + [f"{k}={v!r}" for k, v in n.kwargs.items()]
    if n.op == "call_method":
        return f"{args[0]}.{n.target}({', '.join(args[1:])})"
    if n.op == "call_module":
        return f"self.{n.target}({', '.join(args)})"
    try:
        name = _get_qualified_name(n.target).removeprefix("_operator.").removeprefix("builtins.")  # type: ignore[arg-type]
    except Exception:
        name = str(n.target)
    return f"{name}({', '.join(args)})"


def _module_of(n: fx.Node) -> str:
    """`` in module inner (Inner)``: the innermost submodule whose forward made the node."""
    if n.target is getattr:
        return ""  # torch.fx makes an attribute's node where it is first used, not where read
    stack = n.meta.get("nn_module_stack") or {}
    path, cls = next(reversed(stack.values()), ("", None))
    if not path:
        return " in the model's own forward"
    name = cls if isinstance(cls, str) else getattr(cls, "__name__", "?")
    return f" in module {path} ({name.rpartition('.')[2]})"


# -- comparing ---------------------------------------------------------------------------------


def _difference(got: Any, expected: Any, *, values: bool) -> str | None:
    """The first way ``got`` (the graph's) differs from ``expected`` (the model's), or None."""
    paths, spec = pytree.tree_flatten_with_path(expected)
    leaves, got_spec = pytree.tree_flatten(got)
    if got_spec != spec:
        return f"the model returns {_outline(expected)} but the graph returns {_outline(got)}"
    for (path, e), g in zip(paths, leaves, strict=True):
        where = f"output {pytree.keystr(path)}" if path else "the output"
        if not (isinstance(e, torch.Tensor) and isinstance(g, torch.Tensor)):
            if isinstance(e, torch.Tensor) or isinstance(g, torch.Tensor) or not same_constant(g, e):
                return f"{where} is {_brief(e)} in the model but {_brief(g)} in the graph"
            continue
        if e.shape != g.shape or e.dtype != g.dtype:
            return f"{where} is {_brief(e)} in the model but {_brief(g)} in the graph"
        if values:
            gap = _gap(g, e)
            if gap:
                return f"{where} ({_brief(e)}) differs from the model's {gap}"
    return None


def _gap(got: torch.Tensor, expected: torch.Tensor) -> str:
    """How far ``got`` is from ``expected``, or "" when within tolerance."""
    if torch.equal(got, expected):
        return ""
    if not (expected.is_floating_point() or expected.is_complex()):
        n = int((got != expected).sum())
        return f"in {n} of {expected.numel()} elements" if n else ""
    e, g = expected.detach().to(torch.float64), got.detach().to(torch.float64)
    finite = torch.isfinite(e)
    scale = max(1.0, float(e[finite].abs().max())) if bool(finite.any()) else 1.0
    close = torch.isclose(g, e, rtol=_RTOL, atol=_ATOL * scale, equal_nan=True)
    if bool(close.all()):
        return ""
    diff = (g - e).abs().nan_to_num(nan=float("inf"))
    return (
        f"in {int((~close).sum())} of {e.numel()} elements, by up to {float(diff.max()):.3g} "
        f"(the model's values reach {scale:.3g})"
    )


def _brief(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        dtype = str(x.dtype).removeprefix("torch.")
        return f"{'an' if dtype[0] in 'aeio' else 'a'} {dtype} tensor of shape {tuple(x.shape)}"
    text = repr(x)
    return f"{type(x).__name__} {text[:60] + '...' if len(text) > 60 else text}"


class _Leaf:
    def __init__(self, t: torch.Tensor):
        self.text = f"Tensor{tuple(t.shape)}"

    def __repr__(self) -> str:
        return self.text


def _outline(tree: Any) -> str:
    """The pytree with tensors written as their shapes: ``{'loss': Tensor(), 'logits': ...}``."""
    try:
        text = repr(pytree.tree_map_only(torch.Tensor, _Leaf, tree))
    except Exception:  # a container that will not hold non-tensors
        text = f"a {type(tree).__name__} of {len(pytree.tree_leaves(tree))} leaves"
    return text if len(text) <= 200 else text[:200] + "..."


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"
