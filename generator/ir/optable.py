"""The table of ops by name, which ops/registry.py fills (one OpDef per op) and
anything holding a graph reads: a leaf of the IR, so that printing a graph
(printing.py, dot.py) looks an op up without importing the ops."""

from __future__ import annotations

REGISTRY: dict = {}


def get_op(name: str):
    """The OpDef registered as `name` (ops/registry.py)."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown op {name!r}; registered ops: {', '.join(sorted(REGISTRY))}")
