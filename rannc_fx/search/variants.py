"""A stage's variants and the terms that depend on its replica count: how it holds its
activations (recomputation), its optimizer state (sharded over its replicas, ZeRO-1; in
host memory, offloaded) and its parameters (in host memory, fetched at each use; or sharded
over its replicas with their gradients and state, ZeRO-3, all-gathered at each use), and
what those cost per micro-batch, once a step and after the backwards.

This module imports numpy only (no torch). ``cost_model``'s docstring has the formulas; here are
the ones a variant changes: up_s (all-reduce, all-gather, optimizer step, the offloaded
state's round trip), the state a replica keeps on its device and on its host, and the
transient after the backwards. A stage takes the first variant of ``VARIANTS`` that fits.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .nodes import collective_s
from .problem import SearchSpace, StageChoice

__all__ = ["TWIN", "VARIANTS", "Variant", "after_transient", "allreduce_s", "choice", "dominated",
           "host_bytes", "host_state", "host_step_s", "shard_s", "state_saved", "update_s",
           "variants"]


def after_transient(space: SearchSpace, grad: np.ndarray, reps: np.ndarray,
                    zero: bool | np.ndarray = False, offload: bool | np.ndarray = False,
                    full: bool = False) -> np.ndarray:
    """tr: what exists beside the gradients after the backwards, at most: the gradient
    all-reduce's copy of a bucket of them (r > 1; with the gradients in host memory, the
    bucket the all-reduce brings to the device), or, offloaded, a bucket's optimizer state
    brought to the device for its step; fully sharded (``full``), nothing: its gradients
    were reduce-scattered by the backwards."""
    copy = np.where(np.asarray(reps) > 1, np.minimum(grad, space.reduce_bucket), 0.0)
    if full:
        return np.where(np.asarray(reps) > 1, 0.0 * copy, copy)
    bucket = np.minimum(host_state(space, grad, reps, zero, True),
                        space.reduce_bucket * space.optimizer_state_factor)
    return np.where(np.asarray(offload), np.maximum(copy, bucket), copy)


def allreduce_s(space: SearchSpace, grad: np.ndarray, reps: np.ndarray,
                zero: bool | np.ndarray = False) -> np.ndarray:
    """ar_s of stages with ``grad`` gradient bytes on ``reps`` replicas (broadcasting): a
    ring all-reduce (hierarchical over whole nodes, ``nodes.collective_s``), or where the stage is sharded (``zero``) and the space shards the
    gradients too (ZeRO-2), a reduce-scatter, half of it."""
    r = np.asarray(reps, float)
    whole = collective_s(space, grad, r)
    if not space.grad_shards:
        return whole
    return np.where(np.asarray(zero) & (r > 1), whole / 2, whole)


def update_s(space: SearchSpace, grad: np.ndarray, opt: np.ndarray, reps: np.ndarray,
             zero: bool | np.ndarray, offload: bool | np.ndarray = False,
             host: bool = False, full: bool = False) -> np.ndarray:
    """up_s: the once-a-step part of u, all-reduce, optimizer step and, offloaded, the
    replica's optimizer state to the device and back (broadcasting); ``host``: the
    parameters in host memory, the all-reduce's buckets to the device and back (r > 1) and
    the optimizer step on the host (``host_step_s``); ``full`` (ZeRO-3, r > 1): the step of
    the replica's shard alone, nothing to reduce or gather (the backwards reduce-scattered
    the gradients, each replica steps the parameters it holds)."""
    ar = allreduce_s(space, grad, reps, zero)
    if full:
        r = np.asarray(reps, float)
        return np.where(r > 1, opt / r, ar + opt)
    if host:
        r = np.asarray(reps, float)
        bounce = np.where(r > 1, 2 * grad / (space.host_bandwidth or np.inf), 0.0)
        return ar + bounce + host_step_s(space, grad)
    r = np.asarray(reps, float)
    sharded = ar + (collective_s(space, grad, r, 1.0) + opt / r)
    up = np.where(np.asarray(zero) & (r > 1), sharded, ar + opt)  # ar: ZeRO-2's is halved
    if space.host_bandwidth is None or not np.any(offload):
        return up
    moved = 2 * host_state(space, grad, reps, zero, True) / space.host_bandwidth
    return np.where(np.asarray(offload), up + moved, up)


def shard_s(space: SearchSpace, params: np.ndarray, grad: np.ndarray, reps: np.ndarray,
            rho: int) -> tuple[np.ndarray, np.ndarray]:
    """ZeRO-3: one micro-batch's all-gathers of the stage's parameters (each fetched
    ``terms.fetches(rho)`` times: F, B and each forward run again) and its reduce-scatter
    of their gradients (once, in B), over the r replicas on the links the group spans
    (``nodes.collective_s``); none on one replica (broadcasting)."""
    from .terms import fetches

    r = np.asarray(reps, float)
    one = r > 1
    gather = np.where(one, fetches(rho) * collective_s(space, params, r, 1.0), 0.0)
    return gather, np.where(one, collective_s(space, grad, r, 1.0), 0.0)


def host_step_s(space: SearchSpace, grad: np.ndarray) -> np.ndarray:
    """The optimizer step on the host: it reads the parameters, gradients and state and
    writes the parameters and state, G (3 + 2 optimizer_state_factor) bytes, at the host
    memory's bandwidth a device has (``host_step_bandwidth``)."""
    bw = space.host_step_bandwidth or space.host_bandwidth or np.inf
    return grad * (3 + 2 * space.optimizer_state_factor) / bw


def host_bytes(space: SearchSpace, params: np.ndarray, grad: np.ndarray) -> np.ndarray:
    """host_params: what a replica keeps in host memory, its parameters, their gradients
    and their optimizer state."""
    return params + grad * (1 + space.optimizer_state_factor)


def host_state(space: SearchSpace, grad: np.ndarray, reps: np.ndarray,
               zero: bool | np.ndarray, offload: bool | np.ndarray) -> np.ndarray:
    """Optimizer-state bytes a replica keeps in host memory: its share (ZeRO-1) or all of it
    where offloaded, else 0."""
    r = np.asarray(reps, float)
    state = grad * space.optimizer_state_factor
    mine = np.where(np.asarray(zero) & (r > 1), state / r, state)
    return np.where(np.asarray(offload), mine, 0.0)


def state_saved(space: SearchSpace, grad: np.ndarray, reps: np.ndarray,
                zero: bool | np.ndarray, offload: bool | np.ndarray = False) -> np.ndarray:
    """Optimizer-state bytes a replica does not keep on its device: the other replicas'
    shares under ZeRO-1, all of it offloaded (0 with neither)."""
    r = np.asarray(reps, float)
    state = grad * space.optimizer_state_factor
    return np.where(np.asarray(offload), state,
                    np.where(np.asarray(zero) & (r > 1), state - state / r, 0.0))


class Variant(NamedTuple):
    """How a stage holds its activations, parameters and optimizer state."""

    recompute: int  # rho: 0 none, 1 the stage's forward again, 2 layer by layer, 3 selective
    # ZeRO over its replicas (none to shard over: no effect): the optimizer state sharded,
    # and the gradients too where the space says ``grad_shards``
    zero: bool
    offload: bool = False  # its (share of the) optimizer state in host memory
    host: bool = False  # parameters, gradients and state in host memory, fetched at each use
    # ZeRO-3 (with ``zero``): parameters, gradients and state sharded over the replicas,
    # each parameter all-gathered at each use, its gradient reduce-scattered in each backward
    full: bool = False


# A stage's variants in the order a stage takes the first that fits: offloaded, sharded
# first (the state moved each step is then a share), fully sharded after those (its
# all-gathers and reduce-scatter come every micro-batch); recomputation after all of them,
# selective first (it reruns part of a forward, and keeps part of its activations), then the
# whole forward again, then layer by layer (a forward more per micro-batch) after that; the
# parameters in host memory last of all (every micro-batch fetches them), at each level.
# The planner also searches every stage fully sharded (``planner/driver.py``), which wins
# where the per-micro-batch traffic costs less than the state's round trip or a recomputation
VARIANTS: tuple[Variant, ...] = tuple(
    Variant(rho, zero, offload, False, full) for rho in (0, 3, 1, 2)
    for zero, offload, full in ((False, False, False), (True, False, False),
                                (True, True, False), (False, True, False),
                                (True, False, True))) + tuple(
    Variant(rho, False, False, True) for rho in (0, 3, 1, 2))


# each unsharded variant's sharded twin: the same recomputation and offloading
TWIN = {k: next(j for j, w in enumerate(VARIANTS)
                 if w.zero and (w.recompute, w.offload) == (v.recompute, v.offload))
         for k, v in enumerate(VARIANTS) if not (v.zero or v.host or v.full)}


def dominated(u: np.ndarray, kinds: list[int]) -> np.ndarray:
    """(..., variants): an unsharded variant whose sharded twin is allowed and has a smaller u
    (the twin's memory is never more and its t the same: the stage takes the twin)."""
    out = np.zeros(u.shape, bool)
    for v in kinds:
        if v in TWIN and TWIN[v] in kinds:
            out[..., v] = u[..., TWIN[v]] < u[..., v]
    return out



def choice(start: int, end: int, replicas: int, kind: int) -> StageChoice:
    """The stage of variant ``kind`` (one replica: nothing to shard)."""
    v = VARIANTS[kind]
    return StageChoice(start, end, replicas, v.recompute in (1, 2), v.zero and replicas > 1,
                       v.offload, layers=v.recompute == 2, selective=v.recompute == 3,
                       host=v.host, full=v.full and replicas > 1)


_RECOMPUTE = {None: (0, 1, 2, 3), False: (0,), True: (1, 2, 3)}
_LAYERS = {None: (0, 1, 2, 3), False: (0, 1, 3), True: (0, 2)}
_SELECTIVE = {None: (0, 1, 2, 3), False: (0, 1, 2), True: (0, 3)}


def variants(space: SearchSpace, segmented: bool = True, selective: bool = True) -> list[int]:
    """Indices into ``VARIANTS`` the space allows, in chain order (offloading only where the
    device has a host to offload to; layer by layer only where the model has layers,
    ``segmented``; selectively only where the table costs it, ``selective``)."""
    host = space.host_bandwidth is not None and space.host_budget > 0
    return [k for k, v in enumerate(VARIANTS)
            if v.recompute in _RECOMPUTE[space.recompute] and v.recompute in _LAYERS[space.layers]
            and v.recompute in _SELECTIVE[space.selective]
            and (segmented or v.recompute != 2) and (selective or v.recompute != 3)
            and space.zero in (None, v.zero) and space.offload in (None, v.offload)
            and space.full_shard in (None, v.full)
            and space.host_params in (None, v.host) and (host or not (v.offload or v.host))]
