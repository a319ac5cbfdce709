"""Benchmark: dg.cond masked (today's lowering: both branches on every example, the
results selected per example by `where`) against compaction by index lists (each branch
on a compact block of the rows of the examples that take it), the measurement behind the
rule that #42's cond compaction is to follow (docs/ARCHITECTURE.md, "Booleans are bytes;
`dg.cond` masks").

    python benchmarks/cond_compaction.py [--reps R]

The compacted side is written with the DSL's own ops, so it is generated and built like
any model: the host lists the examples that take each branch (`then_ids` [K], `else_ids`
[M], symbolic dims, so the block sizes are the run's), the graph gathers their rows into a
compact block, runs the branch on it, and puts each example's row back with a gather by its
position in its branch's block and a `where` by pred. The lowering #42 asks for writes each
block's rows straight to their output rows instead (no `where`, no gather back over all N
rows), so these compacted timings are an upper bound on its cost: where they already win,
the lowering wins more.

Two branch pairs, the same seeded weights both ways: `cheap`, an elementwise update of a
[N, 16] state on each side (h * 0.9 + 0.3 / h * 1.1 - 0.2: the pair for which masking could
win, its per-row work being no more than the lists' bookkeeping); `gemm`, a tanh(h @ w)
layer of width 96 against a cheap exit (h * 0.5), like an early exit's "go on" and "stop".
Batch 32 and 256, a quarter or three quarters of the examples taking the then-branch (drawn
per call's input, seeded); forward() on one thread, the two builds alternated call by call;
median ms per call over R alternations (default 200). Outputs are checked equal first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from _common import build_module, import_module, machine_facts, set_threads  # noqa: E402

import generator as dg  # noqa: E402
from generator.codegen import record  # noqa: E402

# Generation runs the numpy reference once on sample inputs to record expected outputs; the
# compacted model's ids index tables of symbolic sizes that those samples cannot respect, so
# these two projects are generated without them (as a model too large to run the reference
# on is): the outputs are checked here instead, compacted against masked.
record.REFERENCE_BYTES_LIMIT = 0

N, K, M = dg.dim("N"), dg.dim("K"), dg.dim("M")
WIDTH = {"cheap": 16, "gemm": 96}


def branches(kind: str, w):
    if kind == "cheap":
        return (lambda h: h * 0.9 + 0.3), (lambda h: h * 1.1 - 0.2)
    return (lambda h: dg.tanh(h @ w)), (lambda h: h * 0.5)


def masked(kind: str):
    @dg.model
    def cond_masked():
        h = dg.input("h", (N, WIDTH[kind]))
        gate = dg.input("gate", (N,))
        w = dg.param("w", (WIDTH[kind], WIDTH[kind]), init=dg.normal(0.0, 0.1), seed=1)
        then_fn, else_fn = branches(kind, w)
        return {"y": dg.cond(gate > 0.5, then_fn, else_fn, h)}

    return cond_masked


def compacted(kind: str):
    @dg.model
    def cond_compacted():
        h = dg.input("h", (N, WIDTH[kind]))
        gate = dg.input("gate", (N,))
        then_ids = dg.input("then_ids", (K,), dtype="int64")  # the examples that take the then-branch
        else_ids = dg.input("else_ids", (M,), dtype="int64")  # and the else-branch
        then_pos = dg.input("then_pos", (N,), dtype="int64")  # each example's row in its branch's block
        else_pos = dg.input("else_pos", (N,), dtype="int64")
        w = dg.param("w", (WIDTH[kind], WIDTH[kind]), init=dg.normal(0.0, 0.1), seed=1)
        then_fn, else_fn = branches(kind, w)
        then_rows = then_fn(dg.gather(h, then_ids))
        else_rows = else_fn(dg.gather(h, else_ids))
        taken = dg.reshape(gate > 0.5, (N, 1))
        y = dg.where(taken, dg.gather(then_rows, then_pos), dg.gather(else_rows, else_pos))
        return {"y": y}

    return cond_compacted


def lists(gate):
    """The host's inspector: each branch's examples, and each example's row in its block."""
    taken = gate > 0.5
    then_ids, else_ids = np.flatnonzero(taken), np.flatnonzero(~taken)
    then_pos, else_pos = np.zeros(gate.size, np.int64), np.zeros(gate.size, np.int64)
    then_pos[then_ids], else_pos[else_ids] = np.arange(then_ids.size), np.arange(else_ids.size)
    return {"then_ids": then_ids.astype(np.int64), "else_ids": else_ids.astype(np.int64),
            "then_pos": then_pos, "else_pos": else_pos}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    print(f"Machine: {machine_facts()['cpu']}; one thread; median ms per forward() call")
    print(f"{'branch':>6} {'batch':>5} {'then':>5} | {'compacted':>9} {'masked':>9} | masked/compacted")
    for kind in ("cheap", "gemm"):
        built = {}
        for name, make in (("compacted", compacted), ("masked", masked)):
            info = build_module(make(kind), name=f"cond_{kind}_{name}")
            module = import_module(info["name"], info["build"])
            set_threads(module, 1)
            built[name] = module.Model(seed=0)
        for size in (32, 256):
            for share in (0.25, 0.75):
                rng = np.random.default_rng(size + int(100 * share))
                h = rng.uniform(-1, 1, (size, WIDTH[kind])).astype(np.float32)
                gate = (rng.permutation(size) < round(share * size)).astype(np.float32)
                inputs = {"compacted": {"h": h, "gate": gate, **lists(gate)}, "masked": {"h": h, "gate": gate}}
                a = built["compacted"].forward(**inputs["compacted"])["y"]
                b = built["masked"].forward(**inputs["masked"])["y"]
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
                times = {"compacted": [], "masked": []}
                for _ in range(args.reps):
                    for name in ("compacted", "masked"):
                        t0 = time.perf_counter()
                        built[name].forward(**inputs[name])
                        times[name].append(1000 * (time.perf_counter() - t0))
                c, m = statistics.median(times["compacted"]), statistics.median(times["masked"])
                print(f"{kind:>6} {size:>5} {100 * share:4.0f}% | {c:9.4f} {m:9.4f} | {m / c:15.2f}x", flush=True)


if __name__ == "__main__":
    main()
