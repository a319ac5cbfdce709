"""`deepgen compare`: where does an imported model stop agreeing with PyTorch (or ONNX)?

    deepgen compare MODEL.py --weights W.npz --torch FILE.py:FACTORY --example-input x=1,3,64,64

The model is generated a second time as a debug project in which every DSL
statement's value is an output too (`keep_values`: a generation option of the
project, off in a normal `generate`, so it costs nothing there), built, loaded
with the weights and run in evaluation mode. PyTorch runs the factory's module
on the same inputs with a forward hook on every submodule. Each statement named
after a module path (`layer2_0_conv1` for `layer2.0.conv1`; a module called
again gives `..._1`, `..._2` as the importer names them) is compared with that
module's output, in the order the statements run; the table shows the largest
error per layer and the first statement past the tolerance is named with its
line in the model file.

    deepgen compare MODEL.py --weights W.npz --onnx FILE.onnx --example-input x=1,3,64,64

compares a model `deepgen from-onnx` wrote with onnxruntime running the ONNX file
(optional: imported only here): the import recorded which ONNX value each statement
computes (`meta/onnx_value_names` in the .npz), and those values are added to the
graph's outputs. Integer example inputs are ones there (no PyTorch is needed).
"""

from __future__ import annotations

import ast
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import DeepgenError
from ..frontend.loader import load_model
from ..frontend.source import assigned_names
from ..importers.onnx_import import load
from ..importers.torch_cli import _DTYPES, _shape, _short, example_inputs, load_factory
from ..importers.torch_import import ONNX_NAMES, torch_keys
from ..ir.names import safe_identifier
from ..pipeline import generate
from .build import cmake_build


def statement_names(model_file: str) -> set:
    """The names the model file assigns to (its statements' variables)."""
    path = model_file.rpartition(":")[0] if model_file.count(":") and not os.path.exists(model_file) else model_file
    try:
        tree = ast.parse(Path(path).read_text(), path)
    except (OSError, SyntaxError) as e:
        raise DeepgenError(f"{path}: cannot read the model file ({e})") from None
    names = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            for leaf in ast.walk(target):
                if isinstance(leaf, ast.Name):
                    names.add(leaf.id)
    return names


def name_block_values(graph) -> set:
    """Rename each statement value made inside a function that the model file calls with
    `name="<prefix>"` to `<prefix>_<variable>`: from-torch writes each instance of a repeated
    module class as such a call (`layer1_1 = bottleneck(layer1_0, ..., name="layer1_1")`), and
    `relu_1` inside it is then `layer1_1_relu_1`, the name compare matches to the second call
    of module `layer1.1.relu`. A name another value has already is left alone. Returns the
    names so made (a layer's value named `f"{name}_conv1"` has its name already)."""

    last = {}  # each call's statements: the last node (the statement's value)
    for node in graph.nodes:
        loc = node.loc
        if loc is not None and loc.call is not None:
            last[loc.filename, loc.stmt_line, loc.call.line, loc.call_id] = node
    taken = {v.name for v in graph.values()}
    trees: dict = {}
    renamed = set()
    for node in last.values():
        prefix = _call_name(node.loc, trees)
        targets = assigned_names(node.loc) or []
        pairs = zip(node.outputs, targets) if len(targets) == len(node.outputs) else \
            zip(node.outputs[:1], targets[:1])
        for value, target in pairs:
            name = f"{prefix}_{target}" if prefix else None
            if name and name != value.name and name not in taken and graph.names.claim(name):
                taken.add(name)
                value.name = name
            if name == value.name:
                renamed.add(name)
    return renamed


def _call_name(loc, trees: dict):
    """The `name=` string of the call at loc.call of the function that holds loc, or None."""
    for path in (loc.filename, loc.call.filename):
        if path not in trees:
            try:
                trees[path] = ast.parse(Path(path).read_text())
            except (OSError, SyntaxError, ValueError):
                trees[path] = None
    if trees[loc.filename] is None or trees[loc.call.filename] is None:
        return None
    functions = [f for f in ast.walk(trees[loc.filename]) if isinstance(f, ast.FunctionDef)
                 and f.lineno <= loc.line <= (f.end_lineno or f.lineno)]
    if not functions:
        return None
    function = max(functions, key=lambda f: f.lineno).name
    for call in ast.walk(trees[loc.call.filename]):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == function \
                and call.lineno <= loc.call.line <= (call.end_lineno or call.lineno):
            for kw in call.keywords:
                if kw.arg == "name" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
                    return kw.value.value
    return None


def keep_values(graph, names) -> dict:
    """Make each float value of graph named in `names` an output as well (a debug
    generation: every statement's value comes back from forward()); {statement name:
    the output that returns it}, in schedule order (a value that already was an
    output keeps its output's name)."""
    taken = {name for name, _ in graph.outputs}
    returned = {id(value): name for name, value in graph.outputs}
    kept = {}
    for node in graph.nodes:
        for value in node.outputs:
            if value.name not in names or value.dtype != "float32":
                continue
            if id(value) in returned:
                kept[value.name] = returned[id(value)]
            elif value.name not in taken:
                graph.outputs.append((value.name, value))
                taken.add(value.name)
                returned[id(value)] = kept[value.name] = value.name
    return kept


@dataclass
class Row:
    statement: str
    module: str
    where: str
    max_abs: float
    rel: float
    note: str = ""


def _identifier(path: str) -> str:

    return safe_identifier(path.replace(".", "_"))


def torch_values(module, examples: dict) -> dict:
    """{statement name: output array} from forward hooks on every submodule of module,
    named as the importer names a module's call (k-th call of a module: `_k`)."""
    import torch

    calls, hooks = {}, []

    def hook(path):
        def record(_, __, output):
            if isinstance(output, torch.Tensor):
                calls.setdefault(path, []).append(output.detach().float().numpy().copy())
        return record

    for path, sub in module.named_modules():
        if path:
            hooks.append(sub.register_forward_hook(hook(path)))
    try:
        with torch.no_grad():
            final = module(**examples)
    finally:
        for h in hooks:
            h.remove()
    values = {}
    for path, outputs in calls.items():
        base = _identifier(path)
        for k, out in enumerate(outputs):
            values[(base if k == 0 else f"{base}_{k}", path)] = out
    return values, final


def example_arrays(items) -> dict:
    """{name: numpy array} from NAME=SHAPE[:dtype] items without PyTorch (compare --onnx):
    floats drawn from a seeded normal, integers ones (ids valid for any vocabulary, attention
    masks that keep every position)."""

    rng = np.random.default_rng(0)
    arrays = {}
    for item in items or []:
        name, sep, rest = item.partition("=")
        shape_text, _, dtype = rest.partition(":")
        dtype = dtype or "float32"
        if not sep or not name.isidentifier() or dtype not in _DTYPES or not shape_text or name in arrays:
            raise DeepgenError(f"--example-input {_short(item)}: expected NAME=SHAPE[:dtype] once per input, e.g. "
                               f"x=4,784 (dtype one of {', '.join(_DTYPES)})")
        shape, _ = _shape(item, shape_text)
        arrays[name] = (rng.standard_normal(shape).astype(np.float32) if dtype == "float32"
                        else np.ones(shape, dtype=dtype))
    return arrays


def _onnxruntime():
    """The onnxruntime module, or a one-line error saying how to install it (it is optional)."""
    try:
        import onnxruntime
    except ImportError:
        raise DeepgenError("deepgen compare --onnx needs onnxruntime (pip install onnxruntime)") from None
    return onnxruntime


def onnx_values(onnx_file: str, names: dict, inputs: dict, wanted) -> tuple[dict, list]:
    """({(statement, ONNX value name): array}, the graph's outputs) from onnxruntime running
    onnx_file with the values of the statements in `wanted` (float32 values) added as graph
    outputs; `names`: {statement or input of the written file: ONNX value name}, as from_onnx
    recorded it. Graph optimizations off, so each value is its node's own result."""
    onnxruntime = _onnxruntime()
    from onnx import TensorProto, helper


    model = load(onnx_file)
    graph_inputs = [i.name for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
    by_onnx = {v: k for k, v in names.items()}
    feeds = {}
    for name in graph_inputs:
        ours = by_onnx.get(name, name)
        if ours not in inputs:
            raise DeepgenError(f"--example-input: the ONNX input {name!r} (`{ours}` in the model file) has no example")
        feeds[name] = inputs[ours]
    outputs = [o.name for o in model.graph.output]
    values = [v for v in dict.fromkeys(names[k] for k in wanted if k in names) if v not in graph_inputs]
    for value in values:
        if value not in outputs:
            model.graph.output.append(helper.make_tensor_value_info(value, TensorProto.FLOAT, None))
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        results = session.run(values, feeds)
    except Exception as e:  # onnxruntime's own errors (an input of the wrong shape): its first line
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise DeepgenError(f"onnxruntime cannot run {onnx_file} on the example inputs: {first}") from None
    theirs = {(by_onnx[v], v): np.asarray(r, dtype=np.float32) for v, r in zip(values, results)}
    return theirs, outputs


_MASKED = float(np.finfo(np.float32).min) / 2  # at or below it on both sides: a masked position


def compare_rows(graph, ours: dict, theirs: dict, tolerance: float) -> list:
    """A Row per statement both sides have, in schedule order."""
    by_name = {name: (name_path, out) for (name, name_path), out in theirs.items()}
    locs = {v.name: n.loc for n in graph.nodes for v in n.outputs}
    rows = []
    for name, got in ours.items():
        if name not in by_name:
            continue
        path, want = by_name[name]
        where = str(locs.get(name) or "")
        if tuple(got.shape) != tuple(want.shape):
            if got.size == want.size:
                got = got.reshape(want.shape)
            else:
                rows.append(Row(name, path, where, float("inf"), float("inf"),
                                f"shape {list(got.shape)} vs the reference's {list(want.shape)}"))
                continue
        got, want = got.astype(np.float64), want.astype(np.float64)
        # Masked attention scores: -inf here, the lowest float32 (or -inf) there; equal, and
        # not part of the scale.
        masked = (got <= _MASKED) & (want <= _MASKED)
        got, want = np.where(masked, 0.0, got), np.where(masked, 0.0, want)
        diff = np.abs(got - want)
        max_abs = float(diff.max()) if diff.size else 0.0
        scale = float(np.abs(want).max()) if want.size else 0.0
        rows.append(Row(name, path, where, max_abs, max_abs / max(scale, 1e-12)))
    return rows


def first_difference(rows: list, tolerance: float):
    for row in rows:
        if not row.rel <= tolerance:
            return row
    return None


def build_debug(graph, build_dir: Path):
    """Generate and build the debug project for graph in build_dir; its module."""
    import importlib


    src, build = build_dir / "src", build_dir / "build"
    generate(graph, src, force=True)
    cmake_build(src, build)
    sys.path.insert(0, str(build))
    try:
        sys.modules.pop(graph.name, None)
        return importlib.import_module(graph.name)
    finally:
        sys.path.remove(str(build))


def run_compare(model_file: str, weights: str, factory: str | None, example_items, tolerance: float = 1e-4,
                build_dir: str | None = None, echo=print, onnx_file: str | None = None) -> Row | None:
    """The whole `deepgen compare`; returns the first differing Row (None: all agree). The
    reference is the PyTorch module `factory` makes, or onnxruntime running `onnx_file`."""

    if not Path(weights).is_file():
        raise DeepgenError(f"--weights {weights}: no such file")
    if onnx_file is not None:
        _onnxruntime()  # (before the debug build, not after it)
        with np.load(weights) as stored:
            names = torch_keys(stored, ONNX_NAMES)
        if not names:
            raise DeepgenError(f"--weights {weights} holds no {ONNX_NAMES} (the ONNX value each statement computes): "
                               "compare --onnx needs the weights `deepgen from-onnx` wrote")
        inputs = example_arrays(example_items)
    else:
        module = load_factory(factory)
        examples, _ = example_inputs(example_items)
        inputs = {name: t.numpy() for name, t in examples.items()}
    model = load_model(model_file)
    graph = model.build(f"{model.name}_compare")
    kept = keep_values(graph, statement_names(model_file) | name_block_values(graph))
    missing = [v.name for v in graph.inputs if v.name not in inputs]
    if missing:
        raise DeepgenError(f"--example-input: the model's input(s) {', '.join(missing)} have no example")
    echo(f"building {graph.name} with {len(kept)} statement values kept as outputs ...")
    with tempfile.TemporaryDirectory(prefix="deepgen-compare-") as tmp:
        folder = Path(build_dir) if build_dir else Path(tmp)
        generated = build_debug(graph, folder)
        m = generated.Model()
        m.load(weights)
        if hasattr(m, "eval"):
            m.eval()
        ours = m.forward(**{v.name: inputs[v.name] for v in graph.inputs})
    ours = {name: ours[output] for name, output in kept.items() if output in ours}
    if onnx_file is not None:
        theirs, _ = onnx_values(onnx_file, names, inputs, ours)
        against, column = "onnxruntime", "ONNX value"
    else:
        theirs, _ = torch_values(module, examples)
        against, column = "PyTorch", "module"
    rows = compare_rows(graph, ours, theirs, tolerance)
    if not rows:
        raise DeepgenError(f"no statement of the model is named after a {column} of the reference: compare needs a "
                           f"model file written by `deepgen from-{'onnx' if onnx_file else 'torch'}` (or named like one)")
    width = max(len(r.statement) for r in rows)
    echo(f"{'statement':<{width}}  {'max abs error':>13}  {'relative':>9}  {column}")
    first = first_difference(rows, tolerance)
    for row in rows:
        mark = "  <- first difference" if row is first else ""
        echo(f"{row.statement:<{width}}  {row.max_abs:>13.3g}  {row.rel:>9.2g}  {row.module}{mark}"
             + (f" ({row.note})" if row.note else ""))
    if first is None:
        echo(f"all {len(rows)} compared statements agree with {against} within {tolerance:g} (relative)")
    else:
        echo(f"first difference: {first.statement} ({first.where}), {column} {first.module}: max error "
             f"{first.max_abs:.3g}, relative {first.rel:.3g} > {tolerance:g}")
    return first
