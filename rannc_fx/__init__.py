"""rannc_fx: automatic hybrid data+pipeline parallel training for unmodified PyTorch models.

    parted = rannc_fx.partition(model, args, world_size=4)   # plan + stage GraphModules
    print(parted.plan.summary())
"""

from .config import Config
from .device import DeviceSpec
from .partition import Partitioned, partition
from .plan import Plan

__all__ = ["Config", "DeviceSpec", "Partitioned", "Plan", "partition"]
__version__ = "0.1.0"
