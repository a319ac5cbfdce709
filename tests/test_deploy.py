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


def test_example_program_takes_values_and_prints_outputs(built, tmp_path):
    """--values NAME=V,V,...: an input on the command line, the batch fitted to the count;
    --print NAME: an output's values, a line per example (printed with %.6g)."""
    _, module, where = built
    model = _trained(module)
    model.save(str(tmp_path / "trained.npz"))
    x = np.round(_batch(n=3, seed=4)["x"], 2)
    text = ",".join(f"{v:g}" for v in x.reshape(-1))
    proc = _example(where, "--weights", tmp_path / "trained.npz", "--values", f"x={text}", "--print", "logits")
    assert proc.returncode == 0, proc.stderr
    assert "logits: shape [3, 3]" in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.startswith("logits[")]
    assert [r.split(":")[0] for r in rows] == ["logits[0]", "logits[1]", "logits[2]"]
    got = np.array([[float(v) for v in r.split(":")[1].split()] for r in rows])
    np.testing.assert_allclose(got, model.forward(x=x)["logits"], rtol=1e-5, atol=1e-5)
    cases = {
        "count": (["--values", "x=1,2,3"], 1, "--values x: 3 values, expected a multiple of 6"),
        "number": (["--values", "x=1,2,z,4,5,6"], 1, "--values x: 'z' is not a number"),
        "empty": (["--values", "x=1,,3,4,5,6"], 1, "--values x: '' is not a number"),
        "input": (["--values", "y=1"], 1, "--values y: the model has no input 'y' \\(its inputs: x\\)"),
        "output": (["--print", "probs"], 1, "--print probs: the model has no output 'probs' \\(its outputs: logits\\)"),
        "form": (["--values", "x"], 2, "expected NAME=V,V,..."),
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


# -- weights and input files: regular files only, read no further than their headers say --


def _image(array) -> bytes:
    """`array` as an .npy file's bytes."""
    out = io.BytesIO()
    np.lib.format.write_array(out, np.asanyarray(array), allow_pickle=False)
    return out.getvalue()


def _with_header(image: bytes, old: str, new: str) -> bytes:
    """`image` with `old` replaced by `new` in its .npy header, the header's padding
    adjusted so that its length (and so the data's place) stays as it was."""
    length = int.from_bytes(image[8:10], "little")
    header = image[10 : 10 + length].decode("latin1")
    assert old in header, (old, header)
    changed = header.replace(old, new).rstrip("\n")
    changed = changed[: length - 1].ljust(length - 1) + "\n"  # padding spaces taken or given
    assert len(changed) == length and changed.rstrip().endswith("}"), changed
    return image[:10] + changed.encode("latin1") + image[10 + length :]


def _zip_members(members: dict, compression=zipfile.ZIP_STORED, level=None) -> bytes:
    """An .npz archive holding each name's bytes as the member `name.npy`."""
    data = io.BytesIO()
    with zipfile.ZipFile(data, "w", compression, compresslevel=level) as archive:
        for name, image in members.items():
            archive.writestr(name + ".npy", image)
    return data.getvalue()


def _run_python(where, code: str, *args, timeout=60, memory_bytes=4 << 30):
    """`code` in a child Python that imports the built module, its address space
    bounded (a runaway read is a MemoryError, not the machine's memory)."""
    import os
    import resource
    import sys

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))

    env = dict(os.environ, PYTHONPATH=str(where / "build"))
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, preexec_fn=limit)


@pytest.mark.parametrize("entry", ["load", "--weights", "--input"])
def test_weights_and_inputs_only_from_regular_files(built, tmp_path, entry):
    """A FIFO (which blocked load() and --weights until a writer came) and /dev/zero
    (read until memory ran out) are refused before they are opened, naming the file."""
    import os

    _, _, where = built
    fifo = tmp_path / "fifo.npz"
    os.mkfifo(fifo)
    load = "import sys, deploy_mlp\ntry:\n    deploy_mlp.Model().load(sys.argv[1])\nexcept OSError as e:\n    print(e)"
    for path, kind in ((fifo, "a FIFO"), ("/dev/zero", "a character device")):
        if entry == "load":
            proc = _run_python(where, load, path, timeout=30)
            said, code = proc.stdout, 0
        else:
            proc = _example(where, entry, path if entry == "--weights" else f"x={path}")  # 60 s timeout: a hang fails
            said, code = proc.stderr, 1
        assert proc.returncode == code and f"{path}: is {kind}, not a regular file" in said, (proc.stdout, proc.stderr)
    assert sorted(os.listdir(tmp_path)) == ["fifo.npz"]


def test_compressed_member_is_inflated_no_further_than_its_shape_needs(built, tmp_path):
    """A member whose stream inflates to far more than its header's shape needs (64 MiB
    of zeros after the data; it used to load, after inflating all of it) is refused
    before its data is inflated, naming the file and the array."""
    import time

    _, module, _ = built
    _trained(module).save(str(tmp_path / "w.npz"))
    saved = dict(np.load(tmp_path / "w.npz"))
    first = next(iter(saved))
    members = {k: _image(v) for k, v in saved.items()}
    members[first] += bytes(64 << 20)
    (tmp_path / "bomb.npz").write_bytes(_zip_members(members, zipfile.ZIP_DEFLATED, level=1))
    assert (tmp_path / "bomb.npz").stat().st_size < 1 << 20
    model = module.Model(seed=4)
    before = state_of(model)
    start = time.monotonic()
    data_bytes = saved[first].nbytes
    with pytest.raises(ValueError, match=re.escape(f"bomb.npz: array '{first}': {64 << 20} bytes after the "
                                                   f"{data_bytes} bytes of data its shape")):
        model.load(str(tmp_path / "bomb.npz"))
    assert time.monotonic() - start < 1.0  # nothing inflated but the headers
    assert_same_state(before, state_of(model))


def _zip64_member(name: str, stream: bytes, size: int, crc: int = 0) -> bytes:
    """A zip archive of one deflated member whose zip64 sizes say it inflates to `size`."""
    import struct

    file_name = (name + ".npy").encode()
    extra = struct.pack("<HHQQ", 1, 16, size, len(stream))  # zip64: size, compressed size
    local = struct.pack("<IHHHHHIIIHH", 0x04034B50, 45, 0, 8, 0, 0x21, crc, 0xFFFFFFFF, 0xFFFFFFFF,
                        len(file_name), len(extra)) + file_name + extra
    central = struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45, 0, 8, 0, 0x21, crc, 0xFFFFFFFF, 0xFFFFFFFF,
                          len(file_name), len(extra), 0, 0, 0, 0, 0) + file_name + extra
    directory_at = len(local) + len(stream)
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 1, 1, len(central), directory_at, 0)
    return local + stream + central + end


def test_huge_zip64_member_is_refused_by_its_header(built, tmp_path):
    """A 6 GiB zip64 member (its header's shape [1610612736] float32, a few bytes of
    stream) is refused by its shape, before anything is allocated for it (it was a
    bare std::bad_alloc, or a corrupt-stream error naming no array)."""
    import zlib

    _, module, _ = built
    first = next(iter(module.Model().parameters()))
    count = 6 << 30 >> 2
    header = _with_header(_image(np.zeros(0, np.float32)), "(0,)", f"({count},)")
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    stream = compressor.compress(header + bytes(1 << 16)) + compressor.flush()
    (tmp_path / "huge.npz").write_bytes(_zip64_member(first, stream, len(header) + (6 << 30)))
    shape = list(module.Model().parameters()[first].shape)
    with pytest.raises(ValueError, match=re.escape(f"huge.npz: parameter '{first}' has shape [{count}], "
                                                   f"expected {shape}")):
        module.Model().load(str(tmp_path / "huge.npz"))


@pytest.mark.parametrize("case", ["negative", "descr", "after", "key", "minor"])
def test_npy_headers_are_parsed_strictly(built, tmp_path, case):
    """Negative sizes (read as positive ones before), junk after the dtype ('<f4xyz'
    was read as '<f4'), bytes after the data, unknown keys and a format version's minor
    number (ignored before) are refused: in a weights file naming the file and array, in an input file naming
    the input."""
    _, module, where = built
    _trained(module).save(str(tmp_path / "w.npz"))
    saved = dict(np.load(tmp_path / "w.npz"))
    first = next(iter(saved))

    def broken(array):
        image, shape = _image(array), str(tuple(array.shape))
        negative = shape.replace("(", "(-", 1)
        return {
            "negative": (_with_header(image, shape, negative), f"malformed .npy header ('shape' {negative} has a negative size)"),
            "descr": (_with_header(image, "'<f4'", "'<f4xyz'"), "malformed .npy header ('descr' '<f4xyz' is not a dtype)"),
            "after": (image + bytes(4), f"4 bytes after the {array.nbytes} bytes of data its shape {list(array.shape)} needs"),
            "key": (_with_header(image, "'fortran_order'", "'fortran_order': False, 'extra'"),
                    "malformed .npy header (unknown key 'extra')"),
            "minor": (image[:7] + b"\x01" + image[8:], ".npy format version 1.1 is not supported"),
        }[case]

    model = module.Model(seed=4)
    before = state_of(model)
    members = {k: _image(v) for k, v in saved.items()}
    members[first], message = broken(saved[first])
    (tmp_path / "bad.npz").write_bytes(_zip_members(members))
    with pytest.raises(ValueError, match=re.escape(f"bad.npz: array '{first}': {message}")):
        model.load(str(tmp_path / "bad.npz"))
    assert_same_state(before, state_of(model))
    image, message = broken(_batch(n=2)["x"])
    (tmp_path / "x.npy").write_bytes(image)
    proc = _example(where, "--input", f"x={tmp_path / 'x.npy'}")
    assert proc.returncode == 1, proc.stdout
    assert f"input 'x': {tmp_path / 'x.npy'}: {message}" in proc.stderr, proc.stderr


SAVE_PATHS = {
    "": (ValueError, "the path is empty"),
    "/dev/full": (OSError, "/dev/full: is a character device, not a regular file"),
    "fifo": (OSError, "fifo: is a FIFO, not a regular file"),
    "folder": (OSError, "folder: is a folder, not a regular file"),
    "folder/": (OSError, "folder/: names a folder, not a file"),
    "missing/": (OSError, "missing/: names a folder, not a file"),
    "w\0.npz": (ValueError, "the path holds a NUL byte"),
}


def _fifo_and_folder(tmp_path, monkeypatch):
    import os

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "folder").mkdir()
    monkeypatch.chdir(tmp_path)


def _nothing_written(tmp_path):
    import os

    stray = os.path.exists("/dev/full.npz")
    if stray:  # written by the code before the fix (as root): not ours to leave
        os.remove("/dev/full.npz")
    assert not stray, "/dev/full.npz written"
    assert sorted(os.listdir(tmp_path)) == ["fifo", "folder"] and os.listdir(tmp_path / "folder") == []


@pytest.mark.parametrize("path", SAVE_PATHS)
def test_save_refuses_paths_it_cannot_write_a_file_at(built, tmp_path, monkeypatch, path):
    """save("") wrote ./.npz, save("/dev/full") /dev/full.npz, save(folder) folder.npz:
    each is an error naming the path now (load() of it too), and nothing is written."""
    _, module, _ = built
    model = _trained(module)
    _fifo_and_folder(tmp_path, monkeypatch)
    error, message = SAVE_PATHS[path]
    try:
        with pytest.raises(error, match=re.escape(message)):
            model.save(path)
        with pytest.raises((ValueError, OSError)):
            module.Model().load(path)
    finally:
        _nothing_written(tmp_path)


def test_example_output_refuses_a_folder_fifo_or_device(built, tmp_path, monkeypatch):
    """--output of a folder ("cannot write folder/: Not a directory") or a FIFO (replaced
    by a file) is an error naming it, and nothing is written."""
    _, _, where = built
    _fifo_and_folder(tmp_path, monkeypatch)
    try:
        for target in ("folder", "folder/", "fifo", "/dev/full", ""):
            proc = _example(where, "--output", target)
            assert proc.returncode == (1 if target else 2), (target, proc.stdout)  # 2: a bad argument
            assert SAVE_PATHS[target][1] in proc.stderr, (target, proc.stderr)
    finally:
        _nothing_written(tmp_path)


def test_save_and_load_take_path_like_objects(built, tmp_path):
    import pathlib

    _, module, _ = built
    model = _trained(module)
    model.save(tmp_path / "p.npz")
    model.save(pathlib.PurePosixPath(tmp_path / "q"))  # ".npz" added
    model.save(bytes(tmp_path / "b.npz"))
    for path in (tmp_path / "p.npz", tmp_path / "q", bytes(tmp_path / "b.npz")):
        other = module.Model(seed=9)
        other.load(path)
        assert_same_state(state_of(model), state_of(other))
    with pytest.raises(TypeError, match="os.PathLike"):
        model.save(3)


def test_parameters_only_file_resets_optimizer_state_with_a_warning(built, tmp_path):
    """A file without optimizer state (np.savez of the parameters) loaded into a trained
    model resets its optimizer state and step, as a new Model's, and warns that it did;
    into a model with no state to lose, silently."""
    import warnings

    _, module, _ = built
    model = _trained(module)
    np.savez(tmp_path / "params.npz", **{k: np.array(v) for k, v in model.parameters().items()})
    with pytest.warns(UserWarning, match=re.escape(f"{tmp_path / 'params.npz'} holds no optimizer state: the model's "
                                                   "optimizer state and step were reset")):
        model.load(str(tmp_path / "params.npz"))
    assert model.step == 0
    assert all(not np.any(v) for v in model.optimizer_state().values())
    fresh = module.Model(seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.load(str(tmp_path / "params.npz"))  # nothing to lose: no warning
        model.load(str(tmp_path / "params.npz"))  # reset already: nothing more to lose
    assert_same_state(state_of(model), state_of(fresh))
