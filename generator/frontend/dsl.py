"""The user-facing DSL: inputs, parameters, ops and helpers.

    import generator as dg
    N = dg.dim("N")

    @dg.model
    def mlp():
        x = dg.input("x", (N, 784))
        h = dg.dense(x, 512, act=dg.relu)
        return dg.dense(h, 10)

Every function checks its operands at once and raises an error naming the
user's line, the op, and the expected versus the actual shapes.
"""

from __future__ import annotations

import builtins
import numbers

import sympy

from . import initializers as inits
from .builder import Tensor, current
from ..errors import ModelError, ShapeError
from ..ir.names import problem_with
from ..ops import ARGS, SCALAR_FUNCS, scalar_expr
from ..ir.shapes import contiguous_groups, fmt_dim, fmt_shape, norm_dim, normalize_axis, numel, same
from .source import user_loc

__all__ = [
    "input", "param", "elementwise", "leaky_relu", "elu", "matmul", "bmm", "sum", "mean", "max",
    "softmax", "log_softmax", "cumsum", "round_bf16", "reshape", "expand", "transpose", "concat", "split", "slice_axis",
    "gather", "dense", "linear", "embedding", "add", "sub", "mul", "div", "pow",
    "maximum", "minimum",
]

# -- declarations --------------------------------------------------------------


def input(name=None, shape=None, dtype: str = "float32") -> Tensor:  # noqa: A001
    """A named model input; `shape` entries are ints or symbolic dims (dg.dim)."""
    if shape is None and not isinstance(name, str):
        name, shape = None, name
    b, loc = current(), user_loc()
    if shape is None:
        raise ModelError("dg.input needs a shape, e.g. dg.input('x', (N, 784))", loc, "input")
    explicit = name is not None
    return b.declare("input", name if explicit else b.default_name(loc, "input"), shape, dtype, explicit, loc)


def param(name=None, shape=None, init=None, seed: int | None = None) -> Tensor:
    """A trainable float32 parameter with a concrete shape and an initializer
    (default glorot_uniform). `seed` fixes this parameter's draw regardless of
    the seed the Model is constructed with."""
    if shape is None and not isinstance(name, str):
        name, shape = None, name
    b, loc = current(), user_loc()
    init = init if init is not None else inits.glorot_uniform()
    if not isinstance(init, inits.Init):
        raise ModelError(f"init must be a dg initializer such as dg.normal(0, 0.1), got {init!r}", loc, "param")
    if shape is None or any(not isinstance(norm_dim(d), int) for d in (shape if isinstance(shape, (tuple, list)) else (shape,))):
        raise ModelError(f"a parameter needs a concrete shape (ints only), got {shape!r}", loc, "param")
    if seed is not None and (not isinstance(seed, int) or seed < 0):
        raise ModelError(f"seed must be a non-negative int, got {seed!r}", loc, "param")
    explicit = name is not None
    name = name if explicit else b.default_name(loc, "parameter")
    return b.declare("param", name, shape, "float32", explicit, loc, init=init, seed=seed)


# -- elementwise -------------------------------------------------------------


def _ewise(fn: str, operands, make_expr=None, name=None) -> Tensor:
    """One `ewise` node: tensors become the symbols x0, x1, ...; numbers are constants."""
    tensors, symbols = [], []
    for o in operands:
        if isinstance(o, Tensor):
            if o.value not in [t.value for t in tensors]:
                tensors.append(o)
            symbols.append(ARGS[[t.value for t in tensors].index(o.value)])
        elif isinstance(o, numbers.Real) and not isinstance(o, bool):
            symbols.append(sympy.Integer(int(o)) if isinstance(o, numbers.Integral) else sympy.Float(float(o)))
        else:
            raise ModelError(f"operand {o!r} is not a Tensor or a number", user_loc(), fn)
    if not tensors:
        raise ModelError("at least one operand must be a Tensor", user_loc(), fn)
    expr = make_expr(*symbols) if make_expr else scalar_expr(fn, *symbols)
    return current().add("ewise", tensors, {"fn": fn, "expr": expr}, label=fn, name=name)[0]


def _unary(fn):
    def apply(x, name=None):
        return _ewise(fn, [x], name=name)

    apply.__name__ = fn
    apply.__doc__ = f"{fn}(x) elementwise; defined by the sympy expression {scalar_expr(fn, ARGS[0])}."
    return apply


def _binary(fn):
    def apply(a, b, name=None):
        return _ewise(fn, [a, b], name=name)

    apply.__name__ = fn
    apply.__doc__ = f"{fn}(a, b) elementwise with numpy broadcasting."
    return apply


_UNARY = [f for f, (arity, _) in SCALAR_FUNCS.items() if arity == 1]
for _fn in _UNARY:
    globals()[_fn] = _unary(_fn)
    __all__.append(_fn)
for _fn in ("add", "sub", "mul", "div", "pow", "maximum", "minimum"):
    globals()[_fn] = _binary(_fn)


def elementwise(fn, name: str | None = None):
    """A new elementwise op from a function of sympy symbols, e.g.
    `mish = dg.elementwise(lambda x: x * sympy.tanh(sympy.log(1 + sympy.exp(x))), "mish")`.
    Its reference, C++ code and (later) derivative all come from the expression."""
    label = name or getattr(fn, "__name__", "custom")
    if label == "<lambda>":
        label = "custom"
    problem = problem_with(label)
    if problem:
        raise ModelError(problem, user_loc(), "dg.elementwise")

    def apply(*operands, name=None):
        symbols = ARGS[: len(operands)]
        try:
            expr = sympy.sympify(fn(*symbols))
        except Exception as e:  # the user's function failed on symbols
            raise ModelError(f"elementwise function {label!r} failed on sympy symbols: {e}", user_loc(), label)
        if not isinstance(expr, sympy.Expr) or not expr.free_symbols <= set(symbols):
            raise ModelError(
                f"elementwise function {label!r} must return a sympy expression of its arguments, got {expr!r}",
                user_loc(),
                label,
            )
        return _ewise(label, operands, lambda *syms: expr.xreplace(dict(zip(symbols, syms))), name=name)

    apply.__name__ = label
    return apply


def leaky_relu(x, alpha: float = 0.01, name=None):
    return _ewise("leaky_relu", [x], lambda s: sympy.Max(s, 0) + alpha * sympy.Min(s, 0), name=name)


def elu(x, alpha: float = 1.0, name=None):
    return _ewise("elu", [x], lambda s: sympy.Piecewise((s, s > 0), (alpha * (sympy.exp(s) - 1), True)), name=name)


# -- tensor ops ----------------------------------------------------------------


def _tensor(x, op):
    if not isinstance(x, Tensor):
        raise ModelError(f"expected a Tensor, got {type(x).__name__}", user_loc(), op)
    return x


def _axis(x, axis, op, loc):
    """`axis` of `x` as a non-negative int; an axis beyond the rank is a ShapeError
    naming the tensor and its shape."""
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise ModelError(f"axis must be an int, got {axis!r}", loc, op)
    try:
        return normalize_axis(axis, x.ndim)
    except ValueError:
        raise ShapeError(
            f"axis {axis} is out of range for '{x.name}' {fmt_shape(x.shape)} (rank {x.ndim})", loc, op
        ) from None


def matmul(a, b, tb: bool = False, name=None) -> Tensor:
    """a[..., K] @ b[K, P] -> [..., P]; with tb, b is stored [P, K] (a PyTorch Linear
    weight: x @ W^T without a transposed copy). A b of rank above 2 is a batched
    product (`bmm`)."""
    a, b = _tensor(a, "matmul"), _tensor(b, "matmul")
    if b.ndim > 2 and a.ndim == b.ndim:  # else matmul's shape rule names the 2-D b it wants
        return bmm(a, b, tb=tb, name=name)
    return current().add("matmul", [a, b], {"tb": True} if tb else {}, name=name)[0]


def bmm(a, b, ta: bool = False, tb: bool = False, name=None) -> Tensor:
    """Batched product of two activations: a[..., M, K] @ b[..., K, P] -> [..., M, P],
    one product per index of the leading axes (which must agree). ta / tb: that
    operand is stored with its last two axes swapped (q @ k^T is bmm(q, k, tb=True))."""
    a, b = _tensor(a, "bmm"), _tensor(b, "bmm")
    flags = {k: True for k, v in (("ta", ta), ("tb", tb)) if v}
    return current().add("bmm", [a, b], flags, name=name)[0]


def _reduce(op, x, axis, keepdims, name):
    x = _tensor(x, op)
    loc = user_loc()
    wanted = range(x.ndim) if axis is None else (axis if isinstance(axis, (tuple, list)) else (axis,))
    axes = sorted({_axis(x, a, op, loc) for a in wanted})
    if not axes and x.ndim == 0:
        return x  # reducing a scalar over all (no) axes leaves it as it is, as in numpy
    if not axes:
        raise ModelError("no axes to reduce", loc, op)
    groups = contiguous_groups(axes)
    # Reduce the last group first so earlier axis numbers stay valid.
    for i, (lo, hi) in enumerate(reversed(groups)):
        last = i == len(groups) - 1
        x = current().add(op, [x], {"axes": (lo, hi), "keepdims": bool(keepdims)}, name=name if last else None)[0]
    return x


def sum(x, axis=None, keepdims=False, name=None):  # noqa: A001
    return _reduce("sum", x, axis, keepdims, name)


def mean(x, axis=None, keepdims=False, name=None):
    return _reduce("mean", x, axis, keepdims, name)


def max(x, axis=None, keepdims=False, name=None):  # noqa: A001
    return _reduce("max", x, axis, keepdims, name)


def _axis_op(op, x, axis, name):
    x = _tensor(x, op)
    axis = _axis(x, axis, op, user_loc())
    return current().add(op, [x], {"axis": axis}, name=name)[0]


def softmax(x, axis=-1, mask=None, name=None):
    """softmax along `axis`; `mask`, an additive float mask that broadcasts to x
    (0 to keep, -inf to drop, such as dg.length_mask makes), is added first."""
    if mask is not None:
        x, mask = _tensor(x, "softmax"), _tensor(mask, "softmax")
        if mask.ndim > x.ndim or any(not (same(m, 1) or same(m, d)) for m, d in zip(mask.shape[::-1], x.shape[::-1])):
            raise ShapeError(f"mask '{mask.name}' {fmt_shape(mask.shape)} does not broadcast to '{x.name}' "
                             f"{fmt_shape(x.shape)}", user_loc(), "softmax")
        x = x + mask
    return _axis_op("softmax", x, axis, name)


def log_softmax(x, axis=-1, name=None):
    return _axis_op("log_softmax", x, axis, name)


def cumsum(x, axis, name=None):
    """Inclusive prefix sums along `axis`, as numpy.cumsum and torch.cumsum."""
    x = _tensor(x, "cumsum")
    axis = _axis(x, axis, "cumsum", user_loc())
    return current().add("cumsum", [x], {"axis": axis, "reverse": False}, name=name)[0]


def round_bf16(x, name=None):
    """x rounded to bfloat16 (round to nearest, ties to even; NaN stays NaN), kept as
    float32: the step `--precision bf16` puts before every product's operands."""
    x = _tensor(x, "round_bf16")
    return current().add("round_bf16", [x], {}, name=name)[0]


def expand(x, shape, name=None):
    """torch.Tensor.expand: x broadcast to `shape` (a new tensor; numpy's rules): sizes 1
    stretch, new axes come in front, -1 keeps a size. Its gradient sums over the
    stretched axes."""
    x = _tensor(x, "expand")
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    loc = user_loc()
    lead = len(shape) - x.ndim
    if lead < 0:
        raise ShapeError(f"cannot expand '{x.name}' {fmt_shape(x.shape)} to {len(shape)} dimensions", loc, "expand")
    try:
        out = []
        for i, d in enumerate(shape):
            if isinstance(d, int) and not isinstance(d, bool) and d == -1:
                if i < lead:
                    raise ShapeError(f"-1 at position {i} of {shape}: a new leading axis needs a size", loc, "expand")
                d = x.shape[i - lead]
            out.append(norm_dim(d))
    except TypeError as e:
        raise ModelError(str(e), loc, "expand") from None
    for i, d in enumerate(x.shape):
        if d != 1 and d != out[lead + i]:
            raise ShapeError(f"'{x.name}' {fmt_shape(x.shape)} cannot expand to {fmt_shape(tuple(out))}: axis {i} "
                             f"has size {d}, not 1", loc, "expand")
    return current().add("ewise", [x], {"fn": "expand", "expr": ARGS[0], "shape": tuple(out)}, label="expand",
                         name=name)[0]


def reshape(x, shape, name=None):
    """New shape with the same number of elements; one entry may be -1."""
    x = _tensor(x, "reshape")
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    loc = user_loc()
    if builtins.sum(1 for d in shape if isinstance(d, int) and d == -1) > 1:
        raise ModelError(f"only one dimension may be -1, got {shape}", loc, "reshape")
    try:
        known = [norm_dim(d) for d in shape if not (isinstance(d, int) and d == -1)]
    except TypeError as e:
        raise ModelError(str(e), loc, "reshape") from None
    if len(known) < len(shape):
        rest = sympy.cancel(sympy.sympify(numel(x.shape)) / sympy.sympify(numel(known)))
        if sympy.fraction(rest)[1] != 1:
            raise ShapeError(
                f"cannot infer -1 in {shape}: {numel(x.shape)} elements of '{x.name}' {fmt_shape(x.shape)} "
                f"are not divisible by {numel(known)} for every size",
                loc,
                "reshape",
            )
        shape = tuple(norm_dim(rest) if isinstance(d, int) and d == -1 else d for d in shape)
    return current().add("reshape", [x], {"shape": tuple(norm_dim(d) for d in shape)}, name=name)[0]


def transpose(x, perm=None, name=None):
    x = _tensor(x, "transpose")
    perm = tuple(range(x.ndim))[::-1] if perm is None else tuple(perm)
    return current().add("transpose", [x], {"perm": perm}, name=name)[0]


def concat(tensors, axis=0, name=None):
    tensors = [_tensor(t, "concat") for t in tensors]
    if not tensors:
        raise ModelError("concat needs at least one tensor", user_loc(), "concat")
    axis = _axis(tensors[0], axis, "concat", user_loc())
    return current().add("concat", tensors, {"axis": axis}, name=name)[0]


def split(x, sizes, axis=0):
    """Split along `axis` into pieces of the given sizes, or into `sizes` equal pieces."""
    x = _tensor(x, "split")
    loc = user_loc()
    axis = _axis(x, axis, "split", loc)
    length = x.shape[axis]
    what = f"axis {axis} of '{x.name}' {fmt_shape(x.shape)}"
    if isinstance(sizes, int) and not isinstance(sizes, bool):
        if not isinstance(length, int) or sizes <= 0 or length % sizes:
            raise ShapeError(
                f"cannot split {what} (size {fmt_dim(length)}) into {sizes} equal pieces", loc, "split"
            )
        sizes = [length // sizes] * sizes
    try:
        sizes = [norm_dim(s) for s in sizes]
    except TypeError as e:
        raise ModelError(f"split sizes: {e}", loc, "split") from None
    if any(isinstance(s, int) and s < 0 for s in sizes):
        raise ShapeError(f"split sizes {fmt_shape(sizes)} must not be negative", loc, "split")
    total = sympy.expand(builtins.sum(sympy.sympify(s) for s in sizes))
    if sympy.simplify(total - sympy.sympify(length)) != 0:
        raise ShapeError(
            f"sizes {fmt_shape(sizes)} add up to {fmt_dim(total)}, but {what} has size {fmt_dim(length)}",
            loc,
            "split",
        )
    bounds, start = [], 0
    for s in sizes:
        stop = norm_dim(sympy.expand(sympy.sympify(start) + s))
        bounds.append((start, stop))
        start = stop
    return tuple(current().add("slice", [x], {"axis": axis, "bounds": tuple(bounds)}, label="split"))


def slice_axis(x, axis, start=None, stop=None, name=None):
    """x[start:stop] along one axis (step 1). Bounds may be negative (from the end)."""
    x = _tensor(x, "slice")
    loc = user_loc()
    axis = _axis(x, axis, "slice", loc)
    length = x.shape[axis]
    if isinstance(length, int) and all(isinstance(b, int) or b is None for b in (start, stop)):
        # No clamping: a bound outside the axis is an error, not a silently smaller tensor.
        lo = 0 if start is None else (length + start if start < 0 else start)
        hi = length if stop is None else (length + stop if stop < 0 else stop)
        if not 0 <= lo <= hi <= length:
            text = f"{'' if start is None else start}:{'' if stop is None else stop}"
            raise ShapeError(
                f"slice {text} of axis {axis} is out of range for '{x.name}' {fmt_shape(x.shape)}", loc, "slice"
            )
        start, stop = lo, hi
    else:
        start = 0 if start is None else (length + start if start < 0 else start)
        stop = length if stop is None else (length + stop if stop < 0 else stop)
        start, stop = norm_dim(start), norm_dim(stop)
        b = current()
        b.require(norm_dim(sympy.expand(stop - start)), f"slice [{start}:{stop}] at {loc.short if loc else '?'} needs a non-empty range")
        b.require(norm_dim(sympy.expand(length - stop)), f"slice stop {stop} at {loc.short if loc else '?'} must not exceed {length}")
    return current().add("slice", [x], {"axis": axis, "bounds": ((start, stop),)}, name=name)[0]


def gather(table, ids, name=None):
    """Rows of `table` picked by the integer tensor `ids`: shape ids.shape + table.shape[1:]."""
    return current().add("gather", [_tensor(table, "gather"), _tensor(ids, "gather")], {}, name=name)[0]


# -- helpers -------------------------------------------------------------------


def dense(x, units: int, act=None, bias: bool = True, name: str | None = None, init=None, bias_init=None):
    """x @ W + b, then `act` (a DSL function such as dg.relu, or its name).
    Parameters are named `<name>_w` and `<name>_b`, where name defaults to the
    variable the result is assigned to."""
    x = _tensor(x, "dense")
    loc = user_loc()
    b = current()
    if not isinstance(units, int) or isinstance(units, bool) or units <= 0:
        raise ModelError(f"units must be a positive int, got {units!r}", loc, "dense")
    if not isinstance(x.shape[-1], int):
        raise ModelError(f"the last dimension of '{x.name}' {fmt_shape(x.shape)} must be concrete", loc, "dense")
    if isinstance(act, str) and act not in _UNARY:
        raise ModelError(f"unknown activation {act!r}; known: {', '.join(_UNARY)}", loc, "dense")
    _check_init(init, loc, "dense")
    _check_init(bias_init, loc, "dense")
    base = name if name is not None else b.default_name(loc, "dense layer")
    names = b.derived_names(base, ["w", "b"] if bias else ["w"], name is not None, loc, "dense")
    w = _helper_param(b, loc, names[0], (x.shape[-1], units), init or inits.glorot_uniform())
    y = matmul(x, w)
    if bias:
        y = y + _helper_param(b, loc, names[1], (units,), bias_init or inits.zeros())
    if act is not None:
        if isinstance(act, str):
            act = globals()[act]
        y = act(y)
    return y


linear = dense


def embedding(ids, vocab: int, width: int, name: str | None = None, init=None):
    """A [vocab, width] table parameter and the lookup of `ids` in it."""
    b, loc = current(), user_loc()
    for what, n in (("vocab", vocab), ("width", width)):
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise ModelError(f"{what} must be a positive int, got {n!r}", loc, "embedding")
    _check_init(init, loc, "embedding")
    base = name if name is not None else b.default_name(loc, "embedding")
    (table_name,) = b.derived_names(base, ["table"], name is not None, loc, "embedding")
    table = _helper_param(b, loc, table_name, (vocab, width), init or inits.normal(0.0, 1.0))
    return gather(table, ids)


def _check_init(init, loc, op):
    if init is not None and not isinstance(init, inits.Init):
        raise ModelError(f"init must be a dg initializer such as dg.normal(0, 0.1), got {init!r}", loc, op)


def _helper_param(b, loc, name, shape, init):
    """A parameter of a helper (dense, embedding) whose name `derived_names` claimed."""
    return b.declare("param", name, shape, "float32", True, loc, claimed=True, init=init, seed=None)


# -- Tensor operators ------------------------------------------------------------


def _getitem(self, index):
    index = index if isinstance(index, tuple) else (index,)
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (self.ndim - len(index) + 1) + index[at + 1 :]
    if len(index) > self.ndim:
        raise ModelError(f"too many indices ({len(index)}) for '{self.name}' {fmt_shape(self.shape)}", user_loc(), "slice")
    y = self
    for axis, s in enumerate(index):
        if not isinstance(s, slice):
            raise ModelError(
                f"only slices (a:b) are supported in indexing, got {s!r}; use dg.reshape to drop an axis",
                user_loc(),
                "slice",
            )
        if s.step not in (None, 1):
            from .windows import strided_slice  # (windows.py builds on this module)

            y = strided_slice(y, axis, s.start, s.stop, s.step)
            continue
        if s.start is None and s.stop is None:
            continue
        y = slice_axis(y, axis, s.start, s.stop)
    return y


Tensor.__add__ = lambda a, b: _ewise("add", [a, b])
Tensor.__radd__ = lambda a, b: _ewise("add", [b, a])
Tensor.__sub__ = lambda a, b: _ewise("sub", [a, b])
Tensor.__rsub__ = lambda a, b: _ewise("sub", [b, a])
Tensor.__mul__ = lambda a, b: _ewise("mul", [a, b])
Tensor.__rmul__ = lambda a, b: _ewise("mul", [b, a])
Tensor.__truediv__ = lambda a, b: _ewise("div", [a, b])
Tensor.__rtruediv__ = lambda a, b: _ewise("div", [b, a])
Tensor.__pow__ = lambda a, b: _ewise("pow", [a, b])
Tensor.__rpow__ = lambda a, b: _ewise("pow", [b, a])
Tensor.__neg__ = lambda a: _ewise("neg", [a])
Tensor.__matmul__ = lambda a, b: matmul(a, b)  # bmm when b has more than 2 axes
Tensor.__getitem__ = _getitem
Tensor.T = property(lambda a: transpose(a))
