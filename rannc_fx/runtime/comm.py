"""Process groups and collectives: setup, the plan's subgroups, flat all-reduces, the
agreement on a problem (``agree``); point-to-point messages are ``p2p``'s.

Every failure (a peer that died, a timeout) is raised as ``CommError`` naming this rank, the
peer rank(s) and the operation, so a broken pipeline ends in a traceback that says who to
look at, never a silent hang. A peer that raised inside the step is read off the failure
board while waiting (``failures``), so that one is ``PeerFailed`` at once, not a timeout.
The runtime's messages travel on its own groups (``Groups.world``, with ``Config.timeout_s``),
never on the user's default group, so a step abandoned after a failure leaves nothing in
flight there, and fresh groups replace them.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..plan.config import Config
from ..plan.plan import Plan
from .failures import Board, PeerFailed, board, settle

__all__ = [
    "BUCKET_BYTES",
    "CommError",
    "agree",
    "buckets",
    "clean_exit",
    "Groups",
    "abort_groups",
    "all_reduce_flat",
    "backend_for",
    "backend_of",
    "build_groups",
    "check_same_plan",
    "collective",
    "init_distributed",
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


log = logging.getLogger("rannc_fx")

_CLEAN_EXIT: list[bool] = []  # registered once per process
EXIT_SETTLE_S = 30.0  # how long the exit waits for a failed step's blocked waits


def _register_clean_exit() -> None:
    if not _CLEAN_EXIT:
        atexit.register(clean_exit)
        _CLEAN_EXIT.append(True)


def clean_exit() -> None:
    """Destroy the process groups still alive when the interpreter exits (``atexit``).

    A gloo process that exits with its group alive can abort during interpreter shutdown
    ("terminate called without an active exception": gloo's threads still hold work while
    Python finalizes); here 4 of 15 two-rank runs without ``destroy_process_group()`` did.
    After a script's own ``destroy_process_group()`` this does nothing. First it waits (up
    to ``EXIT_SETTLE_S``) for the waits a failed step left blocked to end
    (``failures.settle``).
    """
    if not settle(EXIT_SETTLE_S):
        log.warning("a wait of a failed step did not end within %g s of the exit; the "
                    "process may abort as it ends", EXIT_SETTLE_S)
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
    world: dist.ProcessGroup | None = None  # every rank: the runtime's messages, the agreement
    timeout_s: float = 300.0
    board: Board | None = None  # the job's failure board (failures.py); None alone
    # ``world`` is gloo: each message starts on its own (``p2p.post``); its ranks are the global
    # ones (it spans every rank, in order)
    gloo: bool = False


def build_groups(plan: Plan, *, timeout_s: float = 300.0) -> Groups:
    """Create the plan's subgroups; every rank calls this, and creates them in the same order.

    ``new_group`` is collective over the whole world, so even ranks outside a group take part
    in making it: first the replica group of each stage with more than one replica (stage
    order), then one group per shared parameter (plan order), each set of ranks once. A
    one-rank plan needs none (and no process group).
    """
    timeout = timedelta(seconds=timeout_s)
    stage_ranks = [st.ranks for st in plan.stages]
    shared_ranks = [  # each rank once: two stages of one lane share their ranks
        tuple(sorted({r for s in sp.stages for r in plan.stages[s].ranks}))
        for sp in plan.shared_params
    ]
    if plan.world_size == 1:
        return Groups(
            [None] * len(stage_ranks), [None] * len(shared_ranks), stage_ranks, shared_ranks,
            timeout_s=timeout_s,
        )
    rank = dist.get_rank()
    world = _new_group(list(range(plan.world_size)), timeout)
    assert world is not None

    made: dict[tuple[int, ...], dist.ProcessGroup | None] = {}  # a lane's stages share one

    def make(ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
        if len(ranks) < 2:
            return None
        if ranks not in made:
            made[ranks] = _new_group(list(ranks), timeout)
        return made[ranks] if rank in ranks else None

    stage = [make(r) for r in stage_ranks]
    shared = [make(r) for r in shared_ranks]
    return Groups(stage, shared, stage_ranks, shared_ranks, world, timeout_s, board(),
                  gloo=backend_of(world) == "gloo")


def _new_group(ranks: list[int], timeout: timedelta) -> dist.ProcessGroup | None:
    """``dist.new_group`` (collective over the world), None on a rank outside ``ranks`` (where
    torch returns its non-member marker)."""
    group = dist.new_group(ranks, timeout=timeout)
    return group if isinstance(group, dist.ProcessGroup) else None


def abort_groups(groups: Groups) -> None:
    """Abort and destroy ``groups`` (a step abandoned after a failure may have left messages
    in flight in them); fresh ones replace them."""
    for g in {id(g): g for g in (groups.world, *groups.stage, *groups.shared) if g}.values():
        try:
            g.abort()
            dist.destroy_process_group(g)
        except Exception:  # a group already torn down: nothing left to free
            pass


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


def all_reduce_flat(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    *,
    what: str,
    ranks: Sequence[int] = (),
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    groups: Groups | None = None,
) -> list[torch.Tensor]:
    """All-reduce ``tensors`` (``op``, SUM by default) as one flat buffer per dtype; returns
    the reduced tensors.

    One collective per dtype instead of one per tensor: latency, not bandwidth, dominates
    small stages. With ``groups`` (a step's all-reduce) the wait reads the failure board.
    """
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for idx in by_dtype.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in idx])
        home = flat.device
        if home.type == "cpu" and backend_of(group) == "nccl":  # host gradients (host_params)
            flat = flat.to(torch.device("cuda", torch.cuda.current_device()))
        def start(async_op: bool, flat: torch.Tensor = flat) -> Any:
            return dist.all_reduce(flat, op=op, group=group, async_op=async_op)

        collective(start, f"all-reduce of {what}", ranks=ranks, groups=groups,
                   cpu=flat.device.type == "cpu")
        flat = flat.to(home)
        for i, piece in zip(idx, flat.split([tensors[i].numel() for i in idx]), strict=True):
            out[i] = piece.view_as(tensors[i])
    return [t for t in out if t is not None]


def backend_of(group: dist.ProcessGroup | None) -> str:
    """The backend of ``group`` ("gloo", "nccl"), "" where there is no process group."""
    try:
        return str(dist.get_backend(group))
    except (RuntimeError, ValueError):
        return ""


# The most bytes one bucket of a flat collective copies (a gradient all-reduce, ZeRO-1's
# all-gather): the transient copy of a stage's gradients or parameters stays within it
BUCKET_BYTES = 64 * 2**20

T = TypeVar("T", bound=torch.Tensor)


def buckets(tensors: Sequence[T], cap: int) -> list[list[T]]:
    """``tensors`` in order, cut into runs of at most ``cap`` bytes (a larger one alone)."""
    out: list[list[T]] = []
    size = cap
    for t in tensors:
        n = t.numel() * t.element_size()
        if size + n > cap or not out:
            out.append([])
            size = 0
        out[-1].append(t)
        size += n
    return out


def collective(
    start: Callable[[bool], Any], what: str, *, ranks: Sequence[int] = (),
    groups: Groups | None = None, cpu: bool = True,
) -> None:  # fmt: skip
    """Run one collective, ``start(async_op)``, as ``CommError`` naming ``what`` and the
    ranks when it fails; with ``groups`` (a step's) on CPU tensors, waiting reads the failure
    board, so a peer that raised is ``PeerFailed`` at once rather than a timeout."""
    who = f"ranks {list(ranks)}" if ranks else "all ranks"

    def failed(e: RuntimeError) -> CommError:
        return CommError(
            f"rank {_rank()}: {what} among {who} failed: {e}; a rank that died or never "
            "reached this step (it must run forward and backward too) is the cause"
        )

    try:
        if groups is not None and groups.board is not None and cpu:
            groups.board.wait([start(True)], lambda _: f"in the {what}",
                              timeout_s=groups.timeout_s, on_error=lambda _, e: failed(e))
        else:
            start(False)
    except RuntimeError as e:
        if isinstance(e, CommError | PeerFailed):
            raise
        raise failed(e) from e


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


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
