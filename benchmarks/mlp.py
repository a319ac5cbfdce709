"""Benchmark: one MLP training step, the generated module against PyTorch eager.

    python benchmarks/mlp.py [--json FILE] [--quick]

Model: examples/mlp.py, x[N, 784] -> 512 relu -> 256 relu -> 10 logits, softmax
cross-entropy (mean over the batch), SGD with momentum (lr 0.05, momentum 0.9:
the module's own hyperparameters, read from it), generated and built once as module
mlp_bench (cached under build/bench/mlp_bench/). PyTorch eager: the same three nn.Linear layers with the
generated Model(seed=0)'s weights copied in, F.cross_entropy, torch.optim.SGD with
the same lr and momentum; a step is zero_grad(), forward, loss, backward(), step()
and loss.item() (train_step returns the loss as a float too).

Check before timing: from the same weights, both sides take 3 steps on 3
different batches, at each batch size; every loss must agree within 1e-4 and the
weights after the steps within 1e-4 (np.allclose).

Timing: train_step at batch 64 and 256, with 1 and 2 threads. Each (thread count,
peer) runs in a child process of its own with OMP/OPENBLAS/MKL_NUM_THREADS set
before numpy or torch is imported, plus torch.set_num_threads(n) and the generated
module's set_num_threads(n) (when it has none, its default is used and reported).
A child cycles through 16 seeded batches (pixels uniform in [0, 1), random labels,
so the loss stays away from zero) and keeps training while timed; medians of single
steps, pooled over rounds (3, 1 with --quick) with the peers' order reversed every
other round. Ratio = PyTorch / generated median (> 1: generated is faster). Targets,
1 thread: >= 1.5 at batch 64, >= 1.0 at batch 256.

Ceiling: the step's matrix-product FLOPs (forward, weight gradients, input
gradients of the layers after the first) over the generated median, against the
machine's sgemm peak (numpy's 2048^3 float32 product at that thread count,
measured in the torch child after its timing), and the ratio the generated step
would reach if it ran its products at that peak and everything else (loss,
activations, the momentum update's passes over the weights) took no time.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from _common import (PEAK_N, ROOT, build_module, import_module, machine_facts, measure, quiet_blas, run_rounds,
                     set_threads, sgemm_peak_gflops)

BATCHES = (64, 256)
THREADS = (1, 2)
PEERS = ("generated", "torch")
TARGETS = {(64, 1): 1.5, (256, 1): 1.0}  # (batch, threads) -> torch / generated at least
TOL = 1e-4
POOL = 16  # batches a timing child cycles through


LAYERS = ((784, 512), (512, 256), (256, 10))


def step_flops(n: int) -> float:
    """Multiply-add FLOPs of one train step's matrix products at batch n: each
    layer's forward and weight gradient, and the input gradient of every layer
    but the first (x needs none)."""
    forward = sum(2.0 * n * k * m for k, m in LAYERS)
    input_grads = sum(2.0 * n * k * m for k, m in LAYERS[1:])
    return 2 * forward + input_grads


def mlp_model():
    from generator.frontend.loader import load_model

    return load_model(str(ROOT / "examples" / "mlp.py"))


def make_batch(rng, n):
    import numpy as np

    x = rng.random((n, 784), dtype=np.float32)
    labels = rng.integers(0, 10, size=n).astype(np.int64)
    return x, labels


def torch_peer(model):
    """A PyTorch copy of the generated `model` (its weights and hyperparameters now);
    returns step(x, labels) -> loss (its optimizer as step.optimizer) and the torch network."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    params = model.parameters()
    net = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))
    with torch.no_grad():
        for linear, name in zip((net[0], net[2], net[4]), ("h1", "h2", "logits")):
            linear.weight.copy_(torch.from_numpy(params[f"{name}_w"].T.copy()))
            linear.bias.copy_(torch.from_numpy(params[f"{name}_b"].copy()))
    hyper = model.hyperparameters()
    opt = torch.optim.SGD(net.parameters(), lr=hyper["lr"], momentum=hyper["momentum"])

    def step(x, labels):
        opt.zero_grad()
        loss = F.cross_entropy(net(x), labels)
        loss.backward()
        opt.step()
        return loss.item()

    step.optimizer = opt
    return step, net


def check(module) -> float:
    """Same losses and weights after 3 steps from the same start, at every batch size;
    returns the largest |difference| seen."""
    import numpy as np
    import torch

    worst = 0.0
    for n in BATCHES:
        model = module.Model(seed=0)
        step, net = torch_peer(model)
        rng = np.random.default_rng(n)
        for k in range(3):
            x, labels = make_batch(rng, n)
            ours = model.train_step(x=x, labels=labels)
            theirs = step(torch.from_numpy(x), torch.from_numpy(labels))
            worst = max(worst, abs(ours - theirs))
            if not abs(ours - theirs) <= TOL * max(1.0, abs(theirs)):
                raise SystemExit(f"batch {n}, step {k + 1}: loss {ours:.6f} (generated) vs {theirs:.6f} (torch)")
        params = model.parameters()
        for linear, name in zip((net[0], net[2], net[4]), ("h1", "h2", "logits")):
            for ours, theirs in ((params[f"{name}_w"], linear.weight.detach().numpy().T),
                                 (params[f"{name}_b"], linear.bias.detach().numpy())):
                worst = max(worst, float(np.max(np.abs(ours - theirs))))
                if not np.allclose(ours, theirs, atol=TOL):
                    raise SystemExit(f"batch {n}: {name} weights differ after 3 steps")
    return worst


def child(config: dict) -> None:
    import numpy as np

    threads, peer = config["threads"], config["peer"]
    info = config["module"]
    module = import_module(info["name"], info["build"])
    out = {"threads": threads, "peer": peer, "round": config["round"], "mlp": []}
    if peer == "torch":
        import torch

        torch.set_num_threads(threads)
        out["torch_threads"] = torch.get_num_threads()
    else:
        quiet_blas()  # numpy only makes the batches here (see _common.quiet_blas)
        out["generated_threads"] = set_threads(module, threads)
    for n in BATCHES:
        rng = np.random.default_rng(1000 + n)
        batches = [make_batch(rng, n) for _ in range(POOL)]
        model = module.Model(seed=0)
        if peer == "torch":
            step, _ = torch_peer(model)
            batches = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in batches]
        else:
            def step(x, labels, model=model):
                return model.train_step(x=x, labels=labels)
        state = {"k": 0, "loss": None}

        def one():
            x, labels = batches[state["k"] % POOL]
            state["k"] += 1
            state["loss"] = step(x, labels)

        t = measure(one, config["target_s"], config["min_reps"])
        times = [1000 * s for s in t["times"]]
        out["mlp"].append({"batch": n, "times_ms": times, "cpu_per_wall": t["cpu_per_wall"],
                           "steps": state["k"], "last_loss": state["loss"]})
        print(f"  [round {config['round'] + 1}, {threads} thr] batch {n:3d} {peer:9s} "
              f"{statistics.median(times):8.3f} ms/step ({len(times)} steps timed, loss now "
              f"{state['loss']:.3f}, cpu/wall {t['cpu_per_wall']:.2f})", flush=True)
    if peer == "torch":  # numpy's BLAS has this child's thread count (set before import)
        out["peak_gflops"] = sgemm_peak_gflops(config["target_s"])
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

    print("Building the generated module (cached under build/bench/):", flush=True)
    info = build_module(mlp_model(), name="mlp_bench")  # not "mlp": this script's own name
    module = import_module(info["name"], info["build"])
    diff = check(module)
    print(f"Losses and weights agree with PyTorch over 3 steps at batch {BATCHES} "
          f"(largest |difference| {diff:.1e}, tolerance {TOL:g})", flush=True)

    rounds = 1 if args.quick else 3
    config = {"module": info, "target_s": 0.3 if args.quick else 1.5 / rounds, "min_reps": 5}
    t0 = time.perf_counter()
    results = run_rounds(__file__, config, rounds, THREADS, PEERS, "mlp")
    elapsed = time.perf_counter() - t0

    pooled = {}
    for res in results:
        for r in res["mlp"]:
            pooled.setdefault((r["batch"], res["threads"], res["peer"]), []).extend(r["times_ms"])
    med = {key: statistics.median(times) for key, times in pooled.items()}
    peaks = {}
    for res in results:
        if "peak_gflops" in res:
            peaks[res["threads"]] = max(peaks.get(res["threads"], 0.0), res["peak_gflops"])
    records = []
    for n in BATCHES:
        for threads in THREADS:
            gen, torch_ms = med[(n, threads, "generated")], med[(n, threads, "torch")]
            target = TARGETS.get((n, threads))
            records.append({
                "batch": n,
                "threads": threads,
                "generated_ms": round(gen, 4),
                "torch_ms": round(torch_ms, 4),
                "ratio": round(torch_ms / gen, 4),
                "target": target,
                "met": None if target is None else torch_ms / gen >= target,
                "generated_speedup_vs_1_thread": round(med[(n, 1, "generated")] / gen, 3),
                "torch_speedup_vs_1_thread": round(med[(n, 1, "torch")] / torch_ms, 3),
                "product_gflops": round(step_flops(n) / gen / 1e6, 1),
                "peak_gflops": round(peaks[threads], 1),
                "ratio_at_peak": round(torch_ms / (step_flops(n) / peaks[threads] / 1e6), 3),
            })

    gen_threads = sorted({str(r.get("generated_threads")) for r in results if r["peer"] == "generated"})
    print(f"\nMLP 784-512-256-10 train step, median ms per step ({rounds} round(s) in {elapsed:.0f} s); "
          f"ratio = torch / generated (> 1: generated is faster); generated threads: {', '.join(gen_threads)}")
    head = (f"{'batch':>5} {'thr':>3} | {'generated':>9} {'torch':>8} | {'ratio':>6} {'target':>6} {'met':>3} | "
            f"{'GFLOP/s':>7} {'peak':>6} {'of peak':>7} {'ratio at peak':>13}")
    print(head)
    print("-" * len(head))
    for r in records:
        target = f">={r['target']:g}" if r["target"] else "-"
        met = "-" if r["met"] is None else "yes" if r["met"] else "no"
        print(f"{r['batch']:5d} {r['threads']:3d} | {r['generated_ms']:9.3f} {r['torch_ms']:8.3f} | "
              f"{r['ratio']:6.2f} {target:>6} {met:>3} | {r['product_gflops']:7.1f} {r['peak_gflops']:6.1f} "
              f"{r['product_gflops'] / r['peak_gflops']:7.0%} {r['ratio_at_peak']:13.2f}")
    print(f"GFLOP/s: the step's matrix-product FLOPs / generated median; peak: numpy's {PEAK_N}^3 sgemm at "
          "that thread count, same run;\nratio at peak: torch / the time those FLOPs take at peak (the most the "
          "generated step could reach with nothing else costing time)")
    busy = [max(r["other_cores"], r["steal_cores"]) for r in results if r["other_cores"] is not None]
    if busy and max(busy) > 0.1:
        print(f"WARNING: other processes used up to {max(busy):.2f} cores while measuring: noisy figures")
    losses = [r["last_loss"] for res in results for r in res["mlp"]]
    if not all(math.isfinite(x) for x in losses):
        print(f"WARNING: training diverged while timed (last losses {losses}): NaN/inf arithmetic may be slower")

    if args.json:
        env = machine_facts(module, info["build"])
        env.update({"quick": args.quick, "rounds": rounds, "generated_threads": gen_threads,
                    "contention_cores": busy, "max_abs_diff_check": diff, "measure_seconds": round(elapsed, 1)})
        Path(args.json).write_text(json.dumps({"environment": env, "module": info, "records": records},
                                              indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
