"""Benchmark: early exit (#42), examples/early_exit.py's encoder whose examples leave after the
layer whose classifier is sure of them (each later layer a dg.cond over the examples still running).

    python benchmarks/early_exit.py [--quick] [--json FILE] [--rounds R]
    python benchmarks/control_flow.py --early-exit [...]   # the same

The model: 3 post-norm encoder layers (hidden 32, 2 heads, FFN 64, GELU) over a [CLS] token and
7 words, a classifier after each layer. Its weights are trained once (the example's train(), 20
epochs on one thread, under a minute) and saved beside the build (build/bench/early_exit/
trained.npz; trained again when the module is rebuilt). Every peer gets them. Thresholds (nats):
0 (no example exits: every layer on every example, "all layers"), then two at which the average
exit layer falls (THRESHOLDS); the table gives each one's average exit layer.

  deepgen      the generated module's forward(tokens, threshold), set_num_threads(n): layer 1 on
               every example, then each later layer one batched block over the examples still
               running (listed by index); those that exited are carried along
  torch-loop   PyTorch eager, one example at a time in a Python loop: nn.TransformerEncoderLayer
               and its nn.Linear classifier layer by layer until the entropy is under the threshold
  torch-masked PyTorch eager, the whole batch at once: each layer on every example, the exited
               ones' logits kept by torch.where, until no example runs (one .any() per layer)

Both PyTorch peers: torch.inference_mode(), eval() (nn.TransformerEncoderLayer's fused fast
path), torch.set_num_threads(n). Workload: seeded held-out sentences (the example's
make_sentences, seed 101 + batch), batch 1 (a set of 32 single sentences) and batch 32 (a set
of 4 batches; --quick: 16 and 2), timed as a set, reported per batch. Before timing, every
child compares its peer's predictions and exit layers with the generated module's and refuses
to time when over 1% differ (float32 in another order can put an entropy on the other side of a
threshold: the table says how many agreed).

Each (round, thread count, peer) runs in a child process of its own, thread variables set before
numpy or torch is imported (benchmarks/_common.py), the peers' order alternating from round to
round; medians pooled over 3 rounds (--rounds; 1 with --quick). Threads 1 and 2. Table: ms per
batch (median); ratios = peer time / deepgen time at the same threshold (> 1: deepgen faster),
and each threshold's deepgen time against its own at threshold 0 (the saving of exiting).
"""

from __future__ import annotations

import argparse
import json
import runpy
import statistics
import time
from pathlib import Path

from _common import (
    BUSY_LIMIT,
    ROOT,
    WAITED_NOTE,
    build_module,
    import_module,
    machine_facts,
    machine_line,
    quiet_blas,
    run_rounds,
    set_threads,
    time_batches,
    waited_marks,
)

PEERS = ("deepgen", "torch-loop", "torch-masked")
THREADS = (1, 2)
BATCHES = (1, 32)
THRESHOLDS = (0.0, 0.003, 0.1)
SETS = {1: 32, 32: 4}
QUICK_SETS = {1: 16, 32: 2}
EXAMPLE = ROOT / "examples" / "early_exit.py"


def example():
    return runpy.run_path(str(EXAMPLE), run_name="early_exit_example")


def workloads(ex: dict, sets: dict) -> dict:
    """{batch: [tokens]}: seeded held-out sentences, the same in every process."""
    return {
        size: list(ex["make_sentences"](size * count, 101 + size)["tokens"].reshape(count, size, -1))
        for size, count in sets.items()
    }


# -- the PyTorch peers: fn(tokens, threshold) -> (predictions, exit layers) ------------------


def torch_model(params: dict, ex: dict):
    """Embeddings, nn.TransformerEncoderLayer per layer and an nn.Linear classifier per layer,
    loaded from the generated module's parameters (state_dict keys, dots as underscores)."""
    import numpy as np
    import torch

    nn = torch.nn
    hidden, ffn = params["embeddings_norm_weight"].shape[0], params["encoder_layers_0_linear1_bias"].shape[0]
    layers = sum(1 for k in params if k.startswith("classifiers_") and k.endswith("_bias"))
    model = nn.ModuleDict(
        {
            "embeddings": nn.ModuleDict(
                {
                    "word_embeddings": nn.Embedding(ex["VOCAB"], hidden),
                    "position_embeddings": nn.Embedding(ex["T"], hidden),
                    "norm": nn.LayerNorm(hidden),
                }
            ),
            "encoder": nn.ModuleDict(
                {
                    "layers": nn.ModuleList(
                        nn.TransformerEncoderLayer(
                            hidden, 2, ffn, dropout=0.0, activation="gelu", batch_first=True
                        )
                        for _ in range(layers)
                    )
                }
            ),
            "classifiers": nn.ModuleList(nn.Linear(hidden, ex["CLASSES"]) for _ in range(layers)),
        }
    )
    model.load_state_dict(
        {
            k: torch.from_numpy(np.array(params[k.replace(".", "_")], dtype=np.float32))
            for k in model.state_dict()
        }
    )
    return model.eval()


def _embed(model, tokens):
    emb = model["embeddings"]
    return emb["norm"](emb["word_embeddings"](tokens) + emb["position_embeddings"].weight[: tokens.shape[1]])


def _entropy(logits):
    import torch

    log_p = torch.log_softmax(logits, -1)
    return -(log_p.exp() * log_p).sum(-1)


def torch_loop(params: dict, ex: dict):
    """One example at a time, layer by layer until its entropy is under the threshold."""
    import torch

    model = torch_model(params, ex)
    steps = list(zip(model["encoder"]["layers"], model["classifiers"]))

    def run(tokens, threshold):
        predictions, exits = [], []
        with torch.inference_mode():
            for row in torch.from_numpy(tokens):
                x = _embed(model, row[None])
                for k, (layer, classifier) in enumerate(steps):
                    x = layer(x)
                    logits = classifier(x[:, 0])
                    if k + 1 == len(steps) or float(_entropy(logits)) < threshold:
                        break
                predictions.append(int(logits.argmax()))
                exits.append(k + 1)
        return predictions, exits

    return run


def torch_masked(params: dict, ex: dict):
    """The whole batch each layer, the exited examples' logits kept, until none runs."""
    import torch

    model = torch_model(params, ex)
    steps = list(zip(model["encoder"]["layers"], model["classifiers"]))

    def run(tokens, threshold):
        with torch.inference_mode():
            x = _embed(model, torch.from_numpy(tokens))
            running = torch.ones(x.shape[0], dtype=torch.bool)
            exits = torch.zeros(x.shape[0], dtype=torch.int64)
            logits = None
            for k, (layer, classifier) in enumerate(steps):
                x = layer(x)
                new = classifier(x[:, 0])
                logits = new if logits is None else torch.where(running[:, None], new, logits)
                exits += running
                running = running & (_entropy(new) >= threshold)
                if k + 1 < len(steps) and not bool(running.any()):
                    break
            return logits.argmax(1).tolist(), exits.tolist()

    return run


def peer_fn(peer: str, model, ex: dict):
    if peer == "deepgen":
        import numpy as np

        def run(tokens, threshold):
            out = model.forward(tokens=tokens, threshold=np.array([threshold], np.float32))
            return out["logits"].argmax(1).tolist(), out["exit_layer"].tolist()

        return run
    return (torch_loop if peer == "torch-loop" else torch_masked)(model.parameters(), ex)


# -- a child: one (round, threads, peer) ------------------------------------------------------


def child(config: dict) -> None:
    threads, peer = config["threads"], config["peer"]
    out = {"threads": threads, "peer": peer, "round": config["round"], "rows": []}
    if peer.startswith("torch"):
        import torch

        torch.set_num_threads(threads)
    else:
        quiet_blas()
    ex = example()
    module = import_module(config["module"]["name"], config["module"]["build"])
    model = module.Model(seed=0)
    model.load(config["weights"])
    model.eval()
    out["generated_threads"] = set_threads(module, threads if peer == "deepgen" else 1)
    fn, reference = peer_fn(peer, model, ex), peer_fn("deepgen", model, ex)
    for size, batches in workloads(ex, {int(k): v for k, v in config["sets"].items()}).items():
        for threshold in THRESHOLDS:
            agree = total = 0
            exits = []
            for tokens in batches:
                want, got = reference(tokens, threshold), fn(tokens, threshold)
                agree += sum(w == g for w, g in zip(zip(*want), zip(*got)))
                total += len(tokens)
                exits += want[1]
            if agree < 0.99 * total:
                raise SystemExit(
                    f"{peer}: {total - agree} of {total} examples predict or exit differently from the "
                    f"generated module's (batch {size}, threshold {threshold}); refusing to time"
                )

            per_batch, cpu_per_wall = time_batches(fn, batches, config, threshold)
            out["rows"].append(
                {
                    "batch": size,
                    "threshold": threshold,
                    "times_ms": per_batch,
                    "agree": agree,
                    "examples": total,
                    "exit_layer": statistics.mean(exits),
                }
            )
            print(
                f"  [round {config['round'] + 1}, {threads} thr] batch {size:2d} threshold {threshold:<5g} "
                f"{peer:12s} {statistics.median(per_batch):8.3f} ms/batch (cpu/wall {cpu_per_wall:.2f}; "
                f"agree {agree}/{total})",
                flush=True,
            )
    Path(config["out"]).write_text(json.dumps(out))


# -- main -------------------------------------------------------------------------------------


def trained_weights(ex: dict, info: dict) -> Path:
    """The example trained once (its train(), one thread), saved beside the build; trained again
    when the module was rebuilt or the file is missing."""
    path = Path(info["build"]).parent / "trained.npz"
    if path.is_file() and info["reused"]:
        print(f"  trained weights: {path} (cached)", flush=True)
        return path
    module = import_module(info["name"], info["build"])
    set_threads(module, 1)
    t0 = time.perf_counter()
    model, results = ex["train"](module, log=lambda *_: None)
    model.save(str(path))
    print(
        f"  trained in {time.perf_counter() - t0:.0f} s: held-out accuracy {results[0.0]['accuracy']:.3f} "
        f"(every layer); saved to {path}",
        flush=True,
    )
    return path


def report(results: list) -> list:
    pooled, exits, agree = {}, {}, {}
    for res in results:
        for r in res["rows"]:
            key = (r["batch"], res["threads"], r["threshold"], res["peer"])
            pooled.setdefault(key, []).extend(r["times_ms"])
            exits[(r["batch"], r["threshold"])] = r["exit_layer"]
            agree.setdefault((r["batch"], r["threshold"]), []).append((r["agree"], r["examples"]))
    med = {k: statistics.median(v) for k, v in pooled.items()}
    print(
        "\nms per batch (median); ratio = peer / deepgen at the same threshold (> 1: deepgen faster); "
        "dg/dg@0 = deepgen against its own time at threshold 0 (every layer):"
    )
    head = (
        f"{'batch':>5} {'thr':>3} {'threshold':>9} {'exit':>5} | {'deepgen':>8} {'torch-loop':>10} "
        f"{'torch-masked':>12} | {'loop/dg':>7} {'masked/dg':>9} {'dg/dg@0':>7}"
    )
    print(head)
    print("-" * len(head))
    records, starred = [], False
    for size in BATCHES:
        for threads in THREADS:
            for threshold in THRESHOLDS:
                dg_ms, loop_ms, masked_ms = (med[(size, threads, threshold, p)] for p in PEERS)
                full = med[(size, threads, 0.0, "deepgen")]
                # a 2-thread median over twice the same peer's 1-thread one: its threads waited for a core
                mark = waited_marks(lambda t, p: med[(size, t, threshold, p)], threads, PEERS)
                starred = starred or "*" in mark.values()
                print(
                    f"{size:>5} {threads:>3} {threshold:>9g} {exits[(size, threshold)]:5.2f} | {dg_ms:7.3f}"
                    f"{mark['deepgen']} {loop_ms:9.3f}{mark['torch-loop']} {masked_ms:11.3f}{mark['torch-masked']} | "
                    f"{loop_ms / dg_ms:6.2f}x {masked_ms / dg_ms:8.2f}x {dg_ms / full:7.2f}"
                )
                records += [
                    {
                        "batch": size,
                        "threads": threads,
                        "threshold": threshold,
                        "peer": p,
                        "exit_layer": round(exits[(size, threshold)], 4),
                        "median_ms": round(med[(size, threads, threshold, p)], 4),
                        "ratio_vs_deepgen": round(med[(size, threads, threshold, p)] / dg_ms, 3),
                    }
                    for p in PEERS
                ]
    if starred:
        print(WAITED_NOTE)
    worst = min(a / t for pairs in agree.values() for a, t in pairs)
    print(
        f"Predictions and exit layers: every peer agreed with the generated module on at least {100 * worst:.1f}% "
        "of the examples at every batch and threshold."
    )
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE", help="write every figure to FILE as JSON")
    parser.add_argument("--quick", action="store_true", help="fewer batches, repetitions and rounds")
    parser.add_argument("--rounds", type=int, help="rounds of children (default 3; 1 with --quick)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    t_start = time.perf_counter()
    ex = example()
    print("Building the generated module (cached under build/bench/):", flush=True)
    info = build_module(ex["early_exit"])
    weights = trained_weights(ex, info)
    rounds = args.rounds or (1 if args.quick else 3)
    config = {
        "module": info,
        "weights": str(weights),
        "sets": QUICK_SETS if args.quick else SETS,
        "min_reps": 3 if args.quick else 5,
        "target_s": 0.2 if args.quick else 0.6 / rounds,
    }
    print(f"\n{rounds} round(s) x {len(THREADS)} thread counts, a child per peer:", flush=True)
    results = run_rounds(__file__, config, rounds, THREADS, PEERS, "early_exit")
    machine = machine_facts()
    print("\n" + machine_line(machine))
    print(
        "Model: examples/early_exit.py, 3 layers, hidden 32, trained weights; exit = the average exit layer."
    )
    records = report(results)
    contention = max([max(r["other_cores"] or 0, r["steal_cores"] or 0) for r in results], default=0.0)
    if contention > BUSY_LIMIT:
        print(
            f"\nWARNING: other processes or the hypervisor took up to {contention:.2f} cores while children ran: "
            "the figures are noisy, the 2-thread ones most."
        )
    print(f"\n(ran in {time.perf_counter() - t_start:.0f} s)")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"machine": machine, "module": info, "records": records, "children": results}, indent=1
            )
        )


if __name__ == "__main__":
    main()
