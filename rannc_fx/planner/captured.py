"""Capture and shapes on one example batch: the ``Captured`` graph that rank 0 plans from and
every rank of ``compile()`` splits by the plan.

    capture_model  trace_model, then shape_model: what planning runs
    trace_model    the graph alone (``capture_pass``)
    shape_model    every value's spec and the graph's tail: found (``shapes_pass``,
                   ``find_tail``), or given by rank 0, which found them on the same graph

A meta-device model computes on meta: its example inputs are moved there first (shapes are
all capture and shape inference use).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..capture.capture import CapturedGraph, capture_pass
from ..capture.graph import TailNodes
from ..plan.config import Config
from ..plan.device import device_of
from ..plan.values import ValueSpec
from ..progress import note
from ..shapes.infer import shapes_pass
from ..shapes.symbolic import SymbolicValues
from ..shapes.tail import find_tail, insert_tail_inputs

__all__ = ["Captured", "capture_model", "shape_model", "trace_model"]


@dataclass
class Captured:
    """A captured graph, the example inputs it was captured on, every value's spec and, where
    the graph's sizes are formulas in the sample count, those formulas (the profile's)."""

    graph: CapturedGraph
    inputs: list[Any]  # the example batch, flat, as the graph takes it (on meta for meta models)
    values: dict[str, ValueSpec]
    formulas: SymbolicValues | None = None


def capture_model(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], config: Config, *,
    opaque: dict[str, Any] | None = None, pieces: tuple[int, int] | None = None,
    device: torch.device | None = None,
) -> Captured:
    """``capture_pass`` then ``shapes_pass`` on one example batch, as ``config`` says
    (``opaque``: the modules kept whole and their recorded calls, ``capture/opaque``;
    ``pieces``: where the forward is cut, ``capture/pieces``; ``device``: the device the
    shape pass's fakes carry, ``profile.fakes``)."""
    return shape_model(trace_model(model, args, kwargs, config, opaque=opaque, pieces=pieces),
                       config, device=device)


def trace_model(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], config: Config, *,
    opaque: dict[str, Any] | None = None, pieces: tuple[int, int] | None = None,
) -> Captured:
    """``capture_pass`` alone: a ``Captured`` without values yet (``shape_model`` adds them)."""
    args, kwargs = tuple(args), dict(kwargs)
    if device_of(model).type == "meta":
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
    graph = capture_pass(
        model, args, kwargs,
        tracer=config.tracer, leaf_modules=config.leaf_modules, batch_dim=config.batch_dim,
        dynamic=config.dynamic_dims != "batch", opaque=opaque,
        pieces=pieces,
    )  # fmt: skip
    return Captured(graph, graph.flatten_inputs(args, kwargs), {})


def shape_model(traced: Captured, config: Config, *,
                given: tuple[dict[str, ValueSpec], TailNodes | None] | None = None,
                device: torch.device | None = None) -> Captured:
    """``traced`` with every value's spec and its tail: from ``shapes_pass`` and
    ``find_tail``, or ``given`` by the rank that planned the same graph (``compile()``'s
    other ranks: the specs and tail rank 0 found, so that they need not find them again)."""
    graph, inputs = traced.graph, traced.inputs
    if given is not None:
        values, tail = given
        if tail is not None:
            insert_tail_inputs(graph, tail)
            graph.tail = tail
        return Captured(graph, inputs, values)
    dynamic = config.dynamic_dims != "batch"
    shapes = shapes_pass(graph, inputs, batch_dim=config.batch_dim, dynamic=dynamic, device=device)
    tail = find_tail(graph, shapes.specs, loss_reduction=config.loss_reduction)
    if tail is not None:  # its inputs get nodes of their own: the shapes again, with them
        insert_tail_inputs(graph, tail)
        graph.tail = tail
        shapes = shapes_pass(graph, inputs, batch_dim=config.batch_dim, dynamic=dynamic,
                             device=device)
        note("capture: samples mix at %s; %d node(s) from there run once a step on the "
             "whole batch, on the last stage's ranks", ", ".join(tail.mixing),
             len(tail.nodes))
    return Captured(graph, inputs, shapes.specs, shapes.formulas)
