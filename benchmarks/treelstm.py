"""Benchmark: the generated binary TreeLSTM against PyTorch and numpy.

    python benchmarks/treelstm.py [--json FILE] [--quick] [--hidden 64 128 256 512]

Peers (all compute the same function with the same weights, copied from the
generated module's Model(seed=0).parameters()):

  generated    the deepgen module (examples/treelstm.py's model at HIDDEN 64, 128,
               256 and 512, or those given with --hidden), built with plain CMake in Release mode
               under build/bench/; its set_num_threads(n) sets the thread count when
               the module has one (else its default is used and reported)
  torch-node   PyTorch eager, one node at a time in topological order
  torch-level  PyTorch, one batched step for all leaves and one per tree level
               (index_select gathers the children, one matmul per level)
  numpy-level  the same level-batched algorithm in numpy

Workload: seeded SST-like batches of 1 and 10 binary trees (random merges of
pending subtrees, generator.treebatch.random_batch; 2..50 leaves per tree, about
18 on average), made once and shared by every measurement.

Threads 1 and 2. Each (thread count, peer) pair runs in a child process of its
own, with OMP_NUM_THREADS / OPENBLAS_NUM_THREADS / MKL_NUM_THREADS set before
numpy or torch are imported, threadpoolctl limits (when installed) and
torch.set_num_threads on top; one peer's idle-spinning thread pool cannot slow
another's. Every child checks its peer's root states against the generated
module's (np.allclose, atol 1e-4) on every batch before it times anything.

Timings are medians of repeated runs (time.perf_counter) after a warm-up, each
run covering the whole set of batches, pooled over 3 rounds (1 with --quick) in
which every child runs once, the peers' order reversed every other round. The
peers' timed region starts from the same int64 numpy arrays the generated module
takes, so it includes their own scheduling (heights, level order), as forward()
includes its inspector. The run reports how steady the machine was: CPU taken by
other processes or the hypervisor while each child ran, and a fixed speed probe
at each child's start and end (a VM's host can slow it down invisibly).

Per-node ratio: after the table, torch-node / generated for every hidden size, batch
and thread count, against issue #20's target (>= 14x at H <= 128, batch 10, 1 thread;
at H 64 and 128 PyTorch's per-node cost is almost all per-op overhead).

GEMM: the matmul the generated code runs once per tree level, [M, 2H] @ [2H, 5H],
as its own tiny generated model (y = x[M, K] @ w[K, N]) timed through forward()
(nothing subtracted) against numpy's float32 matmul, in GFLOP/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from _common import (
    BUSY_LIMIT,
    PEAK_N,
    ROOT,
    build_module,
    gemm_model,
    import_module,
    machine_facts,
    measure,
    quiet_blas,
    set_threads,
    sgemm_peak_gflops,
)
from _common import run_child as run_child_process

VOCAB, EMBED = 1000, 128
HIDDENS = (64, 128, 256, 512)  # 64, 128: Cortex's and Cavs's models, where per-node overhead dominates
PER_NODE_TARGET = 14.0  # issue #20: torch-node / generated at H <= 128, batch 10, 1 thread
BATCHES = (1, 10)
THREADS = (1, 2)
GEMM_M = (1, 5, 20, 60)
MEAN_LEAVES, MIN_LEAVES, MAX_LEAVES = 18, 2, 50
PEERS = ("generated", "torch-node", "torch-level", "numpy-level")
GEMM_PEER = {"generated": "generated", "numpy-level": "numpy"}  # which child also times the GEMM
ATOL = 1e-4


# ----------------------------------------------------------------------------
# Models (DSL) and builds
# ----------------------------------------------------------------------------


def treelstm_model(hidden: int):
    """examples/treelstm.py at another hidden size (model name treelstm_h<H>)."""
    import runpy

    example = runpy.run_path(str(ROOT / "examples" / "treelstm.py"))
    return example["treelstm_model"](hidden, f"treelstm_h{hidden}")


# ----------------------------------------------------------------------------
# Workload
# ----------------------------------------------------------------------------


def leaf_counts(rng, count: int):
    """SST-like sentence lengths: a gamma distribution with mean 18, clipped to [2, 50]."""
    import numpy as np

    draws = np.rint(rng.gamma(4.0, MEAN_LEAVES / 4.0, size=count))
    return np.clip(draws, MIN_LEAVES, MAX_LEAVES).astype(int)


def make_batches(seed: int, trees: int, count: int) -> list:
    """`count` batches of `trees` binary trees (random merges of pending subtrees,
    generator.treebatch.random_batch); children come before parents."""
    import numpy as np
    from generator.treebatch import random_batch

    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(count):
        children, words, roots, offset = [], [], [], 0
        for n in leaf_counts(rng, trees):
            one = random_batch(rng, 1, 2, VOCAB, min_leaves=int(n), max_leaves=int(n))
            ch = one["children"]
            children.append(np.where(ch >= 0, ch + offset, -1))
            words.append(one["words"])
            roots.append(one["roots"] + offset)
            offset += len(ch)
        batch = {
            "trees_children": np.ascontiguousarray(np.concatenate(children), dtype=np.int64),
            "trees_words": np.ascontiguousarray(np.concatenate(words), dtype=np.int64),
            "trees_roots": np.ascontiguousarray(np.concatenate(roots), dtype=np.int64),
        }
        ch = batch["trees_children"]
        ids = np.arange(len(ch))
        assert ((ch < ids[:, None]) | (ch == -1)).all(), "children must come before parents"
        assert ((ch[:, 0] == -1) == (ch[:, 1] == -1)).all(), "a binary tree node has 0 or 2 children"
        batches.append(batch)
    return batches


def save_batches(path: Path, workloads: dict) -> None:
    import numpy as np

    arrays = {
        f"b{size}/{k}/{field}": a
        for size, batches in workloads.items()
        for k, batch in enumerate(batches)
        for field, a in batch.items()
    }
    np.savez(path, **arrays)


def load_batches(path: str) -> dict:
    import numpy as np

    workloads = {}
    with np.load(path) as data:
        for key in data.files:
            size, k, field = key.split("/")
            batches = workloads.setdefault(int(size[1:]), {})
            batches.setdefault(int(k), {})[field] = np.ascontiguousarray(data[key])
    return {size: [b[k] for k in sorted(b)] for size, b in sorted(workloads.items())}


def schedule(batch):
    """Heights, nodes sorted by height (leaves first), level boundaries, each sorted
    node's children as sorted rows, the leaves' words and the roots' rows. Needs
    children before parents (checked when the workload is made)."""
    import numpy as np

    children = batch["trees_children"]
    height = [0] * len(children)
    for n, (left, right) in enumerate(children.tolist()):
        if left >= 0:
            height[n] = max(height[left], height[right]) + 1
    height = np.array(height)
    order = np.argsort(height, kind="stable")
    counts = np.bincount(height)
    start = [0] + np.cumsum(counts).tolist()
    pos = np.empty(len(children), dtype=np.int64)
    pos[order] = np.arange(len(children))
    child_rows = pos[children[order]]  # rows of leaves hold junk (pos[-1]); never read
    return {
        "start": start,
        "child_rows": np.ascontiguousarray(child_rows.reshape(-1)),
        "leaf_words": np.ascontiguousarray(batch["trees_words"][order[: counts[0]]]),
        "root_rows": pos[batch["trees_roots"]],
        "nodes": len(children),
    }


def workload_stats(batches) -> dict:
    import numpy as np

    nodes, leaves, levels, level_rows, leaf_rows = [], [], [], [], []
    for batch in batches:
        s = schedule(batch)
        nodes.append(s["nodes"])
        leaf_rows.append(s["start"][1])
        leaves.append(s["start"][1] / len(batch["trees_roots"]))
        levels.append(len(s["start"]) - 1)
        level_rows += [s["start"][i + 1] - s["start"][i] for i in range(1, len(s["start"]) - 1)]
    return {
        "batches": len(batches),
        "nodes_per_batch": round(float(np.mean(nodes)), 1),
        "leaves_per_tree": round(float(np.mean(leaves)), 1),
        "levels_per_batch": round(float(np.mean(levels)), 1),
        "internal_level_rows_median": float(np.median(level_rows)),
        "internal_level_rows_mean": round(float(np.mean(level_rows)), 1),
        "internal_level_rows_max": int(np.max(level_rows)),
        "leaves_per_batch": round(float(np.mean(leaf_rows)), 1),
    }


def forward_flops(stats: dict, hidden: int) -> float:
    """Multiply-add FLOPs of one forward batch: each leaf's [EMBED] @ [EMBED, 3H]
    and each internal node's [2H] @ [2H, 5H] (the elementwise work not counted)."""
    leaves = stats["leaves_per_batch"]
    internal = stats["nodes_per_batch"] - leaves
    return 2.0 * leaves * EMBED * 3 * hidden + 2.0 * internal * 2 * hidden * 5 * hidden


# ----------------------------------------------------------------------------
# Peers: each maps a batch (the int64 arrays the generated module takes) to root_h
# ----------------------------------------------------------------------------


def make_peer(name: str, model, hidden: int):
    """The callable for peer `name`, using the weights of `model` (a generated Model)."""
    import numpy as np

    if name == "generated":
        return lambda batch: model.forward(**batch)["root_h"]
    params = {k: np.array(v, dtype=np.float32, copy=True) for k, v in model.parameters().items()}
    if name == "numpy-level":
        return _numpy_level(params, hidden)
    import torch

    tp = {k: torch.from_numpy(v) for k, v in params.items()}
    return (_torch_node if name == "torch-node" else _torch_level)(tp, hidden)


def _torch_node(tp, hidden):
    import torch

    emb, w_leaf, b_leaf, u, b = (tp[k] for k in ("emb", "w_leaf", "b_leaf", "u", "b"))
    sig, tanh = torch.sigmoid, torch.tanh

    @torch.no_grad()
    def torch_node(batch):
        children = batch["trees_children"].tolist()
        words = batch["trees_words"].tolist()
        hs, cs = [None] * len(children), [None] * len(children)
        for n, (left, right) in enumerate(children):  # children before parents
            if left < 0:
                w = words[n]
                i, o, g = torch.addmm(b_leaf, emb[w : w + 1], w_leaf).chunk(3, 1)
                c = sig(i) * tanh(g)
            else:
                gates = torch.addmm(b, torch.cat((hs[left], hs[right]), 1), u)
                i, o, g, f_l, f_r = gates.chunk(5, 1)
                c = sig(i) * tanh(g) + sig(f_l) * cs[left] + sig(f_r) * cs[right]
            hs[n], cs[n] = sig(o) * tanh(c), c
        return torch.cat([hs[r] for r in batch["trees_roots"].tolist()], 0).numpy()

    return torch_node


def _torch_level(tp, hidden):
    import torch

    emb, w_leaf, b_leaf, u, b = (tp[k] for k in ("emb", "w_leaf", "b_leaf", "u", "b"))
    sig, tanh = torch.sigmoid, torch.tanh

    @torch.no_grad()
    def torch_level(batch):
        s = schedule(batch)
        start, leaves = s["start"], s["start"][1]
        hs, cs = torch.empty(s["nodes"], hidden), torch.empty(s["nodes"], hidden)
        x = emb.index_select(0, torch.from_numpy(s["leaf_words"]))
        i, o, g = torch.addmm(b_leaf, x, w_leaf).chunk(3, 1)
        c = sig(i) * tanh(g)
        cs[:leaves], hs[:leaves] = c, sig(o) * tanh(c)
        child_rows = torch.from_numpy(s["child_rows"])
        for level in range(1, len(start) - 1):
            lo, hi = start[level], start[level + 1]
            idx = child_rows[2 * lo : 2 * hi]  # [left0, right0, left1, ...]
            hcat = hs.index_select(0, idx).view(hi - lo, 2 * hidden)  # = concat([h_l, h_r], 1)
            cc = cs.index_select(0, idx).view(hi - lo, 2, hidden)
            i, o, g, f_l, f_r = torch.addmm(b, hcat, u).chunk(5, 1)
            c = sig(i) * tanh(g) + sig(f_l) * cc[:, 0] + sig(f_r) * cc[:, 1]
            cs[lo:hi], hs[lo:hi] = c, sig(o) * tanh(c)
        return hs.index_select(0, torch.from_numpy(s["root_rows"])).numpy()

    return torch_level


def _numpy_level(params, hidden):
    import numpy as np

    emb, w_leaf, b_leaf, u, b = (params[k] for k in ("emb", "w_leaf", "b_leaf", "u", "b"))
    hd = hidden

    def sigmoid_(x):  # in place; exp overflowing to inf for very negative x gives the right 0
        np.negative(x, out=x)
        np.exp(x, out=x)
        x += 1.0
        np.reciprocal(x, out=x)
        return x

    def numpy_level(batch):
        s = schedule(batch)
        start, leaves = s["start"], s["start"][1]
        hs = np.empty((s["nodes"], hd), np.float32)
        cs = np.empty((s["nodes"], hd), np.float32)
        gates = emb[s["leaf_words"]] @ w_leaf
        gates += b_leaf
        with np.errstate(over="ignore"):
            c = sigmoid_(gates[:, :hd]) * np.tanh(gates[:, 2 * hd :])
            cs[:leaves] = c
            np.multiply(sigmoid_(gates[:, hd : 2 * hd]), np.tanh(c), out=hs[:leaves])
            child_rows = s["child_rows"]
            for level in range(1, len(start) - 1):
                lo, hi = start[level], start[level + 1]
                idx = child_rows[2 * lo : 2 * hi]  # [left0, right0, left1, ...]
                hcat = hs[idx].reshape(hi - lo, 2 * hd)  # = concat([h_l, h_r], 1)
                cc = cs[idx].reshape(hi - lo, 2, hd)
                gates = hcat @ u
                gates += b
                c = sigmoid_(gates[:, :hd]) * np.tanh(gates[:, 2 * hd : 3 * hd])
                c += sigmoid_(gates[:, 3 * hd : 4 * hd]) * cc[:, 0]
                c += sigmoid_(gates[:, 4 * hd :]) * cc[:, 1]
                cs[lo:hi] = c
                np.multiply(sigmoid_(gates[:, hd : 2 * hd]), np.tanh(c), out=hs[lo:hi])
        return hs[s["root_rows"]]

    return numpy_level


# ----------------------------------------------------------------------------
# Timing: a child process per (thread count, peer)
# ----------------------------------------------------------------------------


def speed_probe(config: dict) -> float:
    """Median ms of one fixed single-threaded job (the generated [20, 512] @ [512, 1280]
    GEMM): the same in every child on a steady machine. A host that slows the VM
    down without showing it as steal time shows up here."""
    import numpy as np

    info = config["modules"]["gemm_k512_n1280"]
    module = import_module(info["name"], info["build"])
    set_threads(module, 1)
    model = module.Model(seed=0)
    x = np.ones((20, 512), np.float32)
    return 1000 * statistics.median(measure(lambda: model.forward(x=x), 0.15, 20)["times"])


def child(config: dict) -> None:
    import numpy as np

    global HIDDENS
    HIDDENS = tuple(config["hiddens"])
    threads, peer = config["threads"], config["peer"]
    out = {"threads": threads, "peer": peer, "round": config["round"], "treelstm": [], "gemm": []}
    if peer.startswith("torch"):
        import torch

        torch.set_num_threads(threads)
        out["torch_threads"] = torch.get_num_threads()
    limiter = None
    try:
        from threadpoolctl import threadpool_info, threadpool_limits

        limiter = threadpool_limits(limits=threads)
        out["pools"] = [
            {
                "api": p.get("internal_api"),
                "lib": os.path.basename(p.get("filepath", "")),
                "threads": p.get("num_threads"),
            }
            for p in threadpool_info()
        ]
    except ImportError:
        out["pools"] = []
    if peer == "generated":
        quiet_blas()  # numpy is only the GEMM check's oracle here (see _common.quiet_blas)
    target, min_reps = config["target_s"], config["min_reps"]
    out["probe_ms"] = [speed_probe(config)]

    def log(text):
        print(f"  [round {config['round'] + 1}, {threads} thr] {text}", flush=True)

    workloads = load_batches(config["batches"])
    out["max_abs_diff"] = 0.0
    for hidden in HIDDENS:
        info = config["modules"][f"treelstm_h{hidden}"]
        module = import_module(info["name"], info["build"])
        if peer == "generated":  # the module's own thread count (the others' reference runs use it too)
            out["generated_threads"] = set_threads(module, threads)
        model = module.Model(seed=0)
        reference, fn = make_peer("generated", model, hidden), make_peer(peer, model, hidden)
        for batch_size, batches in workloads.items():
            # The same function first: root states against the generated module's, on every batch.
            for k, batch in enumerate(batches):
                want, got = reference(batch), np.asarray(fn(batch))
                assert want.shape == (batch_size, hidden), want.shape
                if got.shape != want.shape or not np.allclose(got, want, atol=ATOL):
                    diff = float(np.max(np.abs(got - want))) if got.shape == want.shape else float("nan")
                    raise SystemExit(
                        f"{peer} differs from the generated module (hidden {hidden}, batch "
                        f"{batch_size}, set {k}): max |diff| {diff:.3g}; refusing to time "
                        "different functions"
                    )
                out["max_abs_diff"] = max(out["max_abs_diff"], float(np.max(np.abs(got - want))))

            def run_set(fn=fn, batches=batches):
                for batch in batches:
                    fn(batch)

            t = measure(run_set, target, min_reps)
            per_batch = [1000 * s / len(batches) for s in t["times"]]  # ms per batch, one per run of the set
            out["treelstm"].append(
                {
                    "hidden": hidden,
                    "batch": batch_size,
                    "peer": peer,
                    "times_ms": per_batch,
                    "batches_per_rep": len(batches),
                    "cpu_per_wall": t["cpu_per_wall"],
                }
            )
            log(
                f"h{hidden} batch {batch_size:2d} {peer:12s} {statistics.median(per_batch):9.3f} ms/batch "
                f"({len(per_batch)} reps, cpu/wall {t['cpu_per_wall']:.2f})"
            )

    if peer in GEMM_PEER:
        rng = np.random.default_rng(7)
        for hidden in HIDDENS:
            k, n = 2 * hidden, 5 * hidden
            info = config["modules"][f"gemm_k{k}_n{n}"]
            module = import_module(info["name"], info["build"])
            set_threads(module, threads)
            model = module.Model(seed=0)
            w = np.array(model.parameters()["w"], dtype=np.float32, copy=True)
            for m in GEMM_M:
                x = rng.standard_normal((m, k), dtype=np.float32)
                if not np.allclose(model.forward(x=x)["y"], x @ w, atol=ATOL, rtol=1e-4):
                    raise SystemExit(f"generated GEMM [{m},{k}]@[{k},{n}] differs from numpy")
                fn = (lambda: model.forward(x=x)) if peer == "generated" else (lambda: x @ w)
                t = measure(fn, target, min_reps)
                times = [1000 * s for s in t["times"]]
                out["gemm"].append(
                    {
                        "hidden": hidden,
                        "M": m,
                        "K": k,
                        "N": n,
                        "peer": GEMM_PEER[peer],
                        "times_ms": times,
                        "cpu_per_wall": t["cpu_per_wall"],
                    }
                )
                med = statistics.median(times)
                log(
                    f"gemm [{m:3d},{k}]@[{k},{n}] {GEMM_PEER[peer]:9s} {med:8.3f} ms "
                    f"{2 * m * k * n / med / 1e6:7.2f} GFLOP/s"
                )
    if peer == "numpy-level":
        out["peak_gflops"] = sgemm_peak_gflops(target)
        log(f"numpy {PEAK_N}^3 sgemm (peak) {out['peak_gflops']:7.2f} GFLOP/s")
    out["probe_ms"].append(speed_probe(config))
    if limiter is not None:
        limiter.restore_original_limits()
    Path(config["out"]).write_text(json.dumps(out))


def run_child(config: dict, threads: int, peer: str, rnd: int, tmp: Path) -> dict:
    cfg = dict(config, threads=threads, peer=peer, round=rnd, out=str(tmp / f"r{rnd}-t{threads}-{peer}.json"))
    return run_child_process(Path(__file__).resolve(), cfg, threads, peer)


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------


def _pool(results, section, key_fields):
    """Every run's times of each measurement, pooled over the rounds; and each round's median."""
    pooled, rounds = {}, {}
    for res in results:
        for r in res[section]:
            key = tuple(r[f] for f in key_fields[:-2]) + (res["threads"], r["peer"])
            entry = pooled.setdefault(key, {"times": [], "cpu": [], "meta": r})
            entry["times"] += r["times_ms"]
            entry["cpu"].append(r["cpu_per_wall"])
            rounds.setdefault(key, {})[res["round"]] = statistics.median(r["times_ms"])
    return pooled, rounds


def main() -> None:
    global HIDDENS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE", help="write every figure to FILE as JSON")
    parser.add_argument(
        "--quick", action="store_true", help="fewer batches, repetitions and rounds (about a minute)"
    )
    parser.add_argument(
        "--hidden", type=int, nargs="+", choices=HIDDENS, default=list(HIDDENS), help="hidden sizes (default: all)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    HIDDENS = tuple(sorted(set(args.hidden)))
    import numpy as np

    print("Building the generated modules (cached under build/bench/):", flush=True)
    modules = {}
    gemm_hiddens = sorted(set(HIDDENS) | {256})  # gemm_k512_n1280 is the speed probe
    for model_def in [treelstm_model(h) for h in HIDDENS] + [gemm_model(2 * h, 5 * h) for h in gemm_hiddens]:
        info = build_module(model_def)
        modules[info["name"]] = info

    sets = {1: 6, 10: 2} if args.quick else {1: 24, 10: 6}
    workloads = {b: make_batches(1000 + b, b, sets[b]) for b in BATCHES}
    stats = {b: workload_stats(batches) for b, batches in workloads.items()}
    print(
        "\nWorkload (seeded; binary trees by random merges, leaves per tree gamma(mean 18) "
        "clipped to [2, 50]):"
    )
    for b, w in stats.items():
        print(
            f"  batch {b:2d}: {w['batches']} batches, {w['nodes_per_batch']} nodes/batch, "
            f"{w['leaves_per_tree']} leaves/tree, {w['levels_per_batch']} levels/batch, rows per internal "
            f"level: median {w['internal_level_rows_median']:g}, mean {w['internal_level_rows_mean']}, "
            f"max {w['internal_level_rows_max']}"
        )

    # Rounds: every (threads, peer) child once per round, the peers' order reversed every other
    # round, so that a slow spell of the machine does not fall on one peer only. Each measurement
    # gets ~0.3 s of runs over all rounds; its median is taken over the pooled runs.
    rounds = 1 if args.quick else 3
    config = {
        "modules": modules,
        "hiddens": HIDDENS,
        "target_s": 0.05 if args.quick else 0.3 / rounds,
        "min_reps": 3 if args.quick else 2,
    }
    results = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        config["batches"] = str(Path(tmp) / "batches.npz")
        save_batches(Path(config["batches"]), workloads)
        for rnd in range(rounds):
            for threads in THREADS:
                print(
                    f"\nRound {rnd + 1} of {rounds}, {threads} thread(s), one child process per peer:",
                    flush=True,
                )
                for peer in (PEERS if rnd % 2 == 0 else PEERS[::-1]):
                    results.append(run_child(config, threads, peer, rnd, Path(tmp)))
    elapsed = time.perf_counter() - t0

    times, round_ms = _pool(results, "treelstm", ("hidden", "batch", "threads", "peer"))
    records = []
    for key, entry in sorted(times.items()):
        hidden, batch, threads, peer = key
        gen_key = (hidden, batch, threads, "generated")
        median = statistics.median(entry["times"])
        per_round = [round_ms[key][r] / round_ms[gen_key][r] for r in sorted(round_ms[key])]
        records.append(
            {
                "kind": "treelstm",
                "model": f"treelstm_h{hidden}",
                "hidden": hidden,
                "batch": batch,
                "threads": threads,
                "peer": peer,
                "median_ms": round(median, 4),
                "min_ms": round(min(entry["times"]), 4),
                "reps": len(entry["times"]),
                "batches_per_rep": entry["meta"]["batches_per_rep"],
                "cpu_per_wall": round(statistics.mean(entry["cpu"]), 3),
                "ratio_to_generated": round(median / statistics.median(times[gen_key]["times"]), 4),
                "ratio_to_generated_by_round": [round(r, 4) for r in per_round],
            }
        )
    gtimes, _ = _pool(results, "gemm", ("hidden", "M", "threads", "peer"))
    gemm = []
    for (hidden, m, threads, peer), entry in sorted(gtimes.items()):
        meta, median = entry["meta"], statistics.median(entry["times"])
        gemm.append(
            {
                "kind": "gemm",
                "model": f"gemm_k{meta['K']}_n{meta['N']}",
                "hidden": hidden,
                "M": m,
                "K": meta["K"],
                "N": meta["N"],
                "threads": threads,
                "peer": peer,
                "median_ms": round(median, 5),
                "min_ms": round(min(entry["times"]), 5),
                "gflops": round(2 * m * meta["K"] * meta["N"] / median / 1e6, 3),
                "reps": len(entry["times"]),
                "cpu_per_wall": round(statistics.mean(entry["cpu"]), 3),
            }
        )

    diff = max(r["max_abs_diff"] for r in results)
    print(
        f"\nEvery peer's root states matched the generated module's on every batch before timing "
        f"(np.allclose, atol {ATOL:g}; largest |difference| {diff:.1e})."
    )
    print(
        f"TreeLSTM forward, median latency per batch (ms); ratios = peer / generated "
        f"(> 1: generated is faster). Measured in {elapsed:.0f} s, {rounds} round(s)."
    )
    head = (
        f"{'H':>4} {'batch':>5} {'thr':>3} | {'generated':>9} {'torch-node':>10} {'torch-lvl':>9} "
        f"{'numpy-lvl':>9} | {'node/gen':>8} {'lvl/gen':>8} {'np/gen':>8}"
    )
    print(head)
    print("-" * len(head))
    idx = {(r["hidden"], r["batch"], r["threads"], r["peer"]): r for r in records}
    for hidden in HIDDENS:
        for batch in BATCHES:
            for threads in THREADS:
                r = {p: idx[(hidden, batch, threads, p)] for p in PEERS}
                print(
                    f"{hidden:>4} {batch:>5} {threads:>3} | "
                    + " ".join(f"{r[p]['median_ms']:{w}.3f}" for p, w in zip(PEERS, (9, 10, 9, 9)))
                    + " | "
                    + " ".join(f"{r[p]['ratio_to_generated']:8.2f}" for p in PEERS[1:])
                )
    print(
        f"\nPer-node PyTorch / generated (torch-node median / generated median; issue #20 target: "
        f">= {PER_NODE_TARGET:g}x at H <= 128, batch 10, 1 thread):"
    )
    for hidden in HIDDENS:
        cells = []
        for batch in BATCHES[::-1]:
            for threads in THREADS:
                ratio = idx[(hidden, batch, threads, "torch-node")]["ratio_to_generated"]
                judged = hidden <= 128 and batch == 10 and threads == 1
                verdict = f" ({'met' if ratio >= PER_NODE_TARGET else 'MISSED'})" if judged else ""
                cells.append(f"batch {batch:2d} {threads} thr {ratio:6.2f}x{verdict}")
        print(f"  H {hidden:>3}: " + "; ".join(cells))
    if rounds > 1:
        spreads = sorted(
            (max(r["ratio_to_generated_by_round"]) / min(r["ratio_to_generated_by_round"]) - 1, r)
            for r in records
            if r["peer"] != "generated"
        )
        worst = spreads[-1][1]
        print(
            f"Spread of a ratio between rounds (max/min - 1): "
            f"median {100 * spreads[len(spreads) // 2][0]:.0f}%, "
            f"largest {100 * spreads[-1][0]:.0f}% (H{worst['hidden']} batch {worst['batch']} "
            f"{worst['threads']} thr {worst['peer']}: {worst['ratio_to_generated_by_round']})"
        )
    preempted = [r for r in records if r["threads"] == 1 and r["cpu_per_wall"] < 0.9]
    if preempted:
        print(
            "NOTE: preempted while measuring (1 thread, CPU time < 0.9 x wall time): "
            + ", ".join(
                f"H{r['hidden']} batch {r['batch']} {r['peer']} ({r['cpu_per_wall']:.2f})" for r in preempted
            )
        )

    peaks = {t: statistics.median([r["peak_gflops"] for r in results if r["threads"] == t and "peak_gflops" in r])
             for t in THREADS}
    print(
        "\nLevel GEMM [M, 2H] @ [2H, 5H] in GFLOP/s = 2*M*K*N / median time "
        "(generated: a whole forward() of a one-matmul model, nothing subtracted); peak = numpy's "
        f"{PEAK_N}^3 sgemm at that thread count, measured in the same run"
    )
    head = (
        f"{'H':>4} {'M':>4} {'K':>5} {'N':>5} {'thr':>3} | {'generated':>9} {'numpy':>9} {'peak':>7} | "
        f"{'numpy/gen':>9} {'gen/peak':>8}"
    )
    print(head)
    print("-" * len(head))
    gi = {(r["hidden"], r["M"], r["threads"], r["peer"]): r for r in gemm}
    for hidden in HIDDENS:
        for m in GEMM_M:
            for threads in THREADS:
                g, n = gi[(hidden, m, threads, "generated")], gi[(hidden, m, threads, "numpy")]
                g["peak_gflops"] = round(peaks[threads], 3)
                print(
                    f"{hidden:>4} {m:>4} {g['K']:>5} {g['N']:>5} {threads:>3} | {g['gflops']:9.2f} "
                    f"{n['gflops']:9.2f} {peaks[threads]:7.1f} | {n['gflops'] / g['gflops']:9.1f} "
                    f"{100 * g['gflops'] / peaks[threads]:7.0f}%"
                )

    print(
        "\nWhole forward, generated: multiply-add FLOPs per batch (leaves' [EMBED] @ [EMBED, 3H] and "
        "internal nodes' [2H] @ [2H, 5H], from the workload) / median time, against the peak above "
        "(issue #20 target: >= 80% at H 256, batch 10):"
    )
    for hidden in HIDDENS:
        cells = []
        for batch in BATCHES[::-1]:
            for threads in THREADS:
                r = idx[(hidden, batch, threads, "generated")]
                rate = forward_flops(stats[batch], hidden) / r["median_ms"] / 1e6
                r["forward_gflops"], r["forward_share_of_peak"] = round(rate, 2), round(rate / peaks[threads], 3)
                judged = hidden == 256 and batch == 10
                verdict = f" ({'met' if rate >= 0.8 * peaks[threads] else 'MISSED'})" if judged else ""
                cells.append(f"batch {batch:2d} {threads} thr {rate:6.1f} GFLOP/s {100 * rate / peaks[threads]:3.0f}%"
                             f"{verdict}")
        print(f"  H {hidden:>3}: " + "; ".join(cells))

    probes = [p for r in results for p in r["probe_ms"]]
    env = {
        **machine_facts(),
        "generated_uses_openmp": any(m["openmp"] for m in modules.values()),
        "compiler": modules[f"treelstm_h{HIDDENS[0]}"]["compiler"],
        "generated_set_num_threads": all(
            isinstance(r.get("generated_threads"), int) for r in results if r["peer"] == "generated"
        ),
        "children": [
            {
                k: r.get(k)
                for k in (
                    "round",
                    "threads",
                    "peer",
                    "probe_ms",
                    "other_cores",
                    "steal_cores",
                    "torch_threads",
                    "generated_threads",
                    "pools",
                )
            }
            for r in results
        ],
        "max_abs_diff_root_h": diff,
        "quick": args.quick,
        "rounds": rounds,
        "atol": ATOL,
        "measure_seconds": round(elapsed, 1),
    }
    print(
        f"\nGenerated code ({env['git'] or 'not a git checkout'}): "
        f"{'OpenMP' if env['generated_uses_openmp'] else 'no OpenMP (single-threaded)'}; "
        f"threads {'set with set_num_threads(n)' if env['generated_set_num_threads'] else 'default (no set_num_threads)'}; "
        f"compiler: {env['compiler'] or '?'}"
    )
    busy = [max(r["other_cores"], r["steal_cores"]) for r in results if r["other_cores"] is not None]
    ordered = sorted(probes)
    trim = len(ordered) // 10  # one slow probe is not a drift: leave out the extreme tenths
    drift = ordered[len(ordered) - 1 - trim] / ordered[trim]
    print(f"numpy {env['numpy']}, torch {env['torch']}, {env['cpu']}, {env['cores']} cores")
    print(
        f"Machine steadiness: contention (other processes or steal) up to "
        f"{max(busy, default=float('nan')):.2f} cores; speed probe (a fixed GEMM at each child's start "
        f"and end) {min(probes):.3f}..{max(probes):.3f} ms, "
        f"middle 80% within {100 * (drift - 1):.0f}%"
    )
    if any(b > BUSY_LIMIT for b in busy):
        print(
            "WARNING: other processes were running during the measurement; the figures are noisy "
            "(multi-threaded ones most: a spinning thread pool loses its core). Rerun on an idle machine."
        )
    if drift > 1.1:
        print(
            f"WARNING: the machine's speed changed by {100 * (drift - 1):.0f}% during the measurement "
            "(the host, not this process); compare ratios from the same round, and rerun."
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "environment": env,
                    "modules": modules,
                    "workloads": {str(b): w for b, w in stats.items()},
                    "records": records,
                    "gemm": gemm,
                },
                indent=1,
            )
            + "\n"
        )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
