"""4. Group: nodes into atomic blocks, coarsened into the chain the search cuts; where layers
start (for recomputation layer by layer)."""
