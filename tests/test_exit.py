"""A script that ends without ``destroy_process_group()`` exits 0: rannc_fx destroys the
process group at interpreter exit (a gloo process that exits with it alive can abort)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .dist_utils import free_port

SCRIPT = Path(__file__).parent / "scripts" / "no_cleanup.py"
RUNS = 3


def _run_pair() -> list[subprocess.CompletedProcess[str]]:
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    done = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


@pytest.mark.slow  # ~4 s a run: two processes import torch and plan
def test_a_script_without_clean_up_exits_zero_every_time():
    for _ in range(RUNS):
        for rank, done in enumerate(_run_pair()):
            assert done.returncode == 0, f"rank {rank} exited {done.returncode}:\n{done.stderr}"
            assert "terminate called" not in done.stderr
            assert done.stdout.startswith("loss "), done.stdout + done.stderr
