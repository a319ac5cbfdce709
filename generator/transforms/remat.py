"""Rematerialization: the backward pass makes some forward values again instead of
keeping them from the forward pass, where that costs one elementwise sweep.

A convolutional network keeps, per conv -> batch norm -> relu, two tensors for its
backward pass: the convolution's output (batch norm's gradient reads it) and the
relu's output (the relu's own gradient and the next convolution's weight gradient
read it). The second is a function of the first and of batch norm's per-channel
statistics, which are kept anyway: `relu((x - mean) * invstd * w + b)`. So the
backward pass recomputes it (a `batch_norm_apply`, then the same elementwise node)
just before its first reader (or before the gradient of the user's function call
that reader is in: _before_its_call), and the forward copy dies as
soon as the forward pass is done with it: about half of ResNet-18's training activations.

An elementwise node E is recomputed when
  * it runs in the forward pass, the backward pass reads its output, and its output
    is not an output of the model (those are kept to the end anyway);
  * it reads at least one batch norm output (the saving: that output and E's are
    no longer kept);
  * every batch norm output it reads comes from a batch norm whose input, mean and
    invstd the backward pass reads anyway (batch_norm_grad does, in training);
  * every other value it reads is still there in the backward pass: a parameter, an
    input, or a value the backward pass reads that is not itself recomputed (a
    residual block's output adds the block's input: recomputed blocks alternate).
Nodes are visited in forward order, so a value recomputed earlier is known when a
later node asks for it. The result is the same math: only where values live changes.
"""

from __future__ import annotations

from ..ir.graph import Node, Value


def remat(graph):
    """Recompute in the backward pass the elementwise outputs of batch norms (above)."""
    if graph.train is None or not graph.train.prepared:
        return graph
    nodes = graph.nodes
    readers = {}
    for node in nodes:
        for v in node.inputs:
            readers.setdefault(id(v), []).append(node)

    def backward_readers(v):
        return [n for n in readers.get(id(v), []) if n.phase == "backward"]

    kept_to_end = {id(v) for _, v in graph.outputs} | {id(graph.train.loss)}
    recomputed = set()

    def available(v):  # still there when the backward pass runs
        if v.producer is None:
            return True  # inputs, parameters, module state, the mode
        return id(v) not in recomputed and bool(backward_readers(v))

    plans = []
    for node in nodes:
        if node.op != "ewise" or node.phase != "forward":
            continue
        out = node.outputs[0]
        if id(out) in kept_to_end or not backward_readers(out):
            continue
        norms = [v for v in node.inputs if _is_batch_norm_output(v)]
        others = [v for v in node.inputs if not _is_batch_norm_output(v)]
        if not norms or not all(available(v) for v in others):
            continue
        if not all(all(available(s) for s in _statistics(v)) for v in norms):
            continue
        plans.append(node)
        recomputed.update(id(v) for v in [out, *norms])  # backward reads their twins from now on

    for node in plans:
        _recompute(graph, node, backward_readers)
    return graph


def _is_batch_norm_output(v) -> bool:
    return v.producer is not None and v.producer.op == "batch_norm" and v is v.producer.outputs[0]


def _statistics(y):
    """What batch_norm_apply reads to make y again: x, weight, bias, mean, invstd."""
    bn = y.producer
    x, w, b = bn.inputs[:3]
    _, mean, invstd = bn.outputs
    return [x, w, b, mean, invstd]


def _recompute(graph, node, backward_readers):
    """Insert node's recomputation before the first backward node that reads its
    output (or one of its batch norm inputs) and make those readers read it."""
    swapped = {}  # id(forward value) -> its recomputed twin
    swap = [node.outputs[0]] + [v for v in node.inputs if _is_batch_norm_output(v)]
    first = _before_its_call(graph.nodes, min(graph.nodes.index(r) for v in swap for r in backward_readers(v)))
    made = []
    for v in node.inputs:
        if _is_batch_norm_output(v) and id(v) not in swapped:
            apply = Node("batch_norm_apply", _statistics(v), {"recomputed": True}, loc=v.producer.loc,
                         phase="backward")
            apply.outputs.append(_twin(graph, v, apply))
            swapped[id(v)] = apply.outputs[0]
            made.append(apply)
    again = Node("ewise", [swapped.get(id(v), v) for v in node.inputs], {**node.attrs, "recomputed": True},
                 loc=node.loc, phase="backward")
    again.outputs.append(_twin(graph, node.outputs[0], again))
    swapped[id(node.outputs[0])] = again.outputs[0]
    made.append(again)
    graph.nodes[first:first] = made
    for reader in graph.nodes[first + len(made):]:
        if reader.phase == "backward":
            reader.inputs = [swapped.get(id(v), v) for v in reader.inputs]


def _before_its_call(nodes, k) -> int:
    """Where a recomputation read first by nodes[k] goes: just before it, unless nodes[k]
    lies inside the gradient of a call of a user's function: then before the first node
    of that call's gradient, so the call's gradient is one piece of code (codegen/outline.py
    makes it one function call). The block's input made again (a residual block's output,
    which the next block's first convolution's weight gradient and its shortcut read) so
    lives through that call's gradient: ResNet-18's arena grows by one layer-4 block output
    (8,192 floats an example, 1.1%), the price of reading as `stem`, `basic_block` x 8 and
    their gradients."""
    call = nodes[k].user_call
    if call is None:
        return k
    start = k
    while start > 0 and nodes[start - 1].phase == "backward" and nodes[start - 1].user_call == call:
        start -= 1
    return start


def _twin(graph, v, producer) -> Value:
    """A value like v, made by `producer` in the backward pass (named v_again)."""
    return Value(graph.names.unique(f"{v.name}_again"), v.dtype, v.shape, producer=producer, loc=v.loc)
