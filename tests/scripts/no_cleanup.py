"""A short training script that never calls destroy_process_group(): rannc_fx must exit cleanly.

Run as one of WORLD_SIZE processes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set).
"""

import sys
from pathlib import Path

import torch

import rannc_fx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: examples
from examples.models import mlp_example  # noqa: E402

torch.set_num_threads(1)
model, (x, y), _ = mlp_example(batch=8)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
config = rannc_fx.Config(replicas=(1, 1), micro_batches=4, schedule="1f1b",
                         profile_cache_dir=None, profile_repeats=1, timeout_s=60)
model = rannc_fx.compile(model, optimizer, config, example_args=(x, y))
for _ in range(5):
    loss = model(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print(f"loss {loss.item():.4f}", flush=True)
