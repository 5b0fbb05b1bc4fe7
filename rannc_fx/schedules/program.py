"""A plan's schedule lowered once: the program every rank runs its lane of, checked and timed.

``program_of(plan)`` lowers the plan's schedule (``lowering``), simulates it with the plan's
own per-stage costs (``simulate``: a schedule that could hang or leave a message unmatched
never starts) and picks the list each lane runs where the backward waits for
``loss.backward()``. The planner reads its simulation where it makes the plan (the simulated
step); every rank hands it to its executor, which reads its lane's lists. The last few plans'
programs are kept, so the planner and a rank's start-up lower a plan once.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..plan.plan import Plan
from .actions import Kind, Schedule
from .kinds import GPIPE
from .lowering import Topology, lower_plan, split_at_gather
from .simulate import Simulation, plan_durations, simulate

__all__ = ["Program", "keep", "program_of", "simulate_plan"]

_KEPT = 4  # programs kept (the plans of the last few calls: train, eval, another batch size)


@dataclass(frozen=True)
class Program:
    """``lowered``: the plan's schedule lowered, one list a lane. ``deferred``: the list each
    lane runs when the backward waits for ``loss.backward()`` (its own where it is
    fill-drain, GPipe's otherwise: a 1F1B list cannot stop at ``GATHER`` with every forward
    done). ``in_call``: per lane, whether its lowered list runs a backward before
    ``GATHER`` (the whole step can run in the call). ``simulation``: the lowered lists timed
    with the plan's costs."""

    topology: Topology
    lowered: Schedule
    deferred: Schedule
    in_call: tuple[bool, ...]
    simulation: Simulation

    def lane_of(self, stage: int) -> int:
        return self.topology.lane_of[stage]


_programs: list[tuple[Plan, Program]] = []


def keep(plan: Plan, program: Program) -> Plan:
    """Hold ``program`` as ``plan``'s (a copy of the plan it was built for that differs in
    no field the lowering reads: its predicted times); returns ``plan``."""
    _programs.insert(0, (plan, program))
    del _programs[_KEPT:]
    return plan


def program_of(plan: Plan) -> Program:
    """``plan``'s program (built once for a plan object; see the module docstring)."""
    for held, program in _programs:
        if held is plan:
            return program
    topology, lowered = lower_plan(plan)
    simulation = simulate(lowered, topology, plan_durations(plan, lowered))
    in_call = tuple(any(a.kind is Kind.B for a in split_at_gather(acts)[0]) for acts in lowered)
    gpipe = lower_plan(plan, GPIPE.name)[1] if any(in_call) else []
    deferred = [gpipe[k] if mixed else acts
                for k, (acts, mixed) in enumerate(zip(lowered, in_call, strict=True))]
    program = Program(topology, lowered, deferred, in_call, simulation)
    keep(plan, program)
    return program


def simulate_plan(plan: Plan) -> Simulation:
    """The plan's lowered schedule, checked and timed from its own per-stage costs."""
    return program_of(plan).simulation
