"""A plan file given to ``compile(plan=...)`` trains exactly as planned, and one whose fields
that change what trains disagree with the model or the Config is refused on every rank."""

from __future__ import annotations

import copy
import json

import torch

import rannc_fx
from examples.models import gpt_example
from tests.dist_utils import local_part, run_ranks
from tests.harness import LINK, test_config

LOCAL = 4
CONFIG = dict(LINK, timeout_s=30.0, replicas=(1, 1), micro_batches=2, schedule="gpipe")

# (field edited in the file, its new value, the Config the plan is loaded with)
EDITS = [
    ("shared_params", [], {}),
    ("loss_reduction", "sum", {}),
    ("batch_norm", "micro-batch", {}),
    ("schedule", "1f1b", {}),
    ("micro_batches", 4, {}),
    ("micro_batches", 2, {"micro_batches": 4}),  # the file as made, another Config
]


def _steps(cm: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, world: int) -> list[float]:
    out = []
    for step in range(3):
        model, args, kwargs = gpt_example(LOCAL * world)
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 64, args[0].shape, generator=g)
        ids, labels = local_part((ids, torch.roll(ids, -1, 1)), rank, LOCAL * world, LOCAL)
        loss = cm(ids, labels=labels)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(float(loss))
    return out


def _run(rank: int, world: int, folder: str) -> tuple[list[float], list[float], list[str]]:
    torch.manual_seed(0)
    model, _, _ = gpt_example(LOCAL * world)
    fresh = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cm = rannc_fx.compile(model, opt, test_config(**CONFIG))
    planned = _steps(cm, opt, rank, world)
    path = f"{folder}/plan.json"
    if rank == 0:
        cm.plan.save(path)
    torch.distributed.barrier()
    again = copy.deepcopy(fresh)
    opt2 = torch.optim.SGD(again.parameters(), lr=0.1)
    loaded = _steps(rannc_fx.compile(again, opt2, test_config(**CONFIG), plan=path), opt2, rank, world)
    refusals = []
    for k, (field, value, config) in enumerate(EDITS):
        edited = f"{folder}/edited{k}.json"
        if rank == 0:
            with open(path) as f:
                data = json.load(f)
            assert field in data
            data[field] = value
            with open(edited, "w") as f:
                json.dump(data, f)
        torch.distributed.barrier()
        model = copy.deepcopy(fresh)
        cm = rannc_fx.compile(model, None, test_config(**{**CONFIG, **config}), plan=edited)
        try:
            _steps(cm, torch.optim.SGD(model.parameters(), lr=0.1), rank, world)
        except ValueError as e:
            refusals.append(str(e))
        else:
            refusals.append("trained")
    return planned, loaded, refusals


def test_a_plan_file_trains_as_planned_and_an_edited_one_is_refused(tmp_path):
    results = run_ranks(_run, 2, str(tmp_path), timeout_s=30.0, wall_s=240.0)
    for planned, loaded, _ in results:
        assert loaded == planned  # the same plan: bit for bit
    for k, (field, _, _) in enumerate(EDITS):
        said = [r[2][k] for r in results]
        assert all(s == said[0] for s in said), said  # the same refusal on every rank
        assert said[0].startswith("the plan given to compile() disagrees"), said[0]
        assert f"{field}: the plan says" in said[0], said[0]


