"""The partition plan: the one serializable object between the compiler and the runtime.

Glossary (these words mean only this, everywhere in rannc_fx):

node
    One ``torch.fx`` node of the captured graph, named by ``node.name``.
block
    A run of nodes that is never cut apart (a matmul with its weight transpose, a view with
    its producer, a layer the grouping pass coarsened). Blocks form a chain in topological
    order; the search only cuts between consecutive blocks.
stage
    A contiguous range of blocks. It becomes one ``fx.GraphModule`` (``stage_0``, ...).
replica
    One rank running a stage. A stage with ``r`` replicas splits every micro-batch ``r``
    ways by sample (data parallelism inside the stage) and all-reduces its gradients among
    those ``r`` ranks.
micro-batch
    One of the ``micro_batches`` equal slices of the global batch that flow through the
    pipeline one after another.
schedule
    The order in which each stage runs its micro-batches' forwards and backwards: ``gpipe``
    (every forward, then every backward: a stage holds all m micro-batches' activations) or
    ``1f1b`` (one forward, one backward: stage s holds at most min(m, S - s)).
recompute
    A stage that recomputes keeps only its inputs for a micro-batch in flight and runs its
    forward again right before that micro-batch's backward.
sample
    One row of the batch dimension of the model's inputs. Shapes in a plan are given per
    sample, so a rank can work out any tensor's shape for the samples it holds.
rank
    One process. Stage ``s`` runs on ranks ``stages[s].ranks``; ranks are handed out to the
    lanes in order.
lane
    The ranks that run one list of the schedule: one stage's replicas, or under interleaved
    1F1B and ZBV the replicas of ``virtual_stages`` stages at once (``Plan.lanes``: lane
    ``p`` of ``P`` holds stages ``p, p + P, ...``, or ZBV's ``p`` and ``2P - 1 - p``), all
    with the same replica count.
tail
    The nodes from where the model first mixes its samples (a contrastive loss's
    ``(batch, batch)`` logits) to the outputs they feed. The last stage's ranks run it once a
    step on the whole batch, between the last forward and the first backward (``Plan.tail``).
value
    What one node produces. A *cut value* is produced in one stage and consumed in a later
    one; it is sent straight from its producer to every consumer stage.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..schedules.kinds import GPIPE, ScheduleKind, ScheduleName, kind_of
from .device import DeviceSpec
from .parts import (
    Block,
    CutValue,
    ExcludedSize,
    MemoryEstimate,
    OutputRef,
    SharedParam,
    Stage,
    Tail,
)
from .table import plan_table
from .values import DynamicDim, ValueSpec

__all__ = [
    "FORMAT_VERSION",
    "Block",
    "CutValue",
    "ExcludedSize",
    "MemoryEstimate",
    "OutputRef",
    "Plan",
    "SharedParam",
    "Stage",
    "Tail",
    "loss_output",
]

FORMAT_VERSION = 3  # 2: schedule and per-stage recompute; 3: dynamic dimensions

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class Plan(BaseModel):
    """Where every node runs, on how many ranks, and what crosses between stages."""

    model_config = _FROZEN

    format_version: int = FORMAT_VERSION
    model_fingerprint: str
    tracer: Literal["fx", "export"]
    world_size: int = Field(ge=1)
    global_batch: int = Field(ge=1, description="samples per step over all ranks")
    micro_batches: int = Field(ge=1)
    schedule: ScheduleName = GPIPE.name
    virtual_stages: int = Field(default=1, ge=1, description="stages a lane (interleaved, zbv)")
    # "stages": stage s's replicas on consecutive ranks, stages in order; "pipelines": replica
    # k of every stage on rank k * stages + s (each replica's pipeline on consecutive ranks)
    rank_order: Literal["stages", "pipelines"] = "stages"
    # how the slices' floating outputs without a batch dimension (the loss) combine:
    # "mean" weights each by its share of the global batch, "sum" adds them (Config)
    loss_reduction: Literal["mean", "sum"] = "mean"
    # BatchNorm running statistics: one update a step from the whole mini-batch ("step"), or
    # the share-weighted mean of each micro-batch's update ("micro-batch"; Config)
    batch_norm: Literal["step", "micro-batch"] = "step"
    device: DeviceSpec
    cost_model: Literal["measured", "analytic"]
    memory_budget: int
    optimizer_state_factor: float
    blocks: tuple[Block, ...]
    stages: tuple[Stage, ...]
    inputs: tuple[ValueSpec, ...]
    # input dimensions a call may pass at another size, up to the plan's (plan/values.py)
    dynamic_dims: tuple[DynamicDim, ...] = ()
    outputs: tuple[OutputRef, ...]
    cut_values: tuple[CutValue, ...]
    # integers a stage rebuilds from its inputs' sizes (it reads them from another stage)
    # that depend on a dynamic dimension: their formulas (split reads them; others need none)
    sizes: tuple[ValueSpec, ...] = ()
    shared_params: tuple[SharedParam, ...] = ()
    tail: Tail | None = None  # run once a step on the whole batch, by the last stage's ranks
    predicted_step_ms: float
    # the executor's lowered schedule run on the plan's per-stage costs (runtime.simulate);
    # the search minimizes predicted_step_ms, the cost model's closed form
    simulated_step_ms: float | None = None
    search_seconds: float = 0.0
    # sizes a stage never runs (a node raised there when profiled), and what planning says
    # beside the table, for people (``summary``)
    excluded_sizes: tuple[ExcludedSize, ...] = ()
    notes: tuple[str, ...] = ()

    # -- invariants ------------------------------------------------------------------------
    @model_validator(mode="before")
    @classmethod
    def _check_version(cls, data: object) -> object:
        # before the fields: an older plan would otherwise be misread with today's defaults
        version = data.get("format_version", FORMAT_VERSION) if isinstance(data, dict) else None
        if version is not None and version != FORMAT_VERSION:
            raise ValueError(
                f"plan format version {version} is not {FORMAT_VERSION} (version 2 added the "
                "schedule and per-stage recomputation, 3 dynamic dimensions); make the plan again with this version "
                "of rannc_fx"
            )
        return data

    def _check_pipelines(self, lanes: tuple[tuple[int, ...], ...]) -> int:
        """Laid out by pipelines: one stage a lane, the same replicas on each, replica k of
        stage s on rank k * S + s; returns the ranks they cover."""
        S = len(self.stages)
        if any(len(lane) > 1 for lane in lanes) or len({st.replicas for st in self.stages}) > 1:
            raise ValueError(
                f"rank_order='pipelines' needs one stage a lane and the same replicas on every "
                f"stage, not {[st.replicas for st in self.stages]} under {self.schedule!r}")
        for st in self.stages:
            want = tuple(k * S + st.index for k in range(st.replicas))
            if st.ranks != want:
                raise ValueError(f"stage {st.index} has ranks {list(st.ranks)}; laid out by "
                                 f"pipelines it must have ranks {list(want)}")
        return S * self.stages[0].replicas

    @model_validator(mode="after")
    def _check(self) -> Plan:
        if [b.index for b in self.blocks] != list(range(len(self.blocks))):
            raise ValueError("blocks must be numbered 0, 1, ... in order")
        if not self.stages:
            raise ValueError("a plan needs at least one stage")
        expect_block = 0
        for i, st in enumerate(self.stages):
            if st.index != i:
                raise ValueError(f"stage {st.index} is listed at position {i}")
            if st.first_block != expect_block or st.end_block <= st.first_block:
                raise ValueError(
                    f"stage {i} covers blocks [{st.first_block}, {st.end_block}) but must start "
                    f"at block {expect_block} and be non-empty: stages cover all blocks in order"
                )
            expect_block = st.end_block
        lanes = lane_layout(self.schedule, len(self.stages), self.virtual_stages)
        next_rank = self._check_pipelines(lanes) if self.rank_order == "pipelines" else 0
        for lane in lanes if self.rank_order == "stages" else ():
            first = self.stages[lane[0]]
            for i in lane:
                st = self.stages[i]
                if st.replicas != first.replicas:
                    raise ValueError(
                        f"stages {list(lane)} share their ranks under schedule "
                        f"{self.schedule!r}, so they need one replica count, not "
                        f"{[self.stages[j].replicas for j in lane]}"
                    )
                if st.ranks != tuple(range(next_rank, next_rank + st.replicas)):
                    raise ValueError(
                        f"stage {i} has ranks {list(st.ranks)}; with {st.replicas} replicas it "
                        f"must have ranks {list(range(next_rank, next_rank + st.replicas))}"
                    )
            next_rank += first.replicas
        if expect_block != len(self.blocks):
            raise ValueError(
                f"stages end at block {expect_block} but the plan has {len(self.blocks)} blocks"
            )
        if next_rank != self.world_size:
            raise ValueError(
                f"replica counts {[s.replicas for s in self.stages]} (a lane's counted once) "
                f"sum to {next_rank}, not the world size {self.world_size}"
            )
        for st in self.stages:
            if st.checkpoints and not st.recompute:
                raise ValueError(f"stage {st.index} has checkpoints {list(st.checkpoints)[:3]} "
                                 "but does not recompute: checkpoints are where a recomputing "
                                 "stage's R keeps values")
            if st.selective and st.recompute:
                raise ValueError(f"stage {st.index} recomputes both selectively and whole: "
                                 "selective recomputation has no R; make the plan again")
            if st.zero == 3 and (st.offload or st.replicas < 2 or not self.kind.plain):
                raise ValueError(
                    f"stage {st.index} is fully sharded (zero=3) on {st.replicas} replica(s) "
                    f"with offload={st.offload} under schedule {self.schedule!r}: such a stage "
                    "has two replicas or more, keeps its state on the device and runs under "
                    "GPipe or 1F1B only; make the plan again")
            if st.host_params and (st.zero or st.offload or not self.kind.plain):
                raise ValueError(
                    f"stage {st.index} keeps its parameters in host memory with zero="
                    f"{st.zero}, offload={st.offload} under schedule {self.schedule!r}: such a "
                    "stage keeps its whole optimizer state on the host and runs under GPipe "
                    "or 1F1B only; make the plan again")
        for d in self.dynamic_dims:
            spec = self.inputs[d.input] if d.input < len(self.inputs) else None
            if spec is None or spec.kind != "tensor" or d.dim >= len(spec.shape) or spec.shape[
                d.dim
            ] != d.size:
                raise ValueError(
                    f"dynamic dimension {d.name!r} is dimension {d.dim} of input {d.input} of "
                    f"size {d.size}, which the plan's inputs do not have"
                )
        n = len(self.stages)
        if any(x.stage >= n for x in self.excluded_sizes):
            raise ValueError(f"excluded sizes name stages {[x.stage for x in self.excluded_sizes]}"
                             f" of {n}")
        if self.tail is not None:
            last = self.stages[-1]
            if not self.kind.forwards_first:
                raise ValueError("a plan with a tail runs GPipe: the tail runs between every "
                                 "forward and every backward")
            missing = [v.name for v in self.tail.inputs if v.name not in last.outputs]
            if missing:
                raise ValueError(f"the tail reads {missing}, which the last stage does not return")
            if any(not 0 <= j < len(self.outputs) for j in self.tail.outputs):
                raise ValueError(f"the tail makes outputs {list(self.tail.outputs)}, which the "
                                 f"model's {len(self.outputs)} outputs do not all include")
        for cv in self.cut_values:
            if not cv.consumers:
                raise ValueError(f"cut value {cv.name!r} has no consumer stage")
            if not 0 <= cv.producer < n or any(
                not cv.producer < c < n for c in cv.consumers
            ):
                raise ValueError(
                    f"cut value {cv.name!r}: producer stage {cv.producer} must come before "
                    f"its consumers {list(cv.consumers)} within {n} stages"
                )
            if cv.name not in self.stages[cv.producer].outputs:
                raise ValueError(f"cut value {cv.name!r} is not an output of stage {cv.producer}")
            for c in cv.consumers:
                if cv.name not in self.stages[c].inputs:
                    raise ValueError(f"cut value {cv.name!r} is not an input of stage {c}")
        return self

    # -- lookups ---------------------------------------------------------------------------
    @property
    def lanes(self) -> tuple[tuple[int, ...], ...]:
        """The stages each lane holds, lane by lane (one stage a lane but for interleaved
        1F1B and ZBV)."""
        return lane_layout(self.schedule, len(self.stages), self.virtual_stages)

    def stages_of_rank(self, rank: int) -> tuple[Stage, ...]:
        """The stages rank ``rank`` runs, in stage order."""
        out = tuple(st for st in self.stages if rank in st.ranks)
        if not out:
            raise ValueError(f"rank {rank} is outside the plan's world size {self.world_size}")
        return out

    def stage_of_rank(self, rank: int) -> Stage:
        """The stage rank ``rank`` runs, where it runs one (see ``stages_of_rank``)."""
        held = self.stages_of_rank(rank)
        if len(held) > 1:
            raise ValueError(f"rank {rank} runs stages {[st.index for st in held]} under "
                             f"schedule {self.schedule!r}; ask for stages_of_rank")
        return held[0]

    @property
    def loss_output(self) -> int | None:
        """The index of the model's only output without a batch dimension that carries a
        gradient, when it is a scalar (a schedule may then run the whole step in the call)."""
        return loss_output([r.spec for r in self.outputs])

    def tail_output(self, index: int) -> bool:
        """Model output ``index`` is made by the tail (on the whole batch)."""
        return self.tail is not None and index in self.tail.outputs

    @property
    def kind(self) -> ScheduleKind:
        """What the plan's schedule does (``schedules.kinds``)."""
        return kind_of(self.schedule)

    def in_flight(self, stage: int) -> int:
        """Micro-batches whose activations (or, recomputing, inputs) stage ``stage`` holds at
        once under the plan's schedule."""
        return self.kind.in_flight(len(self.stages), self.micro_batches, self.virtual_stages,
                                   stage)

    def at_sizes(self, sizes: Mapping[str, int]) -> Plan:
        """The plan for a call whose dynamic dimensions have ``sizes`` (name -> size): every
        value the runtime sizes (inputs, cut values, outputs) evaluated there. The stages,
        their costs and the schedule stay the plan's."""
        if all(sizes[d.name] == d.size for d in self.dynamic_dims):
            return self
        tail = self.tail
        if tail is not None:
            tail = tail.model_copy(update={"inputs": tuple(s.at_sizes(sizes) for s in tail.inputs)})
        return self.model_copy(update={
            "tail": tail,
            "inputs": tuple(s.at_sizes(sizes) for s in self.inputs),
            "cut_values": tuple(cv.model_copy(update={"spec": cv.spec.at_sizes(sizes)})
                                for cv in self.cut_values),
            "outputs": tuple(r.model_copy(update={"spec": r.spec.at_sizes(sizes)})
                             for r in self.outputs),
        })

    def node_stage(self) -> dict[str, int]:
        """Node name -> stage index, for every node the blocks hold."""
        out: dict[str, int] = {}
        for st in self.stages:
            for b in self.blocks[st.first_block : st.end_block]:
                for name in b.nodes:
                    out[name] = st.index
        return out

    def cut(self, name: str) -> CutValue:
        for cv in self.cut_values:
            if cv.name == name:
                return cv
        raise KeyError(f"no cut value named {name!r}")

    def iter_stage_blocks(self, stage: int) -> Iterator[Block]:
        st = self.stages[stage]
        return iter(self.blocks[st.first_block : st.end_block])

    # -- serialization ---------------------------------------------------------------------
    def to_json(self) -> str:
        return self.model_dump_json(indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.model_validate_json(text)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_json(Path(path).read_text())

    # -- for people ------------------------------------------------------------------------
    def summary(self) -> str:
        """A table: one row per stage, with predicted time and memory against the budget
        (``table.plan_table``)."""
        return plan_table(self)


def lane_layout(schedule: str, num_stages: int, virtual: int) -> tuple[tuple[int, ...], ...]:
    """The stages each lane holds under ``schedule`` (``ScheduleKind.lanes``)."""
    return kind_of(schedule).lanes(num_stages, virtual)


def loss_output(outputs: list[ValueSpec]) -> int | None:
    """See ``Plan.loss_output``; ``outputs`` are the model's flat outputs in order. Outputs
    with a batch dimension come back detached (per rank), so only the others can be losses."""
    carry = [
        j for j, spec in enumerate(outputs) if spec.carries_gradient and spec.batch_dim is None
    ]
    if len(carry) != 1:
        return None
    return carry[0] if all(d == 1 for d in outputs[carry[0]].shape) else None
