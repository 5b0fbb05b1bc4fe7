"""What one step keeps between a stage's actions (``StageRunner`` reads and writes it; the
executor makes one per stage of its rank each step and finishes what is left at the end)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..schedules.routing import Transfer
from .backward_split import SavedBoxes, WeightWork
from .p2p import Pending

__all__ = ["StepState"]

_Received = tuple[Pending, dict[Transfer, torch.Tensor]]


@dataclass
class StepState:
    """Everything one step holds between actions, per micro-batch where it is per micro-batch.

    ``grad``: the step keeps what a backward needs. ``held``: its backwards run in the call
    and their gradients wait for ``loss.backward()``. ``sync``: its call was made outside
    ``model.no_sync()``, and its ``REDUCE`` sums over ranks; ``late``: that sum waits for
    ``loss.backward()`` (``accumulation``). ``seeds``: stage output position -> the
    gradient that reaches it from the caller (scaled by each micro-batch's share in B).
    """

    index: int
    grad: bool
    local: list[Any]
    held: bool = False
    sync: bool = True
    late: bool = False
    seeds: dict[int, torch.Tensor] = field(default_factory=dict)
    inputs: list[_Received] = field(default_factory=list)  # per micro-batch (SCATTER)
    cut_recv: dict[int, list[_Received]] = field(default_factory=dict)  # a receive action each
    grad_recv: dict[int, list[_Received]] = field(default_factory=dict)
    args: dict[int, list[Any]] = field(default_factory=dict)
    outs: dict[int, tuple[Any, ...]] = field(default_factory=dict)  # for the backward
    model_outs: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # for GATHER
    # the local batch of each batched model output, this rank's own rows in it (``home``)
    assembled: dict[int, torch.Tensor] = field(default_factory=dict)
    rng: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)
    sends: list[Pending] = field(default_factory=list)
    # each send by ("F" or "B", micro-batch), so the executor can wait for it mid-step
    # (``schedules/release.py``); the rest are waited at the step's end
    sent: dict[tuple[str, int], Pending] = field(default_factory=dict)
    reduced: dict[int, torch.Tensor] = field(default_factory=dict)  # share-weighted losses
    results: dict[int, Any] = field(default_factory=dict)  # model outputs, after GATHER
    backwards: int = 0
    # the tail (runtime/tail.py): this replica's rows of its inputs per micro-batch, its
    # inputs and outputs for the backward, its outputs until sent, its inputs' gradients' rows
    tail_in: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    tail: tuple[list[Any], tuple[Any, ...]] | None = None
    tail_out: dict[int, torch.Tensor] = field(default_factory=dict)
    tail_grads: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    # micro-batches whose backward is split (the list has a W for them), their forwards'
    # saved tensors (B drops those its W does not read), and what each B keeps for its W
    split: frozenset[int] = frozenset()
    saved: dict[int, SavedBoxes] = field(default_factory=dict)
    weight_work: dict[int, WeightWork] = field(default_factory=dict)
    # stage -> its state, for every stage this rank runs (the main stage's is this one)
    parts: dict[int, StepState] = field(default_factory=dict)

    def finish_sends(self) -> None:
        for p in self.sends:
            p.wait()
        self.sends.clear()
        self.sent.clear()

    def finish_send(self, what: str, i: int) -> None:
        """Wait for micro-batch i's sends of ``what`` ("F": cut values, "B": gradients), if
        still pending: their tensors are freed now rather than at the step's end. Called at
        the sends' release points, where every receiver has posted its receive
        (``release.py``): waited in place."""
        pending = self.sent.pop((what, i), None)
        if pending is not None:
            pending.wait_posted()
            self.sends.remove(pending)
