"""Buffers and constants that several stages read, on ranks: each stage holds its own copy
(same values, no gradient all-reduce; only parameters are shared), beside a tied embedding; on
the meta device every stage computes its copy; checkpoints hold a persistent one under each
name. A buffer the forward writes keeps all its readers in one stage, and a loaded plan that
splits them is refused."""

from __future__ import annotations

import copy
import functools
import io
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.testing import assert_close

import rannc_fx
from tests.dist_utils import run_ranks
from tests.harness import Run, optimizer, test_config, train_against_reference
from tests.unit.test_group import value_specs
from tests.unit.test_shared_buffers import (
    MODELS,
    Scaled,
    _capture,
    _example,
    _split_after_first_reader,
)

TOL = dict(rtol=1e-5, atol=1e-5)
LOCAL = 2  # samples per rank
# the analytic cost model and fixed links: the same plan on every run (a measured one moves
# the stage boundaries, and with them which stages read the buffer)
CFG = dict(timeout_s=60.0, cost_model="analytic", link_bandwidth=1e9,
           link_latency=1e-5, allreduce_bandwidth=1e9)
INV_FREQ = "rotary.inv_freq"


def _adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.01)


def _step(model: Any, opt: torch.optim.Optimizer, args: Any) -> torch.Tensor:
    loss = model(*args)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _local(args: tuple[torch.Tensor, ...], rank: int) -> tuple[torch.Tensor, ...]:
    return tuple(a[rank * LOCAL : (rank + 1) * LOCAL] for a in args)


def _scale_init(m: nn.Module) -> None:
    if isinstance(m, Scaled):
        m.scale.copy_(torch.linspace(0.5, 1.5, m.scale.numel()))
    elif hasattr(m, "reset_parameters"):
        m.reset_parameters()


def _shared_model(name: str, kw: dict[str, Any], meta: bool) -> tuple[nn.Module, Any, dict]:
    """The model (built on the meta device with ``meta``: each stage computes or is given its
    tensors) and the global batch."""
    model, args = _example(name, LOCAL * dist.get_world_size(), **kw)
    if meta:
        with torch.device("meta"):
            model = MODELS[name](**kw)  # Rotary.reset_parameters() computes inv_freq on each
    return model, args, {}


def _plain_model(name: str, kw: dict[str, Any]) -> nn.Module:
    return _example(name, 1, **kw)[0]


def _reference_buffers(ref: nn.Module) -> dict[str, torch.Tensor]:
    # a stage GraphModule holds a constant (a plain tensor attribute) as a buffer
    constants = {k: v for k, v in vars(ref).items() if isinstance(v, torch.Tensor)}
    return {**dict(ref.named_buffers(remove_duplicate=False)), **constants}


def _buffers_alike(meta: bool, run: Run) -> None:
    """3 Adam steps; every buffer (and constant) of this rank's stage is the reference's
    before them (from the meta device: after loading the plain model's state dict)."""
    if meta:  # the persistent tensors come from the plain model: all but inv_freq
        run.cm.load_state_dict(run.ref.state_dict())
    ref_buffers = _reference_buffers(run.ref)
    for bname, b in run.cm.stages[0].named_buffers(remove_duplicate=False):
        assert torch.equal(b, ref_buffers[bname]), bname
    for step in range(1, 4):
        run.train_step(step)


def _held(name: str, run: Run) -> dict[str, Any]:
    """Every buffer and constant equal to the reference's after the steps; only the tied
    embedding is a shared parameter; which buffers the plan gives each stage and which this
    rank's holds."""
    model, stage, plan = run.model, run.cm.stages[0], run.cm.plan
    ref_buffers = _reference_buffers(run.ref)
    for bname, b in stage.named_buffers(remove_duplicate=False):
        assert_close(b, ref_buffers[bname], **TOL, msg=lambda m, n=bname: f"{n}: {m}")
    # only the tied embedding is a shared parameter: a buffer has no gradient to all-reduce
    assert [sp.name for sp in plan.shared_params] == (["embed.weight"] if name == "rotary" else [])
    assert all(INV_FREQ not in st.param_names for st in plan.stages)
    first: dict[int, str] = {}  # the plan's name of a tensor: its first name in the model
    own = {k: v for k, v in vars(model).items() if isinstance(v, torch.Tensor)}
    for bname, b in (*model.named_buffers(remove_duplicate=False), *own.items()):
        first.setdefault(id(b), bname)
    return {
        "buffers": [st.buffer_names for st in plan.stages],
        "held": sorted({first[id(b)] for b in stage.buffers()}),
        "stage": plan.stage_of_rank(run.rank).index,
    }


def _train(world: int, name: str, kw: dict[str, Any], cfg: dict[str, Any],
           meta: bool = False) -> list[dict[str, Any]]:
    """3 Adam steps against a single-process reference on the global batch (the plain model
    where the compiled one is built on the meta device); the loss at each step, every
    parameter and every buffer (and constant) of this rank's stage equal it."""
    got = train_against_reference(
        functools.partial(_shared_model, name, kw, meta), {**CFG, **cfg}, world,
        reference=functools.partial(_plain_model, name, kw) if meta else None,
        optimizer=optimizer(torch.optim.Adam, lr=0.01),
        compile_kw=dict(init=_scale_init if meta and name == "scaled" else None),
        loop=functools.partial(_buffers_alike, meta), check=functools.partial(_held, name))
    return [t.extra for t in got]


@pytest.mark.parametrize(
    "world,kw,cfg",
    [
        (2, dict(), dict(replicas=(1, 1), micro_batches=2)),
        (3, dict(persistent=True), dict(replicas=(1, 1, 1), micro_batches=2, schedule="1f1b")),
        (3, dict(alias=True), dict(replicas=(1, 1, 1), micro_batches=2, tracer="export")),
        (3, dict(), dict(replicas=(1, 1, 1), micro_batches=3, tracer="export", schedule="1f1b",
                         recompute=True)),
    ],
)
def test_a_buffer_every_layer_reads_is_held_by_each_stage(world, kw, cfg):
    results = _train(world, "rotary", kw, cfg)
    plan_buffers = results[0]["buffers"]
    readers = [s for s, names in enumerate(plan_buffers) if INV_FREQ in names]
    assert len(readers) >= 2, plan_buffers  # the case this file is about
    for r in results:  # each rank holds its stage's buffers, and no others
        assert r["held"] == sorted(plan_buffers[r["stage"]]), r


@pytest.mark.parametrize("kw", [dict(), dict(alias=True, persistent=True)])
def test_a_meta_model_computes_the_shared_buffer_on_every_stage(kw):
    cfg = dict(replicas=(1, 1, 1), micro_batches=2)
    results = _train(3, "rotary", kw, cfg, True)
    assert sum(INV_FREQ in names for names in results[0]["buffers"]) >= 2


@pytest.mark.parametrize("tracer,meta", [("fx", False), ("export", False), ("fx", True)])
def test_a_tensor_constant_every_layer_reads_is_held_by_each_stage(tracer, meta):
    cfg = dict(replicas=(1, 1), micro_batches=2, tracer=tracer)
    results = _train(2, "scaled", {}, cfg, meta)
    assert all("scale" in names for names in results[0]["buffers"]), results[0]["buffers"]


def _constant_on_meta(rank: int, world: int) -> str:
    _, args = _example("scaled", LOCAL * world)
    with torch.device("meta"):
        model = Scaled()
    cfg = test_config(**CFG, replicas=(1, 1), micro_batches=2)
    try:
        rannc_fx.compile(model, None, cfg, example_args=_local(args, rank))
    except RuntimeError as e:
        return str(e)
    return "placed"


def test_a_tensor_constant_nothing_computed_on_the_meta_device_is_named():
    for message in run_ranks(_constant_on_meta, 2, timeout_s=30.0, wall_s=60.0):
        assert "tensor attribute 'scale' (Scaled) of this rank's stage is on the meta device" in (
            message), message
        assert "register it as a buffer" in message


@pytest.mark.parametrize(
    "name,world,tracer", [("bn", 3, "fx"), ("bn", 2, "export"), ("counter", 3, "fx"),
                          ("counter", 2, "export")]
)
def test_a_buffer_the_forward_writes_stays_with_all_its_readers(name, world, tracer):
    # BatchNorm normalizes by each micro-batch's statistics: exact with one micro-batch
    cfg = dict(replicas=(1,) * world, micro_batches=1 if name == "bn" else 2, tracer=tracer)
    results = _train(world, name, {}, cfg)
    written = ("bn.running_mean", "bn.running_var") if name == "bn" else ("count",)
    for buf in written:  # the buffers themselves equal the reference's (checked in _train)
        holders = [s for s, names in enumerate(results[0]["buffers"]) if buf in names]
        assert len(holders) == 1, (buf, results[0]["buffers"])


def _save(rank: int, world: int, path: str, kw: dict[str, Any]) -> dict[str, Any]:
    model, args = _example("rotary", LOCAL * world, **kw)
    opt = _adam(model)
    cm = rannc_fx.compile(model, opt, test_config(**CFG, replicas=(1,) * world, micro_batches=2))
    _step(cm, opt, _local(args, rank))
    msd, osd = rannc_fx.get_state_dict(cm, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    full, _ = rannc_fx.get_state_dict(cm, opt, full=True)
    buf = io.BytesIO()  # tensors cross the process boundary as bytes, not shared memory
    torch.save(full, buf)
    return {"keys": sorted(msd), "full": buf.getvalue(),
            "buffers": cm.plan.stage_of_rank(rank).buffer_names}


def _load(rank: int, world: int, path: str, kw: dict[str, Any], full: bytes) -> None:
    model, args = _example("rotary", LOCAL * world, **kw)
    with torch.no_grad():  # what the checkpoint must put back, the buffer too
        for t in (*model.parameters(), *model.buffers()):
            t.zero_()
    opt = _adam(model)
    cm = rannc_fx.compile(model, opt, test_config(**CFG, replicas=(1,) * world, micro_batches=2),
                          example_args=_local(args, rank))
    msd, osd = rannc_fx.get_state_dict(cm, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    rannc_fx.set_state_dict(cm, opt, model_state_dict=msd, optim_state_dict=osd)
    want = torch.load(io.BytesIO(full))
    for k, t in cm.state_dict().items():
        assert torch.equal(t, want[k]), k


@pytest.mark.parametrize("kw", [dict(), dict(persistent=True, alias=True)])
def test_a_checkpoint_holds_a_persistent_shared_buffer_under_each_name(tmp_path, kw):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_save, 3, path, kw, timeout_s=60.0, wall_s=120.0)
    names = [INV_FREQ] + [f"layers.{i}.inv_freq" for i in range(4)] * bool(kw.get("alias"))
    assert sum(INV_FREQ in r["buffers"] for r in saved) >= 2
    for r in saved:
        holds = INV_FREQ in r["buffers"]
        for n in names:  # every name of the one tensor, wherever a stage holds it
            assert (n in r["keys"]) == (holds and bool(kw.get("persistent"))), (n, r)
    full = torch.load(io.BytesIO(saved[0]["full"]))
    plain, _ = _example("rotary", 1, **kw)
    plain.load_state_dict(full)  # strict: non-persistent buffers are in no state dict
    assert all((n in full) == bool(kw.get("persistent")) for n in names)
    assert all(torch.equal(full[n], plain.rotary.inv_freq) for n in names if n in full)
    if kw.get("persistent"):  # loaded under another world size, every name of it in place
        run_ranks(_load, 2, path, kw, saved[0]["full"], timeout_s=60.0, wall_s=120.0)


def _loaded_split_plan(rank: int, world: int) -> str:
    model, args = _example("bn", LOCAL * world)
    cg, flat = _capture(copy.deepcopy(model), "fx")
    plan = _split_after_first_reader(cg, value_specs(cg, flat), "bn.running_mean", LOCAL * world)
    plan = plan.model_copy(update={"model_fingerprint": cg.fingerprint()})
    try:
        rannc_fx.compile(model, None, test_config(**CFG), plan=plan, example_args=_local(args, rank))
    except ValueError as e:
        return str(e)
    return "compiled"


def test_a_loaded_plan_that_splits_them_fails_on_every_rank():
    messages = run_ranks(_loaded_split_plan, 2, timeout_s=30.0, wall_s=60.0)
    assert all("'bn.running_mean' is written in the forward" in m for m in messages), messages


def _llama() -> tuple[nn.Module, tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_cache=False, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (LOCAL * dist.get_world_size(), 16),
                        generator=torch.Generator().manual_seed(1))
    return model, (ids,), {"labels": ids}


def _plan_of_llama(run: Run) -> dict[str, Any]:
    plan = run.cm.plan
    return {"buffers": [st.buffer_names for st in plan.stages],
            "shared": [(sp.name, sp.aliases) for sp in plan.shared_params]}


@pytest.mark.slow
def test_transformers_llama_with_tied_embeddings_trains_on_two_stages():
    results = [t.extra for t in train_against_reference(
        _llama, {**CFG, "replicas": (1, 1), "micro_batches": 2}, 2, example=False,
        check=_plan_of_llama, timeout_s=90.0, wall_s=240.0)]
    assert results[0]["shared"] == [("model.embed_tokens.weight", ("lm_head.weight",))]
    inv_freq = "model.rotary_emb.inv_freq"
    assert all(inv_freq in names for names in results[0]["buffers"]), results[0]["buffers"]
