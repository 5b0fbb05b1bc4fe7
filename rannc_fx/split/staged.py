"""The captured graph copied in stage order, for ``split_module``: every recomputed value a
stage reads from elsewhere (``group.recomputed_values``) rebuilt inside that stage.

A size is rebuilt as ``a * samples + c`` from the stage's sample count (or as its formulas
in the sizes of the stage's inputs where it depends on a dynamic dimension), a data-free
value (a mask) by running its chain again, so only tensors ever cross stages. Each node of
the copy notes in its ``meta`` the stage it runs in (``STAGE``), the captured node it copies
(``VALUE``; none on a rebuilt copy), and the captured node's op and target (``ORIGIN``,
``TARGET``), which ``split`` reads to make the per-stage modules.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch
from torch import fx

from ..capture.graph import CapturedGraph
from ..group.group import CALL_OPS
from ..plan.values import SAMPLES, Formula, ValueSpec
from .interface import StageInterface, _sample_source, dimension_source

__all__ = ["ORIGIN", "STAGE", "TARGET", "VALUE", "StagedCopy"]

# node.meta keys of the staged copy
STAGE = "rannc_stage"  # stage index of a call node
VALUE = "rannc_value"  # the captured node it copies (absent on recomputed copies)
TARGET = "rannc_target"  # original qualified name of a get_attr / call_module target
ORIGIN = "rannc_origin"  # op of the captured node


class StagedCopy:
    """The captured graph copied in stage order, recomputed values rebuilt in each reader."""

    def __init__(self, captured: CapturedGraph, node_stage: dict[str, int],
                 values: dict[str, ValueSpec], ifaces: list[StageInterface],
                 recomputed: frozenset[str]) -> None:
        self.gm = captured.gm
        self.node_stage = node_stage
        self.values = values
        self.ifaces = ifaces
        self.recomputed = recomputed
        self.graph = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.local: dict[tuple[int, fx.Node], Any] = {}
        self.samples: dict[int, fx.Node] = {}
        self.dim_sizes: dict[tuple[int, str], fx.Node] = {}

    def build(self) -> fx.Graph:
        g = self.graph
        nodes = list(self.gm.graph.nodes)
        for n in nodes:
            if n.op in ("placeholder", "get_attr"):
                new = g.node_copy(n)
                new.meta.update({VALUE: n.name, ORIGIN: n.op, TARGET: n.target})
                self.env[n] = new
        index = {n: i for i, n in enumerate(nodes)}
        calls = sorted((n for n in nodes if n.op in CALL_OPS),
                       key=lambda n: (self.node_stage[n.name], index[n]))
        for n in calls:
            s = self.node_stage[n.name]
            new = g.node_copy(n, functools.partial(self._read, s=s))
            new.meta.update({STAGE: s, VALUE: n.name, ORIGIN: n.op, TARGET: n.target})
            self.env[n] = new
        out = self.gm.graph.output_node()
        g.output(fx.map_arg(out.args[0], self.env.__getitem__))
        return g

    def _read(self, a: fx.Node, s: int) -> Any:
        if a.op in CALL_OPS and a.name in self.recomputed and self.node_stage[a.name] != s:
            return self._rebuild(a, s)
        return self.env[a]

    def _rebuild(self, a: fx.Node, s: int) -> Any:
        key = (s, a)
        if key not in self.local:
            spec = self.values[a.name]
            if spec.kind in ("int", "ints"):
                self.local[key] = self._affine(spec, s)
            else:
                def read(b: fx.Node) -> Any:
                    return self._read(b, s)

                new = self.graph.node_copy(a, read)
                new.meta.update({STAGE: s, ORIGIN: a.op, TARGET: a.target})
                self.local[key] = new
        return self.local[key]

    def _affine(self, spec: ValueSpec, s: int) -> Any:
        """``a * samples + c`` (a torch.Size of them for ``ints``) in stage ``s``; its formulas
        where it depends on a dynamic dimension."""
        g = self.graph
        parts: list[Any] = []
        if spec.formulas:
            parts = [self._polynomial(f, s) for f in spec.formulas]
            if spec.kind == "int":
                return parts[0]
            return self._tag(g.call_function(torch.Size, (parts,)), s)
        for a, c in spec.int_coeffs:
            if a == 0:
                parts.append(c)
                continue
            v = self._sample_count(s)
            if a != 1:
                v = self._tag(g.call_function(operator.mul, (v, a)), s)
            if c:
                v = self._tag(g.call_function(operator.add, (v, c)), s)
            parts.append(v)
        if spec.kind == "int":
            return parts[0]
        return self._tag(g.call_function(torch.Size, (parts,)), s)

    def _polynomial(self, formula: Formula, s: int) -> Any:
        """``formula`` computed in stage ``s`` from its inputs' sizes."""
        g = self.graph
        total: Any = None
        for coeff, names in formula:
            term: Any = coeff
            for name in names:
                size = self._sample_count(s) if name == SAMPLES else self._dim_size(name, s)
                term = size if term == 1 else self._tag(g.call_function(operator.mul, (term, size)), s)
            total = term if total is None else self._tag(g.call_function(operator.add, (total, term)), s)
        return 0 if total is None else total

    def _dim_size(self, name: str, s: int) -> fx.Node:
        key = (s, name)
        if key not in self.dim_sizes:
            found = dimension_source(self.ifaces[s].inputs, self.values, name)
            assert found is not None, "build_plan pins a dimension no input of the stage has"
            value, d = found
            x = self.env[next(n for n in self.env if n.name == value)]
            self.dim_sizes[key] = self._tag(self.graph.call_method("size", (x, d)), s)
        return self.dim_sizes[key]

    def _sample_count(self, s: int) -> fx.Node:
        if s not in self.samples:
            name = _sample_source(self.ifaces[s].inputs, self.values)
            assert name is not None, "stage_interfaces checks that a sample source exists"
            spec = self.values[name]
            assert spec.batch_dim is not None
            src = next(n for n in self.env if n.name == name)
            x = self.env[src]
            g = self.graph
            v = self._tag(g.call_method("size", (x, spec.batch_dim)), s)
            if spec.shape[spec.batch_dim] != 1:
                v = self._tag(g.call_function(operator.floordiv, (v, spec.shape[spec.batch_dim])), s)
            self.samples[s] = v
        return self.samples[s]

    @staticmethod
    def _tag(node: fx.Node, s: int) -> fx.Node:
        node.meta[STAGE] = s
        return node
