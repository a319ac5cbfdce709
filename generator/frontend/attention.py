"""The DSL's attention layers, over batch-first sequences x [N, T, E] as PyTorch's
`batch_first=True` modules take them:

    x = dg.input("x", (N, T, 64))
    lengths = dg.input("lengths", (N,), dtype="int64")
    y = dg.transformer_encoder_layer(x, lengths, 64, nhead=4, dim_feedforward=128, name="enc0")

A layer named `foo` names its parameters `foo_` + PyTorch's state_dict key with
dots as underscores (`foo_self_attn_in_proj_weight`, `foo_linear1_bias`, ...), in
PyTorch's layouts (Linear weights [out, in], multiplied as x @ W^T), so the
weights of a torch.nn.TransformerEncoderLayer load one to one.

Padding follows PyTorch's slow path (training, or gradients enabled): keys at
t >= lengths[n] get attention weight 0; every query row, padded or not, is
computed (padded rows attend to the valid keys).
"""

from __future__ import annotations

import math
from contextlib import contextmanager

from . import initializers as inits
from .builder import Tensor, current
from .dsl import _helper_param, _tensor, bmm, gelu, matmul, relu, reshape, softmax, split, transpose
from .source import user_loc
from ..errors import ModelError, ShapeError
from ..ir.shapes import fmt_shape, norm_dim
from ..ops import get_op

__all__ = ["layer_norm", "length_mask", "key_mask", "causal_mask", "linear_t", "multi_head_attention", "transformer_encoder_layer"]

_ACTIVATIONS = {"relu": relu, "gelu": gelu}


@contextmanager
def _named(name):
    """Names the values of the nodes a layer helper adds inside the block after the
    layer's `name=`: the last node's result `<name>` (`enc0_scores`), the others
    `<name>_<op>` (`enc0_scores_mul`); values an inner block named keep their names.
    The names are preferences: a name already taken gets a numeric suffix. With
    `name` None the user's variable names them, as for any DSL call."""
    if name is None:
        yield
        return
    b = current()
    start = len(b.graph.nodes)
    yield
    nodes = b.graph.nodes[start:]
    for node in nodes:
        for i, v in enumerate(node.outputs):
            if v.explicit or id(v) in b.layer_names or (i and get_op(node.op).output_hints):
                continue  # a layer norm's mean and rstd: <its name>_mean
            b.layer_names[id(v)] = name if node is nodes[-1] and i == 0 else f"{name}_{v.name}"


def _positive(value, what, op):
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelError(f"{what} must be a positive int, got {value!r}", user_loc(), op)
    return value


def _eps(eps, op):
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < float("inf"):
        raise ModelError(f"eps must be a positive finite number, got {eps!r}", user_loc(), op)
    return float(eps)


def layer_norm(x, weight, bias, eps=1e-5, name=None) -> Tensor:
    """torch.nn.functional.layer_norm over the last axis: x [..., D], weight and bias [D];
    each row is normalized by its mean and biased variance."""
    x, weight, bias = (_tensor(t, "layer_norm") for t in (x, weight, bias))
    return current().add("layer_norm", [x, weight, bias], {"eps": _eps(eps, "layer_norm")}, name=name)[0]


def length_mask(lengths, length, name=None) -> Tensor:
    """The float32 [N, length] additive mask of sequences padded to `length` (an int or a
    symbolic dim): 0 where t < lengths[n], -inf past it, for dg.softmax(..., mask=).
    `lengths` is int32/int64 [N]; a length outside [1, length] is a ValueError at run
    time naming `lengths` and the position."""
    lengths = _tensor(lengths, "length_mask")
    try:
        length = norm_dim(length)
    except TypeError as e:
        raise ModelError(f"length: {e}", user_loc(), "length_mask") from None
    what = f"lengths '{lengths.name}'" if lengths.value.kind == "input" else "lengths"
    return current().add("length_mask", [lengths], {"length": length, "what": what}, name=name)[0]


def key_mask(mask, name=None) -> Tensor:
    """The float32 [N, T] additive mask of a 0/1 integer mask [N, T] (Hugging Face's
    attention_mask: 1 for a token to attend to, 0 for padding, anywhere in the row): 0
    where mask is nonzero, -inf where it is 0, for dg.softmax(..., mask=). A row of only
    zeros is a ValueError at run time naming the mask and the row."""
    mask = _tensor(mask, "key_mask")
    what = f"mask '{mask.name}'" if mask.value.kind == "input" else "mask"
    return current().add("key_mask", [mask], {"what": what}, name=name)[0]


def causal_mask(length, name=None) -> Tensor:
    """The float32 [length, length] additive mask of causal attention: 0 where key k <= query
    q, -inf above the diagonal. `length` is an int or a symbolic dim."""
    try:
        length = norm_dim(length)
    except TypeError as e:
        raise ModelError(f"length: {e}", user_loc(), "causal_mask") from None
    return current().add("causal_mask", [], {"length": length}, name=name)[0]


def linear_t(x, weight, bias=None, name=None) -> Tensor:
    """torch.nn.functional.linear: x @ weight^T (+ bias), weight stored [out, in] as PyTorch
    keeps it (no transposed copy is made)."""
    y = matmul(_tensor(x, "linear_t"), _tensor(weight, "linear_t"), tb=True)
    return y + bias if bias is not None else y


def multi_head_attention(x, mask, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias, nhead,
                         name=None) -> Tensor:
    """Self-attention as torch.nn.MultiheadAttention(batch_first=True) computes it: x [N, T, E]
    projected to q, k, v by in_proj ([3E, E]), split into `nhead` heads of E / nhead,
    softmax(q k^T / sqrt(E / nhead) + mask) v per head, the heads joined and projected by
    out_proj. `mask` is an additive [N, T] key mask (dg.length_mask) or None. With `name`,
    every value it makes is named after it: `<name>_q`, `<name>_scores`, ..., `<name>`."""
    x = _tensor(x, "multi_head_attention")
    if x.ndim != 3 or not isinstance(x.shape[2], int) or x.shape[2] % nhead:
        raise ShapeError(f"input '{x.name}' {fmt_shape(x.shape)} must be [N, T, E] with E divisible by "
                         f"nhead={nhead}", user_loc(), "multi_head_attention")
    return _attention(x, mask, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias, nhead, name, name)


def _attention(x, mask, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias, nhead, prefix, result):
    """multi_head_attention, its values named `<prefix>_q`, ... and its result `result`."""
    N, T, E = x.shape
    head = E // nhead
    part = (lambda what: _named(f"{prefix}_{what}")) if prefix is not None else (lambda what: _named(None))
    with _named(result):
        with part("qkv"):
            qkv = linear_t(x, in_proj_weight, in_proj_bias)  # [N, T, 3E]

        def heads(t):  # [N, T, E] -> [N, h, T, E/h]
            return transpose(reshape(t, (N, T, nhead, head)), (0, 2, 1, 3))

        pieces = split(qkv, 3, axis=2)
        with part("q"):
            q = heads(pieces[0])
        with part("k"):
            k = heads(pieces[1])
        with part("v"):
            v = heads(pieces[2])
        with part("scores"):
            scores = bmm(q * (1.0 / math.sqrt(head)), k, tb=True)  # [N, h, T, T]: query by key
        with part("keys"):
            keys = reshape(mask, (N, 1, 1, T)) if mask is not None else None
        with part("weights"):
            weights = softmax(scores, axis=-1, mask=keys)
        with part("context"):
            context = transpose(bmm(weights, v), (0, 2, 1, 3))  # [N, T, h, E/h]
        return linear_t(reshape(context, (N, T, E)), out_proj_weight, out_proj_bias)


def transformer_encoder_layer(x, lengths, d_model, nhead, dim_feedforward, activation="relu", norm_first=False,
                              eps=1e-5, name=None) -> Tensor:
    """torch.nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout=0,
    activation, batch_first=True, norm_first, layer_norm_eps=eps) called on x [N, T, d_model]
    with src_key_padding_mask True at t >= lengths[n] (lengths int32/int64 [N], each in
    [1, T]; None: no padding). Parameters `<name>_self_attn_in_proj_weight` [3E, E],
    `..._in_proj_bias`, `..._out_proj_weight` [E, E], `..._out_proj_bias`,
    `<name>_linear1_weight` [F, E], `_linear1_bias`, `_linear2_weight` [E, F],
    `_linear2_bias`, `<name>_norm1_weight`, `_norm1_bias`, `_norm2_weight`, `_norm2_bias`,
    initialized as PyTorch does. `activation`: "relu", "gelu" or a DSL function."""
    op = "transformer_encoder_layer"
    x, loc, b = _tensor(x, op), user_loc(), current()
    E, nhead, F = (_positive(v, what, op) for v, what in ((d_model, "d_model"), (nhead, "nhead"),
                                                           (dim_feedforward, "dim_feedforward")))
    if x.ndim != 3 or x.shape[2] != E:
        raise ShapeError(f"input '{x.name}' {fmt_shape(x.shape)} must be [N, T, {E}] (batch first, d_model last)",
                         loc, op)
    if E % nhead:
        raise ModelError(f"d_model {E} must be divisible by nhead {nhead}", loc, op)
    act = _ACTIVATIONS.get(activation, activation) if isinstance(activation, str) else activation
    if not callable(act):
        raise ModelError(f"activation must be 'relu', 'gelu' or a DSL function, got {activation!r}", loc, op)
    eps = _eps(eps, op)
    base = name if name is not None else b.default_name(loc, "transformer encoder layer")
    keys = ["self_attn_in_proj_weight", "self_attn_in_proj_bias", "self_attn_out_proj_weight",
            "self_attn_out_proj_bias", "linear1_weight", "linear1_bias", "linear2_weight", "linear2_bias",
            "norm1_weight", "norm1_bias", "norm2_weight", "norm2_bias"]
    names = dict(zip(keys, b.derived_names(base, keys, name is not None, loc, op)))

    def param(key, shape, init):
        return _helper_param(b, loc, names[key], shape, init)

    def fan_in(n):  # nn.Linear's default: uniform in +-1/sqrt(fan_in)
        return inits.uniform(-1 / math.sqrt(n), 1 / math.sqrt(n))

    xavier = math.sqrt(6.0 / (3 * E + E))
    p = {
        "in_w": param("self_attn_in_proj_weight", (3 * E, E), inits.uniform(-xavier, xavier)),
        "in_b": param("self_attn_in_proj_bias", (3 * E,), inits.zeros()),
        "out_w": param("self_attn_out_proj_weight", (E, E), fan_in(E)),
        "out_b": param("self_attn_out_proj_bias", (E,), inits.zeros()),
        "w1": param("linear1_weight", (F, E), fan_in(E)), "b1": param("linear1_bias", (F,), fan_in(E)),
        "w2": param("linear2_weight", (E, F), fan_in(F)), "b2": param("linear2_bias", (E,), fan_in(F)),
        "n1_w": param("norm1_weight", (E,), inits.ones()), "n1_b": param("norm1_bias", (E,), inits.zeros()),
        "n2_w": param("norm2_weight", (E,), inits.ones()), "n2_b": param("norm2_bias", (E,), inits.zeros()),
    }
    # With name=, every value is named after the layer: enc0_q, enc0_scores, enc0_norm1, ...
    part = (lambda what: _named(f"{name}_{what}")) if name is not None else (lambda what: _named(None))
    with part("mask"):
        mask = length_mask(lengths, x.shape[1]) if lengths is not None else None

    def attend(t):
        result = f"{name}_self_attn" if name is not None else None
        return _attention(t, mask, p["in_w"], p["in_b"], p["out_w"], p["out_b"], nhead, name, result)

    def feed_forward(t):
        with part("linear1"):
            hidden = linear_t(t, p["w1"], p["b1"])
        with part("activation"):
            hidden = act(hidden)
        with part("linear2"):
            return linear_t(hidden, p["w2"], p["b2"])

    def norm(t, which, label):
        with part(label):
            return layer_norm(t, p[f"{which}_w"], p[f"{which}_b"], eps)

    with _named(name):
        if norm_first:
            with part("residual1"):
                x = x + attend(norm(x, "n1", "norm1"))
            y = x + feed_forward(norm(x, "n2", "norm2"))
        else:
            with part("residual1"):
                r = x + attend(x)
            x = norm(r, "n1", "norm1")
            with part("residual2"):
                r = x + feed_forward(x)
            y = layer_norm(r, p["n2_w"], p["n2_b"], eps)  # named `name` itself
    return y
