"""Selective recomputation: which ops' outputs a stage keeps for its backward.

A stage that recomputes selectively runs each micro-batch's forward once, with gradients,
under non-reentrant activation checkpointing with a selective policy
(``torch.utils.checkpoint.create_selective_checkpoint_contexts``): the outputs of the ops in
``KEPT`` are kept; every other op's saved tensors are dropped, and the backward runs those
ops again, from the stage's inputs and the kept outputs, right before it needs them.

``KEPT`` are the ops whose cost is their arithmetic and whose outputs are small for it:
matrix products with a weight (``mm``, ``addmm``), convolutions, and fused attention kernels
(which keep no score matrix). Everything else is recomputed: normalizations, activations,
dropout (its random state replayed), elementwise ops and, where attention is not fused, its
score matrix (``bmm``, softmax, dropout over sequence x sequence values): the largest
activations a transformer layer makes, for a few percent of its arithmetic. Batched products
(``bmm``, ``baddbmm``) are recomputed for that reason: in attention they make the scores.

The profile (``profile/opcost.py``) counts, per op it costs, the bytes of the kept ops'
outputs and what those ops cost, with this same ``kept``; the cost model's selective
variant holds those bytes for every micro-batch in flight and runs the rest of the forward
again inside the backward. The runtime (``runtime/stage.py``) checkpoints with ``policy``.
So planning and running agree op by op, on whatever ops the model's graph dispatches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

__all__ = ["KEPT", "checkpointed", "contexts", "kept", "policy"]

_aten = torch.ops.aten

KEPT = frozenset({
    _aten.mm, _aten.addmm, _aten._addmm_activation,
    _aten.convolution, _aten._convolution,
    _aten._scaled_dot_product_flash_attention, _aten._scaled_dot_product_efficient_attention,
    _aten._scaled_dot_product_cudnn_attention, _aten._scaled_dot_product_flash_attention_for_cpu,
    _aten._scaled_dot_product_fused_attention_overrideable,
    _aten._flash_attention_forward, _aten._efficient_attention_forward,
})


def kept(func: Any) -> bool:
    """Whether selective recomputation keeps the outputs of ``func`` (an aten overload)."""
    return getattr(func, "overloadpacket", None) in KEPT


def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The checkpoint policy: keep ``KEPT`` ops' outputs, recompute the others."""
    return CheckpointPolicy.MUST_SAVE if kept(func) else CheckpointPolicy.PREFER_RECOMPUTE


def contexts(recompute_scope: Callable[[], AbstractContextManager[Any]] | None = None
             ) -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
    """``context_fn``'s pair for ``torch.utils.checkpoint``: the selective policy's forward
    and recomputation contexts, the recomputation also inside ``recompute_scope()``."""
    fwd, again = create_selective_checkpoint_contexts(policy)
    if recompute_scope is None:
        return fwd, again
    # the scope first: what it does to the buffers is no op of the recomputation (the
    # policy's recomputation replays the forward's ops by position)
    return fwd, _within(recompute_scope(), again)


def checkpointed(module: Callable[..., Any], args: Any,
                 recompute_scope: Callable[[], AbstractContextManager[Any]] | None = None
                 ) -> Any:
    """``module(*args)`` under selective activation checkpointing (non-reentrant): what its
    backward reruns runs on this forward's random state, inside ``recompute_scope``.

    Autocast's cache of cast weights is off inside: the policy replays the forward's ops by
    position, and a forward that found a weight's cast in the cache (an earlier micro-batch
    of the same autocast region cast it) dispatches no cast where its recomputation, in a
    region of its own (GPipe's backwards run after the call), does. Each micro-batch then
    casts its weights itself, as the first does anyway."""
    cached = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        return checkpoint(module, *args, use_reentrant=False, preserve_rng_state=True,
                          context_fn=lambda: contexts(recompute_scope))
    finally:
        torch.set_autocast_cache_enabled(cached)


@contextlib.contextmanager
def _within(outer: AbstractContextManager[Any], inner: AbstractContextManager[Any]
            ) -> Iterator[None]:
    with outer, inner:
        yield
