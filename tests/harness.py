"""Training on forked gloo ranks against one process: the harness of every distributed
numerics test, and the suite's ``Config``.

``train_against_reference(model_factory, config, ranks, steps)`` runs on ``ranks`` forked
gloo ranks (``dist_utils.run_ranks``). Each rank builds the model (``torch.manual_seed(seed)``
first), deep-copies it as the one-process reference, makes an optimizer for each, compiles
the model with ``test_config(**LINK, **config)`` and trains both side by side on the same global
batches: the compiled model on this rank's slice of each batch, the reference on all of it.
Every call compares the loss; after the steps every parameter of this rank's stages is
compared with the reference's. Back in the test process, every rank must have seen the same
losses. It returns each rank's ``Trained`` (losses, clipped norms, GradScaler scales and what
``check`` returned).

The options select further comparisons (``outputs``, ``grads``, ``clip``, ``scaler``,
``buffers``, ``moved``). A test that drives the steps itself (autocast, ``no_sync()``, a
failing call, another way to call the model) passes ``loop``, a function of the rank's
``Run``, and uses its parts (``batch``, ``forward``, ``call``, ``compare``, ``backward``,
``step``).
Functions given to the harness run in the ranks, so they must be module-level (picklable):
``functools.partial`` of one is fine, a lambda is not.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.testing import assert_close
from torch.utils import _pytree as pytree

import rannc_fx
from rannc_fx.plan.config import Config
from tests import captures
from tests.dist_utils import assert_moved_alike, held_of, local_part, run_ranks, snapshot

TOL = dict(rtol=1e-5, atol=1e-5)

# A batch: (args, kwargs). ``data`` functions may also return a tuple of tensors (args only)
# or a dict (kwargs only).
Batch = tuple[tuple[Any, ...], dict[str, Any]]


def test_config(**overrides: Any) -> Config:
    """The suite's Config: the session's op-cost cache (``captures.profile_dir``: an op's
    cost is measured or counted once a session, not once a test), one timed run per
    profiled op, a 60 s process-group timeout; ``overrides`` on top."""
    settings: dict[str, Any] = dict(profile_cache_dir=captures.profile_dir(), profile_repeats=1,
                                    timeout_s=60.0)
    settings.update(overrides)
    return Config(**settings)


test_config.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test to collect

# The link between ranks, given to every compile of the harness: compile on several ranks
# measures it otherwise (a second or more a compile on loaded cores, and figures that move the
# stage boundaries from run to run). test_links_and_optimizer measures it.
LINK = dict(link_bandwidth=1e9, link_latency=1e-5, allreduce_bandwidth=1e9)


# -- the model zoo, seeded ------------------------------------------------------------------------

# name -> (module, factory); the transformers ones need transformers (``tests/hf_models.py``)
ZOO = {
    "mlp": ("examples.models", "mlp_example"),
    "cnn": ("examples.models", "cnn_example"),
    "gpt": ("examples.models", "gpt_example"),
    "bert": ("tests.hf_models", "bert_example"),
    "gpt2": ("tests.hf_models", "gpt2_example"),
    "resnet": ("tests.hf_models", "resnet_example"),
    "llama": ("tests.hf_models", "llama_example"),
    "tied-llama": ("tests.hf_models", "tied_llama_example"),
    "t5": ("tests.hf_models", "t5_example"),
}


def example(name: str, batch: int, **kw: Any) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    """The zoo's ``name`` with a batch of ``batch`` samples, after ``torch.manual_seed(0)``:
    the same model and batch in every process."""
    import importlib

    module, factory = ZOO[name]
    torch.manual_seed(0)
    return getattr(importlib.import_module(module), factory)(batch=batch, **kw)


# -- optimizers -----------------------------------------------------------------------------------


def _make_optimizer(cls: type[torch.optim.Optimizer], settings: dict[str, Any],
                    model: nn.Module) -> torch.optim.Optimizer:
    return cls(model.parameters(), **settings)


def optimizer(cls: type[torch.optim.Optimizer] = torch.optim.Adam,
              **settings: Any) -> Callable[[nn.Module], torch.optim.Optimizer]:
    """A picklable optimizer factory: ``cls(model.parameters(), **settings)``."""
    return functools.partial(_make_optimizer, cls, settings)


# eps=1e-4: attention key biases have exactly zero gradient in exact arithmetic (softmax ignores
# a constant per query), so their float gradients are summation-order noise (~1e-9) that Adam's
# default eps=1e-8 would blow up into steps of +-lr
ADAM = optimizer(torch.optim.Adam, lr=0.01, eps=1e-4)


# -- what a rank runs -----------------------------------------------------------------------------


def default_loss(out: Any) -> torch.Tensor:
    """The loss in a model's output: ``out["loss"]`` (a dict or transformers' ModelOutput), the
    first of a tuple or list, or the output itself."""
    if isinstance(out, dict):
        return out["loss"]
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


def as_batch(batch: Any) -> Batch:
    """(args, kwargs) of what a ``data`` function returned (see ``Batch``)."""
    if isinstance(batch, dict):
        return (), batch
    if (isinstance(batch, tuple) and len(batch) == 2 and isinstance(batch[0], tuple)
            and isinstance(batch[1], dict)):
        return batch
    return tuple(batch), {}


def batch_size(batch: Batch) -> int:
    """The global batch's samples: the first dimension of its first tensor of any dimension."""
    for t in pytree.tree_leaves(batch):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    raise ValueError("the batch holds no tensor with a batch dimension")


def rank_slice(batch: Batch, rank: int, world: int) -> Batch:
    """This rank's equal share of every tensor whose first dimension is the batch's."""
    n = batch_size(batch)
    assert n % world == 0, f"a batch of {n} samples does not divide among {world} ranks"
    return local_part(batch, rank, n, n // world)


@dataclass(frozen=True)
class Spec:
    """What ``train_against_reference`` sends to the ranks (see its parameters)."""

    model_factory: Callable[[], Any]
    config: dict[str, Any]
    steps: int
    data: Callable[[int], Any] | None
    split: Callable[[Batch, int, int], tuple[Batch, Batch]] | None
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    reference: Callable[[], nn.Module] | None
    loss: Callable[[Any], torch.Tensor]
    tol: dict[str, float]
    param_tol: dict[str, float]
    outputs: bool | Callable[[Any], Any]
    grads: bool
    clip: tuple[float, float] | None
    clip_kw: dict[str, Any]
    clip_tol: dict[str, float] | None
    clipped: bool
    scaler: float | None
    params: bool
    buffers: bool
    moved: bool
    example: bool
    compile_kw: dict[str, Any] | Callable[[nn.Module], dict[str, Any]]
    setup: Callable[[], Any] | None
    loop: Callable[[Run], Any] | None
    check: Callable[[Run], Any] | None
    seed: int


class Trained(NamedTuple):
    """One rank's run: every call's loss, every clipped norm, GradScaler's scale after each
    step, and what ``check`` returned (else ``loop``'s result)."""

    losses: list[float]
    norms: list[float]
    scales: list[float]
    extra: Any


@dataclass
class Run:
    """A rank's side of the run: the compiled model ``cm``, the one-process reference ``ref``,
    their optimizers (and GradScalers), and the steps' parts for a ``loop`` of a test's own."""

    spec: Spec
    rank: int
    world: int
    model: nn.Module
    ref: nn.Module
    opt: torch.optim.Optimizer
    ref_opt: torch.optim.Optimizer
    example_batch: Batch | None
    installed: Any  # what ``setup`` returned
    cm: Any = None
    scaler: Any = None
    ref_scaler: Any = None
    before: dict[str, torch.Tensor] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)

    # -- the parts of a step --
    def batch(self, step: int) -> Batch:
        """Step ``step``'s global batch (steps count from 1): ``data(step)``, or the model
        factory's example batch at every step."""
        if self.spec.data is not None:
            return as_batch(self.spec.data(step))
        assert self.example_batch is not None, "no data function and no example batch"
        return self.example_batch

    def split(self, batch: Batch) -> tuple[Batch, Batch]:
        """(this rank's inputs, the reference's) for a global batch."""
        if self.spec.split is not None:
            return self.spec.split(batch, self.rank, self.world)
        return rank_slice(batch, self.rank, self.world), batch

    def forward(self, batch: Batch) -> tuple[Any, Any]:
        """Both models on ``batch`` (the compiled one on this rank's part), not compared."""
        (args, kwargs), (rargs, rkwargs) = self.split(batch)
        return self.cm(*args, **kwargs), self.ref(*rargs, **rkwargs)

    def call(self, batch: Batch, **tol: float) -> tuple[Any, Any]:
        """Both models on ``batch`` (the compiled one on this rank's part), compared."""
        out, want = self.forward(batch)
        self.compare(out, want, whole=batch, **tol)
        return out, want

    def compare(self, out: Any, want: Any, *, whole: Batch | None = None,
                **tol: float) -> None:
        """The losses (``tol``, else the spec's) and, if asked, the outputs: this rank's rows
        of the reference's (``whole``: the global batch, for its size). Records the loss."""
        tol = tol or self.spec.tol
        loss, ref_loss = self.spec.loss(out), self.spec.loss(want)
        assert_close(loss, ref_loss, **tol)
        if self.spec.outputs:
            pick = (lambda o: o) if self.spec.outputs is True else self.spec.outputs
            got, exp = pytree.tree_leaves(pick(out)), pytree.tree_leaves(pick(want))
            assert len(got) == len(exp), (len(got), len(exp))
            n = batch_size(whole) if whole is not None else None
            for a, b in zip(got, exp, strict=True):
                if n is not None:
                    b = local_part(b, self.rank, n, n // self.world)
                assert_close(a, b.detach(), **tol)
        self.losses.append(loss.item())

    def backward(self, out: Any, want: Any) -> None:
        """Both losses' backward (scaled by the GradScalers, if any)."""
        for loss, scaler in ((self.spec.loss(out), self.scaler),
                             (self.spec.loss(want), self.ref_scaler)):
            (scaler.scale(loss) if scaler is not None else loss).backward()

    def step(self) -> None:
        """Gradients compared (``grads``), clipped (``clip``: both norms compared), then
        both optimizers step (through the GradScalers, if any) and zero the gradients."""
        pairs = ((self.scaler, self.opt), (self.ref_scaler, self.ref_opt))
        if self.scaler is not None:
            for s, o in pairs:
                s.unscale_(o)
        if self.spec.grads:
            assert_grads_like_reference(self.cm.stages, self.ref, **self.spec.tol)
        if self.spec.clip is not None:
            max_norm, norm_type = self.spec.clip
            ref_norm = nn.utils.clip_grad_norm_(self.ref.parameters(), max_norm, norm_type)
            if self.spec.clipped:
                assert max_norm / (ref_norm.item() + 1e-6) < 1  # the reference did clip
            norm = self.cm.clip_grad_norm_(max_norm, norm_type, **self.spec.clip_kw)
            assert_close(norm, ref_norm, **(self.spec.clip_tol or self.spec.tol))
            self.norms.append(norm.item())
        for s, o in pairs:
            if s is not None:
                s.step(o)
                s.update()
            else:
                o.step()
            o.zero_grad()
        if self.scaler is not None:
            assert self.scaler.get_scale() == self.ref_scaler.get_scale()
            self.scales.append(self.scaler.get_scale())

    def train_step(self, step: int) -> None:
        """One default step: call both on ``batch(step)``, backward, ``step()``."""
        out, want = self.call(self.batch(step))
        self.backward(out, want)
        self.step()

    # -- the checks at the end --
    def assert_params_like_reference(self) -> None:
        tol = self.spec.param_tol
        for stage in self.cm.stages:  # one, or a lane's several
            for name, p in stage.named_parameters():
                assert_close(p, held_of(p, self.ref.get_parameter(name)), **tol,
                             msg=lambda m, n=name: f"{n}: {m}")
            if self.spec.moved and any(p.requires_grad for p in stage.parameters()):
                assert_moved_alike(stage, self.ref, self.before, **tol)

    def assert_buffers_like_reference(self) -> None:
        for stage in self.cm.stages:
            for name, b in stage.named_buffers():
                assert_close(b, self.ref.get_buffer(name), **self.spec.param_tol,
                             msg=lambda m, n=name: f"{n}: {m}")


def assert_grads_like_reference(stages: Any, ref: nn.Module, **tol: float) -> None:
    """Every parameter's gradient on this rank equals the reference's (Adam would hide a
    gradient counted twice: it is scale-invariant)."""
    for stage in stages:
        for name, p in stage.named_parameters():
            assert_close(p.grad, held_of(p, ref.get_parameter(name).grad), **tol,
                         msg=lambda m, n=name: f"{n}.grad: {m}")


def _rank(rank: int, world: int, spec: Spec) -> Trained:
    installed = spec.setup() if spec.setup is not None else None
    torch.manual_seed(spec.seed)
    made = spec.model_factory()
    model, example_batch = (made[0], (made[1], made[2])) if isinstance(made, tuple) else (made, None)
    ref = spec.reference() if spec.reference is not None else copy.deepcopy(model)
    run = Run(spec=spec, rank=rank, world=world, model=model, ref=ref,
              opt=spec.optimizer(model), ref_opt=spec.optimizer(ref),
              example_batch=example_batch, installed=installed)
    kw = dict(spec.compile_kw(model) if callable(spec.compile_kw) else spec.compile_kw)
    if spec.example:
        first = example_batch if example_batch is not None else run.batch(0)
        (args, kwargs), _ = run.split(first)
        kw.update(example_args=args, example_kwargs=kwargs)
    run.cm = rannc_fx.compile(model, run.opt, test_config(**spec.config), **kw)
    if spec.scaler is not None:
        run.scaler = rannc_fx.GradScaler("cpu", init_scale=spec.scaler)
        run.ref_scaler = torch.amp.GradScaler("cpu", init_scale=spec.scaler)
    run.before = snapshot(ref)
    if spec.loop is not None:
        result = spec.loop(run)
    else:
        result = None
        for step in range(1, spec.steps + 1):
            run.train_step(step)
    if spec.params:
        run.assert_params_like_reference()
    if spec.buffers:
        run.assert_buffers_like_reference()
    if spec.check is not None:
        result = spec.check(run)
    return Trained(run.losses, run.norms, run.scales, result)


def train_against_reference(
    model_factory: Callable[[], Any],
    config: dict[str, Any] | None,
    ranks: int,
    steps: int = 3,
    *,
    data: Callable[[int], Any] | None = None,
    split: Callable[[Batch, int, int], tuple[Batch, Batch]] | None = None,
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] = ADAM,
    reference: Callable[[], nn.Module] | None = None,
    loss: Callable[[Any], torch.Tensor] = default_loss,
    tol: dict[str, float] | None = None,
    param_tol: dict[str, float] | None = None,
    outputs: bool | Callable[[Any], Any] = False,
    grads: bool = False,
    clip: float | tuple[float, float] | None = None,
    clip_kw: dict[str, Any] | None = None,
    clip_tol: dict[str, float] | None = None,
    clipped: bool = False,
    scaler: float | None = None,
    params: bool = True,
    buffers: bool = False,
    moved: bool = False,
    example: bool = True,
    compile_kw: dict[str, Any] | Callable[[nn.Module], dict[str, Any]] | None = None,
    setup: Callable[[], Any] | None = None,
    loop: Callable[[Run], Any] | None = None,
    check: Callable[[Run], Any] | None = None,
    seed: int = 0,
    same_losses: bool = True,
    timeout_s: float = 60.0,
    wall_s: float = 120.0,
    patches: Sequence[tuple[str, str, Any]] = (),
) -> list[Trained]:
    """Train ``model_factory()``'s model compiled on ``ranks`` gloo ranks against itself in one
    process; each rank's ``Trained``.

    ``model_factory()`` returns the model, or (model, args, kwargs): the model and a global
    batch, which is then the example ``compile`` plans with and, without ``data``, every
    step's batch. ``config``: ``test_config``'s overrides (replicas, schedule, ...).
    ``steps``: optimizer steps of the default loop.

    ``data(step)``: step ``step``'s global batch (steps count from 1; ``data(0)`` is the example
    when the factory gives none). ``split(batch, rank, world)``: (this rank's inputs, the
    reference's); default, this rank's equal share of the batch's samples and the batch.
    ``optimizer(model)``: one for each model (default Adam, lr 0.01, eps 1e-4).
    ``reference()``: the reference model, where it is not the model's deep copy (a meta-device
    model, ranks that build different models). ``loss(out)``: the loss in an output.

    Comparisons: ``tol``, the losses' and outputs' (default rtol = atol = 1e-5); ``param_tol``,
    the parameters' and buffers' (default ``tol``); ``outputs``, every output (True) or those
    a function picks, against this rank's rows of the reference's; ``grads``, every gradient
    before each step; ``clip``, max_norm or (max_norm, norm_type): both models clipped
    (``clip_kw`` to ``CompiledModel.clip_grad_norm_``), the norms compared within ``clip_tol``
    and with ``clipped`` asserted to have clipped the reference; ``scaler``: an initial scale,
    both models step through GradScalers whose scales must agree; ``params``, every parameter
    of the rank's stages at the end; ``buffers``, every buffer too; ``moved``, also that the
    reference's parameters moved by more than the tolerance (``assert_moved_alike``).

    ``config``'s timeout defaults to ``timeout_s``, the ranks' group's, and its link to
    ``LINK`` (no probe).
    ``example``: compile with this rank's part of the example batch (else the first call
    plans). ``compile_kw``: more of ``rannc_fx.compile``'s arguments (``plan``, ``init``,
    ``loss_fn``), or a function of the model that returns them (an ``init`` bound to it). ``setup()`` runs first in each rank (a spy), its result ``Run.installed``.
    ``loop(run)`` drives the steps instead of the default loop; ``check(run)`` runs after the
    last comparison, and its result (else ``loop``'s) is ``Trained.extra``. ``seed`` seeds
    torch before ``model_factory``. ``same_losses``: every rank's losses are equal.
    ``timeout_s``, ``wall_s`` and ``patches`` go to ``run_ranks``.
    """
    tol = dict(tol or TOL)
    spec = Spec(
        model_factory=model_factory, config={"timeout_s": timeout_s, **LINK, **(config or {})},
        steps=steps, data=data,
        split=split, optimizer=optimizer, reference=reference, loss=loss, tol=tol,
        param_tol=dict(param_tol or tol), outputs=outputs, grads=grads,
        clip=(clip, 2.0) if isinstance(clip, (int, float)) else clip,
        clip_kw=dict(clip_kw or {}), clip_tol=clip_tol, clipped=clipped, scaler=scaler,
        params=params, buffers=buffers, moved=moved, example=example,
        compile_kw=compile_kw if callable(compile_kw) else dict(compile_kw or {}),
        setup=setup, loop=loop, check=check, seed=seed,
    )
    got = run_ranks(_rank, ranks, spec, timeout_s=timeout_s, wall_s=wall_s, patches=patches)
    if same_losses:
        assert all(t.losses == got[0].losses for t in got), [t.losses for t in got]
    return got
