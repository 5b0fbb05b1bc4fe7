"""Multi-node training with torchrun's c10d rendezvous: two agents ("nodes") on this machine.

Each agent runs one worker of ``tests/scripts/train_multinode.py`` (``rannc_fx.compile`` on
the built-in MLP, two stages, one per node). The losses must equal a single-process
reference computed here; and when one node's worker dies, the other must end with an error
naming the rank and the operation, within the process-group timeout: never a hang.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.dist_utils import free_port
from tests.scripts import train_multinode as script

pytestmark = pytest.mark.scripts  # whole processes (conftest: their own xdist group)

SCRIPT = Path(script.__file__)
REPO = SCRIPT.parents[2]
LOCAL = 4
WALL_S = 90.0  # per launch: a hang fails the test instead of the suite


def _agents(tmp: Path, *extra: str) -> tuple[list[int], list[str], float]:
    """Run the two torchrun agents; their return codes, outputs and the wall time."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    procs, logs = [], []
    t0 = time.monotonic()
    for node in (0, 1):
        log = open(tmp / f"agent{node}.log", "w+")  # closed below
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", f"rannc-{port}", "--local-addr", "127.0.0.1", "--max-restarts", "0",
            str(SCRIPT), "--out", str(out), "--local-batch", str(LOCAL), *extra,
        ]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        logs.append(log)
        if node == 0:
            # node 0 hosts the rendezvous store: then node 1 dying cannot take the store along
            _wait_listening(port, procs[0])
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=max(1.0, WALL_S - (time.monotonic() - t0))))
    except subprocess.TimeoutExpired:
        pytest.fail(f"torchrun agents still running after {WALL_S} s: a hang\n" + _read(logs))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    return codes, texts, time.monotonic() - t0


def _wait_listening(port: int, proc: subprocess.Popen, wait_s: float = 30.0) -> None:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and proc.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"torchrun agent 0 did not open the rendezvous port {port}")


def _read(logs: list) -> str:
    text = []
    for log in logs:
        log.seek(0)
        text.append(log.read()[-4000:])
    return "\n".join(text)


def _reference(steps: int, world: int = 2) -> list[float]:
    model, opt = script.build()
    losses = []
    for step in range(steps):
        loss = model(*script.global_batch(step, world * LOCAL))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_two_nodes_train_like_one_process(tmp_path):
    codes, logs, _ = _agents(tmp_path, "--steps", "3")
    assert codes == [0, 0], "\n".join(logs)
    reports = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["node"], r["stage"], r["world"]) for r in reports] == [(0, 0, 2), (1, 1, 2)]
    want = _reference(3)
    for r in reports:
        torch.testing.assert_close(r["losses"], want, rtol=1e-5, atol=1e-6)
    assert want[-1] < want[0]


def test_a_node_that_dies_ends_the_other_with_an_error_naming_it(tmp_path):
    timeout = 5.0
    codes, logs, wall = _agents(
        tmp_path, "--steps", "3", "--die-rank", "1", "--die-step", "1", "--timeout", str(timeout)
    )
    assert codes[0] != 0 and codes[1] != 0, "\n".join(logs)
    # rank 0 waits in step 1's first exchange with rank 1 (the batch sizes every call agrees
    # on) when rank 1 goes
    assert "CommError: rank 0: all-gather of the local batch sizes" in logs[0], logs[0]
    assert "a rank died" in logs[0]
    assert "exitcode  : 3" in logs[1]
    assert wall < 30.0 + timeout
