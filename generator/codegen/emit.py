"""Emission, the last two stages: `render` (ProjectPlan + templates + runtime
headers -> {path: bytes}, pure) and `write` (those files -> the project folder).

Output is byte-for-byte deterministic: no timestamps, no absolute paths, sorted
where order would otherwise vary; C++ is formatted with clang-format, Python
with black. A manifest records what was generated and .deepgen/base/ keeps the
generated files themselves, so regenerating merges the user's edits with the
new generation (three-way, codegen/merge.py) instead of overwriting them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import black
import jinja2

from ..errors import DeepgenError
from ..resources import resource_dir
from .merge import merge_file

MANIFEST = ".deepgen/manifest.json"
BASE_DIR = ".deepgen/base"  # each file as deepgen last generated it: the base of the next merge
PREMERGE_DIR = ".deepgen/premerge"  # edited files as they were before a merge overwrote them
BESIDE = ".generated"  # suffix of the new generation written next to a file that could not be merged


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
    stub = env.get_template("module.pyi.j2").render(p=plan, target=target.names)  # for editors (CMake installs it)
    files[f"{name}.pyi"] = black.format_str(stub, mode=black.Mode(line_length=110, is_pyi=True)).encode()
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


def write_project(out_dir, files: dict, force: bool = False, restore: bool = False) -> "WriteResult":
    """Write `files` under out_dir, merging them with the user's edits.

    Each generated file is also stored under .deepgen/base/, so that the next
    generation can do a three-way merge (codegen/merge.py): base = that stored
    copy, ours = the file as the user left it, theirs = `files`. Edited files are
    merged (their pre-merge content kept under .deepgen/premerge/); files that
    conflict are listed in a MergeConflicts error raised after everything else
    was written. A generated file the user deleted stays deleted unless `restore`;
    one no longer generated but edited is kept. `force` writes the generation as
    it is (edited files' content still kept under .deepgen/premerge/).
    Touches nothing outside out_dir; a new project that fails half-way is removed."""
    root = Path(out_dir).resolve()
    if root.exists() and not root.is_dir():
        raise DeepgenError(f"{out_dir} is a file, not a folder: choose a folder to write the project into")
    old = read_manifest(root) if root.is_dir() else None
    if old is None and root.is_dir() and any(root.iterdir()) and not force:
        raise DeepgenError(f"{out_dir} exists and was not made by deepgen; choose another folder or pass --force")
    old = old or {}
    targets = {rel: _inside(root, rel, "generated file") for rel in files}
    bases = {rel: _inside(root, f"{BASE_DIR}/{rel}", "stored generation") for rel in files}  # checked before writing
    result = WriteResult()
    created = _first_missing(root)
    try:
        for rel, data in files.items():
            _write_one(root, rel, targets[rel], data, old.get(rel), force, restore, result)
        for rel in sorted(set(old) - set(files)):  # generated before, not any more
            _remove_stale(root, rel, old[rel], force, result)
            _unlink(_inside(root, f"{BASE_DIR}/{rel}", "stored generation"))
        for rel, data in files.items():
            _put(bases[rel], data)
        manifest_path = _inside(root, MANIFEST, "the manifest")
        manifest_path.parent.mkdir(parents=True, exist_ok=True)
        manifest = {"generator": "deepgen", "files": {rel: _digest(data) for rel, data in files.items()}}
        manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    except OSError as e:
        if created is not None:  # nothing there was the user's: leave no half-written project
            shutil.rmtree(created, ignore_errors=True)
        raise DeepgenError(f"writing the project into {out_dir} failed: {e}"
                           + ("; nothing was left behind" if created is not None else "")) from None
    if result.conflicts:
        raise MergeConflicts(out_dir, result)
    return result


@dataclass
class WriteResult:
    """What write_project did: `written`, the paths of the generated files now in
    the project; `merged`, the files where the user's edits and the new generation
    were merged cleanly; `conflicts` and `notes`, lines for the user ("path: what")."""

    written: list = field(default_factory=list)
    merged: list = field(default_factory=list)
    conflicts: list = field(default_factory=list)
    notes: list = field(default_factory=list)


class MergeConflicts(DeepgenError):
    """Files that could not be merged; everything else was written."""

    def __init__(self, out_dir, result: WriteResult):
        self.result = result
        lines = [f"{len(result.conflicts)} file(s) in {out_dir} could not be merged with the new generation:"]
        lines += [f"  {line}" for line in result.conflicts]
        lines.append("resolve them (keep what you want between the <<<<<<< and >>>>>>> markers; merge a "
                     f"FILE{BESIDE} into FILE by hand, then delete it), then build; everything else was written")
        lines += [f"  note: {line}" for line in result.notes]
        super().__init__("\n".join(lines))


def _write_one(root: Path, rel: str, path: Path, data: bytes, old_digest, force: bool, restore: bool,
               result: WriteResult) -> None:
    """Bring one generated file up to date (see write_project)."""
    if old_digest is not None and not path.exists() and not path.is_symlink():
        if not (restore or force):
            result.notes.append(f"{rel}: you deleted it, so it stays deleted (--restore writes it again)")
            return
    ours = path.read_bytes() if path.is_file() else None
    if ours is None or ours == data or _digest(ours) == old_digest:  # missing, current, or not edited
        _put(path, data)
        result.written.append(path.resolve())
        return
    premerge = _inside(root, f"{PREMERGE_DIR}/{rel}", "pre-merge copy")
    if force:
        _put(premerge, ours)
        _put(path, data)
        result.written.append(path.resolve())
        result.notes.append(f"{rel}: overwritten (--force); your version is in {PREMERGE_DIR}/{rel}")
        return
    beside = _inside(root, rel + BESIDE, "new generation beside an unmerged file")
    base = _inside(root, f"{BASE_DIR}/{rel}", "stored generation")
    base_data = base.read_bytes() if old_digest is not None and base.is_file() else None
    if base_data is not None and _digest(base_data) != old_digest:
        base_data = None  # not what the manifest says was generated: no base to trust
    outcome = merge_file(base_data, ours, data, pending=beside.is_file())
    if outcome.data is not None:
        _put(premerge, ours)
        _put(path, outcome.data)
        result.written.append(path.resolve())
    if outcome.beside is not None:
        _put(beside, outcome.beside)
    if outcome.conflict is None:
        if outcome.data is not None:
            result.merged.append(rel)
            result.notes.append(f"{rel}: your edits merged with the new generation "
                                f"(your version before the merge: {PREMERGE_DIR}/{rel})")
        return
    where = (f"your version before the merge: {PREMERGE_DIR}/{rel}" if outcome.beside is None
             else f"your file is unchanged; the new generation is in {rel}{BESIDE}")
    result.conflicts.append(f"{rel}: {outcome.conflict} ({where})")


def _remove_stale(root: Path, rel: str, old_digest: str, force: bool, result: WriteResult) -> None:
    """A file generated last time but not now: removed, unless the user edited it."""
    path = _inside(root, rel, "file generated earlier")
    if path.is_symlink() or not path.is_file():
        _unlink(path)
        return
    ours = path.read_bytes()
    if _digest(ours) != old_digest:
        if not force:
            result.notes.append(f"{rel}: no longer generated, but you edited it, so it was kept "
                                "(deepgen no longer tracks it)")
            return
        _put(_inside(root, f"{PREMERGE_DIR}/{rel}", "pre-merge copy"), ours)
        result.notes.append(f"{rel}: no longer generated; removed (--force), your version is in {PREMERGE_DIR}/{rel}")
    path.unlink()


def _put(path: Path, data: bytes) -> None:
    """Write data at path (a path checked by _inside), replacing a symlink rather than writing through it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink():
        path.unlink()
    if not path.is_file() or path.read_bytes() != data:
        path.write_bytes(data)


def _unlink(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()


def _first_missing(path: Path) -> Path | None:
    """The outermost folder of `path` (itself included) that does not exist yet."""
    missing = None
    while not path.exists():
        missing, path = path, path.parent
    return missing
