"""torch functions and Tensor methods (call_function / call_method fx nodes) as DSL code.

Arithmetic on sizes (`b, t, e = x.shape; x.view(b * t, e)`) is not written: it
is computed on the DSL's symbolic sizes, so the reshape reads `(N*T, 16)`.
"""

from __future__ import annotations

import math
import operator

import sympy

from .emitter import Var, code

_BINARY = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "div": "/", "matmul": "@"}
_UNARY = ("relu", "tanh", "sigmoid", "gelu", "silu", "exp", "log", "sqrt", "rsqrt", "abs", "relu6", "hardswish",
          "hardsigmoid")
_COMPARE = {"eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le, "gt": operator.gt,
            "ge": operator.ge}
# Functions outside torch's namespaces that torch.fx records as calls (wrapped with torch.fx.wrap).
_LIBRARY = {("torchvision.ops.stochastic_depth", "stochastic_depth"): "stochastic_depth"}


def _get(args, kwargs, i, name, default=None):
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def _canonical(node):
    """The handler name of a call_function or call_method node (None: unsupported)."""
    import torch
    import torch.nn.functional as F

    if node.op == "call_method":
        name = node.target
    else:
        target = node.target
        name = None
        if target is operator.getitem or target is getattr:
            name = target.__name__
        elif getattr(target, "__module__", None) in ("_operator", "operator"):
            name = target.__name__
            name = name[1:] if name.startswith("i") and name[1:] in _BINARY else name  # x += y
        elif (getattr(target, "__module__", None), getattr(target, "__name__", None)) in _LIBRARY:
            name = _LIBRARY[target.__module__, target.__name__]
        else:
            key = getattr(target, "__name__", None)
            if key and any(getattr(namespace, key, None) is target for namespace in (torch, F, torch.Tensor)):
                name = key
    return name


def convert_call(imp, node, args, kwargs):
    name = _canonical(node)
    handler = HANDLERS.get(name) if name else None
    if handler is None:
        raise imp.fail(node, f"unsupported PyTorch operation {imp.kind(node)}")
    return handler(imp, node, name, list(args), dict(kwargs))


def _tensor(imp, node, x, what="its input"):
    if not isinstance(x, Var):
        raise imp.fail(node, f"{imp.kind(node)}: {what} must be a tensor, got {x!r}")
    return x


def binary(imp, node, name, args, kwargs):
    a, b = args[0], _get(args, kwargs, 1, "other")
    if kwargs.get("alpha", 1) != 1:
        raise imp.fail(node, f"{imp.kind(node)}: alpha={kwargs['alpha']!r} is not supported")
    if not isinstance(a, Var) and not isinstance(b, Var):  # sizes: computed here, not written
        return {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
                "@": operator.matmul}[_BINARY[name]](a, b)
    return imp.em.assign(node.name, f"{code(a)} {_BINARY[name]} {code(b)}")


def floordiv(imp, node, name, args, kwargs):
    a, b = args[0], args[1]
    if isinstance(a, Var) or isinstance(b, Var):
        raise imp.fail(node, f"unsupported PyTorch operation {imp.kind(node)} on tensors")
    return a // b


def neg(imp, node, name, args, kwargs):
    x = args[0]
    return -x if not isinstance(x, Var) else imp.em.assign(node.name, f"-{code(x)}")


def unary(imp, node, name, args, kwargs):
    x = _tensor(imp, node, args[0])
    if kwargs.get("approximate", "none") != "none":
        raise imp.fail(node, f"{imp.kind(node)}: approximate={kwargs['approximate']!r} is not supported")
    return imp.em.assign(node.name, f"dg.{name}({code(x)})")


def hardtanh(imp, node, name, args, kwargs):
    x = _tensor(imp, node, args[0])
    low, high = _get(args, kwargs, 1, "min_val", -1.0), _get(args, kwargs, 2, "max_val", 1.0)
    if (low, high) != (0, 6):
        raise imp.fail(node, f"{imp.kind(node)}: only min_val=0, max_val=6 (relu6) is supported, got {low}, {high}")
    return imp.em.assign(node.name, f"dg.relu6({code(x)})")


def compare(imp, node, name, args, kwargs):
    """A comparison of sizes (`h == self.image_size`): a bool, or for symbolic sizes a sympy
    relation `_assert` checks at the example sizes. Never a statement of the model."""
    a, b = args[0], _get(args, kwargs, 1, "other")
    if isinstance(a, Var) or isinstance(b, Var):
        raise imp.fail(node, f"unsupported PyTorch operation {imp.kind(node)} on tensors")
    if isinstance(a, sympy.Basic) or isinstance(b, sympy.Basic):
        relation = {"eq": sympy.Eq, "ne": sympy.Ne, "lt": sympy.Lt, "le": sympy.Le, "gt": sympy.Gt,
                    "ge": sympy.Ge}[name](a, b)
        return bool(relation) if relation in (sympy.true, sympy.false) else relation
    return _COMPARE[name](a, b)


def check_assert(imp, node, name, args, kwargs):
    """torch._assert(condition, message) on sizes: checked here, at the example sizes, and
    dropped from the model (its sizes are fixed by the inputs' declarations)."""
    condition, message = args[0], _get(args, kwargs, 1, "message", "")
    if isinstance(condition, Var):
        raise imp.fail(node, f"{imp.kind(node)} on a tensor's values is not supported (only on sizes)")
    if isinstance(condition, sympy.Basic):
        condition = condition.subs(imp.sizes)
    if not bool(condition):
        raise imp.fail(node, f"the module's assertion fails with the example inputs: {message}")
    return None


def expand(imp, node, name, args, kwargs):
    x = _tensor(imp, node, args[0])
    shape = _shape_args(args, kwargs, "size")
    return imp.em.assign(node.name, f"dg.expand({code(x)}, {code(shape)})")


def layer_norm(imp, node, name, args, kwargs):
    x, shape, w, b, eps = (_get(args, kwargs, i, k, d) for i, (k, d) in enumerate(
        (("input", None), ("normalized_shape", None), ("weight", None), ("bias", None), ("eps", 1e-5))))
    x = _tensor(imp, node, x)
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    if len(shape) != 1 or not isinstance(w, Var) or not isinstance(b, Var):
        raise imp.fail(node, f"{imp.kind(node)}: only over the last axis, with a weight and a bias")
    return imp.em.assign(node.name, f"dg.layer_norm({code(x)}, {code(w)}, {code(b)}, eps={eps!r})")


def adaptive_avg_pool(imp, node, name, args, kwargs):
    from .modules import adaptive_pool_to

    return adaptive_pool_to(imp, node, _tensor(imp, node, args[0]), _get(args, kwargs, 1, "output_size"))


def pool(imp, node, name, args, kwargs):
    from .modules import pool_args

    x = _tensor(imp, node, args[0])
    keys = ["kernel_size", "stride", "padding"] + (["dilation", "ceil_mode", "return_indices"] if name == "max_pool2d"
                                                    else ["ceil_mode", "count_include_pad", "divisor_override"])
    values = {k: _get(args, kwargs, i + 1, k) for i, k in enumerate(keys)}
    if values.get("dilation") not in (None, 1, (1, 1), [1, 1]) or values.get("return_indices") or \
            values.get("count_include_pad") is False or values.get("divisor_override") is not None:
        raise imp.fail(node, f"{imp.kind(node)}: dilation, return_indices, count_include_pad=False or "
                             "divisor_override is not supported")
    opts = pool_args(values["kernel_size"], values["stride"], values["padding"] or 0, values["ceil_mode"])
    return imp.em.assign(node.name, f"dg.{name}({code(x)}, {', '.join(opts)})")


def stochastic_depth(imp, node, name, args, kwargs):
    """torchvision.ops.stochastic_depth: dg.stochastic_depth, identity in eval mode (the
    mode the module was traced in is not baked in: the model's own mode decides)."""
    x = _tensor(imp, node, args[0])
    p, mode = _get(args, kwargs, 1, "p"), _get(args, kwargs, 2, "mode")
    if p == 0:
        return x
    return imp.em.assign(node.name, f'dg.stochastic_depth({code(x)}, p={p!r}, mode="{mode}")')


def linear(imp, node, name, args, kwargs):
    x, w, b = (_get(args, kwargs, i, k) for i, k in enumerate(("input", "weight", "bias")))
    return imp.em.assign(node.name, f"dg.linear_t({code(x)}, {code(w)}{', ' + code(b) if b is not None else ''})")


def dropout(imp, node, name, args, kwargs):
    x, p, training = args[0], _get(args, kwargs, 1, "p", 0.5), _get(args, kwargs, 2, "training", True)
    if not training or p == 0:
        return x
    return imp.em.assign(node.name, f"dg.dropout({code(x)}, p={p!r})")


def identity(imp, node, name, args, kwargs):
    return _tensor(imp, node, args[0])


def getitem(imp, node, name, args, kwargs):
    x, index = args
    if not isinstance(x, Var):
        return x[index]  # a tuple of module results, or of sizes
    if isinstance(index, Var):  # rows picked by an integer tensor
        return take(imp, node, x, index)
    return _index(imp, node, x, index if isinstance(index, tuple) else (index,))


def _index(imp, node, x, index):
    """x[...] with slices (step 1), ints (the axis dropped), None and `...`."""
    if any(i is Ellipsis for i in index):
        at = index.index(Ellipsis)
        rest = sum(1 for i in index if i is not None and i is not Ellipsis)
        index = index[:at] + (slice(None),) * (x.tensor.ndim - rest) + index[at + 1:]
    parts, keep, live = [], [], []  # the text per axis, which result axes stay, the live slices
    for i in index:
        if i is None:
            keep.append("new")
        elif isinstance(i, slice) and (i.step is None or isinstance(i.step, int) and i.step >= 1):
            step = "" if i.step in (None, 1) else f":{i.step}"
            parts.append(f"{'' if i.start is None else code(i.start)}:{'' if i.stop is None else code(i.stop)}{step}")
            live.append(slice(i.start, i.stop, i.step))
            keep.append(True)
        elif isinstance(i, int) and not isinstance(i, bool):
            stop = None if i == -1 else i + 1
            parts.append(f"{i}:{'' if stop is None else stop}")
            live.append(slice(i, stop))
            keep.append(False)
        else:
            raise imp.fail(node, f"indexing with {i!r} is not supported (slices with positive steps, ints, None and ...)")
    while parts and parts[-1] == ":":
        parts.pop()
    text = f"{code(x)}[{', '.join(parts)}]" if parts else code(x)
    if all(k is True for k in keep):
        return imp.em.assign(f"{x.name}_part", text) if parts else x
    ints = [i for i in index if isinstance(i, int) and not isinstance(i, bool)]
    hint = f"{x.name}_{'last' if ints == [-1] else 'part'}"
    sliced = x.tensor[tuple(live)].shape if parts else x.tensor.shape
    shape, axis = [], 0
    for k in keep:
        if k == "new":
            shape.append(1)
            continue
        if k:
            shape.append(sliced[axis])
        axis += 1
    shape += list(sliced[axis:])
    return imp.em.assign(hint, f"dg.reshape({text}, {code(tuple(shape))})")


def get_attribute(imp, node, name, args, kwargs):
    x, attr = args
    if isinstance(x, Var) and attr == "shape":
        return tuple(x.tensor.shape)
    if isinstance(x, Var) and attr == "ndim":
        return x.tensor.ndim
    if isinstance(x, Var) and attr == "T":
        return _permute(imp, node, x, tuple(range(x.tensor.ndim))[::-1])
    raise imp.fail(node, f"unsupported attribute Tensor.{attr}")


def size(imp, node, name, args, kwargs):
    x, dim = _tensor(imp, node, args[0]), _get(args, kwargs, 1, "dim")
    return tuple(x.tensor.shape) if dim is None else x.tensor.shape[dim]


def ndim(imp, node, name, args, kwargs):
    return _tensor(imp, node, args[0]).tensor.ndim


def _shape_args(args, kwargs, key):
    rest = args[1:] or [kwargs.get(key)]
    return tuple(rest[0]) if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else tuple(rest)


def reshape(imp, node, name, args, kwargs):
    x = _tensor(imp, node, args[0])
    return imp.em.assign(node.name, f"dg.reshape({code(x)}, {code(_shape_args(args, kwargs, 'shape'))})")


def unsqueeze(imp, node, name, args, kwargs):
    x = _tensor(imp, node, args[0])
    dim = _get(args, kwargs, 1, "dim")
    shape = list(x.tensor.shape)
    shape.insert(dim % (len(shape) + 1), 1)
    return imp.em.assign(node.name, f"dg.reshape({code(x)}, {code(tuple(shape))})")


def flatten(imp, node, name, args, kwargs):
    x = _tensor(imp, node, args[0])
    return flatten_to(imp, node, x, _get(args, kwargs, 1, "start_dim", 0), _get(args, kwargs, 2, "end_dim", -1))


def flatten_to(imp, node, x, start, end):
    rank = x.tensor.ndim
    start, end = start % rank if rank else 0, end % rank if rank else 0
    if start == 1 and end == rank - 1 and rank >= 2:
        return imp.em.assign(node.name, f"dg.flatten({code(x)})")
    if start >= end:
        return x
    shape = tuple(x.tensor.shape)
    merged = sympy.expand(math.prod(sympy.sympify(d) for d in shape[start:end + 1]))
    merged = int(merged) if merged.is_Integer else merged
    return imp.em.assign(node.name, f"dg.reshape({code(x)}, {code(shape[:start] + (merged,) + shape[end + 1:])})")


def _permute(imp, node, x, perm):
    return imp.em.assign(node.name, f"dg.transpose({code(x)}, {code(tuple(p % x.tensor.ndim for p in perm))})")


def permute(imp, node, name, args, kwargs):
    return _permute(imp, node, _tensor(imp, node, args[0]), _shape_args(args, kwargs, "dims"))


def transpose(imp, node, name, args, kwargs):
    x = _tensor(imp, node, args[0])
    perm = list(range(x.tensor.ndim))
    if name == "t":
        perm = perm[::-1]
    else:
        a, b = (_get(args, kwargs, i, k) % x.tensor.ndim for i, k in ((1, "dim0"), (2, "dim1")))
        perm[a], perm[b] = perm[b], perm[a]
    return _permute(imp, node, x, tuple(perm))


def cat(imp, node, name, args, kwargs):
    tensors, dim = _get(args, kwargs, 0, "tensors"), _get(args, kwargs, 1, "dim", 0)
    tensors = [_tensor(imp, node, t, "each tensor") for t in tensors]
    return imp.em.assign(node.name, f"dg.concat({code(list(tensors))}, axis={dim})")


def split(imp, node, name, args, kwargs):
    x = _tensor(imp, node, args[0])
    dim = _get(args, kwargs, 2, "dim", 0) % x.tensor.ndim
    length = x.tensor.shape[dim]
    if name == "chunk":
        chunks = _get(args, kwargs, 1, "chunks")
        if not isinstance(length, int):
            raise imp.fail(node, f"chunk of the symbolic axis {dim} ({length}) is not supported")
        step = -(-length // chunks)
        sizes = [min(step, length - s) for s in range(0, length, step)]
    else:
        sizes = _get(args, kwargs, 1, "split_size_or_sections", _get(args, kwargs, 1, "split_size"))
        if isinstance(sizes, int):
            if not isinstance(length, int):
                raise imp.fail(node, f"splitting the symbolic axis {dim} ({length}) in pieces of {sizes} is not "
                                     "supported: give the sizes")
            sizes = [min(sizes, length - s) for s in range(0, length, sizes)]
    names = [imp.em.fresh(f"{node.name}_{i}") for i in range(len(sizes))]
    imp.em.statement(f"{', '.join(names)}{',' if len(names) == 1 else ''} = "
                     f"dg.split({code(x)}, {code(list(sizes))}, axis={dim})")
    return tuple(imp.em.var(n) for n in names)


def softmax(imp, node, name, args, kwargs):
    x, dim = _tensor(imp, node, args[0]), _get(args, kwargs, 1, "dim")
    if dim is None or kwargs.get("dtype") is not None:
        raise imp.fail(node, f"{imp.kind(node)} needs dim= (and no dtype=)")
    return imp.em.assign(node.name, f"dg.{name}({code(x)}, axis={dim})")


def reduce(imp, node, name, args, kwargs):
    x, dim = _tensor(imp, node, args[0]), _get(args, kwargs, 1, "dim")
    keep = _get(args, kwargs, 2, "keepdim", False)
    if kwargs.get("dtype") is not None:
        raise imp.fail(node, f"{imp.kind(node)}: dtype= is not supported")
    axis = "" if dim is None else f", axis={code(tuple(dim) if isinstance(dim, list) else dim)}"
    return imp.em.assign(node.name, f"dg.{name}({code(x)}{axis}{', keepdims=True' if keep else ''})")


HANDLERS = {
    **{op: binary for op in _BINARY}, "floordiv": floordiv, "neg": neg,
    **{op: unary for op in _UNARY}, "linear": linear, "dropout": dropout, "contiguous": identity,
    "getitem": getitem, "getattr": get_attribute, "size": size, "dim": ndim,
    "view": reshape, "reshape": reshape, "flatten": flatten, "permute": permute, "transpose": transpose, "t": transpose,
    "swapaxes": transpose, "swapdims": transpose, "unsqueeze": unsqueeze,
    "cat": cat, "concat": cat, "split": split, "chunk": split,
    "softmax": softmax, "log_softmax": softmax, "mean": reduce, "sum": reduce,
    "hardtanh": hardtanh, **{op: compare for op in _COMPARE}, "_assert": check_assert, "expand": expand,
    "layer_norm": layer_norm, "adaptive_avg_pool2d": adaptive_avg_pool, "max_pool2d": pool, "avg_pool2d": pool,
    "stochastic_depth": stochastic_depth,
}

from .windows import HANDLERS as _WINDOW_HANDLERS, LIBRARY as _WINDOW_LIBRARY, take  # noqa: E402  (they use the helpers above)

HANDLERS.update(_WINDOW_HANDLERS)
_LIBRARY.update(_WINDOW_LIBRARY)
