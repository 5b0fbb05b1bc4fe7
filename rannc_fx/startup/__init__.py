"""9. Startup: what one rank does at its first call: plan or receive the plan, split, place its
stage.

    rank       set_up_rank: the first call's steps in order, and what it leaves (Ready)
    probe      the link between ranks, measured before planning
    planned    rank 0's example batch, then its plan with the shapes and dtypes it found
    amp        the cut values' dtypes under each autocast state; GradScaler
    placement  this rank's stage on its device: move or materialize, free the rest
    sync       every stage starts from rank 0's model: the ranks agree, rank 0 sends its values
"""

from .rank import Ready, set_up_rank

__all__ = ["Ready", "set_up_rank"]
