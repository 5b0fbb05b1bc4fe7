"""A rank that raises inside a call or ``loss.backward()`` ends the step on every rank at once
(``runtime/failures.py``), and the next call trains as if the failed one never ran. The board
alone: ``unit/test_failures.py``."""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest
import torch

from examples.models import gpt_example
from tests.harness import Run, train_against_reference

TOL = dict(rtol=1e-5, atol=1e-5)
LOCAL = 4  # samples per rank
VOCAB = 256


def _batch(world: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (LOCAL * world, 16), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def _spoil(what: str, ids: torch.Tensor, labels: torch.Tensor) -> tuple[Any, ...]:
    """A batch that fails where ``what`` says: token ids past the embedding (stage 0), or
    labels past the classes (the loss, in the last stage)."""
    if what == "ids":
        return ids + VOCAB, labels
    return ids, labels + VOCAB


def _gpt() -> torch.nn.Module:
    return gpt_example(batch=2, seq=16)[0]


def _labelled(world: int, step: int) -> tuple[tuple[torch.Tensor], dict[str, torch.Tensor]]:
    ids, labels = _batch(world, seed=step)
    return (ids,), {"labels": labels}


def _run(case: str, run: Run) -> list[str]:
    """4 steps, the second failing as ``case`` says on some rank (the reference skips it);
    what each rank raised."""
    rank, world, cm, ref, opt, ref_opt = run.rank, run.world, run.cm, run.ref, run.opt, run.ref_opt
    mine = slice(rank * LOCAL, (rank + 1) * LOCAL)
    raised: list[str] = []
    hook = None
    for step in range(4):
        ids, labels = _batch(world, seed=step + 1)
        bad = step == 1
        x, y = ids[mine], labels[mine]
        if bad and case.startswith("bad "):
            who = case.split()[2]  # "every", or the one rank that passes the bad batch
            if who == "every" or int(who) == rank:
                x, y = _spoil(case.split()[1], x, y)
        if bad and case == "backward" and rank == world - 1:
            p = next(iter(cm.stages[0].parameters()))
            hook = p.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("hook failed")))
        try:
            if bad and case == "structure 1" and rank == 1:
                out = cm(x, y)  # labels by position: not the structure the model was planned for
            else:
                out = cm(x, labels=y)
            out["loss"].backward()
            opt.step()
        except Exception as e:
            assert bad, f"step {step} raised: {e}"
            raised.append(f"{type(e).__name__}: {e}")
            # nothing of the failed step reached .grad (every step starts with none)
            held = [n for st in cm.stages for n, p in st.named_parameters() if p.grad is not None]
            assert not held, held
            if hook is not None:
                hook.remove()
            continue
        finally:
            opt.zero_grad()
        assert not bad, "the bad step ran"
        want = ref(ids, labels=labels)  # the reference skips the bad batch
        want["loss"].backward()
        ref_opt.step()
        ref_opt.zero_grad()
        run.compare(out, want)
    return raised


CASES = [
    # (case, world, config, what the rank that fails raises, what the others raise)
    ("bad ids every", 2, dict(replicas=(1, 1), micro_batches=2, schedule="gpipe"),
     r"IndexError: index out of range",
     r"PeerFailed: rank 1 stopped .*rank 0 \(stage 0\) raised IndexError in its forward"),
    ("bad ids 1", 2, dict(replicas=(1, 1), micro_batches=2, schedule="1f1b"),
     r"IndexError: index out of range", r"rank 0 \(stage 0\) raised IndexError in its forward"),
    ("bad labels 0", 3, dict(replicas=(2, 1), micro_batches=2, schedule="1f1b"),
     r"IndexError: Target \d+ is out of bounds",
     r"rank 2 \(stage 1\) raised IndexError in its forward"),
    ("bad labels 1 interleaved", 2, dict(replicas=(1, 1), micro_batches=2,
                                       schedule="interleaved"),
     r"IndexError: Target \d+ is out of bounds",
     r"rank 1 \(stages 1, 3\) raised IndexError in its forward"),
    ("structure 1", 2, dict(replicas=(1, 1), micro_batches=2, schedule="1f1b"),
     r"ValueError: .*", r"rank 1 \(stage 1\) raised ValueError in its call"),
    ("backward", 2, dict(replicas=(1, 1), micro_batches=2, schedule="gpipe"),
     r"RuntimeError: hook failed", r"rank 1 \(stage 1\) raised RuntimeError in its backward"),
]


@pytest.mark.parametrize("case,world,cfg,own,peer", CASES, ids=[c[0] for c in CASES])
def test_a_failure_in_a_step_ends_it_on_every_rank_and_the_next_call_trains(
    case, world, cfg, own, peer
):
    # wall_s far below the 60 s timeout: no rank waits for the one that failed
    # every parameter against one process's (which skipped the bad step) at the end
    results = [t.extra for t in train_against_reference(
        _gpt, cfg, world, data=functools.partial(_labelled, world),
        loop=functools.partial(_run, case), timeout_s=60.0, wall_s=40.0)]
    failing = [r for r, msgs in enumerate(results) if any(re.search(own, m) for m in msgs)]
    assert failing, results
    for rank, msgs in enumerate(results):
        assert len(msgs) == 1, (rank, msgs)  # the bad step, once; every later one trains
        if rank not in failing:
            assert msgs[0].startswith("PeerFailed") and re.search(peer, msgs[0]), msgs[0]
            assert "next call starts over" in msgs[0]
