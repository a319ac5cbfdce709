"""Benchmark: GEMM throughput at the models' shapes, the generated runtime against numpy.

    python benchmarks/gemm.py [--json FILE] [--quick]

Shapes (M, K, N of y[M, N] = a[M, K] @ b[K, N]):

  treelstm  the level GEMM [M, 2H] @ [2H, 5H] for H = 256 and 512, M in {1, 5, 10, 20, 70}
            (rows of a tree level)
  mlp       the 784-512-256-10 MLP's train step at batch B = 64 and 256: forward
            x @ W for each layer; weight gradients x^T @ g ([in, B] @ [B, out]);
            input gradients g @ W^T for layers 2 and 3 (layer 1's is never computed:
            inputs get no gradient)

Peers, each timed in child processes of its own per thread count (1 and 2), with
OMP/OPENBLAS/MKL_NUM_THREADS set before numpy is imported (and the generated
module's set_num_threads(n) when it has one, else its default, reported):

  generated  a tiny generated model per shape family, with the sizes the models fix
             (the weights' sizes) fixed and the batch or level size symbolic, as in
             the models' own code: gemm_k<K>_n<N> y = x @ w (w a parameter, the same
             module treelstm.py uses); gemm_tn_m<M>_n<N> y = a^T @ g (both inputs
             [B, M] and [B, N]: a weight gradient); gemm_nt_k<K>_n<N> y = g @ w^T
             (w a parameter [N, K]: an input gradient). The transposed forms are the
             calls the generated backward pass makes (matmul with ta / tb). Timed
             through forward() (input checks, the result a new array), nothing
             subtracted.
  numpy      float32 x @ w, a.T @ g, g @ w.T with the module's own w (BLAS reads the
             transposed views in place).

Before timing, each child checks the generated result against numpy's on its shapes.
GFLOP/s = 2*M*K*N / median time; medians are pooled over rounds (3, 1 with --quick)
with the peers' order reversed every other round. Ratio = generated / numpy GFLOP/s;
the target is >= 0.8 (80% of numpy's sgemm) at every shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from _common import (
    ROOT,
    build_module,
    gemm_model,
    import_module,
    machine_facts,
    measure,
    quiet_blas,
    run_rounds,
    set_threads,
)

THREADS = (1, 2)
PEERS = ("generated", "numpy")
TARGET = 0.8  # generated GFLOP/s >= 80% of numpy's
TREELSTM_M = (1, 5, 10, 20, 70)
MLP_LAYERS = ((784, 512), (512, 256), (256, 10))
MLP_BATCHES = (64, 256)


def shapes() -> list:
    """(label, kind, M, K, N, module): kind nn is a @ b, tn a^T @ b, nt a @ b^T."""
    out = []
    for h in (256, 512):
        out += [(f"treelstm H{h} level", "nn", m, 2 * h, 5 * h) for m in TREELSTM_M]
    for b in MLP_BATCHES:
        out += [(f"mlp B{b} x@W{i}", "nn", b, k, n) for i, (k, n) in enumerate(MLP_LAYERS, 1)]
        out += [(f"mlp B{b} x^T@g{i}", "tn", k, b, n) for i, (k, n) in enumerate(MLP_LAYERS, 1)]
        out += [(f"mlp B{b} g@W{i}^T", "nt", b, n, k) for i, (k, n) in enumerate(MLP_LAYERS, 1) if i > 1]
    names = {"nn": "gemm_k{K}_n{N}", "tn": "gemm_tn_m{M}_n{N}", "nt": "gemm_nt_k{K}_n{N}"}
    return [(*s, names[s[1]].format(M=s[2], K=s[3], N=s[4])) for s in out]


def transposed_model(kind: str, p: int, q: int):
    """tn: y[p, q] = a^T @ g, a [B, p] and g [B, q] inputs; nt: y[B, q] = g @ w^T,
    g [B, p] an input, w [q, p] a parameter. B is symbolic."""
    import generator as dg
    from generator.frontend.builder import current

    @dg.model(name=f"gemm_tn_m{p}_n{q}" if kind == "tn" else f"gemm_nt_k{p}_n{q}")
    def gemm():
        b = dg.dim("B")
        if kind == "tn":
            (y,) = current().add("matmul", [dg.input("a", (b, p)), dg.input("g", (b, q))], {"ta": True}, name="y")
        else:
            (y,) = current().add("matmul", [dg.input("g", (b, p)), dg.param("w", (q, p))], {"tb": True}, name="y")
        return {"y": y}

    return gemm


def model_for(shape):
    _, kind, m, k, n, _ = shape
    if kind == "nn":
        return gemm_model(k, n)
    return transposed_model("tn", m, n) if kind == "tn" else transposed_model("nt", k, n)


def operands(kind, m, k, n, model, seed):
    """The generated call's inputs, and numpy's operands (a, b) with y = op(a) @ op(b)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if kind == "tn":
        a = rng.standard_normal((k, m), dtype=np.float32)
        g = rng.standard_normal((k, n), dtype=np.float32)
        return {"a": a, "g": g}, (a, g)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = np.array(model.parameters()["w"], dtype=np.float32, copy=True)
    return ({"x": x} if kind == "nn" else {"g": x}), (x, w)


def numpy_gemm(kind, a, b):
    return a.T @ b if kind == "tn" else a @ b.T if kind == "nt" else a @ b


def child(config: dict) -> None:
    import numpy as np

    threads, peer = config["threads"], config["peer"]
    out = {"threads": threads, "peer": peer, "round": config["round"], "gemm": []}
    if peer == "generated":
        quiet_blas()
    models = {}
    for name, info in config["modules"].items():
        module = import_module(info["name"], info["build"])
        out["generated_threads"] = set_threads(module, threads)
        models[name] = module.Model(seed=0)
    for i, (label, kind, m, k, n, name) in enumerate(config["shapes"]):
        model = models[name]
        inputs, (a, b) = operands(kind, m, k, n, model, seed=i)
        got, want = model.forward(**inputs)["y"], numpy_gemm(kind, a, b)
        if got.shape != want.shape or not np.allclose(got, want, rtol=1e-4, atol=1e-3):
            raise SystemExit(f"generated GEMM {kind} [{m},{k}]@[{k},{n}] differs from numpy")
        fn = (lambda: model.forward(**inputs)) if peer == "generated" else (lambda: numpy_gemm(kind, a, b))
        t = measure(fn, config["target_s"], config["min_reps"])
        times = [1000 * s for s in t["times"]]
        out["gemm"].append({"shape": i, "times_ms": times, "cpu_per_wall": t["cpu_per_wall"]})
        med = statistics.median(times)
        print(
            f"  [round {config['round'] + 1}, {threads} thr] {label:22s} {kind} [{m:4d},{k:4d}]@[{k:4d},{n:4d}] "
            f"{peer:9s} {med:8.3f} ms {2 * m * k * n / med / 1e6:7.2f} GFLOP/s",
            flush=True,
        )
    Path(config["out"]).write_text(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE", help="write every figure to FILE as JSON")
    parser.add_argument("--quick", action="store_true", help="one round, short measurements")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return

    print("Building the generated modules (cached under build/bench/):", flush=True)
    modules = {}
    for shape in shapes():
        if shape[-1] not in modules:
            modules[shape[-1]] = build_module(model_for(shape))
    rounds = 1 if args.quick else 3
    config = {
        "modules": modules,
        "shapes": shapes(),
        "target_s": 0.03 if args.quick else 0.3 / rounds,
        "min_reps": 3 if args.quick else 5,
    }
    t0 = time.perf_counter()
    results = run_rounds(__file__, config, rounds, THREADS, PEERS, "gemm")
    elapsed = time.perf_counter() - t0

    pooled = {}
    for res in results:
        for r in res["gemm"]:
            pooled.setdefault((r["shape"], res["threads"], res["peer"]), []).extend(r["times_ms"])
    records = []
    for i, (label, kind, m, k, n, name) in enumerate(config["shapes"]):
        for threads in THREADS:
            med = {p: statistics.median(pooled[(i, threads, p)]) for p in PEERS}
            gflops = {p: 2 * m * k * n / med[p] / 1e6 for p in PEERS}
            ratio = gflops["generated"] / gflops["numpy"]
            records.append(
                {
                    "label": label,
                    "kind": kind,
                    "M": m,
                    "K": k,
                    "N": n,
                    "module": name,
                    "threads": threads,
                    "generated_ms": round(med["generated"], 5),
                    "numpy_ms": round(med["numpy"], 5),
                    "generated_gflops": round(gflops["generated"], 3),
                    "numpy_gflops": round(gflops["numpy"], 3),
                    "ratio": round(ratio, 4),
                    "target": TARGET,
                    "met": ratio >= TARGET,
                }
            )

    gen_threads = sorted({str(r.get("generated_threads")) for r in results if r["peer"] == "generated"})
    print(
        f"\nGEMM GFLOP/s = 2*M*K*N / median time, {rounds} round(s) in {elapsed:.0f} s; "
        f"ratio = generated / numpy (target >= {TARGET}); generated threads: {', '.join(gen_threads)}"
    )
    head = (
        f"{'shape':22s} {'op':3s} {'M':>4} {'K':>4} {'N':>4} {'thr':>3} | {'generated':>9} {'numpy':>8} | "
        f"{'ratio':>5} {'met':>3}"
    )
    print(head)
    print("-" * len(head))
    for r in records:
        print(
            f"{r['label']:22s} {r['kind']:3s} {r['M']:4d} {r['K']:4d} {r['N']:4d} {r['threads']:3d} | "
            f"{r['generated_gflops']:9.2f} {r['numpy_gflops']:8.2f} | {r['ratio']:5.2f} "
            f"{'yes' if r['met'] else 'no':>3}"
        )
    met = sum(r["met"] for r in records)
    print(f"target met at {met} of {len(records)} (shape, threads) pairs")
    busy = [max(r["other_cores"], r["steal_cores"]) for r in results if r["other_cores"] is not None]
    if busy and max(busy) > 0.1:
        print(f"WARNING: other processes used up to {max(busy):.2f} cores while measuring: noisy figures")

    if args.json:
        first = next(iter(modules.values()))
        env = machine_facts(import_module(first["name"], first["build"]), first["build"])
        env.update({"quick": args.quick, "rounds": rounds, "generated_threads": gen_threads,
                    "contention_cores": busy, "measure_seconds": round(elapsed, 1)})
        Path(args.json).write_text(json.dumps({"environment": env, "modules": modules, "records": records},
                                              indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
