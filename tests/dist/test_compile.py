"""``rannc_fx.compile`` end to end on forked gloo ranks: plan on rank 0, broadcast,
split, free, prune, train; every rank checks loss, outputs and parameters after Adam steps
against a deep-copied single-process reference trained on the global batch."""

from __future__ import annotations

import copy
import importlib
from typing import Any

import pytest
import torch
from torch.testing import assert_close
from torch.utils import _pytree as pytree

from rannc_fx.compile import compile as rannc_compile
from rannc_fx.config import Config

from tests.dist_utils import local_part, run_ranks

TOL = dict(rtol=1e-5, atol=1e-5)
LOCAL = 2  # samples per rank

ZOO = {
    "mlp": ("rannc_fx.models", "mlp_example"),
    "cnn": ("rannc_fx.models", "cnn_example"),
    "gpt": ("rannc_fx.models", "gpt_example"),
    "gpt2": ("tests.hf_models", "gpt2_example"),
    "bert": ("tests.hf_models", "bert_example"),
    "resnet": ("tests.hf_models", "resnet_example"),
    "llama": ("tests.hf_models", "llama_example"),
    "tied-llama": ("tests.hf_models", "tied_llama_example"),
    "t5": ("tests.hf_models", "t5_example"),
}


def _warm(name: str) -> None:
    """Import the model's module here (the ranks' fork server preloads its own modules:
    ``dist_utils._PRELOAD``; a rank imports what is missing there)."""
    importlib.import_module(ZOO[name][0])
    import torch.export  # noqa: F401


def _example(name: str, batch: int) -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]:
    module, factory = ZOO[name]
    torch.manual_seed(0)
    return getattr(importlib.import_module(module), factory)(batch=batch)


def _local(tree: Any, rank: int, global_batch: int) -> Any:
    return local_part(tree, rank, global_batch, LOCAL)


def _loss(out: Any) -> torch.Tensor:
    return out["loss"] if isinstance(out, dict) else out


def _train(rank: int, world: int, name: str, cfg: dict[str, Any], steps: int = 5) -> float:
    g = LOCAL * world
    model, args, kwargs = _example(name, g)
    ref = copy.deepcopy(model)
    # eps=1e-4: attention key biases have exactly zero gradient in exact arithmetic (softmax
    # ignores a constant per query), so their float gradients are summation-order noise
    # (~1e-9) that Adam's default eps=1e-8 would blow up into steps of +-lr.
    opt = torch.optim.Adam(model.parameters(), lr=0.01, eps=1e-4)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01, eps=1e-4)
    config = Config(profile_cache_dir=None, profile_repeats=1, timeout_s=60.0, **cfg)
    cm = rannc_compile(model, opt, config)
    largs, lkwargs = _local((args, kwargs), rank, g)
    for _ in range(steps):
        out = cm(*largs, **lkwargs)
        want = ref(*args, **kwargs)
        assert_close(_loss(out), _loss(want), **TOL)
        got, exp = pytree.tree_leaves(out), pytree.tree_leaves(_local(want, rank, g))
        assert len(got) == len(exp)
        for a, b in zip(got, exp, strict=True):  # logits etc.: this rank's samples
            assert_close(a, b.detach(), **TOL)
        _loss(out).backward()
        _loss(want).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    # this rank's stages (one, or a lane's several) hold every parameter the model still has
    named = {n: p for stage in cm.stages for n, p in stage.named_parameters()}
    held = {id(p): p for p in named.values()}.values()
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in held)
    for pname, p in named.items():
        assert_close(p, ref.get_parameter(pname), **TOL, msg=lambda m, n=pname: f"{n}: {m}")
    assert cm.plan.world_size == world and f"rank {rank} runs stage" in repr(cm)
    assert f"rank {world - 1} " in repr(cm).split("one step:")[1]  # a grid row per rank
    if "schedule" in cfg:
        assert cm.plan.schedule == cfg["schedule"] and f"schedule {cfg['schedule']}" in repr(cm)
    if cfg.get("recompute") is not None:  # R, or selectively (the search's first choice)
        assert all((st.recompute or st.selective) == cfg["recompute"] for st in cm.plan.stages)
    if cfg.get("recompute_selective") is False:
        assert not any(st.selective for st in cm.plan.stages)
    if cfg.get("recompute_layers"):  # every stage that holds a layer start recomputes by layer
        assert any(st.checkpoints for st in cm.plan.stages)
    # the user's Adam was timed for the plan: every stage with parameters has a step cost
    assert all((st.optimizer_ms > 0) == (st.memory.grads > 0) for st in cm.plan.stages), [
        (st.index, st.optimizer_ms, st.memory.grads, st.param_names) for st in cm.plan.stages]
    return _loss(out).item()


@pytest.mark.parametrize(
    "name,world,cfg",
    [
        ("mlp", 1, dict(micro_batches=2)),
        ("mlp", 2, dict(replicas=(1, 1), micro_batches=2)),
        ("mlp", 3, dict(replicas=(2, 1), micro_batches=3)),
        ("cnn", 2, dict(replicas=(1, 1), micro_batches=1)),
        ("gpt", 2, dict(replicas=(1, 1), micro_batches=2)),
        ("gpt", 3, dict(replicas=(2, 1), micro_batches=2)),
        ("gpt", 4, dict(replicas=(2, 1, 1), micro_batches=2)),
        ("gpt", 2, dict()),  # whatever the search picks
        ("mlp", 4, dict(replicas=(1, 1, 1, 1), micro_batches=8)),
        ("mlp", 4, dict(replicas=(1, 3), micro_batches=2)),
        ("cnn", 3, dict(replicas=(1, 1, 1), micro_batches=1)),  # BatchNorm: exact with m=1, r=1
    ],
)
def test_trains_like_one_process(name, world, cfg):
    _warm(name)
    losses = run_ranks(_train, world, name, cfg, timeout_s=60.0, wall_s=120.0)
    assert len(set(losses)) == 1


@pytest.mark.parametrize(
    "name,world,cfg",
    [
        ("mlp", 1, dict(micro_batches=2, recompute=True, recompute_selective=False)),
        ("mlp", 3, dict(replicas=(2, 1), micro_batches=3, schedule="1f1b", recompute=True)),
        ("gpt", 2, dict(replicas=(1, 1), micro_batches=4, schedule="1f1b")),
        ("gpt", 3, dict(replicas=(1, 1, 1), micro_batches=3, schedule="1f1b", recompute=True,
                        recompute_selective=False)),
        ("gpt", 4, dict(replicas=(2, 1, 1), micro_batches=2, schedule="gpipe", recompute=True)),
        ("cnn", 2, dict(replicas=(1, 1), micro_batches=1, schedule="1f1b", recompute=True)),
        ("cnn", 2, dict(replicas=(1, 1), micro_batches=1, schedule="gpipe", recompute=True,
                        recompute_selective=False)),
        # several stages a rank (replicas count lanes)
        ("gpt", 2, dict(replicas=(1, 1), micro_batches=4, schedule="interleaved")),
        ("gpt", 3, dict(replicas=(2, 1), micro_batches=2, schedule="zbv")),
        ("gpt", 2, dict(replicas=(1, 1), micro_batches=4, schedule="zbv", recompute=True)),
        ("gpt", 3, dict(replicas=(2, 1), micro_batches=2, schedule="interleaved",
                        recompute=True)),
        ("mlp", 4, dict(replicas=(1, 1, 1, 1), micro_batches=4, schedule="zbv")),
    ],
)
def test_schedules_and_recomputation_train_like_one_process(name, world, cfg):
    _warm(name)
    losses = run_ranks(_train, world, name, cfg, timeout_s=60.0, wall_s=120.0)
    assert len(set(losses)) == 1


def _saved_plan(rank: int, world: int, path: str) -> None:
    model, args, kwargs = _example("mlp", LOCAL * world)
    local_args = _local(args, rank, LOCAL * world)
    cfg = Config(replicas=(1,) * world, micro_batches=2, profile_cache_dir=None)
    first = rannc_compile(copy.deepcopy(model), None, cfg)
    loss = first(*local_args)
    if rank == 0:
        first.plan.save(path)
    torch.distributed.barrier()
    again = rannc_compile(copy.deepcopy(model), None, plan=path)  # no profiling, no search
    assert_close(again(*local_args), loss, rtol=0, atol=0)
    assert again.plan == first.plan
    from rannc_fx.models import MLP

    with pytest.raises(ValueError, match="made for another model"):
        rannc_compile(MLP(hidden=48), None, plan=path)(*local_args)


def _wrong_world(rank: int, world: int, path: str) -> None:
    model, args, _ = _example("mlp", LOCAL)
    with pytest.raises(ValueError, match="the plan is for 2 ranks but 1 are running"):
        rannc_compile(model, None, plan=path)(*args)


def test_saved_plan_skips_planning_and_is_checked(tmp_path):
    path = str(tmp_path / "mlp.plan.json")
    run_ranks(_saved_plan, 2, path, timeout_s=60.0)
    run_ranks(_wrong_world, 1, path)


class DropoutMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(64, 4)
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.net(x), y)


def _dropout(rank: int, world: int) -> list[float]:
    torch.manual_seed(0)
    model = DropoutMLP()
    x, y = torch.randn(LOCAL * world, 16), torch.randint(0, 4, (LOCAL * world,))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    cfg = Config(replicas=(1, 1), micro_batches=2, profile_cache_dir=None)
    cm = rannc_compile(model, opt, cfg)
    losses = []
    for _ in range(30):
        loss = cm(*_local((x, y), rank, LOCAL * world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_dropout_trains_and_the_loss_falls():
    losses = run_ranks(_dropout, 2, timeout_s=60.0)
    assert losses[0] == losses[1]  # one loss, the same on every rank
    first, last = sum(losses[0][:5]) / 5, sum(losses[0][-5:]) / 5
    assert last < 0.7 * first, losses[0]


class SeqFirst(torch.nn.Module):
    """Returns logits as (seq * batch, classes), the layout of PyTorch's word-LM example:
    rows of different samples interleave (``seq`` blocks of one row per sample)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(8, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.b(torch.relu(self.a(x))).transpose(0, 1)  # (seq, batch, 5)
        logits = h.reshape(-1, h.size(-1))
        loss = torch.nn.functional.cross_entropy(logits, y.transpose(0, 1).reshape(-1))
        return loss, logits


def _interleaved_output(rank: int, world: int, cfg: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model, g = SeqFirst(), LOCAL * world
    x, y = torch.randn(g, 3, 6), torch.randint(0, 5, (g, 3))
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    cm = rannc_compile(model, opt, Config(profile_cache_dir=None, profile_repeats=1, **cfg))
    lx, ly = _local((x, y), rank, g)
    for _ in range(3):
        loss, logits = cm(lx, ly)
        assert cm.plan.outputs[1].spec.interleave == 3
        with torch.no_grad():
            assert_close(logits, ref(lx, ly)[1], **TOL)  # laid out as for the local batch
        want = ref(x, y)[0]
        assert_close(loss, want, **TOL)
        loss.backward()
        want.backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for pname, p in cm.stages[0].named_parameters():
        assert_close(p, ref.get_parameter(pname), **TOL)


@pytest.mark.parametrize(
    "world,cfg", [(2, dict(replicas=(1, 1), micro_batches=1)), (3, dict(replicas=(2, 1)))]
)
def test_an_interleaved_output_comes_back_in_the_local_layout(world, cfg):
    run_ranks(_interleaved_output, world, cfg, timeout_s=60.0)


class HalfRows(torch.nn.Module):
    """Returns (2, batch * 2): half the samples in each row, a layout nothing can route."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin(x)
        return h.pow(2).mean(), h.reshape(2, -1)


def _unroutable(rank: int, world: int) -> None:
    torch.manual_seed(0)
    cm = rannc_compile(HalfRows(), None, Config(profile_cache_dir=None, micro_batches=1))
    with pytest.raises(ValueError, match=r"model output 1 \('reshape'.*interleaved.*"
                       r"view\(seq, batch, -1\)"):
        cm(torch.randn(LOCAL, 4))


def test_an_output_whose_rows_cannot_be_routed_is_refused_on_every_rank():
    run_ranks(_unroutable, 2, timeout_s=30.0)
