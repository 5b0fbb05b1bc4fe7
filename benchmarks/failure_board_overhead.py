"""What watching for other ranks' failures costs a step.

    torchrun --nproc-per-node 2 benchmarks/failure_board_overhead.py

Since ``runtime/failures.py``, every wait of the runtime on gloo is handed to a waiter thread
while the rank waits on that thread and reads the failure board (the c10d store) every 5 ms,
so that a peer's failure ends the wait at once. This script times the same compiled model
three ways, interleaved step by step after ``--warmup`` rounds:

- ``watched``: a step as every step runs now;
- ``blocking``: the same executor with its board taken away for the step, so each wait
  blocks in the work's own ``wait()`` as before (no thread, no store);
- ``again``: ``blocking`` once more, so the A/A ratio shows the noise of the run's median.

The overhead is the median of the per-round wall-time ratios minus one; CPU time per step is
given too. Each ``--sizes`` entry is one model (runtime_common.GPT, forced plan of one stage
per rank).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead_common import (  # noqa: E402
    Compiled,
    medians_ms,
    overhead_main,
    overhead_parser,
    overhead_vs,
)
from runtime_common import interleave  # noqa: E402


def run(name: str, args: argparse.Namespace) -> None:
    gpt = Compiled(name, args.micro_batches, args.schedule)
    executor = gpt.cm._executor
    assert executor is not None and executor.groups.board is not None
    groups, board = executor.groups, executor.groups.board

    def blocking() -> None:
        groups.board = None  # every wait of this executor blocks in the work's own wait()
        try:
            gpt.step()
        finally:
            groups.board = board

    wall, cpu = interleave({"watched": gpt.step, "blocking": blocking, "again": blocking},
                           warmup=args.warmup, steps=args.steps, sync=dist.barrier)
    if dist.get_rank() == 0:
        w, c = medians_ms(wall), medians_ms(cpu)

        def vs(k: str) -> str:
            return overhead_vs(wall, k, "blocking")

        print(f"| {name} | {gpt.shape} | {w['blocking']:.2f} | {w['watched']:.2f} | "
              f"{vs('watched')} | {vs('again')} | {c['blocking']:.2f} | {c['watched']:.2f} |",
              flush=True)


def main() -> None:
    args = overhead_parser(__doc__, steps=40).parse_args()
    overhead_main(args, "failure_board_overhead.py", [
        "model", "plan", "blocking ms (wall)", "watched ms (wall)",
        "overhead (median of per-round ratios)", "A/A: blocking again",
        "blocking ms (CPU, rank 0)", "watched ms (CPU, rank 0)",
    ], run)  # fmt: skip


if __name__ == "__main__":
    main()
