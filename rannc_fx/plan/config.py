"""Every user-facing option, with its default; ``RANNC_FX_<NAME>`` environment variables override."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from ..schedules.kinds import ScheduleName, kind_of

__all__ = ["Config", "ENV_PREFIX"]

ENV_PREFIX = "RANNC_FX_"


class Config(BaseModel):
    """Options of the compiler and the runtime.

    ``None`` for ``stages``, ``replicas`` and ``micro_batches`` means "searched"; a value
    forces it, and the forced plan is still checked against the memory budget.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    # -- what the search may choose ------------------------------------------------------
    stages: int | None = Field(default=None, ge=1, description="number of pipeline stages; None = searched")
    replicas: tuple[int, ...] | None = Field(
        default=None, description="replica count of each stage, summing to the world size; None = searched"
    )
    micro_batches: int | None = Field(default=None, ge=1, description="micro-batches per step; None = searched")
    max_micro_batches: int = Field(default=32, ge=1, description="largest micro-batch count the search tries")
    schedule: ScheduleName | None = Field(
        default=None, description="pipeline schedule; None = searched (GPipe or 1F1B, then "
        "ZB-H1, interleaved 1F1B with 2, 3 or 4 stages a lane and ZBV on the searched stages, "
        "and the last two on every equal split of the ranks into lanes unless stages or "
        "replicas is set, kept where they fit and simulate shorter); 'zbh1' = zero bubble "
        "(split backward) on the searched stages; 'interleaved' = interleaved 1F1B with "
        "virtual_stages stages on each searched lane; 'zbv' = the V-shape zero bubble, two "
        "stages a lane (with these two, stages and replicas count lanes); a named schedule "
        "gets the shortest plan of it that fits. All but 'gpipe' need the model's only "
        "gradient-carrying output to be a scalar loss",
    )
    virtual_stages: int | None = Field(
        default=None, ge=2, description="stages a lane under schedule='interleaved'; None = 2",
    )
    recompute: bool | None = Field(
        default=None,
        description="activation recomputation: None = searched per stage, True = every stage "
        "(selectively, whole or layer by layer: recompute_selective, recompute_layers), "
        "False = none",
    )
    recompute_layers: bool | None = Field(
        default=None,
        description="how a stage recomputes: layer by layer (True: it keeps only the inputs "
        "of its layers, the children of an nn.ModuleList or nn.Sequential of alike modules, and runs each "
        "layer's forward once more inside the backward) or its whole forward at once (False: "
        "it keeps all its activations from its recomputation to its backward); None = "
        "searched per stage. True is refused with schedule 'zbh1', 'zbv' or 'interleaved' "
        "(their stages recompute whole)",
    )
    recompute_selective: bool | None = Field(
        default=None,
        description="selective recomputation: a stage keeps the outputs of its matrix "
        "products, convolutions and fused attention for every micro-batch in flight and its "
        "backward reruns the rest of its forward (normalizations, activations, dropout, "
        "unfused attention scores; under autocast each micro-batch casts its weights itself, "
        "autocast's cache being off inside, so that the recomputation replays the forward's "
        "ops), instead of running the whole forward again; None = searched per stage, True = "
        "the only recomputation (refused with schedule 'zbh1' or 'zbv', which split the "
        "backward, and with recompute_layers=True), False = never",
    )
    offload: bool | None = Field(
        default=None,
        description="optimizer state in host memory, brought to the device a bucket at a "
        "time for the step: None = searched per stage (only where it does not fit otherwise, "
        "after sharding; only on a device whose DeviceSpec has host_bandwidth and "
        "host_memory_bytes); True = every stage (on the CPU, where host and device are one "
        "memory, it runs the same path); False = none",
    )
    host_params: bool | None = Field(
        default=None,
        description="parameters, their gradients and optimizer state in host memory: each use "
        "in a stage's graph fetches its parameter to the device (the next ones fetched ahead, "
        "overlapped with the compute), its gradient goes back to the host, and the optimizer "
        "steps there (runtime/host_params.py): None = searched per stage (after every other "
        "way to fit; only on a device whose DeviceSpec has host_bandwidth and "
        "host_memory_bytes); True = every stage (refused with zero or offload set, or a "
        "schedule other than 'gpipe' or '1f1b'); False = none",
    )
    zero: Literal[0, 1, 2, 3] | None = Field(
        default=None,
        description="ZeRO level inside each stage's replicas: None = searched per stage "
        "among 0, 1 and 3 (1 only where a stage does not fit without it, or where it shortens "
        "the step; 3 where nothing else fits without recomputation, or where every stage "
        "fully sharded makes the faster plan, plain FSDP among them); 0 = none; 1 = every stage with more than one replica shards its "
        "optimizer state over them, every gradient kept on every replica (runtime/zero.py); "
        "2 = and reduce-scatters its gradients, each replica keeping those of the "
        "parameters it steps, .grad None on the others (runtime/grad_shards.py): a step "
        "then moves one all-reduce's bytes, not one and a half, and never takes longer or "
        "more memory than level 0 or 1, but .grad no longer holds every gradient, so it is "
        "asked for, not searched; 3 = every stage with more than one replica shards its "
        "parameters, gradients and optimizer state over them along their first dimension, "
        "all-gathers each parameter where the stage's graph uses it and reduce-scatters its "
        "gradient in each backward (runtime/full_shard.py, ZeRO-3 / FSDP): each parameter "
        "and its .grad hold the replica's rows, the optimizer steps those (GPipe and 1F1B "
        "only; with host_params refused)",
    )

    # -- placement -------------------------------------------------------------------------
    device: str | None = Field(
        default=None,
        description="where this rank runs its stage: None = cuda:LOCAL_RANK when CUDA is "
        "available, else cpu; 'cuda' means cuda:LOCAL_RANK",
    )
    sync_module_states: bool = Field(
        default=True,
        description="start training from rank 0's model: compile() sends rank 0's parameters "
        "and buffers to every stage's ranks (DDP's construction, FSDP's sync_module_states), "
        "so ranks seeded differently, or where only rank 0 loaded weights, train one model; "
        "False skips that transfer for a script whose ranks build identical models (a "
        "meta-device model is materialized from rank 0's seed either way)",
    )

    autocast_dtype: Literal["bfloat16", "float16"] | None = Field(
        default=None,
        description="plan for torch.autocast with this dtype (profiles and memory in its "
        "dtypes); None = the autocast state of the call that plans",
    )

    # -- memory ----------------------------------------------------------------------------
    device_memory: int | None = Field(
        default=None, gt=0, description="bytes per device; None = the device's own size"
    )
    memory_margin: float = Field(
        default=0.1, ge=0, lt=1, description="fraction of device memory kept free"
    )
    optimizer_state_factor: float = Field(
        default=2.0, ge=0, description="optimizer state bytes per parameter byte (Adam: 2, SGD: 0)"
    )

    # -- links -----------------------------------------------------------------------------
    link_bandwidth: float | None = Field(
        default=None,
        gt=0,
        description="bytes/s between two ranks; None = measured by compile() over the process "
        "group (more than one rank), else the device spec's",
    )
    link_latency: float | None = Field(
        default=None,
        ge=0,
        description="seconds per message between two ranks; None = measured or the spec's",
    )
    allreduce_bandwidth: float | None = Field(
        default=None,
        gt=0,
        description="bytes/s of a ring all-reduce's traffic (reduction included); None = "
        "measured or the spec's",
    )
    devices_per_node: int | None = Field(
        default=None,
        ge=1,
        description="devices (ranks) a node holds: a stage lies inside one node or over "
        "whole nodes, and what crosses nodes goes at network_bandwidth; None = torchrun's "
        "LOCAL_WORLD_SIZE where it is below the world size, else the device spec's (every "
        "rank in one node if it has none)",
    )
    network_bandwidth: float | None = Field(
        default=None,
        gt=0,
        description="bytes/s one device sends between nodes; None = the device spec's",
    )
    network_latency: float | None = Field(
        default=None,
        ge=0,
        description="seconds per message between nodes; None = the device spec's",
    )
    rank_order: Literal["stages", "pipelines"] | None = Field(
        default=None,
        description="how ranks are laid out over several nodes: 'stages', stage by stage (a "
        "stage's replicas on consecutive ranks), or 'pipelines', each replica's whole pipeline "
        "on consecutive ranks (every stage the same replicas; the stage count divides the "
        "node's devices or is a multiple of them); None = the faster, searched",
    )

    # -- capture and profile ---------------------------------------------------------------
    tracer: Literal["auto", "fx", "export"] = Field(
        default="auto",
        description="how the model is captured: 'fx' (torch.fx.symbolic_trace), 'export' "
        "(non-strict torch.export, ATen level), 'auto' = fx where its graph matches the model "
        "on the example batch and keeps no torch.nn container opaque, else export",
    )
    leaf_modules: tuple[str, ...] = Field(
        default=(), description="module class names kept as single calls: torch.fx calls "
        "them without tracing inside, torch.export runs them eagerly as one node each (as it "
        "does by itself with a module it fails inside)"
    )
    cost_model: Literal["auto", "measured", "analytic"] = Field(
        default="auto",
        description="how op costs are found: 'measured' (timed on the device; a meta-device "
        "model, or one elsewhere, has each distinct op made real there, timed and freed), "
        "'analytic' (from FLOPs and bytes), 'auto' = measured on a torch device (the rank's), "
        "analytic for a DeviceSpec or preset",
    )
    batch_dim: int = Field(default=0, ge=0, description="batch dimension of the inputs")
    dynamic_dims: Literal["auto", "batch"] | tuple[str, ...] = Field(
        default="auto",
        description="input dimensions other than the batch's that a call may pass at any size "
        "up to the example's (a sequence length under dynamic padding): 'auto' = every one "
        "the model allows (torch.export keeps it a symbol), 'batch' = none (every call passes "
        "the example's other sizes), or names 'INPUT.DIM' ('input_ids.1') of the ones to keep "
        "(the others are pinned at the example's size)",
    )
    profile_repeats: int = Field(
        default=3, ge=1,
        description="timed runs per profiled op, and per size of the optimizer step and the "
        "gradient accumulation",
    )
    profile_cache_dir: Path | None = Field(
        default_factory=lambda: Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        / "rannc_fx",
        description="where profiles persist; None disables the disk cache",
    )

    # -- grouping and search ---------------------------------------------------------------
    # 192: on a 96-layer BERT a 96-block chain gave a 6.6 % slower plan (benchmarks/results/
    # plan_time_cpu_202611.md); the search then takes 0.4-2 s at 32 ranks
    max_blocks: int = Field(default=192, ge=2, description="blocks the search cuts between")

    # -- runtime ---------------------------------------------------------------------------
    loss_reduction: Literal["mean", "sum"] = Field(
        default="mean",
        description="how the micro-batch slices' losses make the step's loss: 'mean' weights "
        "each slice's by its share of the global batch (exact for a mean over samples), 'sum' "
        "adds them and seeds each slice's backward with 1 (exact for a sum, or for a loss "
        "already divided by a global count such as transformers' num_items_in_batch)",
    )
    timeout_s: float = Field(default=300.0, gt=0, description="process-group timeout, seconds")
    batch_norm: Literal["step", "micro-batch"] = Field(
        default="step",
        description="BatchNorm running statistics: 'step' updates them once a step from the "
        "whole mini-batch's mean and unbiased variance (replicas equal, as one process); "
        "'micro-batch' averages each micro-batch's own update",
    )
    check_batches: bool = Field(
        default=True,
        description="agree on the ranks' local batch sizes, autocast states, modes "
        "(train()/eval()) and no_sync() at each call (one all-gather of a row of integers a "
        "rank), so unequal ones fail on every rank at once; "
        "False skips it when every rank is known to pass equal batches (a rank that does not "
        "then leaves the others waiting until timeout_s)",
    )
    trace_dir: Path | None = Field(
        default=None,
        description="write a Chrome trace of the steps trace_steps names here (trace.json, "
        "merged on rank 0); None = no tracing, at no cost",
    )
    trace_steps: str = Field(
        default="3-4",
        pattern=r"^\s*\d+(\s*-\s*\d+)?\s*$",
        description="training steps to trace, 1-based: 'N' or 'FIRST-LAST' (calls with "
        "gradients count; evaluation calls are not steps)",
    )
    debug: bool = Field(
        default=False,
        description="log the captured graph, the blocks and every stage's code (logger rannc_fx)",
    )

    @field_validator("trace_steps", mode="before")
    @classmethod
    def _steps_text(cls, v: Any) -> Any:
        return str(v) if isinstance(v, int) else v  # RANNC_FX_TRACE_STEPS=3 parses as JSON

    @property
    def traced_steps(self) -> range:
        """``trace_steps`` as a range of 1-based step numbers."""
        first, _, last = self.trace_steps.partition("-")
        a, b = int(first), int(last or first)
        if a < 1 or b < a:
            raise ValueError(
                f"trace_steps={self.trace_steps!r}: write 'N' or 'FIRST-LAST' with "
                "1 <= FIRST <= LAST, e.g. '3-4'"
            )
        return range(a, b + 1)

    @model_validator(mode="after")
    def _check_forced(self) -> Config:
        if self.replicas is not None:
            if any(r < 1 for r in self.replicas):
                raise ValueError(f"replicas={list(self.replicas)}: every stage needs at least 1")
            if self.stages is not None and self.stages != len(self.replicas):
                raise ValueError(
                    f"stages={self.stages} but replicas={list(self.replicas)} names "
                    f"{len(self.replicas)} stages; give one replica count per stage"
                )
        kind = None if self.schedule is None else kind_of(self.schedule)
        if self.virtual_stages is not None and (kind is None or kind.lane_stages is not None):
            raise ValueError(
                f"virtual_stages={self.virtual_stages} applies to schedule='interleaved' (zbv "
                f"runs 2 a lane), not schedule={self.schedule!r}"
            )
        if self.recompute_layers and kind is not None and not kind.plain:
            raise ValueError(
                f"recompute_layers=True with schedule={self.schedule!r}: its stages recompute "
                "whole (ZB-H1 and ZBV split each backward in two, and recomputing layer by "
                "layer runs inside one backward; interleaved lanes are costed so); use "
                "recompute_layers=None, or schedule '1f1b', 'gpipe' or None"
            )
        if self.recompute_selective and kind is not None and kind.splits_backward:
            raise ValueError(
                f"recompute_selective=True with schedule={self.schedule!r}: ZB-H1 and ZBV "
                "split each backward in two and selective recomputation reruns inside one "
                "backward; use recompute_selective=None, or schedule '1f1b', 'gpipe', "
                "'interleaved' or None"
            )
        if self.host_params and (self.zero or self.offload):
            raise ValueError(
                f"host_params=True with zero={self.zero} and offload={self.offload}: a stage "
                "whose parameters are in host memory keeps its whole optimizer state there and "
                "steps it there; leave zero and offload to the search (None) or set them off"
            )
        if self.zero == 3 and kind is not None and not kind.plain:
            raise ValueError(
                f"zero=3 with schedule={self.schedule!r}: fully sharded stages gather their "
                "parameters at each use and run under the searched schedules only ('gpipe', "
                "'1f1b'); use zero=None, 1 or 2, or one of those schedules"
            )
        if self.host_params and kind is not None and not kind.plain:
            raise ValueError(
                f"host_params=True with schedule={self.schedule!r}: parameters in host memory "
                "run under the searched schedules only ('gpipe', '1f1b'); use host_params=None "
                "or one of those"
            )
        if self.recompute_selective and self.recompute_layers:
            raise ValueError(
                "recompute_selective=True and recompute_layers=True: a stage recomputes "
                "either selectively or layer by layer; force at most one of them"
            )
        if self.micro_batches is not None and self.micro_batches > self.max_micro_batches:
            raise ValueError(
                f"micro_batches={self.micro_batches} exceeds max_micro_batches="
                f"{self.max_micro_batches}; raise max_micro_batches too"
            )
        _ = self.traced_steps  # 'FIRST-LAST' in order
        return self

    @property
    def forced_stages(self) -> int | None:
        return len(self.replicas) if self.replicas is not None else self.stages

    @classmethod
    def from_env(cls, base: Config | None = None, environ: dict[str, str] | None = None) -> Config:
        """``base`` (or the defaults) with ``RANNC_FX_<NAME>`` variables applied on top.

        Values are parsed as JSON where they parse (``RANNC_FX_REPLICAS=[2,1]``,
        ``RANNC_FX_STAGES=2``, ``RANNC_FX_PROFILE_CACHE_DIR=null``), else taken as strings.
        """
        env = os.environ if environ is None else environ
        data: dict[str, Any] = (base or cls()).model_dump()
        changed = False
        for name in cls.model_fields:
            key = ENV_PREFIX + name.upper()
            if key not in env:
                continue
            raw = env[key]
            try:
                data[name] = json.loads(raw)
            except json.JSONDecodeError:
                data[name] = raw
            changed = True
        unknown = sorted(
            k
            for k in env
            if k.startswith(ENV_PREFIX) and k[len(ENV_PREFIX) :].lower() not in cls.model_fields
        )
        if unknown:
            raise ValueError(
                f"unknown rannc_fx option(s) in the environment: {', '.join(unknown)}; known: "
                + ", ".join(ENV_PREFIX + n.upper() for n in cls.model_fields)
            )
        if not changed:
            return base or cls()
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ValueError(f"bad {ENV_PREFIX}* environment variable: {e}") from None
