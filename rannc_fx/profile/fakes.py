"""Where runs on fake tensors compute: the kind of device the plan is for, never meta.

The shape pass and the analytic profile run the graph on fake tensors, and which kernel an op
dispatches to, in which dtype, follows the device its tensors carry: autocast keeps a policy per
device type and has none for meta (under bfloat16 a meta tensor's matmul stays float32), and
``scaled_dot_product_attention`` runs a fused kernel on the CPU and on CUDA (which saves its
output and a log-sum-exp row per head) but its math on meta (which saves the score matrix of
every head: quadratic in the length). So fakes carry the kind of device the plan is for, where
this torch can make such tensors (CUDA's on a machine with a GPU: autograd on a fake CUDA tensor
aborts a torch without CUDA), else the CPU's; a model built on the meta device computes as the
same model built there.

    fake_device    that device, for a plan on devices of a type
    computes_as    the device a model's fakes carry when the caller names none
    fake_of        a model tensor's fake twin on that device
    retarget       a node's arguments with the capture's device (a constant torch.export or
                   torch.fx wrote into the graph) replaced by the fakes'
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.utils import _pytree as pytree

__all__ = ["computes_as", "fake_device", "fake_of", "retarget"]


def fake_device(device_type: str) -> torch.device:
    """The device fakes carry for a plan on ``device_type`` devices."""
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def computes_as(home: torch.device, given: torch.device | None = None) -> torch.device:
    """``given``, else where the model's tensors are (``home``), a meta model's as the CPU's."""
    if given is not None:
        return given
    return torch.device("cpu") if home.type == "meta" else home


def fake_of(mode: FakeTensorMode, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t``'s fake twin in ``mode`` on ``device``, its sizes static, needing a gradient as
    ``t`` does."""
    if t.device.type == device.type:
        return mode.from_tensor(t, static_shapes=True)
    with unset_fake_temporarily():
        meta = t.detach().to("meta")
    fake = mode.fake_tensor_converter.from_meta_and_device(mode, meta, device)
    return fake.requires_grad_(True) if t.requires_grad else fake


def retarget(args: tuple[Any, ...], kwargs: dict[str, Any], source: torch.device,
             device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A node's arguments with every ``source``-type device in them (a ``torch.device``, or
    a ``device=`` string) made ``device``."""
    if source.type == device.type:
        return args, kwargs

    def swap(x: Any) -> Any:
        return device if isinstance(x, torch.device) and x.type == source.type else x

    named = kwargs.get("device")
    if isinstance(named, str) and torch.device(named).type == source.type:
        kwargs = {**kwargs, "device": device}
    return pytree.tree_map(swap, args), pytree.tree_map(swap, kwargs)
