"""Writing a generation never loses a hand edit nor leaves half a project
(codegen/writer.py), whatever fails: a full disk or a kill at any write or
rename, Ctrl-C at any moment, a truncated user file, a damaged stored base,
conflict markers not yet resolved, a read-only file. Each test failed before the
transactional writer."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT
from generator.codegen.writer import BASE_DIR, BESIDE, JOURNAL, PREMERGE_DIR, STAGING_DIR, MergeConflicts, write_project
from generator.errors import DeepgenError
from generator.tools.cli import main

MLP = ROOT / "examples" / "mlp.py"


def text(*lines) -> bytes:
    return "".join(f"{line}\n" for line in lines).encode()


OLD = {"include/m.h": text("int f();", "int g();"), "src/m.cpp": text("// generated", "int f() {", "  return 1;", "}",
                                                                      "", "int g() { return 2; }"),
       "README.md": text("old readme"), "stale.txt": text("dropped next time")}
NEW = {"include/m.h": text("int f();", "int g();", "int h();"),
       "src/m.cpp": text("// generated", "int f() {", "  return 1;", "}", "", "int g() { return 3; }", "",
                         "int h() { return 4; }"),
       "README.md": text("new readme")}
EDIT = "  // my edit\n"


def _edit(root: Path) -> None:
    path = root / "src" / "m.cpp"
    path.write_text(path.read_text().replace("int f() {\n", "int f() {\n" + EDIT))


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _fresh(tmp_path: Path, name: str = "proj") -> Path:
    root = tmp_path / name
    write_project(root, OLD)
    _edit(root)
    return root


def _check_consistent(root: Path) -> None:
    """No edit lost; without a pending journal the project is wholly one generation."""
    assert EDIT in (root / "src" / "m.cpp").read_text()
    if (root / JOURNAL).is_file():
        return  # half applied: the next run completes it (and `deepgen build` refuses until then)
    manifest = json.loads((root / ".deepgen" / "manifest.json").read_text())["files"]
    generation = OLD if manifest == {k: hashlib.sha256(v).hexdigest() for k, v in OLD.items()} else NEW
    for rel, data in generation.items():
        if rel != "src/m.cpp":
            assert (root / rel).read_bytes() == data, rel


def _check_final(root: Path) -> None:
    write_project(root, NEW)  # completes whatever was interrupted, then is a no-op generation
    merged = (root / "src" / "m.cpp").read_text()
    assert merged == NEW["src/m.cpp"].decode().replace("int f() {\n", "int f() {\n" + EDIT)
    assert "<<<<<<<" not in merged and not (root / ("src/m.cpp" + BESIDE)).exists()
    for rel in ("include/m.h", "README.md"):
        assert (root / rel).read_bytes() == NEW[rel]
    assert not (root / "stale.txt").exists() and not (root / JOURNAL).exists() and not (root / STAGING_DIR).exists()
    copies = sorted(p.name for p in (root / PREMERGE_DIR / "src").iterdir())
    assert copies == ["m.cpp"] and EDIT in (root / PREMERGE_DIR / "src" / "m.cpp").read_text()
    assert not [p for p in root.rglob(".deepgen-tmp-*")]


def _count_calls(tmp_path: Path) -> int:
    """How many writes and renames one regeneration makes."""
    root = _fresh(tmp_path, "count")
    calls = [0]
    real_write, real_replace = os.write, os.replace

    def write(*a):
        calls[0] += 1
        return real_write(*a)

    def replace(*a):
        calls[0] += 1
        return real_replace(*a)

    os.write, os.replace = write, replace
    try:
        write_project(root, NEW)
    finally:
        os.write, os.replace = real_write, real_replace
    return calls[0]


def test_a_full_disk_at_any_write_loses_no_edit_and_leaves_no_half_project(tmp_path, monkeypatch):
    total = _count_calls(tmp_path)
    assert total > 10
    for k in range(total):
        root = _fresh(tmp_path, f"p{k}")
        calls = [0]
        real_write, real_replace = os.write, os.replace

        def fail_at_k(real):
            def call(*a):
                calls[0] += 1
                if calls[0] == k + 1:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return real(*a)
            return call

        monkeypatch.setattr(os, "write", fail_at_k(real_write))
        monkeypatch.setattr(os, "replace", fail_at_k(real_replace))
        with pytest.raises(DeepgenError, match="No space left"):
            write_project(root, NEW)
        monkeypatch.undo()
        _check_consistent(root)
        _check_final(root)


def test_a_kill_at_any_write_loses_no_edit_and_leaves_no_half_project(tmp_path):
    total = _count_calls(tmp_path)
    for k in range(total):
        root = _fresh(tmp_path, f"p{k}")
        pid = os.fork()
        if pid == 0:  # the child dies at its k-th write or rename, as under SIGKILL
            calls = [0]
            real_write, real_replace = os.write, os.replace

            def die_at_k(real):
                def call(*a):
                    calls[0] += 1
                    if calls[0] == k + 1:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return real(*a)
                return call

            os.write, os.replace = die_at_k(real_write), die_at_k(real_replace)
            try:
                write_project(root, NEW)
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        _check_consistent(root)
        _check_final(root)


def test_an_empty_or_truncated_file_is_not_taken_as_edits(tmp_path):
    for cut in (0, 20):
        root = tmp_path / f"cut{cut}"
        write_project(root, OLD)
        path = root / "src" / "m.cpp"
        path.write_bytes(OLD["src/m.cpp"][:cut])
        with pytest.raises(MergeConflicts, match="interrupted write") as e:
            write_project(root, NEW)
        assert ("empty" if cut == 0 else f"first {cut} of") in str(e.value)
        assert path.read_bytes() == OLD["src/m.cpp"][:cut]  # left as it is, the generation beside it
        assert (root / ("src/m.cpp" + BESIDE)).read_bytes() == NEW["src/m.cpp"]
        assert (root / BASE_DIR / "src" / "m.cpp").read_bytes() == NEW["src/m.cpp"]


def test_a_premerge_copy_is_never_replaced_by_another_version(tmp_path):
    root = _fresh(tmp_path)
    first = (root / "src" / "m.cpp").read_bytes()
    write_project(root, NEW)
    path = root / "src" / "m.cpp"
    path.write_text(path.read_text().replace("  return 1;", "  return 1;  // second edit"))
    second = path.read_bytes()
    newer = dict(NEW, **{"README.md": text("newer readme"), "src/m.cpp": NEW["src/m.cpp"] + text("int i();")})
    result = write_project(root, newer)
    assert (root / PREMERGE_DIR / "src" / "m.cpp").read_bytes() == first
    assert (root / PREMERGE_DIR / "src" / "m.cpp.~1~").read_bytes() == second
    assert any("m.cpp.~1~" in note for note in result.notes)


def test_a_damaged_base_is_not_called_missing(tmp_path):
    root = _fresh(tmp_path)
    (root / BASE_DIR / "src" / "m.cpp").write_text("garbage\n")
    with pytest.raises(MergeConflicts, match="damaged") as e:
        write_project(root, NEW)
    assert "no stored earlier generation" not in str(e.value)


def test_unresolved_conflict_markers_refuse_regeneration(tmp_path):
    root = _fresh(tmp_path)
    path = root / "src" / "m.cpp"
    path.write_text(path.read_text().replace("int g() { return 2; }", "int g() { return 5; }"))
    with pytest.raises(MergeConflicts):
        write_project(root, NEW)
    line = path.read_text().split("\n").index("<<<<<<< ours (your edits)") + 1
    before = _snapshot(root)
    with pytest.raises(DeepgenError, match=rf"m.cpp:{line}: conflict markers"):
        write_project(root, NEW)
    assert _snapshot(root) == before
    write_project(root, NEW, force=True)
    assert path.read_bytes() == NEW["src/m.cpp"]


def test_cli_refuses_markers_with_exit_1_naming_file_and_line(tmp_path, capsys):
    out = tmp_path / "proj"
    assert main(["generate", str(MLP), "-o", str(out), "--name", "mlp_marks"]) == 0
    model = out / "src" / "model.cpp"
    lines = model.read_text().split("\n")
    lines[9:9] = ["<<<<<<< ours (your edits)", "mine", "=======", "theirs", ">>>>>>> theirs (new generation)"]
    model.write_text("\n".join(lines))
    capsys.readouterr()
    assert main(["generate", str(MLP), "-o", str(out), "--name", "mlp_marks"]) == 1
    err = capsys.readouterr().err
    assert f"model.cpp:10: conflict markers" in err and len(err.strip().splitlines()) == 1


def test_nothing_is_written_when_a_file_is_read_only(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes read-only files; os.access says so")
    root = _fresh(tmp_path)
    (root / "README.md").chmod(0o444)
    before = _snapshot(root)
    with pytest.raises(DeepgenError, match="README.md is read-only"):
        write_project(root, NEW)
    assert _snapshot(root) == before


def test_a_read_only_folder_is_found_before_the_first_write(tmp_path, monkeypatch):
    """As root, os.access grants everything: the check is exercised through it."""
    root = _fresh(tmp_path)
    before = _snapshot(root)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == root / "include" else real(p, mode))
    with pytest.raises(DeepgenError, match="cannot write into the folder .*include"):
        write_project(root, NEW)
    assert _snapshot(root) == before


def test_an_interrupted_generation_is_completed_and_not_merged_again(tmp_path, monkeypatch):
    root = _fresh(tmp_path)
    real_replace = os.replace
    calls = [0]

    def stop_after_two(*a):  # the third move of a staged file into the project fails
        calls[0] += int(Path(a[0]).parent.name == "staging" and not Path(a[0]).name.startswith(".deepgen-tmp"))
        if calls[0] == 3:
            raise OSError(errno.EIO, "Input/output error")
        return real_replace(*a)

    monkeypatch.setattr(os, "replace", stop_after_two)
    with pytest.raises(DeepgenError, match=r"stopped(.|\n)*written:(.|\n)*not yet written(.|\n)*completes it"):
        write_project(root, NEW)
    monkeypatch.undo()
    assert (root / JOURNAL).is_file()
    from generator.tools.build import build_project

    with pytest.raises(DeepgenError, match="interrupted half-way"):
        (root / "pyproject.toml").write_text("")
        (root / "CMakeLists.txt").write_text("")
        build_project(root)
    result = write_project(root, NEW)
    assert any("interrupted generate was completed" in note for note in result.notes)
    assert not result.conflicts and EDIT in (root / "src" / "m.cpp").read_text()


def test_an_edit_made_after_an_interruption_is_kept(tmp_path, monkeypatch):
    root = _fresh(tmp_path)
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error"))
                        if str(a[1]).endswith("m.cpp") and PREMERGE_DIR not in str(a[1]) else real_replace(*a))
    with pytest.raises(DeepgenError, match="stopped"):
        write_project(root, NEW)
    monkeypatch.undo()
    path = root / "src" / "m.cpp"
    path.write_text(path.read_text() + "// edited after the interruption\n")
    result = write_project(root, NEW)
    kept = [p for p in (root / PREMERGE_DIR / "src").iterdir() if "after the interruption" in p.read_text()]
    assert kept and any("changed after an interrupted generate" in note for note in result.notes)


@pytest.mark.parametrize("delay", [0.3, 0.5, 0.8, 1.2, 1.7, 2.5])
def test_ctrl_c_at_any_moment_prints_one_line(tmp_path, delay):
    """From the moment Python runs deepgen's code (the interpreter's own start-up, in
    its site module, is before that: ~0.1 s here)."""
    out = tmp_path / "proj"
    cmd = [sys.executable, "-c", "import sys; from generator.tools.cli import main; sys.exit(main())",
           "generate", str(MLP), "-o", str(out), "--name", "mlp_sigint"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert "Traceback" not in err, err
    if proc.returncode != 0:
        assert proc.returncode in (130, -signal.SIGINT) and len(err.strip().splitlines()) <= 1, err
    if out.exists() and (out / ".deepgen" / "manifest.json").exists() and not (out / JOURNAL).exists():
        assert (out / "src" / "model.cpp").stat().st_size > 0
