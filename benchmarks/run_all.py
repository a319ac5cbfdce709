"""Every benchmark, one table: deepgen's figure, its peer's (measured in the same run),
the ratio, the target and whether it is met.

    python benchmarks/run_all.py [--quick] [--json FILE] [--only treelstm mlp gemm build_time]

Runs, each as a subprocess with --json into a temporary folder (their own output
streams through; --quick is passed on, about 5 minutes in all):

  treelstm.py --hidden 64 128 256
                             generated TreeLSTM vs PyTorch per-node and level-batched,
                             batch 1 and 10, 1 and 2 threads (rows for H 64 and 128:
                             per-node, batch 10, 1 thread)
  engines.py                 MLP forward and TreeLSTM level cell vs ONNX Runtime and
                             OpenVINO fp32 (those installed), M 1..256, 1 and 2 threads
  mlp.py                     784-512-256-10 train step vs PyTorch eager, batch 64 and 256
  gemm.py                    GEMM GFLOP/s at the models' shapes vs numpy
  build_time.py              generation and build time of each example (no peer)

Ratios are always "> 1: deepgen is better": peer time / deepgen time, deepgen
GFLOP/s / numpy GFLOP/s, and for thread scaling 1-thread time / 2-thread time.
Targets are for 1 thread unless the row says otherwise. --json FILE writes the
same rows, the machine's facts and each benchmark's own JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import BUSY_LIMIT, machine_facts

HERE = Path(__file__).resolve().parent
BENCHMARKS = {
    "treelstm": ["--hidden", "64", "128", "256"],
    "engines": [],
    "mlp": [],
    "gemm": [],
    "build_time": [],
}
TREELSTM_TARGETS = {(10, 1, "torch-node"): 14.0, (10, 1, "torch-level"): 1.6, (1, 1, "torch-level"): 2.5}
SMALL_PER_NODE_TARGET = 14.0  # H <= 128, batch 10, 1 thread: PyTorch per-node / generated
SCALING_TARGET = 1.7  # generated TreeLSTM H256 batch 10: 1-thread time / 2-thread time


def row(bench, config, deepgen, peer, unit, ratio=None, target=None):
    return {
        "benchmark": bench,
        "config": config,
        "deepgen": deepgen,
        "peer": peer,
        "unit": unit,
        "ratio": None if ratio is None else round(ratio, 3),
        "target": target,
        "met": None if target is None or ratio is None else ratio >= target,
    }


def treelstm_rows(data) -> list:
    recs = {(r["batch"], r["threads"], r["peer"]): r for r in data["records"] if r["hidden"] == 256}
    rows = []
    for batch in (10, 1):
        for threads in (1, 2):
            gen = recs[(batch, threads, "generated")]["median_ms"]
            for peer, name in (("torch-node", "PyTorch per-node"), ("torch-level", "PyTorch level-batched")):
                other = recs[(batch, threads, peer)]["median_ms"]
                rows.append(row("treelstm H256", f"batch {batch}, {threads} thr, vs {name}", gen, other, "ms",
                                other / gen, TREELSTM_TARGETS.get((batch, threads, peer))))
    small = {(r["hidden"], r["peer"]): r["median_ms"] for r in data["records"]
             if r["hidden"] < 256 and r["batch"] == 10 and r["threads"] == 1}
    for hidden in sorted({h for h, _ in small}):  # Cortex's regime, where per-node overhead dominates
        gen, node = small[(hidden, "generated")], small[(hidden, "torch-node")]
        rows.append(row(f"treelstm H{hidden}", "batch 10, 1 thr, vs PyTorch per-node", gen, node, "ms",
                        node / gen, SMALL_PER_NODE_TARGET))
    one, two = recs[(10, 1, "generated")]["median_ms"], recs[(10, 2, "generated")]["median_ms"]
    rows.append(row("treelstm H256", "batch 10, 2 thr vs deepgen 1 thr (scaling)", two, one, "ms", one / two,
                    SCALING_TARGET))
    return rows


def mlp_rows(data) -> list:
    return [
        row("mlp train step", f"batch {r['batch']}, {r['threads']} thr, vs PyTorch eager", r["generated_ms"],
            r["torch_ms"], "ms", r["torch_ms"] / r["generated_ms"], r["target"])
        for r in data["records"]
    ]


def gemm_rows(data) -> list:
    return [
        row("gemm", f"{r['label']} [{r['M']},{r['K']}]@[{r['K']},{r['N']}], {r['threads']} thr, vs numpy",
            r["generated_gflops"], r["numpy_gflops"], "GFLOP/s", r["generated_gflops"] / r["numpy_gflops"],
            r["target"])
        for r in data["records"]
    ]


def build_time_rows(data) -> list:
    rows = []
    for r in data["records"] + [dict(data["total"], example="total")]:
        rows.append(row("generate", r["example"], r["generate_api_s"], None, "s"))
        rows.append(row("build", f"{r['example']} (configure + compile, -j 2)", r["build_s"], None, "s"))
    return rows


def engines_rows(data) -> list:
    recs = {(r["model"], r["M"], r["threads"], r["engine"]): r for r in data["records"]}
    names = {"mlp": "mlp forward", "level": "treelstm level"}
    return [
        row(names[r["model"]], f"M {r['M']}, {r['threads']} thr, vs {r['engine']}",
            recs[(r["model"], r["M"], r["threads"], "deepgen")]["median_us"], r["median_us"], "us",
            r["ratio_to_deepgen"], 1.0)
        for r in data["records"]
        if r["engine"] != "deepgen"
    ]


def contention(data) -> float:
    """The most cores other processes (or the hypervisor) took while a benchmark measured."""
    env = data.get("environment", {})
    busy = list(env.get("contention_cores", []))
    busy += [max(c["other_cores"], c["steal_cores"]) for c in env.get("children", []) if c.get("other_cores") is not None]
    return max(busy, default=0.0)


ROWS = {
    "treelstm": treelstm_rows,
    "engines": engines_rows,
    "mlp": mlp_rows,
    "gemm": gemm_rows,
    "build_time": build_time_rows,
}


def fmt(value, unit) -> str:
    if value is None:
        return "-"
    return f"{value:.3f} {unit}" if value < 10 else f"{value:.1f} {unit}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE", help="write the rows, machine facts and every figure to FILE")
    parser.add_argument("--quick", action="store_true", help="each benchmark's quick mode (a few minutes)")
    parser.add_argument("--only", nargs="+", choices=list(BENCHMARKS), help="run these benchmarks only")
    args = parser.parse_args()

    names = args.only or list(BENCHMARKS)
    rows, raw, failed, seconds = [], {}, [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            out = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, str(HERE / f"{name}.py"), *BENCHMARKS[name], "--json", str(out)]
            cmd += ["--quick"] if args.quick else []
            print(f"\n=== {' '.join(Path(c).name if c.endswith('.py') else c for c in cmd[1:])}", flush=True)
            t0 = time.perf_counter()
            code = subprocess.run(cmd).returncode
            seconds[name] = round(time.perf_counter() - t0, 1)
            if code != 0 or not out.is_file():
                failed.append(name)
                print(f"=== {name} FAILED (exit {code})", flush=True)
                continue
            raw[name] = json.loads(out.read_text())
            rows += ROWS[name](raw[name])

    facts = machine_facts()
    for data in raw.values():  # what the generated modules and their builds report
        env = data.get("environment", {})
        for key in ("build_info", "compiler", "generated_threads", "generated_set_num_threads"):
            if env.get(key) is not None:
                facts.setdefault(key, env[key])

    print("\n" + "=" * 30 + " deepgen benchmarks " + "=" * 30)
    print(f"{facts['cpu']}, {facts['cores']} cores, ISA {' '.join(facts['cpu_isa']) or '?'}; python "
          f"{facts['python']}, numpy {facts['numpy']}, torch {facts['torch']}; git {facts['git']}")
    print(f"generated code: compiler {facts.get('compiler', '?')}; build_info {facts.get('build_info', 'n/a')}; "
          f"threads {facts.get('generated_threads', '?')}")
    print("ratio > 1: deepgen is better (peer time / deepgen time; deepgen GFLOP/s / numpy GFLOP/s)"
          + ("; QUICK mode: noisy figures" if args.quick else ""))
    widths = (14, max([len(r["config"]) for r in rows] + [13]), 14, 14, 7, 7, 3)
    head = " | ".join(f"{h:{w}s}" for h, w in zip(
        ("benchmark", "configuration", "deepgen", "peer", "ratio", "target", "met"), widths))
    print(head)
    print("-" * len(head))
    for r in rows:
        cells = (r["benchmark"], r["config"], fmt(r["deepgen"], r["unit"]), fmt(r["peer"], r["unit"]),
                 "-" if r["ratio"] is None else f"{r['ratio']:.2f}",
                 "-" if r["target"] is None else f">={r['target']:g}",
                 "-" if r["met"] is None else "yes" if r["met"] else "no")
        print(" | ".join(f"{c:>{w}s}" if i >= 2 else f"{c:{w}s}" for i, (c, w) in enumerate(zip(cells, widths))))
    judged = [r for r in rows if r["met"] is not None]
    print(f"targets met: {sum(r['met'] for r in judged)} of {len(judged)}; "
          f"time per benchmark (s): {', '.join(f'{k} {v}' for k, v in seconds.items())}")
    busy = {name: contention(data) for name, data in raw.items()}
    if any(b > BUSY_LIMIT for b in busy.values()):
        print("WARNING: other processes ran while measuring (cores taken: "
              + ", ".join(f"{k} {v:.2f}" for k, v in busy.items())
              + "); the figures are noisy, 2-thread ones most (a thread pool that loses a core stalls). "
              "Rerun on an idle machine.")
    if failed:
        print(f"FAILED: {', '.join(failed)} (see their output above)")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"machine": facts, "quick": args.quick, "rows": rows, "failed": failed, "seconds": seconds,
             "contention_cores": busy, "benchmarks": raw}, indent=1) + "\n")
        print(f"wrote {args.json}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
