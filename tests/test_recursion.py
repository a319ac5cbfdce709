"""Recursive models: every example against plain per-node recursion (the
reference runs one node at a time, independent of the level-batched lowering),
on random, single-node, deep, wide and mixed batches; and bad batches rejected
with the offending node named, by the generated inspector and the reference alike."""

from __future__ import annotations

import re

import numpy as np
import pytest

import generator as dg
from conftest import CHECK_BUILD_FLAGS, load_example
from generator.reference import interpreter as reference
from generator.treebatch import check_batch, from_nested, random_batch

RECURSIVE = ["treelstm", "childsum_treelstm", "treegru", "treernn", "mvrnn", "dagrnn"]


@pytest.fixture(scope="module", params=RECURSIVE)
def model(request, builds):
    graph = load_example(request.param).build()
    module, _ = builds.module(graph)
    node = next(n for n in graph.nodes if n.op == "recurse")
    return graph, module, node


def _inputs(node, batch):
    children, words, roots = node.inputs[:3]
    return {children.name: batch["children"], words.name: batch["words"], roots.name: batch["roots"]}


def _vocab(graph):
    from generator.reference.samples import id_limit

    return id_limit(graph, next(n for n in graph.nodes if n.op == "recurse").inputs[1])


def _check(graph, module, inputs, atol=2e-5):
    want = reference.run(graph, inputs)
    got = module.Model(seed=0).forward(**inputs)
    for name in want:
        assert got[name].shape == want[name].shape
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=atol, err_msg=name)


def _chain(depth, arity, vocab):
    """A single path: node i has node i-1 as its only child."""
    children = np.full((depth, arity), -1, np.int64)
    children[1:, 0] = np.arange(depth - 1)
    return {"children": children, "words": np.arange(depth, dtype=np.int64) % vocab,
            "roots": np.array([depth - 1], np.int64)}


def test_random_mixed_batch(model):
    graph, module, node = model
    spec = node.attrs["spec"]
    batch = random_batch(np.random.default_rng(1), 12, spec.arity, _vocab(graph), 1, 30, dag=spec.dag)
    _check(graph, module, _inputs(node, batch))


def test_single_node_trees(model):
    graph, module, node = model
    spec = node.attrs["spec"]
    batch = from_nested([3, 5, 7], spec.arity)
    _check(graph, module, _inputs(node, batch))


def test_deep_chain_of_2000(model):
    graph, module, node = model
    spec = node.attrs["spec"]
    _check(graph, module, _inputs(node, _chain(2000, spec.arity, _vocab(graph))), atol=1e-4)


def test_wide_levels(model):
    """Many trees at once: levels of hundreds of rows."""
    graph, module, node = model
    spec = node.attrs["spec"]
    batch = random_batch(np.random.default_rng(2), 150, spec.arity, _vocab(graph), 1, 6, dag=spec.dag)
    _check(graph, module, _inputs(node, batch))


def test_full_fan_out(builds):
    """A child-sum node with every slot filled, beside nodes with one child."""
    graph = load_example("childsum_treelstm").build()
    module, _ = builds.module(graph)
    node = next(n for n in graph.nodes if n.op == "recurse")
    batch = from_nested([(9, [1, 2, 3, 4]), (8, [(7, [5]), 6])], node.attrs["spec"].arity)
    _check(graph, module, _inputs(node, batch))


BAD = {
    "child out of range": (lambda b: b["children"].__setitem__((2, 0), 99), "node 2 has child 99, outside"),
    "cycle": (lambda b: b.update(children=np.array([[-1, -1], [-1, -1], [0, 1], [4, -1], [3, -1]], np.int64),
                                 words=np.arange(5, dtype=np.int64), roots=np.array([2], np.int64)),
              "node 3 lies on a cycle"),
    "own child": (lambda b: b["children"].__setitem__((2, 1), 2), "node 2 is its own child"),
    "shared child": (lambda b: b["children"].__setitem__((4, 1), 0), "node 0 has more than one parent"),
    "root out of range": (lambda b: b["roots"].__setitem__(0, -3), "root 0 is node -3, outside"),
}


@pytest.mark.parametrize("what", list(BAD))
def test_bad_batches_name_the_node(what, builds):
    graph = load_example("treernn").build()
    module, _ = builds.module(graph)
    node = next(n for n in graph.nodes if n.op == "recurse")
    batch = from_nested([((1, 2), 3)], 2)  # nodes: 0, 1 leaves; 2 = (0, 1); 3 leaf; 4 = (2, 3)
    breaks, message = BAD[what]
    breaks(batch)
    with pytest.raises(ValueError, match=message):
        module.Model().forward(**_inputs(node, batch))
    with pytest.raises(ValueError, match=message):
        reference.run(graph, _inputs(node, batch))


def test_batch_shape_and_dtype_errors(builds):
    graph = load_example("treernn").build()
    module, _ = builds.module(graph)
    node = next(n for n in graph.nodes if n.op == "recurse")
    good = _inputs(node, from_nested([((1, 2), 3)], 2))
    model = module.Model()
    with pytest.raises(ValueError, match="trees_nodes, which must be at least 1"):
        model.forward(trees_children=np.zeros((0, 2), np.int64), trees_words=np.zeros(0, np.int64),
                      trees_roots=np.zeros(1, np.int64))
    with pytest.raises(ValueError, match="input 'trees_words': dimension 0 is trees_nodes"):
        model.forward(**dict(good, trees_words=good["trees_words"][:3]))
    with pytest.raises(ValueError, match="expected dtype int64, got int32"):
        model.forward(**dict(good, trees_children=good["trees_children"].astype(np.int32)))
    with pytest.raises(ValueError, match="expected 2 dimensions"):
        model.forward(**dict(good, trees_children=good["trees_children"].reshape(-1)))


def test_dag_shares_children_and_trees_do_not():
    children = np.array([[-1, -1], [-1, -1], [0, 1], [0, 1]], np.int64)  # nodes 2 and 3 share 0 and 1
    check_batch(children, [2, 3], dag=True)
    with pytest.raises(ValueError, match="node 0 has more than one parent"):
        check_batch(children, [2, 3], dag=False)


def test_from_nested():
    batch = from_nested([((1, 2), 3), 4, (5, [6, (7, 8)])], 2)
    np.testing.assert_array_equal(batch["roots"], [4, 5, 10])
    np.testing.assert_array_equal(batch["children"][4], [2, 3])
    assert batch["words"][10] == 5 and batch["words"][2] == -1
    deep = 0
    for _ in range(3000):
        deep = (deep,)
    assert from_nested([deep], 1)["children"].shape == (3001, 1)
    with pytest.raises(ValueError, match="more than the arity"):
        from_nested([(1, 2, 3)], 2)
    with pytest.raises(ValueError, match="a tree node must be"):
        from_nested([(1, "x")], 2)


def test_hoisting_is_visible_in_the_generated_code():
    from generator.pipeline import project_files

    files = project_files(load_example("childsum_treelstm").build())
    model = files["src/model.cpp"].decode()
    loop = model.index("for (std::int64_t level = 1;")
    hoisted = model.index("// Hoisted out of the level loop")
    assert hoisted < loop
    assert "dg::matmul(wx_gather" in model[hoisted:loop] or "@ w" in model[hoisted:loop]
    assert "std::vector" not in model[loop : model.index("dg::unsort_rows")], "no allocation inside the loop"


def test_generated_module_converts_nested_trees(model):
    graph, module, node = model
    spec = node.attrs["spec"]
    nested = [((1, 2), 3), 4, (5, [6, (7, 8)])] if spec.arity >= 2 else [((1,),), 2]
    convert = getattr(module, node.inputs[0].name.removesuffix("_children") + "_from_nested")
    inputs = convert(nested)
    want = _inputs(node, from_nested(nested, spec.arity))
    assert set(inputs) == set(want)
    for key in want:
        np.testing.assert_array_equal(inputs[key], want[key])
    deep = 0
    for _ in range(3000):
        deep = (deep,)
    assert convert([deep])[node.inputs[0].name].shape == (3001, spec.arity)
    with pytest.raises(ValueError, match="a tree node must be"):
        convert([(1, "x")])


@dg.model
def placed_states():
    """States written every way the level loop can: by a kernel through the row map
    (b; t in the leaves), by a gather or a GEMM's epilogue and scattered to their
    rows (x, a), one value as two states (t, t), a hoisted value (e), and a state
    nothing reads afterwards (c)."""
    trees = dg.trees("trees", arity=2)
    emb = dg.param("emb", (7, 4), init=dg.uniform(-1, 1))
    w = dg.param("w", (8, 4), init=dg.uniform(-1, 1))

    def leaf(words):
        x = dg.gather(emb, words)
        t = dg.tanh(x)
        return x, t, t

    def internal(words, children):
        (a_l, b_l, c_l), (a_r, b_r, c_r) = children
        e = dg.gather(emb, words) * 0.5
        a = dg.tanh(dg.concat([a_l, b_r], axis=1) @ w)
        b = a_l * b_r + dg.sigmoid(c_l) - c_r * a
        return a, b, e

    a, b, c = dg.recurse(trees, leaf, internal, names=("a", "b", "c"))
    return {"b": b, "root_a": dg.roots(trees, a)}


def test_states_are_written_once_in_node_order(builds):
    """No copy of a state in schedule order and no putting it back after the loop:
    kernels write rows through the schedule's order, other results are scattered
    to their rows after their block; every way equals the per-node reference."""
    from generator.pipeline import project_files

    graph = placed_states.build()
    model = project_files(graph)["src/model.cpp"].decode()
    kernels = project_files(graph)["src/kernels.cpp"].decode()
    loop = model.index("for (std::int64_t level = 1;")
    assert "in schedule order" not in model and not re.search(r"Scratch<float> \w+_rows\b", model)
    # b: straight to its node's row (the kernel's output through a row map: the schedule's order)
    assert "out[_i1 + out_ld * out_at[_i0]] =" in kernels and "b.data(), order," in model
    assert model.count("dg::unsort_rows") == 5  # leaves: x, t twice; levels: a (a GEMM), c (hoisted)
    assert "dg::unsort_rows" not in model[model.index('return {"b": b') :]  # nothing after the loop
    assert model[:loop].count("dg::gather_child_nodes") == 0
    module, _ = builds.module(graph, flags=CHECK_BUILD_FLAGS)  # values at tiny sizes, not speed: -O0
    node = next(n for n in graph.nodes if n.op == "recurse")
    for seed, (trees, low, high) in enumerate([(9, 1, 12), (3, 20, 40)]):
        batch = random_batch(np.random.default_rng(seed), trees, 2, 7, low, high)
        _check(graph, module, _inputs(node, batch))
