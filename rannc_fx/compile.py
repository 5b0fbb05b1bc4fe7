"""``compile(model, optimizer)``: plan on the first call, then run this rank's stage each step.

    model = rannc_fx.compile(model, optimizer)      # every rank, same script (torchrun)
    loss = model(x, y)                              # this rank's local batch
    loss.backward(); optimizer.step(); optimizer.zero_grad()

Each rank runs its stage on its own device (``cuda:LOCAL_RANK`` when CUDA is available, else
the CPU; ``Config.device`` overrides). The model may be built on the CPU or on the meta
device; each rank moves or materializes only its stage's tensors (``placement.py``).
``compile(..., example_args=...)`` plans at once (so a checkpoint can be loaded before the
first step); otherwise the first call plans.

Planning measures the link between ranks (unless ``Config.link_bandwidth`` and
``link_latency`` are given) and, on every rank at once, the optimizer step and gradient
accumulation per tensor size, then captures the model on every rank; rank 0 alone profiles
(timing the user's optimizer too) and searches (the others wait) and broadcasts the plan as
JSON. A meta-device model, or one whose tensors are not on the rank's device, is planned
with the analytic cost model for the rank's device. Each rank then splits the graph, places
its own stage, frees every other parameter and buffer of the model, and prunes the optimizer
to the parameters it still holds. Later calls go straight to the ``StageExecutor``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from .amp import AmpSpecs, amp_state, autocast_as
from .checkpoint import StateNames, load_local
from .config import Config
from .device import DeviceSpec
from .driver import Planned, plan_model, split_stages
from .passes.capture import CapturedGraph, batch_size_of, capture_pass, retarget_device_pass
from .passes.optcost import ParameterCosts, parameter_costs
from .passes.shapes import infer_values_pass
from .placement import InitFn, Placement, free_others, place_stage, rank_device
from .plan import Plan
from .probe import measure_link
from .runtime import AloneExecutor, BatchSizes, StageExecutor, clip_grad_norm, plan_grid
from .runtime.comm import CommError, agree, init_distributed

__all__ = ["CompiledModel", "compile"]


def compile(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    config: Config | None = None,
    plan: Plan | str | Path | None = None,
    *,
    example_args: tuple[Any, ...] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    init: InitFn | None = None,
) -> CompiledModel:
    """Wrap ``model`` for pipeline-parallel training on the default process group.

    Starts the process group from torchrun's environment if the script has not (a
    one-process group without torchrun). ``plan`` (a Plan or a saved plan file) skips
    profiling and search; it must have been made for this model and world size.

    ``example_args`` / ``example_kwargs`` (one rank's batch, as ``forward`` will get it) plan
    and place the stage now instead of on the first call. ``init(module)`` initializes a
    module's own tensors when they are materialized from the meta device (default: the
    module's ``reset_parameters()``).
    """
    return CompiledModel(
        model, optimizer, config=config, plan=plan, example_args=example_args,
        example_kwargs=example_kwargs, init=init,
    )  # fmt: skip


class CompiledModel(nn.Module):
    """The model as this rank runs it: ``plan``, ``stages`` and ``print(model)`` show where."""

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
    ):
        super().__init__()
        self.config = Config.from_env(config)
        self.device = rank_device(self.config.device)
        init_distributed(self.config, device=self.device)
        self.model: nn.Module | None = model  # until the first call; then only `stage` is kept
        self.stage: fx.GraphModule | None = None
        self._optimizer = optimizer
        self._given = plan
        self._captured: CapturedGraph | None = None
        self._executor: StageExecutor | AloneExecutor | None = None  # the plan's batch size
        self._batches: BatchSizes | None = None  # one executor per batch size seen
        self._last: StageExecutor | AloneExecutor | None = None  # the last call's
        self._param_costs: ParameterCosts | None = None  # measured by every rank at once
        self._init = init
        self._names: StateNames | None = None  # this rank's part under the original names
        self.placement: Placement | None = None
        self._checked = False  # whether the first step checked every rank's tensors
        if example_args is not None or example_kwargs is not None:
            self._setup(tuple(example_args or ()), dict(example_kwargs or {}))

    # -- what runs where ----------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        return self._ready().plan

    @property
    def stages(self) -> list[fx.GraphModule]:
        """This rank's stage GraphModules (one: each rank runs one stage)."""
        self._ready()
        assert self.stage is not None
        return [self.stage]

    def __repr__(self) -> str:
        if self._executor is None:
            return (
                f"CompiledModel(not planned yet: the first call plans {type(self.model).__name__})"
            )
        ex = self._executor
        where = (
            f"rank {ex.rank} runs stage {ex.stage.index} "
            f"(replica {ex.replica + 1} of {ex.stage.replicas}, ranks {list(ex.stage.ranks)})"
        )
        plan = ex.plan
        if plan.world_size * plan.micro_batches <= 256:
            grid = plan_grid(plan)
        else:
            grid = "(rannc_fx.runtime.plan_grid(model.plan) prints one step's actions per rank)"
        return f"CompiledModel(\n{plan.summary()}\n{where}\none step:\n{grid}\n)"

    # -- a step ---------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._executor is None:
            self._setup(args, kwargs)
        assert self._captured is not None and self._executor is not None
        if self.placement is not None and not self._checked:
            self._check_initialized()
        flat = self._captured.flatten_inputs(args, kwargs)
        assert self._batches is not None
        executor = self._last = self._batches.for_inputs(flat)
        return self._captured.unflatten_outputs(executor.forward(flat))

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
        return clip_grad_norm(
            self._last or self._executor, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite,
            foreach=foreach,
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
        model, cfg = self.model, self.config
        assert model is not None
        rank, world = dist.get_rank(), dist.get_world_size()
        planned = self._given is None and rank == 0
        home = _device_of(model)  # where the model's tensors are: the graph is captured there
        analytic = _analytic(home, self.device, cfg)
        if home.type == "meta":
            args, kwargs = torch.utils._pytree.tree_map_only(
                torch.Tensor, lambda t: t.to("meta"), (args, kwargs)
            )
        links = (cfg.link_bandwidth, cfg.link_latency, cfg.allreduce_bandwidth)
        if self._given is None and world > 1 and None in links:
            link = measure_link(self.device)  # every rank takes part
            if link is not None:
                measured = {
                    "link_bandwidth": link.bandwidth,
                    "link_latency": link.latency,
                    "allreduce_bandwidth": link.allreduce_bandwidth,
                }
                unset = {k: v for k, v in measured.items() if getattr(cfg, k) is None}
                cfg = self.config = cfg.model_copy(update=unset)  # what the user gave stays
        if self._given is None and world > 1 and not analytic:
            # every rank at once: ranks that share a host's memory bandwidth step side by side
            dist.barrier()
            self._param_costs = parameter_costs(
                self._optimizer, self.device, DeviceSpec.of(self.device),
                cfg.optimizer_state_factor,
            )  # fmt: skip
        amp_type = home.type if home.type != "meta" else self.device.type
        planned_amp = cfg.autocast_dtype or amp_state(amp_type)
        with _untouched(model), autocast_as(amp_type, planned_amp):
            if planned:
                try:
                    here = self._plan_here(args, kwargs, world, analytic)
                    plan, captured, values = here.plan, here.captured, here.values
                except Exception as e:
                    _broadcast_plan(e, rank, world)  # the others must hear of it, not time out
                    raise
            else:
                captured = capture_pass(
                    model, args, kwargs, tracer=cfg.tracer, leaf_modules=cfg.leaf_modules,
                    batch_dim=cfg.batch_dim,
                )  # fmt: skip
                values = infer_values_pass(
                    captured, captured.flatten_inputs(args, kwargs), batch_dim=cfg.batch_dim
                )
        if self._given is None:
            plan = _broadcast_plan(plan if planned else None, rank, world)
        else:
            plan = self._load_given(captured, world)
        stages = split_stages(Planned(plan, captured, values, 0.0), cfg)
        stage = stages[plan.stage_of_rank(rank).index]
        amp = None
        if home.type != "meta":  # the other autocast states' dtypes, while the model is whole
            with _untouched(model):
                amp = AmpSpecs.of(
                    captured, captured.flatten_inputs(args, kwargs), plan, device_type=amp_type,
                    planned=planned_amp, batch_dim=cfg.batch_dim,
                )  # fmt: skip
        if home != self.device:
            retarget_device_pass(stage, self.device)  # export baked the capture device in
        seed = _shared_seed(world) if home.type == "meta" else 0
        try:
            self.placement = place_stage(
                model, stage, self.device, holders=(captured.gm,), optimizer=self._optimizer,
                init=self._init, seed=seed,
            )  # fmt: skip
        except RuntimeError as e:
            agree([str(e)], "cannot place the stages", error=RuntimeError)
            raise
        agree([], "cannot place the stages", error=RuntimeError)
        held = {id(t) for t in (*stage.parameters(), *stage.buffers())}
        self._names = StateNames.of(model, held)  # before the rest is freed: whole-model shapes
        free_others(model, stage, self.placement)
        if self._optimizer is not None:
            _prune_optimizer(self._optimizer, stage)
        self._captured, self.stage = captured, stage
        self.model = None  # drops the full model; `stage` holds the parameters that remain
        device_type = self.device.type
        self._batches = BatchSizes(
            plan, stage, device=self.device, timeout_s=cfg.timeout_s, planned=planned_amp,
            state=lambda: amp_state(device_type),
            retype=amp.retype if amp is not None else _planned_only(planned_amp),
        )  # fmt: skip
        self._executor = self._batches.default

    def _plan_here(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], world: int, analytic: bool
    ) -> Planned:
        """Rank 0: capture, profile and search for the global batch of all ranks."""
        assert self.model is not None
        cfg = self.config
        local = batch_size_of(list(_leaves(args, kwargs)), cfg.batch_dim)
        return plan_model(
            self.model, args, kwargs, world_size=world, config=cfg, global_batch=local * world,
            optimizer=self._optimizer, param_costs=self._param_costs,
            device=DeviceSpec.of(self.device) if analytic else None,
        )  # fmt: skip

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

    def _load_given(self, captured: CapturedGraph, world: int) -> Plan:
        given = self._given
        plan = given if isinstance(given, Plan) else Plan.load(given)  # type: ignore[arg-type]
        if plan.world_size != world:
            raise ValueError(
                f"the plan is for {plan.world_size} ranks but {world} are running; launch with "
                f"--nproc-per-node {plan.world_size} or make a plan for {world}"
            )
        fp = captured.fingerprint()
        if plan.model_fingerprint != fp:
            raise ValueError(
                f"the plan was made for another model (fingerprint "
                f"{plan.model_fingerprint[:12]}..., this model's is {fp[:12]}...): its graph, "
                "parameter names, shapes or dtypes differ; make the plan again for this model"
            )
        return plan


def _broadcast_plan(plan: Plan | Exception | None, rank: int, world: int) -> Plan:
    """Rank 0's plan (or its error) to every rank, as JSON."""
    if world == 1:
        if isinstance(plan, Exception):
            raise plan
        assert plan is not None
        return plan
    payload: list[str | None] = [None, None]
    if rank == 0:
        if isinstance(plan, Plan):
            payload = ["plan", plan.to_json()]
        else:
            payload = ["error", f"{type(plan).__name__}: {plan}"]
    try:
        dist.broadcast_object_list(payload, src=0)
    except RuntimeError as e:
        why = (
            "another rank died (see its log)"
            if rank == 0
            else "planning on rank 0 took longer than Config.timeout_s, or rank 0 died (see its log)"
        )
        raise CommError(f"rank {rank}: broadcasting the plan from rank 0 failed: {e}; {why}") from e
    kind, text = payload
    if kind == "error":
        if isinstance(plan, Exception):
            raise plan
        raise RuntimeError(f"rank 0 could not plan the model: {text}")
    return Plan.from_json(str(text))


def _leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[Any]:
    yield from torch.utils._pytree.tree_leaves((args, kwargs))


@contextlib.contextmanager
def _untouched(model: nn.Module) -> Iterator[None]:
    """Planning runs the model (profiling): give back the buffers, gradients and random state
    it found, so training starts from exactly the user's initial state on every rank."""
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    grads = {id(p): p.grad for p in model.parameters()}
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in buffers:
                    b.copy_(buffers[n])
        for p in model.parameters():
            p.grad = grads.get(id(p))
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _analytic(home: torch.device, device: torch.device, cfg: Config) -> bool:
    """Whether the plan is made with the analytic cost model for ``device``'s spec: a meta
    model has nothing to measure, and a model elsewhere than the rank's device would be
    measured on the wrong hardware."""
    if cfg.cost_model != "measured":
        return cfg.cost_model == "analytic" or home != device
    if home != device:
        where = "on the meta device" if home.type == "meta" else f"on {home}"
        raise ValueError(
            f"cost_model='measured' times the model's ops where its tensors are, but they are "
            f"{where} and this rank runs on {device}: use cost_model='auto' (analytic here) or "
            f"build the model on {device}"
        )
    return False


def _planned_only(planned: str | None) -> Callable[[Plan, str | None], Plan]:
    def retype(plan: Plan, state: str | None) -> Plan:
        if state != planned:
            raise ValueError(
                f"this call runs under autocast({state}) but the model, built on the meta "
                f"device, was planned under autocast({planned}) and its values' dtypes under "
                "other states cannot be inferred there: call it under the state it was "
                "planned for (Config(autocast_dtype=...)), or build it on the CPU"
            )
        return plan

    return retype


def _shared_seed(world: int) -> int:
    """Rank 0's seed, so that every rank materializes a module's tensors identically."""
    seed = [torch.initial_seed()]
    if world > 1:
        dist.broadcast_object_list(seed, src=0)
    return int(seed[0])


def _prune_optimizer(optimizer: torch.optim.Optimizer, stage: fx.GraphModule) -> None:
    """Keep only the stage's parameters in the optimizer's groups (and state)."""
    keep = {id(p) for p in stage.parameters()}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) in keep]
    for p in list(optimizer.state):
        if id(p) not in keep:
            del optimizer.state[p]


def _device_of(model: nn.Module) -> torch.device:
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")
