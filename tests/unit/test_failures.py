"""The failure board (``runtime/failures.py``) in one process: a wait ends with the failure
another rank posts, news of a later call does not fail a wait that finished, errors are posted
once. On ranks: ``distributed/test_failures.py``."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import rannc_fx
from rannc_fx.runtime.failures import Board, PeerFailed, raised_everywhere


def test_peer_failed_is_public_and_a_runtime_error():
    assert rannc_fx.PeerFailed is PeerFailed and issubclass(PeerFailed, RuntimeError)


class _Work:
    """A work whose ``wait()`` blocks until ``done`` is set (or raises ``error``)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.done, self.error = threading.Event(), error

    def wait(self) -> bool:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return True


def _board() -> Board:
    import torch.distributed as dist

    return Board(dist.HashStore())


def test_a_wait_ends_with_the_failure_another_rank_posts():
    import torch.distributed as dist

    store = dist.HashStore()
    board, other = Board(store), Board(store)  # two ranks' views of the job's store
    work = _Work()
    threading.Timer(0.05, lambda: other.post(3, 1, IndexError("index out of range"),
                                             "in its forward")).start()
    t0 = time.monotonic()
    with pytest.raises(PeerFailed, match=r"rank 0 stopped waiting for h: rank 3 \(stage 1\) "
                                         r"raised IndexError in its forward: index out of range"):
        board.wait([work], lambda i: "waiting for h", timeout_s=30,
                   on_error=lambda i, e: RuntimeError(e))
    assert time.monotonic() - t0 < 1.0
    work.done.set()  # the abandoned wait's thread ends when the work does
    assert board.seen == other.seen == board.count() == 1  # both have acted on it


def test_news_from_a_peer_s_next_call_does_not_fail_a_wait_that_finished():
    """A peer leaves the collective this rank waits on, fails in its next call and posts it;
    this rank reads the board after its works finished: the wait returns, and the news is
    raised at the next one (the peer's next call's)."""
    import torch.distributed as dist

    store = dist.HashStore()
    board, other = Board(store), Board(store)
    work = _Work()
    read = board.count

    def late_read() -> int:  # the works finish, and the peer posts, while this rank reads
        if not work.done.is_set():
            work.done.set()
            other.post(1, (1, 3), IndexError("bad labels"), "in its forward")
            time.sleep(0.05)
        return read()

    board.count = late_read  # type: ignore[method-assign]
    board.wait([work], lambda i: "waiting for h", timeout_s=30,
               on_error=lambda i, e: RuntimeError(e))
    assert board.seen == 0 and read() == 1  # not acted on yet
    never = _Work()
    try:
        with pytest.raises(PeerFailed, match=r"rank 1 \(stages 1, 3\) raised IndexError"):
            board.wait([never], lambda i: "waiting for the next call", timeout_s=30,
                       on_error=lambda i, e: RuntimeError(e))
    finally:
        never.done.set()  # the abandoned wait ends (else the exit waits for it: settle)


def test_a_wait_returns_when_its_works_finish_and_times_out_when_nothing_does():
    board = _board()
    works = [_Work(), _Work()]
    threading.Timer(0.02, works[0].done.set).start()
    threading.Timer(0.04, works[1].done.set).start()
    board.wait(works, lambda i: "w", timeout_s=30, on_error=lambda i, e: RuntimeError(e))
    never = _Work()
    try:
        with pytest.raises(KeyError, match="work 1: Timed out after 0.05 s"):
            board.wait([works[0], never], lambda i: "w", timeout_s=0.05,
                       on_error=lambda i, e: KeyError(f"work {i}: {e}"))
    finally:
        never.done.set()  # the abandoned wait ends (else the exit waits for it: settle)
    failing = _Work(RuntimeError("Connection closed by peer"))
    failing.done.set()
    with pytest.raises(KeyError, match="work 2: Connection closed by peer"):
        board.wait([works[0], works[1], failing], lambda i: "w", timeout_s=30,
                   on_error=lambda i, e: KeyError(f"work {i}: {e}"))


def test_a_released_send_is_waited_in_place_and_its_error_read_against_the_board():
    """A send waited at its release point blocks this thread itself (its receiver has posted
    the receive); a closed pair is ``PeerFailed`` where a peer posted its failure, else a
    ``CommError`` naming the peer."""
    import torch.distributed as dist

    from rannc_fx.runtime.comm import CommError, Groups
    from rannc_fx.runtime.p2p import Message, Pending

    store = dist.HashStore()
    board, other = Board(store), Board(store)
    groups = Groups([], [], [], [], board=board)
    done = _Work()
    done.done.set()
    waited_by = []
    done_wait = done.wait
    done.wait = lambda: waited_by.append(threading.current_thread()) or done_wait()
    msg = Message("send", torch.zeros(2), 1, "cut value 'h' of micro-batch 0")
    Pending([msg], [done], groups).wait_posted()
    assert waited_by == [threading.current_thread()]  # no hand-over to the waiter
    closed = _Work(RuntimeError("Connection closed by peer"))
    closed.done.set()
    with pytest.raises(CommError, match=r"send of cut value 'h' of micro-batch 0 to rank 1"):
        Pending([msg], [closed], groups).wait_posted()
    other.post(1, 1, IndexError("bad labels"), "in its forward")
    with pytest.raises(PeerFailed, match=r"rank 1 \(stage 1\) raised IndexError"):
        Pending([msg], [closed], groups).wait_posted()


def test_an_error_is_posted_once_and_refusals_every_rank_made_not_at_all():
    board = _board()
    e = ValueError("bad")
    board.post(0, 0, e, "in its call")
    board.post(0, 0, e, "in its call")  # the executor posted it; the call's wrapper again
    board.post(0, 0, raised_everywhere(ValueError("refused")), "in its call")
    board.post(0, 0, PeerFailed("x", 1, 1), "in its call")
    assert board.count() == 1 and "told the other ranks" in e.__notes__[0]
