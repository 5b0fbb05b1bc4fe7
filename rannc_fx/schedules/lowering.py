"""Lower a compute schedule to the actions a rank runs: recomputation, messages, once-a-step work.

``lower(schedule, topology)`` turns each lane's compute list into the list its ranks
interpret, by fixed rules that hold for any schedule (none is written per schedule):

- every list starts with ``SCATTER`` (the local batch's pieces to where they are read) and
  ends with ``REDUCE`` (the gradient all-reduces), once a lane, tagged with its first stage;
- each compute action's messages are its own stage's, wherever the other stage runs (on
  the same lane the runtime copies instead of sending);
- a forward is preceded by ``RECV_F`` of its micro-batch where the stage reads cut values and
  followed by ``SEND_F`` where it produces some; a backward is preceded by ``RECV_B`` where its
  outputs' gradients come back and followed by ``SEND_B`` where its inputs' gradients leave
  (one receive per source stage, ``1RECV_B0<3``, where lanes run several stages);
- a stage that recomputes runs ``R`` right before each ``B`` of the same micro-batch;
- a ``W`` (a micro-batch's weight gradients, after its ``B``) sends and receives nothing;
- ``GATHER`` (model outputs home, the loss to every rank) follows the last forward when on
  every stage every backward comes after every forward (fill-drain: the call can return there
  and leave the backwards to ``loss.backward()``), and otherwise comes after the last backward;
- a receive is posted one compute action early, so its message overlaps that computation, but
  never across a once-a-step action: messages between two ranks match in the order both post
  them, and every rank posts the once-a-step messages at the same point; where a lane's
  stages exchange messages with another lane's in both directions, receives move up to
  follow the order their sender sends.

GPipe, 2 stages, 2 micro-batches, stage 1 recomputing (``format_lowered``)::

    st 0  SCATTER F0 SEND_F0 F1 SEND_F1 GATHER RECV_B1 RECV_B0 B1 B0 REDUCE
    st 1  SCATTER RECV_F0 RECV_F1 F0 F1 GATHER R1 B1 SEND_B1 R0 B0 SEND_B0 REDUCE

``Topology`` is what lowering and the simulator need to know of a plan: who sends cut values
(and their gradients) to whom, which stages recompute, own model outputs and share parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from ..plan.plan import Plan
from ..plan.values import needs_grad
from .generators import Action, Kind, Schedule, format_schedule
from .kinds import make_schedule

__all__ = ["Topology", "format_lowered", "lower", "lower_plan", "plan_grid", "split_at_gather",
           "topology_of"]


@dataclass(frozen=True)
class Topology:
    """The stage graph as lowering and simulation see it.

    ``sends_to[s]``: stages that read a cut value of s (its forwards' messages go there);
    ``grads_to[s]``: stages whose cut values s reads with a gradient flowing back;
    ``output_stages``: stages that hold model outputs (they send them home at ``GATHER``);
    ``shared``: sets of stages that all-reduce one parameter together at ``REDUCE``;
    ``lanes``: the stages each lane runs (default: one stage a lane).
    """

    num_stages: int
    sends_to: tuple[frozenset[int], ...]
    grads_to: tuple[frozenset[int], ...]
    recompute: tuple[bool, ...]
    output_stages: frozenset[int] = frozenset()
    shared: tuple[frozenset[int], ...] = ()
    lanes: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if not self.lanes:
            object.__setattr__(self, "lanes", tuple((s,) for s in range(self.num_stages)))
        if sorted(s for lane in self.lanes for s in lane) != list(range(self.num_stages)):
            raise ValueError(f"lanes {[list(x) for x in self.lanes]} must hold each of the "
                             f"{self.num_stages} stages once")

    @property
    def num_lanes(self) -> int:
        return len(self.lanes)

    @cached_property  # read for every message the lowering and the simulator look at
    def lane_of(self) -> tuple[int, ...]:
        out = [0] * self.num_stages
        for k, lane in enumerate(self.lanes):
            for s in lane:
                out[s] = k
        return tuple(out)

    @cached_property  # read for every message the lowering and the simulator look at
    def reads_from(self) -> tuple[frozenset[int], ...]:
        return tuple(
            frozenset(p for p in range(self.num_stages) if s in self.sends_to[p])
            for s in range(self.num_stages)
        )

    @cached_property  # read for every message the lowering and the simulator look at
    def grads_from(self) -> tuple[frozenset[int], ...]:
        return tuple(
            frozenset(c for c in range(self.num_stages) if s in self.grads_to[c])
            for s in range(self.num_stages)
        )

    @classmethod
    def chain(cls, num_stages: int, recompute: Sequence[bool] | None = None,
              lanes: Sequence[Sequence[int]] = ()) -> Topology:
        """Stage s sends to s + 1 and gets gradients back; the last stage owns the outputs."""
        n = num_stages
        return cls(
            num_stages=n,
            sends_to=tuple(frozenset({s + 1}) if s + 1 < n else frozenset() for s in range(n)),
            grads_to=tuple(frozenset({s - 1}) if s > 0 else frozenset() for s in range(n)),
            recompute=tuple(recompute) if recompute is not None else (False,) * n,
            output_stages=frozenset({n - 1}),
            lanes=tuple(tuple(x) for x in lanes),
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
        lanes=plan.lanes,
    )


Msg = tuple[str, int, int, int | None]  # (what, from stage or lane, to, micro-batch)


def messages_sent(a: Action, topo: Topology) -> list[tuple[int, Msg]]:
    """(destination lane, label) of every message ``a`` posts, in posting order."""
    s, i, lane = a.stage, a.microbatch, topo.lane_of
    if a.kind is Kind.SEND_F:
        return [(lane[c], ("F", s, c, i)) for c in sorted(topo.sends_to[s])]
    if a.kind is Kind.SEND_B:
        return [(lane[p], ("B", s, p, i)) for p in sorted(topo.grads_to[s])]
    here = lane[s]
    if a.kind is Kind.SCATTER:
        return [(d, ("SCATTER", here, d, None)) for d in range(topo.num_lanes) if d != here]
    held = [o for o in topo.lanes[here] if o in topo.output_stages]
    if a.kind is Kind.GATHER and held:
        return [(d, ("GATHER", here, d, None)) for d in range(topo.num_lanes) if d != here]
    return []


def messages_received(a: Action, topo: Topology) -> list[tuple[int, Msg]]:
    """(source lane, label) of every message ``a`` posts a receive for, in posting order."""
    s, i, lane = a.stage, a.microbatch, topo.lane_of
    if a.kind is Kind.RECV_F:
        return [(lane[p], ("F", p, s, i)) for p in sorted(topo.reads_from[s])
                if a.peer in (None, p)]
    if a.kind is Kind.RECV_B:
        return [(lane[c], ("B", c, s, i)) for c in sorted(topo.grads_from[s])
                if a.peer in (None, c)]
    here = lane[s]
    if a.kind is Kind.SCATTER:
        return [(d, ("SCATTER", d, here, None)) for d in range(topo.num_lanes) if d != here]
    if a.kind is Kind.GATHER:
        owners = sorted({lane[o] for o in topo.output_stages} - {here})
        return [(o, ("GATHER", o, here, None)) for o in owners]
    return []


def lower(schedule: Schedule, topology: Topology) -> Schedule:
    """Every lane's full action list (see the module docstring for the rules)."""
    if len(schedule) != topology.num_lanes:
        raise ValueError(
            f"the schedule has {len(schedule)} lanes but the topology {topology.num_lanes}"
        )
    reads, grads_from = topology.reads_from, topology.grads_from
    for k, compute in enumerate(schedule):
        if any(a.stage not in topology.lanes[k] or not a.kind.is_compute for a in compute):
            raise ValueError(f"lane {k}'s list must hold only F, B and W actions of its stages "
                             f"{list(topology.lanes[k])}")
    # one decision for all lanes: every rank posts GATHER's messages at the same point
    fill_drain = all(_fill_drain(compute) for compute in schedule)
    out: Schedule = []
    for k, compute in enumerate(schedule):
        home = topology.lanes[k][0]
        kinds = [a.kind for a in compute]
        last_f = max((p for p, kind in enumerate(kinds) if kind is Kind.F), default=-1)
        acts = [Action(home, Kind.SCATTER)]
        for p, a in enumerate(compute):
            s, i = a.stage, a.microbatch
            if a.kind is Kind.F:
                acts += _receives(Action(s, Kind.RECV_F, i), reads[s], topology)
                acts.append(a)
                if topology.sends_to[s]:
                    acts.append(Action(s, Kind.SEND_F, i))
                if p == last_f and fill_drain:
                    acts.append(Action(home, Kind.GATHER))
            elif a.kind is Kind.W:
                acts.append(a)  # no messages: nobody waits for a stage's weight gradients
            else:
                acts += _receives(Action(s, Kind.RECV_B, i), grads_from[s], topology)
                if topology.recompute[s]:
                    acts.append(Action(s, Kind.R, i))
                acts.append(a)
                if topology.grads_to[s]:
                    acts.append(Action(s, Kind.SEND_B, i))
        if not fill_drain:
            acts.append(Action(home, Kind.GATHER))
        acts.append(Action(home, Kind.REDUCE))
        out.append(_hoist_receives(acts))
    return _follow_senders(out, topology)


def lower_plan(plan: Plan, schedule: str | None = None) -> tuple[Topology, Schedule]:
    """The plan's topology and its schedule (or the named one) lowered."""
    topology = topology_of(plan)
    name = schedule or plan.schedule
    compute = make_schedule(name, len(plan.stages), plan.micro_batches,
                            plan.virtual_stages if name == plan.schedule else None,
                            lanes=plan.lanes)
    return topology, lower(compute, topology)


def _receives(recv: Action, sources: frozenset[int], topology: Topology) -> list[Action]:
    """``recv`` (all of a stage's receives of one micro-batch), or, where lanes run several
    stages and the stage has several sources, one receive per source stage: each must be
    posted in its sender's order (``_follow_senders``), and two senders' orders (ZBV sends a
    skip connection's gradient before the next stage's; one lane's forwards and another's
    gradients interleave) need not agree on where one action for both would go."""
    if not sources:
        return []
    if len(sources) == 1 or all(len(lane) == 1 for lane in topology.lanes):
        return [recv]
    return [recv._replace(peer=p) for p in sorted(sources)]


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


def _follow_senders(lowered: Schedule, topology: Topology) -> Schedule:
    """Post each lane's receives in the order their senders send: where two lanes exchange
    messages of several stages (ZBV's forwards one way and gradients the other), a receive
    moves up to just before the first receive that the sender's order puts after it. Posting
    early never waits (the compute action that reads it does), and it keeps every pair of
    lanes matching in posting order without tags."""
    order: dict[tuple[int, int], dict[Msg, int]] = {}
    for k, acts in enumerate(lowered):
        for a in acts:
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                for d, label in messages_sent(a, topology):
                    sent = order.setdefault((k, d), {})
                    sent[label] = len(sent)
    return [_receives_in_order(acts, k, order, topology) for k, acts in enumerate(lowered)]


def _receives_in_order(acts: list[Action], k: int, order: dict[tuple[int, int], dict[Msg, int]],
                       topology: Topology) -> list[Action]:
    recvs = {p: messages_received(a, topology) for p, a in enumerate(acts)
             if a.kind in (Kind.RECV_F, Kind.RECV_B)}
    by_label = {(src, label): p for p, got in recvs.items() for src, label in got}
    sequence = {src: list(sent) for (src, dst), sent in order.items() if dst == k}
    done = dict.fromkeys(sequence, 0)  # per sender: its labels up to here are placed
    placed: set[int] = set()
    out: list[Action] = []

    def place(p: int) -> None:  # after every receive its senders send earlier
        placed.add(p)
        for src, label in recvs[p]:
            n = order.get((src, k), {}).get(label)
            if n is None:
                continue  # a mismatch simulate reports
            while done[src] < n:
                q = by_label.get((src, sequence[src][done[src]]))
                done[src] += 1
                if q is not None and q not in placed:
                    place(q)
            done[src] = max(done[src], n + 1)
        out.append(acts[p])

    for p, a in enumerate(acts):
        if p in recvs and p not in placed:
            place(p)
        elif p not in placed:
            placed.add(p)
            out.append(a)
    return out


def plan_grid(plan: Plan) -> str:
    """One step of ``plan``'s schedule, one row per rank: its stages' forwards and backwards
    by clock tick (a recomputing stage runs R before each of its B)."""
    sched = make_schedule(plan.schedule, len(plan.stages), plan.micro_batches,
                          plan.virtual_stages)
    lane = {s: k for k, held in enumerate(plan.lanes) for s in held}
    rows = [(f"rank {r}", lane[plan.stages_of_rank(r)[0].index]) for r in range(plan.world_size)]
    return format_schedule(sched, rows)


def split_at_gather(actions: Sequence[Action]) -> tuple[list[Action], list[Action]]:
    """(up to and including GATHER, the rest): what a call runs and what ``backward`` runs."""
    for p, a in enumerate(actions):
        if a.kind is Kind.GATHER:
            return list(actions[: p + 1]), list(actions[p + 1 :])
    raise ValueError("a lowered schedule has a GATHER action")


def format_lowered(lowered: Schedule, rows: Sequence[tuple[str, int]] | None = None) -> str:
    """One line per row (default one per lane): its actions, without the stage number where
    a lane runs one stage."""
    rows = rows if rows is not None else [(f"st {s}", s) for s in range(len(lowered))]
    label = max(6, *(len(name) + 1 for name, _ in rows))

    def shown(acts: list[Action]) -> str:
        one = len({a.stage for a in acts if not a.kind.once}) <= 1
        return " ".join(str(a)[len(str(a.stage)):] if one else str(a) for a in acts)

    return "\n".join(name.ljust(label) + shown(lowered[s]) for name, s in rows)
