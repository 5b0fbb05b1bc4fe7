"""Step time of rannc_fx against torch.distributed.pipelining (ScheduleGPipe, Schedule1F1B).

Run with torchrun (gloo on CPU, one thread per rank):

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/runtime_vs_pipelining.py \
        --mode same-split
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/runtime_vs_pipelining.py \
        --mode auto --vocab 32768

``--mode same-split``: rannc_fx's plan is forced to one replica per stage and ``--micro-batches``
(``Config(replicas=(1,)*W, micro_batches=m)``) with every transformer layer a leaf module, so
it can only cut between layers; the peers then cut at the same layers and run the same
micro-batch count. Per schedule in ``--schedules``: ``rannc_fx-<schedule>`` (and with
``--recompute`` also ``rannc_fx-<schedule>-recompute``, every stage recomputing),
``pipelining-manual-<schedule>`` (hand-written stage modules, ``PipelineStage``) and
``pipelining-traced-<schedule>`` (``pipeline()`` with a ``split_spec``). The first rannc_fx
contender is the reference of the ratios.

``--mode auto``: rannc_fx plans on its own (stages, cuts, replicas, micro-batches); the peer
splits the layers evenly over W stages (embedding with the first, head with the last), as its
users do, once per micro-batch count in ``--peer-micro-batches`` (manual frontend).

Every contender trains its own deep copy of one model with Adam on the same global batch;
steps are interleaved round-robin (A B C A B C ...) after ``--warmup`` rounds, and a step is
timed on rank 0 between two barriers (so it covers every rank). Ratios are medians of the
per-round ratios. The first-step losses of all contenders are printed as a check that they
compute the same thing.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_common import (  # noqa: E402
    GPT,
    add_model_args,
    environment,
    interleave,
    lm_loss,
    make_batch,
    median_ratio,
    pin_to_core,
    summarize,
)

import rannc_fx  # noqa: E402
from rannc_fx import Config  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--mode",
        choices=("same-split", "auto"),
        default="same-split",
        help="same-split: forced rannc_fx plan vs both pipelining frontends at the same "
        "cut; auto: rannc_fx's own plan vs an even layer split (default: same-split)",
    )
    add_model_args(p)
    p.add_argument(
        "--micro-batches",
        type=int,
        default=4,
        help="same-split: micro-batches of every contender (default: 4)",
    )
    p.add_argument(
        "--peer-micro-batches",
        type=int,
        nargs="+",
        default=[4, 8, 16],
        help="auto: micro-batch counts the even-split peer runs with; each is a "
        "contender and the best one is the reference (default: 4 8 16)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        nargs="+",
        default=None,
        help="auto: force rannc_fx's replica count per stage (e.g. 1 1: a pipeline "
        "whose cut and micro-batch count are still searched); default: searched",
    )
    p.add_argument(
        "--schedules",
        nargs="+",
        choices=("gpipe", "1f1b", "zbh1", "interleaved", "zbv"),
        default=["gpipe"],
        help="same-split: schedules every contender runs (default: gpipe); the peer of "
        "'zbh1' is ScheduleInterleavedZeroBubble with one stage a rank, of 'interleaved' "
        "ScheduleInterleaved1F1B and of 'zbv' ScheduleZBVZeroBubble, two stages a rank "
        "(manual frontend only)",
    )
    p.add_argument(
        "--recompute",
        action="store_true",
        help="same-split: add a rannc_fx contender per schedule with every stage recomputing",
    )
    p.add_argument("--warmup", type=int, default=5, help="untimed rounds first (default: 5)")
    p.add_argument("--steps", type=int, default=30, help="timed rounds (default: 30)")
    p.add_argument(
        "--no-traced", action="store_true", help="same-split: leave out the pipeline() frontend"
    )
    p.add_argument(
        "--pin",
        action="store_true",
        help="bind each rank (every thread of its process) to one core, LOCAL_RANK modulo "
        "the cores, before the process group starts; every contender runs so pinned",
    )
    p.add_argument(
        "--profile-repeats",
        type=int,
        default=3,
        help="rannc_fx's timed runs per profiled op (Config.profile_repeats; default: 3, "
        "the package default)",
    )
    p.add_argument(
        "--profile-cache",
        action="store_true",
        help="let rannc_fx reuse profiles from its disk cache (default: profile afresh)",
    )
    p.add_argument(
        "--json",
        type=Path,
        default=None,
        help="rank 0 writes the raw step times and the plan summary here",
    )
    return p.parse_args(argv)


# -- contenders -----------------------------------------------------------------------------


class _Stage(nn.Module):
    """Layers [lo, hi) of a GPT, with the embedding if first and the head if last."""

    def __init__(self, model: GPT, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.embed, self.pos = model.embed, model.pos
        self.blocks = nn.ModuleList(model.blocks[lo:hi])
        if last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos if self.first else x
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.ln_f(h)) if self.last else h


class PeerStep:
    """One rank's stage of torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B or
    ScheduleInterleavedZeroBubble (one stage a rank), or its two stages of
    ScheduleInterleaved1F1B or ScheduleZBVZeroBubble, plus Adam."""

    def __init__(
        self,
        model: GPT,
        bounds: list[int],
        m: int,
        traced: bool,
        ids: torch.Tensor,
        labels: torch.Tensor,
        schedule: str = "gpipe",
    ):
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            SplitPoint,
            pipeline,
        )

        rank, world = dist.get_rank(), dist.get_world_size()
        self.rank, self.world, self.ids, self.labels = rank, world, ids, labels
        self.last_rank = 0 if schedule == "zbv" else world - 1
        dev = torch.device("cpu")
        if schedule in ("interleaved", "zbv"):
            from torch.distributed.pipelining import ScheduleInterleaved1F1B, ScheduleZBVZeroBubble

            n = 2 * world
            mine = [rank, 2 * world - 1 - rank] if schedule == "zbv" else [rank, rank + world]
            edges = [0, *bounds, len(model.blocks)]
            stages, params = [], []
            for s in mine:
                mod = _Stage(model, edges[s], edges[s + 1], s == 0, s == n - 1)
                stages.append(PipelineStage(mod, s, n, dev))
                params += list(mod.parameters())
            kind = ScheduleZBVZeroBubble if schedule == "zbv" else ScheduleInterleaved1F1B
            self.sched = kind(stages, n_microbatches=m, loss_fn=lm_loss)
            self.opt = torch.optim.Adam(params, lr=1e-4)
            self.losses = []
            return
        if traced:
            split = {f"blocks.{b}": SplitPoint.BEGINNING for b in bounds}
            pipe = pipeline(model, mb_args=(ids.chunk(m)[0],), split_spec=split)
            stage = pipe.build_stage(rank, dev)
            params = list(stage.submod.parameters())
        else:
            edges = [0, *bounds, len(model.blocks)]
            mod = _Stage(model, edges[rank], edges[rank + 1], rank == 0, rank == world - 1)
            stage = PipelineStage(mod, rank, world, dev)
            params = list(mod.parameters())
        if schedule == "zbh1":
            from torch.distributed.pipelining import ScheduleInterleavedZeroBubble

            self.sched = ScheduleInterleavedZeroBubble([stage], n_microbatches=m,
                                                       loss_fn=lm_loss)
        else:
            kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
            self.sched = kind(stage, n_microbatches=m, loss_fn=lm_loss)
        self.opt = torch.optim.Adam(params, lr=1e-4)
        self.losses: list[torch.Tensor] = []

    def __call__(self) -> None:
        self.losses = []
        first, last = self.rank == 0, self.rank == self.last_rank
        if first and last:
            self.sched.step(self.ids, target=self.labels, losses=self.losses,
                            return_outputs=False)
        elif first:
            self.sched.step(self.ids, return_outputs=False)
        elif last:
            self.sched.step(target=self.labels, losses=self.losses, return_outputs=False)
        else:
            self.sched.step(return_outputs=False)
        self.opt.step()
        self.opt.zero_grad()

    def loss(self) -> float | None:
        return float(torch.stack(self.losses).detach().mean()) if self.losses else None


class RanncStep:
    """rannc_fx.compile on this rank's local slice of the global batch, plus Adam."""

    def __init__(self, model: GPT, config: Config, ids: torch.Tensor, labels: torch.Tensor):
        rank, world = dist.get_rank(), dist.get_world_size()
        local = ids.shape[0] // world
        self.ids = ids[rank * local : (rank + 1) * local]
        self.labels = labels[rank * local : (rank + 1) * local]
        self.opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        self.model = rannc_fx.compile(model, self.opt, config)
        self.last: float | None = None

    def __call__(self) -> None:
        loss = self.model(self.ids, self.labels)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.last = float(loss.detach())


def layer_bounds(plan: Any, layers: int) -> list[int]:
    """The first layer of every stage after the first, from a plan whose layers are leaves;
    refuses a plan that cuts anywhere but between layers."""
    where = plan.node_stage()
    stage_of_layer = []
    for k in range(layers):
        s = where.get(f"blocks_{k}")
        if s is None:
            raise ValueError(f"layer {k} is not one node of the plan; were the Blocks leaves?")
        stage_of_layer.append(s)
    if where.get("embed") not in (0, None) or where.get("head") != len(plan.stages) - 1:
        raise ValueError("the plan puts the embedding or the head in an inner stage")
    bounds = [k for k in range(1, layers) if stage_of_layer[k] != stage_of_layer[k - 1]]
    if len(bounds) != len(plan.stages) - 1:
        raise ValueError(f"stage of each layer {stage_of_layer} is not contiguous")
    return bounds


def even_bounds(layers: int, stages: int) -> list[int]:
    return [round(k * layers / stages) for k in range(1, stages)]


# -- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.pin:
        pin_to_core()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must divide evenly over {world} ranks")
    torch.manual_seed(0)
    base = GPT(args.vocab, args.d_model, args.heads, args.layers, args.seq)
    ids, labels = make_batch(args.vocab, args.batch, args.seq)
    cache: dict[str, Any] = {"profile_repeats": args.profile_repeats}
    if not args.profile_cache:
        cache["profile_cache_dir"] = None

    variants = [("rannc_fx", {})]
    if args.mode == "same-split":
        cfg = Config(
            replicas=(1,) * world,
            micro_batches=args.micro_batches,
            leaf_modules=("Block",),
            **cache,
        )
        variants = [
            (f"rannc_fx-{s}{'-recompute' if r else ''}",
             {"schedule": s, "recompute": r, **({"recompute_selective": False} if r else {})})
            for s in args.schedules
            for r in ((False, True) if args.recompute else (False,))
        ]
    else:
        cfg = Config(replicas=tuple(args.replicas) if args.replicas else None, **cache)
    t0 = time.perf_counter()
    contenders: dict[str, Any] = {}
    for name, forced in variants:
        step = RanncStep(copy.deepcopy(base), cfg.model_copy(update=forced), ids, labels)
        step()  # plans (rank 0 profiles; the others wait), then runs the first step
        contenders[name] = step
    ref = variants[0][0]
    plan = contenders[ref].model.plan
    setup_s = time.perf_counter() - t0

    if args.mode == "same-split":
        # every contender cuts where the first rannc_fx contender's plan cuts; a schedule
        # with two stages a rank cuts where its own plan does (twice as many stages)
        bounds = layer_bounds(plan, args.layers)
        virtual_bounds = {
            s: layer_bounds(contenders[f"rannc_fx-{s}"].model.plan, args.layers)
            for s in args.schedules if s in ("interleaved", "zbv")
        }
        m = args.micro_batches
        for s in args.schedules:
            contenders[f"pipelining-manual-{s}"] = PeerStep(
                copy.deepcopy(base), virtual_bounds.get(s, bounds), m, False, ids, labels, s
            )
            if not args.no_traced and s not in ("interleaved", "zbv"):
                contenders[f"pipelining-traced-{s}"] = PeerStep(
                    copy.deepcopy(base), bounds, m, True, ids, labels, s
                )
        peer_desc = f"cut before layer(s) {bounds}, m={m}" + "".join(
            f"; {s}: cut before layer(s) {b}" for s, b in virtual_bounds.items())
    else:
        bounds = even_bounds(args.layers, world)
        for m in args.peer_micro_batches:
            contenders[f"pipelining-even-m{m}"] = PeerStep(
                copy.deepcopy(base), bounds, m, False, ids, labels
            )
        peer_desc = f"even split: cut before layer(s) {bounds}"

    # first-step losses: every contender starts from the same weights and batch
    for name, step in contenders.items():
        if not name.startswith("rannc_fx"):
            step()
    first = {
        name: (s.last if name.startswith("rannc_fx") else s.loss())
        for name, s in contenders.items()
    }
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, first)

    times, cpu = interleave(contenders, warmup=args.warmup, steps=args.steps, sync=dist.barrier)
    cpus: list[Any] = [None] * world
    dist.all_gather_object(cpus, cpu)
    if rank != 0:
        dist.destroy_process_group()
        return
    # CPU seconds of a step summed over the ranks: the work done, whatever the load
    cpu_sum = {k: [sum(c[k][i] for c in cpus) for i in range(args.steps)] for k in contenders}

    losses = {k: next((g[k] for g in gathered if g[k] is not None), None) for k in contenders}
    print(plan.summary())
    print(f"\nrannc_fx setup (capture, profile, search, split, first step) of "
          f"{len(variants)} contender(s): {setup_s:.1f} s")
    print(f"peer: {peer_desc}; {args.steps} timed rounds after {args.warmup} warm-up rounds"
          + ("; each rank pinned to its own core" if args.pin else "") + "\n")
    print(
        f"| contender | wall ms median | p10 | p90 | {ref} / contender, wall | CPU ms (all ranks) "
        f"| {ref} / contender, CPU | first-step loss |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, ts in times.items():
        s = summarize([1e3 * t for t in ts])
        c = summarize([1e3 * t for t in cpu_sum[name]])
        ratio = "1" if name == ref else f"{median_ratio(times[ref], ts):.3f}"
        cratio = "1" if name == ref else f"{median_ratio(cpu_sum[ref], cpu_sum[name]):.3f}"
        loss = losses[name]
        print(
            f"| {name} | {s['median']:.1f} | {s['p10']:.1f} | {s['p90']:.1f} | {ratio} | "
            f"{c['median']:.1f} | {cratio} | {loss if loss is None else f'{loss:.6f}'} |"
        )
    for s in args.schedules if args.mode == "same-split" else ():
        mine, peer = f"rannc_fx-{s}", f"pipelining-manual-{s}"
        print(f"\n{s}: {mine} / {peer}, median of per-round ratios: wall "
              f"{median_ratio(times[mine], times[peer]):.3f}, CPU "
              f"{median_ratio(cpu_sum[mine], cpu_sum[peer]):.3f}")
    print(
        f"\npredicted step (plan.predicted_step_ms): {plan.predicted_step_ms:.1f} ms; "
        f"measured rannc_fx median {1e3 * summarize(times[ref])['median']:.1f} ms"
    )
    print("\n".join(environment()))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "times_s": times,
                    "cpu_s_all_ranks": cpu_sum,
                    "losses": losses,
                    "plan_summary": plan.summary(),
                    "predicted_step_ms": plan.predicted_step_ms,
                    "peer": peer_desc,
                },
                indent=1,
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
