"""``rannc_fx.compile`` end to end on forked gloo ranks: plan on rank 0, broadcast,
split, free, prune, train; every rank checks loss, outputs and parameters after Adam steps
against a deep-copied single-process reference trained on the global batch."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from torch.testing import assert_close

from rannc_fx.compile import compile as rannc_compile
from tests.dist_utils import local_part, run_ranks
from tests.harness import LINK, TOL, Run, example, optimizer, test_config, train_against_reference

LOCAL = 2  # samples per rank


def _local(tree: Any, rank: int, global_batch: int) -> Any:
    return local_part(tree, rank, global_batch, LOCAL)


def _checks(run: Run) -> None:
    """What the compiled model holds and shows, and the plan made for the case's config."""
    cm, cfg, rank, world = run.cm, run.spec.config, run.rank, run.world
    # this rank's stages (one, or a lane's several) hold every parameter the model still has
    named = {n: p for stage in cm.stages for n, p in stage.named_parameters()}
    held = {id(p): p for p in named.values()}.values()
    assert sum(p.numel() for p in run.model.parameters()) == sum(p.numel() for p in held)
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


def train_zoo_model(name: str, world: int, cfg: dict[str, Any]) -> None:
    """5 Adam steps of the zoo's ``name`` on ``world`` ranks (``LOCAL`` samples each, the first
    call plans) against one process: losses, every output (this rank's samples) and every
    parameter, then ``_checks``; ``test_compile_hf`` runs the transformers models so."""
    train_against_reference(functools.partial(example, name, LOCAL * world), cfg, world,
                            steps=5, example=False, outputs=True, check=_checks)


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
    train_zoo_model(name, world, cfg)


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
    train_zoo_model(name, world, cfg)


def _saved_plan(rank: int, world: int, path: str) -> None:
    model, args, kwargs = example("mlp", LOCAL * world)
    local_args = _local(args, rank, LOCAL * world)
    cfg = test_config(**LINK, replicas=(1,) * world, micro_batches=2)
    first = rannc_compile(copy.deepcopy(model), None, cfg)
    loss = first(*local_args)
    if rank == 0:
        first.plan.save(path)
    torch.distributed.barrier()
    again = rannc_compile(copy.deepcopy(model), None, plan=path)  # no profiling, no search
    assert_close(again(*local_args), loss, rtol=0, atol=0)
    assert again.plan == first.plan
    from examples.models import MLP

    with pytest.raises(ValueError, match="made for another model"):
        rannc_compile(MLP(hidden=48), None, plan=path)(*local_args)


def _wrong_world(rank: int, world: int, path: str) -> None:
    model, args, _ = example("mlp", LOCAL)
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
    cfg = test_config(**LINK, replicas=(1, 1), micro_batches=2)
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


def _seq_first(samples: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], dict]:
    return SeqFirst(), (torch.randn(samples, 3, 6), torch.randint(0, 5, (samples, 3))), {}


def _interleaved_steps(run: Run) -> None:
    """The logits against the reference's on this rank's samples (the layout of a local
    batch), the loss against the global batch's."""
    for step in range(1, 4):
        batch = run.batch(step)
        (args, _), _ = run.split(batch)
        out, want = run.call(batch)
        assert run.cm.plan.outputs[1].spec.interleave == 3
        with torch.no_grad():
            assert_close(out[1], run.ref(*args)[1], **TOL)  # laid out as for the local batch
        run.backward(out, want)
        run.step()


@pytest.mark.parametrize(
    "world,cfg", [(2, dict(replicas=(1, 1), micro_batches=1)), (3, dict(replicas=(2, 1)))]
)
def test_an_interleaved_output_comes_back_in_the_local_layout(world, cfg):
    train_against_reference(functools.partial(_seq_first, LOCAL * world), cfg, world,
                            optimizer=optimizer(torch.optim.Adam, lr=0.01), example=False,
                            loop=_interleaved_steps)


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
    cm = rannc_compile(HalfRows(), None, test_config(**LINK, micro_batches=1))
    with pytest.raises(ValueError, match=r"model output 1 \('reshape'.*interleaved.*"
                       r"view\(seq, batch, -1\)"):
        cm(torch.randn(LOCAL, 4))


def test_an_output_whose_rows_cannot_be_routed_is_refused_on_every_rank():
    run_ranks(_unroutable, 2, timeout_s=30.0)
