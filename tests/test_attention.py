"""Attention layers against PyTorch, weights copied one to one by name (deepgen's
`<name>_<state_dict key with dots as underscores>`): dg.transformer_encoder_layer
against torch.nn.TransformerEncoderLayer (post- and pre-norm, relu and gelu) and
examples/bert_encoder.py against a twin built from torch.nn modules, on batches of
mixed lengths with src_key_padding_mask True past each length. Forward values and
gradients (every parameter, and the layer's input) through the reference
interpreter in float64 and through the generated, compiled module in float32.
Then bad lengths, masks and layer arguments: clear errors naming the input."""

from __future__ import annotations

import numpy as np
import pytest

import generator as dg
from conftest import CHECK_BUILD_FLAGS, ROOT, load_example
from generator.reference import interpreter as reference
from generator.transforms.autodiff import differentiate

torch = pytest.importorskip("torch")

N, T = dg.dim("N"), dg.dim("T")
E, HEADS, FFN = 8, 2, 16
LENGTHS = np.array([5, 2, 4])  # padded to T = 5: one full sequence, two shorter ones
LAYERS = [("relu", False), ("gelu", True)]  # (activation, norm_first) of the two stacked layers


@dg.model
def two_layers():
    """A post-norm relu layer, then a pre-norm gelu one; loss = sum(y * target)."""
    x = dg.input("x", (N, T, E))
    lengths = dg.input("lengths", (N,), dtype="int64")
    target = dg.input("target", (N, T, E))
    h = x
    for i, (act, norm_first) in enumerate(LAYERS):
        h = dg.transformer_encoder_layer(h, lengths, E, HEADS, FFN, activation=act, norm_first=norm_first,
                                         eps=1e-5, name=f"layer{i}")
    dg.train(dg.sum(h * target), dg.sgd(lr=1e-30))
    return {"y": h}


def _torch_layers(params, dtype):
    layers = []
    for i, (act, norm_first) in enumerate(LAYERS):
        layer = torch.nn.TransformerEncoderLayer(E, HEADS, FFN, dropout=0.0, activation=act, batch_first=True,
                                                 norm_first=norm_first)
        _load(layer, params, f"layer{i}_")
        layers.append(layer.to(dtype).train())
    return layers


def _load(module, params, prefix=""):
    """The deepgen parameters, by name, as the module's state_dict (which must match exactly)."""
    keys = module.state_dict().keys()
    assert {prefix + k.replace(".", "_") for k in keys} == {k for k in params if k.startswith(prefix)}
    module.load_state_dict({k: torch.tensor(np.asarray(params[prefix + k.replace(".", "_")])) for k in keys})


def _padding(lengths, T):
    return torch.arange(T)[None, :] >= torch.as_tensor(lengths)[:, None]  # True: ignore this key


def _layer_inputs(dtype=np.float32):
    rng = np.random.default_rng(7)
    shape = (len(LENGTHS), int(LENGTHS.max()), E)
    return {"x": rng.normal(size=shape).astype(dtype), "lengths": LENGTHS.astype(np.int64),
            "target": rng.normal(size=shape).astype(dtype)}


def _torch_layers_run(params, inputs, dtype):
    """(y, {parameter name: gradient}, d loss / d x) of the PyTorch twin."""
    layers = _torch_layers(params, dtype)
    x = torch.tensor(inputs["x"], dtype=dtype, requires_grad=True)
    mask = _padding(inputs["lengths"], x.shape[1])
    h = x
    for layer in layers:
        h = layer(h, src_key_padding_mask=mask)
    (h * torch.tensor(inputs["target"], dtype=dtype)).sum().backward()
    grads = {f"layer{i}_{k.replace('.', '_')}": p.grad.numpy() for i, layer in enumerate(layers)
             for k, p in layer.named_parameters()}
    return h.detach().numpy(), grads, x.grad.numpy()


def test_layers_match_torch_in_float64():
    graph = two_layers.build()
    params = {k: v.astype(np.float64) for k, v in reference.init_params(graph, seed=3).items()}
    inputs = _layer_inputs(np.float64)
    x = graph.inputs[0]
    loss = graph.train.loss
    wrt = graph.trainable + [x]
    grads = differentiate(graph, loss, wrt)
    got = reference.run(graph, inputs, params, float_dtype=np.float64, values=[dict(graph.outputs)["y"]]
                        + [grads[id(v)] for v in wrt])
    y, want_grads, want_dx = _torch_layers_run(params, inputs, torch.float64)
    np.testing.assert_allclose(got[dict(graph.outputs)["y"].name], y, rtol=1e-10, atol=1e-10)
    for p in graph.trainable:
        np.testing.assert_allclose(got[grads[id(p)].name], want_grads[p.name], rtol=1e-9, atol=1e-10,
                                   err_msg=p.name)
    np.testing.assert_allclose(got[grads[id(x)].name], want_dx, rtol=1e-9, atol=1e-10)
    # padded positions matter: a padded query row attends to the valid keys, and its value reaches the loss
    assert np.abs(want_dx[1, 2:]).max() > 1e-3


def test_initialization_follows_pytorch():
    """in_proj xavier-uniform, out_proj and Linear layers uniform in +-1/sqrt(fan_in), zero
    attention biases, unit norms: the ranges PyTorch draws from."""
    params = reference.init_params(two_layers.build(), seed=0)
    xavier = np.sqrt(6 / (4 * E))
    w = params["layer0_self_attn_in_proj_weight"]
    assert w.shape == (3 * E, E) and xavier * 0.8 < np.abs(w).max() <= xavier
    assert not params["layer0_self_attn_in_proj_bias"].any() and not params["layer0_self_attn_out_proj_bias"].any()
    for name, fan_in in (("self_attn_out_proj_weight", E), ("linear1_weight", E), ("linear1_bias", E),
                         ("linear2_weight", FFN), ("linear2_bias", FFN)):
        assert np.abs(params[f"layer1_{name}"]).max() <= fan_in**-0.5, name
    assert (params["layer0_norm2_weight"] == 1).all() and not params["layer0_norm2_bias"].any()


@pytest.fixture(scope="module")
def compiled(builds):
    """conftest's builds, with this file's two modules (the two layers, BERT's encoder in
    training) built side by side when a test first asks for one (Builds.prebuild), at
    CHECK_BUILD_FLAGS' -O0: the tests compare values with PyTorch at tiny sizes (E 8) and
    time nothing. On the 2-core AMD EPYC CI machine, loaded: 123 s for both, against
    111 s + 135 s one after the other at -O2."""
    builds.prebuild([two_layers.build("attention_layers"),
                     load_example("bert_encoder").build("bert_encoder_train", train=True)], flags=CHECK_BUILD_FLAGS)
    return builds


@pytest.fixture(scope="module")
def layers_module(compiled):
    graph = two_layers.build("attention_layers")
    module, _ = compiled.module(graph)
    return graph, module


def test_generated_layers_match_torch(layers_module):
    graph, module = layers_module
    model = module.Model(seed=3)
    params = {k: np.array(v) for k, v in model.parameters().items()}
    inputs = _layer_inputs()
    y, grads, _ = _torch_layers_run(params, {k: v.astype(np.float64) if v.dtype == np.float32 else v
                                             for k, v in inputs.items()}, torch.float64)
    got = model.forward(x=inputs["x"], lengths=inputs["lengths"])["y"]
    np.testing.assert_allclose(got, y, rtol=1e-4, atol=1e-4)
    model.train_step(**inputs)  # lr 1e-30: the gradients are kept, the parameters stay
    got_grads = model.gradients()
    assert set(got_grads) == set(grads)
    for name, want in grads.items():
        np.testing.assert_allclose(got_grads[name], want, rtol=1e-3, atol=1e-4 * np.abs(want).max(), err_msg=name)


# -- the BERT example ---------------------------------------------------------------


def _bert_twin(params, dtype, heads=4):
    """embeddings + nn.TransformerEncoder + pooler + classifier, named as the example names them
    (the small size: 4 heads)."""
    from torch import nn

    V, H = params["embeddings_word_embeddings_weight"].shape
    ffn, depth = params["encoder_layers_0_linear1_weight"].shape[0], _depth(params)
    twin = nn.Module()
    twin.embeddings = nn.Module()
    twin.embeddings.word_embeddings = nn.Embedding(V, H)
    twin.embeddings.position_embeddings = nn.Embedding(params["embeddings_position_embeddings_weight"].shape[0], H)
    twin.embeddings.norm = nn.LayerNorm(H, eps=1e-12)
    layer = nn.TransformerEncoderLayer(H, heads, ffn, dropout=0.0, activation="gelu", batch_first=True,
                                       layer_norm_eps=1e-12)
    twin.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
    twin.pooler = nn.Linear(H, H)
    twin.classifier = nn.Linear(H, params["classifier_bias"].shape[0])
    _load(twin, params)
    return twin.to(dtype).train()


def _depth(params):
    return len({k.split("_")[2] for k in params if k.startswith("encoder_layers_")})


def _bert_torch(twin, inputs):
    """(hidden, logits, loss) of the twin; loss.backward() fills its gradients."""
    tokens = torch.as_tensor(inputs["tokens"])
    T = tokens.shape[1]
    emb = twin.embeddings
    x = emb.norm(emb.word_embeddings(tokens) + emb.position_embeddings.weight[:T])
    hidden = twin.encoder(x, src_key_padding_mask=_padding(inputs["lengths"], T))
    logits = twin.classifier(torch.tanh(twin.pooler(hidden[:, 0])))
    loss = torch.nn.functional.cross_entropy(logits, torch.as_tensor(inputs["labels"]))
    return hidden, logits, loss


def _bert_inputs():
    rng = np.random.default_rng(11)
    lengths = np.array([6, 1, 3, 5], dtype=np.int64)
    return {"tokens": rng.integers(0, 100, (4, 6)).astype(np.int64), "lengths": lengths,
            "labels": np.array([0, 1, 1, 0], dtype=np.int64)}


def test_bert_example_matches_torch_in_float64():
    graph = load_example("bert_encoder").build(train=True)
    params = {k: v.astype(np.float64) for k, v in reference.init_params(graph, seed=2).items()}
    inputs = _bert_inputs()
    twin = _bert_twin(params, torch.float64)
    hidden, logits, loss = _bert_torch(twin, inputs)
    loss.backward()
    got = reference.run(graph, inputs, params, float_dtype=np.float64)
    np.testing.assert_allclose(got["hidden"], hidden.detach().numpy(), rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(got["logits"], logits.detach().numpy(), rtol=1e-9, atol=1e-12)
    got_loss, grads = reference.gradients(graph, inputs, params, float_dtype=np.float64)
    np.testing.assert_allclose(got_loss, loss.item(), rtol=1e-12)
    want = {k.replace(".", "_"): p.grad.numpy() for k, p in twin.named_parameters()}
    assert set(grads) == set(want)
    for name, g in grads.items():
        np.testing.assert_allclose(g, want[name], rtol=1e-8, atol=1e-12, err_msg=name)


@pytest.fixture(scope="module")
def bert_module(compiled):
    graph = load_example("bert_encoder").build("bert_encoder_train", train=True)
    module, _ = compiled.module(graph)
    return graph, module


def test_generated_bert_matches_torch(bert_module):
    graph, module = bert_module
    model = module.Model(seed=2)
    params = {k: np.array(v, dtype=np.float64) for k, v in model.parameters().items()}
    inputs = _bert_inputs()
    twin = _bert_twin(params, torch.float64)
    hidden, logits, loss = _bert_torch(twin, inputs)
    loss.backward()
    got = model.forward(tokens=inputs["tokens"], lengths=inputs["lengths"])
    np.testing.assert_allclose(got["hidden"], hidden.detach().numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got["logits"], logits.detach().numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(model.train_step(**inputs), loss.item(), rtol=1e-5)
    want = {k.replace(".", "_"): p.grad.numpy() for k, p in twin.named_parameters()}
    got_grads = model.gradients()
    assert set(got_grads) == set(want)
    for name, g in got_grads.items():
        np.testing.assert_allclose(g, want[name], rtol=2e-3, atol=2e-4 * np.abs(want[name]).max() + 1e-9,
                                   err_msg=name)


@pytest.mark.parametrize("bad, position", [(7, 2), (0, 1), (-3, 3)])
def test_bad_lengths_are_value_errors_naming_them(bert_module, bad, position):
    graph, module = bert_module
    inputs = _bert_inputs()
    inputs["lengths"] = inputs["lengths"].copy()
    inputs["lengths"][position] = bad
    forward = {k: v for k, v in inputs.items() if k != "labels"}
    message = rf"length_mask of lengths 'lengths'.*: length {bad} at position {position} is out of range \[1, 6\]"
    with pytest.raises(ValueError, match=message):
        module.Model().forward(**forward)
    with pytest.raises(ValueError, match=message.replace(".*", "")):
        reference.run(graph, forward)
    model = module.Model(seed=1)
    before = {k: np.array(v) for k, v in model.parameters().items()}
    with pytest.raises(ValueError, match=message):
        model.train_step(**inputs)
    for k, v in model.parameters().items():  # a bad batch changes nothing
        np.testing.assert_array_equal(v, before[k], err_msg=k)


def test_lengths_of_wrong_count_or_dtype_are_value_errors(bert_module):
    graph, module = bert_module
    inputs = {k: v for k, v in _bert_inputs().items() if k != "labels"}
    for bad, message in ((np.array([6, 1, 3], np.int64), "lengths"), (inputs["lengths"].astype(np.float32),
                                                                       "expected dtype int64")):
        for run in (module.Model().forward, lambda **kw: reference.run(graph, kw)):
            with pytest.raises(ValueError, match=message) as error:
                run(**dict(inputs, lengths=bad))
            assert "'lengths'" in str(error.value)


def test_bad_masks_and_layer_arguments_are_errors_at_the_line():
    def build(body):
        @dg.model
        def net():
            x = dg.input("x", (N, T, E))
            lengths = dg.input("lengths", (N,), dtype="int64")
            return {"y": body(x, lengths)}

        return net.build()

    scores = lambda x: dg.bmm(x, x, tb=True)  # noqa: E731  [N, T, T]
    with pytest.raises(dg.ShapeError, match=r"mask 'mask' \[N, 4\] does not broadcast to .* \[N, T, T\]"):
        build(lambda x, l: dg.softmax(scores(x), mask=dg.input("mask", (N, 4))))
    with pytest.raises(dg.ShapeError, match="lengths 'x' must be int32/int64"):
        build(lambda x, l: dg.length_mask(x, T))
    with pytest.raises(dg.ShapeError, match=r"inner dimensions differ"):
        build(lambda x, l: dg.bmm(x, x))
    with pytest.raises(dg.ModelError, match="d_model 8 must be divisible by nhead 3"):
        build(lambda x, l: dg.transformer_encoder_layer(x, l, E, 3, FFN, name="enc"))
    with pytest.raises(dg.ShapeError, match=r"must be \[N, T, 16\]"):
        build(lambda x, l: dg.transformer_encoder_layer(x, l, 16, 2, FFN, name="enc"))
    with pytest.raises(dg.ModelError, match="activation must be"):
        build(lambda x, l: dg.transformer_encoder_layer(x, l, E, 2, FFN, activation="swish", name="enc"))


def test_memory_command_takes_model_options(capsys):
    from generator.tools import cli

    example = str(ROOT / "examples" / "bert_encoder.py")
    assert cli.main(["memory", example, "--batch", "8", "--dim", "T=128"]) == 0
    out = capsys.readouterr().out
    assert "peak (planned arena)" in out and "at N=8, T=128" in out
    assert cli.main(["memory", example, "--option", "layers=1", "--option", "train=True", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "encoder_layers_0" in out and "encoder_layers_1" not in out and "optimizer state" in out
    assert cli.main(["memory", example, "--option", "size"]) == 1
    assert "expected NAME=VALUE" in capsys.readouterr().err
