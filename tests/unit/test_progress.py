"""Planning's log: one INFO line per pass, progress lines while a pass runs long, rank 0 only,
and the CLI's default and ``--quiet``. No test waits on the real clock for a line to be due:
the intervals are lowered, or a fake clock is given."""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

import pytest
import torch.distributed as dist

import rannc_fx
from examples.models import mlp_example
from rannc_fx import progress
from rannc_fx.__main__ import main as cli
from rannc_fx.progress import Progress
from tests.harness import test_config

CFG = test_config()

# the first word of each pass's line, in the order the driver runs the passes
PASSES = ["captured", "inferred", "profiled", "grouped", "costed", "cost", "searched", "built",
          "split", "partitioned"]

pytestmark = pytest.mark.own_captures  # the capture pass's own lines are watched


def _lines(caplog: pytest.LogCaptureFixture, level: int = logging.INFO) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "rannc_fx" and r.levelno == level]


def _partition(world_size: int = 2, **config: Any) -> rannc_fx.Partitioned:
    model, args, kwargs = mlp_example()
    return rannc_fx.partition(model, args, kwargs, world_size=world_size,
                              config=CFG.model_copy(update=config))


@pytest.fixture
def never_due(monkeypatch: pytest.MonkeyPatch) -> None:
    """No progress line, however slow the machine."""
    monkeypatch.setattr(progress, "FIRST_S", 1e9)


@pytest.fixture
def always_due(monkeypatch: pytest.MonkeyPatch) -> None:
    """A progress line at every chance (the ticker every 5 ms)."""
    monkeypatch.setattr(progress, "FIRST_S", 0.0)
    monkeypatch.setattr(progress, "EVERY_S", 0.005)


def test_one_line_per_pass(caplog: pytest.LogCaptureFixture, never_due: None) -> None:
    with caplog.at_level(logging.INFO, logger="rannc_fx"):
        parted = _partition()
    # the planner's notes ("plan: ZB-H1 ... simulated step ...", where a loaded machine's
    # timings make it pay) come besides the pass lines
    lines = [line for line in _lines(caplog) if not line.startswith("plan: ")]
    assert [line.split(" ", 1)[0] for line in lines] == PASSES, "\n".join(lines)
    assert all(re.search(r" in \d+\.\d\d s\b", line) for line in lines), "\n".join(lines)
    plan = parted.plan
    (search,) = [line for line in lines if line.startswith("searched")]
    reps = "/".join(str(s.replicas) for s in plan.stages)
    kept = plan.schedule in ("gpipe", "1f1b")  # else ZB-H1 took the searched stages
    searched, predicted = ((plan.schedule, f"{plan.predicted_step_ms:.1f}") if kept
                           else ("(gpipe|1f1b)", r"\d+\.\d"))
    assert re.fullmatch(
        rf"searched {len(plan.blocks)} blocks x 2 ranks x \d+ micro-batch counts in \d+\.\d\d s "
        rf"\(\d+ DPs\): {len(plan.stages)} stages \(replicas {reps}\), m={plan.micro_batches}, "
        rf"{searched}, 0 recomputing, predicted {predicted} ms", search)
    (built,) = [line for line in lines if line.startswith("built")]
    assert f"{len(plan.stages)} stages on 2 ranks" in built
    assert re.search(r"measured on cpu\b", next(x for x in lines if x.startswith("profiled")))


def test_long_passes_report_progress(caplog: pytest.LogCaptureFixture, always_due: None) -> None:
    with caplog.at_level(logging.INFO, logger="rannc_fx"):
        _partition()
    lines = _lines(caplog)
    for name in ("capture", "shapes", "profile", "search"):
        assert any(line.startswith(f"{name}: ") for line in lines), name
    assert any(re.fullmatch(r"profile: \d+/\d+ ops \(\d+ measured, \d+ from cache\), \d+\.\d s",
                            line) for line in lines)
    assert any(re.fullmatch(r"search: \d+/\d+ bounds and scans, \d+ DPs, best step so far "
                            r"(\d+\.\d ms|none), \d+\.\d s", line) for line in lines)
    # progress lines come besides the pass lines, never instead of one
    firsts = [line.split(" ", 1)[0] for line in lines]
    assert [word for word in firsts if not word.endswith(":")] == PASSES


def test_update_is_rate_limited_by_the_clock(caplog: pytest.LogCaptureFixture,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "FIRST_S", 5.0)
    monkeypatch.setattr(progress, "EVERY_S", 10.0)
    now = [100.0]
    p = Progress("profile", total=10, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="rannc_fx"):
        for t, done in [(101, 1), (105, 2), (106, 3), (114.9, 4), (115, 5), (130, 6)]:
            now[0] = t
            p.update(done, "ops (%d measured)", done - 1)
        p.update(7, total=20)
        now[0] = 141.5
        p.update(8, total=20)
        p.done("profiled %d ops in %.2f s", 8, p.seconds)
    assert _lines(caplog) == [
        "profile: 2/10 ops (1 measured), 5.0 s",
        "profile: 5/10 ops (4 measured), 15.0 s",
        "profile: 6/10 ops (5 measured), 30.0 s",
        "profile: 8/20, 41.5 s",
        "profiled 8 ops in 41.50 s",
    ]


def test_the_ticker_speaks_for_a_pass_without_a_loop(caplog: pytest.LogCaptureFixture,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "FIRST_S", 0.001)
    monkeypatch.setattr(progress, "EVERY_S", 0.001)
    seen: list[str] = []
    heard = threading.Condition()

    class Hear(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            with heard:
                seen.append(record.getMessage())
                heard.notify_all()

    def hear(text: str) -> bool:  # a bound on a hang, not a timing: the ticker runs every ms
        with heard:
            return heard.wait_for(lambda: any(text in line for line in seen), timeout=60)

    log, handler = logging.getLogger("rannc_fx"), Hear()
    log.addHandler(handler)
    try:
        with caplog.at_level(logging.INFO, logger="rannc_fx"):
            with Progress("capture", doing="tracing with torch.fx") as p:
                assert hear("tracing with torch.fx")
                p.doing = "tracing with torch.export"  # the pass says which step it is at
                assert hear("tracing with torch.export")
                ticker = p._ticker
                assert ticker is not None
            assert not ticker.is_alive()  # stopped and joined when the pass ends
    finally:
        log.removeHandler(handler)
    assert all(re.fullmatch(r"capture: tracing with torch\.(fx|export), \d+\.\d s", line)
               for line in seen), seen


def test_other_ranks_say_nothing(caplog: pytest.LogCaptureFixture, always_due: None,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    with caplog.at_level(logging.INFO, logger="rannc_fx"):
        _partition()
        # the planner's own lines too (ZB-H1 named: it says so whether or not it is faster)
        _partition(schedule="zbh1")
        with Progress("capture", doing="tracing") as p:
            p.done("captured it%s", ", but something is off", level=logging.WARNING)
    assert _lines(caplog) == []
    assert _lines(caplog, logging.WARNING) == ["captured it, but something is off"]


def test_torchruns_rank_counts_before_the_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setenv("RANK", "3")
    assert not progress.is_rank_zero()
    monkeypatch.setenv("RANK", "0")
    assert progress.is_rank_zero()
    monkeypatch.delenv("RANK")
    assert progress.is_rank_zero()


@pytest.mark.parametrize("flags, level", [((), logging.INFO), (("--quiet",), logging.WARNING),
                                          (("-v",), logging.DEBUG)])
def test_cli_logs_each_pass_unless_quiet(flags: tuple[str, ...], level: int, tmp_path,
                                         caplog: pytest.LogCaptureFixture,
                                         capsys: pytest.CaptureFixture[str], never_due: None,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANNC_FX_PROFILE_CACHE_DIR", "null")
    log = logging.getLogger("rannc_fx")
    before = log.level
    rc = cli(["plan", "examples.models:mlp_example", "--world-size", "2", "--device",
              "v100-32gb", "--out", str(tmp_path / "plan.json"), *flags])
    assert rc == 0 and "rannc_fx plan:" in capsys.readouterr().out
    assert log.level == before  # main() leaves the logger as it found it
    lines = _lines(caplog)
    if level == logging.WARNING:
        assert lines == []
    else:
        assert [line.split(" ", 1)[0] for line in lines] == PASSES
        assert "analytic costs for v100-32gb" in lines[2]
    debug = [line for line in _lines(caplog, logging.DEBUG) if line.startswith("search ran")]
    assert bool(debug) == (level == logging.DEBUG)
