"""`deepgen compare` (generator/tools/compare.py): an imported residual network run beside
its PyTorch original agrees statement by statement; with one layer's weights planted
wrong in the .npz, compare names that layer, its line and its module as the first
difference and exits 1. One debug project is built (and rebuilt incrementally for
nothing: the weights are not in the code)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from generator.tools import cli
from generator.tools.compare import compare_rows, first_difference, keep_values, statement_names

pytest.importorskip("torch")


@pytest.fixture
def check_builds(monkeypatch):
    """compare's debug project built at the test suite's CHECK_BUILD_FLAGS (-O0), without
    the example program compare does not run: these tests check which statement differs,
    at tolerances far above what the optimization level changes, not how fast the code
    runs (the user's `deepgen compare` keeps the Release -O3). On the 2-core AMD EPYC CI
    machine, loaded: the two planted-error tests 112 s and 88 s at -O3, 84 s and 76 s so."""
    from conftest import CHECK_BUILD_FLAGS
    from generator.tools import compare
    from generator.tools.build import cmake_build, project_name

    def build(project, build_dir, **kw):
        example = f"-D{project_name(Path(project)).upper()}_EXAMPLE=OFF"
        return cmake_build(project, build_dir, extra_args=(*CHECK_BUILD_FLAGS, example), **kw)

    monkeypatch.setattr(compare, "cmake_build", build)


NET = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, c, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(c if stride == 1 else c // 2, c, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.down = nn.Conv2d(c // 2, c, 1, stride=stride) if stride > 1 else None

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + (self.down(x) if self.down is not None else x))


class TinyResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.layer1 = Block(4, 1)
        self.layer2 = Block(8, 2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


def make():
    torch.manual_seed(0)
    net = TinyResNet()
    for m in net.modules():  # running statistics that are not the identity
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    return net
'''


def test_compare_agrees_and_then_finds_a_planted_one_layer_error(tmp_path, capsys, check_builds):
    (tmp_path / "nets.py").write_text(NET)
    model, weights = tmp_path / "tiny_resnet.py", tmp_path / "tiny_resnet.npz"
    example = ["--example-input", "x=2,3,8,8"]
    assert cli.main(["from-torch", f"{tmp_path / 'nets.py'}:make", "-o", str(model), *example]) == 0
    args = ["compare", str(model), "--torch", f"{tmp_path / 'nets.py'}:make", *example, "--build-dir",
            str(tmp_path / "debug")]
    capsys.readouterr()
    assert cli.main([*args, "--weights", str(weights)]) == 0
    out = capsys.readouterr().out
    assert "agree with PyTorch" in out and "layer2_conv1" in out and "layer1_relu_1" in out

    planted = dict(np.load(weights))
    planted["layer2_conv1_weight"] = planted["layer2_conv1_weight"] * 1.5
    np.savez(tmp_path / "planted.npz", **planted)
    assert cli.main([*args, "--weights", str(tmp_path / "planted.npz")]) == 1
    out = capsys.readouterr().out
    first = [line for line in out.splitlines() if line.startswith("first difference")]
    assert len(first) == 1 and first[0].startswith("first difference: layer2_conv1 (")
    assert "tiny_resnet.py:" in first[0] and "module layer2.conv1" in first[0]
    # Every statement before it agreed.
    table = out.splitlines()
    at = next(i for i, line in enumerate(table) if "<- first difference" in line)
    assert at > 3 and all("first difference" not in line for line in table[:at])


def test_keep_values_makes_statements_outputs():
    import generator as dg

    @dg.model
    def net():
        x = dg.input("x", (dg.dim("N"), 3))
        hidden = dg.relu(x * 2.0)
        out = hidden + 1.0
        return {"y": out}

    graph = net.build()
    kept = keep_values(graph, {"hidden", "out", "x"})
    assert kept == {"hidden": "hidden", "out": "y"} and [name for name, _ in graph.outputs] == ["y", "hidden"]


def test_statement_names_and_first_difference(tmp_path):
    (tmp_path / "m.py").write_text("a = 1\nb, (c, d) = 2, (3, 4)\ne: int = 5\n")
    assert statement_names(str(tmp_path / "m.py")) == {"a", "b", "c", "d", "e"}
    assert statement_names(f"{tmp_path / 'm.py'}:net") == {"a", "b", "c", "d", "e"}

    class Row:
        def __init__(self, rel):
            self.rel = rel

    rows = [Row(1e-7), Row(float("nan")), Row(1.0)]
    assert first_difference(rows, 1e-4) is rows[1]  # NaN is a difference


def test_compare_onnx_agrees_and_then_finds_a_planted_one_layer_error(tmp_path, capsys, check_builds):
    """`compare --onnx`: the same small network exported by torch.onnx.export and imported by
    `deepgen from-onnx`; onnxruntime runs the file with the values the statements hold added
    as outputs (the import recorded their ONNX names in the .npz)."""
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    import io
    import sys
    import warnings

    import torch

    (tmp_path / "nets.py").write_text(NET)
    sys.path.insert(0, str(tmp_path))
    try:
        import nets
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("nets", None)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(nets.make().eval(), (torch.randn(2, 3, 8, 8),), buffer, input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "batch"}}, dynamo=False)
    (tmp_path / "tiny.onnx").write_bytes(buffer.getvalue())
    model, weights = tmp_path / "tiny_onnx.py", tmp_path / "tiny_onnx.npz"
    assert cli.main(["from-onnx", str(tmp_path / "tiny.onnx"), "-o", str(model)]) == 0
    args = ["compare", str(model), "--onnx", str(tmp_path / "tiny.onnx"), "--example-input", "x=3,3,8,8",
            "--build-dir", str(tmp_path / "debug")]
    capsys.readouterr()
    assert cli.main([*args, "--weights", str(weights)]) == 0
    out = capsys.readouterr().out
    assert "agree with onnxruntime" in out and "layer2_conv2" in out and "/layer2/conv2/Conv_output_0" in out
    compared = int(out.split("all ")[1].split()[0])
    assert compared >= 8  # every conv, add and the classifier

    planted = dict(np.load(weights))
    assert "meta/onnx_value_names" in planted
    planted["layer2_conv1_weight"] = planted["layer2_conv1_weight"] * 1.5
    np.savez(tmp_path / "planted.npz", **planted)
    assert cli.main([*args, "--weights", str(tmp_path / "planted.npz")]) == 1
    out = capsys.readouterr().out
    first = [line for line in out.splitlines() if line.startswith("first difference")]
    assert len(first) == 1 and first[0].startswith("first difference: layer2_conv1 (")
    # (its statement holds the conv and the relu after it: the relu's value)
    assert "tiny_onnx.py:" in first[0] and "ONNX value /layer2/relu/Relu_output_0:" in first[0]
    table = out.splitlines()
    at = next(i for i, line in enumerate(table) if "<- first difference" in line)
    assert at > 3 and all("first difference" not in line for line in table[:at])

    # --torch and --onnx exclude each other; weights without the recorded names are refused.
    with pytest.raises(SystemExit):
        cli.main([*args, "--weights", str(weights), "--torch", f"{tmp_path / 'nets.py'}:make"])
    bare = {k: v for k, v in planted.items() if not k.startswith("meta/")}
    np.savez(tmp_path / "bare.npz", **bare)
    assert cli.main([*args, "--weights", str(tmp_path / "bare.npz")]) == 1
    assert "holds no meta/onnx_value_names" in capsys.readouterr().err


def test_compare_onnx_without_onnxruntime_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    """onnxruntime is optional: without it compare --onnx says so before building anything."""
    np.savez(tmp_path / "w.npz", a=np.zeros(1, np.float32))
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # (import onnxruntime raises ImportError)
    argv = ["compare", str(tmp_path / "m.py"), "--weights", str(tmp_path / "w.npz"), "--onnx",
            str(tmp_path / "m.onnx"), "--example-input", "x=1,2"]
    assert cli.main(argv) == 1
    # (m.py does not exist: the check comes before the model is even read)
    assert capsys.readouterr().err.strip().endswith("deepgen compare --onnx needs onnxruntime (pip install onnxruntime)")


def test_masked_scores_agree_and_stay_out_of_the_scale():
    """Attention scores masked with -inf on one side and float32's lowest on the other agree;
    a position masked on one side only, or NaN, does not."""
    import generator as dg

    @dg.model
    def net():
        x = dg.input("x", (dg.dim("N"), 2))
        scores = x * 2.0
        return {"y": scores}

    graph = net.build()
    low = np.finfo(np.float32).min
    ours = {"scores": np.array([[1.0, -np.inf], [2.0, 3.0]], np.float32)}
    (row,) = compare_rows(graph, ours, {("scores", "v"): np.array([[1.0, low], [2.0, 3.0]], np.float32)}, 1e-4)
    assert row.max_abs == 0 and row.rel == 0
    (row,) = compare_rows(graph, ours, {("scores", "v"): np.array([[1.0, 0.5], [2.0, 3.0]], np.float32)}, 1e-4)
    assert row.max_abs == float("inf")
    (row,) = compare_rows(graph, {"scores": np.array([[1.0, np.nan], [2.0, 3.0]], np.float32)},
                          {("scores", "v"): np.array([[1.0, low], [2.0, 3.0]], np.float32)}, 1e-4)
    assert first_difference([row], 1e-4) is row
