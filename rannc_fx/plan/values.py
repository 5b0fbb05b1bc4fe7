"""What a value is, at any sample count and any size of the inputs' dynamic dimensions.

A plan is made at one size of every input: the example's. Between calls the sample count
changes (micro-batches, replicas, a smaller last batch) and so may the size of an input's
*dynamic dimensions* (the sequence length under dynamic padding, up to the plan's). Every
value's sizes are polynomials in those sizes, read once from a symbolic propagation: a
``Formula`` names them, ``"samples"`` standing for the sample count::

    ((64, ("input_ids.1", "samples")), (1, ()))      64 * input_ids.1 * samples + 1

so a rank works out any value's shape for the call in front of it without asking another.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["SAMPLES", "DynamicDim", "Formula", "ValueSpec", "dtype_itemsize", "evaluate",
           "formula_text"]

SAMPLES = "samples"

# A sum of terms, each a coefficient times the product of the named sizes (a name repeated
# for a power); () is the empty sum, 0.
Formula = tuple[tuple[int, tuple[str, ...]], ...]


def evaluate(formula: Formula, sizes: Mapping[str, int]) -> int:
    """``formula`` at ``sizes`` (every name it uses must be there)."""
    return sum(c * math.prod(sizes[n] for n in names) for c, names in formula)


def formula_text(formula: Formula) -> str:
    """``formula`` as people write it: ``64*input_ids.1*samples + 1``."""
    terms = ["*".join(([str(c)] if c != 1 or not names else []) + list(names))
             for c, names in formula]
    return " + ".join(terms).replace("+ -", "- ") or "0"


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name such as ``"float32"`` (the plan's dtype strings)."""
    return int(getattr(torch, dtype).itemsize)

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class ValueSpec(BaseModel):
    """What a value is, for any number of samples, so that no rank asks another.

    For a tensor with a batch dimension, ``shape`` is its shape for ONE sample:
    ``shape[batch_dim]`` is the rows a sample contributes (1 normally, ``seq`` after a
    ``view(B * seq, h)``). A tensor with ``batch_dim=None`` is the same for every micro-batch.
    An integer (a size the graph computes) is ``int_coeffs = (a, c)``: ``a * samples + c``;
    a tuple of them (a ``torch.Size``) is one pair per element.

    A value whose sizes depend on a dynamic dimension (``DynamicDim``) has ``formulas``: one
    per tensor dimension (the whole tensor's, the sample count included) or one per integer.
    ``shape`` and ``int_coeffs`` then hold them at the plan's sizes, and ``at_sizes`` gives
    the spec at a call's.

    ``interleaved`` marks a batched tensor whose rows of different samples alternate along
    the batch dimension (a ``(seq, batch, h)`` tensor viewed as ``(seq * batch, h)``): fine
    inside a stage, but it cannot be sliced by sample, so it never crosses a stage boundary.
    ``interleave`` is its layout where known: the batch dimension holds ``interleave`` blocks
    one after another, each with every sample's ``shape[batch_dim] // interleave`` rows in
    sample order (``seq`` blocks of one row for the view above; 2 for ``cat([x, y])``)::

        rows for samples a, b, c with interleave = 2:   a0 b0 c0 | a1 b1 c1

    ``mixed`` lists the dimensions other than ``batch_dim`` that also grow with the sample
    count (a ``(batch, batch)`` similarity matrix: one entry per pair of samples). Such a value
    mixes the batch's samples, so it is made only in the model's tail, which runs once a step
    on the whole batch (``shapes/tail.py``); ``shape`` holds those dimensions per sample too.
    """

    model_config = _FROZEN

    name: str
    kind: Literal["tensor", "int", "ints", "constant"]
    dtype: str | None = None
    shape: tuple[int, ...] = ()
    batch_dim: int | None = None
    int_coeffs: tuple[tuple[int, int], ...] = ()
    requires_grad: bool = False
    interleaved: bool = False
    interleave: int | None = None
    formulas: tuple[Formula, ...] = ()
    mixed: tuple[int, ...] = ()

    @model_validator(mode="after")
    def _check_layout(self) -> ValueSpec:
        sized = len(self.shape) if self.kind == "tensor" else len(self.int_coeffs)
        if self.formulas and len(self.formulas) != sized:
            raise ValueError(
                f"value {self.name!r} has {len(self.formulas)} formulas for {sized} sizes"
            )
        if self.interleave is not None:
            rows = self.shape[self.batch_dim] if self.batch_dim is not None else 0
            if not self.interleaved or self.interleave < 2 or rows % self.interleave:
                raise ValueError(
                    f"value {self.name!r}: interleave={self.interleave} needs an interleaved "
                    f"batched tensor whose {rows} rows per sample it divides (at least 2 blocks)"
                )
        return self

    @property
    def carries_gradient(self) -> bool:
        """A floating tensor that requires a gradient (a loss, when it has no batch dim)."""
        dt = self.dtype or ""
        return (
            self.kind == "tensor"
            and self.requires_grad
            and dt.startswith(("float", "bfloat", "complex"))
        )

    def shape_for(self, samples: int, whole: int | None = None) -> tuple[int, ...]:
        """The tensor's shape when it holds ``samples`` samples (the rows of ``samples`` of
        a batch of ``whole`` along ``mixed`` dimensions: ``samples`` by default)."""
        if self.kind != "tensor":
            raise ValueError(f"value {self.name!r} is a {self.kind}, not a tensor")
        if self.batch_dim is None:
            return self.shape
        s = list(self.shape)
        s[self.batch_dim] *= samples
        for d in self.mixed:
            s[d] *= samples if whole is None else whole
        return tuple(s)

    def ints_for(self, samples: int) -> tuple[int, ...]:
        """The integer(s) this value holds when its stage sees ``samples`` samples."""
        return tuple(a * samples + c for a, c in self.int_coeffs)

    def at_sizes(self, sizes: Mapping[str, int]) -> ValueSpec:
        """This value when the dynamic dimensions have ``sizes`` (itself if it has none)."""
        if not self.formulas:
            return self
        if self.kind == "tensor":  # per sample: the batch dimension's rows for one sample
            one = {**sizes, SAMPLES: 1}
            return self.model_copy(update={"shape": tuple(evaluate(f, one) for f in self.formulas)})
        none, one = {**sizes, SAMPLES: 0}, {**sizes, SAMPLES: 1}
        coeffs = tuple(
            (evaluate(f, one) - evaluate(f, none), evaluate(f, none)) for f in self.formulas
        )
        return self.model_copy(update={"int_coeffs": coeffs})

    def nbytes_for(self, samples: int) -> int:
        if self.kind != "tensor":
            return 8 * len(self.int_coeffs)
        return math.prod(self.shape_for(samples)) * dtype_itemsize(self.dtype or "float32")


def needs_grad(spec: ValueSpec) -> bool:
    """Whether a gradient flows back through this value (decided statically, from the plan)."""
    dtype = spec.dtype or ""
    floating = dtype.startswith(("float", "bfloat", "complex"))
    return spec.kind == "tensor" and spec.requires_grad and floating


class DynamicDim(BaseModel):
    """An input dimension whose size may change from call to call (a sequence length).

    ``name`` is the first input that has it and which dimension (``"input_ids.1"``); other
    inputs of the same length (an attention mask) use the same name in their formulas.
    ``size`` is the plan's: the example's, the largest a call may pass (memory is planned
    there; the stages' times are the example's).
    """

    model_config = _FROZEN

    name: str
    input: int = Field(ge=0)  # where a call's size is read: plan.inputs[input], dimension dim
    dim: int = Field(ge=0)
    size: int = Field(ge=2)
