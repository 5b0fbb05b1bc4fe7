"""11. Runtime: what executes a plan on every rank.

routing   which samples each rank holds and every piece that moves (pure arithmetic)
comm      process groups, flat all-reduces, errors that name the peer
p2p       point-to-point messages: posted in order, batched on NCCL, waited on the board
pieces    cutting tensors into sample pieces and reassembling them
checks    plan, stage module and inputs agree
buffers   BatchNorm-style buffers under micro-batching, replicas and recomputation
grads     gradient all-reduce; gradients held for loss.backward()
accumulation  model.no_sync(): calls that leave their gradients unsummed over ranks
outputs   model outputs home, the loss to every rank
stage     StageRunner: the operations the actions name, on this rank's stage
autograd_link  the loss's autograd function: loss.backward() reaches the executor
interpret  which part of the lowered list a call runs (Mode), and the loop that runs it
executor  StageExecutor: interprets the lowered schedule (``schedules.lowering``)
single_rank  the one-rank, one-micro-batch fast path (same interface)
clip      the whole model's gradient norm and clipping, each parameter counted once

It imports only the plan's types, the schedules and itself; ``rannc_fx.compile`` builds it.
The schedules' names are re-exported here for the runtime's users.
"""

from ..schedules.generators import (
    Action,
    Kind,
    format_schedule,
    gpipe_schedule,
    one_f_one_b_schedule,
)
from ..schedules.kinds import make_schedule
from ..schedules.lowering import Topology, format_lowered, lower, plan_grid, topology_of
from ..schedules.simulate import ScheduleError, Simulation, plan_durations, simulate
from .batches import BatchSizes, rebatched
from .clip import clip_grad_norm
from .comm import CommError, Groups, build_groups, init_distributed
from .executor import StageExecutor
from .failures import PeerFailed
from .single_rank import AloneExecutor, build_executor

__all__ = [
    "BatchSizes",
    "rebatched",
    "Action",
    "AloneExecutor",
    "CommError",
    "Groups",
    "Kind",
    "PeerFailed",
    "ScheduleError",
    "Simulation",
    "StageExecutor",
    "Topology",
    "build_executor",
    "build_groups",
    "clip_grad_norm",
    "format_lowered",
    "format_schedule",
    "gpipe_schedule",
    "init_distributed",
    "lower",
    "make_schedule",
    "one_f_one_b_schedule",
    "plan_durations",
    "plan_grid",
    "simulate",
    "topology_of",
]
