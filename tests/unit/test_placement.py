"""The device a rank places its stage on follows ``LOCAL_RANK``. Placement on ranks:
``distributed/test_placement.py``."""

from __future__ import annotations

import torch

from rannc_fx.startup.placement import rank_device


def test_the_rank_device_follows_local_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert rank_device("cuda") == torch.device("cuda", 3)
    assert rank_device("cuda:1") == torch.device("cuda", 1)
    assert rank_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert rank_device(None) == torch.device("cpu")
