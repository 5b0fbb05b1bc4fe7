"""The inputs the model casts before anything else reads them (``x.float()``, ``y.long()``).

A call whose input has another dtype than the plan's must not reach the stages as it is: its
bytes would be read as the planned dtype by the rank it travels to. Where the graph's only
use of an input is a cast to the planned dtype, converting the input to that dtype on
arrival is exactly what the model does to it, so such a call trains as the model would;
any other input of another dtype is refused (``runtime/agreement.py``).

Only torch.fx's graphs tell: torch.export keeps a cast that changes nothing on the example
(``x.float()`` on float inputs) as ``aten.to.dtype`` but reads its result wherever the model
reads the input itself too (``x.float() + x`` becomes ``to + to``), so converting could
change what those reads compute; under torch.export an input of another dtype is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

__all__ = ["cast_inputs", "input_casts"]

# Tensor methods that cast to one dtype
_METHODS = {
    "float": torch.float32, "double": torch.float64, "half": torch.float16,
    "bfloat16": torch.bfloat16, "long": torch.int64, "int": torch.int32, "short": torch.int16,
    "char": torch.int8, "byte": torch.uint8, "bool": torch.bool,
}


def input_casts(gm: fx.GraphModule) -> dict[int, torch.dtype]:
    """Placeholder position -> the dtype every use of that input casts it to, for the inputs
    a torch.fx graph reads only through such casts (none for torch.export's)."""
    out: dict[int, torch.dtype] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, p in enumerate(placeholders):
        dtypes = {_cast_to(u, p) for u in p.users}
        if len(dtypes) == 1 and None not in dtypes:
            (dtype,) = dtypes
            assert dtype is not None
            out[i] = dtype
    return out


def _cast_to(n: fx.Node, x: fx.Node) -> torch.dtype | None:
    """The dtype ``n`` casts ``x`` to, where ``n`` is nothing but that cast."""
    if not n.args or n.args[0] is not x:
        return None
    rest, kw = n.args[1:], dict(n.kwargs)
    if n.op != "call_method":
        return None
    if n.target in _METHODS and not rest and not kw:
        return _METHODS[str(n.target)]
    if n.target in ("to", "type"):
        dtype = rest[0] if len(rest) == 1 and not kw else kw.get("dtype") if not rest else None
        extra = set(kw) - {"dtype"}
        return dtype if isinstance(dtype, torch.dtype) and not extra else None
    return None


def cast_inputs(flat: Sequence[Any], planned: Sequence[str | None],
                casts: dict[int, torch.dtype]) -> list[Any]:
    """``flat`` with each input of another dtype than ``planned`` (names without ``torch.``)
    that the model casts to the planned dtype first converted to it; the rest as given."""
    out = list(flat)
    for j, want in casts.items():
        t = out[j] if j < len(out) else None
        if (isinstance(t, torch.Tensor) and j < len(planned) and planned[j] is not None
                and str(want).removeprefix("torch.") == planned[j]
                and str(t.dtype).removeprefix("torch.") != planned[j]):
            out[j] = t.to(want)
    return out
