"""Stage `write`: the rendered files -> the project folder, as one transaction.

Each generated file is also stored under .deepgen/base/, so that the next
generation can do a three-way merge (codegen/merge.py): base = that stored copy,
ours = the file as the user left it, theirs = the new generation. A manifest
(.deepgen/manifest.json) records what was generated last.

No fault (a full disk, a kill, Ctrl-C, a power cut) may lose an edit or leave
half a project, so a generation is written in four steps:

1. check: the manifest, every path (inside the folder, symlinks included),
   unresolved conflict markers, write permission; nothing is written before all
   of it passed;
2. decide: every file's new content, merged with the user's edits, in memory;
3. stage: each new content into .deepgen/staging/, synced to the disk, then the
   journal .deepgen/journal.json naming each staged file's destination (written
   atomically: the commit point);
4. apply: each staged file renamed onto its destination (pre-merge copies of the
   user's files first, the manifest last), stale files removed, the journal
   deleted.

A run that finds a journal completes it before anything else (its staged files
are complete once it exists); staged files without a journal are an interrupted
step 3 and are dropped. A pre-merge copy never replaces a different earlier one:
later copies are numbered (model.cpp.~1~, ~2~ ...).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DeepgenError
from ..fileio import fsync_dir, remove_temporaries, write_atomic
from .merge import as_text, conflict_marker_line, merge_file

MANIFEST = ".deepgen/manifest.json"
BASE_DIR = ".deepgen/base"  # each file as deepgen last generated it: the base of the next merge
PREMERGE_DIR = ".deepgen/premerge"  # edited files as they were before a merge overwrote them
STAGING_DIR = ".deepgen/staging"  # a generation being written: its files before they are moved in place
JOURNAL = ".deepgen/journal.json"  # the moves of a generation being written (present only until it is done)
BESIDE = ".generated"  # suffix of the new generation written next to a file that could not be merged


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


def _read(path: Path) -> bytes | None:
    """The content of a regular file at path, None if there is none."""
    return path.read_bytes() if path.is_file() else None


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
        if not _is_digest(digest):
            raise DeepgenError(f"{path}: entry {rel!r} has no sha256 digest; {fix}")
        _inside(root, rel, f"{path}: entry")
    return files


def _is_digest(value) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


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


@dataclass
class _Move:
    """One file of the transaction: `data` goes to `rel`. `expect` is the digest of
    what the user had there when the move was decided (None: nothing), checked again
    if the move is completed by a later run; internal files (.deepgen/) have no check."""

    rel: str
    data: bytes
    expect: str | None = None
    checked: bool = False


@dataclass
class _Plan:
    moves: list = field(default_factory=list)  # in the order they are applied
    removals: list = field(default_factory=list)  # (rel, digest of the file removed)
    result: WriteResult = field(default_factory=WriteResult)


def write_project(out_dir, files: dict, force: bool = False, restore: bool = False) -> WriteResult:
    """Write `files` under out_dir, merging them with the user's edits.

    Edited files are merged (their pre-merge content kept under .deepgen/premerge/);
    files that conflict are listed in a MergeConflicts error raised after everything
    else was written. A generated file the user deleted stays deleted unless
    `restore`; one no longer generated but edited is kept. `force` writes the
    generation as it is (edited files' content still kept under .deepgen/premerge/)
    and overrides the refusal to regenerate over unresolved conflict markers.
    Touches nothing outside out_dir; a new project that fails half-way is removed."""
    root = Path(out_dir).resolve()
    if root.exists() and not root.is_dir():
        raise DeepgenError(f"{out_dir} is a file, not a folder: choose a folder to write the project into")
    notes = complete_interrupted(root) if root.is_dir() else []
    old = read_manifest(root) if root.is_dir() else None
    if old is None and root.is_dir() and any(root.iterdir()) and not force:
        raise DeepgenError(f"{out_dir} exists and was not made by deepgen; choose another folder or pass --force")
    old = old or {}
    for rel in files:  # every path is checked before anything is written
        _inside(root, rel, "generated file")
        _inside(root, f"{BASE_DIR}/{rel}", "stored generation")
    for rel in old:
        _inside(root, f"{BASE_DIR}/{rel}", "stored generation")
    if not force:
        _refuse_unresolved(root, old)
    plan = _decide(root, files, old, force, restore)
    plan.result.notes[:0] = notes
    _check_writable(root, plan)
    created = _first_missing(root)
    try:
        _stage(root, plan)
        with _signals_held():  # from the commit point on, Ctrl-C waits for the renames
            _write_journal(root, plan)
            _apply(root, out_dir)
    except (OSError, DeepgenError, KeyboardInterrupt) as e:
        if created is not None:  # nothing there was the user's: leave no half-written project
            shutil.rmtree(created, ignore_errors=True)
        elif not (root / JOURNAL).is_file():
            _drop_staging(root)
        if isinstance(e, KeyboardInterrupt) or (isinstance(e, DeepgenError) and created is None):
            raise
        what = "nothing was left behind" if created is not None else "no file of the project was changed"
        raise DeepgenError(f"writing the project into {out_dir} failed: {e}; {what}") from None
    if plan.result.conflicts:
        raise MergeConflicts(out_dir, plan.result)
    return plan.result


# -- 1. check --------------------------------------------------------------------------


def _refuse_unresolved(root: Path, old: dict) -> None:
    """A generated file still holding conflict markers has not been merged by hand yet."""
    for rel in sorted(old):
        data = _read(root / rel)
        text = as_text(data) if data is not None else None
        line = conflict_marker_line(text) if text is not None else None
        if line is not None:
            raise DeepgenError(f"{root / rel}:{line}: conflict markers from the last generation are still there: "
                               "resolve them (keep what you want between <<<<<<< and >>>>>>>, delete the markers) "
                               "and generate again, or pass --force to write the new generation over the file "
                               f"(your version is then kept under {PREMERGE_DIR}/)")


def _check_writable(root: Path, plan: _Plan) -> None:
    """Every file to replace or remove, and every folder a file lands in, must be writable by us."""
    folders = set()
    for rel in [m.rel for m in plan.moves] + [rel for rel, _ in plan.removals]:
        path = root / rel
        if path.is_file() and not path.is_symlink() and not os.access(path, os.W_OK):
            raise DeepgenError(f"{path} is read-only; make it writable (or move it away) and generate again: "
                               "nothing was written")
        folder = path.parent
        while not folder.exists():
            folder = folder.parent
        folders.add(folder)
    for folder in sorted(folders):
        if not os.access(folder, os.W_OK | os.X_OK):
            raise DeepgenError(f"cannot write into the folder {folder} (permission denied): nothing was written")


# -- 2. decide -------------------------------------------------------------------------


def _decide(root: Path, files: dict, old: dict, force: bool, restore: bool) -> _Plan:
    plan = _Plan()
    for rel, data in files.items():
        _decide_one(root, rel, data, old.get(rel), force, restore, plan)
    for rel in sorted(set(old) - set(files)):  # generated before, not any more
        _decide_stale(root, rel, old[rel], force, plan)
        if (root / BASE_DIR / rel).is_file():
            plan.removals.append((f"{BASE_DIR}/{rel}", None))
    for rel, data in files.items():
        if _read(root / BASE_DIR / rel) != data:
            plan.moves.append(_Move(f"{BASE_DIR}/{rel}", data))
    manifest = {"generator": "deepgen", "files": {rel: _digest(data) for rel, data in files.items()}}
    plan.moves.append(_Move(MANIFEST, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()))
    # Copies of the user's versions go first: no file of theirs is replaced before its copy exists.
    plan.moves.sort(key=lambda m: not m.rel.startswith(PREMERGE_DIR + "/"))
    return plan


def _replace(root: Path, plan: _Plan, rel: str, data: bytes, ours: bytes | None) -> None:
    """Move data onto the project file rel, where the user has `ours`."""
    if ours != data:
        plan.moves.append(_Move(rel, data, _digest(ours) if ours is not None else None, checked=True))
    plan.result.written.append((root / rel).resolve())


def _keep_copy(root: Path, plan: _Plan, rel: str, ours: bytes) -> str:
    """Stage a pre-merge copy of the user's `ours` of rel; its path. An earlier copy of
    another version is never replaced: the new one is numbered (rel.~1~, rel.~2~ ...)."""
    candidate, n = f"{PREMERGE_DIR}/{rel}", 0
    while True:
        path = _inside(root, candidate, "pre-merge copy")
        existing = _read(path)
        if existing == ours:
            return candidate
        if existing is None and not path.exists() and not path.is_symlink():
            plan.moves.append(_Move(candidate, ours))
            return candidate
        n += 1
        candidate = f"{PREMERGE_DIR}/{rel}.~{n}~"


def _damaged(ours: bytes, base: bytes | None, old_digest: str) -> str | None:
    """Why ours looks like a write cut short rather than the user's edit, or None."""
    if not ours and old_digest != _digest(b""):
        return "it is empty, but deepgen wrote it with content last time"
    if base is not None and len(ours) < len(base) and base.startswith(ours):
        return f"it holds only the first {len(ours)} of the {len(base)} bytes deepgen wrote last time"
    return None


def _decide_one(root: Path, rel: str, data: bytes, old_digest, force: bool, restore: bool, plan: _Plan) -> None:
    """Bring one generated file up to date (see write_project)."""
    path = root / rel
    result = plan.result
    if old_digest is not None and not path.exists() and not path.is_symlink():
        if not (restore or force):
            result.notes.append(f"{rel}: you deleted it, so it stays deleted (--restore writes it again)")
            return
    ours = _read(path)
    if path.is_symlink():  # replaced by the file, never written through
        plan.moves.append(_Move(rel, data, None))
        result.written.append(path.resolve())
        return
    if ours is None or ours == data or _digest(ours) == old_digest:  # missing, current, or not edited
        _replace(root, plan, rel, data, ours)
        return
    if force:
        copy = _keep_copy(root, plan, rel, ours)
        _replace(root, plan, rel, data, ours)
        result.notes.append(f"{rel}: overwritten (--force); your version is in {copy}")
        return
    beside_rel = rel + BESIDE
    beside = _inside(root, beside_rel, "new generation beside an unmerged file")
    base_path = root / BASE_DIR / rel
    base_data = _read(base_path) if old_digest is not None else None
    base_problem = None
    if old_digest is None:
        base_problem = ("no stored earlier generation to merge with (a file deepgen did not write): "
                        "merge the new generation by hand")
    elif base_data is None:
        base_problem = (f"no stored earlier generation to merge with ({BASE_DIR}/{rel} is missing: a project made by "
                        "an older deepgen, or the copy was deleted): merge the new generation by hand")
    elif _digest(base_data) != old_digest:
        base_problem = (f"the stored earlier generation {BASE_DIR}/{rel} is damaged (not what the manifest recorded), "
                        "so there is no base to merge with: merge the new generation by hand")
        base_data = None
    damage = _damaged(ours, base_data, old_digest) if old_digest is not None else None
    if damage is not None:
        outcome_beside, conflict, data_out = data, (f"{damage}, as an interrupted write would leave it, so it is not "
                                                    "taken as your edits: if it is what you want, merge the new "
                                                    "generation by hand; else move it over the file"), None
    else:
        outcome = merge_file(base_data, ours, data, pending=beside.is_file(), base_problem=base_problem)
        outcome_beside, conflict, data_out = outcome.beside, outcome.conflict, outcome.data
    copy = None
    if data_out is not None:
        copy = _keep_copy(root, plan, rel, ours)
        _replace(root, plan, rel, data_out, ours)
    if outcome_beside is not None and _read(beside) != outcome_beside:
        plan.moves.append(_Move(beside_rel, outcome_beside, _digest(_read(beside)) if beside.is_file() else None,
                                checked=True))
    if conflict is None:
        if data_out is not None:
            result.merged.append(rel)
            result.notes.append(f"{rel}: your edits merged with the new generation (your version before the merge: {copy})")
        return
    where = (f"your version before the merge: {copy}" if outcome_beside is None
             else f"your file is unchanged; the new generation is in {rel}{BESIDE}")
    result.conflicts.append(f"{rel}: {conflict} ({where})")


def _decide_stale(root: Path, rel: str, old_digest: str, force: bool, plan: _Plan) -> None:
    """A file generated last time but not now: removed, unless the user edited it."""
    path = _inside(root, rel, "file generated earlier")
    if path.is_symlink() or not path.is_file():
        if path.is_symlink():
            plan.removals.append((rel, None))
        return
    ours = path.read_bytes()
    if _digest(ours) != old_digest:
        if not force:
            plan.result.notes.append(f"{rel}: no longer generated, but you edited it, so it was kept "
                                     "(deepgen no longer tracks it)")
            return
        copy = _keep_copy(root, plan, rel, ours)
        plan.result.notes.append(f"{rel}: no longer generated; removed (--force), your version is in {copy}")
    plan.removals.append((rel, _digest(ours)))


# -- 3. stage --------------------------------------------------------------------------


def _stage(root: Path, plan: _Plan) -> None:
    """Every move's data into the staging folder, synced."""
    _drop_staging(root)
    for i, move in enumerate(plan.moves):
        write_atomic(root / STAGING_DIR / f"{i:04d}", move.data)


def _write_journal(root: Path, plan: _Plan) -> None:
    """The moves and removals, written atomically: the commit point of the generation."""
    entries = [{"staged": f"{i:04d}", "to": m.rel, "expect": m.expect, "checked": m.checked}
               for i, m in enumerate(plan.moves)]
    removals = [{"path": rel, "expect": digest} for rel, digest in plan.removals]
    write_atomic(root / JOURNAL, (json.dumps({"moves": entries, "removals": removals}, indent=1) + "\n").encode())


def _drop_staging(root: Path) -> None:
    staging = root / STAGING_DIR
    if staging.is_dir() and not staging.is_symlink():
        shutil.rmtree(staging, ignore_errors=True)
    remove_temporaries(root / ".deepgen")


# -- 4. apply (also a later run completing an interrupted one) ---------------------------


@contextmanager
def _signals_held():
    """Ctrl-C and SIGTERM wait until the renames are done (they take milliseconds)."""
    held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    try:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    except (AttributeError, OSError, ValueError):
        previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _apply(root: Path, out_dir, notes: list | None = None) -> None:
    """Carry out the journal: rename each staged file onto its destination, remove what
    it lists, then delete it. A failure leaves the journal for the next run to complete
    and says what was written and what was not."""
    journal = json.loads((root / JOURNAL).read_text())
    done, folders = [], set()
    with _signals_held():
        try:
            for entry in journal["moves"]:
                staged = root / STAGING_DIR / entry["staged"]
                dest = _inside(root, entry["to"], "journal entry")
                if not staged.is_file():
                    continue  # moved by the run that was interrupted
                if notes is not None and entry["checked"]:  # a later run: did the user change it meanwhile?
                    now = _read(dest)
                    if (_digest(now) if now is not None else None) != entry["expect"] and now is not None:
                        plan = _Plan()
                        copy = _keep_copy(root, plan, entry["to"], now)
                        for move in plan.moves:
                            write_atomic(root / move.rel, move.data)
                        notes.append(f"{entry['to']}: changed after an interrupted generate; that version is kept "
                                     f"in {copy} before the interrupted generation was completed")
                dest.parent.mkdir(parents=True, exist_ok=True)
                if dest.is_dir() and not dest.is_symlink():
                    raise DeepgenError(f"{dest} is a folder; deepgen has to write a file there")
                os.replace(staged, dest)
                folders.add(dest.parent)
                done.append(entry["to"])
            for entry in journal["removals"]:
                path = _inside(root, entry["path"], "journal entry")
                now = _read(path)
                if entry["expect"] is not None and now is not None and _digest(now) != entry["expect"]:
                    if notes is not None:
                        notes.append(f"{entry['path']}: changed after an interrupted generate, so it was kept")
                    continue
                if path.is_symlink() or path.is_file():
                    path.unlink()
                    folders.add(path.parent)
            for folder in folders:
                fsync_dir(folder)
        except (OSError, DeepgenError) as e:
            pending = [entry["to"] for entry in journal["moves"] if entry["to"] not in done]
            raise DeepgenError(
                f"writing the project into {out_dir} stopped: {e}\n  written: {', '.join(done) or 'nothing'}\n"
                f"  not yet written: {', '.join(pending) or 'nothing'}\n"
                f"  the next `deepgen generate` into {out_dir} completes it ({JOURNAL})") from None
        (root / JOURNAL).unlink()
        _drop_staging(root)


def complete_interrupted(root: Path) -> list:
    """Finish a generation an earlier run was interrupted in (see the module docstring);
    notes for the user (empty when there was nothing to do)."""
    journal = _inside(root, JOURNAL, "the journal")
    if not journal.is_file():
        _drop_staging(root)  # staged files without a journal: the interrupted run had changed nothing
        return []
    try:
        data = json.loads(journal.read_text())
        ok = isinstance(data, dict) and isinstance(data.get("moves"), list) and isinstance(data.get("removals"), list)
    except (OSError, UnicodeDecodeError, ValueError):
        ok = False
    if not ok:
        raise DeepgenError(f"{journal}: not a readable deepgen journal; it records a generation that was interrupted: "
                           f"delete it and {STAGING_DIR} to drop that generation, then generate again")
    notes = []
    _apply(root, root, notes)
    return [f"an interrupted generate was completed first ({len(data['moves'])} files)"] + notes


def pending_generation(root) -> bool:
    """True while a generation into root is half applied (the next generate completes it)."""
    return (Path(root) / JOURNAL).is_file()


def _first_missing(path: Path) -> Path | None:
    """The outermost folder of `path` (itself included) that does not exist yet."""
    missing = None
    while not path.exists():
        missing, path = path, path.parent
    return missing
