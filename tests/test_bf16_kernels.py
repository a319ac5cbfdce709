"""runtime/dg_bf16.h and dg_bf16_conv.h: the bf16 products (and convolutions) of a
--precision bf16 model on every path this CPU has (AMX tiles, vdpbf16ps, and the float32 products of rounded operands that
CPUs without bf16 instructions run), against float64 products of the same bf16
values (the activations come rounded, as the generated code passes them; the kept
weight rounds the weight). Every path multiplies the same bf16 values exactly; the float32 sums differ
from one another only in the order of their additions, which the tolerance bounds:
(K + 1) * 2^-24 of the sum of the products' magnitudes."""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest

from conftest import build_runtime_drivers, cpu_flags
from generator.ops.precision import round_to_bf16

FLAGS = cpu_flags()

# (M, K, N, stored [N, K]): one row; K not a whole pair, tile (32) or group; N not a
# whole panel (16); rows below, at and past a tile's 16 and a block's 32
CASES = [(1, 1, 1, False), (1, 77, 10, True), (2, 33, 17, False), (3, 64, 16, False), (5, 100, 40, True),
         (8, 31, 49, False), (16, 32, 16, False), (17, 785, 33, False), (33, 300, 70, True), (64, 784, 130, False),
         (300, 520, 40, False)]  # (the last: rows packed by two threads where there are two)


@pytest.fixture(scope="module")
def drivers(tmp_path_factory):
    return _build(tmp_path_factory, "bf16_driver")


@pytest.fixture(scope="module")
def conv_drivers(tmp_path_factory):
    return _build(tmp_path_factory, "bf16_conv_driver")


def _build(tmp_path_factory, source: str) -> dict:
    # native: the bf16 instructions where the CPU has them; float32: the same CPU told it
    # has none (what an AVX2-only or older CPU runs)
    return build_runtime_drivers(tmp_path_factory.mktemp(source), source, {
        "native": ["-march=native"],
        "float32": ["-march=native", "-mno-avx512bf16", "-mno-amx-bf16", "-mno-amx-int8", "-mno-amx-tile"]})


def _paths() -> list:
    """(driver, DG_AMX setting, the kernel it must name for M >= 3) this CPU can run."""
    paths = [("float32", None, "float32")]
    if "avx512_bf16" in FLAGS:
        paths.append(("native", "0", "avx512_bf16"))
        paths.append(("native", None, "amx" if "amx_bf16" in FLAGS else "avx512_bf16"))
    else:
        paths.append(("native", None, "float32"))
    return paths


@pytest.mark.parametrize("driver,amx,kernel", _paths(), ids=[f"{d}-amx{a}" for d, a, _ in _paths()])
def test_bf16_products_equal_float64_products_of_the_bf16_values(drivers, driver, amx, kernel):
    rng = np.random.default_rng(11)
    env = dict(os.environ)
    env.pop("DG_AMX", None)
    if amx is not None:
        env["DG_AMX"] = amx
    for m, k, n, tb in CASES:
        x = rng.normal(size=(m, k)).astype(np.float32)  # unrounded, as the generated code passes it: every path rounds it
        w = rng.normal(size=(n, k) if tb else (k, n)).astype(np.float32)
        xr, wr = round_to_bf16(x).astype(np.float64), round_to_bf16(w).astype(np.float64)
        wk = wr.T if tb else wr
        want = xr @ wk + 1.0
        bound = (k + 1) * 2.0**-24 * (np.abs(xr) @ np.abs(wk)) + 2.0**-23 * np.abs(want)
        unrounded = xr @ (w.T if tb else w).astype(np.float64) + 1.0
        for threads in (1, 2):
            proc = subprocess.run([str(drivers[driver]), str(m), str(k), str(n), "1" if tb else "0"],
                                  input=x.tobytes() + w.tobytes(), capture_output=True, timeout=60,
                                  env=dict(env, OMP_NUM_THREADS=str(threads)))
            assert proc.returncode == 0, proc.stderr.decode()
            name, _, data = proc.stdout.partition(b"\n")
            handed, _, data = data.partition(b"\n")
            expected = kernel if (m >= 3 or kernel != "amx") else "avx512_bf16"
            assert name.decode() == expected, (m, k, n, name)
            # handed over to a product that reads it: the bytes that one would pack, nothing else written
            assert handed.decode() == ("handed_over none" if kernel == "float32" else "handed_over same"), (m, k, n)
            got = np.frombuffer(data, np.float32).reshape(m, n).astype(np.float64)
            what = f"{driver} DG_AMX={amx} {threads} threads, {m}x{k}x{n} tb={tb}"
            assert (np.abs(got - want) <= bound).all(), (what, np.abs(got - want).max())
            # and the weight was rounded: its unrounded product is further away than the bound
            if k >= 16:
                assert (np.abs(unrounded - want) > bound).any(), what


# (N, C, H, W, O, KH, KW, stride, pad, dilation): odd sizes; stride 2 and more than 32
# outputs; a 1x1 of stride 1 (the input is the column matrix); a 1x1 of stride 2;
# dilation; images several to a product and over kBf16ConvColumnBytes (two products)
CONVS = [(1, 3, 9, 9, 5, 3, 3, 1, 1, 1), (2, 4, 8, 8, 33, 3, 3, 2, 1, 1), (3, 16, 5, 7, 16, 1, 1, 1, 0, 1),
         (2, 8, 6, 6, 20, 1, 1, 2, 0, 1), (5, 7, 4, 4, 12, 3, 3, 1, 2, 2), (4, 64, 32, 32, 8, 3, 3, 1, 1, 1),
         # channels in whole 16s: the channels-last path (positions are the product's rows)
         (1, 32, 4, 4, 40, 3, 3, 2, 1, 1), (2, 16, 3, 3, 17, 3, 3, 1, 1, 1), (1, 48, 5, 5, 16, 3, 3, 2, 2, 2),
         (1, 16, 1, 2, 8, 1, 1, 1, 0, 1), (3, 32, 8, 8, 64, 1, 1, 2, 0, 1),
         # small planes, many images to a product, enough of them that its preparation (copy and packing of the
         # whole product's images) runs on 2 threads: rows past a tile (61 * 4), and whole tiles
         (61, 64, 2, 2, 24, 3, 3, 1, 1, 1), (20, 48, 4, 4, 40, 3, 3, 1, 1, 1),
         # images copied in several groups a product (kBf16ConvCopyBytes): 9 images a product in groups of 2
         # (1 thread) or 4 (2 threads), rows past a tile in the last group, then a product of 1; 3 a product in
         # groups of 2 (1 thread)
         (10, 256, 15, 15, 24, 1, 1, 1, 0, 1), (3, 64, 31, 31, 24, 3, 3, 2, 1, 1)]


def _conv64(x, w, stride, pad, dil):
    """conv2d in float64 (cross-correlation, zero padding), and the sum of the products'
    magnitudes of each output."""
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    oh = (h + 2 * pad - dil * (kh - 1) - 1) // stride + 1
    ow = (wd + 2 * pad - dil * (kw - 1) - 1) // stride + 1
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    y, size = np.zeros((n, o, oh, ow)), np.zeros((n, o, oh, ow))
    for i in range(kh):
        for j in range(kw):
            part = xp[:, :, i * dil: i * dil + stride * (oh - 1) + 1: stride, j * dil: j * dil + stride * (ow - 1) + 1: stride]
            y += np.einsum("nchw,oc->nohw", part, w[:, :, i, j])
            size += np.einsum("nchw,oc->nohw", np.abs(part), np.abs(w[:, :, i, j]))
    return y, size


@pytest.mark.parametrize("driver,amx,kernel", _paths(), ids=[f"{d}-amx{a}" for d, a, _ in _paths()])
def test_bf16_convolutions_equal_float64_convolutions_of_the_bf16_values(conv_drivers, driver, amx, kernel):
    """conv2d_bf16 (bias) and conv2d_batch_norm_bf16 (evaluation mode, residual, relu)
    against float64 of the same bf16 values; the batch norm's float32 steps add a few
    ulps of the terms they combine. The input is not rounded beforehand: every path
    rounds it as it reads it (the generator drops the rounding call before it)."""
    rng = np.random.default_rng(12)
    env = dict(os.environ)
    env.pop("DG_AMX", None)
    if amx is not None:
        env["DG_AMX"] = amx
    for case in CONVS:
        n, c, h, wd, o, kh, kw, stride, pad, dil = case
        x = rng.normal(size=(n, c, h, wd)).astype(np.float32)
        w = rng.normal(size=(o, c, kh, kw)).astype(np.float32)
        b = rng.normal(size=o).astype(np.float32)
        conv, size = _conv64(round_to_bf16(x).astype(np.float64), round_to_bf16(w).astype(np.float64), stride, pad,
                             dil)
        k = c * kh * kw
        bound = (k + 2) * 2.0**-24 * (size + np.abs(b)[:, None, None])
        conv = conv + b[:, None, None]
        oh, ow = conv.shape[2:]
        stats = [rng.normal(size=o).astype(np.float32), rng.normal(size=o).astype(np.float32),
                 rng.normal(size=o).astype(np.float32), rng.uniform(0.5, 2, size=o).astype(np.float32)]
        residual = rng.normal(size=conv.shape).astype(np.float32)
        bn_w, bn_b, mean, var = (v.astype(np.float64)[:, None, None] for v in stats)
        scale = (1 / np.sqrt(var + np.float32(1e-5))) * bn_w
        normed = (conv - mean) * scale + bn_b + residual
        want = {0: conv, 1: np.maximum(normed, 0)}
        bounds = {0: bound, 1: np.abs(scale) * bound + 2.0**-21 * (np.abs(conv - mean) * np.abs(scale) + np.abs(bn_b)
                                                                  + np.abs(residual))}
        for bn in (0, 1):
            feed = x.tobytes() + w.tobytes() + b.tobytes()
            if bn:
                feed += b"".join(v.tobytes() for v in stats) + residual.tobytes()
            args = [str(v) for v in (n, c, h, wd, o, kh, kw, oh, ow, stride, pad, dil, bn)]
            for threads in (1, 2):
                proc = subprocess.run([str(conv_drivers[driver]), *args], input=feed, capture_output=True,
                                      timeout=120, env=dict(env, OMP_NUM_THREADS=str(threads)))
                assert proc.returncode == 0, proc.stderr.decode()
                name, _, data = proc.stdout.partition(b"\n")
                rows = n * oh * ow if c % 16 == 0 else o  # the product's rows (conv2d_bf16_kernel)
                assert name.decode() == (kernel if rows >= 3 or kernel != "amx" else "avx512_bf16"), (case, name)
                got = np.frombuffer(data, np.float32).reshape(want[bn].shape).astype(np.float64)
                what = f"{driver} DG_AMX={amx} {threads} threads, conv {case} bn={bn}"
                assert (np.abs(got - want[bn]) <= bounds[bn]).all(), (what, np.abs(got - want[bn]).max())
