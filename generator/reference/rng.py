"""Deterministic parameter initialization, bit-identical to targets/cpu/runtime/dg_rng.h.

A generated C++ model constructed with a seed must hold exactly the weights that
the numpy reference computes, so every value produced here is defined by integer
arithmetic plus a few float32 operations that IEEE-754 rounds the same way in
numpy and in C++.

The generator is counter based (no hidden state): element ``i`` of parameter
``name`` draws the 64-bit word ``mix(seed, name_stream(name), i)``.  This makes
each parameter independent of which other parameters exist and of the order in
which they are initialized.

Keep this file and dg_rng.h in lock-step; tests/test_runtime.py checks that
they agree bit for bit.
"""

from __future__ import annotations

import math

import numpy as np

MASK64 = (1 << 64) - 1

# FNV-1a 64-bit parameters.
FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3

# splitmix64 constants (Steele, Lea & Flood; as used by java.util.SplittableRandom).
GOLDEN = 0x9E3779B97F4A7C15
MIX_MUL1 = 0xBF58476D1CE4E5B9
MIX_MUL2 = 0x94D049BB133111EB

# Normal draws use 12 uniforms of 20 bits each; see init_normal.
NORMAL_WORDS = 4  # 64-bit words per normal sample (3 chunks of 20 bits per word)
NORMAL_BITS = 20
NORMAL_CENTER = 6 * ((1 << NORMAL_BITS) - 1)  # mean of the 12-chunk sum


def name_stream(name: str) -> int:
    """FNV-1a 64-bit hash of the UTF-8 bytes of ``name``: the stream id of a parameter."""
    h = FNV_OFFSET
    for byte in name.encode("utf-8"):
        h = ((h ^ byte) * FNV_PRIME) & MASK64
    return h


def _fmix_int(z: int) -> int:
    """splitmix64 finalizer on a Python int (exact, masked to 64 bits)."""
    z = ((z ^ (z >> 30)) * MIX_MUL1) & MASK64
    z = ((z ^ (z >> 27)) * MIX_MUL2) & MASK64
    return z ^ (z >> 31)


def _fmix_array(z: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer on a uint64 array (numpy wraps modulo 2**64)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(MIX_MUL1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(MIX_MUL2)
    return z ^ (z >> np.uint64(31))


def _key(seed: int, stream: int) -> int:
    """Per-(seed, stream) splitmix64 state; the first step of ``mix``."""
    k = _fmix_int((seed + GOLDEN) & MASK64)
    return _fmix_int(k ^ (stream & MASK64))


def mix(seed: int, stream: int, counter: int) -> int:
    """The random 64-bit word for one (seed, stream, counter) triple.

    key  = fmix(fmix(seed + GOLDEN) ^ stream)
    word = fmix(key + (counter + 1) * GOLDEN)

    i.e. output number ``counter`` of a splitmix64 generator seeded with ``key``.
    All arithmetic is modulo 2**64; negative seeds wrap like a C++ uint64_t cast.
    """
    key = _key(seed & MASK64, stream)
    return _fmix_int((key + ((counter + 1) * GOLDEN)) & MASK64)


def _words(seed: int, stream: int, count: int) -> np.ndarray:
    """``mix(seed, stream, c)`` for c in [0, count), as a uint64 array."""
    key = np.uint64(_key(seed & MASK64, stream))
    counters = np.arange(1, count + 1, dtype=np.uint64)  # counter + 1
    with np.errstate(over="ignore"):  # wrapping is intended
        return _fmix_array(key + counters * np.uint64(GOLDEN))


def _uniform01(words: np.ndarray) -> np.ndarray:
    """Top 24 bits of each word scaled by 2**-24: exact float32 values in [0, 1)."""
    k = (words >> np.uint64(40)).astype(np.float32)  # < 2**24, so exact
    return k * np.float32(2.0**-24)  # power-of-two scaling, exact


def _size(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def init_constant(shape, value: float) -> np.ndarray:
    """Every element equal to ``value`` rounded to float32."""
    return np.full(shape, np.float32(value), dtype=np.float32)


def init_uniform(shape, seed: int, name: str, low: float, high: float) -> np.ndarray:
    """Uniform in [low, high): ``low + (high - low) * u`` in float32, u = k * 2**-24.

    The float32 operation order (one subtraction, one multiplication, one
    addition, each rounded) is mirrored exactly by dg::init_uniform.
    """
    n = _size(shape)
    u = _uniform01(_words(seed, name_stream(name), n))
    lo = np.float32(low)
    span = np.float32(np.float32(high) - lo)
    out = lo + span * u  # float32 * float32 array stays float32
    return out.astype(np.float32, copy=False).reshape(shape)


def _standard_normal(n: int, seed: int, stream: int) -> np.ndarray:
    """Approximate N(0, 1) samples computed with exact integer arithmetic.

    Box-Muller needs log/sqrt/cos, whose last bit may differ between libm
    implementations, so it could not be reproduced bit for bit in C++.  Instead
    we use the Irwin-Hall approximation: the sum of 12 uniforms minus 6 has
    mean 0 and variance 1 (tails are cut at +-6, which is harmless for
    initialization).  Each uniform is a 20-bit integer chunk; the sum of 12 of
    them stays below 2**24, so the centered sum and its scaling by 2**-20 are
    exact in float32 and no rounding is involved at all.  Centering on
    6 * (2**20 - 1) makes the distribution exactly symmetric around 0.

    Sample i uses the 4 words with counters 4*i .. 4*i+3; each word provides
    three chunks (bits 44..63, 24..43 and 4..23).
    """
    words = _words(seed, stream, n * NORMAL_WORDS).reshape(n, NORMAL_WORDS)
    chunk_mask = np.uint64((1 << NORMAL_BITS) - 1)
    total = np.zeros(n, dtype=np.int64)
    for shift in (44, 24, 4):
        chunks = (words >> np.uint64(shift)) & chunk_mask
        total += chunks.sum(axis=1, dtype=np.uint64).astype(np.int64)
    centered = (total - NORMAL_CENTER).astype(np.float32)  # |value| < 2**23: exact
    return centered * np.float32(2.0**-NORMAL_BITS)


def init_normal(shape, seed: int, name: str, mean: float, std: float) -> np.ndarray:
    """Approximately normal with the given mean and std: ``mean + std * z`` in float32."""
    n = _size(shape)
    z = _standard_normal(n, seed, name_stream(name))
    out = np.float32(mean) + np.float32(std) * z
    return out.astype(np.float32, copy=False).reshape(shape)


def glorot_uniform_limit(fan_in: int, fan_out: int) -> float:
    """Glorot/Xavier uniform bound: sqrt(6 / (fan_in + fan_out))."""
    return math.sqrt(6.0 / (fan_in + fan_out))


def he_normal_std(fan_in: int) -> float:
    """He/Kaiming normal standard deviation: sqrt(2 / fan_in)."""
    return math.sqrt(2.0 / fan_in)


def glorot_uniform(shape, seed: int, name: str, fan_in: int, fan_out: int) -> np.ndarray:
    """init_uniform on [-limit, limit) with limit = glorot_uniform_limit(fan_in, fan_out).

    The C++ side calls dg::init_uniform with the float32 value of -limit and limit.
    """
    limit = glorot_uniform_limit(fan_in, fan_out)
    return init_uniform(shape, seed, name, -limit, limit)


def he_normal(shape, seed: int, name: str, fan_in: int) -> np.ndarray:
    """init_normal with mean 0 and std = he_normal_std(fan_in).

    The C++ side calls dg::init_normal with 0.0f and the float32 value of the std.
    """
    return init_normal(shape, seed, name, 0.0, he_normal_std(fan_in))


def dropout_keep(n: int, seed: int, stream: int, draw: int, p: float) -> np.ndarray:
    """Which of n elements a dropout keeps in call number `draw` of a model made with
    `seed`: element i is kept when u_i >= p, u_i = uniform01(mix(key, 0, i)) with
    key = mix(seed, stream, draw). dg::dropout_keep computes the same bits."""
    key = mix(seed, stream, draw)
    u = _uniform01(_words(key, 0, n))
    return u >= np.float32(p)
