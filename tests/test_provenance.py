"""Provenance: every generated statement, forward or gradient, cites the DSL call that made it,
quoted whole, and a layer helper's values carry the user's name= (issue #39, requirement 5)."""

from __future__ import annotations

import ast
import re
import textwrap

from conftest import ROOT
from generator.frontend.loader import load_model
from generator.pipeline import project_files


def _dsl_call_lines(path) -> dict:
    """{line: (first, last)} of each call `dg.<name>(...)` in the model file: the lines it spans."""
    spans = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                isinstance(node.func.value, ast.Name) and node.func.value.id == "dg":
            spans[node.lineno] = (node.lineno, node.end_lineno)
    return spans


def test_treelstm_gradient_cites_the_line_of_its_forward_call():
    """The recursion's gradient (the reverse level loop) cites dg.recurse's line, not the
    last line of the cells its rule differentiated (autodiff.backprop left gb.loc there);
    every other gradient statement cites the line of a forward op of its own region."""
    path = ROOT / "examples" / "treelstm_sentiment.py"
    graph = load_model(f"{path}:treelstm_sentiment").build()
    cpp = project_files(graph)["src/model.cpp"].decode()
    recurse = next(n for n in graph.nodes if n.op == "recurse" and n.phase != "backward")
    cells = [recurse.attrs["spec"].leaf, recurse.attrs["spec"].internal]
    cell_lines = {n.loc.line for c in cells for n in c.nodes if n.loc}
    top_lines = {n.loc.line for n in graph.nodes if n.loc and n.phase != "backward"}
    assert cell_lines and not cell_lines & top_lines  # (the test can tell them apart)
    for n in graph.nodes:
        if n.phase == "backward":  # the graph's own gradient nodes: at their forward op
            assert n.loc.line in top_lines, (n.op, n.loc)
    backward = cpp[cpp.index("// gradient of"):]
    cited = [int(m) for m in re.findall(r"// gradient of treelstm_sentiment\.py:(\d+)", backward)]
    assert cited and set(cited) <= top_lines, cited
    loops = [int(m) for m in re.findall(r"recurse over '\w+' \(treelstm_sentiment\.py:(\d+)\)", cpp)]
    assert loops == [recurse.loc.line] * 2, loops  # the forward loop and the gradient's
    inner = [int(m) for m in re.findall(r"^ {4,}// treelstm_sentiment\.py:(\d+)", backward, re.M)]
    assert inner and set(inner) <= cell_lines, inner
    assert _dsl_call_lines(path)[recurse.loc.line]  # the cited line is the dg.recurse call's


MODEL = '''\
import generator as dg


@dg.model
def prov():
    x = dg.input("x", (2, 8))
    h = dg.relu(x @ dg.param("w", (8, 8)),  # a comment inside the call
                )  # and one after it
    for i in range(2):
        h = dg.dense(h, 8, act=dg.tanh,
                     name=f"fc{i}")
    return {"y": h}
'''


def test_a_multi_line_call_is_quoted_whole_and_each_pass_of_a_loop_apart(tmp_path):
    path = tmp_path / "prov.py"
    path.write_text(MODEL)
    cpp = project_files(load_model(f"{path}:prov").build())["src/model.cpp"].decode()
    # as one line the way a person writes it on one: no trailing comma, no space inside brackets
    assert '// prov.py:7  h = dg.relu(x @ dg.param("w", (8, 8)))  # and one after it' in cpp
    quoted = '// prov.py:10  h = dg.dense(h, 8, act=dg.tanh, name=f"fc{i}")'
    run = cpp[cpp.index("Network::_run"):]
    assert run.count(quoted) == 2, run  # one block per call, each under its own comment
    first, second = run.index(quoted), run.rindex(quoted)
    assert "fc0_w" in run[first:second] and "fc1_w" not in run[first:second]
    assert "fc1_w" in run[second:]


def test_a_multi_line_call_is_quoted_whole_in_errors(tmp_path):
    from generator.errors import ModelError

    path = tmp_path / "bad.py"
    path.write_text(textwrap.dedent('''\
        import generator as dg

        @dg.model
        def bad():
            x = dg.input("x", (2, 8))
            y = dg.matmul(x,
                          dg.param("w", (3, 4)))
            return {"y": y}
        '''))
    try:
        load_model(f"{path}:bad").build()
    except ModelError as e:
        assert 'y = dg.matmul(x, dg.param("w", (3, 4)))' in str(e), str(e)
    else:
        raise AssertionError("a shape error was expected")


def test_bert_layers_name_every_value_after_name():
    """transformer_encoder_layer(name="encoder_layers_0") names what it makes
    encoder_layers_0_q, ..._scores, ..., and its result encoder_layers_0; each layer of the
    loop is a call of its own in the C++, citing the line with its arguments' values (the
    first layer's mask, inline before its call, under the line quoted whole)."""
    path = ROOT / "examples" / "bert_encoder.py"
    graph = load_model(f"{path}:bert_encoder").build()
    layer_nodes = [n for n in graph.nodes if n.loc and n.loc.line == 44]
    runs = sorted({n.loc.run for n in layer_nodes})
    assert len(runs) == 2
    for i, run in enumerate(runs):
        names = [v.name for n in layer_nodes if n.loc.run == run for v in n.outputs]
        assert names and all(name.startswith(f"encoder_layers_{i}") for name in names), names
        for part in ("q", "k", "v", "scores", "weights", "context", "self_attn", "norm1", "residual2"):
            assert f"encoder_layers_{i}_{part}" in names, (part, names)
        assert f"encoder_layers_{i}" in names
    cpp = project_files(graph)["src/model.cpp"].decode()
    run = cpp[cpp.index("Network::_run"):]
    quoted = ('// bert_encoder.py:44  x = dg.transformer_encoder_layer(x, lengths, H, cfg["heads"], cfg["ffn"], '
              'activation="gelu", eps=1e-12, name=f"encoder_layers_{i}")')
    assert run.count(quoted) == 1
    for i in range(2):
        assert re.search(rf"// bert_encoder\.py:44  transformer_encoder_layer\(x, lengths, .*name='encoder_layers_{i}'\)\n",
                         run), i
    assert len(re.findall(r"^\s+transformer_encoder_layer\(", run, re.M)) == 2
