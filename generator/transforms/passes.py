"""Optimization passes: each a function Graph -> Graph (rewriting in place and
returning it), run in order by `optimize(graph, level)`.

Expression level: `fuse` merges chains of elementwise ops into one `ewise` node
whose expression is the composition (so its kernel, its reference and its
derivative come from one sympy expression, printed with sympy.cse), then
`simplify` simplifies fused expressions, `epilogue` folds an elementwise consumer
into the GEMM before it, `fold` substitutes constant tensors. SSA level: `cse`
(common subexpressions), `copyprop` (identity ops), `dce` (dead code). They also
run inside recursive cells. Schedule: `weight_grads_last` moves a training
graph's weight-gradient products after the weight's last read, so that its update
can run inside the product. Loop-invariant code motion for recursion is done where
the level loop is built (ops/recurse.py hoists child-independent work).
"""

from __future__ import annotations

import sympy

from ..ir.graph import Node
from ..ir.shapes import broadcast
from ..ops import ARGS, get_op, make_constant
from ..ops.linalg import epilogue_role
from ..ops.quantize import float_form, to_int8
from ..ops.scalar import _functions, simplified
from .remat import remat
from .rounding import rounded_reads

LEVELS = {
    "O0": [],
    "O1": ["dce", "cse", "fold", "copyprop", "dce"],
    "O2": ["dce", "cse", "fold", "copyprop", "conv_batch_norm", "rounded_reads", "fuse", "simplify", "epilogue",
           "remat", "weight_grads_last", "dce"],
}


def regions(graph):
    """(node list, values that must survive) for the graph and each recursive cell."""
    keep = {id(v) for _, v in graph.outputs}
    if graph.train is not None:
        keep.add(id(graph.train.loss))
        keep |= {id(g) for g in graph.train.grads.values()}
    yield graph.nodes, keep
    for node in graph.nodes:
        yield from get_op(node.op).regions(node)


def _uses(nodes) -> dict:
    uses = {}
    for node in nodes:
        for v in node.inputs:
            uses.setdefault(id(v), []).append(node)
    return uses


def _replace(graph, old, new):
    """Every read of `old` reads `new` instead (nodes, sub-graphs, outputs, training)."""
    for node in graph.nodes:
        node.inputs = [new if v is old else v for v in node.inputs]
        get_op(node.op).replace(node, old, new)
    graph.outputs = [(name, new if v is old else v) for name, v in graph.outputs]
    if graph.train is not None:
        if graph.train.loss is old:
            graph.train.loss = new
        graph.train.grads = {p: new if g is old else g for p, g in graph.train.grads.items()}


def dce(graph):
    """Drop nodes whose outputs nothing needs."""
    for nodes, keep in list(regions(graph)):
        need = set(keep)
        alive = []
        for node in reversed(nodes):
            if any(id(v) in need for v in node.outputs):
                need.update(id(v) for v in node.inputs)
                alive.append(node)
        nodes[:] = reversed(alive)
    return graph


def _key(node):
    attrs = tuple(sorted((k, sympy.srepr(v) if isinstance(v, sympy.Basic) else repr(v))
                         for k, v in node.attrs.items()))
    return node.op, tuple(id(v) for v in node.inputs), attrs


def cse(graph):
    """A node equal to an earlier one (same op, operands, attrs) is replaced by it."""
    for nodes, keep in list(regions(graph)):
        seen, kept = {}, []
        for node in nodes:
            if not get_op(node.op).cse:
                kept.append(node)
                continue
            key = _key(node)
            if key in seen and not any(id(v) in keep for v in node.outputs):
                for old, new in zip(node.outputs, seen[key].outputs):
                    _replace(graph, old, new)
                continue
            seen.setdefault(key, node)
            kept.append(node)
        nodes[:] = kept
    return graph


def copyprop(graph):
    """A node that only copies its operand (x * 1, x + 0: OpDef.copy_of) is removed."""
    for nodes, keep in list(regions(graph)):
        kept = []
        for node in nodes:
            source = get_op(node.op).copy_of(node)
            if (source is not None and tuple(source.shape) == tuple(node.outputs[0].shape)
                    and not any(id(v) in keep for v in node.outputs)):
                _replace(graph, node.outputs[0], source)
                continue
            kept.append(node)
        nodes[:] = kept
    return graph


def _fill_value(v):
    """The one value of a tensor its producer makes constant (OpDef.constant), else None."""
    p = v.producer
    return get_op(p.op).constant(p) if p is not None else None


def fold(graph):
    """Constant folding. Tensors of one value (`fill`: the zeros and the loss
    gradient's 1 that autodiff makes) are offered to each op that reads them
    (OpDef.fold): elementwise ops substitute them into their expressions; an op
    whose result is then one value (a reshape of a fill, a matmul by zeros, an
    expression left without operands) becomes a fill itself, and dce drops fills
    nothing reads."""
    for nodes, _ in list(regions(graph)):
        for node in nodes:
            consts = [_fill_value(v) for v in node.inputs]
            if any(c is not None for c in consts):
                value = get_op(node.op).fold(node, consts)
                if value is not None:
                    make_constant(node, value)
    return graph


MAX_OPERANDS = 8  # a fused kernel reads at most this many arrays (readable signatures)


def fuse(graph):
    """Merge an elementwise producer into its only consumer when that consumer is
    elementwise, in the same phase, and reads it at full shape (no broadcast, so
    nothing is recomputed). The fused node remembers every DSL line it holds."""
    for nodes, keep in list(regions(graph)):
        # Nodes of different calls of a user's function, or of a call and the model's own
        # lines, are not merged: each call's code, and its gradient's, stays one C++ function
        # of the same shape as the other calls' (codegen/outline.py).
        changed = True
        while changed:
            changed = False
            uses = _uses(nodes)
            for consumer in nodes:
                if consumer.op != "ewise":
                    continue
                for k, u in enumerate(consumer.inputs):
                    producer = u.producer
                    if (producer is None or producer.op != "ewise" or producer not in nodes
                            or len(uses.get(id(u), [])) != 1 or id(u) in keep
                            or producer.phase != consumer.phase
                            or producer.user_call != consumer.user_call
                            or tuple(u.shape) != tuple(consumer.outputs[0].shape)
                            or len({id(v) for v in consumer.inputs + producer.inputs}) - 1 > MAX_OPERANDS):
                        continue
                    _merge(producer, consumer, k)
                    nodes.remove(producer)
                    changed = True
                    break
                if changed:
                    break
    return graph


def _merge(producer, consumer, k):
    """consumer := consumer with operand k replaced by producer's expression."""
    inputs = [v for i, v in enumerate(consumer.inputs) if i != k]
    mapping = {}
    for j, v in enumerate(consumer.inputs):
        if j != k:
            mapping[ARGS[j]] = ARGS[inputs.index(v)]
    inner = {}
    for j, v in enumerate(producer.inputs):
        if v not in inputs:
            inputs.append(v)
        inner[ARGS[j]] = ARGS[inputs.index(v)]
    sub = producer.attrs["expr"].xreplace(inner)
    temp = sympy.Dummy("fused")
    expr = consumer.attrs["expr"].xreplace({ARGS[k]: temp}).xreplace(mapping).xreplace({temp: sub})
    fused_from = producer.attrs.get("fused_from", [producer.loc]) + consumer.attrs.get("fused_from", [consumer.loc])
    names = producer.attrs.get("fused_fns", [producer.attrs["fn"]]) + consumer.attrs.get("fused_fns", [consumer.attrs["fn"]])
    consumer.inputs = inputs
    consumer.attrs = {**consumer.attrs, "expr": expr, "fn": "fused", "fused_from": fused_from, "fused_fns": names}
    # A producer that broadcast up to its shape (dg.expand) leaves operands smaller than
    # the output: the fused node then states its output shape, as the producer did.
    out_shape = tuple(consumer.outputs[0].shape)
    if tuple(broadcast([v.shape for v in inputs])) != out_shape:
        consumer.attrs["shape"] = out_shape


def epilogue(graph):
    """Fold an elementwise consumer of a matmul into the GEMM as its epilogue
    (Cortex/DeepDSL's bias + activation fusion): the GEMM applies the expression
    to each block of C once its sums are complete, while the block is still in
    cache, and the matmul's own output buffer disappears. The consumer must be the
    matmul's only reader, read it at full shape, and read every other operand per
    element of C (ops.linalg.epilogue_role). In a model that trains, this waits
    until the backward pass exists (the gradients come from the unfused nodes).
    A product that `--precision int8` made int8 (before the passes) is fused as the
    matmul it computes (its float form, ops/quantize.py), and the fused node made
    int8 again the same way (matmul_int8 with attr `epilogue`)."""
    if graph.train is not None and not graph.train.prepared:
        return graph
    for nodes, keep in list(regions(graph)):
        uses = _uses(nodes)
        # The last product made first: where two products meet in one consumer
        # (an RNN's x @ W + h @ U + b), the later one takes the epilogue and the
        # earlier stays a plain product (in a recurrence: of the inputs only, made
        # for every step at once before the loop).
        for made in reversed(list(nodes)):
            mm, scales = float_form(made)
            if mm.op != "matmul" or "epilogue" in mm.attrs or len(mm.outputs) != 1:
                continue
            u = mm.outputs[0]
            readers = uses.get(id(u), [])
            if id(u) in keep or len(readers) != 1:
                continue
            consumer = readers[0]
            out = consumer.outputs[0] if consumer.outputs else None
            if (consumer.op != "ewise" or consumer.phase != mm.phase or consumer not in nodes
                    or sum(v is u for v in consumer.inputs) != 1 or tuple(out.shape) != tuple(u.shape)):
                continue
            extras = [v for v in consumer.inputs if v is not u]
            if any(epilogue_role(v, u.shape) is None or v.dtype != "float32" for v in extras):
                continue
            order = [u] + extras
            expr = consumer.attrs["expr"].xreplace({ARGS[j]: ARGS[order.index(v)]
                                                    for j, v in enumerate(consumer.inputs)})
            mm.attrs = {**mm.attrs, "epilogue": expr,
                        "epilogue_fns": consumer.attrs.get("fused_fns", [consumer.attrs["fn"]]),
                        "epilogue_from": consumer.attrs.get("fused_from", [consumer.loc])}
            mm.inputs = mm.inputs + extras
            mm.outputs = consumer.outputs
            if scales:
                to_int8(mm, *scales)
            for v in mm.outputs:
                v.producer = mm
            # The GEMM moves to the consumer's place: its extra operands may be
            # made between the two, and its own operands are all made before it.
            nodes.remove(made)
            nodes[nodes.index(consumer)] = mm
            uses = _uses(nodes)
    return graph


def conv_batch_norm(graph):
    """In a model that does not train, a batch norm whose input is a convolution's
    output that nothing else reads becomes one node with it, `conv2d_batch_norm`
    (ops/modes.py): at inference the convolution normalizes each piece of its output
    in its epilogue, while it is in cache, with batch norm's own arithmetic (the
    same results, no weight rewritten, nothing more kept); in training mode it runs
    the two as before. What follows the batch norm joins the node too, as far as
    it is a residual add of a tensor of the output's shape (attr residual: the last
    operand), then a relu (attr relu), each the only reader of what it reads: the
    epilogue applies them as well (add_relu in runtime/dg_conv.h, the same bits).
    A model that trains keeps the two nodes (batch norm's gradient reads the
    convolution's output). A convolution that `--precision int8` made int8 (before the
    passes: transforms/quantize.py) is fused as the conv2d it computes (its float
    form, ops/quantize.py), and the fused node made int8 the same way
    (`conv2d_batch_norm_int8`, ops/quantize_conv.py)."""
    if graph.train is not None:
        return graph
    (nodes, keep), *_ = regions(graph)
    uses = _uses(nodes)
    for bn in list(nodes):
        if bn.op != "batch_norm":
            continue
        y = bn.inputs[0]
        made = getattr(y, "producer", None)
        if made is None or made not in nodes or id(y) in keep:
            continue
        conv, scales = float_form(made)
        if conv.op != "conv2d" or len(uses.get(id(y), [])) != 1 or conv.phase != bn.phase:
            continue
        x, w = conv.inputs[:2]
        fused = Node("conv2d_batch_norm", [x, w, *bn.inputs[1:6], *conv.inputs[2:]],
                     {**conv.attrs, "eps": bn.attrs["eps"], "momentum": bn.attrs["momentum"]},
                     outputs=bn.outputs, loc=bn.loc, phase=bn.phase)
        if scales:
            to_int8(fused, *scales)
        nodes.remove(made)
        nodes[nodes.index(bn)] = fused
        for role in ("residual", "relu"):
            _join_tail(nodes, keep, uses, fused, role)
        for v in fused.outputs:
            v.producer = fused
    return graph


def _join_tail(nodes, keep, uses, fused, role):
    """conv_batch_norm's tail: the fused node takes over its output's only reader
    when that is an elementwise `role` ("residual": out + r with r of out's shape;
    "relu": max(0, out)); the fused node moves to the reader's place (r is made
    before it)."""
    out = fused.outputs[0]
    readers = uses.get(id(out), [])
    if id(out) in keep or len(readers) != 1 or role in fused.attrs:
        return
    node = readers[0]
    if node.op != "ewise" or "expr" not in node.attrs or node.phase != fused.phase or node not in nodes or len(node.outputs) != 1:
        return
    if tuple(node.outputs[0].shape) != tuple(out.shape) or node.outputs[0].dtype != out.dtype:
        return
    if role == "relu":
        if len(node.inputs) != 1 or node.attrs["expr"] != sympy.Max(ARGS[0], 0):
            return
        extra = []
    else:
        if len(node.inputs) != 2 or node.attrs["expr"] != ARGS[0] + ARGS[1] or "relu" in fused.attrs:
            return
        (r,) = [v for v in node.inputs if v is not out] or [out]
        if r is out or tuple(r.shape) != tuple(out.shape) or r.dtype != out.dtype:
            return
        extra = [r]
    # The node moves later: nothing between may read its other outputs or the running statistics it updates.
    watched = {id(v) for v in fused.outputs[1:]} | {id(fused.inputs[i]) for i in get_op(fused.op).updates_state}
    between = nodes[nodes.index(fused) + 1 : nodes.index(node)]
    if any(id(v) in watched for n in between for v in n.inputs):
        return
    fused.inputs = fused.inputs + extra
    fused.attrs = {**fused.attrs, role: True}
    fused.outputs = [node.outputs[0]] + fused.outputs[1:]
    nodes.remove(fused)
    nodes[nodes.index(node)] = fused


def weight_grads_last(graph):
    """In a training graph, the product that makes a parameter's gradient (x^T @ g)
    moves after the backward pass's last read of the parameter (the input gradient
    g @ W^T), where nothing between reads the gradient: the parameter's update can
    then run inside that product, block by block while the gradient is in cache
    (memory/liveness.py), instead of in a pass of its own over the parameter, its
    optimizer state and the gradient after both products. The values are SSA, so
    the move changes no result; the product's operands may live one product longer
    (in a dense layer the input gradient reads them: g, and x through the
    activation's derivative)."""
    spec = graph.train
    if spec is None or not spec.prepared:
        return graph
    nodes = graph.nodes
    params = {p.name: p for p in graph.params}
    for name, g in spec.grads.items():
        node, param = g.producer, params.get(name)
        if node is None or param is None or node.op != "matmul" or node.phase != "backward" or node not in nodes:
            continue
        i = nodes.index(node)
        readers = [j for j in range(i + 1, len(nodes)) if any(v is param for v in nodes[j].inputs)]
        if not readers or any(v is g for n in nodes[i + 1 : readers[-1] + 1] for v in n.inputs):
            continue
        nodes.insert(readers[-1], nodes.pop(i))  # right after the last reader
    return graph


def simplify(graph):
    """sympy simplification of fused expressions, kept only when it is smaller and
    brings in no new functions (see ops.scalar.derivative for why)."""
    for nodes, _ in list(regions(graph)):
        for node in nodes:
            if node.op == "ewise" and node.attrs.get("fn") == "fused":
                expr = node.attrs["expr"]
                try:
                    simple = simplified(expr)
                except Exception:  # noqa: BLE001  (simplification is optional)
                    continue
                if sympy.count_ops(simple) < sympy.count_ops(expr) and _functions(simple) <= _functions(expr):
                    node.attrs = {**node.attrs, "expr": simple}
    return graph


PASSES = {"dce": dce, "cse": cse, "copyprop": copyprop, "conv_batch_norm": conv_batch_norm,
          "rounded_reads": rounded_reads, "fuse": fuse, "simplify": simplify, "epilogue": epilogue,
          "fold": fold, "remat": remat, "weight_grads_last": weight_grads_last}


def optimize(graph, level: str = "O2", until: str | None = None, report=None):
    """Run the passes of `level` in order (stopping after `until` if given).
    `report`, a list, receives (pass, nodes before, nodes after) per pass."""
    if level not in LEVELS:
        raise ValueError(f"unknown optimization level {level!r}; use one of {', '.join(LEVELS)}")
    names = LEVELS[level] if until is None else _until(until)
    for name in names:
        before = _count(graph)
        PASSES[name](graph)
        if report is not None:
            report.append((name, before, _count(graph)))
    return graph


def _until(name):
    order = LEVELS["O2"]
    if name not in order:
        raise ValueError(f"unknown pass {name!r}; passes: {', '.join(dict.fromkeys(order))}")
    return order[: order.index(name) + 1]


def _count(graph) -> int:
    return sum(len(nodes) for nodes, _ in regions(graph))
