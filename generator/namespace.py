"""The DSL namespace: everything `import generator as dg` offers (`dg.input`,
`dg.dense`, `dg.model`, ...). generator/__init__.py loads it on the first use of
one of its names."""

from . import ops  # noqa: F401  (registers every op)
from .frontend.builder import ModelDef, Tensor
from .frontend.dsl import *  # noqa: F401,F403
from .frontend.dsl import (  # noqa: F401  (names that shadow builtins, exported explicitly)
    input,
    max,
    sum,
)
from .errors import BuildError, DeepgenError, ModelError, ShapeError
from .frontend.initializers import constant, glorot_uniform, he_normal, normal, ones, uniform, zeros
from .ir.shapes import dim
from .frontend.recursion import recurse, roots, trees
from .frontend.sequences import gru, lstm, scan
from .frontend.vision import *  # noqa: F401,F403
from .frontend.attention import *  # noqa: F401,F403
from .frontend.windows import *  # noqa: F401,F403
from .frontend.control import *  # noqa: F401,F403
from .frontend.train import adam, bce_with_logits, mse, sgd, softmax_cross_entropy, train
from .importers import from_torch  # noqa: F401  (torch is imported only when it runs)

def model(fn=None, *, name: str | None = None):
    """Mark a function as a deepgen model: `@dg.model` or `@dg.model(name="net")`."""
    if fn is None:
        return lambda f: ModelDef(f, name)
    return ModelDef(fn, name)
