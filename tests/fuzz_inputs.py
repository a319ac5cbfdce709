"""The input side of the binding fuzzer (tests/fuzz_child.py): valid inputs for a
model's entry points, random mutations of them (dtype, rank, shape, huge empty arrays,
layout, values, non-arrays, names), random and mutated tree batches, and nested trees
for <trees>_from_nested().

Every input is a Value: the value and the Python code that makes it with the builders
of tests/fuzz_arrays.py, from which the oracle writes a call's reproduction.
"""

from __future__ import annotations

import warnings
from math import inf, nan

import numpy as np

import fuzz_arrays
from fuzz_arrays import (
    INT64_MAX,
    INT64_MIN,
    ArrayLike,
    flipped,
    floats,
    huge_empty,
    ints,
    resize_axis,
    setitems,
)

DTYPES = ["float16", "float32", "float64", "longdouble", "int8", "int16", "int32", "int64", "uint8",
    "uint16", "uint32", "uint64", "bool", "object", "complex64", "complex128", "U5", "S5"]
FLOAT_SPECIALS = [nan, -nan, inf, -inf, 1e30, -1e30, 1e-40, -1e-45, -0.0, 0.0, 65504.0]
FINITE_SPECIALS = [1e30, -1e30, 1e-40, -1e-45, -0.0, 0.0, 65504.0, 1e6]
BAD_IDS = [-1, -2, 2**31 - 1, 2**31, 2**32, INT64_MAX, INT64_MIN]
EXTRA_NAMES = ["bogus", "", " ", "x", "X", "labels", "tokens", "pixels", "trees_children", "dag_words",
    "é", "\x00", "a" * 300, "__class__", "self"]


class Value:
    """An input value and the Python code that makes it."""

    def __init__(self, value, code):
        self.value, self.code = value, code


class FuzzInputs:
    """The Fuzzer's (fuzz_child.Fuzzer's) inputs: it sets graph, decl, limit and trees."""

    # -- building inputs --------------------------------------------------------

    def draw_dims(self, data):
        from hypothesis import strategies as st

        # Mostly small; sometimes past the GEMM's blocking sizes (tails of micro-kernels).
        size = st.one_of(st.integers(1, 4), st.sampled_from([5, 7, 8, 9, 16, 17, 31, 33, 64, 65]))
        return {d: data.draw(size, label=f"dim {d}") for d in self.graph.dims}

    def base_inputs(self, data, names, finite=False, special=True):
        """Valid inputs for `names`: {name: Value} (float inputs with a few special
        values, finite ones only with `finite`, none without `special`)."""
        from hypothesis import strategies as st

        from generator.ir.shapes import evaluate

        dims = self.draw_dims(data)
        out = {}
        for t in self.trees:
            if t["children"] in names:
                out.update(self.tree_values(self.valid_tree(data, t), t))
        for name in names:
            if name in out:
                continue
            v = self.decl[name]
            shape = tuple(evaluate(v.shape, dims))
            seed = data.draw(st.integers(0, 2**16), label=f"seed {name}")
            if v.dtype == "float32":
                marks = {}
                if special and data.draw(st.booleans(), label=f"special values in {name}"):
                    pool = FINITE_SPECIALS if finite else FLOAT_SPECIALS
                    marks = data.draw(
                        st.dictionaries(st.integers(0, 10**6), st.sampled_from(pool), min_size=1, max_size=3),
                        label="special",
                    )
                out[name] = Value(
                    floats(shape, seed, marks),
                    f"floats({shape}, seed={seed}" + (f", special={marks!r})" if marks else ")"),
                )
            else:
                high = self.limit[name]
                out[name] = Value(ints(shape, seed, high), f"ints({shape}, seed={seed}, high={high})")
        return out

    def valid_tree(self, data, t):
        from hypothesis import strategies as st

        from generator.treebatch import random_batch

        seed = data.draw(st.integers(0, 2**16), label="tree seed")
        big = data.draw(st.integers(0, 4), label="big batch") == 0
        count = data.draw(st.integers(1, 12 if big else 3), label="trees")
        leaves = data.draw(st.integers(1, 24 if big else 5), label="max leaves")
        b = random_batch(np.random.default_rng(seed), count, t["arity"], t["vocab"], 1, leaves, dag=t["dag"])
        return b["children"], b["words"], b["roots"]

    @staticmethod
    def tree_values(arrays, t):
        out = {}
        for key, a in zip(("children", "words", "roots"), arrays):
            a = np.ascontiguousarray(a, dtype=np.int64)
            code = f"i64({a.tolist()!r})" if a.size else f"i64([], {a.shape})"
            out[t[key]] = Value(a, code)
        return out

    # -- mutations ----------------------------------------------------------------

    def mutate(self, data, inputs, names, finite=False):
        """0-3 random mutations of `inputs` (in place)."""
        from hypothesis import strategies as st

        kinds = ["dtype", "rank", "shape", "huge", "layout", "values", "nonarray", "names"]
        for _ in range(data.draw(st.integers(0, 3), label="mutations")):
            kind = data.draw(st.sampled_from(kinds), label="mutation")
            if kind == "names":
                self.mutate_names(data, inputs, names)
                continue
            if not inputs:
                continue
            name = data.draw(st.sampled_from(sorted(inputs)), label="input")
            v = inputs[name]
            if not isinstance(v.value, np.ndarray) or max(v.value.shape, default=0) > 2**20:
                continue  # not an array, or a huge empty one that the mutations would fill
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore")
                inputs[name] = getattr(self, "mutate_" + kind)(data, name, v, finite)

    def mutate_dtype(self, data, name, v, finite):
        from hypothesis import strategies as st

        dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
        return Value(v.value.astype(dtype), f"{v.code}.astype({dtype!r})")

    def mutate_rank(self, data, name, v, finite):
        from hypothesis import strategies as st

        a = v.value
        how = data.draw(
            st.sampled_from(["[..., None]", "[None]", ".reshape(-1)", "[0]", "0-d"]), label="rank"
        )
        if how == "0-d":
            if a.size == 0:
                return Value(np.asarray(0, a.dtype), f"np.asarray(0, {str(a.dtype)!r})")
            return Value(np.asarray(a.reshape(-1)[0]), f"np.asarray({v.code}.reshape(-1)[0])")
        if how == "[0]" and (a.ndim == 0 or a.shape[0] == 0):
            return v
        return Value(eval("a" + how), v.code + how)  # noqa: S307  (one of the fixed strings above)

    def mutate_shape(self, data, name, v, finite):
        from hypothesis import strategies as st

        a = v.value
        if a.ndim == 0:
            return v
        axis = data.draw(st.integers(0, a.ndim - 1), label="axis")
        n = data.draw(
            st.sampled_from([0, 1, a.shape[axis] + 1, max(a.shape[axis] - 1, 0), 2 * a.shape[axis]]),
            label="length",
        )
        return Value(resize_axis(a, axis, n), f"resize_axis({v.code}, {axis}, {n})")

    def mutate_huge(self, data, name, v, finite):
        """An empty array with a huge dimension: the declared rank (or one more), one axis 0."""
        from hypothesis import strategies as st

        a = v.value
        rank = max(a.ndim, 1) + data.draw(st.integers(0, 1), label="extra axis")
        shape = list(a.shape) + [1] * (rank - a.ndim)
        zero = data.draw(st.integers(0, rank - 1), label="empty axis")
        shape[zero] = 0
        others = [i for i in range(rank) if i != zero]
        if others:
            big = data.draw(st.sampled_from(others), label="huge axis")
            rest = int(np.prod([max(s, 1) for i, s in enumerate(shape) if i not in (zero, big)]))
            top = (2**63 - 1) // (a.dtype.itemsize * rest)
            shape[big] = data.draw(
                st.sampled_from([s for s in (2**31 - 1, 2**31, 2**32 + 1, 2**40, top) if s <= top]),
                label="huge size",
            )
        shape = tuple(shape)
        return Value(huge_empty(shape, a.dtype), f"huge_empty({shape}, {str(a.dtype)!r})")

    def mutate_layout(self, data, name, v, finite):
        from hypothesis import strategies as st

        a = v.value
        how = data.draw(
            st.sampled_from(
                [
                    "noncontig",
                    "fortran",
                    "transposed",
                    "flipped",
                    "broadcast",
                    "unaligned",
                    "offset_view",
                    "readonly",
                    "masked",
                ]
            ),
            label="layout",
        )
        if how == "flipped":
            if a.ndim == 0:
                return v
            axis = data.draw(st.integers(0, a.ndim - 1), label="axis")
            return Value(flipped(a, axis), f"flipped({v.code}, {axis})")
        if how == "broadcast" and (a.ndim == 0 or a.shape[0] == 0):
            return v
        if how == "masked" and a.dtype == object:
            return v
        return Value(getattr(fuzz_arrays, how)(a), f"{how}({v.code})")

    def mutate_values(self, data, name, v, finite):
        from hypothesis import strategies as st

        a = v.value
        if a.size == 0 or not (a.dtype.kind == "f" or a.dtype == np.int64):
            return v  # (ids out of range do not fit the narrower integer types)
        pool = (
            (FINITE_SPECIALS if finite else FLOAT_SPECIALS)
            if a.dtype.kind == "f"
            else (BAD_IDS + [self.limit.get(name, 10), self.limit.get(name, 10) + 1])
        )
        items = data.draw(
            st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(pool)), min_size=1, max_size=3),
            label="values",
        )
        items = [(pos % a.size, val) for pos, val in items]
        return Value(setitems(a, items), f"setitems({v.code}, {items!r})")

    def mutate_nonarray(self, data, name, v, finite):
        from hypothesis import strategies as st

        a = v.value
        choices = {
            "None": lambda: None,
            "'abc'": lambda: "abc",
            "b'\\x00'": lambda: b"\x00",
            "3.0": lambda: 3.0,
            "7": lambda: 7,
            "True": lambda: True,
            "[]": lambda: [],
            "{'a': 1}": lambda: {"a": 1},
            "object()": object,
            "1j": lambda: 1j,
            "np.float32(1.5)": lambda: np.float32(1.5),
            "np.int64(3)": lambda: np.int64(3),
            f"{v.code}.tolist()": a.tolist,
            f"ArrayLike({v.code})": lambda: ArrayLike(a),
            f"memoryview(np.ascontiguousarray({v.code}))": lambda: memoryview(np.ascontiguousarray(a)),
        }
        if a.dtype == object:
            choices.pop(f"memoryview(np.ascontiguousarray({v.code}))")
        code = data.draw(st.sampled_from(sorted(choices)), label="non-array")
        return Value(choices[code](), code)

    def mutate_names(self, data, inputs, names):
        from hypothesis import strategies as st

        how = data.draw(st.sampled_from(["extra", "missing", "rename"]), label="names")
        present = sorted(inputs)
        if how == "extra":
            new = data.draw(st.sampled_from(EXTRA_NAMES), label="extra name")
            if new not in inputs:
                inputs[new] = inputs[present[0]] if present else Value(None, "None")
        elif present:
            old = data.draw(st.sampled_from(present), label="name")
            value = inputs.pop(old)
            if how == "rename":
                new = data.draw(st.sampled_from(EXTRA_NAMES + list(self.decl)), label="new name")
                inputs[new] = value

    # -- tree structure ------------------------------------------------------------

    def random_tree_arrays(self, data, t):
        """Children, words and roots drawn at random (mostly not a valid batch)."""
        from hypothesis import strategies as st

        n = data.draw(st.integers(1, 7), label="nodes")
        slot = st.one_of(st.just(-1), st.integers(-3, n + 1))
        children = data.draw(
            st.lists(st.lists(slot, min_size=t["arity"], max_size=t["arity"]), min_size=n, max_size=n),
            label="children",
        )
        words = data.draw(
            st.lists(
                st.one_of(st.integers(0, t["vocab"] - 1), st.sampled_from([-1, t["vocab"]])),
                min_size=n,
                max_size=n,
            ),
            label="words",
        )
        roots = data.draw(st.lists(st.integers(-1, n), min_size=1, max_size=3), label="roots")
        return (
            np.array(children, np.int64).reshape(n, t["arity"]),
            np.array(words, np.int64),
            np.array(roots, np.int64),
        )

    def mutate_tree(self, data, t, children, words, roots):
        """One structural mutation of a batch; returns the new arrays (earlier
        mutations may have left them with no rows, no columns or unequal lengths)."""
        from hypothesis import strategies as st

        c, w, r = children.copy(), words.copy(), roots.copy()
        n, arity = c.shape
        kind = data.draw(
            st.sampled_from(
                [
                    "child out of range",
                    "self loop",
                    "cycle",
                    "shared child",
                    "random child",
                    "empty slot",
                    "arity",
                    "root out of range",
                    "duplicate root",
                    "another root",
                    "no roots",
                    "word out of vocabulary",
                    "words length",
                    "nodes",
                ]
            ),
            label="tree mutation",
        )
        if kind in ("child out of range", "self loop", "cycle", "shared child", "random child", "empty slot"):
            if n == 0 or arity == 0:
                return c, w, r
            i, k = data.draw(st.integers(0, n - 1), label="node"), data.draw(
                st.integers(0, arity - 1), label="slot"
            )
            if kind == "child out of range":
                c[i, k] = data.draw(st.sampled_from([n, n + 1, -2, -n - 1, INT64_MAX, INT64_MIN, 2**32]))
            elif kind == "self loop":
                c[i, k] = i
            elif kind == "cycle":  # a descendant of node i gets i as a child
                below, stack = [], [i]
                while stack:
                    for j in c[stack.pop()]:
                        if 0 <= j < n and j not in below and j != i:
                            below.append(int(j))
                            stack.append(int(j))
                if below:
                    c[data.draw(st.sampled_from(below), label="descendant"), k] = i
            elif kind == "empty slot":
                c[i, k] = -1
            else:  # another node as the child: shared if it already has a parent
                c[i, k] = data.draw(st.integers(0, n - 1), label="child")
        elif kind == "arity":
            c = resize_axis(c, 1, data.draw(st.sampled_from([0, 1, max(arity - 1, 0), arity + 1])))
            c[:, arity:] = -1
        elif kind == "root out of range" and len(r):
            r[data.draw(st.integers(0, len(r) - 1))] = data.draw(
                st.sampled_from([n, -1, -2, INT64_MIN, INT64_MAX])
            )
        elif kind == "duplicate root" and len(r):
            r = np.concatenate([r, r[: data.draw(st.integers(1, len(r)))]])
        elif kind == "another root" and len(r) and n:
            r[data.draw(st.integers(0, len(r) - 1))] = data.draw(st.integers(0, n - 1))
        elif kind == "no roots":
            r = r[:0]
        elif kind == "word out of vocabulary" and len(w):
            w[data.draw(st.integers(0, len(w) - 1))] = data.draw(
                st.sampled_from([-1, -2, t["vocab"], t["vocab"] + 1, INT64_MAX, INT64_MIN])
            )
        elif kind == "words length":
            w = resize_axis(w, 0, data.draw(st.sampled_from([0, max(n - 1, 0), n + 1])))
        elif kind == "nodes" and n:
            c = c[: data.draw(st.integers(0, n - 1))]
        return c, w, r


def nested_trees(arity):
    """Lists of nested trees as trees_from_nested takes them, with odd leaves and shapes."""
    from hypothesis import strategies as st

    word = st.one_of(
        st.integers(-3, 1100),
        st.integers(-3, 1100),
        st.integers(-3, 1100),
        st.sampled_from([INT64_MAX, INT64_MIN, 2**63, -(2**63) - 1, 2**70, True, 1.5, None, "a"]),
        st.integers(0, 5).map(np.int64),
    )
    return st.lists(
        st.recursive(
            word,
            lambda kids: st.one_of(
                st.lists(kids, min_size=0, max_size=arity + 1).map(tuple),
                st.lists(kids, min_size=0, max_size=arity + 1),
                st.tuples(word, st.lists(kids, min_size=0, max_size=arity + 1)),
            ),
            max_leaves=12,
        ),
        min_size=0,
        max_size=3,
    )
