"""Two steps of a run asked to trace steps 3-4: at exit rank 0 says no trace was written.

Run by tests/distributed/test_trace.py as two processes with torchrun's variables; argv[1] is the
trace directory."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch

import rannc_fx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: examples
from examples.models import mlp_example  # noqa: E402

torch.set_num_threads(1)
logging.basicConfig()
model, (x, y), _ = mlp_example(batch=4)
cfg = rannc_fx.Config(profile_cache_dir=None, profile_repeats=1, replicas=(1, 1),
                      micro_batches=2, trace_dir=sys.argv[1], trace_steps="3-4")
cm = rannc_fx.compile(model, None, cfg, example_args=(x, y))
for _ in range(2):
    cm(x, y).backward()
print("ran", flush=True)
