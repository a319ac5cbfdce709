"""Emission: ProjectPlan + templates + runtime headers -> a formatted project folder.

Output is byte-for-byte deterministic: no timestamps, no absolute paths, sorted
where order would otherwise vary; C++ is formatted with clang-format, Python
with black. A manifest records what was generated, so regenerating never
silently overwrites a file the user edited.
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
from pathlib import Path

import black
import jinja2
import numpy as np

from ..errors import DeepgenError
from ..reference import init_params, run, train_step
from ..resources import resource_dir
from ..samples import sample_dims, sample_inputs
from ..shapes import evaluate
from .lower import lower
from .targets import load_target

MANIFEST = ".deepgen/manifest.json"


def _environment(target) -> jinja2.Environment:
    return jinja2.Environment(
        # A target's template folders are searched in order: it overrides only what differs.
        loader=jinja2.ChoiceLoader(
            [jinja2.FileSystemLoader(str(resource_dir("templates") / d)) for d in target.template_dirs]
        ),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def _clang_format(text: str, filename: str) -> str:
    import clang_format

    style = resource_dir("templates") / "project" / "clang-format"
    exe = clang_format.get_executable("clang-format")
    proc = subprocess.run(
        [exe, f"--style=file:{style}", f"--assume-filename={filename}"],
        input=text.encode(),
        capture_output=True,
    )
    if proc.returncode != 0:
        raise DeepgenError(f"clang-format failed on {filename}: {proc.stderr.decode()}")
    return proc.stdout.decode()


def _extras(plan, graph):
    """Example inputs for the README and examples/main.cpp: zeros for float inputs,
    and for integer inputs (ids, labels, trees) the valid sample values."""
    samples = sample_inputs(graph)
    dims = dict(sample_dims(graph))
    for v in graph.inputs:
        for d, size in zip(v.shape, samples[v.name].shape):
            if not isinstance(d, int):
                dims[d] = size
    example = []
    forward_names = {i.name for i in plan.inputs}
    for v in [v for v in graph.inputs if v.name in forward_names]:
        shape = evaluate(v.shape, dims)
        dims_text = ", ".join(f"{d}={dims[d]}" for d in graph.dims if d in getattr(v, "shape", ())) or "fixed sizes"
        values = "" if v.dtype == "float32" else ", ".join(str(int(x)) for x in samples[v.name].reshape(-1))
        example.append(
            {"name": v.name, "ctype": plan.all_inputs[graph.inputs.index(v)].ctype, "size": int(np.prod(shape)),
             "shape": ", ".join(map(str, shape)), "declared": plan.all_inputs[graph.inputs.index(v)].declared,
             "dims": dims_text, "data": values}
        )
    count = sum(int(np.prod(p.shape)) for p in graph.params)

    def call(values):
        return ", ".join(
            f"{v.name}=np.zeros(({', '.join(map(str, evaluate(v.shape, dims)))}{',' if v.rank == 1 else ''}), "
            f"np.{v.dtype})"
            for v in values
        )

    plan.extra.update(param_count=f"{count:,}", param_bytes=f"{4 * count:,}")
    plan.example_inputs = example
    plan.example_call = call([v for v in graph.inputs if v.name in forward_names])
    plan.example_train_call = call(graph.inputs)


def _expected_npz(graph) -> bytes:
    """Reference outputs for deterministic inputs and the seed-0 parameters (and,
    for a trainable model, the loss of one train_step and the outputs after it)."""
    inputs = sample_inputs(graph)
    params = init_params(graph, seed=0)
    outputs = run(graph, inputs, params)
    arrays = {f"input/{k}": v for k, v in inputs.items()}
    arrays.update({f"output/{k}": np.asarray(v) for k, v in outputs.items()})
    if graph.train is not None:
        arrays["train/loss"] = np.float32(train_step(graph, inputs, params, {}, step=1))
        arrays.update({f"train/output/{k}": np.asarray(v) for k, v in run(graph, inputs, params).items()})
    buf = io.BytesIO()
    np.savez(buf, **arrays)  # zip entries carry a fixed 1980 date: deterministic
    return buf.getvalue()


def prepare(graph, opt: str = "O2", report=None):
    """The pass pipeline before lowering: optimize the forward graph, add the
    backward pass (for a trainable model), and optimize again."""
    from ..autodiff import prepare_training
    from ..passes import optimize

    optimize(graph, opt, report=report)
    if graph.train is not None and not graph.train.prepared:
        prepare_training(graph)
        optimize(graph, opt, report=report)
    return graph


def render(graph, target_name: str = "cpu", opt: str = "O2", report=None) -> dict:
    """All files of the generated project: {relative path: bytes}."""
    target = load_target(target_name)
    prepare(graph, opt, report)
    plan = lower(graph, target)
    _extras(plan, graph)
    from ..memory_report import report

    plan.extra["memory_report"] = report(graph, plan, batch=32)
    env = _environment(target)
    name = plan.name
    cpp = {
        f"include/{name}/model.h": "model.h.j2",
        f"src/model{target.model_ext}": "model.cpp.j2",
        "src/kernels.h": "kernels.h.j2",
        f"src/kernels{target.kernel_ext}": "kernels.cpp.j2",
        "src/bindings.cpp": "bindings.cpp.j2",
        "examples/main.cpp": "example_main.cpp.j2",
    }
    files = {}
    for path, template in cpp.items():
        files[path] = _clang_format(env.get_template(template).render(p=plan), path).encode()
    test = env.get_template("test_model.py.j2").render(p=plan)
    files["tests/test_model.py"] = black.format_str(test, mode=black.Mode(line_length=110)).encode()
    files["tests/expected.npz"] = _expected_npz(graph)
    for path, template in {"CMakeLists.txt": "CMakeLists.txt.j2", "pyproject.toml": "pyproject.toml.j2",
                           "README.md": "README.md.j2"}.items():
        files[path] = env.get_template(template).render(p=plan).encode()
    files[".clang-format"] = (resource_dir("templates") / "project" / "clang-format").read_bytes()
    files[".gitignore"] = (resource_dir("templates") / "project" / "gitignore").read_bytes()
    for header, source in target.runtime_sources().items():
        files[f"runtime/{header}"] = source.read_bytes()
    return dict(sorted(files.items()))


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_project(out_dir, files: dict, force: bool = False) -> list:
    """Write `files` under out_dir. Refuses to overwrite files changed since the
    last generation (or a folder deepgen did not make) unless force is set."""
    root = Path(out_dir).resolve()
    manifest_path = root / MANIFEST
    old = {}
    if manifest_path.is_file():
        old = json.loads(manifest_path.read_text()).get("files", {})
    elif root.exists() and any(root.iterdir()) and not force:
        raise DeepgenError(f"{out_dir} exists and was not made by deepgen; choose another folder or pass --force")
    if not force:
        edited = [p for p, digest in old.items() if (root / p).is_file() and _digest((root / p).read_bytes()) != digest]
        if edited:
            raise DeepgenError(
                f"these generated files in {out_dir} were edited since generation: {', '.join(sorted(edited))}; "
                "regenerating would lose the edits (pass --force to overwrite, or generate into another folder)"
            )
    written = []
    for rel, data in files.items():
        path = (root / rel).resolve()
        if root not in path.parents:
            raise DeepgenError(f"refusing to write {rel}: outside {out_dir}")
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_file() or path.read_bytes() != data:
            path.write_bytes(data)
        written.append(path)
    for rel in sorted(set(old) - set(files)):  # generated before, not any more
        stale = root / rel
        if stale.is_file():
            stale.unlink()
    manifest_path.parent.mkdir(parents=True, exist_ok=True)
    manifest = {"generator": "deepgen", "files": {rel: _digest(data) for rel, data in files.items()}}
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return written


def generate(graph, out_dir, target: str = "cpu", force: bool = False, opt: str = "O2", report=None) -> list:
    return write_project(out_dir, render(graph, target, opt, report), force)
