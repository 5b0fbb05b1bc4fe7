"""The examples run as their docstrings say (torchrun, 2 processes on CPU) and the loss falls."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import free_port

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _torchrun(script: str, *args: str) -> str:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(free_port()), str(EXAMPLES / script), *args,
    ]
    env = dict(os.environ, RANNC_FX_PROFILE_CACHE_DIR="null", RANNC_FX_TIMEOUT_S="60")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow  # ~20 s each: three processes import torch, rank 0 plans
@pytest.mark.parametrize("script", ["train.py", "train_hf.py"])
def test_example_prints_the_plan_and_a_falling_loss(script):
    if script == "train_hf.py":
        pytest.importorskip("transformers")
    out = _torchrun(script, "--steps", "12", "--layers", "1", "--stages", "2",
                    "--log-every", "11")
    # two stages, or two lanes of two stages where the planner interleaves
    found = re.search(r"rannc_fx plan: (\d+) stage\(s\) on 2 rank\(s\)", out)
    assert found and (found.group(1) == "2" or "2 stages a lane" in out), out
    losses = [float(x) for x in re.findall(r"^step +\d+ +loss ([\d.]+)", out, re.M)]
    assert len(losses) == 2 and losses[1] < losses[0], out


def _losses(out: str) -> dict[int, float]:
    return {int(s): float(x) for s, x in re.findall(r"^step +(\d+) +loss ([\d.]+)", out, re.M)}


@pytest.mark.slow  # ~20 s: three torchrun launches
def test_train_resumes_from_its_checkpoint_on_the_same_trajectory(tmp_path):
    small = ["--layers", "2", "--d-model", "64", "--seq", "32", "--vocab", "256",
             "--stages", "2", "--micro-batches", "2", "--log-every", "1"]
    ckpt = ["--ckpt-dir", str(tmp_path), "--ckpt-every", "3"]
    whole = _losses(_torchrun("train.py", *small, *ckpt, "--steps", "10"))
    assert all((tmp_path / f"step_{k}" / ".metadata").is_file() for k in (3, 6, 9, 10))
    # as if the run died saving step 9: DCP writes .metadata last; step 10 never began
    (tmp_path / "step_9" / ".metadata").unlink()
    shutil.rmtree(tmp_path / "step_10")
    out = _torchrun("train.py", *small, *ckpt, "--steps", "10", "--resume")
    assert f"resumed from {tmp_path / 'step_6'} at step 6" in out, out
    resumed = _losses(out)
    assert sorted(resumed) == [6, 7, 8, 9], out
    for step, loss in resumed.items():
        assert loss == pytest.approx(whole[step], rel=1e-4), (step, whole, resumed)
    assert (tmp_path / "step_10" / ".metadata").is_file()  # the last step is saved too


def _train_module():  # type: ignore[no-untyped-def]
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_example", EXAMPLES / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_main_jobs_budget_forces_the_plan_the_readme_names(monkeypatch):
    """README: with its default 24 MiB per device the main job's model fits no single rank
    with Adam even with one micro-batch in flight, nor two replicas with the Adam state
    sharded between them, and on 2 ranks the search (nothing forced) picks two stages,
    16 micro-batches, the tied embedding on both, run as ZB-H1 (its simulated step shorter
    than the same stages' under 1F1B: the first stage's backward is not split). Planned here
    with the script's own options and model, costed analytically (the same on any machine;
    the job measures its costs, and its plan follows them)."""
    import torch

    import rannc_fx
    from rannc_fx.models import TransformerLM

    train = _train_module()
    monkeypatch.setattr(sys, "argv", ["train.py"])
    args = train.parse_args()
    cfg = train.config(args).model_copy(update={"cost_model": "analytic", "profile_cache_dir": None,
                                                 "profile_repeats": 1})
    assert cfg.device_memory == 24 * 2**20 and cfg.stages is None and cfg.micro_batches is None
    model = TransformerLM(args.vocab, args.d_model, layers=args.layers, seq=args.seq)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    ids = torch.zeros(2 * args.batch, args.seq, dtype=torch.long)  # 2 ranks' local batches

    def plan(world: int, **forced: object) -> rannc_fx.Plan:
        return rannc_fx.partition(model, (ids,), {"labels": ids}, world_size=world,
                                  device="cpu", config=cfg.model_copy(update=forced),
                                  optimizer=opt).plan

    chosen = plan(2)
    assert [st.replicas for st in chosen.stages] == [1, 1]
    assert chosen.schedule == "zbh1" and chosen.micro_batches == 16
    one_f_one_b = plan(2, schedule="1f1b")
    assert [(st.first_block, st.end_block) for st in one_f_one_b.stages] == [
        (st.first_block, st.end_block) for st in chosen.stages]
    assert chosen.simulated_step_ms < one_f_one_b.simulated_step_ms
    assert [sp.name for sp in chosen.shared_params] == ["embed.weight"]
    assert all(st.memory.total <= chosen.memory_budget for st in chosen.stages)
    # one rank, one micro-batch in flight (1F1B on one stage), recomputing: still too big
    with pytest.raises(ValueError, match=r"no plan fits 1 device"):
        plan(1, micro_batches=2 * args.batch, schedule="1f1b", recompute=True)
    # and the model replicated on both ranks does not fit either, sharded or not
    with pytest.raises(ValueError, match=r"no plan fits 2 devices"):
        plan(2, stages=1)
    with pytest.raises(ValueError, match=r"no plan fits 2 devices"):
        plan(2, stages=1, zero=1)
