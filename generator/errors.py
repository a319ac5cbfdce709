"""Errors that deepgen reports to the user.

Every error raised while reading a model names where it came from: the user's
file and line (and the line's text), the op, and what was expected versus what
was found. The CLI prints these without a Python traceback.
"""

from __future__ import annotations


class DeepgenError(Exception):
    """Base class: a problem in the user's model, arguments or environment."""


class ModelError(DeepgenError):
    """A problem in the model description, located at a DSL line."""

    def __init__(self, message: str, loc=None, op: str | None = None):
        self.loc = loc
        self.op = op
        self.detail = message
        where = f"{loc}: " if loc is not None else ""
        what = f"{op}: " if op else ""
        text = f"{where}{what}{message}"
        if loc is not None and loc.text:
            text += f"\n    {loc.text}"
        super().__init__(text)


class ShapeError(ModelError):
    """Shapes or dtypes of an op's operands do not fit together."""


class BuildError(DeepgenError):
    """Building a generated project failed (the compiler's message is attached)."""
