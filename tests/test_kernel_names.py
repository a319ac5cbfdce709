"""Elementwise kernels: one per distinct body, named for what it computes, sizes as
arguments (codegen/kernel_table.py)."""

from __future__ import annotations

import re

import pytest

from conftest import ROOT
from generator.codegen.stmt import Call, Named, nested_lines
from generator.frontend.loader import load_model
from generator.pipeline import lowered, prepare, project_files


def _plan(source: str, target: str = "cpu", **options):
    return lowered(prepare(load_model(source).build(None, **options)), target)


def _loop_kernels(text: str) -> dict:
    """name -> the definition's text with its own name and arguments' names abstracted."""
    out = {}
    for m in re.finditer(r"^void (\w+)\(([^)]*)\) \{\n(.*?)^\}", text, re.S | re.M):
        name, params, body = m.groups()
        names = [p.split()[-1] for p in params.replace("\n", " ").split(",")]
        for j, arg in enumerate(names):
            body = re.sub(rf"\b{re.escape(arg)}\b", f"@{j}", body)
        out[name] = body.replace(f'"{name}"', '"@"')  # CUDA names the kernel in its launch
    return out


def _calls(plan) -> list:
    """Every kernel call of the plan (forward, loss, backward)."""
    groups = [plan.statements] + ([plan.train.loss_statements, plan.train.backward_statements] if plan.train else [])
    return [line for group in groups for s in group for line in nested_lines(s.lines)
            if isinstance(line, Call) and line.fn.startswith("kernels::")]


@pytest.mark.parametrize("example,target", [("resnet18", "cpu"), ("lstm_classifier", "cpu"),
                                            ("treelstm_sentiment", "cuda"), ("gru_tagger", "cpu")])
def test_no_two_kernels_have_the_same_body(example, target):
    """Kernels that differ only in their names or sizes were printed once each per
    node before (ResNet-18: 47 kernels, 5 different bodies)."""
    files = project_files(load_model(str(ROOT / "examples" / f"{example}.py")).build(None), target)
    ext = ".cu" if target == "cuda" else ".cpp"
    bodies = _loop_kernels(files[f"src/kernels{ext}"].decode())
    assert len(set(bodies.values())) == len(bodies), sorted(bodies)
    assert not any(re.search(r"_\d+$", name) for name in bodies), sorted(bodies)  # no numbered names


def test_resnet18_has_one_kernel_per_function_whatever_the_sizes():
    plan = _plan(str(ROOT / "examples" / "resnet18.py"))
    loops = sorted(k.name for k in plan.kernels if k.kind == "loop")
    # Fusion stays inside one call of basic_block (transforms/passes.py): a block's input
    # gradient is summed (`add`) in the block that reads it, and the pooling's gradient is
    # its own kernel (`d_mean_rows`), not fused into the last block's.
    assert loops == ["add", "add_relu", "d_add_relu", "d_mean_rows", "relu", "sgd_update"]
    # Every call of one kernel has the same form: operands, then the same Named sizes.
    forms, sizes = {}, {}
    for call in _calls(plan):
        named = tuple(a.name for a in call.args if isinstance(a, Named))
        forms.setdefault(call.fn, set()).add((len(call.args), named))
        sizes.setdefault(call.fn, set()).update(str(a.arg) for a in call.args if isinstance(a, Named))
    assert all(len(f) == 1 for f in forms.values()), forms
    assert forms["kernels::relu"] == {(3, ("n",))}
    # One relu serves every stage: 64 channels at 32x32, then 128 at 16x16, ...
    assert {"65536*N", "32768*N", "16384*N", "8192*N"} <= sizes["kernels::relu"]


def test_the_broadcast_pattern_names_apart_what_the_chain_does_not(tmp_path):
    model = tmp_path / "adds.py"
    model.write_text(
        "import generator as dg\n"
        "N = dg.dim('N')\n"
        "@dg.model\n"
        "def adds():\n"
        "    x = dg.input('x', (N, 8))\n"
        "    b = dg.param('b', (8,))\n"
        "    s = dg.input('s', (N, 1))\n"
        "    return {'y': x + b, 'z': x + s, 'w': x + x}\n"  # outputs: not fused into one kernel
    )
    plan = _plan(str(model))
    kernels = {k.name: k for k in plan.kernels if k.kind == "loop"}
    assert sorted(kernels) == ["add", "add_bias", "add_rows"]
    assert kernels["add_bias"].assign == "out[_i0*n1 + _i1] = x0[_i0*n1 + _i1] + x1[_i1];"
    assert kernels["add_rows"].assign == "out[_i0*n1 + _i1] = x0[_i0*n1 + _i1] + x1[_i0];"
    assert [str(c) for c in _calls(plan)] == ["kernels::add_bias(x, b.ptr(), y.data(), /*n0=*/N, /*n1=*/8);",
                                              "kernels::add_rows(x, s, z.data(), /*n0=*/N, /*n1=*/8);",
                                              "kernels::add(x, w.data(), /*n=*/8*N);"]


def test_epilogues_that_add_one_bias_or_two_are_named_apart():
    """The LSTM's gate products add two biases in their epilogue, the classifier's one: the
    way both biases are read is said once, in the plural, instead of a number."""
    files = project_files(load_model(str(ROOT / "examples" / "lstm_classifier.py")).build(None))
    structs = re.findall(r"^struct (\w+) \{", files["src/kernels.h"].decode(), re.M)
    assert {"add_biases_epilogue", "add_bias_epilogue"} <= set(structs), structs
    assert not any(re.search(r"_\d+$", name) for name in structs), structs
    text = files["src/model.cpp"].decode()
    assert "kernels::add_biases_epilogue{lstm_bias_ih_l0.ptr(), lstm_bias_hh_l0.ptr()}" in text
    assert "kernels::add_bias_epilogue{classifier_b.ptr()}" in text
