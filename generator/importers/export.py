"""The torch.export front end: modules torch.fx cannot trace (Hugging Face transformers).

torch.fx traces `forward` with proxies and stops at Python that inspects them
(transformers' decorators, `position_ids[:, :seq_length]`, mask code branching on sizes).
torch.export runs the real Python under fake tensors, so it follows all of that, and
its ATen graph still says where each op came from: `nn_module_stack` (the module path:
statements are named after it, parameters after their state_dict keys) and
`stack_trace` (the library or user line each statement cites). Sizes stay symbolic
(`Dim.AUTO`), mapped back to the inputs' dims (N, T).

Three kinds of values: DSL tensors (Var), sizes (ints, sympy), and *derived* integer or
boolean tensors that read no float value (position ids, attention masks built from
`attention_mask`, aranges). Derived values are never written as statements: the
importer runs the exported program on the example inputs (and on probes with other
masks) and recognizes what a float op reads from them: a slice of an embedding table
(position ids that are an arange), or an additive attention mask that is
`dg.key_mask(attention_mask)` and/or `dg.causal_mask(T)`; anything else is an error.
"""

from __future__ import annotations

import operator

from ..errors import DeepgenError
from .blocks import scope_of
from .emitter import Var, code
from .torch_import import identifier
from ..ir.shapes import evaluate
from .trace import source_site


class Derived:
    """An integer / boolean tensor computed without float values: known by its values."""

    def __init__(self, node):
        self.node = node


class LazyParam:
    """A parameter placeholder, declared on first use (next to the statement that reads it)."""

    def __init__(self, key: str, tensor):
        self.key, self.tensor = key, tensor


def export(module, args, kwargs, dims: dict, fx_error=None):
    """The ExportedProgram of module(*args, **kwargs) with the named axes dynamic."""
    import torch
    from torch.export import Dim

    shapes = {}
    sig = __import__("inspect").signature(module.forward)
    names = list(sig.parameters)
    for name, value in [*zip(names, args), *kwargs.items()]:
        axes = dims.get(name, ())
        shapes[name] = {i: Dim.AUTO for i, d in enumerate(axes) if d is not None} if torch.is_tensor(value) else None
    try:
        return torch.export.export(module, tuple(args), dict(kwargs), dynamic_shapes=shapes, strict=False)
    except Exception as e:
        first = f"{fx_error}; " if fx_error is not None else ""
        raise DeepgenError(f"{first}torch.export cannot trace {type(module).__name__} either: "
                           f"{type(e).__name__}: {str(e).strip().splitlines()[0]}") from None


class ExportWalk:
    """Translate an ExportedProgram into statements of `imp` (the Importer)."""

    def __init__(self, imp, ep, examples: dict, input_vars: dict):
        self.imp, self.ep, self.em = imp, ep, imp.em
        self.examples = examples  # input name -> torch tensor
        self.inputs = input_vars  # input name -> Var
        self.symbols: dict = {}  # torch's size symbol (str) -> our dim
        self.values = self._record(examples)  # node name -> its value at the example inputs
        self.masks: dict = {}  # derived node name -> the Var of its additive mask

    # -- running the program ---------------------------------------------------------------
    def _record(self, inputs: dict) -> dict:
        """Every node's value when the exported program runs on `inputs`."""
        import torch
        import torch.fx

        ep = self.ep
        sig = ep.graph_signature
        state = {**dict(ep.named_parameters()), **dict(ep.named_buffers())}
        flat = []
        for spec in sig.input_specs:
            if spec.kind.name == "USER_INPUT":
                flat.append(inputs[spec.arg.name] if hasattr(spec.arg, "name") else None)
            elif spec.kind.name in ("PARAMETER", "BUFFER"):
                flat.append(state[spec.target])
            else:
                flat.append(ep.constants[spec.target])
        values: dict = {}

        class Recorder(torch.fx.Interpreter):
            def run_node(self, n):
                out = super().run_node(n)
                values[n.name] = out
                return out

        with torch.no_grad():
            Recorder(ep.graph_module).run(*flat)
        return values

    # -- the walk ---------------------------------------------------------------------------
    def run(self):
        import os


        ep, em = self.ep, self.em
        sig = ep.graph_signature
        params = dict(sig.inputs_to_parameters)
        buffers = dict(sig.inputs_to_buffers)
        env: dict = {}
        outputs = None
        site = None
        for node in ep.graph.nodes:
            if node.op == "placeholder":
                if node.name in params:
                    env[node] = LazyParam(params[node.name], self.ep.state_dict[params[node.name]])
                elif node.name in self.inputs:
                    env[node] = self.inputs[node.name]
                    self._bind_symbols(node, self.inputs[node.name])
                else:  # buffers and constants: derived values (position ids, ...)
                    env[node] = Derived(node)
                continue
            if node.op == "output":
                outputs = [env.get(a) if a is not None else None for a in node.args[0]]
                continue
            here = source_site(node)
            if here and here != site:
                site = here
                em.comment(f"{os.path.basename(here[0])}:{here[1]}: {here[2]}")
            em.scope = scope_of(node)
            try:
                env[node] = self.convert(node, env)
            except DeepgenError as e:
                if str(e).startswith("/") or ":" in str(e).split(" ")[0]:
                    raise
                raise self.imp.fail(node, str(e)) from None
            self._check(node, env[node])
        return outputs

    def _bind_symbols(self, node, var: Var):
        val = node.meta.get("val")
        for d, ours in zip(getattr(val, "shape", ()), var.tensor.shape):
            if not isinstance(d, int) and not str(d).isdigit():
                self.symbols[str(d)] = ours

    def _check(self, node, value):
        if not isinstance(value, Var):
            return
        real = self.values.get(node.name)

        ours = tuple(evaluate(value.tensor.shape, self.imp.sizes))
        if real is not None and hasattr(real, "shape") and ours != tuple(real.shape):
            raise self.imp.fail(node, f"deepgen's translation of {node.target} has shape {ours} at the example "
                                      f"sizes, PyTorch's has {tuple(real.shape)} (a deepgen importer bug)")

    # -- naming -------------------------------------------------------------------------------
    def hint(self, node) -> str:
        """The module path of the node (a leaf layer: its path; inside a module: path_op)."""
        stack = node.meta.get("nn_module_stack") or {}
        path = list(stack.values())[-1][0] if stack else ""
        op = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        module = self._module(path)
        leaf = module is not None and not list(module.children()) and path
        base = identifier(path) if path else ""
        if leaf:
            return base
        return f"{base}_{op}" if base else op

    def _module(self, path):
        try:
            return self.imp.module.get_submodule(path) if path else self.imp.module
        except AttributeError:
            return None

    # -- values ----------------------------------------------------------------------------------
    def tensor(self, value, node) -> Var:
        if isinstance(value, LazyParam):
            path, _, key = value.key.rpartition(".")
            return self.imp.param(path, key, value.tensor)
        if isinstance(value, Var):
            return value
        raise self.imp.fail(node, f"{node.target}: expected a tensor computed from the inputs, got {value!r}")

    def size(self, value):
        """A size argument: ints, sympy sizes (SymInts arrive as what sym_size made)."""
        if isinstance(value, (list, tuple)):
            return tuple(self.size(v) for v in value)
        return value

    def arg(self, env, a):
        import torch.fx

        if isinstance(a, torch.fx.Node):
            return env[a]
        if isinstance(a, (list, tuple)):
            return type(a)(self.arg(env, x) for x in a)
        return a

    # -- ops ----------------------------------------------------------------------------------
    def convert(self, node, env):
        import torch

        target = node.target
        args = [self.arg(env, a) for a in node.args]
        kwargs = {k: self.arg(env, v) for k, v in node.kwargs.items()}
        if target is operator.getitem:
            seq, i = args
            return seq[i] if isinstance(seq, (tuple, list)) else Derived(node)
        if target in (operator.mul, operator.add, operator.sub, operator.floordiv, operator.truediv):
            return target(*args)
        name = getattr(target, "_opname", None) or getattr(target, "__name__", str(target))
        overload = getattr(target, "_overloadname", "")
        tensors = [a for a in [*args, *kwargs.values()] if isinstance(a, (Var, LazyParam))]
        if name == "sym_size":
            x, d = args
            if isinstance(x, Var):
                return x.tensor.shape[d]
            return self._sym(node)
        if name in ("_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size"):
            return None
        floats = [a for a in tensors if isinstance(a, LazyParam) or a.tensor.dtype.startswith("float")]
        ids_view = name in ("view", "reshape", "_unsafe_view") and isinstance(args[0], Var) and \
            any("embedding" in str(u.target) for u in node.users)  # GPT-2's input_ids.view(-1, T)
        if not floats and not ids_view:  # an integer or boolean computation on sizes, buffers and int inputs
            return Derived(node)
        em = self.em
        hint = self.hint(node)
        if name == "linear":
            x, w = self.tensor(args[0], node), self.tensor(args[1], node)
            b = self.tensor(args[2], node) if len(args) > 2 and args[2] is not None else None
            return em.assign(hint, f"dg.linear_t({code(x)}, {code(w)}{', ' + code(b) if b else ''})")
        if name == "addmm":  # GPT-2's Conv1D: bias + x @ W
            b, x, w = (self.tensor(a, node) for a in args[:3])
            return em.assign(hint, f"dg.matmul({code(x)}, {code(w)}) + {code(b)}")
        if name == "embedding":
            table, ids = args[0], args[1]
            table = self.tensor(table, node)
            if isinstance(ids, Var):
                return em.assign(hint, f"dg.gather({code(table)}, {code(ids)})")
            return self.embedding_rows(node, table, ids, hint)
        if name == "layer_norm":
            x = self.tensor(args[0], node)
            shape = args[1]
            if len(shape) != 1 or len(args) < 4 or args[2] is None or args[3] is None:
                raise self.imp.fail(node, "layer_norm: only over the last axis, with a weight and a bias")
            w, b = self.tensor(args[2], node), self.tensor(args[3], node)
            eps = args[4] if len(args) > 4 else 1e-5
            return em.assign(hint, f"dg.layer_norm({code(x)}, {code(w)}, {code(b)}, eps={eps!r})")
        if name == "dropout":
            x, p = self.tensor(args[0], node), args[1]
            return em.assign(hint, f"dg.dropout({code(x)}, p={p!r})") if p else x
        if name in ("gelu", "tanh", "relu", "sigmoid", "silu", "exp", "rsqrt", "sqrt"):
            x = self.tensor(args[0], node)
            if name == "gelu" and kwargs.get("approximate", "none") != "none":
                return em.assign(hint, f"0.5 * {code(x)} * (1.0 + dg.tanh(0.7978845608028654 * ({code(x)} + "
                                       f"0.044715 * dg.pow({code(x)}, 3.0))))")
            return em.assign(hint, f"dg.{name}({code(x)})")
        if name in ("view", "reshape", "_unsafe_view"):
            x = self.tensor(args[0], node)
            return em.assign(hint, f"dg.reshape({code(x)}, {code(self.size(tuple(args[1])))})")
        if name == "transpose":
            x = self.tensor(args[0], node)
            perm = list(range(x.tensor.ndim))
            a, b = args[1] % x.tensor.ndim, args[2] % x.tensor.ndim
            perm[a], perm[b] = perm[b], perm[a]
            return em.assign(hint, f"dg.transpose({code(x)}, {code(tuple(perm))})")
        if name == "permute":
            x = self.tensor(args[0], node)
            return em.assign(hint, f"dg.transpose({code(x)}, {code(tuple(p % x.tensor.ndim for p in args[1]))})")
        if name == "unsqueeze":
            x = self.tensor(args[0], node)
            shape = list(x.tensor.shape)
            shape.insert(args[1] % (len(shape) + 1), 1)
            return em.assign(hint, f"dg.reshape({code(x)}, {code(tuple(shape))})")
        if name == "expand":
            x = self.tensor(args[0], node)
            return em.assign(hint, f"dg.expand({code(x)}, {code(self.size(tuple(args[1])))})")
        if name in ("contiguous", "clone", "alias") or (name in ("to", "type_as") and isinstance(args[0], Var)):
            return self.tensor(args[0], node)
        if name in ("select", "slice"):
            return self.index(node, name, args, hint)
        if name in ("split", "split_with_sizes"):
            x = self.tensor(args[0], node)
            dim = (args[2] if len(args) > 2 else 0) % x.tensor.ndim
            length = x.tensor.shape[dim]
            sizes = args[1] if isinstance(args[1], (list, tuple)) else \
                [min(args[1], length - s) for s in range(0, length, args[1])]
            names = [em.fresh(f"{hint}_{i}") for i in range(len(sizes))]
            em.statement(f"{', '.join(names)}{',' if len(names) == 1 else ''} = "
                         f"dg.split({code(x)}, {code(list(sizes))}, axis={dim})")
            return tuple(em.var(n) for n in names)
        if name in ("add", "sub", "mul", "div"):
            return self.binary(node, name, args, kwargs, hint)
        if name == "pow":
            x = self.tensor(args[0], node)
            return em.assign(hint, f"dg.pow({code(x)}, {float(args[1])!r})")
        if name in ("softmax", "_softmax"):
            x = self.tensor(args[0], node)
            return em.assign(hint, f"dg.softmax({code(x)}, axis={args[1]})")
        if name == "scaled_dot_product_attention":
            return self.attention(node, args, kwargs, hint)
        if name in ("matmul", "bmm"):
            a, b = self.tensor(args[0], node), self.tensor(args[1], node)
            return em.assign(hint, f"dg.bmm({code(a)}, {code(b)})")
        raise self.imp.fail(node, f"unsupported ATen operation {target} (torch.export front end)")

    def _sym(self, node):
        val = node.meta.get("val")
        key = str(val)
        if key in self.symbols:
            return self.symbols[key]
        return int(self.values[node.name])

    def binary(self, node, name, args, kwargs, hint):
        a, b = args[0], args[1]
        if kwargs.get("alpha", 1) != 1:
            raise self.imp.fail(node, f"{name} with alpha={kwargs['alpha']} is not supported")
        sym = {"add": "+", "sub": "-", "mul": "*", "div": "/"}[name]
        a = self.mask_or(node, a)
        b = self.mask_or(node, b)
        text = [code(self.tensor(v, node)) if isinstance(v, (Var, LazyParam)) else repr(float(v)) for v in (a, b)]
        return self.em.assign(hint, f"{text[0]} {sym} {text[1]}")

    def mask_or(self, node, value):
        if isinstance(value, Derived):
            return self.mask(node, value)
        if hasattr(value, "dtype") and not isinstance(value, (Var, LazyParam)):  # a torch constant
            if value.numel() == 1:
                return float(value)
            raise self.imp.fail(node, "a constant tensor operand is not supported")
        return value

    def index(self, node, name, args, hint):
        x = self.tensor(args[0], node)
        dim = args[1] % x.tensor.ndim
        if name == "select":
            i = args[2]
            parts = [":"] * dim + [f"{i}:{'' if i == -1 else i + 1}"]
            shape = tuple(d for k, d in enumerate(x.tensor.shape) if k != dim)
            return self.em.assign(hint, f"dg.reshape({code(x)}[{', '.join(parts)}], {code(shape)})")
        start, stop = (args[2] if len(args) > 2 else None), (args[3] if len(args) > 3 else None)
        step = args[4] if len(args) > 4 else 1
        if step != 1:
            raise self.imp.fail(node, "slicing with a step is not supported")
        length = x.tensor.shape[dim]
        start = None if start in (None, 0) else start
        stop = None if stop is None or (isinstance(stop, int) and stop >= 2 ** 62) or stop == length else stop
        if start is None and stop is None:
            return x
        parts = [":"] * dim + [f"{'' if start is None else code(start)}:{'' if stop is None else code(stop)}"]
        return self.em.assign(hint, f"{code(x)}[{', '.join(parts)}]")

    # -- derived values -------------------------------------------------------------------------
    def embedding_rows(self, node, table: Var, ids: Derived, hint):
        """table[ids] for ids computed without float values: an arange (position ids) or one
        repeated id (token type 0), checked on the example; written as a slice of the table."""
        import torch

        value = self.values[ids.node.name]
        if not torch.is_tensor(value) or value.dim() == 0:
            raise self.imp.fail(node, "embedding ids that are not a tensor")
        rows = value.reshape(-1, value.shape[-1])
        first = int(rows[0, 0])
        T = self._last_dim(ids.node)
        width = table.tensor.shape[1]
        source = self._int_input(ids.node)
        if source is not None:  # RoBERTa's position ids count the non-padding tokens of input_ids
            self.em.note(f"position ids computed from {source}'s values are taken as they are on the example "
                         f"(exact while {source} holds no padding token)")
        if bool((rows == rows[0]).all()) and bool((rows[0] == torch.arange(first, first + rows.shape[1])).all()):
            stop = first + T if not (isinstance(T, int) and first == 0 and T == table.tensor.shape[0]) else None
            rows_text = f"{code(table)}[{'' if first == 0 else first}:{code(stop) if stop is not None else ''}]"
            shape = self.shape_of(ids.node) + (width,)
            if all(d == 1 for d in shape[:-2]):
                return self.em.assign(hint, f"dg.reshape({rows_text}, {code(shape)})")
            return self.em.assign(hint, f"dg.expand({rows_text}, {code(shape)})")
        if bool((rows == first).all()):
            shape = self.shape_of(ids.node) + (width,)
            return self.em.assign(hint, f"dg.expand({code(table)}[{first}:{first + 1}], {code(shape)})")
        raise self.imp.fail(node, "embedding ids computed from the inputs' values (not an arange or one id) are "
                                  "not supported")

    def shape_of(self, node) -> tuple:
        """The node's shape in our dims (torch's size symbols mapped to N, T, ...)."""
        return tuple(self.symbols.get(str(d), d) if not str(d).isdigit() else int(d)
                     for d in node.meta["val"].shape)

    def _last_dim(self, node):
        val = node.meta.get("val")
        d = val.shape[-1]
        key = str(d)
        if key in self.symbols:
            return self.symbols[key]
        return int(d)

    def attention(self, node, args, kwargs, hint):
        q, k, v = (self.tensor(a, node) for a in args[:3])
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        if len(args) > 4 and args[4] or kwargs.get("dropout_p"):
            pass  # dropout_p: the export was made in eval mode; nothing to do in inference
        causal = (args[5] if len(args) > 5 else kwargs.get("is_causal", False))
        scale = kwargs.get("scale") or (args[6] if len(args) > 6 else None)
        if scale is None:
            d = q.tensor.shape[-1]
            scale = 1.0 / float(d) ** 0.5
        masks = []
        if mask is not None:
            masks.append(code(self.mask(node, mask)))
        if causal:
            masks.append(code(self.causal(node, q)))
        opts = f", mask={' + '.join(masks)}" if masks else ""
        return self.em.assign(hint, f"dg.bmm(dg.softmax(dg.bmm({code(q)}, {code(k)}, tb=True) * {scale!r}{opts}), "
                                    f"{code(v)})")

    def causal(self, node, q):
        T = q.tensor.shape[-2]
        key = ("causal", str(T))
        if key not in self.masks:
            self.masks[key] = self._model_level("causal_mask", f"dg.causal_mask({code(T)})")
        return self.masks[key]

    def mask(self, node, derived: Derived) -> Var:
        """The additive mask a derived value is, recognized on probes of the integer input
        it reads: key padding (`dg.key_mask`), causal (`dg.causal_mask`), or both."""
        import torch

        name = derived.node.name
        if name in self.masks:
            return self.masks[name]
        source = self._mask_input(derived.node)
        if source is None:
            raise self.imp.fail(node, "a mask computed without an integer input is not supported")
        example = self.examples[source]
        Nn, Tt = example.shape
        g = torch.Generator().manual_seed(0)
        probes = [example]
        for _ in range(3):
            m = torch.randint(0, 2, (Nn, Tt), generator=g, dtype=example.dtype)
            m[:, 0] = 1
            probes.append(m)
        kinds = {"pad": True, "pad+causal": True, "causal": True}
        for m in probes:
            value = self._record({**self.examples, source: m})[name] if m is not example else self.values[name]
            kept = _kept(value)
            if kept is None:
                raise self.imp.fail(node, "a mask whose values are not boolean or 0 / -inf (additive) is not supported")
            pad = (m != 0)[:, None, None, :]
            causal = torch.ones(Tt, Tt, dtype=torch.bool).tril()[None, None]
            full = kept.expand(Nn, kept.shape[1], Tt, Tt) if kept.dim() == 4 else None
            if full is None:
                raise self.imp.fail(node, f"a mask of shape {tuple(kept.shape)} is not supported ([N, 1, T, T] only)")
            for kind, want in (("pad", pad), ("pad+causal", pad & causal), ("causal", causal)):
                kinds[kind] = kinds[kind] and bool((full == want.expand_as(full)).all())
        kind = next((k for k in ("causal", "pad", "pad+causal") if kinds[k]), None)
        if kind is None:
            raise self.imp.fail(node, f"the attention mask built from {source!r} is neither a key padding mask nor a "
                                      "causal one (nor both)")
        mask_var = self.inputs[source]
        N, T = mask_var.tensor.shape
        parts = []
        if "pad" in kind:
            key = ("pad", source)
            if key not in self.masks:
                self.masks[key] = self._model_level(f"{source}_additive",
                                                 f"dg.reshape(dg.key_mask({code(mask_var)}), {code((N, 1, 1, T))})")
            parts.append(self.masks[key])
        if "causal" in kind:
            key = ("causal", str(T))
            if key not in self.masks:
                self.masks[key] = self._model_level("causal_mask", f"dg.causal_mask({code(T)})")
            parts.append(self.masks[key])
        result = parts[0] if len(parts) == 1 else self._model_level(f"{source}_causal",
                                                                  " + ".join(code(p) for p in parts))
        self.masks[name] = result
        return result

    def _model_level(self, hint, expr):
        """A statement of the model itself, though written at its first use (a mask the first
        layer reads): blocks.py moves it before that layer's function call."""
        scope, self.em.scope = self.em.scope, ()
        try:
            return self.em.assign(hint, expr)
        finally:
            self.em.scope = scope

    def _mask_input(self, node):
        """The integer user input a derived node reads (through derived nodes)."""
        import torch.fx

        seen, todo = set(), [node]
        while todo:
            n = todo.pop()
            if n.name in seen:
                continue
            seen.add(n.name)
            if n.op == "placeholder" and n.name in self.inputs and n.name in self.examples \
                    and not self.examples[n.name].dtype.is_floating_point:
                if self._only_masks(n):
                    return n.name
            todo += [a for a in n.all_input_nodes if isinstance(a, torch.fx.Node)]
        return None

    def _int_input(self, node):
        """An integer user input the derived node reads, or None."""
        seen, todo = set(), [node]
        while todo:
            n = todo.pop()
            if n.name in seen:
                continue
            seen.add(n.name)
            if n.op == "placeholder" and n.name in self.inputs:
                return n.name
            if "sym_size" not in str(n.target):  # (reading an input's size is not reading its values)
                todo += list(n.all_input_nodes)
        return None

    def _only_masks(self, placeholder) -> bool:
        """Not an embedding's ids (input_ids): the input feeds no embedding directly."""
        return not any("embedding" in str(u.target) for u in placeholder.users)


def _kept(value):
    """A mask's kept positions as booleans (bool masks; additive 0 / very negative masks)."""
    import torch

    if not torch.is_tensor(value):
        return None
    if value.dtype == torch.bool:
        return value
    if value.dtype.is_floating_point:
        ok = (value == 0) | (value <= torch.finfo(value.dtype).min / 2)
        return value == 0 if bool(ok.all()) else None
    return None

