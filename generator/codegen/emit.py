"""Emission, stage `render`: ProjectPlan + templates + runtime headers ->
{path: bytes}, pure. Only the runtime headers the project's code uses are
included and copied (codegen/runtime_headers.py). (The last stage, `write`, is
codegen/writer.py: those files -> the project folder, merged with the user's edits.)

Output is byte-for-byte deterministic: no timestamps, no absolute paths, sorted
where order would otherwise vary; C++ is formatted with clang-format, Python
with black.
"""

from __future__ import annotations

import subprocess

import black
import clang_format
import jinja2

from ..errors import DeepgenError
from ..resources import resource_dir
from .runtime_headers import RuntimeHeaders


def _environment(target) -> jinja2.Environment:
    return jinja2.Environment(
        # A target's template folders are searched in order: it overrides only what differs.
        # The templates root comes last, so a target's template can extend a shared one
        # by its folder: {% extends "project/bindings.cpp.j2" %}.
        loader=jinja2.ChoiceLoader(
            [jinja2.FileSystemLoader(str(resource_dir("templates") / d)) for d in target.template_dirs]
            + [jinja2.FileSystemLoader(str(resource_dir("templates")))]
        ),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def clang_format_cpp(text: str, filename: str) -> str:
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


def render(plan, target) -> dict:
    """Stage `render`: all files of the generated project, {relative path: bytes},
    from the plan (lowered, memory-planned and recorded) alone."""
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
    runtime = RuntimeHeaders(target.runtime_sources())
    for path, template in cpp.items():
        text = env.get_template(template).render(p=plan, target=target.names, includes=())
        includes = runtime.missing(text)
        if includes:  # again, with the runtime headers its code uses
            text = env.get_template(template).render(p=plan, target=target.names, includes=includes)
        files[path] = clang_format_cpp(text, path).encode()
    test = env.get_template("test_model.py.j2").render(p=plan, target=target.names)
    files["tests/test_model.py"] = black.format_str(test, mode=black.Mode(line_length=110)).encode()
    stub = env.get_template("module.pyi.j2").render(p=plan, target=target.names)  # for editors (CMake installs it)
    files[f"{name}.pyi"] = black.format_str(stub, mode=black.Mode(line_length=110, is_pyi=True)).encode()
    if plan.recording.expected_npz is not None:
        files["tests/expected.npz"] = plan.recording.expected_npz
    for path, template in {"CMakeLists.txt": "CMakeLists.txt.j2", "pyproject.toml": "pyproject.toml.j2",
                           "README.md": "README.md.j2"}.items():
        files[path] = env.get_template(template).render(p=plan, target=target.names).encode()
    files[".clang-format"] = (resource_dir("templates") / "project" / "clang-format").read_bytes()
    files[".gitignore"] = (resource_dir("templates") / "project" / "gitignore").read_bytes()
    for path, source in (target.files or {}).items():
        files[path] = (resource_dir("templates") / source).read_bytes()
    for header, source in runtime.included(files[path].decode() for path in cpp).items():
        files[f"runtime/{header}"] = source.read_bytes()
    return dict(sorted(files.items()))
