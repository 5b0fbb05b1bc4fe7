"""Compiler passes, in the order they run.

    capture  nn.Module            -> CapturedGraph (flat fx.GraphModule + pytree specs)
    shapes   CapturedGraph        -> {node: ValueSpec}  (per-sample shapes, batch dims)
    profile  CapturedGraph        -> Profile            (per-node time and memory, cached)
    group    graph + Profile      -> BlockGraph         (atomic blocks, coarsened chain)
    costs    BlockGraph + Profile -> CostTable          (numpy arrays the search reads)
    search   CostTable            -> SearchResult       (stages, replicas, micro-batches)
    split    graph + Plan         -> [fx.GraphModule]   (one per stage)

Analysis passes return data and never mutate the graph; ``split_pass`` builds new modules.
"""
