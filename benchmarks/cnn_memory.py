"""Benchmark: DeepDSL's memory claim on ResNet-18 (CIFAR-style, 32x32), the generated
train step against PyTorch eager's, in the same run.

    python benchmarks/cnn_memory.py [--budget 2GiB] [--threads 2] [--json FILE]

1. Largest trainable batch under the same cap. Each trial is a child process that
   imports what it needs (numpy and the generated module; or torch), reads its own
   address-space size, then caps it with RLIMIT_AS at that size + the budget, builds
   the model (parameters, gradients) and runs one train step (SGD, softmax cross-
   entropy) on a random batch. A trial that ends in MemoryError, a failed
   allocation or any other error fails. Bisection finds the largest batch that
   trains, for each side. The cap counts every mapping the step makes (arena,
   parameters, gradients, workspaces, thread stacks, the allocator's slack), not
   only tensors: it is what "fits in this much memory" means to a user.
2. Train-step activation peak at batch 32: deepgen's measured arena high-water mark
   (memory_stats()["peak_bytes"], equal to the plan's prediction) plus its outputs;
   PyTorch's transient peak from its memory profiler (the highest running total of
   bytes allocated minus freed inside the step, over what was live before it:
   parameters and .grad), as benchmarks/memory.py measures it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import ROOT, build_module, import_module, machine_facts, thread_env

HERE = Path(__file__).resolve().parent
UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def parse_bytes(text: str) -> int:
    for unit, size in UNITS.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * size)
    return int(text)


def address_space() -> int:
    """This process's virtual memory size in bytes (/proc/self/statm)."""
    return int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def batch_arrays(batch: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return (rng.normal(size=(batch, 3, 32, 32)).astype(np.float32), rng.integers(0, 10, batch).astype(np.int64))


def child(config: dict) -> None:
    """One trial (config["kind"] == "trial") or the batch-32 activation peak ("peak")."""
    images, labels = batch_arrays(config["batch"])
    if config["peer"] == "deepgen":
        module = import_module("resnet18", config["build"])
        module.set_num_threads(config["threads"])
    else:
        import torch
        from torch.nn import functional as F

        sys.path.insert(0, str(ROOT / "tests"))
        from torch_models import ResNet18

        torch.set_num_threads(config["threads"])
    result = {}
    if config["kind"] == "trial":
        base = address_space()
        resource.setrlimit(resource.RLIMIT_AS, (base + config["budget"], base + config["budget"]))
        result["base_bytes"] = base
    if config["peer"] == "deepgen":
        model = module.Model(seed=0)
        model.train_step(images=images, labels=labels)
        stats = model.memory_stats()
        result["peak_bytes"] = stats["peak_bytes"] + 40 * config["batch"]  # + the logits output
        result["predicted_bytes"] = stats["predicted_peak_bytes"]
    else:
        net = ResNet18()
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        x, y = torch.tensor(images), torch.tensor(labels)

        def step(_):
            opt.zero_grad(set_to_none=False)
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            return loss

        if config["kind"] == "peak":
            from memory import profile_window

            step(None)  # .grad exists, as in the steady state
            measured, _ = profile_window(lambda: None, step)
            result["peak_bytes"] = measured["transient_peak_bytes"]
        else:
            step(None)
    Path(config["out"]).write_text(json.dumps(result))


def run(config: dict) -> dict | None:
    with tempfile.TemporaryDirectory() as tmp:
        config = dict(config, out=str(Path(tmp) / "out.json"))
        proc = subprocess.run([sys.executable, str(HERE / "cnn_memory.py"), "--child", json.dumps(config)],
                              env=thread_env(config["threads"]), capture_output=True, text=True)
        if proc.returncode != 0 or not Path(config["out"]).exists():
            return None
        return json.loads(Path(config["out"]).read_text())


def largest_batch(peer: str, base: dict) -> tuple:
    """Bisection over batch sizes: (largest that trains, smallest that fails)."""
    ok, bad = 0, None
    batch = 16
    while bad is None:  # grow until a trial fails
        trains = run(dict(base, peer=peer, kind="trial", batch=batch)) is not None
        print(f"    {peer:8s} batch {batch:5d}: {'trains' if trains else 'fails'}", flush=True)
        ok, bad, batch = (batch, None, batch * 2) if trains else (ok, batch, batch)
    while bad - ok > max(1, ok // 64):
        mid = (ok + bad) // 2
        trains = run(dict(base, peer=peer, kind="trial", batch=mid)) is not None
        print(f"    {peer:8s} batch {mid:5d}: {'trains' if trains else 'fails'}", flush=True)
        ok, bad = (mid, bad) if trains else (ok, mid)
    return ok, bad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", default="2GiB", help="address space each child may add (default 2GiB)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    from generator.frontend.loader import load_model

    built = build_module(load_model(str(ROOT / "examples" / "resnet18.py")))
    budget = parse_bytes(args.budget)
    base = {"build": built["build"], "threads": args.threads, "budget": budget}
    print(f"ResNet-18 (32x32) train step, {args.threads} thread(s), each child capped at its own size + "
          f"{args.budget} (RLIMIT_AS)", flush=True)
    largest = {peer: largest_batch(peer, base) for peer in ("deepgen", "torch")}
    peaks = {peer: run(dict(base, peer=peer, kind="peak", batch=32)) for peer in ("deepgen", "torch")}
    ratio = largest["deepgen"][0] / max(largest["torch"][0], 1)
    peak_ratio = peaks["deepgen"]["peak_bytes"] / peaks["torch"]["peak_bytes"]
    print(f"\nlargest batch that trains under {args.budget}:  deepgen {largest['deepgen'][0]}  "
          f"PyTorch {largest['torch'][0]}  ratio {ratio:.2f} (target >= 1.5)")
    print(f"train-step activation peak at batch 32:  deepgen {peaks['deepgen']['peak_bytes'] / 2**20:.1f} MiB "
          f"(arena measured = predicted: {peaks['deepgen']['peak_bytes'] - 1280 == peaks['deepgen']['predicted_bytes']})"
          f"  PyTorch {peaks['torch']['peak_bytes'] / 2**20:.1f} MiB (profiler)  ratio {peak_ratio:.2f} (target <= 0.6)")
    if args.json:
        Path(args.json).write_text(json.dumps({"largest": largest, "peaks": peaks, "batch_ratio": ratio,
                                               "peak_ratio": peak_ratio, "machine": machine_facts()}, indent=1))


if __name__ == "__main__":
    main()
