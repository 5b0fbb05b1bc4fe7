"""Training starts from rank 0's model: ranks that seed differently before building the model
train exactly like one process started from rank 0's initial weights (its buffers, frozen,
tied and host-memory parameters too) under 1 stage x 2, 2 x 1, 2 x 2, a lane of two stages
and a plan from a file, and a meta-built model's ``init=`` draws the same values on every
rank; with ``sync_module_states=False`` each rank keeps its own, so the replicas differ."""

from __future__ import annotations

import copy
import functools
import zlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import rannc_fx
from rannc_fx.startup import sync
from tests.dist_utils import run_ranks
from tests.harness import Run, optimizer, test_config, train_against_reference

# forced plans without the link probe or per-op profiling (they cost seconds a case)
CFG = dict(timeout_s=30.0, cost_model="analytic", link_bandwidth=1e9, link_latency=1e-5,
           allreduce_bandwidth=1e9)
TOL = dict(rtol=1e-5, atol=1e-6)
LOCAL = 2  # samples per rank
STEPS = 3


class Net(nn.Module):
    """Every kind of tensor a stage holds: Linear layers, an input layer tied to the head, a
    frozen layer, a BatchNorm in eval mode (its running statistics shape the forward), a
    persistent and a non-persistent buffer; all random, so differently seeded ranks differ."""

    def __init__(self, d: int = 16, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.norm = nn.BatchNorm1d(d).eval()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.frozen = nn.Linear(d, d).requires_grad_(False)
        self.head = nn.Linear(d, d)
        self.head.weight = self.embed.weight  # tied: read by the first and the last stage
        self.shift: torch.Tensor
        self.scale: torch.Tensor
        self.register_buffer("shift", torch.empty(d))
        self.register_buffer("scale", torch.empty(d), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.shift.is_meta:
            return  # materialized by compile(init=...) instead
        with torch.no_grad():
            self.shift.uniform_(-0.5, 0.5)
            self.scale.uniform_(0.5, 1.5)
            self.norm.running_mean.normal_()
            self.norm.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(x) + self.shift) * self.scale
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return F.mse_loss(self.head(self.frozen(h)), y)


def _init(module: nn.Module) -> None:
    """A meta-built Net's init: random draws for every tensor a module owns."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.3)
        nn.init.uniform_(module.bias, -0.1, 0.1)
    elif isinstance(module, nn.BatchNorm1d):
        nn.init.uniform_(module.weight, 0.5, 1.5)
        nn.init.zeros_(module.bias)
        with torch.no_grad():
            module.running_mean.normal_()
            module.running_var.uniform_(0.5, 2.0)
            module.num_batches_tracked.zero_()
    elif isinstance(module, Net):
        with torch.no_grad():
            module.shift.uniform_(-0.5, 0.5)
            module.scale.uniform_(0.5, 1.5)


def _materialized(seed: int) -> Net:
    """A meta-built Net as compile(init=_init) materializes it, whole, by the documented rule:
    in model order, each module owning tensors inits them from torch's generator seeded with
    (rank 0's seed + crc32 of the module's name) mod 2**63."""
    with torch.device("meta"):
        model = Net()
    model.to_empty(device="cpu")
    model.head.weight = model.embed.weight  # to_empty made one tensor of each name
    done: set[int] = set()
    with torch.random.fork_rng():
        for name, mod in model.named_modules(remove_duplicate=False):
            if id(mod) in done or not (mod._parameters or mod._buffers):
                continue
            done.add(id(mod))
            torch.manual_seed((seed + zlib.crc32(name.encode())) % 2**63)
            _init(mod)
    return model


def _batch(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)  # the same global batch on every rank
    return torch.randn(LOCAL * world, 16, generator=g), torch.randn(LOCAL * world, 16, generator=g)


def _every_step(world: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _batch(world)  # the same batch at every step


def _rank_model(how: str, cfg: dict[str, Any], tmp: str) -> Net:
    """This rank's model, drawn from its own seed (on the meta device for "meta"); for "file",
    a plan made by an earlier compile of a copy, saved by rank 0 to ``tmp`` for every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)  # each rank draws its own model
    if how == "meta":
        with torch.device("meta"):
            return Net()
    model = Net()
    if how == "file":
        x, y = _batch(world)
        lx, ly = x[rank * LOCAL:(rank + 1) * LOCAL], y[rank * LOCAL:(rank + 1) * LOCAL]
        first = rannc_fx.compile(copy.deepcopy(model), None, test_config(**CFG, **cfg),
                                 example_args=(lx, ly))
        if rank == 0:
            first.plan.save(tmp)
        dist.barrier()
    return model


def _rank_0s_model(how: str) -> Net:
    """What rank 0 built (or, from the meta device, what ``init=`` materializes there)."""
    if how == "meta":
        return _materialized(seed=0)  # rank 0's seed
    torch.manual_seed(0)
    return Net()


def _from_rank_0(how: str, run: Run) -> Any:
    """Every tensor this rank holds starts as rank 0's (unless "off"), then 3 Adam steps; for
    "off", whether this rank started from rank 0's and where its tensors ended."""
    cm, ref = run.cm, run.ref
    start = {k: v.clone() for k, v in cm.state_dict().items()}
    assert start, "this rank holds no tensors"
    differ = [k for k, v in start.items() if not torch.equal(v, ref.state_dict()[k])]
    assert how == "off" or not differ, differ
    for step in range(1, STEPS + 1):
        loss, want = run.forward(run.batch(step))
        if how != "off":
            run.compare(loss, want)
        run.backward(loss, want)
        run.step()
    if how == "off":
        return not differ, {k: v.tolist() for k, v in cm.state_dict().items()}
    return sorted(start)


def _trained(run: Run) -> Any:
    """The parameters trained, so equal ones mean equal training."""
    moved = max(float((run.ref.get_parameter(name).detach() - run.before[name]).abs().max())
                for stage in run.cm.stages for name, _ in stage.named_parameters())
    assert moved > 1e-3
    return sorted(run.cm.state_dict())


def _train(world: int, cfg: dict[str, Any], how: str, tmp: str = "",
           bucket: int | None = None) -> list[Any]:
    """Seed by rank, build, compile, check the start and 3 Adam steps against one process
    started from rank 0's model. ``how``: "cpu", "meta" (init=), "file" (a saved plan),
    "off" (sync_module_states=False: returns whether this rank started from rank 0's).
    ``bucket``: the transfer's bucket bytes (a 16 x 16 weight is 1 KiB)."""
    got = train_against_reference(
        functools.partial(_rank_model, how, cfg, tmp), {**CFG, **cfg,
                                                       "sync_module_states": how != "off"},
        world, data=functools.partial(_every_step, world), reference=functools.partial(
            _rank_0s_model, how), optimizer=optimizer(torch.optim.Adam, lr=0.01), tol=TOL,
        params=how != "off", compile_kw=dict(plan=tmp if how == "file" else None,
                                             init=_init if how == "meta" else None),
        loop=functools.partial(_from_rank_0, how), check=None if how == "off" else _trained,
        timeout_s=30.0,
        patches=[(sync.__name__, "BUCKET_BYTES", bucket)] if bucket is not None else ())
    return [t.extra for t in got]


@pytest.mark.parametrize("world,cfg,how,bucket", [
    (2, dict(replicas=(2,), micro_batches=2, tracer="fx"), "cpu", None),  # 1 stage x 2
    (2, dict(replicas=(1, 1), micro_batches=2, tracer="export", host_params=True), "cpu", None),
    # 2 x 2: lane 1 gets its tensors through its first rank; buckets of one weight, or of
    # several smaller tensors
    (4, dict(replicas=(2, 2), micro_batches=2, tracer="fx", zero=1), "cpu", 1024),
    (2, dict(replicas=(1, 1), micro_batches=4, tracer="fx", schedule="interleaved"), "file", 1500),
    (4, dict(replicas=(2, 2), micro_batches=2, tracer="export"), "meta", None),
])
def test_ranks_seeded_differently_train_like_one_process_from_rank_0s_model(
    world, cfg, how, bucket, tmp_path
):
    held = _train(world, cfg, how, str(tmp_path / "plan.json"), bucket)
    # every tensor of the model was checked on some rank (export keeps no counter of a
    # BatchNorm in eval mode: nothing reads it)
    assert set().union(*held) >= set(Net().state_dict()) - {"norm.num_batches_tracked"}


def test_without_the_transfer_each_rank_keeps_its_own_model():
    cfg = dict(replicas=(2,), micro_batches=2, tracer="fx")
    (first, a), (second, b) = _train(2, cfg, "off")
    assert first and not second  # rank 1 started from its own draws, not rank 0's
    assert any(a[k] != b[k] for k in a)  # and the replicas stay apart after the steps


def _unlike(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = Net()
    if rank == 1:  # a buffer of another shape (it still broadcasts in the forward)
        model.shift = torch.zeros(1)
    x, y = _batch(world)
    cfg = test_config(**CFG, replicas=(2,), micro_batches=2, tracer="fx")
    with pytest.raises(ValueError, match="the ranks built different models") as e:
        rannc_fx.compile(model, None, cfg, example_args=(x[:LOCAL], y[:LOCAL]))
    return str(e.value)


def test_ranks_that_built_different_models_are_refused_on_every_rank():
    messages = run_ranks(_unlike, 2, timeout_s=30.0, wall_s=120.0)
    assert messages[0] == messages[1] and "rank 1's stage(s) [0]" in messages[0]
