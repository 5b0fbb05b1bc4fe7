"""The profile's disk cache never misleads a plan: keyed by the autocast state too, its bad
entries measured again, and a directory others can write not used."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

import rannc_fx
from examples.models import gpt_example
from rannc_fx.plan.config import Config


def _activations(cache: Path | None, autocast: bool = False) -> int:
    """The activation memory of a 2-stage GPipe plan of the built-in LM, over its stages
    (measured bytes: the same on every run wherever the measured times put the cut)."""
    torch.manual_seed(0)
    model, args, kwargs = gpt_example(4)
    config = Config(profile_cache_dir=cache, profile_repeats=1, replicas=(1, 1),
                    micro_batches=2, schedule="gpipe")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        parted = rannc_fx.partition(model, args, kwargs, world_size=2, config=config)
    return sum(st.memory.activations for st in parted.plan.stages)


def _files(cache: Path) -> list[Path]:
    return sorted(cache.glob("profile-*.json"))


def test_a_float32_plan_after_a_bfloat16_filled_cache_is_a_fresh_ones(tmp_path):
    fresh = _activations(None)
    bf16 = _activations(tmp_path, autocast=True)
    assert bf16 != fresh  # bfloat16 saves other bytes: a shared entry would mislead
    assert _activations(tmp_path) == fresh
    assert len(_files(tmp_path)) == 2  # one file per autocast state
    assert _activations(tmp_path, autocast=True) == bf16  # each read back


def _forge(cache: Path, edit) -> None:  # type: ignore[no-untyped-def]
    for path in _files(cache):
        doc = json.loads(path.read_text())
        doc["entries"] = {k: edit(v) for k, v in doc["entries"].items()}
        path.write_text(json.dumps(doc))


def test_a_forged_entry_is_measured_again(tmp_path, caplog):
    fresh = _activations(tmp_path)
    _forge(tmp_path, lambda v: {k: -1 if isinstance(x, int | float) else x for k, x in v.items()})
    with caplog.at_level(logging.WARNING, logger="rannc_fx"):
        assert _activations(tmp_path) == fresh
    assert "negative or non-finite costs ignored" in caplog.text


def test_a_cache_others_can_write_is_not_used(tmp_path, caplog):
    fresh = _activations(tmp_path)
    # valid-looking costs, halved memory: what a planted file could say
    _forge(tmp_path, lambda v: {k: x // 2 if isinstance(x, int) and not isinstance(x, bool)
                                else x for k, x in v.items()})
    assert _activations(tmp_path) != fresh  # this user's own file is trusted
    tmp_path.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="rannc_fx"):
        assert _activations(tmp_path) == fresh
    assert "others may write it" in caplog.text


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="giving a file to another user needs root")
def test_a_cache_another_user_owns_is_not_used(tmp_path, caplog):
    fresh = _activations(tmp_path)
    _forge(tmp_path, lambda v: {k: x // 2 if isinstance(x, int) and not isinstance(x, bool)
                                else x for k, x in v.items()})
    os.chown(tmp_path, 4242, -1)
    with caplog.at_level(logging.WARNING, logger="rannc_fx"):
        assert _activations(tmp_path) == fresh
    assert "another user owns it" in caplog.text
