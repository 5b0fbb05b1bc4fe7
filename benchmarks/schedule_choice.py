"""The schedule the planner chooses against the best GPipe/1F1B plan, predicted.

    python benchmarks/schedule_choice.py bert-32 bert-256 bert-512 bert-4.9b bert-100b gpt-13b

Each workload of ``plan_time.WORKLOADS`` (a meta-device BertForPreTraining returning its
pre-training loss, so every schedule is eligible) is analyzed once; the search then runs with
GPipe only, 1F1B only, and both (as ``Config(schedule=None)`` does), and the planner's
interleaving and zero-bubble steps (``planner/virtual.py`` on the searched lanes and every
equal split of the ranks into lanes, ``planner/lanes.py``; then ``planner/zb_choice.py``)
are applied to the last, as the planner does (``planner.driver.choose``). ``gpt-13b`` is a
meta-device GPT-2 architecture at GPT-3 13B's shape
(40 layers of 5120, 40 heads, sequence 2048, global batch 64) returning its LM loss
(``labels=``) on 16 A100-80GB. Per workload: the best
GPipe/1F1B plan's simulated step and bubble (the share of the step the busiest lane is idle:
the step less its actions' simulated durations, forwards, recomputation, backwards with their
gradient accumulation and messages, and its once-a-step update), the chosen plan's schedule
and simulated step, and their ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_time import WORKLOADS, bert, environment  # noqa: E402

from rannc_fx import Config, Plan  # noqa: E402
from rannc_fx.planner.analyze import analyze  # noqa: E402
from rannc_fx.planner.build import build_plan  # noqa: E402
from rannc_fx.planner.driver import choose, run_search  # noqa: E402
from rannc_fx.planner.virtual import virtual_variants  # noqa: E402
from rannc_fx.schedules.lowering import lower_plan  # noqa: E402
from rannc_fx.schedules.simulate import plan_durations  # noqa: E402


def bubble(plan: Plan) -> float:
    """1 - the busiest lane's busy time (its actions' simulated durations) over the step."""
    _, lowered = lower_plan(plan)
    of = plan_durations(plan, lowered)
    busy = max(sum(of(a) for a in acts) for acts in lowered)
    step = 1e-3 * (plan.simulated_step_ms or plan.predicted_step_ms)
    return max(0.0, 1 - busy / step)


GPT = {"gpt-13b": dict(layers=40, hidden=5120, heads=40, seq=2048, global_batch=64,
                      world_size=16, device="a100-80gb")}


def gpt(layers: int, hidden: int, *, heads: int, seq: int) -> tuple[Any, ...]:
    """A meta-device GPT2LMHeadModel (tied embedding and head) with its LM loss."""
    import torch
    import transformers

    cfg = transformers.GPT2Config(vocab_size=50257, n_positions=seq, n_embd=hidden,
                                  n_layer=layers, n_head=heads, use_cache=False)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.zeros(2, seq, dtype=torch.long)
    return model, (ids,), {"labels": ids}


def run(name: str) -> str:
    a = _analyzed(name)
    plans = {}
    for label, schedules in (("gpipe", ("gpipe",)), ("1f1b", ("1f1b",)),
                             ("searched", a.space.schedules)):
        space = dataclasses.replace(a.space, schedules=schedules)
        b = dataclasses.replace(a, space=space)
        result = run_search(b.table, b.space)
        plan = build_plan(b, result)
        if label == "searched":  # what the planner makes of it (``driver.choose``)
            plan = choose(b, result)
        plans[label] = plan
    best = min((plans["gpipe"], plans["1f1b"]), key=lambda p: p.simulated_step_ms or 0.0)
    chosen = plans["searched"]
    sb, sc = best.simulated_step_ms or 0.0, chosen.simulated_step_ms or 0.0
    return (f"| {name} | {best.schedule}, {len(best.stages)} stages, m={best.micro_batches} | "
            f"{sb:.0f} | {100 * bubble(best):.1f} % | {chosen.schedule}, {len(chosen.stages)} "
            f"stages on {len(chosen.lanes)} lanes, m={chosen.micro_batches} | {sc:.0f} | "
            f"{100 * bubble(chosen):.1f} % | "
            f"{sc / sb:.3f} |")


def probe(name: str) -> str:
    """Whether other lanes or boundaries would open the schedules: interleaved 1F1B and ZBV on
    the best plan of every forced stage count, and ZB-H1's memory on plans searched at a
    fraction of the budget (room left for what ZB-H1 holds more than 1F1B)."""
    from rannc_fx.planner.zb_choice import zbh1_evaluation
    from rannc_fx.search import NoFeasiblePlan

    a = _analyzed(name)
    base = build_plan(a, run_search(a.table, a.space))
    ref = base.simulated_step_ms or 0.0
    out = [f"{name}: searched {base.schedule}, {len(base.stages)} stages, m={base.micro_batches}, "
           f"{ref:.0f} ms"]
    for S in range(2, min(a.table.num_blocks, a.space.world_size, 24) + 1):
        b = dataclasses.replace(a, space=dataclasses.replace(a.space, stages=S))
        try:
            r = run_search(b.table, b.space)
        except NoFeasiblePlan:
            continue
        p = virtual_variants(b, r, build_plan(b, r), lambda x, b=b: build_plan(b, x))
        step = p.simulated_step_ms or 0.0
        out.append(f"  {S} stages (replicas {'/'.join(str(s.replicas) for s in r.stages)}): "
                   f"{p.schedule} v={p.virtual_stages} {step:.0f} ms ({step / ref:.3f})")
    for frac in (1.0, 0.9, 0.8, 0.7, 0.6, 0.5):
        b = dataclasses.replace(a, space=dataclasses.replace(
            a.space, memory_budget=a.space.memory_budget * frac))
        try:
            r = run_search(b.table, b.space)
        except NoFeasiblePlan:
            continue
        ev = zbh1_evaluation(a, r.stages, r.micro_batches)
        need = max(s.memory for s in ev.stages) / a.space.memory_budget
        out.append(f"  searched at {frac:.1f} of the budget: {len(r.stages)} stages, "
                   f"m={r.micro_batches}: ZB-H1 needs {need:.2f} of the budget")
    return "\n".join(out)


def named(name: str) -> str:
    """Each schedule named (``Config.schedule``) on the searched plan's stages or lanes, as
    the planner tries them: its simulated step against the searched plan's and its bubble,
    or why it is refused (it does not fit)."""
    from rannc_fx.planner.zb_choice import searched, zero_bubble

    a = _analyzed(name)
    result = run_search(a.table, a.space)
    base = build_plan(a, result)
    ref = base.simulated_step_ms or 0.0
    out = [f"{name}: searched {base.schedule}, {len(base.stages)} stages, "
           f"m={base.micro_batches}, {ref:.0f} ms, bubble {100 * bubble(base):.1f} %"]
    t0 = time.perf_counter()
    zb = searched(a, lambda r: build_plan(a, r), result)
    took = time.perf_counter() - t0
    if zb is None:
        out.append(f"  zbh1 searched: none fits with a closed form below the searched "
                   f"plan's formula ({took:.1f} s)")
    else:
        step = zb.simulated_step_ms or 0.0
        out.append(f"  zbh1 searched: {len(zb.stages)} stages (replicas "
                   f"{'/'.join(str(st.replicas) for st in zb.stages)}), m={zb.micro_batches}: "
                   f"{step:.0f} ms ({step / ref:.3f}), closed form {zb.predicted_step_ms:.0f} ms, "
                   f"bubble {100 * bubble(zb):.1f} %; search and build {took:.1f} s")
    for schedule, v in (("zbh1", None), ("zbv", None), ("interleaved", 2), ("interleaved", 3),
                        ("interleaved", 4)):
        b = dataclasses.replace(a, config=a.config.model_copy(
            update={"schedule": schedule, "virtual_stages": v}))
        try:
            p = (zero_bubble if schedule == "zbh1" else virtual_variants)(
                b, result, base, lambda r, b=b: build_plan(b, r))
        except ValueError as e:
            out.append(f"  {schedule}{f' v={v}' if v else ''}: refused "
                       f"({str(e).split(';')[0]})")
            continue
        step = p.simulated_step_ms or 0.0
        out.append(f"  {schedule}{f' v={v}' if v else ''}: {step:.0f} ms ({step / ref:.3f}), "
                   f"bubble {100 * bubble(p):.1f} %, recomputing "
                   f"{sum(st.recompute for st in p.stages)} of {len(p.stages)}")
    return "\n".join(out)


def _analyzed(name: str) -> Any:
    w = dict(WORKLOADS[name] if name in WORKLOADS else GPT[name])
    make = bert if name in WORKLOADS else gpt
    model, args, kwargs, *_ = make(w.pop("layers"), w.pop("hidden"), heads=w.pop("heads"),
                                   seq=w.pop("seq"))
    return analyze(model, args, kwargs, world_size=w["world_size"], device=w["device"],
                   config=Config(profile_cache_dir=None), global_batch=w["global_batch"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workloads", nargs="+", choices=sorted({*WORKLOADS, *GPT}))
    p.add_argument("--probe", action="store_true",
                   help="instead of the table: interleaving on every forced stage count, and "
                   "ZB-H1's memory on plans searched at 0.5-1.0 of the budget")
    p.add_argument("--named", action="store_true",
                   help="instead of the table: each schedule named on the searched plan")
    args = p.parse_args()
    if args.probe or args.named:
        for name in args.workloads:
            print((probe if args.probe else named)(name), flush=True)
        print(f"\n{environment(None)}")
        return
    print("| workload | best GPipe/1F1B plan | simulated ms | bubble | chosen plan | simulated ms "
          "| bubble | chosen / best |\n|---|---|---:|---:|---|---:|---:|---:|", flush=True)
    for name in args.workloads:
        print(run(name), flush=True)
    print(f"\n{environment(None)}")


if __name__ == "__main__":
    main()
