"""Train the built-in MLP with ``rannc_fx.compile`` under torchrun; each rank writes its losses.

``tests/distributed/test_torchrun.py`` runs it as two torchrun agents (two "nodes") on one machine:

    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:29400 --node-rank 0 tests/scripts/train_multinode.py --out DIR

and computes the single-process reference from ``build`` and ``global_batch`` below. With
``--die-rank R --die-step S`` rank R exits abruptly when step S begins, so the test can see
that the other rank fails with an error naming the rank and the operation, not a hang.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

import rannc_fx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: examples
from examples.models import MLP  # noqa: E402

D_IN, CLASSES = 16, 5


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and optimizer every rank (and the reference) starts from."""
    torch.manual_seed(0)
    model = MLP(d_in=D_IN, hidden=32, depth=3, classes=CLASSES)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def global_batch(step: int, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch; rank r's local batch is its r-th slice."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(samples, D_IN, generator=g), torch.randint(0, CLASSES, (samples,), generator=g)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder for rank<R>.json")
    p.add_argument("--steps", type=int, default=3, help="Adam steps")
    p.add_argument("--local-batch", type=int, default=4, help="samples per rank per step")
    p.add_argument("--timeout", type=float, default=20.0, help="Config.timeout_s, seconds")
    p.add_argument("--die-rank", type=int, default=-1, help="this rank exits abruptly ...")
    p.add_argument("--die-step", type=int, default=-1, help="... when this step begins")
    args = p.parse_args()

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model, opt = build()
    cfg = rannc_fx.Config(
        replicas=(1,) * world, micro_batches=2, timeout_s=args.timeout,
        profile_cache_dir=None, profile_repeats=1,
    )
    model = rannc_fx.compile(model, opt, cfg)
    lo, hi = rank * args.local_batch, (rank + 1) * args.local_batch
    losses = []
    for step in range(args.steps):
        if rank == args.die_rank and step == args.die_step:
            os._exit(3)  # no clean-up, no goodbye: as a killed or crashed node
        x, y = global_batch(step, world * args.local_batch)
        loss = model(x[lo:hi], y[lo:hi])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    report = {
        "rank": rank, "world": world, "node": int(os.environ.get("GROUP_RANK", -1)),
        "stage": model.plan.stage_of_rank(rank).index, "losses": losses,
    }
    (args.out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
