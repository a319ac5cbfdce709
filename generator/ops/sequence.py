"""`last_steps`: where each padded sequence's recurrence ends.

out[n] = n * steps + lengths[n] - 1 (with `reverse`: n * steps, the step a
backward recurrence ends at): the rows of a scan's [N * T, ...] states that
hold each sequence's final state (frontend/sequences.py gathers them). A length
outside [1, steps] is an error naming its index, in the reference and in the
generated code (the runtime's host_last_steps, dg_schedule.h).
"""

from __future__ import annotations

import numpy as np
import sympy

from ..codegen.stmt import Named
from ..treebatch import check_lengths
from .registry import OpDef, register


@register
class LastSteps(OpDef):
    name = "last_steps"

    def infer(self, inputs, attrs):
        (lengths,) = inputs
        if lengths.dtype != "int64" or lengths.rank != 1:
            raise ValueError(f"lengths '{lengths.name}' must be int64 [N], got {lengths.type_str()}")
        return [("int64", lengths.shape)]

    def reference(self, args, attrs, dims):
        (lengths,) = args
        steps = int(sympy.sympify(attrs["steps"]).subs(dims))
        check_lengths(lengths, steps, "last_steps")
        first = np.arange(len(lengths), dtype=np.int64) * steps
        return [first if attrs["reverse"] else first + lengths.astype(np.int64) - 1]

    def sample_inputs(self, node, rng, dims, graph):
        lengths = node.inputs[0]
        count = lengths.shape[0] if isinstance(lengths.shape[0], int) else dims.get(lengths.shape[0], 2)
        steps = int(sympy.sympify(node.attrs["steps"]).subs(dims))
        return {lengths.name: rng.integers(1, steps + 1, count).astype(np.int64)}

    def lower(self, node, ctx):
        (lengths,) = node.inputs
        what = ctx.string(f"lengths '{lengths.name}' ({node.loc.short if node.loc else ''})")
        return [ctx.call("dg::last_steps", ctx.read(lengths), Named("count", ctx.size(lengths.shape[0])),
                         Named("steps", ctx.size(node.attrs["steps"])),
                         Named("reverse", "true" if node.attrs["reverse"] else "false"),
                         ctx.write(node.outputs[0]), what)]

    def describe(self, node):
        which = "first" if node.attrs["reverse"] else "last"
        return f"last_steps({node.inputs[0].name}, steps={node.attrs['steps']}, {which} step of each)"
