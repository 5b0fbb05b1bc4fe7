"""Checkpoints in one process: a state saved before the first step resumes like a fresh
optimizer, parameter groups come back with their saved settings, and groups saved with other
settings are named. The tied-embedding LM and its Adam, shared with ``distributed/test_checkpoint.py``
and ``distributed/test_zero.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.testing import assert_close

import rannc_fx
from examples.models import TransformerLM, gpt_example

TOL = dict(rtol=1e-5, atol=1e-5)
GLOBAL = 6  # divides among 1, 2 and 3 ranks


def _data() -> tuple[TransformerLM, tuple[Any, ...], dict[str, Any]]:
    torch.manual_seed(0)
    model, args, kwargs = gpt_example(batch=GLOBAL)
    assert isinstance(model, TransformerLM)
    return model, args, kwargs


def _adam(model: torch.nn.Module) -> torch.optim.Optimizer:
    # eps=1e-4: see test_compile (zero-gradient key biases)
    return torch.optim.Adam(model.parameters(), lr=0.01, eps=1e-4)


def _step(model: Any, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> float:
    loss = model(*args, **kwargs)["loss"]
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.item())


def _reference(steps: int) -> tuple[list[float], TransformerLM, torch.optim.Optimizer]:
    model, args, kwargs = _data()
    opt = _adam(model)
    return [_step(model, opt, args, kwargs) for _ in range(steps)], model, opt


def test_saving_before_the_first_step_resumes_like_a_fresh_optimizer(tmp_path):
    """The optimizer has no state yet: the saved state is the zero state (step 0), which
    Adam continues exactly like a fresh optimizer."""
    want, _, _ = _reference(2)
    model, args, kwargs = _data()
    opt = _adam(model)
    msd, osd = rannc_fx.get_state_dict(model, opt)
    assert not opt.state  # taking the state dict leaves the optimizer fresh
    assert all(float(v) == 0 for k, v in osd.items() if k.endswith(".step"))
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path))
    model2, _, _ = _data()
    opt2 = _adam(model2)
    msd2, osd2 = rannc_fx.get_state_dict(model2, opt2)
    dcp.load({"model": msd2, "optim": osd2}, checkpoint_id=str(tmp_path))
    rannc_fx.set_state_dict(model2, opt2, model_state_dict=msd2, optim_state_dict=osd2)
    losses = [_step(model2, opt2, args, kwargs) for _ in range(2)]
    assert_close(torch.tensor(losses), torch.tensor(want), **TOL)


def test_parameters_saved_in_groups_with_other_settings_are_named():
    model, _, _ = _data()
    head = [p for n, p in model.named_parameters() if n.startswith("norm.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("norm.")]
    two = torch.optim.Adam([{"params": rest}, {"params": head, "lr": 0.5}], lr=0.01)
    _, osd = rannc_fx.get_state_dict(model, two)
    one = _adam(model)  # one group: the saved settings of its parameters disagree
    with pytest.raises(ValueError, match=r"param group 0 of this rank holds .* saved with "
                                         r"different lr \(0.01 and 0.5\)"):
        rannc_fx.set_state_dict(model, one, optim_state_dict=osd)


def _groups(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def test_resumed_param_groups_are_the_saved_ones(tmp_path):
    """Every setting of every group (lr and the rest) comes back from the checkpoint, not from
    the optimizer it is loaded into, which was made with other settings."""
    model, args, kwargs = _data()
    norm = [p for n, p in model.named_parameters() if n.startswith("norm.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("norm.")]
    opt = torch.optim.Adam([{"params": rest}, {"params": norm, "lr": 0.5}], lr=0.01, eps=1e-4)
    _step(model, opt, args, kwargs)
    opt.param_groups[0].update(lr=0.003, weight_decay=0.1, betas=(0.8, 0.95), eps=1e-6)
    opt.param_groups[1].update(lr=0.2, weight_decay=0.01, betas=(0.5, 0.9))
    saved = _groups(opt)
    msd, osd = rannc_fx.get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path))

    model2, _, _ = _data()
    norm2 = [p for n, p in model2.named_parameters() if n.startswith("norm.")]
    rest2 = [p for n, p in model2.named_parameters() if not n.startswith("norm.")]
    opt2 = torch.optim.Adam([{"params": rest2}, {"params": norm2, "lr": 0.7}], lr=0.02)
    assert _groups(opt2) != saved
    msd2, osd2 = rannc_fx.get_state_dict(model2, opt2)
    dcp.load({"model": msd2, "optim": osd2}, checkpoint_id=str(tmp_path))
    rannc_fx.set_state_dict(model2, opt2, model_state_dict=msd2, optim_state_dict=osd2)
    assert _groups(opt2) == saved
    assert [len(g["params"]) for g in opt2.param_groups] == [len(rest), len(norm)]
