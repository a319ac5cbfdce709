"""Benchmark: reduced precision (issue #41): accuracy and speed of bf16 and int8 against fp32.

    python benchmarks/precision.py [--quick] [--accuracy-only | --speed-only] [--models mlp,resnet18]
                                   [--threads 1,2] [--batches 1,64] [--image 224] [--rounds 3] [--json FILE]

Accuracy (in this process; benchmarks/precision_accuracy.py says how each model is trained
and on what): the digits MLP, LeNet on the digits, the LSTM classifier, the TreeLSTM
sentiment example and torchvision's ResNet-18 (imported, random initialization: top-1
agreement only), each trained in fp32, then generated and built three times: fp32,
`--precision bf16`, `--precision int8` (scales by `deepgen quantize` on the training
inputs, max-abs). The table gives each one's held-out accuracy, its relative change
against fp32 (target: within 1%) and its top-1 agreement with fp32. Needs scikit-learn
(the digits); torch and torchvision for the ResNet-18 row.

Speed: the MLP, the TreeLSTM level cell, torchvision's ResNet-18 and ResNet-50 and the BERT
encoder (benchmarks/precision_models.py says how each is built, weighted, quantized and
exported) at batch 1 and 64, 1 and 2 threads (--models, --batches, --threads pick others).
Images are 224x224 (the deployment size; --image, 64 with --quick). Peers, all on the same
weights (benchmarks/precision_peers.py says how each one runs):
  dg_fp32 / dg_bf16 / dg_int8   the generated modules (`--precision bf16`, `int8` with
                                `deepgen quantize`'s scales), set_num_threads(n)
  ov_bf16    OpenVINO on the ONNX graph, INFERENCE_PRECISION_HINT bf16, static shapes
  ov_int8    OpenVINO on nncf.quantize's int8 model (INFERENCE_PRECISION_HINT f32 for what
             stays float, as deepgen int8 keeps it float32), when nncf is installed
  ort_int8   ONNX Runtime: quantize_static (QDQ) for the CNNs, quantize_dynamic for the MLP,
             the level cell and BERT; intra_op_num_threads n
Each (model, round, thread count, peer) runs in a child process of its own with the thread
variables set before anything is imported; peers alternate order from round to round; times
are medians of single calls pooled over rounds (3; 1 with --quick). Before timing, each child
checks its peer's output at every batch against our fp32 output (relative error = max |diff|
/ max |fp32|) within TOLERANCE: 1e-4 for fp32, 5e-2 for bf16, 1e-1 for int8 (the operands'
rounding on random weights through up to 50 layers; seen with --quick: bf16 <= 6e-3 for every
peer, int8 <= 1.7e-2 for ours, <= 6.8e-2 for OpenVINO's MLP, <= 3.8e-2 for the others; a
weight mixed up gives errors of order 1); a peer that misses is not timed there and the table
says so (--json: every cell's error). Ratio "x" = our fp32 median / the peer's (> 1: faster than our fp32); "vs"
columns = the other engine's median / ours at the same precision (> 1: we are faster).
Targets (#41), checked and listed at the end: dg_bf16 >= 1.8x and dg_int8 >= 2.5x our fp32 at
batch >= 32, both >= 1.4x at batch 1; every "vs" >= 1.0. A 2-thread cell whose median is over
twice the peer's 1-thread one is marked * (its threads waited for a core another process held).
Each model's table names the kernels its deepgen modules were compiled for (build_info():
gemm_kernel, bf16_kernel, int8_kernel: amx, avx512_vnni, avx_vnni, avx2 or portable); DG_AMX=0
in the environment turns the AMX tiles off.

Run time (2-core AVX-512 + AMX VM shared with two other developers' builds, so loaded; builds
cached; --quick --speed-only --models M): mlp 17-54 s, level_cell 17-36 s, resnet18 39-100 s,
resnet50 145-190 s, bert_encoder 97-135 s. A model's first run also builds its three modules (20-60 s
each). All five models, --quick --speed-only --threads 1, idle, the builds cached but int8's
convolution modules rebuilt: 6.2 min. The full run (224x224, 3 rounds; a batch-64 ResNet-50
call takes seconds) is longer: not yet timed on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from _common import ROOT, WAITED_NOTE, machine_facts, measure, pooled_rows, quiet_blas, run_rounds
from precision_accuracy import accuracy_table
from precision_models import MODELS, prepare
from precision_peers import FACTORIES, PRECISION, peers_of

TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2, "int8": 1e-1}
SAME = {"ov_bf16": "dg_bf16", "ov_int8": "dg_int8", "ort_int8": "dg_int8"}  # peer -> ours at its precision
TARGET = {"dg_bf16": 1.8, "dg_int8": 2.5}  # x our fp32 at batch >= 32; 1.4 at batch 1; SAME >= 1.0
TARGET_ONE, LARGE = 1.4, 32


def child(config: dict) -> None:
    quiet_blas()
    import logging
    import warnings

    import numpy as np

    from real_models import make_feeds, relative_error

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    desc, peer, threads = config["model"], config["peer"], config["threads"]
    for_batch = FACTORIES[peer.split("_")[0]](desc, peer, threads)
    with np.load(desc["reference"]) as f:
        reference = {k: f[k].astype(np.float64) for k in f.files}
    out = {"peer": peer, "threads": threads, "round": config["round"], "rows": [], "errors": {}}
    for n in config["batches"]:
        feeds = make_feeds(desc, n)
        call, output = for_batch(n)
        err = relative_error(output(call(feeds)), reference[f"b{n}"])
        if not err <= TOLERANCE[PRECISION[peer]]:
            out["errors"][str(n)] = err
            print(f"  {desc['key']} {peer}: batch {n} differs from our fp32 by {err:.2e} (relative): not timed",
                  flush=True)
            continue
        t = measure(lambda: call(feeds), config["seconds"], config["min_reps"])
        ms = [1e3 * s for s in t["times"]]
        out["rows"].append({"batch": n, "times_ms": ms, "cpu_per_wall": t["cpu_per_wall"], "rel_err": err})
        print(f"  [round {config['round'] + 1}, {threads} thr] {desc['key']} batch {n:3d} {peer:8s} "
              f"{statistics.median(ms):10.3f} ms ({len(ms)} calls, error {err:.1e})", flush=True)
    Path(config["out"]).write_text(json.dumps(out))


# ----------------------------------------------------------------------------
# The speed table
# ----------------------------------------------------------------------------


def speed_model(key: str, args, cache: Path) -> tuple:
    """Prepare model `key`, time its peers, print its table; (its JSON description, its records)."""
    t0 = time.perf_counter()
    desc = prepare(key, cache, args.image, args.batches)
    summary = {k: desc.get(k) for k in ("status", "size", "family", "options", "calibration", "kernels",
                                        "ov_int8_status", "builds", "build_errors")}
    if desc["status"] != "ok":
        print(f"\n{key}: not timed: {desc['status']}")
        return summary, []
    peers = peers_of(desc)
    config = {"model": desc, "batches": args.batches, "seconds": 0.3 if args.quick else 1.0,
              "min_reps": 3 if args.quick else 5}
    results = run_rounds(Path(__file__), config, args.rounds, args.threads, peers, key)
    pooled, cpu, medians, _ = pooled_rows(results)
    errors, agreement = {}, {}  # untimed cells' errors; the largest error of each timed cell over its rounds
    for res in results:
        for n, err in res["errors"].items():
            errors[(int(n), res["threads"], res["peer"])] = err
        for r in res["rows"]:
            at = (r["batch"], res["threads"], res["peer"])
            agreement[at] = max(agreement.get(at, 0.0), r["rel_err"])
    records = []
    for n in args.batches:
        for threads in args.threads:
            fp32 = medians.get((n, threads, "dg_fp32"))
            for peer in peers:
                key_ = (n, threads, peer)
                rec = {"model": key, "batch": n, "threads": threads, "peer": peer, "precision": PRECISION[peer]}
                if key_ not in medians:
                    rec["error"] = errors.get(key_)
                    records.append(rec)
                    continue
                ours = medians.get((n, threads, SAME.get(peer, peer)))
                rec.update(median_ms=round(medians[key_], 4), min_ms=round(min(pooled[key_]), 4),
                           reps=len(pooled[key_]), cpu_per_wall=round(statistics.mean(cpu[key_]), 3),
                           rel_err=agreement[key_],
                           x_fp32=round(fp32 / medians[key_], 3) if fp32 else None,
                           vs_ours=round(medians[key_] / ours, 3) if peer in SAME and ours else None)
                records.append(rec)
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    print_speed(key, desc, peers, records, args)
    return summary, records


def print_speed(key: str, desc: dict, peers: list, records: list, args) -> None:
    kernels = "; ".join(f"{p} " + (", ".join(f"{k} {v}" for k, v in ks.items()) or "none reported")
                        for p, ks in (desc.get("kernels") or {}).items())
    size = f", {desc['size']}" if desc.get("size") else ""
    print(f"\n{key}{size}: median ms per call, (x) = our fp32 / peer; vs = peer / ours at its precision. "
          f"deepgen kernels (build_info): {kernels}" + (f"; ov_int8: {desc['ov_int8_status']}" if desc.get("ov_int8_status") else "")
          + "".join(f"; dg_{p} not built: {e}" for p, e in (desc.get("build_errors") or {}).items()))
    others = [p for p in peers if p in SAME]
    print(f"{'batch':>5} {'thr':>3} | " + " ".join(f"{p:>17}" for p in peers) + " | "
          + " ".join(f"{p + ' vs':>11}" for p in others))
    at = {(r["batch"], r["threads"], r["peer"]): r for r in records if r["model"] == key}
    for n in args.batches:
        for threads in args.threads:
            cells, vs = [], []
            for p in peers:
                r, one = at[(n, threads, p)], at.get((n, 1, p), {})
                waited = "*" if threads > 1 and r.get("median_ms", 0) > 2 * one.get("median_ms", float("inf")) else " "
                if "median_ms" not in r:
                    cells.append(f"{'differs ' + format(r['error'], '.0e') if r.get('error') else '-':>17}")
                else:
                    cells.append(f"{r['median_ms']:8.3f}{waited}({r['x_fp32']:5.2f}x)" if r["x_fp32"]
                                 else f"{r['median_ms']:8.3f}{waited}{'':8}")
                if p in SAME:
                    vs.append(f"{r['vs_ours']:11.2f}" if r.get("vs_ours") else f"{'-':>11}")
            print(f"{n:>5} {threads:>3} | " + " ".join(cells) + " | " + " ".join(vs))
    if any(r.get("median_ms", 0) > 2 * at.get((r["batch"], 1, r["peer"]), {}).get("median_ms", float("inf"))
           for r in at.values() if r["threads"] > 1):
        print(WAITED_NOTE)


def target_misses(records: list) -> tuple:
    """(cells checked, the misses as text) against #41's targets."""
    checked, misses = 0, []
    for r in records:
        if "median_ms" not in r:
            continue
        cell = f"{r['model']} b{r['batch']} {r['threads']}thr {r['peer']}"
        need = TARGET.get(r["peer"]) if r["batch"] >= LARGE else TARGET_ONE if r["batch"] == 1 and r["peer"] in TARGET else None
        if need is not None:
            checked += 1
            if r["x_fp32"] < need:
                misses.append(f"{cell} {r['x_fp32']:.2f}x fp32 (< {need})")
        if r.get("vs_ours") is not None:
            checked += 1
            if r["vs_ours"] < 1.0:
                misses.append(f"{cell} vs ours {r['vs_ours']:.2f} (< 1.0)")
    return checked, misses


def speed_table(args, cache: Path) -> tuple:
    models, records = {}, []
    for key in args.models:
        models[key], recs = speed_model(key, args, cache)
        records += recs
    checked, misses = target_misses(records)
    print(f"\n#41 targets: {checked - len(misses)} of {checked} checks met"
          + ("; missed:\n  " + "\n  ".join(misses) if misses else ""))
    untimed = [f"{r['model']} b{r['batch']} {r['threads']}thr {r['peer']}" + (f" (differs: {r['error']:.2e})"
               if r.get("error") else "") for r in records if "median_ms" not in r]
    if untimed:
        print("not timed (so not checked): " + ", ".join(untimed))
    return models, records


def print_accuracy(rows: list) -> None:
    """One block per model: accuracy, change against fp32, top-1 agreement with fp32."""
    print(f"\n{'model':>20} {'precision':>9} {'accuracy':>9} {'vs fp32':>8} {'top-1 agreement':>16}")
    for row in rows:
        if row["precision"] == "fp32":
            print(f"  {row['what']}")
        accuracy = "-" if row["accuracy"] is None else f"{row['accuracy']:.4f}"
        relative = "-" if row["relative"] is None else f"{row['relative']:+.2%}"
        print(f"{row['model']:>20} {row['precision']:>9} {accuracy:>9} {relative:>8} {row['agreement']:16.4f}")


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def _ints(text: str) -> list:
    return [int(v) for v in text.split(",") if v]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="one round, shorter timings, 64x64 images")
    parser.add_argument("--accuracy-only", action="store_true", help="the accuracy table only (no timings)")
    parser.add_argument("--speed-only", action="store_true", help="the speed table only (no accuracy)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"speed table's models (default: {','.join(MODELS)})")
    parser.add_argument("--threads", type=_ints, default=[1, 2], help="thread counts, e.g. 1,2 (default)")
    parser.add_argument("--batches", type=_ints, default=[1, 64], help="batches, e.g. 1,64 (default)")
    parser.add_argument("--image", type=int, help="the CNNs' image size (default 224; 64 with --quick)")
    parser.add_argument("--rounds", type=int, help="rounds per cell (default 3; 1 with --quick)")
    parser.add_argument("--json", type=Path, help="write the tables here")
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    args.models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; the models: {', '.join(MODELS)}")
    args.image = args.image or (64 if args.quick else 224)
    args.rounds = args.rounds or (1 if args.quick else 3)
    cache = ROOT / "build" / "bench" / "precision"
    cache.mkdir(parents=True, exist_ok=True)
    facts = machine_facts()
    facts["engines"] = {p: _version(p) for p in ("onnxruntime", "openvino", "nncf")}
    print(f"machine: {facts.get('cpu')}, {facts.get('cores')} cores ({', '.join(facts.get('cpu_isa') or [])}); "
          f"git {facts.get('git')}; " + ", ".join(f"{k} {v}" for k, v in facts["engines"].items()))
    accuracy = [] if args.speed_only else accuracy_table(cache)
    if accuracy:
        print_accuracy(accuracy)
    models, speed = ({}, []) if args.accuracy_only else speed_table(args, cache)
    if args.json:
        settings = {k: getattr(args, k) for k in ("quick", "threads", "batches", "image", "rounds")}
        legend = {"x_fp32": "our fp32 median / this peer's", "vs_ours": "this peer's median / ours at its precision",
                  "rel_err": "max |peer - our fp32| / max |our fp32| at this batch"}
        args.json.write_text(json.dumps({"machine": facts, "settings": settings, "tolerance": TOLERANCE, "legend": legend,
                                         "accuracy": accuracy, "models": models, "speed": speed}, indent=1))


if __name__ == "__main__":
    main()
