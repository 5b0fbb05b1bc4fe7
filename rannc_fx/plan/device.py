"""Describe the hardware a plan is made for (memory, compute and link speeds), and say where a
module's tensors are."""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

__all__ = ["DeviceSpec", "GiB", "device_of"]

GiB = 1024**3

# Dense peak rates as the vendors list them (no sparsity); the interconnect figure is the
# per-GPU bandwidth of the usual fabric for that part (NVLink within a node). The host
# figures are a DGX node's per GPU: its host memory over its 8 GPUs, and what one GPU's PCIe
# link moves in practice (gen3 x16 about 12 GB/s, gen4 24, gen5 50), and its share of the
# host's memory bandwidth (an optimizer step on the host streams through it): DGX-1's two
# Xeon E5-2698 v4 about 154 GB/s over 8 GPUs, DGX A100's two EPYC 7742 410 GB/s, DGX H100's
# two Xeon 8480C 614 GB/s (the channels' peak; a step reaches less). The network between
# nodes is the DGX systems' per GPU: DGX-1, 4 x 100 Gb/s EDR InfiniBand for 8 V100s (6.25
# GB/s a GPU); DGX A100, 8 x 200 Gb/s HDR (25 GB/s); DGX H100 and H200, 8 x 400 Gb/s NDR (50
# GB/s). Its latency, 15 us a message against 10 us inside a node, is an estimate, not a
# measurement: an InfiniBand hop adds a few microseconds to NCCL's time per message.
_PRESETS: dict[str, dict[str, Any]] = {
    "v100-32gb": dict(
        memory_bytes=32 * GiB,
        peak_flops={"float32": 15.7e12, "float16": 125e12, "bfloat16": 15.7e12},
        memory_bandwidth=900e9,
        interconnect_bandwidth=150e9,
        interconnect_latency=10e-6,
        host_bandwidth=12e9,
        host_memory_bytes=64 * GiB,
        host_step_bandwidth=19e9,
        devices_per_node=8,
        network_bandwidth=6.25e9,
        network_latency=15e-6,
    ),
    "a100-40gb": dict(
        memory_bytes=40 * GiB,
        peak_flops={"float32": 19.5e12, "float16": 312e12, "bfloat16": 312e12},
        memory_bandwidth=1555e9,
        interconnect_bandwidth=300e9,
        interconnect_latency=10e-6,
        host_bandwidth=24e9,
        host_memory_bytes=128 * GiB,
        host_step_bandwidth=51e9,
        devices_per_node=8,
        network_bandwidth=25e9,
        network_latency=15e-6,
    ),
    "a100-80gb": dict(
        memory_bytes=80 * GiB,
        peak_flops={"float32": 19.5e12, "float16": 312e12, "bfloat16": 312e12},
        memory_bandwidth=2039e9,
        interconnect_bandwidth=300e9,
        interconnect_latency=10e-6,
        host_bandwidth=24e9,
        host_memory_bytes=256 * GiB,
        host_step_bandwidth=51e9,
        devices_per_node=8,
        network_bandwidth=25e9,
        network_latency=15e-6,
    ),
    "h100-80gb": dict(
        memory_bytes=80 * GiB,
        peak_flops={"float32": 67e12, "float16": 989e12, "bfloat16": 989e12},
        memory_bandwidth=3350e9,
        interconnect_bandwidth=450e9,
        interconnect_latency=10e-6,
        host_bandwidth=50e9,
        host_memory_bytes=256 * GiB,
        host_step_bandwidth=77e9,
        devices_per_node=8,
        network_bandwidth=50e9,
        network_latency=15e-6,
    ),
    "h200-141gb": dict(
        memory_bytes=141 * GiB,
        peak_flops={"float32": 67e12, "float16": 989e12, "bfloat16": 989e12},
        memory_bandwidth=4800e9,
        interconnect_bandwidth=450e9,
        interconnect_latency=10e-6,
        host_bandwidth=50e9,
        host_memory_bytes=256 * GiB,
        host_step_bandwidth=77e9,
        devices_per_node=8,
        network_bandwidth=50e9,
        network_latency=15e-6,
    ),
    # A commodity CPU host running gloo over loopback: a few cores, tens of GB. gloo moves
    # about 0.6 GB/s between two processes here, with ~50-100 us per message; compile()
    # measures the real link when it has more than one rank.
    "cpu": dict(
        device_type="cpu",
        memory_bytes=16 * GiB,
        peak_flops={"float32": 100e9, "float16": 10e9, "bfloat16": 50e9},
        memory_bandwidth=20e9,
        interconnect_bandwidth=1e9,
        interconnect_latency=80e-6,
        # no host figures: host and device are one memory, offloading frees nothing
    ),
}


class DeviceSpec(BaseModel):
    """One accelerator as the cost model sees it.

    ``peak_flops`` maps a dtype name (``"float32"``) to dense FLOP/s; ``memory_bandwidth``
    is device-memory bytes/s; ``interconnect_bandwidth`` is the bytes/s one device can send
    to a peer (point-to-point, and ring all-reduce unless ``allreduce_bandwidth`` says
    otherwise) and ``interconnect_latency`` the seconds one message costs whatever its size.
    ``host_bandwidth`` is the bytes/s between the device and its host's memory, each way, and
    ``host_memory_bytes`` the host memory one device may fill with offloaded optimizer state
    (a node's, over its devices); None: no offloading. ``device_type`` is the kind of torch
    device it is: the analytic cost model runs the ops as that kind runs them (its autocast
    policy, its fused kernels). A cluster is nodes of ``devices_per_node`` devices (None:
    one node, however many ranks) on ``interconnect_bandwidth``, and a network between nodes
    at ``network_bandwidth`` bytes/s per device and ``network_latency`` seconds a message.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    device_type: Literal["cuda", "cpu"] = "cuda"
    memory_bytes: int = Field(gt=0)
    peak_flops: dict[str, float]
    memory_bandwidth: float = Field(gt=0)
    interconnect_bandwidth: float = Field(gt=0)
    interconnect_latency: float = Field(default=0.0, ge=0)
    # bytes/s of a ring all-reduce's traffic, the reduction included; None: the link's
    allreduce_bandwidth: float | None = Field(default=None, gt=0)
    host_bandwidth: float | None = Field(default=None, gt=0)
    host_memory_bytes: int | None = Field(default=None, gt=0)
    # bytes/s of host memory one device's share of an optimizer step on the host streams
    # (parameters in host memory); None: host_bandwidth
    host_step_bandwidth: float | None = Field(default=None, gt=0)
    # the cluster's nodes: devices a node (None: one node), the network between them
    devices_per_node: int | None = Field(default=None, ge=1)
    network_bandwidth: float | None = Field(default=None, gt=0)
    network_latency: float = Field(default=0.0, ge=0)
    # Fraction of peak that real kernels reach; the analytic cost model divides by it. 0.5 is
    # an assumption, neither measured here nor taken from a published benchmark: plans for a
    # torch device measure each op there instead (``profile/materialize`` for a meta model).
    efficiency: float = Field(default=0.5, gt=0, le=1)

    @property
    def copies_beside_compute(self) -> bool:
        """Whether copies between host and device overlap the device's compute (a GPU's copy
        engine); a device without host figures (the CPU) is its own host, its copies run on
        the cores that compute."""
        return self.host_bandwidth is not None

    @classmethod
    def preset(cls, name: str) -> DeviceSpec:
        """A known device by name, e.g. ``DeviceSpec.preset("v100-32gb")``."""
        key = name.lower()
        if key not in _PRESETS:
            raise ValueError(
                f"unknown device preset {name!r}; known presets: {', '.join(sorted(_PRESETS))}. "
                "Describe another device with DeviceSpec(name=..., memory_bytes=..., "
                "peak_flops={'float32': ...}, memory_bandwidth=..., interconnect_bandwidth=...)."
            )
        return cls(name=key, **_PRESETS[key])

    @classmethod
    def presets(cls) -> list[str]:
        return sorted(_PRESETS)

    @classmethod
    def of(cls, device: torch.device | str) -> DeviceSpec:
        """A spec for a local device: its real memory size, rates from the closest preset.

        Measured profiles take their times from the device itself, so only memory and the
        link speed matter for them.
        """
        dev = torch.device(device)
        if dev.type == "cuda":
            props = torch.cuda.get_device_properties(dev)
            base = "h100-80gb" if props.major >= 9 else "a100-80gb" if props.major == 8 else "v100-32gb"
            spec = cls.preset(base)
            return spec.model_copy(update={"name": props.name, "memory_bytes": props.total_memory})
        if dev.type == "cpu":
            return cls.preset("cpu")
        if dev.type == "meta":
            raise ValueError(
                "a meta-device model has no hardware to measure; pass device=DeviceSpec.preset(...) "
                f"(one of {', '.join(sorted(_PRESETS))}) to plan it with the analytic cost model"
            )
        raise ValueError(f"no device spec for {dev}; pass a DeviceSpec")

    def flops_for(self, dtype: str) -> float:
        """Peak FLOP/s for a dtype name, falling back to float32's rate."""
        return self.peak_flops.get(dtype, self.peak_flops.get("float32", max(self.peak_flops.values())))


def device_of(module: torch.nn.Module) -> torch.device:
    """Where ``module``'s tensors are: the meta device if any parameter or buffer is there
    (nothing on it can be measured or run), else the first one's device, else the CPU."""
    first = None
    for t in (*module.parameters(), *module.buffers()):
        if t.device.type == "meta":
            return t.device
        first = first or t.device
    return first or torch.device("cpu")
