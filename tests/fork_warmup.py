"""Imported by the fork server of ``dist_utils.run_ranks`` (its preload list): the first
capture and shape inference in a process cost more than the later ones (torch.export's,
FakeTensor's and sympy's first-use set-up), and every forked rank would pay them again. They
run here once, on models built on the meta device: no data, no compute, so no thread pool or
autograd thread starts before the fork."""

from __future__ import annotations

import torch

from examples.models import MLP, ResCNN, TransformerLM
from rannc_fx.plan.config import Config
from rannc_fx.planner import capture_model


def _warm_up() -> None:
    cfg = Config(profile_cache_dir=None)
    with torch.device("meta"):  # a torch.fx graph of each kind of layer, and an exported one
        models = ((MLP(), (torch.empty(4, 32), torch.zeros(4, dtype=torch.long))),
                  (ResCNN(), (torch.empty(4, 3, 16, 16), torch.zeros(4, dtype=torch.long))),
                  (TransformerLM(), (torch.zeros(4, 16, dtype=torch.long),)))
        for model, args in models:
            try:
                capture_model(model, args, {}, cfg)
            except Exception:  # the workers pay the set-up themselves: slower, not wrong
                pass


_warm_up()
