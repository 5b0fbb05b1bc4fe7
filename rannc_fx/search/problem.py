"""What the search is given and what it gives back, as data (the formulas are ``cost_model``'s).

Given: ``CostTable``, every block's costs at each per-replica micro-batch size, and
``SearchSpace``, the ranks, batch, budgets and links, and which choices are free or forced
(micro-batch counts, stage and replica counts, schedules, recomputation, sharding, offloading,
parameters on the host). Given back: ``StageChoice``, a stage as chosen (its block range,
replicas and variant), ``StageCost``, one replica of it as costed, ``Evaluation``, a plan's
step time and stages, and ``SearchResult``, the search's answer. ``SCHEDULES`` are the
schedules searched unless the space names others, ``SEARCHED`` every one the search can cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..plan.parts import MemoryEstimate
from ..schedules.kinds import GPIPE, ONE_F_ONE_B, ZBH1
from .segments import Segments

__all__ = [
    "SCHEDULES",
    "SEARCHED",
    "CostTable",
    "Evaluation",
    "SearchResult",
    "SearchSpace",
    "StageChoice",
    "StageCost",
]

SCHEDULES = (GPIPE.name, ONE_F_ONE_B.name)  # searched unless the space names others
SEARCHED = (*SCHEDULES, ZBH1.name)  # what the search can cost (ties go to the earlier)


@dataclass(frozen=True)
class CostTable:
    """Per-block costs at each per-replica micro-batch size in ``sizes``.

    Shapes: sizes (Q,); fwd, bwd, act, workspace (Q, B); cut (Q, B + 1) with cut[:, 0] and
    cut[:, B] zero; param_bytes and grad_bytes (B, B + 1), entry [i, j] for the block range
    [i, j) with shared parameters counted once (only i < j is read); optimizer_s and
    accumulate_s (B, B + 1) likewise give the seconds of the range's optimizer step and of
    adding one micro-batch's gradients into ``.grad`` (None: free); out (Q, B) the bytes of
    the batched model outputs (logits) each block makes for one micro-batch (None: none);
    kept, redo and rebuilt (Q, B) what selective recomputation (``rannc_fx.plan.selective``) keeps
    of a block's activations, the seconds it adds (rerunning the forward less what it kept),
    and what of ``act`` its backward rebuilds (None: it keeps all, ``act``, runs all again,
    ``fwd``, and rebuilds all, ``act``); wheld (Q, B) what a micro-batch holds between a split
    backward's ``B`` and its ``W`` (``profile/opcost_bw.py``; None: its activations and cut
    values, and ``terms.HELD`` of them more for the gradients ``W`` reads); casts (Q, B) of
    ``act``, autocast's copies of the block's weights (None: none), which a stage holds once
    whatever its micro-batches in flight, unless it recomputes (then each backward's
    forward makes them again, one micro-batch's worth). ``excluded``
    maps a per-replica sample count to the blocks that cannot run it (a node of theirs
    raised there when profiled): a stage holding one never runs a micro-batch of that size
    on any replica (``blocked``).
    """

    sizes: np.ndarray
    fwd: np.ndarray
    bwd: np.ndarray
    act: np.ndarray
    workspace: np.ndarray
    cut: np.ndarray
    param_bytes: np.ndarray
    grad_bytes: np.ndarray
    optimizer_s: np.ndarray | None = None
    accumulate_s: np.ndarray | None = None
    out: np.ndarray | None = None  # (Q, B): bytes of batched model outputs each block makes
    segments: Segments | None = None  # the layers, for recomputation layer by layer
    kept: np.ndarray | None = None  # (Q, B): bytes selective recomputation keeps
    redo: np.ndarray | None = None  # (Q, B): forward seconds it runs again
    rebuilt: np.ndarray | None = None  # (Q, B): of act, what its backward rebuilds
    wheld: np.ndarray | None = None  # (Q, B): held between a split backward's B and W
    casts: np.ndarray | None = None  # (Q, B): of act, autocast's weight copies (once a stage)
    # the tensors several blocks use (a tied embedding and LM head): (the blocks, parameter
    # bytes, gradient bytes, optimizer step seconds) each; a lane holding two stages that
    # both use one holds it, reduces its gradient and steps it once
    shared: tuple[tuple[tuple[int, ...], float, float, float], ...] = ()
    excluded: dict[int, tuple[int, ...]] = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return int(self.fwd.shape[1])


@dataclass(frozen=True)
class SearchSpace:
    world_size: int
    global_batch: int
    memory_budget: float
    link_bandwidth: float
    optimizer_state_factor: float = 2.0
    link_latency: float = 0.0  # seconds per message
    allreduce_bandwidth: float | None = None  # None: link_bandwidth
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)  # candidates; forced = one candidate
    stages: int | None = None  # forced stage count
    replicas: tuple[int, ...] | None = None  # forced replica counts (implies stages)
    schedules: tuple[str, ...] = SCHEDULES  # candidates; forced = one candidate
    recompute: bool | None = None  # None: per stage, only where needed; True / False: all / none
    # recomputing layer by layer (``segments``) or the whole stage: None searched per stage
    layers: bool | None = None
    # recomputing selectively (``CostTable.kept``): None searched per stage, True: only so
    selective: bool | None = None
    zero: bool | None = None  # ZeRO over a stage's replicas: as ``recompute`` (r = 1: never)
    # a sharded stage's gradients reduce-scattered to their owners (ZeRO-2) rather than
    # all-reduced (ZeRO-1, every gradient kept on every replica)
    grad_shards: bool = False
    # a sharded stage's parameters and gradients sharded too (ZeRO-3: all-gathered at each
    # use, reduce-scattered in each backward): None searched, True every sharded stage so
    full_shard: bool | None = None
    offload: bool | None = None  # optimizer state in host memory: as ``recompute``
    # parameters, gradients and optimizer state in host memory, fetched at each use (the
    # optimizer steps on the host): as ``recompute``
    host_params: bool | None = None
    host_bandwidth: float | None = None  # bytes/s device <-> host; None: nothing to offload to
    # whether the device copies from its host beside its compute (a GPU's copy engine), so
    # host_params' transfers overlap it; False: they add to it (the CPU, its own host)
    host_overlap: bool = True
    # bytes/s of host memory an optimizer step on the host has for one device; None:
    # host_bandwidth
    host_step_bandwidth: float | None = None
    host_budget: float = 0.0  # host bytes a device may fill with offloaded state
    output_bytes: float = 0.0  # batched model outputs of one rank's local batch (every rank)
    reduce_bucket: float = 64 * 2**20  # bytes the gradient all-reduce copies at a time
    # the cluster's nodes (``nodes``): devices a node (0: every rank in one node), and the
    # network between nodes, bytes/s per device and seconds per message
    devices_per_node: int = 0
    network_bandwidth: float | None = None
    network_latency: float = 0.0
    # how ranks are laid out (``nodes``): "stages", stage by stage (a stage's replicas on
    # consecutive ranks), or "pipelines", replica k's whole pipeline on ranks kS .. kS + S - 1
    # (forced replicas, all alike)
    rank_order: str = "stages"


@dataclass(frozen=True)
class StageChoice:
    start: int
    end: int  # exclusive
    replicas: int
    recompute: bool = False  # run the forward again before each backward; keep only cut values
    zero: bool = False  # ZeRO-1: the optimizer state sharded over the replicas (r > 1)
    offload: bool = False  # the (share of the) optimizer state kept in host memory
    layers: bool = False  # recompute layer by layer (``segments``; with recompute only)
    # recompute selectively (``rannc_fx.plan.selective``): no R, the backward reruns what the
    # forward did not keep (never with ``recompute``)
    selective: bool = False
    # parameters, gradients and optimizer state in host memory (never with zero or offload)
    host: bool = False
    # ZeRO-3 (with zero): parameters and gradients sharded over the replicas too
    full: bool = False

    @property
    def level(self) -> int:
        """rho: 0 no recomputation, 1 the stage's forward again, 2 layer by layer, 3
        selectively."""
        return 3 if self.selective else 2 if self.layers else int(self.recompute)


@dataclass(frozen=True)
class StageCost:
    """One replica of one stage: samples per micro-batch, times (s) and memory parts (bytes).

    ``recompute_s`` is the forward that recomputation runs again (``fwd_s`` or 0);
    ``in_flight`` is n, the micro-batches whose activations the stage holds at once;
    ``memory`` is the plan's breakdown (the plan's stage carries it as it is): its
    ``activations`` are n * A without recomputation and A with it, its ``comm_buffers``
    n * (cin + cout) without and n * cin + cout with it, its ``overlap`` the bytes of those
    parts that never coexist.
    """

    samples: int
    fwd_s: float
    bwd_s: float
    comm_s: float
    allreduce_s: float
    optimizer_s: float
    accumulate_s: float  # per micro-batch after the first
    memory: MemoryEstimate  # the plan's own breakdown (``Stage.memory``), peak = its total
    recompute: bool = False  # R: the forward again before each backward
    in_flight: int = 1
    recompute_s: float = 0.0
    selective: bool = False  # the backward reruns what the forward did not keep
    gather_s: float = 0.0  # ag_s: ZeRO-1's all-gather of the stepped parameters
    zero: bool = False
    offload: bool = False
    host_s: float = 0.0  # the offloaded state to the device and back, each step
    host_state: int = 0  # bytes of optimizer state in host memory (host: and parameters, grads)
    host: bool = False  # parameters in host memory (``params``: the fetched windows)
    fetch_s: float = 0.0  # host: one micro-batch's transfers
    fetch_overlap: bool = True  # host: the transfers overlap the compute (else they add)
    window: int = 0  # host, full: the parameter bytes fetched ahead
    full: bool = False  # ZeRO-3: fetch_s its all-gathers, scatter_s its reduce-scatter
    scatter_s: float = 0.0  # full: one micro-batch's reduce-scatter (beside no compute)

    @property
    def time_s(self) -> float:
        """t: the stage's seconds per micro-batch, forward, backward and messages (with its
        parameters in host memory, or fully sharded, the compute or the fetches, the longer,
        where they overlap; fully sharded, its reduce-scatter after them)."""
        compute = self.fwd_s + self.bwd_s + self.recompute_s
        if self.host or self.full:
            compute = max(compute, self.fetch_s) if self.fetch_overlap else (
                compute + self.fetch_s)
        return compute + self.scatter_s + self.comm_s


@dataclass(frozen=True)
class Evaluation:
    step_s: float
    stages: tuple[StageCost, ...]
    fits: bool


@dataclass(frozen=True)
class SearchResult:
    micro_batches: int
    stages: tuple[StageChoice, ...]
    evaluation: Evaluation
    seconds: float = 0.0  # wall time of the search
    schedule: str = GPIPE.name
    dps: int = 0  # dynamic programs it ran (how hard the search worked)
    virtual_stages: int = 1  # stages a lane (interleaved, zbv: planner/virtual.py)
