"""A module class used more than once is one DSL function (#37 item 5,
generator/importers/blocks.py): each instance is one call with its name prefix, the
constants that differ between instances are arguments, instances of another structure
get a function of their own; parameter names and state_dict keys are what they were, and
the written file still equals PyTorch (the numpy reference with the written weights)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import generator as dg
from generator.frontend.builder import ModelDef
from generator.reference import interpreter as reference

torch = pytest.importorskip("torch")
nn = torch.nn


class Mix(nn.Module):
    """Two layers of attention-free mixing; used inside Stage: a repeated class in a repeated class."""

    def __init__(self, c):
        super().__init__()
        self.proj = nn.Conv2d(c, c, 1)

    def forward(self, x):
        return torch.relu(self.proj(x)) + x


class Stage(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.mix = Mix(cout)
        self.skip = nn.Conv2d(cin, cout, 1, stride=stride) if (cin != cout or stride != 1) else None

    def forward(self, x):
        out = self.mix(torch.relu(self.bn(self.conv(x))))
        return out + (self.skip(x) if self.skip is not None else x)


class Head(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.fc = nn.Linear(c, 5)

    def forward(self, x):
        return self.fc(torch.flatten(x.mean((2, 3), keepdim=True), 1))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.stages = nn.Sequential(Stage(4, 4, 1), Stage(4, 8, 2), Stage(8, 8, 1), Stage(8, 16, 2))
        self.extra = Mix(16)
        self.head = Head(16)

    def forward(self, x):
        return self.head(self.extra(self.stages(self.stem(x))))


def _perturbed(module):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for key, t in [*module.named_parameters(), *module.named_buffers()]:
            if t.dtype.is_floating_point:
                t.add_(torch.randn(t.shape, generator=g) * 0.1)
                if "running_var" in key:
                    t.abs_().add_(0.5)
    return module.eval()


def _build(source):
    namespace: dict = {}
    exec(compile(source, "<imported>", "exec"), namespace)
    return next(v for v in namespace.values() if isinstance(v, ModelDef)).build()


def _matches_torch(module, source, weights, inputs: dict, output="output"):
    graph = _build(source)
    with torch.no_grad():
        want = module(**inputs)
    got = reference.run(graph, {k: v.numpy() for k, v in inputs.items()}, dict(weights), training=False)
    want = want if isinstance(want, dict) else {output: want}
    for key, value in got.items():
        expected = want[key].numpy()
        assert float(np.abs(value - expected).max() / np.abs(expected).max()) <= 1e-4, key
    assert sorted(p.name for p in graph.params) == sorted(weights)


def _calls(source, function):
    return re.findall(rf"= {function}\((?:.|\n)*?name=\"(\w+)\"\)", source)


def test_repeated_class_is_a_function_per_structure_with_differing_constants_as_arguments():
    torch.manual_seed(0)
    module = _perturbed(Net())
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    source, weights = dg.from_torch(module, (x,), name="net")
    _matches_torch(module, source, weights, {"x": x})
    # Stage: with and without `skip` (two structures); its channels differ between instances.
    assert source.count("def stage(") == 1 and source.count("def stage_skip(") == 1
    assert _calls(source, "stage") == ["stages_0", "stages_2"]
    assert _calls(source, "stage_skip") == ["stages_1", "stages_3"]
    assert re.search(r"stage_skip\(stages_0, out_channels=8, (\w+=\S+, )*name=\"stages_1\"\)", source)
    # Parameter names and state_dict keys as before, built from the prefix.
    assert 'name=f"{name}_conv"' in source and 'name=f"{name}_mix_proj"' in source
    assert weights.torch_keys["stages_3_skip_weight"] == ["stages.3.skip.weight"]
    # Mix: repeated, but inside Stage it stays inline; the one at the top level is no function
    # of Mix's instances elsewhere (only the outermost repeated level is a function).
    assert "def mix(" in source and _calls(source, "mix") == ["extra"]
    # Head is used once: inline.
    assert "def head(" not in source and 'dg.param("head_fc_weight"' in source
    # Deterministic.
    assert dg.from_torch(module, (x,), name="net")[0] == source


def test_resnet18_is_basic_block_calls():
    from vision_models import torchvision

    tv = torchvision()
    if tv is None:
        pytest.skip("torchvision is not installed")
    torch.manual_seed(0)
    module = _perturbed(tv.models.resnet18(num_classes=10))
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    source, weights = dg.from_torch(module, (x,), name="resnet18")
    _matches_torch(module, source, weights, {"x": x})
    plain, down = _calls(source, "basic_block"), _calls(source, "basic_block_downsample")
    assert source.count("def basic_block(") == 1 and source.count("def basic_block_downsample(") == 1
    assert sorted(plain + down) == [f"layer{s}_{b}" for s in range(1, 5) for b in range(2)]
    assert down == ["layer2_0", "layer3_0", "layer4_0"]
    assert len(source.splitlines()) < 100  # (one function of 180 lines before)
    assert weights.torch_keys["layer2_0_downsample_0_weight"] == ["layer2.0.downsample.0.weight"]
    assert 'name=f"{name}_downsample_0"' in source


def test_bert_is_one_layer_function_called_per_layer(tmp_path):
    transformers = pytest.importorskip("transformers")
    from test_hf_import import SMALL, batch

    torch.manual_seed(0)
    module = _perturbed(transformers.BertModel(transformers.BertConfig(**{**SMALL, "num_hidden_layers": 3})))
    source, weights = dg.from_torch(module, batch(2, 7, 2), name="bert")
    _matches_torch(module, source, weights, batch(3, 5, 4))
    assert re.findall(r"^def (\w+)\(", source, re.M) == ["bert_layer", "bert"]  # (and the model)
    assert _calls(source, "bert_layer") == ["encoder_layer_0", "encoder_layer_1", "encoder_layer_2"]
    # The mask the first layer made at its first use is the model's, before the first call.
    assert source.index("dg.key_mask(attention_mask)") < source.index("= bert_layer(")
    assert weights.torch_keys["encoder_layer_2_attention_self_query_weight"] == [
        "encoder.layer.2.attention.self.query.weight"]


def test_compare_names_values_inside_a_block_function_after_the_module_path(tmp_path):
    from generator.frontend.loader import load_model
    from generator.tools.compare import name_block_values, statement_names

    torch.manual_seed(0)
    module = _perturbed(Net())
    source, _ = dg.from_torch(module, (torch.randn(2, 3, 8, 8),), name="net")
    path = tmp_path / "net.py"
    path.write_text(source)
    graph = load_model(str(path)).build()
    named = name_block_values(graph)
    # `relu` / `add` inside stage() with name="stages_2": the module paths' names.
    assert {"stages_2_conv", "stages_2_bn", "stages_3_skip", "stages_1_mix_proj", "extra_proj"} <= named
    assert named <= {v.name for v in graph.values()}
    assert not {"stages_2_conv", "stages_2_relu"} & statement_names(str(path))  # (in the file: conv, relu)
