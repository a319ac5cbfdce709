"""The trainable binary TreeLSTM (examples/treelstm.py, train=True) against
PyTorch autograd of a per-node TreeLSTM written here, weights copied one to
one: the loss and every parameter's gradient of one train step, and the
parameters after a few Adam steps."""

from __future__ import annotations

import numpy as np
import pytest

from test_tree_training import _inputs, _spec, _vocab, build_trainable
from generator.treebatch import random_batch

torch = pytest.importorskip("torch")


def _topological(children):
    """Children before parents (depth-first, iterative: a chain of 2000 is fine)."""
    order, seen = [], set()
    for start in range(len(children)):
        stack = [(start, False)]
        while stack:
            n, expanded = stack.pop()
            if expanded:
                order.append(n)
                continue
            if n in seen:
                continue
            seen.add(n)
            stack.append((n, True))
            stack.extend((int(c), False) for c in children[n] if c != -1 and int(c) not in seen)
    return order


def torch_treelstm_loss(p, inputs):
    """Tai et al.'s binary TreeLSTM, one node at a time, then a per-node classifier
    and cross-entropy over the labeled nodes (ignore_index=-1)."""
    children, words = inputs["trees_children"], inputs["trees_words"]
    hidden = p["b"].shape[0] // 5
    zeros = torch.zeros(1, hidden, dtype=p["b"].dtype)
    h, c = {}, {}
    for n in _topological(children):
        kids = [int(k) for k in children[n]]
        if all(k == -1 for k in kids):
            x = p["emb"][int(words[n])].reshape(1, -1)
            i, o, g = torch.split(x @ p["w_leaf"] + p["b_leaf"], hidden, dim=1)
            c[n] = torch.sigmoid(i) * torch.tanh(g)
        else:
            (h_l, c_l), (h_r, c_r) = [(h[k], c[k]) if k != -1 else (zeros, zeros) for k in kids]
            gates = torch.cat([h_l, h_r], dim=1) @ p["u"] + p["b"]
            i, o, g, f_l, f_r = torch.split(gates, hidden, dim=1)
            c[n] = torch.sigmoid(i) * torch.tanh(g) + torch.sigmoid(f_l) * c_l + torch.sigmoid(f_r) * c_r
        h[n] = torch.sigmoid(o) * torch.tanh(c[n])
    states = torch.cat([h[n] for n in range(len(children))], dim=0)
    logits = states @ p["logits_w"] + p["logits_b"]
    labels = torch.as_tensor(inputs["labels"])
    return torch.nn.functional.cross_entropy(logits, labels, ignore_index=-1)


@pytest.fixture(scope="module")
def treelstm(builds):
    graph = build_trainable("treelstm")
    module, _ = builds.module(graph)
    return graph, module


def _batch(graph, seed, trees=4):
    rng = np.random.default_rng(seed)
    spec = _spec(graph)
    return _inputs(graph, random_batch(rng, trees, spec.arity, _vocab(graph), 1, 12, dag=spec.dag), rng)


def test_gradients_match_pytorch_autograd(treelstm):
    graph, module = treelstm
    inputs = _batch(graph, 11)
    model = module.Model(seed=3)
    start = {k: np.array(v) for k, v in model.parameters().items()}
    loss = model.train_step(**inputs)
    got = model.gradients()
    p = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in start.items()}
    want_loss = torch_treelstm_loss(p, inputs)
    want_loss.backward()
    assert abs(loss - want_loss.item()) <= 1e-5 * max(1.0, abs(want_loss.item()))
    assert set(got) == set(p)
    for name, t in p.items():
        want = t.grad.numpy()
        scale = max(float(np.abs(want).max()), 1e-3)
        err = float(np.abs(np.asarray(got[name]) - want).max())
        assert err <= 1e-4 * scale, (name, err, scale)


def test_adam_steps_match_pytorch(treelstm):
    graph, module = treelstm
    model = module.Model(seed=5)
    p = {k: torch.tensor(np.array(v), dtype=torch.float64, requires_grad=True) for k, v in model.parameters().items()}
    opt = torch.optim.Adam(list(p.values()), lr=1e-3)
    for step in range(3):
        inputs = _batch(graph, 20 + step)
        model.train_step(**inputs)
        opt.zero_grad()
        torch_treelstm_loss(p, inputs).backward()
        opt.step()
    for name, value in model.parameters().items():
        np.testing.assert_allclose(np.asarray(value), p[name].detach().numpy(), atol=2e-5, err_msg=name)
