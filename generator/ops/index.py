"""Indexing ops: embedding lookup (gather rows of a table by integer ids)."""

from __future__ import annotations

import numpy as np
import sympy

from ..ir.shapes import fmt_shape, numel
from ..codegen.stmt import Named
from .registry import OpDef, register

_CPP_ID = {"int32": "std::int32_t", "int64": "std::int64_t"}


@register
class Gather(OpDef):
    """out[i..., :] = table[ids[i...], :]; ids out of range is a run-time error."""

    name = "gather"

    def id_limit(self, node, value):
        rows = node.inputs[0].shape[0]
        return rows if node.inputs[1] is value and isinstance(rows, int) else None

    def infer(self, inputs, attrs):
        table, ids = inputs
        if table.dtype != "float32" or table.rank < 1:
            raise ValueError(f"table '{table.name}' must be a float32 tensor, got {table.type_str()}")
        if ids.dtype not in _CPP_ID:
            raise ValueError(f"ids '{ids.name}' must be int32 or int64, got {ids.dtype}")
        return [("float32", ids.shape + table.shape[1:])]

    def reference(self, args, attrs, dims):
        table, ids = args
        bad = (ids < 0) | (ids >= table.shape[0])
        if bad.any():
            pos = int(np.flatnonzero(bad.ravel())[0])
            raise ValueError(
                f"gather from a table of {table.shape[0]} rows: index {int(ids.ravel()[pos])} "
                f"at position {pos} is out of range [0, {table.shape[0]})"
            )
        return [table[ids]]

    def lower(self, node, ctx):
        table, ids = node.inputs
        what = ctx.string(f"gather '{table.name}' by '{ids.name}' ({node.loc.short if node.loc else ''})")
        return [ctx.call("dg::gather_rows", ctx.read(table), Named("rows", ctx.size(table.shape[0])),
                         Named("width", ctx.size(numel(table.shape[1:]))), ctx.read(ids),
                         Named("n", ctx.size(numel(ids.shape))),
                         ctx.write(node.outputs[0]), what, template=_CPP_ID[ids.dtype])]

    def grad(self, node, gouts, gb):
        table, ids = node.inputs
        d = gb.op("scatter_add", [ids, gouts[0]], {"rows": table.shape[0]}, f"d_{table.name}")
        return [d, None]


@register
class ScatterAdd(OpDef):
    """The adjoint of gather: out[rows, ...] = 0; out[ids[i]] += src[i]."""

    name = "scatter_add"

    def infer(self, inputs, attrs):
        ids, src = inputs
        if ids.dtype not in _CPP_ID:
            raise ValueError(f"ids '{ids.name}' must be int32 or int64, got {ids.dtype}")
        if src.shape[: ids.rank] != ids.shape:
            raise ValueError(f"src {fmt_shape(src.shape)} does not start with the ids' shape {fmt_shape(ids.shape)}")
        return [("float32", (attrs["rows"],) + tuple(src.shape[ids.rank :]))]

    def reference(self, args, attrs, dims):
        ids, src = args
        rows = attrs["rows"]  # a symbolic size when the table was an activation (a gather of tree states)
        rows = rows if isinstance(rows, int) else int(sympy.sympify(rows).subs(dims))
        out = np.zeros((rows,) + src.shape[ids.ndim :], dtype=src.dtype)
        np.add.at(out, ids, src)
        return [out]

    def lower(self, node, ctx):
        ids, src = node.inputs
        width = numel(src.shape[ids.rank :])
        return [ctx.call("dg::scatter_add_rows", ctx.read(ids), Named("n", ctx.size(numel(ids.shape))), ctx.read(src),
                         Named("width", ctx.size(width)), ctx.write(node.outputs[0]),
                         Named("rows", ctx.size(node.attrs["rows"])),
                         template=_CPP_ID[ids.dtype])]
