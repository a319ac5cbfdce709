"""Tests for targets/cpu/runtime/dg_conv.h: 2-D convolution and pooling (NCHW).

tests/conv_runtime_driver.cpp, which calls every function of the header on
raw float32 arrays (stdin to stdout), is compiled once per session for this
machine (-march=native) and, where that is AVX-512, once more for AVX2 only,
since dg::gemm's micro-kernel (and so the tile edges im2col's columns meet)
differs between the two.  Each case is compared with torch.nn.functional and
torch.autograd.  The driver starts outputs and the workspace as NaN and
guards the workspace's end, so a value not written or a write past the size
conv2d_workspace gives fails here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from conftest import cpu_flags

torch = pytest.importorskip("torch")
F = torch.nn.functional

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_DIR = ROOT / "targets" / "cpu" / "runtime"
DRIVER_SRC = Path(__file__).resolve().parent / "conv_runtime_driver.cpp"
CXX_FLAGS = ["-std=c++17", "-O2", "-fopenmp", "-Wall", "-Wextra"]
GUARD_EXIT = 4  # the driver's exit status for a write past the workspace


def _builds() -> dict[str, list[str]]:
    """Build name -> its ISA flags: native, plus AVX2-only on an AVX-512 machine."""
    builds = {"native": ["-march=native"]}
    flags = cpu_flags()
    if "avx512f" in flags and {"avx2", "fma"} <= flags:
        builds["avx2"] = ["-march=native", "-mno-avx512f", "-mavx2", "-mfma"]
    return builds


BUILDS = _builds()


class Driver:
    """Runs one compiled driver: ``driver(op, geom, *extra, inputs=[arrays])``."""

    def __init__(self, exe: Path, name: str):
        self.exe = exe
        self.name = name

    def run(self, op, geom, *extra, inputs=(), threads=1) -> subprocess.CompletedProcess:
        stdin = b"".join(np.ascontiguousarray(a, dtype=np.float32).tobytes() for a in inputs)
        cmd = [str(self.exe), op, *[str(v) for v in geom.args()], *[str(v) for v in extra]]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        return subprocess.run(cmd, input=stdin, capture_output=True, timeout=60, env=env)

    def __call__(self, op, geom, *extra, inputs=(), threads=1) -> np.ndarray:
        proc = self.run(op, geom, *extra, inputs=inputs, threads=threads)
        assert proc.returncode == 0, (proc.returncode, proc.stderr.decode())
        return np.frombuffer(proc.stdout, dtype=np.float32)


@pytest.fixture(scope="session")
def compiled(tmp_path_factory) -> dict[str, Driver]:
    """Every build of the driver, compiled once per session (in parallel)."""
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("g++ not found: cannot compile the conv runtime tests")
    tmp = tmp_path_factory.mktemp("conv_runtime")

    def build(item):
        name, isa = item
        exe = tmp / f"conv_runtime_driver_{name}"
        cmd = [cxx, *CXX_FLAGS, *isa, "-I", str(RUNTIME_DIR), str(DRIVER_SRC), "-o", str(exe)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 0, f"compile failed:\n{' '.join(cmd)}\n{proc.stderr}"
        assert "warning" not in proc.stderr, proc.stderr
        return name, Driver(exe, name)

    with ThreadPoolExecutor(len(BUILDS)) as pool:
        return dict(pool.map(build, BUILDS.items()))


@pytest.fixture(params=list(BUILDS))
def driver(request, compiled) -> Driver:
    return compiled[request.param]


# --------------------------------------------------------------------------- geometry


class Geom:
    """A dg::Conv2dGeom with the output size PyTorch gives (floor mode)."""

    def __init__(self, N, C, H, W, O, KH, KW, stride=1, pad=0, dil=1, groups=1):
        pair = lambda v: tuple(v) if isinstance(v, (tuple, list)) else (v, v)  # noqa: E731
        self.N, self.C, self.H, self.W, self.O, self.KH, self.KW = N, C, H, W, O, KH, KW
        self.stride, self.pad, self.dil, self.groups = pair(stride), pair(pad), pair(dil), groups
        self.OH = (H + 2 * self.pad[0] - self.dil[0] * (KH - 1) - 1) // self.stride[0] + 1
        self.OW = (W + 2 * self.pad[1] - self.dil[1] * (KW - 1) - 1) // self.stride[1] + 1

    def args(self):
        return [self.N, self.C, self.H, self.W, self.O, self.KH, self.KW, self.OH, self.OW,
                self.stride[0], self.stride[1], self.pad[0], self.pad[1], self.dil[0], self.dil[1],
                self.groups]

    def __repr__(self):
        return (f"N{self.N}C{self.C}_{self.H}x{self.W}_O{self.O}_k{self.KH}x{self.KW}"
                f"_s{self.stride}_p{self.pad}_d{self.dil}_g{self.groups}")


def pool_geom(N, C, H, W, K, stride, pad, dil=1):
    k = K if isinstance(K, tuple) else (K, K)
    return Geom(N, C, H, W, C, k[0], k[1], stride, pad, dil, 1)


def close(got, want, rtol=1e-4):
    """float32 agreement up to rtol of the result's scale."""
    want = want.detach().numpy().astype(np.float32)
    got = got.reshape(want.shape)
    scale = max(1.0, float(np.abs(want).max(initial=0.0)))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale)


def randn(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float32)


# --------------------------------------------------------------------------- convolutions

CONV_CASES = [
    Geom(1, 3, 8, 8, 4, 3, 3),                            # plain, no padding
    Geom(3, 4, 9, 7, 5, 3, 3, pad=1),                     # padding 1, N=3, odd sizes
    Geom(2, 3, 11, 10, 6, 3, 3, stride=2, pad=1),         # stride 2
    Geom(2, 3, 12, 12, 4, 3, 3, stride=2),                # stride 2, no padding
    Geom(1, 2, 12, 11, 3, 3, 3, pad=2, dil=2),            # dilation 2
    Geom(2, 4, 9, 9, 6, 3, 3, pad=1, groups=2),           # groups 2
    Geom(2, 6, 10, 10, 9, 3, 2, stride=(2, 1), pad=(1, 0), groups=3),  # groups 3, rectangular
    Geom(3, 5, 8, 9, 5, 3, 3, pad=1, groups=5),           # depthwise (direct loops)
    Geom(2, 4, 10, 9, 8, 3, 3, stride=2, pad=1, groups=4),  # depthwise, multiplier 2 (direct)
    Geom(1, 3, 13, 12, 3, 5, 3, stride=(1, 2), pad=(2, 1), dil=(1, 2), groups=3),  # depthwise, mixed
    Geom(2, 3, 20, 37, 3, 3, 3, pad=1, groups=3),        # depthwise, wide rows (vectorized along them)
    Geom(1, 4, 23, 41, 8, 5, 5, stride=2, pad=2, groups=4),  # depthwise wide, stride 2, multiplier 2
    Geom(1, 2, 19, 60, 2, 3, 5, stride=(1, 3), pad=(3, 1), dil=(2, 1), groups=2),  # wide, stride 3, pad > overlap
    Geom(2, 20, 6, 7, 20, 3, 3, pad=1, groups=20),        # depthwise narrow, 20 channels: a partial lane block
    Geom(2, 2, 9, 8, 16, 3, 3, pad=1, groups=2),          # one channel per group, 8 outputs (GEMM)
    Geom(2, 1, 10, 10, 8, 5, 5, pad=2),                   # one input channel, GEMM path
    Geom(1, 1, 7, 7, 2, 3, 3, pad=1),                     # one input channel, direct path
    Geom(1, 8, 6, 5, 12, 1, 1),                           # 1x1 pointwise
    Geom(3, 6, 5, 7, 4, 1, 1, groups=2),                  # pointwise, groups 2
    Geom(2, 4, 5, 5, 4, 1, 1, groups=4),                  # pointwise depthwise
    Geom(2, 4, 9, 9, 6, 1, 1, stride=2),                  # 1x1 stride 2: not pointwise
    Geom(1, 4, 7, 7, 5, 1, 1, pad=1),                     # 1x1 padded: not pointwise
    Geom(2, 3, 7, 9, 4, 2, 5, pad=(0, 2)),                # rectangular kernel
    Geom(1, 2, 6, 6, 3, 6, 6),                            # kernel covers the whole input
    Geom(1, 2, 4, 4, 3, 3, 3, pad=2),                     # padding wider than the overlap
    Geom(1, 3, 5, 6, 2, 3, 3, stride=3, pad=2, dil=2),    # stride 3 and dilation
    Geom(2, 16, 12, 12, 40, 3, 3, pad=1),                 # more rows than one GEMM tile
    Geom(2, 40, 2, 2, 70, 1, 1),                          # 2x2 output planes: the GEMM transposed
    Geom(1, 6, 3, 5, 8, 3, 3, stride=2, pad=1, groups=2),  # 2x3 output planes, im2col, groups 2
    Geom(9, 65536, 1, 2, 1, 1, 1),                        # small planes, the batch in two products (scratch cap)
]


def conv_reference(g: Geom, gen, bias: bool):
    """Random x, w, b, dy and torch's y, dx, dw for them."""
    x = randn(gen, g.N, g.C, g.H, g.W).requires_grad_()
    w = randn(gen, g.O, g.C // g.groups, g.KH, g.KW).requires_grad_()
    b = randn(gen, g.O) if bias else None
    y = F.conv2d(x, w, b, stride=g.stride, padding=g.pad, dilation=g.dil, groups=g.groups)
    assert y.shape == (g.N, g.O, g.OH, g.OW)
    dy = randn(gen, *y.shape)
    y.backward(dy)
    return x.detach(), w.detach(), b, dy, y, x.grad, w.grad


@pytest.mark.parametrize("g", CONV_CASES, ids=repr)
def test_conv2d(driver, g):
    gen = torch.Generator().manual_seed(7)
    for bias in (True, False):
        x, w, b, dy, y, dx, dw = conv_reference(g, gen, bias)
        inputs = [x, w] + ([b] if bias else [])
        close(driver("conv2d", g, int(bias), inputs=inputs), y)
    close(driver("conv2d_grad_input", g, inputs=[dy, w]), dx)
    close(driver("conv2d_grad_weight", g, inputs=[x, dy]), dw)


@pytest.mark.parametrize("g", CONV_CASES, ids=repr)
def test_conv2d_batch_norm_equals_the_two_calls(driver, g):
    """dg::conv2d_batch_norm (the conv_batch_norm pass's op): in evaluation mode
    the normalization in the convolution's epilogue gives conv2d then batch_norm's
    bits; in training mode too (the two calls, batch norm in place); both near
    PyTorch's conv2d + batch_norm, running statistics included. The same with the
    residual add and the relu the pass folds after the batch norm."""
    gen = torch.Generator().manual_seed(5)
    # (bias, training, residual, relu): the tail the pass folds (residual add, relu) in both modes
    for bias, training, residual, relu in [(True, False, False, False), (False, False, False, False),
                                           (True, True, False, False), (False, False, False, True),
                                           (True, False, True, True), (False, True, True, True),
                                           (False, False, True, False)]:
        x, w, b, _, y, _, _ = conv_reference(g, gen, bias)
        if training and g.N * g.OH * g.OW < 2:
            continue
        bn_w, bn_b, rm = randn(gen, g.O), randn(gen, g.O), randn(gen, g.O)
        rv = torch.rand(g.O, generator=gen, dtype=torch.float32) + 0.5
        r = randn(gen, *y.shape)
        inputs = [x, w] + ([b] if bias else []) + [bn_w, bn_b, rm, rv] + ([r] if residual else [])
        out = driver("conv2d_batch_norm", g, int(bias), int(training), int(residual), int(relu), inputs=inputs)
        n = y.numel()
        fused, plain, stats = out[:n], out[n : 2 * n], out[2 * n :].reshape(4, g.O)
        np.testing.assert_array_equal(fused, plain)
        np.testing.assert_array_equal(stats[:2], stats[2:])
        rm_t, rv_t = rm.clone(), rv.clone()
        want = F.batch_norm(y, rm_t, rv_t, bn_w, bn_b, training=training, momentum=0.1, eps=1e-5)
        want = F.relu(want + r if residual else want) if relu else (want + r if residual else want)
        close(fused.reshape(want.shape), want)
        close(stats[0], rm_t)
        close(stats[1], rv_t)


# Small output planes of one group: the weight read through a dg::KeptPackedB
# (conv_detail::kept_plane), whatever its size. Above kSmallPlaneWeight (2^18
# floats) the packing is streamed by the micro-kernel (dg_gemm.h,
# kStreamPackedRows) where the stored weight goes one product per image.
KEPT_CASES = [
    Geom(2, 40, 2, 2, 70, 1, 1),                    # small weight: conv2d_small either way
    Geom(1, 64, 2, 2, 520, 3, 3, pad=1),            # 520 x 576 weight, 4 positions, 3 K blocks
    Geom(3, 72, 3, 3, 500, 3, 3, stride=2, pad=1),  # 500 x 648, 2x2 planes of 3 images (12 rows)
    Geom(1, 600, 1, 1, 450, 1, 1),                  # 450 x 600, one position: a Linear layer's product
    Geom(2, 300, 2, 4, 900, 1, 1),                  # 900 x 300, 2x4 planes: 16 rows, 3 row panels
]


@pytest.mark.parametrize("g", KEPT_CASES, ids=repr)
def test_conv2d_kept_packing(driver, g):
    """conv2d through a kept packing of the weight (the Model's forward at
    inference) and through its stored weight (a training step) agree with
    PyTorch, and bit for bit with conv2d on the weight as stored: every case has
    more than 3 output rows, so the packed and the per-call products sum each
    output in the same K blocks in the same order."""
    gen = torch.Generator().manual_seed(13)
    for bias in (True, False):
        x, w, b, _, y, _, _ = conv_reference(g, gen, bias)
        inputs = [x, w] + ([b] if bias else [])
        out = driver("conv2d_kept", g, int(bias), inputs=inputs)
        packed, stored = np.split(out, 2)
        close(packed, y)
        plain = driver("conv2d", g, int(bias), inputs=inputs)
        np.testing.assert_array_equal(packed, plain)
        np.testing.assert_array_equal(stored, plain)


# Large enough that every loop and GEMM splits over threads.
THREAD_CASES = [
    Geom(3, 16, 32, 32, 32, 3, 3, pad=1),
    Geom(4, 32, 48, 48, 32, 3, 3, stride=2, pad=1, groups=32),  # depthwise
    Geom(2, 64, 16, 16, 64, 1, 1),  # pointwise
]


@pytest.mark.parametrize("g", THREAD_CASES, ids=repr)
def test_conv2d_threads(driver, g):
    """Two threads: right, and bitwise equal to one thread."""
    gen = torch.Generator().manual_seed(11)
    x, w, b, dy, y, dx, dw = conv_reference(g, gen, True)
    for op, inputs, extra, want in [("conv2d", [x, w, b], [1], y), ("conv2d_grad_input", [dy, w], [], dx),
                                    ("conv2d_grad_weight", [x, dy], [], dw)]:
        one = driver(op, g, *extra, inputs=inputs, threads=1)
        two = driver(op, g, *extra, inputs=inputs, threads=2)
        close(two, want)
        np.testing.assert_array_equal(one, two)


def test_builds_use_their_isa(driver):
    want = {"native": {"avx512", "avx2", "portable"}, "avx2": {"avx2"}}[driver.name]
    proc = subprocess.run([str(driver.exe), "isa"], capture_output=True, text=True)
    assert proc.stdout.strip() in want


def test_conv2d_empty_batch_weight_gradient(driver):
    """N == 0: the weight gradient is all zeros (overwritten, not left as is)."""
    g = Geom(0, 3, 6, 6, 4, 3, 3, pad=1)
    dw = driver("conv2d_grad_weight", g, inputs=[])
    np.testing.assert_array_equal(dw, np.zeros(4 * 3 * 3 * 3, np.float32))


def test_workspace_sizes(driver):
    """The documented formulas (the driver allocates exactly these)."""
    # A case where grad_weight's partial product is bigger than the columns.
    g = Geom(2, 8, 1, 1, 16, 3, 3, pad=1, groups=2)
    gen = torch.Generator().manual_seed(3)
    x, w, b, dy, y, dx, dw = conv_reference(g, gen, False)
    close(driver("conv2d_grad_weight", g, inputs=[x, dy]), dw)


# --------------------------------------------------------------------------- pools

POOL_CASES = [
    pool_geom(1, 2, 8, 8, 2, 2, 0),
    pool_geom(3, 3, 9, 7, 3, 2, 1),        # padding 1, N=3
    pool_geom(2, 2, 10, 11, 3, 1, 1),      # overlapping windows, stride 1
    pool_geom(1, 3, 7, 9, (3, 2), (2, 1), (1, 1)),  # rectangular
    pool_geom(2, 2, 5, 5, 5, 1, 2),        # window bigger than the input, heavy padding
    pool_geom(2, 4, 6, 6, 1, 1, 0),        # 1x1 window: identity
    pool_geom(1, 2, 9, 11, 3, 2, 1, dil=2),  # dilated (max pool only): windows inside and across the edges
]


@pytest.mark.parametrize("g", POOL_CASES, ids=repr)
def test_max_pool2d(driver, g):
    gen = torch.Generator().manual_seed(5)
    x = randn(gen, g.N, g.C, g.H, g.W).requires_grad_()
    y = F.max_pool2d(x, (g.KH, g.KW), g.stride, g.pad, g.dil)
    dy = randn(gen, *y.shape)
    y.backward(dy)
    got = driver("max_pool2d", g, inputs=[x.detach()])
    np.testing.assert_array_equal(got, y.detach().numpy().ravel())
    close(driver("max_pool2d_grad", g, inputs=[x.detach(), y.detach(), dy]), x.grad, rtol=1e-6)


@pytest.mark.parametrize("g", [pool_geom(2, 2, 6, 6, 3, 2, 1), pool_geom(1, 2, 7, 8, 3, 1, 1),
                               pool_geom(1, 1, 4, 4, 2, 2, 0)], ids=repr)
def test_max_pool2d_ties_go_to_first_max(driver, g):
    """Constant input (every position ties) and repeated values: PyTorch's first max."""
    gen = torch.Generator().manual_seed(9)
    for x0 in (torch.full((g.N, g.C, g.H, g.W), 0.5),
               torch.randint(-2, 3, (g.N, g.C, g.H, g.W), generator=gen).float(),
               torch.full((g.N, g.C, g.H, g.W), -3.0)):  # negative: padding must not win
        x = x0.clone().requires_grad_()
        y = F.max_pool2d(x, (g.KH, g.KW), g.stride, g.pad)
        dy = randn(gen, *y.shape)
        y.backward(dy)
        got_y = driver("max_pool2d", g, inputs=[x0])
        np.testing.assert_array_equal(got_y, y.detach().numpy().ravel())
        got = driver("max_pool2d_grad", g, inputs=[x0, y.detach(), dy])
        close(got, x.grad, rtol=1e-6)


def test_max_pool2d_nan_propagates(driver):
    g = pool_geom(1, 1, 4, 4, 2, 2, 0)
    x = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    x[0, 0, 0, 1] = np.nan
    x[0, 0, 3, 3] = np.nan
    y = driver("max_pool2d", g, inputs=[x])
    assert np.isnan(y[0]) and np.isnan(y[3])
    np.testing.assert_array_equal(y[1:3], [7.0, 13.0])
    dx = driver("max_pool2d_grad", g, inputs=[x, y, np.ones(4, np.float32)]).reshape(4, 4)
    assert dx[0, 1] == 1.0 and dx[3, 3] == 1.0 and dx.sum() == 4.0


@pytest.mark.parametrize("g", POOL_CASES, ids=repr)
def test_avg_pool2d(driver, g):
    if g.dil != (1, 1):
        pytest.skip("avg_pool2d has no dilation")
    if 2 * g.pad[0] > g.KH or 2 * g.pad[1] > g.KW:
        pytest.skip("PyTorch needs padding <= half the kernel")
    gen = torch.Generator().manual_seed(6)
    x = randn(gen, g.N, g.C, g.H, g.W).requires_grad_()
    y = F.avg_pool2d(x, (g.KH, g.KW), g.stride, g.pad)  # count_include_pad=True
    dy = randn(gen, *y.shape)
    y.backward(dy)
    close(driver("avg_pool2d", g, inputs=[x.detach()]), y)
    close(driver("avg_pool2d_grad", g, inputs=[dy]), x.grad)


def sized(g, OH, OW):
    """g with the output size set (ceil_mode gives one row or column more than the
    floor; bigger still leaves windows all padding, which Conv2dGeom allows)."""
    g.OH, g.OW = OH, OW
    return g


# Shapes for the bit-for-bit comparison: the AVX-512 path runs 16 outputs of a row
# at a time, stride 1 and 2 by loads, other strides by gathers, masking the lanes
# before and after the row.
MAX_POOL_BIT_CASES = [
    pool_geom(1, 64, 32, 32, 3, 2, 1),            # ResNet's stem pool at 64px: OW 16, one vector
    pool_geom(2, 3, 9, 37, 3, 1, 1),              # stride 1, OW 37: three vectors, the last partial
    pool_geom(1, 2, 11, 16, 3, 1, 0),             # OW 14
    pool_geom(1, 2, 6, 16, 3, 1, 1),              # OW 16: the last lane's window ends past the row
    pool_geom(1, 2, 8, 17, 2, 1, 0),              # OW 16, the loads end at the row's end
    pool_geom(1, 3, 13, 45, 3, 2, 1),             # stride 2, OW 23
    pool_geom(2, 2, 7, 5, 3, 2, 1),               # rows narrower than a vector
    pool_geom(1, 2, 12, 50, 3, 3, 1),             # stride 3 (gather)
    pool_geom(1, 2, 9, 61, (2, 4), (3, 5), (1, 2)),  # stride 5, windows skip positions
    pool_geom(1, 2, 15, 41, 3, 2, 2, dil=2),      # dilation 2, stride 2
    pool_geom(1, 2, 10, 35, 3, 1, 2, dil=2),      # dilation 2, stride 1
    pool_geom(1, 2, 13, 40, 3, 3, 3, dil=(1, 2)),  # dilation 2, stride 3
    pool_geom(1, 3, 9, 33, (2, 5), (1, 2), (0, 2)),  # rectangular
    pool_geom(1, 2, 6, 21, 1, 2, 0),              # 1x1 window, stride 2: every other input
    pool_geom(2, 2, 5, 5, 5, 1, 2),               # window bigger than the input
    pool_geom(1, 2, 8, 19, 3, 1, 3),              # padding 3 > the window's reach: edge windows all padding
    sized(pool_geom(1, 2, 34, 34, 3, 2, 0), 17, 17),  # ceil_mode: the last window cut by the edge
    sized(pool_geom(1, 2, 33, 47, 3, 2, 1), 17, 24),  # ceil_mode with padding
    sized(pool_geom(1, 2, 5, 37, 2, 3, 0), 3, 14),    # ceil_mode, stride 3
    sized(pool_geom(1, 2, 5, 5, 2, 2, 0), 4, 4),      # beyond ceil_mode: windows all padding (-inf)
    sized(pool_geom(1, 2, 6, 30, 3, 2, 1, dil=2), 4, 17),  # dilated, the last windows past the edge
]


def _planted(shape, seed):
    """Random floats with NaNs (random sign and payload), infinities and signed zeros
    planted, as raw uint32 bits."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32).view(np.uint32)
    kind = rng.integers(0, 40, shape)
    nan = 0x7FC00000 | rng.integers(0, 1 << 22, shape, dtype=np.uint32) | (rng.integers(0, 2, shape, dtype=np.uint32) << 31)
    x = np.where(kind == 0, nan, x)
    x = np.where(kind == 1, np.float32(-np.inf).view(np.uint32), x)
    x = np.where(kind == 2, np.float32(np.inf).view(np.uint32), x)
    x = np.where(kind == 3, np.uint32(0), x)
    x = np.where(kind == 4, np.uint32(0x80000000), x)
    return x.astype(np.uint32)


@pytest.mark.parametrize("g", MAX_POOL_BIT_CASES, ids=repr)
def test_max_pool2d_bits_match_plain_loop(driver, g):
    """dg::max_pool2d gives the bits of a plain loop (tests/conv_runtime_driver.cpp's
    max_pool2d_reference): the same maximum, the same signed zero, the last NaN of
    the window with its payload, -inf for a window all padding. Inputs are mostly
    ordinary values, so that the planted ones meet them; once more with many NaNs
    and -infs, and once with every value -inf or 0."""
    shape = (g.N, g.C, g.H, g.W)
    rng = np.random.default_rng(11)
    inputs = [_planted(shape, 0), _planted(shape, 1)]
    dense = _planted(shape, 2)
    dense[rng.integers(0, 3, shape) == 0] = np.float32(np.nan).view(np.uint32)
    dense[rng.integers(0, 3, shape) == 0] = np.float32(-np.inf).view(np.uint32)
    inputs.append(dense)
    inputs.append(np.where(rng.integers(0, 2, shape) == 0, np.float32(-np.inf).view(np.uint32), np.uint32(0)))
    for x in inputs:
        x = x.view(np.float32)
        got = driver("max_pool2d", g, inputs=[x]).view(np.uint32)
        want = driver("max_pool2d_reference", g, inputs=[x]).view(np.uint32)
        assert got.size == g.N * g.C * g.OH * g.OW
        np.testing.assert_array_equal(got, want)
    if g.OH * g.OW > 16:  # two threads: the same bits
        np.testing.assert_array_equal(driver("max_pool2d", g, inputs=[x], threads=2).view(np.uint32), got)


def test_max_pool2d_reference_matches_torch(driver):
    """The plain loop the bits are compared with is PyTorch's max_pool2d (no NaN)."""
    g = pool_geom(2, 3, 11, 23, 3, 2, 1, dil=2)
    x = np.random.default_rng(4).standard_normal((g.N, g.C, g.H, g.W)).astype(np.float32)
    want = F.max_pool2d(torch.from_numpy(x), 3, 2, 1, 2).numpy().ravel()
    np.testing.assert_array_equal(driver("max_pool2d_reference", g, inputs=[x]), want)


def test_max_pool2d_padded_window_bigger_than_input(driver):
    """Padding beyond what PyTorch allows (windows partly outside): still the max of the real inputs."""
    g = pool_geom(2, 2, 5, 5, 5, 1, 2)
    x = np.random.default_rng(0).standard_normal((2, 2, 5, 5)).astype(np.float32)
    y = driver("max_pool2d", g, inputs=[x]).reshape(2, 2, 5, 5)
    want = np.empty_like(y)
    for i in range(5):
        for j in range(5):
            want[:, :, i, j] = x[:, :, max(0, i - 2):i + 3, max(0, j - 2):j + 3].max(axis=(2, 3))
    np.testing.assert_array_equal(y, want)


def test_pools_threads(driver):
    """Pools over many planes: two threads equal one."""
    g = pool_geom(8, 32, 48, 48, 3, 2, 1)
    x = np.random.default_rng(1).standard_normal((8, 32, 48, 48)).astype(np.float32)
    dy = np.random.default_rng(2).standard_normal((8, 32, g.OH, g.OW)).astype(np.float32)
    for op, inputs in [("max_pool2d", [x]), ("avg_pool2d", [x]), ("avg_pool2d_grad", [dy])]:
        np.testing.assert_array_equal(driver(op, g, inputs=inputs, threads=1),
                                      driver(op, g, inputs=inputs, threads=2))
    y = driver("max_pool2d", g, inputs=[x])
    np.testing.assert_array_equal(driver("max_pool2d_grad", g, inputs=[x, y, dy], threads=1),
                                  driver("max_pool2d_grad", g, inputs=[x, y, dy], threads=2))


# --------------------------------------------------------------------------- header hygiene


def test_header_compiles_without_openmp(tmp_path):
    """The header alone, no OpenMP, portable ISA: no warnings."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    src = tmp_path / "only_conv.cpp"
    src.write_text('#include "dg_conv.h"\nint main() {\n'
                   '    constexpr dg::Conv2dGeom g(1, 2, 4, 4, 2, 3, 3, 2, 2, 1, 1, 0, 0, 1, 1, 1);\n'
                   '    static_assert(dg::conv2d_workspace(g) == 2 * 9 * 4, "workspace");\n'
                   '    float x[32] = {}, w[36] = {}, y[8], ws[72];\n'
                   '    dg::conv2d(x, w, nullptr, y, ws, g);\n'
                   '    return y[0] == 0.0f ? 0 : 1;\n}\n')
    cmd = ["g++", "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-I", str(RUNTIME_DIR), str(src),
           "-o", str(tmp_path / "only_conv")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert subprocess.run([str(tmp_path / "only_conv")]).returncode == 0
