"""What accepting other batch sizes costs a step at the plan's own size.

    torchrun --nproc-per-node 2 benchmarks/batch_sizes_overhead.py

Since ``runtime/batches.py``, each call first agrees with the other ranks on the local batch
sizes and autocast states (one all-gather of two integers a rank) and looks up the executor for
that size. This script times the same compiled model four ways, interleaved step by step
after ``--warmup`` rounds:

- ``checked``: ``model(ids, labels=labels)``, what every call does by default;
- ``unchecked``: the same with ``Config(check_batches=False)`` (no agreement, the lookup stays);
- ``direct``: the plan's executor called directly, as every call did before (no agreement,
  no lookup; the same flattening of inputs and outputs);
- ``again``: ``direct`` once more, so the A/A ratio shows the noise of the run's median.

The overhead is the median of the per-round wall-time ratios minus one; CPU time per step is
given too. Each ``--sizes`` entry is one model (runtime_common.GPT, forced plan of 2 stages).
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
    cm, opt, ids, labels = gpt.cm, gpt.opt, gpt.ids, gpt.labels
    captured, executor, batches = cm._captured, cm._executor, cm._batches
    assert captured is not None and executor is not None and batches is not None

    def unchecked() -> None:  # Config(check_batches=False): no agreement, the lookup stays
        batches.check = False
        try:
            gpt.step()
        finally:
            batches.check = True

    def direct() -> None:
        flat = captured.flatten_inputs((ids,), {"labels": labels})
        captured.unflatten_outputs(executor.forward(flat)).backward()
        opt.step()
        opt.zero_grad()

    # "again" is "direct" a second time: the A/A ratio is the noise of this run's median
    wall, cpu = interleave({"checked": gpt.step, "unchecked": unchecked, "direct": direct,
                            "again": direct},
                           warmup=args.warmup, steps=args.steps, sync=dist.barrier)
    if dist.get_rank() == 0:
        w, c = medians_ms(wall), medians_ms(cpu)

        def vs(k: str) -> str:
            return overhead_vs(wall, k, "direct")

        print(f"| {name} | {gpt.shape} | {w['direct']:.2f} | {w['checked']:.2f} | "
              f"{vs('checked')} | {vs('unchecked')} | {vs('again')} | "
              f"{c['direct']:.2f} | {c['checked']:.2f} |", flush=True)


def main() -> None:
    args = overhead_parser(__doc__, steps=40).parse_args()
    overhead_main(args, "batch_sizes_overhead.py", [
        "model", "plan", "direct ms (wall)", "checked ms (wall)",
        "overhead (median of per-round ratios)", "check_batches=False", "A/A: direct again",
        "direct ms (CPU, rank 0)", "checked ms (CPU, rank 0)",
    ], run)  # fmt: skip


if __name__ == "__main__":
    main()
