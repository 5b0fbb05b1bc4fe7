"""The main job's plan (``examples/train.py``'s options and model, planned in this process):
what the README says its budget forces. Running the examples: ``distributed/test_examples.py``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _train_module():  # type: ignore[no-untyped-def]
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_example", EXAMPLES / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_main_jobs_budget_forces_the_plan_the_readme_names(monkeypatch):
    """README and docs/guide.md, "The main job": with its default 24 MiB per device the main
    job's model fits no single rank with Adam even with one micro-batch in flight, nor two
    replicas with the Adam state sharded between them, and on 2 ranks the search (nothing forced) picks two stages,
    16 micro-batches, the tied embedding on both, run as ZB-H1 (its simulated step shorter
    than the same stages' under 1F1B: the first stage's backward is not split; one stage on
    both ranks fits fully sharded only, and is slower). Planned here
    with the script's own options and model, costed analytically (the same on any machine;
    the job measures its costs, and its plan follows them)."""
    import torch

    import rannc_fx
    from examples.models import TransformerLM

    train = _train_module()
    monkeypatch.setattr(sys, "argv", ["train.py"])
    args = train.parse_args()
    cfg = train.config(args).model_copy(update={"cost_model": "analytic", "profile_cache_dir": None,
                                                 "profile_repeats": 1})
    assert cfg.device_memory == 24 * 2**20 and cfg.stages is None and cfg.micro_batches is None
    model = TransformerLM(args.vocab, args.d_model, layers=args.layers, seq=args.seq)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    ids = torch.zeros(2 * args.batch, args.seq, dtype=torch.long)  # 2 ranks' local batches

    def plan(world: int, **forced: object) -> rannc_fx.Plan:
        return rannc_fx.partition(model, (ids,), {"labels": ids}, world_size=world,
                                  device="cpu", config=cfg.model_copy(update=forced),
                                  optimizer=opt).plan

    chosen = plan(2)
    assert [st.replicas for st in chosen.stages] == [1, 1]
    assert chosen.schedule == "zbh1" and chosen.micro_batches == 16
    one_f_one_b = plan(2, schedule="1f1b")
    assert [(st.first_block, st.end_block) for st in one_f_one_b.stages] == [
        (st.first_block, st.end_block) for st in chosen.stages]
    assert chosen.simulated_step_ms < one_f_one_b.simulated_step_ms
    assert [sp.name for sp in chosen.shared_params] == ["embed.weight"]
    assert all(st.memory.total <= chosen.memory_budget for st in chosen.stages)
    # one rank, one micro-batch in flight (1F1B on one stage), recomputing: still too big
    with pytest.raises(ValueError, match=r"no plan fits 1 device"):
        plan(1, micro_batches=2 * args.batch, schedule="1f1b", recompute=True)
    # and the model replicated on both ranks fits only fully sharded (ZeRO-3), its step
    # longer than the pipeline's (every micro-batch gathers the parameters)
    flat = plan(2, stages=1)
    assert [(st.replicas, st.zero) for st in flat.stages] == [(2, 3)]
    assert flat.predicted_step_ms > chosen.predicted_step_ms
    with pytest.raises(ValueError, match=r"no plan fits 2 devices"):
        plan(2, stages=1, zero=1)
