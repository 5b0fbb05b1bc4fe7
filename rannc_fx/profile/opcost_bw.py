"""What one op holds between a split backward's ``B`` and its ``W``.

A zero-bubble schedule runs a micro-batch's backward in two parts (``runtime/backward_split``):
``B`` makes the inputs' gradients and drops every saved tensor that ``W`` will not read; ``W``,
later, makes the weight matrices' gradients. Between the two, the micro-batch holds what the
weight GEMMs read (a Linear's input, a convolution's) and the gradients kept for the nodes
``W`` starts from (a Linear's output gradient), not the saved tensors of normalizations,
activations or attention. The profile measures that per op by running the runtime's own
split on the op alone: its forward under ``keeping_for_split``, then ``B`` (the op's inputs
that need a gradient are the path ``B`` follows, as a stage's inputs are), and reads what
is left. Storages are reported as ``opcost`` reports saved ones (input and output positions,
bytes made inside the op), so the profile charges each once, to the node that made it.

Per op this agrees with a stage's split wherever the op's inputs need gradients in the stage
too. An op whose inputs need none (the embeddings of the ids) runs its whole backward in
``W`` and holds what it saved, not the gradient ``W`` starts it from, which it does not own
(a first stage's output gradient: the search counts a first stage's micro-batches whole
between its ``B`` and its ``W``, its ``B`` making nothing, ``search.terms``; elsewhere a
node's above it, which several such ops share).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..runtime.backward_split import SavedBoxes, backward_inputs, keeping_for_split
from .instruments import differentiable, first_positions, storage_id, tensors
from .opcost import OpCall

__all__ = ["WeightHeld", "weight_held"]


class WeightHeld(NamedTuple):
    inputs: tuple[int, ...] = ()  # positions of inputs whose storage W reads
    outputs: tuple[int, ...] = ()  # positions of outputs whose storage W reads
    internal: int = 0  # bytes of storages made inside the op that W reads
    grads: int = 0  # bytes of the gradients kept for W's first nodes


def weight_held(call: OpCall) -> WeightHeld:
    """What ``call`` holds between ``B`` and ``W`` (nothing without a weight matrix that
    needs a gradient: ``B`` does all of its backward)."""
    run, bound = call.bind()
    params = [p for p in call.params if p.requires_grad] + [
        t for t in bound if storage_id(t) in call.excluded and t.requires_grad]
    if not any(p.dim() >= 2 for p in params) or all(
            storage_id(t) in call.excluded for t in bound):
        # no weight matrix; or an op on parameters alone (a weight's transpose): W runs it on
        # its way to the parameter, starting from the node above, which holds the gradient
        return WeightHeld()
    boxes = SavedBoxes()
    with torch.enable_grad(), keeping_for_split(boxes):
        out = run()
    outs = [t for t in tensors(out) if t.requires_grad and t.grad_fn is not None]
    if not outs:
        return WeightHeld()
    inputs = [t for t in bound if t.requires_grad and differentiable(t)
              and storage_id(t) not in call.excluded]
    grads_before = [(t, t.grad) for t in [*inputs, *params]]
    try:
        work = backward_inputs(outs, [torch.ones_like(t) for t in outs], inputs, params, boxes)
    finally:  # B accumulates into .grad: leave the model's and the inputs' as they were
        for t, g in grads_before:
            t.grad = g
    held = {storage_id(b.tensor): b.tensor for b in boxes if b.tensor is not None}
    held = {s: t for s, t in held.items() if s not in call.excluded}
    in_ids, out_ids = [storage_id(t) for t in bound], [storage_id(t) for t in tensors(out)]
    kept_grads = {storage_id(g): g for grads in work.kept.values() for g in grads
                  if g is not None}
    if inputs:  # else W runs the op's whole backward from a gradient it does not own: a
        # first stage's (counted whole, ``search.terms``), or a node's above it, shared
        kept_grads.update({storage_id(g): g for group in work.groups
                           for _, _, g in group.seeded})
    return WeightHeld(
        inputs=first_positions(in_ids, held),
        outputs=first_positions(out_ids, {s for s in held if s not in in_ids}),
        internal=sum(_nbytes(t) for s, t in held.items() if s not in in_ids and s not in out_ids),
        grads=sum(_nbytes(g) for g in kept_grads.values()),
    )


def _nbytes(t: torch.Tensor) -> int:
    return int(t.untyped_storage().nbytes())
