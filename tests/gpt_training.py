"""Training the built-in GPT on 2 ranks under a given plan (against one process, on the
harness; or two runs bit for bit alike), and the bytes a run keeps alive: the helpers the
recomputation and host-parameter tests share (``test_recompute_layers``,
``test_recompute_selective``, ``test_host_params``)."""

from __future__ import annotations

import functools
import io
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import rannc_fx
from examples.models import gpt_example
from rannc_fx.plan.config import Config
from rannc_fx.plan.plan import Plan
from tests.harness import Run, train_against_reference

TOL = dict(rtol=1e-5, atol=1e-5)
GLOBAL = 6  # samples a step, over 2 ranks
STEPS = 3


def gpt(dropout: float) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    """The 4-layer GPT, seeded: the same weights in every process."""
    torch.manual_seed(0)
    return gpt_example(batch=GLOBAL, layers=4, dropout=dropout)


def local(rank: int, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """Rank ``rank``'s half of the global batch."""
    n = GLOBAL // 2
    cut = lambda t: t[rank * n : (rank + 1) * n]  # noqa: E731
    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.01, eps=1e-4)  # as test_checkpoint's


def step(model: Any, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> float:
    out = model(*args, **kwargs)
    loss = out["loss"] if isinstance(out, dict) else out
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.item())


def to_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """Tensors as bytes: through the result queue as shared memory they can vanish with the
    worker before the parent reads them."""
    buf = io.BytesIO()
    torch.save(tensors, buf)
    return buf.getvalue()


def from_bytes(data: bytes) -> dict[str, torch.Tensor]:
    return torch.load(io.BytesIO(data))


def train_gpt(rank: int, world: int, plan: Plan, dropout: float, seed: int,
              counter: Callable[[], list[int]]) -> tuple[list[float], bytes, int]:
    """A worker: ``STEPS`` Adam steps of the GPT under ``plan``; the losses, this rank's
    parameters, and how often ``counter`` (installed first, in the worker) counted."""
    calls = counter()
    model, args, kwargs = gpt(dropout)
    opt = adam(model)
    largs, lkwargs = local(rank, args, kwargs)
    cm = rannc_fx.compile(model, opt, Config(timeout_s=30.0), plan=plan, example_args=largs,
                          example_kwargs=lkwargs)
    torch.manual_seed(seed + rank)  # each rank's dropout stream, the same in every run
    losses = [step(cm, opt, largs, lkwargs) for _ in range(STEPS)]
    params = {n: p.detach() for gm in cm.stages for n, p in gm.named_parameters()}
    return losses, to_bytes(params), len(calls)


def _counted_and_moved(run: Run) -> int:
    """The parameters moved enough for the comparison to fail; how often the counter counted."""
    moved = max(float((run.ref.get_parameter(n).detach() - p0).abs().max())
                for n, p0 in run.before.items())
    assert moved > 100 * TOL["atol"]
    return len(run.installed)


def train_like_one_process(plan: Plan, counter: Callable[[], list[int]]) -> list[int]:
    """``STEPS`` Adam steps of the GPT under ``plan`` on 2 ranks against one process (the
    harness: every loss and every parameter); how often ``counter`` (installed first, in each
    rank) counted there."""
    got = train_against_reference(functools.partial(gpt, 0.0), dict(timeout_s=30.0), 2,
                                  STEPS, optimizer=adam, compile_kw=dict(plan=plan),
                                  setup=counter, check=_counted_and_moved, timeout_s=30.0)
    return [t.extra for t in got]


Trained = tuple[list[float], bytes, int]  # what ``train_gpt`` returns, per rank


def assert_bitwise_alike(got: list[Trained], plain: list[Trained]) -> None:
    """``got`` counted calls and ``plain`` none, and they trained bit for bit alike."""
    assert all(calls > 0 for _, _, calls in got) and all(calls == 0 for _, _, calls in plain)
    for (losses, params, _), (want_losses, want, _) in zip(got, plain, strict=True):
        assert losses == want_losses
        want_params = from_bytes(want)
        for name, p in from_bytes(params).items():
            assert torch.equal(p, want_params[name]), name


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages that ops make and that are still alive, and their peak
    (views of the ``known`` storages, a weight's transpose, are not new)."""

    def __init__(self, known: set[int] | None = None) -> None:
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
        self.known = known or set()
        self.peak = 0

    @property
    def now(self) -> int:
        self.refs = {k: v for k, v in self.refs.items() if not v[0].expired()}
        return sum(n for _, n in self.refs.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                if s._cdata not in self.known:
                    self.refs.setdefault(s._cdata, (StorageWeakRef(s), s.nbytes()))
        self.peak = max(self.peak, self.now)
        return out
