"""Which parameters train, followed call by call: ``requires_grad`` changed after compile.

Fine-tuning recipes unfreeze in stages: ``model.head.requires_grad_(True)`` and
``optimizer.add_param_group(...)`` between two steps. What depends on which parameters
train reads it as the last call saw it: the replicas' all-reduce and a shared parameter's
(``grads``), ZeRO's owners and shards (``zero``, ``grad_shards``), a split backward's ``W``
and the tail's parameters. Each call compares the flags of this rank's parameters with the
last call's (a tuple of booleans: 40 us for 400 parameters); where they changed, the change is
*committed* once the ranks agree, and each executor builds its gradient sums again before
its next step. A newly trainable parameter is then summed over its replicas like any
other, and a newly frozen one no longer is.

Every rank must change alike, and the plan must be able to follow. Each call's agreement
(``agreement``) carries this rank's row from ``row()``, and ``check`` reads every rank's,
so that every rank refuses at once, before any message of the step:

- replicas of a stage, or holders of a shared parameter, whose flags differ (their sums
  would not match: a hang, or replicas that drift apart);
- a parameter frozen at compile that trains now and feeds a stage output the plan sends
  without a gradient (a cut value, a tail input or a loss that nothing before it trained
  when the graph was captured): no backward ever reaches it. Only compiling again can route
  one, so the refusal says so;
- a change while gradients accumulated under ``model.no_sync()`` wait for their sum (the
  closing sum would skip the local sums of a newly frozen parameter).

ZeRO's owners are kept for good (``zero.Owners``): a parameter that starts training goes to
the least loaded replica, and one that stops keeps its owner and its optimizer state.

The optimizer follows too. ``add_param_group`` over the model's parameters gives each rank
the stand-ins (shape [0]) that other stages' parameters became here (``placement``): at the
next call or step every group holds only this rank's stage's parameters, as at compile, and
an object that placement replaced (a reference taken before compile) becomes the placed one.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.utils.weak import WeakIdKeyDictionary

from ..plan.plan import Plan
from ..plan.values import ValueSpec
from .zero import Owners, offloaded_params, shard_of, sharded_params

__all__ = ["Trainable", "feeders", "gradless_outputs"]

_BITS = 62  # shared parameters' flags per integer of the row
_DETACH = {torch.detach, torch.Tensor.detach, torch.ops.aten.detach.default}


class Trainable:
    """This rank's stages' parameters, and which of them train as the last call saw them."""

    def __init__(self, plan: Plan, modules: Mapping[int, nn.Module], *, rank: int = 0,
                 optimizer: torch.optim.Optimizer | None = None,
                 placed: WeakIdKeyDictionary | None = None) -> None:
        """``modules``: rank ``rank``'s stage modules by stage index; ``placed``: the objects
        placement replaced, old -> new."""
        self.plan, self.rank, self.optimizer = plan, rank, optimizer
        self.modules = {s: modules[s] for s in sorted(modules)}
        self.params = list({id(p): p for m in self.modules.values()
                            for p in m.parameters()}.values())
        self._placed = placed if placed is not None else WeakIdKeyDictionary()
        self._compiled = self._seen = self.flags()
        self.version = 0  # commits of a change
        self.owners = Owners(plan.stages[min(self.modules)].replicas)
        self.owners.assign(sharded_params(plan, self.modules))
        self._lanes = _lanes(plan)
        self._now: tuple[bool, ...] | None = None  # the flags this call's row() read
        # the last row made, by the flags and the last committed ones it was made from
        self._row: tuple[tuple[tuple[bool, ...], tuple[bool, ...]], list[int]] | None = None
        self._feeders: dict[int, list[tuple[int, list[tuple[str, nn.Parameter]]]]] | None = None
        self._groups: tuple[int, ...] | None = None
        if optimizer is not None:  # before ZeRO's hooks: they read the groups
            optimizer.register_step_pre_hook(lambda *_: self.own_groups())

    def flags(self) -> tuple[bool, ...]:
        """Whether each parameter requires a gradient now (about 0.1 us a parameter)."""
        return tuple([p.requires_grad for p in self.params])

    # -- the agreement -----------------------------------------------------------------------
    def row(self) -> list[int]:
        """This rank's part of the call's agreement: (fingerprint of the flags, parameters
        that train, changed since the last call, the first parameter the plan cannot train
        as (stage, output position, index in the stage's ``param_names``) or -1s, then the
        shared parameters' flags where held, ``_BITS`` to an integer)."""
        flags = self._now = self.flags()
        key = (flags, self._seen)
        if self._row is not None and self._row[0] == key:
            return self._row[1]
        where = self._unroutable(flags)
        bits = [0] * -(-len(self.plan.shared_params) // _BITS)
        named = {n: p for m in self.modules.values()
                 for n, p in m.named_parameters(remove_duplicate=False)}
        for j, sp in enumerate(self.plan.shared_params):
            if any(n in named and named[n].requires_grad for n in (sp.name, *sp.aliases)):
                bits[j // _BITS] |= 1 << (j % _BITS)
        row = [zlib.crc32(bytes(flags)), sum(flags), int(flags != self._seen), *where, *bits]
        self._row = (key, row)
        return row

    def check(self, rows: Mapping[int, Sequence[int]], *, pending: bool) -> None:
        """Refuse the call from the ranks' ``row()`` (by rank: every rank's after the
        agreement, or this rank's alone without it; see the module docstring); ``pending``:
        gradients of ``no_sync()`` calls wait for their sum."""
        plan = self.plan
        for r, row in rows.items():
            if row[3] != -1:
                raise ValueError(self._cannot_route(r, row[3], row[4], row[5]))
        if pending and any(row[2] for row in rows.values()):
            changed = [r for r, row in rows.items() if row[2]]
            raise ValueError(
                f"requires_grad changed on rank(s) {changed} while gradients accumulated "
                "under model.no_sync() wait for their sum over the ranks; change it after "
                "the call outside no_sync() that sums them (and optimizer.step()), or before "
                "the accumulation starts"
            )
        if len(rows) < plan.world_size:
            return  # the ranks are not compared (Config(check_batches=False))
        for stages, ranks in self._lanes.items():
            if len({(rows[r][0], rows[r][1]) for r in ranks}) > 1:
                shown = ", ".join(f"rank {r}: {rows[r][1]}" for r in ranks)
                raise ValueError(
                    f"the ranks of stage(s) {list(stages)} set requires_grad on its parameters "
                    f"differently (parameters that train: {shown}); their gradients' sum over "
                    "the replicas would not match: change requires_grad alike on every rank "
                    "before the call (the model object compiled holds every parameter on "
                    "every rank)"
                )
        for j, sp in enumerate(plan.shared_params):
            holders = sorted({r for s in sp.stages for r in plan.stages[s].ranks})
            bits = {r: rows[r][6 + j // _BITS] >> (j % _BITS) & 1 for r in holders}
            if len(set(bits.values())) > 1:
                shown = ", ".join(f"rank {r}: {'trains' if b else 'frozen'}"
                                  for r, b in bits.items())
                raise ValueError(
                    f"shared parameter {sp.name!r} (stages {list(sp.stages)}) requires a "
                    f"gradient on some of its holders only ({shown}); set requires_grad on "
                    "it alike on every rank before the call"
                )

    def _cannot_route(self, rank: int, stage: int, pos: int, param: int) -> str:
        st = self.plan.stages[stage]
        name = repr(st.param_names[param]) if param >= 0 else "a parameter"
        return (
            f"{name} of stage {stage} (rank {rank}) requires a gradient now but was frozen "
            f"when the model was compiled, and it feeds the stage's output "
            f"{st.outputs[pos]!r}, which the plan sends without a gradient (nothing in stage "
            f"{stage} or before it trained then): no backward reaches it. Compile the model "
            "again with this parameter trainable (rannc_fx.compile on a fresh model), or "
            "set requires_grad_(False) on it again"
        )

    # -- following a change -------------------------------------------------------------------
    def commit(self) -> bool:
        """Take the flags as they are now (the call was agreed: those its ``row()`` read);
        whether they changed. The optimizer's groups and ZeRO's shards follow at once, the
        executors at their next step (``version``)."""
        flags = self._now if self._now is not None else self.flags()
        self._now = None  # the next call reads them again
        changed = flags != self._seen
        if changed:
            self._seen, self._groups = flags, None
            self.version += 1
        self.own_groups()
        return changed

    def own_groups(self) -> None:
        """Every param group of the optimizer holds only this rank's parameters (an object
        placement replaced becomes the placed one), each group's state likewise, and ZeRO's
        share follows the groups and the flags; nothing to do where neither changed."""
        opt = self.optimizer
        if opt is None:
            return
        seen = tuple(len(g["params"]) for g in opt.param_groups)
        if seen == self._groups:
            return
        keep = {id(p) for p in self.params}
        for group in opt.param_groups:
            ps = [self._placed.get(p, p) for p in group["params"]]
            group["params"] = [p for p in ps if id(p) in keep]
        for p in list(opt.state):
            if id(p) not in keep:
                del opt.state[p]
        self._groups = tuple(len(g["params"]) for g in opt.param_groups)
        shard = shard_of(opt)
        if shard is not None:
            shard.follow(sharded_params(self.plan, self.modules),
                         offloaded_params(self.plan, self.modules))

    # -- what the plan can route ---------------------------------------------------------------
    def _unroutable(self, flags: tuple[bool, ...]) -> list[int]:
        """(stage, output position, parameter index) of the first parameter frozen at compile
        that trains now and feeds an output the plan sends without a gradient; -1s if none."""
        if flags == self._compiled:
            return [-1, -1, -1]
        if self._feeders is None:
            self._feeders = {}
            for s, gm in self.modules.items():
                if isinstance(gm, fx.GraphModule):
                    gradless = gradless_outputs(self.plan, s)
                    self._feeders[s] = sorted(feeders(gm, gradless).items())
        was = {id(p): f for p, f in zip(self.params, self._compiled, strict=True)}
        for s, fed in self._feeders.items():
            for pos, ps in fed:
                for name, p in ps:
                    if p.requires_grad and not was.get(id(p), True):
                        names = self.plan.stages[s].param_names
                        return [s, pos, names.index(name) if name in names else -1]
        return [-1, -1, -1]


def gradless_outputs(plan: Plan, stage: int) -> list[int]:
    """Positions of stage ``stage``'s outputs that the plan moves without a gradient though a
    floating tensor could carry one: cut values and the tail's inputs, and model outputs
    without a batch dimension (losses; batched ones come back detached anyway)."""
    specs: dict[str, ValueSpec] = {cv.name: cv.spec for cv in plan.cut_values}
    if plan.tail is not None:
        specs.update((v.name, v) for v in plan.tail.inputs)
    for ref in plan.outputs:
        if ref.stage == stage and ref.spec.batch_dim is None:
            specs.setdefault(ref.spec.name, ref.spec)
    out = []
    for pos, name in enumerate(plan.stages[stage].outputs):
        spec = specs.get(name)
        dtype = (spec.dtype or "") if spec is not None else ""
        if (spec is not None and spec.kind == "tensor" and not spec.requires_grad
                and dtype.startswith(("float", "bfloat", "complex"))):
            out.append(pos)
    return out


def feeders(gm: fx.GraphModule, positions: Sequence[int]
            ) -> dict[int, list[tuple[str, nn.Parameter]]]:
    """The parameters (by qualified name) that each of ``gm``'s outputs at ``positions``
    depends on, through any node but a detach."""
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    returned = out_node.args[0]
    outs = list(returned) if isinstance(returned, (tuple, list)) else [returned]
    found: dict[int, list[tuple[str, nn.Parameter]]] = {}
    for pos in positions:
        start = outs[pos] if pos < len(outs) else None
        if not isinstance(start, fx.Node):
            continue
        params: dict[int, tuple[str, nn.Parameter]] = {}
        seen = {start}
        todo = [start]
        while todo:
            n = todo.pop()
            if _detaches(n):
                continue
            for name, p in _params_of(gm, n):
                params.setdefault(id(p), (name, p))
            for x in n.all_input_nodes:
                if x not in seen:
                    seen.add(x)
                    todo.append(x)
        if params:
            found[pos] = list(params.values())
    return found


def _detaches(n: fx.Node) -> bool:
    return (n.op == "call_method" and n.target in ("detach", "detach_")) or (
        n.op == "call_function" and n.target in _DETACH)


def _params_of(gm: fx.GraphModule, n: fx.Node) -> list[tuple[str, nn.Parameter]]:
    """The parameters node ``n`` reads itself: a ``get_attr`` of one (or of a module), or
    a ``call_module``'s module's."""
    if n.op not in ("get_attr", "call_module"):
        return []
    target = str(n.target)
    try:
        value: Any = gm.get_submodule(target) if n.op == "call_module" else _attr(gm, target)
    except AttributeError:
        return []
    if isinstance(value, nn.Parameter):
        return [(target, value)]
    if isinstance(value, nn.Module):
        return [(f"{target}.{k}", p) for k, p in value.named_parameters()]
    return []


def _attr(gm: nn.Module, target: str) -> Any:
    *path, last = target.split(".")
    owner = gm.get_submodule(".".join(path)) if path else gm
    return getattr(owner, last)


def _lanes(plan: Plan) -> dict[tuple[int, ...], list[int]]:
    """The ranks that run the same stages (a stage's replicas), by those stages."""
    out: dict[tuple[int, ...], list[int]] = {}
    for r in range(plan.world_size):
        out.setdefault(tuple(st.index for st in plan.stages_of_rank(r)), []).append(r)
    return out
