"""``model.train()`` and ``model.eval()``: a graph per mode, the second one captured when first run.

Both tracers bake what the forward did in the mode it was captured in: torch.export a
dropout's and a batch norm's training flag, either tracer a Python branch on
``self.training`` (stochastic depth, an attention's dropout probability). So the compiled
model keeps one graph per mode. The planned one is the model as it was at the first call (its
modules in the modes the user had set); the other mode's is captured the first time a call
runs in it, from a copy of the model whose tensors are all on the meta device (taken at the
first call, before the model's other stages were freed: it holds no data), with every module
in that mode. ``split/restage.py`` puts it on the plan's stages; its parameters and buffers
are then this rank's own (the running statistics eval reads are the ones training updates),
its constants the copy's. ``CompiledModel.train(mode)`` only picks the graph: it does not
touch the modes the graphs were captured in.

Every rank holds rank 0's example and the same model, so one capture serves them all: where
there are several ranks (and each took rank 0's example, ``planned.same_example``), rank 0
alone captures the other mode's graph, infers its values' specs and dtypes and restages the
plan, and sends them with the graph (``planned.broadcast_planning``), which the others bind to
their own copy (``capture/portable``), as at the first call. A mode's first call is collective
already (every call's agreement, ``runtime/agreement``, checks that every rank runs in the
same mode). Where the graph cannot travel each rank captures it, with rank 0's specs; the
executors then check that the ranks agree (``check_same_plan``).
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from ..capture.capture import CapturedGraph, retarget_device_pass
from ..capture.portable import NotPortable, unpack
from ..plan.config import Config
from ..plan.plan import Plan
from ..planner import Captured, capture_model, shape_model, split_stages, trace_model
from ..profile.fakes import fake_device
from ..progress import note
from ..runtime.lane import LaneModules, graph_modules
from ..split.restage import restage
from .amp import AmpSpecs, autocast_as
from .planned import Planning, broadcast_planning, packed

__all__ = ["ModeGraph", "Modes"]

Retype = Callable[[Plan, str | None], Plan]


@dataclass
class ModeGraph:
    """One mode's graph: what a call in that mode runs on this rank."""

    training: bool
    captured: CapturedGraph
    plan: Plan
    module: fx.GraphModule | LaneModules
    retype: Retype


class Modes:
    """The graph of each mode, the planned one given, the other made at its first call."""

    def __init__(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                 config: Config, device: torch.device, rank: int, amp_type: str,
                 planned_amp: str | None, home: torch.device, world: int = 1,
                 alike: bool = True) -> None:
        """``args``/``kwargs``: the first call's example (rank 0's, where ``alike``: every
        rank holds it, and rank 0 captures the other mode for all ``world`` ranks)."""
        self.config, self.device, self.rank = config, device, rank
        self.shared = world > 1 and alike  # rank 0 captures, the others receive
        self.world = world
        self.amp_type, self.planned_amp, self.home = amp_type, planned_amp, home
        self.planned_mode = model.training
        self._made: dict[bool, ModeGraph] = {}
        self._example = pytree.tree_map_only(
            torch.Tensor, lambda t: torch.empty_like(t, device="meta"), (tuple(args), kwargs))
        self._copy: nn.Module | None = None
        self._why_not = ""
        try:
            self._copy = _meta_copy(model)
        except Exception as e:  # deepcopy of an exotic module: the other mode cannot be made
            self._why_not = f"the model could not be copied ({type(e).__name__}: {e})"

    def planned(self, captured: CapturedGraph, plan: Plan, module: fx.GraphModule | LaneModules,
                retype: Retype) -> ModeGraph:
        """The planned graph: the mode the model was in at the first call."""
        made = self._made[self.planned_mode] = ModeGraph(
            self.planned_mode, captured, plan, module, retype)
        for gm in graph_modules(module):
            gm.training = self.planned_mode  # the stage's own flag, read by the executor
        return made

    def of(self, training: bool) -> ModeGraph:
        """The graph a call in this mode runs (made now if this is the mode's first call)."""
        found = self._made.get(training)
        if found is None:
            found = self._made[training] = self._make(training)
            self._copy = None  # both modes are made: the copy's work is done
        return found

    def _make(self, training: bool) -> ModeGraph:
        mode = "training" if training else "eval"
        base = self._made[self.planned_mode]
        if self._copy is None:
            raise RuntimeError(
                f"this call runs in {mode} mode, but the model was compiled in "
                f"{'training' if self.planned_mode else 'eval'} mode and its {mode} graph "
                f"cannot be captured: {self._why_not}; call the model in the mode it was "
                "compiled in"
            )
        copy_ = self._copy.train(training)
        cfg = self.config.model_copy(update={"tracer": base.captured.tracer})
        if not self.shared:
            other, plan, amp = self._found(copy_, cfg, base, mode)
        elif self.rank == 0:
            try:
                other, plan, amp = self._found(copy_, cfg, base, mode)
                found = Planning(plan, other.values, other.graph.tail, amp,
                                 packed(other.graph, copy_), "meta")
            except Exception as e:  # the others raise it too
                broadcast_planning(e, self.rank, self.world, what=f"capture the {mode} graph")
                raise
            broadcast_planning(found, self.rank, self.world)
        else:
            found = broadcast_planning(None, self.rank, self.world,
                                       what=f"capture the {mode} graph")
            other, plan, amp = self._received(found, copy_, cfg, base)
        retype = amp.retype if amp is not None else base.retype
        own = frozenset(n for n, _ in (*copy_.named_parameters(remove_duplicate=False),
                                        *copy_.named_buffers(remove_duplicate=False)))
        _take_state(other.graph, base.captured, own)
        stages = split_stages(other.graph, other.values, plan, debug=cfg.debug)
        mine = [st.index for st in plan.stages_of_rank(self.rank)]
        module: fx.GraphModule | LaneModules = (
            stages[mine[0]] if len(mine) == 1 else LaneModules({s: stages[s] for s in mine}))
        for gm in graph_modules(module):
            _adopt(gm, base.module, own, mode, self.device)
            retarget_device_pass(gm, self.device)  # captured on the meta device
            gm.training = training
        note("captured the model's %s graph (%d nodes) for the plan's stages", mode,
             other.graph.num_nodes)
        return ModeGraph(training, other.graph, plan, module, retype)

    def _found(self, copy_: nn.Module, cfg: Config, base: ModeGraph,
               mode: str) -> tuple[Captured, Plan, AmpSpecs | None]:
        """The other mode's graph with its values' specs, the plan on it and (for a model
        not built on the meta device) its dtypes under the other autocast states, found here."""
        args, kwargs = self._example
        # capture runs the model's code: the user's random stream must not move
        with torch.random.fork_rng(devices=[]), autocast_as(self.amp_type, self.planned_amp):
            other = capture_model(copy_, args, kwargs, cfg, opaque=base.captured.opaque,
                                  pieces=base.captured.pieces,
                                  device=fake_device(self.device.type))
        plan = restage(base.plan, base.captured, other, mode=mode)
        amp = None
        if self.home.type != "meta":  # the other autocast states' dtypes, as the planned's
            amp = AmpSpecs.of(other.graph, other.inputs, plan, device_type=self.amp_type,
                              planned=self.planned_amp, batch_dim=cfg.batch_dim)
        return other, plan, amp

    def _received(self, found: Planning, copy_: nn.Module, cfg: Config,
                  base: ModeGraph) -> tuple[Captured, Plan, AmpSpecs | None]:
        """What rank 0 found, on this rank's copy: its graph bound to the copy's tensors, or
        where it could not travel the graph captured here, with rank 0's specs and tail."""
        args, kwargs = self._example
        if found.graph is not None:
            try:
                graph = unpack(found.graph, copy_)  # both copies on the meta device
            except NotPortable as e:
                note("rank 0's graph does not fit this rank's copy (%s): capturing it here", e)
            else:
                return Captured(graph, graph.flatten_inputs(args, kwargs), found.values), \
                    found.plan, found.amp
        with torch.random.fork_rng(devices=[]), autocast_as(self.amp_type, self.planned_amp):
            traced = trace_model(copy_, args, kwargs, cfg, opaque=base.captured.opaque,
                                 pieces=base.captured.pieces)
        other = shape_model(traced, cfg, given=(found.values, found.tail))
        return other, found.plan, found.amp


def _meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are on the meta device (tied
    ones stay tied); plain tensor attributes (constants) are copied as they are."""
    memo: dict[int, Any] = {}
    for _, t in (*model.named_parameters(remove_duplicate=False),
                 *model.named_buffers(remove_duplicate=False)):
        if id(t) in memo:
            continue
        data = torch.empty_like(t, device="meta")
        memo[id(t)] = (nn.Parameter(data, requires_grad=t.requires_grad)
                       if isinstance(t, nn.Parameter) else data)
    return copy.deepcopy(model, memo)


def _state_tables(gm: nn.Module) -> dict[str, tuple[dict[str, Any], str]]:
    """Qualified name -> (the owner's parameter or buffer table, key) for all of ``gm``'s."""
    out: dict[str, tuple[dict[str, Any], str]] = {}
    for mname, mod in gm.named_modules(remove_duplicate=False):
        for table in (mod._parameters, mod._buffers):
            for k, v in table.items():
                if v is not None:
                    out[f"{mname}.{k}" if mname else k] = (table, k)
    return out


def _take_state(other: CapturedGraph, planned: CapturedGraph, own: frozenset[str]) -> None:
    """Point ``other``'s parameters and buffers (the model's own, by name: not the constants
    torch.export lifts into buffers) at the planned graph's objects of the same names: this
    rank's placed tensors for its stage, freed ones for the others."""
    mine: dict[str, torch.Tensor] = {
        **dict(planned.gm.named_parameters(remove_duplicate=False)),
        **dict(planned.gm.named_buffers(remove_duplicate=False)),
    }
    for name, (table, key) in _state_tables(other.gm).items():
        found = mine.get(name, mine.get(planned.aliases.get(name, name)))
        if name in own and found is not None:
            table[key] = found


def _adopt(gm: fx.GraphModule, planned: nn.Module, own: frozenset[str], mode: str,
           device: torch.device) -> None:
    """Check that the other mode's stage reads only model state the planned stage holds (the
    rank has no other's data), and put its constants (tensor attributes and lifted buffers
    that are not the model's state: the copy's values) on ``device``."""
    held = {id(t) for t in (*planned.parameters(), *planned.buffers())}
    places: dict[str, tuple[Any, str]] = {
        name: (table, key) for name, (table, key) in _state_tables(gm).items()}
    for n in gm.graph.nodes:
        if n.op == "get_attr" and str(n.target) not in places:
            *path, leaf = str(n.target).split(".")
            places[str(n.target)] = (operator.attrgetter(".".join(path))(gm) if path else gm,
                                     leaf)
    for name, (where, key) in places.items():
        value = where[key] if isinstance(where, dict) else getattr(where, key)
        if not isinstance(value, torch.Tensor):
            continue
        if name in own:
            if id(value) not in held:
                raise ValueError(
                    f"in {mode} mode this rank's stage reads {name!r}, which the planned "
                    "graph's stage does not read, so this rank does not hold it; compile the "
                    f"model in {mode} mode, or read it in both modes"
                )
            continue
        if value.device.type == "meta":
            raise ValueError(
                f"the {mode} graph's constant {name!r} is on the meta device (the model was "
                "built there), so its values are unknown; build the model on the CPU, or make "
                "the constant a buffer"
            )
        if value.device != device:
            moved = value.to(device)
            if isinstance(where, dict):
                where[key] = moved
            else:
                setattr(where, key, moved)
