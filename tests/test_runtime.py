"""Tests for the C++ runtime headers in targets/cpu/runtime.

One driver program (tests/runtime_driver.cpp) exposing every kernel is compiled
once per session; each case runs it with raw arrays on stdin/stdout and
compares against numpy (for the ops) or against generator/rng.py bit for bit
(for parameter initialization).
"""

from __future__ import annotations

import itertools
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_DIR = ROOT / "targets" / "cpu" / "runtime"
DRIVER_SRC = Path(__file__).resolve().parent / "runtime_driver.cpp"

sys.path.insert(0, str(ROOT))
from generator import rng  # noqa: E402

CXX_FLAGS = ["-std=c++17", "-O2", "-Wall", "-Wextra"]
INVALID_ARGUMENT_EXIT = 3  # the driver's exit status for std::invalid_argument


# --------------------------------------------------------------------------- driver


class Driver:
    """Runs the compiled driver: ``driver(op, *args, inputs=[arrays])``."""

    def __init__(self, exe: Path):
        self.exe = exe

    def call(self, op: str, *args, inputs=()) -> subprocess.CompletedProcess:
        stdin = b"".join(np.ascontiguousarray(a).tobytes() for a in inputs)
        cmd = [str(self.exe), op, *[str(a) for a in args]]
        return subprocess.run(cmd, input=stdin, capture_output=True, timeout=60)

    def __call__(self, op: str, *args, inputs=()) -> np.ndarray:
        """Runs a case that must succeed and returns its float32 output."""
        proc = self.call(op, *args, inputs=inputs)
        assert proc.returncode == 0, proc.stderr.decode()
        return np.frombuffer(proc.stdout, dtype=np.float32)

    def error(self, op: str, *args, inputs=()) -> str:
        """Runs a case that must raise std::invalid_argument and returns its message."""
        proc = self.call(op, *args, inputs=inputs)
        assert proc.returncode == INVALID_ARGUMENT_EXIT, (proc.returncode, proc.stderr)
        return proc.stderr.decode().strip()


@pytest.fixture(scope="session")
def compiled(tmp_path_factory):
    """(Driver, compiler diagnostics); compiled once for the whole session."""
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("g++ not found: cannot compile the C++ runtime tests")
    exe = tmp_path_factory.mktemp("runtime") / "runtime_driver"
    cmd = [cxx, *CXX_FLAGS, "-I", str(RUNTIME_DIR), str(DRIVER_SRC), "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"compile failed:\n{' '.join(cmd)}\n{proc.stderr}"
    return Driver(exe), proc.stderr


@pytest.fixture
def driver(compiled) -> Driver:
    return compiled[0]


def f32_bits(value: float) -> int:
    """A float32 as the uint32 bit pattern the driver expects on its command line."""
    return int(np.float32(value).view(np.uint32))


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a = np.asarray(a, dtype=np.float32).ravel()
    b = np.asarray(b, dtype=np.float32).ravel()
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_headers_compile_without_warnings(compiled):
    _, diagnostics = compiled
    assert diagnostics == "", diagnostics


# --------------------------------------------------------------------------- rng

NAMES = ["", "a", "w1", "layer.0.weight", "embed/tokens", "größe", "重み"]


def test_name_stream_known_values():
    # Reference FNV-1a 64-bit values.
    assert rng.name_stream("") == 0xCBF29CE484222325
    assert rng.name_stream("a") == 0xAF63DC4C8601EC8C
    assert rng.name_stream("foobar") == 0x85944171F73967E8


@pytest.mark.parametrize("name", NAMES)
def test_name_stream_matches_cpp(driver, name):
    proc = driver.call("name_stream", name)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) == rng.name_stream(name)


@pytest.mark.parametrize(
    "seed,stream,counter",
    [(0, 0, 0), (1, 2, 3), (2**64 - 1, 2**64 - 1, 2**64 - 1), (12345, rng.name_stream("w1"), 999)],
)
def test_mix_matches_cpp(driver, seed, stream, counter):
    proc = driver.call("mix", seed, stream, counter)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) == rng.mix(seed, stream, counter)


def test_negative_seed_wraps_like_uint64():
    assert rng.mix(-1, 5, 7) == rng.mix(2**64 - 1, 5, 7)
    assert same_bits(rng.init_uniform(10, -1, "w", 0, 1), rng.init_uniform(10, 2**64 - 1, "w", 0, 1))


def test_words_match_scalar_mix():
    """The vectorized numpy path agrees with the scalar definition of mix."""
    stream = rng.name_stream("w1")
    words = rng._words(7, stream, 5)
    assert [int(w) for w in words] == [rng.mix(7, stream, c) for c in range(5)]


RNG_CASES = [
    # (seed, name, n, low/mean, high/std)
    (0, "w1", 1, -1.0, 1.0),
    (0, "w1", 1000, -0.1, 0.1),
    (1, "w1", 1000, -0.1, 0.1),
    (42, "layer.0.weight", 4097, 0.0, 1.0),
    (2**63 + 5, "重み", 257, -3.5, 2.25),
    (123456789, "b", 100, 1e-3, 1e-2),
    (7, "x", 0, 0.0, 1.0),
]


@pytest.mark.parametrize("seed,name,n,low,high", RNG_CASES)
def test_uniform_bit_identical(driver, seed, name, n, low, high):
    expected = rng.init_uniform(n, seed, name, low, high)
    got = driver("init_uniform", n, seed, name, f32_bits(low), f32_bits(high))
    assert same_bits(got, expected)


@pytest.mark.parametrize("seed,name,n,mean,std", RNG_CASES)
def test_normal_bit_identical(driver, seed, name, n, mean, std):
    expected = rng.init_normal(n, seed, name, mean, std)
    got = driver("init_normal", n, seed, name, f32_bits(mean), f32_bits(std))
    assert same_bits(got, expected)


@pytest.mark.parametrize("value", [0.0, 1.0, -0.0, 0.1, 3.4e38, 1e-45])
def test_constant_bit_identical(driver, value):
    expected = rng.init_constant((3, 5), value)
    assert expected.dtype == np.float32 and expected.shape == (3, 5)
    assert same_bits(driver("init_constant", 15, f32_bits(value)), expected)


def test_glorot_and_he_match_cpp(driver):
    """The generator passes the float32 value of the computed parameters to C++."""
    limit = rng.glorot_uniform_limit(300, 100)
    assert limit == pytest.approx(np.sqrt(6 / 400))
    w = rng.glorot_uniform((300, 100), 3, "dense.w", 300, 100)
    assert w.shape == (300, 100) and w.dtype == np.float32
    assert np.all(w >= -np.float32(limit)) and np.all(w < np.float32(limit))
    got = driver("init_uniform", w.size, 3, "dense.w", f32_bits(-limit), f32_bits(limit))
    assert same_bits(got, w)

    std = rng.he_normal_std(50)
    assert std == pytest.approx(np.sqrt(2 / 50))
    w = rng.he_normal((50, 20), 3, "conv.w", 50)
    got = driver("init_normal", w.size, 3, "conv.w", f32_bits(0.0), f32_bits(std))
    assert same_bits(got, w)


def test_shape_is_row_major_over_flat_index():
    flat = rng.init_normal(24, 5, "w", 0.0, 1.0)
    shaped = rng.init_normal((2, 3, 4), 5, "w", 0.0, 1.0)
    assert shaped.shape == (2, 3, 4) and shaped.dtype == np.float32
    assert same_bits(shaped, flat)
    assert same_bits(rng.init_uniform((4, 6), 5, "w", 0, 1), rng.init_uniform(24, 5, "w", 0, 1))


def test_normal_statistics(driver):
    n = 100_000
    x = rng.init_normal(n, 0, "stats", 0.5, 2.0)
    assert same_bits(driver("init_normal", n, 0, "stats", f32_bits(0.5), f32_bits(2.0)), x)
    assert abs(x.mean() - 0.5) < 0.03  # standard error is 2 / sqrt(n) ~ 0.006
    assert abs(x.std() / 2.0 - 1.0) < 0.02
    # Irwin-Hall tails stop at 6 standard deviations.
    assert np.all(np.abs(x - 0.5) <= 12.0)
    z = (x - 0.5) / 2.0
    assert 0.66 < np.mean(np.abs(z) < 1.0) < 0.71  # ~68% within one std


def test_uniform_statistics():
    x = rng.init_uniform(100_000, 0, "stats", -2.0, 3.0)
    assert x.min() >= -2.0 and x.max() < 3.0
    assert abs(x.mean() - 0.5) < 0.03
    counts, _ = np.histogram(x, bins=10, range=(-2.0, 3.0))
    assert counts.min() > 9_500 and counts.max() < 10_500


def test_streams_are_independent_and_reproducible():
    a = rng.init_uniform(1000, 0, "w1", 0.0, 1.0)
    assert same_bits(a, rng.init_uniform(1000, 0, "w1", 0.0, 1.0))
    for other in [rng.init_uniform(1000, 0, "w2", 0.0, 1.0), rng.init_uniform(1000, 1, "w1", 0.0, 1.0)]:
        assert np.mean(a == other) < 0.01
        assert abs(np.corrcoef(a, other)[0, 1]) < 0.1
    n1 = rng.init_normal(1000, 0, "w1", 0.0, 1.0)
    assert same_bits(n1, rng.init_normal(1000, 0, "w1", 0.0, 1.0))
    assert not same_bits(n1, rng.init_normal(1000, 0, "w2", 0.0, 1.0))


def test_rng_emits_no_numpy_warnings():
    with np.errstate(all="raise"):
        rng.init_uniform(100, 2**64 - 1, "w", 0.0, 1.0)
        rng.init_normal(100, 2**64 - 1, "w", 0.0, 1.0)


# --------------------------------------------------------------------------- ops

GEN = np.random.default_rng(20240601)


def rand(*shape) -> np.ndarray:
    return GEN.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("M,K,N", [(1, 1, 1), (1, 5, 1), (3, 1, 4), (7, 13, 5), (64, 129, 33), (1, 300, 2)])
def test_matmul(driver, M, K, N):
    a, b = rand(M, K), rand(K, N)
    got = driver("matmul", M, K, N, inputs=[a, b]).reshape(M, N)
    expected = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.sqrt(K))


AXIS_SHAPES = [(1, 1, 1), (1, 5, 1), (3, 1, 4), (2, 7, 3), (4, 33, 17), (1, 1000, 1), (5, 3, 1), (1, 4, 64)]


@pytest.mark.parametrize("op", ["reduce_sum", "reduce_mean", "reduce_max"])
@pytest.mark.parametrize("shape", AXIS_SHAPES)
def test_reductions(driver, op, shape):
    x = rand(*shape)
    got = driver(op, *shape, inputs=[x]).reshape(shape[0], shape[2])
    oracle = {"reduce_sum": np.sum, "reduce_mean": np.mean, "reduce_max": np.max}[op]
    expected = oracle(x.astype(np.float64), axis=1)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.sqrt(shape[1]))


def test_reduce_max_on_empty_axis_throws(driver):
    assert driver.error("reduce_max", 2, 0, 3) == "max over an empty axis"


def test_sum_and_mean_over_empty_axis(driver):
    assert np.array_equal(driver("reduce_sum", 2, 0, 3), np.zeros(6, np.float32))
    assert np.all(np.isnan(driver("reduce_mean", 2, 0, 3)))


def test_reduce_max_propagates_nan(driver):
    x = rand(2, 4, 3)
    x[0, 2, 1] = np.nan  # in the middle of its column
    x[1, 0, 0] = np.nan  # first element of its column
    got = driver("reduce_max", 2, 4, 3, inputs=[x]).reshape(2, 3)
    np.testing.assert_array_equal(got, np.max(x, axis=1))


def softmax_oracle(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def log_softmax_oracle(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    shifted = x - x.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


@pytest.mark.parametrize("shape", AXIS_SHAPES)
def test_softmax(driver, shape):
    x = rand(*shape) * 5
    got = driver("softmax", *shape, inputs=[x]).reshape(shape)
    np.testing.assert_allclose(got, softmax_oracle(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.sum(axis=1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("shape", AXIS_SHAPES)
def test_log_softmax(driver, shape):
    x = rand(*shape) * 5
    got = driver("log_softmax", *shape, inputs=[x]).reshape(shape)
    np.testing.assert_allclose(got, log_softmax_oracle(x), rtol=1e-5, atol=1e-5)


def test_softmax_is_numerically_stable(driver):
    # Huge logits would overflow exp without the max shift; a spread of 300
    # underflows the smallest probability, which log_softmax must still give.
    x = np.array([[1000.0, 1001.0, 700.0], [-1000.0, -1000.0, -1300.0]], np.float32).reshape(2, 3, 1)
    p = driver("softmax", 2, 3, 1, inputs=[x]).reshape(x.shape)
    np.testing.assert_allclose(p, softmax_oracle(x), rtol=1e-6, atol=1e-30)
    lp = driver("log_softmax", 2, 3, 1, inputs=[x]).reshape(x.shape)
    assert np.all(np.isfinite(lp))
    np.testing.assert_allclose(lp, log_softmax_oracle(x), rtol=1e-6)


TRANSPOSE_CASES = [
    ((), ()),
    ((5,), (0,)),
    ((1, 1), (1, 0)),
    ((3, 4), (1, 0)),
    ((0, 3), (1, 0)),
    ((1, 5, 1, 3), (3, 0, 2, 1)),
    ((2, 3, 4, 5, 6), (4, 2, 0, 3, 1)),
    ((7, 1, 9), (0, 1, 2)),
] + [((2, 3, 4), perm) for perm in itertools.permutations(range(3))]


@pytest.mark.parametrize("shape,perm", TRANSPOSE_CASES)
def test_transpose(driver, shape, perm):
    x = rand(*shape)
    got = driver("transpose", len(shape), *shape, *perm, inputs=[x])
    assert same_bits(got, np.transpose(x, perm))


@pytest.mark.parametrize(
    "outer,src_len,src_start,dst_len,dst_start,count,inner",
    [
        (1, 1, 0, 1, 0, 1, 1),
        (3, 10, 2, 5, 0, 5, 2),  # slice
        (2, 4, 0, 9, 5, 4, 3),  # second half of a concat
        (4, 6, 1, 6, 3, 2, 1),
        (2, 5, 1, 7, 2, 0, 3),  # empty block copies nothing
        (1, 8, 0, 8, 0, 8, 16),  # whole array
    ],
)
def test_copy_axis(driver, outer, src_len, src_start, dst_len, dst_start, count, inner):
    src, dst = rand(outer, src_len, inner), rand(outer, dst_len, inner)
    expected = dst.copy()
    expected[:, dst_start : dst_start + count] = src[:, src_start : src_start + count]
    args = (outer, src_len, src_start, dst_len, dst_start, count, inner)
    got = driver("copy_axis", *args, inputs=[src, dst])
    assert same_bits(got, expected)


def test_copy_axis_implements_concat(driver):
    a, b = rand(2, 3, 4), rand(2, 5, 4)
    out = np.zeros((2, 8, 4), np.float32)
    out = driver("copy_axis", 2, 3, 0, 8, 0, 3, 4, inputs=[a, out])
    out = driver("copy_axis", 2, 5, 0, 8, 3, 5, 4, inputs=[b, out])
    assert same_bits(out, np.concatenate([a, b], axis=1))


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("rows,width,n", [(1, 1, 1), (5, 3, 8), (50, 1, 20), (7, 16, 0), (100, 33, 64)])
def test_gather_rows(driver, id_dtype, rows, width, n):
    table = rand(rows, width)
    ids = GEN.integers(0, rows, size=n).astype(id_dtype)
    op = "gather_rows_i32" if id_dtype == np.int32 else "gather_rows_i64"
    got = driver(op, rows, width, n, "emb", inputs=[table, ids])
    assert same_bits(got, table[ids])


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("bad,position", [(7, 3), (5, 0), (-1, 2)])
def test_gather_rows_out_of_range(driver, id_dtype, bad, position):
    ids = np.array([0, 1, 2, 4], id_dtype)
    ids[position] = bad
    op = "gather_rows_i32" if id_dtype == np.int32 else "gather_rows_i64"
    what = "embedding 'emb' ids 'tokens'"
    message = driver.error(op, 5, 3, 4, what, inputs=[rand(5, 3), ids])
    assert message == f"{what}: index {bad} at position {position} is out of range [0, 5)"


def test_gather_rows_large_int64_id(driver):
    message = driver.error("gather_rows_i64", 5, 2, 1, "e", inputs=[rand(5, 2), np.array([2**40], np.int64)])
    assert message == f"e: index {2**40} at position 0 is out of range [0, 5)"
