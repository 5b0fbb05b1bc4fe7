"""Lower a compute schedule to the actions a rank runs: recomputation, messages, once-a-step work.

``lower(schedule, topology)`` turns each stage's compute list into the list its replicas
interpret, by fixed rules that hold for any schedule (none is written per schedule):

- every list starts with ``SCATTER`` (the local batch's pieces to where they are read) and
  ends with ``REDUCE`` (the gradient all-reduces);
- a forward is preceded by ``RECV_F`` of its micro-batch where the stage reads cut values and
  followed by ``SEND_F`` where it produces some; a backward is preceded by ``RECV_B`` where its
  outputs' gradients come back and followed by ``SEND_B`` where its inputs' gradients leave;
- a stage that recomputes runs ``R`` right before each ``B`` of the same micro-batch;
- a ``W`` (a micro-batch's weight gradients, after its ``B``) sends and receives nothing;
- ``GATHER`` (model outputs home, the loss to every rank) follows the last forward when on
  every stage every backward comes after every forward (fill-drain: the call can return there
  and leave the backwards to ``loss.backward()``), and otherwise comes after the last backward;
- a receive is posted one compute action early, so its message overlaps that computation, but
  never across a once-a-step action: messages between two ranks match in the order both post
  them, and every rank posts the once-a-step messages at the same point.

GPipe, 2 stages, 2 micro-batches, stage 1 recomputing (``format_lowered``)::

    st 0  SCATTER F0 SEND_F0 F1 SEND_F1 GATHER RECV_B1 RECV_B0 B1 B0 REDUCE
    st 1  SCATTER RECV_F0 RECV_F1 F0 F1 GATHER R1 B1 SEND_B1 R0 B0 SEND_B0 REDUCE

``Topology`` is what lowering and the simulator need to know of a plan: who sends cut values
(and their gradients) to whom, which stages recompute, own model outputs and share parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..plan import Plan
from .routing import needs_grad
from .schedule import Action, Kind, Schedule, make_schedule

__all__ = ["Topology", "format_lowered", "lower", "lower_plan", "split_at_gather", "topology_of"]


@dataclass(frozen=True)
class Topology:
    """The stage graph as lowering and simulation see it.

    ``sends_to[s]``: stages that read a cut value of s (its forwards' messages go there);
    ``grads_to[s]``: stages whose cut values s reads with a gradient flowing back;
    ``output_stages``: stages that hold model outputs (they send them home at ``GATHER``);
    ``shared``: sets of stages that all-reduce one parameter together at ``REDUCE``.
    """

    num_stages: int
    sends_to: tuple[frozenset[int], ...]
    grads_to: tuple[frozenset[int], ...]
    recompute: tuple[bool, ...]
    output_stages: frozenset[int] = frozenset()
    shared: tuple[frozenset[int], ...] = ()

    @property
    def reads_from(self) -> tuple[frozenset[int], ...]:
        return tuple(
            frozenset(p for p in range(self.num_stages) if s in self.sends_to[p])
            for s in range(self.num_stages)
        )

    @property
    def grads_from(self) -> tuple[frozenset[int], ...]:
        return tuple(
            frozenset(c for c in range(self.num_stages) if s in self.grads_to[c])
            for s in range(self.num_stages)
        )

    @classmethod
    def chain(cls, num_stages: int, recompute: Sequence[bool] | None = None) -> Topology:
        """Stage s sends to s + 1 and gets gradients back; the last stage owns the outputs."""
        n = num_stages
        return cls(
            num_stages=n,
            sends_to=tuple(frozenset({s + 1}) if s + 1 < n else frozenset() for s in range(n)),
            grads_to=tuple(frozenset({s - 1}) if s > 0 else frozenset() for s in range(n)),
            recompute=tuple(recompute) if recompute is not None else (False,) * n,
            output_stages=frozenset({n - 1}),
        )


def topology_of(plan: Plan) -> Topology:
    n = len(plan.stages)
    sends: list[set[int]] = [set() for _ in range(n)]
    grads: list[set[int]] = [set() for _ in range(n)]
    for cv in plan.cut_values:
        if cv.spec.kind != "tensor":
            continue  # integers are recomputed by each consumer: nothing moves
        sends[cv.producer].update(cv.consumers)
        if needs_grad(cv.spec):
            for c in cv.consumers:
                grads[c].add(cv.producer)
    return Topology(
        num_stages=n,
        sends_to=tuple(frozenset(x) for x in sends),
        grads_to=tuple(frozenset(x) for x in grads),
        recompute=tuple(st.recompute for st in plan.stages),
        output_stages=frozenset(r.stage for r in plan.outputs if r.spec.kind == "tensor"),
        shared=tuple(frozenset(sp.stages) for sp in plan.shared_params),
    )


def lower(schedule: Schedule, topology: Topology) -> Schedule:
    """Every stage's full action list (see the module docstring for the rules)."""
    if len(schedule) != topology.num_stages:
        raise ValueError(
            f"the schedule has {len(schedule)} stages but the topology {topology.num_stages}"
        )
    reads, grads_from = topology.reads_from, topology.grads_from
    for s, compute in enumerate(schedule):
        if any(a.stage != s or not a.kind.is_compute for a in compute):
            raise ValueError(f"stage {s}'s list must hold only its own F, B and W actions")
    # one decision for all stages: every rank posts GATHER's messages at the same point
    fill_drain = all(_fill_drain(compute) for compute in schedule)
    out: Schedule = []
    for s, compute in enumerate(schedule):
        kinds = [a.kind for a in compute]
        last_f = max((p for p, k in enumerate(kinds) if k is Kind.F), default=-1)
        acts = [Action(s, Kind.SCATTER)]
        for p, a in enumerate(compute):
            i = a.microbatch
            if a.kind is Kind.F:
                if reads[s]:
                    acts.append(Action(s, Kind.RECV_F, i))
                acts.append(a)
                if topology.sends_to[s]:
                    acts.append(Action(s, Kind.SEND_F, i))
                if p == last_f and fill_drain:
                    acts.append(Action(s, Kind.GATHER))
            elif a.kind is Kind.W:
                acts.append(a)  # no messages: nobody waits for a stage's weight gradients
            else:
                if grads_from[s]:
                    acts.append(Action(s, Kind.RECV_B, i))
                if topology.recompute[s]:
                    acts.append(Action(s, Kind.R, i))
                acts.append(a)
                if topology.grads_to[s]:
                    acts.append(Action(s, Kind.SEND_B, i))
        if not fill_drain:
            acts.append(Action(s, Kind.GATHER))
        acts.append(Action(s, Kind.REDUCE))
        out.append(_hoist_receives(acts))
    return out


def lower_plan(plan: Plan, schedule: str | None = None) -> tuple[Topology, Schedule]:
    """The plan's topology and its schedule (or the named one) lowered."""
    topology = topology_of(plan)
    compute = make_schedule(schedule or plan.schedule, len(plan.stages), plan.micro_batches)
    return topology, lower(compute, topology)


def _fill_drain(compute: Sequence[Action]) -> bool:
    """Every backward comes after every forward."""
    kinds = [a.kind for a in compute]
    return Kind.F not in kinds[kinds.index(Kind.B):] if Kind.B in kinds else True


def _hoist_receives(acts: list[Action]) -> list[Action]:
    """Move each receive before the compute action ahead of it (with that action's R)."""
    out: list[Action] = []
    for a in acts:
        if a.kind not in (Kind.RECV_F, Kind.RECV_B):
            out.append(a)
            continue
        p = len(out)
        while p > 0 and out[p - 1].kind in (Kind.SEND_F, Kind.SEND_B, Kind.RECV_F, Kind.RECV_B):
            p -= 1
        if p > 0 and out[p - 1].kind in (Kind.F, Kind.B, Kind.W):
            p -= 1
            if out[p].kind is Kind.B and p > 0 and out[p - 1].kind is Kind.R:
                p -= 1
        out.insert(p, a)
    return out


def split_at_gather(actions: Sequence[Action]) -> tuple[list[Action], list[Action]]:
    """(up to and including GATHER, the rest): what a call runs and what ``backward`` runs."""
    for p, a in enumerate(actions):
        if a.kind is Kind.GATHER:
            return list(actions[: p + 1]), list(actions[p + 1 :])
    raise ValueError("a lowered schedule has a GATHER action")


def format_lowered(lowered: Schedule, rows: Sequence[tuple[str, int]] | None = None) -> str:
    """One line per row (default one per stage): its actions without the stage number."""
    rows = rows if rows is not None else [(f"st {s}", s) for s in range(len(lowered))]
    label = max(6, *(len(name) + 1 for name, _ in rows))
    return "\n".join(
        name.ljust(label)
        + " ".join(str(a)[len(str(a.stage)) :] for a in lowered[s])
        for name, s in rows
    )
