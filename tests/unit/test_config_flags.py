"""The command line's flags are Config's fields: one each, parsed into the Config they say,
Config's own messages for bad values, and the flags named in errors."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from rannc_fx import Config, DeviceSpec, Plan
from rannc_fx.__main__ import _parser
from rannc_fx.__main__ import main as cli
from rannc_fx.plan.config_flags import config_from_flags, flag_of, name_flags

FACTORY = "examples.models:mlp_example"


def _plan_parser() -> argparse.ArgumentParser:
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["plan"]


def _config_actions(plan: argparse.ArgumentParser | None = None) -> list[argparse.Action]:
    plan = plan or _plan_parser()
    group = next(g for g in plan._action_groups if g.title == "Config options")
    return list(group._group_actions)


def _config(*flags: str) -> Config:
    return config_from_flags(_parser().parse_args(["plan", FACTORY, "--world-size", "2", *flags]))


def test_the_flags_are_the_config_fields() -> None:
    plan = _plan_parser()
    actions = _config_actions(plan)
    flags = {s for a in actions for s in a.option_strings if not s.startswith("--no-")}
    assert flags == {"--" + name.replace("_", "-") for name in Config.model_fields} | {
        "--autocast"}  # the one alias: autocast_dtype's short spelling
    assert {a.dest for a in actions} == set(Config.model_fields)
    own = {s for a in plan._actions if a not in actions for s in a.option_strings}
    assert {"--world-size", "--out", "--meta", "--global-batch", "--arg"} <= own


def test_each_flag_is_documented_by_its_field() -> None:
    for action in _config_actions():
        description = Config.model_fields[action.dest].description
        assert description, f"Config.{action.dest} needs a Field(description=...)"
        assert action.help is not None
        assert action.help.replace("%%", "%").startswith(description)


def test_flags_give_the_config_they_spell() -> None:
    assert _config() == Config()
    got = _config("--replicas", "2,1", "--schedule", "1f1b", "--autocast-dtype", "bfloat16",
                  "--no-check-batches", "--recompute", "--zero", "1", "--max-micro-batches", "64",
                  "--micro-batches", "64", "--profile-cache-dir", "none", "--leaf-modules",
                  "Block, Head", "--dynamic-dims", "input_ids.1", "--memory-margin", "0.25",
                  "--trace-dir", "trace", "--device-memory", "1073741824")
    assert got == Config(replicas=(2, 1), schedule="1f1b", autocast_dtype="bfloat16",
                         check_batches=False, recompute=True, zero=1, max_micro_batches=64,
                         micro_batches=64, profile_cache_dir=None, leaf_modules=("Block", "Head"),
                         dynamic_dims=("input_ids.1",), memory_margin=0.25,
                         trace_dir=Path("trace"), device_memory=2**30)
    assert _config("--no-recompute", "--debug", "--dynamic-dims", "batch", "--stages", "none") == \
        Config(recompute=False, debug=True, dynamic_dims="batch", stages=None)
    assert _config("--autocast", "float16", "--devices-per-node", "8", "--network-bandwidth",
                   "5e10", "--network-latency", "1.5e-5") == Config(
        autocast_dtype="float16", devices_per_node=8, network_bandwidth=5e10,
        network_latency=1.5e-5)


@pytest.mark.parametrize("flags, says", [
    (("--stages", "0"), "--stages 0 (Config.stages): Input should be greater than or equal to 1"),
    (("--schedule", "gpipe2"), "--schedule gpipe2 (Config.schedule): Input should be 'gpipe', "),
    (("--zero", "4"), "--zero 4 (Config.zero): Input should be 0, 1, 2 or 3"),
    (("--micro-batches", "64"), "micro_batches=64 exceeds max_micro_batches=32; raise "
     "max_micro_batches too (as flags: micro_batches is --micro-batches, max_micro_batches is "
     "--max-micro-batches)"),
])
def test_a_bad_value_gets_configs_message_under_its_flag(
        flags: tuple[str, ...], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["plan", FACTORY, "--world-size", "2", *flags]) == 2
    assert f"error: {says}" in capsys.readouterr().err


def test_errors_name_the_flags_of_the_fields_they_name() -> None:
    said = "no plan fits; force more stages, or let the search choose (Config(stages=None))"
    assert name_flags(said) == f"{said} (as flags: stages is --stages)"
    # one-word fields are English words too: only 'name=' is the field
    assert name_flags("the device holds 2 stages") == "the device holds 2 stages"
    assert name_flags("schedule='zbh1' with recompute_layers=True") == (
        "schedule='zbh1' with recompute_layers=True (as flags: schedule is --schedule, "
        "recompute_layers is --recompute-layers)")
    assert flag_of("max_micro_batches") == "--max-micro-batches"


def test_the_flags_reach_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANNC_FX_PROFILE_CACHE_DIR", "null")
    out = tmp_path / "plan.json"
    rc = cli(["plan", FACTORY, "--world-size", "2", "--device", "v100-32gb", "--max-micro-batches",
              "1", "--schedule", "gpipe", "--replicas", "1,1", "--out", str(out), "-q"])
    assert rc == 0, capsys.readouterr().err
    plan = Plan.load(out)
    assert plan.micro_batches == 1 and plan.schedule == "gpipe"
    assert [st.replicas for st in plan.stages] == [1, 1]
    assert plan.device == DeviceSpec.preset("v100-32gb")  # a preset is the cost model's device
