"""``compile(model, optimizer)``: plan on the first call, then run this rank's stage each step.

    model = rannc_fx.compile(model, optimizer)      # every rank, same script (torchrun)
    loss = model(x, y)                              # this rank's local batch
    loss.backward(); optimizer.step(); optimizer.zero_grad()

    with model.no_sync():                           # gradient accumulation: k - 1 calls
        model(x1, y1).backward()                    # without the sums over ranks,
    model(x2, y2).backward()                        # the k-th sums them all once

Each rank runs its stage on its own device (``cuda:LOCAL_RANK`` when CUDA is available, else
the CPU; ``Config.device`` overrides). The model may be built on the CPU or on the meta
device; each rank moves or materializes only its stage's tensors (``startup/placement.py``),
which start from rank 0's values whatever each rank built (``startup/sync.py``).
``compile(..., example_args=...)`` plans at once (so a checkpoint can be loaded before the
first step); otherwise the first call plans.

The first call's work (plan, split, place, executors) is ``startup/``'s; later calls go to
the executor for their batch size and autocast state (``runtime/batches.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from .capture.capture import CapturedGraph
from .capture.input_casts import cast_inputs, input_casts
from .capture.loss import with_loss
from .plan.config import Config
from .plan.plan import Plan
from .runtime import AloneExecutor, BatchSizes, StageExecutor, clip_grad_norm, plan_grid
from .runtime.accumulation import Accumulation
from .runtime.comm import agree, init_distributed
from .runtime.lane import LaneModules, graph_modules
from .runtime.trace import Recorder
from .startup import set_up_rank
from .startup.modes import Modes
from .startup.placement import InitFn, Placement, rank_device
from .state import StateNames, load_local

__all__ = ["CompiledModel", "compile"]

log = logging.getLogger("rannc_fx")


def compile(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    config: Config | None = None,
    plan: Plan | str | Path | None = None,
    *,
    example_args: tuple[Any, ...] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    init: InitFn | None = None,
    loss_fn: Callable[..., Any] | None = None,
) -> CompiledModel:
    """Wrap ``model`` for pipeline-parallel training on the default process group.

    Starts the process group from torchrun's environment if the script has not (a
    one-process group without torchrun). ``plan`` (a Plan or a saved plan file) skips
    profiling and search; it must have been made for this model and world size.

    ``example_args`` / ``example_kwargs`` (one rank's batch, as ``forward`` will get it) plan
    and place the stage now instead of on the first call. ``init(module)`` initializes a
    module's own tensors when they are materialized from the meta device (default: the
    module's ``reset_parameters()``).

    ``loss_fn(output, *targets)`` (torch.distributed.pipelining's convention): calls then pass
    the targets as ``target=`` (a tensor or a tuple), ``loss = model(x, target=y)``; the loss
    runs eagerly on the last stage, so it may hold code no tracer captures
    (``capture/loss.py``).
    """
    return CompiledModel(
        model, optimizer, config=config, plan=plan, example_args=example_args,
        example_kwargs=example_kwargs, init=init, loss_fn=loss_fn,
    )  # fmt: skip


class CompiledModel(nn.Module):
    """The model as this rank runs it: ``plan``, ``stages`` and ``print(model)`` show where."""

    _root: nn.Module  # the model object compiled (set without registering it as a child)

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        config: Config | None = None,
        plan: Plan | str | Path | None = None,
        example_args: tuple[Any, ...] | None = None,
        example_kwargs: dict[str, Any] | None = None,
        init: InitFn | None = None,
        loss_fn: Callable[..., Any] | None = None,
    ):
        super().__init__()
        self.training = model.training  # the mode calls run in: train() and eval() switch it
        # the user's model object itself, whose flag counts too (``net.eval()`` on the model
        # compiled, as with DDP); not a submodule: its other stages' tensors are freed
        object.__setattr__(self, "_root", model)
        self.config = Config.from_env(config)
        self.device = rank_device(self.config.device)
        init_distributed(self.config, device=self.device)
        # until the first call (with the loss, where loss_fn is given); then only `stage` is kept
        self.model: nn.Module | None = model if loss_fn is None else with_loss(model, loss_fn)
        self.stage: fx.GraphModule | LaneModules | None = None
        self._optimizer = optimizer
        self._given = plan
        self._captured: CapturedGraph | None = None
        self._batches: BatchSizes | None = None  # one executor per batch size seen
        self._last: StageExecutor | AloneExecutor | None = None  # the last call's
        self._init = init
        self._names: StateNames | None = None  # this rank's part under the original names
        self.placement: Placement | None = None
        self._checked = False  # whether the first step checked every rank's tensors
        self._trace: Recorder | None = None  # Config.trace_dir: the traced steps' events
        self._modes: Modes | None = None  # the graph of each mode, from the first call
        self._sync = True  # False inside no_sync()
        # inputs the model casts first (x.float()): converted on arrival (capture/input_casts.py)
        self._casts: dict[int, torch.dtype] = {}
        self._planned_dtypes: list[str | None] = []
        self._accumulation = Accumulation()  # every executor's: calls left unsummed
        if optimizer is not None:  # before ZeRO's step hooks (at planning): refused first
            self._accumulation.guard(optimizer)
        if example_args is not None or example_kwargs is not None:
            self._setup(tuple(example_args or ()), dict(example_kwargs or {}))

    @property
    def _executor(self) -> StageExecutor | AloneExecutor | None:
        """The executor of the plan's batch size (a new one after a failed call)."""
        return None if self._batches is None else self._batches.default

    # -- what runs where ----------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        return self._ready().plan

    @property
    def stages(self) -> list[fx.GraphModule]:
        """This rank's stage GraphModules: one, or each of its lane's (interleaved, ZBV)."""
        self._ready()
        assert self.stage is not None
        return graph_modules(self.stage)

    def __repr__(self) -> str:
        if self._executor is None:
            return (
                f"CompiledModel(not planned yet: the first call plans {type(self.model).__name__})"
            )
        ex = self._executor
        held = getattr(ex, "stages", (ex.stage,))
        where = (
            f"rank {ex.rank} runs stage{'s' if len(held) > 1 else ''} "
            f"{', '.join(str(st.index) for st in held)} "
            f"(replica {ex.replica + 1} of {ex.stage.replicas}, ranks {list(ex.stage.ranks)})"
        )
        plan = ex.plan
        if plan.world_size * plan.micro_batches <= 256:
            grid = plan_grid(plan)
        else:
            grid = "(rannc_fx.runtime.plan_grid(model.plan) prints one step's actions per rank)"
        return f"CompiledModel(\n{plan.summary()}\n{where}\none step:\n{grid}\n)"

    # -- a step ---------------------------------------------------------------------------------
    def train(self, mode: bool = True) -> CompiledModel:
        """Run later calls in training (``True``) or eval mode: dropout, batch norm and every
        branch of the forward on ``self.training`` as ``model.train(mode)`` would set them.

        Each mode runs a graph captured in that mode (``startup/modes.py``: the first call's
        mode is the planned graph, the other is captured at its first call), so this sets no
        flag on the stages' modules: the graphs keep the modes they were captured in. A call
        runs in eval mode where this model or the model object it compiled is in eval mode
        (``net.eval()`` on the original works as with DDP)."""
        if not isinstance(mode, bool):
            raise ValueError(f"training mode is expected to be a bool, got {mode!r}")
        self.training = mode
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._executor is None:
            self._setup(args, kwargs)
        assert self._captured is not None and self._executor is not None
        if self.placement is not None and not self._checked:
            self._check_initialized()
        if self._trace is not None:
            self._trace.begin_call(torch.is_grad_enabled())
        assert self._batches is not None
        try:
            flat = cast_inputs(self._captured.flatten_inputs(args, kwargs),
                               self._planned_dtypes, self._casts)
            training = self.training and self._root.training
            self._last = None  # a call after a failure drops the failed executors (batches.py)
            executor = self._last = self._batches.for_inputs(flat, training, sync=self._sync)
            assert self._modes is not None
            return self._modes.of(training).captured.unflatten_outputs(
                executor.forward(flat, sync=self._sync))
        except Exception as e:  # tell the other ranks (runtime/failures.py), unless they know
            self._batches.failed(e, "in its call")
            raise

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """As ``DistributedDataParallel.no_sync()``: calls made inside add their gradients
        to ``.grad`` on each rank alone, without summing them over ranks (the replicas'
        all-reduce, a tied weight's over its holders, ZeRO-2's reduce-scatter); the first
        call outside sums what they left together with its own, once, so k calls then
        ``optimizer.step()`` equal one process's step over the k batches::

            with model.no_sync():
                for x, y in batches[:-1]:
                    model(x, y).backward()      # local sums only
            model(*batches[-1]).backward()      # one sum over ranks for all of them
            optimizer.step()

        A call's choice is made at the call, as DDP's at its forward. Every rank enters it
        for the same calls (checked with the batch sizes, ``Config.check_batches``).
        ``optimizer.step()`` and ``clip_grad_norm_`` are refused while ``.grad`` holds
        sums no call has summed; inside, ``.grad`` holds this rank's part (a gradient summed
        before the first call inside is kept on one rank of its group). Under a schedule that
        runs the backwards in the call (1F1B), the closing call's sum runs in its
        ``loss.backward()``."""
        before = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = before

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` for the whole model, on every rank after
        ``loss.backward()``: returns the norm of the whole model's gradient (the same on every
        rank) and scales every rank's gradients by the same factor. Torch's own function over
        ``model.parameters()`` would see only this rank's stage (``runtime/clip.py``)."""
        if self._executor is None:
            raise RuntimeError(
                "clip_grad_norm_ before the first call: there are no gradients yet (and the "
                "model is planned on its first call); call it after loss.backward()"
            )
        self._accumulation.check_summed("clip_grad_norm_")
        rec = self._trace
        with nullcontext() if rec is None else rec.span(
            "clip_grad_norm_", "collective", kind="clip", peers=rec.others, match="clip",
        ):  # fmt: skip
            return clip_grad_norm(
                self._last or self._executor, max_norm, norm_type,
                error_if_nonfinite=error_if_nonfinite, foreach=foreach,
            )  # fmt: skip

    def _check_initialized(self) -> None:
        """Once, before the first step: every rank's tensors were initialized or loaded."""
        assert self.placement is not None
        try:
            self.placement.check_initialized()
        except RuntimeError as e:
            agree([str(e)], "cannot train", error=RuntimeError)
            raise
        agree([], "cannot train", error=RuntimeError)
        self._checked = True

    def _ready(self) -> StageExecutor | AloneExecutor:
        if self._executor is None:
            raise RuntimeError("the model is planned on its first call; call it once first")
        return self._executor

    # -- the first call --------------------------------------------------------------------------
    def _setup(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        assert self.model is not None
        ready = set_up_rank(
            self.model, self._optimizer, args, kwargs, config=self.config, device=self.device,
            given=self._given, init=self._init, accumulation=self._accumulation,
        )  # fmt: skip
        self._captured, self.stage = ready.captured, ready.stage
        self.placement, self._names, self._batches = ready.placement, ready.names, ready.batches
        self._modes = ready.modes
        self._casts = input_casts(ready.captured.gm)
        self._planned_dtypes = [s.dtype if s.kind == "tensor" else None
                                for s in ready.batches.default.plan.inputs]
        self.model = None  # drops the full model; `stage` holds the parameters that remain
        if self.config.trace_dir is not None:
            self._trace = _recorder(self.config, ready.batches.default, self._optimizer)
            if self._trace is not None:
                ready.batches.set_trace(self._trace)

    # -- state dicts under the original names -------------------------------------------------
    def state_names(self) -> StateNames:
        """The original model's state-dict names and this rank's tensors under them."""
        if self._names is not None:
            return self._names
        assert self.model is not None
        return StateNames.of(self.model)  # not planned yet: every rank holds the whole model

    def state_dict(  # type: ignore[override]
        self, *, destination: dict[str, Any] | None = None, prefix: str = "",
        keep_vars: bool = False,
    ) -> dict[str, Any]:
        """This rank's part under the original model's names (``rannc_fx.get_state_dict``
        adds the optimizer, and ``full=True`` the whole model on rank 0)."""
        out = destination if destination is not None else {}
        for k, t in self.state_names().local.items():
            out[prefix + k] = t if keep_vars else t.detach()
        return out

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load this rank's part of ``state_dict`` (keys of other stages are skipped)."""
        if assign:
            raise ValueError("assign=True is not supported: the stage's tensors stay in place")
        return load_local(self, state_dict, strict=strict)


def _recorder(
    config: Config, executor: StageExecutor | AloneExecutor,
    optimizer: torch.optim.Optimizer | None,
) -> Recorder | None:  # fmt: skip
    """The recorder of the steps ``config.trace_steps`` names (``runtime/trace.py``)."""
    assert config.trace_dir is not None
    if not isinstance(executor, StageExecutor):
        log.warning("trace_dir is set but the plan runs on one rank, one micro-batch: there is "
                    "no schedule to trace (torch.profiler shows the model's own step)")
        return None
    rec = Recorder(
        config.traced_steps, config.trace_dir, rank=executor.rank,
        world=executor.plan.world_size, stage=executor.stage.index, replica=executor.replica,
        device=executor.device,
    )  # fmt: skip
    if optimizer is not None:
        rec.watch(optimizer)
    return rec
