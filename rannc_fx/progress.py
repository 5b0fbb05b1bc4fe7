"""What planning says while it runs: one line per pass, and progress while a pass runs long.

Planning a 100 B model takes minutes, and a silent minute looks like a hang. Each pass opens
a ``Progress``, reports through it while it works, and closes with its one line::

    p = Progress("profile", total=len(ops))
    for i, op in enumerate(ops):
        ...
        p.update(i + 1, "ops (%d measured)", measured)    # at most one line per EVERY_S
    p.done("profiled %d ops in %.2f s", len(ops), p.seconds)

which logs, at INFO on the ``rannc_fx`` logger::

    profile: 1830/4211 ops (612 measured), 12.4 s
    profile: 3650/4211 ops (1104 measured), 22.4 s
    profiled 4211 ops in 26.80 s

A pass with no loop to report from (torch.export is one call) runs in ``with
Progress(name, doing="tracing")``: a daemon thread then logs ``capture: tracing, 12.0 s``
until the block ends. Rate limiting reads a clock, so ``update`` in a per-op loop costs one
``time.monotonic()`` call; the first line comes after ``FIRST_S``, then one per ``EVERY_S``
(module constants, read at each use, so tests can lower them).

Under torch.distributed with more than one rank every rank may run the same passes (each
captures and splits the model under ``compile()``; a script may call ``partition()`` on
every rank), so only rank 0 says what they do: elsewhere INFO lines and progress are dropped,
while warnings are kept (a rank's own trouble is worth its lines).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from types import TracebackType

import torch.distributed as dist

__all__ = ["EVERY_S", "FIRST_S", "Progress", "is_rank_zero", "note"]

FIRST_S = 5.0  # a pass quicker than this prints no progress at all
EVERY_S = 10.0  # then a line this often: enough to show it moves, few enough to read

log = logging.getLogger("rannc_fx")


def is_rank_zero() -> bool:
    """Whether this process speaks for the job: rank 0 of the process group, or of torchrun's
    ``RANK`` before the group exists, or any process outside torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def note(msg: str, *args: object, level: int = logging.INFO) -> None:
    """Log one line as ``log.log`` does, except INFO and below on a rank other than 0."""
    if level >= logging.WARNING or is_rank_zero():
        log.log(level, msg, *args)


class Progress:
    """One pass's progress lines and its closing line (see the module docstring).

    ``name`` prefixes progress lines; ``total`` is the default denominator of ``update``;
    ``doing`` starts the background ticker when used as a context manager; ``clock`` is
    injectable for tests.
    """

    def __init__(
        self,
        name: str,
        *,
        total: int | None = None,
        doing: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name, self.total, self.doing = name, total, doing
        self._clock = clock
        self._start = clock()
        self._next = self._start + FIRST_S
        self._speaks = is_rank_zero()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    @property
    def seconds(self) -> float:
        """Time since the pass started, for its closing line."""
        return self._clock() - self._start

    def update(self, done: int, what: str = "", *args: object, total: int | None = None) -> None:
        """Log ``name: done/total what % args, N s`` if a line is due (formatted only then)."""
        if not self._speaks:
            return
        now = self._clock()
        if now < self._next:
            return
        self._next = now + EVERY_S
        total = self.total if total is None else total
        count = f"{done}/{total}" if total is not None else str(done)
        text = what % args if args else what
        log.info("%s: %s%s, %.1f s", self.name, count, f" {text}" if text else "",
                 now - self._start)

    def done(self, msg: str, *args: object, level: int = logging.INFO) -> None:
        """The pass's one line (INFO and below on rank 0 only, like ``note``)."""
        self._stop.set()
        if level >= logging.WARNING or self._speaks:
            log.log(level, msg, *args)

    # -- the ticker, for a pass that cannot call update ----------------------------------------

    def __enter__(self) -> Progress:
        if self.doing is not None and self._speaks:
            self._ticker = threading.Thread(
                target=self._tick, name=f"rannc_fx {self.name} progress", daemon=True
            )
            self._ticker.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None

    def _tick(self) -> None:
        wait = FIRST_S
        while not self._stop.wait(wait):
            log.info("%s: %s, %.1f s", self.name, self.doing, self.seconds)
            wait = EVERY_S
