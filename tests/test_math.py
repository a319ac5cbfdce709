"""Tests for targets/cpu/runtime/dg_math.h (vectorizable float exp/expm1/log/log1p/tanh/erf/sigmoid).

tests/math_driver.cpp is compiled once per session in four builds: plain (SSE2, no FMA), with
-mavx2 -mfma, with -mavx2 -mfma -ffp-contract=fast (these two run only where the CPU has AVX2 and
FMA), and with AVX-512 and 512-bit loops as a generated project builds it on such a CPU (run only
there).  Its evaluation loop is vectorized in every build, so the vectorized code is what
is checked.  Two oracles:

* the driver's `sweep` compares against double-precision libm itself: a dense sweep over all
  2^32 bit patterns with a stride, plus windows swept at full density where the functions switch
  method or saturate, near 0 and in the subnormals;
* numpy (float64, and scipy's erf or math.erf) checks a sample independently here in Python.

Bound: at most 2 ulp from the correctly rounded float, NaN/inf/signed zero exactly right.
(Over all 2^32 inputs the measured worst case is 1 ulp from the correctly rounded float, 2 for sigmoid.)
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_DIR = ROOT / "targets" / "cpu" / "runtime"
DRIVER_SRC = Path(__file__).resolve().parent / "math_driver.cpp"

FUNCS = ["exp", "expm1", "log", "log1p", "tanh", "erf", "sigmoid"]
MAX_ULPS = 2  # distance from the correctly rounded float (the promised bound)
MAX_ERR = 1.5  # |result - exact| / ulp: a regression guard (all 2^32 inputs measure <= 1.32, erf without FMA)
# sigmoid: all 2^32 inputs measure 2.40 (e^-|x|'s error doubles where t / (1 + t) drops a binade),
# still at most 2 ulp from the correctly rounded float
MAX_ERR_OF = {"sigmoid": 2.45}
BASE_FLAGS = ["-std=c++17", "-O2", "-Wall", "-Wextra", "-pthread"]
BUILDS = {
    "sse2": [],
    "avx2_fma": ["-mavx2", "-mfma"],
    # GCC's default outside ISO mode (-std=gnu++17): a * b + c fused wherever it appears.
    "avx2_fma_contract": ["-mavx2", "-mfma", "-ffp-contract=fast"],
    # What a generated project compiles on an AVX-512 machine: 512-bit loops (its CMakeLists
    # adds -mprefer-vector-width=512 to -march=native).
    "avx512": ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx2", "-mfma", "-mprefer-vector-width=512"],
}
FULL_STRIDE = 2039  # odd prime: the sweep reaches every exponent with varied mantissas
THREADS = 2


def _cpu_has(*flags: str) -> bool:
    """Whether /proc/cpuinfo lists every flag (False where it cannot be read)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    lines = [line for line in info.splitlines() if line.startswith("flags")]
    return bool(lines) and set(flags) <= set(lines[0].split(":", 1)[1].split())


class Driver:
    """The compiled math_driver; `runner` is a command line that runs it (tests/test_arm64.py:
    qemu-aarch64 for an aarch64 build), empty for a native one."""

    def __init__(self, exe: Path, runner=(), timeout: float = 60):
        self.exe, self.runner, self.timeout = exe, list(runner), timeout

    def eval(self, fn: str, x) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        proc = subprocess.run([*self.runner, str(self.exe), "eval", fn], input=x.tobytes(), capture_output=True,
                              timeout=self.timeout)
        assert proc.returncode == 0, proc.stderr.decode()
        y = np.frombuffer(proc.stdout, dtype=np.float32)
        assert y.shape == x.shape
        return y

    def sweep(self, fn: str, start: int, end: int, stride: int) -> dict:
        cmd = [*self.runner, str(self.exe), "sweep", fn, str(start), str(end), str(stride), str(THREADS)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=2 * self.timeout)
        assert proc.returncode == 0, proc.stderr
        out = dict(kv.split("=") for kv in proc.stdout.split())
        return {k: (float(v) if k == "max_ulp" else int(v, 0)) for k, v in out.items()}


@pytest.fixture(scope="session")
def builds(tmp_path_factory):
    """{build name: (Driver, compiler stderr, vectorizer report)}; compiled once per session."""
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("g++ not found: cannot compile the math tests")
    out = {}
    tmp = tmp_path_factory.mktemp("math")
    for name, flags in BUILDS.items():
        exe = tmp / f"math_driver_{name}"
        report = tmp / f"vec_{name}.txt"
        cmd = [cxx, *BASE_FLAGS, *flags, f"-fopt-info-vec-optimized={report}", "-I", str(RUNTIME_DIR)]
        cmd += [str(DRIVER_SRC), "-o", str(exe)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 0, f"compile failed:\n{' '.join(cmd)}\n{proc.stderr}"
        out[name] = (Driver(exe), proc.stderr, report.read_text())
    return out


@pytest.fixture(params=list(BUILDS))
def build(request, builds):
    if request.param.startswith("avx2") and not _cpu_has("avx2", "fma"):
        pytest.skip("CPU lacks AVX2/FMA")
    if request.param == "avx512" and not _cpu_has("avx512f", "avx512dq", "avx512vl", "avx2", "fma"):
        pytest.skip("CPU lacks AVX-512")
    return request.param


@pytest.fixture
def driver(builds, build) -> Driver:
    return builds[build][0]


# --------------------------------------------------------------------------- helpers


def f32(v: float) -> np.float32:
    return np.float32(v)


def bits(v) -> int:
    return int(np.float32(v).view(np.uint32))


def interval_bits(a: float, b: float) -> tuple[int, int]:
    """The [start, end) bit-pattern range of the floats between a and b (same sign, inclusive)."""
    lo, hi = sorted([bits(a), bits(b)])
    return lo, hi + 1


def ordered(y: np.ndarray) -> np.ndarray:
    """float32 -> int64 increasing with the value (differences count ulps)."""
    i = np.asarray(y, dtype=np.float32).view(np.int32).astype(np.int64)
    return np.where(i < 0, -(i & 0x7FFFFFFF), i)


def _erf64(x: np.ndarray) -> np.ndarray:
    try:
        from scipy.special import erf

        return erf(x)
    except ImportError:
        return np.array([math.erf(v) for v in x.tolist()])


ORACLE = {
    "exp": np.exp,
    "expm1": np.expm1,
    "log": np.log,
    "log1p": np.log1p,
    "tanh": np.tanh,
    "erf": _erf64,
    "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
}


def oracle(fn: str, x: np.ndarray) -> np.ndarray:
    """The correctly rounded float32 result (float64 numpy rounded once)."""
    with np.errstate(all="ignore"):
        return ORACLE[fn](np.asarray(x, dtype=np.float32).astype(np.float64)).astype(np.float32)


def assert_close(fn: str, x: np.ndarray, y: np.ndarray):
    ref = oracle(fn, x)
    nan_ref, nan_y = np.isnan(ref), np.isnan(y)
    bad = np.flatnonzero(nan_ref != nan_y)
    assert bad.size == 0, f"{fn}: NaN mismatch at x={x[bad[:5]]}: got {y[bad[:5]]}, want {ref[bad[:5]]}"
    ok = ~nan_ref
    inf = ok & (np.isinf(ref) | np.isinf(y))
    bad = np.flatnonzero(inf & (ref != y))
    assert bad.size == 0, f"{fn}: inf mismatch at x={x[bad[:5]]}: got {y[bad[:5]]}, want {ref[bad[:5]]}"
    zero = ok & (ref == 0) & (y == 0)
    bad = np.flatnonzero(zero & (np.signbit(ref) != np.signbit(y)))
    assert bad.size == 0, f"{fn}: sign of zero at x={x[bad[:5]]}"
    fin = ok & ~inf
    dist = np.abs(ordered(y[fin]) - ordered(ref[fin]))
    worst = int(np.argmax(dist)) if dist.size else 0
    assert (
        dist.size == 0 or dist[worst] <= MAX_ULPS
    ), f"{fn}: {dist[worst]} ulps at x={x[fin][worst]!r}: got {y[fin][worst]!r}, want {ref[fin][worst]!r}"


# --------------------------------------------------------------------------- compile / vectorize


def test_header_compiles_without_warnings(builds):
    for name, (_, stderr, _) in builds.items():
        assert stderr == "", f"{name}:\n{stderr}"


def test_driver_loops_are_vectorized(builds):
    """The six dg::math loops of math_driver.cpp's `apply` are vectorized (the libm ones cannot be)."""
    line = next(i for i, s in enumerate(DRIVER_SRC.read_text().splitlines(), 1) if "= F{}(x[i + j])" in s)
    for name, (_, _, report) in builds.items():
        hits = re.findall(rf"math_driver\.cpp:{line}:\d+: optimized: loop vectorized", report)
        assert len(hits) == len(FUNCS), f"{name}: {len(hits)} loops vectorized:\n{report}"


KERNEL = """
#include "dg_math.h"
{loops}
void sigmoid_like(const float* x, float* h, long n) {{
    for (long i0 = 0; i0 < n; ++i0) h[i0] = (1.0F + dg::math::tanh_f(0.5F * x[i0])) / 2;
}}
struct momentum_hyper {{ float lr; float momentum; float weight_decay; }};
void momentum_update_like(float* w, const float* g, float* buf, long n, momentum_hyper hyper) {{
    for (long i = 0; i < n; ++i) {{ const float new_buf = dg::math::flush_subnormal_f(buf[i] * hyper.momentum + g[i]);
        buf[i] = new_buf; w[i] = w[i] - hyper.lr * new_buf; }}
}}
"""
LOOP = "void k_{f}(const float* x, float* y, long n) {{ for (long i = 0; i < n; ++i) y[i] = dg::math::{f}_f(x[i]); }}"


@pytest.mark.parametrize(
    "flags,width",
    [
        (["-O3", "-mavx2", "-mfma"], 32),
        (["-O3"], 16),
        (["-O3", "-mavx2", "-mfma", "-std=gnu++17"], 32),
        (["-O3", *BUILDS["avx512"]], 64),
    ],
    ids=["O3-avx2-fma", "O3-sse2", "O3-avx2-fma-gnu++17", "O3-avx512"],
)
def test_plain_loops_are_vectorized(tmp_path, flags, width):
    """Loops shaped like the generated elementwise kernels vectorize under GCC's default
    -ftrapping-math (no -ffast-math)."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    src = tmp_path / "kernels.cpp"
    loops = "\n".join(LOOP.format(f=f) for f in FUNCS)
    src.write_text(KERNEL.format(loops=loops))
    cmd = ["g++", "-std=c++17", *flags, "-I", str(RUNTIME_DIR), "-c", str(src), "-o", str(tmp_path / "k.o")]
    proc = subprocess.run([*cmd, "-fopt-info-vec-optimized"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    lines = src.read_text().splitlines()
    for name in [f"k_{f}" for f in FUNCS] + ["sigmoid_like", "momentum_update_like"]:
        n = next(i for i, s in enumerate(lines, 1) if f" {name}(" in s) + (not name.startswith("k_"))
        assert re.search(
            rf"kernels\.cpp:{n}:\d+: optimized: loop vectorized using {width} byte vectors", proc.stderr
        ), f"{name} (line {n}) not vectorized with {flags}:\n{proc.stderr}"
    obj = subprocess.run(["objdump", "-d", str(tmp_path / "k.o")], capture_output=True, text=True)
    if obj.returncode == 0:  # no calls left (no libm, no out-of-line helpers)
        assert "call" not in obj.stdout


# --------------------------------------------------------------------------- accuracy: libm sweeps

# Windows swept densely (every float when there are at most WINDOW_POINTS, else a stride):
# where the methods switch, saturate or under/overflow, near 0 (relative accuracy) and in the
# subnormals.  a and b have the same sign.
WINDOW_POINTS = 400_000
TINY = [(1e-45, 1e-37), (-1e-45, -1e-37), (1e-37, 1e-3), (-1e-37, -1e-3)]
WINDOWS = {
    "exp": [(88.0, 89.0), (-86.5, -88.0), (-102.0, -105.0), (0.33, 0.36), (-0.33, -0.36), (1.0, 2.0)] + TINY,
    "expm1": [
        (0.33, 0.36),
        (-0.33, -0.36),
        (0.3, 1.1),
        (-0.6, -1.1),
        (16.0, 22.0),
        (88.0, 89.0),
        (-15.0, -31.0),
    ]
    + TINY,
    "log": [(0.7, 0.72), (1.4, 1.42), (0.99, 1.01), (1e-45, 1.2e-38), (3.3e38, 3.4028235e38), (0.3, 3.0)],
    "log1p": [(-0.28, -0.3), (0.41, 0.42), (-0.999, -1.0), (1.0, 3.0), (1.6e7, 1.7e7), (3.3e7, 3.4e7)] + TINY,
    "tanh": [(0.6, 0.65), (-0.6, -0.65), (8.9, 9.6), (0.1, 3.0)] + TINY,
    "erf": [(0.98, 1.02), (-0.98, -1.02), (3.85, 4.1), (1.0, 4.0), (0.1, 1.0)] + TINY,
    # saturation to 1 near 16.6, underflow into the subnormals and to 0 (-87.3 .. -103.9), and 0
    "sigmoid": [(15.0, 18.0), (-86.0, -88.0), (-100.0, -105.0), (-0.5, -3.0), (0.5, 3.0)] + TINY,
}


def window_ranges(fn: str) -> list[tuple[int, int, int]]:
    out = []
    for a, b in WINDOWS[fn]:
        start, end = interval_bits(a, b)
        out.append((start, end, max(1, (end - start) // WINDOW_POINTS)))
    return out


@pytest.mark.parametrize("fn", FUNCS)
def test_dense_sweep_vs_libm(driver, fn):
    """Every float with bit pattern = 0 mod FULL_STRIDE (2.1M per function), and the windows."""
    for start, end, stride in [(0, 1 << 32, FULL_STRIDE)] + window_ranges(fn):
        st = driver.sweep(fn, start, end, stride)
        where = f"{fn} bits [{start:#x}, {end:#x}) stride {stride}"
        assert (
            st["special_fail"] == 0
        ), f"{where}: NaN/inf/zero-sign mismatch at x bits {st['special_fail_at']:#010x}"
        assert (
            st["max_dist"] <= MAX_ULPS
        ), f"{where}: {st['max_dist']} ulps at x bits {st['max_dist_at']:#010x}"
        assert (
            st["max_ulp"] <= MAX_ERR_OF.get(fn, MAX_ERR)
        ), f"{where}: error {st['max_ulp']} ulp at x bits {st['max_ulp_at']:#010x}"


# --------------------------------------------------------------------------- accuracy: numpy oracle


def sample(fn: str) -> np.ndarray:
    """~200k floats: a strided pass over all bit patterns plus random points of the windows."""
    rng = np.random.default_rng(12345)
    allbits = np.arange(7, 1 << 32, 40009, dtype=np.uint64).astype(np.uint32)
    parts = [allbits.view(np.float32)]
    for start, end, _ in window_ranges(fn):
        parts.append(rng.integers(start, end, 8000, dtype=np.uint64).astype(np.uint32).view(np.float32))
    return np.concatenate(parts)


@pytest.mark.parametrize("fn", FUNCS)
def test_sample_vs_numpy(driver, fn):
    x = sample(fn)
    assert_close(fn, x, driver.eval(fn, x))


@pytest.mark.parametrize("fn", FUNCS)
def test_libm_oracle_agrees_with_numpy(driver, fn):
    """The sweeps' oracle (the driver's double-precision libm) matches numpy's float64 values."""
    x = sample(fn)[::16]
    x = x[np.isfinite(x)]
    proc = subprocess.run([*driver.runner, str(driver.exe), "ref", fn], input=x.tobytes(), capture_output=True,
                          timeout=driver.timeout)
    assert proc.returncode == 0, proc.stderr.decode()
    got = np.frombuffer(proc.stdout, dtype=np.float64)
    with np.errstate(all="ignore"):
        want = ORACLE[fn](x.astype(np.float64))
    assert np.array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_allclose(got[ok], want[ok], rtol=1e-14, atol=1e-300)


# --------------------------------------------------------------------------- special values

INF, NAN = float("inf"), float("nan")
MIN_SUB = 1e-45  # 2^-149
FLT_MAX = 3.4028235e38
LARGEST_FINITE_EXP = float(np.uint32(0x42B17217).view(np.float32))  # 88.72283...: exp rounds to < inf
SMALLEST_OVERFLOW_EXP = float(np.uint32(0x42B17218).view(np.float32))

# (function, x, expected) compared exactly: NaN is any NaN, zeros by sign.
EXACT = [
    ("exp", NAN, NAN),
    ("exp", INF, INF),
    ("exp", -INF, 0.0),
    ("exp", 0.0, 1.0),
    ("exp", -0.0, 1.0),
    ("exp", LARGEST_FINITE_EXP, 3.4027e38),
    ("exp", SMALLEST_OVERFLOW_EXP, INF),
    ("exp", 1000.0, INF),
    ("exp", FLT_MAX, INF),
    ("exp", -1000.0, 0.0),
    ("exp", -FLT_MAX, 0.0),
    ("exp", -105.0, 0.0),
    ("exp", -103.5, MIN_SUB),
    ("exp", -87.5, 9.8e-39),
    ("expm1", NAN, NAN),
    ("expm1", INF, INF),
    ("expm1", -INF, -1.0),
    ("expm1", 0.0, 0.0),
    ("expm1", -0.0, -0.0),
    ("expm1", SMALLEST_OVERFLOW_EXP, INF),
    ("expm1", LARGEST_FINITE_EXP, 3.4027e38),
    ("expm1", 1000.0, INF),
    ("expm1", -20.0, -1.0),
    ("expm1", -1000.0, -1.0),
    ("expm1", MIN_SUB, MIN_SUB),
    ("expm1", -MIN_SUB, -MIN_SUB),
    ("expm1", 1e-30, 1e-30),
    ("log", NAN, NAN),
    ("log", INF, INF),
    ("log", -INF, NAN),
    ("log", 0.0, -INF),
    ("log", -0.0, -INF),
    ("log", -1.0, NAN),
    ("log", -MIN_SUB, NAN),
    ("log", 1.0, 0.0),
    ("log", MIN_SUB, -103.27893),
    ("log", FLT_MAX, 88.72284),
    ("log1p", NAN, NAN),
    ("log1p", INF, INF),
    ("log1p", -INF, NAN),
    ("log1p", -1.0, -INF),
    ("log1p", -1.0000001, NAN),
    ("log1p", -2.0, NAN),
    ("log1p", 0.0, 0.0),
    ("log1p", -0.0, -0.0),
    ("log1p", MIN_SUB, MIN_SUB),
    ("log1p", -MIN_SUB, -MIN_SUB),
    ("log1p", FLT_MAX, 88.72284),
    ("tanh", NAN, NAN),
    ("tanh", INF, 1.0),
    ("tanh", -INF, -1.0),
    ("tanh", 0.0, 0.0),
    ("tanh", -0.0, -0.0),
    ("tanh", 9.1, 1.0),
    ("tanh", -20.0, -1.0),
    ("tanh", FLT_MAX, 1.0),
    ("tanh", MIN_SUB, MIN_SUB),
    ("tanh", -MIN_SUB, -MIN_SUB),
    ("erf", NAN, NAN),
    ("erf", INF, 1.0),
    ("erf", -INF, -1.0),
    ("erf", 0.0, 0.0),
    ("erf", -0.0, -0.0),
    ("erf", 4.0, 1.0),
    ("erf", -5.0, -1.0),
    ("erf", FLT_MAX, 1.0),
    ("erf", -FLT_MAX, -1.0),
    ("sigmoid", NAN, NAN),
    ("sigmoid", INF, 1.0),
    ("sigmoid", -INF, 0.0),
    ("sigmoid", 0.0, 0.5),
    ("sigmoid", -0.0, 0.5),
    ("sigmoid", 17.0, 1.0),
    ("sigmoid", FLT_MAX, 1.0),
    ("sigmoid", -FLT_MAX, 0.0),
    ("sigmoid", -105.0, 0.0),
    ("sigmoid", -103.0, 1e-45),
    ("sigmoid", -90.0, 8.194e-40),
]


def _same(got: np.float32, want: np.float32) -> bool:
    if np.isnan(want):
        return bool(np.isnan(got))
    return bool(got == want) and np.signbit(got) == np.signbit(want)


@pytest.mark.parametrize("fn", FUNCS)
def test_special_values(driver, fn):
    cases = [(x, e) for f, x, e in EXACT if f == fn]
    x = np.array([c[0] for c in cases], dtype=np.float32)
    y = driver.eval(fn, x)
    for (xi, want), got in zip(cases, y):
        want = f32(want)
        if np.isfinite(want) and want not in (0.0, 1.0, -1.0) and abs(want) > MIN_SUB:
            # a rounded transcendental value: within the bound of the correctly rounded float
            want = oracle(fn, np.array([xi], dtype=np.float32))[0]
            assert abs(int(ordered(np.array([got]))[0] - ordered(np.array([want]))[0])) <= MAX_ULPS, (
                fn,
                xi,
                got,
            )
        else:
            assert _same(got, want), f"{fn}({xi!r}) = {got!r}, want {want!r}"


# Arguments where the result must keep full relative accuracy (tests/test_arm64.py runs them too).
TINY_ARGUMENTS = [
    ("tanh", 1e-6),
    ("tanh", -3e-7),
    ("tanh", 1e-20),
    ("expm1", 1e-6),
    ("expm1", -2.5e-8),
    ("expm1", 1e-10),
    ("log1p", 1e-6),
    ("log1p", -1e-7),
    ("log1p", 3e-9),
    ("erf", 1e-6),
    ("erf", -1e-20),
    ("erf", 1e-40),
    ("log", 1.0000001),
    ("log", 0.99999994),
    ("exp", 1e-7),
    ("exp", -1e-7),
    ("sigmoid", -87.0),
    ("sigmoid", -95.0),
]


@pytest.mark.parametrize("fn,x", TINY_ARGUMENTS)
def test_tiny_arguments_relative_accuracy(driver, fn, x):
    """Near 0 the result keeps full relative accuracy (e.g. tanh(1e-6) within 2 ulp)."""
    xs = np.array([x], dtype=np.float32)
    got, want = driver.eval(fn, xs)[0], oracle(fn, xs)[0]
    assert want != 0
    assert abs(int(ordered(np.array([got]))[0] - ordered(np.array([want]))[0])) <= MAX_ULPS, (got, want)


def test_tail_lengths_and_subnormal_inputs(driver):
    """Lengths that are not a multiple of the vector width, and every subnormal power of 2."""
    x = np.concatenate([(np.uint32(1) << np.arange(23, dtype=np.uint32)).view(np.float32), [np.float32(1.5)]])
    x = np.concatenate([x, -x])
    for n in (1, 3, 7, 17, 23, 46):
        for fn in FUNCS:
            assert_close(fn, x[:n], driver.eval(fn, x[:n]))
