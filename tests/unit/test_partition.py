"""End to end in one process: partition() on every model of the zoo, the CLI, bad input."""

from __future__ import annotations

import json
import operator

import pytest
import torch
from torch.utils import _pytree as pytree

import rannc_fx
import rannc_fx.capture.capture
from examples.models import TransformerLM, cnn_example, gpt_example, mlp_example
from rannc_fx import DeviceSpec, Plan
from rannc_fx.__main__ import main as cli
from rannc_fx.plan.plan import FORMAT_VERSION
from tests import hf_models
from tests.harness import test_config

CFG = test_config()

ZOO = {
    "mlp": mlp_example,
    "cnn": cnn_example,
    "transformer_lm": gpt_example,
    "bert": hf_models.bert_example,
    "gpt2": hf_models.gpt2_example,
    "resnet": hf_models.resnet_example,
    "llama": hf_models.llama_example,
    "t5": hf_models.t5_example,
}


def _leaves(out):
    return [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]


@pytest.mark.parametrize("name", list(ZOO))
@pytest.mark.parametrize("world_size", [1, 3])
def test_stages_compose_to_the_model(name, world_size):
    model, args, kwargs = ZOO[name]()
    model.eval()  # BatchNorm: compare without updating running statistics twice
    parted = rannc_fx.partition(model, args, kwargs, world_size=world_size, config=CFG)
    plan = parted.plan
    # an interleaved plan's lanes share ranks: each lane's replicas count once
    assert sum(plan.stages[lane[0]].replicas for lane in plan.lanes) == world_size
    assert len(parted.stages) == len(plan.stages)
    assert Plan.from_json(plan.to_json()) == plan

    got = parted(*args, **kwargs)
    whole = parted.captured.unflatten_outputs(
        parted.captured.gm(*parted.captured.flatten_inputs(args, kwargs)))
    want = model(*args, **kwargs)
    assert type(got) is type(want)
    for g, w, c in zip(_leaves(got), _leaves(want), _leaves(whole), strict=True):
        assert torch.equal(g, c), "stages differ from the captured graph"
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    for st, gm in zip(plan.stages, parted.stages, strict=True):
        # the stage takes exactly its plan inputs and owns every attribute its code reads
        assert [n.op for n in gm.graph.nodes].count("placeholder") == len(st.inputs)
        for n in gm.graph.nodes:
            if n.op == "get_attr":  # raises if the stage lacks it
                assert isinstance(operator.attrgetter(n.target)(gm), (torch.Tensor, torch.nn.Module))


def test_forced_stages_split_the_transformer_and_share_the_tied_embedding():
    model, args, kwargs = gpt_example(layers=4)
    # one stage a rank: interleaved 1F1B would put two on each of the four lanes; analytic
    # costs, so that the cut does not move with the load (timed, under make test-quick's two
    # workers it once left the head out of the last stage)
    cfg = CFG.model_copy(update={"replicas": (1, 1, 1, 1), "micro_batches": 2,
                                 "schedule": "1f1b", "cost_model": "analytic"})
    parted = rannc_fx.partition(model, args, kwargs, world_size=4, config=cfg)
    plan = parted.plan
    assert [s.replicas for s in plan.stages] == [1, 1, 1, 1] and plan.micro_batches == 2
    tied = {sp.name: sp for sp in plan.shared_params}
    assert any(set(sp.stages) == {0, 3} for sp in tied.values()), plan.shared_params
    # every stage holds only its own parameters
    for st, gm in zip(plan.stages, parted.stages, strict=True):
        names = {n for n, _ in gm.named_parameters()}
        assert names, f"stage {st.index} has no parameters"
        assert len(names) < len(dict(model.named_parameters()))
    # every cut value has its shape and dtype, for any number of samples
    for cv in plan.cut_values:
        if cv.spec.kind == "tensor":
            assert cv.spec.dtype and cv.spec.shape_for(3)
    loss = parted(*args, **kwargs)["loss"]
    torch.testing.assert_close(loss, model(*args, **kwargs)["loss"])


def test_meta_device_model_is_planned_analytically_without_weights():
    with torch.device("meta"):
        model = TransformerLM(vocab=1000, d_model=128, layers=6, seq=32)
    ids = torch.zeros(16, 32, dtype=torch.long)
    parted = rannc_fx.partition(model, (ids,), {"labels": ids}, world_size=4,
                                device="a100-40gb", config=CFG)
    assert parted.plan.cost_model == "analytic" and parted.plan.device.name == "a100-40gb"
    assert all(p.device.type == "meta" for gm in parted.stages for p in gm.parameters())
    assert parted.plan.predicted_step_ms > 0


@pytest.mark.parametrize(
    "name, device", [("gpt2", None), ("gpt2", "a100-40gb"), ("bert", "a100-40gb"),
                     ("resnet", "a100-40gb")],
)
def test_real_model_is_planned_analytically_for_a_device_it_does_not_have(name, device):
    """A real CPU model with the analytic cost model, for its own CPU or for an A100."""
    model, args, kwargs = ZOO[name]()
    model.eval()
    cfg = CFG.model_copy(update={"cost_model": "analytic"})
    parted = rannc_fx.partition(model, args, kwargs, world_size=2, device=device, config=cfg)
    plan = parted.plan
    assert plan.cost_model == "analytic" and plan.predicted_step_ms > 0
    assert plan.device.name == (device or "cpu")
    assert all(p.device.type == "cpu" for gm in parted.stages for p in gm.parameters())
    for g, w in zip(_leaves(parted(*args, **kwargs)), _leaves(model(*args, **kwargs)), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_a_model_too_big_for_the_devices_says_by_how_much_and_what_fits():
    with torch.device("meta"):
        model = TransformerLM(vocab=32000, d_model=1024, layers=8, seq=64)
    ids = torch.zeros(8, 64, dtype=torch.long)
    # half a GiB: even with the Adam state in host memory (searched) the parameters and
    # gradients of half the model do not fit
    cfg = CFG.model_copy(update={"device_memory": 512 * 1024**2})
    with pytest.raises(ValueError, match=r"MiB over.*smallest world size that fits is \d"):
        rannc_fx.partition(model, (ids,), {"labels": ids}, world_size=2, device="v100-32gb",
                           config=cfg)


def test_meta_model_without_a_device_spec_is_refused_with_the_way_out():
    with torch.device("meta"):
        model = TransformerLM()
    ids = torch.zeros(4, 32, dtype=torch.long)
    with pytest.raises(ValueError, match="preset"):
        rannc_fx.partition(model, (ids,), world_size=2, config=CFG)


def test_forced_replicas_must_match_the_world_size():
    model, args, kwargs = mlp_example()
    with pytest.raises(ValueError, match="sum to 3, not the world size 2"):
        rannc_fx.partition(model, args, kwargs, world_size=2,
                           config=CFG.model_copy(update={"replicas": (2, 1)}))


def test_cli_prints_the_summary_and_writes_the_plan(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANNC_FX_PROFILE_CACHE_DIR", "null")
    out = tmp_path / "plan.json"
    rc = cli(["plan", "examples.models:gpt_example", "--arg", "layers=4", "--meta",
              "--device", "v100-32gb", "--world-size", "4", "--global-batch", "64",
              "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "rannc_fx plan:" in text and "predicted step time" in text
    plan = Plan.load(out)
    assert plan.world_size == 4 and plan.global_batch == 64
    assert json.loads(out.read_text())["format_version"] == FORMAT_VERSION
    assert plan.device == DeviceSpec.preset("v100-32gb")


def test_debug_logs_the_graph_the_blocks_and_every_stage(caplog):
    model, args, kwargs = mlp_example()
    cfg = CFG.model_copy(update={"debug": True, "replicas": (1, 1)})
    with caplog.at_level("INFO", logger="rannc_fx"):
        parted = rannc_fx.partition(model, args, kwargs, world_size=2, config=cfg)
    text = caplog.text
    assert "captured graph:" in text and "block 0:" in text
    for st in parted.plan.stages:
        assert f"stage {st.index} (blocks {st.first_block}-{st.end_block - 1})" in text
    assert "class stage_1" in text


def test_a_model_returning_a_cache_is_told_to_turn_it_off():
    model, args, kwargs = hf_models.llama_example(use_cache=True)
    with pytest.raises(rannc_fx.capture.capture.CaptureError, match="use_cache=False"):
        rannc_fx.partition(model, args, kwargs, world_size=2, config=CFG)


def test_plan_records_schedule_recomputation_and_the_simulated_step():
    from rannc_fx.schedules.program import simulate_plan

    model, args, kwargs = gpt_example(layers=4)
    cfg = CFG.model_copy(update={"replicas": (1, 1), "micro_batches": 4, "schedule": "1f1b",
                                 "recompute": True, "recompute_selective": False})
    plan = rannc_fx.partition(model, args, kwargs, world_size=2, config=cfg).plan
    assert plan.schedule == "1f1b" and all(st.recompute for st in plan.stages)
    assert [plan.in_flight(s) for s in range(2)] == [2, 1]
    assert plan.simulated_step_ms == pytest.approx(1e3 * simulate_plan(plan).makespan)
    assert "schedule simulated" in plan.summary()


def test_1f1b_needs_one_scalar_loss():
    """An auxiliary loss beside the main one: 1F1B cannot run the backward in the call."""

    class TwoLosses(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

        def forward(self, x, y):
            h = torch.relu(self.a(x))
            return torch.nn.functional.cross_entropy(self.b(h), y), h.pow(2).mean()

    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    with pytest.raises(ValueError, match="schedule='1f1b' .* return their sum"):
        rannc_fx.partition(TwoLosses(), (x, y), world_size=2,
                           config=CFG.model_copy(update={"schedule": "1f1b"}))
    plan = rannc_fx.partition(TwoLosses(), (x, y), world_size=2, config=CFG).plan
    assert plan.schedule == "gpipe"  # searched: GPipe only


def _plan_in(mib: float, **options) -> Plan:
    """The 4-layer LM on 2 ranks of ``mib`` MiB each, analytic costs (the same on any machine);
    the optimizer state unsharded and on the device, recomputation (where any) of whole
    stages, unless ``zero``, ``offload`` or ``recompute_layers`` is given (the tests below are
    about the budget's other ways out)."""
    model, args, kwargs = gpt_example(layers=4)
    cfg = CFG.model_copy(update={"device_memory": int(mib * 2**20), "cost_model": "analytic",
                                 "zero": 0, "offload": False, "recompute_layers": False,
                                 **options})
    return rannc_fx.partition(model, args, kwargs, world_size=2, device="cpu", config=cfg).plan


def test_memory_margin_is_kept_free_of_the_plan():
    """6 MiB holds the whole model twice (one stage, 2 replicas, one micro-batch); 30 % kept
    free leaves 4.2 MiB, which that plan does not fit: the search must pick another."""
    whole = _plan_in(6, memory_margin=0.0)
    assert whole.memory_budget == 6 * 2**20
    assert [st.replicas for st in whole.stages] == [2] and whole.micro_batches == 1
    budget = int(6 * 2**20 * 0.7)
    assert whole.stages[0].memory.total > budget  # so the margin must change the plan
    kept = _plan_in(6, memory_margin=0.3)
    assert kept.memory_budget == budget
    assert all(st.memory.total <= budget for st in kept.stages)
    assert kept.micro_batches > 1
    assert f"memory budget {4.2:.1f} MiB" in kept.summary()


def test_the_search_shards_the_optimizer_state_where_that_beats_pipelining():
    """At 4.2 MiB two unsharded replicas of the whole model fit with no micro-batch count: the
    plan pipelines 2 stages. With the Adam state halved (ZeRO-1, searched) the two replicas fit
    with one micro-batch, and the step is shorter for it."""
    plain = _plan_in(6, memory_margin=0.3)
    assert [st.replicas for st in plain.stages] == [1, 1]
    with pytest.raises(ValueError, match="no plan fits"):
        _plan_in(6, memory_margin=0.3, stages=1)
    sharded = _plan_in(6, memory_margin=0.3, zero=None)
    assert [st.replicas for st in sharded.stages] == [2] and sharded.micro_batches == 1
    st = sharded.stages[0]
    assert st.zero == 1 and st.memory.total <= sharded.memory_budget
    # fp32 Adam keeps 2 bytes of state per parameter byte: each replica half of it
    assert st.memory.optimizer_state == st.memory.params
    whole = _plan_in(7, memory_margin=0.3, stages=1, micro_batches=1, zero=None)
    assert whole.stages[0].zero == 0  # where it fits unsharded, sharding only costs time
    assert st.gather_ms > 0
    assert st.optimizer_ms == pytest.approx(whole.stages[0].optimizer_ms / 2)
    assert sharded.predicted_step_ms < plain.predicted_step_ms
    head, _, row = sharded.summary().splitlines()[1:4]
    end = head.index(" zero") + len(" zero")  # the columns are right-aligned
    assert row[:end].split()[-1] == "1"


def test_zero_2_halves_the_gradient_reduce_and_is_asked_for():
    """ZeRO-2 reduce-scatters what ZeRO-1 all-reduces: the same plan with the reduce's time
    halved (its latency terms too), the all-gather, the state and the step's memory as
    ZeRO-1's; the search never takes it on its own (it changes what ``.grad`` holds)."""
    one = _plan_in(7, memory_margin=0.3, stages=1, micro_batches=1, zero=1)
    two = _plan_in(7, memory_margin=0.3, stages=1, micro_batches=1, zero=2)
    a, b = one.stages[0], two.stages[0]
    assert (a.replicas, a.zero, b.zero) == (2, 1, 2)
    assert b.allreduce_ms == pytest.approx(a.allreduce_ms / 2)
    assert (b.gather_ms, b.optimizer_ms, b.memory) == (a.gather_ms, a.optimizer_ms, a.memory)
    assert two.predicted_step_ms < one.predicted_step_ms
    searched = _plan_in(6, memory_margin=0.3, zero=None)
    assert [st.zero for st in searched.stages] == [1]


def test_max_micro_batches_bounds_the_searched_count():
    """With 4.48 MiB the search picks 4 micro-batches on one stage; allowed at most 2 (or 3:
    1 and 2 are the counts up to 3 it tries for a batch of 8), it pipelines 2 stages instead."""
    free = _plan_in(6.4, memory_margin=0.3)
    assert free.micro_batches == 4 and len(free.stages) == 1
    for most in (2, 3):
        bounded = _plan_in(6.4, memory_margin=0.3, max_micro_batches=most)
        assert bounded.micro_batches == 2, most
        assert [st.replicas for st in bounded.stages] == [1, 1]
        assert all(st.memory.total <= bounded.memory_budget for st in bounded.stages)
    # one micro-batch does not fit 4.0 MiB on 2 ranks: the error names the bound's way out
    with pytest.raises(ValueError, match=r"use more micro-batches \(2 fit: max_micro_batches=2;"):
        _plan_in(4, memory_margin=0.0, max_micro_batches=1)
