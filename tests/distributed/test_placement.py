"""Placement: each rank materializes (meta model) or keeps (CPU model) only its stage's
tensors, initialized identically wherever a tensor lives on several ranks (with the values their
modules' resets draw, a non-persistent buffer computed where it is held); tensors no init
touched are named before they can train; the optimizer carries over."""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import rannc_fx
from examples.models import TransformerLM, gpt_example
from tests.dist_utils import run_ranks
from tests.harness import LINK, Run, optimizer, test_config, train_against_reference

CFG = dict(timeout_s=30.0)


def _example(batch: int) -> tuple[Any, Any]:
    torch.manual_seed(0)
    _, args, kwargs = gpt_example(batch=batch)
    return args, kwargs


def _meta_lm(rank: int, world: int, replicas: tuple[int, ...]) -> list[str]:
    args, kwargs = _example(2)
    with torch.device("meta"):
        model = TransformerLM()
    opt = torch.optim.AdamW(model.parameters(), lr=0.003, weight_decay=0.05)
    # 2 MiB per device: too little for one stage, so the layers (and the tied weight) split
    cfg = test_config(**CFG, **LINK, replicas=replicas, micro_batches=2, device_memory=2 * 2**20)
    cm = rannc_fx.compile(model, opt, cfg,
                          example_args=args, example_kwargs=kwargs)
    # this rank's stages: one, or a lane's several (the plan may interleave)
    params = {id(p): p for stage in cm.stages for p in stage.parameters()}
    tensors = [*params.values(), *(b for stage in cm.stages for b in stage.buffers())]
    held = {id(t) for t in tensors}
    assert all(t.device == torch.device("cpu") for t in tensors)
    assert _materialized_like_reset(model, held) > 0
    # the optimizer steps the materialized parameters, with its own settings
    in_opt = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(in_opt) == len(set(in_opt)) and set(in_opt) == set(params)
    assert opt.param_groups[0]["lr"] == 0.003 and opt.param_groups[0]["weight_decay"] == 0.05
    # what every rank holds, to compare across ranks
    values = {k: v.clone() for k, v in cm.state_dict().items()}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, values)
    # replicas of stage 1 (ranks 1 and 2) hold the same tensors, and the tied embedding is
    # on both stages: every tensor held by several ranks is the same on each
    assert everyone[1].keys() == everyone[2].keys() != everyone[0].keys()
    assert "embed.weight" in everyone[0] and "head.weight" in everyone[2]
    for k in everyone[0].keys() & everyone[2].keys():
        assert torch.equal(everyone[0][k], everyone[2][k]), k
    for k in everyone[1]:
        assert torch.equal(everyone[1][k], everyone[2][k]), k
    return sorted(values)


def _materialized_like_reset(model: nn.Module, held: set[int]) -> int:
    """Check that the held parameters hold what their modules' resets draw, not what
    allocation left: LayerNorm 1 and 0, attention input biases 0, weights spread within their
    init's bound (kaiming / xavier uniform, the position table N(0, 0.02)); the count checked."""
    checked = 0
    for mname, mod in model.named_modules():
        for pname, t in mod.named_parameters(recurse=False):
            if id(t) not in held:
                continue
            name, checked = f"{mname}.{pname}", checked + 1
            assert torch.isfinite(t).all(), name
            if isinstance(mod, nn.LayerNorm):
                assert torch.equal(t, torch.full_like(t, 1.0 if pname == "weight" else 0.0)), name
            elif pname == "in_proj_bias":
                assert torch.equal(t, torch.zeros_like(t)), name
            elif t.dim() == 2:
                bound = (6 / sum(t.shape)) ** 0.5 if pname == "in_proj_weight" else (
                    0.1 if pname == "pos" else t.shape[1] ** -0.5)
                assert float(t.abs().max()) <= bound, name
                assert float(t.std()) > bound / 8, name  # spread, not a constant
            else:  # a Linear's bias: within its layer's bound
                assert float(t.abs().max()) <= 1.0, name
    return checked


def test_a_meta_model_materializes_each_stage_alike_on_every_rank_that_holds_it():
    held = run_ranks(_meta_lm, 3, (1, 2), timeout_s=30.0, wall_s=120.0)
    # every tensor of the model is held by some rank
    assert set().union(*held) == set(TransformerLM().state_dict())


class Scale(nn.Module):
    """A module with its own parameter and no reset_parameters()."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class Rotary(nn.Module):
    """A non-persistent buffer computed in __init__ (as rotary-embedding caches are)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(d) / d), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.inv_freq


class Net(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # a scalar loss
        return super().forward(x).square().mean()


def _net(extra: nn.Module) -> nn.Module:
    return Net(nn.Linear(8, 8), extra, nn.Linear(8, 1))


def _uninitialized(rank: int, world: int, mode: str) -> str:
    x = torch.randn(4, 8)
    with torch.device("meta"):
        model = _net(Rotary(8) if mode == "buffer" else Scale(8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def init(m: nn.Module) -> None:
        if isinstance(m, Scale):
            nn.init.ones_(m.gain)
        elif isinstance(m, Rotary):
            d = m.inv_freq.numel()
            m.inv_freq.copy_(1.0 / 10000 ** (torch.arange(d) / d))
        elif isinstance(m, nn.Linear):
            m.reset_parameters()

    hook = init if mode == "init" else None
    plan = dict(stages=1) if world == 1 else dict(replicas=(1,) * world, micro_batches=2)
    try:
        cm = rannc_fx.compile(model, opt, test_config(**CFG, **LINK, **plan), example_args=(x,), init=hook)
    except RuntimeError as e:
        return str(e)
    if mode == "load":
        plain = _net(Scale(8))
        cm.load_state_dict(plain.state_dict())
    try:
        cm(x).backward()
    except RuntimeError as e:
        return str(e)
    if isinstance(model[1], Scale) and model[1].gain.numel():
        assert torch.equal(model[1].gain, torch.ones(8))
    return "trained"


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("none", r"1 tensor\(s\) of this rank's stage .* never initialized: '1.gain'.*init=fn"),
        ("buffer", r"non-persistent buffer '1.inv_freq' \(Rotary\) .* nothing computed it"),
        ("init", r"trained"),
        ("load", r"trained"),
    ],
)
@pytest.mark.parametrize("world", [1, 2])
def test_tensors_no_init_touched_are_named_before_they_train(mode, expected, world):
    # on 2 ranks only one stage holds the module: both ranks stop with its message at once
    # (a timeout of 30 s would fail the wall limit of 20 s)
    messages = run_ranks(_uninitialized, world, mode, timeout_s=30.0, wall_s=20.0)
    for message in messages:
        assert re.search(expected, message), message
    if world == 2 and expected != "trained":
        assert all(re.search(r"rank [01]: ", m) for m in messages), messages


class Frequencies(nn.Module):
    """A non-persistent buffer that ``reset_parameters()`` computes (a rotary table): no
    checkpoint holds it, so a rank that materializes it must compute it."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", torch.empty(d), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.inv_freq.copy_(_inv_freq(self.inv_freq.numel(), self.inv_freq.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.inv_freq


def _inv_freq(d: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return 1.0 / 10000 ** (torch.arange(d, device=device) / d)


def _computed_buffer(rank: int, world: int) -> bool:
    torch.manual_seed(0)
    plain = _net(Frequencies(8))  # the CPU-built model: the reference
    x = torch.randn(4, 8)
    with torch.device("meta"):
        model = _net(Frequencies(8))
    cm = rannc_fx.compile(model, None, test_config(**CFG, **LINK, replicas=(1, 1), micro_batches=2),
                          example_args=(x,))
    buffers = dict(cm.stages[0].named_buffers())
    holds = any(b is model[1].inv_freq for b in buffers.values())
    if holds:  # computed on this rank, with the values the CPU-built model has
        assert model[1].inv_freq.device.type == "cpu"
        assert torch.equal(model[1].inv_freq, _inv_freq(8))
        assert torch.equal(model[1].inv_freq, plain[1].inv_freq)
    cm.load_state_dict(plain.state_dict())  # the parameters; the buffer is in no state dict
    torch.testing.assert_close(cm(x), plain(x), rtol=1e-6, atol=1e-6)
    return holds


def test_a_non_persistent_buffer_reset_parameters_computes_is_computed_where_it_is_held():
    held = run_ranks(_computed_buffer, 2, timeout_s=30.0, wall_s=60.0)
    assert sorted(held) == [False, True]  # one stage holds it


def _measured_on_meta(rank: int, world: int) -> tuple[str, str, bool]:
    """A meta-built model compiled with ``cost_model='measured'``: its ops made real on this
    rank's CPU, timed there; it then trains as the CPU-built model does."""
    torch.manual_seed(0)
    plain = _net(nn.ReLU())
    with torch.device("meta"):
        model = _net(nn.ReLU())
    x = torch.randn(4, 8)
    cm = rannc_fx.compile(model, None, test_config(**CFG, **LINK, cost_model="measured"),
                          example_args=(x,))
    cm.load_state_dict(plain.state_dict())
    torch.testing.assert_close(cm(x), plain(x), rtol=1e-6, atol=1e-6)
    return cm.plan.cost_model, cm.plan.device.name, all(
        p.device.type == "cpu" for stage in cm.stages for p in stage.parameters())


def test_a_meta_model_is_measured_on_the_ranks_device():
    for cost_model, device, on_cpu in run_ranks(_measured_on_meta, 2, timeout_s=30.0,
                                                 wall_s=60.0):
        assert cost_model == "measured" and device == "cpu" and on_cpu


def _plain(name: str) -> Any:
    from tests import hf_models

    return getattr(hf_models, f"{name}_example")(batch=2 * dist.get_world_size())


def _plain_model(name: str) -> nn.Module:
    return _plain(name)[0]


def _from_meta(name: str) -> Any:
    """The transformers model built on the meta device, and the global batch."""
    ref, args, kwargs = _plain(name)
    with torch.device("meta"):
        model = type(ref)(ref.config)
    return model, args, kwargs


def _its_init(model: nn.Module) -> dict[str, Any]:
    return dict(init=model._init_weights)


def _loaded_then_trained(run: Run) -> None:
    """Non-persistent buffers (rotary inv_freq) computed by the init, as the CPU model has
    them; every rank takes its part of the plain model's state dict, then 2 steps."""
    ref_buffers = dict(run.ref.named_buffers())
    for bname, b in run.cm.stages[0].named_buffers():
        if bname in ref_buffers:
            assert torch.equal(b, ref_buffers[bname]), bname
    run.cm.load_state_dict(run.ref.state_dict())
    for step in range(1, 3):
        run.train_step(step)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_transformers_model_from_meta_trains_like_the_cpu_built_one(name):
    got = train_against_reference(
        functools.partial(_from_meta, name), dict(CFG, replicas=(1, 1), micro_batches=2), 2,
        reference=functools.partial(_plain_model, name),
        optimizer=optimizer(torch.optim.Adam, lr=1e-3), compile_kw=_its_init,
        loop=_loaded_then_trained, params=False, wall_s=180.0)
    assert got[0].losses == got[1].losses
