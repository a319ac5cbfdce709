"""What the ONNX op converters share: attribute and constant readers, the converter
registry (`CONVERTERS`, filled by the family modules onnx_elementwise, onnx_layers,
onnx_shapes as onnx_ops imports them) and the statement helpers."""

from __future__ import annotations

import numpy as np
import sympy

from .emitter import Var, code
from .onnx_import import Const

_INT_MAX = 2**62  # ends at or past this (INT64_MAX in exporters' slices) mean "to the end"

# -- helpers ------------------------------------------------------------------------


def _attrs(node) -> dict:
    from onnx import helper

    out = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        out[a.name] = v.decode() if isinstance(v, bytes) else v
    return out


def _entries(imp, node, value, what) -> list:
    """A Const's entries as Python ints or sympy sizes (axes, sizes, pads given as inputs)."""
    if value is None:
        return None
    if not isinstance(value, Const):
        raise imp.fail(node, f"its {what} is computed from tensors at run time; deepgen needs it known at import")
    return [_scalar(v) for v in np.asarray(value.value).reshape(-1)]


def _scalar(v):
    if isinstance(v, sympy.Basic):
        return int(v) if v.is_Integer else v
    if isinstance(v, (np.integer, int)):
        return int(v)
    if isinstance(v, (np.floating, float)):
        return float(v)
    return v


def _normalize(array: np.ndarray) -> np.ndarray:
    """An object array whose sizes all turned out concrete, as int64 again."""
    if array.dtype != object:
        return array
    flat = [_scalar(v) for v in array.reshape(-1)]
    if all(isinstance(v, int) and not isinstance(v, bool) for v in flat):
        return np.array(flat, dtype=np.int64).reshape(array.shape)
    out = np.empty(array.shape, dtype=object)
    out.reshape(-1)[:] = flat
    return out


def _sizes(shape) -> np.ndarray:
    return _normalize(np.array(list(shape) or [], dtype=object).reshape(len(shape)))


def _axis(imp, node, axis: int, rank: int) -> int:
    if not -rank <= axis < max(rank, 1):
        raise imp.fail(node, f"axis {axis} is out of range for rank {rank}")
    return axis % rank if rank else 0


def _text(imp, node, value, role="input") -> str:
    """An operand of an expression: a variable, a number (a one-element Const), or a parameter."""
    if isinstance(value, Const):
        inline = imp.inline(value)
        if inline is not None:
            return inline
    return imp.tensor(value, node, role).name


def _onnx_dtype(to: int):
    return {1: np.float32, 6: np.int32, 7: np.int64, 9: np.bool_, 10: np.float16, 11: np.float64,
            2: np.uint8, 3: np.int8, 5: np.int16}.get(to)


def _pair(values) -> str:
    values = tuple(values)
    return code(values[0]) if len(set(values)) == 1 else code(values)


# -- converters (a tensor of the model among the inputs) ------------------------------

CONVERTERS: dict = {}


def converter(*ops):
    def register(fn):
        for op in ops:
            CONVERTERS[op] = fn
        return fn

    return register


def _x(imp, node, value, role="input") -> Var:
    return imp.tensor(value, node, role)


def _assign(imp, node, expr: str, hint: str | None = None) -> Var:
    return imp.em.assign(hint or imp.layer(node), expr)
