"""Tracing a step: every rank's actions in one Chrome trace, the prediction beside them, and
the summary; the traced steps train like one process."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import rannc_fx
from examples.models import gpt_example
from rannc_fx.__main__ import main as cli
from rannc_fx.plan.plan import Plan
from rannc_fx.runtime.tracefile import matching_start, summarize
from rannc_fx.schedules.lowering import lower_plan
from tests.dist_utils import run_ranks
from tests.harness import LINK, Run, test_config, train_against_reference

LOCAL = 4  # samples per rank
STEPS = 4
TRACED = (2, 3)


def _gpt_batch(world: int, step: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    torch.manual_seed(step)
    _, args, kwargs = gpt_example(batch=LOCAL * world)
    return args, kwargs


def _plan(run: Run) -> str:
    return run.cm.plan.to_json()


def _label(a: Any) -> str:
    return a.kind.value + ("" if a.microbatch is None else str(a.microbatch))


@pytest.fixture(scope="module", params=["gpipe", "1f1b", "gpipe+recompute"])
def traced(request, tmp_path_factory) -> tuple[dict[str, Any], Plan, Path, str]:
    out = tmp_path_factory.mktemp(f"trace_{request.param}")
    schedule, _, recompute = request.param.partition("+")
    cfg = dict(replicas=(2, 1), micro_batches=2, schedule=schedule, recompute=bool(recompute))
    # the traced steps train like one process
    got = train_against_reference(
        functools.partial(gpt_example, batch=LOCAL * 3),
        dict(trace_dir=str(out), trace_steps=f"{TRACED[0]}-{TRACED[-1]}", **cfg), 3, STEPS,
        data=functools.partial(_gpt_batch, 3), check=_plan, timeout_s=30.0)
    plan = Plan.from_json(got[0].extra)
    path = out / "trace.json"
    return json.loads(path.read_text()), plan, path, schedule


def _measured(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["pid"] == 0]


def test_every_action_of_the_schedule_appears_once_per_step_on_its_rank(traced):
    trace, plan, _, schedule = traced
    # a step with its loss in the call's 1F1B list, or GPipe's (the backward deferred)
    lowered = lower_plan(plan, schedule)[1]
    events = _measured(trace)
    for step in TRACED:
        for st in plan.stages:
            for rank in st.ranks:
                ran = [e["name"] for e in sorted(events, key=lambda e: e["ts"])
                       if e["tid"] == rank and e["args"]["step"] == step
                       and e["cat"] in ("compute", "post")
                       or e["tid"] == rank and e["args"]["step"] == step
                       and e["args"].get("kind") in ("GATHER", "REDUCE")]
                assert ran == [_label(a) for a in lowered[st.index]], (step, rank)
                assert ("R0" in ran) == st.recompute
                assert all(e["args"]["stage"] == st.index for e in events if e["tid"] == rank)
                optimizer = [e for e in events if e["tid"] == rank and e["args"]["step"] == step
                             and e["cat"] == "optimizer"]
                assert len(optimizer) == 1
    assert {e["args"]["step"] for e in events} == set(TRACED)  # steps 1 and 4 untraced


def test_events_on_one_rank_never_overlap(traced):
    trace, plan, _, _ = traced
    for rank in range(plan.world_size):
        mine = sorted((e for e in _measured(trace) if e["tid"] == rank), key=lambda e: e["ts"])
        assert len(mine) > 10
        for a, b in zip(mine, mine[1:], strict=False):
            assert b["ts"] >= a["ts"] + a["dur"] - 1e-3, (a["name"], b["name"])


def test_a_receive_never_ends_before_its_matching_send_starts(traced):
    trace, _, _, _ = traced
    meta = trace["otherData"]["rannc_fx"]
    slack_us = max(meta["clock"]["uncertainty_ns"].values()) / 1e3
    events = _measured(trace)
    waits = [e for e in events if e["cat"] == "wait"]
    assert {e["args"]["match"] for e in waits} >= {"SEND_F", "SEND_B"}
    for step in TRACED:
        rows: dict[int, list[dict[str, Any]]] = {}
        for e in events:
            if e["args"]["step"] == step:
                rows.setdefault(e["tid"], []).append(e)
        for rank, evs in rows.items():
            for e in evs:
                if e["cat"] != "wait":
                    continue
                sent = matching_start(e, rank, rows)
                assert sent is not None, e
                assert e["ts"] + e["dur"] >= sent - slack_us, (e, sent)


def test_the_prediction_and_the_summary_sit_beside_the_measurement(traced, capsys):
    trace, plan, path, _ = traced
    predicted = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["pid"] == 1]
    assert {e["tid"] for e in predicted} == {st.index for st in plan.stages}
    assert {e["args"]["step"] for e in predicted} == set(TRACED)
    s = summarize(trace)
    assert s.steps == TRACED and s.unmatched == 0
    assert s.predicted_ms is not None and s.predicted_ms > 0 and s.step_ms > 0
    # the parts from the events themselves: busy is the compute and optimizer events of a
    # stage's ranks over the step (first call to last event), the mean over ranks and steps
    meta = trace["otherData"]["rannc_fx"]
    events = _measured(trace)
    for st in s.stages:
        busy = comm_wait = 0.0
        for step in TRACED:
            mine = [e for e in events if e["args"]["step"] == step]
            begin = min(meta["step_starts"][str(step)].values())
            span = max(e["ts"] + e["dur"] for e in mine) - begin
            for r in st.ranks:
                held = [e for e in mine if e["tid"] == r]
                busy += sum(e["dur"] for e in held if e["cat"] in ("compute", "optimizer")) / span
                comm_wait += sum(e["dur"] for e in held
                                 if e["cat"] in ("wait", "collective", "post")) / span
        n = len(TRACED) * len(st.ranks)
        assert st.measured["busy"] == pytest.approx(busy / n, rel=1e-6) and busy > 0
        assert st.measured["bubble"] + st.measured["comm"] == pytest.approx(comm_wait / n,
                                                                            rel=1e-6)
        # predicted busy + comm: the stage's drawn actions over the drawn step's length
        assert st.predicted is not None
        drawn = [e for e in predicted if e["tid"] == st.stage and e["args"]["step"] == TRACED[0]]
        at = min(e["ts"] for e in predicted if e["args"]["step"] == TRACED[0])
        makespan = max(e["ts"] + e["dur"] for e in predicted
                       if e["args"]["step"] == TRACED[0]) - at
        assert st.predicted["busy"] + st.predicted["comm"] == pytest.approx(
            sum(e["dur"] for e in drawn) / makespan, rel=1e-6)
    assert cli(["trace", "summary", str(path)]) == 0
    printed = capsys.readouterr().out
    assert f"steps {TRACED[0]}-{TRACED[-1]}" in printed and "predicted" in printed
    for st in plan.stages:
        assert f"\n{st.index:<6}{','.join(map(str, st.ranks)):<8}" in printed


def _alone(rank: int, world: int, out: str) -> tuple[list[str], bool]:
    import logging

    from examples.models import mlp_example

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("rannc_fx").addHandler(handler)
    model, (x, y), _ = mlp_example(batch=LOCAL)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # one micro-batch: what runs alone is one rank, one micro-batch (the search may cut the
    # batch on one rank where the measured costs say that is no slower)
    cm = rannc_fx.compile(model, opt, test_config(trace_dir=out, trace_steps="1-2",
                                                  micro_batches=1),
                          example_args=(x, y))
    for _ in range(3):
        cm(x, y).backward()
        opt.step()
    return said, (Path(out) / "trace.json").exists()


def test_a_one_rank_plan_says_it_has_no_schedule_to_trace(tmp_path):
    said, written = run_ranks(_alone, 1, str(tmp_path), timeout_s=30.0)[0]
    assert any("no schedule to trace" in m for m in said) and not written



AHEAD_NS = 3600 * 10**9  # rank 1's clock in the test below: an hour ahead of rank 0's


def _clock_ahead(rank: int, world: int, out: str) -> dict[str, Any] | None:
    import time
    import types

    import rannc_fx.runtime.trace as trace_module
    from examples.models import mlp_example

    if rank == 1:  # every time the recorder takes, on this rank only (a forked process)
        real = time.perf_counter_ns
        trace_module.time = types.SimpleNamespace(  # type: ignore[assignment]
            perf_counter_ns=lambda: real() + AHEAD_NS)
    model, (x, y), _ = mlp_example(batch=LOCAL)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = test_config(**LINK, timeout_s=30.0, replicas=(1, 1), micro_batches=2, trace_dir=out,
                      trace_steps="2-3")
    cm = rannc_fx.compile(model, opt, cfg, example_args=(x, y))
    for _ in range(3):
        cm(x, y).backward()
        opt.step()
        opt.zero_grad()
    return json.loads((Path(out) / "trace.json").read_text()) if rank == 0 else None


def test_a_rank_whose_clock_runs_ahead_is_aligned_to_rank_0(tmp_path):
    """All ranks here share one clock, so an offset of 0 would pass with either sign: rank 1's
    clock is put an hour ahead, and the trace must measure that and take it out."""
    trace = run_ranks(_clock_ahead, 2, str(tmp_path), timeout_s=30.0, wall_s=120.0)[0]
    clock = trace["otherData"]["rannc_fx"]["clock"]
    offset, half_trip = clock["offset_ns"]["1"], clock["uncertainty_ns"]["1"]
    assert clock["offset_ns"]["0"] == 0 and 0 < half_trip < 10**9
    assert abs(offset - AHEAD_NS) <= half_trip, (offset, half_trip)
    # on rank 0's clock both ranks begin each step within a second, not an hour apart
    for step, by_rank in trace["otherData"]["rannc_fx"]["step_starts"].items():
        assert abs(by_rank["1"] - by_rank["0"]) < 1e6, (step, by_rank)
    events = _measured(trace)
    assert {e["tid"] for e in events} == {0, 1}
    assert max(e["ts"] + e["dur"] for e in events) < 60e6  # us: both steps, not an hour
    assert summarize(trace).unmatched == 0 and summarize(trace).step_ms < 1e3


@pytest.mark.scripts  # two whole processes (conftest: their own xdist group)
def test_a_run_that_ends_before_its_traced_steps_says_so_at_exit(tmp_path):
    import os
    import subprocess
    import sys

    from tests.dist_utils import free_port

    script = Path(__file__).parents[1] / "scripts" / "trace_short.py"
    port, procs = free_port(), []
    for rank in range(2):  # real processes: the warning comes from an atexit hook
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env,
                                      text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    done = [p.communicate(timeout=120) + (p.returncode,) for p in procs]
    for out, err, code in done:
        assert code == 0 and out == "ran\n", err
    said = [err.count("no trace written") for _, err, _ in done]
    assert said == [1, 0]  # rank 0 only
    assert "the run ended at step 2, before step 4" in done[0][1]
    assert not (tmp_path / "trace.json").exists()
