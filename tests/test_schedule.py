"""Schedules as data: GPipe's action lists and their clock ticks, no processes."""

from __future__ import annotations

import pytest

from rannc_fx.runtime.schedule import Action, clock_ticks, format_schedule, gpipe_schedule


def test_action_prints_compactly():
    assert str(Action(1, "F", 0)) == "1F0"
    assert repr(Action(2, "B", 13)) == "2B13"
    assert [str(a) for a in gpipe_schedule(2, 2)[1]] == ["1F0", "1F1", "1B1", "1B0"]


@pytest.mark.parametrize("stages", [1, 2, 3, 5])
@pytest.mark.parametrize("mbs", [1, 2, 4, 7])
def test_gpipe_is_fill_drain(stages, mbs):
    sched = gpipe_schedule(stages, mbs)
    assert len(sched) == stages
    for s, actions in enumerate(sched):
        assert all(a.stage == s for a in actions)
        assert [a.microbatch for a in actions if a.kind == "F"] == list(range(mbs))
        assert [a.microbatch for a in actions if a.kind == "B"] == list(reversed(range(mbs)))
        assert [a.kind for a in actions] == ["F"] * mbs + ["B"] * mbs


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("mbs", [1, 3, 8])
def test_ticks_match_gpipe_length(stages, mbs):
    # GPipe's makespan with unit-time actions: 2 * (m + n - 1) ticks.
    tick = clock_ticks(gpipe_schedule(stages, mbs))
    assert max(tick.values()) + 1 == 2 * (mbs + stages - 1)
    for a, t in tick.items():
        if a.kind == "F" and a.stage > 0:
            assert t > tick[Action(a.stage - 1, "F", a.microbatch)]
        if a.kind == "B" and a.stage < stages - 1:
            assert t > tick[Action(a.stage + 1, "B", a.microbatch)]


def test_format_schedule_is_the_docstring_table():
    text = format_schedule(gpipe_schedule(3, 4))
    assert text.splitlines()[1].split() == [
        "st",
        "0",
        "0F0",
        "0F1",
        "0F2",
        "0F3",
        ".",
        ".",
        ".",
        ".",
        "0B3",
        "0B2",
        "0B1",
        "0B0",
    ]
    import rannc_fx.runtime.schedule as mod

    assert "\n".join("    " + line for line in text.splitlines()) in (mod.__doc__ or "")


def test_deadlock_is_reported():
    # 0B0 waits on 1B0, 1B0 on 1F0, 1F0 on 0F0, and 0F0 comes after 0B0 on stage 0.
    bad = [[Action(0, "B", 0), Action(0, "F", 0)], [Action(1, "F", 0), Action(1, "B", 0)]]
    with pytest.raises(ValueError, match="deadlocks"):
        clock_ticks(bad)


def test_bad_sizes():
    with pytest.raises(ValueError, match="at least one"):
        gpipe_schedule(0, 2)
