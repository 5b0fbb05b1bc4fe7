"""The schedule registry (``schedules/kinds.py``): each kind's declared properties agree with
the actions its generator makes, and no other module names a schedule by its string."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import rannc_fx
from rannc_fx.plan.config import Config
from rannc_fx.plan.plan import Plan
from rannc_fx.schedules.actions import Kind, in_flight
from rannc_fx.schedules.kinds import GPIPE, KINDS, NAMES, ONE_F_ONE_B, kind_of, make_schedule

ROOT = Path(rannc_fx.__file__).parent


def _shapes(kind_name: str) -> list[tuple[int, int]]:
    """(stages, virtual) pairs the kind runs: 4 and 8 stages at the stages a lane it takes."""
    kind = kind_of(kind_name)
    vs = (kind.lane_stages,) if kind.lane_stages is not None else (2, 4)
    return [(n, v) for v in vs for n in (4, 8) if n % v == 0 and n >= 2 * v or v == 1]


@pytest.mark.parametrize("name", NAMES)
def test_a_kinds_properties_are_what_its_generator_makes(name):
    kind = kind_of(name)
    for n, v in _shapes(name):
        for m in (1, 3, 8):
            sched = kind.make(n, m, v)
            lanes = kind.lanes(n, v)
            assert len(sched) == len(lanes)
            for lane, acts in zip(lanes, sched, strict=True):
                assert {a.stage for a in acts} == set(lane)  # a lane runs its own stages
                # B and W apart exactly where the kind splits the backward
                assert any(a.kind is Kind.W for a in acts) == kind.splits_backward
                # every stage runs every micro-batch's forward and backward once
                for s in lane:
                    assert sorted(a.microbatch for a in acts
                                  if a.stage == s and a.kind is Kind.F) == list(range(m))
            # the backward inside the call: some lane runs a backward before its last
            # forward (with more than one micro-batch); GPipe runs every forward first
            early = any(next(i for i, a in enumerate(acts) if a.kind is Kind.B)
                        < max(i for i, a in enumerate(acts) if a.kind is Kind.F) for acts in sched)
            assert early == (kind.backward_in_call and m > 1)
            for s in range(n):  # the closed forms are what the lists hold
                lane = next(k for k, held in enumerate(lanes) if s in held)
                assert kind.in_flight(n, m, v, s) == in_flight(sched[lane], s)


def test_the_registry_is_one_table():
    assert tuple(KINDS) == NAMES
    assert [k.name for k in KINDS.values() if k.plain] == [GPIPE.name, ONE_F_ONE_B.name]
    assert not GPIPE.backward_in_call and GPIPE.forwards_first
    with pytest.raises(ValueError, match="unknown schedule 'zb'"):
        kind_of("zb")
    with pytest.raises(ValueError, match="needs virtual_stages >= 2"):
        make_schedule("interleaved", 4, 2)
    # the Config and the plan take exactly the registry's names
    for field in (Config.model_fields["schedule"], Plan.model_fields["schedule"]):
        assert set(NAMES) <= set(str(field.annotation).replace("'", '"').split('"'))


def _named_outside(path: Path) -> list[str]:
    """The places in ``path`` where a schedule's name is written as a string (a dict key of
    another meaning, such as ValueSpec's ``interleaved`` field, aside)."""
    tree = ast.parse(path.read_text())
    keys = {id(k) for node in ast.walk(tree) if isinstance(node, ast.Dict) for k in node.keys}
    return [f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in NAMES and id(node) not in keys]


def test_no_module_but_the_registry_names_a_schedule_by_its_string():
    found = [hit for path in sorted(ROOT.rglob("*.py")) if path.name != "kinds.py"
             for hit in _named_outside(path)]
    assert found == []
    assert _named_outside(ROOT / "schedules" / "kinds.py")  # the finder sees a name
