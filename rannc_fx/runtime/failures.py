"""When one rank fails inside a step, every rank stops at once: a board in the c10d store.

A rank whose call or ``loss.backward()`` raises posts what failed (its rank, its stage, the
exception's type and message) on the board: a counter and a message in the job's c10d store,
which every rank reaches without its peers. Every wait of the runtime on gloo that a peer
could leave unfinished (a message, an all-reduce, the per-call agreement) reads the board
every ``CHECK_S`` while it waits; when the board shows a failure the rank has not seen, it
abandons its step and raises ``PeerFailed`` naming the rank that failed, its stage and its
exception. So no rank waits for a peer that has already failed, and none needs that peer to
tell it. (A send waited at its release point, whose receiver has already posted the receive,
completes whatever that peer does next: it is waited in place, ``p2p.Pending.wait_posted``.)::

    rank 0   F0 ✗ IndexError ── post(rank 0, stage 0, IndexError) ──▶ store
    rank 1   RECV_F 0 … waits, reads the board every CHECK_S ──────── PeerFailed(rank 0)

An abandoned step leaves messages in flight in its communicators. So every rank that raised
starts its next call by making fresh ones (``BatchSizes``: every rank calls ``new_group``
again, the old groups aborted), and the next call trains as if the failed one never ran: a
step's gradients reach ``.grad`` only once all its backwards are done.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

__all__ = [
    "CHECK_S", "Board", "PeerFailed", "StoreLost", "board", "raised_everywhere", "settle",
    "store_host",
]

CHECK_S = 0.005  # how often a waiting rank reads the board (one store round trip, ~20 us)
ROLL_CALL_S = 1.0  # how long a roll call waits for every rank to answer
ANSWER_AFTER_S = 0.05  # a wait answers roll calls once it has lasted this long


class PeerFailed(RuntimeError):
    """Another rank raised inside this step; this rank abandoned its part of it."""

    def __init__(self, message: str, rank: int, failures: int):
        super().__init__(message)
        self.rank, self.failures = rank, failures


class StoreLost(RuntimeError):
    """The job's c10d store stopped answering: the process that hosts it died."""


def store_host() -> str:
    """Who hosts the job's c10d store: torchrun's agent on the first node, else rank 0."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return "torchrun's agent on the first node"
    return "rank 0"


class Board:
    """The job's failures in the c10d store: ``count`` and one message per failure.

    It also takes the roll call that names the rank a failed wait lost: the rank whose wait
    failed without a failure posted (a connection closed, a timeout) asks every rank to
    answer, every rank in a wait of over ``ANSWER_AFTER_S`` answers within ``CHECK_S``, and
    the ranks that do not answer within ``ROLL_CALL_S`` are named (a rank that died, or hangs outside the
    runtime). When the store itself stops answering, its host is the rank lost."""

    def __init__(self, store: dist.Store):
        self.store = dist.PrefixStore("rannc_fx/failures/", store)
        self.answered = 0  # the roll calls this rank has answered
        self.seen = self.count()  # the failures this rank has acted on

    def _ask(self, what: str, op: Callable[[], Any]) -> Any:
        try:
            return op()
        except (RuntimeError, OSError) as e:
            first = (str(e).strip().splitlines() or [""])[0][:200]
            raise StoreLost(
                f"rank {_rank()}: the job's c10d store, which {store_host()} hosts, stopped "
                f"answering {what} ({type(e).__name__}: {first}): {store_host()} died or "
                "its host is unreachable; the job cannot go on"
            ) from None

    def count(self) -> int:
        return int(self._ask("reading the failure board", lambda: self.store.add("count", 0)))

    def answer(self) -> None:
        """Answer every roll call taken since the last one this rank answered."""
        n = int(self._ask("a roll call", lambda: self.store.add("rollcall", 0)))
        while self.answered < n:
            self.answered += 1
            key = f"alive/{self.answered}/{_rank()}"
            self._ask("a roll call", lambda key=key: self.store.set(key, "1"))  # type: ignore[misc]

    def roll_call(self, world: int, timeout_s: float = 0.0) -> list[int]:
        """The ranks that do not answer a roll call within ``timeout_s`` (``ROLL_CALL_S``)."""
        timeout_s = timeout_s or ROLL_CALL_S
        n = int(self._ask("a roll call", lambda: self.store.add("rollcall", 1)))
        deadline = time.monotonic() + timeout_s
        while True:
            self.answer()
            keys = {r: f"alive/{n}/{r}" for r in range(world) if r != _rank()}
            missing = [r for r, key in keys.items() if not self._ask(
                "a roll call", lambda key=key: self.store.check([key]))]  # type: ignore[misc]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(CHECK_S)

    def post(self, rank: int, stage: int | tuple[int, ...], error: BaseException,
             during: str) -> None:
        """Tell every rank that ``rank`` (running stage ``stage``, or a lane's stages) raised
        ``error`` ``during`` what, once per error, and none for a ``PeerFailed`` or an error
        ``raised_everywhere``."""
        if isinstance(error, PeerFailed) or getattr(error, _NOTED, False):
            return
        stages = (stage,) if isinstance(stage, int) else stage
        where = (f"stage {stages[0]}" if len(stages) == 1
                 else f"stages {', '.join(map(str, stages))}")
        text = f"rank {rank} ({where}) raised {type(error).__name__} {during}: {error}"
        try:
            n = int(self._ask("posting a failure", lambda: self.store.add("count", 1)))
            self._ask("posting a failure", lambda: self.store.set(str(n), text))
        except StoreLost as lost:  # the error stands; the others cannot be told
            error.add_note(f"rannc_fx: {lost}")
            _mark(error)
            return
        self.seen = n
        _mark(error)
        error.add_note(f"rannc_fx: rank {rank} told the other ranks, which stop this step too; "
                       "the next call starts over on fresh communicators")

    def raise_news(self, what: str, finished: Callable[[], bool] | None = None, *,
                   answer: bool = True) -> None:
        """PeerFailed for the newest failure on the board, if this rank has not seen it,
        unless ``finished()`` says the wait it interrupts completed after all (a peer that
        left the same collective and failed in its next call: its news is for this rank's
        next wait, not this one). With ``answer``, it answers the open roll calls too."""
        n = self.count()
        if answer:
            self.answer()
        if n > self.seen and not (finished is not None and finished()):
            self.seen = n
            text = self._ask("reading the failure board", lambda: self.store.get(str(n))).decode()
            rank = int(text.split()[1])
            raise PeerFailed(
                f"rank {_rank()} stopped {what}: {text}. Every rank raises in this call; the "
                "next call starts over on fresh communicators (nothing of this step reached "
                ".grad), so skipping the batch and going on works",
                rank, n,
            )

    def wait(self, works: Sequence[Any], what: Callable[[int], str], *, timeout_s: float,
             on_error: Callable[[int, RuntimeError], Exception]) -> None:
        """Finish ``works`` (``dist.Work``) in order, reading the board every ``CHECK_S``.

        gloo's point-to-point works can be neither polled nor aborted (``is_completed``
        stays False; ``abort`` does not wake a wait), so a waiter thread blocks in their
        ``wait()`` and this rank waits on that thread, with a timeout to read the board: one
        hand-over for the whole batch. A wait abandoned for a failure keeps its thread until
        the group's own timeout; a new waiter takes over. ``what(i)`` says what work ``i``
        is, for the messages; ``on_error(i, e)`` turns work ``i``'s error into the one to
        raise; after ``timeout_s`` with neither the works done nor a failure posted, that
        is a timeout of the work still waited on.
        """
        job = _waiter().submit(works)
        start = time.monotonic()
        while not job.wait(CHECK_S):
            try:
                # a wait of a step's usual length costs one store round trip a check; one
                # that lasts (a peer lost, a roll call open) answers roll calls too
                self.raise_news(what(job.current), finished=job.succeeded,
                                answer=time.monotonic() - start > ANSWER_AFTER_S)
            except PeerFailed:
                _abandon(job)
                raise
            if time.monotonic() - start > timeout_s:
                _abandon(job)
                raise on_error(job.current, RuntimeError(
                    f"Timed out after {timeout_s:g} s (Config.timeout_s) with no failure "
                    f"posted by another rank{self._lost()}"))
        error = job.error
        if isinstance(error, _WorkFailed):
            self.raise_news(what(error.index))  # a peer's failure explains a closed pair best
            lost = self._lost()
            raise on_error(error.index, RuntimeError(f"{error.error}{lost}") if lost
                           else error.error) from error.error
        if error is not None:
            raise error


    def _lost(self) -> str:
        """``; rank 1 did not answer ...`` naming the ranks a roll call finds gone, or ""."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        missing = self.roll_call(world)
        if not missing:
            return ""
        who = ", ".join(map(str, missing))
        return (f"; rank{'s' if len(missing) > 1 else ''} {who} did not answer the failure "
                f"board's roll call within {ROLL_CALL_S:g} s: "
                f"{'they' if len(missing) > 1 else 'it'} died (or hang outside rannc_fx)")


class _WorkFailed(Exception):
    def __init__(self, index: int, error: RuntimeError):
        super().__init__(str(error))
        self.index, self.error = index, error


class _Job:
    """A batch of works handed to the waiter: ``current`` is the one it waits on. Its latch
    is a plain lock, held until the waiter is done (a ``Future``'s condition costs more per
    hand-over, and a step makes dozens)."""

    __slots__ = ("works", "current", "error", "_latch")

    def __init__(self, works: Sequence[Any]) -> None:
        self.works, self.current = works, 0
        self.error: BaseException | None = None
        self._latch = threading.Lock()
        self._latch.acquire()

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self._latch.release()

    def wait(self, timeout: float) -> bool:
        """Whether the waiter is done, waiting up to ``timeout`` seconds for it."""
        if self._latch.acquire(timeout=timeout):
            self._latch.release()  # done stays done
            return True
        return False

    def succeeded(self) -> bool:
        return not self._latch.locked() and self.error is None


class _Waiter:
    """A daemon thread that runs ``wait()`` on the works it is handed, one batch at a time."""

    def __init__(self) -> None:
        self.pid = os.getpid()  # a forked child has the object but not the thread
        self._queue: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="rannc_fx-waiter", daemon=True).start()

    def submit(self, works: Sequence[Any]) -> _Job:
        job = _Job(works)
        self._queue.put(job)
        return job

    def _run(self) -> None:
        while True:
            self._finish(self._queue.get())

    @staticmethod
    def _finish(job: _Job) -> None:
        """Wait on the job's works, then drop them: a work holds its tensors (an all-gather's
        buffers, a step's last messages), which must not live on until the next job."""
        error: BaseException | None = None
        try:
            for i, w in enumerate(job.works):
                job.current = i
                w.wait()
        except RuntimeError as e:
            error = _WorkFailed(job.current, e)
        except BaseException as e:
            error = e
        finally:
            job.works = ()
            job.finish(error)


_WAITER: list[_Waiter] = []


def _waiter() -> _Waiter:
    if not _WAITER or _WAITER[0].pid != os.getpid():
        _WAITER[:] = [_Waiter()]
    return _WAITER[0]


_STUCK: list[_Job] = []  # waits abandoned for a failure, until their works end


def _abandon(job: _Job) -> None:
    """The current waiter is stuck on works that may never finish: start another."""
    _STUCK.append(job)
    _WAITER.clear()


def settle(timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for the waits abandoned for a failure to end, and say
    whether they all did. Such a wait ends when its peer lets go of the group (at its next
    call, ``BatchSizes._recover``, or when its process exits); a thread still blocked in
    one when the interpreter finalizes aborts the process ("terminate called without an
    active exception"), so the exit waits for them first (``comm.clean_exit``)."""
    deadline = time.monotonic() + timeout_s
    while _STUCK:
        if not _STUCK[0].wait(max(0.0, deadline - time.monotonic())):
            return False
        _STUCK.pop(0)
    return True


_NOTED = "_rannc_fx_noted"  # on an exception the board has, or that every rank raised


def _mark(error: BaseException) -> None:
    try:
        setattr(error, _NOTED, True)
    except AttributeError:  # an exception type that takes no attributes: post it again
        pass


def raised_everywhere(error: BaseException) -> BaseException:
    """``error``, marked as raised by every rank at once (a refusal after the per-call
    agreement): nothing to post, nothing left in flight."""
    _mark(error)
    return error


_BOARD: dict[tuple[int, int], Board] = {}  # (process, store) -> its board


def board() -> Board | None:
    """This process's board (one per job: the default group's store); None alone."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    store = dist.distributed_c10d._get_default_store()
    key = (os.getpid(), id(store))
    if key not in _BOARD:
        _BOARD.clear()
        _BOARD[key] = Board(store)
    return _BOARD[key]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
