"""Fused losses. Softmax cross-entropy is one op (numerically stable, no
one-hot tensor); its gradient is a second op. Other losses (mean squared error,
binary cross-entropy with logits) are built from elementwise ops and means in
generator/frontend/train.py, and differentiated like any other graph."""

from __future__ import annotations

import numpy as np

from ..ir.shapes import fmt_shape, same
from .index import _CPP_ID
from ..codegen.stmt import Named
from .registry import OpDef, register


def _check(logits, labels):
    if logits.dtype != "float32" or logits.rank != 2:
        raise ValueError(f"logits '{logits.name}' must be float32 [rows, classes], got {logits.type_str()}")
    if labels.dtype not in _CPP_ID or labels.rank != 1:
        raise ValueError(f"labels '{labels.name}' must be int32/int64 [rows], got {labels.type_str()}")
    if not same(logits.shape[0], labels.shape[0]):
        raise ValueError(
            f"logits '{logits.name}' {fmt_shape(logits.shape)} and labels '{labels.name}' "
            f"{fmt_shape(labels.shape)} have different numbers of rows"
        )


def _log_softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def _check_labels(labels, classes, ignore=None):
    bad = ((labels < 0) | (labels >= classes)) & (labels != ignore if ignore is not None else True)
    if bad.any():
        pos = int(np.flatnonzero(bad)[0])
        raise ValueError(f"label {int(labels[pos])} at position {pos} is out of range [0, {classes})")


@register
class SoftmaxXent(OpDef):
    """mean_i -log softmax(logits_i)[labels_i], a scalar; with attr ignore_index,
    over the rows whose label is not it (0 when there are none)."""

    name = "softmax_xent"

    def id_limit(self, node, value):
        classes = node.inputs[0].shape[1]
        return classes if node.inputs[1] is value and isinstance(classes, int) else None

    def infer(self, inputs, attrs):
        _check(*inputs)
        return [("float32", ())]

    def reference(self, args, attrs, dims):
        logits, labels = args
        ignore = attrs.get("ignore_index")
        _check_labels(labels, logits.shape[1], ignore)
        rows = np.flatnonzero(labels != ignore) if ignore is not None else np.arange(len(labels))
        if len(rows) == 0:
            return [np.zeros((), logits.dtype)]
        logp = _log_softmax(logits[rows])
        return [np.asarray(-logp[np.arange(len(rows)), labels[rows]].mean(), dtype=logits.dtype)]

    def lower(self, node, ctx):
        logits, labels = node.inputs
        what = ctx.string(f"softmax_cross_entropy labels '{labels.name}'")
        return [ctx.call("dg::softmax_xent", ctx.read(logits), ctx.read(labels), ctx.write(node.outputs[0]),
                         Named("rows", ctx.size(logits.shape[0])), Named("classes", ctx.size(logits.shape[1])), what,
                         *_ignore_arg(node), template=_CPP_ID[labels.dtype])]

    def grad(self, node, gouts, gb):
        logits, labels = node.inputs
        attrs = {k: v for k, v in node.attrs.items() if k == "ignore_index"}
        d = gb.op("softmax_xent_grad", [logits, labels, gouts[0]], attrs, f"d_{logits.name}")
        return [d, None]


def _ignore_arg(node) -> list:
    ignore = node.attrs.get("ignore_index")
    return [] if ignore is None else [f"dg::IgnoreIndex{{{int(ignore)}}}"]


@register
class SoftmaxXentGrad(OpDef):
    """(softmax(logits) - onehot(labels)) * g / rows (the labeled rows: zero on
    the others)."""

    name = "softmax_xent_grad"

    def infer(self, inputs, attrs):
        _check(inputs[0], inputs[1])
        return [("float32", inputs[0].shape)]

    def reference(self, args, attrs, dims):
        logits, labels, g = args
        ignore = attrs.get("ignore_index")
        labeled = labels != ignore if ignore is not None else np.ones(len(labels), bool)
        rows = np.flatnonzero(labeled)
        d = np.exp(_log_softmax(logits)) if logits.shape[0] else np.zeros_like(logits)
        d[rows, labels[rows]] -= 1
        d[~labeled] = 0
        return [(d * (g / max(len(rows), 1))).astype(logits.dtype)]

    def lower(self, node, ctx):
        logits, labels, g = node.inputs
        return [ctx.call("dg::softmax_xent_grad", ctx.read(logits), ctx.read(labels), ctx.read(g),
                         ctx.write(node.outputs[0]), Named("rows", ctx.size(logits.shape[0])),
                         Named("classes", ctx.size(logits.shape[1])), *_ignore_arg(node),
                         template=_CPP_ID[labels.dtype])]
