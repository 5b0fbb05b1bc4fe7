"""12. State: state dicts and checkpoints under the original model's names, on any plan and
world size.

    checkpoint  get_state_dict / set_state_dict: this rank's part, checked before loading
    optim_state the optimizer's part, under the parameters' names
    gather      full=True: every rank's part on rank 0's CPU, one copy of each tensor
"""

from .checkpoint import StateNames, get_state_dict, load_local, set_state_dict

__all__ = ["StateNames", "get_state_dict", "load_local", "set_state_dict"]
