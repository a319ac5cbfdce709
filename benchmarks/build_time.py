"""Benchmark: how long each example takes to generate and to build.

    python benchmarks/build_time.py [--json FILE] [--quick] [--examples mlp treelstm ...]

For every examples/*.py (--quick: mlp and treelstm only), in a temporary folder:

  generate (API)  generator.frontend.loader.load_model + ModelDef.build + pipeline.generate
                  in this process (after one untimed generation, so that one-time
                  imports are not charged to the first example)
  generate (CLI)  `deepgen generate FILE -o DIR` in a fresh Python, as a user runs it
                  (interpreter start-up and imports included)
  configure       a fresh `cmake -S DIR -B BUILD -DCMAKE_BUILD_TYPE=Release` (Ninja
                  when available; this Python for the module)
  compile         `cmake --build BUILD --target <module> -j 2`: the model library and
                  the Python module (not the example program)

in seconds, per example and in total. No peer: these are deepgen's own costs.
Nothing is written into the repository.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, compiler_flags, machine_facts

QUICK = ("mlp", "treelstm")
JOBS = 2


def timed(cmd, what: str) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed: {' '.join(map(str, cmd))}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return seconds


def generate_api(path: Path, out: Path) -> tuple[float, str]:
    from generator.pipeline import generate
    from generator.frontend.loader import load_model

    t0 = time.perf_counter()
    graph = load_model(str(path)).build()
    generate(graph, out, force=True)
    return time.perf_counter() - t0, graph.name


def measure_example(path: Path, tmp: Path) -> dict:
    api_seconds, name = generate_api(path, tmp / "api")
    src = tmp / "cli"
    cli = [sys.executable, "-m", "generator.tools.cli", "generate", str(path), "-o", str(src)]
    cli_seconds = timed(cli, f"deepgen generate {path.name}")
    build = tmp / "build"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = timed(["cmake", "-S", str(src), "-B", str(build), *gen, "-DCMAKE_BUILD_TYPE=Release",
                       f"-DPython_EXECUTABLE={sys.executable}"], f"cmake configure of {name}")
    compile_ = timed(["cmake", "--build", str(build), "--target", name, "--parallel", str(JOBS)],
                     f"cmake build of {name}")
    if not list(build.glob(f"{name}*.so")) + list(build.glob(f"{name}*.pyd")):
        raise SystemExit(f"the build of {name} produced no Python module in {build}")
    lines = sum(len(p.read_text().splitlines()) for p in (src / "src").glob("*.cpp"))
    return {
        "example": path.stem,
        "module": name,
        "generate_api_s": round(api_seconds, 3),
        "generate_cli_s": round(cli_seconds, 3),
        "configure_s": round(configure, 3),
        "compile_s": round(compile_, 3),
        "build_s": round(configure + compile_, 3),
        "generated_cpp_lines": lines,
        "compiler": compiler_flags(build),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE", help="write every figure to FILE as JSON")
    parser.add_argument("--quick", action="store_true", help=f"only {' and '.join(QUICK)}")
    parser.add_argument("--examples", nargs="+", metavar="NAME", help="these examples only (file stems)")
    args = parser.parse_args()
    every = sorted(p.stem for p in (ROOT / "examples").glob("*.py"))
    names = args.examples or (list(QUICK) if args.quick else every)
    unknown = sorted(set(names) - set(every))
    if unknown:
        raise SystemExit(f"no such example(s): {', '.join(unknown)}; examples: {', '.join(every)}")

    records = []
    with tempfile.TemporaryDirectory(prefix="deepgen-build-time-") as tmp:
        generate_api(ROOT / "examples" / f"{names[0]}.py", Path(tmp) / "warm-up")  # imports, template loading
        for name in names:
            folder = Path(tmp) / name
            folder.mkdir()
            r = measure_example(ROOT / "examples" / f"{name}.py", folder)
            records.append(r)
            print(f"  {name:18s} generate {r['generate_api_s']:6.2f} s (CLI {r['generate_cli_s']:5.2f} s), "
                  f"configure {r['configure_s']:5.2f} s, compile {r['compile_s']:6.2f} s", flush=True)
            shutil.rmtree(folder)

    print(f"\nGeneration and build time per example, seconds (Release, -j {JOBS}, fresh build folders)")
    head = (f"{'example':18s} | {'generate':>8} {'gen CLI':>7} | {'configure':>9} {'compile':>8} {'build':>7} | "
            f"{'C++ lines':>9}")
    print(head)
    print("-" * len(head))
    for r in records:
        print(f"{r['example']:18s} | {r['generate_api_s']:8.2f} {r['generate_cli_s']:7.2f} | {r['configure_s']:9.2f} "
              f"{r['compile_s']:8.2f} {r['build_s']:7.2f} | {r['generated_cpp_lines']:9d}")
    keys = ("generate_api_s", "generate_cli_s", "configure_s", "compile_s", "build_s")
    total = {k: round(sum(r[k] for r in records), 3) for k in keys}
    print("-" * len(head))
    print(f"{'total':18s} | {total['generate_api_s']:8.2f} {total['generate_cli_s']:7.2f} | "
          f"{total['configure_s']:9.2f} {total['compile_s']:8.2f} {total['build_s']:7.2f} |")
    if records:
        print(f"compiler: {records[0]['compiler']}")
    if args.json:
        env = dict(machine_facts(), quick=args.quick, jobs=JOBS)
        Path(args.json).write_text(json.dumps({"environment": env, "records": records, "total": total},
                                              indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
