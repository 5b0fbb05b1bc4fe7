"""Capture an nn.Module as one flat fx.GraphModule: torch.fx where it traces and its graph
computes what the model does, else torch.export.

    graph          CapturedGraph: the flat graph, its pytree specs, the model's own tensors
    trace          torch.fx and torch.export, each to a CapturedGraph
    repeat         torch.export with each kind of repeated submodule traced once
    same           which submodules are of one kind
    shell          later members of a kind as empty shells while export runs
    copy_nodes     a traced member's nodes copied for the others
    check          a torch.fx graph against the model, on the example inputs
    opaque         modules no tracer captures, one node each run eagerly
    record         their calls recorded on the example
    failure        what to say when no tracer works
    capture        ``capture_pass``: which tracer, and the modules kept whole where one fails
    portable       a captured graph sent to another copy of the model (``compile()``'s ranks)
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, Literal

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from ..progress import Progress
from .check import GraphMismatch, check_capture
from .failure import failure_message, first_line
from .graph import CapturedGraph, CaptureError, autocast_state, batch_size_of
from .loss import LossFn
from .opaque import CallRecord
from .pieces import Cut, Piece, capture_in_pieces
from .record import record_calls
from .trace import opaque_modules, trace_export, trace_fx

__all__ = [
    "CaptureError",
    "CapturedGraph",
    "batch_size_of",
    "capture_pass",
    "retarget_device_pass",
]

log = logging.getLogger("rannc_fx")


def capture_pass(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    tracer: Literal["auto", "fx", "export"] = "auto",
    leaf_modules: tuple[str, ...] = (),
    batch_dim: int = 0,
    dynamic: bool = True,
    opaque: Mapping[str, list[CallRecord]] | None = None,
    pieces: tuple[int, int] | None = None,
) -> CapturedGraph:
    """``model(*args, **kwargs)`` as a CapturedGraph.

    ``"auto"`` tries torch.fx first (module-level graph, instant, works on any device) and
    checks its graph against the model on the example inputs (``capture/check``); when fx
    fails, its graph differs from the model, or it keeps a torch.nn container such as
    ``nn.TransformerEncoder`` as one opaque node, it tries non-strict torch.export (ATen-level
    graph) and keeps the finer graph. ``"fx"`` raises CaptureError when the check finds a
    difference; the check costs one forward of the model and one of the graph, under no_grad.
    ``leaf_modules`` (class names) are kept as single ``call_module`` nodes by torch.fx, and
    run eagerly as one node each under torch.export (``capture/opaque``). Where a tracer
    fails inside a submodule (data-dependent code, an op without a fake kernel), that module
    and every other of its class are kept whole too, run eagerly, and the capture goes on
    (torch.export always; torch.fx when it is the tracer asked for): a graph break at the
    module's boundary. ``opaque`` gives such modules' recorded calls (a capture of the
    model's other mode keeps the planned capture's). With torch.export the batch dimension of every
    input whose ``batch_dim`` has the example's batch size is dynamic, so the graph runs at any
    micro-batch size; with ``dynamic``, so is every other input dimension the model allows
    (``trace_export``). Where capture fails in the model's own forward, its statements before
    and after a traceable body run eagerly as one node each (``capture/pieces``); ``pieces``
    cuts it where a capture of the model's other mode did.
    """
    kwargs = dict(kwargs or {})
    with Progress("capture", doing="tracing with torch.fx") as p:
        def attempt(m: nn.Module) -> tuple[CapturedGraph, list[str], bool]:
            return _capture(m, tuple(args), kwargs, tracer, leaf_modules, batch_dim, dynamic, p,
                            dict(opaque or {}))

        (captured, notes, warn), cut, cut_note = capture_in_pieces(
            model, attempt, Cut(*pieces) if pieces else None)
        if cut is not None:
            captured.pieces = (cut.pre, cut.post)
            notes.insert(0, cut_note)
            warn = True
        captured.model_name = type(model).__name__
        captured.autocast = autocast_state(_device_type(model, args, kwargs))
        if captured.copied_calls:
            notes.insert(0, f"{captured.copied_calls} calls of repeated modules copied from "
                            "the first of their kind")
        p.done(
            "captured %s with %s: %d nodes in %.2f s%s",
            captured.model_name,
            "torch.fx" if captured.tracer == "fx" else "torch.export",
            captured.num_nodes,
            p.seconds,
            "".join(f"; {n}" for n in notes),
            level=logging.WARNING if warn else logging.INFO,
        )
    return captured


def _capture(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    tracer: Literal["auto", "fx", "export"],
    leaf_modules: tuple[str, ...],
    batch_dim: int,
    dynamic: bool,
    p: Progress,
    known: dict[str, list[CallRecord]],
) -> tuple[CapturedGraph, list[str], bool]:
    """(the graph, notes for the log line, whether they are a warning); ``p.doing`` says
    which step runs, for the progress lines of a long capture."""
    errors: dict[str, BaseException] = {}
    captured: CapturedGraph | None = None
    opaque: list[tuple[str, str]] = []
    notes: list[str] = []
    breaks = _Breaks(model, args, kwargs, batch_dim, known)
    if tracer in ("auto", "fx"):
        try:
            if tracer == "fx" or known:
                captured = breaks.run(lambda o: trace_fx(model, args, kwargs, leaf_modules,
                                                         batch_dim, o), p)
            else:
                captured = trace_fx(model, args, kwargs, leaf_modules, batch_dim)
            opaque = opaque_modules(captured, leaf_modules)
        except CaptureError:
            raise
        except Exception as e:  # torch.fx raises anything the model's code raises on a Proxy
            errors["torch.fx"] = e
    if captured is not None and (tracer == "fx" or not opaque):
        p.doing = "checking torch.fx's graph against the model"
        captured = _checked(captured, model, args, kwargs, errors)
        if captured is None and tracer == "fx":
            raise CaptureError(failure_message(model, errors, tracer)) from errors["torch.fx"]
    if tracer == "export" or (tracer == "auto" and (captured is None or opaque)):
        breaks.wanted |= _of_classes(model, leaf_modules)
        # where torch.fx has a graph (a container kept whole), export is tried as it is
        breaks.grow = tracer == "export" or captured is None
        p.doing = "tracing with torch.export"
        # torch.export prints the partial graph of a failure to stderr; keep it for debugging.
        printed = io.StringIO()
        try:
            with contextlib.redirect_stderr(printed):
                exported = breaks.run(lambda o: trace_export(
                    model, args, kwargs, batch_dim, dynamic=dynamic, opaque=o), p)
            if not breaks.found:  # else it holds the failed attempts' partial graphs
                sys.stderr.write(printed.getvalue())
            captured, opaque = exported, []
        except Exception as e:
            log.debug("torch.export printed:\n%s", printed.getvalue())
            errors["torch.export"] = e
            mismatch = isinstance(errors.get("torch.fx"), GraphMismatch)
            if captured is None and isinstance(e, CaptureError) and not mismatch:
                raise  # already says what to do
    if captured is not None and opaque and "torch.export" in errors:
        p.doing = "checking torch.fx's graph against the model"
        captured = _checked(captured, model, args, kwargs, errors)  # the opaque graph is all we have
    if captured is None:
        raise CaptureError(failure_message(model, errors, tracer)) from errors.get(
            "torch.export", errors.get("torch.fx")
        )
    warn = False
    whole = sorted(n for n in captured.opaque if not isinstance(model.get_submodule(n), Piece))
    if whole:
        warn = bool(breaks.found)
        notes.append(
            f"kept {', '.join(whole)} whole, run eagerly as one node each"
            + (f" (capture failed inside: {breaks.why})" if breaks.found else "")
        )
    if isinstance(errors.get("torch.fx"), GraphMismatch):
        warn = True
        notes.append(
            f"torch.fx's graph differed from the model on the example inputs "
            f"({errors['torch.fx']}), so torch.export captured it"
        )
    if opaque and "torch.export" in errors:
        warn = True
        notes.append(
            f"kept {', '.join(f'{n} ({c})' for n, c in opaque)} as one node each (torch.fx "
            f"does not trace into torch.nn modules and torch.export failed: "
            f"{first_line(errors['torch.export'])}), so no stage boundary can fall inside"
        )
    return captured, notes, warn


_MAX_BREAKS = 8  # kinds of modules kept whole before capture gives up


class _Breaks:
    """The modules a capture keeps whole: those asked for, and each kind it failed inside."""

    def __init__(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 batch_dim: int, known: dict[str, list[CallRecord]]) -> None:
        self.model, self.args, self.kwargs, self.batch_dim = model, args, kwargs, batch_dim
        self.records = dict(known)
        self.wanted = set(known) | {
            n for n, m in model.named_modules() if isinstance(m, (LossFn, Piece))}
        self.found: list[str] = []  # kept whole because capture failed inside them
        self.grow = True  # whether a failure inside a module keeps it whole and goes on
        self.why = ""
        self.names = {id(m): name for name, m in model.named_modules() if name}

    def run(self, trace: Callable[[dict[str, list[CallRecord]]], CapturedGraph],
            p: Progress) -> CapturedGraph:
        for _ in range(_MAX_BREAKS + 1):
            missing = self.wanted - set(self.records)
            if missing:
                p.doing = "running the model once to record the calls of the modules kept whole"
                self.records.update(record_calls(self.model, self.args, self.kwargs, missing,
                                                 self.batch_dim))
            try:
                return trace({n: self.records[n] for n in sorted(self.wanted)})
            except CaptureError:
                raise
            except Exception as e:
                culprit = _innermost_module(e, self.names) if self.grow else None
                if culprit is None or culprit in self.wanted or len(self.found) >= _MAX_BREAKS:
                    raise
                kind = type(self.model.get_submodule(culprit))
                self.wanted |= {n for n, m in self.model.named_modules()
                                if n and type(m) is kind}
                self.found.append(culprit)
                self.why = f"{culprit} ({kind.__name__}): {first_line(e)}"
                log.debug("capture: failed inside %s; keeping its kind whole: %s", culprit, e)
        raise AssertionError("unreachable")


def _of_classes(model: nn.Module, classes: tuple[str, ...]) -> set[str]:
    """The submodules whose class name (or qualified name) ``classes`` lists."""
    return {n for n, m in model.named_modules() if n and (
        type(m).__name__ in classes or f"{type(m).__module__}.{type(m).__qualname__}" in classes)}


def _innermost_module(e: BaseException, modules: dict[int, str]) -> str | None:
    """The name of the innermost submodule whose code was running where ``e`` was raised."""
    chain: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and cur not in chain:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    for exc in chain:
        found = None
        tb: TracebackType | None = exc.__traceback__
        while tb is not None:
            owner = tb.tb_frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and id(owner) in modules:
                found = modules[id(owner)]
            tb = tb.tb_next
        if found is not None:
            return found
    return None


def _checked(captured: CapturedGraph, model: nn.Module, args: tuple[Any, ...],
             kwargs: dict[str, Any], errors: dict[str, BaseException]) -> CapturedGraph | None:
    """``captured`` once checked against the model, or None with the difference in ``errors``."""
    try:
        captured.checked = check_capture(captured, model, args, kwargs)
    except GraphMismatch as e:
        errors["torch.fx"] = e
        return None
    return captured


def retarget_device_pass(gm: fx.GraphModule, device: torch.device | str, *,
                         only: torch.device | None = None) -> fx.GraphModule:
    """Point every device the graph names (``arange(..., device=cpu)``) at ``device``, in place
    (with ``only``: every mention of that device).

    torch.export bakes the capture device into factory calls; a graph captured on the CPU or
    on ``meta`` runs elsewhere only after this.
    """
    dev = torch.device(device)

    def swap(x: Any) -> Any:
        return dev if isinstance(x, torch.device) and (only is None or x == only) else x

    # nested graphs too: export puts autocast / grad-mode regions in submodule graphs
    for sub in gm.modules():
        if not isinstance(sub, fx.GraphModule):
            continue
        for n in sub.graph.nodes:
            n.args = pytree.tree_map(swap, n.args)
            n.kwargs = pytree.tree_map(swap, n.kwargs)
        sub.graph.lint()
        sub.recompile()
    return gm


def _device_type(model: nn.Module, args: Any, kwargs: Any) -> str:
    """The type of device the capture computed on: meta where any of its tensors is, else
    that of the model's state, else of its first input."""
    types = [t.device.type for t in (*model.parameters(), *model.buffers(),
                                     *pytree.tree_leaves((args, kwargs)))
             if isinstance(t, torch.Tensor)]
    return "meta" if "meta" in types else types[0] if types else "cpu"
