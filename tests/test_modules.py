"""A repeated call's parameters are one module struct (codegen/modules.py).

ResNet-18 built against PyTorch (test_cnn, test_examples, test_cuda's emulation) checks
that code printing parameters by their struct paths computes what it did; these check the
structs, the fallbacks, and a small trained model built and compared with the reference."""

from __future__ import annotations

import re

from conftest import build_example, load_example
from generator.codegen.modules import find_modules
from generator.frontend.loader import load_model
from generator.pipeline import project_files
from module_checks import check_forward, check_init, check_train_steps

DENSE = """\
import generator as dg

N = dg.dim("N")


def dense(x, width, name):
    w = dg.param(f"{name}_weight", (width, x.shape[1]))
    b = dg.param(f"{name}_bias", (width,), init=dg.zeros())
    return dg.tanh(x @ w.T + b)


@dg.model
def dense_net():
    x = dg.input("x", (N, 5))
    y = dg.input("y", (N,), dtype="int64")
    h = dense(x, 7, "fc1")
    h = dense(h, 7, "fc2")
    h = dense(h, 4, "fc3")
    loss = dg.softmax_cross_entropy(h, y)
    dg.train(loss, dg.sgd(lr=0.1))
    return {"h": h}
"""


def _graph(tmp_path, source=DENSE, name="dense_net"):
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    return load_model(str(path)).build()


def test_resnet_blocks_are_structs_with_their_sizes_as_constructor_arguments():
    files = project_files(build_example("resnet18"))
    header, cpp = files["include/resnet18_small/model.h"].decode(), files["src/model.cpp"].decode()
    # The constructor takes the sizes that differ between the calls, named after the outlined
    # function's sizes where every call's forward pass is outlined (the example's: C, O), else
    # after the user's arguments (the small build's last blocks are inline: channels).
    assert re.search(r"^struct BasicBlock \{\n  explicit BasicBlock\(std::int64_t channels\)", header, re.M)
    assert re.search(r"^struct BasicBlockWithShortcut \{\n  BasicBlockWithShortcut\(std::int64_t channels, "
                     r"std::int64_t size1\)", header, re.M)
    assert re.search(r"^  mutable dg::Tensor<float> bn1_running_mean;  // \[channels\]", header, re.M)
    assert re.search(r"^  BasicBlock layer1_0\{/\*channels=\*/8\};", header, re.M)
    assert re.search(r"^  BasicBlockWithShortcut layer2_0\{/\*channels=\*/16, /\*size1=\*/8\};", header, re.M)
    full = project_files(load_example("resnet18").build())["include/resnet18/model.h"].decode()
    assert "  BasicBlockWithShortcut layer2_0{/*O=*/128, /*C=*/64};" in full
    # state_dict names do not change; the C++ member is the path
    assert '{"layer1_0_conv1_weight", &net.layer1_0.conv1_weight}' in cpp
    assert '{"layer2_0_shortcut_1_running_var", &net.layer2_0.shortcut_1_running_var}' in cpp
    # The forward function reads its block's module; the gradient's updates write it.
    assert re.search(r"^void basic_block\(const float\* x, const BasicBlock& layer, ", cpp, re.M)
    assert re.search(r"^void basic_block_backward\([^)]*\bBasicBlock& layer\b", cpp, re.M)
    assert not re.search(r"\blayer1_0_conv1_weight\.ptr\(\)", cpp)


def test_a_small_model_of_modules_trains_as_the_reference(tmp_path, builds):
    graph = _graph(tmp_path)
    modules = find_modules(graph)
    # fc3 is narrower: the same fields, other sizes (the constructor's arguments)
    assert [(s.type, [i.name for i in s.instances], s.arity) for s in modules.structs] == [
        ("Dense", ["fc1", "fc2", "fc3"], 2)]
    assert modules.path("fc2_weight") == "fc2.weight"
    module, _ = builds.module(graph)
    check_init(graph, module)
    check_forward(graph, module, 3)
    check_train_steps(graph, module)
    text = project_files(graph)["include/dense_net/model.h"].decode()
    assert "Dense fc1{" in text and "Dense fc3{" in text

def test_calls_that_are_not_modules_keep_their_parameters_flat(tmp_path):
    # no name=: nothing to call the module
    unnamed = DENSE.replace('def dense(x, width, name):', 'def dense(x, width, label):').replace(
        '{name}', '{label}')
    assert not find_modules(_graph(tmp_path, unnamed)).structs
    # a parameter not under the call's name
    stray = DENSE.replace('f"{name}_bias"', 'f"bias_{name}"')
    assert not find_modules(_graph(tmp_path, stray)).structs
    # one call only
    once = DENSE.replace('    h = dense(h, 7, "fc2")\n    h = dense(h, 4, "fc3")\n', '')
    assert not find_modules(_graph(tmp_path, once)).structs
    # a name that is a C++ keyword: not a member name
    keyword = DENSE.replace('"fc1"', '"int"')
    found = find_modules(_graph(tmp_path, keyword), reserved=lambda n: n == "int")
    assert "int_weight" not in found.paths
