"""The link between ranks, measured on ranks, and ``compile`` planning with it. The other
costs outside the model's graph: ``unit/test_links_and_optimizer.py``."""

from __future__ import annotations

import math

from examples.models import mlp_example
from rannc_fx import Config, DeviceSpec
from rannc_fx.compile import compile as rannc_compile
from rannc_fx.startup.probe import measure_link
from tests.dist_utils import run_ranks
from tests.unit.test_links_and_optimizer import CPU


def _probe(rank: int, world: int) -> tuple[float, float, float] | None:
    link = measure_link(CPU, rounds=3, large_rounds=2)
    return None if link is None else (link.bandwidth, link.latency, link.allreduce_bandwidth)


def test_the_link_is_measured_between_ranks():
    # 3 ranks: rank 0 probes ranks 1 and 2, so all three get figures
    for got in run_ranks(_probe, 3):
        assert got is not None
        assert all(math.isfinite(x) and x > 0 for x in got)


def _compiled_link(rank: int, world: int) -> tuple[float, float, float | None]:
    model, args, _ = mlp_example(batch=2 * world)
    local = tuple(a[2 * rank : 2 * rank + 2] for a in args)
    cfg = Config(replicas=(1, 1), micro_batches=1, profile_cache_dir=None, profile_repeats=1)
    cm = rannc_compile(model, None, cfg)
    cm(*local)
    dev = cm.plan.device
    return dev.interconnect_bandwidth, dev.interconnect_latency, dev.allreduce_bandwidth


def test_compile_plans_with_the_measured_link():
    preset = DeviceSpec.preset("cpu")
    results = run_ranks(_compiled_link, 2, timeout_s=60.0)
    assert len(set(results)) == 1  # one plan, from rank 0
    bw, lat, ar = results[0]
    assert (bw, lat) != (preset.interconnect_bandwidth, preset.interconnect_latency)
    assert bw > 0 and lat > 0 and ar is not None and ar > 0
