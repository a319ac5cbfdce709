"""The CUDA runtime's convolutions and pools (targets/cuda/runtime/dg_cuda_conv.h)
against torch.nn.functional, outputs and autograd gradients.

tests/cuda_conv_driver.cpp runs the ops on cases written here: built with the
C++ compiler and DG_CUDA_EMULATE (every kernel body, the tile kernel's phases
included, runs as host loops), and on a machine with a GPU with nvcc. Each
convolution runs three ways: the public functions (which pick a way by the
geometry), the direct per-element lambdas and the tile kernel. The header is
also compiled by nvcc for sm_90 where nvcc is present.
"""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ROOT / "targets" / "cuda" / "runtime"
CPU_RUNTIME = ROOT / "targets" / "cpu" / "runtime"
DRIVER = ROOT / "tests" / "cuda_conv_driver.cpp"

from test_cuda import COMPILE_ARCH, GPU, NVCC  # noqa: E402  (one way to find nvcc and a GPU)

needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (the CUDA toolkit is not installed)")
needs_gpu = pytest.mark.skipif(
    not GPU or NVCC is None,
    reason="no GPU here (set DEEPGEN_GPU=1 on a machine with one and nvcc)",
)
MODES = [pytest.param("emulated", id="emulated"), pytest.param("gpu", id="gpu", marks=needs_gpu)]
TOL = 1e-4
PATHS = {"auto": 0, "direct": 1, "tiled": 2}


def _out(size, k, s, p, d):
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


@dataclass(frozen=True)
class Conv:
    name: str
    N: int
    C: int
    H: int
    W: int
    O: int
    K: tuple = (3, 3)
    stride: tuple = (1, 1)
    pad: tuple = (0, 0)
    dil: tuple = (1, 1)
    groups: int = 1
    bias: bool = True

    def geom(self):
        OH = _out(self.H, self.K[0], self.stride[0], self.pad[0], self.dil[0])
        OW = _out(self.W, self.K[1], self.stride[1], self.pad[1], self.dil[1])
        return [
            self.N,
            self.C,
            self.H,
            self.W,
            self.O,
            *self.K,
            OH,
            OW,
            *self.stride,
            *self.pad,
            *self.dil,
            self.groups,
        ]


@dataclass(frozen=True)
class Pool:
    name: str
    kind: str  # "max" or "avg"
    N: int
    C: int
    H: int
    W: int
    K: tuple = (2, 2)
    stride: tuple = (2, 2)
    pad: tuple = (0, 0)
    dil: tuple = (1, 1)
    ties: bool = False
    nan: bool = False

    def geom(self):
        OH = _out(self.H, self.K[0], self.stride[0], self.pad[0], self.dil[0])
        OW = _out(self.W, self.K[1], self.stride[1], self.pad[1], self.dil[1])
        return [
            self.N,
            self.C,
            self.H,
            self.W,
            self.C,
            *self.K,
            OH,
            OW,
            *self.stride,
            *self.pad,
            *self.dil,
            1,
        ]


CONVS = [
    Conv("plain3x3", 2, 3, 7, 6, 4),
    Conv("no_bias", 2, 3, 7, 6, 4, bias=False),
    Conv("stride2_pad1", 2, 4, 9, 8, 5, stride=(2, 2), pad=(1, 1)),
    Conv("asym", 1, 3, 8, 11, 3, K=(2, 3), stride=(2, 1), pad=(1, 0)),
    Conv("dilation2", 2, 3, 9, 9, 4, pad=(2, 1), dil=(2, 2)),
    Conv("groups2", 2, 4, 6, 7, 6, pad=(1, 1), groups=2),
    Conv("depthwise", 2, 4, 8, 8, 4, pad=(1, 1), groups=4),
    Conv("depthwise_x2_stride2", 1, 3, 9, 7, 6, stride=(2, 2), pad=(1, 1), groups=3, bias=False),
    Conv("pointwise", 2, 5, 4, 5, 7, K=(1, 1)),
    Conv("pointwise_groups", 2, 6, 3, 3, 4, K=(1, 1), groups=2, bias=False),
    Conv("1x1_stride2", 2, 3, 7, 7, 4, K=(1, 1), stride=(2, 2)),
    Conv("kernel_equals_input", 2, 3, 4, 4, 5, K=(4, 4)),
    # Crosses the 64x64 tiles and the 16 steps; Og >= 16 so the public path tiles.
    Conv("tiles_groups2", 2, 8, 9, 10, 70, pad=(1, 1), groups=2),
    Conv("tiles_big_k", 1, 20, 6, 6, 20, stride=(2, 2), pad=(1, 1)),
    # Weight gradients split along K (images * OH * OW >= 512) into workspace slices.
    Conv("slices_tiled", 2, 4, 16, 16, 16, pad=(1, 1)),
    Conv("slices_direct", 2, 4, 16, 16, 4, pad=(1, 1), groups=4),
    Conv("batch0", 0, 3, 5, 5, 4, pad=(1, 1)),
]

POOLS = [
    Pool("max2x2", "max", 2, 3, 6, 7),
    Pool("max3x3_s2_pad1_ties", "max", 2, 3, 7, 8, K=(3, 3), pad=(1, 1), ties=True),
    Pool("max3x3_s1_pad1_ties", "max", 1, 2, 5, 5, K=(3, 3), stride=(1, 1), pad=(1, 1), ties=True),
    Pool("max_dilation2", "max", 1, 2, 8, 8, K=(2, 2), stride=(1, 1), dil=(2, 2), ties=True),
    Pool("max_nan", "max", 2, 2, 6, 6, K=(3, 3), stride=(2, 2), pad=(1, 1), nan=True),
    Pool("avg2x2", "avg", 2, 3, 6, 7),
    Pool("avg3x3_s2_pad1", "avg", 2, 3, 7, 8, K=(3, 3), pad=(1, 1)),
    Pool("avg3x2_s1_pad1", "avg", 1, 2, 5, 6, K=(3, 2), stride=(1, 2), pad=(1, 1)),
]


# -- building and running the driver ---------------------------------------------


def _driver(mode: str, tmp: Path) -> Path:
    headers = sorted(RUNTIME.glob("*.h")) + sorted(CPU_RUNTIME.glob("*.h"))
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in [DRIVER] + headers)).hexdigest()[:16]
    exe = tmp / f"cuda-conv-driver-{mode}-{digest}"
    if exe.is_file():
        return exe
    includes = ["-I", str(RUNTIME), "-I", str(CPU_RUNTIME)]
    if mode == "emulated":
        cmd = [
            os.environ.get("CXX", "g++"),
            "-std=c++17",
            "-O1",
            "-Wall",
            "-Wextra",
            "-DDG_CUDA_EMULATE",
            *includes,
            "-x",
            "c++",
            str(DRIVER),
            "-o",
            str(exe),
        ]
    else:
        arch = os.environ.get("DEEPGEN_CUDA_ARCHS", "native").split(";")[0].replace("-real", "")
        arch_flag = "-arch=native" if arch == "native" else f"-arch=sm_{arch}"
        cmd = [
            NVCC,
            "-std=c++17",
            "-O2",
            "--extended-lambda",
            arch_flag,
            *includes,
            "-x",
            "cu",
            str(DRIVER),
            "-o",
            str(exe),
        ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "warning" not in proc.stderr, proc.stderr
    return exe


def _inputs(case, gen):
    """Float64 torch tensors: the case's inputs and the output gradient dy."""

    def rand(*shape):
        return torch.rand(*shape, generator=gen, dtype=torch.float64) * 2 - 1

    g = case.geom()
    N, C, H, W, O, KH, KW, OH, OW = g[:9]
    if isinstance(case, Conv):
        x, w = rand(N, C, H, W), rand(O, C // case.groups, KH, KW)
        b = rand(O) if case.bias else None
        return dict(x=x, w=w, b=b, dy=rand(N, O, OH, OW))
    if case.ties:  # few distinct values: windows with several maxima
        x = torch.randint(0, 3, (N, C, H, W), generator=gen).to(torch.float64)
    else:
        x = rand(N, C, H, W)
    if case.nan:  # one NaN per plane, so no window holds two (torch then takes the last)
        for n in range(N):
            for c in range(C):
                x[n, c, (n + c) % H, (2 * c + 1) % W] = float("nan")
    return dict(x=x, dy=rand(N, C, OH, OW))


def _expected(case, t):
    """(name, float64 array) of each result the driver writes, from torch autograd."""
    x = t["x"].clone().requires_grad_(True)
    if isinstance(case, Conv):
        w = t["w"].clone().requires_grad_(True)
        y = F.conv2d(
            x, w, t["b"], stride=case.stride, padding=case.pad, dilation=case.dil, groups=case.groups
        )
        dx, dw = torch.autograd.grad(y, (x, w), t["dy"], allow_unused=True)
        dx = torch.zeros_like(x) if dx is None else dx
        dw = torch.zeros_like(w) if dw is None else dw
        return [("y", y.detach()), ("dx", dx), ("dw", dw)]
    if case.kind == "max":
        y = F.max_pool2d(x, case.K, case.stride, case.pad, case.dil)
    else:
        y = F.avg_pool2d(x, case.K, case.stride, case.pad, count_include_pad=True)
    (dx,) = torch.autograd.grad(y, (x,), t["dy"])
    return [("y", y.detach()), ("dx", dx)]


def _record(case, t, path):
    kind = 0 if isinstance(case, Conv) else (1 if case.kind == "max" else 2)
    has_bias = int(isinstance(case, Conv) and t["b"] is not None)
    head = struct.pack("<19q", kind, has_bias, path, *case.geom())
    names = ["x", "w", "b", "dy"] if kind == 0 else ["x", "dy"]
    arrays = [t[n].numpy().astype("<f4").tobytes() for n in names if t.get(n) is not None]
    return head + b"".join(arrays)


def _run_cases(mode, tmp_path, runs):
    """runs: (label, case, path); returns {label: [(name, got, want)]}."""
    exe = _driver(mode, tmp_path)
    gen = torch.Generator().manual_seed(7)
    records, expected = [], []
    for label, case, path in runs:
        t = _inputs(case, gen)
        records.append(_record(case, t, path))
        expected.append((label, _expected(case, t)))
    cases, results = tmp_path / "cases.bin", tmp_path / "results.bin"
    cases.write_bytes(b"".join(records))
    proc = subprocess.run([str(exe), str(cases), str(results)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stdout + proc.stderr
    got = np.frombuffer(results.read_bytes(), dtype="<f4")
    out, at = {}, 0
    for label, arrays in expected:
        out[label] = []
        for name, want in arrays:
            want = want.numpy()
            out[label].append((name, got[at : at + want.size].reshape(want.shape), want))
            at += want.size
    assert at == got.size, "the driver wrote a different number of values"
    return out


def _check(label, results):
    for name, got, want in results:
        assert got.shape == want.shape
        bad = ~np.isclose(got, want, rtol=TOL, atol=TOL, equal_nan=True)
        if bad.any():
            i = np.argwhere(bad)[0]
            raise AssertionError(
                f"{label} {name}: {bad.sum()} of {want.size} differ, first at {tuple(i)}: "
                f"{got[tuple(i)]} vs torch {want[tuple(i)]}"
            )


@pytest.fixture(scope="module", params=MODES)
def results(request, tmp_path_factory):
    runs = [(f"{c.name}[{p}]", c, n) for c in CONVS for p, n in PATHS.items()]
    runs += [(p.name, p, 0) for p in POOLS]
    return _run_cases(request.param, tmp_path_factory.mktemp(f"conv-{request.param}"), runs)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case", CONVS, ids=lambda c: c.name)
def test_conv2d_matches_torch(results, case, path):
    _check(f"{case.name}[{path}]", results[f"{case.name}[{path}]"])


@pytest.mark.parametrize("case", POOLS, ids=lambda c: c.name)
def test_pool_matches_torch(results, case):
    _check(case.name, results[case.name])


@needs_nvcc
def test_header_compiles_with_nvcc(tmp_path):
    """Every op of the header, instantiated by the driver, compiles for sm_90
    (device code through ptxas) without a warning."""
    cmd = [
        NVCC,
        "-std=c++17",
        "-O0",
        "--extended-lambda",
        f"-arch=sm_{COMPILE_ARCH}",
        "-I",
        str(RUNTIME),
        "-I",
        str(CPU_RUNTIME),
        "-x",
        "cu",
        "-c",
        str(DRIVER),
        "-o",
        str(tmp_path / "driver.o"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "warning" not in proc.stderr.lower(), proc.stderr
