"""The value builders of the binding fuzzer (tests/test_fuzz.py): floats, ints, i64,
the array transforms (setitems, resize_axis, huge_empty, the layouts noncontig ... masked,
the descriptors pickled, with_metadata, longlong), ArrayLike and chain.

The fuzzer (tests/fuzz_inputs.py, tests/fuzz_child.py) makes its inputs with these, and
the reproductions it prints call them, after `from fuzz_arrays import *`: numpy as np and
math's nan and inf are among the names this module exports for them. It needs numpy only.
"""

from __future__ import annotations

import pickle
from math import inf, nan  # noqa: F401  (reproductions print nan and inf)

import numpy as np

INT64_MAX, INT64_MIN = 2**63 - 1, -(2**63)


def floats(shape, seed=0, special=None):
    """float32 uniform in [-1, 1), with `special` {flat position: value} set."""
    a = np.random.default_rng(seed).uniform(-1, 1, size=shape).astype(np.float32)
    for pos, value in (special or {}).items():
        a.reshape(-1)[pos % a.size] = value
    return a


def ints(shape, seed=0, high=10):
    """int64 uniform in [0, high)."""
    return np.random.default_rng(seed).integers(0, high, size=shape, dtype=np.int64)


def i64(values, shape=None):
    a = np.array(values, dtype=np.int64)
    return a.reshape(shape) if shape is not None else a


def setitems(a, items):
    """A copy of `a` with a[index] = value for each (index, value)."""
    a = np.array(a, copy=True)
    flat = a.reshape(-1)
    for pos, value in items:
        flat[pos % flat.size] = value
    return a


def resize_axis(a, axis, n):
    """`a` with axis `axis` made n long (values repeat cyclically; zeros if it was empty)."""
    if a.shape[axis] == 0:
        shape = list(a.shape)
        shape[axis] = n
        return np.zeros(shape, a.dtype)
    return np.take(a, np.arange(n) % a.shape[axis], axis=axis)


def huge_empty(shape, dtype):
    """An empty array whose other dimensions are huge (it holds no data)."""
    return np.empty(shape, dtype)


def noncontig(a):
    """The same values, every other element of a twice-as-wide array."""
    return np.repeat(a, 2, axis=-1)[..., ::2]


def fortran(a):
    return np.asfortranarray(a)


def transposed(a):
    """The same shape and values, stored with the axes reversed."""
    return np.ascontiguousarray(a.T).T


def flipped(a, axis):
    """A view with a negative stride along `axis` (values reversed along it)."""
    return np.flip(a, axis)


def broadcast(a):
    """Row 0 repeated with stride 0 (read-only)."""
    return np.broadcast_to(a[:1], a.shape)


def unaligned(a):
    """The same values, C-contiguous but at an odd address."""
    if a.dtype == object or a.dtype.itemsize == 1:
        return a
    buf = np.zeros(a.nbytes + 1, np.uint8)
    out = buf[1:].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def offset_view(a):
    """The same values, a view into the middle of a larger array (aligned, contiguous)."""
    big = np.zeros(a.size + 8, a.dtype)
    out = big[8:].reshape(a.shape)
    out[...] = a
    return out


def readonly(a):
    a = np.array(a, copy=True)
    a.flags.writeable = False
    return a


def masked(a):
    return np.ma.masked_array(a, mask=np.zeros(a.shape, bool))


def pickled(a):
    """A pickle round trip (as multiprocessing sends arrays): an equal dtype, a distinct descriptor."""
    return pickle.loads(pickle.dumps(a))


def with_metadata(a):
    return a.view(np.dtype(a.dtype, metadata={"unit": "none"}))


def longlong(a):
    """int64 values as np.longlong, a distinct descriptor equal to int64 on Linux."""
    return a.astype(np.longlong)


class ArrayLike:
    """Not an array, but numpy converts it to one (np.asarray calls __array__)."""

    def __init__(self, a):
        self.a = a

    def __array__(self, dtype=None, copy=None):
        return self.a if dtype is None else self.a.astype(dtype)

    def __repr__(self):
        return f"ArrayLike({self.a!r})"


def chain(depth, fanout=1):
    """A tree `depth` levels deep: each internal node has `fanout` children, all but
    the first of them leaves."""
    tree = 0
    for _ in range(depth):
        tree = (tree,) + tuple(range(1, fanout))
    return tree
