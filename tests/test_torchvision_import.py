"""Every torchvision classification model through from_torch (#37): random weights, eval
mode, a small image; the written file is built as `deepgen generate` loads it and the
numpy reference interpreter, with the weights from_torch returned, gives PyTorch's output
(relative error <= 1e-4 of the output's largest magnitude). No C++ compile here except for
two representative models (test_generated_*). Skipped without torchvision.

The smallest model of each family runs by default; DEEPGEN_TORCHVISION=all runs every
model (the big ones take minutes and gigabytes: VGG-19, RegNet-Y 128GF, ViT-H/14, ...)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from generator.frontend.builder import ModelDef
from generator.importers import torch_keys, write_model
from generator.reference import interpreter as reference
from vision_models import classification_models, torchvision

torch = pytest.importorskip("torch")
F = torch.nn.functional
tv = torchvision()
if tv is None:
    pytest.skip("torchvision is not installed", allow_module_level=True)

# The smallest model of each family: the default run.
DEFAULT = ["alexnet", "convnext_tiny", "densenet121", "efficientnet_b0", "efficientnet_v2_s", "googlenet",
           "inception_v3", "mnasnet0_5", "mobilenet_v2", "mobilenet_v3_small", "regnet_x_400mf", "regnet_y_400mf",
           "resnet18", "shufflenet_v2_x0_5", "squeezenet1_0", "squeezenet1_1", "vgg11_bn", "vit_b_16", "swin_t",
           "swin_v2_t", "maxvit_t"]
# Image size per model: the smallest the network takes (Inception v3 needs 75, AlexNet 63, MaxViT 224:
# its 7x7 partitions must tile every stage's map, 1/32 of the image at the last; the rest 32: Swin's
# 8x8 first map is padded to 14x14 for its 7x7 windows, its later maps are one padded window).
SIZE = {"inception_v3": 80, "alexnet": 64, "maxvit_t": 224}
BATCH = {"maxvit_t": 1}  # (at 224 one image takes the reference about 2 minutes; the rest take 2)
# DEEPGEN_TORCHVISION_SIZE=224: every model at that size instead, one image (the full-size check).
FULL = int(os.environ.get("DEEPGEN_TORCHVISION_SIZE") or 0)


def _size(name: str) -> int:
    return FULL or SIZE.get(name, 32)


def make(name: str):
    """torchvision's model `name` with random weights (a fixed seed), in eval mode."""
    torch.manual_seed(0)
    kwargs = {}
    if name.startswith("vit_"):
        kwargs["image_size"] = _size(name)
    if name in ("googlenet", "inception_v3"):
        kwargs.update(aux_logits=False, init_weights=False)
    module = tv.models.get_model(name, weights=None, **kwargs)
    return _perturb(module).eval()


def _perturb(module):
    """Weights that were initialized constant (biases, norms, zero-initialized heads and layer
    scales) and batch norm statistics get random values of a similar size, so that a
    mix-up between them shows; the rest keep their scaled initialization."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for key, t in [*module.named_parameters(), *module.named_buffers()]:
            if not t.dtype.is_floating_point or t.numel() == 0:
                continue
            if "running_var" in key:
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)
            elif t.numel() == 1 or bool((t == t.flatten()[0]).all()):
                t.add_(torch.randn(t.shape, generator=g) * 0.1)
    return module


def _selected():
    models = classification_models()
    if os.environ.get("DEEPGEN_TORCHVISION") == "all":
        return models
    return [m if m in DEFAULT else pytest.param(m, marks=pytest.mark.skip(reason="set DEEPGEN_TORCHVISION=all"))
            for m in models]


def _import(module, x, name="net"):
    import generator as dg

    source, weights = dg.from_torch(module, (x,), name=name)
    namespace: dict = {}
    exec(compile(source, "<imported>", "exec"), namespace)
    graph = next(v for v in namespace.values() if isinstance(v, ModelDef)).build()
    return source, weights, graph


def _relative_error(got, want) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


@pytest.mark.parametrize("name", _selected())
def test_imports_and_matches_torch(name):
    module = make(name)
    size = _size(name)
    x = torch.randn(1 if FULL else BATCH.get(name, 2), 3, size, size, generator=torch.Generator().manual_seed(2))
    source, weights, graph = _import(module, x)
    with torch.no_grad():
        want = module(x).numpy()
    got = reference.run(graph, {"x": x.numpy()}, dict(weights), training=False)["output"]
    assert got.shape == want.shape
    assert _relative_error(got, want) <= 1e-4
    # Every state_dict entry (but batch norm's counters, and the window tables of Swin and MaxViT:
    # constant buffers the model computes, dg.relative_position_index / relative_coords_table) is
    # one parameter, mapped back to its key.
    tables = ("relative_position_index", "relative_coords_table")
    state = {k for k in module.state_dict() if not k.endswith(("num_batches_tracked",) + tables)}
    for table in tables:
        assert any(k.endswith(table) for k in module.state_dict()) == (f"dg.{table}(" in source)
    mapped = [k for keys in weights.torch_keys.values() for k in keys]
    assert sorted(mapped) == sorted(state) and sorted(weights.torch_keys) == sorted(weights)


def test_module_paths_become_identifiers_and_the_npz_keeps_their_keys(tmp_path):
    """RegNet's `trunk_output.block1.block1-0`: `block1_0` in the names, never an error; the
    .npz maps each parameter back to its state_dict key."""
    module = make("regnet_y_400mf")
    source, weights, _ = _import(module, torch.randn(1, 3, 32, 32))
    # (the block is a call of the function of its class: its name prefix, then the layers' names in it)
    assert 'name="trunk_output_block1_block1_0"' in source and 'name=f"{name}_proj_0"' in source
    assert "block1-0" not in source.replace("block1-0 ", "")
    _, weights_path = write_model(source, weights, str(tmp_path / "regnet.py"))
    with np.load(weights_path) as f:
        keys = torch_keys(f)
        assert keys["trunk_output_block1_block1_0_proj_0_weight"] == ["trunk_output.block1.block1-0.proj.0.weight"]
        assert set(f.files) - set(keys) == {"meta/torch_state_dict_keys"}


class Collide(torch.nn.Module):
    """Module paths that differ only in '.', '_' and '-': one name each, numbered."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.ModuleDict({"b": torch.nn.Linear(3, 3)})
        self.a_b = torch.nn.Linear(3, 3)
        setattr(self, "a-b", torch.nn.Linear(3, 3))

    def forward(self, x):
        return self.a["b"](x) + self.a_b(x) + getattr(self, "a-b")(x)


def test_colliding_paths_are_numbered_not_rejected():
    module = _perturb(Collide()).eval()
    x = torch.randn(2, 3)
    source, weights, graph = _import(module, x)
    assert sorted(weights) == ["a_b_2_bias", "a_b_2_weight", "a_b_3_bias", "a_b_3_weight", "a_b_bias", "a_b_weight"]
    assert {k: v[0] for k, v in weights.torch_keys.items()} == {
        "a_b_weight": "a.b.weight", "a_b_bias": "a.b.bias", "a_b_2_weight": "a_b.weight", "a_b_2_bias": "a_b.bias",
        "a_b_3_weight": "a-b.weight", "a_b_3_bias": "a-b.bias"}
    with torch.no_grad():
        want = module(x).numpy()
    got = reference.run(graph, {"x": x.numpy()}, dict(weights), training=False)["output"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


class Windows(torch.nn.Module):
    """What Swin and MaxViT call, written in a user's forward: F.pad with a value, torch.roll,
    strided slices, F.normalize, clamp, a batched-matmul einsum, a table indexed by a constant
    relative position index buffer (for a 2x2 window, made here by its definition), swapaxes."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(9, 3, generator=torch.Generator().manual_seed(4)))
        index = [(p // 2 - q // 2 + 1) * 3 + (p % 2 - q % 2 + 1) for p in range(4) for q in range(4)]
        self.register_buffer("index", torch.tensor(index))

    def forward(self, x):  # [N, 5, 6, 4]
        y = torch.roll(F.pad(x, (0, 0, 1, 2, 0, 1), value=0.25), shifts=(2, -3), dims=(1, 2))  # [N, 6, 9, 4]
        y = y[:, 0::2, 1::3, :]  # [N, 3, 3, 4]
        y = F.normalize(y, dim=-1) + torch.clamp(y, min=-0.5, max=0.5)
        scores = torch.einsum("n h i d, n h j d -> n h i j", y, y)
        bias = self.table[self.index].view(4, 4, 3).unsqueeze(0)
        return {"scores": scores, "bias": torch.swapaxes(bias, 1, 3)}


def test_window_functions_import_as_dsl_ops():
    module = Windows().eval()
    x = torch.randn(2, 5, 6, 4, generator=torch.Generator().manual_seed(5))
    source, weights, graph = _import(module, x)
    for written in ("dg.pad(", "dg.roll(", "0::2, 1::3]", "dg.normalize(", "dg.minimum(", "dg.bmm(",
                    "dg.relative_position_index((2, 2))", "dg.gather("):
        assert written in source, written
    with torch.no_grad():
        want = module(x)
    got = reference.run(graph, {"x": x.numpy()}, dict(weights), training=False)
    for key in want:
        np.testing.assert_allclose(got[key], want[key].numpy(), rtol=1e-5, atol=1e-6, err_msg=key)


def test_unknown_buffer_is_still_an_error():
    """A constant index that is not a relative position index is refused, naming the buffer."""
    module = Windows().eval()
    module.index[0] = 1
    with pytest.raises(Exception, match="self.index is a buffer or constant tensor"):
        _import(module, torch.randn(2, 5, 6, 4))


@pytest.mark.parametrize("name", ["mobilenet_v3_small", "resnet18", "swin_t"])
def test_generated_matches_torch(name, tmp_path, builds):
    """Representative models compiled: the generated module with the .npz loaded (Swin: pad,
    roll, strided slices, the window tables in C++)."""
    from generator.frontend.loader import load_model

    module = make(name)
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    source, weights, _ = _import(module, x[:2], name=f"tv_{name}")  # (one Python module name per model)
    model_path, weights_path = write_model(source, weights, str(tmp_path / f"{name}.py"))
    compiled, _ = builds.module(load_model(model_path).build())
    model = compiled.Model()
    model.load(weights_path)
    model.eval()
    with torch.no_grad():
        want = module(x).numpy()
    assert _relative_error(model.forward(x=x.numpy())["output"], want) <= 1e-4
