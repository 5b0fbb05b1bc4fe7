"""rannc_fx: automatic hybrid data+pipeline parallel training for unmodified PyTorch models.

    model = rannc_fx.compile(model, optimizer)               # under torchrun: trains pipelined
    parted = rannc_fx.partition(model, args, world_size=4)   # offline: plan + stage GraphModules
    print(parted.plan.summary())

The package's folders, in the order a model goes through them (each ``__init__`` says more):

    capture    nn.Module -> one flat fx.GraphModule (torch.fx or torch.export)
    shapes     per-sample shapes, batch dimensions, integer formulas; the tail
    profile    per-node time and memory, measured or counted, cached
    group      atomic blocks, coarsened into the chain the search cuts
    search     the exact optimum of the cost model (stages, replicas, micro-batches, ...)
    planner    the passes in order, and the choice among plans the search does not make
    plan       the plan and its types (parts, values, device, Config)
    split      one fx.GraphModule per stage
    startup    a rank's first call: plan or receive it, split, place its stage
    schedules  the schedule as data, lowered to each rank's program and simulated
    runtime    the executor: a rank's program run with torch.distributed
    state      state dicts and checkpoints under the model's own names
"""

from .compile import CompiledModel, compile
from .partition import Partitioned, partition
from .plan.config import Config
from .plan.device import DeviceSpec
from .plan.plan import Plan
from .runtime import PeerFailed
from .startup.amp import GradScaler
from .state import get_state_dict, set_state_dict

__all__ = [
    "CompiledModel",
    "Config",
    "DeviceSpec",
    "GradScaler",
    "Partitioned",
    "PeerFailed",
    "Plan",
    "compile",
    "get_state_dict",
    "partition",
    "set_state_dict",
]
__version__ = "0.1.0"
