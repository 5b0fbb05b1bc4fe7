"""The cost model: what one stage of a plan costs in time and memory, and the step time.

This module states the formulas and holds the helpers the search shares (the sizes a
replica runs, range sums and maxima); it imports numpy, no torch op. What the search is given
and gives back (``CostTable``, ``SearchSpace``, ``StageCost``, ...) is ``problem``'s. All
times are in seconds, sizes in bytes.

A stage covers blocks [i, j) with r replicas; with m micro-batches each replica handles
q = ceil(global_batch / (m * r)) samples per micro-batch, and ``k`` is the index of q in
``table.sizes``. The schedule sigma ("gpipe", "1f1b", or "zbh1" below) is chosen for the whole plan, the
activation recomputation rho (0 none, 1 the stage's forward, 2 layer by layer, 3 selective)
per stage;
d is the stage's position from the end (the last stage has d = 1). n is how many
micro-batches' activations the stage holds at once:

    n        = m                 (gpipe: every forward before any backward)
             = min(m, d)         (1f1b: a stage d from the end runs at most d forwards ahead)
    F, Bw, A = sum(fwd[k, i:j]), sum(bwd[k, i:j]), sum(act[k, i:j])
    cin,cout = cut[k, i], cut[k, j]
    t_s      = F + Bw + [rho in (1, 2)] F + [rho = 2] F' + [rho = 3] D
               + 2 (cin + cout) / link_bw + 2 link_lat ([i > 0] + [j < B])
                         (recomputation runs the stage's forward again before each backward;
                          layer by layer, the backward runs each layer's forward once more
                          but the last's: F' = ``segments.again``; selectively, the backward
                          reruns what the forward did not keep: D = sum(redo[k, i:j]))
    ar_s     = 2 * (r - 1) / r * grad_bytes[i, j] / ar_bw + 2 * (r - 1) * link_lat
                         (ring all-reduce; ar_bw = allreduce_bandwidth, else link_bw)
    acc_s    = accumulate_s[i, j]             (micro-batch 2.. adds its gradients into .grad)
    opt_s    = optimizer_s[i, j]              (the optimizer step of the range's parameters)
    up_s     = ar_s + opt_s                                   (zeta = 0)
             = ar_s + (ag_s + opt_s / r)                      (zeta = 1, r > 1)
             = ag_s + (ag_s + opt_s / r)                      (zeta = 1, r > 1, grad_shards)
    ag_s     = (r - 1) / r * grad_bytes[i, j] / ar_bw + (r - 1) * link_lat
                         (ring all-gather of the stepped parameters: half an all-reduce;
                          ZeRO-2's reduce-scatter of the gradients to their owners, the
                          other half, costs the same, ``runtime/grad_shards.py``)
    u_s      = (m - 1) * (t_s + acc_s) + up_s
    step     = sum_s t_s  +  max_s u_s
    memory_s = param_bytes[i, j] + grad_bytes[i, j] * optimizer_state_factor
               - zeta * grad_bytes[i, j] * optimizer_state_factor * (r - 1) / r
                         (ZeRO-1, zeta = 1: each replica keeps the optimizer state of 1 / r
                          of the stage's parameters, ``runtime/zero.py``)
               + G + n * (A + cin + cout)      (rho = 0)
               + G + n * cin + cout + A        (rho = 1: a micro-batch in flight keeps only
                                                the stage's inputs; one micro-batch's
                                                activations and outputs exist during its
                                                backward; rho = 2: as rho = 1 with A
                                                replaced by K + a_max, the inputs of the
                                                stage's layers and one layer's activations,
                                                ``segments``)
               + G + n * (cin + cout + P) + R    (rho = 3: every micro-batch in flight keeps
                                                its kept ops' outputs P = sum(kept[k, i:j]);
                                                the one in its backward rebuilds
                                                R = sum(rebuilt[k, i:j]), the saved tensors
                                                no kept op made)
               - overlap
               + max(workspace[k, i:j])
               + m * sum(out[k, i:j]) + output_bytes
             (the last three terms but ``fixed``'s are the backward's peak; the larger of it
              and G + tr is taken, tr = [r > 1] min(G, reduce_bucket): after the backwards
              the gradient all-reduce copies a bucket of them at a time)
                         (batched model outputs such as logits: the stage keeps every
                          micro-batch's until they go home at the end of the forwards, and
                          every rank assembles its local batch's, output_bytes)

G = grad_bytes[i, j] are the stage's gradients. They are made by the backwards, so (with
``.grad`` None when the step starts, torch's default ``zero_grad``) they coexist with every
in-flight micro-batch only when a forward runs after the stage's first backward, i.e. when
n < m (1F1B). With n = m (GPipe, or a 1F1B stage whose forwards all come first) they appear
while the backwards free activations, and ``overlap`` is what never coexists:

    overlap  = 0                                                      (n < m)
             = G + m (A + c) - m c - max(m A, (m - 1) A + G)           (rho = 0, n = m)
             = G + A + h - max(h + max(A, G), h - cin + A + G)         (rho = 1, 2, n = m > 1)
             = G + A + h - h - max(A, G)                               (rho = 1, 2, m = 1)
             = G + R + m g - max(m g + max(R, G), (m - 1) g + R + G)   (rho = 3, n = m > 1)
             = G + R + g - g - max(R, G)                               (rho = 3, m = 1)
    (c = cin + cout, h = m cin + cout, g = c + P)

so the peak is m c + max(m A, (m - 1) A + G) without recomputation (all activations, or all
but one micro-batch's and the gradients) and the larger of the first backward (every
micro-batch's inputs, then one micro-batch's activations or the gradients) and the second
(one micro-batch fewer inputs, one micro-batch's activations and the gradients) with it.
Gradients kept from earlier calls (accumulation without ``zero_grad``) coexist with all of it.

The sharding zeta (0 or 1) and the offloading of the optimizer state are chosen per stage,
like rho: they change only the stage's fixed memory, its once-a-step u and what exists after
the backwards, so with a fixed n a stage's variants form a chain from fastest to smallest
(``variants.VARIANTS``: for rho = 0, 3, 1, 2 in turn, plain, sharded, sharded and offloaded,
offloaded) and a stage takes the first that fits. Sharding and offloading come before
recomputation: they cost an all-gather and the state's round trip a step where recomputation
costs a forward per micro-batch; which of those is faster is a choice of policy, and the
sharded twin replaces the unsharded variant where its u is smaller.

A stage may also keep its parameters, gradients and optimizer state in host memory (eta = 1,
never with zeta or the offloaded state; ``runtime/host_params.py``), at any rho, after every
other variant of the chain: each use fetches its parameter, so

    t_s      = max(F + Bw + ..., (f_rho P + G) / host_bw) + ...   (f_rho = 2, 3 with R or a
                         selective rerun, 4 layer by layer; the transfers overlap the compute,
                         or add to it where the device is its own host, ``host_overlap``)
    up_s     = ar_s + [r > 1] 2 G / host_bw + G (3 + 2 osf) / host_step_bw
                         (the all-reduce's buckets through the device; the step on the host)
    memory_s = the formula above with params + G osf replaced by 2 W and G by W
                         (W = the stage's largest block's parameter bytes: the copies fetched
                          ahead and in use, the gradients on their way home)
    host_s   = P + G (1 + osf) <= host budget

``sum_s t_s`` is the pipeline's fill and drain; the max term is the steady state of the
bottleneck stage (with its gradient accumulation) plus its gradient all-reduce and its optimizer
step (every replica steps the stage's parameters; stages step in parallel). A plan is feasible
when every stage's memory is within ``memory_budget``, replica counts sum to ``world_size``,
m * r <= global_batch, and no stage holds a block that cannot run a size its replicas'
micro-batches hold (``CostTable.excluded``, ``blocked``: the floor or the ceiling of q).

Without recomputation a stage is never slower (same or lower t, hence u) and with it never
needs more memory, so the search gives each stage recomputation only when it does not fit
without (unless ``SearchSpace.recompute`` forces it on or off). 1F1B never holds more in
flight than GPipe; with m = 1 the two are the same plan and the search reports "gpipe"
unless only "1f1b" was allowed.

ZB-H1 ("zbh1", searched only where ``schedules`` names it: the planner asks for it apart,
``planner/zb_choice.py``) runs 1F1B's order with each backward split into B (input
gradients) and W (weight gradients), W held back into the bubble. Its stages do not
recompute and keep their parameters on the device (the variants above with rho = 0, not
eta). A stage holds held = min(m, S) micro-batches from F to W, x = min(held, d) of them at
most whole, the rest between B and W, each holding w = ``wheld`` (what W reads and the
gradients kept for it), so with G + held w + x (A + c - w) at one corner of its list, or
(x - 1) at the other where w > A + c (``StageTerms.memory_zbh1``); t and u are
``StageTerms.zbh1_times`` (the simulator's step on equal stages). Since held depends on S
where S < m, the search runs ZB-H1's layered DP with held = m (exact for S >= m, S >= 3) and
again with each S < m (and S = 1, 2) forced.

``StageTerms`` (module ``terms``) holds the formulas; ``evaluate`` (module ``evaluate``) and the
search kernel both read them, so a plan the search returns has the step and the memory
``evaluate`` gives it, bit for bit.
"""

from __future__ import annotations

import numpy as np

from ..schedules.kinds import kind_of
from .nodes import layout_problem, usable_replicas
from .problem import SEARCHED, CostTable, SearchSpace

__all__ = [
    "blocked",
    "bottleneck_s",
    "in_flight",
    "needed_sizes",
    "range_max",
    "range_sum",
    "run_sizes",
    "samples_per_replica",
    "size_index",
    "sizes_run",
]


def samples_per_replica(global_batch: int, micro_batches: int, replicas: int) -> int:
    return -(-global_batch // (micro_batches * replicas))


def sizes_run(global_batch: int, micro_batches: int, replicas: int) -> tuple[int, ...]:
    """The samples a replica's micro-batch holds: the runtime splits the batch evenly into
    micro-batches and each among the replicas (``routing.even_split``), so each holds the
    floor or the ceiling of ``global_batch / (micro_batches * replicas)``."""
    lo = global_batch // (micro_batches * replicas)
    hi = samples_per_replica(global_batch, micro_batches, replicas)
    return tuple(q for q in dict.fromkeys((lo, hi)) if q >= 1)


def run_sizes(space: SearchSpace) -> tuple[int, ...]:
    """Every per-replica micro-batch size a plan of the space may run (``needed_sizes`` and
    the smaller of uneven splits), ascending."""
    reps = usable_replicas(space)
    return tuple(sorted({
        q for m in set(space.micro_batches) for r in reps if m * r <= space.global_batch
        for q in sizes_run(space.global_batch, m, r)
    }))


def blocked(table: CostTable, global_batch: int, micro_batches: int, replicas: int,
            i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """Whether each stage [i, j) holds a block that cannot run a size its replicas' micro-
    batches hold (``CostTable.excluded``) with that many micro-batches and replicas."""
    bad = np.zeros(table.num_blocks, bool)
    for q in sizes_run(global_batch, micro_batches, replicas):
        bad[list(table.excluded.get(q, ()))] = True
    if not bad.any():
        return np.zeros(np.shape(i), bool)
    c = np.concatenate(([0], np.cumsum(bad)))
    return (c[j] - c[i]) > 0


def needed_sizes(space: SearchSpace) -> tuple[int, ...]:
    """Every per-replica micro-batch size the search may look up, ascending."""
    reps = usable_replicas(space)
    return tuple(sorted({
        samples_per_replica(space.global_batch, m, r)
        for m in set(space.micro_batches) for r in reps if m * r <= space.global_batch
    }))


def size_index(table: CostTable) -> dict[int, int]:
    return {int(q): k for k, q in enumerate(np.asarray(table.sizes).tolist())}


def in_flight(schedule: str, m: int, d: int) -> int:
    """n: micro-batches whose activations a stage d stages from the end holds at once."""
    return m if kind_of(schedule).forwards_first else min(m, d)


def bottleneck_s(m: int, t: np.ndarray, acc: np.ndarray, fixed_s: np.ndarray) -> np.ndarray:
    """u_s = (m - 1) (t_s + acc_s) + (ar_s + opt_s); ``fixed_s`` is ar_s + opt_s."""
    return (m - 1) * (t + acc) + fixed_s


def range_sum(arr: np.ndarray | None, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """``arr[i, j]`` for an optional per-range array (None: zeros)."""
    return np.zeros(np.shape(i)) if arr is None else np.asarray(arr, float)[i, j]


def range_max(x: np.ndarray) -> np.ndarray:
    """(B + 1, B + 1) array whose [i, j] is max(x[i:j]) for i < j."""
    B = len(x)
    rows = np.where(np.arange(B)[None, :] >= np.arange(B)[:, None], x[None, :], -np.inf)
    out = np.full((B + 1, B + 1), -np.inf)
    out[:B, 1:] = np.maximum.accumulate(rows, axis=1)
    return out


def _check(table: CostTable, space: SearchSpace) -> None:
    """ValueError when the table's shapes or the space's values are unusable."""
    B, Q = table.num_blocks, len(table.sizes)
    shapes = {"fwd": (Q, B), "bwd": (Q, B), "act": (Q, B), "workspace": (Q, B),
              "cut": (Q, B + 1), "param_bytes": (B, B + 1), "grad_bytes": (B, B + 1)}
    for name, shape in shapes.items():
        if np.shape(getattr(table, name)) != shape:
            raise ValueError(f"CostTable.{name} has shape {np.shape(getattr(table, name))}, "
                             f"expected {shape} for {Q} sizes and {B} blocks")
    if B < 1 or space.world_size < 1 or space.global_batch < 1 or space.link_bandwidth <= 0:
        raise ValueError(f"need blocks, world size, global batch and link bandwidth > 0: {space}")
    if not space.micro_batches or min(space.micro_batches) < 1:
        raise ValueError(f"micro_batches={space.micro_batches}: need counts >= 1")
    if not space.schedules or not set(space.schedules) <= set(SEARCHED):
        raise ValueError(f"schedules={space.schedules}: need one or more of {SEARCHED}")
    if space.replicas is not None:
        if min(space.replicas, default=0) < 1 or sum(space.replicas) != space.world_size:
            raise ValueError(f"replicas={list(space.replicas)} must be >= 1 and sum to the "
                             f"world size {space.world_size}")
        if space.stages is not None and space.stages != len(space.replicas):
            raise ValueError(f"stages={space.stages} but replicas={list(space.replicas)}")
    if space.layers and space.selective:
        raise ValueError("layers=True and selective=True: a stage recomputes either layer by "
                         "layer or selectively; force at most one of them")
    if space.stages is not None and space.stages < 1:
        raise ValueError(f"stages={space.stages}: need at least one stage")
    if space.host_params and (space.zero or space.offload):
        raise ValueError("host_params=True with zero or offload forced: a stage whose "
                         "parameters are in host memory keeps its optimizer state there and "
                         "steps it there, whole; force at most one of them")
    if space.full_shard and (space.zero is False or space.offload or space.host_params):
        raise ValueError(f"full_shard=True with zero={space.zero}, offload={space.offload}, "
                         f"host_params={space.host_params}: a fully sharded stage shards its "
                         "state over its replicas (zero) and keeps it, with its parameters, on "
                         "the device; leave those to the search (None) or set zero=True")
    for name in ("host_params", "offload"):
        if getattr(space, name) and (space.host_bandwidth is None or space.host_budget <= 0):
            raise ValueError(f"{name}=True but the device has no host memory to use "
                             f"(host_bandwidth={space.host_bandwidth}, host budget "
                             f"{space.host_budget:g} bytes): describe it in the DeviceSpec "
                             f"(host_bandwidth, host_memory_bytes), or leave {name} to the "
                             "search")
    if (problem := layout_problem(space)) is not None:
        raise ValueError(problem)
    missing = sorted(set(needed_sizes(space)) - set(size_index(table)))
    if missing:
        raise ValueError(f"the cost table has no costs for {missing} samples per replica; "
                         "build it for needed_sizes(space)")

