"""An op's FLOPs as the kernels compute them, and the dtype they compute in.

torch's ``FlopCounterMode`` counts each aten op by a formula of its operands' shapes. Two things
it does not say, which the analytic cost model needs, ``Flops`` adds:

- **Fused attention** (the ``_scaled_dot_product_*`` kernels: flash, memory-efficient and cuDNN
  on CUDA, flash on the CPU) is counted by one formula whichever device's kernel ran (torch
  2.13 has no formula for the CPU's kernel: it counted as nothing), and under a causal
  mask only the score matrix's unmasked part: the flash kernels skip the blocks above the
  diagonal, so a causal call does about half the work of an unmasked one.
- **The compute dtype.** Under autocast a linear's matmul runs in bfloat16 though its inputs
  arrive in float32; the op's FLOPs are tallied by the dtype of each counted kernel's first
  operand, and ``dtype`` is the one that holds the most (what the device's peak rate for it
  prices).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch.utils.flop_counter import (
    FlopCounterMode,
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

__all__ = ["FORMULAS", "Flops", "causal_fraction", "count"]

aten = torch.ops.aten

# forward kernels, and backward kernels (which also take the output's gradient first)
_ATTENTION = [aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_efficient_attention,
              aten._scaled_dot_product_cudnn_attention, aten._scaled_dot_product_flash_attention_for_cpu]
_ATTENTION_BACKWARD = [aten._scaled_dot_product_flash_attention_backward,
                       aten._scaled_dot_product_efficient_attention_backward,
                       aten._scaled_dot_product_cudnn_attention_backward,
                       aten._scaled_dot_product_flash_attention_for_cpu_backward]


def causal_fraction(queries: int, keys: int) -> float:
    """The part of a ``queries`` x ``keys`` score matrix a causal mask keeps (torch's
    ``is_causal``: row i sees the first i + 1 keys)."""
    if queries <= keys:
        kept = queries * (queries + 1) // 2
    else:
        kept = keys * (keys + 1) // 2 + (queries - keys) * keys
    return kept / (queries * keys)


def _bound(packet: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    names = [a.name for a in packet.default._schema.arguments]
    return {**dict(zip(names, args, strict=False)), **kwargs}


def _attention(backward: bool, packet: Any) -> Callable[..., int]:
    def count(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        a = _bound(packet, args, kwargs)
        q, k, v = a["query"].shape, a["key"].shape, a["value"].shape
        dense = (sdpa_backward_flop_count(_grad_out(a).shape, q, k, v) if backward
                 else sdpa_flop_count(q, k, v))
        return round(dense * (causal_fraction(q[-2], k[-2]) if a.get("is_causal") else 1.0))

    count._get_raw = True  # type: ignore[attr-defined]  # FlopCounterMode: pass the tensors
    return count


def _grad_out(a: dict[str, Any]) -> torch.Tensor:
    return a["grad_out"] if "grad_out" in a else a["grad_out_"]


def _first_dtype(args: tuple[Any, ...]) -> str:
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return str(a.dtype).removeprefix("torch.")
    return "float32"


# every counted kernel's formula, the fused attention's as above (torch's registry, at import:
# formulas registered later are not seen)
FORMULAS: dict[Any, Callable[..., int]] = {
    **flop_registry,
    **{p: _attention(False, p) for p in _ATTENTION},
    **{p: _attention(True, p) for p in _ATTENTION_BACKWARD},
}


def count(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """The FLOPs of one aten call (0 for a kernel no formula counts)."""
    formula = FORMULAS.get(getattr(func, "overloadpacket", func))
    return int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0


class Flops:
    """``FlopCounterMode`` with fused attention counted as it runs and FLOPs by dtype::

        with Flops() as flops:
            run()
        flops.total, flops.dtype
    """

    def __init__(self) -> None:
        self.by_dtype: dict[str, int] = defaultdict(int)
        self._mode = FlopCounterMode(display=False, custom_mapping={
            p: self._tallied(f) for p, f in FORMULAS.items()})

    def _tallied(self, formula: Callable[..., int]) -> Callable[..., int]:
        def count(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
            n = int(formula(*args, out_val=out_val, **kwargs))
            self.by_dtype[_first_dtype(args)] += n
            return n

        count._get_raw = True  # type: ignore[attr-defined]
        return count

    @property
    def total(self) -> int:
        return sum(self.by_dtype.values())

    @property
    def dtype(self) -> str | None:
        """The dtype most of the FLOPs ran in (None: none counted)."""
        return max(self.by_dtype, key=self.by_dtype.__getitem__) if self.total else None

    def __enter__(self) -> Flops:
        self._mode.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._mode.__exit__(kind, e, tb)
