"""The runtime: what executes a plan on every rank.

schedule  which micro-batch each stage runs, forward or backward (data, no processes)
routing   which samples each rank holds and every piece that moves (pure arithmetic)
comm      process groups, batched p2p, flat all-reduces, errors that name the peer
buffers   BatchNorm-style buffers under micro-batching and replicas
grads     gradient all-reduce: shared parameters over their holders, the rest per stage
pieces    cutting tensors into sample pieces and reassembling them
executor  StageExecutor: GPipe on this rank's stage, the loss bridge to autograd
compile   compile(model, optimizer): plan on rank 0, broadcast, split, run the executor
"""

from .comm import CommError, Groups, build_groups, init_distributed
from .compile import CompiledModel, compile
from .executor import StageExecutor
from .schedule import Action, gpipe_schedule

__all__ = [
    "Action",
    "CommError",
    "CompiledModel",
    "Groups",
    "StageExecutor",
    "build_groups",
    "compile",
    "gpipe_schedule",
    "init_distributed",
]
