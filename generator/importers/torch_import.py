"""A torch.nn.Module as a deepgen model file and its weights.

`from_torch(module, example_inputs)` traces the module with torch.fx, walks the
graph node by node and writes one DSL statement (or a few) per node, each run at
once under a live Builder; the finished file is built once more as `generate`
will load it, and its parameters are checked against the weights. torch is
imported here only, so importing deepgen never imports it.
"""

from __future__ import annotations

import contextlib
import io
import os
import re

import numpy as np

from ..fileio import TEMP_PREFIX, stage, write_atomic  # (not `from .. import fileio`: that asks
# generator.__getattr__, which loads the DSL namespace, which imports this package: a cycle)
from ..errors import DeepgenError
from ..ir.names import problem_with
from ..ir.shapes import evaluate
from .blocks import scope_of
from .emitter import Emitter, StatementError, Var, code, model_file, validate_model_file
from .functions import convert_call
from .modules import Unusable, convert_module
from .trace import describe, node_error, source_site, trace
from .windows import constant_buffer

_SEQUENCE_MODULES = ("LSTM", "GRU", "MultiheadAttention", "TransformerEncoderLayer", "TransformerEncoder", "Embedding")
_DTYPES = {"torch.float32": "float32", "torch.int64": "int64", "torch.int32": "int32"}


def from_torch(module, example_inputs, name: str | None = None, dims: dict | None = None):
    """(model file text, {parameter name: float32 array}) for an nn.Module.

    `example_inputs`: a tensor, a tuple of tensors (forward's arguments in order)
    or a dict by argument name; their shapes and dtypes become the inputs'.
    Axis 0 of every input is the symbolic batch `N`; axis 1 of a sequence ([N, T,
    features] floats or [N, T] ids, in a model with LSTM / GRU / attention /
    Embedding layers) is the symbolic `T`. `dims` overrides this per input: a
    tuple with a dim name or None (concrete) per axis, e.g. {"x": ("N", None)}."""
    try:
        import torch
    except ImportError:
        raise DeepgenError("from_torch needs PyTorch (pip install torch)") from None
    if not isinstance(module, torch.nn.Module):
        raise DeepgenError(f"from_torch needs a torch.nn.Module, got {type(module).__name__}")
    name = name or _snake(type(module).__name__)
    problem = problem_with(name)
    if problem:
        raise DeepgenError(f"invalid model name: {problem}")
    return Importer(module, name).run(example_inputs, dims or {})


def write_model(source: str, weights: dict, model_path: str, weights_path: str | None = None, *,
                replace: bool = True, protect=()) -> tuple[str, str]:
    """Write the model file and its weights (`.npz` next to it by default); returns both paths.
    Weights from `from_torch` carry their state_dict keys: the .npz keeps them as the uint8
    member `meta/torch_state_dict_keys` (JSON; read back with `torch_keys(npz)`, skipped by load());
    weights from `from_onnx` the ONNX value each statement computes (`meta/onnx_value_names`).

    Both files are written or neither: each is staged as a synced temporary beside its target
    (folders made as needed), then both are renamed into place; should the second rename fail,
    the first file is put back as it was. `replace=False` refuses a target that exists;
    `protect` names files never to be written over (the PyTorch source the module came from)."""
    weights_path = weights_path or os.path.splitext(model_path)[0] + ".npz"
    targets = check_targets(model_path, weights_path, replace=replace, protect=protect)
    data = io.BytesIO()
    keys = getattr(weights, "torch_keys", None)
    meta = {TORCH_KEYS: keys_array(keys)} if keys else {}
    onnx_names = getattr(weights, "onnx_names", None)  # from_onnx's {statement or input: ONNX value name}
    if onnx_names:
        meta[ONNX_NAMES] = keys_array(onnx_names)
    np.savez(data, **weights, **meta)
    made = _missing_folders(targets)
    staged = []
    try:
        for target, content in zip(targets, (source.encode("utf-8"), data.getvalue())):
            staged.append(stage(target, content))
        check_targets(model_path, weights_path, replace=replace, protect=protect)  # (again: the import took time)
        before = _saved(targets[0])
        staged[0].commit()
        try:
            staged[1].commit()
        except BaseException:
            _restore(targets[0], before)
            raise
    except BaseException:
        for s in staged:
            s.discard()
        for folder in reversed(made):  # folders this call made, when it wrote nothing into them
            try:
                os.rmdir(folder)
            except OSError:
                pass
        raise
    return model_path, weights_path


def check_targets(model_path: str, weights_path: str, *, replace: bool, protect=()) -> tuple[str, str]:
    """The two targets as absolute paths, after checking that they may be written: not the same
    file, no folder, not a file in `protect` (whatever `replace` says), and, unless `replace`,
    not existing."""
    targets = (os.path.abspath(model_path), os.path.abspath(weights_path))
    if _same(*targets):
        raise DeepgenError(f"{model_path} is both the model file and the weights file to write; name another "
                           "--weights")
    for given, target, what in zip((model_path, weights_path), targets, ("model file", "weights file")):
        for kept in protect:
            if _same(target, os.path.abspath(kept)):
                raise DeepgenError(f"{given} (the {what} to write) is the PyTorch source the module comes from "
                                   f"({kept}): deepgen never writes over it, not even with --force; name another file")
        if os.path.isdir(target):
            raise DeepgenError(f"{given} (the {what} to write) is a folder; name a file")
        folder = os.path.dirname(target)
        while not os.path.lexists(folder):
            folder = os.path.dirname(folder)
        if not os.path.isdir(folder):
            raise DeepgenError(f"{given} (the {what} to write): {folder} is a file, not a folder")
        if not replace and os.path.lexists(target):
            raise DeepgenError(f"{given} (the {what} to write) exists; pass --force to replace it")
    return targets


def _same(a: str, b: str) -> bool:
    """a and b are one file (the same path, or a link to it), existing or not."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _missing_folders(targets) -> list[str]:
    """The folders above the targets that do not exist yet, outermost first."""
    missing = []
    for target in targets:
        folder = os.path.dirname(target)
        chain = []
        while folder and not os.path.exists(folder) and folder not in missing:
            chain.append(folder)
            parent = os.path.dirname(folder)
            if parent == folder:
                break
            folder = parent
        missing += reversed(chain)
    return missing


def _saved(path: str):
    """What is at path now, to put back: None (nothing), ("link", target) or ("file", bytes, mode)."""
    if os.path.islink(path):
        return ("link", os.readlink(path))
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return ("file", f.read(), os.stat(path).st_mode & 0o7777)


def _restore(path: str, before) -> None:
    """Put back what `_saved` recorded (best effort: the error that made us restore comes first)."""
    try:
        if before is None:
            os.unlink(path)
        elif before[0] == "file":
            write_atomic(path, before[1], before[2])
        else:
            temp = os.path.join(os.path.dirname(path), f"{TEMP_PREFIX}{os.getpid()}-link")
            os.symlink(before[1], temp)
            os.replace(temp, path)
    except OSError:
        pass


TORCH_KEYS = "meta/torch_state_dict_keys"
ONNX_NAMES = "meta/onnx_value_names"  # {statement or input name: the ONNX value it is}


class Weights(dict):
    """{parameter name: float32 array}, and `torch_keys`: {parameter name: the state_dict
    key(s) it holds} (a tied weight has several), which write_model keeps in the .npz."""

    def __init__(self, arrays: dict, torch_keys: dict):
        super().__init__(arrays)
        self.torch_keys = dict(torch_keys)


def keys_array(mapping: dict) -> np.ndarray:
    """{parameter name: [state_dict keys]} as the .npz member TORCH_KEYS: UTF-8 JSON in a
    uint8 array (a plain dtype every .npy reader takes; loaders skip `meta/` members)."""
    import json

    return np.frombuffer(json.dumps(mapping, sort_keys=True).encode("utf-8"), dtype=np.uint8).copy()


def torch_keys(weights, member: str = TORCH_KEYS) -> dict:
    """The {parameter name: [state_dict keys]} an import kept in its weights (a dict or an
    open .npz); {} when there is none. `member=ONNX_NAMES`: from_onnx's {statement or input
    name: ONNX value name} instead."""
    import json

    if member not in weights:
        return {}
    return json.loads(np.asarray(weights[member]).tobytes().decode("utf-8"))


def identifier(path: str) -> str:
    """A module path or state_dict key as an identifier: every character that is not a letter,
    digit or underscore becomes `_`; one starting with a digit gets `layer_` in front; one the
    DSL refuses (a keyword, a reserved name) gets `_layer` after."""
    base = re.sub(r"\W", "_", path, flags=re.ASCII)
    base = "layer_" + base if base[:1].isdigit() or not base else base
    return base + "_layer" if problem_with(base) else base


def _snake(text: str) -> str:
    """LSTMClassifier -> lstm_classifier."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", text).lower()


class Importer:
    """One import: the traced module, the statements written so far and the weights."""

    def __init__(self, module, name: str):
        self.module = module
        self.name = name
        self.em = Emitter(name)
        self.weights: dict[str, np.ndarray] = {}
        self.params: dict[str, Var] = {}  # parameter name -> its variable
        self._lengths: Var | None = None
        self.sizes: dict = {}  # symbolic dim -> its size in the example
        # Tied weights (`out.weight = emb.weight`): one tensor under several state_dict keys. It
        # becomes one parameter named after its first key (as module.parameters() lists it once).
        keys: dict[int, list[str]] = {}
        for key, tensor in [*module.named_parameters(remove_duplicate=False),
                            *module.named_buffers(remove_duplicate=False)]:
            keys.setdefault(id(tensor), []).append(key)
        self.tied = {k: v for k, v in keys.items() if len(v) > 1}  # id(tensor) -> its keys
        self.tie_uses: dict[str, list[str]] = {}  # first key -> the other keys read as it
        self.front = "torch.fx"  # the front end that traced the module (torch.export when fx cannot)
        self._bases: dict[str, str] = {}  # module path -> its name prefix
        self._paths: dict[str, str] = {}  # name prefix -> its module path
        self.torch_keys: dict[str, list[str]] = {}  # parameter name -> its state_dict key(s)
        self.traced = None  # torch.fx's GraphModule (it holds the constants fx made: `_tensor_constant0`)

    # -- helpers the converters use ---------------------------------------------------
    def fail(self, node, message: str) -> DeepgenError:
        return node_error(node, message)

    def kind(self, node) -> str:
        """`self.fc (nn.Linear)` or `torch.fft.fft`: the node as the user wrote it."""
        if node.op == "call_module":
            return f"{describe(node)} (nn.{type(self.module.get_submodule(node.target)).__name__})"
        return describe(node)

    def base(self, node_or_path) -> str:
        """The name prefix of a module's parameters: its path made an identifier (dots and any
        other character no identifier has as underscores: `block1.block1-0` -> `block1_block1_0`).
        Two paths that come out the same get numbered (`a_b`, `a_b_2`); a path always gets the
        name it got first."""
        path = node_or_path if isinstance(node_or_path, str) else node_or_path.target
        if path in self._bases:
            return self._bases[path]
        base = identifier(path)
        name, k = base, 1
        while name in self._paths or name in self.weights or self._prefix_clash(name, path):
            k += 1
            name = f"{base}_{k}"
        self._bases[path], self._paths[name] = name, path
        return name

    def _prefix_clash(self, name: str, path: str) -> bool:
        """Some stored weight named `name_...` belongs to a module other than `path`'s."""
        return any(w.startswith(name + "_") and not any(k == path or k.startswith(path + ".") for k in keys)
                   for w, keys in self.torch_keys.items())

    def param(self, path: str, key: str, tensor) -> Var:
        """The parameter `<path>_<key>` with the value of `tensor` (declared once); a tied
        tensor is one parameter, named after its first state_dict key."""
        dotted = f"{path}.{key}" if path else key
        keys = self.tied.get(id(tensor))
        if keys and dotted != keys[0]:
            uses = self.tie_uses.setdefault(keys[0], [])
            if dotted not in uses:
                uses.append(dotted)
                self.em.note(f"{dotted} is {keys[0]} (tied weights: one parameter, {self.key_name(keys[0])})")
        first = keys[0] if keys else dotted
        full = self.key_name(first)
        if full not in self.params:
            self._store(full, tensor, path, [first] + self.tie_uses.get(first, []))
            var = self.em.fresh(full)
            self.em.statement(f'{var} = dg.param("{full}", {code(tuple(tensor.shape))})')
            self.params[full] = self.em.var(var)
        elif keys:
            self.torch_keys[full] = [first] + self.tie_uses.get(first, [])
        return self.params[full]

    def key_name(self, dotted: str) -> str:
        """The parameter name of the state_dict key `dotted` (`fc.weight` -> `fc_weight`)."""
        path, _, key = dotted.rpartition(".")
        name = self.base(key) if not path else f"{self.base(path)}_{identifier(key)}"
        given, k = name, 1
        while name in self.torch_keys and dotted not in self.torch_keys[name]:  # another module's weight
            k += 1
            name = f"{given}_{k}"
        return name

    def layer(self, node, module) -> str:
        """The name of the layer helper for `node`'s module, its weights stored."""
        base = self.base(node)
        self.take_state(base, module, node, node.target)
        return base

    def take_state(self, base: str, module, node=None, path: str | None = None):
        """The weights of a layer helper named `base`: its state_dict, keys prefixed. The helper
        declares its own parameters, so a weight of it tied to another module's is an error."""
        for key, tensor in [*module.named_parameters(remove_duplicate=False),
                            *module.named_buffers(remove_duplicate=False)]:
            keys = self.tied.get(id(tensor), ())
            others = [k for k in keys if self._owner(k) is not self._owner_of(module, key)]
            if others:
                mine = next(k for k in keys if k not in others)
                message = (f"self.{mine} is the same tensor as self.{others[0]} (tied weights); deepgen ties "
                           f"weights of Linear, Embedding, LayerNorm, MultiheadAttention and bare parameters, "
                           f"not of {type(self._owner(mine)).__name__}, and never imports them untied")
                raise self.fail(node, message) if node is not None else DeepgenError(message)
        prefix = f"{path}." if path else f"{base}."
        for key, tensor in module.state_dict().items():
            if not key.endswith("num_batches_tracked"):
                self._store(f"{base}_{key.replace('.', '_')}", tensor, base, [prefix + key])

    def _owner(self, key: str):
        """The module that holds the parameter or buffer `key` (a state_dict key)."""
        return self.module.get_submodule(key.rpartition(".")[0])

    def _owner_of(self, module, key: str):
        """The module that holds `key` of `module` (a name relative to it)."""
        return module.get_submodule(key.rpartition(".")[0])

    def _store(self, full: str, tensor, path: str, keys: list[str]):
        if full in self.weights:
            raise DeepgenError(f"parameter name {full!r} (of self.{path}) is used twice: a layer module called "
                               "more than once, or two module paths that differ only in '.' and '_'")
        self.weights[full] = tensor.detach().cpu().numpy().astype(np.float32)
        self.torch_keys[full] = list(keys)

    def lengths(self) -> Var:
        """The int64 [N] input of sequence lengths that dg.lstm / dg.gru take."""
        if self._lengths is None:
            self._lengths = self.em.declare_input("lengths", (self.em.dim("N"),), "int64")
        return self._lengths

    # -- the walk -------------------------------------------------------------------
    def run(self, example_inputs, dims: dict):
        try:
            gm = trace(self.module)
        except DeepgenError as fx_error:
            return self._run_export(example_inputs, dims, fx_error)
        self.traced = gm
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        examples = self._examples(placeholders, example_inputs)
        self._propagate(gm, placeholders, examples)
        env, outputs, site = {}, None, None
        with self.em:
            for node in gm.graph.nodes:
                here = source_site(node)
                if here and here != site:
                    site = here
                    self.em.comment(f"{os.path.basename(here[0])}:{here[1]}: {here[2]}")
                args, kwargs = self._resolve(node, node.args, env), self._resolve(node, node.kwargs, env)
                self.em.scope = scope_of(node)
                try:
                    if node.op == "placeholder":
                        env[node] = self._input(node, examples, dims)
                    elif node.op == "get_attr":
                        env[node] = self._attribute(node)
                    elif node.op == "call_module":
                        env[node] = convert_module(self, node, gm.get_submodule(node.target), args, kwargs)
                    elif node.op in ("call_function", "call_method"):
                        env[node] = convert_call(self, node, args, kwargs)
                    elif node.op == "output":
                        outputs = self._outputs(node, args[0])
                except StatementError as e:  # e.g. an example input of another rank than forward reads
                    raise node_error(node, f"{describe(node)}, imported as `{e.statement}`, does not check with "
                                           f"the example inputs' shapes: {e}") from None
                self._check_shape(node, env.get(node))
        source = self._render(outputs)
        self._validate(source)
        return source, Weights(self.weights, self.torch_keys)

    def _run_export(self, example_inputs, dims: dict, fx_error):
        """The torch.export front end (export.py), for modules torch.fx cannot trace."""
        import inspect
        import types

        import torch

        from .export import ExportWalk, export

        names = [n for n, p in inspect.signature(self.module.forward).parameters.items()
                 if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        placeholders = [types.SimpleNamespace(target=n, args=()) for n in names]
        given = self._examples(placeholders, example_inputs, require=False)
        self.front = "torch.export"
        named_dims = {}
        with self.em:
            inputs = {}
            for name in names:
                if name in given:
                    example = given[name]
                    dtype = _DTYPES.get(str(example.dtype), "float32")
                    named_dims[name] = dims.get(name, self._default_dims(example, dtype))
                    inputs[name] = self._input(types.SimpleNamespace(target=name, args=()), given, dims)
            ep = export(self.module, (), given, named_dims, fx_error)
            walk = ExportWalk(self, ep, given, inputs)
            results = walk.run()
        with torch.no_grad():
            eager = self.module(**given)
        if isinstance(eager, dict):
            keys = [k for k, v in eager.items() if torch.is_tensor(v)]
        elif isinstance(eager, (tuple, list)):
            keys = [f"output{i}" for i in range(len(eager))]
        else:
            keys = ["output"]
        if len(keys) != len(results):
            raise DeepgenError(f"internal: {len(results)} exported outputs for {len(keys)} of {type(self.module).__name__}")
        outputs = {}
        for key, value in zip(keys, results):
            if not isinstance(value, Var):
                raise DeepgenError(f"output {key!r} of {type(self.module).__name__} is not computed from its inputs' "
                                   "float values (deepgen models return tensors they compute)")
            outputs[key] = value
        source = self._render(outputs)
        self._validate(source)
        return source, Weights(self.weights, self.torch_keys)

    def _examples(self, placeholders, example_inputs, require: bool = True) -> dict:
        import torch

        names = [p.target for p in placeholders]
        if isinstance(example_inputs, dict):
            unknown = sorted(set(example_inputs) - set(names))
            if unknown:
                raise DeepgenError(f"example input(s) {', '.join(unknown)} are not arguments of "
                                   f"{type(self.module).__name__}.forward ({', '.join(names)})")
            given = dict(example_inputs)
        else:
            items = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
            if len(items) > len(names):
                raise DeepgenError(f"{len(items)} example inputs for forward({', '.join(names)})")
            given = dict(zip(names, items))
        for p in placeholders:
            if require and p.target not in given and not p.args:
                raise DeepgenError(f"no example input for argument {p.target!r} of {type(self.module).__name__}.forward")
        return {k: torch.as_tensor(v) for k, v in given.items()}

    def _propagate(self, gm, placeholders, examples):
        """PyTorch's own shapes per node (fx ShapeProp), to check each translated node against."""
        import torch
        from torch.fx.passes.shape_prop import ShapeProp

        args = [examples.get(p.target, p.args[0] if p.args else None) for p in placeholders]
        printed = io.StringIO()  # ShapeProp prints the traceback of a failing node itself
        try:
            with torch.no_grad(), contextlib.redirect_stderr(printed):
                ShapeProp(gm).propagate(*args)
        except Exception as e:
            cause = e  # ShapeProp wraps the module's own error (a shape mismatch, say) in one of its own
            while cause.__cause__ is not None:
                cause = cause.__cause__
            named = re.search(r"node=%(\w+)", str(e))
            node = next((n for n in gm.graph.nodes if named and n.name == named.group(1)), None)
            message = (f"running {type(self.module).__name__} on the example inputs failed"
                       f"{f' in {describe(node)}' if node is not None else ''}: {type(cause).__name__}: "
                       f"{str(cause).strip()}")
            raise (node_error(node, message) if node is not None else DeepgenError(message)) from None

    def _input(self, node, examples, dims):
        if node.target not in examples:
            return node.args[0]  # an argument left at its default (None, a flag)
        example = examples[node.target]
        dtype = _DTYPES.get(str(example.dtype))
        if dtype is None:
            raise DeepgenError(f"example input {node.target!r} has dtype {example.dtype}; deepgen inputs are "
                               f"float32, int32 or int64")
        names = dims.get(node.target, self._default_dims(example, dtype))
        if len(names) != example.dim():
            raise DeepgenError(f"dims for input {node.target!r}: {names} has {len(names)} entries, the example "
                               f"has {example.dim()} axes")
        shape = []
        for d, n in zip(example.shape, names):
            if n is None:
                shape.append(int(d))
                continue
            symbol = self.em.dim(n)
            if self.sizes.setdefault(symbol, int(d)) != int(d):
                raise DeepgenError(f"example input {node.target!r} has {n} = {int(d)}, another input has "
                                   f"{n} = {self.sizes[symbol]}")
            shape.append(symbol)
        return self.em.declare_input(node.target, shape, dtype)

    def _default_dims(self, example, dtype):
        from torch import nn

        kinds = tuple(getattr(nn, k) for k in _SEQUENCE_MODULES)  # (subclasses too: BART's embeddings)
        sequences = any(isinstance(m, kinds) for m in self.module.modules())
        rank = example.dim()
        names = [None] * rank
        if rank >= 1:
            names[0] = "N"
        if sequences and rank == (3 if dtype == "float32" else 2):
            names[1] = "T"
        return tuple(names)

    def _attribute(self, node):
        import torch

        value = self.module.get_parameter(node.target) if _has(self.module.get_parameter, node.target) else None
        if isinstance(value, torch.nn.Parameter):
            path, _, key = node.target.rpartition(".")
            return self.param(path, key, value)
        # A buffer, or a constant fx made of one (`_tensor_constant0`, an attribute of the traced module).
        tensor = (self.module.get_buffer(node.target) if _has(self.module.get_buffer, node.target)
                  else getattr(self.traced, node.target, None))
        if torch.is_tensor(tensor):
            table = constant_buffer(self, node, tensor)
            if table is not None:
                return table
        raise self.fail(node, f"self.{node.target} is a buffer or constant tensor; deepgen imports parameters, "
                              "the buffers of BatchNorm and window attention's index and coordinate tables only")

    def _resolve(self, node, value, env):
        """fx arguments with earlier nodes replaced by what they became."""
        import torch.fx

        if isinstance(value, torch.fx.Node):
            value = env[value]
            if isinstance(value, Unusable):
                raise self.fail(node, f"{value.what} are not computed by deepgen")
            return value
        if isinstance(value, (tuple, list)):
            return type(value)(self._resolve(node, v, env) for v in value)
        if isinstance(value, dict):
            return {k: self._resolve(node, v, env) for k, v in value.items()}
        if isinstance(value, slice):
            return slice(*(self._resolve(node, v, env) for v in (value.start, value.stop, value.step)))
        return value

    def _outputs(self, node, result) -> dict:
        if isinstance(result, dict):
            outputs = {str(k): v for k, v in result.items()}
        elif isinstance(result, (tuple, list)):
            outputs = {f"output{i}": v for i, v in enumerate(result)}
        else:
            outputs = {"output": result}
        for key, value in outputs.items():
            if not isinstance(value, Var):
                raise self.fail(node, f"forward returns {value!r} as {key!r}; deepgen models return tensors")
            if problem_with(key):
                raise self.fail(node, f"output name: {problem_with(key)}")
        return outputs

    def _check_shape(self, node, value):
        """The translation of `node` has PyTorch's shape at the example sizes."""
        meta = node.meta.get("tensor_meta")
        if not isinstance(value, Var) or meta is None or not hasattr(meta, "shape"):
            return
        ours = evaluate(value.tensor.shape, self.sizes)
        if tuple(ours) != tuple(meta.shape):
            raise self.fail(node, f"deepgen's translation of {self.kind(node)} has shape {tuple(ours)} at the "
                                  f"example sizes, PyTorch's has {tuple(meta.shape)} (a deepgen importer bug, or "
                                  "a size the module reads from its input: pass dims=)")

    # -- the file ---------------------------------------------------------------------
    def _render(self, outputs: dict) -> str:
        em = self.em
        cls = type(self.module).__name__
        lines = [f'"""{cls} imported from PyTorch by `deepgen from-torch` ({self.front}).', "",
                 "Parameters are named after the module's state_dict keys, dots as underscores",
                 "(`fc.weight` -> `fc_weight`). Load the weights the importer wrote (the .npz) and",
                 "switch to eval mode, as the module was traced (batch norm, dropout):",
                 f"`model = {self.name}.Model(); model.load(path); model.eval()`."]
        if self._lengths is not None:
            lines += ["", f"`{self._lengths.name}` (int64 [N], each in [1, T]): the length of each sequence; give T",
                      "for all of them to run the layers on the whole padded batch, as PyTorch does."]
        if self.tie_uses:
            lines += ["", "Tied weights are one parameter, named after the first state_dict key (the .npz holds",
                      "one array for it; PyTorch's state_dict lists it under each key):"]
            lines += [f"`{', '.join(others)}` {'is' if len(others) == 1 else 'are'} `{first}` "
                      f"(`{self.key_name(first)}`)." for first, others in self.tie_uses.items()]
        return model_file(lines, em, self.name, outputs, module=self.module)

    def _validate(self, source: str):
        validate_model_file(source, self.name, self.weights, "from-torch")


def _has(get, target) -> bool:
    try:
        get(target)
        return True
    except AttributeError:
        return False
