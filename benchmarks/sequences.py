"""Benchmark: generated sequence models (an LSTM, a Transformer encoder layer) against PyTorch.

    python benchmarks/sequences.py [--json FILE] [--quick] [--only lstm encoder]

LSTM: dg.lstm(x, lengths, H, name="lstm") at hidden H 256 and 512 over GloVe-like
inputs (300 features, x float32 [N, T, 300] padded to the batch's longest sentence,
lengths int64 [N]); h_n is the output. Inference = forward; train step = forward,
a linear classifier (5 classes) on h_n, cross-entropy, backward and an SGD update
(lr 0.01), the same on every side. Peers (same weights, copied one to one from the
generated module's Model(seed=0).parameters(): the DSL names them as PyTorch does):

  generated     the deepgen module (forward / train_step), built with plain CMake in
                Release mode under build/bench/, threads set with set_num_threads(n)
  torch-packed  torch.nn.LSTM(batch_first=True) on pack_padded_sequence(...,
                enforce_sorted=False) (PyTorch's own sorting, packing and unsorting)
  torch-step    a Python loop over time steps with torch.nn.LSTMCell on the sequences
                still running, the batch sorted by length (longest first)

Workload: seeded SST-like sentences (lengths from a gamma distribution with mean 18,
clipped to [2, 50], as benchmarks/treelstm.py's trees), batches of 1 and 64, x drawn
N(0, 0.4^2) (about GloVe's spread), seeded labels; a fixed set of batches per batch
size, timed as a whole, reported per batch.

Encoder: dg.transformer_encoder_layer at BERT-base's shape (d_model 768, 12 heads,
FFN 3072, relu, post-norm, eps 1e-5) on x [N, 128, 768] with lengths: all 128
("full") or seeded uniform in [32, 128] ("mixed", zeros past each length); forward
only, batch 1 and 8. Peers:

  generated      the deepgen module's forward
  torch-eager    torch.nn.TransformerEncoderLayer(batch_first=True, dropout=0) in eval
                 mode under torch.inference_mode with src_key_padding_mask (its fast path)
  torch-compile  torch.compile of the same module (skipped, with the reason printed,
                 where compiling fails on this machine); compiling happens before timing

Before timing, every child checks its peer against the generated module on the same
weights: the LSTM's h_n on every batch, and for the train step the first step's loss
and every gradient; the encoder's outputs at the valid (unpadded) positions only
(PyTorch's fast path may leave zeros at padded ones). Tolerance 1e-4 (absolute, plus
1e-4 relative for the encoder's unit-scale outputs).

Threads 1 and 2, a child process per (round, threads, peer) with the thread variables
set before numpy or torch are imported; peers alternate their order from round to
round; medians pooled over 3 rounds (1 with --quick, which also times H 256 only
and fewer batches: a smoke test, about a minute). Targets (1 thread): LSTM batch 1
>= 1.5x faster than torch-packed, batch 64 >= 1.0x; encoder batch 1 >= 1.0x torch-eager.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from _common import BUSY_LIMIT, build_module, import_module, machine_facts, measure, quiet_blas, run_rounds, set_threads

FEATURES, CLASSES, LR = 300, 5, 0.01
HIDDENS = (256, 512)
LSTM_BATCHES = (1, 64)
MODES = ("forward", "train")
LSTM_PEERS = ("generated", "torch-packed", "torch-step")
MEAN_LEN, MIN_LEN, MAX_LEN = 18, 2, 50

D_MODEL, HEADS, FFN, SEQ = 768, 12, 3072, 128
MIXED_MIN = 32
ENC_BATCHES = (1, 8)
LENGTHS = ("full", "mixed")
ENC_PEERS = ("generated", "torch-eager", "torch-compile")

THREADS = (1, 2)
ATOL = 1e-4
ENC_RTOL = 1e-4
LSTM_TARGETS = {1: 1.5, 64: 1.0}  # batch -> generated must be this much faster than torch-packed (1 thread)
ENC_TARGET = {1: 1.0}  # batch -> vs torch-eager (1 thread)


# ----------------------------------------------------------------------------
# Models (DSL)
# ----------------------------------------------------------------------------


def lstm_def(hidden: int):
    """x [N, T, 300], lengths [N] -> h_n [N, H]; with train=True a 5-class classifier
    on h_n, cross-entropy, SGD."""
    import generator as dg

    N, T = dg.dim("N"), dg.dim("T")

    @dg.model(name=f"lstm_bench_h{hidden}")
    def lstm_bench(train: bool = False):
        x = dg.input("x", (N, T, FEATURES))
        lengths = dg.input("lengths", (N,), dtype="int64")
        outputs, (h_n, c_n) = dg.lstm(x, lengths, hidden, name="lstm")
        last = dg.reshape(h_n, (N, hidden))
        if train:
            labels = dg.input("labels", (N,), dtype="int64")
            logits = dg.dense(last, CLASSES, name="classifier")
            dg.train(dg.softmax_cross_entropy(logits, labels), dg.sgd(lr=LR))
        return {"h_n": last}

    return lstm_bench


def encoder_def():
    """One BERT-base shaped post-norm encoder layer; None when the DSL has no
    dg.transformer_encoder_layer."""
    import generator as dg

    if not hasattr(dg, "transformer_encoder_layer"):
        return None
    N, T = dg.dim("N"), dg.dim("T")

    @dg.model(name=f"encoder_bench_d{D_MODEL}")
    def encoder_bench():
        x = dg.input("x", (N, T, D_MODEL))
        lengths = dg.input("lengths", (N,), dtype="int64")
        y = dg.transformer_encoder_layer(x, lengths, D_MODEL, HEADS, FFN, activation="relu", norm_first=False,
                                         eps=1e-5, name="layer")
        return {"y": y}

    return encoder_bench


# ----------------------------------------------------------------------------
# Workloads
# ----------------------------------------------------------------------------


def sentence_lengths(rng, count: int):
    """SST-like sentence lengths: gamma with mean 18, clipped to [2, 50] (treelstm.py's leaf counts)."""
    import numpy as np

    draws = np.rint(rng.gamma(4.0, MEAN_LEN / 4.0, size=count))
    return np.clip(draws, MIN_LEN, MAX_LEN).astype(np.int64)


def lstm_batches(seed: int, size: int, count: int) -> list:
    """`count` batches of `size` sentences: x padded to the batch's longest, zeros past each length."""
    import numpy as np

    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(count):
        lengths = sentence_lengths(rng, size)
        x = (0.4 * rng.standard_normal((size, int(lengths.max()), FEATURES))).astype(np.float32)
        for n, length in enumerate(lengths):
            x[n, length:] = 0.0
        labels = rng.integers(0, CLASSES, size).astype(np.int64)
        batches.append({"x": np.ascontiguousarray(x), "lengths": lengths, "labels": labels})
    return batches


def encoder_batches(seed: int, size: int, count: int, mixed: bool) -> list:
    import numpy as np

    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(count):
        lengths = (rng.integers(MIXED_MIN, SEQ + 1, size) if mixed else np.full(size, SEQ)).astype(np.int64)
        x = rng.standard_normal((size, SEQ, D_MODEL)).astype(np.float32)
        for n, length in enumerate(lengths):
            x[n, length:] = 0.0
        batches.append({"x": x, "lengths": lengths})
    return batches


def save_workloads(path: Path, workloads: dict) -> None:
    """workloads: {key string: [batch dict]} into one .npz."""
    import numpy as np

    np.savez(path, **{f"{key}/{k}/{field}": a for key, batches in workloads.items()
                      for k, batch in enumerate(batches) for field, a in batch.items()})


def load_workloads(path: str) -> dict:
    import numpy as np

    found = {}
    with np.load(path) as data:
        for name in data.files:
            key, k, field = name.split("/")
            found.setdefault(key, {}).setdefault(int(k), {})[field] = np.ascontiguousarray(data[name])
    return {key: [b[k] for k in sorted(b)] for key, b in found.items()}


# ----------------------------------------------------------------------------
# LSTM peers: run(batch) -> h_n (numpy) for forward; step(batch) -> loss for train
# ----------------------------------------------------------------------------


def _torch_lstm_params(model, hidden):
    """torch.nn.LSTM and the classifier's (w [H, 5], b) with the generated model's weights."""
    import numpy as np
    import torch

    p = {k: np.array(v, dtype=np.float32, copy=True) for k, v in model.parameters().items()}
    lstm = torch.nn.LSTM(FEATURES, hidden, batch_first=True)
    with torch.no_grad():
        for key in ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0"):
            getattr(lstm, key).copy_(torch.from_numpy(p[f"lstm_{key}"]))
    classifier = [torch.tensor(p[k], requires_grad=True) for k in ("classifier_w", "classifier_b") if k in p]
    return lstm, classifier


def _packed_h_n(lstm):
    import torch
    from torch.nn.utils.rnn import pack_padded_sequence

    def h_n(batch):
        packed = pack_padded_sequence(torch.from_numpy(batch["x"]), torch.from_numpy(batch["lengths"]),
                                      batch_first=True, enforce_sorted=False)
        _, (h, _) = lstm(packed)
        return h[0]

    return h_n


def _step_h_n(lstm, hidden):
    """h_n by a Python loop over time with nn.LSTMCell over the running sequences
    (sorted longest first, so they are the first `running` rows)."""
    import torch

    cell = torch.nn.LSTMCell(FEATURES, hidden)
    with torch.no_grad():
        for key in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            getattr(cell, key).copy_(getattr(lstm, f"{key}_l0"))

    def h_n(batch):
        lengths = torch.from_numpy(batch["lengths"])
        sorted_lengths, order = torch.sort(lengths, descending=True)
        x = torch.from_numpy(batch["x"]).index_select(0, order)
        counts = sorted_lengths.tolist()
        rows = len(counts)
        h = x.new_zeros(rows, hidden)
        c = x.new_zeros(rows, hidden)
        finished = []
        for t in range(counts[0]):
            while counts[rows - 1] <= t:  # sequences that ended before step t keep their state
                rows -= 1
            if rows < h.shape[0]:
                finished.append(h[rows:])
                h, c = h[:rows], c[:rows]
            h, c = cell(x[:rows, t], (h, c))
        finished.append(h)
        h_sorted = torch.cat(finished[::-1], 0)
        return h_sorted.index_select(0, torch.argsort(order))

    return h_n, cell


def lstm_peer(peer: str, mode: str, model, hidden: int):
    """(fn(batch), grads() -> {generated param name: array} or None) for `peer` from
    `model`'s weights; fn returns h_n (forward) or the loss (train, with the update)."""
    import numpy as np

    if peer == "generated":
        if mode == "forward":
            return (lambda b: model.forward(x=b["x"], lengths=b["lengths"])["h_n"]), None
        return (lambda b: model.train_step(**b)), (lambda: {k: np.array(v) for k, v in model.gradients().items()})
    import torch

    lstm, classifier = _torch_lstm_params(model, hidden)
    if peer == "torch-packed":
        h_n, params = _packed_h_n(lstm), {f"lstm_{k}": v for k, v in lstm.named_parameters()}
    else:
        h_n, cell = _step_h_n(lstm, hidden)
        params = {f"lstm_{k}_l0": v for k, v in cell.named_parameters()}
    if mode == "forward":

        def run(batch):
            with torch.inference_mode():
                return h_n(batch).numpy()

        return run, None
    params.update(zip(("classifier_w", "classifier_b"), classifier))
    opt = torch.optim.SGD(list(params.values()), lr=LR)

    def step(batch):
        opt.zero_grad(set_to_none=True)
        logits = torch.addmm(params["classifier_b"], h_n(batch), params["classifier_w"])
        loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(batch["labels"]))
        loss.backward()
        opt.step()
        return loss.item()

    return step, (lambda: {k: t.grad.numpy().copy() for k, t in params.items()})


def lstm_child(config: dict, out: dict, log) -> None:
    import numpy as np

    peer, threads = config["peer"], config["threads"]
    workloads = load_workloads(config["lstm_batches"])
    for hidden in config["hiddens"]:
        for mode in MODES:
            info = config["modules"][f"lstm_{mode}_h{hidden}"]
            module = import_module(info["name"], info["build"])
            # The reference (the generated module) runs single-threaded in the other peers'
            # children: no second thread pool stays around to compete with the peer's.
            if peer == "generated":
                quiet_blas()  # numpy only makes the inputs here (see _common.quiet_blas)
            out["generated_threads"] = set_threads(module, threads if peer == "generated" else 1)
            for size in LSTM_BATCHES:
                batches = workloads[f"b{size}"]
                fn, grads = lstm_peer(peer, mode, module.Model(seed=0), hidden)
                worst = 0.0
                if peer != "generated":  # the same function first
                    ref, ref_grads = lstm_peer("generated", mode, module.Model(seed=0), hidden)
                    if mode == "forward":
                        for k, batch in enumerate(batches):
                            want, got = ref(batch), fn(batch)
                            worst = max(worst, float(np.max(np.abs(got - want))))
                            if worst > ATOL:
                                raise SystemExit(f"{peer} h_n differs from the generated module's (H {hidden}, "
                                                 f"batch {size}, set {k}): max |diff| {worst:.3g}; refusing to "
                                                 "time different functions")
                    else:
                        want_loss, got_loss = ref(batches[0]), fn(batches[0])
                        want, got = ref_grads(), grads()
                        diffs = {k: float(np.max(np.abs(got[k] - want[k]))) for k in want}
                        worst = max([abs(want_loss - got_loss)] + list(diffs.values()))
                        if worst > ATOL:
                            raise SystemExit(f"{peer} train step differs from the generated module's (H {hidden}, "
                                             f"batch {size}): loss {got_loss} vs {want_loss}, max |gradient "
                                             f"diff| per parameter {diffs}; refusing to time different functions")
                    set_threads(module, 1)

                def run_set(fn=fn, batches=batches):
                    for batch in batches:
                        fn(batch)

                t = measure(run_set, config["target_s"], config["min_reps"])
                per_batch = [1000 * s / len(batches) for s in t["times"]]
                out["rows"].append({"section": "lstm", "hidden": hidden, "mode": mode, "batch": size, "peer": peer,
                                    "times_ms": per_batch, "cpu_per_wall": t["cpu_per_wall"],
                                    "max_abs_diff": worst})
                log(f"lstm H{hidden} {mode:7s} batch {size:2d} {peer:13s} {statistics.median(per_batch):9.3f} "
                    f"ms/batch ({len(per_batch)} reps, cpu/wall {t['cpu_per_wall']:.2f})")


# ----------------------------------------------------------------------------
# Encoder peers: fn(batch) -> y [N, T, d_model] (numpy)
# ----------------------------------------------------------------------------


def encoder_peer(peer: str, model):
    """The callable for `peer` with `model`'s weights."""
    import numpy as np

    if peer == "generated":
        return (lambda b: model.forward(x=b["x"], lengths=b["lengths"])["y"])
    import torch

    layer = torch.nn.TransformerEncoderLayer(D_MODEL, HEADS, FFN, dropout=0.0, activation="relu",
                                             layer_norm_eps=1e-5, batch_first=True, norm_first=False)
    p = model.parameters()
    layer.load_state_dict({k: torch.from_numpy(np.array(p["layer_" + k.replace(".", "_")], dtype=np.float32))
                           for k in layer.state_dict()})
    layer.eval()
    run = torch.compile(layer, dynamic=False) if peer == "torch-compile" else layer
    steps = torch.arange(SEQ)

    def fn(batch):
        with torch.inference_mode():
            x = torch.from_numpy(batch["x"])
            pad = steps[None, : x.shape[1]] >= torch.from_numpy(batch["lengths"])[:, None]  # True: padding
            return run(x, src_key_padding_mask=pad).numpy()

    return fn


def encoder_child(config: dict, out: dict, log) -> None:
    import numpy as np

    peer, threads = config["peer"], config["threads"]
    info = config["modules"]["encoder"]
    module = import_module(info["name"], info["build"])
    if peer == "generated":
        quiet_blas()  # numpy only makes the inputs here (see _common.quiet_blas)
    out["generated_threads"] = set_threads(module, threads if peer == "generated" else 1)
    workloads = load_workloads(config["encoder_batches"])
    try:
        fn = encoder_peer(peer, module.Model(seed=0))
        ref = encoder_peer("generated", module.Model(seed=0)) if peer != "generated" else None
        checked = {}
        for size in ENC_BATCHES:  # compile (torch-compile) and check every batch before any timing
            for lengths in LENGTHS:
                batches, worst = workloads[f"enc_b{size}_{lengths}"], 0.0
                for k, batch in enumerate(batches):
                    got = fn(batch)
                    if ref is None:
                        continue
                    want = ref(batch)
                    for n, length in enumerate(batch["lengths"].tolist()):  # valid positions only
                        g, w = got[n, :length], want[n, :length]
                        worst = max(worst, float(np.max(np.abs(g - w))))
                        if not np.allclose(g, w, atol=ATOL, rtol=ENC_RTOL):
                            raise SystemExit(f"{peer} differs from the generated module (batch {size}, {lengths} "
                                             f"lengths, set {k}, sequence {n}): max |diff| {worst:.3g}; refusing "
                                             "to time different functions")
                checked[(size, lengths)] = worst
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001  (torch.compile's failures come in many types)
        if peer != "torch-compile":
            raise
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
        out["skipped"] = reason
        log(f"encoder {peer}: skipped ({reason})")
        return
    if ref is not None:
        set_threads(module, 1)
    for size in ENC_BATCHES:
        for lengths in LENGTHS:
            batches = workloads[f"enc_b{size}_{lengths}"]

            def run_set(batches=batches):
                for batch in batches:
                    fn(batch)

            t = measure(run_set, config["target_s"], config["min_reps"])
            per_batch = [1000 * s / len(batches) for s in t["times"]]
            out["rows"].append({"section": "encoder", "batch": size, "lengths": lengths, "peer": peer,
                                "times_ms": per_batch, "cpu_per_wall": t["cpu_per_wall"],
                                "max_abs_diff": checked[(size, lengths)]})
            log(f"encoder batch {size} {lengths:5s} {peer:13s} {statistics.median(per_batch):9.3f} ms/batch "
                f"({len(per_batch)} reps, cpu/wall {t['cpu_per_wall']:.2f})")


# ----------------------------------------------------------------------------
# Child: one (round, threads, peer)
# ----------------------------------------------------------------------------


def child(config: dict) -> None:
    threads, peer = config["threads"], config["peer"]
    out = {"threads": threads, "peer": peer, "round": config["round"], "rows": []}
    if peer.startswith("torch"):
        import torch

        torch.set_num_threads(threads)
        out["torch_threads"] = torch.get_num_threads()

    def log(text):
        print(f"  [round {config['round'] + 1}, {threads} thr] {text}", flush=True)

    (lstm_child if config["section"] == "lstm" else encoder_child)(config, out, log)
    Path(config["out"]).write_text(json.dumps(out))


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------


def _verdict(ratio, target):
    if target is None:
        return ""
    return f"met (>= {target:g}x)" if ratio >= target else f"MISSED (target {target:g}x, {100 * ratio / target:.0f}%)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE", help="write every figure to FILE as JSON")
    parser.add_argument("--quick", action="store_true", help="fewer batches, repetitions and rounds (about a minute)")
    parser.add_argument("--only", nargs="+", choices=("lstm", "encoder"), default=["lstm", "encoder"],
                        help="run these sections only")
    parser.add_argument("--hidden", type=int, nargs="+", choices=HIDDENS,
                        help=f"LSTM hidden sizes (default: {' and '.join(map(str, HIDDENS))}; 256 with --quick)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    import numpy as np

    sections = [s for s in ("lstm", "encoder") if s in args.only]
    hiddens = tuple(sorted(set(args.hidden))) if args.hidden else (HIDDENS[:1] if args.quick else HIDDENS)
    print("Building the generated modules (cached under build/bench/):", flush=True)
    modules, skipped = {}, {}
    import generator as dg

    if "lstm" in sections and not hasattr(dg, "lstm"):
        skipped["lstm"] = "this DSL has no dg.lstm (generator/frontend/sequences.py)"
        print(f"  LSTM section SKIPPED: {skipped['lstm']}", flush=True)
        sections.remove("lstm")
    if "lstm" in sections:
        for h in hiddens:
            modules[f"lstm_forward_h{h}"] = build_module(lstm_def(h))
            modules[f"lstm_train_h{h}"] = build_module(lstm_def(h), f"lstm_bench_h{h}_train", train=True)
    if "encoder" in sections:
        model_def = encoder_def()
        if model_def is None:
            skipped["encoder"] = "this DSL has no dg.transformer_encoder_layer (generator/frontend/attention.py)"
            print(f"  encoder section SKIPPED: {skipped['encoder']}", flush=True)
            sections.remove("encoder")
        else:
            modules["encoder"] = build_module(model_def)

    rounds = 1 if args.quick else 3
    counts = {1: 6, 64: 1} if args.quick else {1: 24, 64: 3}
    enc_counts = {1: 1, 8: 1} if args.quick else {1: 2, 8: 1}
    workloads = {}
    print("\nWorkloads (seeded):")
    if "lstm" in sections:
        for size in LSTM_BATCHES:
            batches = lstm_batches(100 + size, size, counts[size])
            workloads[f"b{size}"] = batches
            lengths = np.concatenate([b["lengths"] for b in batches])
            print(f"  LSTM batch {size:2d}: {len(batches)} batches, sentence length mean {lengths.mean():.1f} "
                  f"(min {lengths.min()}, max {lengths.max()}), padded T per batch mean "
                  f"{np.mean([b['x'].shape[1] for b in batches]):.1f}")
    if "encoder" in sections:
        for size in ENC_BATCHES:
            for lengths in LENGTHS:
                batches = encoder_batches(200 + size, size, enc_counts[size], lengths == "mixed")
                workloads[f"enc_b{size}_{lengths}"] = batches
                ls = np.concatenate([b["lengths"] for b in batches])
                print(f"  encoder batch {size} {lengths:5s}: {len(batches)} batches of [{size}, {SEQ}, {D_MODEL}], "
                      f"valid tokens {ls.sum()} of {len(ls) * SEQ} (lengths {ls.min()}..{ls.max()})")

    t0 = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        files = {"lstm_batches": Path(tmp) / "lstm.npz", "encoder_batches": Path(tmp) / "encoder.npz"}
        save_workloads(files["lstm_batches"], {k: v for k, v in workloads.items() if not k.startswith("enc")})
        save_workloads(files["encoder_batches"], {k: v for k, v in workloads.items() if k.startswith("enc")})
        config = {"modules": modules, "hiddens": list(hiddens), "min_reps": 1 if args.quick else 2,
                  "target_s": 0.03 if args.quick else 0.3 / rounds, **{k: str(v) for k, v in files.items()}}
        for section in sections:
            print(f"\n{section}: {rounds} round(s) x {len(THREADS)} thread counts, a child per peer:", flush=True)
            peers = LSTM_PEERS if section == "lstm" else ENC_PEERS
            t1 = time.perf_counter()
            results += run_rounds(__file__, dict(config, section=section), rounds, THREADS, peers, section)
            print(f"{section}: {time.perf_counter() - t1:.0f} s", flush=True)
    elapsed = time.perf_counter() - t0

    pooled, cpu = {}, {}
    for res in results:
        for r in res["rows"]:
            key = ((r["section"], r["hidden"], r["mode"], r["batch"]) if r["section"] == "lstm"
                   else (r["section"], r["batch"], r["lengths"]))
            pooled.setdefault(key + (res["threads"], r["peer"]), []).extend(r["times_ms"])
            cpu.setdefault(key + (res["threads"], r["peer"]), []).append(r["cpu_per_wall"])
    for res in results:
        if res.get("skipped"):
            skipped.setdefault(res["peer"], res["skipped"])
    med = {k: statistics.median(v) for k, v in pooled.items()}
    records, verdicts = [], []

    def record(key, peer, threads, target):
        base = key + (threads,)
        gen = med[base + ("generated",)]
        m = med.get(base + (peer,))
        ratio = None if m is None else m / gen
        rec = dict(zip(("section", "hidden", "mode", "batch") if key[0] == "lstm" else ("section", "batch", "lengths"),
                       key), threads=threads, peer=peer, median_ms=None if m is None else round(m, 4),
                   min_ms=None if m is None else round(min(pooled[base + (peer,)]), 4),
                   reps=len(pooled.get(base + (peer,), [])),
                   cpu_per_wall=None if m is None else round(statistics.mean(cpu[base + (peer,)]), 3),
                   ratio_vs_generated=None if ratio is None else round(ratio, 3), target=target,
                   met=None if target is None or ratio is None else ratio >= target)
        records.append(rec)
        return rec

    diffs = [r["max_abs_diff"] for res in results for r in res["rows"] if r["peer"] != "generated"]
    print(f"\nEvery peer matched the generated module before timing (largest |difference| "
          f"{max(diffs, default=0.0):.1e}; tolerance {ATOL:g}).")
    if "lstm" in sections:
        print(f"\nLSTM (input {FEATURES}), ms per batch, median; ratio = peer / generated (> 1: generated faster):")
        head = (f"{'H':>4} {'mode':>7} {'batch':>5} {'thr':>3} | {'generated':>9} {'torch-packed':>12} "
                f"{'torch-step':>10} | {'packed/gen':>10} {'step/gen':>8} | target (1 thr)")
        print(head)
        print("-" * len(head))
        for hidden in hiddens:
            for mode in MODES:
                for size in LSTM_BATCHES:
                    for threads in THREADS:
                        key = ("lstm", hidden, mode, size)
                        target = LSTM_TARGETS.get(size) if threads == 1 else None
                        gen = record(key, "generated", threads, None)
                        packed = record(key, "torch-packed", threads, target)
                        step = record(key, "torch-step", threads, None)
                        verdict = _verdict(packed["ratio_vs_generated"], target)
                        if target is not None:
                            verdicts.append((f"LSTM H{hidden} {mode} batch {size} vs torch-packed",
                                             packed["ratio_vs_generated"], target))
                        print(f"{hidden:>4} {mode:>7} {size:>5} {threads:>3} | {gen['median_ms']:9.3f} "
                              f"{packed['median_ms']:12.3f} {step['median_ms']:10.3f} | "
                              f"{packed['ratio_vs_generated']:9.2f}x {step['ratio_vs_generated']:7.2f}x | {verdict}")
    if "encoder" in sections:
        print(f"\nTransformer encoder layer (d_model {D_MODEL}, {HEADS} heads, FFN {FFN}, relu, post-norm, "
              f"T {SEQ}), forward, ms per batch, median; ratio = peer / generated:")
        head = (f"{'batch':>5} {'lengths':>7} {'thr':>3} | {'generated':>9} {'torch-eager':>11} "
                f"{'torch-compile':>13} | {'eager/gen':>9} {'compile/gen':>11} | target (1 thr)")
        print(head)
        print("-" * len(head))
        for size in ENC_BATCHES:
            for lengths in LENGTHS:
                for threads in THREADS:
                    key = ("encoder", size, lengths)
                    target = ENC_TARGET.get(size) if threads == 1 else None
                    gen = record(key, "generated", threads, None)
                    eager = record(key, "torch-eager", threads, target)
                    comp = record(key, "torch-compile", threads, None)
                    if target is not None:
                        verdicts.append((f"encoder batch {size} {lengths} vs torch-eager",
                                         eager["ratio_vs_generated"], target))
                    cm = "skipped" if comp["median_ms"] is None else f"{comp['median_ms']:.3f}"
                    cr = "-" if comp["ratio_vs_generated"] is None else f"{comp['ratio_vs_generated']:.2f}x"
                    print(f"{size:>5} {lengths:>7} {threads:>3} | {gen['median_ms']:9.3f} {eager['median_ms']:11.3f} "
                          f"{cm:>13} | {eager['ratio_vs_generated']:8.2f}x {cr:>11} | "
                          f"{_verdict(eager['ratio_vs_generated'], target)}")
    for what, reason in skipped.items():
        print(f"SKIPPED {what}: {reason}")

    facts = machine_facts()
    if modules:
        first = next(iter(modules.values()))
        info = import_module(first["name"], first["build"]).build_info()
        facts["build_info"] = dict(info) if hasattr(info, "keys") else str(info)
        facts["compiler"] = first["compiler"]
    isa = "AVX-512" if "avx512f" in facts["cpu_isa"] else "AVX2" if "avx2" in facts["cpu_isa"] else "no AVX2"
    print(f"\nTargets (1 thread): {sum(r >= t for _, r, t in verdicts)} of {len(verdicts)} met")
    for what, ratio, target in verdicts:
        print(f"  {what}: {ratio:.2f}x, {_verdict(ratio, target)}")
    print(f"\n{facts['cpu']} ({isa}), {facts['cores']} cores; python {facts['python']}, numpy {facts['numpy']}, "
          f"torch {facts['torch']}; git {facts['git']}; generated: {facts.get('build_info')}, compiler "
          f"{facts.get('compiler')}")
    busy = [max(r["other_cores"], r["steal_cores"]) for r in results if r.get("other_cores") is not None]
    print(f"{elapsed:.0f} s of measurement, {rounds} round(s); contention (other processes or steal) up to "
          f"{max(busy, default=float('nan')):.2f} cores")
    preempted = [r for r in records if r["threads"] == 1 and r["cpu_per_wall"] is not None and r["cpu_per_wall"] < 0.9]
    if preempted:
        print("NOTE: 1-thread measurements with CPU time < 0.9 x wall time (preempted, or a thread pool "
              "sleeping): " + ", ".join(f"{r['section']} {r.get('hidden', '')} {r.get('mode', r.get('lengths'))} "
                                        f"batch {r['batch']} {r['peer']} ({r['cpu_per_wall']:.2f})" for r in preempted))
    if any(b > BUSY_LIMIT for b in busy):
        print("WARNING: other processes ran while measuring; the figures are noisy. Rerun on an idle machine.")
    if args.json:
        env = {**facts, "children": [{k: r.get(k) for k in ("round", "threads", "peer", "other_cores", "steal_cores",
                                                              "torch_threads", "generated_threads", "skipped")}
                                     for r in results],
               "quick": args.quick, "rounds": rounds, "atol": ATOL, "measure_seconds": round(elapsed, 1),
               "contention_cores": busy}
        Path(args.json).write_text(json.dumps({"environment": env, "modules": modules, "skipped": skipped,
                                               "records": records}, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
