"""Tests for the C++ runtime headers in targets/cpu/runtime.

One driver program (tests/runtime_driver.cpp) exposing every kernel is compiled
once per session; each case runs it with raw arrays on stdin/stdout and
compares against numpy (for the ops) or against generator/reference/rng.py bit for bit
(for parameter initialization).
"""

from __future__ import annotations

import itertools
import os
import platform
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
from conftest import build_runtime_drivers, cpu_flags  # noqa: E402
from generator.reference import rng  # noqa: E402

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
    ((2, 3, 4, 5), (0, 2, 1, 3)),  # a head split: the last axis copied as runs
    ((2, 3, 4, 5), (1, 0, 2, 3)),  # two trailing axes kept: runs of 20
] + [((2, 3, 4), perm) for perm in itertools.permutations(range(3))]


@pytest.mark.parametrize("shape,perm", TRANSPOSE_CASES)
def test_transpose(driver, shape, perm):
    x = rand(*shape)
    got = driver("transpose", len(shape), *shape, *perm, inputs=[x])
    assert same_bits(got, np.transpose(x, perm))


@pytest.mark.parametrize("shape,perm,row_axes", [
    ((2, 3, 4, 5), (0, 2, 1, 3), 2),  # a head split of a fused projection's third
    ((2, 3, 4, 5), (0, 1, 2, 3), 2),  # nothing moves: rows copied one by one
    ((2, 3, 4, 5), (3, 2, 1, 0), 1),
    ((6, 4), (1, 0), 1),
])
def test_transpose_of_row_strided_piece(driver, shape, perm, row_axes):
    """dg::transpose reading a split's piece in place (row_axes, ld: LowerCtx.slice_view):
    the piece [..., start:start + width] of rows of 3 widths + 1 floats, as numpy sees it."""
    rows, width = int(np.prod(shape[:row_axes])), int(np.prod(shape[row_axes:]))
    ld = 3 * width + 1
    x = rand(rows, ld)
    for start in (0, width, 2 * width + 1):
        piece = x[:, start : start + width].reshape(shape)
        got = driver("transpose_rows", len(shape), *shape, *perm, row_axes, ld, start, inputs=[x])
        assert same_bits(got, np.transpose(piece, perm)), start


def test_ops_shared_out_over_threads(tmp_path, driver):
    """dg::transpose, softmax and log_softmax on arrays big enough for threads
    (threads_for), the driver built with OpenMP and run on 2 and 3 threads (ranges that
    split the axes unevenly): the same bits as numpy's transpose (each thread starts its
    odometer where its range of runs begins; runs of 256 floats and of 1) and as the
    one-thread build's softmax (each row computed as on one thread)."""
    exe = build_runtime_drivers(tmp_path, "runtime_driver", {"omp": []})["omp"]

    def run(threads, *args, x):
        proc = subprocess.run([str(exe), *map(str, args)], input=x.tobytes(), capture_output=True, timeout=60,
                              env=dict(os.environ, OMP_NUM_THREADS=threads))
        assert proc.returncode == 0, proc.stderr.decode()
        return np.frombuffer(proc.stdout, np.float32)

    for threads in ("2", "3"):
        for shape, perm in [((8, 64, 4, 256), (0, 2, 1, 3)), ((3, 129, 7, 197), (3, 1, 0, 2))]:
            x = rand(*shape)
            got = run(threads, "transpose", len(shape), *shape, *perm, x=x)
            assert same_bits(got, np.transpose(x, perm)), (shape, threads)
        x = rand(300, 50, 7) * 4
        for op in ("softmax", "log_softmax"):
            assert same_bits(run(threads, op, 300, 50, 7, x=x), driver(op, 300, 50, 7, inputs=[x])), (op, threads)


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


# --------------------------------------------------------------------------- gemm
#
# dg::gemm (dg_gemm.h) against numpy in float64.  The default driver above is
# built with the compiler's default target and without OpenMP; GEMM_BUILDS adds
# builds with OpenMP whose micro-kernel is forced: the portable C++ one and
# AVX2 + FMA (run only where the CPU has them).  The AVX-512 kernel is compiled
# (to an object file) but not run: most test machines cannot run it.

X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
GEMM_BUILDS = {
    "portable": ["-march=x86-64", "-fopenmp"],
    "avx2": ["-mavx2", "-mfma", "-fopenmp"],
    "avx512": ["-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq", "-mfma", "-fopenmp"],
}


@pytest.fixture(scope="session")
def gemm_builds(compiled, tmp_path_factory):
    """{name: (Driver, diagnostics)} for GEMM_BUILDS, compiled in parallel (each
    runs only where the CPU has its instruction set, see RUNNABLE); "default" is
    the driver every other test uses."""
    if not X86:
        pytest.skip("the forced-ISA GEMM builds need an x86 compiler")
    cxx = shutil.which("g++")
    folder = tmp_path_factory.mktemp("gemm_builds")
    base = [cxx, *CXX_FLAGS, "-I", str(RUNTIME_DIR), str(DRIVER_SRC)]
    jobs = {name: base + flags + ["-o", str(folder / name)] for name, flags in GEMM_BUILDS.items()}
    procs = {
        name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, cmd in jobs.items()
    }
    builds = {"default": (compiled[0], compiled[1])}
    for name, proc in procs.items():
        _, err = proc.communicate()
        assert proc.returncode == 0, f"compile failed:\n{' '.join(jobs[name])}\n{err}"
        builds[name] = (Driver(folder / name), err)
    return builds


# The CPU flags each build needs to run (every build is compiled everywhere).
RUNNABLE = {
    "portable": set(),
    "avx2": {"avx2", "fma"},
    "avx512": {"avx512f", "avx512vl", "avx512bw", "avx512dq", "fma"},
}


@pytest.fixture(params=list(RUNNABLE))
def gemm_driver(request, gemm_builds) -> Driver:
    """Each GEMM build in turn (skipped where the CPU lacks its ISA)."""
    missing = RUNNABLE[request.param] - cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {sorted(missing)}")
    return gemm_builds[request.param][0]


def gemm_info(driver: Driver, threads: int = 1) -> tuple[str, int, bool]:
    proc = driver.call("gemm_info", threads)
    assert proc.returncode == 0, proc.stderr
    isa, n, openmp = proc.stdout.decode().split()
    return isa, int(n), openmp == "1"


def run_gemm(driver, ta, tb, M, N, K, pad=(0, 0, 0), threads=1, bias=None, c0=None):
    """Runs dg::gemm on random operands stored with `pad` extra columns
    (lda - width, ldb - width, ldc - N).  Returns (stored a, stored b, C as
    stored [M, ldc], and with `bias`: the epilogue's count and thread arrays)."""
    lda = (M if ta else K) + pad[0]
    ldb = (K if tb else N) + pad[1]
    ldc = N + pad[2]
    a = rand(K if ta else M, lda)
    b = rand(N if tb else K, ldb)
    c = np.full((M, ldc), np.nan, np.float32) if c0 is None else c0
    inputs = [a, b, c] + ([bias] if bias is not None else [])
    args = (int(ta), int(tb), M, N, K, lda, ldb, ldc, threads, int(bias is not None))
    out = driver("gemm", *args, inputs=inputs)
    size = M * ldc
    got = out[:size].reshape(M, ldc)
    if bias is None:
        assert out.size == size
        return a, b, got
    assert out.size == 3 * size
    return a, b, got, out[size : 2 * size].reshape(M, ldc), out[2 * size :].reshape(M, ldc)


def gemm_reference(a, b, ta, tb, M, N, K) -> np.ndarray:
    """op(A) @ op(B) in float64, reading only the logical part of each stored operand."""
    opa = a[:K, :M].T if ta else a[:M, :K]
    opb = b[:N, :K].T if tb else b[:K, :N]
    return opa.astype(np.float64) @ opb.astype(np.float64)


def assert_gemm_close(got, expected, K):
    # float32 sums of K products of standard normals: errors grow with K.
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=2e-6 * (K + 1))


# (M, N, K): 1x1x1, primes, one less / equal / one more than the tiles (MR x NR
# = 4 x 8, 6 x 16, 12 x 32; the narrow edge tile 16 or 8 wide) and the K blocks
# (KC = 256, 1024).
# fmt: off
EDGE_SHAPES = [
    (1, 1, 1), (1, 1, 7), (2, 3, 1), (7, 13, 29), (13, 7, 29), (29, 13, 7),
    (3, 7, 9), (4, 8, 8), (5, 9, 17), (5, 15, 16), (6, 16, 191), (7, 17, 193),
    (11, 31, 255), (12, 32, 256), (13, 33, 257), (25, 47, 100), (47, 63, 385), (49, 65, 64),
    (143, 95, 31), (145, 97, 513), (25, 48, 1023), (13, 40, 1024), (26, 9, 1025), (3, 49, 2049),
]
# fmt: on
TATB = [(False, False), (True, False), (False, True), (True, True)]


@pytest.mark.parametrize("ta,tb", TATB)
def test_gemm_edge_shapes(gemm_driver, ta, tb):
    for M, N, K in EDGE_SHAPES:
        a, b, got = run_gemm(gemm_driver, ta, tb, M, N, K)
        assert_gemm_close(got, gemm_reference(a, b, ta, tb, M, N, K), K)


# The products the models run (M, N, K, ta, tb): TreeLSTM level GEMMs
# [M, 2H] @ [2H, 5H] at H = 256 and 512, and an MLP 784-512-256-10 at batch 64
# and 256: forward x @ W, input gradient dY @ W^T, weight gradient X^T @ dY.
# fmt: off
MODEL_SHAPES = [
    *[(m, 1280, 512, False, False) for m in (1, 2, 3, 4, 9, 20, 70)],
    (9, 2560, 1024, False, False),
    (64, 512, 784, False, False), (256, 256, 512, False, False), (64, 10, 256, False, False),
    (64, 784, 512, False, True), (256, 256, 10, False, True),
    (784, 512, 64, True, False), (256, 10, 256, True, False),
]
# fmt: on


@pytest.mark.parametrize("M,N,K,ta,tb", MODEL_SHAPES)
def test_gemm_model_shapes(gemm_driver, M, N, K, ta, tb):
    a, b, got = run_gemm(gemm_driver, ta, tb, M, N, K)
    assert_gemm_close(got, gemm_reference(a, b, ta, tb, M, N, K), K)


@pytest.mark.parametrize("ta,tb", TATB)
@pytest.mark.parametrize("M,N,K", [(1, 40, 9), (3, 33, 20), (7, 13, 29), (50, 70, 300)])
def test_gemm_leading_dimensions(gemm_driver, ta, tb, M, N, K):
    """Rows longer than the matrix: the padding is never read (it holds random
    values) and the padding of C is left as it was."""
    pad = (3, 5, 7)
    c0 = rand(M, N + pad[2])
    a, b, got = run_gemm(gemm_driver, ta, tb, M, N, K, pad=pad, c0=c0)
    assert_gemm_close(got[:, :N], gemm_reference(a, b, ta, tb, M, N, K), K)
    assert same_bits(got[:, N:], c0[:, N:])


@pytest.mark.parametrize(
    "M,N,K,ta,tb",
    [
        (1, 1, 1, False, False),
        (2, 100, 30, False, False),
        (3, 1280, 512, False, False),
        (7, 13, 29, True, True),
        (9, 1280, 512, False, False),
        (70, 1280, 512, False, False),
        (64, 10, 256, False, False),
        (64, 784, 512, False, True),
        (784, 512, 64, True, False),
    ],
)
def test_gemm_epilogue_once_per_element(gemm_driver, M, N, K, ta, tb):
    """c = max(c + bias[col], 0), applied exactly once to every element of C
    (and never to the padding of C), after the whole sum."""
    bias = rand(N)
    a, b, got, count, _ = run_gemm(gemm_driver, ta, tb, M, N, K, pad=(0, 0, 2), threads=2, bias=bias)
    assert np.array_equal(count[:, :N], np.ones((M, N), np.float32))
    assert np.array_equal(count[:, N:], np.zeros((M, 2), np.float32))
    expected = np.maximum(gemm_reference(a, b, ta, tb, M, N, K) + bias, 0.0)
    assert_gemm_close(got[:, :N], expected, K)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("M,N,K,ta,tb", [(1, 1280, 512, False, False), (3, 33, 20, True, False), (5, 1280, 512, False, False),
                                         (9, 1280, 512, False, False), (13, 33, 257, False, True),
                                         (70, 1280, 512, False, False), (200, 47, 385, True, True),
                                         (4, 70, 600, False, True), (6, 1000, 1280, False, True)])
def test_gemm_with_packed_b_equals_gemm(gemm_driver, M, N, K, ta, tb, threads):
    """A PackedB (weights packed once before a loop) gives gemm's result bit for
    bit at every use (read in place, packing, packed: its panels walked forward,
    then backward), streamed (M <= 3) or not; a few rows by a transposed B
    packed over several K blocks (a kept weight streamed with prefetches, as a
    batch-1 convolution or Linear layer reads it) included."""
    lda, ldb, ldc = (M if ta else K) + 1, (K if tb else N) + 2, N + 3
    a, b = rand(K if ta else M, lda), rand(N if tb else K, ldb)
    out = gemm_driver("gemm_packed", int(ta), int(tb), M, N, K, lda, ldb, ldc, threads,
                      inputs=[a, b, np.zeros((M, ldc), np.float32)])
    *uses, plain, few, one = (x.reshape(M, ldc) for x in np.split(out, 7))
    assert all(same_bits(use, plain) for use in uses)
    want = gemm_reference(a, b, ta, tb, M, N, K)
    assert_gemm_close(plain[:, :N], want, K)
    assert np.all(plain[:, N:] == -1.0)
    # Two-row and one-row products with the same PackedB, packed by now where M > MR
    # (it streams row-major B, so its rounding may differ from the M-row product's).
    # A transposed B is always read packed: its 1 x 4 and 2 x 2 panel kernels
    # give the micro-kernel's bits, those of a product of more than 3 rows.
    for rows, got in ((min(M, 2), few), (1, one)):
        assert_gemm_close(got[:rows, :N], want[:rows], K)
        assert np.all(got[rows:] == -1.0) and np.all(got[:rows, N:] == -1.0)
        if tb and M > 3:
            assert same_bits(got[:rows], plain[:rows])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "M,N,K,ta,tb",
    [
        (784, 512, 64, True, False),  # an MLP's first weight gradient, x^T @ g: several blocks of rows
        (256, 10, 64, True, False),  # its last (N = 10: one narrow panel)
        (300, 47, 385, True, True),  # K over one block, partial tiles
        (2, 1280, 512, False, False),  # streamed (M <= 3)
        (5, 1280, 512, False, True),  # one row panel: split by columns on two threads
        (13, 33, 0, True, False),  # K = 0: zeros, then the update
    ],
)
def test_gemm_update_rows(gemm_driver, M, N, K, ta, tb, threads):
    """dg::update_rows: the product is gemm's bit for bit, and the update runs once
    on every element, from that element's finished sum; with apply false, never."""
    a, b = rand(K if ta else M, M if ta else K), rand(N if tb else K, K if tb else N)
    w0 = rand(M, N)
    for apply in (1, 0):
        out = gemm_driver("gemm_update", int(ta), int(tb), M, N, K, threads, apply, inputs=[a, b, w0])
        c, w, count, plain = (x.reshape(M, N) for x in np.split(out, 4))
        assert same_bits(c, plain)
        if apply:
            assert np.array_equal(count, np.ones((M, N), np.float32))
            assert same_bits(w, (w0 - np.float32(0.5) * plain).astype(np.float32))
        else:
            assert np.array_equal(count, np.zeros((M, N), np.float32)) and same_bits(w, w0)
    assert_gemm_close(plain, gemm_reference(a, b, ta, tb, M, N, K), K)


@pytest.mark.parametrize("M,N,K,tb", [(1, 1280, 512, False), (2, 47, 785, True), (3, 33, 20, False),
                                      (1, 10, 256, False), (9, 200, 385, True)])
def test_packing_gives_back_its_weight_and_reads_without_it(gemm_driver, M, N, K, tb):
    """PackedB::unpack writes B back bit for bit (every K block and the partial
    last panel; the row padding untouched), and a packing whose stored B is gone
    (set_source(nullptr), dg::KeptPackedB standing in for the weight) still
    multiplies right at every M, with no row streaming from B."""
    ldb = (K if tb else N) + 3
    a, b = rand(M, K), rand(N if tb else K, ldb)
    out = gemm_driver("gemm_unpack", int(tb), M, N, K, ldb, inputs=[a, b])
    back, c = out[: b.size].reshape(b.shape), out[b.size :].reshape(M, N)
    width = K if tb else N
    assert same_bits(back[:, :width], b[:, :width])
    assert np.isnan(back[:, width:]).all()
    assert_gemm_close(c, gemm_reference(a, b, False, tb, M, N, K), K)


@pytest.mark.parametrize("ta,tb", TATB)
def test_gemm_k_zero_gives_zeros_then_epilogue(gemm_driver, ta, tb):
    M, N = 5, 19
    bias = rand(N)
    _, _, got, count, _ = run_gemm(gemm_driver, ta, tb, M, N, 0, bias=bias)
    assert np.array_equal(count, np.ones((M, N), np.float32))
    np.testing.assert_array_equal(got, np.broadcast_to(np.maximum(bias, 0.0), (M, N)))
    _, _, got = run_gemm(gemm_driver, ta, tb, M, N, 0)
    assert np.array_equal(got, np.zeros((M, N), np.float32))


def test_gemm_empty_output(gemm_driver):
    for M, N in [(0, 5), (5, 0), (0, 0)]:
        _, _, got = run_gemm(gemm_driver, False, False, M, N, 4)
        assert got.size == 0


# fmt: off
THREAD_SHAPES = [
    (1, 1280, 512, False, False), (3, 1300, 700, False, False), (9, 1280, 512, False, False),
    (70, 1280, 512, False, False), (64, 512, 784, False, False), (64, 784, 512, False, True),
    (784, 512, 64, True, False), (256, 10, 256, True, False), (130, 70, 300, True, True),
]
# fmt: on


@pytest.mark.parametrize("build", list(GEMM_BUILDS))
@pytest.mark.parametrize("M,N,K,ta,tb", THREAD_SHAPES)
def test_gemm_same_bits_for_1_and_2_threads(gemm_builds, build, M, N, K, ta, tb):
    """K is never split over threads, so the result does not depend on the
    thread count; the epilogue shows that two threads did take part."""
    missing = RUNNABLE[build] - cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {sorted(missing)}")
    driver = gemm_builds[build][0]
    bias = rand(N)
    results = {}
    for threads in (1, 2):
        state = GEN.bit_generator.state
        results[threads] = run_gemm(driver, ta, tb, M, N, K, threads=threads, bias=bias)
        GEN.bit_generator.state = state  # the same operands for both runs
    (a, b, one, _, thread1), (_, _, two, count, thread2) = results[1], results[2]
    assert same_bits(one, two)
    assert np.array_equal(count, np.ones((M, N), np.float32))
    assert set(np.unique(thread1)) == {0.0}
    _, threads, openmp = gemm_info(driver, 2)
    assert openmp
    if threads == 2:
        assert set(np.unique(thread2)) == {0.0, 1.0}
    assert_gemm_close(one, np.maximum(gemm_reference(a, b, ta, tb, M, N, K) + bias, 0.0), K)


@pytest.mark.parametrize(
    "M,N,K,ta,tb",
    [
        (7, 13, 29, False, False),
        (3, 100, 64, False, False),
        (70, 1280, 512, False, False),
        (64, 784, 512, False, True),
        (784, 512, 64, True, False),
        (13, 33, 257, True, True),
    ],
)
def test_gemm_default_build(driver, M, N, K, ta, tb):
    """The driver built with the compiler's default target and without OpenMP."""
    bias = rand(N)
    a, b, got, count, thread = run_gemm(driver, ta, tb, M, N, K, threads=2, bias=bias)
    assert np.array_equal(count, np.ones((M, N), np.float32))
    assert set(np.unique(thread)) == {0.0}
    assert_gemm_close(got, np.maximum(gemm_reference(a, b, ta, tb, M, N, K) + bias, 0.0), K)


def test_gemm_builds_compile_without_warnings(gemm_builds):
    for name, (_, diagnostics) in gemm_builds.items():
        assert diagnostics == "", f"{name}:\n{diagnostics}"


def test_gemm_isa_of_each_build(gemm_builds):
    assert gemm_info(gemm_builds["portable"][0])[0] == "portable"
    if {"avx2", "fma"} <= cpu_flags():
        assert gemm_info(gemm_builds["avx2"][0])[0] == "avx2"
    if RUNNABLE["avx512"] <= cpu_flags():
        assert gemm_info(gemm_builds["avx512"][0])[0] == "avx512"
    assert gemm_info(gemm_builds["default"][0])[0] in ("portable", "avx2", "avx512")


def test_num_threads(driver):
    # Without OpenMP the count is always 1; with it, what was set.
    _, threads, openmp = gemm_info(driver, 3)
    assert threads == (3 if openmp else 1)
    message = "dg::set_num_threads: the number of threads must be >= 1, got 0"
    assert driver.error("gemm_info", 0) == message


def test_num_threads_with_openmp(gemm_builds):
    assert gemm_info(gemm_builds["portable"][0], 3)[1:] == (3, True)
    assert gemm_builds["portable"][0].error("gemm_info", -2).endswith("got -2")


def test_gemm_rejects_bad_leading_dimension(driver):
    # M=2, N=3, K=4 with lda=3 < K
    message = driver.error("gemm", 0, 0, 2, 3, 4, 3, 3, 3, 1, 0, inputs=[rand(2, 3), rand(4, 3), rand(2, 3)])
    assert message.startswith("dg::gemm: a leading dimension is smaller than its row (lda=3 < 4")


@pytest.mark.parametrize("M,K,N", [(1, 1, 1), (7, 13, 5), (64, 129, 33), (2, 300, 70)])
def test_matmul_tn_and_nt(driver, M, K, N):
    a_t, b = rand(K, M), rand(K, N)
    got = driver("matmul_tn", M, K, N, inputs=[a_t, b]).reshape(M, N)
    np.testing.assert_allclose(got, a_t.T.astype(np.float64) @ b, rtol=1e-5, atol=1e-5 * np.sqrt(K))
    a, b_t = rand(M, K), rand(N, K)
    got = driver("matmul_nt", M, K, N, inputs=[a, b_t]).reshape(M, N)
    np.testing.assert_allclose(got, a.astype(np.float64) @ b_t.T, rtol=1e-5, atol=1e-5 * np.sqrt(K))


# --------------------------------------- guards (dg_state_lock.h, dg_finite_loss.h, dg_range_checks.h)


def test_numel_refuses_products_beyond_int64(driver):
    assert driver.call("numel", 3, 4, 5).stdout.decode().strip() == "60"
    assert driver.call("numel", 2**31, 2**31).stdout.decode().strip() == str(2**62)
    proc = driver.call("numel", 2**32, 2**32)
    assert proc.returncode == 4 and b"more elements than int64" in proc.stderr
    proc = driver.call("numel", 2**62, 3)
    assert proc.returncode == 4


def test_require_size_refuses_arenas_beyond_int64(driver):
    assert driver.call("require_size", 2**20, 2**20, 2**20).returncode == 0  # 2**60
    proc = driver.call("require_size", 2**32, 2**32, 4)
    assert proc.returncode == 4 and b"input sizes too large: the arena" in proc.stderr


@pytest.mark.parametrize("value, word", [(float("nan"), "nan"), (float("inf"), "inf"), (float("-inf"), "inf")])
def test_non_finite_loss_is_refused_naming_the_step(driver, value, word):
    proc = driver.call("finite_loss", f32_bits(value), 7)
    assert proc.returncode == 5
    assert proc.stderr.decode().startswith(f"train_step 7: the loss is {word}; nothing was updated")
    assert driver.call("finite_loss", f32_bits(1.5), 7).returncode == 0
