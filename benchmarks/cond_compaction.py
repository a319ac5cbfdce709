"""Benchmark: dg.cond compacted (`compact=True`: each branch one batched block over the
rows of the examples that take it, listed by index: ops/cond.py) against masked (both
branches on every example, the results selected per example by `where`), the measurement
behind the rule in docs/ARCHITECTURE.md ("dg.cond compacts").

    python benchmarks/cond_compaction.py [--reps R] [--train]

Two branch pairs, each built both ways, the same seeded weights: `cheap`, an elementwise
update of a [N, 16] state on each side (h * 0.9 + 0.3 / h * 1.1 - 0.2: the pair for which
masking could win, its per-row work being no more than the lists' bookkeeping); `gemm`, a
tanh(h @ w) layer of width 96 against a cheap exit (h * 0.5), like an early exit's "go on"
and "stop". Batch 32 and 256, a quarter, three quarters or all of the examples taking
the then-branch (seeded; all: nothing to skip, the lists and moves are pure cost); forward() on one thread, the two builds alternated call by call;
median ms per call over R alternations (default 200). Outputs are checked equal first.
`--train`: the same with a 4-class head and a loss, timing train_step() (loss and
gradients checked equal first).
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
WIDTH = {"cheap": 16, "gemm": 96}


def branches(kind: str, w):
    if kind == "cheap":
        return (lambda h: h * 0.9 + 0.3), (lambda h: h * 1.1 - 0.2)
    return (lambda h: dg.tanh(h @ w)), (lambda h: h * 0.5)


def built_as(kind: str, compact: bool):
    @dg.model
    def cond_branches(train: bool = False):
        h = dg.input("h", (N, WIDTH[kind]))
        gate = dg.input("gate", (N,))
        w = dg.param("w", (WIDTH[kind], WIDTH[kind]), init=dg.normal(0.0, 0.1), seed=1)
        then_fn, else_fn = branches(kind, w)
        y = dg.cond(gate > 0.5, then_fn, else_fn, h, compact=compact)
        if train:  # a 4-class head, so that the gradient crosses the cond to w
            labels = dg.input("labels", (N,), dtype="int64")
            dg.train(dg.softmax_cross_entropy(dg.dense(y, 4, name="head"), labels), dg.sgd(lr=0.01))
        return {"y": y}

    return cond_branches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--train", action="store_true", help="time train_step() instead of forward()")
    args = parser.parse_args()
    call = "train_step" if args.train else "forward"
    print(f"Machine: {machine_facts()['cpu']}; one thread; median ms per {call}() call")
    print(f"{'branch':>6} {'batch':>5} {'then':>5} | {'compacted':>9} {'masked':>9} | masked/compacted")
    for kind in ("cheap", "gemm"):
        built = {}
        for name, compact in (("compacted", True), ("masked", False)):
            info = build_module(built_as(kind, compact), name=f"cond_{kind}_{name}{'_train' if args.train else ''}",
                                train=args.train)
            module = import_module(info["name"], info["build"])
            set_threads(module, 1)
            built[name] = module.Model(seed=0)
        for size in (32, 256):
            for share in (0.25, 0.75, 1.0):
                rng = np.random.default_rng(size + int(100 * share))
                h = rng.uniform(-1, 1, (size, WIDTH[kind])).astype(np.float32)
                gate = (rng.permutation(size) < round(share * size)).astype(np.float32)
                a = built["compacted"].forward(h=h, gate=gate)["y"]
                b = built["masked"].forward(h=h, gate=gate)["y"]
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
                feed = {"h": h, "gate": gate}
                if args.train:  # lr 0.01: the weights barely move over the alternated calls
                    feed["labels"] = rng.integers(0, 4, size).astype(np.int64)
                    la, lb = built["compacted"].train_step(**feed), built["masked"].train_step(**feed)
                    assert abs(la - lb) <= 1e-5 * max(1.0, abs(lb)), (la, lb)
                    for k, g in built["masked"].gradients().items():
                        np.testing.assert_allclose(np.asarray(built["compacted"].gradients()[k]), np.asarray(g),
                                                   rtol=1e-4, atol=1e-6, err_msg=k)
                times = {"compacted": [], "masked": []}
                for _ in range(args.reps):
                    for name in ("compacted", "masked"):
                        t0 = time.perf_counter()
                        getattr(built[name], call)(**feed)
                        times[name].append(1000 * (time.perf_counter() - t0))
                c, m = statistics.median(times["compacted"]), statistics.median(times["masked"])
                print(f"{kind:>6} {size:>5} {100 * share:4.0f}% | {c:9.4f} {m:9.4f} | {m / c:15.2f}x", flush=True)


if __name__ == "__main__":
    main()
