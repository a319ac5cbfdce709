"""Regeneration merges hand edits (codegen/merge.py, emit.write_project), and
`deepgen ir --dot/--svg` draws the graph (ir/dot.py).

The merge is checked on its own (diff3 cases), on small file sets written by
write_project, and end to end: the mlp example edited by hand, its model
changed, regenerated, built, and compared with the numpy reference."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from conftest import ROOT
from generator.codegen.writer import BASE_DIR, BESIDE, PREMERGE_DIR, MergeConflicts, write_project
from generator.codegen.merge import merge3, merge_file
from generator.errors import DeepgenError
from generator.tools.cli import main

MLP = ROOT / "examples" / "mlp.py"
MARKERS = ("<<<<<<< ours (your edits)\n", "||||||| base\n", "=======\n", ">>>>>>> theirs (new generation)\n")


def lines(*items):
    return "".join(f"{item}\n" for item in items)


# -- the merge itself ------------------------------------------------------------

BASE = lines("a", "b", "c", "d", "e", "f")


def test_disjoint_edits_both_kept():
    m = merge3(BASE, lines("a", "B", "c", "d", "e", "f"), lines("a", "b", "c", "d", "E", "f"))
    assert m.clean and m.text == lines("a", "B", "c", "d", "E", "f")


def test_one_side_only():
    ours = lines("a", "b", "inserted", "c", "d", "e", "f")
    assert merge3(BASE, ours, BASE).text == ours
    assert merge3(BASE, BASE, ours).text == ours


def test_same_edit_on_both_sides_once():
    both = lines("a", "b", "X", "d", "e", "f", "g")
    m = merge3(BASE, both, both)
    assert m.clean and m.text == both


def test_overlapping_edits_leave_markers():
    m = merge3(BASE, lines("a", "b", "ours", "d", "e", "f"), lines("a", "b", "theirs", "d", "e", "f"))
    assert m.conflict_lines == [3]
    assert m.text == lines("a", "b") + MARKERS[0] + lines("ours") + MARKERS[1] + lines("c") + MARKERS[2] \
        + lines("theirs") + MARKERS[3] + lines("d", "e", "f")


def test_deletion_against_edit_conflicts():
    m = merge3(BASE, lines("a", "b", "d", "e", "f"), lines("a", "b", "C", "d", "e", "f"))
    assert not m.clean and "C\n" in m.text and m.text.count(MARKERS[0]) == 1


def test_insertions_at_the_end():
    ours = BASE + lines("mine")
    m = merge3(BASE, ours, lines("A") + BASE[2:])
    assert m.clean and m.text == lines("A", "b", "c", "d", "e", "f", "mine")
    # Both append different lines: a conflict with an empty base part.
    m = merge3(BASE, ours, BASE + lines("new"))
    assert m.text == BASE + MARKERS[0] + lines("mine") + MARKERS[1] + MARKERS[2] + lines("new") + MARKERS[3]


def test_empty_files_and_missing_final_newline():
    assert merge3("", "", "").text == ""
    assert merge3("", "", lines("x")).text == lines("x")
    assert merge3(lines("x"), "", lines("x")).text == ""  # the user emptied it; the generation did not change it
    m = merge3("a\nb\nc", "a\nb\nC", "A\nb\nc")  # no final newline anywhere
    assert m.clean and m.text == "A\nb\nC"
    assert not merge3("a\nb", "a\nB", "A\nb").clean  # as in diff3, changes to adjacent lines are one region
    m = merge3("a", "ours", "theirs")  # markers stay on lines of their own
    assert m.text == MARKERS[0] + "ours\n" + MARKERS[1] + "a\n" + MARKERS[2] + "theirs\n" + MARKERS[3]


def test_repeated_lines_align():
    """Many identical lines (braces, blanks) must not make edits in different functions collide."""
    body = [f"void f{i}() {{\n  work({i});\n}}\n\n" for i in range(300)]
    base = "".join(body)
    ours = base.replace("  work(3);\n", "  work(3);\n  extra();\n")
    theirs = base.replace("  work(250);\n", "  work(250, fast);\n")
    m = merge3(base, ours, theirs)
    assert m.clean and m.text == ours.replace("  work(250);\n", "  work(250, fast);\n")


def test_merge_file_cases():
    assert merge_file(None, b"x\n", b"y\n").conflict.startswith("no stored earlier generation")
    assert merge_file(b"a\n", b"mine\n", b"a\n").data is None  # generation unchanged: the user's file stands
    binary = merge_file(b"\0a", b"\0b", b"\0c")
    assert binary.data is None and binary.beside == b"\0c" and "binary" in binary.conflict
    assert merge_file(b"a\n", b"\xff\n", b"b\n").beside == b"b\n"  # not UTF-8
    pending = merge_file(b"a\n", b"b\n", b"c\n", pending=True)
    assert pending.data is None and pending.beside == b"c\n" and "still there" in pending.conflict


# -- write_project on small file sets --------------------------------------------------


def test_regeneration_merges_and_keeps_the_premerge_copy(tmp_path):
    write_project(tmp_path, {"f.txt": BASE.encode()})
    ours = lines("a", "B", "c", "d", "e", "f")
    (tmp_path / "f.txt").write_text(ours)
    result = write_project(tmp_path, {"f.txt": lines("a", "b", "c", "d", "E", "f").encode()})
    assert result.merged == ["f.txt"] and not result.conflicts
    assert (tmp_path / "f.txt").read_text() == lines("a", "B", "c", "d", "E", "f")
    assert (tmp_path / PREMERGE_DIR / "f.txt").read_text() == ours
    # The base moves on to the new generation: regenerating the same thing is quiet.
    assert (tmp_path / BASE_DIR / "f.txt").read_text() == lines("a", "b", "c", "d", "E", "f")
    again = write_project(tmp_path, {"f.txt": lines("a", "b", "c", "d", "E", "f").encode()})
    assert not again.merged and not again.notes


def test_conflict_is_raised_after_writing_everything(tmp_path):
    write_project(tmp_path, {"f.txt": BASE.encode(), "g.txt": b"1\n"})
    (tmp_path / "f.txt").write_text(lines("a", "b", "mine", "d", "e", "f"))
    with pytest.raises(MergeConflicts, match=r"f\.txt: conflict markers at line 3") as e:
        write_project(tmp_path, {"f.txt": lines("a", "b", "new", "d", "e", "f").encode(), "g.txt": b"2\n"})
    assert (tmp_path / "g.txt").read_text() == "2\n"
    assert MARKERS[0] in (tmp_path / "f.txt").read_text()
    assert (tmp_path / PREMERGE_DIR / "f.txt").read_text() == lines("a", "b", "mine", "d", "e", "f")
    assert len(e.value.result.conflicts) == 1


def test_binary_files_are_not_merged(tmp_path):
    write_project(tmp_path, {"w.bin": b"\0\1\2"})
    (tmp_path / "w.bin").write_bytes(b"\0mine")
    write_project(tmp_path, {"w.bin": b"\0\1\2"})  # generation unchanged: the user's file stands
    assert (tmp_path / "w.bin").read_bytes() == b"\0mine"
    with pytest.raises(MergeConflicts, match=r"w\.bin: binary"):
        write_project(tmp_path, {"w.bin": b"\0new"})
    assert (tmp_path / "w.bin").read_bytes() == b"\0mine"
    assert (tmp_path / f"w.bin{BESIDE}").read_bytes() == b"\0new"


def test_project_without_stored_base(tmp_path):
    """A project made before bases were stored: an edited file cannot be merged,
    so it is left alone with the new generation beside it, until the user has
    merged it by hand and deleted that file."""
    write_project(tmp_path, {"f.txt": BASE.encode()})
    for path in sorted((tmp_path / BASE_DIR).rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    (tmp_path / "f.txt").write_text(BASE + lines("mine"))
    new = lines("A") + BASE[2:]
    for _ in range(2):  # the second time: the unmerged file beside is still there
        with pytest.raises(MergeConflicts, match="f.txt: "):
            write_project(tmp_path, {"f.txt": new.encode()})
        assert (tmp_path / "f.txt").read_text() == BASE + lines("mine")
        assert (tmp_path / f"f.txt{BESIDE}").read_text() == new
    (tmp_path / "f.txt").write_text(new + lines("mine"))  # merged by hand
    (tmp_path / f"f.txt{BESIDE}").unlink()
    write_project(tmp_path, {"f.txt": new.encode()})
    assert (tmp_path / "f.txt").read_text() == new + lines("mine")


def test_deleted_file_stays_deleted_unless_restored(tmp_path):
    write_project(tmp_path, {"f.txt": b"1\n", "g.txt": b"1\n"})
    (tmp_path / "g.txt").unlink()
    result = write_project(tmp_path, {"f.txt": b"2\n", "g.txt": b"2\n"})
    assert not (tmp_path / "g.txt").exists() and any("g.txt: you deleted it" in n for n in result.notes)
    write_project(tmp_path, {"f.txt": b"2\n", "g.txt": b"3\n"})
    assert not (tmp_path / "g.txt").exists()
    write_project(tmp_path, {"f.txt": b"2\n", "g.txt": b"3\n"}, restore=True)
    assert (tmp_path / "g.txt").read_text() == "3\n"


def test_file_no_longer_generated(tmp_path):
    write_project(tmp_path, {"f.txt": b"1\n", "old.txt": b"1\n", "edited.txt": b"1\n"})
    (tmp_path / "edited.txt").write_text("mine\n")
    result = write_project(tmp_path, {"f.txt": b"1\n"})
    assert not (tmp_path / "old.txt").exists() and not (tmp_path / BASE_DIR / "old.txt").exists()
    assert (tmp_path / "edited.txt").read_text() == "mine\n"
    assert any("edited.txt: no longer generated, but you edited it" in n for n in result.notes)
    assert set(json.loads((tmp_path / ".deepgen" / "manifest.json").read_text())["files"]) == {"f.txt"}


def test_force_overwrites_but_keeps_the_edits(tmp_path):
    write_project(tmp_path, {"f.txt": BASE.encode(), "gone.txt": b"1\n"})
    (tmp_path / "f.txt").write_text("mine\n")
    (tmp_path / "gone.txt").unlink()
    write_project(tmp_path, {"f.txt": b"new\n", "gone.txt": b"2\n"}, force=True)
    assert (tmp_path / "f.txt").read_text() == "new\n" and (tmp_path / "gone.txt").read_text() == "2\n"
    assert (tmp_path / PREMERGE_DIR / "f.txt").read_text() == "mine\n"


# -- end to end: the mlp example -------------------------------------------------------

FORWARD_RETURN = "  return outputs;\n}\n"
DOUBLE_LOGITS = ("  // my edit: report doubled logits\n"
                 "  for (auto i = outputs.logits.size(); i-- > 0;) outputs.logits.ptr()[i] *= 2.0f;\n")


def _variant(tmp_path, hidden: int):
    """examples/mlp.py with the second layer `hidden` wide, as mlp.py in its own folder
    (the generated comments cite the file by name)."""
    folder = tmp_path / f"h{hidden}"
    folder.mkdir()
    text = MLP.read_text()
    assert "dg.dense(h1, 256" in text
    (folder / "mlp.py").write_text(text.replace("dg.dense(h1, 256", f"dg.dense(h1, {hidden}"))
    return folder / "mlp.py"


def _generate(capsys, model, out, *flags):
    rc = main(["generate", str(model), "-o", str(out), "--name", "mlp_merged", *flags])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _edit_forward(model_cpp):
    text = model_cpp.read_text()
    start = text.index("Outputs Model::forward(")
    at = text.index(FORWARD_RETURN, start)
    model_cpp.write_text(text[:at] + DOUBLE_LOGITS + text[at:])


def test_edit_and_model_change_merge_and_build(tmp_path, capsys, builds):
    from generator.frontend.loader import load_model
    from generator.reference import interpreter as reference

    out = tmp_path / "proj"
    assert _generate(capsys, MLP, out)[0] == 0
    model_cpp = out / "src" / "model.cpp"
    _edit_forward(model_cpp)
    (out / "tests" / "test_model.py").unlink()
    rc, stdout, err = _generate(capsys, _variant(tmp_path, 128), out)
    assert rc == 0, err
    assert "src/model.cpp: your edits merged" in stdout and "tests/test_model.py: you deleted it" in stdout
    text = model_cpp.read_text()
    assert DOUBLE_LOGITS in text and "/*N=*/128" in text and "/*N=*/256" not in text
    assert not (out / "tests" / "test_model.py").exists()
    # The merged tree builds, and its forward() is the new model's with the edit applied.
    graph = load_model(str(tmp_path / "h128" / "mlp.py")).build("mlp_merged")
    manifest = json.loads((out / ".deepgen" / "manifest.json").read_text())
    files = {rel: (out / rel).read_bytes() for rel in manifest["files"] if (out / rel).exists()}
    project = builds.project(graph, files)
    import importlib
    import sys

    sys.path.insert(0, str(project / "build"))
    try:
        module = importlib.import_module("mlp_merged")
    finally:
        sys.path.remove(str(project / "build"))
    x = np.random.default_rng(0).standard_normal((5, 784)).astype(np.float32)
    want = reference.run(graph, {"x": x})["logits"]
    np.testing.assert_allclose(module.Model(0).forward(x=x)["logits"], 2 * want, rtol=1e-5, atol=1e-5)


def test_overlapping_edit_gives_markers_and_fails(tmp_path, capsys):
    out = tmp_path / "proj"
    assert _generate(capsys, MLP, out)[0] == 0
    model_cpp = out / "src" / "model.cpp"
    mine = model_cpp.read_text().replace("/*K=*/512, /*N=*/256,", "/*K=*/512, /*N=*/256 /* checked */,", 1)
    model_cpp.write_text(mine)
    rc, _, err = _generate(capsys, _variant(tmp_path, 128), out)
    assert rc == 1 and "could not be merged" in err and "src/model.cpp: conflict markers at line" in err
    assert "Traceback" not in err
    text = model_cpp.read_text()
    assert all(marker in text for marker in MARKERS) and "/* checked */" in text and "/*N=*/128" in text
    assert (out / PREMERGE_DIR / "src" / "model.cpp").read_text() == mine
    conflicted = [line for line in err.splitlines() if "conflict markers" in line]
    assert len(conflicted) == 1, err  # only model.cpp


def test_restore_flag_brings_a_deleted_file_back(tmp_path, capsys):
    out = tmp_path / "proj"
    assert _generate(capsys, MLP, out)[0] == 0
    readme = (out / "README.md").read_bytes()
    (out / "README.md").unlink()
    assert _generate(capsys, MLP, out)[0] == 0 and not (out / "README.md").exists()
    assert _generate(capsys, MLP, out, "--restore")[0] == 0
    assert (out / "README.md").read_bytes() == readme


# -- deepgen ir --dot / --svg ------------------------------------------------------------

NODE = re.compile(r'^  (\w+) \[label="((?:[^"\\]|\\.)*)", (.*)\];$')
EDGE = re.compile(r"^  (\w+) -> (\w+)(?: \[label=\"(\w+)\"\])?;$")


def _parse(dot: str):
    rows = dot.splitlines()
    assert rows[0].startswith("digraph ") and rows[-1] == "}"
    nodes, edges = {}, []
    for row in rows[1:-1]:
        if m := NODE.match(row):
            nodes[m.group(1)] = (m.group(2), m.group(3))
        elif m := EDGE.match(row):
            edges.append((m.group(1), m.group(2)))
        else:
            assert re.match(r"^  (rankdir|node|edge)\b", row), row
    return nodes, edges


@pytest.mark.parametrize("grad", [False, True])
def test_dot_has_every_node_and_edge(tmp_path, capsys, grad):
    from generator.frontend.loader import load_model
    from generator.transforms.autodiff import prepare_training

    dot = tmp_path / "g.dot"
    assert main(["ir", str(MLP), "--dot", str(dot)] + (["--grad"] if grad else [])) == 0
    assert "written to" in capsys.readouterr().out
    nodes, edges = _parse(dot.read_text())
    graph = load_model(str(MLP)).build()
    if grad:
        prepare_training(graph)
    # Where each value must come from, from the graph: its DOT node, whose label names it.
    source = {}
    for i, v in enumerate(graph.inputs):
        source[id(v)] = f"in{i}"
        assert nodes[f"in{i}"][0] == f"input {v.name}\\n{v.type_str()}"
    for i, p in enumerate(graph.params):
        source[id(p)] = f"p{i}"
        assert nodes[f"p{i}"][0] == f"param {p.name}\\n{p.type_str()}"
    assert len([key for key in nodes if key.startswith("n")]) == len(graph.nodes)
    for i, node in enumerate(graph.nodes):
        label, style = nodes[f"n{i}"]
        assert label.startswith(node.attrs.get("fn", node.op) + "\\n"), label
        for v in node.outputs:
            source[id(v)] = f"n{i}"
            assert f"{v.name}: {v.type_str()}" in label
        assert ("#f3f4f6" in style) == (node.phase == "backward")
    want = [(source[id(v)], f"n{i}") for i, n in enumerate(graph.nodes) for v in n.inputs]
    want += [(source[id(v)], f"out{i}") for i, (_, v) in enumerate(graph.outputs)]
    assert sorted(edges) == sorted(want)
    # Deterministic: the same text again.
    assert main(["ir", str(MLP), "--dot", str(tmp_path / "again.dot")] + (["--grad"] if grad else [])) == 0
    assert (tmp_path / "again.dot").read_bytes() == dot.read_bytes()


def test_dot_quotes_labels():
    from generator.ir.dot import quote

    assert quote('a "b" \\ c\nd') == '"a \\"b\\" \\\\ c\\nd"'


def test_svg_without_graphviz_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no `dot` here
    rc = main(["ir", str(MLP), "--svg", str(tmp_path / "g.svg")])
    err = capsys.readouterr().err
    assert rc == 1 and "Graphviz" in err and "not installed" in err and "--dot" in err
    assert not (tmp_path / "g.svg").exists()


def test_svg_runs_dot(tmp_path, capsys, monkeypatch):
    """With a stand-in `dot` on PATH: it is given the DOT text and its output is the file."""
    fake = tmp_path / "bin" / "dot"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nPATH=/usr/bin:/bin\n[ "$1" = "-Tsvg" ] || exit 2\ncat > "$0.input"\necho "<svg/>"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(fake.parent))
    assert main(["ir", str(MLP), "--svg", str(tmp_path / "g.svg"), "--dot", str(tmp_path / "g.dot")]) == 0
    assert (tmp_path / "g.svg").read_text() == "<svg/>\n"
    assert (tmp_path / "bin" / "dot.input").read_bytes() == (tmp_path / "g.dot").read_bytes()


def test_dot_refuses_a_lowered_plan(tmp_path, capsys):
    assert main(["ir", str(MLP), "--after", "lower", "--dot", str(tmp_path / "g.dot")]) == 1
    assert "draw a graph" in capsys.readouterr().err


def test_stored_generation_folder_linked_outside_is_refused(tmp_path):
    """.deepgen/base is inside the project like every generated file: a link out is an error."""
    outside = tmp_path / "outside"
    (outside / "f.txt").parent.mkdir(parents=True)
    (outside / "f.txt").write_bytes(b"precious")
    out = tmp_path / "proj"
    write_project(out, {"f.txt": b"1\n"})
    (out / BASE_DIR / "f.txt").unlink()
    (out / BASE_DIR).rmdir()
    (out / BASE_DIR).symlink_to(outside)
    with pytest.raises(DeepgenError, match="outside the project"):
        write_project(out, {"f.txt": b"2\n"})
    assert (outside / "f.txt").read_bytes() == b"precious" and (out / "f.txt").read_bytes() == b"1\n"
