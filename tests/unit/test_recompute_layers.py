"""Recomputation layer by layer (``runtime/recompute.py``) in one process: the segments
compute the stage and hold less while its backward runs, checkpoints that are not the stage's
nodes are refused, and so is a schedule that splits the backward. Training on ranks:
``distributed/test_recompute_layers.py``."""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest
import torch
from torch import fx, nn

import rannc_fx
from examples.models import gpt_example
from rannc_fx.partition import Partitioned
from rannc_fx.plan.plan import Plan
from rannc_fx.runtime.recompute import build_segmented, check_reruns_unsplit, segment_of
from tests.gpt_training import (
    GLOBAL,
    LiveBytes,
    gpt,
)
from tests.harness import test_config


def _layer(n: fx.Node) -> str | None:
    """The ``layers.<i>`` (or ``blocks.<i>``) a node belongs to, from its module stack."""
    stack = n.meta.get("nn_module_stack")
    if not stack:
        return None
    found = re.search(r"(?:layers|blocks)\.\d+", str(list(stack.values())[-1][0]))
    return found.group(0) if found else None


def _layer_starts(gm: fx.GraphModule, placed: set[str]) -> tuple[str, ...]:
    """The stage's nodes that start a layer, but its first node (that starts segment 0)."""
    calls = [n for n in gm.graph.nodes
             if n.op in ("call_function", "call_method", "call_module") and n.name in placed]
    starts, last = [], None
    for n in calls:
        layer = _layer(n)
        if layer is not None and layer != last and n is not calls[0]:
            starts.append(n.name)
        last = layer if layer is not None else last
    return tuple(starts)


def _with_checkpoints(parted: Partitioned) -> Plan:
    plan = parted.plan
    stages = []
    for st, gm in zip(plan.stages, parted.stages, strict=True):
        placed = {n for b in plan.iter_stage_blocks(st.index) for n in b.nodes}
        stages.append(st.model_copy(update={"checkpoints": _layer_starts(gm, placed)}))
    return plan.model_copy(update={"stages": tuple(stages)})


@functools.cache
def _gpt_plan(schedule: str, dropout: float = 0.0) -> Plan:
    """2 stages on 2 ranks, both recomputing layer by layer (checkpoints: ``_layer_starts``)."""
    model, args, kwargs = gpt(dropout)
    cfg = test_config(recompute=True,
                      recompute_selective=False, replicas=(1, 1),
                      micro_batches=2, schedule=schedule)
    parted = rannc_fx.partition(model, args, kwargs, world_size=2, device="cpu", config=cfg)
    return _with_checkpoints(parted)


def _without_recompute(plan: Plan, *, whole: bool = False) -> Plan:
    """``plan`` without recomputation, or (``whole``) recomputing each stage whole."""
    return plan.model_copy(update={"stages": tuple(
        st.model_copy(update={"recompute": whole, "checkpoints": ()}) for st in plan.stages)})


@functools.cache
def _deep_stage() -> tuple[Plan, fx.GraphModule, tuple[str, ...], dict[str, Any]]:
    """The last stage of a 6-layer GPT with dropout cut in 2: 3 layers and the head, with the
    sizes and masks the split pass rebuilt inside it."""
    torch.manual_seed(0)
    model, args, kwargs = gpt_example(batch=GLOBAL, layers=6, dropout=0.1)
    cfg = test_config(recompute=True,
                      recompute_selective=False, replicas=(1, 1),
                      micro_batches=2, schedule="1f1b")
    parted = rannc_fx.partition(model, args, kwargs, world_size=2, device="cpu", config=cfg)
    plan = _with_checkpoints(parted)
    return plan, parted.stages[1], plan.stages[1].checkpoints, kwargs


def _run(module: nn.Module, inputs: list[Any], params: list[torch.Tensor]
         ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, int, int]:
    """Outputs, parameter and input gradients, the live bytes the forward left and their peak
    while the backward ran, with the random state of seed 5."""
    x = next(t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad)
    for p in [*params, x]:
        p.grad = None
    torch.manual_seed(5)
    live = LiveBytes()
    with live:
        out = module(*inputs)
        kept, live.peak = live.now, 0
        out[0].backward()
    return out[0].detach(), [p.grad.clone() for p in params], x.grad.clone(), kept, live.peak


def test_segments_compute_the_stage_and_hold_less_during_the_backward():
    plan, gm, checkpoints, kwargs = _deep_stage()
    st = plan.stages[1]
    placed = {n for b in plan.iter_stage_blocks(1) for n in b.nodes}
    assert len(checkpoints) == 2  # layers 3 | 4 | 5 and the head: 3 segments
    segmented = build_segmented(gm, checkpoints, placed=placed)

    # the structure: segment k holds the placed nodes from checkpoint k-1 to checkpoint k; a
    # node the split pass rebuilt (not placed) goes to the first segment that reads it
    of = segment_of(gm, checkpoints, placed=placed)
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    k = 0
    for n in calls:
        if n.name in placed:
            k += n.name in checkpoints
            assert of[n] == k, n.name
    rebuilt = [n for n in calls if n.name not in placed]
    assert rebuilt, "the stage should read sizes rebuilt by the split pass"
    for n in rebuilt:
        assert of[n] == min(of[u] for u in n.users if u.op != "output"), n.name
    segments = [m for name, m in segmented.named_children() if name.startswith("segment_")]
    assert [m.checkpointed for m in segments] == [True, True, False]
    for i, m in enumerate(segments):
        assert {n.name for n in m.module.graph.nodes if n.op in ("call_function", "call_method")} \
            == {n.name for n in calls if of[n] == i}
    # the stage's own parameter objects, read inside the segments, none taken as an input
    assert {id(p) for p in segmented.parameters()} <= {id(p) for p in gm.parameters()}
    assert all(not n.name.startswith("encoder_") for n in segmented.graph.nodes
               if n.op == "placeholder")

    inputs: list[Any] = [kwargs["labels"][:3] if name == "labels" else
                         torch.randn(3, 32, 64, generator=torch.Generator().manual_seed(1),
                                     requires_grad=True) for name in st.inputs]
    params = list(gm.parameters())
    out, grads, grad_in, kept, peak = _run(gm, inputs, params)
    out2, grads2, grad_in2, kept2, peak2 = _run(segmented, inputs, params)
    assert torch.equal(out, out2)  # the same kernels on the same random state: bitwise
    assert torch.equal(grad_in, grad_in2)
    for a, b in zip(grads, grads2, strict=True):
        assert torch.equal(a, b)
    # what R leaves for the backward, and the most the backward holds at once (measured:
    # 3.1 MB and 3.3 MB for the whole stage, 1.7 MB and 2.2 MB as segments)
    assert kept2 < 0.6 * kept, (kept2, kept)
    assert peak2 < 0.75 * peak, (peak2, peak)


def test_checkpoints_that_are_not_the_stage_s_nodes_are_refused():
    _, gm, checkpoints, _ = _deep_stage()
    with pytest.raises(ValueError, match=r"stage 1's checkpoints .* must name distinct nodes "
                                         r"of stage 1: \['no_such_node'\]"):
        segment_of(gm, (*checkpoints, "no_such_node"), name="stage 1")
    with pytest.raises(ValueError, match="one is named twice"):
        segment_of(gm, (*checkpoints, checkpoints[0]))
    with pytest.raises(ValueError, match="are not in its graph's order"):
        segment_of(gm, tuple(reversed(checkpoints)))


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        mask = torch.ones_like(h).tril()  # as the split pass rebuilds a mask: not placed
        return self.b(h * mask).sum()


def test_a_rebuilt_value_goes_to_the_first_segment_that_reads_it():
    gm = fx.symbolic_trace(_Masked())
    names = [n.name for n in gm.graph.nodes]
    assert names == ["x", "a", "tanh", "ones_like", "tril", "mul", "b", "sum_1", "output"]
    placed = {"a", "tanh", "mul", "b", "sum_1"}
    of = {n.name: k for n, k in segment_of(gm, ("mul",), placed=placed).items()}
    # by position the mask would be made in segment 0 and kept as an input of segment 1
    assert of == {"a": 0, "tanh": 0, "ones_like": 1, "tril": 1, "mul": 1, "b": 1, "sum_1": 1}
    segmented = build_segmented(gm, ("mul",), placed=placed)
    assert segmented.segment_0.checkpointed and not segmented.segment_1.checkpointed
    x = torch.randn(3, 4, requires_grad=True)
    assert torch.equal(segmented(x), gm(x))
    kept = [n.name for n in segmented.segment_1.module.graph.nodes if n.op == "placeholder"]
    assert kept == ["tanh"]


def _zbh1(plan: Plan) -> Plan:
    return plan.model_copy(update={"schedule": "zbh1"})


def test_a_split_backward_of_a_layered_stage_is_refused():
    layered = _gpt_plan("1f1b")
    check_reruns_unsplit(layered)  # 1F1B: fine
    # recomputed whole: fine
    check_reruns_unsplit(_zbh1(_without_recompute(layered, whole=True)))
    with pytest.raises(ValueError, match=r"stage 0 recomputes layer by layer .* schedule 'zbh1' "
                                         r"splits its backward into B and W"):
        check_reruns_unsplit(_zbh1(layered))
