"""A captured graph sent to another copy of the model (``capture/portable``): what
``compile()``'s other ranks receive from rank 0 instead of capturing the model again."""

from __future__ import annotations

import copy
from collections import defaultdict

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

from rannc_fx.capture import fake_values
from rannc_fx.capture.capture import capture_pass
from rannc_fx.capture.graph import CapturedGraph
from rannc_fx.capture.opaque import OPAQUE, OpaqueCall
from rannc_fx.capture.portable import NotPortable, pack, unpack
from rannc_fx.shapes.infer import Shapes, shapes_pass
from tests.unit.test_capture import CASES, IDS, _Branchy, _BranchyRoot, assert_same, run


def _sent(cg: CapturedGraph, model: nn.Module) -> tuple[CapturedGraph, nn.Module]:
    """``cg`` as another rank receives it, bound to its own copy of ``model``."""
    theirs = copy.deepcopy(model)
    return unpack(pack(cg, model), theirs), theirs


def _assert_same_graph(got: CapturedGraph, cg: CapturedGraph) -> None:
    mine = [(n.op, n.name, str(n.target), n.meta.get(OPAQUE)) for n in cg.gm.graph.nodes]
    theirs = [(n.op, n.name, str(n.target), n.meta.get(OPAQUE)) for n in got.gm.graph.nodes]
    assert theirs == mine
    assert got.gm.code == cg.gm.code
    assert got.fingerprint() == cg.fingerprint()
    for field in ("tracer", "in_spec", "out_spec", "input_names", "tensor_leaf_index",
                  "output_names", "aliases", "output_leaf_index", "constant_outputs",
                  "model_name", "checked", "pieces", "copied_calls"):
        assert getattr(got, field) == getattr(cg, field), field


def _assert_holds_own_state(got: CapturedGraph, model: nn.Module) -> None:
    """Every parameter and buffer of the graph that the model has a name for is ``model``'s
    own object, under that name."""
    own = {**dict(model.named_parameters(remove_duplicate=False)),
           **dict(model.named_buffers(remove_duplicate=False))}
    held = {**dict(got.gm.named_parameters(remove_duplicate=False)),
            **dict(got.gm.named_buffers(remove_duplicate=False))}
    assert set(held) & set(own)
    assert all(t is own[name] for name, t in held.items() if name in own)


@pytest.mark.parametrize(("name", "tracer", "expect"), CASES, ids=IDS)
def test_the_graph_arrives_whole_on_the_receiver_s_own_model(zoo, name, tracer, expect):
    model, args, kwargs, cg = zoo(name, tracer)
    got, theirs = _sent(cg, model)
    assert got.tracer == expect
    _assert_same_graph(got, cg)
    _assert_holds_own_state(got, theirs)
    model.eval()
    theirs.eval()  # the copy computes what the model does, bitwise (no dropout in the way)
    try:
        with torch.no_grad():
            assert_same(run(got, args, kwargs), run(cg, args, kwargs))
    finally:
        model.train()


def _source(shapes: Shapes) -> str | None:
    return shapes.formulas.source if shapes.formulas is not None else None


def _alike(signatures: dict[str, str]) -> list[list[str]]:
    """The nodes grouped by equal signature (symbols are named afresh on arrival)."""
    groups = defaultdict(list)
    for name, sig in signatures.items():
        groups[sig].append(name)
    return sorted(groups.values())


@pytest.mark.parametrize(("name", "tracer", "expect"), CASES, ids=IDS)
def test_the_receiver_s_shapes_are_the_sender_s_from_the_values_that_travel(
        zoo, name, tracer, expect):
    """torch.export's node values travel as formulas: the receiver's shape pass reads them
    as the sender's does (no symbolic run of its own) and finds the same specs, with the same
    nodes alike; a torch.fx graph has none to send, and both run."""
    model, args, kwargs, cg = zoo(name, tracer)
    got, _ = _sent(cg, model)
    assert not any("val" in n.meta for n in got.gm.graph.nodes)  # made where asked for
    assert (got.values is not None) == (expect == "export")
    flat = cg.flatten_inputs(args, kwargs)
    mine, theirs = shapes_pass(cg, flat), shapes_pass(got, flat)
    assert got.values is None
    assert theirs.specs == mine.specs
    assert _source(theirs) == _source(mine)
    assert (_source(theirs) == "torch.export's") == (expect == "export")
    if mine.formulas is not None and theirs.formulas is not None:
        assert _alike(theirs.formulas.signatures) == _alike(mine.formulas.signatures)


def test_a_received_graph_sent_on_carries_the_values_it_received(zoo):
    """A graph sent on before its values were made still carries them."""
    model, args, kwargs, cg = zoo("gpt", "auto")
    got, theirs = _sent(cg, model)
    again, _ = _sent(got, theirs)
    flat = cg.flatten_inputs(args, kwargs)
    assert _source(shapes_pass(again, flat)) == "torch.export's"
    assert shapes_pass(again, flat).specs == shapes_pass(cg, flat).specs


def test_values_that_cannot_be_written_stay_behind_and_the_receiver_runs():
    """A node value that is neither a fake tensor, a SymInt nor plain data: the graph
    travels without values, and the receiver's shape pass runs to the same specs."""
    model, x = _Constant(), torch.randn(4, 2)
    cg = capture_pass(model, (x,), tracer="export")
    flat = cg.flatten_inputs((x,), {})
    mine = shapes_pass(cg, flat)
    first = next(n for n in cg.gm.graph.nodes if n.op == "call_function")
    first.meta["val"] = (first.meta["val"], object())
    got, _ = _sent(cg, model)
    assert got.values is None  # none travelled
    theirs = shapes_pass(got, flat)
    assert theirs.specs == mine.specs
    assert _source(theirs) == "one run" and _source(mine) == "torch.export's"


def test_a_tied_parameter_arrives_as_the_receiver_s_one_object(zoo):
    model, _, _, cg = zoo("gpt2", "auto")
    got, theirs = _sent(cg, model)
    assert theirs.lm_head.weight is theirs.transformer.wte.weight
    held = dict(got.gm.named_parameters(remove_duplicate=False))
    assert held["lm_head.weight"] is held["transformer.wte.weight"] is theirs.lm_head.weight


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_module_kept_whole_runs_the_receiver_s_module(tracer):
    model, x = _Branchy(), torch.randn(4, 4)
    cg = capture_pass(model, (x,), tracer=tracer)  # type: ignore[arg-type]
    got, theirs = _sent(cg, model)
    _assert_same_graph(got, cg)
    flip = got.gm.get_submodule("flip")
    assert isinstance(flip, OpaqueCall) and flip.inner is theirs.flip
    assert flip.calls == cg.gm.get_submodule("flip").calls  # the recorded calls travel
    with torch.no_grad():
        theirs.lin.weight.neg_()  # the receiver's own weights compute, not the sender's
    for sign in (1.0, -1.0):
        assert_same(run(got, (sign * x,), {}), theirs(sign * x))


@pytest.mark.parametrize(("tracer", "says"), [
    ("export", r"holds the tensor 'lin\.bias', which this rank's model lacks"),  # by name
    ("fx", r"differs from rank 0's in the shapes or dtypes"),  # its Linear, called whole
])
def test_another_model_is_refused_with_what_differs(tracer, says):
    model, x = _Branchy(), torch.randn(4, 4)
    cg = capture_pass(model, (x,), tracer=tracer)
    other = _Branchy()
    other.lin = nn.Linear(4, 4, bias=False)
    with pytest.raises(NotPortable, match=says + ".*build the same model on every rank"):
        unpack(pack(cg, model), other)


def test_bytes_that_cannot_be_read_are_not_portable():
    """Whatever unpickling raises (cut-off bytes here, an operator the process lacks) is a
    ``NotPortable``, on which the rank captures the model itself."""
    model, x = _Branchy(), torch.randn(4, 4)
    data = pack(capture_pass(model, (x,), tracer="export"), model)
    with pytest.raises(NotPortable, match="cannot be read here"):
        unpack(data[: len(data) // 2], copy.deepcopy(model))


def test_a_forward_run_in_pieces_stays_where_it_was_captured():
    model, x = _BranchyRoot(), torch.randn(4, 4)
    cg = capture_pass(model, (x,), tracer="export")
    assert cg.pieces is not None
    with pytest.raises(NotPortable, match="runs in pieces"):
        pack(cg, model)


class _Constant(nn.Module):
    """A tensor made in the forward: the graph carries it (export: a lifted constant, fx: a
    tensor attribute of the graph) beside a device the export bakes in."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * torch.tensor([1.0, 2.0]) + torch.ones(2, device=x.device)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_receiver_on_another_device_gets_the_graph_on_its_own(tracer):
    """The devices the graph names and the constants it carries follow the receiver's model
    (rank 1 on cuda:1 receiving rank 0's cuda:0 graph; here the CPU and the meta device),
    the model's own tensors stay where the model has them."""
    model, here = _Constant(), torch.device("meta")
    theirs = copy.deepcopy(model)  # before capture: torch.fx sets its constant on the model
    cg = capture_pass(model, (torch.randn(4, 2),), tracer=tracer)  # type: ignore[arg-type]
    got = unpack(pack(cg, model), theirs, moved=(torch.device("cpu"), here))
    _assert_holds_own_state(got, theirs)
    own = {id(t) for t in theirs.parameters()}
    carried = [t for m in got.gm.modules() for t in (*m._buffers.values(), *vars(m).values())
               if isinstance(t, torch.Tensor) and id(t) not in own]
    named = [a for n in got.gm.graph.nodes for a in (*n.args, *n.kwargs.values())
             if isinstance(a, torch.device)]
    assert len(carried) == 1 and carried[0].device == here
    assert all(d == here for d in named) and (named or tracer == "fx")
    fake_values.made(got)
    values = [t for n in got.gm.graph.nodes for t in pytree.tree_leaves(n.meta.get("val"))
              if isinstance(t, torch.Tensor)]
    assert all(t.device == here for t in values) and (values or tracer == "fx")
    assert all(p.device.type == "cpu" for p in theirs.parameters())
