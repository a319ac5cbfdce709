"""ONNX values computed without the model's float values: attention masks and position ids.

Exporters of Hugging Face models write the attention mask and the position ids as
integer / boolean arithmetic on the inputs' sizes and on `attention_mask` (Range,
Equal, Where, Expand, GatherElements, And, CumSum, ...). The DSL has no such ops and
needs none: such a value is a `Derived` (no statement), and the float op that reads
it recognizes what it is by its values, as the torch.export front end does
(export.py): the derived sub-graph is run by onnx's reference evaluator on probes
(other sizes, other masks), and

- an additive mask added to attention scores is `dg.key_mask(attention_mask)` (key
  padding), `dg.causal_mask(T)`, or both;
- the ids an embedding table is gathered by are an arange (`table[first:first + T]`)
  or one id (token type 0).

Anything else is an error naming the op, the node and the opset. An integer input
read by an embedding gather (input_ids) is probed with an id that equals no constant
of the file (RoBERTa's position ids count its non-padding tokens: the file notes that
they are taken as an arange, exact while input_ids holds no padding id).
"""

from __future__ import annotations

import numpy as np
import sympy

from .emitter import Var, code
from .onnx_common import _onnx_dtype
from .onnx_import import Const, Derived

__all__ = ["Derived", "additive_mask", "embedding_rows", "is_derived"]

_PROBE_ID = 1_000_003  # an input id no exporter compares with (a padding id is small)
_PLUMBING = ("Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Transpose", "Slice", "Concat")


def is_derived(imp, node, ins) -> bool:
    """Does node compute a derived value (reads no float tensor of the model, and reads a
    derived value or computes more than plumbing on an integer input)?"""
    if any(isinstance(v, Var) and v.tensor.dtype == "float32" for v in ins):
        return False
    if node.op_type == "Gather" and isinstance(ins[0], Const) and ins[0].value.dtype.kind == "f":
        return False  # an embedding lookup (onnx_shapes.gather reads derived ids)
    if any(isinstance(v, Derived) for v in ins):
        return True
    ints = [v for v in ins if isinstance(v, Var)]
    if not ints or node.op_type in _PLUMBING:
        return False
    if node.op_type == "Cast":
        return _onnx_dtype(_attrs_to(node)) not in (np.int64, np.int32)
    return True


def _attrs_to(node):
    return next((a.i for a in node.attribute if a.name == "to"), None)


# -- running the derived sub-graph ------------------------------------------------------------


def evaluate(imp, node, names, probe: dict) -> list:
    """The values of the derived ONNX values `names` (read by `node`) when the inputs are
    `probe` ({ONNX input name: array}); the constants they read with the probe's sizes."""
    from onnx import helper

    dims = _bind(imp, probe)
    nodes, feeds, seen, todo = [], {}, set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen or not name:
            continue
        seen.add(name)
        value = imp.env.get(name)
        if isinstance(value, Const):
            feeds[name] = _concrete(value.value, dims)
        elif name in probe:
            feeds[name] = probe[name]
        elif name not in imp.producer or isinstance(value, Var) and value.tensor.dtype == "float32":
            raise imp.fail(node, f"it reads {name!r} through integer / boolean arithmetic, which deepgen reads only as "
                                 "an attention mask or position ids")
        else:
            producer = imp.producer[name]
            if id(producer) not in {id(n) for n in nodes}:
                nodes.append(producer)
                todo += list(producer.input)
    order = {id(n): i for i, n in enumerate(imp.graph.node)}
    nodes.sort(key=lambda n: order[id(n)])
    graph = helper.make_graph(
        nodes, "derived",
        [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), None) for k, v in feeds.items()],
        [helper.make_empty_tensor_value_info(n) for n in names])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", imp.opset)])
    from onnx.reference import ReferenceEvaluator

    try:
        return [np.asarray(r) for r in ReferenceEvaluator(model).run(list(names), feeds)]
    except Exception as e:
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise imp.fail(node, f"running the integer arithmetic it reads failed: {first}") from None


def _bind(imp, probe) -> dict:
    """{dim symbol: size} from the probe's shapes."""
    dims = {}
    for name, array in probe.items():
        var = imp.env.get(name)
        for d, size in zip(var.tensor.shape, array.shape):
            if isinstance(d, sympy.Basic) and not d.is_number:
                dims[d] = size
    return dims


def _concrete(array: np.ndarray, dims: dict) -> np.ndarray:
    if array.dtype != object:
        return array
    flat = [int(sympy.sympify(v).subs(dims)) for v in array.reshape(-1)]
    return np.array(flat, dtype=np.int64).reshape(array.shape)


def _int_inputs(imp) -> list:
    return [i.name for i in imp.graph.input if isinstance(imp.env.get(i.name), Var)
            and imp.env[i.name].tensor.dtype != "float32"]


def _is_ids(imp, name) -> bool:
    """An integer input an embedding table is gathered by (through reshapes)."""
    todo, seen = [name], set()
    while todo:
        n = todo.pop()
        for user in imp.consumers.get(n, []):
            if user.op_type == "Gather" and user.input[1] == n and imp.static_const(user.input[0]) is not None:
                return True
            if user.op_type in _PLUMBING and user.input[0] == n and user.output[0] not in seen:
                seen.add(user.output[0])
                todo.append(user.output[0])
    return False


def probes(imp, count: int = 4):
    """[(probe inputs, {dim symbol: size})]: two size settings, random 0/1 masks (each row keeps
    its first position) for integer inputs that are not ids, ids of _PROBE_ID."""
    rng = np.random.default_rng(0)
    symbols = []
    for name in _int_inputs(imp):
        for d in imp.env[name].tensor.shape:
            if isinstance(d, sympy.Basic) and not d.is_number and d not in symbols:
                symbols.append(d)
    out = []
    for k in range(count):
        sizes = dict(zip(symbols, [(3, 5, 4, 6), (2, 6, 5, 3)][k % 2]))
        probe = {}
        for name in _int_inputs(imp):
            var = imp.env[name]
            shape = tuple(sizes.get(d, d) if not isinstance(d, int) else d for d in var.tensor.shape)
            shape = tuple(int(d) for d in shape)
            if _is_ids(imp, name):
                probe[name] = np.full(shape, _PROBE_ID, dtype=var.tensor.dtype)
            else:
                m = rng.integers(0, 2, shape).astype(var.tensor.dtype)
                if m.ndim == 2:
                    m[:, 0] = 1
                probe[name] = m
        out.append((probe, sizes))
    return out


# -- what a float op reads --------------------------------------------------------------------


def _kept(imp, node, value):
    if value.dtype == bool:
        return value
    if value.dtype.kind == "f" and bool(((value == 0) | (value <= np.finfo(np.float32).min / 2)).all()):
        return value == 0
    raise imp.fail(node, "it adds a value computed from integer inputs that is not an additive mask (0 / -inf); "
                         "deepgen reads such values only as attention masks")


def additive_mask(imp, node, derived: Derived, scores: Var) -> Var:
    """The Var of the mask `derived` is when added to `scores` [..., T, T]: key padding,
    causal, or both; one statement per kind (imp.masks)."""
    T = scores.tensor.shape[-1]
    sources = [n for n in _int_inputs(imp) if not _is_ids(imp, n)]
    kinds = {"pad": bool(sources), "pad+causal": bool(sources), "causal": True}
    for probe, sizes in probes(imp):
        (value,) = evaluate(imp, node, [derived.name], probe)
        kept = _kept(imp, node, value)
        t = int(sympy.sympify(T).subs(sizes)) if not isinstance(T, int) else T
        causal = np.tril(np.ones((t, t), bool))
        full = np.broadcast_to(kept, np.broadcast_shapes(kept.shape, (1,) * (kept.ndim - 2) + (t, t)))
        pad = probe[sources[0]].astype(bool) if sources else None
        if pad is not None:
            pad = pad.reshape(pad.shape[0], *([1] * (full.ndim - 2)), pad.shape[1])
        for kind in kinds:
            want = {"pad": pad, "causal": causal, "pad+causal": None if pad is None else pad & causal}[kind]
            kinds[kind] = kinds[kind] and want is not None and full.ndim >= 2 and np.array_equal(
                full, np.broadcast_to(want, np.broadcast_shapes(want.shape, full.shape)))
    kind = next((k for k in ("causal", "pad", "pad+causal") if kinds[k]), None)
    if kind is None:
        raise imp.fail(node, f"the attention mask it reads ({derived.name!r}) is neither a key padding mask of "
                             f"{' or '.join(map(repr, sources)) or 'an integer input'} nor a causal one (nor both)")
    cache = imp.masks
    parts = []
    if "pad" in kind:
        mask = imp.env[sources[0]]
        N, S = mask.tensor.shape
        if ("pad", mask.name) not in cache:
            shape = (N,) + (1,) * (scores.tensor.ndim - 2) + (S,)
            cache[("pad", mask.name)] = imp.em.assign(f"{mask.name}_additive",
                                                     f"dg.reshape(dg.key_mask({mask.name}), {code(shape)})")
        parts.append(cache[("pad", mask.name)])
    if "causal" in kind:
        if ("causal", str(T)) not in cache:
            cache[("causal", str(T))] = imp.em.assign("causal_mask", f"dg.causal_mask({code(T)})")
        parts.append(cache[("causal", str(T))])
    if len(parts) == 1:
        return parts[0]
    if kind not in cache:
        cache[kind] = imp.em.assign(f"{parts[0].name}_causal", " + ".join(p.name for p in parts))
    return cache[kind]


def embedding_rows(imp, node, table: Var, ids: Derived) -> Var:
    """table gathered by derived ids: an arange from `first` (position ids) or one id (token
    type 0) along the last axis, on every probe; written as a slice of the table."""
    first, kind = None, None
    for probe, sizes in probes(imp, 2):
        (value,) = evaluate(imp, node, [ids.name], probe)
        rows = value.reshape(-1, value.shape[-1]) if value.ndim else value.reshape(1, 1)
        start = int(rows.flat[0])
        first = start if first is None else first
        if bool((rows == np.arange(start, start + rows.shape[1])).all()) and rows.shape[1] > 1 and start == first:
            this = "arange"
        elif bool((rows == start).all()) and start == first:
            this = "one"
        else:
            this = None
        kind = this if kind in (None, this) else None
        if kind is None:
            raise imp.fail(node, f"its ids ({ids.name!r}) are computed from the inputs' values and are no arange or "
                                 "single id; deepgen reads such ids only as position ids or one token type")
    shape = _shape_of(imp, ids, node)
    width = table.tensor.shape[1]
    if any(n for n in _int_inputs(imp) if _is_ids(imp, n) and _reads(imp, ids.name, n)):
        imp.em.note(f"{ids.name}: computed from the token ids' values; taken as it is when they hold no padding id "
                    f"({'an arange' if kind == 'arange' else 'one id'})")
    if kind == "arange":
        T = shape[-1]
        picked = f"{table.name}[{first or ''}:{code(sympy.sympify(T) + first) if first else code(T)}]"
    else:
        picked = f"{table.name}[{first}:{first + 1}]"
    target = tuple(shape) + (width,)
    if kind == "arange" and all(isinstance(d, int) and d == 1 for d in target[:-2]):
        return imp.em.assign(imp.layer(node), f"dg.reshape({picked}, {code(target)})")
    return imp.em.assign(imp.layer(node), f"dg.expand({picked}, {code(target)})")


def _reads(imp, name, source) -> bool:
    todo, seen = [name], set()
    while todo:
        n = todo.pop()
        if n == source:
            return True
        if n in seen or not isinstance(imp.env.get(n), (Derived, Var)) or n not in imp.producer:
            continue
        seen.add(n)
        todo += [i for i in imp.producer[n].input if i]
    return False


def _shape_of(imp, ids: Derived, node) -> tuple:
    """The derived ids' shape in the model's dims: its shape on two probes, each axis a
    dim symbol (when it follows one) or a size."""
    shapes = []
    settings = probes(imp, 2)
    for probe, sizes in settings:
        (value,) = evaluate(imp, node, [ids.name], probe)
        shapes.append((value.shape, sizes))
    (a, sa), (b, sb) = shapes
    if len(a) != len(b):
        raise imp.fail(node, f"the rank of its ids ({ids.name!r}) depends on the sizes")
    out = []
    for x, y in zip(a, b):
        if x == y:
            out.append(int(x))
            continue
        match = [s for s in sa if sa[s] == x and sb.get(s) == y]
        if not match:
            raise imp.fail(node, f"an axis of its ids ({ids.name!r}) follows no dim of the inputs")
        out.append(match[0])
    return tuple(out)
