"""Padding masks from sequence lengths: `length_mask(lengths)` with attr `length`
(T, an int or a symbolic dim) is the float32 [N, T] additive mask of a batch of
sequences padded to T: 0 where t < lengths[n], -inf past it. Added to attention
scores before a softmax over keys, it gives padded keys weight 0 exactly (as
PyTorch's key_padding_mask does). A length outside [1, T] is a run-time error
naming the lengths and the position: a row of only -inf would make NaN. Attr
`what` names the lengths in that message (the DSL records the input's name)."""

from __future__ import annotations

import numpy as np
import sympy

from ..codegen.stmt import Named
from ..ir.shapes import fmt_dim
from .index import _CPP_ID
from .registry import OpDef, register


@register
class LengthMask(OpDef):
    name = "length_mask"

    def infer(self, inputs, attrs):
        (lengths,) = inputs
        if lengths.dtype not in _CPP_ID or lengths.rank != 1:
            raise ValueError(f"lengths '{lengths.name}' must be int32/int64 [N], got {lengths.type_str()}")
        return [("float32", (lengths.shape[0], attrs["length"]))]

    def reference(self, args, attrs, dims):
        (lengths,) = args
        T = attrs["length"] if isinstance(attrs["length"], int) else int(sympy.sympify(attrs["length"]).subs(dims))
        bad = (lengths < 1) | (lengths > T)
        if bad.any():
            pos = int(np.flatnonzero(bad)[0])
            raise ValueError(f"length_mask of {attrs['what']}: length {int(lengths[pos])} at position {pos} "
                             f"is out of range [1, {T}]")
        valid = np.arange(T)[None, :] < lengths[:, None]
        return [np.where(valid, 0.0, -np.inf).astype(np.float32)]

    def lower(self, node, ctx):
        (lengths,) = node.inputs
        what = ctx.string(f"length_mask of {node.attrs['what']} ({node.loc.short if node.loc else ''})")
        return [ctx.call("dg::length_mask", ctx.read(lengths), ctx.write(node.outputs[0]),
                         Named("N", ctx.size(lengths.shape[0])), Named("T", ctx.size(node.attrs["length"])), what,
                         template=_CPP_ID[lengths.dtype])]

    def describe(self, node):
        return f"length_mask({node.inputs[0].name}, T={fmt_dim(node.attrs['length'])})"

    def grad(self, node, gouts, gb):
        return [None]  # integer lengths: nothing to differentiate

    def sample_inputs(self, node, rng, dims, graph) -> dict:
        """Lengths of an input drawn in [1, T], the first one T (a full sequence)."""
        (lengths,) = node.inputs
        if lengths.kind != "input":
            return {}
        count = lengths.shape[0] if isinstance(lengths.shape[0], int) else int(sympy.sympify(lengths.shape[0]).subs(dims))
        length = node.attrs["length"]
        T = length if isinstance(length, int) else int(sympy.sympify(length).subs(dims))
        values = rng.integers(1, T + 1, count)
        values[:1] = T
        return {lengths.name: values.astype(lengths.dtype)}



@register
class KeyMask(OpDef):
    """`key_mask(mask)`: a 0/1 integer mask [N, T] (Hugging Face's attention_mask: 1 for a
    token to attend to, 0 for padding, anywhere in the row) as the float32 additive mask
    [N, T]: 0 where the mask is nonzero, -inf where it is 0. A row with no nonzero entry
    is a run-time error naming the mask and the row (its softmax would be NaN)."""

    name = "key_mask"

    def infer(self, inputs, attrs):
        (mask,) = inputs
        if mask.dtype not in _CPP_ID or mask.rank != 2:
            raise ValueError(f"mask '{mask.name}' must be int32/int64 [N, T], got {mask.type_str()}")
        return [("float32", tuple(mask.shape))]

    def reference(self, args, attrs, dims):
        (mask,) = args
        empty = ~(mask != 0).any(axis=1)
        if empty.any():
            row = int(np.flatnonzero(empty)[0])
            raise ValueError(f"key_mask of {attrs['what']}: row {row} keeps no position (all zeros)")
        return [np.where(mask != 0, 0.0, -np.inf).astype(np.float32)]

    def lower(self, node, ctx):
        (mask,) = node.inputs
        what = ctx.string(f"key_mask of {node.attrs['what']} ({node.loc.short if node.loc else ''})")
        return [ctx.call("dg::key_mask", ctx.read(mask), ctx.write(node.outputs[0]),
                         Named("N", ctx.size(mask.shape[0])), Named("T", ctx.size(mask.shape[1])), what,
                         template=_CPP_ID[mask.dtype])]

    def describe(self, node):
        return f"key_mask({node.inputs[0].name})"

    def grad(self, node, gouts, gb):
        return [None]  # an integer mask: nothing to differentiate

    def sample_inputs(self, node, rng, dims, graph) -> dict:
        """A 0/1 mask of an input with the first position of each row kept."""
        (mask,) = node.inputs
        if mask.kind != "input":
            return {}
        shape = [d if isinstance(d, int) else int(sympy.sympify(d).subs(dims)) for d in mask.shape]
        values = rng.integers(0, 2, shape)
        values[:, 0] = 1
        return {mask.name: values.astype(mask.dtype)}


@register
class CausalMask(OpDef):
    """`causal_mask(length)`: the float32 [T, T] additive mask of causal attention (query
    row q sees keys 0..q): 0 on and below the diagonal, -inf above it."""

    name = "causal_mask"

    def infer(self, inputs, attrs):
        return [("float32", (attrs["length"], attrs["length"]))]

    def reference(self, args, attrs, dims):
        T = attrs["length"] if isinstance(attrs["length"], int) else int(sympy.sympify(attrs["length"]).subs(dims))
        return [np.where(np.tril(np.ones((T, T), dtype=bool)), 0.0, -np.inf).astype(np.float32)]

    def lower(self, node, ctx):
        return [ctx.call("dg::causal_mask", ctx.write(node.outputs[0]), Named("T", ctx.size(node.attrs["length"])))]

    def describe(self, node):
        return f"causal_mask(T={fmt_dim(node.attrs['length'])})"

    def grad(self, node, gouts, gb):
        return []
