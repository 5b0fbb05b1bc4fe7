"""Helpers for runtime tests: run a function on N forked gloo ranks; build plans by hand."""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rannc_fx.plan.device import DeviceSpec
from rannc_fx.plan.plan import (
    Block,
    CutValue,
    MemoryEstimate,
    OutputRef,
    Plan,
    SharedParam,
    Stage,
    lane_layout,
)
from rannc_fx.plan.values import ValueSpec

from . import captures

__all__ = ["RankFailed", "SharedRanks", "assert_like_reference", "assert_moved_alike",
           "assert_moved_alike_in_norm", "local_part", "make_plan", "run_ranks", "scalar",
           "snapshot", "step_each", "tensor"]


class RankFailed(AssertionError):
    """One or more ranks raised; the message holds each one's traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 10.0,
    wall_s: float = 60.0,
    init: bool = True,
    patches: Sequence[tuple[str, str, Any]] = (),
) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` worker processes; their results.

    The workers are forked from a fork server, a fresh interpreter of its own started once
    (``tests/distributed/conftest.py``), never from this process: a process forked from one
    where autograd's threads ran cannot use autograd (torch 2.14 refuses it: "Unable to
    handle autograd's threading in combination with fork-based multiprocessing"), while a
    fork is ~0.1 s against 10-17 s for a spawned worker that imports torch. ``fn`` and ``args`` must pickle (module-level functions).
    Each worker sets one thread first (forked workers hang in OpenMP otherwise) and joins a
    gloo group with ``timeout_s``, so a mismatched message becomes an error, not a hang.
    When one rank fails the others get a short grace period, then are killed, and
    ``RankFailed`` carries every traceback. With ``init=False`` the workers get torchrun's
    variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) instead of a group.
    ``patches`` (module, attribute, value) are set in each worker before ``fn`` runs: the
    workers do not see what a test sets in this process (``monkeypatch``).
    """
    ctx = _context()
    port = free_port()
    results: mp.Queue[tuple[int, bool, Any]] = ctx.Queue()
    logs = tempfile.TemporaryDirectory(prefix="rannc_fx-ranks-")
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, timeout_s, init, results, args,
                                          dict(os.environ), tuple(patches),
                                          f"{logs.name}/rank{r}.log"))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + wall_s
    try:
        while len(got) < world_size:
            left = deadline - time.monotonic()
            if any(not ok for ok, _ in got.values()):
                left = min(left, timeout_s + 2.0)  # the rest will fail on their timeout
            if left <= 0:
                break
            try:
                rank, ok, value = results.get(timeout=min(left, 0.5))
                got[rank] = (ok, value)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
                for r in dead:
                    got[r] = (
                        False,
                        f"rank {r} exited with code {procs[r].exitcode} without a result",
                    )
    finally:
        for p in procs:
            p.join(timeout=0.5)
            if p.is_alive():
                p.kill()
                p.join()
        _show_output(logs)
    missing = [r for r in range(world_size) if r not in got]
    errors = [f"--- rank {r} ---\n{v}" for r, (ok, v) in sorted(got.items()) if not ok]
    errors += [f"--- rank {r} --- gave no result within {wall_s} s" for r in missing]
    if errors:
        raise RankFailed("\n".join(errors))
    return [got[r][1] for r in range(world_size)]


class SharedRanks:
    """Many small cases, each ``fn(rank, world, *args)``, run on shared ranks: the cases of a
    world size run one after another in one launch of its ranks, the first time a test asks
    for any of them (``result``), instead of one launch each. Start-up (fork, imports, the
    group) is most of a small case's time.

    A case that raises on any rank ends its launch there; it and every case after it run
    again alone (``run_ranks``), so that a failing test reports its own ranks' tracebacks, as
    it would without sharing. Only for functions that leave nothing behind in the process
    that a later case could see (no patched modules)."""

    def __init__(self, **run_ranks_kw: Any) -> None:
        self.kw = run_ranks_kw
        self.pending: dict[int, list[tuple[Callable[..., Any], tuple[Any, ...]]]] = {}
        self.done: dict[tuple[Any, ...], list[Any] | RankFailed] = {}

    def add(self, fn: Callable[..., Any], world: int, *args: Any) -> None:
        """Register a case (before the first ``result`` of its world size)."""
        if (fn, world, args) not in self.done:
            self.pending.setdefault(world, []).append((fn, args))

    def result(self, fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
        """Every rank's return value of the case (registered or not); its ``RankFailed``
        raised."""
        key = (fn, world, args)
        if key not in self.done:
            if (fn, args) not in self.pending.get(world, []):
                self.pending.setdefault(world, []).append((fn, args))
            self._launch(world)
        got = self.done[key]
        if isinstance(got, RankFailed):
            raise got
        return got

    def _launch(self, world: int) -> None:
        cases = self.pending.pop(world)
        timeout_s = self.kw.get("timeout_s", 10.0)
        wall_s = self.kw.get("wall_s", 60.0)
        try:
            ran = run_ranks(_run_cases, world, cases, **{**self.kw, "timeout_s": timeout_s,
                                                        "wall_s": wall_s * len(cases)})
        except RankFailed:
            ran = [[] for _ in range(world)]
        for k, (fn, args) in enumerate(cases):
            if all(len(r) > k for r in ran):
                self.done[fn, world, args] = [r[k] for r in ran]
                continue
            try:  # it failed, or a case before it did: alone, as a test without sharing runs
                self.done[fn, world, args] = run_ranks(fn, world, *args, **self.kw)
            except RankFailed as e:
                self.done[fn, world, args] = e


def _run_cases(rank: int, world: int, cases: list[tuple[Callable[..., Any], tuple[Any, ...]]]
               ) -> list[Any]:
    """``SharedRanks``' worker: the cases in order, until one raises on any rank."""
    done = []
    for fn, args in cases:
        try:
            value, failed = fn(rank, world, *args), 0
        except Exception:
            value, failed = None, 1
        flag = torch.tensor([failed])
        dist.all_reduce(flag)  # every rank hears of a failure, and stops there
        if int(flag):
            break
        done.append(value)
    return done


# imported once by the fork server, so that each worker starts with them
# (a missing one is skipped: transformers and peft are optional); the last warms it up
_PRELOAD = ["torch", "torch._dynamo", "torch.export._trace", "torch.distributed", "rannc_fx",
            "rannc_fx.compile", "tests.dist_utils", "tests.harness", "tests.hf_models",
            "transformers", "transformers.models.bert.modeling_bert",
            "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama",
            "transformers.models.t5.modeling_t5", "transformers.models.resnet.modeling_resnet",
            "peft", "tests.fork_warmup"]


def _context() -> Any:
    """The fork server's context (the server started by ``tests/distributed/conftest.py``
    before the tier's first test, else at the first call)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _show_output(logs: tempfile.TemporaryDirectory[str]) -> None:
    """Each worker's output on this process's stderr, which pytest shows with a failure."""
    for path in sorted(Path(logs.name).glob("rank*.log")):
        text = path.read_text(errors="replace")
        if text.strip():
            sys.stderr.write(f"--- {path.stem} output ---\n{text}")
    logs.cleanup()


def start_fork_server() -> None:
    """Start the fork server now (``tests/distributed/conftest.py``: before the tier's first
    test, outside its patches)."""
    from multiprocessing import forkserver

    _context()
    forkserver.ensure_running()


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    timeout_s: float,
    init: bool,
    results: mp.Queue[tuple[int, bool, Any]],
    args: tuple[Any, ...],
    env: dict[str, str],
    patches: tuple[tuple[str, str, Any], ...],
    log: str,
) -> None:
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)  # the worker's output, for the test's own (captured) output
    os.dup2(out, 2)
    os.environ.clear()  # the caller's, as a fork of it would have (the server's is older)
    os.environ.update(env)
    for module, attribute, value in patches:
        setattr(importlib.import_module(module), attribute, value)
    captures.install()  # the session's shared captures, unless a patch turned them off
    torch.set_num_threads(1)
    try:
        if init:
            os.environ.pop("RANK", None)  # the runtime must not mistake the test for torchrun
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout_s),
            )
        else:
            os.environ.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def held_of(p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """What of ``whole`` (the one process's parameter, or its gradient) the compiled model's
    ``p`` holds: all of it, or the rows of a fully sharded (ZeRO-3) parameter."""
    from rannc_fx.runtime.full_shard import rows_of

    rows = rows_of(p)
    if rows is None or whole is None:
        return whole
    a, b = rows.span
    return whole[a:b]


def assert_moved_alike(
    module: torch.nn.Module,
    ref: torch.nn.Module,
    before: dict[str, torch.Tensor],
    *,
    rtol: float,
    atol: float,
) -> float:
    """Each parameter of ``module`` (a stage: the original names) equals ``ref``'s within the
    tolerance, and the check could fail: some parameter of ``ref`` moved away from ``before``
    (the values before the step or steps checked) by more than that tolerance, so a stage
    that did not move would fail it. Returns the largest move in units of the tolerance."""
    moved = 0.0
    for name, p in module.named_parameters():
        want = held_of(p, ref.get_parameter(name))
        torch.testing.assert_close(p, want, rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{name}: {m}")
        slack = atol + rtol * want.detach().abs()
        was = held_of(p, before[name])
        moved = max(moved, float(((want.detach() - was).abs() / slack).max()))
    assert moved > 1, (
        f"the parameters moved by at most {moved:.2f} times the tolerance (rtol={rtol}, "
        f"atol={atol}): the comparison would pass parameters that never moved"
    )
    return moved


def assert_moved_alike_in_norm(
    module: torch.nn.Module, ref: torch.nn.Module, before: dict[str, torch.Tensor], *, rel: float
) -> float:
    """Over all parameters of ``module`` at once: their distance from ``ref``'s is under
    ``rel`` times the distance ``ref``'s moved from ``before`` (2-norms). For steps that round
    differently (bfloat16 under Adam, whose normalized update turns a rounding in a tiny
    gradient into a whole step of either sign for a few elements), where no elementwise
    tolerance both holds and is below the step; a stage that did not move is at ``1 * moved``.
    Returns the distance over the move."""
    apart = moved = 0.0
    for name, p in module.named_parameters():
        want = ref.get_parameter(name).detach()
        apart += float((p.detach() - want).square().sum())
        moved += float((want - before[name]).square().sum())
    assert moved > 0, "the reference did not move: nothing to compare"
    ratio = (apart / moved) ** 0.5
    assert ratio < rel, f"the parameters are {ratio:.3f} of the step away from the reference"
    return ratio


def step_each(*pairs: tuple[torch.Tensor, torch.optim.Optimizer]) -> None:
    """``loss.backward()``, ``opt.step()`` and ``opt.zero_grad()`` for each (loss, optimizer):
    the compiled model's and the one-process reference's step side by side."""
    for loss, opt in pairs:
        loss.backward()
        opt.step()
        opt.zero_grad()


def assert_like_reference(stages: Any, ref: torch.nn.Module, **tol: Any) -> None:
    """Every parameter of this rank's ``stages`` equals ``ref``'s of the same name."""
    from torch.testing import assert_close

    for stage in stages:
        for name, p in stage.named_parameters():
            assert_close(p, ref.get_parameter(name), **tol, msg=lambda m, n=name: f"{n}: {m}")


def local_part(tree: Any, rank: int, global_batch: int, local: int) -> Any:
    """This rank's ``local`` samples of every tensor in ``tree`` whose first dimension is the
    global batch (the others, such as a global token count, as they are)."""
    from torch.utils import _pytree as pytree

    lo, hi = rank * local, (rank + 1) * local

    def cut(t: Any) -> Any:
        ok = isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == global_batch
        return t[lo:hi] if ok else t

    return pytree.tree_map(cut, tree)


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of ``module``'s parameters by name (``before`` of ``assert_moved_alike``)."""
    return {n: p.detach().clone() for n, p in module.named_parameters(remove_duplicate=False)}


# -- hand-made plans ------------------------------------------------------------------------------


def tensor(
    name: str,
    shape: Sequence[int],
    *,
    dtype: str = "float32",
    batch_dim: int | None = 0,
    requires_grad: bool = False,
) -> ValueSpec:
    """A tensor value; ``shape`` is per sample (``shape[batch_dim]`` rows per sample)."""
    return ValueSpec(
        name=name,
        kind="tensor",
        dtype=dtype,
        shape=tuple(shape),
        batch_dim=batch_dim,
        requires_grad=requires_grad,
    )


def scalar(name: str, *, requires_grad: bool = True) -> ValueSpec:
    """A value without a batch dimension and no shape: a mean-reduced loss."""
    return tensor(name, (), batch_dim=None, requires_grad=requires_grad)


def make_plan(
    *,
    global_batch: int,
    micro_batches: int,
    replicas: Sequence[int],
    values: dict[str, ValueSpec],
    inputs: Sequence[str],
    stage_io: Sequence[tuple[Sequence[str], Sequence[str]]],
    outputs: Sequence[str],
    shared: Sequence[tuple[str, Sequence[int]]] = (),
    schedule: str = "gpipe",
    recompute: Sequence[bool] | None = None,
    virtual_stages: int = 1,
) -> Plan:
    """A plan with one block per stage; cut values follow from ``stage_io``.

    ``stage_io[s]`` is (input names, output names) of stage s in placeholder / return order;
    a name one stage returns and later ones take becomes a cut value. ``outputs`` are the
    model's flat outputs by value name; ``shared`` is (parameter name, stages) pairs;
    ``recompute`` one flag per stage (default none recomputes). Ranks go to the lanes of
    ``schedule`` (``virtual_stages`` stages a lane) in lane order.
    """
    producer: dict[str, int] = {}
    for s, (_, outs) in enumerate(stage_io):
        for n in outs:
            producer.setdefault(n, s)
    cuts = []
    for name, p in producer.items():
        consumers = tuple(s for s, (ins, _) in enumerate(stage_io) if s > p and name in ins)
        if consumers:
            cuts.append(CutValue(producer=p, consumers=consumers, spec=values[name]))
    zero = MemoryEstimate(
        params=0, grads=0, optimizer_state=0, activations=0, comm_buffers=0, workspace=0
    )
    first_rank, rank = {}, 0
    for lane in lane_layout(schedule, len(stage_io), virtual_stages):
        for s in lane:
            first_rank[s] = rank
        rank += replicas[lane[0]]
    stages = []
    for s, ((ins, outs), r) in enumerate(zip(stage_io, replicas, strict=True)):
        stages.append(
            Stage(
                index=s,
                first_block=s,
                end_block=s + 1,
                replicas=r,
                ranks=tuple(range(first_rank[s], first_rank[s] + r)),
                samples=-(-global_batch // (micro_batches * r)),
                num_nodes=1,
                param_names=(),
                inputs=tuple(ins),
                outputs=tuple(outs),
                fwd_ms=1.0,
                bwd_ms=2.0,
                comm_ms=0.0,
                allreduce_ms=0.0,
                recompute=bool(recompute[s]) if recompute is not None else False,
                memory=zero,
            )
        )
    return Plan(
        model_fingerprint="test",
        tracer="fx",
        world_size=rank,
        global_batch=global_batch,
        micro_batches=micro_batches,
        schedule=schedule,
        virtual_stages=virtual_stages,
        device=DeviceSpec.preset("cpu"),
        cost_model="analytic",
        memory_budget=1 << 30,
        optimizer_state_factor=2.0,
        blocks=tuple(
            Block(
                index=s, nodes=(f"n{s}",), fwd_ms=1.0, bwd_ms=2.0, param_bytes=0, activation_bytes=0
            )
            for s in range(len(stage_io))
        ),
        stages=tuple(stages),
        inputs=tuple(values[n] for n in inputs),
        outputs=tuple(
            OutputRef(index=i, stage=producer[n], spec=values[n]) for i, n in enumerate(outputs)
        ),
        cut_values=tuple(cuts),
        shared_params=tuple(SharedParam(name=n, stages=tuple(st)) for n, st in shared),
        predicted_step_ms=1.0,
    )
