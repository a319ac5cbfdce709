"""int8 inference (`deepgen generate --precision int8`, `deepgen quantize`): the
quantization formula, a small MLP generated in int8 against the reference (exactly
equal: integer sums, the same float steps), the trained digits MLP's accuracy in
int8, the error for scales never loaded, and the quantize command's errors. The
modules build at CHECK_BUILD_FLAGS (-O0): the tests compare values, and the int8
kernels are intrinsics at any level (GCC contracts and reorders no float arithmetic
at either level)."""

from __future__ import annotations

import numpy as np
import pytest
import sympy

import generator as dg
from conftest import CHECK_BUILD_FLAGS, ROOT, build_runtime_drivers, child_env, cpu_flags, held_out_agreement, load_example
from generator.errors import DeepgenError
from generator.ops.quantize import MAX_K, matmul_int8, quantize, weight_scales
from generator.pipeline import lowered, prepare
from generator.reference import interpreter as reference
from generator.tools.cli import main as cli
from generator.transforms.passes import optimize
from generator.transforms.precision import set_precision

N = dg.dim("N")

MODEL_FILE = '''
import generator as dg
N = dg.dim("N")

@dg.model
def mlp_int8():
    x = dg.input("x", (N, 37))
    h = dg.dense(x, 21, act=dg.relu, name="fc1")
    w = dg.param("proj_w", (6, 21))
    z = dg.matmul(h, w, tb=True)  # a PyTorch-layout weight, [out, in]
    y = dg.dense(dg.tanh(z), 3, name="fc2")
    return {"y": y}
'''


def test_quantize_rounds_half_to_even_and_clamps():
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, 126.5, 127.5, 300.0, -300.0, 0.0], np.float32)
    assert quantize(x, np.float32(1.0)).tolist() == [0, 2, 2, 0, -2, -2, 0, 126, 127, 127, -127, 0]
    # the scale is used as a float32 reciprocal: x * (1 / s), one rounding each
    s = np.float32(0.1)
    x = np.arange(-20, 21, dtype=np.float32) * np.float32(0.05)
    want = np.clip(np.rint(x * (np.float32(1) / s)), -127, 127)
    assert quantize(x, s).tolist() == want.astype(int).tolist()
    w = np.array([[1.0, 0.0], [-2.0, 0.0], [0.5, 0.0]], np.float32)  # [K=3, P=2]: channel 1 all zeros
    assert weight_scales(w, tb=False).tolist() == [np.float32(2.0) / np.float32(63), 1.0]  # weights: 7 bits
    assert quantize(np.array([100.0, -100.0, 62.5, 63.5], np.float32), np.float32(1.0), 63).tolist() == [63, -63, 62, 63]
    # the AVX2 kernel sums (qx + 128) * qw in int32: qx + 128 <= 255, |qw| <= 63
    assert MAX_K * 255 * 63 <= 2**31 - 1 < (MAX_K + 1) * 255 * 63
    with pytest.raises(ValueError, match="'s' is 0: it was never set"):
        matmul_int8(np.ones((1, 3), np.float32), w, np.zeros(1, np.float32), np.ones(2, np.float32), False, ("s", "t"))


def _mlp_files(tmp_path, rows=200, seed=0):
    """The model file, its float32 weights (seed 0) and calibration inputs."""
    model = tmp_path / "mlp_int8.py"
    model.write_text(MODEL_FILE)
    from generator.frontend.loader import load_model

    fp32 = load_model(str(model)).build()
    params = reference.init_params(fp32, seed=seed)
    np.savez(tmp_path / "w.npz", **params)
    x = np.random.default_rng(seed).normal(size=(rows, 37)).astype(np.float32)
    np.savez(tmp_path / "calib.npz", x=x)
    return model, fp32, params, x


def test_mlp_int8_generated_equals_reference(tmp_path, builds, capsys):
    from generator.frontend.loader import load_model

    model_file, fp32, params, x = _mlp_files(tmp_path)
    assert cli(["quantize", str(model_file), "--weights", str(tmp_path / "w.npz"),
                "--calibrate", str(tmp_path / "calib.npz"), "-o", str(tmp_path / "wq.npz")]) == 0
    out = capsys.readouterr().out
    assert "fc1_w_input_scale" in out and "proj_w_scale" in out and "int8 agrees with fp32" in out, out
    with np.load(tmp_path / "wq.npz") as f:
        wq = {k: f[k] for k in f.files}
    for k, v in params.items():  # every array of W.npz, unchanged
        np.testing.assert_array_equal(wq[k], v)
    assert sorted(set(wq) - set(params)) == sorted(f"{w}_{s}" for w in ("fc1_w", "proj_w", "fc2_w")
                                                     for s in ("input_scale", "scale"))
    assert wq["proj_w_scale"].shape == (6,) and wq["fc1_w_scale"].shape == (21,) and wq["fc2_w_input_scale"].shape == (1,)
    np.testing.assert_array_equal(wq["fc1_w_input_scale"], [np.abs(x).max() / np.float32(127)])

    graph = load_model(str(model_file)).build()
    set_precision(graph, "int8")
    assert [n.op for n in graph.nodes].count("matmul_int8") == 3
    module, project = builds.module(graph, flags=CHECK_BUILD_FLAGS)
    info = module.build_info()
    assert info["precision"] == "int8"
    assert info["int8_kernel"] in ("amx", "avx512_vnni", "avx_vnni", "avx2", "portable"), info  # int8_kernel()
    text = (project / "src_tree" / "src" / "model.cpp").read_text()
    model = module.Model(seed=0)
    with pytest.raises(ValueError, match=r"int8 scale 'fc1_w_input_scale' is 0: it was never set; run `deepgen quantize"):
        model.forward(x=x[:2])
    model.load(str(tmp_path / "wq.npz"))
    forward_floats = sympy.sympify(lowered(prepare(graph)).memory["forward_floats"])
    for rows in (1, 5, 64, 200):
        got = model.forward(x=x[:rows])["y"]
        want = reference.run(graph, {"x": x[:rows]}, wq)["y"]
        np.testing.assert_array_equal(got, want)  # bit for bit
        exact = reference.run(fp32, {"x": x[:rows]}, params)["y"]
        assert 0 < np.abs(want - exact).max() < 0.05 * np.abs(exact).max()  # int8, and close to fp32
        stats = model.memory_stats()  # the int8 copies are arena pieces: the plan counts them
        assert stats["peak_bytes"] == stats["predicted_peak_bytes"] == 4 * int(forward_floats.subs({N: rows}))
    # large and odd values: every AVX2 lane, the K and N tails, clamping (a stale scale)
    big = np.random.default_rng(1).normal(scale=40, size=(33, 37)).astype(np.float32)
    np.testing.assert_array_equal(model.forward(x=big)["y"], reference.run(graph, {"x": big}, wq)["y"])
    # the project's own test: its expected outputs come with scales calibrated on its sample inputs
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                          cwd=project / "src_tree", capture_output=True, text=True, timeout=300,
                          env=child_env(PYTHONPATH=str(project / "build")))
    assert proc.returncode == 0, proc.stdout[-3000:]
    # each step a named call, with its scale's name; the weight's, a member the Model keeps
    header = " ".join((project / "src_tree" / "include" / "mlp_int8" / "model.h").read_text().split())
    assert ('dg::KeptInt8Weight proj_w_int8{_version, proj_w, proj_w_scale, "proj_w_scale", /*tb=*/true, /*K=*/21, '
            "/*N=*/6};") in header
    # (fc1's output h, read by proj's product only, is handed over quantized with proj's
    # input scale: proj quantizes nothing itself)
    for call in ("dg::quantize_int8(x, dg::int8_data(x_q), fc1_w_input_scale.ptr()",
                 '/*handed_over=*/dg::Int8Rows{dg::int8_data(h_q), proj_w_input_scale.ptr(), "proj_w_input_scale"}',
                 "dg::int8_data(h_q), proj_w_input_scale.ptr(), proj_w_int8, "):
        assert call in " ".join(text.split()), call
    assert "dg::quantize_int8(h," not in " ".join(text.split())
    assert "quantize_weight_int8" not in text  # not per call


def test_kept_int8_weight_follows_parameter_changes(tmp_path, builds, capsys):
    """The int8 weight is quantized and packed once per change of the parameters: after
    a write through parameters() or buffers() (a scale), load() or release_packed_weights(),
    the next forward() equals the reference on the new values; and while nothing changes
    the packing is kept (its bytes stay)."""
    from generator.frontend.loader import load_model

    model_file, fp32, params, x = _mlp_files(tmp_path)
    assert cli(["quantize", str(model_file), "--weights", str(tmp_path / "w.npz"),
                "--calibrate", str(tmp_path / "calib.npz"), "-o", str(tmp_path / "wq.npz")]) == 0
    capsys.readouterr()
    with np.load(tmp_path / "wq.npz") as f:
        wq = {k: f[k].copy() for k in f.files}
    graph = load_model(str(model_file)).build()
    set_precision(graph, "int8")
    module, _ = builds.module(graph, flags=CHECK_BUILD_FLAGS)
    model = module.Model(seed=0)
    model.load(str(tmp_path / "wq.npz"))
    xs = x[:7]

    def check(weights):
        np.testing.assert_array_equal(model.forward(x=xs)["y"], reference.run(graph, {"x": xs}, weights)["y"])

    assert model.memory_stats()["packed_weight_bytes"] == 0
    check(wq)
    kept = model.memory_stats()["packed_weight_bytes"]
    assert kept > 0
    check(wq)
    assert model.memory_stats()["packed_weight_bytes"] == kept
    # a weight written through its view
    views = model.parameters()
    views["proj_w"][...] *= np.float32(-0.5)
    views["fc1_w"][3, :] = 0.0
    wq["proj_w"] = wq["proj_w"] * np.float32(-0.5)
    wq["fc1_w"][3, :] = 0.0
    del views
    check(wq)
    # a weight scale written through the buffers' view
    buffers = model.buffers()
    buffers["fc2_w_scale"][...] *= np.float32(1.5)
    wq["fc2_w_scale"] = wq["fc2_w_scale"] * np.float32(1.5)
    del buffers
    check(wq)
    # load() of other weights
    other = {k: (v * np.float32(0.75) if k.endswith("_w") else v) for k, v in wq.items()}
    np.savez(tmp_path / "other.npz", **other)
    model.load(str(tmp_path / "other.npz"))
    check(other)
    model.release_packed_weights()
    assert model.memory_stats()["packed_weight_bytes"] == 0
    check(other)


def test_trained_digits_mlp_in_int8(tmp_path, builds, capsys, trained_digits):
    """examples/digits.py trained in fp32 (the reference's train_step, 8 epochs), quantized
    by `deepgen quantize` on the training images, run in int8 by the generated module on
    the 360 held-out ones: equal to the int8 reference, accuracy within 1% relative of fp32."""
    train_set, test_set, fp32, params = trained_digits
    np.savez(tmp_path / "w.npz", **params)
    np.savez(tmp_path / "train.npz", **train_set)  # pixels and labels: the report gives both accuracies
    assert cli(["quantize", str(ROOT / "examples" / "digits.py"), "--weights", str(tmp_path / "w.npz"),
                "--calibrate", str(tmp_path / "train.npz"), "-o", str(tmp_path / "wq.npz")]) == 0
    report = capsys.readouterr().out
    assert "accuracy against 'labels': fp32" in report, report
    print(report)

    graph = load_example("digits").build("digits_int8")
    notes = set_precision(graph, "int8")
    assert "no train_step()" in notes[0] and "hidden_w, logits_w" in notes[1], notes
    model = builds.module(graph, flags=CHECK_BUILD_FLAGS)[0].Model(seed=0)
    model.load(str(tmp_path / "wq.npz"))
    with np.load(tmp_path / "wq.npz") as f:
        wq = {k: f[k] for k in f.files}
    pixels, labels = test_set["pixels"], test_set["labels"]
    got = model.forward(pixels=pixels)["probs"]
    # the logits are equal bit for bit (as in the MLP test); the softmax's float32 exp and sum
    # are not bitwise the reference's: a few ulps
    np.testing.assert_allclose(got, reference.run(graph, {"pixels": pixels}, wq)["probs"], rtol=2e-5, atol=1e-7)
    want = reference.run(fp32, {"pixels": pixels}, params)["probs"]
    fp32_accuracy, int8_accuracy, agree = held_out_agreement(got, want, labels, "int8")
    assert fp32_accuracy > 0.9
    assert int8_accuracy >= 0.99 * fp32_accuracy and agree >= 0.97


def test_quantize_command_errors(tmp_path, capsys):
    model_file, _, params, x = _mlp_files(tmp_path, rows=8)
    out = tmp_path / "wq.npz"

    def quantize_fails(*args, weights="w.npz", calib="calib.npz"):
        argv = ["quantize", str(model_file), "--weights", str(tmp_path / weights), "--calibrate", str(tmp_path / calib),
                "-o", str(out), *args]
        assert cli(argv) == 1
        return capsys.readouterr().err

    out.write_text("mine")
    assert "exists; pass --force" in quantize_fails()
    assert out.read_text() == "mine"  # never overwritten without --force
    out.unlink()
    err = quantize_fails(weights="nope.npz")
    assert "--weights" in err and "nope.npz: no such file" in err, err
    np.savez(tmp_path / "other.npz", y=x)
    err = quantize_fails(calib="other.npz")
    assert "unknown array(s) y" in err and "the model's inputs are: x" in err, err
    np.savez(tmp_path / "empty.npz")
    assert "missing input(s) x" in quantize_fails(calib="empty.npz")
    np.savez(tmp_path / "partial.npz", **{k: v for k, v in params.items() if k != "fc2_b"})
    assert "missing parameter(s) fc2_b" in quantize_fails(weights="partial.npz")
    np.savez(tmp_path / "bad.npz", **{**params, "fc1_w": params["fc1_w"][:3]})
    assert "'fc1_w' has shape (3, 21)" in quantize_fails(weights="bad.npz")
    (tmp_path / "text.npz").write_text("not a zip")
    assert "not a readable .npz file" in quantize_fails(calib="text.npz")
    assert not out.exists()
    assert cli(["quantize", str(model_file), "--weights", str(tmp_path / "w.npz"), "--calibrate",
                str(tmp_path / "calib.npz"), "-o", str(out)]) == 0 and out.exists()
    # a trained fp32 Model's save() holds its optimizer state: left out (the int8 project refuses it)
    np.savez(tmp_path / "trained.npz", **params, **{"optimizer/fc1_w/m": params["fc1_w"], "optimizer/step": np.int64(3)})
    capsys.readouterr()
    assert cli(["quantize", str(model_file), "--weights", str(tmp_path / "trained.npz"), "--calibrate",
                str(tmp_path / "calib.npz"), "-o", str(out), "--force"]) == 0
    assert "not its optimizer state: 2 arrays" in capsys.readouterr().out
    with np.load(out) as f:
        assert not [k for k in f.files if k.startswith("optimizer/")] and set(params) < set(f.files)


def test_int8_leaves_attention_and_cells_in_float32():
    """Only products by a weight run in int8 (one-group convolutions too: test_lenet_int8_*;
    grouped ones stay float32, ops/quantize.py int8_candidates): bmm and a product of two
    activations stay float32 nodes."""
    def mixed():
        x = dg.input("x", (N, 4, 6))
        q = dg.dense(x, 6, name="q")
        scores = dg.matmul(q, x, tb=True)  # [N, 4, 4]: two activations, a bmm
        w = dg.param("w", (6, 5))
        y = dg.matmul(dg.reshape(dg.matmul(scores, x), (N * 4, 6)), w)
        return {"y": y}

    graph = dg.model(mixed).build()
    set_precision(graph, "int8")
    ops = [n.op for n in graph.nodes]
    assert ops.count("matmul_int8") == 2 and "bmm" in ops and "matmul" not in ops, ops
    states = {p.name: p.shape for p in graph.params if p.kind == "state"}
    assert states == {"q_w_input_scale": (1,), "q_w_scale": (6,), "w_input_scale": (1,), "w_scale": (5,)}
    with pytest.raises(ValueError, match="int8 scale 'q_w_input_scale' is 0: it was never set"):
        reference.run(graph, {"x": np.ones((2, 4, 6), np.float32)})
    from generator.pipeline import project_files

    with pytest.raises(DeepgenError, match="the cuda target has no int8 runtime"):
        project_files(graph, "cuda")


# The drivers built: {name: (g++ flags, the /proc/cpuinfo flags it needs, the kernel it runs)}.
# Each kernel of dg_int8.h gets its own build where this CPU can run it. x86-64-v4 is
# AVX-512 F/BW/CD/DQ/VL (and AVX2, FMA, BMI, ...): with -mavx512vnni, the zmm VNNI kernel
# without AMX, as on Ice Lake and Cascade Lake servers.
_X86_V3 = {"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm"}
INT8_DRIVERS = {
    "portable": (["-march=x86-64"], set(), "portable"),  # SSE2, no AVX2
    "avx2": (["-mavx2", "-mfma"], {"avx2", "fma"}, "avx2"),
    "avx512_vnni": (["-march=x86-64-v4", "-mavx512vnni"],
                    _X86_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"},
                    "avx512_vnni"),
    "amx": (["-march=native"], {"avx512bw", "avx512_vnni", "amx_tile", "amx_int8"}, "amx"),
}


def _int8_drivers(tmp_path) -> dict:
    """{name: driver} for each of INT8_DRIVERS this CPU can run."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the int8 drivers are built for x86-64")
    flags = cpu_flags()
    return build_runtime_drivers(tmp_path, "int8_driver",
                                 {name: spec[0] for name, spec in INT8_DRIVERS.items() if spec[1] <= flags})


def test_runtime_int8_equals_reference_portable_and_avx2(tmp_path):
    """dg_int8.h's kernels, each built where this CPU can run it (/proc/cpuinfo's flags; the
    others are left out, and the test says which ran): the portable loops (baseline x86-64),
    AVX2 (vpmaddubsw), the zmm AVX-512 VNNI kernel without AMX (x86-64-v4 + VNNI), and this
    CPU's own build (-march=native) with AMX tiles, run also with DG_AMX=0 (the VNNI kernel
    again). Each driver names the kernel it runs (int8_kernel(), checked). Their integer sums
    equal a plain int32 loop (rows 1..9 and 12..65, K and N odd, K a multiple of 64 and not,
    the extreme values), and quantize_int8, quantize_pack_int8 and matmul_int8 on one and two
    threads, with an epilogue and without, equal the numpy reference bit for bit at sizes that
    leave every tail (K % 4, K % 64,
    N % 16, rows % 16 and the VNNI kernel's row blocks, the quantizer's 16-wide blocks; one
    product large enough for the AMX kernel to split it over the two threads). The
    AVX-VNNI (ymm vpdpbusd) build is not run: on a CPU with AVX-512 VNNI the zmm kernel replaces it."""
    import os
    import subprocess

    drivers = _int8_drivers(tmp_path)
    runs = [(name, exe, INT8_DRIVERS[name][2], {}) for name, exe in drivers.items()]
    if "amx" in drivers:
        runs.append(("amx, DG_AMX=0", drivers["amx"], "avx512_vnni", {"DG_AMX": "0"}))
    ran = []
    for name, exe, kernel, env in runs:
        proc = subprocess.run([str(exe), "kernel"], capture_output=True, text=True, timeout=60,
                              env=dict(os.environ, **env))
        got_kernel = proc.stdout.strip()
        if kernel == "amx" and got_kernel == "avx512_vnni":  # the CPU has AMX, the OS refused the tiles
            print("amx: the kernel did not grant the tile state (arch_prctl): the VNNI kernel ran")
        else:
            assert got_kernel == kernel, f"{name}: {proc.stdout}{proc.stderr}"
        ran.append(f"{name}: {got_kernel}")
    print("int8 drivers run: " + "; ".join(ran))
    for name, exe, _, env in runs:  # the kernel's integer sums against a plain int32 loop
        proc = subprocess.run([str(exe), "sums"], capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, **env))
        assert proc.returncode == 0 and proc.stdout.startswith("ok "), f"{name}: {proc.stdout}{proc.stderr}"
    rng = np.random.default_rng(7)
    cases = [(1, 1, 1, False), (3, 16, 4, True), (5, 37, 6, False), (17, 64, 10, True), (64, 300, 33, False),
             (9, 130, 70, False), (4, 37, 20, False), (6, 33, 17, False), (7, 37, 20, False),
             (8, 64, 16, False), (16, 128, 32, True), (33, 200, 17, False), (40, 784, 50, True),
             (48, 256, 48, False), (13, 190, 40, False),
             (260, 784, 340, True),  # (M, K, N, tb); past kInt8AmxMinParallelWork: AMX, 2 threads
             (700, 770, 24, False),  # quantize_int8's rows (K % 4 != 0: padded) shared out over 2 threads
             (300, 4100, 40, False)]  # AMX rows a chunk at a time (kInt8AmxChunkBytes): 14 row tiles, then 5
    for m, k, n, tb in cases:
        x = rng.normal(scale=3, size=(m, k)).astype(np.float32)
        x[0, 0] = 1000.0  # clamped
        w = rng.normal(size=(n, k) if tb else (k, n)).astype(np.float32)
        xs = np.array([2.5 / 127], np.float32)
        if m == 3:  # ties: x * (1 / 1) = k + 0.5 rounds to the even neighbour
            x, xs = ((np.arange(m * k) - 24) / 2).reshape(m, k).astype(np.float32), np.ones(1, np.float32)
        ws = weight_scales(w, tb) * np.float32(0.9)  # a scale below the largest weight: clamping
        want = matmul_int8(x, w, xs, ws, tb)
        stdin = b"".join(a.tobytes() for a in (x, w, xs, ws))
        # with an epilogue (the driver's: y * 2 + the element's index, on each finished piece):
        # every element given it once, at its own row and column, after the scaling
        with_epi = want * np.float32(2) + np.arange(m * n, dtype=np.float32).reshape(m, n)
        for name, exe, _, env in runs:
            for threads, epi in ((1, False), (2, False), (1, True), (2, True)):
                proc = subprocess.run([str(exe), str(m), str(k), str(n), "1" if tb else "0"] + (["epi"] if epi else []),
                                      input=stdin, capture_output=True, timeout=60,
                                      env=dict(os.environ, OMP_NUM_THREADS=str(threads), **env))
                assert proc.returncode == 0, proc.stderr.decode()
                got = np.frombuffer(proc.stdout, np.float32).reshape(m, n)
                np.testing.assert_array_equal(got, with_epi if epi else want,
                                              err_msg=f"{name}, {threads} threads, {m}x{k}x{n} tb={tb} epilogue={epi}")


def _model_with(module, params):
    """A Model of the built module holding `params` (its parameters and buffers, the
    int8 scales among them), written through the views, which are then dropped."""
    model = module.Model(seed=0)
    views = {**model.parameters(), **model.buffers()}
    for name, view in views.items():
        view[...] = params[name]
    del views
    return model


def _batch_norm_params(graph, inputs, rng) -> dict:
    """The graph's parameters with batch norm's weight, bias and running statistics none
    trivial (a wrong channel, scale or shift changes the output), and the int8 scales
    calibrated on `inputs`."""
    from generator.reference.quantize import calibrate

    params = reference.init_params(graph, seed=0)
    for p in graph.params:
        if "bn_" in p.name:
            low = 0.5 if p.name.endswith(("running_var", "weight")) else -1.0
            params[p.name] = rng.uniform(low, 1.5, p.shape).astype(np.float32)
    params.update(calibrate(graph, [inputs], params))
    return params


def test_conv2d_batch_norm_int8_equals_reference_bit_for_bit(builds):
    """In an int8 project the conv_batch_norm pass fuses an int8 convolution and its batch
    norm (and the residual add and relu after) as it does a float32 one: one
    conv2d_batch_norm_int8 node (its operands conv2d_batch_norm's, the scales after the
    weight) and one dg::conv2d_batch_norm_int8 call, whose epilogue normalizes each block as
    the int8 product stores it. Batch norm's weights and running statistics are not trivial
    (a wrong channel, scale or shift changes the output), with and without a bias, residual
    and relu; planes of 100 positions (runs that cross images: the AMX store's masked
    pieces) and of 4 (one image: few rows, the VNNI product and to_planes). Evaluation mode:
    generated == reference bit for bit, and the same as the unfused reference (conv2d_int8,
    batch norm, add, relu); training mode: conv, then batch norm's training path (the
    running statistics move as the reference moves them)."""
    @dg.model
    def convbn_int8():
        x = dg.input("x", (N, 6, 10, 10))
        s = dg.input("s", (N, 16, 2, 2))
        a = dg.batch_norm_layer(dg.conv2d_layer(x, 20, 3, padding=1, bias=False, name="a"), name="abn")
        b = dg.relu(dg.batch_norm_layer(dg.conv2d_layer(x, 20, 3, padding=1, name="b"), name="bbn"))
        c = dg.relu(dg.batch_norm_layer(dg.conv2d_layer(b, 20, 3, padding=1, bias=False, name="c"), name="cbn") + a)
        d = dg.batch_norm_layer(dg.conv2d_layer(c, 20, 1, name="d"), name="dbn") + b
        e = dg.relu(dg.batch_norm_layer(dg.conv2d_layer(s, 40, 3, padding=1, name="e"), name="ebn"))
        return {"a": a, "c": c, "d": d, "e": e}  # a an output: the add joins c's node, not a's

    graph = convbn_int8.build("convbn_int8")
    set_precision(graph, "int8")
    unfused = convbn_int8.build("convbn_int8")
    set_precision(unfused, "int8")
    prepare(graph)
    fused = [n for n in graph.nodes if n.op == "conv2d_batch_norm_int8"]
    assert len(fused) == 5 and not any(n.op in ("conv2d_int8", "batch_norm") for n in graph.nodes)
    tails = sorted((n.inputs[1].name, n.attrs.get("residual", False), n.attrs.get("relu", False)) for n in fused)
    assert tails == [("a_weight", False, False), ("b_weight", False, True), ("c_weight", True, True),
                     ("d_weight", True, False), ("e_weight", False, True)], tails
    assert all([v.name for v in n.inputs[2:4]] == [f"{n.inputs[1].name}_input_scale", f"{n.inputs[1].name}_scale"]
               for n in fused)
    module, project = builds.module(graph, flags=CHECK_BUILD_FLAGS)
    code = " ".join((project / "src_tree" / "src" / "model.cpp").read_text().split())
    assert code.count("dg::conv2d_batch_norm_int8(") == 5 and "dg::conv2d_int8(" not in code
    assert "dg::batch_norm(" not in code
    rng = np.random.default_rng(9)
    inputs = {"x": rng.standard_normal((8, 6, 10, 10)).astype(np.float32),
              "s": rng.standard_normal((8, 16, 2, 2)).astype(np.float32)}
    params = _batch_norm_params(graph, inputs, rng)
    model = _model_with(module, params)
    model.eval()
    forward_floats = sympy.sympify(lowered(graph).memory["forward_floats"])
    for n in (8, 1):
        batch = {k: v[:n] for k, v in inputs.items()}
        got = model.forward(**batch)
        want = reference.run(graph, batch, params, training=False)
        plain = reference.run(unfused, batch, params, training=False)
        for k in "acde":
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"{k}, {n} images")
            np.testing.assert_array_equal(want[k], plain[k], err_msg=f"{k}, {n} images, unfused")
        stats = model.memory_stats()  # deepgen memory's prediction holds for the fused calls
        assert stats["peak_bytes"] == stats["predicted_peak_bytes"] == 4 * int(forward_floats.subs({N: n}))
    model.train()  # training mode: the batch's statistics, the running ones moved
    state = {k: v.copy() for k, v in params.items()}
    got = model.forward(**inputs)
    want = reference.run(graph, inputs, state, training=True)
    for k in "acde":
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-4, err_msg=f"{k}, training")
    buffers = model.buffers()
    for name in buffers:
        if name.endswith(("running_mean", "running_var")):
            np.testing.assert_allclose(buffers[name], state[name], rtol=1e-5, atol=1e-6, err_msg=name)
            assert not np.array_equal(state[name], params[name]), name


def test_int8_convolutions_hand_over_quantized_outputs(builds):
    """An int8 convolution with batch norm whose output only the next one reads hands it
    over quantized with that one's input scale, channels last (an arena piece of a quarter
    of the float32 bytes, `<output>_q`; dg::Int8ChannelsLast / Int8ChannelsLastIn): with
    AMX its tiles' sums are normalized, rectified and quantized straight into it, and the
    reader does not quantize. A ResNet bottleneck (1x1 from 128 channels, whose copy goes
    straight into the tiles; 3x3 of stride 2; 1x1 from 64 channels reading the handed-over
    rows, + a downsampled residual: the block's input has two readers, so none is handed
    over) and a chain on planes of 4 positions (few rows: the VNNI product and to_planes,
    then the planes quantized). Evaluation mode: generated == reference bit for bit at 8,
    5 (two threads: 3 + 2 images each) and 1 image; training mode (the float32 output
    written, then quantized) as the reference; deepgen memory's prediction holds."""
    def bottleneck(handed: bool):
        x = dg.input("x", (N, 128, 10, 10))
        s = dg.input("s", (N, 16, 2, 2))
        a = dg.relu(dg.batch_norm_layer(dg.conv2d_layer(x, 64, 1, bias=False, name="a"), name="abn"))
        b = dg.relu(dg.batch_norm_layer(dg.conv2d_layer(a, 64, 3, stride=2, padding=1, bias=False, name="b"),
                                        name="bbn"))
        d = dg.batch_norm_layer(dg.conv2d_layer(x, 96, 1, stride=2, bias=False, name="d"), name="dbn")
        c = dg.relu(dg.batch_norm_layer(dg.conv2d_layer(b, 96, 1, bias=False, name="c"), name="cbn") + d)
        e = dg.relu(dg.batch_norm_layer(dg.conv2d_layer(s, 40, 3, padding=1, name="e"), name="ebn"))
        f = dg.relu(dg.batch_norm_layer(dg.conv2d_layer(e, 24, 3, padding=1, name="f"), name="fbn"))
        return {"c": c, "f": f} if handed else {"c": c, "f": f, "a": a, "b": b, "e": e}  # (outputs: not handed)

    def built(name, handed, **flags):
        graph = dg.model(lambda: bottleneck(handed)).build(name)
        set_precision(graph, "int8")
        return graph, *builds.module(graph, **flags)

    graph, module, project = built("bottleneck_int8", True, flags=CHECK_BUILD_FLAGS)
    code = " ".join((project / "src_tree" / "src" / "model.cpp").read_text().split())
    for reader in "bcf":  # a's, b's and e's outputs quantized with their reader's input scale
        assert f'{reader}_weight_input_scale.ptr(), "{reader}_weight_input_scale"}}' in code, reader
    assert code.count("/*handed_over=*/") == 3 and code.count("dg::Int8ChannelsLastIn{") == 3
    prepare(graph)
    rng = np.random.default_rng(4)
    inputs = {"x": rng.standard_normal((8, 128, 10, 10)).astype(np.float32),
              "s": rng.standard_normal((8, 16, 2, 2)).astype(np.float32)}
    params = _batch_norm_params(graph, inputs, rng)
    model = _model_with(module, params)
    model.eval()
    forward_floats = sympy.sympify(lowered(graph).memory["forward_floats"])
    for n in (8, 5, 1):
        batch = {k: v[:n] for k, v in inputs.items()}
        got, want = model.forward(**batch), reference.run(graph, batch, params, training=False)
        for k in "cf":
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"{k}, {n} images")
        stats = model.memory_stats()
        assert stats["peak_bytes"] == stats["predicted_peak_bytes"] == 4 * int(forward_floats.subs({N: n}))
    model.train()
    state = {k: v.copy() for k, v in params.items()}
    got, want = model.forward(**inputs), reference.run(graph, inputs, state, training=True)
    for k in "cf":
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-4, err_msg=f"{k}, training")
    # optimized as a Release build is (-O3: the compiler may fuse a multiply and an add,
    # which -O0 never does), the bytes handed over are still those the reader makes: the
    # same outputs as without
    o3 = ("-DCMAKE_CXX_FLAGS_RELEASE=-O3 -DNDEBUG", *CHECK_BUILD_FLAGS[1:])
    got = _model_with(built("bottleneck_int8_o3", True, flags=o3)[1], params)
    want = _model_with(built("bottleneck_int8_o3_plain", False, flags=o3)[1], params)
    got.eval()
    want.eval()
    got, want = got.forward(**inputs), want.forward(**inputs)
    for k in "cf":
        np.testing.assert_array_equal(got[k], want[k], err_msg=f"{k}, -O3")


def test_matmul_int8_epilogue_fuses_bias_activation_and_residual(builds):
    """In an int8 project the epilogue pass folds what follows an int8 product (bias +
    gelu, bias + a residual [M, P] operand, bias + relu) into it as it does for a float32
    matmul: the matmul_int8 node takes attr `epilogue` and the consumer's operands, and
    dg::matmul_int8 applies the functor to each finished piece of its output (no separate
    kernel, no buffer for the product). Generated == reference bit for bit on AMX-sized
    (65 rows) and VNNI-sized (5 rows) products, and the reference equals the unfused
    graph's (every pass before epilogue: matmul_int8, then the elementwise kernels);
    deepgen memory's prediction holds."""
    from generator.reference.quantize import calibrate

    @dg.model
    def ffn_int8():
        x = dg.input("x", (N, 5, 40))
        h = dg.gelu(dg.dense(x, 72, name="up"))
        y = dg.dense(h, 40, name="down") + x
        r = dg.dense(y, 24, act=dg.relu, name="out")
        return {"y": y, "r": r}

    graph = ffn_int8.build("ffn_int8")
    set_precision(graph, "int8")
    unfused = ffn_int8.build("ffn_int8")
    set_precision(unfused, "int8")
    optimize(unfused, until="simplify")  # every pass before epilogue: the same elementwise kernels, unfused
    assert [n.op for n in unfused.nodes].count("ewise") == 3
    prepare(graph)
    products = [n for n in graph.nodes if n.op == "matmul_int8"]
    assert len(products) == 3 and all("epilogue" in n.attrs for n in products), [n.attrs for n in products]
    assert not any(n.op in ("ewise", "matmul") for n in graph.nodes), [n.op for n in graph.nodes]
    operands = sorted([v.name for v in n.inputs[1:]] for n in products)
    assert operands == [["down_w", "down_w_input_scale", "down_w_scale", "x", "down_b"],
                        ["out_w", "out_w_input_scale", "out_w_scale", "out_b"],
                        ["up_w", "up_w_input_scale", "up_w_scale", "up_b"]], operands
    module, project = builds.module(graph, flags=CHECK_BUILD_FLAGS)
    code = " ".join((project / "src_tree" / "src" / "model.cpp").read_text().split())
    assert code.count("dg::matmul_int8(") == 3 and code.count("_epilogue{") == 3, code
    assert "kernels::add_bias(" not in code and "kernels::add_bias_gelu(" not in code
    rng = np.random.default_rng(5)
    inputs = {"x": rng.standard_normal((13, 5, 40)).astype(np.float32)}
    params = reference.init_params(graph, seed=0)
    for p in graph.params:
        if p.name.endswith("_b"):  # biases that matter
            params[p.name] = rng.uniform(-0.5, 0.5, p.shape).astype(np.float32)
    params.update(calibrate(graph, [inputs], params))
    model = module.Model(seed=0)
    views = {**model.parameters(), **model.buffers()}
    for name, view in views.items():
        view[...] = params[name]
    del views
    forward_floats = sympy.sympify(lowered(graph).memory["forward_floats"])
    for n in (13, 1):
        batch = {k: v[:n] for k, v in inputs.items()}
        got = model.forward(**batch)
        want = reference.run(graph, batch, params)
        plain = reference.run(unfused, batch, params)
        for k in ("y", "r"):
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"{k}, {n} rows of 5")
            np.testing.assert_array_equal(want[k], plain[k], err_msg=f"{k}, {n} rows of 5, unfused")
        assert (want["r"] == 0).any() and (want["r"] > 0).any()
        stats = model.memory_stats()  # deepgen memory's prediction holds for the fused calls
        assert stats["peak_bytes"] == stats["predicted_peak_bytes"] == 4 * int(forward_floats.subs({N: n}))


def test_conv2d_batch_norm_int8_equals_the_separate_calls(tmp_path):
    """dg::conv2d_batch_norm_int8 against dg::conv2d_int8, then dg::batch_norm and the residual
    add and relu as the elementwise kernels compute them, built at -O2 once per int8 kernel this
    CPU runs (as test_runtime_int8_equals_reference_portable_and_avx2; where the compiler
    contracts batch norm's (x - mean) * scale + shift into a fused multiply-add, it contracts
    the epilogue's one expression alike): the same bits in evaluation mode, on AMX (the
    tiles' plane stores, runs that cross images), DG_AMX=0 (to_planes: 16 x 16 blocks, the
    channels and positions past them), few rows (the VNNI product at any setting) and the
    portable and AVX2 builds; in training mode (the two calls) too, running statistics
    included. The fused call runs in the workspace the generator reserves
    (ops/quantize_conv.py int8_conv_workspace: the driver reports the runtime's size, which
    must be the same, and a guard after it must stay untouched; with AMX the last geometry's
    1x1 convolution of 64 channels writes its input straight into the tiles), the separate
    one in the thread's own buffers."""
    import os
    import platform
    import subprocess

    from generator.ops.quantize_conv import int8_conv_workspace

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the int8 drivers are built for x86-64")
    flags = cpu_flags()
    drivers = build_runtime_drivers(tmp_path, "int8_conv_driver",
                                    {name: spec[0] for name, spec in INT8_DRIVERS.items() if spec[1] <= flags})
    runs = [(name, exe, {}) for name, exe in drivers.items()]
    if "amx" in drivers:
        runs.append(("amx, DG_AMX=0", drivers["amx"], {"DG_AMX": "0"}))
    rng = np.random.default_rng(11)
    # N C H W O KH KW OH OW stride pad dil
    geoms = [(4, 6, 10, 10, 20, 3, 3, 10, 10, 1, 1, 1), (1, 16, 2, 2, 40, 3, 3, 2, 2, 1, 1, 1),
             (2, 8, 8, 8, 33, 1, 1, 8, 8, 1, 0, 1), (3, 5, 9, 7, 17, 3, 3, 5, 4, 2, 1, 1),
             (2, 64, 6, 5, 24, 1, 1, 6, 5, 1, 0, 1)]
    tails = [(1, 0, 0, 0), (0, 0, 1, 1), (0, 0, 0, 1), (1, 0, 1, 0), (0, 1, 1, 1)]  # bias training residual relu
    for geom in geoms:
        n, c, h, wd, o, kh, kw, oh, ow = geom[:9]
        y_n = n * o * oh * ow
        x = rng.normal(size=n * c * h * wd).astype(np.float32)
        w = rng.normal(size=(o, c * kh * kw)).astype(np.float32)
        xs = np.array([3.0 / 127], np.float32)
        for bias, training, residual, relu in tails:
            stats = [rng.normal(size=o), rng.normal(size=o), rng.normal(size=o), rng.uniform(0.5, 2, size=o)]
            feed = [x, w] + ([rng.normal(size=o)] if bias else []) + stats
            feed += ([rng.normal(size=y_n)] if residual else []) + [xs, weight_scales(w, True)]
            stdin = b"".join(np.asarray(a, np.float32).tobytes() for a in feed)
            args = [str(v) for v in geom + (bias, training, residual, relu)]
            for name, exe, env in runs:
                for threads in (1, 2):
                    proc = subprocess.run([str(exe), *args], input=stdin, capture_output=True, timeout=60,
                                          env=dict(os.environ, OMP_NUM_THREADS=str(threads), **env))
                    what = f"{name}, {threads} threads, {geom}, bias/training/residual/relu {bias}{training}{residual}{relu}"
                    assert proc.returncode == 0, (what, proc.stderr.decode())
                    # the workspace the generator reserves is the one the runtime lays out
                    reserved = int8_conv_workspace((n, c, h, wd), (o, c, kh, kw), (oh, ow))
                    assert f"workspace {reserved}" in proc.stderr.decode(), (what, proc.stderr.decode())
                    out = np.frombuffer(proc.stdout, np.float32)
                    fused, plain, stats_out = out[:y_n], out[y_n : 2 * y_n], out[2 * y_n :].reshape(4, o)
                    np.testing.assert_array_equal(fused, plain, err_msg=what)
                    np.testing.assert_array_equal(stats_out[:2], stats_out[2:], err_msg=what)


def test_lenet_int8_convolutions_and_dense_layers(builds):
    """LeNet in int8: its two convolutions (dg::conv2d_int8: runtime/dg_int8_conv.h) and its
    three dense layers run in int8 (scales calibrated on the inputs by
    transforms.quantize.calibrate). Every int8 step is exact and its float32 steps are the
    reference's, but the pooling and the float32 ops between them may not be in the
    reference's order everywhere, so generated vs reference is allowed 1e-3 of a probability
    (seen 3e-8), every top-1 equal; and int8 is not float32: the same weights in fp32 differ."""
    from generator.reference.quantize import calibrate

    graph = load_example("lenet").build("lenet_int8")
    set_precision(graph, "int8")
    ops = [n.op for n in graph.nodes]
    assert ops.count("matmul_int8") == 3 and ops.count("conv2d_int8") == 2 and "conv2d" not in ops, ops
    module, project = builds.module(graph, flags=CHECK_BUILD_FLAGS)
    text = " ".join((project / "src_tree" / "src" / "model.cpp").read_text().split())
    assert text.count("dg::conv2d_int8(") == 2 and text.count("dg::matmul_int8(") == 3
    x = np.random.default_rng(3).uniform(size=(40, 1, 8, 8)).astype(np.float32)
    params = reference.init_params(graph, seed=0)
    params.update(calibrate(graph, [{"images": x}], params))
    model = module.Model(seed=0)
    buffers = model.buffers()
    for name in buffers:
        if name.endswith("scale"):
            buffers[name][...] = params[name]
    del buffers
    got = model.forward(images=x)["probs"]
    want = reference.run(graph, {"images": x}, params)["probs"]
    diff = float(np.abs(got - want).max())
    print(f"lenet int8: generated vs reference, largest probability difference {diff:.2e}")
    assert diff <= 1e-3
    assert float(np.mean(got.argmax(1) == want.argmax(1))) == 1.0
    exact = reference.run(load_example("lenet").build("lenet_fp32"), {"images": x}, params)["probs"]
    assert float(np.abs(exact - want).max()) > 10 * max(diff, 1e-7)


def test_conv2d_int8_equals_reference_bit_for_bit(builds):
    """dg::conv2d_int8's shapes, each against the reference bit for bit: channels that are
    not a multiple of 4 (the rows' zero tail), stride, padding, dilation (in width: taps
    that are not one run, window_row_runs; in height only) and a non-square kernel, 1x1
    convolutions (of stride 1: the channels-last copy is the rows when C is a multiple of 4;
    with AMX and C a multiple of 64, "p", the quantized positions are written straight into
    the tiles, the rows past the last position's zeroed, by two threads where there are
    two), rows of several images in one product (kInt8ConvScratchBytes: "d" takes 7 images
    of 576 rows of 432 bytes with their copy, then 1; 6 and 2 without the tiles) and of one
    image (few rows: the VNNI kernel where the tiles need 8), all in the workspace the
    generator reserves; the kept weights are packed tap-major (/*taps=*/KH*KW). With two
    threads, 8 and 5 images are shared out image by image (each thread its own products in
    its half of the workspace: 4 + 4, 3 + 2), 1 image step by step."""
    from generator.reference.quantize import calibrate

    @dg.model
    def convs_int8():
        x = dg.input("x", (N, 5, 9, 7))
        z = dg.input("z", (N, 48, 24, 24))
        s = dg.input("s", (N, 16, 2, 2))
        p = dg.input("p", (N, 128, 15, 17))
        return {"p": dg.conv2d_layer(p, 24, 1, name="p"),"a": dg.conv2d_layer(x, 6, 3, stride=2, padding=1, name="a"),
                "b": dg.conv2d_layer(x, 4, (3, 2), dilation=2, padding=(2, 1), name="b"),
                "c": dg.conv2d_layer(x, 3, 1, name="c"),
                "d": dg.conv2d_layer(z, 20, 3, padding=1, bias=False, name="d"),
                "e": dg.conv2d_layer(z, 8, 1, name="e"),
                "f": dg.conv2d_layer(z, 8, 1, stride=2, name="f"),
                "g": dg.conv2d_layer(s, 40, 3, padding=1, name="g"),
                "h": dg.conv2d_layer(x, 4, 3, dilation=(2, 1), padding=(1, 2), name="h")}

    graph = convs_int8.build("convs_int8")
    set_precision(graph, "int8")
    assert [n.op for n in graph.nodes].count("conv2d_int8") == 9
    module, project = builds.module(graph, flags=CHECK_BUILD_FLAGS)
    header = " ".join((project / "src_tree" / "include" / "convs_int8" / "model.h").read_text().split())
    assert '"a_weight_scale", /*tb=*/true, /*K=*/45, /*N=*/6, /*taps=*/9};' in header
    assert '"c_weight_scale", /*tb=*/true, /*K=*/5, /*N=*/3};' in header
    rng = np.random.default_rng(5)
    inputs = {"x": rng.standard_normal((8, 5, 9, 7)).astype(np.float32),
              "z": rng.standard_normal((8, 48, 24, 24)).astype(np.float32),
              "s": rng.standard_normal((8, 16, 2, 2)).astype(np.float32),
              "p": rng.standard_normal((8, 128, 15, 17)).astype(np.float32)}
    params = reference.init_params(graph, seed=0)
    params.update(calibrate(graph, [inputs], params))
    model = _model_with(module, params)
    for n in (8, 5, 1):
        batch = {k: v[:n] for k, v in inputs.items()}
        got, want = model.forward(**batch), reference.run(graph, batch, params)
        for k in "abcdefghp":
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"{k}, {n} images")
