"""What tracing costs a step: nothing measurable when it is off.

    torchrun --nproc-per-node 2 benchmarks/trace_overhead.py

The tracing hooks (``runtime/trace.py``) leave two tests in the untraced path: one per
``_run`` of the executor and one per wait for received messages. This script times the same
compiled model (``Config.trace_dir`` unset) four ways, interleaved step by step after
``--warmup`` rounds:

- ``off``: the code as it is, tracing off;
- ``no hooks``: the executor's loop and the stage's waits replaced by the code before
  tracing (no tests at all);
- ``again``: ``no hooks`` once more, so the A/A ratio shows the noise of the run's median;
- ``recording``: every step recorded (a recorder that never writes; its events are dropped
  after each step), what a traced step pays.

The ratios are medians of per-round wall-time ratios to ``no hooks``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead_common import Compiled, overhead_main, overhead_parser  # noqa: E402
from runtime_common import interleave, median_ratio, summarize  # noqa: E402

from rannc_fx.runtime.executor import StageExecutor  # noqa: E402
from rannc_fx.runtime.trace import Recorder  # noqa: E402


def _untraced_run(executor: StageExecutor) -> Any:
    """The executor's loop as it was before tracing."""
    def run(step: Any, actions: list[Any]) -> None:
        dispatch = executor._dispatch
        for s, part in step.parts.items():
            part.split = executor._split[id(actions)][s]
        for a in actions:
            dispatch[a.stage][a.kind](step if a.kind.once else step.parts[a.stage], a.microbatch)
    return run


def run(name: str, args: argparse.Namespace) -> None:
    gpt = Compiled(name, args.micro_batches, args.schedule)
    cm, ex, batches = gpt.cm, gpt.cm._executor, gpt.cm._batches
    assert isinstance(ex, StageExecutor) and batches is not None
    hooked_run, hooked_wait = ex._run, ex.runner._wait
    plain_run = _untraced_run(ex)
    recorder = Recorder(range(1, 1 << 30), Path("unused"), rank=ex.rank, world=ex.plan.world_size,
                        stage=ex.stage.index, replica=ex.replica, device=ex.device)
    recorder.clock = {"offset_ns": {}}  # no alignment: it would be a collective per contender

    def no_hooks() -> None:
        ex._run = plain_run  # type: ignore[method-assign]
        ex.runner._wait = lambda pending, match, i: pending.wait()  # type: ignore[method-assign]
        try:
            gpt.step()
        finally:
            ex._run, ex.runner._wait = hooked_run, hooked_wait  # type: ignore[method-assign]

    def recording() -> None:
        cm._trace = recorder
        batches.set_trace(recorder)
        try:
            gpt.step()
        finally:  # drop what it recorded; the next step records afresh
            recorder.events.clear()
            recorder.starts.clear()
            recorder.plans.clear()
            recorder.on = False
            cm._trace = None
            ex.set_trace(None)
            batches.trace = None

    wall, _ = interleave(
        {"off": gpt.step, "no hooks": no_hooks, "again": no_hooks, "recording": recording},
        warmup=args.warmup, steps=args.steps, sync=dist.barrier,
    )
    recorder.done = True  # never meant to write: no "no trace written" at exit
    if ex.rank == 0:
        w = {k: summarize(v)["median"] * 1e3 for k, v in wall.items()}

        def vs(k: str) -> str:
            return f"{100 * (median_ratio(wall[k], wall['no hooks']) - 1):+.2f} %"

        print(f"| {name} | {gpt.shape} | {w['no hooks']:.2f} | {w['off']:.2f} | {vs('off')} | "
              f"{vs('again')} | {w['recording']:.2f} | {vs('recording')} |", flush=True)


def main() -> None:
    args = overhead_parser(__doc__, steps=100).parse_args()
    overhead_main(args, "trace_overhead.py", [
        "model", "plan", "no hooks ms", "off ms", "off vs no hooks", "A/A: no hooks again",
        "recording ms", "recording vs no hooks",
    ], run)  # fmt: skip


if __name__ == "__main__":
    main()
