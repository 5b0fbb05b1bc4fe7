"""The trace summary's arithmetic on hand-made traces, and the trace options (no processes)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from rannc_fx.__main__ import main as cli
from rannc_fx.plan.config import Config
from rannc_fx.runtime.tracefile import build_trace, format_summary, summarize

MS = 1_000_000  # ns


def _ev(name: str, cat: str, start_ms: float, end_ms: float, **args: Any) -> dict[str, Any]:
    return {"name": name, "cat": cat, "start": int(start_ms * MS), "end": int(end_ms * MS),
            "step": 1, **args}


def _trace(offset_ms: float = 0.0, plans: dict[int, Any] | None = None) -> dict[str, Any]:
    """Rank 0 computes F0 over [0, 6] ms and posts its send at 6; rank 1 waits over [1, 10]
    and computes over [10, 14]. Rank 1's clock runs ``offset_ms`` ahead of rank 0's.
    ``plans``: step -> (plan, schedule) drawn beside it as the prediction."""
    off = offset_ms
    rank0 = {"rank": 0, "stage": 0, "replica": 0, "starts": {1: 0},
             "events": [_ev("F0", "compute", 0, 6, kind="F", microbatch=0),
                        _ev("SEND_F0", "post", 6, 7, kind="SEND_F", microbatch=0, to=[1])]}
    rank1 = {"rank": 1, "stage": 1, "replica": 0, "starts": {1: int(off * MS)},
             "events": [_ev("wait SEND_F0", "wait", 1 + off, 10 + off, microbatch=0,
                            peers=[0], match="SEND_F"),
                        _ev("F0", "compute", 10 + off, 14 + off, kind="F", microbatch=0)]}
    clock = {"method": "test", "offset_ns": {0: 0, 1: int(off * MS)},
             "uncertainty_ns": {0: 0, 1: 20_000}}
    return build_trace([rank0, rank1], clock, plans or {})


@pytest.mark.parametrize("offset_ms", [0.0, 250.0])
def test_a_wait_is_bubble_until_the_send_starts_then_communication(offset_ms):
    s = summarize(_trace(offset_ms))
    assert s.steps == (1,) and s.step_ms == pytest.approx(14.0)
    assert s.predicted_ms is None and s.unmatched == 0
    assert s.clock_uncertainty_us == pytest.approx(20.0)
    first, second = s.stages
    # rank 0: busy 6 of 14 ms, posting 1 ms is communication, the rest in no event
    assert first.measured == pytest.approx(
        {"busy": 6 / 14, "bubble": 0.0, "comm": 1 / 14, "other": 7 / 14})
    # rank 1 waits from 1 to 10: the send started at 6 (bubble 5 ms), then 4 ms in flight
    assert second.measured == pytest.approx(
        {"busy": 4 / 14, "bubble": 5 / 14, "comm": 4 / 14, "other": 1 / 14})


def _two_stage_plan():
    """GPipe, 2 stages of one rank, 2 micro-batches; forward / backward / communication per
    micro-batch 1 / 2 / 1 ms on stage 0 and 2 / 3 / 1 ms on stage 1 (half the communication
    with each compute action, as ``plan_durations`` has it)."""
    from tests.dist_utils import make_plan, scalar, tensor

    values = {"x": tensor("x", (4,)), "h": tensor("h", (4,), requires_grad=True),
              "loss": scalar("loss")}
    plan = make_plan(global_batch=4, micro_batches=2, replicas=(1, 1), values=values,
                     inputs=["x"], stage_io=[(["x"], ["h"]), (["h"], ["loss"])],
                     outputs=["loss"])
    costs = [dict(fwd_ms=1.0, bwd_ms=2.0, comm_ms=1.0), dict(fwd_ms=2.0, bwd_ms=3.0, comm_ms=1.0)]
    stages = tuple(st.model_copy(update=c) for st, c in zip(plan.stages, costs, strict=True))
    return plan.model_copy(update={"stages": stages})


def test_the_predicted_parts_follow_from_the_plan_by_hand():
    """Stage 0: F0 0-1.5, F1 1.5-3; stage 1: F0 1.5-4, F1 4-6.5, then its two backwards of 3.5
    ms to 13.5; stage 0's backwards of 2.5 ms wait for theirs: 10-12.5, 13.5-16. Step 16 ms;
    stage 0 computes 6 ms and communicates 2, stage 1 computes 10 ms and communicates 2."""
    trace = _trace(plans={1: (_two_stage_plan(), "gpipe")})
    s = summarize(trace)
    assert s.predicted_ms == pytest.approx(16.0)
    assert s.error == pytest.approx(14 / 16 - 1)
    first, second = s.stages
    assert first.predicted == pytest.approx({"busy": 6 / 16, "bubble": 8 / 16, "comm": 2 / 16})
    assert second.predicted == pytest.approx({"busy": 10 / 16, "bubble": 4 / 16, "comm": 2 / 16})
    drawn = {(e["tid"], e["name"]): (e["ts"], e["dur"]) for e in trace["traceEvents"]
             if e.get("ph") == "X" and e["pid"] == 1}
    assert drawn[1, "F0"] == pytest.approx((1500.0, 2500.0))  # us from the step's start
    assert drawn[0, "F1"] == pytest.approx((1500.0, 1500.0))
    assert max(ts + d for ts, d in drawn.values()) == pytest.approx(16000.0)


def test_a_wait_whose_send_is_missing_is_counted_and_said():
    trace = _trace()
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e.get("name") != "SEND_F0"]
    s = summarize(trace)
    assert s.unmatched == 1
    assert s.stages[1].measured["bubble"] == 0.0
    assert "1 wait(s) without a matching action" in format_summary(s)


def test_the_summary_reads_from_a_saved_file(tmp_path, capsys):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(_trace()))
    assert cli(["trace", "summary", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("rannc_fx trace: step 1, step 14.00 ms measured")
    assert "within +-20 us" in out
    bad = tmp_path / "other.json"
    bad.write_text("{}")
    assert cli(["trace", "summary", str(bad)]) == 2
    assert "not a rannc_fx trace" in capsys.readouterr().err


def test_trace_steps_read_as_a_range_and_bad_ones_name_the_way_out():
    assert Config(trace_steps="3").traced_steps == range(3, 4)
    assert Config(trace_steps=" 2 - 5 ").traced_steps == range(2, 6)
    assert Config.from_env(environ={"RANNC_FX_TRACE_STEPS": "4"}).traced_steps == range(4, 5)
    assert str(Config.from_env(environ={"RANNC_FX_TRACE_DIR": "/tmp/t"}).trace_dir) == "/tmp/t"
    with pytest.raises(ValidationError, match="FIRST-LAST"):
        Config(trace_steps="5-2")
    with pytest.raises(ValidationError, match="trace_steps"):
        Config(trace_steps="three")


def test_a_trace_rank_0_cannot_write_is_a_warning_not_a_failed_step(tmp_path, caplog):
    import torch

    from rannc_fx.runtime.trace import Recorder

    blocked = tmp_path / "a_file"
    blocked.write_text("")  # trace_dir names a file: mkdir fails
    rec = Recorder(range(1, 2), blocked / "trace", rank=0, world=1, stage=0, replica=0,
                   device=torch.device("cpu"))
    rec.clock = {"offset_ns": {0: 0}}  # one rank: nothing to align
    rec.begin_call(grad=True)
    with rec.span("F0", "compute", kind="F", microbatch=0):
        pass
    rec._before_step()
    rec._after_step()  # the last traced step's optimizer.step(): writes
    assert rec.done and rec.path is None
    assert any("could not write the trace" in r.getMessage() for r in caplog.records)
    ok = Recorder(range(1, 2), tmp_path / "ok", rank=0, world=1, stage=0, replica=0,
                  device=torch.device("cpu"))
    ok.clock = {"offset_ns": {0: 0}}
    ok.begin_call(grad=True)
    ok.begin_call(grad=False)  # no optimizer seen: the next call ends the last traced step
    assert ok.path == tmp_path / "ok" / "trace.json" and ok.path.exists()
