"""Benchmark: the MLP train step over a long run, the generated module against PyTorch eager.

    python benchmarks/long_training.py [--json FILE] [--steps N]

Same model, weights, batches and optimizer as benchmarks/mlp.py (examples/mlp.py, SGD with
momentum 0.9, lr 0.05; 16 seeded batches of 64 with random labels), but timed over a long
run (2000 steps by default, 1 thread) in chunks of 250 steps: mean ms per step per chunk.

Why: with random labels this network's ReLU units die within a few hundred steps, so
whole rows of the weight gradients are exactly 0 from then on, and a momentum buffer
that sees only zeros decays by 0.9 per step, into float32's subnormals after about 800
steps. Every operation on a subnormal is a microcode assist on Intel cores (AMD's Zen
cores take most of them at full speed): PyTorch's step slows several times over.
The generated update flushes such state to 0 (generator/frontend/train.py,
FlushSubnormal), so its step keeps its speed. The table shows each chunk's time for
both peers and their ratio (PyTorch / generated, > 1: generated is faster), and how
many momentum-buffer elements each holds as subnormals at the end. The two runs start
from the same weights (benchmarks/mlp.py checks that their steps agree); over hundreds
of steps float rounding makes their losses drift apart while units die, until both
networks settle at the same dead state.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from _common import build_module, import_module, machine_facts, quiet_blas, run_child, set_threads

CHUNK = 250


def child(config: dict) -> None:
    import numpy as np
    from mlp import POOL, make_batch, torch_peer  # this folder is on sys.path: the script's own

    module = import_module(config["module"]["name"], config["module"]["build"])
    peer, steps = config["peer"], config["steps"]
    model = module.Model(seed=0)
    rng = np.random.default_rng(1064)
    batches = [make_batch(rng, 64) for _ in range(POOL)]
    if peer == "torch":
        import torch

        torch.set_num_threads(1)
        step, _ = torch_peer(model)
        batches = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in batches]
    else:
        quiet_blas()
        set_threads(module, 1)

        def step(x, labels):
            return model.train_step(x=x, labels=labels)

    chunks, loss = [], None
    for start in range(0, steps, CHUNK):
        t0 = time.perf_counter()
        for k in range(start, min(start + CHUNK, steps)):
            loss = step(*batches[k % POOL])
        chunks.append(1000 * (time.perf_counter() - t0) / (min(start + CHUNK, steps) - start))
    if peer == "torch":
        state = [s["momentum_buffer"].numpy() for s in step.optimizer.state.values()]
    else:
        state = [np.asarray(v) for v in model.optimizer_state().values()]
    tiny = np.finfo(np.float32).tiny
    subnormal = sum(int(((np.abs(b) < tiny) & (b != 0)).sum()) for b in state)
    out = {"peer": peer, "chunks_ms": chunks, "last_loss": float(loss), "subnormal_state": subnormal,
           "state_elements": sum(b.size for b in state)}
    Path(config["out"]).write_text(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE", help="write every figure to FILE as JSON")
    parser.add_argument("--steps", type=int, default=2000, help="train steps per peer (default 2000)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    from mlp import mlp_model

    print("Building the generated module (cached under build/bench/):", flush=True)
    info = build_module(mlp_model(), name="mlp_bench")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for peer in ("generated", "torch"):
            config = {"module": info, "peer": peer, "steps": args.steps, "out": str(Path(tmp) / f"{peer}.json")}
            results[peer] = run_child(__file__, config, 1, peer)
    gen, ref = results["generated"]["chunks_ms"], results["torch"]["chunks_ms"]
    print(f"\nMLP 784-512-256-10 train step, batch 64, 1 thread, ms per step (mean of each {CHUNK} steps)")
    print(f"{'steps':>11} | {'generated':>9} {'torch':>8} | {'ratio':>6}")
    print("-" * 43)
    for i, (g, t) in enumerate(zip(gen, ref)):
        print(f"{i * CHUNK:>5}-{min((i + 1) * CHUNK, args.steps):<5} | {g:9.3f} {t:8.3f} | {t / g:6.2f}")
    for peer, r in results.items():
        print(f"{peer}: last loss {r['last_loss']:.4f}, momentum-buffer elements subnormal at the end: "
              f"{r['subnormal_state']:,} of {r['state_elements']:,}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_facts(), "chunk": CHUNK, **results}, indent=1))


if __name__ == "__main__":
    main()
