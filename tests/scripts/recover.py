"""A training script one of whose calls fails on one rank, and that goes on training after it
(or ends right after it): every rank must exit 0.

Run as one of WORLD_SIZE processes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set), with
FAIL_RANK and FAIL_STEP: the rank whose batch holds a token id past the embedding, and when.
"""

import os
import sys
from pathlib import Path

import torch

import rannc_fx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: examples
from examples.models import gpt_example  # noqa: E402

torch.set_num_threads(1)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
fail_rank, fail_step = int(os.environ["FAIL_RANK"]), int(os.environ["FAIL_STEP"])
torch.manual_seed(0)
model = gpt_example(batch=2, seq=16)[0]
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
config = rannc_fx.Config(replicas=(1, 1) if world == 2 else (2, 1), micro_batches=2,
                         schedule="1f1b", profile_cache_dir=None, profile_repeats=1,
                         timeout_s=60)
model = rannc_fx.compile(model, optimizer, config)
failed = []
for step in range(4):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 256, (4, 16), generator=g)
    if step == fail_step and rank == fail_rank:
        ids = ids + 256  # past the embedding: stage 0 raises IndexError
    try:
        model(ids, labels=torch.roll(ids, -1, 1))["loss"].backward()
        optimizer.step()
    except Exception as e:  # every rank raises in the failed call
        failed.append(type(e).__name__)
    optimizer.zero_grad()
print(f"failed {failed}", flush=True)
