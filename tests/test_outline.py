"""A function of the user's called more than once is one C++ function (codegen/outline.py).

The built ResNet-18 (test_examples, test_memory, test_cuda's emulation) checks that the
outlined code computes what the inline code did; these check the code's shape."""

from __future__ import annotations

import re

from conftest import build_example, load_example
from generator.frontend.loader import load_model
from generator.pipeline import project_files

BLOCKS = """\
import generator as dg


def block(x, scale, name):
    w = dg.param(f"{name}_w", (3, 3))
    h = dg.tanh(x @ w)
    return dg.relu(h * scale + x)


@dg.model
def blocks(count=3):
    x = dg.input("x", (2, 3))
    for i in range(count):
        x = block(x, 1.5, f"block_{i}")
    return {"y": x @ dg.param("head", (3, 3))}
"""


def _model_cpp(tmp_path, source=BLOCKS, **options) -> str:
    path = tmp_path / "blocks.py"
    path.write_text(source)
    return project_files(load_model(str(path)).build(**options))["src/model.cpp"].decode()


def _run_body(text: str) -> str:
    """`_run`, and the `backward` it calls where train_step()'s gradient phase is one (codegen/sections.py)."""
    start = text.index("Network::_run(")
    backward = text.find("\nvoid Network::backward(")
    return text[start:] + (text[backward:text.index("\n}\n", backward)] if backward >= 0 else "")


def test_a_function_called_in_a_loop_is_one_cpp_function_called_once_per_use(tmp_path):
    text = _model_cpp(tmp_path)
    assert len(re.findall(r"^void block\(", text, re.M)) == 1
    calls = re.findall(r"^\s+block\(", _run_body(text), re.M)
    assert len(calls) == 3
    # Inside, the block's own names lose the call's prefix; each call passes its weight.
    body = text[text.index("void block("): text.index("Network::_run(")]
    assert "block_0" not in body
    for i in range(3):
        assert f"block_{i}_w" in _run_body(text)


def test_one_call_stays_inline(tmp_path):
    text = _model_cpp(tmp_path, count=1)
    assert not re.search(r"^void block\(", text, re.M)


def test_calls_whose_code_differs_are_variants_named_by_what_differs():
    # The default sizes: at the tests' small ones the last stage's 2x2 planes take another
    # convolution path (conv2d_small), so its blocks lower differently and stay inline.
    text = project_files(load_example("resnet18").build())["src/model.cpp"].decode()
    run = _run_body(text)
    assert len(re.findall(r"^\s+basic_block\(", run, re.M)) == 5
    assert len(re.findall(r"^\s+basic_block_with_shortcut\(", run, re.M)) == 3
    for fn in ("basic_block", "basic_block_with_shortcut"):
        start = text.index(f"\nvoid {fn}(")
        body = text[start: text.index("\n}\n", start)]
        assert "layer1_" not in body and "layer2_" not in body  # no call's own names inside
        assert len(body.splitlines()) < 80


def test_a_function_name_that_a_value_holds_is_not_taken(tmp_path):
    source = BLOCKS.replace('dg.param("head"', 'dg.param("block"')  # a member of the Network
    text = _model_cpp(tmp_path, source)
    # block_3: the calls' results are block_0 .. block_2 (each named after its call's name=)
    assert re.search(r"^void block_3\(", text, re.M) and not re.search(r"^void block\(", text, re.M)


def test_a_layer_helper_called_in_a_loop_is_one_function_and_computes_the_same(builds):
    """BERT's encoder layers are one `transformer_encoder_layer`, the last too (it writes
    the output's own vector, which the caller declares); the first computes the mask the
    others read, inline before its call; each call cites itself with its arguments'
    values; the built module equals the numpy reference."""
    from module_checks import check_forward

    graph = load_example("bert_encoder").build("bert_outlined", layers=4)
    text = project_files(graph)["src/model.cpp"].decode()
    assert len(re.findall(r"^void transformer_encoder_layer\(", text, re.M)) == 1
    run = _run_body(text)
    assert len(re.findall(r"^\s+transformer_encoder_layer\(", run, re.M)) == 4
    assert "std::vector<float> encoder_layers_3(" in run
    for i in range(4):
        assert f"transformer_encoder_layer(x, lengths, d_model=32, nhead=4, dim_feedforward=64, activation='gelu'" \
            in run and f"name='encoder_layers_{i}')" in run
    assert run.index("dg::length_mask") < re.search(r"^\s+transformer_encoder_layer\(", run, re.M).start()
    module, _ = builds.module(graph)
    check_forward(graph, module, 3)


def test_each_residual_blocks_gradient_is_one_call():
    """The backward pass runs a block's gradient in one piece (fusion keeps the pooling's
    gradient out of the last block's and each call's gradient sum inside it)."""
    text = project_files(build_example("resnet18"))["src/model.cpp"].decode()
    run = _run_body(text)
    plain = len(re.findall(r"^\s+basic_block_backward\(", run, re.M))
    shortcut = len(re.findall(r"^\s+basic_block_with_shortcut_backward\(", run, re.M))
    # Every block's gradient is a call, all of it: remat makes a block's input (the previous
    # block's output) again before the gradient of the block that reads it
    # (transforms/remat.py), by a function of its own called once per block that has it.
    assert plain == 5 and shortcut == 3
    assert len(re.findall(r"^\s+basic_block_with_shortcut_again\(", run, re.M)) == 3, run
    assert "conv2d_grad_weight" not in run[run.index("basic_block_backward("):run.rindex("basic_block_backward(")]
    start = text.index("\nvoid basic_block_backward(")
    body = text[start: text.index("\n}\n", start)]
    assert re.search(r"\bd_x\b", body)  # the gradient of the block's input, by the argument's name
    assert "dg::conv2d_grad_weight(x, d_conv1, d_conv1_weight" in body  # its first convolution's too
    # Which update is ready: the call's first index plus a constant; a weight and its size are
    # the block's module's (codegen/modules.py): neither passed by the call.
    assert re.search(r"gradients_only\(_gradients_only, first_index \+ \d\)", body)
    assert "sgd_update(layer.conv2_weight.ptr(), d_conv2_weight, layer.conv2_weight.size(), _hyper)" in body
    assert "_size" not in body and "index_2" not in body
    # Where a gradient goes (the Model's member while the step keeps gradients, else its place in
    # the call's gradient workspace) the function says from the call's gradient struct and the
    # workspace's offset: the caller declares none of them.
    assert re.search(r"float\* d_conv2_weight = _gradients\.at\(d_layer\.conv2_weight, gradients_at\b", body)
    assert re.search(r"^\s+basic_block_backward\([^;]*\bd_layer\d_\d, [^;]*/\*gradients_at=\*/", run, re.M)
    assert not re.search(r"float\* d_layer\d_\d_\w+_weight =", run)


def test_an_argument_that_names_its_parameter_has_no_comment():
    """`layer1_0_bn1_mean` fills `bn1_mean`: no /*bn1_mean=*/ beside it; `layer1_0_out` (the
    first block's result, named after its call) filling `x` keeps /*x=*/, and `bn2` too (the
    result is made in place over bn2: the caller passes its variable there, once, and the
    function names `result` inside); the module `layer1_0` filling `layer` (a `BasicBlock`)
    names itself."""
    text = project_files(build_example("resnet18"))["src/model.cpp"].decode()
    run = _run_body(text)
    assert "/*bn1_mean=*/" not in run and "/*mode=*/" not in run
    assert "/*x=*/layer1_0_out," in run and "/*bn2=*/layer1_0_out, " in run and "/*result=*/layer1_0_out, N" not in run
    start = text.index("\nvoid basic_block(")
    assert "  float* result = bn2;  // in place" in text[start:text.index("\n}\n", start)]
    assert "/*layer=*/" not in run and re.search(r"^\s+basic_block\(x, layer1_0, ", run, re.M)
    # A call's gradient struct (`d_layer1_0` fills `d_layer`) names itself too.
    assert "/*d_layer=*/" not in run and re.search(r"^\s+basic_block_backward\([^;]*\bd_layer1_0, ", run, re.M)


def test_a_long_block_that_runs_once_is_a_member_function():
    """A recursion's levels and their gradient, a sequence's steps and theirs: each a
    Network member named after the statement (`recurse_h_c`, `lstm`), `_run` calls them."""
    for example, names in (("treelstm_sentiment", ("recurse_h_c", "recurse_h_c_backward")),
                           ("lstm_classifier", ("lstm", "lstm_backward"))):
        files = project_files(load_example(example).build())
        text, header = files["src/model.cpp"].decode(), files[f"include/{example}/model.h"].decode()
        run = _run_body(text)
        for name in names:
            assert re.search(rf"^void Network::{name}\(", text, re.M), (example, name)
            assert re.search(rf"^\s+void {name}\(", header, re.M), (example, name)
            assert re.search(rf"^\s+{name}\(", run, re.M), (example, name)
        for fn, length in _function_lengths(text):
            assert length <= 200, (example, fn, length)


def test_a_long_train_steps_gradient_phase_is_a_member_function():
    """ResNet-18's `_run` reads as the forward pass, the loss and `backward(...)`: the gradient
    phase a member function taking the forward's locals it reads (codegen/sections.py), so no
    function of the project passes 200 lines; a short one (the MLP's) stays inline."""
    files = project_files(load_example("resnet18").build())  # the example's sizes (build_example's are smaller)
    text = files["src/model.cpp"].decode()
    header = next(v for k, v in files.items() if k.endswith("/model.h")).decode()
    run = text[text.index("Network::_run("):]
    assert re.search(r"^  backward\(_arena, N, [^;]*\blayer1_0_saved\b[^;]*\);", run, re.M)
    assert "basic_block_backward(" not in run and "basic_block(" in run
    assert re.search(r"^\s+void backward\(dg::Arena& _arena, [^;]*const kernels::sgd_hyper& _hyper", header, re.M)
    assert re.search(r"^namespace kernels \{.*\n^struct sgd_hyper;$", header, re.M)  # what backward() takes
    method = text[text.index("\nvoid Network::backward("):]
    assert "/*x=*/" in method and not re.search(r"[(,] float\* x[,)]", method[:method.index("{")])  # not a comment's word
    for fn, length in _function_lengths(text):
        assert length <= 200, (fn, length)
    mlp = project_files(build_example("mlp"))["src/model.cpp"].decode()
    assert "Network::backward" not in mlp and "// gradient of mlp.py" in mlp[mlp.index("Network::_run("):]


def test_a_gradient_summed_from_two_uses_names_each_part_after_its_use():
    """A block's input feeds its first convolution and its shortcut: the two parts of its
    gradient are `d_x_from_conv1` and `d_x_from_shortcut` (transforms/autodiff.py), not
    `d_x_1` and `d_x_2`; the sum is `d_x`, and the caller's name for it the user's."""
    text = project_files(load_example("resnet18").build())["src/model.cpp"].decode()
    start = text.index("\nvoid basic_block_with_shortcut_backward(")
    body = text[start:text.index("\n}\n", start)]
    assert "kernels::add(d_x_from_shortcut, d_x_from_conv1, d_x, " in body
    assert not re.search(r"\bd_x_\d", text)
    # (the sum is made in place over the shortcut's part: the caller passes its d_layer3_1_out there)
    assert re.search(r"/\*d_x_from_shortcut=\*/d_layer3_1_out,\s", text) and "float* d_x = d_x_from_shortcut;" in body


def test_a_convolutions_geometry_is_declared_once_per_function():
    """A convolution, its input gradient and its weight gradient take one dg::Conv2dGeom,
    named after the convolution (codegen/declared_once.py); two convolutions of one shape
    (a block's conv1 and conv2) keep one each."""
    text = project_files(load_example("resnet18").build())["src/model.cpp"].decode()
    for fn in ("basic_block", "basic_block_backward"):
        start = text.index(f"\nvoid {fn}(")
        body = text[start:text.index("\n}\n", start)]
        declared = re.findall(r"const dg::Conv2dGeom (\w+)\(", body)
        assert sorted(declared) == ["conv1_geom", "conv2_geom"], (fn, declared)
    assert re.search(r"dg::conv2d_grad_input\(d_conv1, layer\.conv1_weight\.ptr\(\), [^;]*, conv1_geom\);", text)
    assert re.search(r"dg::conv2d_grad_weight\(x, d_conv1, d_conv1_weight, d_conv1_weight_cols, conv1_geom\);", text)
    # The stem's weight gradient, in backward(), reads the geometry _run declared for its forward.
    start = text.index("\nvoid Network::backward(")
    method = text[start:text.index("\n}\n", start)]
    assert "const dg::Conv2dGeom& conv1_geom" in method[:method.index("{")]
    assert "Conv2dGeom conv1_geom" not in method[method.index("{"):]


def _function_lengths(text: str):
    """(name, lines) of each top-level function definition in a C++ file."""
    lines = text.splitlines()
    out, start = [], None
    for k, line in enumerate(lines):
        m = re.match(r"^[A-Za-z_][\w:<>,\s*&]*?\b([\w:]+)\(", line)
        if start is None and m and not line.endswith(";"):
            start, name = k, m.group(1)
        if start is not None and line == "}":
            out.append((name, k - start + 1))
            start = None
    return out


def test_a_call_passes_what_it_keeps_for_its_gradient_as_one_frame():
    """The pieces a block keeps for its gradient are one block of the arena (its frame): the
    caller declares it and passes it to the forward call, to what the backward makes again and
    to the gradient; each function finds the pieces at offsets in its own sizes."""
    text = project_files(build_example("resnet18"))["src/model.cpp"].decode()
    run = _run_body(text)
    assert re.search(r"\n  float\* layer1_0_saved = _arena\.at\(", run)
    passed = 2 if "void Network::backward(" in text else 0  # `_run` passes it to backward(): argument, parameter
    assert len(re.findall(r"\blayer1_0_saved\b", run)) == 3 + passed  # declared, forward call, gradient
    assert len(re.findall(r"\blayer2_0_saved\b", run)) == 4 + passed  # ... and the shortcut made again
    assert "layer1_0_conv1 " not in run and "layer1_0_bn1_mean" not in run  # no piece one by one
    forward = text[text.index("\nvoid basic_block("): text.index("\n}\n", text.index("\nvoid basic_block("))]
    assert "float* saved," in forward
    assert re.search(r"\n  float\* conv1 = saved;", forward)
    assert re.search(r"\n  float\* bn1_mean = saved \+ \w", forward)
    start = text.index("\nvoid basic_block_backward(")
    backward = text[start: text.index("\n}\n", start)]
    assert "const float* saved," in backward
    assert re.search(r"\n  const float\* bn2_invstd = saved \+ ", backward)


def test_a_size_that_is_the_product_of_two_others_is_named_inside_the_function():
    """ResNet's block takes C and H; the plane (H * H) and an activation's elements (C * HW * N)
    it names itself (codegen/derived_sizes.py), so no call passes them."""
    from generator.codegen.derived_sizes import derive_sizes

    sizes = [("C", ["64", "128", "512"]), ("H", ["32", "16", "4"]), ("HW", ["1024", "256", "16"]),
             ("n", ["65536 * N", "32768 * N", "8192 * N"]), ("O", ["128", "256", "1024"])]
    assert derive_sizes(sizes, {"N"}) == {"HW": "H * H", "n": "C * HW * N"}  # O = 2 * C: a factor, kept
    assert derive_sizes([("a", ["3", "5"]), ("b", ["7", "7"])], {"N"}) == {}
    text = project_files(build_example("resnet18"))["src/model.cpp"].decode()
    start = text.index("\nvoid basic_block(")
    body = text[start: text.index("\n}\n", start)]
    assert "const std::int64_t HW = H * H;" in body and "const std::int64_t n = C * HW * N;" in body
    calls = re.findall(r"^\s+basic_block\([^;]*;", _run_body(text), re.M)
    assert calls and not any("/*HW=*/" in c or "/*n=*/" in c for c in calls)


def test_int8_blocks_that_hand_over_quantized_outputs_stay_one_function():
    """In an int8 project a residual block's first convolution hands its output to the
    second quantized (dg::Int8ChannelsLast / Int8ChannelsLastIn around dg::int8_data): the
    block, called once per layer, is still one C++ function (outline.py walks those structs),
    its pieces parameters like any other arena piece."""
    text = project_files(_int8_blocks())["src/model.cpp"].decode()
    assert len(re.findall(r"^\s+int8_block\(", _run_body(text), re.M)) == 2  # (the last stays inline: its lines differ)
    start = text.index("\nvoid int8_block(")
    body = text[start: text.index("\n}\n", start)]
    assert "/*handed_over=*/" in body and "dg::Int8ChannelsLastIn{dg::int8_data(" in body
    assert "layer1_" not in body and "layer2_" not in body


def _int8_blocks():
    import generator as dg
    from generator.transforms.precision import set_precision

    def int8_block(x, name):
        a = dg.relu(dg.batch_norm_layer(dg.conv2d_layer(x, 16, 3, padding=1, bias=False, name=f"{name}_a"),
                                        name=f"{name}_abn"))
        b = dg.batch_norm_layer(dg.conv2d_layer(a, 16, 3, padding=1, bias=False, name=f"{name}_b"), name=f"{name}_bbn")
        return dg.relu(b + x)

    @dg.model
    def int8_blocks():
        x = dg.input("x", (dg.dim("N"), 16, 12, 12))
        for i in range(3):
            x = int8_block(x, f"layer{i + 1}")
        return {"y": x}

    graph = int8_blocks.build()
    set_precision(graph, "int8")
    return graph
