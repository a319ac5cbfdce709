"""Training through recursion: every recursive example built with train=True (a
per-node classifier, SST-style labels, -1 for unlabeled nodes).

Oracles: float64 central finite differences of the per-node reference forward
(the reference's gradient, which runs the differentiated cells one node at a
time), and that reference against the generated level-batched backward pass on
random, single-node, deep (2000) and wide batches; train steps at 1 and 2
threads bit for bit. tests/test_tree_torch.py compares with PyTorch autograd."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import load_example
from generator.reference import interpreter as reference
from generator.treebatch import from_nested, random_batch

RECURSIVE = ["treelstm", "childsum_treelstm", "treegru", "treernn", "mvrnn", "dagrnn"]


def build_trainable(name: str):
    return load_example(name).build(f"{name}_train", train=True)


def _spec(graph):
    return next(n for n in graph.nodes if n.op == "recurse").attrs["spec"]


def _vocab(graph):
    from generator.reference.samples import id_limit

    return id_limit(graph, next(n for n in graph.nodes if n.op == "recurse").inputs[1])


def _inputs(graph, batch, rng):
    node = next(n for n in graph.nodes if n.op == "recurse")
    children, words, roots = node.inputs[:3]
    count = len(batch["words"])
    labels = rng.integers(0, 5, count)
    labels[rng.random(count) < 0.3] = -1  # unlabeled nodes
    labels[batch["roots"]] = rng.integers(0, 5, len(batch["roots"]))  # every root labeled
    return {children.name: batch["children"], words.name: batch["words"], roots.name: batch["roots"],
            "labels": labels.astype(np.int64)}


def _chain(depth, arity, vocab):
    children = np.full((depth, arity), -1, np.int64)
    children[1:, 0] = np.arange(depth - 1)
    return {"children": children, "words": np.arange(depth, dtype=np.int64) % vocab,
            "roots": np.array([depth - 1], np.int64)}


def assert_finite_differences(graph, inputs, seed, names, largest=3, random=0, rng=None):
    """The reference's float64 gradient of each parameter in `names` (None: every one
    the loss depends on) against central
    differences of the per-node forward pass: its `largest` entries and `random` more."""
    params = {k: v.astype(np.float64) for k, v in reference.init_params(graph, seed=seed).items()}
    _, grads = reference.gradients(graph, inputs, params, float_dtype=np.float64)
    for name in names if names is not None else list(grads):
        p, grad = params[name], grads[name]
        flat = np.argsort(-np.abs(grad).ravel())[:largest].tolist()
        flat += rng.integers(0, p.size, random).tolist() if random else []
        for index in flat:
            idx = np.unravel_index(index, p.shape)
            old, losses = p[idx], []
            for delta in (1e-6, -1e-6):
                p[idx] = old + delta
                out = reference.run(graph, inputs, params, float_dtype=np.float64, values=[graph.train.loss])
                losses.append(float(next(iter(out.values()))))
            p[idx] = old
            numeric = (losses[0] - losses[1]) / 2e-6
            assert abs(numeric - grad[idx]) <= 1e-6 + 1e-5 * abs(numeric), (name, idx, numeric, grad[idx])
    return grads


@pytest.mark.parametrize("name", RECURSIVE)
def test_reference_gradient_matches_finite_differences(name):
    """The differentiated cells, run per node, against the per-node forward pass
    in float64: a few entries of every parameter, central differences."""
    graph = build_trainable(name)
    spec = _spec(graph)
    rng = np.random.default_rng(3)
    inputs = _inputs(graph, random_batch(rng, 2, spec.arity, _vocab(graph), 1, 5, dag=spec.dag), rng)
    grads = assert_finite_differences(graph, inputs, seed=1, names=None, random=3, rng=rng)
    assert set(grads) == {p.name for p in graph.trainable}


@pytest.fixture(scope="module", params=RECURSIVE)
def trained(request, builds):
    graph = build_trainable(request.param)
    module, _ = builds.module(graph)
    return graph, module


def _compare(graph, module, inputs, seed=4):
    model = module.Model(seed=seed)
    loss = model.train_step(**inputs)
    want_loss, want = reference.gradients(graph, inputs, reference.init_params(graph, seed=seed))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
    got = model.gradients()
    assert set(got) == set(want)
    for name, w in want.items():
        scale = max(float(np.abs(w).max()), 1e-3)
        err = float(np.abs(np.asarray(got[name]) - w).max())
        assert err <= 2e-4 * scale, (name, err, scale)


def test_generated_gradients_match_reference(trained):
    graph, module = trained
    spec = _spec(graph)
    rng = np.random.default_rng(5)
    _compare(graph, module, _inputs(graph, random_batch(rng, 6, spec.arity, _vocab(graph), 1, 20, dag=spec.dag), rng))


def test_single_node_trees_train(trained):
    graph, module = trained
    rng = np.random.default_rng(6)
    _compare(graph, module, _inputs(graph, from_nested([3, 5, 7], _spec(graph).arity), rng))


def test_deep_chain_of_2000_trains(trained):
    graph, module = trained
    if graph.name != "treelstm_train" and graph.name != "dagrnn_train":
        pytest.skip("the deep chain runs on one tree family and the DAG family")
    rng = np.random.default_rng(7)
    _compare(graph, module, _inputs(graph, _chain(2000, _spec(graph).arity, _vocab(graph)), rng))


def test_wide_levels_train(trained):
    graph, module = trained
    spec = _spec(graph)
    rng = np.random.default_rng(8)
    batch = random_batch(rng, 120, spec.arity, _vocab(graph), 1, 6, dag=spec.dag)
    _compare(graph, module, _inputs(graph, batch, rng))


def test_train_steps_are_bitwise_equal_at_1_and_2_threads(trained):
    graph, module = trained
    spec = _spec(graph)
    rng = np.random.default_rng(9)
    batches = [_inputs(graph, random_batch(rng, 30, spec.arity, _vocab(graph), 1, 12, dag=spec.dag), rng)
               for _ in range(2)]
    results = []
    before = module.get_num_threads() if hasattr(module, "get_num_threads") else None
    try:
        for threads in (1, 2):
            module.set_num_threads(threads)
            model = module.Model(seed=2)
            losses = [model.train_step(**b) for b in batches]
            results.append((losses, {k: np.array(v) for k, v in model.parameters().items()}))
    finally:
        if before is not None:
            module.set_num_threads(before)
    (l1, p1), (l2, p2) = results
    assert l1 == l2
    for name in p1:
        assert np.array_equal(p1[name], p2[name]), name


def test_unlabeled_nodes_get_no_gradient(trained):
    """With every label -1 the loss is 0 and every gradient is zero (nothing moves)."""
    graph, module = trained
    spec = _spec(graph)
    rng = np.random.default_rng(10)
    inputs = _inputs(graph, random_batch(rng, 3, spec.arity, _vocab(graph), 1, 6, dag=spec.dag), rng)
    inputs["labels"][:] = -1
    model = module.Model(seed=1)
    assert model.train_step(**inputs) == 0.0
    assert all(not np.asarray(g).any() for g in model.gradients().values())


def test_sentiment_example_learns_negation(builds):
    """examples/treelstm_sentiment.py: labels follow the words and negation's scope;
    the trained TreeLSTM must get at least 95% of the held-out roots (chance: ~40%)."""
    import runpy

    from conftest import ROOT

    example = runpy.run_path(str(ROOT / "examples" / "treelstm_sentiment.py"))
    module, _ = builds.module(example["treelstm_sentiment"].build())
    assert example["train"](module, log=lambda _: None) >= 0.95


def _root_labeled_model():
    """A TreeRNN over a DAG batch with labels at the roots only (dg.roots): the
    gradient flows into the states through a gather, and a shared child sums
    what its parents send."""
    import generator as dg

    @dg.model
    def root_labeled():
        dag = dg.trees("dag", arity=3, dag=True)
        emb = dg.param("emb", (30, 6), init=dg.normal(0, 0.5))
        w = dg.param("w", (6, 8), init=dg.normal(0, 0.5))
        u = dg.param("u", (8, 8), init=dg.normal(0, 0.5))

        def leaf(words):
            return (dg.tanh(dg.gather(emb, words) @ w),)

        def internal(words, children):
            total = children[0][0] + children[1][0] + children[2][0]
            return (dg.tanh(dg.gather(emb, words) @ w + total @ u),)

        h = dg.recurse(dag, leaf, internal, names=("h",))
        labels = dg.input("root_labels", (dag.roots.shape[0],), dtype="int64")
        logits = dg.dense(dg.roots(dag, h), 4)
        dg.train(dg.softmax_cross_entropy(logits, labels), dg.sgd(lr=0.1))
        return {"h": h}

    return root_labeled.build()


def test_root_labels_through_a_dag(builds):
    graph = _root_labeled_model()
    module, _ = builds.module(graph)
    rng = np.random.default_rng(12)
    for trial in range(3):
        batch = random_batch(rng, 5, 3, 30, 1, 9, dag=True)
        inputs = {"dag_children": batch["children"], "dag_words": batch["words"], "dag_roots": batch["roots"],
                  "root_labels": rng.integers(0, 4, len(batch["roots"])).astype(np.int64)}
        _compare(graph, module, inputs, seed=trial)
    # float64 finite differences of the per-node reference, a few entries
    assert_finite_differences(graph, inputs, seed=0, names=["u", "emb"])


def _reshaping_cell(variant: str):
    """Cells that reshape (found by review): a value of [2 * rows, 4] made in the loop
    and read after it, a view of a product kept for after the loop, a hoisted value
    reshaped (and a hoisted chain through a view)."""
    import generator as dg

    @dg.model(name=f"reshaping_{variant}")
    def model():
        trees = dg.trees("trees", arity=2)
        emb = dg.param("emb", (30, 8), init=dg.normal(0, 0.5))
        emb2 = dg.param("emb2", (30, 2, 4), init=dg.normal(0, 0.5))
        w = dg.param("w", (8, 4), init=dg.normal(0, 0.5))
        w2 = dg.param("w2", (16, 8), init=dg.normal(0, 0.5))

        def leaf(words):
            return (dg.gather(emb, words),)

        def internal(words, children):
            ((hl,), (hr,)) = children
            if variant == "double_rows":
                return (dg.reshape(dg.tanh(dg.reshape(dg.concat([hl, hr], axis=1), (-1, 8)) @ w), (-1, 8)),)
            if variant == "kept_view":
                return (dg.reshape(dg.sin(dg.reshape(dg.concat([hl, hr], axis=1) @ w2, (-1, 2, 4))), (-1, 8)),)
            y = dg.reshape(dg.gather(emb2, words), (-1, 8))  # hoisted, a view
            z = dg.reshape(dg.tanh(dg.reshape(dg.gather(emb, words), (-1, 4))), (-1, 8))
            return (dg.tanh(y @ w2[:8] + z + dg.concat([hl, hr], axis=1) @ w2),)

        h = dg.recurse(trees, leaf, internal, names=("h",))
        labels = dg.input("labels", (h.shape[0],), dtype="int64")
        dg.train(dg.softmax_cross_entropy(dg.dense(h, 5, name="cls"), labels, ignore_index=-1), dg.sgd(lr=0.1))
        return {"h": h}

    return model.build()


@pytest.mark.parametrize("variant", ["double_rows", "kept_view", "hoisted_views"])
def test_cells_that_reshape_train(builds, variant):
    graph = _reshaping_cell(variant)
    module, _ = builds.module(graph)
    rng = np.random.default_rng(13)
    inputs = _inputs(graph, random_batch(rng, 5, 2, 30, 1, 9), rng)
    _compare(graph, module, inputs)
    assert_finite_differences(graph, inputs, seed=0, names=None, largest=1)
