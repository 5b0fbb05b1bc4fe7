"""Recomputation layer by layer: a recomputing stage's forward cut into checkpointed segments.

A stage that recomputes runs its forward again (``R``) right before its backward (``B``), and
R keeps every activation of the stage for that micro-batch until B has used them: for a deep
stage, the largest thing a rank holds. ``Stage.checkpoints`` names the nodes that start the
stage's segments (its layers, say); ``build_segmented`` makes a module that computes what the
stage computes, segment after segment, each but the last under non-reentrant activation
checkpointing (``torch.utils.checkpoint``):

    R   seg 0 ──▶ seg 1 ──▶ ... ──▶ seg k       keeps each segment's inputs, and seg k's
        ckpt      ckpt              plain       activations
    B   seg k backward; seg k-1 forward again, its backward; seg k-2 forward again, ...

While B runs, a rank holds the segments' inputs and one segment's activations instead of the
whole stage's. The last segment runs plainly: B needs its activations first, so keeping them
from R costs no more memory than recomputing them at once, and saves that forward.

A segment's third forward must compute what R computed: ``preserve_rng_state`` replays the
random state R's segment started from (R itself replays F's: the same dropout masks), and
the recomputation runs inside the stage's ``recompute_scope`` (``buffers.py``), on the buffers
every forward of the step saw, without counting BatchNorm statistics again.

Cutting is ``torch.fx.passes.split_module`` with a callback node -> segment. A node the plan's
blocks name belongs to the segment its position says; a node the split pass added to the
stage (a size or a mask rebuilt there) has no position of its own and goes to the first
segment that reads it. Each segment reads the parameters and buffers it uses itself
(``get_attr`` on the stage's own objects, as the stage does; ``split_module`` would pass
them in as inputs): their gradients land in the stage's ``.grad``, and a checkpoint saves
activations only.

A backward split into ``B`` and ``W`` (``backward_split``, under ZB-H1 and ZBV) computes the
right gradients over these segments, but each of its autograd passes recomputes every segment
it reaches: ``B`` once, and ``W`` once per group of parameters (a GPT layer's segment ran its
forward 6 times in a step instead of 2: 4 weight matrices). ``GraphExecGroup``
(``torch.utils.checkpoint``), which shares one recomputation among several backward passes,
refuses passes that read the same saved tensor, as ``B`` and ``W`` do at every weight's
matmul. So ``check_reruns_unsplit`` refuses the combination.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module
from torch.utils.checkpoint import checkpoint

from ..plan.plan import Plan
from ..schedules.actions import Action, Kind
from ..schedules.program import program_of

__all__ = ["Segment", "build_segmented", "check_reruns_unsplit", "keeping_nothing",
           "rng_restored", "rng_state", "segment_of"]

_CALLS = ("call_function", "call_method", "call_module")
# node.meta key of a stage node: the captured node it copies (``split/staged.py``'s
# ``VALUE``); it survives the runtime's rewrites that rename a node (``DeferredBatchNorm``)
_CAPTURED = "rannc_value"


class Segment(nn.Module):
    """One segment of a stage: its GraphModule, run under activation checkpointing unless
    it is the last."""

    def __init__(self, module: fx.GraphModule, *, checkpointed: bool,
                 recompute_scope: Callable[[], AbstractContextManager[Any]]) -> None:
        super().__init__()
        self.module = module
        self.checkpointed = checkpointed
        self._scope = recompute_scope

    def forward(self, *args: Any) -> Any:
        if not self.checkpointed:
            return self.module(*args)
        return checkpoint(self.module, *args, use_reentrant=False, preserve_rng_state=True,
                          context_fn=self._contexts)

    def _contexts(self) -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
        # the first forward runs inside R's scope already; the recomputation in B needs it
        return contextlib.nullcontext(), self._scope()


def check_reruns_unsplit(plan: Plan, lowered: Sequence[Sequence[Action]] | None = None) -> None:
    """Refuse a plan whose schedule splits the backward of a stage that recomputes layer by
    layer or selectively (the module docstring says why: both rerun forwards inside the
    backward); ``lowered``: its lanes' lists, if lowered already."""
    inside = {st.index: st for st in plan.stages if st.checkpoints or st.selective}
    if not inside:
        return
    lanes = lowered if lowered is not None else program_of(plan).lowered
    split = sorted({a.stage for lane in lanes for a in lane
                    if a.kind is Kind.W and a.stage in inside})
    if split and inside[split[0]].selective:
        raise ValueError(
            f"stage {split[0]} recomputes selectively but schedule {plan.schedule!r} splits "
            "its backward into B and W, and each of those autograd passes would rerun the "
            "forward it did not keep (W once per weight); plan with schedule '1f1b' or "
            "'gpipe', or Config(recompute_selective=False)")
    if split:
        st = inside[split[0]]
        raise ValueError(
            f"stage {st.index} recomputes layer by layer (checkpoints "
            f"{list(st.checkpoints)[:3]}{' ...' if len(st.checkpoints) > 3 else ''}) but "
            f"schedule {plan.schedule!r} splits its backward into B and W, and each of those "
            "autograd passes would recompute every segment again (W once per weight); plan "
            "with schedule '1f1b' or 'gpipe', or recompute that stage whole "
            "(Config(recompute_layers=False))"
        )


def segment_of(gm: fx.GraphModule, checkpoints: Sequence[str], *,
               placed: Collection[str] | None = None, name: str = "the stage",
               ) -> dict[fx.Node, int]:
    """Every call node of ``gm`` -> its segment (0, 1, ... with none empty).

    ``checkpoints`` name the nodes (in graph order) that start a segment; ``placed`` are the
    names the plan's blocks hold (None: every node's), the others (rebuilt sizes and masks)
    go to the first segment that reads them. ``name`` is ``gm`` in error messages."""
    calls = [n for n in gm.graph.nodes if n.op in _CALLS]
    starts = {c: k for k, c in enumerate(checkpoints)}
    seen = [starts[_captured(n)] for n in calls if _captured(n) in starts]
    missing = sorted(set(checkpoints) - {_captured(n) for n in calls})
    if missing or len(starts) != len(checkpoints):
        raise ValueError(f"{name}'s checkpoints {list(checkpoints)} must name distinct nodes of "
                         f"{name}: {missing or 'one is named twice'}; the plan was made for "
                         "another graph, make it again")
    if seen != sorted(seen):
        raise ValueError(f"{name}'s checkpoints {list(checkpoints)} are not in its graph's order "
                         f"({[checkpoints[k] for k in seen]})")
    by_position: dict[fx.Node, int] = {}
    k = 0  # segment 0: the nodes before the first checkpoint
    for n in calls:
        if _captured(n) in starts:
            k = starts[_captured(n)] + 1
        by_position[n] = k
    out: dict[fx.Node, int] = {}
    for n in reversed(calls):  # readers first
        readers = [out[u] for u in n.users if u in out]
        own = placed is None or _captured(n) in placed
        # never before its position: a rebuilt value reads only what precedes it
        out[n] = by_position[n] if own or not readers else min(readers)
    number = {s: i for i, s in enumerate(sorted(set(out.values())))}
    return {n: number[s] for n, s in out.items()}


def build_segmented(gm: fx.GraphModule, checkpoints: Sequence[str], *,
                    placed: Collection[str] | None = None,
                    recompute_scope: Callable[[], AbstractContextManager[Any]] | None = None,
                    name: str = "the stage") -> fx.GraphModule:
    """A module whose forward is ``gm``'s, run as segments ``segment_0``, ``segment_1``, ...
    (each a ``Segment``; see the module docstring). ``recompute_scope()`` is entered around
    each segment's recomputation in the backward (default: nothing)."""
    of = segment_of(gm, checkpoints, placed=placed, name=name)
    scope = recompute_scope or contextlib.nullcontext
    qualnames: dict[str, str] = {}
    parts = split_module(gm, gm, of.__getitem__, qualname_map=qualnames,
                         keep_original_order=True, keep_original_node_name=True)
    last = max(of.values(), default=0)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    root: dict[str, Any] = {}
    for n in parts.graph.nodes:
        if n.op != "call_module":
            env[n] = graph.node_copy(n, env.__getitem__)
            continue
        index = int(str(n.target).removeprefix("submod_"))
        sub = parts.get_submodule(str(n.target))
        assert isinstance(sub, fx.GraphModule)
        target = f"segment_{index}"
        root[target] = Segment(_reading_own_state(gm, sub, n.args, qualnames, str(n.target)),
                               checkpointed=index != last, recompute_scope=scope)
        env[n] = graph.call_module(target, tuple(env[a] for a in n.args
                                               if isinstance(a, fx.Node) and a.op != "get_attr"))
    for n in list(graph.nodes):
        if n.op == "get_attr":
            if n.users:  # a parameter the stage returns as it is
                root[str(n.target)] = operator.attrgetter(str(n.target))(gm)
            else:
                graph.erase_node(n)
    graph.lint()
    return fx.GraphModule(root, graph, class_name="segmented")


def _reading_own_state(gm: fx.GraphModule, sub: fx.GraphModule, args: Sequence[Any],
                       qualnames: dict[str, str], prefix: str) -> fx.GraphModule:
    """``sub`` (one of ``split_module``'s partitions, called with ``args``) reading ``gm``'s
    parameters, buffers and modules under their names instead of taking them as inputs."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs = [n for n in sub.graph.nodes if n.op == "placeholder"]
    attrs = {p: a.target for p, a in zip(inputs, args, strict=True)
             if isinstance(a, fx.Node) and a.op == "get_attr"}
    for n in sub.graph.nodes:
        if n in attrs:
            env[n] = g.get_attr(str(attrs[n]))
            continue
        env[n] = g.node_copy(n, env.__getitem__)
        if n.op in ("call_module", "get_attr"):  # split_module renamed "a.b" to "a_b"
            env[n].target = qualnames.get(f"{prefix}.{n.target}", str(n.target))
    g.lint()
    return fx.GraphModule(gm, g, class_name=prefix.replace("submod", "segment"))


def _captured(n: fx.Node) -> str:
    return str(n.meta.get(_CAPTURED, n.name))


# -- a recomputing stage's F and R -------------------------------------------------------------


def keeping_nothing() -> torch.autograd.graph.saved_tensors_hooks:
    """F of a recomputing stage: grad mode on, as in R (the same kernels, so R recomputes
    the very values), but nothing saved: the activations go as they are made."""
    return torch.autograd.graph.saved_tensors_hooks(_drop, _never)


def _drop(t: torch.Tensor) -> None:
    return None


def _never(_: None) -> torch.Tensor:
    raise RuntimeError("a recomputing stage's forward keeps no activations: backward runs on R")


def rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The random state F starts from, for R to replay."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def rng_restored(
    state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device
) -> Iterator[None]:
    """Dropout draws what it drew in F; the random stream afterwards is as if R never ran."""
    cpu, cuda = state
    with torch.random.fork_rng(devices=[device] if cuda is not None else [], enabled=True):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield
