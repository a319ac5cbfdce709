"""An ONNX file as a deepgen model file and its weights.

`from_onnx(model)` reads the graph with the `onnx` package (no runtime needed),
walks its nodes in order and writes one DSL statement per node, or per layer it
recognizes (a Conv and the activation after it, a MatMul and its bias, the Erf
pattern of GELU), each run at once under a live Builder (emitter.py) so that
later statements see the DSL's symbolic shapes. Shape arithmetic (Shape ->
Gather -> Concat -> Reshape, as `torch.onnx.export` writes `x.view(b * t, e)`)
is computed here on those symbolic sizes and written as the sizes it makes, not
as statements. Initializers become parameters (the .npz), named after the
initializer, or after the node that uses them when the exporter gave them no
name of their own (`onnx::Conv_28` of node `/layer1/layer1.0/conv1/Conv` ->
`layer1_0_conv1_weight`). The op converters are in onnx_ops.py and the
family modules it names. onnx is imported only when an import runs.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import numpy as np

from ..errors import DeepgenError
from ..ir.names import problem_with
from ..ir.shapes import evaluate
from .emitter import Emitter, StatementError, Var, code, model_file, validate_model_file
from .torch_import import _same, check_targets, write_model

MIN_OPSET = 9  # older opsets differ in broadcasting and attributes; onnx.version_converter updates them
_DTYPES = {1: "float32", 6: "int32", 7: "int64"}  # ONNX elem_type -> deepgen input dtype
_TYPE_NAMES = {0: "undefined", 1: "float32", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64",
               8: "string", 9: "bool", 10: "float16", 11: "float64", 12: "uint32", 13: "uint64", 16: "bfloat16"}


@dataclass(eq=False)
class Const:
    """A value known at import: an initializer, a Constant node's value, or a size computed from
    the inputs' shapes. `value` is a numpy array; sizes that involve a symbolic dim are sympy
    expressions in an object array. `name`: the ONNX name it goes by, for a parameter made of it
    (None: name the parameter after the node that uses it)."""

    value: np.ndarray
    name: str | None = None

    @property
    def symbolic(self) -> bool:
        return self.value.dtype == object


class Derived:
    """A value computed from the inputs' sizes and integer inputs only (attention masks,
    position ids): never a statement; known by its values on probes (onnx_derived.py)."""

    def __init__(self, name: str, node):
        self.name, self.node = name, node


class Weights(dict):
    """{parameter name: float32 array}, and `onnx_names`: {statement or input name of the
    written file: the ONNX value it computes or is} (write_model keeps it in the .npz as
    `meta/onnx_value_names`; `deepgen compare --onnx` reads it)."""

    def __init__(self, arrays: dict, onnx_names: dict):
        super().__init__(arrays)
        self.onnx_names = dict(onnx_names)


class Unsupported(DeepgenError):
    """An ONNX node deepgen cannot translate; the message names op, node and opset."""


def from_onnx(model, name: str | None = None, outputs=None):
    """(model file text, {parameter name: float32 array}) for an ONNX model: a path or an
    onnx.ModelProto. `outputs`: the graph outputs to import (default: all), e.g. a
    classifier's probabilities without its label post-processing. Symbolic dims come from
    the inputs' dim_params (and axis 0 is the symbolic batch `N` where the file fixes it)."""
    try:
        import onnx
    except ImportError:
        raise DeepgenError("from_onnx needs the onnx package (pip install onnx)") from None
    source = None
    if isinstance(model, (str, os.PathLike)):
        source = os.fspath(model)
        model = load(source)
    if not isinstance(model, onnx.ModelProto):
        raise DeepgenError(f"from_onnx needs an ONNX file or an onnx.ModelProto, got {type(model).__name__}")
    if name is None:
        stem = os.path.splitext(os.path.basename(source))[0] if source else (model.graph.name or "onnx_model")
        name = default_name(stem)
    problem = problem_with(name)
    if problem:
        raise DeepgenError(f"invalid model name: {problem}")
    return OnnxImporter(model, name, source).run(outputs)


def command(args) -> None:
    """`deepgen from-onnx MODEL.onnx -o MODEL.py [--weights W.npz] [--name NAME] [--outputs A,B]
    [--force]`: both files written or neither, an existing one only with --force, the ONNX
    file itself never."""
    weights_arg = args.weights or os.path.splitext(args.output)[0] + ".npz"
    for given, what in ((args.output, "model file"), (weights_arg, "weights file")):
        if _same(os.path.abspath(given), os.path.abspath(args.model)):
            raise DeepgenError(f"{given} (the {what} to write) is the ONNX file being imported: deepgen never writes "
                               "over it, not even with --force; name another file")
    paths = check_targets(args.output, weights_arg, replace=args.force)
    outputs = [o for o in args.outputs.split(",") if o] if args.outputs else None
    name = args.name or default_name(os.path.splitext(os.path.basename(args.model))[0])
    source, weights = from_onnx(args.model, name=name, outputs=outputs)
    write_model(source, weights, *paths, replace=args.force, protect=[args.model])
    print(f"wrote {args.output} and {weights_arg} ({len(weights)} arrays)")
    print(f"next: deepgen generate {args.output} -o {os.path.splitext(os.path.basename(args.output))[0]}_project")


def load(path: str):
    """The onnx.ModelProto in `path` (with its external data), or a one-line error."""
    import onnx

    if not os.path.isfile(path):
        raise DeepgenError(f"{path}: no such file" if not os.path.exists(path) else f"{path} is not a regular file")
    try:
        return onnx.load(path)
    except Exception as e:  # a protobuf DecodeError, or external data missing
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise DeepgenError(f"{path} is not a readable ONNX model: {first}") from None


def default_name(stem: str) -> str:
    """A model name from a file name or graph name: `mobilenet-v3.onnx` -> `mobilenet_v3`."""
    text = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", stem).lower()
    text = re.sub(r"[^0-9a-z_]+", "_", text).strip("_") or "onnx_model"
    text = "model_" + text if text[0].isdigit() else text
    return text + "_model" if problem_with(text) else text


def identifier(text: str, fallback: str = "t") -> str:
    """An ONNX name made into an identifier: `layer.norm1.weight` -> `layer_norm1_weight`."""
    base = re.sub(r"_+", "_", "".join(c if c.isalnum() and c.isascii() else "_" for c in text)).strip("_")
    base = base or fallback
    return "layer_" + base if base[0].isdigit() else base


def scope(node) -> list[str]:
    """The module path of a node as torch.onnx.export names it: `/layer1/layer1.0/conv1/Conv` ->
    [`layer1.0`, `conv1`] (a component that extends the one before replaces it)."""
    parts = [p for p in node.name.split("/") if p][:-1] if "/" in node.name else []
    merged: list[str] = []
    for p in parts:
        if merged and p.startswith(merged[-1] + "."):
            merged[-1] = p
        else:
            merged.append(p)
    return merged


# Ops that compute sizes or move data without computing: not counted when deciding whether a
# node is the only computing node of its scope (then it is named after the scope alone).
_PLUMBING = {"Constant", "Shape", "Gather", "Unsqueeze", "Squeeze", "Concat", "Slice", "Cast", "Identity", "Reshape",
             "Transpose", "Flatten", "Dropout", "Range", "Equal", "Where", "ConstantOfShape", "Expand", "Split",
             "Size", "Mod", "Not", "Less", "Greater"}


class OnnxImporter:
    """One import: the graph, its values so far (Var or Const per ONNX name), the weights."""

    def __init__(self, model, name: str, source: str | None):
        import onnx

        self.model = model
        self.graph = model.graph
        self.name = name
        self.source = source
        self.onnx = onnx
        self.opsets = {(o.domain or "ai.onnx"): o.version for o in model.opset_import}
        self.opset = self.opsets.get("ai.onnx", 0)
        self.em = Emitter(name)
        self.weights: dict[str, np.ndarray] = {}
        self.env: dict[str, Var | Const | None] = {}
        self.params: dict[int, tuple] = {}  # id(Const) -> (the Const, the parameter made of it)
        self.renamed: dict[str, str] = {}  # ONNX input/output name -> the identifier used for it
        self.static_batch: dict = {}  # the batch symbol -> the size the file fixed axis 0 to
        self.absorbed: set[int] = set()  # id(node) of nodes another node's statement computes
        self.fused: dict[int, object] = {}  # id(node) -> what a pattern makes of it (see onnx_ops.plan)
        self.masks: dict = {}  # the attention masks written so far, by kind (onnx_derived.additive_mask)
        self.initializers = {t.name: t for t in self.graph.initializer}
        self.producer = {o: n for n in self.graph.node for o in n.output if o}
        self.consumers: dict[str, list] = {}
        for n in self.graph.node:
            for i in n.input:
                if i:
                    self.consumers.setdefault(i, []).append(n)
        self.graph_outputs = {o.name for o in self.graph.output}
        counts: dict[tuple, int] = {}
        for n in self.graph.node:
            if n.op_type not in _PLUMBING:
                counts[tuple(scope(n))] = counts.get(tuple(scope(n)), 0) + 1
        self.scope_counts = counts
        self._site = None
        self.inferred = self._infer()

    # -- names ------------------------------------------------------------------------
    def describe(self, node) -> str:
        """`Conv node /conv1/Conv (opset 17)`: the node as an error names it."""
        label = node.name or (f"making {node.output[0]}" if node.output else "unnamed")
        domain = node.domain if node.domain not in ("", "ai.onnx") else ""
        op = f"{domain}.{node.op_type}" if domain else node.op_type
        version = self.opsets.get(domain or "ai.onnx", "?")
        return f"{op} node {label!r} (opset {version})"

    def fail(self, node, message: str) -> DeepgenError:
        return DeepgenError(f"ONNX {self.describe(node)}: {message}")

    def layer(self, node, op: str | None = None) -> str:
        """A name for what node computes: its module path (`layer1_0_conv1`), plus the op
        (`layer_self_attn_matmul_1`) where its scope computes more than this one node. `op`:
        what to call the op instead (a pattern's, `gelu`)."""
        path = scope(node)
        last = op or (node.name.split("/")[-1] if node.name else "")
        if path:
            base = identifier("_".join(path))
            count = self.scope_counts.get(tuple(path), 0)
            if count > 1 or count and node.op_type in _PLUMBING:
                base += "_" + identifier(last or node.op_type).lower()
            return base
        if last and (op or node.op_type.lower() in last.lower()):
            return identifier(last).lower()
        out = node.output[0] if node.output else ""
        if out and not out.lstrip("0123456789_")[:1].isdigit() and out[:1].isalpha():  # a name, not a number
            return identifier(out)
        return identifier(last or node.op_type).lower()

    def param_name(self, const: Const, node, role: str, layer: str | None = None) -> str:
        """The parameter name for an initializer: its own name, made an identifier; for an
        anonymous one (`onnx::MatMul_215`, a Constant's output), the layer's name (default:
        the node's) + role."""
        own = const.name
        if own and not own.startswith("onnx::"):
            base = identifier(own)
        else:
            base = f"{layer or self.layer(node)}_{role}"
        return self.unique_param(base)

    def unique_param(self, base: str) -> str:
        """`base`, or `base_2`, ... : a parameter name no other parameter or layer has."""
        base = base if not problem_with(base) else base + "_p"
        name, k = base, 2
        while name in self.weights or name in self.em.taken and name not in self.em.locals:
            name, k = f"{base}_{k}", k + 1
        return name

    def layer_base(self, node, roles) -> str:
        """The `name=` of a layer helper for `node`: its layer name, made unique so that
        every `<name>_<role>` parameter is new."""
        base = self.layer(node)
        base = base if not problem_with(base) else base + "_layer"
        name, k = base, 2
        while any(f"{name}_{r}" in self.weights for r in roles):
            name, k = f"{base}_{k}", k + 1
        return name

    # -- values -----------------------------------------------------------------------
    def param(self, const: Const, node, role: str, layer: str | None = None) -> Var:
        """The parameter holding `const` (declared at its first use), a float32 array."""
        if id(const) in self.params:
            return self.params[id(const)][1]
        if const.symbolic or const.value.dtype.kind not in "fiu":
            raise self.fail(node, f"its {role} is a {self._kind(const)}, which deepgen cannot hold as a parameter")
        if const.value.dtype.kind != "f":
            raise self.fail(node, f"its {role} is a constant {const.value.dtype} tensor of shape "
                                  f"{tuple(const.value.shape)}; deepgen parameters are float32")
        full = self.param_name(const, node, role, layer)
        self.weights[full] = np.ascontiguousarray(const.value, dtype=np.float32)
        var = self.em.fresh(full)
        shape = tuple(int(d) for d in const.value.shape)
        if const.name and identifier(const.name) != full:
            self.em.note(f"{full}: ONNX initializer {const.name}")
        self.em.statement(f'{var} = dg.param("{full}", {code(shape)})')
        self.params[id(const)] = (const, self.em.var(var))  # (the Const kept: its id stays its own)
        return self.params[id(const)][1]

    def store(self, full: str, array) -> None:
        """A layer helper's parameter or state `full` (its name claimed by the helper)."""
        if full in self.weights:
            raise DeepgenError(f"internal: parameter name {full!r} is used twice")
        self.weights[full] = np.ascontiguousarray(array, dtype=np.float32)

    def tensor(self, value, node, role: str = "input", layer: str | None = None) -> Var:
        """`value` as a tensor of the model: a Var itself, a Const as a parameter."""
        if isinstance(value, Var):
            return value
        if isinstance(value, Const):
            return self.param(value, node, role, layer)
        if isinstance(value, Derived):
            raise self.fail(node, f"its {role} {value.name!r} is computed from the inputs' sizes and integer values "
                                  "(no float value of the model); deepgen reads such values only as an attention mask "
                                  "added to scores or as the ids of an embedding table")
        raise self.fail(node, f"its {role} is missing")

    def static_const(self, name: str):
        """The array of an initializer or a Constant node's output (None: computed, or no value)."""
        from onnx import numpy_helper

        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name])
        node = self.producer.get(name)
        if node is not None and node.op_type == "Identity" and node.domain in ("", "ai.onnx"):
            return self.static_const(node.input[0])
        if node is not None and node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for a in node.attribute:
                if a.name == "value":
                    return numpy_helper.to_array(a.t)
                if a.name in ("value_float", "value_int"):
                    return np.array(a.f if a.name == "value_float" else a.i)
                if a.name in ("value_floats", "value_ints"):
                    return np.array(list(a.floats) if a.name == "value_floats" else list(a.ints))
        return None

    def _kind(self, const: Const) -> str:
        return ("size computed from the inputs' symbolic shapes" if const.symbolic
                else f"{const.value.dtype} constant")

    def inline(self, const: Const):
        """A Const that can be written as a number in an expression (a single element): the
        number as text; else None."""
        if const.symbolic or const.value.size != 1 or const.value.dtype.kind not in "fiub":
            return None
        return number(const.value.reshape(()).item() if const.value.dtype.kind != "f" else const.value.reshape(())[()])

    # -- the walk ---------------------------------------------------------------------
    def run(self, outputs):
        from .onnx_ops import convert, plan

        if self.opset < MIN_OPSET:
            raise DeepgenError(f"the model uses ONNX opset {self.opset}; deepgen reads opset {MIN_OPSET} and later "
                               "(update it with onnx.version_converter.convert_version)")
        wanted = self._outputs(outputs)
        nodes = self._needed(wanted)
        with self.em:
            self._inputs(wanted)
            plan(self, nodes)
            for node in nodes:
                if id(node) in self.absorbed:
                    continue
                self._comment(node)
                try:
                    convert(self, node)
                except StatementError as e:
                    raise self.fail(node, f"imported as `{e.statement}`, does not check: {e}") from None
                except Unsupported as e:
                    raise Unsupported(f"{e}{self._without(node, wanted)}") from None
                for out in node.output:
                    self._check_shape(node, out)
        results = {}
        for onnx_name in wanted:
            value = self.env.get(onnx_name)
            key = self._rename(onnx_name, "output")
            if key in results:  # two ONNX names that make the same identifier
                key = next(f"{key}_{k}" for k in range(2, len(results) + 3) if f"{key}_{k}" not in results)
                self.renamed[onnx_name] = key
            if not isinstance(value, Var):
                what = "a constant" if isinstance(value, Const) else "computed from the inputs' sizes and integer values"
                raise DeepgenError(f"ONNX output {onnx_name!r} is {what}; deepgen models return tensors computed "
                                   "from their inputs")
            results[key] = value
        source = self._render(results)
        self._validate(source)
        return source, Weights(self.weights, self._onnx_names(nodes))

    def _onnx_names(self, nodes) -> dict:
        """{variable of the file: the ONNX value it holds}: the inputs, and each statement's
        value under the name of the last node output (in graph order) that it is (a Conv
        written with its activation is the activation's output)."""
        names = {}
        for info in self.graph.input:
            value = self.env.get(info.name)
            if isinstance(value, Var):
                names[value.name] = info.name
        inputs = set(names)
        for node in nodes:
            for out in node.output:
                value = self.env.get(out)
                if isinstance(value, Var) and value.name not in inputs:
                    names[value.name] = out
        return names

    def _outputs(self, outputs) -> list[str]:
        names = [o.name for o in self.graph.output]
        if outputs is None:
            return names
        outputs = [outputs] if isinstance(outputs, str) else list(outputs)
        unknown = [o for o in outputs if o not in names]
        if unknown or not outputs:
            raise DeepgenError(f"output(s) {', '.join(map(repr, unknown)) or '(none given)'}: the ONNX graph's outputs "
                               f"are {', '.join(map(repr, names))}")
        return list(dict.fromkeys(outputs))

    def _without(self, node, wanted) -> str:
        """A hint naming the outputs that do not need `node` (a classifier's probabilities
        beside its label), when there are some."""
        free = [o for o in wanted if all(n is not node for n in self._needed([o]))]
        if not free:
            return ""
        return (f"; the output(s) {', '.join(map(repr, free))} do not need it: import them alone with "
                f"--outputs {','.join(free)}")

    def _needed(self, wanted) -> list:
        """The nodes the wanted outputs depend on, in the file's (topological) order."""
        need, todo = set(), list(wanted)
        while todo:
            name = todo.pop()
            node = self.producer.get(name)
            if node is None or id(node) in need:
                continue
            need.add(id(node))
            todo += [i for i in node.input if i]
        return [n for n in self.graph.node if id(n) in need]

    def _inputs(self, wanted):
        """dg.input statements for the graph inputs that are not initializers; the
        initializers as Consts."""
        from onnx import numpy_helper

        for name, tensor in self.initializers.items():
            self.env[name] = Const(numpy_helper.to_array(tensor), name)
        used = {i for n in self.graph.node for i in n.input} | set(wanted)
        for info in self.graph.input:
            if info.name in self.initializers:
                continue
            if info.name not in used:
                continue
            t = info.type.tensor_type
            if not info.type.HasField("tensor_type"):
                raise DeepgenError(f"ONNX input {info.name!r} is not a tensor; deepgen inputs are tensors")
            dtype = _DTYPES.get(t.elem_type)
            if dtype is None:
                raise DeepgenError(f"ONNX input {info.name!r} is {_TYPE_NAMES.get(t.elem_type, t.elem_type)}; deepgen "
                                   "inputs are float32, int32 or int64")
            if not t.HasField("shape"):
                raise DeepgenError(f"ONNX input {info.name!r} has no shape in the file; deepgen needs each input's rank")
            shape = []
            for axis, d in enumerate(t.shape.dim):
                if d.HasField("dim_param") and d.dim_param:
                    shape.append(self.em.dim(self._dim_name(d.dim_param)))
                elif axis == 0:  # fixed or unknown: the batch
                    symbol = self.em.dim("N")
                    if d.HasField("dim_value"):
                        self.static_batch[symbol] = int(d.dim_value)
                    shape.append(symbol)
                elif d.HasField("dim_value"):
                    shape.append(int(d.dim_value))
                else:
                    raise DeepgenError(f"ONNX input {info.name!r}: axis {axis} has neither a size nor a name; give it "
                                       "one when exporting (torch.onnx.export's dynamic_axes names it)")
            key = self._rename(info.name, "input")
            self.env[info.name] = self.em.declare_input(key, shape, dtype)

    def _dim_name(self, text: str) -> str:
        name = identifier(text, "d")
        return name if not problem_with(name) else name + "_dim"

    def _rename(self, onnx_name: str, what: str) -> str:
        key = identifier(onnx_name, what)
        if key != identifier(onnx_name.lstrip("0123456789_"), what):  # `191` (an exporter's number) -> output
            key = what if what not in self.em.taken else f"{what}_{identifier(onnx_name)}"
        if problem_with(key):
            key += f"_{what}"
        if key != onnx_name:
            self.renamed[onnx_name] = key
        return key

    def _comment(self, node):
        """A comment naming the ONNX block (`# layer1.0`: the module above a one-op layer, or
        the module of a node among several) where it changes."""
        if node.op_type in _PLUMBING:
            return
        module = scope(node)
        block = module[:-1] if self.scope_counts.get(tuple(module), 0) == 1 else module
        if block and block != self._site:
            self.em.comment(".".join(block))
            self._site = block

    def _infer(self) -> dict:
        """ONNX's own shape inference: {value name: (int or None per axis)} where it knows."""
        try:
            inferred = self.onnx.shape_inference.infer_shapes(self.model)
        except Exception:  # a model shape inference cannot follow: no checks then
            return {}
        shapes = {}
        for info in list(inferred.graph.value_info) + list(inferred.graph.output):
            t = info.type.tensor_type
            if info.type.HasField("tensor_type") and t.HasField("shape"):
                shapes[info.name] = tuple(d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim)
        return shapes

    def _check_shape(self, node, out: str):
        """The translation of `node` has the shape ONNX infers, on every axis both know."""
        value, want = self.env.get(out), self.inferred.get(out)
        if not isinstance(value, Var) or want is None:
            return
        ours = tuple(value.tensor.shape)
        try:
            known = evaluate(ours, self.static_batch) if self.static_batch else ours
        except Exception:  # a symbolic dim other than the fixed batch: compare the concrete axes
            known = ours
        mismatch = len(ours) != len(want) or any(
            w is not None and isinstance(o, int) and o != w for o, w in zip(known, want))
        if mismatch:
            raise self.fail(node, f"deepgen's translation has shape {tuple(known)}, ONNX's shape inference says "
                                  f"{tuple('?' if w is None else w for w in want)} (a deepgen importer bug)")

    # -- the file ---------------------------------------------------------------------
    def _render(self, outputs: dict) -> str:
        em = self.em
        where = os.path.basename(self.source) if self.source else "an onnx.ModelProto"
        made_by = " ".join(p for p in (self.model.producer_name, self.model.producer_version) if p)
        lines = [f'"""{self.name} imported from ONNX by `deepgen from-onnx` ({where}, opset {self.opset}'
                 f'{", made by " + made_by if made_by else ""}).', "",
                 "Parameters are named after the ONNX initializers made identifiers (`fc.weight` -> `fc_weight`),",
                 "or after the node that uses them where the exporter named them `onnx::...`",
                 "(`/layer1/layer1.0/conv1/Conv` -> `layer1_0_conv1_weight`). Load the weights the importer",
                 f"wrote (the .npz) and switch to eval mode: `model = {self.name}.Model(); model.load(path); "
                 "model.eval()`."]
        if self.renamed:
            lines += ["", "ONNX names made identifiers: " + ", ".join(f"{k!r} -> `{v}`" for k, v in self.renamed.items())
                      + "."]
        return model_file(lines, em, self.name, outputs)

    def _validate(self, source: str):
        validate_model_file(source, self.name, self.weights, "from-onnx")


def number(value) -> str:
    """Python source for a number of the graph: ints as ints, floats as the shortest text
    that is the same float32 (`0.70710677`, not 0.7071067690849304)."""
    if isinstance(value, (bool, np.bool_)):
        return str(int(value))
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    f = np.float32(value)
    if np.isnan(f):
        return 'float("nan")'
    if np.isinf(f):
        return 'float("inf")' if f > 0 else '-float("inf")'
    return repr(float(np.format_float_scientific(f, unique=True)))
