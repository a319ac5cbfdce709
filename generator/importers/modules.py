"""torch.nn modules as deepgen layer helpers.

Each converter gets the Importer, the fx node, the module and the node's
arguments (Vars for tensors), writes the statements and returns what the module
call returns (a Var, or a tuple for LSTM / GRU / MultiheadAttention). Parameters
are named `<path>_<state_dict key>`, dots as underscores, so the weights the
importer saves load into the generated Model one to one.
"""

from __future__ import annotations

from .emitter import Var, code


class Unusable:
    """A module result deepgen does not compute (attention weights): an error if used."""

    def __init__(self, what: str):
        self.what = what


def _arg(imp, node, args, kwargs, count=1):
    """The module's tensor argument(s); anything more is an error naming the module."""
    extra = [k for k, v in kwargs.items() if v is not None and v is not False]
    if len(args) != count or extra or not all(isinstance(a, Var) for a in args):
        raise imp.fail(node, f"{imp.kind(node)} is supported called with {count} tensor argument(s) only "
                             f"(got {len(args)} positional{', keywords ' + ', '.join(extra) if extra else ''})")
    return args[0] if count == 1 else args


def _check(imp, node, ok: bool, what: str):
    if not ok:
        raise imp.fail(node, f"{imp.kind(node)}: {what} is not supported")


def linear(imp, node, m, args, kwargs):
    x = _arg(imp, node, args, kwargs)
    w = imp.param(node.target, "weight", m.weight)
    b = imp.param(node.target, "bias", m.bias) if m.bias is not None else None
    return imp.em.assign(node.name, f"dg.linear_t({code(x)}, {code(w)}{', ' + code(b) if b else ''})")


def conv2d(imp, node, m, args, kwargs):
    x = _arg(imp, node, args, kwargs)
    _check(imp, node, m.padding_mode == "zeros", f"padding_mode={m.padding_mode!r}")
    padding = (0, 0) if m.padding == "valid" else m.padding if isinstance(m.padding, str) else tuple(m.padding)
    base = imp.layer(node, m)
    opts = [f"{m.out_channels}", code(tuple(m.kernel_size))]
    for key, value, default in (("stride", tuple(m.stride), (1, 1)), ("padding", padding, (0, 0)),
                                ("dilation", tuple(m.dilation), (1, 1)), ("groups", m.groups, 1),
                                ("bias", m.bias is not None, True)):
        if value != default:  # (bias=False must not pass as 0: False == 0 in Python)
            opts.append(f"{key}={code(value)}")
    return imp.em.assign(node.name, f'dg.conv2d_layer({code(x)}, {", ".join(opts)}, name="{base}")')


def batch_norm(imp, node, m, args, kwargs):
    x = _arg(imp, node, args, kwargs)
    _check(imp, node, m.affine and m.track_running_stats, "affine=False or track_running_stats=False")
    _check(imp, node, m.momentum is not None, "momentum=None (a cumulative average)")
    base = imp.layer(node, m)
    return imp.em.assign(node.name, f'dg.batch_norm_layer({code(x)}, eps={m.eps!r}, momentum={m.momentum!r}, '
                                    f'name="{base}")')


def pool_args(kernel, stride, padding, ceil_mode) -> list[str]:
    """The arguments of dg.max_pool2d / dg.avg_pool2d after x, defaults left out."""
    kernel, stride, padding = (tuple(v) if isinstance(v, (tuple, list)) else v for v in (kernel, stride, padding))
    opts = [code(kernel)]
    if stride is not None and stride != kernel and stride != ():
        opts.append(f"stride={code(stride)}")
    if padding not in (0, (0, 0)):
        opts.append(f"padding={code(padding)}")
    if ceil_mode:
        opts.append("ceil_mode=True")
    return opts


def _pool_args(imp, node, m):
    return pool_args(m.kernel_size, m.stride, m.padding, m.ceil_mode)


def max_pool(imp, node, m, args, kwargs):
    x = _arg(imp, node, args, kwargs)
    _check(imp, node, m.dilation in (1, (1, 1)) and not m.return_indices, "dilation or return_indices")
    return imp.em.assign(node.name, f"dg.max_pool2d({code(x)}, {', '.join(_pool_args(imp, node, m))})")


def avg_pool(imp, node, m, args, kwargs):
    x = _arg(imp, node, args, kwargs)
    _check(imp, node, m.count_include_pad and m.divisor_override is None,
           "count_include_pad=False or divisor_override")
    return imp.em.assign(node.name, f"dg.avg_pool2d({code(x)}, {', '.join(_pool_args(imp, node, m))})")


def adaptive_avg_pool(imp, node, m, args, kwargs):
    x = _arg(imp, node, args, kwargs)
    return adaptive_pool_to(imp, node, x, m.output_size)


def adaptive_pool_to(imp, node, x, size):
    """adaptive average pooling of x to `size`: the mean over each plane for 1, else
    dg.adaptive_avg_pool2d (a plain average pooling where the sizes divide)."""
    size = tuple(size) if isinstance(size, (tuple, list)) else size
    if size in (1, (1, 1)):
        return imp.em.assign(node.name, f"dg.mean({code(x)}, axis=(2, 3), keepdims=True)")
    return imp.em.assign(node.name, f"dg.adaptive_avg_pool2d({code(x)}, {code(size)})")


def activation(fn):
    def convert(imp, node, m, args, kwargs):
        x = _arg(imp, node, args, kwargs)
        _check(imp, node, getattr(m, "approximate", "none") == "none", "approximate='tanh'")
        return imp.em.assign(node.name, f"dg.{fn}({code(x)})")

    return convert


def softmax(imp, node, m, args, kwargs):
    x = _arg(imp, node, args, kwargs)
    _check(imp, node, m.dim is not None, "dim=None")
    fn = "log_softmax" if type(m).__name__ == "LogSoftmax" else "softmax"
    return imp.em.assign(node.name, f"dg.{fn}({code(x)}, axis={m.dim})")


def dropout(imp, node, m, args, kwargs):
    x = _arg(imp, node, args, kwargs)
    if m.p == 0:
        return x
    return imp.em.assign(node.name, f"dg.dropout({code(x)}, p={m.p!r})")


def identity(imp, node, m, args, kwargs):
    return _arg(imp, node, args, kwargs)


def flatten(imp, node, m, args, kwargs):
    from .functions import flatten_to

    return flatten_to(imp, node, _arg(imp, node, args, kwargs), m.start_dim, m.end_dim)


def embedding(imp, node, m, args, kwargs):
    ids = _arg(imp, node, args, kwargs)
    _check(imp, node, m.max_norm is None, "max_norm")
    table = imp.param(node.target, "weight", m.weight)
    return imp.em.assign(node.name, f"dg.gather({code(table)}, {code(ids)})")


def layer_norm(imp, node, m, args, kwargs):
    x = _arg(imp, node, args, kwargs)
    _check(imp, node, len(m.normalized_shape) == 1, "normalizing over more than the last axis")
    _check(imp, node, m.weight is not None and m.bias is not None, "elementwise_affine=False or bias=False")
    w, b = imp.param(node.target, "weight", m.weight), imp.param(node.target, "bias", m.bias)
    return imp.em.assign(node.name, f"dg.layer_norm({code(x)}, {code(w)}, {code(b)}, eps={m.eps!r})")


def rnn(kind):
    def convert(imp, node, m, args, kwargs):
        x = _arg(imp, node, args, kwargs)
        _check(imp, node, m.batch_first, "batch_first=False (deepgen's sequences are [N, T, features])")
        _check(imp, node, m.bias and not getattr(m, "proj_size", 0), "bias=False or proj_size")
        base = imp.layer(node, m)
        lengths = imp.lengths()
        opts = [code(x), code(lengths), str(m.hidden_size)]
        if m.num_layers != 1:
            opts.append(f"num_layers={m.num_layers}")
        if m.bidirectional:
            opts.append("bidirectional=True")
        opts.append(f'name="{base}"')
        out, h = imp.em.fresh(f"{node.name}_out"), imp.em.fresh(f"{node.name}_h")
        if kind == "lstm":
            c = imp.em.fresh(f"{node.name}_c")
            imp.em.statement(f"{out}, ({h}, {c}) = dg.lstm({', '.join(opts)})")
            return imp.em.var(out), (imp.em.var(h), imp.em.var(c))
        imp.em.statement(f"{out}, {h} = dg.gru({', '.join(opts)})")
        return imp.em.var(out), imp.em.var(h)

    return convert


def multihead_attention(imp, node, m, args, kwargs):
    """Self-attention only: attn(x, x, x) with no masks, batch_first, packed in_proj."""
    q, k, v = (list(args) + [kwargs.get(n) for n in ("query", "key", "value")])[:3]
    masks = [n for n in ("key_padding_mask", "attn_mask") if kwargs.get(n) is not None]
    _check(imp, node, isinstance(q, Var) and q == k == v and len(args) <= 3 and not masks,
           "anything but self-attention attn(x, x, x) without masks")
    _check(imp, node, m.batch_first and m._qkv_same_embed_dim and m.in_proj_bias is not None
           and m.bias_k is None, "batch_first=False, kdim/vdim, bias=False or add_bias_kv")
    w = [imp.param(node.target, key, t) for key, t in (
        ("in_proj_weight", m.in_proj_weight), ("in_proj_bias", m.in_proj_bias),
        ("out_proj.weight", m.out_proj.weight), ("out_proj.bias", m.out_proj.bias))]
    out = imp.em.assign(node.name, f"dg.multi_head_attention({code(q)}, None, {', '.join(code(p) for p in w)}, "
                                   f"{m.num_heads})")
    return out, Unusable("the attention weights MultiheadAttention returns")


def _activation_name(imp, node, layer):
    import torch.nn.functional as F
    from torch import nn

    act = layer.activation
    for name, fn, cls in (("relu", F.relu, nn.ReLU), ("gelu", F.gelu, nn.GELU)):
        if act is fn or (isinstance(act, cls) and getattr(act, "approximate", "none") == "none"):
            return name
    raise imp.fail(node, f"{imp.kind(node)}: activation {act!r} is not supported (relu or gelu)")


def _encoder_layer(imp, node, layer, x, base, path):
    _check(imp, node, layer.self_attn.batch_first, "batch_first=False")
    opts = [code(x), "None", str(layer.self_attn.embed_dim), str(layer.self_attn.num_heads),
            str(layer.linear1.out_features), f'activation="{_activation_name(imp, node, layer)}"']
    if layer.norm_first:
        opts.append("norm_first=True")
    opts += [f"eps={layer.norm1.eps!r}", f'name="{base}"']
    imp.take_state(base, layer, node, path)
    return imp.em.assign(base, f"dg.transformer_encoder_layer({', '.join(opts)})")


def transformer_encoder_layer(imp, node, m, args, kwargs):
    return _encoder_layer(imp, node, m, _arg(imp, node, args, kwargs), imp.base(node), node.target)


def transformer_encoder(imp, node, m, args, kwargs):
    x = _arg(imp, node, args, kwargs)
    base = imp.base(node)
    for i, layer in enumerate(m.layers):
        x = _encoder_layer(imp, node, layer, x, imp.base(f"{node.target}.layers.{i}"), f"{node.target}.layers.{i}")
    if m.norm is not None:
        w, b = imp.param(node.target, "norm.weight", m.norm.weight), imp.param(node.target, "norm.bias", m.norm.bias)
        x = imp.em.assign(f"{base}_norm", f"dg.layer_norm({code(x)}, {code(w)}, {code(b)}, eps={m.norm.eps!r})")
    return x


CONVERTERS = {
    "Linear": linear, "Conv2d": conv2d, "BatchNorm1d": batch_norm, "BatchNorm2d": batch_norm,
    "MaxPool2d": max_pool, "AvgPool2d": avg_pool, "AdaptiveAvgPool2d": adaptive_avg_pool,
    "ReLU": activation("relu"), "GELU": activation("gelu"), "SiLU": activation("silu"),
    "Tanh": activation("tanh"), "Sigmoid": activation("sigmoid"), "ReLU6": activation("relu6"),
    "Hardswish": activation("hardswish"), "Hardsigmoid": activation("hardsigmoid"),
    "Softmax": softmax, "LogSoftmax": softmax, "Dropout": dropout, "Identity": identity, "Flatten": flatten,
    "Embedding": embedding, "LayerNorm": layer_norm, "LSTM": rnn("lstm"), "GRU": rnn("gru"),
    "MultiheadAttention": multihead_attention, "TransformerEncoderLayer": transformer_encoder_layer,
    "TransformerEncoder": transformer_encoder,
}


def convert_module(imp, node, module, args, kwargs):
    from torch import nn

    kind = type(module)
    convert = CONVERTERS.get(kind.__name__) if getattr(nn, kind.__name__, None) is kind else None
    if convert is None:
        raise imp.fail(node, f"unsupported PyTorch module {imp.kind(node)}")
    return convert(imp, node, module, args, kwargs)
