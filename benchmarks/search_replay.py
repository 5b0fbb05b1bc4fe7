"""Replay the search on saved cost tables: time it, profile it, and compare its plans.

Capturing a large model takes most of a minute; the search only needs the ``CostTable`` and
``SearchSpace`` that ``rannc_fx.driver.analyze`` returns. ``--dump`` runs ``analyze`` once on
the meta-device BERT of ``plan_time.py`` (same flags) and pickles both, with the plan the
search returns; ``--replay`` runs ``search_pass`` on saved files and reports each plan, its
time, and whether it is identical to the saved one (stages, replicas, micro-batches, schedule,
recomputation and the predicted step, bit for bit).

    python benchmarks/search_replay.py --dump /tmp/w3.pkl --layers 128 --hidden 8192 \\
        --heads 64 --world-size 1024 --seq 512 --global-batch 1024 --device a100-80gb
    python benchmarks/search_replay.py --replay /tmp/w3.pkl --repeat 3 [--profile 30]
"""

from __future__ import annotations

import argparse
import cProfile
import pickle
import pstats
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rannc_fx.search import (
    CostTable,
    NoFeasiblePlan,
    SearchResult,
    SearchSpace,
    search_pass,
)


def plan_key(result: SearchResult) -> dict[str, Any]:
    """What two searches must agree on: the plan and its predicted step, bit for bit."""
    return {
        "m": result.micro_batches,
        "schedule": result.schedule,
        "stages": [(s.start, s.end, s.replicas, s.recompute) for s in result.stages],
        "step_s": result.evaluation.step_s,
    }


def dump(path: Path, argv: Sequence[str]) -> None:
    """``analyze`` the plan_time.py model of ``argv`` and pickle its table, space and plan."""
    sys.path.insert(0, str(Path(__file__).parent))
    import plan_time  # the model and the flags of the end-to-end benchmark

    from rannc_fx import Config
    from rannc_fx.planner.analyze import analyze

    p = argparse.ArgumentParser()
    for flag, kind, default in (("--layers", int, 96), ("--hidden", int, 2048),
                                ("--heads", int, 32), ("--seq", int, 128),
                                ("--global-batch", int, 256), ("--world-size", int, 32),
                                ("--device", str, "v100-32gb")):
        p.add_argument(flag, type=kind, default=default)
    a = p.parse_args(argv)
    model, args, kwargs, _ = plan_time.bert(a.layers, a.hidden, heads=a.heads, seq=a.seq)
    got = analyze(model, args, kwargs, world_size=a.world_size, device=a.device,
                  config=Config(profile_cache_dir=None), global_batch=a.global_batch)
    result = search_pass(got.table, got.space)
    with open(path, "wb") as f:
        pickle.dump({"argv": list(argv), "table": got.table, "space": got.space,
                     "plan": plan_key(result), "seconds": result.seconds, "dps": result.dps}, f)
    print(f"{path}: {got.table.num_blocks} blocks, search {result.seconds:.2f} s, "
          f"{plan_key(result)}")


def replay(path: Path, repeat: int, profile: int) -> bool:
    """Search the saved table ``repeat`` times; True when every plan equals the saved one."""
    with open(path, "rb") as f:
        saved = pickle.load(f)
    table: CostTable = saved["table"]
    space: SearchSpace = saved["space"]
    same, times = True, []
    for _ in range(repeat):
        t0 = time.perf_counter()
        try:
            result: SearchResult | None = search_pass(table, space)
        except NoFeasiblePlan:
            result = None
        times.append(time.perf_counter() - t0)
        got = plan_key(result) if result is not None else "none"
        same &= got == saved["plan"]
    print(f"{path.name}: {table.num_blocks} blocks, W={space.world_size}, "
          f"m in {space.micro_batches}: {min(times):.3f} s (of {len(times)}: "
          f"{', '.join(f'{t:.3f}' for t in times)}), "
          f"{result.dps if result is not None else 0} DPs (saved {saved.get('dps', '?')}), "
          f"{'same plan' if same else 'DIFFERENT plan'}; saved search {saved['seconds']:.2f} s")
    if not same:
        print(f"  saved: {saved['plan']}\n  now:   {got}")
    if profile:
        prof = cProfile.Profile()
        prof.runcall(search_pass, table, space)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(profile)
    return same


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dump", type=Path, help="analyze plan_time.py's model and save to PATH")
    p.add_argument("--replay", type=Path, nargs="+", default=[], help="saved tables to search")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--profile", type=int, default=0, help="print this many cProfile rows")
    a, rest = p.parse_known_args(argv)
    if a.dump:
        dump(a.dump, rest)
    ok = all([replay(path, a.repeat, a.profile) for path in a.replay])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
