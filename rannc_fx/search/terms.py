"""The cost model's formulas (``cost_model``'s docstring states them): one stage's time and memory
terms at one size, as arrays over stages [i, j).

This module imports numpy only (no torch).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from ..schedules.bw_split import SPLIT_OVERHEAD, weight_share
from .cost_model import range_max
from .problem import CostTable, SearchSpace

__all__ = ["HELD", "SELECTIVE", "TERMS", "StageTerms", "fetches", "held_bytes", "kept_cuts",
           "outputs_held", "reruns", "stage_memory", "stage_terms"]

SELECTIVE = 3  # rho of selective recomputation (``rannc_fx.plan.selective``)

# Where the cost table does not say what a micro-batch holds between a split backward's B and
# its W (``CostTable.wheld``): all of it, and this much more (of its activations and cut values)
# for the gradients its W reads: measured on the runtime_common GPT (d 256, ZBV on 2 ranks)
# when B still kept every saved tensor
HELD = 0.5


def reruns(rho: int) -> bool:
    """Whether level rho runs the stage's forward again before each backward (``R``),
    keeping only its inputs in between: 1 and 2; selective recomputation (3) keeps the
    outputs of its kept ops instead and reruns the rest inside the backward."""
    return rho in (1, 2)


def fetches(rho: int) -> int:
    """How often a stage whose parameters are in host memory fetches each of them per
    micro-batch at level rho: in F and in B, and once more for each forward run again (R;
    layer by layer, R and the backward's rerun; selectively, the backward's rerun)."""
    return 2 + (2 if rho == 2 else 1 if rho else 0)


@dataclass(frozen=True)
class StageTerms:
    """The terms of the stages [i, j) at one size (arrays over the stages, or broadcastable).

    The one place the time and memory formulas are written.
    """

    fb: np.ndarray  # F + Bw
    fwd: np.ndarray  # F: what recomputation runs again
    again: np.ndarray  # layer by layer, what the backward runs once more (F less the last layer)
    comm: np.ndarray  # 2 (cin + cout) / link_bw + 2 lat ([i > 0] + [j < B])
    fixed: np.ndarray  # params + grads * optimizer_state_factor + m out + output_bytes
    grads: np.ndarray  # G
    act: np.ndarray  # A
    casts: np.ndarray  # C, of A: autocast's weight copies, held once (not recomputing)
    seg: np.ndarray  # K + a_max: what recomputing layer by layer holds instead of A
    keep: np.ndarray  # what selective recomputation keeps of a micro-batch's activations
    redo: np.ndarray  # the forward it runs again inside the backward
    rebuilt: np.ndarray  # of A, what that rerun rebuilds (saved, and no kept op's output)
    wheld: np.ndarray  # what a micro-batch holds between a split backward's B and its W
    cuts: np.ndarray  # cin + cout
    cout: np.ndarray  # cout: a recomputing stage sends it on and rebuilds it in R
    ws: np.ndarray  # max workspace
    params: np.ndarray  # P: parameter bytes
    window: np.ndarray  # W: the largest block's parameter bytes (host_params fetches ahead)
    outs: np.ndarray  # m out + output_bytes (part of ``fixed``)
    # the parameter and gradient bytes of tensors shared with blocks outside the stage (a
    # tied embedding and LM head in two stages): a fully sharded stage keeps them whole
    apart_p: np.ndarray
    apart_g: np.ndarray
    apart_s: np.ndarray  # their optimizer state
    m: int  # micro-batches
    host_bw: float = np.inf  # bytes/s device <-> host (host_params' transfers)
    host_overlap: bool = True  # they overlap the compute (else add to it)

    def time(self, rho: int, host: bool = False,
             shard: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """t at recomputation level rho (0 none, 1 the stage's forward again, 2 layer by
        layer, 3 selective: forwards run again before or inside a backward); ``host``:
        the parameters in host memory, their fetches and the gradients' way back overlapped
        with the compute (the slower of the two), or added to it (``host_overlap`` False);
        ``shard``: fully sharded (ZeRO-3), one micro-batch's all-gathers and reduce-scatter
        (``variants.shard_s``), the all-gathers fetched ahead as host_params' transfers
        are, the reduce-scatter after the backward that makes its gradients."""
        compute = self.fb + self.recomputed(rho)
        if host:
            compute = (np.maximum(compute, self.fetch_s(rho)) if self.host_overlap
                       else compute + self.fetch_s(rho))
        if shard is not None:
            gather, scatter = shard
            compute = (np.maximum(compute, gather) if self.host_overlap
                       else compute + gather) + scatter
        return compute + self.comm

    def fetch_s(self, rho: int) -> np.ndarray:
        """host_params: one micro-batch's transfers, ``fetches(rho)`` P to the device and
        the gradients G back."""
        return (fetches(rho) * self.params + self.grads) / self.host_bw

    def recomputed(self, rho: int) -> np.ndarray:
        """The forward seconds run again per micro-batch at level rho."""
        return (0.0 * self.fwd if not rho else self.fwd if rho == 1
                else self.redo if rho == SELECTIVE else self.fwd + self.again)

    def held(self, rho: int) -> np.ndarray:
        """One micro-batch's activations at level rho: A less the weight copies every
        micro-batch shares (C, ``shared_casts``), recomputing A, layer by layer K + a_max, or
        selectively what its backward rebuilds (every micro-batch in flight keeps ``keep``
        besides)."""
        return (self.seg if rho == 2 else self.rebuilt if rho == SELECTIVE
                else self.act if rho else self.act - self.casts)

    def memory(self, n: int | np.ndarray, rho: int,
               transient: np.ndarray | float = 0.0, host: bool = False,
               full: np.ndarray | int | None = None) -> np.ndarray:
        """memory_s; ``host``: the parameters, gradients and optimizer state in host memory,
        the device holding two windows of fetched parameters (those in use and those
        fetched ahead) and a window of gradients on their way back; ``full``: the replica
        counts of a fully sharded stage (ZeRO-3, r > 1), which holds 1 / r of its
        parameters and gradients, the same two windows gathered and a window of whole
        gradients before their reduce-scatter (its optimizer state is ZeRO-1's share: the
        caller takes ``variants.state_saved`` off)."""
        fixed, grads = (self.outs + 2 * self.window, self.window) if host else (
            self.fixed, self.grads)
        if full is not None:
            r = np.maximum(np.asarray(full, float), 1.0)
            sharded, whole = r > 1, 1 - 1 / r
            # the tensors shared with other stages whole, and their state (the caller takes
            # off ZeRO-1's saving over the whole state: 1 / r of it is left, and the
            # shared tensors' state whole)
            fixed = np.where(sharded, self.fixed - self.params + self.params / r
                             + whole * self.apart_p + 2 * self.window
                             + whole * self.apart_s, fixed)
            grads = np.where(sharded, self.grads / r + whole * self.apart_g + self.window,
                             grads)
        fixed = fixed + self.shared_casts(rho)
        return stage_memory(fixed, grads, self.held(rho), self.cuts, self.cout,
                            self.ws, n, self.m, reruns(rho), transient,
                            self.keep if rho == SELECTIVE else None)

    def shared_casts(self, rho: int) -> np.ndarray:
        """The weight copies the stage holds once at level rho: C without recomputation (the
        micro-batches in flight share autocast's), else none (each backward's forward makes
        its own: part of one micro-batch's activations)."""
        return self.casts if not rho else 0.0 * self.casts

    def memory_zbh1(self, x: int | np.ndarray, held: int,
                    transient: np.ndarray | float = 0.0) -> np.ndarray:
        """memory_s under ZB-H1 without recomputation: the stage holds ``held`` = min(m, S)
        micro-batches from their F to their W, at position x = min(held, d) at most x of
        them whole (F to B) and the rest between their B and their W (``wheld``); its peak
        is one of two corners of its list (x whole, or x - 1 whole and one more between B
        and W), the first where a micro-batch whole weighs at least what it holds between
        B and W. The gradients meet all of it (forwards follow the first backward), the
        all-reduce's transient after the backwards as under 1F1B."""
        n = self.zbh1_whole(x)
        peak = self.grads + n * (self.held(0) + self.cuts) + (held - n) * self.wheld
        return self.fixed + self.casts + np.maximum(peak + self.ws, self.grads + transient)

    def zbh1_whole(self, x: int | np.ndarray) -> np.ndarray:
        """How many micro-batches a ZB-H1 stage holds whole at its peak (``memory_zbh1``):
        x, or x - 1 where one between B and W weighs more than one whole."""
        return np.where(self.held(0) + self.cuts >= self.wheld, x, np.asarray(x) - 1)

    def zbh1_times(self, rho: int, acc: np.ndarray, up: np.ndarray, queue: bool = True
                   ) -> tuple[np.ndarray, np.ndarray]:
        """t and u under ZB-H1 at level rho (``acc``: the accumulation, ``up``: up_s), with
        W = the weight share of the backward and B the rest (together ``SPLIT_OVERHEAD``
        longer than one backward). On S equal stages the simulator runs ZB-H1's lists in

            (S - 1) (F + B - W) + m (F + B + W) + (S - 1) max(0, W - F)
                + [S >= 3] max(0, min(F, 2 W - F))

        (fill and drain, steady state, a W longer than the F it fills in for, and the queue
        of W behind the first stage's; exact for m >= S and F <= B, checked on random
        stages), written per stage as the search sums them (``queue``: S >= 3):

            t' = t + ov Bw - 2 W + max(0, W - F)
            u' = (m - 1) (t + ov Bw + acc) + up + 2 W - max(0, W - F)
                 + [queue] max(0, min(F, 2 W - F))

        On unequal stages the simulator's step is the plan's."""
        bw = self.fb - self.fwd
        w = weight_share(self.grads, self.params) * bw * (1 + SPLIT_OVERHEAD)
        t = self.time(rho) + SPLIT_OVERHEAD * bw
        late = np.maximum(0.0, w - self.fwd)
        queued = np.maximum(0.0, np.minimum(self.fwd, 2 * w - self.fwd)) if queue else 0.0
        return t - 2 * w + late, (self.m - 1) * (t + acc) + up + 2 * w - late + queued

    def take(self, idx: np.ndarray) -> StageTerms:
        return StageTerms(**{f: np.asarray(getattr(self, f))[idx] for f in TERMS}, m=self.m,
                          host_bw=self.host_bw, host_overlap=self.host_overlap)

    def column(self) -> StageTerms:
        """The terms as (stages, 1) columns, to broadcast against (stages, k) arrays."""
        return StageTerms(**{f: np.asarray(getattr(self, f))[:, None] for f in TERMS},
                          m=self.m, host_bw=self.host_bw, host_overlap=self.host_overlap)


TERMS = ("fb", "fwd", "again", "comm", "fixed", "grads", "act", "casts", "seg", "keep", "redo",
         "rebuilt", "wheld", "cuts", "cout", "ws", "params", "window", "outs", "apart_p",
         "apart_g", "apart_s")


def kept_cuts(cuts: np.ndarray, cout: np.ndarray, n: int | np.ndarray,
              recompute: bool) -> np.ndarray:
    """Cut values held with n micro-batches in flight: inputs and outputs of each, or, when
    recomputing, the inputs of each and one micro-batch's outputs."""
    return n * (cuts - cout) + cout if recompute else n * cuts


def held_bytes(grads: np.ndarray, act: np.ndarray, cuts: np.ndarray, cout: np.ndarray,
               n: int | np.ndarray, m: int, recompute: bool,
               keep: np.ndarray | None = None) -> np.ndarray:
    """Gradients, activations and cut values at the stage's peak (the docstring's formula
    without the overlap subtracted out: what coexists). ``keep``: recomputing selectively,
    what each micro-batch in flight keeps (with its inputs and outputs), ``act`` then what its
    backward rebuilds; with a forward after the first backward (n < m) the gradients meet
    all of it, else as the other levels: at the first backward the rebuilt activations
    give way to the gradients, at the second one micro-batch fewer is held."""
    if keep is not None:
        h = cuts + keep
        full = (np.maximum(m * h + np.maximum(act, grads), (m - 1) * h + act + grads)
                if m > 1 else h + np.maximum(act, grads))
        return np.where(n < m, n * h + act + grads, full)
    if recompute:
        h = kept_cuts(cuts, cout, m, True)
        full = (np.maximum(h + np.maximum(act, grads), h - (cuts - cout) + act + grads)
                if m > 1 else h + np.maximum(act, grads))
        return np.where(n < m, kept_cuts(cuts, cout, n, True) + act + grads, full)
    return np.where(n < m, n * (act + cuts) + grads,
                    m * cuts + np.maximum(m * act, (m - 1) * act + grads))


def stage_memory(fixed: np.ndarray, grads: np.ndarray, act: np.ndarray, cuts: np.ndarray,
                 cout: np.ndarray, ws: np.ndarray, n: int | np.ndarray, m: int,
                 recompute: bool, transient: np.ndarray | float = 0.0,
                 keep: np.ndarray | None = None) -> np.ndarray:
    """memory_s from ``StageTerms``' parts, n micro-batches in flight, ``transient`` the
    all-reduce's or the offloaded step's bucket (``after_transient``) beside the gradients
    after the backwards; ``keep`` as ``held_bytes``."""
    held = held_bytes(grads, act, cuts, cout, n, m, recompute, keep)
    return fixed + np.maximum(held + ws, grads + transient)


def stage_terms(table: CostTable, space: SearchSpace, k: int, i: np.ndarray, j: np.ndarray,
                ws: np.ndarray, m: int) -> StageTerms:
    """The terms of the stages [i, j) at size index k with m micro-batches, given their
    largest workspace."""
    grad = np.asarray(table.grad_bytes, float)[i, j]
    cut = np.asarray(table.cut[k], float)
    both = cut[i] + cut[j]
    edges = (i > 0).astype(float) + (j < table.num_blocks).astype(float)
    A, F = _range(table.act[k], i, j), _range(table.fwd[k], i, j)
    sg = table.segments
    seg = A if sg is None else sg.transient(k, i, j, A)
    again = F if sg is None else sg.again(k, i, j, F)
    params = np.asarray(table.param_bytes, float)[i, j]
    outs = outputs_held(table, space, k, i, j, m)
    casts = 0.0 * A if table.casts is None else _range(table.casts[k], i, j)
    apart_p, apart_g = shared_apart(table)
    return StageTerms(
        fb=_range(table.fwd[k] + table.bwd[k], i, j), fwd=F, again=again,
        comm=2 * both / space.link_bandwidth + 2 * space.link_latency * edges,
        fixed=params + grad * space.optimizer_state_factor + outs,
        grads=grad, act=A, casts=casts, seg=seg,
        keep=A if table.kept is None else _range(table.kept[k], i, j),
        redo=F if table.redo is None else _range(table.redo[k], i, j),
        rebuilt=A if table.rebuilt is None else _range(table.rebuilt[k], i, j),
        # a first stage's B makes nothing (its inputs need no gradient): whole until its W
        wheld=np.where(i == 0, A - casts + both, (1 + HELD) * (A + both) if table.wheld is None
                       else _range(table.wheld[k], i, j)),
        cuts=both, cout=cut[j], ws=np.asarray(ws, float),
        params=params, window=block_params(table)[i, j], outs=outs,
        apart_p=apart_p[i, j], apart_g=apart_g[i, j],
        apart_s=apart_g[i, j] * space.optimizer_state_factor, m=m,
        host_bw=space.host_bandwidth or np.inf, host_overlap=space.host_overlap)


def _range(per_block: np.ndarray, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """The sums over blocks [i, j) of a per-block series (by its prefix sums)."""
    c = np.concatenate(([0.0], np.cumsum(per_block)))
    return c[j] - c[i]


def block_params(table: CostTable) -> np.ndarray:
    """(B + 1, B + 1): [i, j] the largest parameter bytes of one block in [i, j) (what
    host_params fetches ahead: a tensor lies in one block, so it is at least the largest
    tensor). Made once a table (the search asks for it at every size and stage)."""
    got = _WINDOWS.get(id(table))
    if got is not None and got[0]() is table:
        return got[1]
    pb = np.asarray(table.param_bytes, float)
    B = table.num_blocks
    out = np.maximum(range_max(pb[np.arange(B), np.arange(B) + 1]), 0.0)
    _WINDOWS[id(table)] = (weakref.ref(table), out)
    weakref.finalize(table, _WINDOWS.pop, id(table), None)
    return out


_WINDOWS: dict[int, tuple[weakref.ref[CostTable], np.ndarray]] = {}


def shared_apart(table: CostTable) -> tuple[np.ndarray, np.ndarray]:
    """(B + 1, B + 1) twice: [i, j] the parameter and gradient bytes of the tensors that
    blocks in [i, j) share with blocks outside it (``CostTable.shared``); made once a table."""
    got = _APART.get(id(table))
    if got is not None and got[0]() is table:
        return got[1]
    B = table.num_blocks
    ps, gs = np.zeros((B + 1, B + 1)), np.zeros((B + 1, B + 1))
    edge = np.arange(B + 1)
    for blocks, pb, gb, _ in table.shared:
        at = np.searchsorted(np.asarray(sorted(blocks)), edge)  # users before each edge
        inside = at[None, :] - at[:, None]  # [i, j]: users in [i, j)
        apart = (inside > 0) & (inside < len(blocks))
        ps += apart * pb
        gs += apart * gb
    _APART[id(table)] = (weakref.ref(table), (ps, gs))
    weakref.finalize(table, _APART.pop, id(table), None)
    return ps, gs


_APART: dict[int, tuple[weakref.ref[CostTable], tuple[np.ndarray, np.ndarray]]] = {}


def outputs_held(table: CostTable, space: SearchSpace, k: int, i: np.ndarray, j: np.ndarray,
                 m: int) -> np.ndarray:
    """m * sum(out[k, i:j]) + output_bytes: the batched model outputs the stages hold."""
    if table.out is None:
        return np.full(np.shape(i), float(space.output_bytes))
    return m * _range(table.out[k], i, j) + space.output_bytes
