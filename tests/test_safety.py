"""What deepgen itself promises about files, packages and errors (README, "What
deepgen guarantees"): nothing outside the project folder is touched, no
installed package is replaced, bad input is a one-line error, sizes are checked.
Each test here failed before its fix."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from conftest import ROOT
from generator.tools.cli import main
from generator.codegen.writer import write_project
from generator.pipeline import project_files
from generator.errors import DeepgenError

MLP = ROOT / "examples" / "mlp.py"


def _tiny():
    import generator as dg

    @dg.model
    def tiny():
        x = dg.input("x", (dg.dim("N"), 3))
        return dg.relu(dg.matmul(x, dg.param("w", (3, 4))))

    return tiny.build()


def cli(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- 1. the manifest can name only files inside the project ---------------------


def _project_with_manifest(tmp_path, entries):
    out = tmp_path / "proj"
    write_project(out, project_files(_tiny()))
    manifest = out / ".deepgen" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["files"].update(entries)
    manifest.write_text(json.dumps(data))
    return out


@pytest.mark.parametrize("force", [False, True])
def test_manifest_path_outside_the_project_is_refused(tmp_path, force):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    out = _project_with_manifest(tmp_path, {"../victim.txt": _sha(b"precious")})
    with pytest.raises(DeepgenError, match=r"victim.txt.*outside the project"):
        write_project(out, project_files(_tiny()), force=force)
    assert victim.read_bytes() == b"precious"


def test_manifest_absolute_path_is_refused(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    out = _project_with_manifest(tmp_path, {str(victim): _sha(b"precious")})
    with pytest.raises(DeepgenError, match="not a relative path inside the project"):
        write_project(out, project_files(_tiny()), force=True)
    assert victim.read_bytes() == b"precious"


def test_manifest_path_through_a_symlink_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_bytes(b"precious")
    out = _project_with_manifest(tmp_path, {"link/victim.txt": _sha(b"precious")})
    (out / "link").symlink_to(outside)
    with pytest.raises(DeepgenError, match="outside the project"):
        write_project(out, project_files(_tiny()), force=True)
    assert (outside / "victim.txt").read_bytes() == b"precious"


def test_generated_file_that_is_a_symlink_out_is_not_written_through(tmp_path):
    out = tmp_path / "proj"
    files = project_files(_tiny())
    write_project(out, files)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    (out / "README.md").unlink()
    (out / "README.md").symlink_to(victim)
    with pytest.raises(DeepgenError, match="outside the project"):
        write_project(out, files, force=True)
    assert victim.read_bytes() == b"precious"


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"generator": "deepgen", "files": [1]}',
                                  '{"generator": "deepgen", "files": {"a.txt": "beef"}}', "\xff\xfe"])
def test_malformed_manifest_is_a_clear_error(tmp_path, text):
    out = tmp_path / "proj"
    write_project(out, project_files(_tiny()))
    (out / ".deepgen" / "manifest.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(DeepgenError, match="manifest"):
        write_project(out, project_files(_tiny()))


def test_cli_reports_a_bad_manifest_in_one_line(tmp_path, capsys):
    out = _project_with_manifest(tmp_path, {"../../etc/passwd": "0" * 64})
    rc, _, err = cli(capsys, "generate", MLP, "-o", out, "--force")
    assert rc == 1 and "outside the project" in err and "Traceback" not in err


# -- 2. deepgen build hands pip a path, never a requirement name ----------------


def test_build_passes_a_resolved_file_url(tmp_path, monkeypatch):
    import subprocess

    from generator.tools import build

    project = tmp_path / "proj"
    write_project(project, project_files(_tiny()))
    seen = {}

    class Stop(Exception):
        pass

    def fake_popen(cmd, **kwargs):
        seen["cmd"] = cmd
        raise Stop

    monkeypatch.setattr(subprocess, "Popen", fake_popen)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Stop):
        build.build_project("proj", echo=lambda *a: None)
    assert seen["cmd"][-1] == project.resolve().as_uri()
    assert "proj" not in seen["cmd"][:-1]


def test_generate_suggests_a_path_pip_cannot_mistake_for_a_name(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, _ = cli(capsys, "generate", MLP, "-o", "proj", "--name", "mlp_suggest")
    assert rc == 0
    assert f"pip install .{os.sep}proj" in out and f"deepgen build .{os.sep}proj" in out


# -- 3. a project name never replaces an installed distribution or module -------


@pytest.mark.parametrize("name", ["sympy", "jinja2", "pytest"])
def test_name_of_an_installed_distribution_is_refused(tmp_path, capsys, name):
    rc, _, err = cli(capsys, "generate", MLP, "-o", tmp_path / "p", "--name", name)
    assert rc == 1 and f"'{name}'" in err and "installed distribution" in err and "--replace-installed" in err
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("name", ["json", "generator"])
def test_name_of_a_standard_or_deepgen_module_is_refused(tmp_path, capsys, name):
    rc, _, err = cli(capsys, "generate", MLP, "-o", tmp_path / "p", "--name", name)
    assert rc == 1 and f"'{name}'" in err


def test_build_refuses_a_project_named_after_an_installed_distribution(tmp_path, capsys):
    import sympy

    before = sympy.__file__
    rc, _, _ = cli(capsys, "generate", MLP, "-o", tmp_path / "p", "--name", "sympy", "--replace-installed")
    assert rc == 0
    rc, _, err = cli(capsys, "build", tmp_path / "p")
    assert rc == 1 and "sympy" in err and "uninstall" in err
    from importlib.metadata import distribution

    assert "deepgen" not in (distribution("sympy").metadata["Summary"] or "")
    assert Path(before).is_file()


def _dist_info(folder: Path, name: str, summary: str) -> None:
    info = folder / f"{name}-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1.0\nSummary: {summary}\n")
    (info / "RECORD").write_text(f"{name}.py,,\n")


def test_an_earlier_deepgen_build_of_the_name_is_not_a_conflict(tmp_path, monkeypatch):
    from generator.tools import installed

    _dist_info(tmp_path / "site", "mlp_earlier", "mlp_earlier: a model generated by deepgen from mlp.py")
    _dist_info(tmp_path / "site", "other_pkg", "a package of someone else's")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert installed.conflict("mlp_earlier") is None
    assert "'other_pkg' 0.1.0" in installed.conflict("other_pkg")


# -- 7. errors instead of tracebacks --------------------------------------------


@pytest.mark.parametrize("body, where, what", [
    ("raise RuntimeError('oops')\n", ":2", "RuntimeError: oops"),
    ("import sys\nsys.exit(3)\n", ":3", "sys.exit(3)"),
    ("@dg.model\ndef net():\n    x = dg.input('x', (2, 3))\n    y = 1 / 0\n    return x\n", ":5", "ZeroDivisionError"),
    ("@dg.model\ndef net():\n    raise SystemExit(0)\n", ":4", "sys.exit(0)"),
])
def test_exception_in_the_model_file_is_one_line_with_its_place(tmp_path, capsys, body, where, what):
    model = tmp_path / "bad.py"
    model.write_text("import generator as dg\n" + body)
    for cmd in ("check", "generate"):
        extra = ["-o", tmp_path / "out"] if cmd == "generate" else []
        rc, _, err = cli(capsys, cmd, model, *extra)
        assert rc == 1, err
        assert "Traceback" not in err and f"bad.py{where}" in err and what in err
    rc, _, err = cli(capsys, "check", model, "--debug")
    assert rc == 1 and "Traceback" in err


def test_output_naming_a_file_is_an_error(tmp_path, capsys):
    target = tmp_path / "afile"
    target.write_text("mine")
    rc, _, err = cli(capsys, "generate", MLP, "-o", target, "--name", "mlp_file")
    assert rc == 1 and "is a file" in err and "Traceback" not in err
    assert target.read_text() == "mine"


def test_name_too_long_leaves_nothing_behind(tmp_path, capsys):
    rc, _, err = cli(capsys, "generate", MLP, "-o", tmp_path / "new" / "p", "--name", "m" * 300)
    assert rc == 1 and "300 characters" in err and "Traceback" not in err
    assert not (tmp_path / "new").exists()


def test_a_failed_write_of_a_new_project_leaves_nothing_behind(tmp_path):
    files = dict(project_files(_tiny()))
    files["x" * 300 + ".txt"] = b"too long a name for the file system"
    with pytest.raises(DeepgenError, match="nothing was left behind"):
        write_project(tmp_path / "new" / "p", files)
    assert not (tmp_path / "new").exists()


# -- 8. sizes are checked, never materialized -----------------------------------


def _model_file(tmp_path, body):
    model = tmp_path / "size.py"
    model.write_text("import generator as dg\nN = dg.dim('N')\n@dg.model\ndef size():\n" + body)
    return model


def test_huge_parameter_is_refused_at_build_time(tmp_path, capsys):
    model = _model_file(tmp_path, "    x = dg.input('x', (N, 10**6))\n    w = dg.param('w', (10**6, 10**6))\n"
                                  "    return dg.matmul(x, w)\n")
    start = time.perf_counter()
    rc, _, err = cli(capsys, "generate", model, "-o", tmp_path / "out")
    assert rc == 1 and "size.py:6" in err and "limit of 2**36" in err
    assert time.perf_counter() - start < 30 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("body, what", [
    ("    x = dg.input('x', (2**40, 2**40))\n    return dg.relu(x)\n", "input"),
    ("    x = dg.input('x', (N, 2**40))\n    w = dg.param('w', (2**40, 1))\n    return dg.matmul(x, w)\n", "param"),
])
def test_products_that_overflow_int64_are_refused(tmp_path, capsys, body, what):
    rc, _, err = cli(capsys, "check", _model_file(tmp_path, body))
    assert rc == 1 and f"{what}:" in err and "Traceback" not in err and ("limit of 2**60" in err or "limit of 2**36" in err)


def test_result_whose_size_overflows_is_a_shape_error(tmp_path, capsys):
    body = ("    x = dg.input('x', (2**31, 2**31))\n    y = dg.input('y', (2**31, 2**31))\n"
            "    return dg.add(dg.reshape(x, (2**31, 1, 2**31)), dg.reshape(y, (1, 2**31, 2**31)))\n")
    rc, _, err = cli(capsys, "check", _model_file(tmp_path, body))
    assert rc == 1 and "limit of 2**60" in err and "size.py:" in err


def test_large_model_is_generated_without_materializing_its_reference(tmp_path, capsys):
    # 2**28 parameters (1 GiB of float32): fine to generate, too large to run the reference at generation.
    model = _model_file(tmp_path, "    x = dg.input('x', (N, 2**14))\n    w = dg.param('w', (2**14, 2**14))\n"
                                  "    return dg.matmul(x, w)\n")
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rc, _, err = cli(capsys, "generate", model, "-o", tmp_path / "out")
    assert rc == 0, err
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert grown < 2**29, f"generation grew the process by {grown} bytes"
    assert not (tmp_path / "out" / "tests" / "expected.npz").exists()
    assert "too large" in (tmp_path / "out" / "tests" / "test_model.py").read_text()
