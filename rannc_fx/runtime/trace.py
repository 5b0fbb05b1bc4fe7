"""Record what this rank did in the traced steps; rank 0 merges every rank's record into one file.

A ``Recorder`` exists only when ``Config.trace_dir`` is set; without one the executor's loop
and the stage's waits take their untraced path (one ``None`` test per action). For the steps
``Config.trace_steps`` names (1-based; a step is a call with gradients, evaluation calls are
not steps) it keeps, per action of the lowered schedule, its start and end on this rank's
clock (``time.perf_counter_ns``; on CUDA the device is synchronized first, so an event ends
when its kernels do):

    compute     F, R, B of one micro-batch, from when its inputs are there to its end
    wait        the wait for a micro-batch's received inputs or gradients, inside F or B,
                before the compute event starts (so a rank's events never overlap)
    post        SCATTER, RECV_*, SEND_*: slicing and posting messages (they never wait)
    collective  GATHER (outputs home, the loss fan-out), REDUCE (gradient all-reduces), the
                per-call agreement on batch sizes, the gradient clipping's norm
    optimizer   ``optimizer.step()`` when rannc_fx was given the optimizer

Every waiting event names the ranks it waits for (``peers``) and what it matches on theirs
(``match``): the summary splits its time into bubble (before the last of those ranks started
the matching event) and communication (after), see ``tracefile``.

Clocks: at the first traced step rank 0 plays five ping-pongs with each other rank over the
process group and keeps the fastest; ``offset = t_peer - (t_send + t_back) / 2`` is exact to
within half that round trip, which the trace states. Rank 0 gathers the records (one
``gather_object``) after the last traced step's ``optimizer.step()``, or at the next call when
it does not see the optimizer, and writes ``trace_dir/trace.json``.
"""

from __future__ import annotations

import atexit
import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..plan.plan import Plan

__all__ = ["PINGS", "Recorder", "align_clocks"]

log = logging.getLogger("rannc_fx")

PINGS = 5  # ping-pongs per rank; the fastest one sets the offset


class Recorder:
    """This rank's events of the traced steps (``on`` while one is running)."""

    def __init__(
        self, steps: range, out_dir: Path, *, rank: int, world: int, stage: int, replica: int,
        device: torch.device,
    ) -> None:  # fmt: skip
        self.steps, self.out_dir = steps, Path(out_dir)
        self.rank, self.world, self.stage, self.replica = rank, world, stage, replica
        self.device = device
        self.sync = device.type == "cuda"
        self.step = 0  # calls with gradients so far
        self.on = False
        self.done = False  # written (or given up): nothing more to do, ever
        self.events: list[dict[str, Any]] = []
        self.starts: dict[int, int] = {}  # step -> when its call began
        self.plans: dict[int, tuple[Plan, str]] = {}  # step -> (plan it ran, schedule)
        self.clock: dict[str, Any] = {}
        self._open: int | None = None  # start of the optimizer step in progress
        self.path: Path | None = None
        if rank == 0:
            log.info("tracing steps %s into %s", _steps_text(steps), self.out_dir)
            atexit.register(self._unwritten)

    @property
    def others(self) -> list[int]:
        """Every rank but this one: the peers of a collective over the world."""
        return [r for r in range(self.world) if r != self.rank]

    # -- the clock -----------------------------------------------------------------------------
    def now(self) -> int:
        if self.sync:
            torch.cuda.synchronize(self.device)
        return time.perf_counter_ns()

    # -- calls and steps -----------------------------------------------------------------------
    def begin_call(self, grad: bool) -> None:
        """At the top of every call, on every rank (the same calls everywhere): counts steps,
        aligns the clocks before the first traced one, writes after the last."""
        if self.done:
            return
        if self.on and self.step == self.steps[-1]:
            self.write()  # the optimizer was not seen: the next call ends the last step
            return
        if grad:
            self.step += 1
        if grad and self.step == self.steps.start and not self.clock:
            self.clock = align_clocks(self.device)
        self.on = grad and self.step in self.steps
        if self.on:
            self.starts[self.step] = time.perf_counter_ns()

    def ran(self, plan: Plan, schedule: str) -> None:
        """The plan (re-split for this call's batch) and schedule the traced step ran."""
        if self.on:
            self.plans[self.step] = (plan, schedule)

    def event(self, name: str, cat: str, start: int, end: int, **args: Any) -> None:
        self.events.append(
            {"name": name, "cat": cat, "start": start, "end": end, "step": self.step, **args}
        )

    @contextmanager
    def span(self, name: str, cat: str, **args: Any) -> Iterator[None]:
        """An event around the body, when a traced step is on."""
        if not self.on:
            yield
            return
        t0 = self.now()
        yield
        self.event(name, cat, t0, self.now(), **args)

    # -- the optimizer -------------------------------------------------------------------------
    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.register_step_pre_hook(self._before_step)
        optimizer.register_step_post_hook(self._after_step)

    def _before_step(self, *_: Any) -> None:
        if self.on:
            self._open = self.now()

    def _after_step(self, *_: Any) -> None:
        if self.on and self._open is not None:
            self.event("optimizer step", "optimizer", self._open, self.now(), peers=[])
            self._open = None
            if self.step == self.steps[-1]:
                self.write()

    # -- the file ------------------------------------------------------------------------------
    def part(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "stage": self.stage, "replica": self.replica,
            "events": self.events, "starts": self.starts,
        }  # fmt: skip

    def write(self) -> None:
        """Gather every rank's events on rank 0 and write the merged trace (a collective)."""
        from .tracefile import build_trace, format_summary, summarize

        self.on, self.done = False, True
        parts: list[Any] = [None] * self.world
        if self.world > 1:
            dist.gather_object(self.part(), parts if self.rank == 0 else None, dst=0)
        else:
            parts = [self.part()]
        if self.rank != 0:
            return
        try:
            trace = build_trace(parts, self.clock, self.plans)
            self.out_dir.mkdir(parents=True, exist_ok=True)
            path = self.out_dir / "trace.json"
            path.write_text(json.dumps(trace))
        except (OSError, ValueError) as e:  # a trace that cannot be written must not stop training
            log.warning("rannc_fx: could not write the trace to %s: %s", self.out_dir, e)
            return
        self.path = path
        log.info("trace of steps %s written to %s", _steps_text(self.steps), self.path)
        print(format_summary(summarize(trace)) + f"\ntrace: {self.path}", flush=True)


    def _unwritten(self) -> None:
        """At exit, on rank 0: say why a requested trace is missing (no collective now)."""
        if self.done:
            return
        why = (
            f"the run ended at step {self.step}, before step {self.steps[-1]}"
            if self.step < self.steps[-1]
            else "the last traced step was followed by no optimizer.step() rannc_fx saw "
            "(compile(model, optimizer)) and no further call"
        )
        log.warning("rannc_fx: no trace written to %s: %s; trace steps the run reaches "
                    "(Config.trace_steps, now %r)", self.out_dir, why, _steps_text(self.steps))


def _steps_text(steps: range) -> str:
    return str(steps.start) if len(steps) == 1 else f"{steps.start}-{steps[-1]}"


def align_clocks(device: torch.device) -> dict[str, Any]:
    """Each rank's clock offset to rank 0's (ns) and its uncertainty, known on rank 0.

    Rank 0 sends its time to rank r, which answers with its own; of ``PINGS`` round trips the
    fastest gives ``offset = t_r - (t0 + t2) / 2``, exact to within half its round trip.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    offsets, halves = {0: 0}, {0: 0}
    buf = torch.zeros(1, dtype=torch.int64, device=device)
    for peer in range(1, world):
        best: tuple[int, int] | None = None  # (round trip, offset)
        for _ in range(PINGS):
            if rank == 0:
                t0 = time.perf_counter_ns()
                dist.send(buf, peer)
                dist.recv(buf, peer)
                t2 = time.perf_counter_ns()
                trip, off = t2 - t0, int(buf.item()) - (t0 + t2) // 2
                if best is None or trip < best[0]:
                    best = (trip, off)
            elif rank == peer:
                dist.recv(buf, 0)
                buf.fill_(time.perf_counter_ns())
                dist.send(buf, 0)
        if best is not None:
            offsets[peer], halves[peer] = best[1], best[0] // 2
    return {
        "method": f"ping-pong with rank 0 over the process group, fastest of {PINGS}; "
        "offset = t_rank - (t_send + t_back) / 2, exact to within half the round trip",
        "offset_ns": offsets,
        "uncertainty_ns": halves,
    }
