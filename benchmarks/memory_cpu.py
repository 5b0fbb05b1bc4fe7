"""Per-stage memory of GPipe, 1F1B, ZB-H1 and recomputation on CPU ranks, against the plan's
prediction.

Run with torchrun (gloo, one thread per rank):

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/memory_cpu.py --mode schedules
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/memory_cpu.py --mode budget

``--mode schedules``: the GPT of ``runtime_common`` on a forced split (one replica per stage,
``--micro-batches``, every layer a leaf), once per schedule x recomputation. Per stage:

- saved activations: the peak of the bytes autograd holds at once during a step, counted
  exactly with saved-tensor hooks (unique storages, parameters and buffers excluded, a storage
  counted from its first save until autograd drops its last), against the plan's
  ``activations`` (in-flight micro-batches x a micro-batch's saved bytes; one micro-batch's when
  recomputing);
- the step's memory: the peak of the bytes the process's allocator has handed out (glibc's
  ``mallinfo2``, in-use heap and mmapped blocks, sampled every 0.2 ms) during a step, above
  its level before the step, against the plan's ``grads + activations + comm_buffers +
  workspace + outputs`` (the gradients are set to None before each step; parameters and Adam
  state exist before it and are exact, see runtime_prediction_cpu_202611.md). Resident memory
  would not do: the allocator keeps freed pages, so after the first step it barely moves.

``--mode budget``: ``Config(device_memory=...)`` set so that no GPipe plan without
recomputation fits (below the least largest-stage memory such plans need), the search then
picks its plan; training with it, every rank's peak (static bytes + the measured step memory)
must stay within the budget.

``--mode zero``: ``--replicas`` forced, 1F1B, ``Config(zero=0)``, ``zero=1`` then ``zero=2``;
per rank the parameter, gradient (after a step's backwards) and optimizer-state bytes it
holds, counted off its tensors, against the plan's (the plan's gradients are the backward's
peak, whole under ZeRO-2 too; what ZeRO-2 holds after its reduce is the owner's share), and
the step's heap peak as above.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_common import GPT, add_model_args, environment, make_batch  # noqa: E402

import rannc_fx  # noqa: E402
from rannc_fx import Config  # noqa: E402
from rannc_fx.search import NoFeasiblePlan, search_pass  # noqa: E402

MiB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--mode", choices=("schedules", "budget", "zero"), default="schedules",
                   help="schedules: forced split, each schedule x recomputation; budget: a "
                   "budget no GPipe plan without recomputation fits; zero: --replicas with "
                   "the optimizer state unsharded and sharded (default: schedules)")
    p.add_argument("--replicas", type=int, nargs="+", default=None,
                   help="zero: replica counts of the stages (default: 2 stages, the world "
                   "halved)")
    add_model_args(p)
    p.add_argument("--micro-batches", type=int, default=4,
                   help="schedules: micro-batches (default: 4)")
    p.add_argument("--steps", type=int, default=4, help="measured steps per variant (default: 4)")
    p.add_argument("--schedules", nargs="+",
                   choices=("gpipe", "1f1b", "zbh1", "interleaved", "zbv"),
                   default=["gpipe", "1f1b", "zbh1"], help="schedules: the schedules measured")
    p.add_argument("--recompute", nargs="+", choices=("none", "stage", "layers", "selective"),
                   default=["none", "stage"], help="schedules: recomputation, none, of whole "
                   "stages, or layer by layer (default: none stage)")
    p.add_argument("--schedule", choices=("gpipe", "1f1b", "zbh1"), default=None,
                   help="budget: force the schedule (default: searched); gpipe leaves "
                   "recomputation as the only way to fit")
    p.add_argument("--budget-fraction", type=float, default=0.85,
                   help="budget: the budget as a fraction of the least largest-stage memory "
                   "of GPipe without recomputation (default: 0.85)")
    return p.parse_args(argv)


class SavedBytes:
    """Saved-tensor hooks that track the bytes autograd holds at once, and their peak."""

    def __init__(self, excluded: set[int]):
        self.excluded = excluded
        self.count: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def pack(self, t: torch.Tensor) -> Any:
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr in self.excluded or t.device.type == "meta":
            return t
        if self.count.get(ptr, 0) == 0:
            self.live += s.nbytes()
            self.peak = max(self.peak, self.live)
        self.count[ptr] = self.count.get(ptr, 0) + 1
        # its data only: a node's saved output holds the node as its grad_fn, and the node
        # the holder, a cycle no collector sees through once a backward keeps its graph
        # (retain_graph, as a split backward's W runs)
        holder = _Held(t.detach())
        weakref.finalize(holder, self._drop, ptr, s.nbytes())
        return holder

    def unpack(self, x: Any) -> torch.Tensor:
        return x.t if isinstance(x, _Held) else x

    def _drop(self, ptr: int, nbytes: int) -> None:
        self.count[ptr] -= 1
        if self.count[ptr] == 0:
            self.live -= nbytes


class _Held:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor):
        self.t = t


class HeapPeak:
    """The peak of the allocator's in-use bytes while the context is open (a sampling thread)."""

    def __enter__(self) -> HeapPeak:
        self.base = self.peak = _in_use()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _in_use())
            time.sleep(0.0002)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _in_use())


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                "usmblks", "fsmblks", "uordblks", "fordblks",
                                                "keepcost")]


_LIBC = ctypes.CDLL("libc.so.6")
_LIBC.mallinfo2.restype = _MallInfo2


def _in_use() -> int:
    """Bytes glibc's malloc has handed out and not taken back: heap blocks and mmapped ones."""
    m = _LIBC.mallinfo2()
    return int(m.uordblks + m.hblkhd)


def measure(model: Any, opt: torch.optim.Optimizer, ids: torch.Tensor, labels: torch.Tensor,
            steps: int) -> dict[str, float]:
    """Per step: peak saved bytes and peak heap above the step's start; medians over steps.

    The two come from different steps, in turn: the heap's from steps without the hooks.
    A hook that keeps a saved output alive makes a cycle with the node that saved it, which
    lives on where the graph is retained (a split backward's B keeps it for its W): with the
    hooks on, ZB-H1's steps would never free their graphs.
    """
    excluded = {t.untyped_storage().data_ptr() for stage in model.stages
                for t in (*stage.parameters(), *stage.buffers())}
    saved, heap = [], []
    for k in range(2 * steps):
        hooks = SavedBytes(excluded)
        gc.collect()  # garbage of earlier steps (pytree's cycles) is not freed during this one
        dist.barrier()
        if k % 2 == 0:
            with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
                loss = model(ids, labels)
                loss.backward()
            saved.append(hooks.peak)
        else:
            with HeapPeak() as peak:
                loss = model(ids, labels)
                loss.backward()
            heap.append(peak.peak - peak.base)
        del loss
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"saved": sorted(saved)[len(saved) // 2], "heap": sorted(heap)[len(heap) // 2]}


def run_variant(base: GPT, cfg: Config, ids: torch.Tensor, labels: torch.Tensor,
                steps: int) -> tuple[Any, dict[str, float]]:
    """The plan and the step's peaks; and the bytes of parameters, gradients (after a step's
    backwards) and Adam state (not its step count) this rank holds."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local = ids.shape[0] // world
    mine = slice(rank * local, (rank + 1) * local)
    model = copy.deepcopy(base)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    cm = rannc_fx.compile(model, opt, cfg)
    got: dict[str, float] = {}
    for _ in range(2):  # plan, then a warm step (allocator pools, optimizer state)
        cm(ids[mine], labels[mine]).backward()
        held = list(dict.fromkeys(p for st in cm.stages for p in st.parameters()))
        got["params"] = sum(p.numel() * p.element_size() for p in held)
        got["grads"] = sum(p.grad.numel() * p.grad.element_size() for p in held
                           if p.grad is not None)
        opt.step()
        opt.zero_grad()
    got["state"] = sum(v.numel() * v.element_size() for p in opt.state
                       for v in opt.state[p].values()
                       if isinstance(v, torch.Tensor) and v.dim() > 0)
    return cm.plan, {**got, **measure(cm, opt, ids[mine], labels[mine], steps)}


def _row(name: str, plan: Any, got: dict[str, float]) -> str:
    """One row per rank: its stage, or the sum over its lane's stages."""
    held = plan.stages_of_rank(dist.get_rank())
    act = sum(st.memory.activations for st in held)
    step_pred = sum(st.memory.total - st.memory.params - st.memory.optimizer_state
                    for st in held)
    return (f"| {name} | {'+'.join(str(st.index) for st in held)} | "
            f"{'+'.join(_recomputes(st) for st in held)} | "
            f"{'+'.join(str(plan.in_flight(st.index)) for st in held)} | {act / MiB:.2f} | "
            f"{_saved(act, got['saved'])} | "
            f"{step_pred / MiB:.2f} | {got['heap'] / MiB:.2f} | "
            f"{100 * (step_pred - got['heap']) / got['heap']:+.1f}% |")


def _saved(predicted: float, saved: float) -> str:
    """Measured saved bytes and the error; none where the backward is split, but on a first
    stage: the runtime's own saved-tensor hooks (``backward_split.keeping_for_split``)
    replace this one's there (a first stage's ``W`` runs its whole backward, unhooked)."""
    if not saved:
        return "— | —"
    return f"{saved / MiB:.2f} | {100 * (predicted - saved) / saved:+.1f}%"


def _recomputes(st: Any) -> str:
    return (("layers" if st.checkpoints else "yes") if st.recompute
            else "selective" if st.selective else "no")


_HEAD = ("| variant | stage | recompute | in flight | predicted activations MiB | measured "
         "saved peak MiB | error | predicted step memory MiB | measured heap peak above step "
         "start MiB | error |\n|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")


def _print_rows(rows: list[str], head: str = _HEAD) -> None:
    """Every rank's rows on rank 0, variant by variant, under ``head``."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rows)
    if dist.get_rank() == 0:
        print(head)
        for i in range(len(rows)):
            for r in everyone:
                print(r[i])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.manual_seed(0)
    base = GPT(args.vocab, args.d_model, args.heads, args.layers, args.seq)
    ids, labels = make_batch(args.vocab, args.batch, args.seq)
    common = dict(profile_cache_dir=None, leaf_modules=("Block",))
    rows: list[str] = []
    if args.mode == "zero":
        reps = tuple(args.replicas or (world // 2, world - world // 2))
        for level in (0, 1, 2):
            cfg = Config(replicas=reps, micro_batches=args.micro_batches, schedule="1f1b",
                         zero=level, **common)
            rows.append(_zero_row(f"zero={level}",
                                  *run_variant(base, cfg, ids, labels, args.steps)))
        _print_rows(rows, "| variant | rank | stage | replicas | zero | params MiB predicted / "
                    "measured | grads | optimizer state | step heap peak |\n"
                    "|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    elif args.mode == "schedules":
        for schedule in args.schedules:
            for recompute in args.recompute:
                layers = {"none": None, "stage": False, "layers": True,
                          "selective": None}[recompute]
                cfg = Config(replicas=(1,) * world, micro_batches=args.micro_batches,
                             schedule=schedule, recompute=recompute != "none",
                             recompute_layers=layers,
                             recompute_selective=recompute == "selective", **common)
                plan, got = run_variant(base, cfg, ids, labels, args.steps)
                rows.append(_row(f"{schedule}{'' if recompute == 'none' else ' + ' + recompute}",
                                 plan, got))
        _print_rows(rows)
    else:
        need = _gpipe_need(base, ids, labels, world, Config(**common))
        cfg0 = Config(**common)
        budget = args.budget_fraction * need
        cfg = cfg0.model_copy(update={"device_memory": int(budget / (1 - cfg0.memory_margin)),
                                      "schedule": args.schedule})
        plan, got = run_variant(base, cfg, ids, labels, args.steps)
        rows.append(_row("searched under the budget", plan, got))
        _print_rows(rows)
        st = plan.stage_of_rank(dist.get_rank())
        static = st.memory.params + st.memory.optimizer_state  # grads: in the step
        peaks: list[Any] = [None] * world
        dist.all_gather_object(peaks, (st.index, static, got["heap"]))
        if dist.get_rank() == 0:
            print(f"\nGPipe without recomputation needs at least {need / MiB:.2f} MiB per device; "
                  f"budget {budget / MiB:.2f} MiB ({args.budget_fraction:.2f} of it, "
                  f"device_memory={cfg.device_memory})")
            print(plan.summary())
            for s, stat, step in peaks:
                print(f"- stage {s}: static {stat / MiB:.2f} MiB + step peak {step / MiB:.2f} "
                      f"MiB = {(stat + step) / MiB:.2f} MiB, {100 * (stat + step) / budget:.1f}% "
                      "of the budget")
    if dist.get_rank() == 0:
        print("\n" + "\n".join(environment()))
        print(f"- command: torchrun --nproc-per-node {world} benchmarks/memory_cpu.py "
              + " ".join(sys.argv[1:]))
    dist.destroy_process_group()


def _zero_row(name: str, plan: Any, got: dict[str, float]) -> str:
    held = plan.stages_of_rank(dist.get_rank())
    mem = {k: sum(getattr(st.memory, f) for st in held)
           for k, f in (("params", "params"), ("grads", "grads"), ("state", "optimizer_state"))}
    step_pred = sum(st.memory.total - st.memory.params - st.memory.optimizer_state
                    for st in held)
    cells = " | ".join(f"{mem[k] / MiB:.2f} / {got[k] / MiB:.2f} "
                       f"({100 * (mem[k] - got[k]) / got[k]:+.1f}%)"
                       for k in ("params", "grads", "state"))
    return (f"| {name} | {dist.get_rank()} | {'+'.join(str(st.index) for st in held)} | "
            f"{held[0].replicas} | {held[0].zero} | {cells} | {step_pred / MiB:.2f} / "
            f"{got['heap'] / MiB:.2f} ({100 * (step_pred - got['heap']) / got['heap']:+.1f}%) |")


def _gpipe_need(base: GPT, ids: torch.Tensor, labels: torch.Tensor, world: int,
                cfg: Config) -> float:
    """The least largest-stage memory of any GPipe plan without recomputation (rank 0 plans,
    every rank gets the figure)."""
    import dataclasses

    from rannc_fx.planner.analyze import analyze

    out: list[Any] = [None]
    if dist.get_rank() == 0:
        a = analyze(copy.deepcopy(base), (ids, labels), world_size=world, config=cfg,
                    global_batch=ids.shape[0])
        space = dataclasses.replace(a.space, memory_budget=1.0, schedules=("gpipe",),
                                    recompute=False)
        try:
            search_pass(a.table, space)
            raise SystemExit("a 1-byte budget fits: the model has no memory to plan for")
        except NoFeasiblePlan as e:
            out[0] = e.largest_stage_bytes
    dist.broadcast_object_list(out, src=0)
    return float(out[0])


if __name__ == "__main__":
    main()
