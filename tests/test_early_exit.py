"""examples/early_exit.py (issue #42): a small BERT-style encoder whose examples exit
after the layer whose classifier is sure of them, each later layer a dg.cond over the
examples still running (its branch a whole encoder layer, attention included). The
generated module against the reference and against a PyTorch twin with the module's
weights that runs one example at a time, eagerly, layer by layer until it exits;
train_step against the reference and the twin; the example trained to its stated
accuracy; the plan's memory against the measured peak."""

from __future__ import annotations

import runpy

import numpy as np
import pytest
import sympy

import generator as dg
from conftest import ROOT, build_example
from generator.pipeline import lowered, prepare
from generator.reference import interpreter as reference


@pytest.fixture(scope="module")
def early_exit(builds):
    example = runpy.run_path(str(ROOT / "examples" / "early_exit.py"))
    graph = build_example("early_exit")  # the build tests/test_examples.py checks
    module, where = builds.module(graph)
    return example, graph, module, where


@pytest.fixture(scope="module")
def trained(early_exit):
    example, _, module, _ = early_exit
    # One thread: its small steps gain little from a second, and on a busy machine each
    # parallel region waits for a core (about 6x slower here, under load).
    threads = module.get_num_threads()
    module.set_num_threads(1)
    try:
        return example["train"](module, log=lambda *_: None)
    finally:
        module.set_num_threads(threads)


def _safe_thresholds(entropies):
    """Thresholds that none of `entropies` (the twin's, every example after every layer) comes
    within 1e-4 of: float32 and float64 then exit at the same layer."""
    values = np.sort(np.asarray(entropies))
    middles = (values[1:] + values[:-1]) / 2
    return middles[values[1:] - values[:-1] > 2e-4]


def _twin(torch, params, ex, layers=3, heads=2):
    """The model in PyTorch, float64: nn.Embedding, nn.LayerNorm, nn.TransformerEncoderLayer
    and nn.Linear per layer, loaded from the module's parameters (state_dict keys, dots as
    underscores)."""
    nn = torch.nn
    hidden = params["embeddings_norm_weight"].shape[0]
    ffn = params["encoder_layers_0_linear1_bias"].shape[0]
    twin = nn.ModuleDict(
        {
            "embeddings": nn.ModuleDict(
                {
                    "word_embeddings": nn.Embedding(ex["VOCAB"], hidden),
                    "position_embeddings": nn.Embedding(ex["T"], hidden),
                    "norm": nn.LayerNorm(hidden),
                }
            ),
            "encoder": nn.ModuleDict(
                {
                    "layers": nn.ModuleList(
                        nn.TransformerEncoderLayer(
                            hidden, heads, ffn, dropout=0.0, activation="gelu", batch_first=True
                        )
                        for _ in range(layers)
                    )
                }
            ),
            "classifiers": nn.ModuleList(nn.Linear(hidden, ex["CLASSES"]) for _ in range(layers)),
        }
    ).double()
    own = twin.state_dict()
    assert len(own) == len(params)
    for key in own:
        own[key] = torch.tensor(np.asarray(params[key.replace(".", "_")]), dtype=torch.float64)
    twin.load_state_dict(own)
    return twin.train()  # (the slow path: the fast path's fused kernels are for inference in float32)


def _twin_run(torch, twin, tokens, threshold):
    """One example at a time: each layer, then its classifier; the example exits once the
    entropy is under `threshold`. Returns (logits, exit layers, every layer's entropies, loss
    parts: each layer's logits for every example, for train_step's joint loss)."""
    emb = twin["embeddings"]
    logits_out, exits, entropies = [], [], []
    every = [[] for _ in twin["classifiers"]]
    for row in torch.tensor(tokens):
        x = emb["norm"](emb["word_embeddings"](row[None]) + emb["position_embeddings"].weight[None])
        mine = []
        for k, (layer, classifier) in enumerate(zip(twin["encoder"]["layers"], twin["classifiers"])):
            x = layer(x)
            logits = classifier(x[:, 0])
            every[k].append(logits)
            log_p = torch.log_softmax(logits, 1)
            entropy = -(log_p.exp() * log_p).sum()
            mine.append(entropy.item())
            if mine[-1] < threshold or k + 1 == len(twin["classifiers"]):
                break
        logits_out.append(logits[0])
        exits.append(k + 1)
        entropies.append(mine)
    return torch.stack(logits_out), np.array(exits), entropies, every


def _check_forward(torch, example, graph, model, tokens, threshold):
    """forward() at `threshold` against the reference and the twin: exit layers equal, logits
    close. Returns the exit layers."""
    twin = _twin(torch, model.parameters(), example)
    with torch.no_grad():
        want_logits, want_exits, _, _ = _twin_run(torch, twin, tokens, threshold)
    inputs = {"tokens": tokens, "threshold": np.array([threshold], np.float32)}
    got = model.forward(**inputs)
    ref = reference.run(graph, inputs, {k: np.asarray(v) for k, v in model.parameters().items()})
    assert got["exit_layer"].dtype == np.int64
    np.testing.assert_array_equal(got["exit_layer"], want_exits)
    np.testing.assert_array_equal(ref["exit_layer"], want_exits)
    np.testing.assert_allclose(got["logits"], want_logits.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["logits"], ref["logits"], rtol=1e-4, atol=1e-5)
    return got["exit_layer"]


def _mixed_threshold(torch, example, params, tokens, near=None):
    """A safe threshold (_safe_thresholds) at which the twin with `params` exits at as many
    different layers as any, the nearest to `near` of those (else the median entropy)."""
    twin = _twin(torch, params, example)
    with torch.no_grad():
        entropies = _twin_run(torch, twin, tokens, threshold=-1.0)[2]
    flat = [e for es in entropies for e in es]
    near = float(np.median(flat)) if near is None else near

    def layers_taken(t):
        return len({next((k for k, e in enumerate(es) if e < t), len(es)) for es in entropies})

    candidates = _safe_thresholds(flat)
    most = max(layers_taken(t) for t in candidates)
    best = [t for t in candidates if layers_taken(t) == most]
    return float(min(best, key=lambda t: abs(t - near)))


def test_forward_matches_reference_and_a_per_example_pytorch_twin(early_exit):
    """Untrained: threshold 0 (every example runs every layer: no entropy is below 0), one
    where they exit at mixed layers, and 1 (all exit after the first: no entropy of two
    classes is over log 2); batch 1 too."""
    torch = pytest.importorskip("torch")
    example, graph, module, _ = early_exit
    model = module.Model(seed=3)
    tokens = example["make_sentences"](12, 5)["tokens"]
    assert (_check_forward(torch, example, graph, model, tokens, threshold=0.0) == 3).all()
    assert (_check_forward(torch, example, graph, model, tokens, threshold=1.0) == 1).all()
    middle = _mixed_threshold(torch, example, model.parameters(), tokens)
    mixed = _check_forward(torch, example, graph, model, tokens, threshold=middle)
    assert len(set(mixed.tolist())) == 3, mixed  # every exit layer taken
    _check_forward(torch, example, graph, model, tokens[:1], threshold=middle)


def test_trained_model_exits_early_and_keeps_its_accuracy(early_exit, trained):
    torch = pytest.importorskip("torch")
    example, graph, _, _ = early_exit
    model, results = trained
    every, early = results[0.0], results[0.05]
    assert every["accuracy"] >= 0.95 and every["exit_layer"] == 3.0
    assert early["accuracy"] >= every["accuracy"] - 0.01 and early["exit_layer"] <= 2.0
    # the sentences with a "not" run more layers than those without
    assert early["exit_layer_with_not"] >= early["exit_layer_without_not"] + 0.5
    tokens = example["make_sentences"](16, 9)["tokens"]
    exits = _check_forward(
        torch,
        example,
        graph,
        model,
        tokens,
        _mixed_threshold(torch, example, model.parameters(), tokens, near=0.05),
    )
    assert len(set(exits.tolist())) >= 2, exits


def _check_train_step(torch, example, graph, module, data, threshold):
    """One train_step (Adam) against the reference's loss and gradients and the twin's
    joint loss (each layer's classifier on every example: threshold 0) and autograd."""
    model = module.Model(seed=4)
    start = {k: np.array(v) for k, v in model.parameters().items()}
    inputs = dict(data, threshold=np.array([threshold], np.float32))
    loss = model.train_step(**inputs)
    got = {k: np.asarray(v) for k, v in model.gradients().items()}
    ref_loss, ref_grads = reference.gradients(graph, inputs, start)
    assert abs(loss - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss))
    for name, g in ref_grads.items():
        np.testing.assert_allclose(got[name], g, rtol=1e-3, atol=1e-5, err_msg=name)
    if threshold > 0:
        return
    twin = _twin(torch, start, example)
    _, _, _, every = _twin_run(torch, twin, data["tokens"], threshold)
    labels = torch.tensor(data["labels"])
    want = sum(torch.nn.functional.cross_entropy(torch.cat(layer), labels) for layer in every)
    want.backward()
    assert abs(loss - want.item()) <= 1e-5 * max(1.0, abs(want.item()))
    grads = {k.replace(".", "_"): p.grad.numpy() for k, p in twin.named_parameters()}
    for name, g in grads.items():
        np.testing.assert_allclose(got[name], g, rtol=1e-3, atol=1e-5, err_msg=name)


def test_train_step_matches_reference_and_pytorch_twin(early_exit):
    """Threshold 0 (training: every example through every layer) against the reference and
    the twin; a positive threshold, where the examples that exited carry their logits
    through the later conds' else-branch and its gradient, against the reference."""
    torch = pytest.importorskip("torch")
    example, graph, module, _ = early_exit
    data = example["make_sentences"](6, 13)
    _check_train_step(torch, example, graph, module, data, 0.0)
    middle = _mixed_threshold(torch, example, module.Model(seed=4).parameters(), data["tokens"])
    exits = module.Model(seed=4).forward(tokens=data["tokens"], threshold=np.array([middle], np.float32))
    assert 1 < len(set(exits["exit_layer"].tolist())), exits  # both branches of a cond taken
    _check_train_step(torch, example, graph, module, data, middle)
    # ten Adam steps, threshold 0, against the reference's own
    model = module.Model(seed=4)
    params = {k: np.array(v) for k, v in model.parameters().items()}
    state = {}
    inputs = dict(data, threshold=np.zeros(1, np.float32))
    for step in range(1, 11):
        loss = model.train_step(**inputs)
        ref_loss = reference.train_step(graph, inputs, params, state, step)
        assert abs(loss - ref_loss) <= 1e-4 * max(1.0, abs(ref_loss))
    hidden = params["embeddings_norm_weight"].shape[0]
    for name, v in model.parameters().items():
        got, want = np.asarray(v), params[name]
        if name.endswith("in_proj_bias"):  # the keys' bias: its gradient is 0 but for rounding (a
            # shift of every key's score; softmax ignores it), which Adam scales to whole steps
            got, want = np.delete(got, np.s_[hidden : 2 * hidden]), np.delete(
                want, np.s_[hidden : 2 * hidden]
            )
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4, err_msg=name)


def test_measured_memory_equals_plan(early_exit):
    example, _, module, _ = early_exit
    memory = lowered(prepare(build_example("early_exit"))).memory
    model = module.Model(seed=0)
    N = dg.dim("N")
    for n, threshold in ((1, 0.0), (5, 0.69), (9, 0.0), (7, 1.0)):
        data = example["make_sentences"](n, n)
        inputs = dict(data, threshold=np.array([threshold], np.float32))
        model.forward(tokens=data["tokens"], threshold=inputs["threshold"])
        stats = model.memory_stats()
        want = 4 * int(sympy.sympify(memory["forward_floats"]).subs({N: n}))
        assert stats["peak_bytes"] == stats["predicted_peak_bytes"] == want
        model.train_step(**inputs)
        stats = model.memory_stats()
        want = 4 * int(sympy.sympify(memory["train_floats"]).subs({N: n}))
        assert stats["peak_bytes"] == stats["predicted_peak_bytes"] == want


def test_generated_code_reads_as_batched_blocks_over_the_examples_still_running(early_exit):
    """Each later layer: one batched block over the examples still running, one over those
    that exited (carried along), listed by index; no per-example loop."""
    _, _, _, where = early_exit
    code = "\n".join(p.read_text() for p in (where / "src_tree").rglob("*.cpp"))
    for k in (1, 2):
        assert (
            f"// dg.cond, compacted: the examples still running after layer {k}, and those that exited by "
            f"layer {k}, listed by index;"
        ) in code
        assert (
            f"// The examples still running after layer {k} (the then-branch): one batched block of their rows"
            in code
        )
        assert (
            f"// The examples that exited by layer {k} (the else-branch): one batched block of their rows"
            in code
        )
        assert f"// The examples still running after layer {k} (the then-branch), backward:" in code
    assert (
        "dg::branch_examples(" in code and "for (std::int64_t n" not in code and "for (int64_t n" not in code
    )
