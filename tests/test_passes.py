"""Optimization passes: each preserves semantics (random graphs, every example at
-O0 against -O2) and does its job (kernels and buffers drop)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import generator as dg
from conftest import ROOT, build_example, load_example
from generator.reference import interpreter as reference
from generator.pipeline import prepare
from generator.memory.planner import dominates
from generator.transforms.passes import LEVELS, optimize
from generator.reference.samples import sample_inputs

from conftest import EXAMPLES  # noqa: E402  (the example model files)
UNARY = ["relu", "tanh", "sigmoid", "exp", "neg", "square", "softsign"]


def _random_model(program):
    """A model from a hypothesis-drawn program of elementwise, matmul and reduction steps."""

    def randomnet():
        x = dg.input("x", (dg.dim("N"), 4))
        y = dg.input("y", (4,))
        w = dg.param("w", (4, 4), init=dg.uniform(-0.5, 0.5))
        values = [x]
        for kind, a, b, fn in program:
            p, q = values[a % len(values)], values[b % len(values)]
            if kind == "unary":
                values.append(getattr(dg, fn)(p * 0.5))
            elif kind == "binary":
                values.append(p + q * 0.25 - y)
            elif kind == "matmul":
                values.append(p @ w)
            else:
                values.append(dg.softmax(p) + p)  # reduction inside
        return {"last": values[-1], "copy1": values[-1] * 1.0, "copy2": values[-1] * 1.0}

    return dg.model(randomnet)


STEP = st.tuples(st.sampled_from(["unary", "binary", "matmul", "softmax"]), st.integers(0, 8), st.integers(0, 8),
                 st.sampled_from(UNARY))


@settings(max_examples=40, deadline=None)
@given(st.lists(STEP, min_size=1, max_size=8), st.sampled_from(["dce", "cse", "fold", "copyprop", "fuse", "simplify", "epilogue"]))
def test_passes_preserve_semantics_on_random_graphs(program, until):
    model = _random_model(program)
    plain, optimized = model.build(), optimize(model.build(), "O2", until=until)
    rng = np.random.default_rng(0)
    inputs = {"x": rng.uniform(-1, 1, (3, 4)).astype(np.float32), "y": rng.uniform(-1, 1, 4).astype(np.float32)}
    want, got = reference.run(plain, inputs), reference.run(optimized, inputs)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_example_is_the_same_at_o0_and_o2(name):
    o0, o2 = prepare(build_example(name), "O0"), prepare(build_example(name), "O2")
    inputs = sample_inputs(o0)
    want, got = reference.run(o0, inputs), reference.run(o2, inputs)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6)
    if o0.train is not None:
        params = reference.init_params(o0)
        loss0, grads0 = reference.gradients(o0, inputs, params)
        loss2, grads2 = reference.gradients(o2, inputs, params)
        assert abs(loss0 - loss2) <= 1e-5 * max(1, abs(loss0))
        for p in grads0:
            np.testing.assert_allclose(grads2[p], grads0[p], rtol=1e-4, atol=1e-6)


def _kernel_calls(plan) -> int:
    """The elementwise kernel calls of a plan (an epilogue runs inside its GEMM's call)."""
    from generator.codegen.stmt import Call, nested_lines

    groups = [plan.statements] + ([plan.train.loss_statements, plan.train.backward_statements] if plan.train else [])
    return sum(isinstance(line, Call) and line.fn.startswith("kernels::")
               for group in groups for s in group for line in nested_lines(s.lines))


def test_fusion_reduces_kernels_and_buffers():
    from generator.pipeline import lowered

    for name in ("mlp", "bow"):
        counts = {}
        for level in ("O0", "O2"):
            graph = prepare(load_example(name).build(), level)
            plan = lowered(graph)
            counts[level] = (_kernel_calls(plan), len([b for b in plan.memory["buffers"] if b.inplace_of is None]),
                             len(plan.memory["buffers"]))
        assert counts["O2"][0] < counts["O0"][0], (name, counts)  # fewer kernel calls (passes over memory)
        assert counts["O2"][2] <= counts["O0"][2], (name, counts)  # no more buffers
    assert counts["O2"][2] < counts["O0"][2], counts  # bow: fewer intermediate buffers


def test_fused_kernel_lists_its_dsl_statements():
    from generator.pipeline import project_files

    files = project_files(load_example("mlp").build(), opt="O2")
    assert "// the GEMM's epilogue, fusing add, relu:\n// mlp.py:13  h1 = dg.dense(x, 512, act=dg.relu)\n" in (
        files["src/kernels.h"].decode())
    files = project_files(load_example("treelstm").build(), opt="O2")
    kernels = files["src/kernels.cpp"].decode()
    # the leaf's h and the internal node's compute the same: one kernel, citing both
    assert ("// fuses tanh, sigmoid, mul:\n// treelstm.py:30  h = dg.sigmoid(o) * dg.tanh(c)\n"
            "// treelstm.py:38  h = dg.sigmoid(o) * dg.tanh(c)\n") in kernels
    # a long DSL line stays whole on its comment line (clang-format does not reflow comments)
    assert ("\n// treelstm.py:37  c = dg.sigmoid(i) * dg.tanh(g) + dg.sigmoid(f_l) * c_l + dg.sigmoid(f_r) * c_r\n"
            in kernels)


def test_epilogue_fusion_folds_bias_and_activation_into_the_gemm():
    """mlp at O2: every matmul's bias + relu (forward) and relu' (backward) run
    inside the GEMM; no pre-activation buffer is left, and the training arena
    does not grow."""
    from generator.pipeline import lowered

    plans = {}
    for level in ("O1", "O2"):
        graph = prepare(load_example("mlp").build(), level)
        plans[level] = (graph, lowered(graph))
    graph, plan = plans["O2"]
    fused = [n for n in graph.nodes if n.op == "matmul" and "epilogue" in n.attrs]
    assert len(fused) == 5, [n.outputs[0].name for n in fused]  # h1, h2, logits; d_h1, d_h2
    assert not any(b.name.endswith("_matmul") and b.phase == "forward" for b in plan.memory["buffers"])
    # one functor per distinct epilogue: bias + relu (h1, h2), bias (logits), relu' (d_h1, d_h2)
    assert [k.kind for k in plan.kernels].count("epilogue") == 3
    buffers = {level: len(plans[level][1].memory["buffers"]) for level in plans}
    assert buffers["O2"] < buffers["O1"], buffers
    train = {level: plans[level][1].memory["train_floats"] for level in plans}
    assert dominates(train["O1"], train["O2"]), train


def test_epilogue_reads_rows_columns_and_full_operands():
    """A consumer reading a per-row, per-column, scalar and full operand fuses; its
    reference result equals the unfused graph's."""

    @dg.model
    def epi():
        x = dg.input("x", (dg.dim("N"), 3))
        r = dg.input("r", (dg.dim("N"), 1))
        s = dg.input("s", (1, 1))
        w = dg.param("w", (3, 5), init=dg.uniform(-1, 1))
        c = dg.param("c", (5,), init=dg.uniform(-1, 1))
        full = dg.tanh(x @ dg.param("v", (3, 5), init=dg.uniform(-1, 1)))
        return {"y": dg.sigmoid((x @ w) * r + c - s) * full}

    plain, fused = prepare(epi.build(), "O1"), prepare(epi.build(), "O2")
    mm = [n for n in fused.nodes if n.op == "matmul"]
    assert any("epilogue" in n.attrs and len(n.inputs) == 6 for n in mm), [n.inputs for n in mm]
    rng = np.random.default_rng(1)
    inputs = {"x": rng.normal(size=(4, 3)).astype(np.float32), "r": rng.normal(size=(4, 1)).astype(np.float32),
              "s": np.float32([[0.3]])}
    params = reference.init_params(plain)
    np.testing.assert_allclose(reference.run(fused, inputs, params)["y"], reference.run(plain, inputs, params)["y"],
                               rtol=1e-5, atol=1e-6)


def test_cse_and_copyprop_and_dce():
    @dg.model
    def duplicates():  # (not dup: a model name may not be a global C name, and unistd.h declares dup)
        x = dg.input("x", (2, 3))
        a = dg.tanh(x)
        b = dg.tanh(x)  # the same as a
        unused = dg.exp(x)  # noqa: F841  (dead)
        c = (a + b) * 1  # a copy
        return {"total": dg.sin(c)}

    graph = optimize(duplicates.build(), "O1")
    ops = [n.attrs.get("fn", n.op) for n in graph.nodes]
    assert ops.count("tanh") == 1 and "exp" not in ops and "mul" not in ops, ops


def test_levels_and_ir_after(capsys):
    from generator.tools import cli

    assert LEVELS["O0"] == []
    assert cli.main(["ir", str(ROOT / "examples" / "mlp.py"), "--after", "fuse"]) == 0
    assert "fused(h1_matmul, h1_b)" in capsys.readouterr().out
    assert cli.main(["generate", str(ROOT / "examples" / "mlp.py"), "-o", str(ROOT / "build" / "o0"), "-O0",
                     "--force", "--report"]) == 0
    assert "passes (O0)" in capsys.readouterr().out
    assert cli.main(["generate", str(ROOT / "examples" / "mlp.py"), "-o", str(ROOT / "build" / "o2"), "--force",
                     "--report"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if " -> " in line]
    assert [row.split()[0] for row in rows[-3:]] == ["remat", "weight_grads_last", "dce"]
    assert len({row.index(" -> ") for row in rows}) == 1  # one column, however long the pass's name


def test_fold_substitutes_the_constants_autodiff_makes():
    """The loss gradient's 1 and the zero padding of an unused split piece are
    folded away; gradients are unchanged."""

    @dg.model
    def folded():
        x = dg.input("x", (dg.dim("N"), 6))
        t = dg.input("t", (dg.dim("N"), 2))
        w = dg.param("w", (6, 6), init=dg.uniform(-1, 1))
        a, _unused, c = dg.split(dg.tanh(x @ w), 3, axis=1)
        loss = dg.mse(a * c, t)
        dg.train(loss, dg.sgd(0.1))
        return {"a": a}

    plain, folded_graph = prepare(folded.build(), "O0"), prepare(folded.build(), "O2")
    fills = lambda g: [n for n in g.nodes if n.op == "fill"]  # noqa: E731
    assert len(fills(folded_graph)) < len(fills(plain)), (fills(plain), fills(folded_graph))
    rng = np.random.default_rng(2)
    inputs = {"x": rng.normal(size=(3, 6)).astype(np.float32), "t": rng.normal(size=(3, 2)).astype(np.float32)}
    params = reference.init_params(plain)
    loss0, grads0 = reference.gradients(plain, inputs, params)
    loss2, grads2 = reference.gradients(folded_graph, inputs, params)
    assert abs(loss0 - loss2) <= 1e-6 * max(1.0, abs(loss0))
    np.testing.assert_allclose(grads2["w"], grads0["w"], rtol=1e-5, atol=1e-7)


def test_conv_batch_norm_joins_a_conv_and_its_batch_norm_in_a_model_that_does_not_train():
    """conv_batch_norm: a conv whose only reader is a batch norm becomes one node with it
    (ops/modes.py: conv2d_batch_norm) and one runtime call; the reference gives the same
    outputs and running statistics in both modes; a conv whose output is also read
    elsewhere, and every conv of a model that trains, stay as they are. A relu after
    the batch norm, and a residual add then a relu, join the node too (attrs relu,
    residual); an add whose result is read twice keeps its relu apart."""
    from generator.pipeline import lowered

    def cnn():
        x = dg.input("x", (dg.dim("N"), 3, 8, 8))
        a = dg.relu(dg.batch_norm_layer(dg.conv2d_layer(x, 4, (3, 3), padding=1, name="c1"), name="b1"))
        d = dg.conv2d_layer(a, 4, (3, 3), padding=1, groups=4, bias=False, name="c2")
        b = dg.batch_norm_layer(d, name="b2")
        c = dg.conv2d_layer(b, 2, (1, 1), name="c3")  # read twice: not joined
        e = dg.relu(dg.batch_norm_layer(dg.conv2d_layer(a, 4, (3, 3), padding=1, name="c4"), name="b4") + a)
        f = dg.batch_norm_layer(dg.conv2d_layer(e, 4, (1, 1), name="c5"), name="b5") + e  # read twice
        return {"y": dg.batch_norm_layer(c, name="b3") + c, "z": b, "e": dg.relu(f) + f}

    graphs = {level: prepare(dg.model(cnn).build(), level) for level in ("O1", "O2")}
    ops = [n.op for n in graphs["O2"].nodes]
    assert ops.count("conv2d_batch_norm") == 4 and ops.count("conv2d") == 1 and ops.count("batch_norm") == 1, ops
    tails = sorted((n.attrs.get("residual", False), n.attrs.get("relu", False)) for n in graphs["O2"].nodes
                   if n.op == "conv2d_batch_norm")
    assert tails == [(False, False), (False, True), (True, False), (True, True)], tails
    code = "\n".join(str(line) for s in lowered(graphs["O2"]).statements for line in s.lines)
    assert "dg::conv2d_batch_norm(" in code and "/*relu=*/true" in code
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 3, 8, 8)).astype(np.float32)
    params = {p.name: (rng.random(p.shape) + 0.5).astype(np.float32) for p in graphs["O1"].params}
    for training in (False, True):
        results = {}
        for level, graph in graphs.items():
            state = {k: v.copy() for k, v in params.items()}
            out = reference.run(graph, {"x": x}, state, training=training)
            results[level] = (out, state)
        (out1, state1), (out2, state2) = results["O1"], results["O2"]
        for k in out1:
            np.testing.assert_array_equal(out1[k], out2[k])
        for k in state1:
            np.testing.assert_array_equal(state1[k], state2[k])
    trained = prepare(load_example("resnet18").build(image=16, width=8), "O2")
    assert not any(n.op == "conv2d_batch_norm" for n in trained.nodes)
