"""The op registry: every op is declared once, as one OpDef, with all that the
pipeline needs to know about it.

- `infer`     shape and dtype rule: operand values + attrs -> [(dtype, shape)];
              raises ValueError with a message naming expected vs actual.
- `reference` the numpy implementation used by the reference interpreter.
- `lower`     the C++ statements that compute the node, as calls into the
              target's runtime (`dg::...`) or into printed kernels; the call
              names are the same for every target, only the runtime differs.
- `describe`  how `deepgen ir` prints the node.
- `grad`      adjoint rule (added with autodiff; None until then).
"""

from __future__ import annotations

REGISTRY: dict = {}


class OpDef:
    name = ""
    grad = None

    def infer(self, inputs, attrs):
        raise NotImplementedError

    def reference(self, args, attrs, dims):
        raise NotImplementedError

    def lower(self, node, ctx):
        raise NotImplementedError

    def describe(self, node) -> str:
        args = [v.name for v in node.inputs]
        args += [f"{k}={_fmt(v)}" for k, v in sorted(node.attrs.items())]
        return f"{self.name}({', '.join(args)})"


def _fmt(value) -> str:
    if isinstance(value, tuple):
        return "(" + ", ".join(str(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return str(value)


def register(cls):
    """Class decorator: add one instance of an OpDef subclass to the registry."""
    if cls.name in REGISTRY:
        raise RuntimeError(f"op {cls.name!r} registered twice")
    REGISTRY[cls.name] = cls()
    return cls


def get_op(name: str) -> OpDef:
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown op {name!r}; registered ops: {', '.join(sorted(REGISTRY))}")


def require_float(inputs, what="operand"):
    for i, v in enumerate(inputs):
        if v.dtype != "float32":
            raise ValueError(f"{what} {i} ('{v.name}') must be float32, got {v.dtype}")
