"""The parts of a plan (``plan/plan.py``): blocks, stages and their memory, cut values, outputs,
shared parameters, the tail and the sizes a stage never runs. Each is a frozen pydantic model; ``Plan`` checks how they fit
together."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from .values import ValueSpec

__all__ = ["Block", "CutValue", "ExcludedSize", "MemoryEstimate", "OutputRef", "SharedParam",
           "Stage", "Tail"]

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class Block(BaseModel):
    """A run of nodes the search never cuts, with its costs at its stage's micro-batch."""

    model_config = _FROZEN

    index: int
    nodes: tuple[str, ...]
    fwd_ms: float
    bwd_ms: float
    param_bytes: int
    activation_bytes: int


class MemoryEstimate(BaseModel):
    """Predicted peak bytes held by one replica of a stage, by what holds them."""

    model_config = _FROZEN

    params: int
    grads: int
    optimizer_state: int
    activations: int
    comm_buffers: int
    workspace: int
    outputs: int = 0  # batched model outputs (logits) until they go home, and the local batch's
    # of gradients, activations and cut values: the bytes never held at once (GPipe's
    # gradients appear while its backwards free activations)
    overlap: int = 0

    @property
    def total(self) -> int:
        """The predicted peak: every part, less what never coexists."""
        return (
            self.params
            + self.grads
            + self.optimizer_state
            + self.activations
            + self.comm_buffers
            + self.workspace
            + self.outputs
            - self.overlap
        )


class Stage(BaseModel):
    """A contiguous range of blocks run by ``replicas`` ranks.

    ``inputs`` lists the values the stage's GraphModule takes, in placeholder order (graph
    inputs and cut values from earlier stages); ``outputs`` the values it returns, in order.
    ``samples`` is how many samples one replica handles per micro-batch (the largest slice
    when the micro-batch does not divide evenly).
    """

    model_config = _FROZEN

    index: int
    first_block: int
    end_block: int  # exclusive
    replicas: int = Field(ge=1)
    ranks: tuple[int, ...]
    samples: int = Field(ge=1)
    num_nodes: int
    param_names: tuple[str, ...]
    # buffers and tensor constants the stage reads: each stage that reads one holds a copy
    # (never a SharedParam: nothing to all-reduce; one the forward writes has one reader stage)
    buffer_names: tuple[str, ...] = ()
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    fwd_ms: float
    bwd_ms: float
    comm_ms: float
    allreduce_ms: float
    optimizer_ms: float = 0.0
    accumulate_ms: float = 0.0  # adding one micro-batch's gradients into .grad
    recompute: bool = False  # forward again before each backward (fwd_ms more per micro-batch)
    # recomputation layer by layer: the nodes (in graph order) each of which starts a segment
    # of the stage. R then keeps only each segment's inputs (and its last segment's
    # activations), and the backward runs each other segment's forward a third time just
    # before its backward (again_ms); empty: R keeps every activation of the stage
    checkpoints: tuple[str, ...] = ()
    again_ms: float = 0.0  # with checkpoints or selective: the forwards each backward runs again
    # selective recomputation (``rannc_fx.plan.selective``, never with ``recompute``): F keeps only
    # the outputs of its matrix products, convolutions and fused attention, and B reruns the
    # rest of the forward (again_ms)
    selective: bool = False
    # 1: the optimizer state sharded over the replicas (ZeRO-1); 2: and the gradients,
    # reduce-scattered to their owners (ZeRO-2; allreduce_ms is then the reduce-scatter's);
    # 3: the parameters and gradients too, each replica holding its rows of every parameter,
    # all-gathered at each use (window_bytes of them ahead, fetch_ms a micro-batch's) and
    # their gradients reduce-scattered in each backward (scatter_ms; ZeRO-3,
    # ``runtime/full_shard.py``)
    zero: int = Field(default=0, ge=0, le=3)
    gather_ms: float = 0.0  # zero >= 1: all-gathering the stepped parameters after the step
    offload: bool = False  # the (share of the) optimizer state in host memory
    host_ms: float = 0.0  # offload: its state to the device and back, each step
    host_bytes: int = 0  # offload: the optimizer state each replica keeps in host memory
    # parameters, gradients and optimizer state in host memory (``runtime/host_params.py``):
    # each use fetches its parameter to the device, window_bytes of them fetched ahead; the
    # optimizer steps on the host; never with zero or offload (the state is on the host)
    host_params: bool = False
    window_bytes: int = Field(default=0, ge=0)
    fetch_ms: float = 0.0  # host_params, zero 3: one micro-batch's transfers (or all-gathers)
    scatter_ms: float = 0.0  # zero 3: one micro-batch's reduce-scatter of its gradients
    memory: MemoryEstimate

    @property
    def param_bytes(self) -> int:
        return self.memory.params


class CutValue(BaseModel):
    """A value produced by stage ``producer`` and read by the later ``consumers``."""

    model_config = _FROZEN

    producer: int
    consumers: tuple[int, ...]
    spec: ValueSpec

    @property
    def name(self) -> str:
        return self.spec.name


class OutputRef(BaseModel):
    """Leaf ``index`` of the model's flattened output: which value, made by which stage."""

    model_config = _FROZEN

    index: int
    stage: int
    spec: ValueSpec


class Tail(BaseModel):
    """The part of the model that mixes the batch's samples, run once a step on the whole
    batch by every replica of the last stage (``shapes/tail.py``, ``runtime/tail.py``).

    ``inputs`` are the last stage's outputs it reads (batched ones gathered from every
    micro-batch and replica), in its placeholders' order; ``outputs`` the model outputs it makes (their
    ``plan.outputs`` indices), in its return order. ``nodes`` belong to the last stage's
    blocks but run here. Time and bytes are at the whole batch: the step's once.
    """

    model_config = _FROZEN

    nodes: tuple[str, ...]
    mixing: tuple[str, ...]  # where samples first mix
    inputs: tuple[ValueSpec, ...]
    outputs: tuple[int, ...]
    fwd_ms: float = 0.0
    bwd_ms: float = 0.0
    activation_bytes: int = 0  # what its backward keeps, at the whole batch
    input_bytes: int = 0  # its gathered inputs and their gradients, at the whole batch


class SharedParam(BaseModel):
    """A parameter used by more than one stage (a tied embedding and LM head): each holds it,
    and its gradient is summed over all their ranks. Buffers are never shared parameters."""

    model_config = _FROZEN

    name: str
    aliases: tuple[str, ...] = ()
    stages: tuple[int, ...]


class ExcludedSize(BaseModel):
    """A per-replica micro-batch size stage ``stage`` never runs: its ``nodes`` raised there
    when profiled (a training-mode BatchNorm that sees one value per channel at one sample).
    The search planned around it; the runtime refuses a call that would run it."""

    model_config = _FROZEN

    stage: int = Field(ge=0)
    samples: int = Field(ge=1)
    nodes: tuple[str, ...] = Field(min_length=1)
    error: str  # what the first of them raised, its first line

    def note(self) -> str:
        """The line ``Plan.summary`` shows."""
        more = f" (and {len(self.nodes) - 1} more of its nodes)" if len(self.nodes) > 1 else ""
        return (f"stage {self.stage} never runs {self.samples} sample(s) a replica a "
                f"micro-batch: node {self.nodes[0]}{more} raised there when profiled: "
                f"{self.error}")
