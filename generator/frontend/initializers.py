"""Parameter initializers. Each resolves, for a given shape, to one of three
primitive draws (constant, uniform, normal) that the numpy side (generator.reference.rng)
and the generated C++ (runtime dg_rng.h) compute bit-identically."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..reference import rng


@dataclass(frozen=True)
class Init:
    kind: str  # constant | uniform | normal | glorot_uniform | he_normal
    a: float = 0.0
    b: float = 0.0

    def resolve(self, shape) -> tuple:
        """('constant', v) | ('uniform', low, high) | ('normal', mean, std), as float32 values."""
        fan_in = math.prod(shape[:-1]) if len(shape) > 1 else (shape[0] if shape else 1)
        fan_out = shape[-1] if shape else 1
        if self.kind == "constant":
            prim = ("constant", self.a)
        elif self.kind == "uniform":
            prim = ("uniform", self.a, self.b)
        elif self.kind == "normal":
            prim = ("normal", self.a, self.b)
        elif self.kind == "glorot_uniform":
            limit = math.sqrt(6.0 / max(fan_in + fan_out, 1))
            prim = ("uniform", -limit, limit)
        elif self.kind == "he_normal":
            prim = ("normal", 0.0, math.sqrt(2.0 / max(fan_in, 1)))
        else:
            raise ValueError(f"unknown initializer {self.kind!r}")
        return (prim[0],) + tuple(float(np.float32(v)) for v in prim[1:])

    def describe(self) -> str:
        if self.kind == "constant":
            return f"constant({self.a:g})"
        if self.kind in ("uniform", "normal"):
            return f"{self.kind}({self.a:g}, {self.b:g})"
        return f"{self.kind}()"

    def sample(self, shape, seed: int, name: str) -> np.ndarray:
        """The parameter's initial value, exactly as the generated Model(seed) computes it."""
        prim = self.resolve(shape)
        if prim[0] == "constant":
            return rng.init_constant(shape, prim[1])
        if prim[0] == "uniform":
            return rng.init_uniform(shape, seed, name, prim[1], prim[2])
        return rng.init_normal(shape, seed, name, prim[1], prim[2])


def zeros() -> Init:
    return Init("constant", 0.0)


def ones() -> Init:
    return Init("constant", 1.0)


def constant(value: float) -> Init:
    return Init("constant", float(value))


def uniform(low: float = -0.05, high: float = 0.05) -> Init:
    if not low <= high:
        raise ValueError(f"uniform initializer needs low <= high, got {low}, {high}")
    return Init("uniform", float(low), float(high))


def normal(mean: float = 0.0, std: float = 0.05) -> Init:
    if std < 0:
        raise ValueError(f"normal initializer needs std >= 0, got {std}")
    return Init("normal", float(mean), float(std))


def glorot_uniform() -> Init:
    return Init("glorot_uniform")


def he_normal() -> Init:
    return Init("he_normal")
