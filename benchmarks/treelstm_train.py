"""Benchmark: a train step of the generated binary TreeLSTM against PyTorch autograd.

    python benchmarks/treelstm_train.py [--json FILE] [--quick]

Model: examples/treelstm.py at HIDDEN 256 with train=True: a per-node classifier
(5 classes) and cross-entropy over every node (SST labels every phrase), Adam.
One train step = forward over the batch, loss, backward through the recursion,
Adam update of every parameter. Peers (same function, same initial weights,
copied from the generated module's Model(seed=0).parameters(); Adam with
PyTorch's defaults, lr 1e-3, as the example's):

  generated    Model.train_step (the reverse level loop of ops/recurse_grad.py)
  torch-node   PyTorch eager autograd, one node at a time in topological order
  torch-level  PyTorch autograd, one batched step for all leaves and one per level
               (index_select gathers the children, one matmul per level)

Before timing, every peer's first loss and gradients (of u, w_leaf, emb) are
checked against the generated module's on the same weights (atol 1e-4).

Workload: benchmarks/treelstm.py's seeded SST-like batches of 1 and 10 binary
trees (2..50 leaves per tree, about 18 on average) with seeded labels. Threads 1
(the target's) and 2; a child process per (round, threads, peer); medians of
repeated runs, each over the whole set of batches. Targets (1 thread):
generated >= 10x faster than torch-node and >= 2x faster than torch-level.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from _common import ROOT, build_module, import_module, machine_facts, measure, run_rounds, set_threads
from treelstm import load_batches, make_batches, save_batches, schedule, workload_stats

HIDDEN, CLASSES = 256, 5
BATCHES = (1, 10)
THREADS = (1, 2)
PEERS = ("generated", "torch-node", "torch-level")
ATOL = 1e-4
CHECKED = ("u", "w_leaf", "emb", "logits_w")


def model_def():
    import runpy

    return runpy.run_path(str(ROOT / "examples" / "treelstm.py"))["treelstm_model"](HIDDEN, f"treelstm_train_h{HIDDEN}")


def with_labels(batches, seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    return [dict(b, labels=rng.integers(0, CLASSES, len(b["trees_words"])).astype(np.int64)) for b in batches]


# ----------------------------------------------------------------------------
# PyTorch peers: each builds the loss of a batch; the step is backward + Adam
# ----------------------------------------------------------------------------


def _cells(p):
    import torch

    sig, tanh = torch.sigmoid, torch.tanh

    def leaf(x):
        i, o, g = torch.addmm(p["b_leaf"], x, p["w_leaf"]).chunk(3, 1)
        c = sig(i) * tanh(g)
        return sig(o) * tanh(c), c

    def internal(hcat, c_l, c_r):
        i, o, g, f_l, f_r = torch.addmm(p["b"], hcat, p["u"]).chunk(5, 1)
        c = sig(i) * tanh(g) + sig(f_l) * c_l + sig(f_r) * c_r
        return sig(o) * tanh(c), c

    return leaf, internal


def torch_node_loss(p):
    import torch

    leaf, internal = _cells(p)

    def loss(batch):
        children, words = batch["trees_children"].tolist(), batch["trees_words"].tolist()
        hs, cs = [None] * len(children), [None] * len(children)
        for n, (left, right) in enumerate(children):  # children before parents
            if left < 0:
                hs[n], cs[n] = leaf(p["emb"][words[n] : words[n] + 1])
            else:
                hs[n], cs[n] = internal(torch.cat((hs[left], hs[right]), 1), cs[left], cs[right])
        logits = torch.addmm(p["logits_b"], torch.cat(hs, 0), p["logits_w"])
        return torch.nn.functional.cross_entropy(logits, torch.from_numpy(batch["labels"]))

    return loss


def torch_level_loss(p):
    import torch

    leaf, internal = _cells(p)

    def loss(batch):
        s = schedule(batch)
        start = s["start"]
        h, c = leaf(p["emb"].index_select(0, torch.from_numpy(s["leaf_words"])))
        hs, cs = [h], [c]
        child_rows = torch.from_numpy(s["child_rows"])
        for level in range(1, len(start) - 1):
            lo, hi = start[level], start[level + 1]
            idx = child_rows[2 * lo : 2 * hi]  # [left0, right0, left1, ...]: rows of earlier levels
            h_all, c_all = torch.cat(hs, 0), torch.cat(cs, 0)
            hcat = h_all.index_select(0, idx).view(hi - lo, 2 * HIDDEN)
            cc = c_all.index_select(0, idx).view(hi - lo, 2, HIDDEN)
            h, c = internal(hcat, cc[:, 0], cc[:, 1])
            hs.append(h)
            cs.append(c)
        logits = torch.addmm(p["logits_b"], torch.cat(hs, 0), p["logits_w"])  # rows in schedule order
        order = torch.from_numpy(_order(batch))
        return torch.nn.functional.cross_entropy(logits, torch.from_numpy(batch["labels"])[order])

    return loss


def _order(batch):
    """Node ids in schedule order (the rows torch_level_loss makes)."""
    import numpy as np

    children = batch["trees_children"]
    height = np.zeros(len(children), np.int64)
    for n, (left, right) in enumerate(children.tolist()):
        if left >= 0:
            height[n] = max(height[left], height[right]) + 1
    return np.argsort(height, kind="stable")


def make_step(peer, model):
    """(step(batch) -> loss, grads() -> {name: array}) for `peer`, from `model`'s weights."""
    import numpy as np

    if peer == "generated":
        return (lambda batch: model.train_step(**batch)), (lambda: {k: np.array(v) for k, v in model.gradients().items()})
    import torch

    p = {k: torch.tensor(np.array(v), requires_grad=True) for k, v in model.parameters().items()}
    loss_fn = (torch_node_loss if peer == "torch-node" else torch_level_loss)(p)
    opt = torch.optim.Adam(list(p.values()), lr=1e-3)

    def step(batch):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(batch)
        loss.backward()
        opt.step()
        return loss.item()

    return step, (lambda: {k: t.grad.numpy().copy() for k, t in p.items()})


# ----------------------------------------------------------------------------
# Child: one (round, threads, peer)
# ----------------------------------------------------------------------------


def child(config: dict) -> None:
    import numpy as np

    threads, peer = config["threads"], config["peer"]
    if peer.startswith("torch"):
        import torch

        torch.set_num_threads(threads)
    info = config["module"]
    module = import_module(info["name"], info["build"])
    out = {"threads": threads, "peer": peer, "round": config["round"], "rows": []}
    out["generated_threads"] = set_threads(module, threads)
    workloads = load_batches(config["batches"])
    for batch_size, batches in workloads.items():
        # The same function first: first loss and gradients against the generated module's.
        ref_step, ref_grads = make_step("generated", module.Model(seed=0))
        step, grads = make_step(peer, module.Model(seed=0))
        want_loss, got_loss = ref_step(batches[0]), step(batches[0])
        want, got = ref_grads(), grads()
        worst = max(float(np.max(np.abs(got[k] - want[k]))) for k in CHECKED)
        if abs(want_loss - got_loss) > ATOL or worst > ATOL:
            raise SystemExit(f"{peer} differs from the generated module (batch {batch_size}): loss {got_loss} vs "
                             f"{want_loss}, max |gradient diff| {worst:.3g}; refusing to time different functions")

        def run_set(step=step, batches=batches):
            for batch in batches:
                step(batch)

        t = measure(run_set, config["target_s"], config["min_reps"])
        per_batch = [1000 * s / len(batches) for s in t["times"]]
        out["rows"].append({"batch": batch_size, "times_ms": per_batch, "cpu_per_wall": t["cpu_per_wall"],
                            "max_abs_diff": worst})
        print(f"  [round {config['round'] + 1}, {threads} thr] batch {batch_size:2d} {peer:12s} "
              f"{statistics.median(per_batch):9.3f} ms/step", flush=True)
    Path(config["out"]).write_text(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE", help="write every figure to FILE as JSON")
    parser.add_argument("--quick", action="store_true", help="fewer batches, repetitions and rounds")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    print("Building the generated module (cached under build/bench/):", flush=True)
    info = build_module(model_def(), train=True)
    sets = {1: 6, 10: 2} if args.quick else {1: 24, 10: 6}
    workloads = {b: with_labels(make_batches(1000 + b, b, sets[b]), b) for b in BATCHES}
    for b, batches in workloads.items():
        w = workload_stats(batches)
        print(f"  batch {b:2d}: {w['batches']} batches, {w['nodes_per_batch']} nodes/batch, "
              f"{w['levels_per_batch']} levels/batch, rows per internal level: median "
              f"{w['internal_level_rows_median']:g}, max {w['internal_level_rows_max']}")
    rounds = 1 if args.quick else 3
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        batches_file = Path(tmp) / "batches.npz"
        save_batches(batches_file, {b: [{k: v for k, v in x.items()} for x in bs] for b, bs in workloads.items()})
        config = {"module": info, "batches": str(batches_file), "target_s": 0.1 if args.quick else 0.3 / rounds,
                  "min_reps": 2}
        results = run_rounds(__file__, config, rounds, THREADS, PEERS, "treelstm_train")
    elapsed = time.perf_counter() - t0

    pooled = {}
    for res in results:
        for r in res["rows"]:
            pooled.setdefault((r["batch"], res["threads"], res["peer"]), []).extend(r["times_ms"])
    records = []
    print(f"\nTreeLSTM train step, hidden {HIDDEN} (ms per batch, median; ratio = peer / generated):")
    for (batch, threads, peer), times in sorted(pooled.items()):
        gen = statistics.median(pooled[(batch, threads, "generated")])
        med = statistics.median(times)
        target = {"torch-node": 10.0, "torch-level": 2.0}.get(peer) if threads == 1 else None
        ratio = med / gen
        verdict = "" if target is None else (" ok" if ratio >= target else f" MISSED (target {target:g}x)")
        print(f"  batch {batch:2d}  {threads} thr  {peer:12s} {med:9.3f} ms   {ratio:6.2f}x{verdict}")
        records.append({"batch": batch, "threads": threads, "peer": peer, "median_ms": round(med, 4),
                        "ratio_vs_generated": round(ratio, 3), "target": target, "reps": len(times)})
    print(f"\n{elapsed:.0f} s of measurement")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_facts(), "results": records}, indent=1))


if __name__ == "__main__":
    main()
