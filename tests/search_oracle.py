"""An independent statement of the search's cost model, and exact optima by enumeration.

Plain Python: loops over blocks, no numpy, nothing from the search but its dataclasses.
``stage_figures`` is the cost model of ``rannc_fx/search/cost_model.py``'s docstring written
out again. A stage's recomputation and ZeRO-1 follow the stated policy (``variant``): the
first of (plain, sharded, recomputing selectively, recomputing, then recomputing layer by
layer, each plain, sharded, ...) that fits, an
unsharded one passed over where its sharded twin's u is smaller; a stage holding a block that
cannot run a size its replicas' micro-batches hold (``cannot_run``) has none. ``brute_force`` enumerates every plan (micro-batch count, stage
boundaries, replicas, schedule; each stage's variant by the policy); ``pareto`` keeps
(sum t, max u) labels per DP state, per total stage count under 1F1B so that a stage's
position from the end is known; ``least_largest_stage`` is the least largest-stage memory
over every plan (what ``NoFeasiblePlan.largest_stage_bytes`` reports).

``brute_force`` compares memory with the budget on both sides of a small margin (``SLACK``):
a plan the search calls fitting must fit the loose budget, and the optimum within the strict
budget must be no better than the search's, so rounding at the boundary cannot flip a verdict.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any

from rannc_fx.search import CostTable, SearchSpace, StageChoice

SLACK = 1e-9


class _Lists:
    """A table (or its segments) with every array as nested Python lists, its other fields
    as they are: the enumerations read single elements, each a numpy scalar on an array."""

    def __init__(self, of: Any) -> None:
        for f in fields(of):
            v = getattr(of, f.name)
            if hasattr(v, "tolist"):
                v = v.tolist()
            elif is_dataclass(v) and not isinstance(v, type):
                v = _Lists(v)
            setattr(self, f.name, v)
        if hasattr(of, "num_blocks"):
            self.num_blocks = of.num_blocks
            self.sums: dict[tuple[int, int, int], Any] = {}  # ``_block_sums``' ranges


def _lists(table: CostTable) -> CostTable:
    return table if isinstance(table, _Lists) else _Lists(table)  # type: ignore[return-value]


@dataclass(frozen=True)
class Figures:
    """One stage's figures, as StageCost names them, plus t, u and memory."""

    samples: int
    fwd_s: float
    bwd_s: float
    recompute_s: float
    comm_s: float
    allreduce_s: float
    optimizer_s: float
    accumulate_s: float
    params: float
    grads: float
    optimizer_state: float
    activations: float
    comm_buffers: float
    workspace: float
    outputs: float
    overlap: float
    in_flight: int
    recompute: bool
    zero: bool
    gather_s: float
    offload: bool
    host_s: float
    host_state: float
    t: float
    u: float
    memory: float
    layers: bool = False
    selective: bool = False
    host: bool = False
    full: bool = False
    scatter_s: float = 0.0


def layer_transient(table: CostTable, k: int, i: int, j: int, A: float) -> float:
    """What the stage [i, j) holds of one micro-batch during a backward that recomputes it
    layer by layer: the values entering each of its segments after the first (each counted
    at the first segment start it crosses) and the largest segment's activations, the first
    and last clipped to the stage; A where the stage lies in one segment."""
    sg = table.segments
    assert sg is not None
    si, sj = int(sg.first[i]), int(sg.last[j])
    if si == sj:
        return A
    kept = sum(float(sg.kept[k][s]) for s in range(si + 1, sj + 1))
    parts = [float(sg.head[k][i]), float(sg.tail[k][j])]
    parts += [float(sg.act[k][s]) for s in range(si + 1, sj)]
    return kept + max(parts)


def _block_sums(table: CostTable, k: int, i: int, j: int
                ) -> tuple[float, float, float, float, float, float, float]:
    """Blocks [i, j) at size k, block by block from i: forward, backward, activations, kept,
    redone and rebuilt bytes summed, the largest workspace. A ``_Lists`` table keeps each
    range's, so that [i, j) adds block j - 1 to [i, j - 1): the same sums in the same order."""
    memo = getattr(table, "sums", None)
    if memo is not None and (k, i, j) in memo:
        return memo[k, i, j]  # type: ignore[no-any-return]
    if memo is not None and j > i:
        F, Bw, A, keep, redo, rebuilt, ws = _block_sums(table, k, i, j - 1)
        first = j - 1
    else:
        F = Bw = A = keep = redo = rebuilt = 0.0
        ws, first = -math.inf, i
    for b in range(first, j):
        F += float(table.fwd[k][b])
        Bw += float(table.bwd[k][b])
        A += float(table.act[k][b])
        keep += float(table.act[k][b] if table.kept is None else table.kept[k][b])
        redo += float(table.fwd[k][b] if table.redo is None else table.redo[k][b])
        rebuilt += float(table.act[k][b] if table.rebuilt is None else table.rebuilt[k][b])
        ws = max(ws, float(table.workspace[k][b]))
    if memo is not None:
        memo[k, i, j] = (F, Bw, A, keep, redo, rebuilt, ws)
    return F, Bw, A, keep, redo, rebuilt, ws


def across_nodes(space: SearchSpace) -> bool:
    """Whether the space's ranks fill more than one node (ranks k N .. k N + N - 1 node k)."""
    return bool(space.devices_per_node) and space.world_size > space.devices_per_node


def placeable(space: SearchSpace, first: int, r: int) -> bool:
    """Whether r replicas from rank ``first`` lie inside one node or over whole nodes."""
    N = space.devices_per_node
    if not across_nodes(space) or space.rank_order == "pipelines":
        return True  # by pipelines: whole pipelines a node, or whole nodes a pipeline
    return first // N == (first + r - 1) // N or (first % N == 0 and r % N == 0)


def count_placed(space: SearchSpace, r: int) -> bool:
    """Whether the search places a stage of r replicas at all: on a cluster of more than
    ``nodes.FINE_RANKS`` ranks, only a divisor of a node's devices or k whole nodes (k a
    power of two or a divisor of the node count), and past ``nodes.FINE_NODES`` nodes only
    the whole nodes (read from the module, so that a test may lower them)."""
    from rannc_fx.search import nodes

    N, W = space.devices_per_node, space.world_size
    if space.replicas is not None or not across_nodes(space) or W <= nodes.FINE_RANKS:
        return True
    if r % N:
        return W // N <= nodes.FINE_NODES and N % r == 0
    k, count = r // N, W // N
    return k & (k - 1) == 0 or count % k == 0


def layouts_ok(space: SearchSpace, reps: tuple[int, ...]) -> bool:
    return all(placeable(space, sum(reps[:s]), r) and count_placed(space, r)
               for s, r in enumerate(reps))


def _ring(space: SearchSpace, nbytes: float, group: list[int]) -> float:
    """One pass (a reduce-scatter or an all-gather) of ``nbytes`` over the replicas on the
    ranks ``group``: a ring on the node's links where they share one node; else within each
    node (l of them a node) then each device's 1 / l across the g nodes on the network (a
    message there costs at least the node's latency)."""
    bw = space.allreduce_bandwidth or space.link_bandwidth
    r, N = len(group), space.devices_per_node
    nodes = {x // N for x in group} if across_nodes(space) else {0}
    if len(nodes) == 1:
        return (r - 1) / r * nbytes / bw + (r - 1) * space.link_latency
    g = len(nodes)
    local = sum(1 for x in group if x // N == group[0] // N)
    assert space.network_bandwidth is not None
    return ((local - 1) / local * nbytes / bw + (local - 1) * space.link_latency
            + (g - 1) / g * nbytes / local / space.network_bandwidth
            + (g - 1) * max(space.network_latency, space.link_latency))


def _group(space: SearchSpace, first: int, r: int, stage: int, stages: int) -> list[int]:
    """The ranks of a stage's replicas: consecutive from ``first`` (stage by stage), or
    replica k's at k * stages + stage (by pipelines)."""
    if space.rank_order == "pipelines":
        return [k * stages + stage for k in range(r)]
    return list(range(first, first + r))


def stage_figures(table: CostTable, space: SearchSpace, i: int, j: int, r: int, m: int, n: int,
                  recompute: int, zero: bool = False, offload: bool = False,
                  host: bool = False, full: bool = False, *, first: int = 0, stage: int = 0,
                  stages: int = 1) -> Figures:
    """Blocks [i, j) on r replicas, m micro-batches, n of them in flight; ``recompute``: 0,
    1 (the forward again before each backward), 2 (layer by layer: the backward runs each
    layer's forward once more) or 3 (selectively: every micro-batch in flight keeps what the
    table's ``kept`` says, and its backward rebuilds the rest, ``rebuilt``, adding ``redo``); ``zero``: the optimizer state sharded over the r replicas
    (one replica: no effect); ``offload``: this replica's state in host memory, moved to the
    device and back each step; ``host``: its parameters, gradients and state in host memory,
    each parameter fetched to the device at each use (F, B, and each forward run again), the
    gradients sent back, the step on the host; the device holds two of its largest block's
    parameters (in use, fetched ahead) and one of gradients; ``full`` (with ``zero``, ZeRO-3):
    1 / r of its parameters, gradients and state on each replica, every parameter
    all-gathered at each use (as often as ``host`` fetches it) and its gradient
    reduce-scattered in each backward, the device holding the same two blocks' parameters
    and one block's whole gradients beside its shares, nothing to all-reduce or gather after
    the backwards. ``first``: its first rank,
    ``stage`` of ``stages`` its place (ranks by ``_group``); a boundary to a stage on another
    node sends on the network."""
    rho = int(recompute)
    recompute, selective = rho in (1, 2), rho == 3
    zero = zero and r > 1
    full = full and zero
    B, G = table.num_blocks, space.global_batch
    q = -(-G // (m * r))
    k = [int(x) for x in table.sizes].index(q)
    F, Bw, A, keep, redo, rebuilt, ws = _block_sums(table, k, i, j)
    # autocast's weight copies, of A: held once by a stage that does not recompute (its
    # micro-batches share them), part of each micro-batch's activations where it does
    C = _casts(table, k, i, j) if rho == 0 else 0.0
    A -= C
    again = 0.0  # layer by layer, the backward runs every layer's forward but the last again
    if rho == 2:  # one micro-batch's activations: its layers' inputs and one layer's
        A = layer_transient(table, k, i, j, A)
        sg = table.segments
        assert sg is not None
        if int(sg.first[i]) != int(sg.last[j]):
            again = F - float(sg.tail_fwd[k][j])
    cin, cout = float(table.cut[k][i]), float(table.cut[k][j])
    N, comm = space.devices_per_node, 0.0
    ends = ((first, first - 1), (first + r - 1, first + r))  # stage by stage: the ranks
    if space.rank_order == "pipelines":  # replica 0's pipeline: stage s on rank s
        ends = ((stage, stage - 1), (stage, stage + 1))
    for (here, there), cut, side in zip(ends, (cin, cout), (i > 0, j < B), strict=True):
        if not side:
            continue  # no stage on that side
        if across_nodes(space) and here // N != there // N:
            assert space.network_bandwidth is not None
            slowest = min(space.network_bandwidth, space.link_bandwidth)  # never faster
            comm += 2 * cut / slowest + 2 * max(space.network_latency, space.link_latency)
        else:
            comm += 2 * cut / space.link_bandwidth + 2 * space.link_latency
    again_s = redo if selective else (F if rho else 0.0) + again
    grad, param = float(table.grad_bytes[i][j]), float(table.param_bytes[i][j])
    t = F + Bw + again_s + comm
    if host:  # fetched per use: the compute or the transfers, the longer (overlapped), or
        times = 2 + (2 if rho == 2 else 1 if rho else 0)  # both (the device its own host)
        assert space.host_bandwidth is not None
        moving = (times * param + grad) / space.host_bandwidth
        compute = F + Bw + again_s
        t = (max(compute, moving) if space.host_overlap else compute + moving) + comm
    group = _group(space, first, r, stage, stages)
    scatter = 0.0
    if full:  # the all-gathers fetched ahead beside the compute (or after it), then the
        # reduce-scatter of the gradients
        times = 2 + (2 if rho == 2 else 1 if rho else 0)
        gathers = times * _ring(space, param, group)
        scatter = _ring(space, grad, group)
        compute = F + Bw + again_s
        t = (max(compute, gathers) if space.host_overlap else compute + gathers) \
            + scatter + comm
    ar = 2 * _ring(space, grad, group)
    opt = 0.0 if table.optimizer_s is None else float(table.optimizer_s[i][j])
    acc = 0.0 if table.accumulate_s is None else float(table.accumulate_s[i][j])
    ag = 0.0
    if zero:  # each replica steps 1 / r of the parameters, then they all-gather them
        opt = opt / r
        ag = _ring(space, grad, group)
        if space.grad_shards:  # ZeRO-2: a reduce-scatter, the all-reduce's first half
            ar = _ring(space, grad, group)
        if full:  # nothing after the backwards: each replica steps the rows it holds
            ar = ag = 0.0
    share = grad * space.optimizer_state_factor / (r if zero else 1)
    # fully sharded, a tensor shared with a block outside the stage stays whole, with its
    # gradient and state (its holders sum the gradient whole)
    apart_p = apart_g = 0.0
    for blocks, pb, gb, _ in (table.shared if full else ()):
        inside = sum(i <= b < j for b in blocks)
        if 0 < inside < len(blocks):
            apart_p, apart_g = apart_p + pb, apart_g + gb
    share += (1 - 1 / r) * apart_g * space.optimizer_state_factor if full else 0.0
    kept_host = share if offload else 0.0
    moved = 2 * kept_host / space.host_bandwidth if offload and space.host_bandwidth else 0.0
    if host:  # the all-reduce through the device, the step on the host
        assert space.host_bandwidth is not None
        moved = 2 * grad / space.host_bandwidth if r > 1 else 0.0
        opt = grad * (3 + 2 * space.optimizer_state_factor) / (
            space.host_step_bandwidth or space.host_bandwidth)
        kept_host = param + grad + grad * space.optimizer_state_factor
    u = (m - 1) * (t + acc) + ar + ag + opt + moved
    activations = A if recompute else n * keep + rebuilt if selective else n * A
    # recomputing, a micro-batch in flight keeps its inputs; its outputs went on and R
    # makes them again, for one micro-batch at a time
    buffers = n * cin + cout if recompute else n * (cin + cout)
    state = 0.0 if offload or host else share
    device_params = param
    window = max([float(table.param_bytes[b][b + 1]) for b in range(i, j)] + [0.0])
    if host:
        device_params, grad_here = 2 * window, window
    elif full:
        device_params = param / r + (1 - 1 / r) * apart_p + 2 * window
        grad_here = grad / r + (1 - 1 / r) * apart_g + window
    else:
        grad_here = grad
    grad_all, grad = grad, grad_here  # the peak meets the gradients the device holds
    # every micro-batch's batched model outputs until they go home, and the local batch's
    outputs = space.output_bytes
    if table.out is not None:
        outputs += m * sum(float(table.out[k][b]) for b in range(i, j))
    # the gradients come with the backwards: they meet every in-flight micro-batch only if a
    # forward follows the first backward (n < m); else they replace freed activations
    c = cin + cout
    if n < m:
        peak = grad + activations + buffers
    elif selective:  # every micro-batch's kept outputs and cut values, one rebuilt at a time
        held = cin + cout + keep
        peak = (max(m * held + max(rebuilt, grad), (m - 1) * held + rebuilt + grad) if m > 1
                else held + max(rebuilt, grad))
    elif not recompute:
        # the last forward ends with m micro-batches held; the first backward frees one
        # micro-batch's activations while the gradients appear
        peak = m * c + max(m * A, (m - 1) * A + grad)
    elif m == 1:
        peak = c + max(A, grad)
    else:
        # first backward: every input and its outputs, one micro-batch's activations giving
        # way to the gradients; second: one input fewer, activations and gradients side by side
        peak = max(m * cin + cout + max(A, grad), (m - 1) * cin + cout + A + grad)
    overlap = grad + activations + buffers - peak
    # after the backwards the all-reduce copies a bucket of the gradients beside them
    copy = min(grad_all, space.reduce_bucket) if r > 1 and not full else 0.0
    if offload:  # or a bucket's state brought in for its step
        copy = max(copy, min(kept_host, space.reduce_bucket * space.optimizer_state_factor))
    ws = max(ws, grad + copy - peak)
    return Figures(q, F, Bw, again_s, comm, ar, opt, acc, device_params, grad, state,
                   activations + C, buffers, ws, outputs, overlap, n, recompute, zero, ag,
                   offload, moved, kept_host, t, u,
                   device_params + state + C + peak + ws + outputs, rho == 2, selective, host,
                   full, scatter)


def _casts(table: CostTable, k: int, i: int, j: int) -> float:
    return 0.0 if table.casts is None else sum(float(table.casts[k][b]) for b in range(i, j))


# (recompute, zero, offload, host, full): the policy's order, fully sharded after the other
# ways to hold the state at each level, the parameters in host memory last
CHAIN = tuple((rho, zeta, omega, False, phi) for rho in (0, 3, 1, 2)
              for zeta, omega, phi in ((False, False, False), (True, False, False),
                                       (True, True, False), (False, True, False),
                                       (True, False, True))
              ) + tuple((rho, False, False, True, False) for rho in (0, 3, 1, 2))


def allowed(space: SearchSpace, table: CostTable) -> list[tuple[int, bool, bool, bool, bool]]:
    host = space.host_bandwidth is not None and space.host_budget > 0
    rhos = {None: (0, 1, 2, 3), False: (0,), True: (1, 2, 3)}[space.recompute]
    rhos = tuple(x for x in rhos if {None: True, False: x != 2, True: x in (0, 2)}[space.layers]
                 and {None: True, False: x != 3, True: x in (0, 3)}[space.selective]
                 and (table.segments is not None or x != 2)
                 and (table.kept is not None or x != 3))
    return [(rho, zeta, omega, h, phi) for rho, zeta, omega, h, phi in CHAIN
            if rho in rhos and space.zero in (None, zeta) and space.full_shard in (None, phi)
            and space.offload in (None, omega) and space.host_params in (None, h)
            and (host or not (omega or h))]


def cannot_run(table: CostTable, space: SearchSpace, i: int, j: int, r: int, m: int) -> bool:
    """Whether a block of [i, j) cannot run (``CostTable.excluded``) a size one of the r
    replicas' micro-batches holds: the batch split into m nearly equal micro-batches, each
    into r nearly equal parts."""
    if not table.excluded:  # the enumerations call this for every stage of every plan
        return False
    G = space.global_batch
    held = {mb // r + (k < mb % r) for a in range(m) for mb in [G // m + (a < G % m)]
            for k in range(r)}
    return any(b in table.excluded.get(q, ()) for q in held for b in range(i, j))


def variant(table: CostTable, space: SearchSpace, i: int, j: int, r: int, m: int, n: int,
            budget: float | None = None, first: int = 0, stage: int = 0,
            stages: int = 1) -> Figures | None:
    """The stage as the policy runs it: its first allowed variant that fits (``budget``, the
    space's if None), passing over an unsharded one whose sharded twin is allowed and has a
    smaller u; None if none fits, or if it cannot run its size (``cannot_run``)."""
    budget = space.memory_budget if budget is None else budget
    if cannot_run(table, space, i, j, r, m):
        return None
    ok = allowed(space, table)
    figs: dict[tuple[int, bool, bool, bool, bool], Figures] = {}

    def of(v: tuple[int, bool, bool, bool, bool]) -> Figures:
        if v not in figs:
            figs[v] = stage_figures(table, space, i, j, r, m, n, *v, first=first, stage=stage,
                                    stages=stages)
        return figs[v]

    for rho, zeta, omega, h, phi in ok:
        f = of((rho, zeta, omega, h, phi))
        if not zeta and not h and (rho, True, omega, False, False) in ok and \
                of((rho, True, omega, False, False)).u < f.u:
            continue
        if f.memory <= budget and f.host_state <= space.host_budget:
            return f
    return None


def in_flight(schedule: str, m: int, d: int) -> int:
    return m if schedule == "gpipe" else min(m, d)


def zbh1_held(s: int, S: int, m: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """What stage ``s`` of ``S`` holds at its two extreme points under ZB-H1 (no
    recomputation): (micro-batches whole, micro-batches between their B and their W).

    ZB-H1 runs 1F1B's order with each W as late as the stage's own list allows without
    holding more micro-batches than 1F1B's first stage: m' = min(m, S) in all, of which at
    most 1F1B's own count f = min(m, S - s) whole (forward done, B not yet), and at most
    k + 1 between B and W once k = max(0, s - (S - m')) of its weight backwards wait behind a
    B (the one whose B just ran counts too). Every point of its list lies within those three
    bounds, and it reaches both corners: (f, m' - f) and (m' - k - 1, k + 1); its memory
    peaks at one of them, whatever a micro-batch weighs whole and between B and W."""
    mm, f = min(m, S), min(m, S - s)
    k = max(0, s - (S - mm))
    return (f, mm - f), (mm - k - 1, k + 1)


OVERHEAD = 0.04  # what splitting a backward in two adds to it (the simulator's constant)


def zbh1_figures(table: CostTable, space: SearchSpace, i: int, j: int, r: int, m: int, s: int,
                 S: int, zero: bool = False, offload: bool = False, first: int = 0
                 ) -> tuple[float, float, float]:
    """t, u and memory of stage s of S under ZB-H1, without recomputation (its only kind):
    the stage holds at its peak one of ``zbh1_held``'s corners, each micro-batch whole as
    1F1B holds it (activations and cut values) or between its B and its W (``wheld``, by
    default 1.5 times that; whole on the first stage, whose inputs need no gradient), the
    gradients beside all of it; after the backwards, the
    all-reduce's copy. Its time: W is a weight share of the backward (half, times the
    share of parameter bytes that train), B and W together 4 % longer than one backward;
    on equal stages the step is S (F + B - W) less one B - W, plus m (F + B + W), plus
    S - 1 times what W exceeds F by, plus with three stages or more the least of F and
    2 W - F where that is positive (how the simulator runs ZB-H1's lists when F <= B)."""
    f = stage_figures(table, space, i, j, r, m, 1, 0, zero, offload, first=first, stage=s,
                      stages=S)
    k = [int(x) for x in table.sizes].index(f.samples)
    A = w = 0.0
    ws = -math.inf
    for b in range(i, j):
        A += float(table.act[k][b])
        ws = max(ws, float(table.workspace[k][b]))
    c = float(table.cut[k][i]) + float(table.cut[k][j])
    for b in range(i, j):
        w += (1.5 * (float(table.act[k][b])) if table.wheld is None
              else float(table.wheld[k][b]))
    if table.wheld is None:
        w += 1.5 * c
    C = _casts(table, k, i, j)  # shared by the micro-batches: held once
    A -= C
    if i == 0:  # a first stage's B makes nothing: its micro-batches stay whole until W
        w = A + c
    grad, param = float(table.grad_bytes[i][j]), float(table.param_bytes[i][j])
    peak = max(grad + whole * (A + c) + held * w for whole, held in zbh1_held(s, S, m))
    copy = min(grad, space.reduce_bucket) if r > 1 else 0.0
    if offload:
        copy = max(copy, min(f.host_state, space.reduce_bucket * space.optimizer_state_factor))
    memory = f.params + f.optimizer_state + f.outputs + C + max(peak + ws, grad + copy)
    share = 0.5 if param <= 0 else 0.5 * min(1.0, grad / param)
    W = share * f.bwd_s * (1 + OVERHEAD)
    t = f.t + OVERHEAD * f.bwd_s
    once = f.u - (m - 1) * (f.t + f.accumulate_s)  # all-reduce, gather, step, offload
    late = max(0.0, W - f.fwd_s)
    queued = max(0.0, min(f.fwd_s, 2 * W - f.fwd_s)) if S > 2 else 0.0
    u = (m - 1) * (t + f.accumulate_s) + once + 2 * W - late + queued
    return t - 2 * W + late, u, memory


def zbh1_variant(table: CostTable, space: SearchSpace, i: int, j: int, r: int, m: int, s: int,
                 S: int, budget: float, first: int = 0
                 ) -> tuple[float, float, StageChoice] | None:
    """The stage as the policy runs it under ZB-H1: its first allowed variant without
    recomputation or parameters on the host that fits (an unsharded one passed over where
    its sharded twin's u is smaller); None if none fits."""
    ok = [(zeta, omega) for rho, zeta, omega, h, phi in allowed(space, table)
          if not rho and not h and not phi]
    if cannot_run(table, space, i, j, r, m):
        return None
    for zeta, omega in ok:
        t, u, mem = zbh1_figures(table, space, i, j, r, m, s, S, zeta, omega, first)
        if not zeta and (True, omega) in ok and \
                zbh1_figures(table, space, i, j, r, m, s, S, True, omega, first)[1] < u:
            continue
        host = stage_figures(table, space, i, j, r, m, 1, 0, zeta, omega,
                             first=first, stage=s, stages=S).host_state
        if mem <= budget and host <= space.host_budget:
            return t, u, StageChoice(i, j, r, False, zeta and r > 1, omega)
    return None


def plan_figures(table: CostTable, space: SearchSpace, stages: tuple[StageChoice, ...], m: int,
                 schedule: str) -> tuple[float, list[Figures]]:
    """The step time and each stage's figures of a plan."""
    S = len(stages)
    figs = [stage_figures(table, space, st.start, st.end, st.replicas, m,
                          in_flight(schedule, m, S - s), st.level, st.zero, st.offload,
                          st.host, st.full, first=sum(x.replicas for x in stages[:s]), stage=s,
                          stages=S)
            for s, st in enumerate(stages)]
    return sum(f.t for f in figs) + max(f.u for f in figs), figs


@dataclass(frozen=True)
class Best:
    step: float
    m: int
    schedule: str
    stages: tuple[StageChoice, ...]


@dataclass
class Verdict:
    """The optimum within the strict and the loose budget, and whether a plan fits without
    recomputation under GPipe (the search before schedules and recomputation)."""

    strict: Best | None = None
    loose: Best | None = None
    plain_fits: bool = False


def stage_counts(space: SearchSpace, B: int) -> list[int]:
    if space.replicas is not None:
        return [len(space.replicas)]
    if space.stages is not None:
        return [space.stages]
    return list(range(1, min(B, space.world_size) + 1))


def plans(table: CostTable, space: SearchSpace
          ) -> Iterator[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """Every (m, stage bounds, replica counts) of the space, without schedule or recompute."""
    B, W, G = table.num_blocks, space.world_size, space.global_batch
    for m in sorted(set(space.micro_batches)):
        for S in stage_counts(space, B):
            comps = ([tuple(space.replicas)] if space.replicas is not None else
                     [tuple(b - a for a, b in zip((0, *c), (*c, W), strict=True))
                      for c in itertools.combinations(range(1, W), S - 1)])
            for cuts in itertools.combinations(range(1, B), S - 1):
                for reps in comps:
                    if max(reps) * m <= G and layouts_ok(space, reps):
                        yield m, (0, *cuts, B), reps


def brute_force(table: CostTable, space: SearchSpace) -> Verdict:
    """Every plan of the space (tiny inputs), each stage at the policy's variant: the optimum
    within the strict budget and within the loose one (the policy decided at each)."""
    table = _lists(table)
    out = Verdict()
    plain_space = replace(space, recompute=False, zero=False)
    for m, bounds, reps in plans(table, space):
        S = len(reps)
        # plain GPipe, to tell whether one fits
        plain = [stage_figures(table, plain_space, bounds[s], bounds[s + 1], reps[s], m, m,
                               False, first=sum(reps[:s]), stage=s, stages=S)
                 for s in range(S)]
        out.plain_fits |= max(f.memory for f in plain) <= space.memory_budget * (1 + SLACK)
    for side in ("strict", "loose"):
        budget = space.memory_budget * (1 - SLACK if side == "strict" else 1 + SLACK)
        memo: dict[tuple[int, ...], Figures | None] = {}
        best: Best | None = None
        for m, bounds, reps in plans(table, space):
            S = len(reps)
            for schedule in space.schedules:
                if schedule == "zbh1":
                    zb = [zbh1_variant(table, space, bounds[s], bounds[s + 1], reps[s], m, s,
                                       S, budget, sum(reps[:s])) for s in range(S)]
                    if all(x is not None for x in zb):
                        step = sum(x[0] for x in zb if x) + max(x[1] for x in zb if x)
                        if best is None or step < best.step:
                            best = Best(step, m, schedule, tuple(x[2] for x in zb if x))
                    continue
                got = []
                for s in range(S):
                    key = (bounds[s], bounds[s + 1], reps[s], m, in_flight(schedule, m, S - s),
                           sum(reps[:s]), s, S)
                    if key not in memo:
                        memo[key] = variant(table, space, *key[:5], budget, *key[5:])
                    got.append(memo[key])
                figs = [f for f in got if f is not None]
                if len(figs) < S:
                    continue
                step = sum(f.t for f in figs) + max(f.u for f in figs)
                if best is None or step < best.step:
                    stages = tuple(StageChoice(bounds[s], bounds[s + 1], reps[s],
                                               figs[s].recompute, figs[s].zero,
                                               figs[s].offload, figs[s].layers,
                                               figs[s].selective, figs[s].host)
                                   for s in range(S))
                    best = Best(step, m, schedule, stages)
        setattr(out, side, best)
    return out


def least_largest_stage(table: CostTable, space: SearchSpace) -> float:
    """The least largest-stage memory over the space's plans (oracle figures): the plans of
    ``plans``, for each micro-batch count and schedule, as a first stage and the best of the
    rest, whose stages are one fewer from the end (an enumeration of every plan, factored:
    min over plans of max over stages)."""
    table = _lists(table)
    B, W, G = table.num_blocks, space.world_size, space.global_batch
    memo: dict[tuple[int, int, int, int, int], float] = {}

    def least(i: int, j: int, r: int, m: int, n: int) -> float:
        if cannot_run(table, space, i, j, r, m):
            return math.inf
        if (i, j, r, m, n) not in memo:
            figs = [stage_figures(table, space, i, j, r, m, n, *v)
                    for v in allowed(space, table)]
            memo[i, j, r, m, n] = min(f.memory if f.host_state <= space.host_budget
                                      else math.inf for f in figs)
        return memo[i, j, r, m, n]

    def rest_of(m: int, schedule: str) -> Callable[[int, int, int], float]:
        rest: dict[tuple[int, int, int], float] = {}

        def after(i: int, w: int, d: int) -> float:
            """The least largest of d stages on blocks [i, B) and w ranks (forced replicas:
            the last d of them), the first d from the end."""
            if d == 0:
                return -math.inf if i == B and (w == 0 or space.replicas) else math.inf
            if (i, w, d) not in rest:
                n = in_flight(schedule, m, d)
                forced = space.replicas
                reps = [forced[len(forced) - d]] if forced else range(1, w - d + 2)
                out = math.inf
                for j in range(i + 1, B - d + 2):
                    for r in reps:
                        if not placeable(space, W - w, r) or not count_placed(space, r):
                            continue  # over part of a node, or a count not placed
                        if r * m <= G and (then := after(j, w - r, d - 1)) < out:
                            out = min(out, max(least(i, j, r, m, n), then))
                rest[i, w, d] = out
            return rest[i, w, d]

        return after

    best = math.inf
    for m in sorted(set(space.micro_batches)):
        for schedule in space.schedules:
            after = rest_of(m, schedule)  # its memo serves every stage count
            best = min([best, *(after(0, W, S) for S in stage_counts(space, B))])
    return best


Label = tuple[float, float, tuple[StageChoice, ...]]


def _front(new: list[Label]) -> list[Label]:
    """The labels no other label beats on both sum t and max u."""
    new.sort(key=lambda x: (x[0], x[1]))
    front, low = [], math.inf
    for lab in new:
        if lab[1] < low:
            front.append(lab)
            low = lab[1]
    return front


def pareto(table: CostTable, space: SearchSpace) -> Best | None:
    """Exact optimum by labels (sum of t, max of u) per (block, ranks, stages so far), for
    each m, schedule and -- under 1F1B or when forced -- total stage count S, so that a stage's
    position from the end is known; each stage at the policy's variant. No pruning beyond
    dominance."""
    table = _lists(table)
    B, W, G = table.num_blocks, space.world_size, space.global_batch
    memo: dict[tuple[int, ...], Figures | None] = {}
    best: Best | None = None

    def extend(labels: dict[tuple[int, int, int], list[Label]], j: int, used: int, s: int,
               m: int, n: int) -> list[Label]:
        """Labels at (j, used) whose last stage is the s-th (0: not counted)."""
        new: list[Label] = []
        allowed = [space.replicas[s - 1]] if space.replicas is not None else range(1, W + 1)
        allowed = [r for r in allowed if r <= used and m * r <= G]
        before = max(s - 1, 0)
        for i in range(j):
            for r in allowed:
                prev = labels.get((i, used - r, before))
                if not prev or not placeable(space, used - r, r) or not count_placed(space, r):
                    continue
                key = (i, j, r, m, n, used - r, s)
                if key not in memo:  # forced replicas: stage s - 1 of their count
                    memo[key] = variant(table, space, i, j, r, m, n, first=used - r,
                                        stage=max(s - 1, 0),
                                        stages=len(space.replicas or (1,)))
                f = memo[key]
                if f is not None:
                    st = StageChoice(i, j, r, f.recompute, f.zero, f.offload, f.layers,
                                     f.selective, f.host)
                    new += [(a + f.t, max(b, f.u), (*p, st)) for a, b, p in prev]
        return _front(new)

    for m, schedule in itertools.product(sorted(set(space.micro_batches)), space.schedules):
        counted = schedule == "1f1b" or space.stages is not None or space.replicas is not None
        for S in stage_counts(space, B) if counted else [0]:
            labels: dict[tuple[int, int, int], list[Label]] = {(0, 0, 0): [(0.0, 0.0, ())]}
            for s in range(1, S + 1) if S else [0]:
                n = in_flight(schedule, m, S - s + 1)
                for j in range(1, B + 1):
                    for used in range(1, W + 1):
                        if front := extend(labels, j, used, s, m, n):
                            labels[(j, used, s)] = front
            for a, b, plan in labels.get((B, W, S), []):
                if best is None or a + b < best.step:
                    best = Best(a + b, m, schedule, plan)
    return best
