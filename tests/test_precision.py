"""Reduced precision (`deepgen generate --precision bf16`): the rounding itself on
edge values, the MLP and LeNet generated in bf16 against the reference (which
rounds exactly as the C++ does), and how far bf16 moves the outputs from fp32."""

from __future__ import annotations

import numpy as np
import pytest
import sympy

import generator as dg
from conftest import cpu_flags, held_out_agreement, load_example
from generator.errors import DeepgenError
from generator.ops.precision import round_to_bf16
from generator.pipeline import lowered, prepare
from generator.reference import interpreter as reference
from generator.transforms.precision import set_precision
from op_cases import bf16_nearest

N = dg.dim("N")

# float32 bit patterns and the bfloat16 (as float32 bits) each rounds to
EDGES = {
    0x3F800000: 0x3F800000,  # 1.0, exact
    0x3F808000: 0x3F800000,  # 1 + 2^-8: a tie, to the even 1.0
    0x3F818000: 0x3F820000,  # 1 + 3 * 2^-8: a tie, to the even 1 + 2^-6
    0x3F808001: 0x3F810000,  # just above the tie: up
    0x3F807FFF: 0x3F800000,  # just below: down
    0xBF808000: 0xBF800000,  # -(1 + 2^-8): ties to even, the sign kept
    0xBF818000: 0xBF820000,
    0x7F7FFFFF: 0x7F800000,  # the largest finite float: past the last bfloat16 midpoint, to +inf
    0xFF7FFFFF: 0xFF800000,  # and its negative to -inf
    0x7F7F7FFF: 0x7F7F0000,  # below that midpoint: the largest finite bfloat16
    0x7F7F8000: 0x7F800000,  # on it: a tie, to the even (inf, exponent all ones, mantissa 0)
    0x7F800000: 0x7F800000,  # +inf
    0xFF800000: 0xFF800000,  # -inf
    0x00000000: 0x00000000,  # +0
    0x80000000: 0x80000000,  # -0
    0x00000001: 0x00000000,  # the smallest subnormal: to +0
    0x00008000: 0x00000000,  # a subnormal tie: to the even 0
    0x00018000: 0x00020000,  # a subnormal tie: to the even 2 * 2^16 ulps
    0x00008001: 0x00010000,  # just above a tie: the smallest bfloat16 subnormal
    0x807FFFFF: 0x80800000,  # the largest negative subnormal: up to -2^-126, a normal
    0x007F7FFF: 0x007F0000,
}
NANS = [0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0xFFC00000, 0xFFFFFFFF, 0xFF800001]


def _floats(bits) -> np.ndarray:
    return np.array(list(bits), dtype=np.uint32).view(np.float32)


def _random_bits(count, seed=0) -> np.ndarray:
    """Random float32 bit patterns (every exponent), plus ties of every upper half."""
    rng = np.random.default_rng(seed)
    anything = rng.integers(0, 2**32, count, dtype=np.uint64).astype(np.uint32)
    ties = (rng.integers(0, 2**16, count // 4, dtype=np.uint64).astype(np.uint32) << 16) | np.uint32(0x8000)
    return np.concatenate([anything, ties]).view(np.float32)


def _same_bits(got, want_bits, what):
    got_bits = np.asarray(got, dtype=np.float32).view(np.uint32)
    bad = np.flatnonzero(got_bits != np.asarray(want_bits, dtype=np.uint32))
    assert bad.size == 0, [f"{what}: {int(b):#010x}" for b in bad[:5]]


def test_reference_rounding_on_edge_values():
    x = _floats(EDGES)
    _same_bits(round_to_bf16(x), list(EDGES.values()), "reference")
    _same_bits(bf16_nearest(x), list(EDGES.values()), "oracle")
    nans = _floats(NANS)
    _same_bits(round_to_bf16(nans), NANS, "reference NaN")  # the same NaN, payload and sign kept


def test_reference_rounding_equals_the_search_oracle():
    """The reference's add-and-mask against op_cases.bf16_nearest, which picks the
    nearer of the two neighbouring bfloat16 values in float64."""
    x = _random_bits(1 << 20)
    got, want = round_to_bf16(x), bf16_nearest(x)
    nan = np.isnan(x)
    _same_bits(got[~nan], want[~nan].view(np.uint32), "random")
    _same_bits(got[nan], x[nan].view(np.uint32), "random NaN")


@pytest.fixture(scope="module")
def rounding_module(builds):
    def rounding():
        x = dg.input("x", (N,))
        return {"y": dg.round_bf16(x)}

    graph = dg.model(rounding).build("bf16_rounding")
    return builds.module(graph)[0]


def test_generated_rounding_on_edge_values(rounding_module):
    model = rounding_module.Model(seed=0)
    x = np.concatenate([_floats(EDGES), _floats(NANS)])
    got = model.forward(x=x)["y"]
    _same_bits(got, list(EDGES.values()) + NANS, "generated")
    x = _random_bits(1 << 18, seed=1)
    _same_bits(model.forward(x=x)["y"], round_to_bf16(x).view(np.uint32), "generated random")


def _error(got, want) -> float:
    """The largest difference relative to the largest magnitude of `want`."""
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


# generated vs reference, of the output's largest magnitude (see the test below)
ORDER_TOLERANCE = 2.5e-4

# (example, input name, input shape without the batch, output)
MODELS = [("mlp", "x", (784,), "logits"), ("lenet", "images", (1, 8, 8), "probs")]


@pytest.mark.parametrize("name,input_name,shape,output", MODELS, ids=[m[0] for m in MODELS])
def test_bf16_model_matches_reference_and_differs_from_fp32(name, input_name, shape, output, builds):
    fp32 = load_example(name).build()
    graph = load_example(name).build(f"{name}_bf16")
    notes = set_precision(graph, "bf16")
    assert graph.train is None and "no train_step()" in notes[0]
    assert [v.name for v in graph.inputs] == [input_name]
    module, _ = builds.module(graph)
    assert module.build_info()["precision"] == "bf16"
    assert not hasattr(module.Model, "train_step")

    memory_graph = load_example(name).build(f"{name}_bf16")
    set_precision(memory_graph, "bf16")
    forward_floats = sympy.sympify(lowered(prepare(memory_graph)).memory["forward_floats"])
    params = reference.init_params(graph, seed=3)
    model = module.Model(seed=3)
    for k, v in model.parameters().items():  # the same weights: the Model draws the reference's
        np.testing.assert_array_equal(v, params[k], err_msg=k)
    rng = np.random.default_rng(5)
    for batch in (1, 7, 64):
        x = rng.normal(size=(batch,) + shape).astype(np.float32)
        got = model.forward(**{input_name: x})[output]
        stats = model.memory_stats()  # the arena holds the rounded activations: the plan counts them
        assert stats["peak_bytes"] == stats["predicted_peak_bytes"] == 4 * int(forward_floats.subs({d: batch for d in memory_graph.dims}))
        want = reference.run(graph, {input_name: x}, params)[output]
        exact = reference.run(fp32, {input_name: x}, params)[output]
        print(f"{name} N={batch}: generated vs reference {_error(got, want):.2e}, bf16 vs fp32 {_error(want, exact):.2e}"
              f" (of the largest |{output}|)")
        # generated == reference up to float32 accumulation order, and where an order difference
        # moves an activation across a bfloat16 rounding boundary, that element differs by one bf16
        # step (2^-8 of it): seen 5e-5 at N=64 in the MLP, where the fp32 ones are 1e-7
        assert _error(got, want) <= ORDER_TOLERANCE, (batch, _error(got, want))
        # and bf16 is not fp32: about bfloat16's relative precision (2^-8 per rounding) away, seen
        # 1.3e-3 to 4.3e-3: well outside the tolerance above, so the comparison can fail
        assert 2 * ORDER_TOLERANCE < _error(want, exact) < 2**-4, (batch, _error(want, exact))


def test_bf16_convolutions_round_their_input_as_they_read_it():
    """In bf16 inference the rounding before a one-group convolution is the convolution's
    own (attr rounded: dg::conv2d_bf16 rounds as it copies its input channels last): no
    round_bf16 node is left before one, and the optimized graph's reference gives the
    bits of the graph as built (round_bf16, then the convolution), so a reference that
    skipped the attr's rounding would fail here."""
    built = load_example("lenet").build("lenet_bf16")
    set_precision(built, "bf16")
    graph = load_example("lenet").build("lenet_bf16")
    set_precision(graph, "bf16")
    prepare(graph)
    convs = [n for n in graph.nodes if n.op in ("conv2d", "conv2d_batch_norm")]
    assert convs and all(n.attrs.get("rounded") == (0,) for n in convs), [(n.op, n.attrs) for n in convs]
    assert all(getattr(n.inputs[0].producer, "op", None) != "round_bf16" for n in convs)
    params = reference.init_params(built, seed=3)
    x = np.random.default_rng(8).normal(size=(5, 1, 8, 8)).astype(np.float32)
    want = reference.run(built, {"images": x}, params)["probs"]
    got = reference.run(graph, {"images": x}, params)["probs"]
    np.testing.assert_array_equal(got, want)
    for n in convs:  # the attr matters: without it the inputs' low bits would reach the products
        n.attrs = {k: v for k, v in n.attrs.items() if k != "rounded"}
    assert not np.array_equal(reference.run(graph, {"images": x}, params)["probs"], want)


def test_bf16_weights_are_rounded_once_by_their_packing(builds):
    """A weight's rounding is done by its kept packing (no dg::round_bf16 of a weight in
    run()), once per change: a weight written through parameters() is rounded and packed
    again before the next forward(), which then matches the reference on the new weights."""
    graph = load_example("mlp").build("mlp_bf16")  # the build test_bf16_model_matches_reference made
    set_precision(graph, "bf16")
    module, project = builds.module(graph)
    run = (project / "src_tree" / "src" / "model.cpp").read_text()
    header = (project / "src_tree" / "include" / "mlp_bf16" / "model.h").read_text()
    # no rounding call at all: the products round x as they pack its rows (transforms/rounding.py)
    assert "dg::round_bf16(" not in run and "dg::matmul_bf16(x, h1_w_bf16_packed" in run
    assert "dg::KeptBf16Weight h1_w_bf16_packed{_version, h1_w, /*tb=*/false, /*K=*/784, /*N=*/512};" in header
    # the products' path (tests/test_bf16_kernels.py runs each): bf16 instructions where the CPU has them
    kernel = module.build_info()["bf16_kernel"]
    flags = cpu_flags()
    assert kernel in ({"amx", "avx512_bf16"} if "amx_bf16" in flags else {"avx512_bf16"} if "avx512_bf16" in flags
                      else {"float32"}), kernel
    params = reference.init_params(graph, seed=3)
    model = module.Model(seed=3)
    x = np.random.default_rng(6).normal(size=(3, 784)).astype(np.float32)
    before = model.forward(x=x)["logits"]
    assert _error(before, reference.run(graph, {"x": x}, params)["logits"]) <= ORDER_TOLERANCE
    assert model.memory_stats()["packed_weight_bytes"] > 0  # the forward pass packed (and rounded) them
    params["h1_w"] = (params["h1_w"] * np.float32(-1.5)).astype(np.float32)
    views = model.parameters()
    views["h1_w"][...] = params["h1_w"]
    del views
    after = model.forward(x=x)["logits"]
    want = reference.run(graph, {"x": x}, params)["logits"]
    assert _error(after, want) <= ORDER_TOLERANCE and _error(before, want) > 0.1


def test_precision_errors():
    graph = load_example("mlp").build()
    assert set_precision(graph, "fp32") == [] and graph.precision == "fp32" and graph.train is not None
    with pytest.raises(DeepgenError, match="expected one of"):
        set_precision(graph, "fp16")

    def trains_in_fp16():
        x = dg.input("x", (N, 3))
        y = dg.dense(x, 2)
        dg.train(dg.mean(y * y), precision="fp16")
        return {"y": y}

    with pytest.raises(dg.ModelError, match="expected 'fp32' or 'bf16'"):  # bf16 training: test_bf16_training.py
        dg.model(trains_in_fp16).build()


def test_trained_digits_mlp_predicts_the_same_in_bf16(builds, trained_digits):
    """examples/digits.py trained in fp32 (the reference's train_step, 8 epochs), then run
    in bf16 by the generated module: its held-out predictions agree with fp32's."""
    _, test_set, fp32, params = trained_digits

    graph = load_example("digits").build("digits_bf16")
    set_precision(graph, "bf16")
    model = builds.module(graph)[0].Model(seed=0)
    for name, view in model.parameters().items():
        view[...] = params[name]
    pixels, labels = test_set["pixels"], test_set["labels"]
    got = model.forward(pixels=pixels)["probs"]
    want = reference.run(fp32, {"pixels": pixels}, params)["probs"]
    fp32_accuracy, bf16_accuracy, agree = held_out_agreement(got, want, labels, "bf16")
    assert fp32_accuracy > 0.9
    assert agree >= 0.99 and bf16_accuracy >= 0.99 * fp32_accuracy
    assert _error(got, reference.run(graph, {"pixels": pixels}, params)["probs"]) <= ORDER_TOLERANCE


def test_bf16_on_the_cuda_target_emulated(tmp_path):
    """The CUDA target rounds with dg_cuda_precision.h's round_bf16: LeNet in bf16, built
    with DG_CUDA_EMULATE (every kernel on the CPU), against the reference."""
    import importlib
    import sys

    from generator.codegen.writer import write_project
    from generator.pipeline import project_files
    from test_cuda import _cmake

    graph = load_example("lenet").build("lenet_bf16_emu")
    set_precision(graph, "bf16")
    write_project(tmp_path / "src", project_files(graph, "cuda"), force=True)
    _cmake(tmp_path / "src", tmp_path / "build", {"DG_CUDA_EMULATE": "ON", "CMAKE_BUILD_TYPE": "Debug",
                                                  "CMAKE_CXX_FLAGS_DEBUG": "-O1", "LENET_BF16_EMU_EXAMPLE": "OFF"})
    sys.path.insert(0, str(tmp_path / "build"))
    try:
        module = importlib.import_module(graph.name)
    finally:
        sys.path.remove(str(tmp_path / "build"))
    assert module.build_info()["precision"] == "bf16"
    x = np.random.default_rng(1).normal(size=(16, 1, 8, 8)).astype(np.float32)
    got = module.Model(seed=3).forward(images=x)["probs"]
    want = reference.run(graph, {"images": x}, reference.init_params(graph, seed=3))["probs"]
    assert _error(got, want) <= ORDER_TOLERANCE
