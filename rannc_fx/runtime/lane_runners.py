"""The stages one rank runs, as the executor drives them: a ``StageRunner`` each (with its
routes, outputs, buffers and tail), the seeds that start their backwards, and the peers of
their actions for the trace.

One stage a rank is the case of one; a lane's several stages (interleaved 1F1B, ZBV) share
the rank's mailbox, so a cut value between two of them is copied, never sent. The executor
gathers and shares through the ``Outputs`` of its *main* stage (the one holding model
outputs, else the first) for every stage of the rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import fx

from ..plan.plan import Plan, Stage
from ..plan.values import ValueSpec
from ..schedules import routing
from ..schedules.generators import Kind
from ..schedules.lowering import topology_of
from .batchnorm import DeferredBatchNorm
from .buffers import BufferSync
from .comm import Groups
from .outputs import Outputs
from .pieces import dtype_of
from .stage import StageRunner
from .tail import TailRunner

__all__ = ["LaneRunners", "action_peers"]

Seeds = dict[int, dict[int, torch.Tensor]]  # stage -> output position -> gradient


@dataclass
class LaneRunners:
    """This rank's replica of each of its stages, by stage index."""

    plan: Plan
    runners: dict[int, StageRunner]
    routes: dict[int, routing.RankRoutes]
    tails: dict[int, TailRunner | None]

    @classmethod
    def build(cls, plan: Plan, stages: Sequence[Stage],
              modules: dict[int, fx.GraphModule], in_specs: dict[int, list[ValueSpec]], *,
              rank: int, replica: int, groups: Groups, device: torch.device) -> LaneRunners:
        mailbox: dict[routing.Transfer, torch.Tensor] = {}
        runners, all_routes, tails = {}, {}, {}
        lane = tuple(st.index for st in stages)
        for st in stages:
            s, mod = st.index, modules[st.index]
            routes = all_routes[s] = routing.rank_routes(plan, rank, None if len(stages) == 1
                                                         else s)
            spans = [routing.replica_span(plan, s, replica, i) for i in range(plan.micro_batches)]
            outputs = Outputs(plan, st, rank, routes, spans, groups, device, lane=lane)
            buffers = BufferSync(
                mod, micro_batches=plan.micro_batches, group=groups.stage[s], ranks=st.ranks,
                recompute=st.recompute or st.selective, groups=groups,
                deferred=DeferredBatchNorm.install(mod) if plan.batch_norm == "step" else None,
            )  # fmt: skip
            tails[s] = (TailRunner(plan, st, mod, rank, groups, device)
                        if plan.tail is not None else None)
            runners[s] = StageRunner(
                plan, st, mod, rank=rank, routes=routes, spans=spans, in_specs=in_specs[s],
                outputs=outputs, buffers=buffers, device=device, groups=groups, tail=tails[s],
                mailbox=mailbox,
            )  # fmt: skip
        return cls(plan, runners, all_routes, tails)

    @property
    def buffers(self) -> list[BufferSync]:
        return [r.buffers for r in self.runners.values()]

    def unit_seeds(self, loss: int, device: torch.device) -> Seeds:
        """The whole step in the call: the loss's own gradient, d loss / d loss = 1, for the
        stage of this rank's that computes it."""
        ref = self.plan.outputs[loss]
        if ref.stage not in self.runners:
            return {}
        pos = self.runners[ref.stage].out_pos[ref.spec.name]
        return {ref.stage: {pos: torch.ones(ref.spec.shape, dtype=dtype_of(ref.spec),
                                            device=device)}}

    def seeds(self, tied: Sequence[int],
              grads: Sequence[torch.Tensor | None]) -> tuple[Seeds, dict[int, torch.Tensor]]:
        """The user's gradients of the ``tied`` outputs (to be scaled by each share) by the
        stage and output position they seed, and the tail's outputs' (by output index: the
        tail runs once, on the whole batch)."""
        seeds: Seeds = {}
        tail: dict[int, torch.Tensor] = {}
        for j, g in zip(tied, grads, strict=True):
            ref = self.plan.outputs[j]
            if ref.stage not in self.runners or g is None:
                continue
            if self.plan.tail_output(j):
                tail[j] = g
                continue
            pos = self.runners[ref.stage].out_pos[ref.spec.name]
            mine = seeds.setdefault(ref.stage, {})
            mine[pos] = mine[pos] + g if pos in mine else g
        return seeds, tail


def action_peers(plan: Plan, rank: int, stage: int, routes: routing.RankRoutes,
                 groups: Groups) -> dict[tuple[int, Kind, int | None], list[int]]:
    """The ranks each message (of ``stage``) or once-a-step action (stage -1) of ``rank``
    sends to or waits for."""
    peers: dict[tuple[int, Kind, int | None], list[int]] = {}

    def to(ts: list[routing.Transfer]) -> list[int]:
        return sorted({t.dst for t in ts if t.src == rank and not t.local})

    peers[(-1, Kind.SCATTER, None)] = to([t for ts in routes.inputs for t in ts])
    for i in range(plan.micro_batches):
        peers[(stage, Kind.SEND_F, i)] = to(routes.cuts[i])
        peers[(stage, Kind.SEND_B, i)] = to(routes.grads[i])
    owners = {r for s in topology_of(plan).output_stages for r in plan.stages[s].ranks}
    peers[(-1, Kind.GATHER, None)] = sorted(owners - {rank})
    together = {r for rs in (*groups.stage_ranks, *groups.shared_ranks) if rank in rs for r in rs}
    peers[(-1, Kind.REDUCE, None)] = sorted(together - {rank})
    return peers
