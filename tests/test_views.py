"""Split pieces read in place (row-strided views) and children gathered straight
into a concat: the generated code makes no copy where only elementwise kernels
read a piece, copies where anything else reads it, and computes what the numpy
reference interpreter computes, forward and gradients."""

from __future__ import annotations

import numpy as np
import pytest

import generator as dg
from generator.pipeline import lowered, prepare
from generator.reference import interpreter as reference


@dg.model
def pieces():
    x = dg.input("x", (dg.dim("N"), 3, 8))
    labels = dg.input("labels", (dg.dim("N"),), dtype="int64")
    w = dg.param("w", (8, 20), init=dg.uniform(-0.5, 0.5))
    v = dg.param("v", (6, 4), init=dg.uniform(-0.5, 0.5))
    gates = dg.reshape(dg.reshape(x, (dg.dim("N") * 3, 8)) @ w, (dg.dim("N"), 3, 20))
    a, b, c, d = dg.split(gates, 4, axis=2)  # [N, 3, 5] each, rows 20 floats apart
    # a, d: read by elementwise kernels only, forward and backward (views); b: also
    # by a matmul (a copy); c: by a slice (a copy), whose piece is a view of it.
    e = dg.sigmoid(a) * dg.tanh(d) + d * d
    f = dg.slice_axis(dg.reshape(b, (dg.dim("N") * 3, 5)), 1, 0, 4) @ dg.transpose(v, (1, 0))
    first = dg.slice_axis(c, 2, 0, 1)
    g = gates * first
    top, rest = dg.split(g, [1, 2], axis=1)  # axis 1 of a 3-D value: inner rows of 20 floats
    h = dg.tanh(rest) + 1.0
    feats = dg.concat([dg.reshape(e, (dg.dim("N"), 15)), dg.reshape(f, (dg.dim("N"), 18)),
                       dg.reshape(top, (dg.dim("N"), 20)), dg.reshape(h, (dg.dim("N"), 40))], axis=1)
    logits = feats @ dg.param("head", (93, 5), init=dg.uniform(-0.2, 0.2))
    loss = dg.softmax_cross_entropy(logits, labels)
    dg.train(loss, dg.sgd(lr=0.1))
    return {"logits": logits, "e": e}


@dg.model
def broadcast_piece():
    x = dg.input("x", (dg.dim("N"), 6))
    y = dg.tanh(x @ dg.param("w", (6, 6), init=dg.uniform(-1, 1)))
    # y * y[:, 2:3] has y's shape and y dies here: without care it would be written
    # over y while y[:, 2:3] (a view of y) is still read for the later columns.
    scaled = dg.exp(y * dg.slice_axis(y, 1, 2, 3))
    return {"z": scaled @ dg.param("v", (6, 3), init=dg.uniform(-1, 1))}


def _batch(n=5):
    rng = np.random.default_rng(3)
    return {"x": rng.normal(size=(n, 3, 8)).astype(np.float32),
            "labels": rng.integers(0, 5, size=n).astype(np.int64)}


def _model_text(graph) -> str:
    from generator.pipeline import project_files

    return project_files(graph)["src/model.cpp"].decode()


def test_pieces_read_by_kernels_only_are_views():
    text = _model_text(prepare(pieces.build()))
    assert "read in place: rows 20 floats apart" in text
    assert "dg::copy_axis(gates" in text  # b is read by a matmul: copied


def test_a_kernel_never_writes_over_a_buffer_it_reads_through_a_view(builds):
    """z = y * y[:, 2:3] has y's shape: it may not take y's block while the view of
    y is read at other positions."""
    graph = prepare(broadcast_piece.build())
    plan = lowered(graph)
    assert "read in place: rows 6 floats apart" in _model_text(graph)
    by_name = {b.name: b for b in plan.memory["buffers"]}
    assert by_name["scaled"].inplace_of is None
    module, _ = builds.module(graph)
    model = module.Model(seed=0)
    x = np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32)
    want = reference.run(graph, {"x": x}, {k: np.array(v) for k, v in model.parameters().items()})["z"]
    np.testing.assert_allclose(model.forward(x=x)["z"], want, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def built(builds):
    graph = prepare(pieces.build())
    module, _ = builds.module(graph)
    return graph, module


def test_forward_matches_the_reference(built):
    graph, module = built
    batch = _batch()
    model = module.Model(seed=0)
    params = {k: np.array(v) for k, v in model.parameters().items()}
    got = model.forward(x=batch["x"])
    want = reference.run(graph, {"x": batch["x"]}, params)
    for name in ("logits", "e"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_gradients_match_the_reference(built):
    graph, module = built
    batch = _batch()
    model = module.Model(seed=0)
    start = {k: np.array(v) for k, v in model.parameters().items()}
    model.train_step(**batch)
    _, want = reference.gradients(graph, batch, start)
    for name, value in model.gradients().items():
        np.testing.assert_allclose(value, want[name], rtol=1e-4, atol=1e-6, err_msg=name)


@dg.model
def token_slice():
    tokens = dg.input("tokens", (dg.dim("N"), 4), dtype="int64")
    table = dg.param("table", (8, 3), init=dg.normal(0.0, 1.0), seed=1)
    middle = dg.slice_axis(tokens, 1, 1, 3)  # int64 ids, copied (dg::copy_axis of int64)
    return {"emb": dg.gather(table, middle)}


def test_an_int64_slice_compiles_and_its_ids_keep_the_tables_limit(builds):
    """Ids sliced before they index a table: the sample inputs draw them below the table's
    rows (id_limit follows the slice, as it follows a reshape) and the copy is of int64."""
    from generator.reference.samples import sample_inputs

    graph = token_slice.build()
    assert sample_inputs(graph)["tokens"].max() < 8
    module, _ = builds.module(graph)
    model = module.Model(seed=0)
    tokens = np.array([[7, 0, 5, 1], [2, 3, 4, 6]], dtype=np.int64)
    want = reference.run(graph, {"tokens": tokens}, {k: np.array(v) for k, v in model.parameters().items()})
    np.testing.assert_array_equal(model.forward(tokens=tokens)["emb"], want["emb"])
