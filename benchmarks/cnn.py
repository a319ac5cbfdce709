"""Benchmark: convolutional networks, the generated modules against PyTorch eager (oneDNN).

    python benchmarks/cnn.py [--json FILE] [--quick]

Cases (ratio = PyTorch / generated median time, > 1: generated is faster):
  lenet     examples/lenet.py (8x8 digits), train step at batch 32 (Adam). Target >= 2.
  resnet18  examples/resnet18.py (CIFAR-style, 32x32): inference (eval mode, PyTorch
            under no_grad in eval mode) at batch 1 and 32, target >= 1.0; train step
            (SGD, training mode) at batch 1 and 32, target >= 0.8.
  conv      one 3x3 convolution (64 -> 64 channels, 32x32, pad 1, batch 32) forward in a
            generated module of its own, next to the generated GEMM of the same work
            (M = 32*1024, K = 576, N = 64): GFLOP/s of each.
PyTorch runs the twins in tests/torch_models.py with the generated Model(seed=0)'s
weights copied in; before timing, both sides' ResNet-18 logits on one batch must agree
(1e-3 of their largest magnitude). Each (thread count, peer) runs in a child process
of its own with the thread variables set before numpy or torch is imported; medians
over rounds (3, 1 with --quick), peers in alternating order.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from _common import ROOT, build_module, gemm_model, import_module, machine_facts, measure, quiet_blas, run_rounds, set_threads

THREADS = (1, 2)
PEERS = ("generated", "torch")
CASES = [("lenet", "train", 32), ("resnet18", "infer", 1), ("resnet18", "infer", 32), ("resnet18", "train", 1),
         ("resnet18", "train", 32)]
TARGETS = {"lenet": 2.0, "infer": 1.0, "train": 0.8}
CONV = {"N": 32, "C": 64, "HW": 32}


def conv_model():
    import generator as dg

    @dg.model
    def conv_bench():
        x = dg.input("x", (dg.dim("N"), CONV["C"], CONV["HW"], CONV["HW"]))
        return {"y": dg.conv2d_layer(x, CONV["C"], 3, padding=1, bias=False, name="conv")}

    return conv_bench


def conv_flops() -> float:
    return 2.0 * CONV["N"] * CONV["C"] * CONV["HW"] ** 2 * CONV["C"] * 9


def batch(name: str, n: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    shape = (n, 1, 8, 8) if name == "lenet" else (n, 3, 32, 32)
    return rng.normal(size=shape).astype(np.float32), rng.integers(0, 10, n).astype(np.int64)


def torch_twin(name: str, model):
    sys.path.insert(0, str(ROOT / "tests"))
    from torch_models import DENSE, TWINS, copy_into_torch

    net = TWINS[name]()
    buffers = dict(model.buffers()) if hasattr(model, "buffers") else {}
    copy_into_torch(net, dict(model.parameters()), buffers, DENSE.get(name, ()))
    return net


def step_fn(peer: str, name: str, mode: str, module, n: int):
    """A function running one step of the case on one seeded batch, cycling 4 batches."""
    model = module.Model(seed=0)
    batches = [batch(name, n, k) for k in range(4)]
    state = {"k": 0}
    if peer == "generated":
        if mode == "infer":
            model.eval()

        def one():
            x, y = batches[state["k"] % 4]
            state["k"] += 1
            if mode == "infer":
                model.forward(images=x)
            else:
                model.train_step(images=x, labels=y)

        return one
    import torch
    from torch.nn import functional as F

    net = torch_twin(name, model)
    hyper = model.hyperparameters()
    opt = (torch.optim.Adam(net.parameters(), lr=hyper["lr"]) if "beta1" in hyper
           else torch.optim.SGD(net.parameters(), lr=hyper["lr"]))
    tb = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in batches]
    net.train(mode != "infer")

    def one():
        x, y = tb[state["k"] % 4]
        state["k"] += 1
        if mode == "infer":
            with torch.no_grad():
                net(x)
        else:
            opt.zero_grad()
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            loss.item()

    return one


def child(config: dict) -> None:
    import numpy as np

    threads, peer = config["threads"], config["peer"]
    modules = {name: import_module(info["name"], info["build"]) for name, info in config["modules"].items()}
    out = {"threads": threads, "peer": peer, "round": config["round"], "cases": []}
    if peer == "torch":
        import torch

        torch.set_num_threads(threads)
    else:
        quiet_blas()  # numpy only makes the inputs here (see _common.quiet_blas)
        for m in modules.values():
            set_threads(m, threads)
    for name, mode, n in CASES:
        t = measure(step_fn(peer, name, mode, modules[name], n), config["target_s"], config["min_reps"])
        times = [1000 * s for s in t["times"]]
        out["cases"].append({"case": [name, mode, n], "times_ms": times})
        print(f"  [round {config['round'] + 1}, {threads} thr] {name:8s} {mode:5s} batch {n:2d} {peer:9s} "
              f"{statistics.median(times):9.2f} ms", flush=True)
    if peer == "generated":
        x = np.random.default_rng(0).normal(size=(CONV["N"], CONV["C"], CONV["HW"], CONV["HW"])).astype(np.float32)
        conv = modules["conv"].Model(seed=0)
        a = np.random.default_rng(1).normal(size=(CONV["N"] * CONV["HW"] ** 2, 9 * CONV["C"])).astype(np.float32)
        gemm = modules["gemm"].Model(seed=0)
        for label, fn in (("conv", lambda: conv.forward(x=x)), ("gemm", lambda: gemm.forward(x=a))):
            t = measure(fn, config["target_s"], config["min_reps"])
            out[label + "_gflops"] = conv_flops() / statistics.median(t["times"]) / 1e9
        print(f"  [round {config['round'] + 1}, {threads} thr] conv {out['conv_gflops']:.1f} GFLOP/s, "
              f"gemm {out['gemm_gflops']:.1f} GFLOP/s at the same work", flush=True)
    Path(config["out"]).write_text(json.dumps(out))


def check(modules) -> float:
    import numpy as np
    import torch

    model = modules["resnet18"].Model(seed=0)
    net = torch_twin("resnet18", model)
    x, _ = batch("resnet18", 2, 0)
    got = model.forward(images=x)["logits"]
    want = net(torch.from_numpy(x)).detach().numpy()
    err = float(np.abs(got - want).max() / np.abs(want).max())
    if err > 1e-3:
        raise SystemExit(f"ResNet-18 logits differ from PyTorch's: {err:.2e} of the largest")
    return err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--quick", action="store_true", help="one round, short measurements")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    from generator.frontend.loader import load_model

    print("Building the generated modules (cached under build/bench/):", flush=True)
    infos = {name: build_module(load_model(str(ROOT / "examples" / f"{name}.py"))) for name in ("lenet", "resnet18")}
    infos["conv"] = build_module(conv_model())
    infos["gemm"] = build_module(gemm_model(9 * CONV["C"], CONV["C"]), name="conv_gemm")
    modules = {name: import_module(info["name"], info["build"]) for name, info in infos.items()}
    print(f"ResNet-18 logits agree with PyTorch's ({check(modules):.1e} of the largest)", flush=True)

    rounds = 1 if args.quick else 3
    config = {"modules": infos, "target_s": 0.5 if args.quick else 2.0 / rounds, "min_reps": 3}
    t0 = time.perf_counter()
    results = run_rounds(__file__, config, rounds, THREADS, PEERS, "cnn")
    elapsed = time.perf_counter() - t0
    pooled, gflops = {}, {}
    for res in results:
        for c in res["cases"]:
            pooled.setdefault((tuple(c["case"]), res["threads"], res["peer"]), []).extend(c["times_ms"])
        if res["peer"] == "generated":
            for label in ("conv", "gemm"):
                gflops.setdefault((label, res["threads"]), []).append(res[label + "_gflops"])
    print(f"\nmedian ms per step ({rounds} round(s) in {elapsed:.0f} s); ratio = torch / generated")
    head = f"{'case':24s} {'thr':>3} | {'generated':>9} {'torch':>9} | {'ratio':>6} {'target':>6}"
    print(head + "\n" + "-" * len(head))
    records = []
    for name, mode, n in CASES:
        for threads in THREADS:
            gen = statistics.median(pooled[((name, mode, n), threads, "generated")])
            tor = statistics.median(pooled[((name, mode, n), threads, "torch")])
            target = TARGETS["lenet" if name == "lenet" else mode]
            records.append({"case": f"{name} {mode} batch {n}", "threads": threads, "generated_ms": gen,
                            "torch_ms": tor, "ratio": tor / gen, "target": target})
            print(f"{records[-1]['case']:24s} {threads:3d} | {gen:9.2f} {tor:9.2f} | {tor / gen:6.2f} {'>=' + str(target):>6}")
    for threads in THREADS:
        conv, gemm = (statistics.median(gflops[(label, threads)]) for label in ("conv", "gemm"))
        print(f"3x3 conv 64->64 32x32 batch 32, {threads} thr: conv {conv:.1f} GFLOP/s, GEMM at the same work "
              f"{gemm:.1f} GFLOP/s ({conv / gemm:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": machine_facts(), "records": records,
                                               "gflops": {f"{k[0]}_{k[1]}thr": v for k, v in gflops.items()}},
                                              indent=1) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
