"""Fuzzing the runtime's .npy/.npz reader (dg_npz.h, dg_inflate.h, dg_weights.h):
the pieces tests/test_fuzz.py puts together.

- `build_reader` compiles tests/npz_fuzz_driver.cpp with AddressSanitizer and
  UndefinedBehaviorSanitizer (cached like the other builds);
- `Reader` talks to it (one request per line; a crash, a sanitizer report or a hang
  is a `Finding` naming the request);
- the strategies make files: numpy's own .npy images and .npz archives (np.savez,
  np.savez_compressed, zipfile at every level, zip64), then mutate them: random
  bytes, truncations, flipped bytes, junk appended, lying .npy headers (sizes,
  dtypes, keys, header lengths) and lying zip fields (sizes, offsets, methods,
  counts), with the CRC made right again where a lie would otherwise stop at it;
- `check_*` hold the reader to its contract: an answer is either the arrays numpy
  reads from the same file (names, dtypes, shapes, bytes) or an error of an allowed
  kind whose message names the file. Unmutated files must be read.
"""

from __future__ import annotations

import hashlib
import io
import os
import select
import shutil
import subprocess
import tempfile
import zipfile
import zlib
from pathlib import Path

import numpy as np

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
RUNTIME = ROOT / "targets" / "cpu" / "runtime"
DRIVER = TESTS / "npz_fuzz_driver.cpp"
HEADERS = ["dg_npz.h", "dg_inflate.h", "dg_weights.h", "dg_tensor.h"]
ALLOWED_ERRORS = {"invalid_argument", "file_error", "out_of_memory"}
# Under ASan any allocation over this aborts (a finding): the files are a few KB, and
# nothing in them may make the reader allocate more.
ASAN_OPTIONS = "detect_leaks=1:max_allocation_size_mb=64:abort_on_error=0:strict_string_checks=1"
UBSAN_OPTIONS = "print_stacktrace=1:halt_on_error=1"
REQUEST_TIMEOUT_S = 20


class Finding(AssertionError):
    pass


# -- the driver ---------------------------------------------------------------------


def build_reader(cache_root: Path, cxx: str, flags: str) -> Path:
    """The compiled driver (cached by its sources, flags and compiler)."""
    digest = hashlib.sha256(flags.encode())
    digest.update(subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.encode())
    for source in [DRIVER, *(RUNTIME / h for h in HEADERS)]:
        digest.update(source.read_bytes())
    cached = cache_root / f"npz_fuzz_driver-{digest.hexdigest()[:16]}"
    if cached.is_file():
        return cached
    cache_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_root) as tmp:
        exe = Path(tmp) / "driver"
        cmd = [cxx, "-std=c++17", "-O1", "-g1", *flags.split(), "-I", str(RUNTIME), str(DRIVER), "-o", str(exe)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"compile failed:\n{' '.join(cmd)}\n{proc.stderr}")
        os.replace(exe, cached)
    return cached


def _hex(data) -> str:
    data = data.encode() if isinstance(data, str) else bytes(data)
    return data.hex() or "-"


def _unhex(text: str) -> bytes:
    return b"" if text == "-" else bytes.fromhex(text)


class Reader:
    """The driver process: `ask(request, path, *fields)` returns its answer split in
    words. A dead or silent driver is a Finding (naming the request and showing its
    stderr); the next request starts a new one."""

    def __init__(self, exe: Path, tmp: Path):
        self.exe, self.tmp, self.proc = exe, tmp, None
        self.env = dict(os.environ, ASAN_OPTIONS=ASAN_OPTIONS, UBSAN_OPTIONS=UBSAN_OPTIONS)

    def _start(self):
        self.stderr = open(self.tmp / "driver.stderr", "w+b")
        self.proc = subprocess.Popen([str(self.exe)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, env=self.env)
        self.pending = b""

    def close(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.stderr.close()
            self.proc = None

    def _died(self, how: str, line: str):
        self.proc.kill()
        self.proc.wait()
        self.stderr.seek(0)
        tail = self.stderr.read()[-6000:].decode(errors="replace")
        code = self.proc.returncode
        self.stderr.close()
        self.proc = None
        raise Finding(f"the reader {how} (exit status {code}) on the request {line!r}\n{tail}")

    def ask(self, *fields) -> list:
        if self.proc is None:
            self._start()
        line = " ".join(_hex(f) if isinstance(f, (bytes, bytearray)) else f for f in fields)
        try:
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            self._died("died", line)
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            ready, _, _ = select.select([fd], [], [], REQUEST_TIMEOUT_S)
            if not ready:
                self._died(f"gave no answer in {REQUEST_TIMEOUT_S} s (a hang)", line)
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self._died("died", line)
            self.pending += chunk
        answer, self.pending = self.pending.split(b"\n", 1)
        return answer.decode().split()


# -- the oracle ---------------------------------------------------------------------


def _numpy_bytes(a: np.ndarray) -> int:
    """CRC-32 of an array's bytes as the reader keeps them: C order, little-endian."""
    a = np.ascontiguousarray(a)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return zlib.crc32(a.tobytes())


def _parse(answer: list, path: Path, request: str, expect, stats: dict):
    """The arrays of an `ok` answer as [(name, dtype, shape, crc)], or None for an
    allowed error (a Finding for any other answer)."""
    if answer[0] == "error":
        kind, message = answer[1], _unhex(answer[2]).decode(errors="replace")
        if kind not in ALLOWED_ERRORS:
            raise Finding(f"{request} {path}: a {kind} exception: {message}")
        if str(path) not in message:
            raise Finding(f"{request} {path}: the error does not name the file: {message}")
        if expect == "read":
            raise Finding(f"{request} {path}: numpy's own file was refused: {message}")
        why = message.replace(str(path), "FILE")
        stats[f"{request} {kind}: {why[:60]}"] = stats.get(f"{request} {kind}: {why[:60]}", 0) + 1
        return None
    if answer[0] != "ok":
        raise Finding(f"{request} {path}: an answer out of protocol: {answer}")
    if expect == "refuse":
        raise Finding(f"{request} {path}: read, though an array in it holds bytes after its data: {answer}")
    stats[f"{request} ok"] = stats.get(f"{request} ok", 0) + 1
    arrays = []
    for item in answer[1:]:
        name, dtype, shape, crc = item.split("/")
        shape_text = _unhex(shape).decode()
        arrays.append((_unhex(name), _unhex(dtype).decode(errors="replace"),
                       tuple(int(s) for s in shape_text.split(",")) if shape_text else (), int(crc)))
    return arrays


NUMERIC = {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32",
           "float64"}


def _same(ours, theirs: np.ndarray, where: str):
    name, dtype, shape, crc = ours
    if dtype not in NUMERIC:  # named, not read: whoever asks for numbers refuses it
        return
    if (dtype, shape) != (theirs.dtype.name, theirs.shape) or crc != _numpy_bytes(theirs):
        raise Finding(f"{where}: read as {dtype} {shape} (crc {crc}), numpy reads {theirs.dtype.name} "
                      f"{theirs.shape} (crc {_numpy_bytes(theirs)})")


def check_npy(reader: Reader, path: Path, expect, stats: dict):
    arrays = _parse(reader.ask("npy", str(path).encode()), path, "npy", expect, stats)
    if arrays is None:
        return
    try:
        theirs = np.load(path, allow_pickle=False)
    except Exception as e:  # noqa: BLE001  (any refusal by numpy of a file we read is a finding)
        if arrays[0][1] not in NUMERIC:
            return
        raise Finding(f"npy {path}: read as {arrays[0][1:3]}, but numpy refuses it: {e!r}") from None
    _same(arrays[0], theirs, f"npy {path}")


def _numpy_npz(path: Path, arrays: list):
    """numpy's values of the arrays we read as numbers, by numpy's names; None where
    zipfile refuses the archive's structure (stricter than ours, e.g. a local header's
    name that differs from the directory's: nothing a reader needs)."""
    try:
        with np.load(path, allow_pickle=False) as f:
            files = list(f.files)
            if len(files) != len(arrays):
                raise Finding(f"npz {path}: read {len(arrays)} arrays, numpy finds {files}")
            theirs = {}
            for (ours, dtype, _, _), name in zip(arrays, files):
                if ours not in (name.encode("utf-8", "surrogateescape"), name.encode("cp437", "replace")):
                    raise Finding(f"npz {path}: an array read as {ours!r}, numpy's name is {name!r}")
                if dtype in NUMERIC:
                    theirs[name] = f[name]
            return theirs
    except zipfile.BadZipFile:
        return None


def check_npz(reader: Reader, path: Path, expect, stats: dict):
    arrays = _parse(reader.ask("npz", str(path).encode()), path, "npz", expect, stats)
    if arrays is None:
        return
    try:
        theirs = _numpy_npz(path, arrays)
    except Finding:
        raise
    except Exception as e:  # noqa: BLE001  (numpy refuses an array we read as numbers)
        raise Finding(f"npz {path}: read as {[a[:3] for a in arrays]}, but numpy refuses it: {e!r}") from None
    if theirs is None:
        stats["npz ok, zipfile refuses"] = stats.get("npz ok, zipfile refuses", 0) + 1
        return
    for ours, name in zip((a for a in arrays if a[1] in NUMERIC), theirs):
        _same(ours, theirs[name], f"npz {path}: array {name!r}")


def check_weights(reader: Reader, path: Path, expected: dict, expect, stats: dict):
    """dg::stage_weights for a model whose parameters are `expected` (name -> shape)."""
    fields = ["weights", str(path).encode()]
    for name, shape in expected.items():
        fields += [name.encode(), ",".join(map(str, shape)).encode()]
    arrays = _parse(reader.ask(*fields), path, "weights", expect, stats)
    if arrays is None:
        return
    try:
        with np.load(path, allow_pickle=False) as f:
            theirs = {n: f[n] for n in f.files}
    except zipfile.BadZipFile:
        return
    except Exception as e:  # noqa: BLE001
        raise Finding(f"weights {path}: loaded, but numpy refuses the file: {e!r}") from None
    if sorted(theirs) != sorted(expected):
        raise Finding(f"weights {path}: loaded, but numpy finds the arrays {sorted(theirs)}")
    for name, dtype, shape, crc in arrays:
        want = theirs[name.decode()].astype(np.float32)
        if shape != want.shape or crc != _numpy_bytes(want):
            raise Finding(f"weights {path}: parameter {name!r} loaded other values than numpy reads")


# -- the files ------------------------------------------------------------------------

DTYPES = ["<f4", ">f4", "<f2", "<f8", ">f8", "|i1", "<i2", ">i4", "<i8", "|u1", ">u2", "<u4", "<u8", "|b1",
          "<U2", "<c8"]
FLOATS = ["<f4", ">f4", "<f2", "<f8"]
NAME_CHARS = "abcxyz_019/."


def arrays(st, dtypes=DTYPES, finite=False):
    """A small numpy array of one of `dtypes` (values from random bytes, or finite
    float32 values), C or Fortran order."""

    @st.composite
    def build(draw):
        dtype = np.dtype(draw(st.sampled_from(dtypes), label="dtype"))
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3), label="shape"))
        count = int(np.prod(shape))
        if finite:
            values = draw(st.lists(st.floats(-1e4, 1e4, width=16), min_size=count, max_size=count))
            a = np.array(values, np.float32).astype(dtype).reshape(shape)
        else:
            raw = draw(st.binary(min_size=count * dtype.itemsize, max_size=count * dtype.itemsize))
            a = np.frombuffer(raw, dtype).reshape(shape).copy()
        return np.asfortranarray(a) if draw(st.booleans(), label="fortran") else a

    return build()


def npy_image(a: np.ndarray, version) -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array(out, a, version=version, allow_pickle=False)
    return out.getvalue()


def _lying_header(draw, st, image: bytes) -> tuple:
    """(`image` with its .npy header rewritten (sizes, dtype, keys, layout or length),
    False), or (`image` with bytes after its data, True for a numeric array: it must be
    refused)."""
    import ast

    major = image[6]
    prefix = 10 if major == 1 else 12
    length = int.from_bytes(image[8:prefix], "little")
    data = image[prefix + length :]
    true = ast.literal_eval(image[prefix : prefix + length].decode("latin1"))
    if draw(st.integers(0, 5), label="bytes after the data?") == 0:
        tail = draw(st.sampled_from([1, 3, 8, 4096, 100_000]), label="bytes after the data")
        numeric = np.dtype(true["descr"]).kind in "biuf"  # other data is named, never read
        return image + bytes(tail), numeric
    size = st.one_of(st.integers(-3, 70), st.integers(-(2**63), 2**64 + 5), st.sampled_from([2**31, 2**62, 10**18]))
    negated = [list(true["shape"])]
    if true["shape"]:
        at = draw(st.integers(0, len(true["shape"]) - 1), label="size negated")
        negated[0][at] = -negated[0][at]
    shape = draw(st.one_of(st.lists(size, max_size=4), st.sampled_from(negated)), label="lying shape")
    shape_text = draw(st.sampled_from([str(tuple(shape)), str(list(shape)), "(" + " ".join(map(str, shape)) + ")",
                                       str(tuple(shape)).replace(",)", ")"), "'(2,)'", "(2, x)", "()"]), label="shape text")
    descr = draw(st.one_of(st.sampled_from([true["descr"] + junk for junk in ("x", "xyz", " ", "0", "[s]")]),
                           st.sampled_from(DTYPES + ["<f4xyz", "<f", "f4", "<f99", "<q8", "", "<f4 ", "|O", "<M8[ns]",
                                                     "[('a', '<f4')]"]),
                           st.text(alphabet="<>|=fiubUc0123456789x[]", max_size=6)), label="descr")
    descr_text = descr if descr.startswith("[") else repr(descr)
    fortran = draw(st.sampled_from([str(true["fortran_order"]), "False", "True", "0", "None", "'False'"]),
                   label="fortran")
    entries = [f"'descr': {descr_text}", f"'fortran_order': {fortran}", f"'shape': {shape_text}"]
    change = draw(st.sampled_from(["none", "drop", "repeat", "extra", "shuffle", "junk after", "no newline",
                                   "length"]), label="key change")
    if change == "drop":
        entries.pop(draw(st.integers(0, 2)))
    elif change == "repeat":
        entries.append(entries[draw(st.integers(0, 2))])
    elif change == "extra":
        entries.append("'extra': 1")
    elif change == "shuffle":
        entries = draw(st.permutations(entries))
    text = "{" + ", ".join(entries) + ", }"
    if change == "junk after":
        text += draw(st.sampled_from(["x", "}", "\0", "{'a': 1}"]))
    pad = (-(prefix + len(text) + 1)) % 64
    header = (text + " " * pad + ("" if change == "no newline" else "\n")).encode("latin1", "replace")
    length_field = len(header)
    if change == "length":
        length_field = draw(st.integers(0, 2 ** (16 if major == 1 else 32) - 1), label="header length")
    return image[:8] + length_field.to_bytes(prefix - 8, "little") + header + data, False


def mutate(draw, st, data: bytes, lie=None, expect="read") -> tuple:
    """(bytes, what the reader must do with them: "read", "refuse" or None for either):
    `data` as it is (`expect`), or truncated, flipped, extended, replaced by random
    bytes, or with what `lie(draw, data)` makes of it (it says whether that must be
    refused)."""
    kinds = ["none", "truncate", "flip", "append", "random"] + (["lie", "lie"] if lie else [])
    kind = draw(st.sampled_from(kinds), label="mutation")
    if kind == "none":
        return data, expect
    if kind == "truncate":
        return data[: draw(st.integers(0, max(len(data) - 1, 0)), label="truncate at")], None
    if kind == "flip":
        out = bytearray(data)
        for at, bits in draw(st.lists(st.tuples(st.integers(0, max(len(out) - 1, 0)), st.integers(1, 255)),
                                      min_size=1, max_size=4), label="flips"):
            if out:
                out[at] ^= bits
        return bytes(out), None
    if kind == "append":
        return data + draw(st.binary(min_size=1, max_size=32), label="appended"), None
    if kind == "random":
        start = draw(st.sampled_from([b"", b"\x93NUMPY", b"\x93NUMPY\x01\x00", b"PK\x03\x04"]), label="random start")
        return start + draw(st.binary(max_size=300), label="random bytes"), None
    data, refuse = lie(draw, data)
    return data, "refuse" if refuse else None


def npy_lie(st):
    """A lie in an .npy image: (bytes, whether they must be refused)."""
    return lambda draw, image: _lying_header(draw, st, image)


def _write_zip(members: dict, how: str) -> bytes:
    """An archive of .npy images (name -> bytes) as zipfile writes it for `how`."""
    out = io.BytesIO()
    compression, level, zip64 = {"stored": (zipfile.ZIP_STORED, None, False),
                                 "deflate0": (zipfile.ZIP_DEFLATED, 0, False),
                                 "deflate1": (zipfile.ZIP_DEFLATED, 1, False),
                                 "deflate9": (zipfile.ZIP_DEFLATED, 9, False),
                                 "zip64": (zipfile.ZIP_DEFLATED, 6, True)}[how]
    with zipfile.ZipFile(out, "w", compression, compresslevel=level) as archive:
        for name, image in members.items():
            info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = compression
            with archive.open(info, "w", force_zip64=zip64) as member:
                member.write(image)
    return out.getvalue()


WRITERS = ["savez", "savez_compressed", "stored", "deflate0", "deflate1", "deflate9", "zip64"]


def npz_archive(draw, st, arrays_of: dict, how: str, member_lie=None) -> tuple:
    """(an archive of `arrays_of` (name -> array) as `how` writes it, what the reader
    must do with it): with `member_lie` one member's .npy image is a lying one (its
    CRC right: the lie reaches the parser)."""
    if how in ("savez", "savez_compressed") and member_lie is None:
        out = io.BytesIO()
        (np.savez if how == "savez" else np.savez_compressed)(out, **arrays_of)
        return out.getvalue(), "read"
    images = {name: npy_image(a, None) for name, a in arrays_of.items()}
    expect = "read"
    if member_lie is not None:
        name = draw(st.sampled_from(sorted(images)), label="lying member")
        images[name], refuse = member_lie(draw, images[name])
        expect = "refuse" if refuse else None
    return _write_zip(images, how if how not in ("savez", "savez_compressed") else "deflate1"), expect


def zip_lie(st):
    """A lie in a zip field: a member's sizes, offset, method, CRC or name length in the
    directory or its local header, or the directory's count, size or place."""

    def lie(draw, data: bytes) -> bytes:
        out = bytearray(data)
        spots = []
        at = 0
        while True:
            at = out.find(b"PK", at)
            if at < 0:
                break
            signature = bytes(out[at : at + 4])
            if signature == b"PK\x01\x02":  # directory entry: crc 16, sizes 20/24, name length 28, offset 42
                spots += [(at + 10, 2), (at + 16, 4), (at + 20, 4), (at + 24, 4), (at + 28, 2), (at + 30, 2), (at + 42, 4)]
            elif signature == b"PK\x03\x04":  # local header: method 8, sizes 18/22, name/extra lengths 26/28
                spots += [(at + 8, 2), (at + 18, 4), (at + 22, 4), (at + 26, 2), (at + 28, 2)]
            elif signature == b"PK\x05\x06":  # end: counts 8/10, directory size 12, place 16
                spots += [(at + 8, 2), (at + 10, 2), (at + 12, 4), (at + 16, 4)]
            elif signature == b"PK\x06\x06":  # zip64 end: count 32, size 40, place 48
                spots += [(at + 32, 8), (at + 40, 8), (at + 48, 8)]
            elif signature == b"PK\x06\x07":  # zip64 locator: where the zip64 end is
                spots += [(at + 8, 8)]
            at += 2
        # zip64 extra fields (id 1): the 8-byte sizes and offset in them
        at = 0
        while True:
            at = out.find(b"\x01\x00", at)
            if at < 0:
                break
            spots += [(at + 4, 8), (at + 12, 8)]
            at += 2
        spots = [(s, n) for s, n in spots if s + n <= len(out)]
        if not spots:
            return bytes(out), False
        spot, width = draw(st.sampled_from(spots), label="zip field")
        value = draw(st.one_of(st.integers(0, 2 ** (8 * width) - 1),
                               st.sampled_from([0, 1, 8, 2 ** (8 * width) - 1, 2**31, len(out), 6 << 30])), label="value")
        out[spot : spot + width] = (value % 2 ** (8 * width)).to_bytes(width, "little")
        return bytes(out), False

    return lie


def write(tmp: Path, data: bytes, suffix: str) -> Path:
    path = tmp / f"fuzzed{suffix}"
    path.write_bytes(data)
    return path


def compiler_and_flags():
    """(g++, the sanitizer flags) as tests/test_sanitizers.py builds with, or (g++, "")
    where g++ has no sanitizer runtimes (the fuzzing still runs, uninstrumented)."""
    from test_sanitizers import SANITIZE, _compiler

    cxx, libs = _compiler()
    if cxx is None:
        return shutil.which("g++"), ""
    return cxx, SANITIZE


__all__ = ["Reader", "Finding", "build_reader", "check_npy", "check_npz", "check_weights", "arrays", "npy_image",
           "mutate", "npy_lie", "zip_lie", "npz_archive", "WRITERS", "FLOATS", "NAME_CHARS", "write",
           "compiler_and_flags"]
