"""Interpreting this rank's lowered list: which part of it a call runs, and the loop that runs it.

Which part of the list a call runs depends on what the call can know:

    no gradients (``torch.no_grad()``)  the forward actions only; nothing is kept
    the whole step in the call          a schedule that interleaves backwards with forwards
                                        (1F1B), when the loss is the model's only output that
                                        carries a gradient; ``loss.backward()`` then applies
                                        the held gradients scaled by the gradient that reaches
                                        the loss (``grads.GradSync.hold``/``apply``)
    deferred backward                   GPipe, and any schedule in eval mode or with several
                                        outputs that carry gradients: GPipe's lowered list up
                                        to ``GATHER`` in the call, the rest when
                                        ``loss.backward()`` reaches the loss (``Bridge``)

``action_lists`` cuts the lane's lowered lists once an executor: each mode's, and the deferred
one in two at ``GATHER``. ``run_actions`` runs one list action by action by table
(``Dispatch``: by stage and kind, the runner's operation, or the executor's own for the
once-a-step kinds), each action with its stage's step state (a once-a-step one with the main
stage's), and after each action waits for the sends it releases (``schedules/release.py``);
``run_traced`` is the same loop with each action an event of the ``Recorder`` (``trace``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum

from ..plan.parts import Stage
from ..schedules.generators import Action, Kind
from ..schedules.lowering import split_at_gather
from ..schedules.program import Program
from .step import StepState
from .trace import Recorder

__all__ = ["Dispatch", "Mode", "Release", "Split", "action_lists", "run_actions", "run_traced"]

_FORWARD_KINDS = {Kind.SCATTER, Kind.RECV_F, Kind.F, Kind.SEND_F, Kind.GATHER}

# by stage and kind, what runs an action
Dispatch = dict[int, dict[Kind, Callable[..., None]]]
# by position in a list, the sends waited for after that action: (stage, "F" or "B", micro-batch)
Release = dict[int, list[tuple[int, str, int]]]
# by list (its identity) and stage, the micro-batches whose backward the list splits in B and W
Split = dict[int, dict[int, frozenset[int]]]


class Mode(Enum):
    EVAL = "no gradients"
    CALL = "the whole step in the call"
    DEFERRED = "backward deferred to loss.backward()"


def action_lists(program: Program, stage: int, stages: Sequence[Stage]
                 ) -> tuple[dict[Mode, list[Action]], tuple[list[Action], list[Action]], Split]:
    """The list each mode runs, the deferred list cut at ``GATHER`` (the call's part, the
    backward's), and per list (by identity) and stage the micro-batches whose backward it
    splits into B and W (it has their W); ``stage`` is the rank's main stage, ``stages`` all
    it runs."""
    lane = program.lane_of(stage)
    actions = program.lowered[lane]
    deferred = split_at_gather(program.deferred[lane])
    lists = {
        Mode.EVAL: [a for a in actions if a.kind in _FORWARD_KINDS],
        Mode.CALL: actions,
        Mode.DEFERRED: deferred[0],
    }
    split = {
        id(acts): {st.index: frozenset(a.microbatch for a in acts if a.kind is Kind.W
                                       and a.stage == st.index and a.microbatch is not None)
                   for st in stages}
        for acts in (*lists.values(), deferred[1])
    }
    return lists, deferred, split


def run_actions(step: StepState, actions: list[Action], dispatch: Dispatch,
                release: Release) -> None:
    """Run ``actions`` in order, each by ``dispatch``; after each, wait for the sends
    ``release`` names there."""
    parts = step.parts
    for p, a in enumerate(actions):  # the once-a-step kinds get the main stage's state
        fn = dispatch[a.stage][a.kind]
        if a.peer is None:
            fn(step if a.kind.once else parts[a.stage], a.microbatch)
        else:
            fn(parts[a.stage], a.microbatch, a.peer)
        for stage, what, i in release.get(p, ()):
            parts[stage].finish_send(what, i)


def run_traced(rec: Recorder, step: StepState, actions: list[Action], dispatch: Dispatch,
               release: Release, peers_of: dict[tuple[int, Kind, int | None], list[int]]) -> None:
    """``run_actions``, each action an event; a compute action starts after the waits it ran.
    ``peers_of``: the ranks each message or once-a-step action (stage -1) sends to or waits for
    (``lane_runners.action_peers``)."""
    for p, a in enumerate(actions):
        first = len(rec.events)
        t0 = rec.now()
        fn = dispatch[a.stage][a.kind]
        if a.peer is None:
            fn(step if a.kind.once else step.parts[a.stage], a.microbatch)
        else:
            fn(step.parts[a.stage], a.microbatch, a.peer)
        t1 = rec.now()
        if a.kind.is_compute:
            t0 = max([t0, *(e["end"] for e in rec.events[first:])])
        i = a.microbatch
        peers = peers_of.get((a.stage if not a.kind.once else -1, a.kind, i), [])
        label = a.kind.value + ("" if i is None else str(i))
        if a.kind in (Kind.GATHER, Kind.REDUCE):
            rec.event(label, "collective", t0, t1, kind=a.kind.value, peers=peers,
                      match=a.kind.value)
        elif a.kind.is_compute:
            rec.event(label, "compute", t0, t1, kind=a.kind.value, microbatch=i)
        else:
            rec.event(label, "post", t0, t1, kind=a.kind.value, microbatch=i, to=peers)
        for stage, what, j in release.get(p, ()):
            step.parts[stage].finish_send(what, j)
