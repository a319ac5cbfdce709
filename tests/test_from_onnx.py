"""Models from ONNX files (generator/importers/onnx_import.py): small PyTorch models exported
with torch.onnx.export (a CNN with batch norm and pools, an MLP, a transformer encoder layer at
two opsets, torchvision's ResNet-18 and MobileNet v3, Hugging Face's BERT, DistilBERT, RoBERTa,
GPT-2 and BART encoder with attention masks), a scikit-learn MLPClassifier through
skl2onnx, and a hand-written graph of the ops those exporters do not write. Each written model
file is loaded as `deepgen generate` loads it, and the numpy reference interpreter with the
written weights gives the oracle's outputs (relative error <= 1e-4): onnxruntime where it is
installed, else PyTorch / scikit-learn / onnx's own reference evaluator. One model is also
generated, built and run with the .npz loaded. Then what is not supported (one-line errors
naming op, node and opset) and the command line."""

from __future__ import annotations

import importlib.util
import io
import warnings

import numpy as np
import pytest

from generator.errors import DeepgenError
from generator.frontend.loader import load_model
from generator.importers import write_model
from generator.reference import interpreter as reference

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from generator.importers.onnx_import import from_onnx  # noqa: E402

HAVE_ORT = importlib.util.find_spec("onnxruntime") is not None
TOL = 1e-4


def _relative(got, want) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-12))


def _oracle(model_bytes: bytes, feeds: dict, names):
    """onnxruntime's outputs where it is installed, else onnx's reference evaluator's."""
    if HAVE_ORT:
        import onnxruntime

        session = onnxruntime.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
        return session.run(list(names), feeds)
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(onnx.load_from_string(model_bytes)).run(list(names), feeds)


def _import(model, tmp_path, name, outputs=None):
    """from_onnx -> files in tmp_path -> (graph loaded from the file, weights from the .npz, source)."""
    source, weights = from_onnx(model, name=name, outputs=outputs)
    model_path, weights_path = write_model(source, weights, str(tmp_path / f"{name}.py"))
    graph = load_model(model_path).build()
    with np.load(weights_path) as f:
        params = {k: f[k] for k in f.files if not k.startswith("meta/")}  # (the ONNX value names)
    return graph, params, source


def _run(graph, params, feeds):
    return reference.run(graph, feeds, params, training=False)


# -- models exported by PyTorch -------------------------------------------------------

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional


def _export(module, args, names, dynamic=True, opset=None, **options) -> bytes:
    """module exported by the TorchScript exporter (dynamo=False: the new one needs onnxscript)."""
    buffer = io.BytesIO()
    axes = {n: {0: "batch"} for n in names} if dynamic else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, buffer, input_names=list(names), output_names=["y"], dynamic_axes=axes,
                          dynamo=False, opset_version=opset, **options)
    return buffer.getvalue()


def _randomize(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if t.dtype.is_floating_point:
                t.copy_(torch.rand(t.shape, generator=g) + 0.5 if "running_var" in name
                        else torch.randn(t.shape, generator=g) * 0.5)
    return module.eval()


def _matches(module, inputs: dict, tmp_path, name, **export):
    """Export, import, and compare the reference run with PyTorch and (if installed) onnxruntime."""
    example = tuple(torch.as_tensor(v) for v in inputs.values())
    data = _export(module, example, inputs, **export)
    graph, params, source = _import(onnx.load_from_string(data), tmp_path, name)
    with torch.no_grad():
        want = module(*example).numpy()
    got = _run(graph, params, inputs)["y"]
    assert got.shape == want.shape
    assert _relative(got, want) <= TOL
    if HAVE_ORT:
        assert _relative(got, _oracle(data, inputs, ["y"])[0]) <= TOL
    return graph, params, source


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(6)
        self.pool = nn.MaxPool2d(2, ceil_mode=True)
        self.conv2 = nn.Conv2d(6, 8, 3, stride=1, groups=2, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.avg = nn.AvgPool2d(2, stride=2, ceil_mode=True)
        self.fc = nn.Linear(8, 5)
        self.bn3 = nn.BatchNorm1d(5)

    def forward(self, x):
        x = self.pool(F.relu6(self.bn1(self.conv1(x))))
        x = F.hardswish(self.bn2(self.conv2(x)))
        x = torch.flatten(F.adaptive_avg_pool2d(self.avg(x), 1), 1)
        return torch.sigmoid(self.bn3(self.fc(x)))


@pytest.mark.parametrize("folded", [True, False], ids=["folded", "unfolded"])
def test_cnn_with_batch_norm_and_pools(tmp_path, folded):
    x = np.random.default_rng(0).normal(size=(3, 3, 9, 9)).astype(np.float32)
    graph, params, source = _matches(_randomize(CNN(), 1), {"x": x}, tmp_path, f"cnn_{folded}",
                                     do_constant_folding=folded)
    assert 'batch = dg.dim("batch")' in source and 'x = dg.input("x", (batch, 3, 9, 9))' in source
    assert "dg.max_pool2d(" in source and "ceil_mode=True" in source
    assert "dg.relu6(" in source or "act=dg.relu6" in source
    if folded:  # batch norm went into the convolutions: one layer per Conv, its activation inside
        assert 'conv1 = dg.conv2d_layer(x, 6, 3, padding=1, act=dg.relu6, name="conv1")' in source
        assert "act=dg.hardswish" in source and "groups=2" in source
    else:  # the batch norms stay: layers with PyTorch's parameter and statistic names
        assert 'dg.batch_norm_layer(' in source and "bn1_running_var" in params
        assert "conv1_weight" in params and "conv2_bias" not in params


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        self.fc2 = nn.Linear(16, 16)
        self.out = nn.Linear(16, 5)

    def forward(self, x):
        h = F.relu(self.fc1(x))
        h = h + F.gelu(self.fc2(h)) * 0.5 - h / 4
        a, b = torch.split(h, [6, 10], dim=1)
        h = torch.cat([torch.tanh(b), F.leaky_relu(a, 0.2)], dim=1)
        return torch.softmax(self.out(h), dim=-1)


def test_mlp(tmp_path):
    x = np.random.default_rng(2).normal(size=(4, 12)).astype(np.float32)
    graph, params, source = _matches(_randomize(MLP(), 3), {"x": x}, tmp_path, "mlp")
    assert sorted(params) == ["fc1_bias", "fc1_weight", "fc2_bias", "fc2_weight", "out_bias", "out_weight"]
    assert "dg.linear_t(x, fc1_weight, fc1_bias)" in source and "dg.split(" in source
    assert "dg.concat(" in source and "dg.softmax(" in source and " * 0.5" in source


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, activation="gelu", batch_first=True)
        self.proj = nn.Linear(8, 4)

    def forward(self, tokens):
        y = self.layer(self.emb(tokens))
        b, t, e = y.shape
        return self.proj(y.reshape(b * t, e)).view(b, t, 4)


@pytest.mark.parametrize("opset", [14, 20])
def test_transformer_encoder_layer(tmp_path, opset):
    """At opset 14 layer norm and GELU are written as several nodes (ReduceMean ... and the Erf
    pattern), at 20 as LayerNormalization and Gelu: each is one DSL statement either way. The
    attention's Shape/Gather/Concat arithmetic becomes sizes in the batch dim."""
    tokens = np.random.default_rng(4).integers(0, 20, (3, 5)).astype(np.int64)
    graph, params, source = _matches(_randomize(Encoder(), 5), {"tokens": tokens}, tmp_path, f"enc{opset}",
                                     opset=opset)
    assert source.count("dg.layer_norm(") == 2 and source.count("dg.gelu(") == 1
    assert "dg.gather(emb_weight, tokens)" in source
    assert "(5 * batch, 8)" in source  # y.reshape(b * t, e): the sizes, computed from the shapes
    assert "dg.reduce" not in source and "Erf" not in source and "dg.mean(" not in source
    assert "layer_linear1 = dg.matmul(" in source  # MatMul and its bias: one statement
    assert {"layer_norm1_weight", "layer_norm2_bias", "layer_linear1_bias"} <= set(params)


class Flat(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        return self.fc(F.silu(self.conv(x)).view(x.size(0), -1))


def test_a_file_exported_at_a_fixed_batch_size_takes_any_batch(tmp_path):
    """Exported without dynamic axes: axis 0 is still the batch N, and the reshape the exporter
    fixed to [2, 64] reads (N, 64); run at batch 5."""
    module = _randomize(Flat(), 6)
    data = _export(module, (torch.randn(2, 2, 6, 6),), ["x"], dynamic=False)
    graph, params, source = _import(onnx.load_from_string(data), tmp_path, "flat")
    assert 'x = dg.input("x", (N, 2, 6, 6))' in source and "act=dg.silu" in source
    x = np.random.default_rng(7).normal(size=(5, 2, 6, 6)).astype(np.float32)
    with torch.no_grad():
        want = module(torch.as_tensor(x)).numpy()
    assert _relative(_run(graph, params, {"x": x})["y"], want) <= TOL


def _torchvision():
    if importlib.util.find_spec("torchvision") is None:
        return None
    try:
        torch.ops.torchvision.nms.default
    except (AttributeError, RuntimeError):  # its C++ extension does not load beside a CPU torch
        global _TV_LIB
        _TV_LIB = torch.library.Library("torchvision", "DEF")
        _TV_LIB.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _TV_LIB.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    import torchvision

    return torchvision


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small"])
def test_torchvision_classifiers(tmp_path, name):
    tv = _torchvision()
    if tv is None:
        pytest.skip("torchvision is not installed")
    torch.manual_seed(0)
    module = _randomize(getattr(tv.models, name)(), 8)
    x = np.random.default_rng(9).normal(size=(2, 3, 32, 32)).astype(np.float32)
    graph, params, source = _matches(module, {"x": x}, tmp_path, name)
    assert "dg.conv2d_layer(" in source and "dg.linear_t(" in source


# -- Hugging Face transformers (#37): masks and position ids from integer arithmetic ---------

HF = ["bert", "distilbert", "roberta", "gpt2", "bart_encoder"]


def _hf_export(kind):
    """(module, ONNX bytes) for a config-built model of tests/test_hf_import.py exported with
    input_ids and attention_mask as inputs (batch and sequence dynamic), last_hidden_state as y."""
    pytest.importorskip("transformers")
    import test_hf_import as hf  # (its config-built models, batches with padding)

    module = hf.make(kind)

    class Hidden(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = module

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask)[0]

    example = tuple(hf.batch(2, 7, 2).values())
    buffer = io.BytesIO()
    names = ["input_ids", "attention_mask"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Hidden().eval(), example, buffer, input_names=names, output_names=["y"], dynamo=False,
                          dynamic_axes={n: {0: "batch", 1: "seq"} for n in names})
    return module, hf.batch, buffer.getvalue()


@pytest.mark.parametrize("kind", HF)
def test_hugging_face_models(kind, tmp_path):
    """The mask code (Range, Where, Equal, Expand, GatherElements, And, IsNaN, ...) becomes
    dg.key_mask / dg.causal_mask, the position ids slices of their tables; checked against
    onnxruntime (or onnx's reference evaluator) and PyTorch at the export's sizes and at
    others (batch and seq stay symbolic), with padded rows."""
    module, batch, data = _hf_export(kind)
    graph, params, source = _import(onnx.load_from_string(data), tmp_path, kind)
    assert "dg.key_mask(attention_mask)" in source and ("dg.causal_mask(seq)" in source) == (kind == "gpt2")
    assert "Range" not in source and "dg.gather(" in source  # (the token embedding alone is a gather)
    for n, t in ((2, 7), (3, 5)):
        inputs = {k: v.numpy() for k, v in batch(n, t, 3 + n).items()}
        got = _run(graph, params, inputs)["y"]
        with torch.no_grad():
            want = module(**{k: torch.as_tensor(v) for k, v in inputs.items()})[0].numpy()
        assert got.shape == want.shape and _relative(got, want) <= TOL, (n, t)
        assert _relative(got, _oracle(data, inputs, ["y"])[0]) <= TOL, (n, t)


def test_integer_arithmetic_read_otherwise_is_an_error():
    """A mask used as a float factor (not added to scores): one line naming op, node and opset."""

    class Scaled(nn.Module):
        def forward(self, x, mask):
            return x * mask.unsqueeze(-1).float()

    x, mask = torch.randn(2, 5, 4), torch.ones(2, 5, dtype=torch.int64)
    data = _export(Scaled(), (x, mask), ["x", "mask"])
    with pytest.raises(DeepgenError) as e:
        from_onnx(onnx.load_from_string(data))
    text = _one_line(e)
    assert text.startswith("ONNX Mul node '/Mul' (opset ") and "computed from the inputs' sizes and integer" in text

    class Hashed(nn.Module):  # embedding ids computed from the ids' values: neither an arange nor one id
        def __init__(self):
            super().__init__()
            self.table = nn.Embedding(5, 4)

        def forward(self, ids):
            return self.table(ids % 5)

    data = _export(Hashed(), (torch.zeros(2, 3, dtype=torch.int64),), ["ids"])
    with pytest.raises(DeepgenError) as e:
        from_onnx(onnx.load_from_string(data))
    text = _one_line(e)
    assert text.startswith("ONNX Gather node '/table/Gather' (opset ") and "no arange or single id" in text

    class OldMask(nn.Module):  # (1 - mask) * -10000 added to scores: not an additive 0 / -inf mask
        def forward(self, x, mask):
            scores = x @ x.transpose(1, 2)
            return torch.softmax(scores + (1.0 - mask[:, None, :].float()) * -10000.0, -1)

    data = _export(OldMask(), (torch.randn(2, 5, 4), torch.ones(2, 5, dtype=torch.int64)), ["x", "mask"])
    with pytest.raises(DeepgenError) as e:
        from_onnx(onnx.load_from_string(data))
    text = _one_line(e)
    assert text.startswith("ONNX Add node '/Add' (opset ") and "not an additive mask (0 / -inf)" in text


def test_torchvision_swin_t(tmp_path):
    """Swin's window attention as the TorchScript exporter writes it: Pad by non-zero amounts to
    whole windows, strided Slices (patch merging), Slice + Concat rolls; the exporter folds the
    relative position bias and the shift mask into initializers."""
    tv = _torchvision()
    if tv is None:
        pytest.skip("torchvision is not installed")
    torch.manual_seed(0)
    module = _randomize(tv.models.swin_t(), 8)
    x = np.random.default_rng(9).normal(size=(2, 3, 32, 32)).astype(np.float32)
    graph, params, source = _matches(module, {"x": x}, tmp_path, "swin_t")
    assert "dg.pad(" in source and "0::2]" in source


# -- another framework: scikit-learn through skl2onnx -------------------------------------


def test_sklearn_mlp_classifier(tmp_path):
    pytest.importorskip("sklearn")
    skl2onnx = pytest.importorskip("skl2onnx")
    from sklearn.neural_network import MLPClassifier

    rng = np.random.default_rng(10)
    X = rng.normal(size=(80, 6)).astype(np.float32)
    y = (X[:, 0] + X[:, 1] > 0).astype(int) + (X[:, 2] > 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clf = MLPClassifier((10, 8), max_iter=300, random_state=0).fit(X, y)
        model = skl2onnx.to_onnx(clf, X[:1], options={id(clf): {"zipmap": False}}, target_opset=17)
    # Its label output goes through ArgMax and ai.onnx.ml's ArrayFeatureExtractor: the error says
    # which op stops it and which output imports without it.
    with pytest.raises(DeepgenError) as e:
        from_onnx(model, name="skl")
    assert "unsupported ONNX op: ArgMax node 'ArgMax' (opset 17)" in str(e.value)
    assert "--outputs probabilities" in str(e.value) and "\n" not in str(e.value)
    graph, params, source = _import(model, tmp_path, "skl", outputs=["probabilities"])
    assert 'X = dg.input("X", (N, 6))' in source and "dg.softmax(" in source
    assert sorted(params) == ["coefficient", "coefficient1", "coefficient2", "intercepts", "intercepts1",
                              "intercepts2"]
    got = _run(graph, params, {"X": X})["probabilities"]
    assert _relative(got, clf.predict_proba(X)) <= TOL


# -- a hand-written graph: ops and opset forms the exporters above do not write ---------------


def _graph_model(nodes, inputs, outputs, initializers=(), opset=11, domains=()):
    graph = helper.make_graph(nodes, "handmade", inputs, outputs,
                              [numpy_helper.from_array(v, k) for k, v in initializers])
    imports = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, 1) for d in domains]
    return helper.make_model(graph, opset_imports=imports, producer_name="test")


def _info(name, shape, dtype=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, dtype, shape)


def test_hand_written_graph_of_other_op_forms(tmp_path):
    """Opset 11's attribute forms (Squeeze/Unsqueeze axes, Split sizes, Clip inputs), Gemm with
    transB=0 and alpha/beta, HardSigmoid with ONNX's default slope, LeakyRelu, Clip to a range,
    Slice, ReduceSum/Mean, GlobalMaxPool, Transpose, Pow, Reciprocal; against onnx's reference."""
    rng = np.random.default_rng(11)
    w = rng.normal(size=(6, 4)).astype(np.float32)
    c = rng.normal(size=(4,)).astype(np.float32)
    conv_w = rng.normal(size=(3, 2, 3, 3)).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["img", "conv_w"], ["conv"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("LeakyRelu", ["conv"], ["leaky"], alpha=0.3, name="leaky"),
        helper.make_node("GlobalMaxPool", ["leaky"], ["gmax"], name="gmax"),
        helper.make_node("Squeeze", ["gmax"], ["sq"], axes=[2, 3], name="sq"),
        helper.make_node("Gemm", ["x", "w", "c"], ["gemm"], alpha=0.5, beta=2.0, name="gemm"),
        helper.make_node("HardSigmoid", ["gemm"], ["hs"], name="hs"),
        helper.make_node("Constant", [], ["lo"], value=numpy_helper.from_array(np.array(-0.2, np.float32))),
        helper.make_node("Constant", [], ["hi"], value=numpy_helper.from_array(np.array(0.7, np.float32))),
        helper.make_node("Clip", ["gemm", "lo", "hi"], ["clip"], name="clip"),
        helper.make_node("Split", ["clip"], ["s1", "s2"], axis=1, split=[1, 3], name="split"),
        helper.make_node("Slice", ["hs", "starts", "ends", "axes"], ["sl"], name="slice"),
        helper.make_node("Pow", ["s2", "three"], ["cube"], name="cube"),
        helper.make_node("ReduceSum", ["cube"], ["rs"], axes=[1], keepdims=1, name="rsum"),
        helper.make_node("Unsqueeze", ["s1"], ["us"], axes=[2], name="us"),
        helper.make_node("Transpose", ["us"], ["tr"], perm=[0, 2, 1], name="tr"),
        helper.make_node("ReduceMean", ["tr"], ["rm"], axes=[1, 2], keepdims=0, name="rmean"),
        helper.make_node("Unsqueeze", ["rm"], ["rm2"], axes=[1], name="us2"),
        helper.make_node("Add", ["rs", "rm2"], ["t1"], name="add"),
        helper.make_node("Exp", ["sl"], ["ex"], name="exp"),
        helper.make_node("Reciprocal", ["ex"], ["rc"], name="recip"),
        helper.make_node("Mul", ["rc", "t1"], ["t2"], name="mul"),
        helper.make_node("Concat", ["t2", "sq"], ["out"], axis=1, name="concat"),
    ]
    inits = [("w", w), ("c", c), ("conv_w", conv_w), ("starts", np.array([1], np.int64)),
             ("ends", np.array([100], np.int64)), ("axes", np.array([1], np.int64)),
             ("three", np.array(3.0, np.float32))]
    model = _graph_model(nodes, [_info("x", ["n", 6]), _info("img", ["n", 2, 5, 5])], [_info("out", ["n", 6])],
                         inits, opset=11)
    onnx.checker.check_model(model)
    graph, params, source = _import(model, tmp_path, "handmade")
    assert 'n = dg.dim("n")' in source and "dg.leaky_relu(conv, alpha=0.3)" in source
    feeds = {"x": rng.normal(size=(3, 6)).astype(np.float32), "img": rng.normal(size=(3, 2, 5, 5)).astype(np.float32)}
    want = _oracle(model.SerializeToString(), feeds, ["out"])[0]
    assert _relative(_run(graph, params, feeds)["out"], want) <= TOL


# -- what is not supported: one line naming the op, the node and the opset ---------------------


def _one_line(error) -> str:
    text = str(error.value)
    assert "\n" not in text
    return text


def test_unsupported_ops_name_op_node_and_opset():
    class WithPad(nn.Module):
        def forward(self, x):
            return F.pad(x, (1, 2, 1, 2), mode="reflect") * 2  # (constant padding is dg.pad)

    data = _export(WithPad(), (torch.randn(1, 3, 4, 4),), ["x"])
    with pytest.raises(DeepgenError) as e:
        from_onnx(onnx.load_from_string(data))
    assert _one_line(e).startswith("unsupported ONNX op: Pad node '/Pad' (opset 20) with mode 'reflect' and pads "
                                   "[0, 0, 1, 1, 0, 0, 2, 2]")

    model = _graph_model([helper.make_node("FusedGemm", ["x", "x"], ["y"], domain="com.microsoft", name="fg")],
                         [_info("x", ["n", 4])], [_info("y", ["n", 4])], domains=["com.microsoft"])
    with pytest.raises(DeepgenError) as e:
        from_onnx(model)
    assert _one_line(e).startswith("unsupported ONNX op: com.microsoft.FusedGemm node 'fg' (opset 1)")

    # Ops on float tensors the DSL has no op for (comparisons, where, argmax).
    for op, extra in (("ArgMax", {"axis": 1}), ("Greater", {})):
        inputs = ["x"] if op == "ArgMax" else ["x", "x"]
        model = _graph_model([helper.make_node(op, inputs, ["y"], name="n1", **extra)], [_info("x", ["n", 4])],
                             [_info("y", ["n", 1], TensorProto.INT64)], opset=13)
        with pytest.raises(DeepgenError) as e:
            from_onnx(model)
        assert _one_line(e) == f"unsupported ONNX op: {op} node 'n1' (opset 13)"


def test_standalone_erf_is_an_elementwise_function(tmp_path):
    """Erf outside GELU's pattern: dg.elementwise of sympy's erf, against onnxruntime (or the
    reference evaluator)."""
    model = _graph_model([helper.make_node("Mul", ["x", "k"], ["s"], name="scale"),
                          helper.make_node("Erf", ["s"], ["y"], name="erf")], [_info("x", ["n", 4])],
                         [_info("y", ["n", 4])], [("k", np.array([0.5, 1.0, 2.0, -3.0], np.float32))], opset=13)
    graph, params, source = _import(model, tmp_path, "erf_model")
    assert "import sympy" in source and 'dg.elementwise(lambda v: sympy.erf(v), "erf")(' in source
    x = np.random.default_rng(3).normal(size=(5, 4)).astype(np.float32)
    want = _oracle(model.SerializeToString(), {"x": x}, ["y"])[0]
    assert _relative(_run(graph, params, {"x": x})["y"], want) <= TOL


def test_unsupported_forms_and_files_are_one_line_errors(tmp_path):
    w = np.ones((2, 2, 3, 3), np.float32)
    model = _graph_model([helper.make_node("Conv", ["x", "w"], ["y"], pads=[0, 0, 1, 1], name="c")],
                         [_info("x", ["n", 2, 5, 5])], [_info("y", ["n", 4])], [("w", w)])
    with pytest.raises(DeepgenError) as e:
        from_onnx(model)
    assert _one_line(e).startswith("ONNX Conv node 'c' (opset 11): pads [0, 0, 1, 1] differ")

    model = _graph_model([helper.make_node("Relu", ["x"], ["y"])], [_info("x", ["n", 2])], [_info("y", ["n", 4])], opset=7)
    with pytest.raises(DeepgenError) as e:
        from_onnx(model)
    assert "opset 7" in _one_line(e) and "version_converter" in str(e.value)

    model = _graph_model([helper.make_node("Relu", ["x"], ["y"])], [_info("x", ["n", 2], TensorProto.DOUBLE)],
                         [_info("y", ["n", 4])])
    with pytest.raises(DeepgenError) as e:
        from_onnx(model)
    assert _one_line(e) == "ONNX input 'x' is float64; deepgen inputs are float32, int32 or int64"

    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a protobuf at all \xff\xff")
    with pytest.raises(DeepgenError) as e:
        from_onnx(str(bad))
    assert _one_line(e).startswith(f"{bad} is not a readable ONNX model")


# -- the compiled model --------------------------------------------------------------------


def test_generated_cnn_loads_the_weights(tmp_path, builds):
    module = _randomize(CNN(), 12)
    x = np.random.default_rng(13).normal(size=(3, 3, 9, 9)).astype(np.float32)
    data = _export(module, (torch.as_tensor(x),), ["x"])
    source, weights = from_onnx(onnx.load_from_string(data), name="from_onnx_cnn")
    model_path, weights_path = write_model(source, weights, str(tmp_path / "cnn.py"))
    compiled, _ = builds.module(load_model(model_path).build())
    model = compiled.Model()
    model.load(weights_path)
    model.eval()
    with torch.no_grad():
        want = module(torch.as_tensor(x)).numpy()
    assert _relative(model.forward(x=x)["y"], want) <= TOL
    assert _relative(model.forward(x=x[:2])["y"], want[:2]) <= TOL  # another batch size


def test_generated_gpt2_matches_onnxruntime(tmp_path, builds):
    """GPT-2 (key padding and causal masks, position ids) compiled, the .npz loaded."""
    module, batch, data = _hf_export("gpt2")
    source, weights = from_onnx(onnx.load_from_string(data), name="from_onnx_gpt2")
    model_path, weights_path = write_model(source, weights, str(tmp_path / "gpt2.py"))
    compiled, _ = builds.module(load_model(model_path).build())
    model = compiled.Model()
    model.load(weights_path)
    model.eval()
    inputs = {k: v.numpy() for k, v in batch(3, 6, 5).items()}
    want = _oracle(data, inputs, ["y"])[0]
    assert _relative(model.forward(**inputs)["y"], want) <= TOL


# -- the command line ----------------------------------------------------------------------


def test_cli_writes_both_files_and_refuses_to_overwrite(tmp_path, capsys):
    from generator.tools.cli import main

    path = tmp_path / "mlp.onnx"
    path.write_bytes(_export(_randomize(MLP(), 14), (torch.randn(2, 12),), ["x"]))
    out = tmp_path / "gen" / "mlp.py"
    assert main(["from-onnx", str(path), "-o", str(out)]) == 0
    assert out.is_file() and (tmp_path / "gen" / "mlp.npz").is_file()
    assert "def mlp():" in out.read_text()
    first = out.read_text()

    assert main(["from-onnx", str(path), "-o", str(out), "--name", "other"]) == 1
    assert "exists; pass --force to replace it" in capsys.readouterr().err
    assert out.read_text() == first
    assert main(["from-onnx", str(path), "-o", str(out), "--name", "other", "--force"]) == 0
    assert "def other():" in out.read_text()

    before = path.read_bytes()
    for argv in (["-o", str(path)], ["-o", str(tmp_path / "m.py"), "--weights", str(path)]):
        assert main(["from-onnx", str(path), *argv, "--force"]) == 1
        assert "is the ONNX file being imported" in capsys.readouterr().err
    assert path.read_bytes() == before and not (tmp_path / "m.py").exists()

    assert main(["from-onnx", str(path), "-o", str(tmp_path / "x.py"), "--outputs", "nope"]) == 1
    err = capsys.readouterr().err
    assert "output(s) 'nope': the ONNX graph's outputs are 'y'" in err and not (tmp_path / "x.py").exists()
    assert main(["from-onnx", str(tmp_path / "missing.onnx"), "-o", str(tmp_path / "x.py")]) == 1
    assert "missing.onnx: no such file" in capsys.readouterr().err
