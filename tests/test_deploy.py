"""Deploying a generated tree without Python: the C++ Model's save()/load() of numpy
.npz files (which the Python module's save/load now call), the example program
running trained weights on inputs from .npy files, the module's .pyi stub, and
inputs read without a copy from torch tensors and buffers."""

from __future__ import annotations

import ast
import io
import re
import subprocess
import zipfile

import numpy as np
import pytest

import generator as dg
from module_checks import assert_same_state, check_load_validates_everything_first, check_save_load, state_of

N = dg.dim("N")


def _deploy_mlp():
    x = dg.input("x", (N, 6))
    labels = dg.input("labels", (N,), dtype="int64")
    h = dg.dense(x, 8, act=dg.relu)
    logits = dg.dense(h, 3)
    loss = dg.softmax_cross_entropy(logits, labels)
    dg.train(loss, dg.adam(lr=0.01))  # Adam: optimizer state with two slots per parameter
    return {"logits": logits}


@pytest.fixture(scope="module")
def built(builds):
    graph = dg.model(_deploy_mlp).build("deploy_mlp")
    module, where = builds.module(graph)
    return graph, module, where


def _batch(n=5, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(n, 6)).astype(np.float32), "labels": rng.integers(0, 3, n).astype(np.int64)}


def _trained(module, steps=3):
    model = module.Model(seed=1)
    for i in range(steps):
        model.train_step(**_batch(seed=i))
    return model


def _example(where, *args):
    program = where / "build" / "deploy_mlp_example"
    return subprocess.run([str(program), *map(str, args)], capture_output=True, text=True, timeout=60)


def test_example_program_runs_weights_trained_in_python(built, tmp_path):
    _, module, where = built
    model = _trained(module)
    model.save(str(tmp_path / "trained.npz"))
    x = _batch(n=7, seed=9)["x"]
    np.save(tmp_path / "x.npy", x)
    proc = _example(where, "--weights", tmp_path / "trained.npz", "--input", f"x={tmp_path / 'x.npy'}",
                    "--output", tmp_path / "out.npz")
    assert proc.returncode == 0, proc.stderr
    assert "logits: shape [7, 3]" in proc.stdout
    got = np.load(tmp_path / "out.npz")
    assert list(got.files) == ["logits"] and got["logits"].dtype == np.float32
    np.testing.assert_allclose(got["logits"], model.forward(x=x)["logits"], rtol=0, atol=1e-6)
    # Without weights it runs the seed-0 model, as Model(seed=0) does.
    proc = _example(where, "--input", f"x={tmp_path / 'x.npy'}", "--output", tmp_path / "seed0.npz")
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_allclose(np.load(tmp_path / "seed0.npz")["logits"], module.Model(seed=0).forward(x=x)["logits"],
                               rtol=0, atol=1e-6)


def test_example_program_without_arguments_and_with_bad_ones(built, tmp_path):
    _, _, where = built
    proc = _example(where)
    assert proc.returncode == 0 and "logits: shape [" in proc.stdout and ", sum " in proc.stdout
    np.save(tmp_path / "f64.npy", np.zeros((2, 6)))
    np.save(tmp_path / "wide.npy", np.zeros((2, 7), np.float32))
    cases = {
        "dtype": (["--input", f"x={tmp_path / 'f64.npy'}"], 1, "input 'x' \\(.*f64.npy\\): has dtype float64, expected float32"),
        "shape": (["--input", f"x={tmp_path / 'wide.npy'}"], 1, "input 'x': dimension 1 must be 6"),
        "name": (["--input", f"y={tmp_path / 'wide.npy'}"], 1, "the model has no input 'y'"),
        "no file": (["--input", f"x={tmp_path / 'nope.npy'}"], 1, "cannot open .*nope.npy"),
        "no weights": (["--weights", tmp_path / "nope.npz"], 1, "no such file: .*nope.npz"),
        "flag": (["--bogus"], 2, "unknown argument '--bogus'"),
        "value": (["--weights"], 2, "--weights needs a value"),
        "form": (["--input", "x"], 2, "expected NAME=FILE.npy"),
    }
    for what, (args, code, message) in cases.items():
        proc = _example(where, *args)
        assert proc.returncode == code, (what, proc.stdout, proc.stderr)
        assert re.search(message, proc.stderr), (what, proc.stderr)


def test_save_writes_what_numpy_reads(built, tmp_path):
    _, module, _ = built
    model = _trained(module)
    model.save(str(tmp_path / "w"))  # ".npz" added, as numpy's savez adds it
    saved = np.load(tmp_path / "w.npz")
    want = {k: np.array(v) for k, v in model.parameters().items()}
    want.update({f"optimizer/{k}": np.array(v) for k, v in model.optimizer_state().items()})
    assert list(saved.files) == [*want, "optimizer/step"]
    for name, value in want.items():
        assert saved[name].dtype == np.float32
        np.testing.assert_array_equal(saved[name], value, err_msg=name)
    assert saved["optimizer/step"].dtype == np.int64 and saved["optimizer/step"].shape == () and saved["optimizer/step"] == 3
    model.save(str(tmp_path / "again.npz"))  # a fixed timestamp: the same state gives the same bytes
    assert (tmp_path / "again.npz").read_bytes() == (tmp_path / "w.npz").read_bytes()
    assert not list(tmp_path.glob("*.partial"))


def _zip(arrays, compression, level=None):
    """An .npz written by Python's zipfile (every DEFLATE block kind, as levels choose them)."""
    data = io.BytesIO()
    with zipfile.ZipFile(data, "w", compression, compresslevel=level) as archive:
        for name, value in arrays.items():
            image = io.BytesIO()
            np.lib.format.write_array(image, np.asanyarray(value), allow_pickle=False)
            archive.writestr(name + ".npy", image.getvalue())
    return data.getvalue()


def test_load_reads_numpy_compressed_files_and_other_layouts(built, tmp_path):
    _, module, _ = built
    model = _trained(module)
    model.save(str(tmp_path / "w.npz"))
    saved = dict(np.load(tmp_path / "w.npz"))
    x = _batch(seed=7)["x"]
    want = model.forward(x=x)["logits"]
    np.savez_compressed(tmp_path / "compressed.npz", **saved)  # dynamic Huffman blocks
    variants = {"savez_compressed": (tmp_path / "compressed.npz").read_bytes()}
    for level in (0, 1, 9):  # 0: stored blocks inside the deflate stream
        variants[f"zipfile level {level}"] = _zip(saved, zipfile.ZIP_DEFLATED, level)
    # Fortran order, big-endian and float64 arrays hold the same values.
    first, second = list(saved)[:2]
    variants["layouts"] = _zip(dict(saved, **{first: np.asfortranarray(saved[first]),
                                              second: saved[second].astype(">f8")}), zipfile.ZIP_STORED)
    assert np.isfortran(np.asfortranarray(saved[first]))
    for what, data in variants.items():
        (tmp_path / "v.npz").write_bytes(data)
        other = module.Model(seed=5)
        other.load(str(tmp_path / "v.npz"))
        assert other.step == 3, what
        np.testing.assert_array_equal(other.forward(x=x)["logits"], want, err_msg=what)
        for name, value in other.parameters().items():
            np.testing.assert_array_equal(value, saved[name], err_msg=f"{what}: {name}")


def test_bad_files_change_nothing(built, tmp_path):
    graph, module, _ = built
    _trained(module).save(str(tmp_path / "w.npz"))
    saved = dict(np.load(tmp_path / "w.npz"))
    good = (tmp_path / "w.npz").read_bytes()
    compressed = io.BytesIO()
    np.savez_compressed(compressed, **saved)
    compressed = compressed.getvalue()
    member = zipfile.ZipFile(io.BytesIO(compressed)).infolist()[0]
    flipped = bytearray(compressed)
    at = member.header_offset  # the local header: 30 bytes, the name, an extra field, then the data
    at += 30 + len(member.filename) + int.from_bytes(compressed[at + 28 : at + 30], "little")
    flipped[at + member.compress_size // 2] ^= 0x55
    first = next(iter(saved))
    cases = {
        "wrong shape": (dict(saved, **{first: np.zeros((2, 2), np.float32)}), f"parameter '{first}' has shape \\[2, 2\\]"),
        "missing": ({k: v for k, v in saved.items() if k != first}, f"missing parameter '{first}'"),
        "int dtype": (dict(saved, **{first: saved[first].astype(np.int32)}), "has dtype int32, expected a float array"),
        "text dtype": (dict(saved, **{first: np.array(["a"] * saved[first].size).reshape(saved[first].shape)}),
                       "has dtype <U1, expected a float array"),
        "truncated": (good[: len(good) // 2], "not an .npz archive \\(no zip directory"),
        "truncated member": (good[:200] + good[-300:], "not an .npz archive"),
        "corrupt deflate": (bytes(flipped), "not an .npz archive \\(member"),
        "empty": (b"", "not an .npz archive"),
    }
    model = module.Model(seed=4)
    model.train_step(**_batch())
    before = state_of(model)
    for what, (content, message) in cases.items():
        if isinstance(content, dict):
            np.savez(tmp_path / "bad.npz", **content)
        else:
            (tmp_path / "bad.npz").write_bytes(content)
        with pytest.raises(ValueError, match=message):
            model.load(str(tmp_path / "bad.npz"))
        assert_same_state(before, state_of(model))  # {what}
    # The checks every module's load() has always made still hold, messages included.
    check_save_load(graph, module, tmp_path)
    check_load_validates_everything_first(graph, module, tmp_path)


def test_stub_names_every_method_and_input(built):
    graph, module, where = built
    stub_path = where / "build" / "deploy_mlp.pyi"  # next to the built module, as CMake copies it
    assert stub_path.read_text() == (where / "src_tree" / "deploy_mlp.pyi").read_text()
    tree = ast.parse(stub_path.read_text())
    model = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Model")
    declared = {n.name for n in model.body if isinstance(n, ast.FunctionDef)}
    declared |= {n.target.id for n in model.body if isinstance(n, ast.AnnAssign)}
    public = {name for name in dir(module.Model) if not name.startswith("_")}
    assert public <= declared, f"missing from the stub: {sorted(public - declared)}"
    assert declared - {"__init__"} <= public, f"not in the module: {sorted(declared - public)}"
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert {name for name in dir(module) if callable(getattr(module, name)) and not name.startswith("_")} <= (
        functions | {"Model", "NonFiniteLossError"})
    methods = {n.name: n for n in model.body if isinstance(n, ast.FunctionDef)}
    forward_doc = ast.get_docstring(methods["forward"])
    for i in graph.inputs:
        assert i.name in [a.arg for a in methods["forward"].args.kwonlyargs]
        assert i.name in [a.arg for a in methods["train_step"].args.kwonlyargs]
    assert "x: float32 [N, 6]" in forward_doc and "labels: int64 [N]" in forward_doc
    assert "logits: float32 [N, 3]" in forward_doc


def test_inputs_from_buffers_without_copies(built):
    _, module, _ = built
    model = _trained(module)
    x = _batch(seed=3)["x"]
    want = model.forward(x=x)["logits"]
    view = memoryview(bytearray(x.tobytes())).cast("f", shape=list(x.shape))  # a buffer, not a numpy array
    np.testing.assert_array_equal(model.forward(x=view)["logits"], want)
    # The checks see the caller's memory itself: a copy would be aligned, the buffer is not.
    raw = memoryview(bytearray(x.nbytes + 1))[1:]
    raw[:] = x.tobytes()
    with pytest.raises(ValueError, match="input 'x': the array's data is not aligned"):
        model.forward(x=raw.cast("f", shape=list(x.shape)))
    with pytest.raises(ValueError, match="input 'x': expected dtype float32, got uint8"):
        model.forward(x=memoryview(bytearray(x.tobytes())))
    with pytest.raises(ValueError, match="expected a numpy array"):
        model.forward(x=x.tolist())


def test_inputs_from_torch_tensors(built):
    torch = pytest.importorskip("torch")
    _, module, _ = built
    model = module.Model(seed=2)
    batch = _batch(seed=4)
    x = torch.from_numpy(batch["x"].copy())
    np.testing.assert_array_equal(model.forward(x=x)["logits"], model.forward(x=batch["x"])["logits"])
    wide = torch.from_numpy(np.repeat(batch["x"], 2, axis=1))
    cases = {
        "not contiguous": (wide[:, ::2], "must be C-contiguous"),
        "float64": (x.double(), "expected dtype float32, got float64"),
        "requires grad": (x.clone().requires_grad_(), "cannot read this Tensor as an array"),
    }
    for what, (value, message) in cases.items():
        with pytest.raises(ValueError, match=f"input 'x': .*{message}"):
            model.forward(x=value)
    loss = model.train_step(x=x, labels=torch.from_numpy(batch["labels"]))
    assert np.isfinite(loss) and model.step == 1
