"""The generated TreeLSTM on a GPU (deepgen's CUDA target) against PyTorch CUDA.

    python benchmarks/treelstm_cuda.py [--quick] [--json FILE] [--hidden 256 512] [--trees 1 10 100]

Peers, each mapping a batch of trees (the int64 numpy arrays the generated
module takes) to the roots' hidden states as a numpy array:

- generated:   examples/treelstm.py generated with --target cuda (inputs to the
               device, the inspector on the host, one batched step per level,
               outputs back; it also copies every node's h back, the peers only the roots');
- torch-node:  PyTorch CUDA, one node at a time (as a per-node framework runs it);
- torch-level: PyTorch CUDA, level-batched from the same height schedule.

Workloads, the height schedule and the TreeLSTM model at other hidden sizes
come from benchmarks/treelstm.py (the CPU benchmark), by import. All peers use
the generated model's weights and are checked against each other first. Times
are wall-clock milliseconds per batch (median of repeated runs after a
warm-up); each peer returns numpy, so every run includes its synchronization.

Needs torch with CUDA and the CUDA toolkit; without a GPU it says so and exits 0.
The build is cached in build/bench-cuda (CUDAARCHS picks the GPU architectures,
default: native).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CACHE = ROOT / "build" / "bench-cuda"
for path in (str(ROOT), str(HERE)):
    if path not in sys.path:
        sys.path.insert(0, path)

import treelstm as cpu_bench  # noqa: E402  (benchmarks/treelstm.py: workloads, schedule, model)


def build(hidden: int, emulate: bool = False) -> object:
    """The TreeLSTM at `hidden` generated for CUDA and built with CMake (Release),
    reused while the generated sources are unchanged. `emulate`: the CPU
    emulation build (DG_CUDA_EMULATE), to try this script without a GPU."""
    import subprocess

    from _common import import_module

    from generator.codegen.writer import MANIFEST

    from generator.pipeline import generate

    graph = cpu_bench.treelstm_model(hidden).build(f"treelstm_cuda_h{hidden}")
    folder = CACHE / (graph.name + ("_emulated" if emulate else ""))
    src, out = folder / "src", folder / "build"
    archs = os.environ.get("CUDAARCHS", "native")
    t0 = time.perf_counter()
    generate(graph, src, target="cuda", force=True)
    key = json.dumps({"files": json.loads((src / MANIFEST).read_text())["files"], "version": sys.version,
                      "archs": archs, "emulate": emulate}, sort_keys=True)
    stamp = out / ".deepgen-build-key"
    reused = stamp.is_file() and stamp.read_text() == key and any(out.glob(f"{graph.name}*.so"))
    if not reused:
        defines = ["-DCMAKE_BUILD_TYPE=Release", f"-DPython_EXECUTABLE={sys.executable}",
                   f"-D{graph.name.upper()}_EXAMPLE=OFF"]
        defines += ["-DDG_CUDA_EMULATE=ON"] if emulate else [f"-DCMAKE_CUDA_ARCHITECTURES={archs}"]
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        for cmd in (["cmake", "-S", str(src), "-B", str(out), *gen, *defines],
                    ["cmake", "--build", str(out), "--parallel", str(os.cpu_count() or 2)]):
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
        stamp.write_text(key)
    print(f"  {graph.name}: {'reused' if reused else 'built'} in {time.perf_counter() - t0:.1f} s ({out})", flush=True)
    return import_module(graph.name, str(out))


def torch_peers(params: dict, hidden: int, device) -> dict:
    """PyTorch CUDA per-node and level-batched TreeLSTMs with the given weights."""
    import torch

    tp = {k: torch.from_numpy(v).to(device) for k, v in params.items()}
    emb, w_leaf, b_leaf, u, b = (tp[k] for k in ("emb", "w_leaf", "b_leaf", "u", "b"))
    sig, tanh = torch.sigmoid, torch.tanh

    @torch.no_grad()
    def torch_node(batch):
        children = batch["trees_children"].tolist()
        words = torch.from_numpy(batch["trees_words"]).to(device)
        hs, cs = [None] * len(children), [None] * len(children)
        for n, (left, right) in enumerate(children):  # children before parents
            if left < 0:
                i, o, g = torch.addmm(b_leaf, emb[words[n : n + 1]], w_leaf).chunk(3, 1)
                c = sig(i) * tanh(g)
            else:
                gates = torch.addmm(b, torch.cat((hs[left], hs[right]), 1), u)
                i, o, g, f_l, f_r = gates.chunk(5, 1)
                c = sig(i) * tanh(g) + sig(f_l) * cs[left] + sig(f_r) * cs[right]
            hs[n], cs[n] = sig(o) * tanh(c), c
        return torch.cat([hs[r] for r in batch["trees_roots"].tolist()], 0).cpu().numpy()

    @torch.no_grad()
    def torch_level(batch):
        s = cpu_bench.schedule(batch)  # the inspector, on the host as in the generated code
        start, leaves = s["start"], s["start"][1]
        hs = torch.empty(s["nodes"], hidden, device=device)
        cs = torch.empty(s["nodes"], hidden, device=device)
        x = emb.index_select(0, torch.from_numpy(s["leaf_words"]).to(device))
        i, o, g = torch.addmm(b_leaf, x, w_leaf).chunk(3, 1)
        c = sig(i) * tanh(g)
        cs[:leaves], hs[:leaves] = c, sig(o) * tanh(c)
        child_rows = torch.from_numpy(s["child_rows"]).to(device)
        for level in range(1, len(start) - 1):
            lo, hi = start[level], start[level + 1]
            idx = child_rows[2 * lo : 2 * hi]  # [left0, right0, left1, ...]
            hcat = hs.index_select(0, idx).view(hi - lo, 2 * hidden)
            cc = cs.index_select(0, idx).view(hi - lo, 2, hidden)
            i, o, g, f_l, f_r = torch.addmm(b, hcat, u).chunk(5, 1)
            c = sig(i) * tanh(g) + sig(f_l) * cc[:, 0] + sig(f_r) * cc[:, 1]
            cs[lo:hi], hs[lo:hi] = c, sig(o) * tanh(c)
        return hs.index_select(0, torch.from_numpy(s["root_rows"]).to(device)).cpu().numpy()

    return {"torch-node": torch_node, "torch-level": torch_level}


def time_ms(fn, batches, target_s: float, min_reps: int) -> dict:
    """Milliseconds per batch over repeated passes through `batches` after a warm-up pass."""
    for batch in batches:
        fn(batch)
    times = []
    deadline = time.perf_counter() + target_s
    while len(times) < min_reps or (time.perf_counter() < deadline and len(times) < 1000):
        t0 = time.perf_counter()
        for batch in batches:
            fn(batch)
        times.append((time.perf_counter() - t0) * 1e3 / len(batches))
    return {"median_ms": statistics.median(times), "min_ms": min(times), "reps": len(times)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and shorter timing (about a minute)")
    parser.add_argument("--hidden", type=int, nargs="+", help="hidden sizes (default 256 512; --quick: 256)")
    parser.add_argument("--trees", type=int, nargs="+", help="trees per batch (default 1 10 100; --quick: 1 10 50)")
    parser.add_argument("--json", help="write every figure to this file")
    parser.add_argument("--emulate", action="store_true",
                        help="no GPU: the CPU emulation build against PyTorch on the CPU (checks this script only)")
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        print("treelstm_cuda: torch is not installed; nothing to compare against")
        return 0
    if not torch.cuda.is_available() and not args.emulate:
        print("treelstm_cuda: no CUDA device visible to torch; run this on a GPU machine")
        return 0
    if not args.emulate and shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").is_file():
        print("treelstm_cuda: nvcc not found; the CUDA toolkit is needed to build the generated model")
        return 0
    import numpy as np

    device = torch.device("cpu" if args.emulate else "cuda")
    hiddens = args.hidden or ([256] if args.quick else [256, 512])
    trees = args.trees or ([1, 10, 50] if args.quick else [1, 10, 100])
    target_s, min_reps, count = (0.5, 3, 3) if args.quick else (2.0, 5, 5)
    gpu = "CPU (emulation, not a measurement)" if args.emulate else torch.cuda.get_device_name(0)
    print(f"TreeLSTM on {gpu}: generated (deepgen CUDA target) vs PyTorch {torch.__version__} CUDA", flush=True)
    results = {"device": gpu, "torch": torch.__version__, "runs": []}
    for hidden in hiddens:
        module = build(hidden, args.emulate)
        model = module.Model(seed=0)
        print(f"  build_info: {module.build_info()}")
        params = {k: np.array(v, dtype=np.float32, copy=True) for k, v in model.parameters().items()}
        peers = {"generated": lambda batch: model.forward(**batch)["root_h"], **torch_peers(params, hidden, device)}
        for size in trees:
            batches = cpu_bench.make_batches(seed=size, trees=size, count=count)
            want = peers["torch-level"](batches[0])
            for name, fn in peers.items():
                got = fn(batches[0])
                if not np.allclose(got, want, rtol=1e-4, atol=1e-4):
                    print(f"MISMATCH: {name} differs from torch-level by {np.abs(got - want).max():.3g} "
                          f"(hidden {hidden}, {size} trees)")
                    return 1
            stats = cpu_bench.workload_stats(batches)
            row = {"hidden": hidden, "trees": size, "workload": stats}
            for name, fn in peers.items():
                reps = 1 if name == "torch-node" and size >= 50 else min_reps
                row[name] = time_ms(fn, batches, target_s if name != "torch-node" else target_s / 2, reps)
            results["runs"].append(row)
            gen = row["generated"]["median_ms"]
            print(f"  hidden {hidden:4d}, {size:3d} trees ({stats['nodes_per_batch']:.0f} nodes, "
                  f"{stats['levels_per_batch']:.0f} levels): generated {gen:8.3f} ms | "
                  + " | ".join(f"{n} {row[n]['median_ms']:8.3f} ms ({row[n]['median_ms'] / gen:5.1f}x)"
                               for n in ("torch-node", "torch-level")), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
        print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
