"""Plan, Config and DeviceSpec: validation, JSON round trips, environment overrides."""

from __future__ import annotations

import pytest

from rannc_fx import Config, DeviceSpec, Plan
from rannc_fx.plan.plan import Block, CutValue, MemoryEstimate, OutputRef, Stage
from rannc_fx.plan.values import ValueSpec

MEM = MemoryEstimate(params=100, grads=100, optimizer_state=200, activations=50,
                     comm_buffers=10, workspace=5)
X = ValueSpec(name="x", kind="tensor", dtype="float32", shape=(1, 8), batch_dim=0)
H = ValueSpec(name="h", kind="tensor", dtype="float32", shape=(1, 16), batch_dim=0,
              requires_grad=True)
LOSS = ValueSpec(name="loss", kind="tensor", dtype="float32", shape=(), batch_dim=None,
                 requires_grad=True)


def _stage(i: int, first: int, end: int, ranks: tuple[int, ...], inputs, outputs) -> Stage:
    return Stage(index=i, first_block=first, end_block=end, replicas=len(ranks), ranks=ranks,
                 samples=4, num_nodes=end - first, param_names=(f"l{i}.weight",),
                 inputs=inputs, outputs=outputs, fwd_ms=1.0, bwd_ms=2.0, comm_ms=0.1,
                 allreduce_ms=0.0, memory=MEM)


def make_plan(**changes) -> Plan:
    fields = dict(
        model_fingerprint="abc",
        tracer="fx",
        world_size=3,
        global_batch=8,
        micro_batches=2,
        device=DeviceSpec.preset("v100-32gb"),
        cost_model="analytic",
        memory_budget=1 << 30,
        optimizer_state_factor=2.0,
        blocks=tuple(Block(index=i, nodes=(f"n{i}",), fwd_ms=1, bwd_ms=2, param_bytes=4,
                           activation_bytes=8) for i in range(3)),
        stages=(_stage(0, 0, 2, (0, 1), ("x",), ("h",)), _stage(1, 2, 3, (2,), ("h",), ("loss",))),
        inputs=(X,),
        outputs=(OutputRef(index=0, stage=1, spec=LOSS),),
        cut_values=(CutValue(producer=0, consumers=(1,), spec=H),),
        predicted_step_ms=10.0,
    )
    fields.update(changes)
    return Plan(**fields)


def test_json_round_trip_is_exact(tmp_path):
    plan = make_plan()
    again = Plan.from_json(plan.to_json())
    assert again == plan
    plan.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json") == plan


def test_schedule_and_recomputation_round_trip_and_show():
    stages = tuple(st.model_copy(update={"recompute": i == 0})
                   for i, st in enumerate(make_plan().stages))
    plan = make_plan(schedule="1f1b", stages=stages)
    assert Plan.from_json(plan.to_json()) == plan
    assert [plan.in_flight(s) for s in range(2)] == [2, 1]  # min(m, S - s), m = 2
    assert [make_plan().in_flight(s) for s in range(2)] == [2, 2]  # GPipe: m
    text = plan.summary()
    assert "schedule 1f1b" in text
    head, _, *rows = text.splitlines()[1:5]
    end = head.index("recompute") + len("recompute")  # columns are right-aligned
    assert [row[:end].split()[-1] for row in rows] == ["yes", "no"]
    end = head.index("in flight") + len("in flight")
    assert [row[:end].split()[-1] for row in rows] == ["2", "1"]


def test_a_version_1_plan_is_refused_not_misread():
    import json

    old = json.loads(make_plan().to_json())
    old["format_version"] = 1
    del old["schedule"]
    for st in old["stages"]:
        del st["recompute"]
    with pytest.raises(ValueError, match="plan format version 1 is not 3 .*schedule.*make the "
                                         "plan again"):
        Plan.from_json(json.dumps(old))


def test_lookups():
    plan = make_plan()
    assert plan.node_stage() == {"n0": 0, "n1": 0, "n2": 1}
    assert plan.stage_of_rank(1).index == 0 and plan.stage_of_rank(2).index == 1
    assert plan.cut("h").consumers == (1,)
    with pytest.raises(ValueError, match="rank 3"):
        plan.stage_of_rank(3)


def test_summary_names_every_stage_and_the_budget():
    text = make_plan().summary()
    assert "2 stage(s) on 3 rank(s)" in text
    lines = text.splitlines()
    assert any(line.split()[0] == "1" for line in lines[3:5])
    assert "memory budget 1.0 GiB" in text


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(world_size=4), "sum to 3, not the world size 4"),
        (dict(stages=(_stage(0, 0, 1, (0, 1), ("x",), ("h",)),
                      _stage(1, 2, 3, (2,), ("h",), ("loss",)))), "must start at block 1"),
        (dict(stages=(_stage(0, 0, 2, (0, 1), ("x",), ("h",)),
                      _stage(1, 2, 3, (3,), ("h",), ("loss",)))), "must have ranks \\[2\\]"),
        (dict(cut_values=(CutValue(producer=1, consumers=(0,), spec=H),)), "must come before"),
        (dict(cut_values=(CutValue(producer=0, consumers=(), spec=H),)), "no consumer"),
        (dict(format_version=99), "format version 99"),
    ],
)
def test_invalid_plans_are_refused_with_the_reason(changes, message):
    with pytest.raises(ValueError, match=message):
        make_plan(**changes)


def test_value_spec_shapes_scale_with_samples():
    rows = ValueSpec(name="v", kind="tensor", dtype="float16", shape=(32, 64), batch_dim=0)
    assert rows.shape_for(3) == (96, 64)
    assert rows.nbytes_for(3) == 96 * 64 * 2
    size = ValueSpec(name="s", kind="ints", int_coeffs=((1, 0), (0, 32)))
    assert size.ints_for(5) == (5, 32)


def test_config_defaults_env_overrides_and_errors():
    cfg = Config.from_env(environ={"RANNC_FX_REPLICAS": "[2, 1]", "RANNC_FX_TRACER": "export",
                                   "RANNC_FX_PROFILE_CACHE_DIR": "null"})
    assert cfg.replicas == (2, 1) and cfg.forced_stages == 2
    assert cfg.tracer == "export" and cfg.profile_cache_dir is None
    base = Config(micro_batches=4)
    assert Config.from_env(base, environ={}) is base
    with pytest.raises(ValueError, match="RANNC_FX_STAGEZ"):
        Config.from_env(environ={"RANNC_FX_STAGEZ": "2"})
    with pytest.raises(ValueError, match="RANNC_FX_"):
        Config.from_env(environ={"RANNC_FX_TRACER": "jit"})
    with pytest.raises(ValueError, match="names 2 stages"):
        Config(stages=3, replicas=(1, 1))
    cfg = Config.from_env(environ={"RANNC_FX_SCHEDULE": "1f1b", "RANNC_FX_RECOMPUTE": "true"})
    assert (cfg.schedule, cfg.recompute) == ("1f1b", True)
    assert (Config().schedule, Config().recompute) == (None, None)  # searched
    with pytest.raises(ValueError, match="RANNC_FX_"):
        Config.from_env(environ={"RANNC_FX_SCHEDULE": "zero-bubble"})


def test_device_presets():
    v100 = DeviceSpec.preset("V100-32GB")
    assert v100.memory_bytes == 32 * 1024**3
    assert DeviceSpec.model_validate_json(v100.model_dump_json()) == v100
    with pytest.raises(ValueError, match="known presets: a100-40gb"):
        DeviceSpec.preset("tpu-v9")
