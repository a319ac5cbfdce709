"""Models from PyTorch (generator/importers): an MLP, a CNN with batch norm, an LSTM
classifier and a TransformerEncoderLayer are imported with from_torch, the written
model file is loaded as `deepgen generate` loads it, and the numpy reference
interpreter with the written weights gives PyTorch's eval-mode outputs (1e-4); each is
also generated, built and run with the .npz loaded (1e-4). Then what is not
supported: errors naming the module or function and the user's line. And the CLI."""

from __future__ import annotations

import numpy as np
import pytest

import generator as dg
from generator.frontend.loader import load_model
from generator.importers import write_model
from generator.reference import interpreter as reference

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        self.layers = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.2), nn.Linear(16, 16), nn.SiLU())
        self.out = nn.Linear(16, 5)

    def forward(self, x):
        h = F.relu(self.fc1(x))
        h = h + self.layers(h) * 0.5  # residual add, scalar mul
        a, b = torch.split(h, [6, 10], dim=1)
        h = torch.cat([torch.tanh(b), a], dim=1)
        return torch.softmax(self.out(h), dim=-1)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(6)
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(6, 8, 3, bias=False)  # as ResNet's convolutions
        self.bn2 = nn.BatchNorm2d(8)
        self.avg = nn.AvgPool2d(2, stride=1)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        x = torch.sigmoid(self.bn2(self.conv2(x)))
        x = torch.flatten(self.gap(self.avg(x)), 1)
        return self.fc(x)


class LSTMClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.lstm = nn.LSTM(8, 10, num_layers=2, batch_first=True)
        self.head = nn.Linear(20, 3)

    def forward(self, tokens):
        out, (h, c) = self.lstm(self.embed(tokens))
        return self.head(torch.cat([out[:, -1], c[-1]], dim=1))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, activation="gelu", batch_first=True)
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 4)

    def forward(self, x):
        y = self.norm(self.layer(x))
        b, t, e = y.shape
        return self.proj(y.reshape(b * t, e)).view(b, t, 4).permute(0, 2, 1)


def _randomize(module, seed):
    """Weights and batch norm statistics away from their defaults, so a mix-up shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if t.dtype.is_floating_point:
                t.copy_(torch.rand(t.shape, generator=g) + 0.5 if "running_var" in name
                        else torch.randn(t.shape, generator=g) * 0.5)
    return module.eval()


def _import(module, example, tmp_path, name):
    """from_torch -> files in tmp_path -> (graph loaded from the file, weights from the .npz)."""
    source, weights = dg.from_torch(module, example, name=name)
    model_path, weights_path = write_model(source, weights, str(tmp_path / f"{name}.py"))
    graph = load_model(model_path).build()
    with np.load(weights_path) as f:
        params = {k: f[k] for k in f.files}
    return graph, params, source


def _reference_matches(module, inputs, tmp_path, name, extra=None):
    example = {k: torch.as_tensor(v) for k, v in inputs.items()}
    graph, params, source = _import(module, example, tmp_path, name)
    with torch.no_grad():
        want = module(**example).numpy()
    got = reference.run(graph, {**inputs, **(extra or {})}, params, training=False)["output"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    return graph, params, source


def test_mlp(tmp_path):
    x = np.random.default_rng(0).normal(size=(4, 12)).astype(np.float32)
    graph, params, source = _reference_matches(_randomize(MLP(), 1), {"x": x}, tmp_path, "mlp")
    assert sorted(params) == sorted(k.replace(".", "_") for k in MLP().state_dict())
    assert 'x = dg.input("x", (N, 12))' in source and "dg.dropout(" in source
    assert "# test_from_torch.py:" in source  # each block cites the PyTorch line it came from


def test_cnn_with_batch_norm(tmp_path):
    x = np.random.default_rng(1).normal(size=(2, 3, 8, 8)).astype(np.float32)
    _, params, source = _reference_matches(_randomize(CNN(), 2), {"x": x}, tmp_path, "cnn")
    assert "bn1_running_var" in params and "dg.batch_norm_layer(" in source


def test_lstm_classifier(tmp_path):
    tokens = np.random.default_rng(2).integers(0, 20, (3, 5)).astype(np.int64)
    graph, _, source = _reference_matches(_randomize(LSTMClassifier(), 3), {"tokens": tokens}, tmp_path, "lstm_cls",
                                          extra={"lengths": np.full(3, 5, np.int64)})
    assert [v.name for v in graph.inputs] == ["tokens", "lengths"]
    assert "(N, T)" in source and "dg.lstm(" in source


def test_transformer_encoder_layer(tmp_path):
    x = np.random.default_rng(3).normal(size=(2, 5, 8)).astype(np.float32)
    _, _, source = _reference_matches(_randomize(Encoder(), 4), {"x": x}, tmp_path, "encoder")
    assert "dg.reshape(norm, (N * T, 8))" in source  # sizes read from x.shape stay symbolic


class Mix(nn.Module):
    """A bidirectional GRU, self-attention, a pre-norm TransformerEncoder with a final norm, a bare
    parameter, chunk, log_softmax, mean and a transposed, flattened h_n: two outputs."""

    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(6, 8, batch_first=True, bidirectional=True)
        self.attn = nn.MultiheadAttention(16, 4, batch_first=True)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True, norm_first=True)
        self.stack = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(16), enable_nested_tensor=False)
        self.scale = nn.Parameter(torch.ones(16))

    def forward(self, x):
        out, h = self.gru(x)
        a, _ = self.attn(out, out, out, need_weights=False)
        y = self.stack(a + out) * self.scale
        p, q = y.chunk(2, dim=-1)
        return F.log_softmax(p * torch.sigmoid(q), dim=-1).mean(dim=1), h.transpose(0, 1).flatten(1)


def test_gru_attention_and_encoder_stack(tmp_path):
    module = _randomize(Mix(), 6)
    x = np.random.default_rng(5).normal(size=(3, 5, 6)).astype(np.float32)
    graph, params, _ = _import(module, torch.as_tensor(x), tmp_path, "mix")
    assert sorted(params) == sorted(k.replace(".", "_") for k in module.state_dict())
    got = reference.run(graph, {"x": x, "lengths": np.full(3, 5, np.int64)}, params, training=False)
    with torch.no_grad():
        want = module(torch.as_tensor(x))
    for name, w in zip(("output0", "output1"), want):
        np.testing.assert_allclose(got[name], w.numpy(), rtol=1e-4, atol=1e-4, err_msg=name)


def test_generated_cnn_loads_the_weights(tmp_path, builds):
    module = _randomize(CNN(), 5)
    x = np.random.default_rng(4).normal(size=(3, 3, 8, 8)).astype(np.float32)
    source, weights = dg.from_torch(module, torch.as_tensor(x), name="from_torch_cnn")
    model_path, weights_path = write_model(source, weights, str(tmp_path / "cnn.py"))
    compiled, _ = builds.module(load_model(model_path).build())
    model = compiled.Model()
    model.load(weights_path)
    model.eval()
    with torch.no_grad():
        want = module(torch.as_tensor(x)).numpy()
    np.testing.assert_allclose(model.forward(x=x)["output"], want, rtol=1e-4, atol=1e-4)


GENERATED = {  # the other three models of the issue, compiled too: module, inputs, extra inputs
    "mlp": (MLP, {"x": ((3, 12), np.float32)}, {}),
    "lstm": (LSTMClassifier, {"tokens": ((3, 5), np.int64)}, {"lengths": np.full(3, 5, np.int64)}),
    "encoder": (Encoder, {"x": ((2, 5, 8), np.float32)}, {}),
}


@pytest.mark.parametrize("kind", list(GENERATED))
def test_generated_models_match_torch(kind, tmp_path, builds):
    make, shapes, extra = GENERATED[kind]
    module = _randomize(make(), 7)
    rng = np.random.default_rng(8)
    inputs = {k: rng.integers(0, 20, shape).astype(dtype) if dtype == np.int64 else rng.normal(size=shape).astype(dtype)
              for k, (shape, dtype) in shapes.items()}
    example = {k: torch.as_tensor(v) for k, v in inputs.items()}
    source, weights = dg.from_torch(module, example, name=f"from_torch_{kind}")
    model_path, weights_path = write_model(source, weights, str(tmp_path / f"{kind}.py"))
    compiled, _ = builds.module(load_model(model_path).build())
    model = compiled.Model()
    model.load(weights_path)
    if hasattr(model, "eval"):  # a model with dropout or batch norm starts in training mode
        model.eval()
    with torch.no_grad():
        want = module(**example).numpy()
    np.testing.assert_allclose(model.forward(**inputs, **extra)["output"], want, rtol=1e-4, atol=1e-4)


# -- what is not supported -------------------------------------------------------------


class WithUnfold(nn.Module):
    def __init__(self):
        super().__init__()
        self.unfold = nn.Unfold(2)

    def forward(self, x):
        return self.unfold(x)  # the line the error names


class WithFFT(nn.Module):
    def forward(self, x):
        return torch.fft.fft(x).real


class WithControlFlow(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x
        return -x


def test_unsupported_module_names_it_and_the_line():
    with pytest.raises(dg.DeepgenError) as e:
        dg.from_torch(WithUnfold(), torch.zeros(1, 1, 4, 4))
    text = str(e.value)
    assert "self.unfold (nn.Unfold)" in text and "test_from_torch.py:" in text
    assert "return self.unfold(x)  # the line the error names" in text


def test_unsupported_function_names_it_and_the_line():
    with pytest.raises(dg.DeepgenError, match=r"torch\.fft\.fft(.|\n)*return torch.fft.fft\(x\).real"):
        dg.from_torch(WithFFT(), torch.zeros(2, 4))


def test_untraceable_module_says_why():
    with pytest.raises(dg.DeepgenError, match=r"torch.fx cannot trace WithControlFlow at .*test_from_torch.py:\d+ "
                                              r"\(`if x.sum\(\) > 0:`\)"):
        dg.from_torch(WithControlFlow(), torch.zeros(2, 4))


def test_example_input_pytorch_rejects_names_the_layer_and_its_error(capsys):
    """The module's own error (a shape mismatch), not fx's wrapper of it, and no traceback printed."""
    with pytest.raises(dg.DeepgenError) as e:
        dg.from_torch(MLP(), torch.zeros(2, 7))
    text = str(e.value)
    assert "running MLP on the example inputs failed in self.fc1: RuntimeError: mat1 and mat2 shapes cannot be " \
           "multiplied (2x7 and 12x16)" in text, text
    assert "test_from_torch.py:" in text and "ShapeProp" not in text
    assert capsys.readouterr().err == ""


def test_a_translation_the_example_shapes_break_names_the_line():
    """A 1-D example: PyTorch's Linear takes it, the import makes axis 0 the batch N."""
    with pytest.raises(dg.DeepgenError) as e:
        dg.from_torch(nn.Sequential(nn.Linear(6, 3)), torch.zeros(6))
    text = str(e.value)
    assert "self.0, imported as `t0 = dg.linear_t(input_1, layer_0_weight, layer_0_bias)`" in text, text
    assert "does not check with the example inputs' shapes: matmul: inner dimensions differ" in text, text
    assert "<deepgen from-torch" not in text


def test_bad_layer_options_are_named():
    lstm = nn.LSTM(4, 4)  # batch_first=False

    class Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = lstm

        def forward(self, x):
            return self.rnn(x)[0]

    with pytest.raises(dg.DeepgenError, match=r"self.rnn \(nn.LSTM\): batch_first=False"):
        dg.from_torch(Seq(), torch.zeros(2, 3, 4))


# -- the command line --------------------------------------------------------------------


def test_cli_writes_a_loadable_model(tmp_path, capsys):
    from generator.tools import cli

    (tmp_path / "net.py").write_text(
        "import torch\n\n\ndef make():\n    return torch.nn.Sequential(torch.nn.Linear(6, 3), torch.nn.Tanh())\n")
    out = tmp_path / "out" / "net_model.py"
    out.parent.mkdir()
    assert cli.main(["from-torch", f"{tmp_path / 'net.py'}:make", "-o", str(out), "--example-input", "input=2,6",
                     "--name", "net"]) == 0
    assert "wrote" in capsys.readouterr().out
    graph = load_model(str(out)).build()
    with np.load(out.with_suffix(".npz")) as f:
        assert sorted(f.files) == ["layer_0_bias", "layer_0_weight"]
        params = {k: f[k] for k in f.files}
    x = np.ones((5, 6), np.float32)  # another batch size than the example's: N is symbolic
    want = np.tanh(x @ params["layer_0_weight"].T + params["layer_0_bias"])
    np.testing.assert_allclose(reference.run(graph, {"input": x}, params)["output"], want, rtol=1e-5, atol=1e-6)
    assert cli.main(["from-torch", f"{tmp_path / 'net.py'}:nothing", "-o", str(out), "--example-input",
                     "input=2,6"]) == 1
    assert "has no function 'nothing'" in capsys.readouterr().err
    assert cli.main(["from-torch", f"{tmp_path / 'net.py'}:make", "-o", str(out), "--example-input", "input=2,6",
                     "--example-input", "input=3,6"]) == 1
    assert "--example-input 'input=3,6': 'input' is given twice" in capsys.readouterr().err
