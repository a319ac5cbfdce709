"""Windowed attention as DSL code: torch.roll, F.pad, F.normalize, torch.clamp, and the
functions torchvision's Swin Transformer wraps with torch.fx.wrap (so torch.fx records each
as one call: `shifted_window_attention`, `_patch_merging_pad`, `_get_relative_position_bias`),
written out statement by statement with the DSL's pad, roll, strided slices and window tables.

Constant buffers of windowed attention (a relative position index, Swin v2's relative
coordinates table) are recognized by their values and written as the DSL op that computes
them (`constant_buffer`); any other buffer stays an error.
"""

from __future__ import annotations

import math

import numpy as np

from ..ops.windows import relative_coords_table, relative_position_index
from .emitter import Var, code
from .functions import _get, _tensor


def roll(imp, node, name, args, kwargs):
    x = _tensor(imp, node, args[0])
    shifts, dims = _get(args, kwargs, 1, "shifts"), _get(args, kwargs, 2, "dims")
    if dims is None:
        raise imp.fail(node, f"{imp.kind(node)} without dims (a roll of the flattened tensor) is not supported")
    return imp.em.assign(node.name, f"dg.roll({code(x)}, {code(_tuple(shifts))}, {code(_tuple(dims))})")


def pad(imp, node, name, args, kwargs):
    x = _tensor(imp, node, args[0])
    pads, mode = _get(args, kwargs, 1, "pad"), _get(args, kwargs, 2, "mode", "constant")
    value = _get(args, kwargs, 3, "value", None) or 0.0
    if mode != "constant":
        raise imp.fail(node, f"{imp.kind(node)}: mode={mode!r} is not supported (only 'constant')")
    if not any(pads):
        return x
    extra = f", value={float(value)!r}" if value else ""
    return imp.em.assign(node.name, f"dg.pad({code(x)}, {code(_tuple(pads))}{extra})")


def normalize(imp, node, name, args, kwargs):
    x = _tensor(imp, node, args[0])
    p, dim, eps = _get(args, kwargs, 1, "p", 2.0), _get(args, kwargs, 2, "dim", 1), _get(args, kwargs, 3, "eps", 1e-12)
    if p != 2:
        raise imp.fail(node, f"{imp.kind(node)}: p={p!r} is not supported (only 2)")
    return imp.em.assign(node.name, f"dg.normalize({code(x)}, axis={dim}, eps={float(eps)!r})")


def clamp(imp, node, name, args, kwargs):
    x = _tensor(imp, node, args[0])
    low, high = _get(args, kwargs, 1, "min"), _get(args, kwargs, 2, "max")
    if isinstance(low, Var) or isinstance(high, Var):
        raise imp.fail(node, f"{imp.kind(node)} with tensor bounds is not supported (numbers only)")
    text = code(x)
    if low is not None:
        text = f"dg.maximum({text}, {float(low)!r})"
    if high is not None:
        text = f"dg.minimum({text}, {float(high)!r})"
    return imp.em.assign(node.name, text) if text != code(x) else x


def take(imp, node, table, index):
    """table[index] with an integer tensor: rows of the table (dg.gather)."""
    if index.tensor.value.dtype not in ("int32", "int64"):
        raise imp.fail(node, f"indexing with a {index.tensor.value.dtype} tensor is not supported (integer ids only)")
    return imp.em.assign(node.name, f"dg.gather({code(table)}, {code(index)})")


def einsum(imp, node, name, args, kwargs):
    """A batched matrix product written as einsum ("b h i d, b h j d -> b h i j"): dg.bmm,
    each operand's last two axes in either order; other equations are an error."""
    equation, operands = args[0], args[1:]
    if len(operands) == 1 and isinstance(operands[0], (tuple, list)):
        operands = list(operands[0])
    text = equation.replace(" ", "")
    if len(operands) != 2 or "->" not in text or "." in text:
        raise imp.fail(node, f"einsum {equation!r}: only two operands with an explicit output are supported")
    a, b = (_tensor(imp, node, o) for o in operands)
    (sa, sb), out = text.split("->")[0].split(","), text.split("->")[1]
    batch = out[:-2]
    i, j = out[-2], out[-1]
    shared = [c for c in sa if c in sb and c not in out]
    ok = len(shared) == 1 and sa[:-2] == batch and sb[:-2] == batch and sorted(sa[-2:]) == sorted(i + shared[0]) \
        and sorted(sb[-2:]) == sorted(j + shared[0])
    if not ok:
        raise imp.fail(node, f"einsum {equation!r} is not a batched matrix product (batch axes first, one summed axis)")
    k = shared[0]
    flags = ("" if sa[-1] == k else ", ta=True") + ("" if sb[-2] == k else ", tb=True")
    return imp.em.assign(node.name, f"dg.bmm({code(a)}, {code(b)}{flags})")


def _tuple(value):
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


# -- torchvision's Swin Transformer ---------------------------------------------------------


def patch_merging_pad(imp, node, name, args, kwargs):
    """[..., H, W, C] -> [..., ceil(H/2), ceil(W/2), 4C]: the four pixels of each 2x2 patch
    side by side (zero-padded to even sizes first)."""
    x = _tensor(imp, node, args[0])
    H, W, _ = x.tensor.shape[-3:]
    if H % 2 or W % 2:
        x = imp.em.assign(f"{node.name}_padded", f"dg.pad({code(x)}, (0, 0, 0, {W % 2}, 0, {H % 2}))")
    lead = ":, " * (x.tensor.ndim - 3)
    parts = [imp.em.assign(f"{node.name}_{i}", f"{code(x)}[{lead}{h}::2, {w}::2]")
             for i, (h, w) in enumerate(((0, 0), (1, 0), (0, 1), (1, 1)))]
    return imp.em.assign(node.name, f"dg.concat({code(parts)}, axis=-1)")


def relative_position_bias(imp, node, name, args, kwargs):
    """table [(2wh-1)*(2ww-1), heads] gathered by the index [(wh*ww)^2] -> [1, heads, wh*ww, wh*ww]."""
    table, index = _tensor(imp, node, args[0], "the table"), _tensor(imp, node, args[1], "the index")
    wh, ww = _get(args, kwargs, 2, "window_size")
    L, heads = wh * ww, table.tensor.shape[-1]
    rows = imp.em.assign(f"{node.name}_rows", f"dg.gather({code(table)}, {code(index)})")
    square = imp.em.assign(node.name, f"dg.transpose(dg.reshape({code(rows)}, ({L}, {L}, {heads})), (2, 0, 1))")
    return imp.em.assign(node.name, f"dg.reshape({code(square)}, (1, {heads}, {L}, {L}))")


_SWA_ARGS = ("input", "qkv_weight", "proj_weight", "relative_position_bias", "window_size", "num_heads", "shift_size",
             "attention_dropout", "dropout", "qkv_bias", "proj_bias", "logit_scale", "training")
_SWA_DEFAULTS = {"attention_dropout": 0.0, "dropout": 0.0, "training": True}


def shifted_window_attention(imp, node, name, args, kwargs):
    """Swin's (shifted) window attention over x [B, H, W, C], written out: pad to whole
    windows, roll by -shift, cut into windows, attention with the relative position bias
    (cosine attention with a clamped logit scale in v2; the shift mask where rolled), back
    to the map, roll back, crop."""
    a = {k: _get(args, kwargs, i, k, _SWA_DEFAULTS.get(k)) for i, k in enumerate(_SWA_ARGS)}
    em, hint = imp.em, node.name
    x = _tensor(imp, node, a["input"])
    B, H, W, C = x.tensor.shape
    (wh, ww), heads = a["window_size"], a["num_heads"]
    pad_r, pad_b = (ww - W % ww) % ww, (wh - H % wh) % wh
    if pad_r or pad_b:
        x = em.assign(f"{hint}_padded", f"dg.pad({code(x)}, (0, 0, 0, {pad_r}, 0, {pad_b}))")
    pH, pW = H + pad_b, W + pad_r
    shift = [0 if wh >= pH else a["shift_size"][0], 0 if ww >= pW else a["shift_size"][1]]
    if sum(shift) > 0:
        x = em.assign(f"{hint}_rolled", f"dg.roll({code(x)}, ({-shift[0]}, {-shift[1]}), (1, 2))")
    windows, L, d = (pH // wh) * (pW // ww), wh * ww, C // heads
    x = em.assign(f"{hint}_windows", f"dg.transpose(dg.reshape({code(x)}, {code((B, pH // wh, wh, pW // ww, ww, C))}), "
                                     f"(0, 1, 3, 2, 4, 5))")
    x = em.assign(f"{hint}_windows", f"dg.reshape({code(x)}, {code((B * windows, L, C))})")
    bias = a["qkv_bias"]
    if a["logit_scale"] is not None and bias is not None:  # v2: no bias on the keys
        n = bias.tensor.shape[0] // 3
        bias = em.assign(f"{hint}_qkv_bias", f"dg.concat([{code(bias)}[:{n}], dg.pad({code(bias)}[{2 * n}:], ({n}, 0))])")
    qkv = em.assign(f"{hint}_qkv", f"dg.linear_t({code(x)}, {code(a['qkv_weight'])}"
                                   f"{', ' + code(bias) if bias is not None else ''})")
    qkv = em.assign(f"{hint}_qkv", f"dg.transpose(dg.reshape({code(qkv)}, {code((B * windows, L, 3, heads, d))}), "
                                   "(2, 0, 3, 1, 4))")
    names = [em.fresh(f"{hint}_{n}") for n in "qkv"]
    em.statement(f"{', '.join(names)} = dg.split({code(qkv)}, 3)")
    q, k, v = (em.assign(n, f"dg.reshape({n}, {code((B * windows, heads, L, d))})") for n in names)
    if a["logit_scale"] is not None:
        attn = em.assign(f"{hint}_attn", f"dg.bmm(dg.normalize({code(q)}), dg.normalize({code(k)}), tb=True)")
        scale = em.assign(f"{hint}_logit_scale", f"dg.exp(dg.minimum({code(a['logit_scale'])}, {math.log(100.0)!r}))")
        attn = em.assign(f"{hint}_attn", f"{code(attn)} * {code(scale)}")
    else:
        attn = em.assign(f"{hint}_attn", f"dg.bmm({code(q)} * {d ** -0.5!r}, {code(k)}, tb=True)")
    attn = em.assign(f"{hint}_attn", f"{code(attn)} + {code(_tensor(imp, node, a['relative_position_bias']))}")
    if sum(shift) > 0:
        mask = em.assign(f"{hint}_mask", f"dg.shifted_window_mask(({pH}, {pW}), ({wh}, {ww}), ({shift[0]}, {shift[1]}))")
        attn = em.assign(f"{hint}_attn", f"dg.reshape({code(attn)}, {code((B, windows, heads, L, L))}) + "
                                         f"dg.reshape({code(mask)}, (1, {windows}, 1, {L}, {L}))")
        attn = em.assign(f"{hint}_attn", f"dg.reshape({code(attn)}, {code((B * windows, heads, L, L))})")
    attn = em.assign(f"{hint}_attn", f"dg.softmax({code(attn)}, axis=-1)")
    if a["training"] and a["attention_dropout"]:
        attn = em.assign(f"{hint}_attn", f"dg.dropout({code(attn)}, p={a['attention_dropout']!r})")
    x = em.assign(f"{hint}_out", f"dg.transpose(dg.bmm({code(attn)}, {code(v)}), (0, 2, 1, 3))")
    x = em.assign(f"{hint}_out", f"dg.reshape({code(x)}, {code((B * windows, L, C))})")
    proj_bias = a["proj_bias"]
    x = em.assign(f"{hint}_out", f"dg.linear_t({code(x)}, {code(a['proj_weight'])}"
                                 f"{', ' + code(proj_bias) if proj_bias is not None else ''})")
    if a["training"] and a["dropout"]:
        x = em.assign(f"{hint}_out", f"dg.dropout({code(x)}, p={a['dropout']!r})")
    x = em.assign(f"{hint}_map", f"dg.transpose(dg.reshape({code(x)}, {code((B, pH // wh, pW // ww, wh, ww, C))}), "
                                 "(0, 1, 3, 2, 4, 5))")
    x = em.assign(f"{hint}_map", f"dg.reshape({code(x)}, {code((B, pH, pW, C))})")
    if sum(shift) > 0:
        x = em.assign(f"{hint}_map", f"dg.roll({code(x)}, ({shift[0]}, {shift[1]}), (1, 2))")
    if pad_r or pad_b:
        x = em.assign(hint, f"{code(x)}[:, :{H}, :{W}]")
    return x


# -- constant buffers ------------------------------------------------------------------------


def window_index(values: np.ndarray) -> str | None:
    """The DSL expression of an int array that is a relative position index ([L*L] or
    [L, L]), else None."""
    if values.dtype.kind not in "iu" or values.ndim not in (1, 2):
        return None
    L = math.isqrt(values.size)
    for wh in (w for w in range(1, L + 1) if L * L == values.size and L % w == 0):
        if np.array_equal(values.reshape(-1), relative_position_index(wh, L // wh)):
            text = f"dg.relative_position_index(({wh}, {L // wh}))"
            return text if values.ndim == 1 else f"dg.reshape({text}, ({L}, {L}))"
    return None


def constant_buffer(imp, node, tensor):
    """The DSL statement that computes the buffer `tensor` (self.<node.target>), as a Var,
    when its values are a window table deepgen has an op for; None otherwise."""
    values = tensor.detach().cpu().numpy()
    hint = node.target.replace(".", "_")
    index = window_index(values)  # (MaxViT keeps it [L, L])
    if index is not None:
        return imp.em.assign(hint, index)
    if values.dtype == np.float32 and values.ndim == 4 and values.shape[0] == 1 and values.shape[3] == 2 \
            and values.shape[1] % 2 and values.shape[2] % 2 and min(values.shape[1:3]) >= 3:
        wh, ww = (values.shape[1] + 1) // 2, (values.shape[2] + 1) // 2
        if np.allclose(values[0], relative_coords_table(wh, ww), rtol=1e-6, atol=1e-6):
            return imp.em.assign(hint, f"dg.reshape(dg.relative_coords_table(({wh}, {ww})), {code(values.shape)})")
    return None


HANDLERS = {"roll": roll, "pad": pad, "normalize": normalize, "clamp": clamp, "clip": clamp, "einsum": einsum,
            "swin_patch_merging_pad": patch_merging_pad, "swin_relative_position_bias": relative_position_bias,
            "swin_shifted_window_attention": shifted_window_attention}
# torch.fx.wrap'ed functions of torchvision: (module, name) -> handler name.
LIBRARY = {("torchvision.models.swin_transformer", "_patch_merging_pad"): "swin_patch_merging_pad",
           ("torchvision.models.swin_transformer", "_get_relative_position_bias"): "swin_relative_position_bias",
           ("torchvision.models.swin_transformer", "shifted_window_attention"): "swin_shifted_window_attention"}
