"""Group nodes into atomic blocks and coarsen them into the chain the search cuts."""

# INTERFACE (to be implemented)

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from ..plan import ValueSpec
from .capture import CapturedGraph
from .profile import Profile

__all__ = ["BlockGraph", "group_pass"]


class BlockGraph(BaseModel):
    """The chain of blocks in topological order.

    Every call node (call_function / call_method / call_module) is in exactly one block;
    placeholders, get_attr and output nodes are in none (a stage takes the graph inputs and
    parameters it uses directly). ``params[b]`` names the parameters and buffers block ``b``
    reads. ``boundary[k]`` names the values that cross the cut before block ``k`` (produced by a
    node in a block < k, read by one in a block >= k); ``boundary[0]`` and ``boundary[B]`` are
    empty. Graph inputs never count as crossing: every stage reads them from the data.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    blocks: tuple[tuple[str, ...], ...]
    params: tuple[tuple[str, ...], ...]
    boundary: tuple[tuple[str, ...], ...]


def group_pass(
    captured: CapturedGraph,
    profile: Profile,
    values: dict[str, ValueSpec],
    *,
    max_blocks: int,
) -> BlockGraph:
    raise NotImplementedError
