"""What the benchmarks share: cached builds of generated modules, thread settings,
child processes, timing, and facts about the machine.

Each benchmark is a script (python benchmarks/X.py); this file sits next to them,
so `from _common import ...` finds it both in the script and in its children.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "build" / "bench"
PEAK_N = 2048  # numpy's 2048^3 sgemm: the machine's peak that generated code is held against
BUSY_LIMIT = 0.1  # cores taken by other processes (or the hypervisor) while measuring: warn above
THREAD_VARS = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# ----------------------------------------------------------------------------
# Builds
# ----------------------------------------------------------------------------


def build_module(model_def, name: str | None = None, cache: Path = CACHE, precision: str = "fp32",
                 **options) -> dict:
    """Generate into <cache>/<name>/src and build into <cache>/<name>/build (plain CMake,
    Release); a build whose generated sources (and Python) are unchanged is reused.
    `options` go to the model function (train=True); `precision` as `deepgen generate
    --precision` (bf16, int8: the inference part)."""
    from generator.tools.build import build_if_changed
    from generator.codegen.writer import MANIFEST
    from generator.pipeline import generate
    from generator.transforms.precision import set_precision

    graph = model_def.build(name=name, **options)
    if precision != "fp32":
        set_precision(graph, precision)
    folder = cache / graph.name
    src, build = folder / "src", folder / "build"
    t0 = time.perf_counter()
    generate(graph, src, force=True)  # unchanged files keep their mtimes: incremental rebuilds
    key = json.dumps(
        {
            "files": json.loads((src / MANIFEST).read_text())["files"],
            "python": sys.executable,
            "version": sys.version,
        },
        sort_keys=True,
    )
    reused = build_if_changed(src, build, graph.name, key, jobs=os.cpu_count() or 2)
    seconds = time.perf_counter() - t0
    texts = [
        p.read_text()
        for p in [*(src / "src").glob("*.cpp"), *(src / "runtime").glob("*.h"), src / "CMakeLists.txt"]
    ]
    openmp = any(re.search(r"#\s*pragma\s+omp|OpenMP|fopenmp", t) for t in texts)
    print(f"  {graph.name}: {'reused' if reused else 'built'} in {seconds:.1f} s ({build})", flush=True)
    return {
        "name": graph.name,
        "build": str(build),
        "reused": reused,
        "seconds": round(seconds, 2),
        "openmp": openmp,
        "compiler": compiler_flags(build),
    }


def gemm_model(k: int, n: int):
    """y[M, N] = x[M, K] @ w[K, N], M symbolic: a layer's GEMM (the TreeLSTM's level
    GEMM, an MLP layer) on its own, as module gemm_k<K>_n<N>."""
    import generator as dg

    @dg.model(name=f"gemm_k{k}_n{n}")
    def gemm():
        m = dg.dim("M")
        x = dg.input("x", (m, k))
        w = dg.param("w", (k, n))
        y = x @ w
        return {"y": y}

    return gemm


def compiler_flags(build) -> str:
    """The C++ compiler and its Release flags, from a CMake build folder's cache."""
    cache, found = Path(build) / "CMakeCache.txt", []
    if cache.is_file():
        for line in cache.read_text().splitlines():
            if line.startswith(("CMAKE_CXX_COMPILER:", "CMAKE_CXX_FLAGS:", "CMAKE_CXX_FLAGS_RELEASE:")):
                found.append(line.split("=", 1)[1])
    return " ".join(c for c in found if c)


def import_module(name: str, build: str):
    """Import the generated module `name` from the folder `build` (and from nowhere else)."""
    sys.path.insert(0, build)
    try:
        module = importlib.import_module(name)
    finally:
        sys.path.remove(build)
    if not str(Path(module.__file__).resolve()).startswith(str(Path(build).resolve())):
        raise SystemExit(f"imported {name} from {module.__file__}, not from {build}")
    return module


def set_threads(module, threads: int):
    """The generated module's thread count via its set_num_threads(n), when it has one;
    returns the count it reports, or 'default' when it cannot be set."""
    setter, getter = getattr(module, "set_num_threads", None), getattr(module, "get_num_threads", None)
    if setter is None:
        return "default"
    setter(threads)
    return getter() if getter is not None else threads


def installed(*packages) -> bool:
    """Whether every one of `packages` can be imported here (found, not imported)."""
    return all(importlib.util.find_spec(p) is not None for p in packages)


_TV_SCHEMAS = None  # the torch.library.Library that holds the torchvision::nms / qnms schemas we defined


def import_torchvision():
    """torchvision, or None when it is not installed. Beside a CPU-only torch its C++
    extension does not load, yet torchvision registers fake (meta) kernels for the ops
    `torchvision::nms` and `qnms` while it is imported, which fails unless their schemas
    exist: they are defined here first (once per process; the real extension, when it
    loaded, already has them). transformers imports torchvision too: call this before
    importing transformers."""
    global _TV_SCHEMAS
    if importlib.util.find_spec("torchvision") is None:
        return None
    if "torchvision" not in sys.modules and _TV_SCHEMAS is None:
        import torch

        try:
            torch.ops.torchvision.nms.default
        except (AttributeError, RuntimeError):  # no schema yet: define both
            _TV_SCHEMAS = torch.library.Library("torchvision", "DEF")
            for op in ("nms", "qnms"):
                _TV_SCHEMAS.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    import torchvision

    return torchvision


def openvino_compiled(path, names, batch: int, precision: str = "f32", threads: int | None = None):
    """OpenVINO's CPU plugin on the model file `path` (ONNX or IR) reshaped to batch `batch`
    (static shapes: its best case), with INFERENCE_PRECISION_HINT `precision` ("f32" forces
    float32: on an AMX or avx512_bf16 CPU the plugin's default is bf16), PERFORMANCE_HINT
    LATENCY and NUM_STREAMS 1, INFERENCE_NUM_THREADS `threads` (None: the plugin's default).
    Returns (call(feeds), output(result) as numpy): one infer request fed the inputs `names`
    of `feeds`, and the first output of what it returned."""
    import numpy as np
    import openvino as ov

    core = ov.Core()
    config = {"INFERENCE_PRECISION_HINT": precision, "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1}
    if threads is not None:
        config["INFERENCE_NUM_THREADS"] = threads
    net = core.read_model(str(path))
    net.reshape({p.get_any_name(): [batch] + [d.get_length() for d in list(p.get_partial_shape())[1:]]
                 for p in net.inputs})
    compiled = core.compile_model(net, "CPU", config)
    request, port = compiled.create_infer_request(), compiled.outputs[0]
    call = lambda feeds: request.infer({k: feeds[k] for k in names}, share_inputs=True)  # noqa: E731
    return call, lambda result: np.array(result[port])


# ----------------------------------------------------------------------------
# Child processes and timing
# ----------------------------------------------------------------------------


def thread_env(threads: int) -> dict:
    """This process's environment with every BLAS/OpenMP thread variable set to `threads`
    (they must be set before numpy or torch is imported) and the repository importable."""
    env = dict(os.environ)
    env.update({var: str(threads) for var in THREAD_VARS})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def run_child(script, config: dict, threads: int, label: str) -> dict:
    """Run `python script --child CONFIG` with `threads` threads; the child writes its
    result as JSON to config["out"]. Adds the contention seen while it ran: CPU time the
    machine spent outside the child, and time the hypervisor took (steal), in cores."""
    before, t0 = cpu_accounting(), time.perf_counter()
    proc = subprocess.run([sys.executable, str(script), "--child", json.dumps(config)], env=thread_env(threads))
    after, wall = cpu_accounting(), time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"the {label} measurement with {threads} thread(s) failed (exit {proc.returncode})")
    result = json.loads(Path(config["out"]).read_text())
    result["other_cores"] = result["steal_cores"] = None
    if before and after:
        result["other_cores"] = round(
            max(0.0, (after["busy"] - before["busy"]) - (after["child"] - before["child"])) / wall, 3
        )
        result["steal_cores"] = round((after["steal"] - before["steal"]) / wall, 3)
        if result["other_cores"] > BUSY_LIMIT or result["steal_cores"] > BUSY_LIMIT:
            print(
                f"  WARNING: while measuring {label}, other processes used {result['other_cores']:.2f} cores "
                f"and the hypervisor took {result['steal_cores']:.2f}: these figures are noisy",
                flush=True,
            )
    return result


def run_rounds(script, config: dict, rounds: int, threads_list, peers, label: str) -> list:
    """Every (round, thread count, peer) measurement, each in a child of its own
    (run_child), peers in alternating order from round to round so that drift
    affects them alike; returns the children's results."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(rounds):
            for threads in threads_list:
                for peer in peers if rnd % 2 == 0 else peers[::-1]:
                    out = str(Path(tmp) / f"r{rnd}-t{threads}-{peer}.json")
                    cfg = dict(config, threads=threads, peer=peer, round=rnd, out=out)
                    results.append(run_child(Path(script).resolve(), cfg, threads, f"{label} {peer}"))
    return results


def measure(fn, target_s: float, min_reps: int) -> dict:
    """Seconds of each of repeated fn() runs after a warm-up, with enough repetitions
    for ~target_s; also the process's CPU time per wall second (below 1 for a
    single-threaded peer means it was preempted: another process wanted the cores)."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = time.perf_counter() - t0
    reps = max(min_reps, min(10000, math.ceil(target_s / max(once, 1e-7))))
    times = []
    cpu0 = time.process_time()
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"times": times, "cpu_per_wall": (time.process_time() - cpu0) / max(sum(times), 1e-9)}


def sgemm_peak_gflops(target_s: float) -> float:
    """numpy's float32 GFLOP/s on a large square product (2048^3): the machine's
    sgemm throughput at this child's thread count, the yardstick of "% of peak"."""
    import numpy as np

    a = np.random.default_rng(0).standard_normal((PEAK_N, PEAK_N), dtype=np.float32)
    a @ a  # warm up the pool and the caches
    t = measure(lambda: a @ a, target_s, 3)
    return 2.0 * PEAK_N**3 / min(t["times"]) / 1e9


def cpu_accounting():
    """CPU seconds so far: the machine's busy time without steal (/proc/stat), the steal
    time, and our finished children's time (getrusage); None where /proc/stat is missing."""
    import resource

    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    steal = fields[7] if len(fields) > 7 else 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "busy": (sum(fields[:8]) - idle - steal) / tick,
        "steal": steal / tick,
        "child": usage.ru_utime + usage.ru_stime,
    }


# ----------------------------------------------------------------------------
# The machine
# ----------------------------------------------------------------------------


def git_state():
    """The commit the generator came from, with '+dirty' for uncommitted changes; None outside git."""
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--", "generator", "templates", "targets"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_isa() -> list:
    """The vector extensions the CPU reports (Linux), of those a compiler targets."""
    wanted = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
              "amx_tile", "amx_bf16", "amx_int8")
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                have = set(line.split(":", 1)[1].split())
                return [f for f in wanted if f in have] or sorted(have)[:20]
    except OSError:
        pass
    return []


def machine_facts(module=None, build=None) -> dict:
    """Versions, CPU, cores, and the generated module's build facts (its build_info()
    when it has one; else the compiler flags from its CMake cache)."""
    import numpy as np

    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    facts = {
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "torch": torch_version,
        "machine": platform.machine(),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "cpu_isa": cpu_isa(),
        "git": git_state(),
    }
    info = getattr(module, "build_info", None) if module is not None else None
    if info is not None:
        info = info() if callable(info) else info
        facts["build_info"] = dict(info) if hasattr(info, "keys") else str(info)
    if build is not None:
        facts["compiler"] = compiler_flags(build)
    return facts


def quiet_blas() -> None:
    """In the generated module's child, numpy (only the oracle of the check there)
    gets one BLAS thread: a BLAS pool's threads spin for a while after each call,
    and on two cores they keep the generated GEMM's second OpenMP thread off the
    CPU (seen: 8 ms per [1, 512] @ [512, 1280] product instead of 0.035; an MLP
    train step at 2 threads slower than at 1, 1.9 ms instead of 0.94, with numpy
    imported and no BLAS call made). Every generated peer's child calls it.
    threadpoolctl limits the pool when it is installed."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return
    threadpool_limits(limits=1, user_api="blas")


def machine_line(machine: dict) -> str:
    """`Machine: <cpu> (<arch>, <n> cores; ISA ...); torch ..., numpy ..., git ...` from machine_facts()."""
    return (f"Machine: {machine['cpu']} ({machine['machine']}, {machine['cores']} cores; ISA "
            f"{' '.join(machine['cpu_isa'])}); torch {machine['torch']}, numpy {machine['numpy']}, git {machine['git']}")


def pooled_rows(results: list, fields=("batch",)):
    """The children's rows pooled over rounds, keyed (row[f] for f in fields..., threads, peer):
    (every time in ms, each round's cpu/wall, their medians), and the last row per (row[f]..., peer)."""
    pooled, cpu, facts = {}, {}, {}
    for res in results:
        for r in res["rows"]:
            at = tuple(r[f] for f in fields)
            key = at + (res["threads"], res["peer"])
            pooled.setdefault(key, []).extend(r["times_ms"])
            cpu.setdefault(key, []).append(r.get("cpu_per_wall", 0.0))
            facts[at + (res["peer"],)] = r
    medians = {k: statistics.median(v) for k, v in pooled.items()}
    return pooled, cpu, medians, facts


# A 2-thread cell whose median is over twice the same peer's 1-thread one: its threads waited for a core.
WAITED_NOTE = ("* the peer's 2-thread median is over twice its 1-thread one: its threads waited for cores (another "
               "process held one), not a property of the peer; such a cell's ratios say little")


def waited_marks(median_at, threads: int, peers) -> dict:
    """peer -> "*" where its `threads` median (median_at(threads, peer)) is over twice its 1-thread one, else " "."""
    return {p: "*" if threads > 1 and median_at(threads, p) > 2 * median_at(1, p) else " " for p in peers}


def peer_records(size: int, threads: int, peers, pooled: dict, cpu: dict, medians: dict, dg_ms: float) -> list:
    """The --json records of one (batch, threads) cell, a record per peer (keys as pooled_rows())."""
    out = []
    for peer in peers:
        key = (size, threads, peer)
        out.append({"batch": size, "threads": threads, "peer": peer, "median_ms": round(medians[key], 4),
                    "min_ms": round(min(pooled[key]), 4), "reps": len(pooled[key]),
                    "cpu_per_wall": round(statistics.mean(cpu[key]), 3),
                    "ratio_vs_deepgen": round(medians[key] / dg_ms, 3)})
    return out


def time_batches(fn, batches: list, config: dict, *args) -> tuple:
    """fn(batch, *args) over every batch of the set, timed as a set (measure()): each
    repetition's ms per batch, and the cpu/wall ratio."""

    def run_set():
        for batch in batches:
            fn(batch, *args)

    t = measure(run_set, config["target_s"], config["min_reps"])
    return [1000 * s / len(batches) for s in t["times"]], t["cpu_per_wall"]
