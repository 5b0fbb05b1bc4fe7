"""Optimizer state in host memory: between steps a parameter's optimizer state (its moments)
lives on the host; the step brings a bucket of parameters' state to the device, steps those
parameters, and puts it back, so the device never holds more than a bucket of it.

The user's optimizer object still steps: ``step_in_buckets`` calls its unhooked ``step`` once
a bucket with only that bucket's gradients set (an optimizer skips a parameter without a
gradient), from the step's pre-hook (``zero.OptimizerShard``), so the user's ``step()``
itself then finds no gradient and changes nothing. A closure cannot be re-run a bucket at a
time, so a step with one is refused; other keyword arguments reach every bucket's step (a
fused optimizer reads ``GradScaler``'s ``grad_scale`` and ``found_inf`` off itself, so
every bucket's step unscales and skips as the whole step would). Scalars (Adam's step count) stay where the optimizer
keeps them. On a CUDA device the host copies are pinned; on the CPU host and device are the
same memory and the copies change nothing but run the same logic.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from . import comm
from .comm import buckets

__all__ = ["HostState"]


class HostState:
    """The host side of the offloaded parameters' optimizer state."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter]):
        self.optimizer = optimizer
        self.params = list(params)
        self.host = torch.device("cpu")
        self._pin = any(p.device.type == "cuda" for p in self.params)
        self._bufs: dict[tuple[int, str], torch.Tensor] = {}  # the host copies, kept

    def check(self, args: Any, kwargs: Any) -> None:
        """Refuse a step (its pre-hook's ``args``, self first, and ``kwargs``) that cannot
        run a bucket at a time: one with a closure, or of an optimizer without a torch.optim
        step."""
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if closure is not None:
            raise ValueError(
                "optimizer.step() got a closure, but the optimizer state is offloaded to host "
                "memory and steps a bucket of parameters at a time: a closure (LBFGS) cannot be "
                "re-run per bucket; use Config(offload=False)"
            )
        if getattr(type(self.optimizer).step, "__wrapped__", None) is None:
            raise TypeError(f"{type(self.optimizer).__name__}.step is not a torch.optim "
                            "step: its state cannot be offloaded; use Config(offload=False)")

    def step_in_buckets(self, grads: dict[int, torch.Tensor | None], kwargs: Any) -> None:
        """Step the parameters with a gradient in ``grads`` (by id; their ``.grad`` is None
        now), a bucket at a time, their state on the device only for their bucket's step
        (``check`` passed)."""
        step = type(self.optimizer).step.__wrapped__  # type: ignore[attr-defined]  # hooks
        todo = [p for p in self.params if grads.get(id(p)) is not None]
        for bucket in buckets(todo, comm.BUCKET_BYTES):
            for p in bucket:
                p.grad = grads[id(p)]
                self._to(p, p.device)
            try:
                step(self.optimizer, **kwargs)
            finally:
                for p in bucket:
                    self._to(p, self.host)
                    p.grad = None

    def settle(self) -> None:
        """Put every offloaded parameter's state on the host (after ``load_state_dict``,
        which puts it on the parameter's device)."""
        for p in self.params:
            self._to(p, self.host)

    def _to(self, p: nn.Parameter, where: torch.device) -> None:
        state = self.optimizer.state.get(p)
        if not state:
            return
        for k, v in state.items():
            if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.device == where:
                continue
            key = (id(p), k)
            if where == self.host:
                buf = self._bufs.get(key)
                if buf is None or buf.shape != v.shape or buf.dtype != v.dtype:
                    buf = torch.empty(v.shape, dtype=v.dtype, pin_memory=self._pin)
                    self._bufs[key] = buf
                state[k] = buf.copy_(v)
            else:
                self._bufs[key] = v
                state[k] = v.to(where, non_blocking=True)
