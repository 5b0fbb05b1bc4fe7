"""rannc_fx: automatic hybrid data+pipeline parallel training for unmodified PyTorch models.

    model = rannc_fx.compile(model, optimizer)               # under torchrun: trains pipelined
    parted = rannc_fx.partition(model, args, world_size=4)   # offline: plan + stage GraphModules
    print(parted.plan.summary())
"""

from .compile import CompiledModel, compile
from .config import Config
from .device import DeviceSpec
from .partition import Partitioned, partition
from .plan import Plan
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
