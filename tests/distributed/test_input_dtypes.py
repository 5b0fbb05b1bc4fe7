"""Inputs of another dtype than the plan's: converted where the model casts them first, else
refused on every rank; never read as the planned dtype's bytes. The casts capture trusts:
``unit/test_input_dtypes.py``."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from tests.harness import Run, optimizer, train_against_reference
from tests.unit.test_input_dtypes import Casts, _batch

LOCAL = 4  # samples per rank


# (what each call changes: input -> (dtype, the ranks that pass it)), whether a cast is seen
CALLS: list[tuple[str, dict[int, tuple[torch.dtype, tuple[int, ...]]]]] = [
    ("as planned", {}),
    ("float16 features on every rank", {0: (torch.float16, (0, 1, 2))}),
    ("bfloat16 features on rank 1", {0: (torch.bfloat16, (1,))}),
    ("int32 token ids", {1: (torch.int32, (0, 1, 2))}),
    ("int32 labels on rank 0", {2: (torch.int32, (0,))}),
    ("float64 features on rank 0", {0: (torch.float64, (0,))}),
    ("as planned again", {}),
]


def _calls(run: Run) -> list[object]:
    """Each of ``CALLS``: the error it raised, or (loss, one process's loss) after a step."""
    rank, world = run.rank, run.world
    out: list[object] = []
    for step, (_, change) in enumerate(CALLS):
        inputs = list(_batch(LOCAL * world, step))
        parts = [[t[r * LOCAL:(r + 1) * LOCAL] for t in inputs] for r in range(world)]
        for j, (dtype, ranks) in change.items():
            for r in ranks:
                if r < world:
                    parts[r][j] = parts[r][j].to(dtype)
        try:
            got = run.cm(*parts[rank])
        except ValueError as e:
            out.append(str(e))
            continue
        # one process on the global batch, each rank's part cast as the model casts it
        want = run.ref(torch.cat([p[0].float() for p in parts]),
                       torch.cat([p[1] for p in parts]), torch.cat([p[2].long() for p in parts]))
        run.backward(got, want)
        run.step()
        out.append((float(got), float(want)))
    return out


@pytest.mark.parametrize("tracer,world,replicas", [
    ("fx", 2, (1, 1)), ("fx", 2, (2,)), ("fx", 3, (1, 2)), ("export", 2, (1, 1)),
])
def test_inputs_of_another_dtype_are_converted_as_the_model_does_or_refused(tracer, world,
                                                                            replicas):
    results = [t.extra for t in train_against_reference(
        Casts, dict(tracer=tracer, replicas=replicas), world,
        optimizer=optimizer(torch.optim.SGD, lr=0.1), example=False, loop=_calls,
        timeout_s=30.0, wall_s=180.0)]
    for k, (what, change) in enumerate(CALLS):
        seen = [r[k] for r in results]
        # torch.fx's graph shows the model's casts of the features and labels (not of the token
        # ids); torch.export's cannot tell them from other reads, so it refuses every other dtype
        cast = tracer == "fx" and 1 not in change and any(
            r < world for _, ranks in change.values() for r in ranks)
        if not change or cast:
            for got, want in seen:  # type: ignore[misc]
                assert_close(got, want, rtol=1e-5, atol=1e-6, msg=what)
            continue
        if not any(r < world for _, ranks in change.values() for r in ranks):
            continue
        assert all(isinstance(s, str) for s in seen), (what, seen)
        assert all(s == seen[0] for s in seen), what  # the same error on every rank
        (j, (dtype, ranks)), = change.items()
        name = ["x", "ids", "y"][j]
        planned = ["float32", "int64", "int64"][j]
        assert f"({name!r})" in seen[0] and planned in seen[0], seen[0]
        assert str(dtype).removeprefix("torch.") in seen[0], seen[0]
