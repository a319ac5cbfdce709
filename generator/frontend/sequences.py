"""Recurrences over batches of variable-length sequences, and PyTorch's RNN layers
on top of them.

    x = dg.input("x", (N, T, 16))                       # padded
    lengths = dg.input("lengths", (N,), dtype="int64")  # each in [1, T]
    def step(x_t, prev):                                # [rows, 16], ([rows, H],)
        (h,) = prev
        return (dg.tanh(x_t @ w + h @ u + b),)
    (hs,), (h_last,) = dg.scan(step, x, lengths, state=[H], names=["h"])

`scan` runs a cell written once over every sequence's steps, forward in time or
backward (`reverse=True`), from a zero state: it returns each state component
at every step ([N, T, ...], zero past each length) and at each sequence's last
step ([N, ...]). A batch of sequences is a batch of chains, so a scan is the
`recurse` op over the padded lengths (ops/recurse.py): one batched step per time
step over the sequences still running (PyTorch's PackedSequence batches), the
cell's work that reads no earlier step (the input projections) hoisted out of
the loop into one GEMM, and gradients through time by the same reverse loop.

`lstm` and `gru` are torch.nn.LSTM / torch.nn.GRU (batch_first=True) on a packed
sequence: a helper named `foo` names its parameters `foo_` + PyTorch's
state_dict key (`foo_weight_ih_l0`, `foo_bias_hh_l1_reverse`), in PyTorch's
shapes and gate order, so weights come over one to one.
"""

from __future__ import annotations

import math

from . import initializers as inits
from .attention import linear_t
from .builder import Tensor, current
from .dsl import _helper_param, _tensor, concat, gather, reshape, sigmoid, split, tanh
from .recursion import build_recursion
from .source import user_loc
from ..errors import ModelError, ShapeError
from ..ir.shapes import fmt_shape, norm_dim, same

__all__ = ["scan", "lstm", "gru"]


def _state_shape(shape, loc):
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if not shape or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape):
        raise ModelError(f"a state's shape must be a positive int or a tuple of them, got {shape!r}", loc, "scan")
    return shape


def scan(step, inputs, lengths, state, reverse: bool = False, names=None, first=None):
    """Run `step(*x_t, prev) -> new state` over padded sequences (see the module
    docstring). `inputs`: a [N, T, ...] tensor or a list of them (step gets each
    one's rows at the running sequences' current step); `lengths`: int64 [N];
    `state`: the shape of each state component without the row dimension (an
    int or a tuple; a list of them for several components), zeros at the start.
    `prev` is the previous state (a Tensor for one component, else a tuple).
    `first(*x_t)` may compute the first step's state directly (else it is
    `step` from zeros). Returns (outputs, finals), each a Tensor per component
    (a tuple for several): [N, T, ...] zero past each length, and [N, ...]."""
    loc = user_loc()
    b = current()
    xs = [inputs] if isinstance(inputs, Tensor) else list(inputs)
    if not xs:
        raise ModelError("scan needs at least one input sequence", loc, "scan")
    xs = [_tensor(x, "scan") for x in xs]
    lengths = _tensor(lengths, "scan")
    for x in xs:
        if x.dtype != "float32" or x.ndim < 2:
            raise ShapeError(f"input '{x.name}' {fmt_shape(x.shape)} must be float32 [N, T, ...] (padded)", loc, "scan")
    count, steps = xs[0].shape[:2]
    for x in xs[1:]:
        if not (same(x.shape[0], count) and same(x.shape[1], steps)):
            raise ShapeError(f"inputs '{xs[0].name}' {fmt_shape(xs[0].shape)} and '{x.name}' {fmt_shape(x.shape)} "
                             "differ in [N, T]", loc, "scan")
    if lengths.dtype != "int64" or lengths.ndim != 1 or not same(lengths.shape[0], count):
        raise ShapeError(f"lengths '{lengths.name}' must be int64 [{count}] (one per sequence of "
                         f"'{xs[0].name}' {fmt_shape(xs[0].shape)}), got {lengths.dtype} {fmt_shape(lengths.shape)}",
                         loc, "scan")
    one = isinstance(state, int) or (isinstance(state, tuple) and all(isinstance(d, int) for d in state))
    shapes = [_state_shape(state, loc)] if one else [_state_shape(s, loc) for s in state]
    names = list(names) if names is not None else [f"s{j}" for j in range(len(shapes))]
    if len(names) != len(shapes):
        raise ModelError(f"names {names} do not match the {len(shapes)} state components", loc, "scan")
    nodes = norm_dim(count * steps)
    flats = [_hint(reshape(x, (nodes,) + tuple(x.shape[2:])), f"{x.name}_steps") for x in xs]

    def at_step(words):
        return [_hint(gather(f, words), f"{x.name}_t") for f, x in zip(flats, xs)]

    def as_tuple(result, what):
        result = (result,) if isinstance(result, Tensor) else result
        if not isinstance(result, (tuple, list)) or len(result) != len(shapes):
            raise ModelError(f"the {what} must return {len(shapes)} state tensor(s) (names {names}), got {result!r}",
                             loc, "scan")
        return tuple(result)

    def leaf(words):
        if first is not None:
            return as_tuple(first(*at_step(words)), "first-step cell")
        rows = words.shape[0]
        zeros = tuple(_hint(b.add("fill", [], {"shape": (rows,) + s, "value": 0.0})[0], f"{n}_zero")
                      for n, s in zip(names, shapes))
        return as_tuple(step(*at_step(words), zeros[0] if len(zeros) == 1 else zeros), "step cell")

    def internal(words, children):
        prev = children[0]
        return as_tuple(step(*at_step(words), prev[0] if len(prev) == 1 else prev), "step cell")

    states = build_recursion([lengths], leaf, internal, names, loc, arity=1, batch=lengths.name,
                             child_names=lambda k: [[f"{n}_prev" for n in names]], steps=steps,
                             reverse=bool(reverse), what="scan")
    states = (states,) if isinstance(states, Tensor) else states
    states = tuple(_hint(s, f"{n}_flat") for s, n in zip(states, names))
    ends = _hint(b.add("last_steps", [lengths], {"steps": steps, "reverse": bool(reverse)})[0],
                 f"{lengths.name}_{'first' if reverse else 'last'}")
    outputs = tuple(_hint(reshape(s, (count, steps) + sh), f"{n}_steps") for s, n, sh in zip(states, names, shapes))
    finals = tuple(_hint(gather(s, ends), f"{n}_final") for s, n in zip(states, names))
    if len(shapes) == 1:
        return outputs[0], finals[0]
    return outputs, finals


def _hint(t: Tensor, name: str) -> Tensor:
    """Name a value a helper made (a hint: the model's naming keeps it unique)."""
    t.value.name = name
    return t


def _rnn(kind, x, lengths, hidden_size, num_layers, bidirectional, name, loc):
    """The layers of an LSTM or a GRU: per layer and direction a scan; outputs
    of both directions concatenated feed the next layer."""
    b = current()
    x = _tensor(x, kind)
    if x.ndim != 3 or not isinstance(x.shape[2], int):
        raise ShapeError(f"input '{x.name}' {fmt_shape(x.shape)} must be [N, T, features] with concrete features",
                         loc, kind)
    for what, n in (("hidden_size", hidden_size), ("num_layers", num_layers)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ModelError(f"{what} must be a positive int, got {n!r}", loc, kind)
    H, gates = hidden_size, 4 if kind == "lstm" else 3
    base = name if name is not None else b.default_name(loc, kind)
    bound = 1.0 / math.sqrt(H)  # PyTorch's initialization: U(-1/sqrt(H), 1/sqrt(H)) for every parameter
    directions = ["", "_reverse"] if bidirectional else [""]
    keys = [f"{p}_l{layer}{d}" for layer in range(num_layers) for d in directions
            for p in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
    full = b.derived_names(base, keys, name is not None, loc, kind)
    params = dict(zip(keys, full))
    layer_in, finals = x, []
    for layer in range(num_layers):
        outs = []
        for d in directions:
            width = layer_in.shape[2]
            p = {k: _helper_param(b, loc, params[f"{k}_l{layer}{d}"], shape, inits.uniform(-bound, bound))
                 for k, shape in (("weight_ih", (gates * H, width)), ("weight_hh", (gates * H, H)),
                                  ("bias_ih", (gates * H,)), ("bias_hh", (gates * H,)))}
            cell = _lstm_cell if kind == "lstm" else _gru_cell
            names = ["h", "c"] if kind == "lstm" else ["h"]
            out, final = scan(cell(p), layer_in, lengths, state=[H] * len(names), reverse=bool(d), names=names)
            outs.append(out[0] if kind == "lstm" else out)
            finals.append(final if kind == "lstm" else (final,))
        layer_in = outs[0] if len(outs) == 1 else concat(outs, axis=2)
    # h_n (and c_n): [num_layers * directions, N, H], layer-major as PyTorch stacks them.
    stacked = []
    for j in range(len(finals[0])):
        pieces = [reshape(f[j], (1,) + tuple(f[j].shape)) for f in finals]
        stacked.append(pieces[0] if len(pieces) == 1 else concat(pieces, axis=0))
    return layer_in, stacked


def _lstm_cell(p):
    def step(x_t, prev):
        h, c = prev
        gates = _hint(linear_t(x_t, p["weight_ih"], p["bias_ih"]) + linear_t(h, p["weight_hh"], p["bias_hh"]),
                      "gates")
        i, f, g, o = split(gates, 4, axis=1)
        c = _hint(sigmoid(f) * c + sigmoid(i) * tanh(g), "c")
        return _hint(sigmoid(o) * tanh(c), "h"), c

    return step


def _gru_cell(p):
    def step(x_t, h):
        r_x, z_x, n_x = split(linear_t(x_t, p["weight_ih"], p["bias_ih"]), 3, axis=1)
        r_h, z_h, n_h = split(linear_t(h, p["weight_hh"], p["bias_hh"]), 3, axis=1)
        r, z = _hint(sigmoid(r_x + r_h), "r"), _hint(sigmoid(z_x + z_h), "z")
        n = _hint(tanh(n_x + r * n_h), "n")
        return (_hint((1 - z) * n + z * h, "h"),)

    return step


def lstm(x, lengths, hidden_size: int, num_layers: int = 1, bidirectional: bool = False, name=None):
    """torch.nn.LSTM(batch_first=True) on a packed sequence: x [N, T, I] padded,
    lengths int64 [N]. Returns (outputs [N, T, D*H] zero past each length,
    (h_n, c_n) each [num_layers*D, N, H]). Gates i, f, g, o."""
    loc = user_loc()
    outputs, (h_n, c_n) = _rnn("lstm", x, lengths, hidden_size, num_layers, bidirectional, name, loc)
    return outputs, (h_n, c_n)


def gru(x, lengths, hidden_size: int, num_layers: int = 1, bidirectional: bool = False, name=None):
    """torch.nn.GRU(batch_first=True) on a packed sequence: returns (outputs
    [N, T, D*H], h_n [num_layers*D, N, H]). Gates r, z, n."""
    loc = user_loc()
    outputs, (h_n,) = _rnn("gru", x, lengths, hidden_size, num_layers, bidirectional, name, loc)
    return outputs, h_n
