"""The generated code says each thing once and holds nothing dead (issue #39, 3 and 7):
arena offsets are a named region's start plus a constant, no expression printed
twice; only the runtime headers a project uses are copied and included; a model
without optimizer state has no empty optimizer bodies; no comment repeats its line."""

from __future__ import annotations

import re

import pytest
import sympy

from conftest import build_example
from generator.codegen.stmt import nested_lines
from generator.frontend.loader import load_model
from generator.memory.bases import Bases
from generator.memory.planner import Buffer
from generator.pipeline import lowered, prepare, project_files

N = sympy.Symbol("N", positive=True, integer=True)


def _arena_lines(plan) -> list:
    groups = [plan.statements, plan.train.loss_statements, plan.train.backward_statements]
    return [str(line) for group in groups for s in group for line in nested_lines(s.lines) if "_arena.at(" in str(line)]


def test_resnet_offsets_are_named_bases_plus_constants():
    plan = lowered(prepare(build_example("resnet18")))
    memory = plan.memory
    lines = _arena_lines(plan)
    assert lines and not [line for line in lines if "std::max" in line]
    assert "std::max" not in memory["arena"] and "std::max" not in memory["arena_bound"]
    names = [name for name, _ in memory["bases"]]
    assert names and len(set(names)) == len(names)
    # Batch norm's statistics sit above activations that grow differently with N: named once,
    # each block that name plus a constant.
    assert "bn1_mean_at" in names
    assert any(re.fullmatch(r"float\* bn1_invstd = _arena.at\(bn1_mean_at \+ \d+, \d+\);", line) for line in lines)
    # No polynomial of a maximum is printed twice: a region that holds another's names it.
    values = " ".join(value for _, value in memory["bases"])
    polys = re.findall(r"\d+\*N \+ \d+", values)
    assert polys and len(polys) == len(set(polys))


def test_bases_name_a_region_and_the_regions_inside_it():
    def buffer(name, offset, phase="forward"):
        b = Buffer(name, 4, 0, 1, phase)
        b.offset = offset
        return b

    inner = sympy.Max(3 * N + 10, 2 * N + 20)
    outer = sympy.Max(4 * N, inner + 8)
    buffers = [buffer("a", inner), buffer("b", inner + 4), buffer("c", outer), buffer("d", 5 * N)]
    bases = Bases((N,), taken={"a_at_unused"})
    bases.place(buffers)
    assert [bases.offset(b) for b in buffers] == ["a_at", "a_at + 4", "c_at", "5*N"]
    assert bases.declarations() == [
        ("a_at", "std::max<std::int64_t>({3*N + 10, 2*N + 20})"),
        ("c_at", "std::max<std::int64_t>({4*N, a_at + 8})"),
    ]
    assert bases.size(outer + 16, "top") == "c_at + 16"
    assert bases.size(6 * N, "top") == "6*N"
    # Every polynomial computed in int64 is at most the bound that is checked in double first.
    assert sympy.expand(bases.bound([inner + 4, outer + 16, 5 * N]) - (5 * N + 44)) == 0


def test_a_base_name_avoids_the_names_of_the_function():
    b = Buffer("x", 4, 0, 1, "forward")
    b.offset = sympy.Max(3 * N + 1, 2 * N + 5)
    bases = Bases((N,), taken={"x_at"})
    bases.place([b])
    assert bases.offset(b) == "x_at_2"


def test_mlp_project_copies_and_includes_only_the_headers_it_uses():
    files = project_files(build_example("mlp"))
    runtime = {path.split("/", 1)[1] for path in files if path.startswith("runtime/")}
    assert "dg_conv.h" not in runtime and "dg_tree.h" not in runtime and "dg_modes.h" not in runtime
    model = files["src/model.cpp"].decode()
    included = set(re.findall(r'#include "(dg_\w+\.h)"', model))
    assert included <= runtime and "dg_matmul.h" in included and "dg_conv.h" not in included
    # Each copied header is included by a generated file or by another copied header.
    texts = [v.decode() for k, v in files.items() if k.endswith((".h", ".cpp"))]
    for header in runtime:
        assert any(f'#include "{header}"' in text for text in texts), header


PLAIN_SGD = '''import generator as dg

N = dg.dim("N")


@dg.model
def plain():
    x = dg.input("x", (N, 3))
    labels = dg.input("labels", (N,), dtype="int64")
    logits = dg.dense(dg.dense(x, 4, act=dg.relu), 2)
    dg.train(dg.softmax_cross_entropy(logits, labels), dg.sgd(lr=0.1))
    return {"logits": logits}
'''


def test_a_model_without_optimizer_state_prints_no_empty_bodies(tmp_path):
    (tmp_path / "plain.py").write_text(PLAIN_SGD)
    files = project_files(load_model(str(tmp_path / "plain.py")).build())
    model, header = files["src/model.cpp"].decode(), files["include/plain/model.h"].decode()
    for text in (model, header):
        assert "optimizer_slots" not in text and "optimizer_state_allocated" not in text
        assert "allocate_optimizer_state" not in text
    assert "[this] {}" not in model and "return {};" not in model
    # Python's optimizer_state() stays, as on every trainable module: an empty dict.
    assert re.search(r'\.def\(\s*"optimizer_state"', files["src/bindings.cpp"].decode())


def test_no_comment_repeats_the_update_beside_it(tmp_path):
    (tmp_path / "plain.py").write_text(PLAIN_SGD)
    model = project_files(load_model(str(tmp_path / "plain.py")).build())["src/model.cpp"].decode()
    assert "kernels::sgd_update(" in model
    assert not re.search(r"// \w+: gradient complete", model)


def test_a_header_is_needed_for_what_the_code_calls_not_what_comments_and_strings_name():
    from generator.codegen.runtime_headers import RuntimeHeaders
    from generator.codegen.targets import load_target

    runtime = RuntimeHeaders(load_target("cpu").runtime_sources())
    code = 'dg::conv2d(x);  // then dg::schedule_levels\ndg::require(ok, "dg::gather_rows failed");'
    assert runtime.used_by(code) == ["dg_conv.h", "dg_tensor.h"]
    assert set(runtime.included(['#include "dg_conv.h"'])) == {"dg_conv.h", "dg_conv_geom.h", "dg_gemm.h",
                                                                "dg_parallel.h", "dg_arena.h", "dg_modes.h", "dg_rng.h",
                                                                "dg_packed_weights.h", "dg_tensor.h"}
    try:
        runtime.used_by("dg::no_such_function(1);")
    except KeyError as e:
        assert "dg::no_such_function" in str(e)
    else:
        raise AssertionError("a name no header defines was accepted")


def _calls(text: str, fn: str) -> list:
    """The argument lists of each call of `fn` in `text` (top-level commas split them)."""
    found = []
    for m in re.finditer(rf"\b{re.escape(fn)}\(", text):
        depth, args, start = 1, [], m.end()
        for i in range(m.end(), len(text)):
            c = text[i]
            if c in "([{":
                depth += 1
            elif c in ")]}":
                depth -= 1
                if depth == 0:
                    args.append(text[start:i])
                    break
            elif c == "," and depth == 1:
                args.append(text[start:i])
                start = i + 1
        found.append([" ".join(a.split()) for a in args])
    return found


@pytest.mark.parametrize("example,kind,fields", [
    ("lstm_classifier", "adam", ["lr", "beta1", "beta2", "eps", "weight_decay", "c1", "c2"]),
    ("resnet18", "sgd", ["lr", "weight_decay"]),
])
def test_optimizer_hyperparameters_are_one_struct(example, kind, fields):
    """Each update call (in apply_update(), in the backward pass, inside a GEMM's row
    blocks, in an outlined backward function) passes the step's hyperparameters as one
    argument, a struct declared beside the update kernel and filled once per step."""
    files = project_files(build_example(example))
    model, header = files["src/model.cpp"].decode(), files["src/kernels.h"].decode()
    struct = re.search(rf"struct {kind}_hyper \{{(.*?)\}};", header, re.S).group(1)
    assert re.findall(r"float (\w+);", struct) == fields
    decls = _calls(header, f"{kind}_update") + _calls(header, f"{kind}_update_serial")
    assert decls and all(d[-1] == f"{kind}_hyper hyper" and not [a for a in d if a.startswith("float ")] for d in decls)
    calls = _calls(model, f"kernels::{kind}_update") + _calls(model, f"kernels::{kind}_update_serial")
    assert calls and all(args[-1] == "_hyper" for args in calls)
    assert not [a for args in calls for a in args[:-1] if "hyper" in a]
    # Filled twice: in train_step()'s backward pass and in apply_update().
    inits = re.findall(rf"const kernels::{kind}_hyper _hyper = \{{(.*?)\}};", model, re.S)
    assert len(inits) == 2 and model.count("_model.hyper.") == sum(i.count("_model.hyper.") for i in inits)
    if example == "resnet18":  # its blocks' gradients are outlined: the struct is their argument
        backward = model[model.index("\nvoid basic_block_backward("):]
        assert f"const kernels::{kind}_hyper& _hyper" in backward[:backward.index("{")]
    else:
        assert "_n, _hyper)" in " ".join(model.split())  # a GEMM's row blocks' update (UpdateRows)
