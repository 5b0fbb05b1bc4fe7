"""What capture says when no tracer works: the error that names where the model's code failed
(the innermost frame of the model's own files, the submodule that was running) and the ways
out (another tracer, ``leaf_modules``, ``loss_fn``, what a returned non-tensor needs).

``capture`` raises :class:`CaptureError` with :func:`failure_message`'s text, and quotes a
failure in its log lines by :func:`first_line`.
"""

from __future__ import annotations

import os
import re
import traceback
from types import TracebackType

import torch
from torch import nn

from .check import GraphMismatch

__all__ = ["failure_message", "first_line"]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_STDLIB_DIR = os.path.dirname(os.__file__) + os.sep
_HERE = os.path.dirname(__file__)


def _is_user_file(filename: str) -> bool:
    """Whether a frame of ``filename`` is the model's code: not torch's, not this folder's
    (the tracers and the stand-ins that run the model), not the standard library's."""
    if filename.startswith((_TORCH_DIR, "<")) or os.path.dirname(filename) == _HERE:
        return False
    return not filename.startswith(_STDLIB_DIR) or "site-packages" in filename


def _user_frame(e: BaseException, modules: dict[int, str]) -> tuple[str, str | None]:
    """``file:line in fn: code`` of the innermost model-code frame, and the innermost submodule
    of the model that was running (``modules`` maps ids to qualified names)."""
    chain: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and cur not in chain:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    for exc in reversed(chain):
        where, culprit = "", None
        tb: TracebackType | None = exc.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and modules.get(id(owner)):
                culprit = f"{modules[id(owner)]} ({type(owner).__name__})"
            if _is_user_file(frame.f_code.co_filename):
                fs = traceback.FrameSummary(frame.f_code.co_filename, tb.tb_lineno, frame.f_code.co_name)
                path = os.path.relpath(fs.filename)
                path = fs.filename if path.startswith("..") else path
                where = f"{path}:{fs.lineno} in {fs.name}: {(fs.line or '').strip()}"
            tb = tb.tb_next
        if where:
            return where, culprit
    return "", None


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    line = text[0] if text else ""
    return f"{type(e).__name__}: {line[:300]}"


def failure_message(model: nn.Module, errors: dict[str, BaseException], tracer: str) -> str:
    modules = {id(m): name for name, m in model.named_modules() if name}
    lines = [f"could not capture {type(model).__name__} as a graph:"]
    culprits = set()
    for who, e in errors.items():
        where, culprit = _user_frame(e, modules)
        if isinstance(e, GraphMismatch):
            lines.append(f"  {who}'s graph differs from the model on the example inputs: {e}")
            lines.append(
                "      (torch.fx runs forward() on Proxy objects, which answer a Python check "
                "of a value as no tensor would: hasattr() is always true, isinstance(x, "
                "torch.Tensor) false)"
            )
        else:
            lines.append(f"  {who} failed: {first_line(e)}")
        if where:
            lines.append(f"      at {where}")
        if culprit:
            lines.append(f"      inside module {culprit}")
            culprits.add(culprit.rpartition(" (")[2].rstrip(")"))
    lines.append("ways out:")
    differs = tracer == "fx" and isinstance(errors.get("torch.fx"), GraphMismatch)
    if differs:
        lines.append(
            "  - Config(tracer='export'): non-strict torch.export runs the model's code on real "
            "tensors (\"auto\" checks torch.fx's graph and uses torch.export when it differs)"
        )
    for e in errors.values():
        found = re.search(r"Found <class '([\w.]+)'> in output", str(e))
        if found:
            kind = found.group(1).rpartition(".")[2]
            lines.append(
                f"  - the model returns a {kind}, which is not made of tensors: for training, "
                "turn it off (transformers: use_cache=False in the config or the call), or "
                "register it with torch.utils._pytree.register_pytree_node"
            )
    if not all(isinstance(e, GraphMismatch) for e in errors.values()):
        lines.append(
            "  - a Python `if`/`for` on tensor values cannot become a graph: use torch.where(...) "
            "or torch.cond(pred, true_fn, false_fn, (x,)) so the graph holds both branches"
        )
    names = tuple(sorted(culprits)) or ("ClassName",)
    lines.append(
        f"  - keep the failing module whole as one node run eagerly: "
        f"Config(leaf_modules={names!r})"
    )
    lines.append(
        "  - where the failing code is the loss: take it out of the model and pass it as "
        "rannc_fx.compile(model, optimizer, loss_fn=...), called as model(x, target=y); it "
        "runs eagerly on the last stage"
    )
    if tracer != "auto" and not differs:
        other = "export" if tracer == "fx" else "fx"
        lines.append(f"  - try the other tracer: Config(tracer={other!r}) (or \"auto\" for both)")
    return "\n".join(lines)
