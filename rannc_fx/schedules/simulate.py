"""Simulate a lowered schedule without processes: check it cannot hang, and time it.

The model of the runtime it checks (``executor`` runs it so):

- a receive is posted where its ``RECV_*`` action stands and waited on by the compute action
  that reads it (``F``, ``B``) or by ``GATHER``; sends never block (they are finished at the end
  of the step), so an action waits only for messages that are posted earlier;
- messages between two lanes match in posting order (no tags): the sender's sequence of
  messages to a lane must equal that lane's sequence of receives from it, else a receive
  would get another message's bytes (between two stages of one lane they are copies, in
  the same order);
- ``GATHER`` posts its sends and receives at once and then waits for the outputs of every
  other lane that holds model outputs, sent at that lane's ``GATHER``; ``REDUCE`` waits for
  every lane it shares a parameter with.

``simulate`` checks both properties and returns each action's start and end for given action
durations; ``plan_durations`` reads them off a plan's per-stage costs (a forward carries half
the stage's communication time, a backward the other half plus the gradient accumulation after
the first micro-batch, ``REDUCE`` the all-reduce and the optimizer step), so the step time it
predicts is the makespan of the same schedule the executor runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..plan.plan import Plan, Stage
from .bw_split import SPLIT_NODE_MS, SPLIT_OVERHEAD
from .bw_split import weight_share as split_share
from .generators import Action, Kind, Schedule
from .lowering import Msg as _Msg
from .lowering import Topology
from .lowering import messages_received as _receives
from .lowering import messages_sent as _sends

__all__ = ["SPLIT_NODE_MS", "SPLIT_OVERHEAD", "ScheduleError", "Simulation", "plan_durations", "simulate",
           "weight_share"]

Durations = Callable[[Action], float]


class ScheduleError(ValueError):
    """The lowered schedule would hang or mismatch messages; the text names the actions."""


@dataclass(frozen=True)
class Simulation:
    """Start and end (seconds) of every action, and the step's makespan."""

    start: dict[Action, float]
    end: dict[Action, float]

    @property
    def makespan(self) -> float:
        return max(self.end.values(), default=0.0)



def _waits_for(a: Action) -> tuple[str, int, int | None] | None:
    """What ``a`` waits on: (kind, its stage, micro-batch) of the messages it reads, or
    GATHER's (the stage is then its lane's)."""
    if a.kind is Kind.F:
        return ("F", a.stage, a.microbatch)
    if a.kind is Kind.B:
        return ("B", a.stage, a.microbatch)
    if a.kind is Kind.GATHER:
        return ("GATHER", -1, None)
    return None


def _check_matching(lowered: Schedule, topo: Topology) -> None:
    n = topo.num_lanes
    sent: dict[tuple[int, int], list[_Msg]] = {}
    got: dict[tuple[int, int], list[_Msg]] = {}
    for k in range(n):
        for a in lowered[k]:
            for d, label in _sends(a, topo):
                sent.setdefault((k, d), []).append(label)
            for src, label in _receives(a, topo):
                got.setdefault((src, k), []).append(label)
    for pair in sorted(set(sent) | set(got)):
        out, back = sent.get(pair, []), got.get(pair, [])
        if out != back:
            k = next((k for k, (x, y) in enumerate(zip(out, back, strict=False)) if x != y),
                     min(len(out), len(back)))
            raise ScheduleError(
                f"lane {pair[0]} sends {_show(out[k:k + 3])} to lane {pair[1]} where it "
                f"posts receives for {_show(back[k:k + 3])}: messages between two lanes must "
                "be posted in the same order on both sides"
            )


def _show(labels: list[_Msg]) -> str:
    return ", ".join(
        f"{w}{'' if i is None else i}" + (f" ({a}->{b})" if i is not None else "")
        for w, a, b, i in labels
    ) or "nothing"


def simulate(lowered: Schedule, topology: Topology, durations: Durations) -> Simulation:
    """Run every lane's list as early as its messages allow; raise ScheduleError on a hang."""
    _check_matching(lowered, topology)
    n = topology.num_lanes
    lane_of = topology.lane_of
    posted: dict[tuple[int, int, _Msg], float] = {}  # (src, dst, label) -> time posted
    arrived: dict[int, float] = {}  # lane -> when it reached REDUCE
    start: dict[Action, float] = {}
    end: dict[Action, float] = {}
    clock, pos = [0.0] * n, [0] * n
    expected = [[(src, label) for a in lowered[k] for src, label in _receives(a, topology)]
                for k in range(n)]
    peers = [{lane_of[p] for group in topology.shared if set(group) & set(topology.lanes[k])
              for p in group} - {k} for k in range(n)]
    while any(pos[k] < len(lowered[k]) for k in range(n)):
        progressed = False
        for k in range(n):
            while pos[k] < len(lowered[k]):
                a = lowered[k][pos[k]]
                if a.kind is Kind.GATHER:
                    # posts its sends and receives together, then waits: sends count from
                    # its arrival, so two lanes holding outputs never wait on each other
                    for d, label in _sends(a, topology):
                        posted.setdefault((k, d, label), clock[k])
                if a.kind is Kind.REDUCE:
                    # a collective: it starts once every lane sharing a parameter is there
                    arrived.setdefault(k, clock[k])
                    if any(p not in arrived for p in peers[k]):
                        break
                    ready: float | None = max((arrived[p] for p in peers[k] | {k}), default=0.0)
                else:
                    ready = _ready_at(a, k, expected[k], posted)
                if ready is None:
                    break
                t0 = max(clock[k], ready)
                start[a], end[a] = t0, t0 + durations(a)
                clock[k] = end[a]
                for d, label in _sends(a, topology):
                    posted.setdefault((k, d, label), end[a])
                pos[k] += 1
                progressed = True
        if not progressed:
            stuck = ", ".join(str(lowered[k][pos[k]]) for k in range(n) if pos[k] < len(lowered[k]))
            raise ScheduleError(f"the schedule hangs: {stuck} wait for messages never sent")
    return Simulation(start, end)


def _ready_at(a: Action, k: int, expected: list[tuple[int, _Msg]],
              posted: dict[tuple[int, int, _Msg], float]) -> float | None:
    """When the messages ``a`` waits on were sent, or None while one is still unsent."""
    want = _waits_for(a)
    if want is None:
        return 0.0
    what, stage, i = want
    times = []
    for src, label in expected:
        if label[0] == what and label[3] == i and (what == "GATHER" or label[2] == stage):
            t = posted.get((src, k, label))
            if t is None:
                return None
            times.append(t)
    return max(times, default=0.0)


def weight_share(stage: Stage) -> float:
    """The share of a stage's backward that its weight gradients take
    (``split_cost.weight_share``: a LoRA stage's frozen base has no weight gradient to
    defer)."""
    return float(split_share(stage.memory.grads, stage.memory.params))


def plan_durations(plan: Plan, lowered: Schedule) -> Durations:
    """Action durations in seconds from the plan's predicted per-stage costs.

    Every backward but a stage's first adds its gradients into ``.grad`` (``accumulate_ms``).
    A backward split into ``B`` and ``W`` (``backward_split``) takes the stage's backward
    and ``SPLIT_OVERHEAD`` more between them, the accumulation in ``W``: ``W`` the weight
    side of its matmuls, half the backward where every parameter trains, less where some
    are frozen (``weight_share``); ``B`` also walks the autograd graph (``SPLIT_NODE_MS`` a
    node of the stage). The first stage's inputs need no gradient: its ``B`` makes nothing
    and its ``W`` runs the whole backward.
    """
    first_b: dict[int, int | None] = {}
    for acts in lowered:
        for a in acts:
            if a.kind is Kind.B:
                first_b.setdefault(a.stage, a.microbatch)
    split = {(a.stage, a.microbatch) for acts in lowered for a in acts if a.kind is Kind.W}
    lane = {s: held for held in plan.lanes for s in held}
    shares = [weight_share(st) for st in plan.stages]  # once a stage, not once an action

    def of(a: Action) -> float:
        st = plan.stages[a.stage]
        k = stretch(st, plan.device.copies_beside_compute)
        if a.kind is Kind.F:
            return 1e-3 * (k * st.fwd_ms + st.comm_ms / 2)
        if a.kind is Kind.R:
            return 1e-3 * k * st.fwd_ms
        acc = st.accumulate_ms if a.microbatch != first_b[a.stage] else 0.0
        w = shares[a.stage]
        if a.kind is Kind.B and (a.stage, a.microbatch) in split:
            if a.stage == 0:  # its inputs need no gradient: W runs the whole backward
                return 1e-3 * st.comm_ms / 2
            walk = SPLIT_NODE_MS * st.num_nodes
            return 1e-3 * (k * st.bwd_ms * (1 - w) * (1 + SPLIT_OVERHEAD) + walk
                           + st.comm_ms / 2)
        if a.kind is Kind.B:  # layer by layer, each layer's forward runs again inside it
            return 1e-3 * (k * (st.bwd_ms + st.again_ms) + st.comm_ms / 2 + acc)
        if a.kind is Kind.W:
            whole = 1.0 if a.stage == 0 else w * (1 + SPLIT_OVERHEAD)
            return 1e-3 * (k * st.bwd_ms * whole + acc)
        if a.kind is Kind.REDUCE:  # every stage of its lane
            return 1e-3 * sum(plan.stages[j].allreduce_ms + plan.stages[j].optimizer_ms
                              + plan.stages[j].gather_ms + plan.stages[j].host_ms
                              for j in lane[a.stage])
        return 0.0

    return of


def stretch(st: Stage, overlap: bool = True) -> float:
    """How much longer a stage's compute takes than its profile says: 1, or where its
    parameters are in host memory, the ratio of the longer of the compute and the transfers
    to the compute (``overlap``: a device copying beside its compute), or of their sum."""
    compute = st.fwd_ms * (2 if st.recompute else 1) + st.bwd_ms + st.again_ms
    if not st.host_params or compute <= 0:
        return 1.0
    return max(1.0, st.fetch_ms / compute) if overlap else 1.0 + st.fetch_ms / compute
