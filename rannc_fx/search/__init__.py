"""5. Search: the exact optimum of the cost model over stage boundaries, replicas,
micro-batches, schedule, recomputation, sharding, offloading and parameters in host memory.

The search imports numpy only (no torch); its modules, in the order a search uses them:

    problem     what the search is given and gives back: the cost table, the space, the
                stages chosen and costed, the result
    table       the per-node profiles as the per-block cost arrays the search reads
    cost_model  the cost model (its docstring has the formulas)
    nodes       the cluster's nodes: where a stage's ranks may lie, which messages cross the
                network, the hierarchical all-reduce over whole nodes
    segments    recomputation layer by layer: what a stage holds while its backward
                recomputes its layers
    terms       the formulas: one stage's time and memory terms
    variants    a stage's variants (recomputation, sharding, offloading, parameters on the
                host) and the terms
                that depend on its replica count
    evaluate    one plan's step time and per-stage costs under it
    inflight    1F1B's in-flight limits: the most micro-batches a variant of a stage holds;
                the view of one m the layered DP reads (1F1B or ZB-H1)
    candidates  every stage of one micro-batch count, costed
    zb_view     the same under ZB-H1, per count of micro-batches held
    windows     range minima: stages that differ only in consecutive replica counts and
                share a weight read one window of a DP row
    dp_chain    the DP over the block chain (a stage's weight is one number)
    dp_positioned
                the 1F1B and ZB-H1 DP (a stage's weight depends on its position from the end)
    context     what one search's DPs share (the incumbent), and the threshold scan over U
    positions   the scans of 1F1B and ZB-H1, whose stages' costs depend on their position
    scan        ``search_pass``: the exact optimum by a threshold scan over the bottleneck
    explain     ``NoFeasiblePlan``: why nothing fits, and what would
"""

from .cost_model import needed_sizes, run_sizes, samples_per_replica
from .evaluate import evaluate
from .explain import NoFeasiblePlan
from .problem import (
    SCHEDULES,
    CostTable,
    Evaluation,
    SearchResult,
    SearchSpace,
    StageChoice,
    StageCost,
)
from .scan import SearchProgress, search_pass
from .segments import Segments

__all__ = [
    "SCHEDULES",
    "CostTable",
    "Evaluation",
    "NoFeasiblePlan",
    "SearchProgress",
    "SearchResult",
    "SearchSpace",
    "Segments",
    "StageChoice",
    "StageCost",
    "evaluate",
    "needed_sizes",
    "run_sizes",
    "samples_per_replica",
    "search_pass",
]
