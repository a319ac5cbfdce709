"""The graph IR: an SSA list of nodes over values with dtypes and symbolic shapes.

Inputs and parameters are values without a producer; every other value is an
output of exactly one node. Node order is the order the user wrote the model in,
so it is deterministic and already a valid schedule.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy

from .printing import format_graph
from .shapes import fmt_shape

DTYPES = ("float32", "int32", "int64")
SHORT_DTYPE = {"float32": "f32", "int32": "i32", "int64": "i64", "bool": "bool", "mode": "mode"}


@dataclass(eq=False)
class Value:
    name: str
    dtype: str
    shape: tuple
    kind: str = "node"  # "input", "param", "state" (batch norm's running statistics), "mode" or "node"
    producer: "Node | None" = None
    loc: object = None
    init: object = None  # parameters: an initializer (generator.frontend.dsl.Init)
    seed: int | None = None  # parameters: a fixed seed overriding the model's
    explicit: bool = False  # the user gave this name with name=

    @property
    def rank(self) -> int:
        return len(self.shape)

    def type_str(self) -> str:
        return f"{SHORT_DTYPE[self.dtype]}{fmt_shape(self.shape)}"

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type_str()}"


@dataclass(eq=False)
class Node:
    op: str
    inputs: list
    attrs: dict
    outputs: list = field(default_factory=list)
    loc: object = None
    # forward | loss (needs training-only inputs) | backward
    phase: str = "forward"

    @property
    def user_call(self):
        """Which call of a user's function made this node (a residual block's), or None
        (the model's own lines)."""
        loc = self.loc
        return loc.call_id if loc is not None and loc.call is not None else None


@dataclass
class Graph:
    name: str
    inputs: list = field(default_factory=list)
    params: list = field(default_factory=list)
    nodes: list = field(default_factory=list)
    outputs: list = field(default_factory=list)  # [(output name, Value)]
    # Run-time conditions on symbolic dims, [(sympy expr that must be >= 0, why)],
    # e.g. `N - 5 >= 0` for a slice x[5:] of an axis of length N.
    requirements: list = field(default_factory=list)
    loc: object = None
    names: object = None  # the NameTable that made the names, for passes that add values
    train: object = None  # a generator.frontend.train.TrainSpec when the model calls dg.train(...)
    # The train/eval mode (with the dropout draw counter), a Value of dtype "mode" that
    # the ops whose behavior depends on it read; None when no op does.
    mode: object = None
    # "fp32", "bf16": every product's operands rounded to bfloat16 (transforms/precision.py), or
    # "int8": products by a weight in int8 (transforms/quantize.py).
    precision: str = "fp32"

    @property
    def trainable(self) -> list:
        """The parameters training updates (params holds the states too)."""
        return [p for p in self.params if p.kind == "param"]

    @property
    def states(self) -> list:
        """Module state that is not trained: batch norm's running statistics."""
        return [p for p in self.params if p.kind == "state"]

    @property
    def dims(self) -> list:
        """Symbolic dims, in the order the inputs introduce them."""
        seen = []
        for v in self.inputs:
            for d in v.shape:
                if isinstance(d, sympy.Basic):
                    for s in sorted(d.free_symbols, key=str):
                        if s not in seen:
                            seen.append(s)
        return seen

    def values(self):
        yield from self.inputs
        yield from self.params
        if self.mode is not None:
            yield self.mode
        for n in self.nodes:
            yield from n.outputs

    def users(self) -> dict:
        out = {id(v): [] for v in self.values()}
        for n in self.nodes:
            for v in n.inputs:
                out[id(v)].append(n)
        return out

    def __str__(self) -> str:
        return format_graph(self)


def needed_nodes(new_nodes, keep: set) -> list:
    """The nodes of `new_nodes` that the values in `keep` need, in order."""
    keep, kept = set(keep), []
    for node in reversed(new_nodes):
        if any(id(v) in keep for v in node.outputs):
            keep.update(id(v) for v in node.inputs)
            kept.append(node)
    return kept[::-1]


def needed_for(graph, values) -> set:
    """ids of every value that computing `values` requires (them included)."""
    need = {id(v) for v in values}
    for node in reversed(graph.nodes):
        if any(id(v) in need for v in node.outputs):
            need.update(id(v) for v in node.inputs)
    return need


def outer_reads(nodes, inside: set) -> list:
    """The values `nodes` read whose ids are not in `inside` (a cell's free values: the
    parameters and outer values it reads), each once, in the order they are first read."""
    free = []
    for node in nodes:
        for v in node.inputs:
            if id(v) not in inside and all(v is not f for f in free):
                free.append(v)
    return free
