"""Benchmark: dg.while_loop compacted (each step over the examples still running, listed
by index) against masked (each step over every example, the stopped ones kept by `where`),
the measurement behind the rule in docs/ARCHITECTURE.md ("dg.while_loop compacts").

    python benchmarks/while_compaction.py [--reps R]

Two loop bodies, each built both ways (while_loop(compact=True / False)), the same seeded
weights: `cheap`, one elementwise update of a [N, 4] state (h * 0.9 + 0.3, a handful of
flops per row: the body for which masking could win, its per-row work being no more than
the compaction's bookkeeping); `gemm`, a tanh(h @ w) layer of width 96 (a product per step,
like a decoder cell). Every example stops at its own step: it iterates until its counter
passes a threshold drawn per example, so the steps are uniform on 1..max_steps (12) and the
last example runs all of them; and the worst case for compaction, every example running all
12 steps (nothing to skip: the live lists are pure cost). Inputs of 32 and 256 examples; forward() on one thread, the
two builds alternated call by call; median ms per call over R alternations (default 200).
Outputs are checked equal (both builds' steps and states) before timing.
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

N = dg.dim("N")
MAX_STEPS = 12
WIDTH = {"cheap": 4, "gemm": 96}


def looped(kind: str):
    @dg.model
    def while_body(compact: bool = True):
        h0 = dg.input("h0", (N, WIDTH[kind]))
        limit = dg.input("limit", (N, 1))  # each example's threshold: its step count
        w = dg.param("w", (WIDTH[kind], WIDTH[kind]), init=dg.normal(0.0, 0.1), seed=1)

        def running(s):
            _, count, bound = s
            return dg.sum(count - bound, 1) < 0.0

        def step(s):
            h, count, bound = s
            h = h * 0.9 + 0.3 if kind == "cheap" else dg.tanh(h @ w)
            return h, count + 1.0, bound

        zero = dg.sum(h0, 1, keepdims=True) * 0.0
        (h, count, _), steps = dg.while_loop(running, step, (h0, zero, limit), MAX_STEPS, names=("h", "count", "bound"),
                                             compact=compact)
        return {"h": h, "steps": steps}

    return while_body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    print(f"Machine: {machine_facts()['cpu']}; one thread; median ms per forward() call")
    print(f"{'body':>6} {'batch':>5} | {'compacted':>9} {'masked':>9} | masked/compacted | rows of stopped examples")
    for kind in ("cheap", "gemm"):
        built = {}
        for compact in (True, False):
            info = build_module(looped(kind), name=f"while_{kind}_{'compact' if compact else 'masked'}",
                                compact=compact)
            module = import_module(info["name"], info["build"])
            set_threads(module, 1)
            built[compact] = module.Model(seed=0)
        for size, spread in ((32, True), (256, True), (32, False), (256, False)):
            rng = np.random.default_rng(size)
            inputs = {"h0": rng.uniform(-1, 1, (size, WIDTH[kind])).astype(np.float32),
                      "limit": rng.integers(1, MAX_STEPS + 1, (size, 1)).astype(np.float32)}
            inputs["limit"][0 if spread else slice(None)] = MAX_STEPS
            a, b = built[True].forward(**inputs), built[False].forward(**inputs)
            np.testing.assert_array_equal(a["steps"], b["steps"])
            np.testing.assert_allclose(a["h"], b["h"], rtol=1e-6, atol=1e-6)
            times = {True: [], False: []}
            for _ in range(args.reps):
                for compact in (True, False):
                    t0 = time.perf_counter()
                    built[compact].forward(**inputs)
                    times[compact].append(1000 * (time.perf_counter() - t0))
            c, m = statistics.median(times[True]), statistics.median(times[False])
            stopped = 1 - a["steps"].sum() / (size * a["steps"].max())
            print(f"{kind:>6} {size:>5} | {c:9.4f} {m:9.4f} | {m / c:15.2f}x | {100 * stopped:.0f}%", flush=True)


if __name__ == "__main__":
    main()
