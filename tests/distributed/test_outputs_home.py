"""Batched model outputs go home as each forward ends: the rows a replica keeps (its own local
batch's) are written into that batch at once, so a micro-batch all of whose rows stay is not
held besides the local batch until GATHER; the outputs still equal the one process's, rows
sent elsewhere included."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from examples.models import gpt_example
from rannc_fx.schedules.generators import Kind
from tests.harness import LINK, Run, default_loss, train_against_reference

WORLD = 2


def _held(run: Run) -> tuple[int, int, int] | None:
    """What a rank of the last stage holds when GATHER starts: (the micro-batches whose
    outputs it holds for their backwards, of those the ones that still hold the logits, the
    micro-batches whose logits wait for GATHER)."""
    cm = run.cm
    ex, last = cm._executor, cm.plan.stages[-1].index
    (args, kwargs), _ = run.split(run.batch(1))
    if last not in ex.runners:  # every rank calls the model
        default_loss(cm(*args, **kwargs)).backward()
        return None
    logits = next(r.spec.name for r in cm.plan.outputs if r.spec.batch_dim is not None)
    at = ex.runners[last].out_pos[logits]
    seen: list[tuple[int, int, int]] = []
    gather = ex._gather

    def looking(step: Any, i: Any = None) -> None:
        part = step.parts[last]
        seen.append((len(part.outs), sum(1 for o in part.outs.values() if o[at] is not None),
                     sum(1 for outs in part.model_outs.values() if logits in outs)))
        gather(step, i)

    for table in ex._dispatch.values():
        table[Kind.GATHER] = looking
    default_loss(cm(*args, **kwargs)).backward()
    (got,) = seen
    return got


def _check(replicas: tuple[int, ...], run: Run) -> None:
    got = _held(run)
    if got is None:
        return
    m = run.cm.plan.micro_batches
    # one stage x 2: micro-batch i's 2 samples split between the replicas, so rank 0's
    # replica makes samples 0, 2, 4, 6 and its first 2 micro-batches' rows are its own
    # (samples 0-3); on 1 x 1 the last stage (rank 1) makes every sample, and micro-batches
    # 2 and 3 are its own (samples 4-7): either way half wait for GATHER
    sent = m // 2
    assert got == (m, sent, sent), got


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("replicas", [(2,), (1, 1)])
def test_outputs_a_replica_keeps_are_its_local_batch_as_soon_as_made(replicas, tracer):
    cfg: dict[str, Any] = dict(replicas=replicas, micro_batches=4, schedule="gpipe",
                               tracer=tracer, **LINK)
    train_against_reference(functools.partial(gpt_example, 8), cfg, WORLD, steps=2,
                            outputs=True, check=functools.partial(_check, replicas))
