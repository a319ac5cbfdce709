"""Benchmark: what the optimization passes buy, -O0 against -O2.

    python benchmarks/passes.py [--json FILE] [--seconds S]

Cases (each example generated twice from the same model file, as modules
<example>_o0 and <example>_o2 via ModelDef.build(name=...)):

  mlp       examples/mlp.py: forward() and train_step() at batch N = 64
  bow       examples/bow.py: forward() at N = 64, T = 20 (token ids in [0, 1000))
  digits    examples/digits.py: train_step() at batch N = 32
  treelstm  examples/treelstm.py: forward() over one seeded batch of 10 random
            binary trees (generator.treebatch.random_batch, 2..34 leaves per
            tree, 18 on average)

Builds: generator.pipeline.generate(graph, dir, opt=...) writes each project
to build/bench-passes/<module>/src; it is built with plain CMake (Release, Ninja
when available) into build/bench-passes/<module>/build. A build is reused when
the generated sources (the manifest's hashes) and the Python are unchanged.

Per case and level:

  latency   median of single calls (time.perf_counter) after a warm-up; the two
            levels are timed in alternating rounds (--seconds in all per level,
            0.3 s by default) so that drift affects both alike. Inputs are made
            once (seeded) and shared. train_step keeps training while timed.
  arena     model.memory_stats()["predicted_peak_bytes"] after the call (the
            arena the code allocated from the plan); it must equal the measured
            high-water mark "peak_bytes". The plan's formula
            (generator.memory.report.MemoryModel, forward or train arena)
            evaluated at the call's sizes is recorded next to it.
  kernels   `void` function definitions in the generated src/kernels.cpp.
  nodes     nodes of the graph after generator.codegen.emit.prepare (the graph
            that was lowered: backward pass included for a trainable model;
            recursive cells' nodes included, as the passes' own count does).
            The top-level count is in the JSON too.

Before timing, the O0 and O2 modules (both Model(seed=0)) must agree
(np.allclose, atol 1e-4): every output of forward(); for train_step the loss,
every gradient and every parameter after one step.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
CACHE = ROOT / "build" / "bench-passes"
LEVELS = ("O0", "O2")
ATOL = 1e-4
VOCAB = 1000
TREES, MIN_LEAVES, MAX_LEAVES = 10, 2, 34  # uniform leaves: 18 per tree on average
# (example, call, sizes for the label); inputs are made by make_inputs
CASES = [
    ("mlp", "forward", "N=64"),
    ("mlp", "train_step", "N=64"),
    ("bow", "forward", "N=64 T=20"),
    ("digits", "train_step", "N=32"),
    ("treelstm", "forward", f"{TREES} trees"),
]


# ----------------------------------------------------------------------------
# Generation and builds
# ----------------------------------------------------------------------------


def cmake_build(project, build, jobs):
    from generator.tools.build import cmake_build as build_project

    build_project(project, build, jobs)


def count_nodes(graph) -> tuple[int, int]:
    """(top-level nodes, nodes including those of recursive cells)."""
    top = len(graph.nodes)
    total = top
    for node in graph.nodes:
        if node.op == "recurse":
            spec = node.attrs["spec"]
            total += len(spec.leaf.nodes) + len(spec.internal.nodes)
    return top, total


def build_example(example: str, level: str) -> dict:
    """Generate examples/<example>.py at `level` as module <example>_<level>,
    build it (or reuse the build) and import it."""
    from generator.codegen.writer import MANIFEST
    from generator.pipeline import generate
    from generator.pipeline import lowered
    from generator.frontend.loader import load_model

    name = f"{example}_{level.lower()}"
    graph = load_model(str(ROOT / "examples" / f"{example}.py")).build(name=name)
    folder = CACHE / name
    src, build = folder / "src", folder / "build"
    t0 = time.perf_counter()
    generate(graph, src, force=True, opt=level)  # runs prepare(graph, level); unchanged files keep their mtimes
    gen_seconds = time.perf_counter() - t0
    plan = lowered(graph)  # the plan the sources were rendered from (for the formula)
    files = json.loads((src / MANIFEST).read_text())["files"]
    key = hashlib.sha256(json.dumps({"files": files, "python": sys.executable, "version": sys.version},
                                    sort_keys=True).encode()).hexdigest()
    from generator.tools.build import build_if_changed

    t1 = time.perf_counter()
    reused = build_if_changed(src, build, name, key, jobs=os.cpu_count() or 2)
    build_seconds = time.perf_counter() - t1
    sys.path.insert(0, str(build))
    try:
        module = importlib.import_module(name)
    finally:
        sys.path.remove(str(build))
    if not str(Path(module.__file__).resolve()).startswith(str(build.resolve())):
        raise SystemExit(f"imported {name} from {module.__file__}, not from {build}")
    kernels_cpp = (src / "src" / "kernels.cpp").read_text()
    kernels = len(re.findall(r"^\s*(?:static\s+|inline\s+)*void\s+\w+\s*\(", kernels_cpp, re.M))
    top, total = count_nodes(graph)
    print(f"  {name}: generated in {gen_seconds:.1f} s, {'reused build' if reused else 'built'}"
          f"{'' if reused else f' in {build_seconds:.1f} s'} ({build.relative_to(ROOT)})", flush=True)
    return {"name": name, "graph": graph, "plan": plan, "module": module, "kernels": kernels,
            "nodes": total, "nodes_top_level": top, "build": str(build), "reused": reused,
            "generate_seconds": round(gen_seconds, 2), "build_seconds": round(build_seconds, 2)}


# ----------------------------------------------------------------------------
# Inputs, checks, measurements
# ----------------------------------------------------------------------------


def make_inputs(example: str, call: str) -> dict:
    import numpy as np

    from generator.treebatch import random_batch

    rng = np.random.default_rng(0)
    if example == "mlp":
        inputs = {"x": rng.standard_normal((64, 784)).astype(np.float32)}
        if call == "train_step":
            inputs["labels"] = rng.integers(0, 10, 64).astype(np.int64)
    elif example == "bow":
        inputs = {"tokens": rng.integers(0, VOCAB, (64, 20)).astype(np.int64)}
    elif example == "digits":
        inputs = {"pixels": rng.uniform(0, 1, (32, 64)).astype(np.float32),
                  "labels": rng.integers(0, 10, 32).astype(np.int64)}
    elif example == "treelstm":
        batch = random_batch(rng, TREES, 2, VOCAB, min_leaves=MIN_LEAVES, max_leaves=MAX_LEAVES)
        inputs = {f"trees_{k}": v for k, v in batch.items()}
    else:
        raise ValueError(example)
    return {k: np.ascontiguousarray(v) for k, v in inputs.items()}


def bind_dims(graph, inputs: dict) -> dict:
    """Symbolic dims -> sizes, read off the inputs' shapes."""
    dims = {}
    for v in graph.inputs:
        if v.name in inputs:
            for d, size in zip(v.shape, inputs[v.name].shape):
                if not isinstance(d, int):
                    dims[d] = int(size)
    return dims


def formula_bytes(built: dict, call: str, inputs: dict) -> int | None:
    """The plan's arena formula (MemoryModel) at the call's sizes."""
    from generator.memory.report import MemoryModel

    try:
        m = MemoryModel(built["graph"], built["plan"])
        expr = m.arena if call == "train_step" else m.forward_arena
        return m.at(expr, bind_dims(built["graph"], inputs))
    except Exception:  # noqa: BLE001  (an extra figure; the module's own numbers are the ones checked)
        return None


def agree(a, b) -> tuple[bool, float]:
    import numpy as np

    a, b = np.asarray(a), np.asarray(b)
    ok = a.shape == b.shape and bool(np.allclose(a, b, atol=ATOL))
    diff = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) if a.shape == b.shape and a.size else 0.0
    return ok, diff


def check(models: dict, call: str, inputs: dict) -> dict:
    """Run the call once on each level's fresh model and compare. Returns
    {"ok", "max_abs_diff", "compared", "failures"}."""
    results = {}
    for level, model in models.items():
        if call == "forward":
            results[level] = {f"output/{k}": v for k, v in model.forward(**inputs).items()}
        else:
            loss = model.train_step(**inputs)
            res = {"loss": loss}
            res.update({f"gradient/{k}": v.copy() for k, v in model.gradients().items()})
            res.update({f"parameter/{k}": v.copy() for k, v in model.parameters().items()})
            results[level] = res
    a, b = results["O0"], results["O2"]
    failures, worst = [], 0.0
    if set(a) != set(b):
        failures.append(f"different keys: {sorted(set(a) ^ set(b))}")
    for key in sorted(set(a) & set(b)):
        ok, diff = agree(a[key], b[key])
        worst = max(worst, diff)
        if not ok:
            failures.append(f"{key} (max |diff| {diff:.3g})")
    return {"ok": not failures, "max_abs_diff": worst, "compared": len(set(a) & set(b)), "failures": failures}


def time_calls(fns: dict, seconds: float, rounds: int = 3, warmup: float = 0.05) -> dict:
    """Median latency (s) per level: warm-up, then `rounds` alternating rounds of
    seconds/rounds each, one sample per call."""
    samples = {level: [] for level in fns}
    for fn in fns.values():
        t_end = time.perf_counter() + warmup
        n = 0
        while n < 3 or time.perf_counter() < t_end:
            fn()
            n += 1
    for _ in range(rounds):
        for level, fn in fns.items():
            t_end = time.perf_counter() + seconds / rounds
            while True:
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                samples[level].append(t1 - t0)
                if t1 >= t_end and len(samples[level]) >= 5:
                    break
    return {level: {"median_s": statistics.median(s), "calls": len(s),
                    "min_s": min(s)} for level, s in samples.items()}


def measure(example: str, call: str, label: str, builds: dict, seconds: float) -> dict:
    import numpy as np

    inputs = make_inputs(example, call)
    models = {level: builds[(example, level)]["module"].Model(seed=0) for level in LEVELS}
    verdict = check(models, call, inputs)
    if not verdict["ok"]:
        raise SystemExit(f"{example} {call}: -O0 and -O2 disagree: {', '.join(verdict['failures'])}")
    memory = {}
    for level, model in models.items():
        stats = model.memory_stats()
        memory[level] = {"predicted_peak_bytes": int(stats["predicted_peak_bytes"]),
                         "peak_bytes": int(stats["peak_bytes"]),
                         "formula_bytes": formula_bytes(builds[(example, level)], call, inputs)}
        if stats["peak_bytes"] != stats["predicted_peak_bytes"]:
            raise SystemExit(f"{example} {call} at {level}: peak_bytes {stats['peak_bytes']} != "
                             f"predicted_peak_bytes {stats['predicted_peak_bytes']}")
    fns = {level: (lambda m=model: getattr(m, call)(**inputs)) for level, model in models.items()}
    timing = time_calls(fns, seconds)
    final_loss = None
    if call == "train_step":
        final_loss = {level: float(model.train_step(**inputs)) for level, model in models.items()}
        if not all(np.isfinite(v) for v in final_loss.values()):
            print(f"  warning: {example} train_step loss is not finite after timing: {final_loss}", flush=True)
    row = {"example": example, "call": call, "sizes": label,
           "inputs": {k: list(v.shape) for k, v in inputs.items()},
           "dims": {str(d): v for d, v in bind_dims(builds[(example, "O0")]["graph"], inputs).items()},
           "check": verdict, "final_loss": final_loss}
    for level in LEVELS:
        b = builds[(example, level)]
        row[level] = {"module": b["name"], "latency_ms": timing[level]["median_s"] * 1e3,
                      "latency_min_ms": timing[level]["min_s"] * 1e3, "timed_calls": timing[level]["calls"],
                      **memory[level], "kernels": b["kernels"], "nodes": b["nodes"],
                      "nodes_top_level": b["nodes_top_level"]}
    row["latency_ratio"] = ratio(row["O0"]["latency_ms"], row["O2"]["latency_ms"])
    row["arena_ratio"] = ratio(row["O0"]["predicted_peak_bytes"], row["O2"]["predicted_peak_bytes"])
    return row


def ratio(a, b):
    return a / b if b else None


def fmt_ratio(r) -> str:
    return "-" if r is None else f"{r:.2f}"


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write all figures to this file")
    parser.add_argument("--seconds", type=float, default=0.3, help="timing per level and case (default 0.3)")
    args = parser.parse_args(argv)

    import numpy as np

    start = time.perf_counter()
    print(f"Generating and building into {CACHE.relative_to(ROOT)}/ ...", flush=True)
    builds = {}
    for example in dict.fromkeys(e for e, _, _ in CASES):
        for level in LEVELS:
            builds[(example, level)] = build_example(example, level)
    build_elapsed = time.perf_counter() - start

    print("Checking -O0 against -O2 and measuring ...", flush=True)
    t0 = time.perf_counter()
    rows = [measure(example, call, label, builds, args.seconds) for example, call, label in CASES]
    measure_elapsed = time.perf_counter() - t0

    print()
    head = (f"{'example':<9} {'call':<10} {'sizes':<10} | {'O0 ms':>8} {'O2 ms':>8} {'O0/O2':>6} | "
            f"{'arena O0 B':>11} {'arena O2 B':>11} {'O0/O2':>6} | {'kern O0':>7} {'O2':>3} | "
            f"{'nodes O0':>8} {'O2':>4} | check")
    print(head)
    print("-" * len(head))
    for r in rows:
        a, b = r["O0"], r["O2"]
        print(f"{r['example']:<9} {r['call']:<10} {r['sizes']:<10} | {a['latency_ms']:>8.3f} {b['latency_ms']:>8.3f} "
              f"{fmt_ratio(r['latency_ratio']):>6} | {a['predicted_peak_bytes']:>11,} {b['predicted_peak_bytes']:>11,} "
              f"{fmt_ratio(r['arena_ratio']):>6} | {a['kernels']:>7} {b['kernels']:>3} | "
              f"{a['nodes']:>8} {b['nodes']:>4} | ok ({r['check']['compared']}, "
              f"max {r['check']['max_abs_diff']:.1e})")
    print()
    print("latency: median of single calls, warm-up first, ~%.1f s per level in 3 alternating rounds; "
          "arena: predicted_peak_bytes == peak_bytes after the call (held for every row)" % args.seconds)
    print("kernels: `void` definitions in src/kernels.cpp; nodes: graph after prepare (backward included, "
          "recursive cells included; per module, so both mlp rows show the same counts)")
    print("check: O0 vs O2 with np.allclose(atol=%g): (values compared, largest |difference|)" % ATOL)
    formula = [f"{r['example']} {r['call']} {lv}" for r in rows for lv in LEVELS
               if r[lv]["formula_bytes"] is not None and r[lv]["formula_bytes"] != r[lv]["predicted_peak_bytes"]]
    missing = [f"{r['example']} {lv}" for r in rows for lv in LEVELS if r[lv]["formula_bytes"] is None]
    print("plan formula (MemoryModel) at these sizes == predicted_peak_bytes: "
          + ("yes for every row" if not formula else "DIFFERS for " + ", ".join(formula))
          + (f" (not evaluated for {', '.join(missing)})" if missing else ""))
    tree = next((r for r in rows if r["example"] == "treelstm"), None)
    if tree is not None:
        print(f"treelstm batch: {tree['dims']}")
    print(f"builds/generation {build_elapsed:.1f} s ({sum(not b['reused'] for b in builds.values())} built, "
          f"{sum(b['reused'] for b in builds.values())} reused); measuring {measure_elapsed:.1f} s; "
          f"total {time.perf_counter() - start:.1f} s")

    if args.json:
        env = {"python": sys.version.split()[0], "numpy": np.__version__, "machine": platform.machine(),
               "processor": platform.processor(), "cores": os.cpu_count(), "seconds_per_level": args.seconds,
               "build_seconds": round(build_elapsed, 2), "measure_seconds": round(measure_elapsed, 2)}
        modules = {b["name"]: {k: b[k] for k in ("build", "reused", "generate_seconds", "build_seconds", "kernels",
                                                 "nodes", "nodes_top_level")} for b in builds.values()}
        Path(args.json).write_text(json.dumps({"environment": env, "modules": modules, "rows": rows},
                                              indent=1, default=str) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
