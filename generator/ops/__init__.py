"""All ops, registered on import. See registry.py for what an OpDef carries."""

from . import adaptive_pool, cond, conv, elementwise, index, layout, linalg, logic, loss, masks, modes, norm, precision, quantize, quantize_conv, recurse, recurse_grad, reduce, sequence, windows  # noqa: F401  (registration)
from .layout import Fill
from .registry import REGISTRY, OpDef, get_op, register

make_constant = Fill.make_constant  # constant folding's replacement of an evaluated node
from .scalar import ARGS, SCALAR_FUNCS, derivative, scalar_expr

__all__ = ["REGISTRY", "OpDef", "get_op", "register", "make_constant", "ARGS", "SCALAR_FUNCS", "scalar_expr", "derivative"]
