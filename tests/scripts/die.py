"""A training script one of whose ranks is killed (SIGKILL) at the start of its second step;
each survivor prints the error its call raised.

Run as one of WORLD_SIZE processes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set), with
DIE_RANK: the rank that dies. Rank 0 hosts the job's c10d store here (no torchrun agent).
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch

import rannc_fx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: examples
from examples.models import gpt_example  # noqa: E402

torch.set_num_threads(1)
rank, die = int(os.environ["RANK"]), int(os.environ["DIE_RANK"])
torch.manual_seed(0)
model = gpt_example(batch=2, seq=16)[0]
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
config = rannc_fx.Config(replicas=(2, 1), micro_batches=2, schedule="1f1b",
                         profile_cache_dir=None, profile_repeats=1, timeout_s=60)
model = rannc_fx.compile(model, optimizer, config)
for step in range(3):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 256, (4, 16), generator=g)
    if step == 1 and rank == die:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        model(ids, labels=torch.roll(ids, -1, 1))["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    except Exception as e:
        print(f"{type(e).__name__}: {e}", flush=True)
        time.sleep(3.0)  # answer the others' roll calls before rank 0 takes the store away
        os._exit(0)  # the job cannot go on without the dead rank
print("no error", flush=True)
