"""Emission, the last two stages: `render` (ProjectPlan + templates + runtime
headers -> {path: bytes}, pure) and `write` (those files -> the project folder).

Output is byte-for-byte deterministic: no timestamps, no absolute paths, sorted
where order would otherwise vary; C++ is formatted with clang-format, Python
with black. A manifest records what was generated, so regenerating never
silently overwrites a file the user edited.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import black
import jinja2

from ..errors import DeepgenError
from ..resources import resource_dir

MANIFEST = ".deepgen/manifest.json"


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
    for path, template in cpp.items():
        files[path] = _clang_format(env.get_template(template).render(p=plan, target=target.names), path).encode()
    test = env.get_template("test_model.py.j2").render(p=plan, target=target.names)
    files["tests/test_model.py"] = black.format_str(test, mode=black.Mode(line_length=110)).encode()
    if plan.recording.expected_npz is not None:
        files["tests/expected.npz"] = plan.recording.expected_npz
    for path, template in {"CMakeLists.txt": "CMakeLists.txt.j2", "pyproject.toml": "pyproject.toml.j2",
                           "README.md": "README.md.j2"}.items():
        files[path] = env.get_template(template).render(p=plan, target=target.names).encode()
    files[".clang-format"] = (resource_dir("templates") / "project" / "clang-format").read_bytes()
    files[".gitignore"] = (resource_dir("templates") / "project" / "gitignore").read_bytes()
    for header, source in target.runtime_sources().items():
        files[f"runtime/{header}"] = source.read_bytes()
    return dict(sorted(files.items()))


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _inside(root: Path, rel: str, what: str) -> Path:
    """root/rel, refused unless it resolves (symlinks included) inside root."""
    if not isinstance(rel, str) or not rel or "\0" in rel or Path(rel).is_absolute():
        raise DeepgenError(f"{what}: {rel!r} is not a relative path inside the project")
    path = root / rel
    resolved = path.resolve()
    if root not in resolved.parents:
        raise DeepgenError(f"{what}: {rel!r} resolves to {resolved}, outside the project {root}; refusing to touch it")
    return path


def read_manifest(root: Path) -> dict | None:
    """{relative path: sha256} of the last generation into root, None if root
    has no manifest. Every path must lie inside root: a manifest is data a
    cloned or shared project brings along, so it is checked before use."""
    path = _inside(root, MANIFEST, "the manifest")
    if not path.exists() and not path.is_symlink():
        return None
    fix = f"delete {path} to generate afresh (files it listed are then kept), or generate into another folder"
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DeepgenError(f"{path}: not a readable deepgen manifest ({e}); {fix}") from None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict) or data.get("generator") != "deepgen":
        raise DeepgenError(f"{path}: not a deepgen manifest (expected {{'generator': 'deepgen', 'files': {{...}}}}); {fix}")
    for rel, digest in files.items():
        if not (isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
            raise DeepgenError(f"{path}: entry {rel!r} has no sha256 digest; {fix}")
        _inside(root, rel, f"{path}: entry")
    return files


def write_project(out_dir, files: dict, force: bool = False) -> list:
    """Write `files` under out_dir. Refuses to overwrite files changed since the
    last generation (or a folder deepgen did not make) unless force is set.
    Touches nothing outside out_dir; a new project that fails half-way is removed."""
    root = Path(out_dir).resolve()
    if root.exists() and not root.is_dir():
        raise DeepgenError(f"{out_dir} is a file, not a folder: choose a folder to write the project into")
    old = read_manifest(root) if root.is_dir() else None
    if old is None and root.is_dir() and any(root.iterdir()) and not force:
        raise DeepgenError(f"{out_dir} exists and was not made by deepgen; choose another folder or pass --force")
    old = old or {}
    if not force:
        edited = [p for p, digest in old.items() if (root / p).is_file() and _digest((root / p).read_bytes()) != digest]
        if edited:
            raise DeepgenError(
                f"these generated files in {out_dir} were edited since generation: {', '.join(sorted(edited))}; "
                "regenerating would lose the edits (pass --force to overwrite, or generate into another folder)"
            )
    targets = {rel: _inside(root, rel, "generated file") for rel in files}
    created = _first_missing(root)
    try:
        written = []
        for rel, data in files.items():
            path = targets[rel]
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.is_symlink():
                path.unlink()  # replace the link itself, never write through it
            if not path.is_file() or path.read_bytes() != data:
                path.write_bytes(data)
            written.append(path.resolve())
        for rel in sorted(set(old) - set(files)):  # generated before, not any more
            stale = root / rel
            if stale.is_file() or stale.is_symlink():
                stale.unlink()
        manifest_path = _inside(root, MANIFEST, "the manifest")
        manifest_path.parent.mkdir(parents=True, exist_ok=True)
        manifest = {"generator": "deepgen", "files": {rel: _digest(data) for rel, data in files.items()}}
        manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    except OSError as e:
        if created is not None:  # nothing there was the user's: leave no half-written project
            shutil.rmtree(created, ignore_errors=True)
        raise DeepgenError(f"writing the project into {out_dir} failed: {e}"
                           + ("; nothing was left behind" if created is not None else "")) from None
    return written


def _first_missing(path: Path) -> Path | None:
    """The outermost folder of `path` (itself included) that does not exist yet."""
    missing = None
    while not path.exists():
        missing, path = path, path.parent
    return missing
