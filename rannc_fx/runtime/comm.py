"""Process groups and messages: setup, the plan's subgroups, batched p2p, flat all-reduces.

Every failure (a peer that died, a timeout) is raised as ``CommError`` naming this rank, the
peer rank(s) and the operation, so a broken pipeline ends in a traceback that says who to
look at, never a silent hang.
"""

from __future__ import annotations

import atexit
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..config import Config
from ..plan import Plan

__all__ = [
    "CommError",
    "agree",
    "clean_exit",
    "Groups",
    "Message",
    "Pending",
    "all_reduce_flat",
    "backend_for",
    "build_groups",
    "check_same_plan",
    "init_distributed",
    "post",
]


class CommError(RuntimeError):
    """A message or collective failed; the text names the ranks and the operation."""


def backend_for(device: torch.device | str) -> str:
    """NCCL for CUDA tensors, gloo for everything else."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_distributed(config: Config | None = None, *, device: torch.device | str = "cpu") -> None:
    """Start the default process group from torchrun's environment, unless one is running.

    The backend follows ``device`` (``backend_for``), the timeout is ``config.timeout_s``.
    Without torchrun's variables (plain ``python train.py``) it starts a one-process group,
    so the same script runs on one device.

    Either way the process group is destroyed at interpreter exit if the script has not
    done so (``clean_exit``).
    """
    _register_clean_exit()
    if dist.is_initialized():
        return
    dev = torch.device(device)
    timeout = timedelta(seconds=(config or Config()).timeout_s)
    backend = backend_for(dev)
    if dev.type == "cuda":
        # NCCL needs the device chosen before the first collective (else every rank uses GPU 0).
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dev.index or 0)))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )


_CLEAN_EXIT: list[bool] = []  # registered once per process


def _register_clean_exit() -> None:
    if not _CLEAN_EXIT:
        atexit.register(clean_exit)
        _CLEAN_EXIT.append(True)


def clean_exit() -> None:
    """Destroy the process groups still alive when the interpreter exits (``atexit``).

    A gloo process that exits with its group alive can abort during interpreter shutdown
    ("terminate called without an active exception": gloo's threads still hold work while
    Python finalizes); here 4 of 15 two-rank runs without ``destroy_process_group()`` did.
    After a script's own ``destroy_process_group()`` this does nothing.
    """
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # exiting anyway: a peer that already died must not stop it
            pass


@dataclass
class Groups:
    """This rank's view of the plan's subgroups (``None`` where it is not a member or alone).

    ``stage[s]`` all-reduces stage s's gradients among its replicas; ``shared[p]`` the
    gradient of ``plan.shared_params[p]`` among every rank of every stage that uses it.
    """

    stage: list[dist.ProcessGroup | None]
    shared: list[dist.ProcessGroup | None]
    stage_ranks: list[tuple[int, ...]]
    shared_ranks: list[tuple[int, ...]]


def build_groups(plan: Plan, *, timeout_s: float = 300.0) -> Groups:
    """Create the plan's subgroups; every rank calls this, and creates them in the same order.

    ``new_group`` is collective over the whole world, so even ranks outside a group take part
    in making it: first the replica group of each stage with more than one replica (stage
    order), then one group per shared parameter (plan order). A one-rank plan needs none
    (and no process group).
    """
    timeout = timedelta(seconds=timeout_s)
    stage_ranks = [st.ranks for st in plan.stages]
    shared_ranks = [
        tuple(r for s in sp.stages for r in plan.stages[s].ranks) for sp in plan.shared_params
    ]
    if plan.world_size == 1:
        return Groups(
            [None] * len(stage_ranks), [None] * len(shared_ranks), stage_ranks, shared_ranks
        )
    rank = dist.get_rank()

    def make(ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
        if len(ranks) < 2:
            return None
        g = dist.new_group(list(ranks), timeout=timeout)
        return g if rank in ranks else None

    stage = [make(r) for r in stage_ranks]
    shared = [make(r) for r in shared_ranks]
    return Groups(stage, shared, stage_ranks, shared_ranks)


def check_same_plan(plan: Plan, device: torch.device | str = "cpu") -> None:
    """One collective at start-up: every rank holds the same plan (it also creates the world
    communicator on NCCL before any p2p batch that leaves ranks out)."""
    digest = int(hashlib.sha256(plan.to_json().encode()).hexdigest()[:15], 16)
    t = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    except RuntimeError as e:
        raise CommError(f"rank {_rank()}: the start-up check of the plan failed: {e}") from e
    if int(t[0]) != digest or -int(t[1]) != digest:
        raise ValueError(
            f"rank {_rank()} holds a different plan than another rank; broadcast one plan "
            "from rank 0 (or load the same plan file everywhere)"
        )


class Message(NamedTuple):
    """One p2p operation: send ``tensor`` to, or receive it from, global rank ``peer``."""

    op: str  # "send" or "recv"
    tensor: torch.Tensor
    peer: int
    what: str  # for errors: "cut value h of micro-batch 2"


class Pending:
    """Posted messages; ``wait()`` finishes them or raises ``CommError`` naming the peer."""

    def __init__(self, messages: Sequence[Message], works: Sequence[dist.Work]):
        self.messages = list(messages)
        self.works = list(works)

    def wait(self) -> None:
        """Idempotent: a finished gloo work waited on again waits for a new message."""
        if len(self.works) == len(self.messages):
            for w, m in zip(self.works, self.messages, strict=True):
                try:
                    w.wait()
                except RuntimeError as e:
                    raise CommError(_p2p_error(m, e)) from e
            self.works.clear()
            return
        # NCCL coalesces a batch into one work: name every peer in it.
        for w in self.works:
            try:
                w.wait()
            except RuntimeError as e:
                peers = sorted({m.peer for m in self.messages})
                raise CommError(
                    f"rank {_rank()}: a batch of {len(self.messages)} p2p messages with ranks "
                    f"{peers} failed ({', '.join(m.what for m in self.messages[:4])}...): {e}"
                ) from e
        self.works.clear()


def post(messages: Sequence[Message]) -> Pending:
    """Start every message in order with one ``batch_isend_irecv``; returns at once.

    Messages between two ranks match in the order they are posted (no tags), so both
    sides must list them in the same order: the canonical order of ``routing``.
    """
    if not messages:
        return Pending([], [])
    me = _rank()
    ops = []
    for m in messages:
        if m.peer == me:
            raise ValueError(f"rank {me} would {m.op} {m.what} to itself; copy it locally")
        if not m.tensor.is_contiguous():
            raise ValueError(f"{m.what}: p2p needs a contiguous tensor")
        fn = dist.isend if m.op == "send" else dist.irecv
        ops.append(dist.P2POp(fn, m.tensor, m.peer))
    try:
        works = dist.batch_isend_irecv(ops)
    except RuntimeError as e:
        raise CommError(_p2p_error(messages[0], e)) from e
    return Pending(messages, works)


def all_reduce_flat(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    *,
    what: str,
    ranks: Sequence[int] = (),
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
) -> list[torch.Tensor]:
    """All-reduce ``tensors`` (``op``, SUM by default) as one flat buffer per dtype; returns
    the reduced tensors.

    One collective per dtype instead of one per tensor: latency, not bandwidth, dominates
    small stages.
    """
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for idx in by_dtype.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in idx])
        try:
            dist.all_reduce(flat, op=op, group=group)
        except RuntimeError as e:
            who = f"ranks {list(ranks)}" if ranks else "all ranks"
            raise CommError(
                f"rank {_rank()}: all-reduce of {what} among {who} failed: {e}; a rank that "
                "died or never reached this step (it must run forward and backward too) is the "
                "cause"
            ) from e
        for i, piece in zip(idx, flat.split([tensors[i].numel() for i in idx]), strict=True):
            out[i] = piece.view_as(tensors[i])
    return [t for t in out if t is not None]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _p2p_error(m: Message, e: Exception) -> str:
    direction = "to" if m.op == "send" else "from"
    return (
        f"rank {_rank()}: {m.op} of {m.what} {direction} rank {m.peer} failed: {e}. Rank "
        f"{m.peer} died, is stuck, or runs a different plan or step; check its log (and that "
        "every rank calls the model and loss.backward() every step)"
    )


def agree(problems: Sequence[str], what: str, *, error: type[Exception] = ValueError) -> None:
    """One collective: raise ``error`` on every rank when any rank found a problem.

    A rank that fails alone would leave the others waiting in their next collective until
    the timeout; with this they all stop at once, each with every rank's message.
    """
    found: list[tuple[int, Sequence[str]]]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Sequence[str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, list(problems))
        found = [(r, p) for r, p in enumerate(gathered) if p]
    else:
        found = [(dist.get_rank() if dist.is_initialized() else 0, problems)] if problems else []
    if found:
        lines = [f"rank {r}: {msg}" for r, ps in found for msg in ps]
        raise error(f"{what}:\n  " + "\n  ".join(lines))
