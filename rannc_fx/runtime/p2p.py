"""Point-to-point messages: ``Message``, ``post`` (start a list of them) and ``Pending``.

The cut values, their gradients, the scattered inputs and the gathered outputs travel this
way, on the runtime's own world group (``comm.Groups.world``): on gloo each message starts by
itself, on NCCL a list is one batch. Messages between two ranks match in the order they are
posted (no tags), so both sides list them in the canonical order of ``routing``. A message
that fails is ``CommError`` naming this rank, the peer and what it carried; a step's wait on
CPU tensors reads the failure board (``failures``), so a peer that raised in the step is
``PeerFailed`` at once, not a timeout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from .comm import CommError, Groups, _rank

__all__ = ["Message", "Pending", "post"]


class Message(NamedTuple):
    """One p2p operation: send ``tensor`` to, or receive it from, global rank ``peer``."""

    op: str  # "send" or "recv"
    tensor: torch.Tensor
    peer: int
    what: str  # for errors: "cut value h of micro-batch 2"


class Pending:
    """Posted messages; ``wait()`` finishes them or raises ``CommError`` naming the peer
    (``PeerFailed`` where the board shows that a peer raised in this step)."""

    def __init__(self, messages: Sequence[Message], works: Sequence[dist.Work],
                 groups: Groups | None = None):
        self.messages = list(messages)
        self.works = list(works)
        self.groups = groups

    def wait(self) -> None:
        """Idempotent: a finished gloo work waited on again waits for a new message."""
        if len(self.works) == len(self.messages):
            g = self.groups
            if g is not None and g.board is not None and self._on_cpu():
                ms = self.messages
                g.board.wait(self.works, lambda i: f"waiting to {ms[i].op} {ms[i].what}",
                             timeout_s=g.timeout_s, on_error=lambda i, e: _p2p_failed(ms[i], e))
                self.works.clear()
                return
            self.wait_posted()
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

    def wait_posted(self) -> None:
        """``wait`` for sends whose receivers have posted their receives (``release.py``):
        they complete on the transports' threads whatever the peers do next, so this thread
        waits for them itself, with no hand-over to the failure board's waiter. A peer that
        failed and already tore its communicators down closes the pair: that error is read
        against the board first, as ``wait`` does."""
        if len(self.works) != len(self.messages):
            self.wait()
            return
        for w, m in zip(self.works, self.messages, strict=True):
            try:
                w.wait()
            except RuntimeError as e:
                g = self.groups
                if g is not None and g.board is not None:
                    g.board.raise_news(f"waiting to {m.op} {m.what}")
                raise CommError(_p2p_error(m, e)) from e
        self.works.clear()

    def _on_cpu(self) -> bool:
        return all(m.tensor.device.type == "cpu" for m in self.messages)


def post(messages: Sequence[Message], groups: Groups | None = None) -> Pending:
    """Start every message in order on ``groups.world`` (the default group without groups);
    returns at once. On gloo each message starts by itself on the group (``batch_isend_irecv``
    only loops over them there, checking each op's group and ranks again on the way), on
    NCCL as one batch.

    Messages between two ranks match in the order they are posted (no tags), so both
    sides must list them in the same order: the canonical order of ``routing``.
    """
    if not messages:
        return Pending([], [])
    me = _rank()
    for m in messages:
        if m.peer == me:
            raise ValueError(f"rank {me} would {m.op} {m.what} to itself; copy it locally")
        if not m.tensor.is_contiguous():
            raise ValueError(f"{m.what}: p2p needs a contiguous tensor")
    try:
        if groups is not None and groups.gloo and groups.world is not None:
            pg = groups.world
            works = [pg.send([m.tensor], m.peer, 0) if m.op == "send"
                     else pg.recv([m.tensor], m.peer, 0) for m in messages]
        else:
            group = groups.world if groups is not None else None
            works = dist.batch_isend_irecv([
                dist.P2POp(dist.isend if m.op == "send" else dist.irecv, m.tensor, m.peer,
                           group=group) for m in messages])
    except RuntimeError as e:
        raise CommError(_p2p_error(messages[0], e)) from e
    return Pending(messages, works, groups)


def _p2p_failed(m: Message, e: Exception) -> CommError:
    return CommError(_p2p_error(m, e))


def _p2p_error(m: Message, e: Exception) -> str:
    direction = "to" if m.op == "send" else "from"
    return (
        f"rank {_rank()}: {m.op} of {m.what} {direction} rank {m.peer} failed: {e}. Rank "
        f"{m.peer} died, is stuck, or runs a different plan or step; check its log (and that "
        "every rank calls the model and loss.backward() every step)"
    )
