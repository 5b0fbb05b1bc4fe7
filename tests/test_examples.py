"""The examples run as their docstrings say (torchrun, 2 processes on CPU) and the loss falls."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .dist_utils import free_port

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


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
    assert "rannc_fx plan: 2 stage(s) on 2 rank(s)" in out, out
    losses = [float(x) for x in re.findall(r"^step +\d+ +loss ([\d.]+)", out, re.M)]
    assert len(losses) == 2 and losses[1] < losses[0], out
