"""The examples run as their docstrings say (torchrun, 2 processes on CPU) and the loss falls."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.dist_utils import free_port
from tests.unit.test_examples import EXAMPLES

pytestmark = pytest.mark.scripts  # whole processes (conftest: their own xdist group)


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
