"""The runtime: what executes a plan on every rank.

schedule  which micro-batch each stage runs, forward or backward (data, no processes)
routing   which samples each rank holds and every piece that moves (pure arithmetic)
comm      process groups, batched p2p, flat all-reduces, errors that name the peer
buffers   BatchNorm-style buffers under micro-batching and replicas
executor  StageExecutor: GPipe on this rank's stage, the loss bridge to autograd
"""

from .comm import CommError, Groups, build_groups, init_distributed
from .executor import StageExecutor
from .schedule import Action, gpipe_schedule

__all__ = [
    "Action",
    "CommError",
    "Groups",
    "StageExecutor",
    "build_groups",
    "gpipe_schedule",
    "init_distributed",
]
