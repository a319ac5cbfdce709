"""Benchmark: the generated module against the inference engines a deployer would
pick instead, ONNX Runtime and OpenVINO, in fp32.

    python benchmarks/engines.py [--json FILE] [--quick]

Models (both generated and built once, cached under build/bench/):

  mlp          the forward pass of examples/mlp.py, x[M, 784] -> 512 relu -> 256 relu
               -> 10 logits (module mlp_bench, shared with benchmarks/mlp.py)
  level cell   one level of the TreeLSTM of examples/treelstm.py at H = 256, as a DSL
               model of its own (treelstm_level_h256): gates = hcat[M, 512] @ u[512, 1280]
               + b, split into i, o, g, f_l, f_r, c = sigmoid(i) tanh(g) + sigmoid(f_l) c_l
               + sigmoid(f_r) c_r, h = sigmoid(o) tanh(c); inputs hcat (the two children's
               h side by side), c_l, c_r [M, 256]; outputs h and c

Peers (same weights: Model(seed=0)'s, with the biases set to seeded random values
through parameters() so that a misplaced bias cannot pass the check):

  deepgen       the generated module's forward(); threads set with set_num_threads(n)
  onnxruntime   an ONNX graph built with onnx.helper from the module's parameters
                (benchmarks/onnx_models.py: nn.Linear layers as Gemm with [out, in]
                weights, the level GEMM as MatMul + Add, as torch.onnx.export writes
                them), batch dimension symbolic; one InferenceSession, all graph
                optimizations, intra_op_num_threads = n, inter_op_num_threads = 1,
                sequential execution
  openvino      the same ONNX graph, reshaped to each M's static shape and compiled for
                the CPU with INFERENCE_PRECISION_HINT f32 (bf16 is its default on AMX
                machines), INFERENCE_NUM_THREADS n and PERFORMANCE_HINT LATENCY; one
                infer request, inputs shared with numpy, outputs copied (as deepgen
                returns fresh arrays)

The engines come from the optional extra (pip install -e .[bench]); an engine that is
not installed is skipped with a line saying so. Before timing, each child checks its
engine's outputs against the generated module's at every M (np.allclose, atol 1e-4).

Cells: M (batch rows) 1, 10, 64 and 256, threads 1 and 2. Each (thread count, engine)
runs in a child process of its own, with OMP/OPENBLAS/MKL_NUM_THREADS set before
anything is imported, so that one engine's spinning thread pool cannot slow another's.
Timings are medians of single calls (time.perf_counter) after a warm-up, pooled over
3 rounds (1 with --quick) with the engines' order reversed every other round. The
table gives microseconds per call and ratio = engine time / deepgen time (> 1:
deepgen is faster); the issue's target is >= 1.0 in every cell.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import tempfile
import time
from pathlib import Path

from _common import BUSY_LIMIT, build_module, import_module, machine_facts, measure, quiet_blas, run_rounds, set_threads

MS = (1, 10, 64, 256)
THREADS = (1, 2)
HIDDEN = 256
ENGINES = ("deepgen", "onnxruntime", "openvino")
ENGINE_PACKAGES = {"onnxruntime": ("onnx", "onnxruntime"), "openvino": ("onnx", "openvino")}
SHORT = {"deepgen": "deepgen", "onnxruntime": "ort", "openvino": "ov"}
ATOL = 1e-4
TARGET = 1.0


# ----------------------------------------------------------------------------
# Models (DSL)
# ----------------------------------------------------------------------------


def mlp_model():
    from mlp import mlp_model as example_mlp

    return example_mlp()


def level_cell_model(hidden: int = HIDDEN):
    """The internal-node cell of examples/treelstm.py on one level's rows, as a model."""
    import generator as dg

    @dg.model(name=f"treelstm_level_h{hidden}")
    def level_cell():
        m = dg.dim("M")
        hcat = dg.input("hcat", (m, 2 * hidden))  # concat([h_l, h_r], axis=1)
        c_l = dg.input("c_l", (m, hidden))
        c_r = dg.input("c_r", (m, hidden))
        u = dg.param("u", (2 * hidden, 5 * hidden))
        b = dg.param("b", (5 * hidden,), init=dg.zeros())
        gates = hcat @ u + b
        i, o, g, f_l, f_r = dg.split(gates, 5, axis=1)
        c = dg.sigmoid(i) * dg.tanh(g) + dg.sigmoid(f_l) * c_l + dg.sigmoid(f_r) * c_r
        h = dg.sigmoid(o) * dg.tanh(c)
        return {"h": h, "c": c}

    return level_cell


# The benchmark's models: label -> (module name, output names)
MODELS = {"mlp": ("mlp_bench", ("logits",)), "level": (f"treelstm_level_h{HIDDEN}", ("h", "c"))}


def make_inputs(label: str, m: int) -> dict:
    """Seeded inputs of model `label` at M rows (the same in every child)."""
    import numpy as np

    rng = np.random.default_rng(100 + m + (0 if label == "mlp" else 1000))
    if label == "mlp":
        return {"x": rng.random((m, 784), dtype=np.float32)}  # pixels in [0, 1)
    return {
        "hcat": rng.uniform(-1, 1, (m, 2 * HIDDEN)).astype(np.float32),  # h = o * tanh(c) is in (-1, 1)
        "c_l": rng.standard_normal((m, HIDDEN), dtype=np.float32),
        "c_r": rng.standard_normal((m, HIDDEN), dtype=np.float32),
    }


def seeded_model(module):
    """Model(seed=0) with every bias (a 1-D parameter) set to seeded values in
    N(0, 0.1) through parameters()' writable views, before any call."""
    import numpy as np

    model = module.Model(seed=0)
    rng = np.random.default_rng(5)
    for name, array in sorted(model.parameters().items()):
        if array.ndim == 1:
            array[...] = rng.normal(0.0, 0.1, array.shape).astype(np.float32)
    return model


def onnx_graph(label: str, params: dict) -> bytes:
    from onnx_models import level_cell_graph, mlp_graph

    return mlp_graph(params) if label == "mlp" else level_cell_graph(params, HIDDEN)


def installed(engine: str) -> list:
    """The packages `engine` needs that are missing."""
    return [p for p in ENGINE_PACKAGES.get(engine, ()) if importlib.util.find_spec(p) is None]


# ----------------------------------------------------------------------------
# Engines: each gives, per model and M, call(feeds) (what is timed) and
# named(result) -> {output name: array} (for the check)
# ----------------------------------------------------------------------------


def deepgen_engine(model, outputs, threads):
    def prepare(label, graph, m):
        return (lambda feeds: model.forward(**feeds)), lambda result: {k: result[k] for k in outputs}

    return prepare, {}


def onnxruntime_engine(model, outputs, threads):
    import onnxruntime as ort

    sessions = {}

    def prepare(label, graph, m):
        if label not in sessions:
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = threads
            opts.inter_op_num_threads = 1
            opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            sessions[label] = ort.InferenceSession(graph, opts, providers=["CPUExecutionProvider"])
        session = sessions[label]
        names = [o.name for o in session.get_outputs()]
        return (lambda feeds: session.run(None, feeds)), (lambda result: dict(zip(names, result)))

    return prepare, {"onnxruntime": ort.__version__}


def openvino_engine(model, outputs, threads):
    import openvino as ov

    core = ov.Core()
    config = {
        "INFERENCE_PRECISION_HINT": "f32",
        "INFERENCE_NUM_THREADS": threads,
        "PERFORMANCE_HINT": "LATENCY",
    }
    info = {"openvino": ov.__version__, "compiled": {}}

    def prepare(label, graph, m):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"{label}.onnx"
            path.write_bytes(graph)
            net = core.read_model(str(path))
        # static shapes at this M: the engine's best case (a dynamic M costs it more)
        net.reshape(
            {
                p.get_any_name(): [m] + [d.get_length() for d in list(p.get_partial_shape())[1:]]
                for p in net.inputs
            }
        )
        compiled = core.compile_model(net, "CPU", config)
        if not info["compiled"]:  # what the plugin made of the settings
            info["compiled"].update(
                (key, _text(compiled.get_property(key)))
                for key in (
                    "INFERENCE_PRECISION_HINT",
                    "INFERENCE_NUM_THREADS",
                    "PERFORMANCE_HINT",
                    "NUM_STREAMS",
                )
            )
        request = compiled.create_infer_request()
        ports = [(o, o.get_any_name()) for o in compiled.outputs]

        def call(feeds):
            return request.infer(feeds, share_inputs=True)

        return call, (lambda result: {name: result[port] for port, name in ports})

    return prepare, info


def _text(value) -> str:
    """An OpenVINO property as text (an element type as its short name: f32)."""
    return value.to_string() if hasattr(value, "to_string") else str(value)


ENGINE_FACTORIES = {"deepgen": deepgen_engine, "onnxruntime": onnxruntime_engine, "openvino": openvino_engine}


# ----------------------------------------------------------------------------
# Child: one (thread count, engine)
# ----------------------------------------------------------------------------


def child(config: dict) -> None:
    import numpy as np

    threads, engine = config["threads"], config["engine"]
    out = {"threads": threads, "engine": engine, "round": config["round"], "records": [], "max_abs_diff": 0.0}
    if engine == "deepgen":
        quiet_blas()  # numpy only checks outputs here (see _common.quiet_blas)
    for label, (name, outputs) in MODELS.items():
        info = config["modules"][name]
        module = import_module(info["name"], info["build"])
        # deepgen is the reference in every child; outside its own it runs on 1 thread (no pool)
        out["deepgen_threads"] = set_threads(module, threads if engine == "deepgen" else 1)
        model = seeded_model(module)
        params = {k: np.array(v, copy=True) for k, v in model.parameters().items()}
        graph = onnx_graph(label, params) if engine != "deepgen" else None
        prepare, facts = ENGINE_FACTORIES[engine](model, outputs, threads)
        out.update(facts)
        for m in MS:
            feeds = make_inputs(label, m)
            want = {k: np.array(v, copy=True) for k, v in model.forward(**feeds).items()}
            call, named = prepare(label, graph, m)
            got = named(call(feeds))
            for key in outputs:
                a = np.asarray(got[key])
                if a.shape != want[key].shape or not np.allclose(a, want[key], atol=ATOL):
                    diff = (
                        float(np.max(np.abs(a - want[key]))) if a.shape == want[key].shape else float("nan")
                    )
                    raise SystemExit(
                        f"{engine} differs from the generated module ({label}, M {m}, output {key}, shape "
                        f"{a.shape} vs {want[key].shape}): max |diff| {diff:.3g}; refusing to time different "
                        "functions"
                    )
                out["max_abs_diff"] = max(out["max_abs_diff"], float(np.max(np.abs(a - want[key]))))
            t = measure(lambda: call(feeds), config["target_s"], config["min_reps"])
            us = [1e6 * s for s in t["times"]]
            out["records"].append({"model": label, "M": m, "times_us": us, "cpu_per_wall": t["cpu_per_wall"]})
            print(
                f"  [round {config['round'] + 1}, {threads} thr] {label:5s} M {m:3d} {engine:11s} "
                f"{statistics.median(us):9.1f} us ({len(us)} calls, cpu/wall {t['cpu_per_wall']:.2f})",
                flush=True,
            )
    Path(config["out"]).write_text(json.dumps(out))


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE", help="write every figure to FILE as JSON")
    parser.add_argument("--quick", action="store_true", help="one round, fewer calls (about a minute)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        config = json.loads(args.child)
        child(dict(config, engine=config["peer"]))
        return

    engines = []
    for engine in ENGINES:
        missing = installed(engine)
        if missing:
            print(f"skipping {engine}: {', '.join(missing)} not installed (pip install -e .[bench])")
        else:
            engines.append(engine)

    print("Building the generated modules (cached under build/bench/):", flush=True)
    modules = {}
    for model_def, name in ((mlp_model(), "mlp_bench"), (level_cell_model(), None)):
        info = build_module(model_def, name=name)
        modules[info["name"]] = info
    facts = machine_facts(build=modules["mlp_bench"]["build"])
    isa = "AVX-512" if "avx512f" in facts["cpu_isa"] else "AVX2" if "avx2" in facts["cpu_isa"] else "no AVX2"
    print(
        f"Machine: {facts['cpu']}, {facts['cores']} cores, {isa} ({' '.join(facts['cpu_isa'])}); "
        f"git {facts['git']}; compiler: {facts.get('compiler') or '?'}"
    )

    rounds = 1 if args.quick else 3
    config = {"modules": modules, "target_s": 0.1, "min_reps": 10}  # per cell and round
    t0 = time.perf_counter()
    results = run_rounds(__file__, config, rounds, THREADS, engines, "engines")
    elapsed = time.perf_counter() - t0

    pooled, by_round, cpu = {}, {}, {}
    for res in results:
        for r in res["records"]:
            key = (r["model"], r["M"], res["threads"], res["engine"])
            pooled.setdefault(key, []).extend(r["times_us"])
            by_round.setdefault(key, {})[res["round"]] = statistics.median(r["times_us"])
            cpu[key] = min(cpu.get(key, float("inf")), r["cpu_per_wall"])
    records = []
    for (label, m, threads, engine), times in sorted(pooled.items()):
        base = statistics.median(pooled[(label, m, threads, "deepgen")])
        median = statistics.median(times)
        records.append(
            {
                "model": label,
                "M": m,
                "threads": threads,
                "engine": engine,
                "median_us": round(median, 2),
                "min_us": round(min(times), 2),
                "calls": len(times),
                "cpu_per_wall": round(cpu[(label, m, threads, engine)], 3),
                "ratio_to_deepgen": round(median / base, 3),
                "ratio_by_round": [
                    round(
                        by_round[(label, m, threads, engine)][k]
                        / by_round[(label, m, threads, "deepgen")][k],
                        3,
                    )
                    for k in sorted(by_round[(label, m, threads, engine)])
                ],
            }
        )

    versions = {}
    for res in results:
        versions.update({k: res[k] for k in ("onnxruntime", "openvino", "compiled") if k in res})
    diff = max(r["max_abs_diff"] for r in results)
    others = [e for e in engines if e != "deepgen"]
    if others:
        print(
            f"\nEvery engine's outputs matched the generated module's at every M before timing "
            f"(np.allclose, atol {ATOL:g}; largest |difference| {diff:.1e})."
        )
    print(
        f"Engines: onnxruntime {versions.get('onnxruntime', 'not installed')}, openvino "
        f"{versions.get('openvino', 'not installed')}"
        + (f" (compiled with {versions['compiled']})" if versions.get("compiled") else "")
    )
    print(
        f"Median microseconds per call; ratio = engine / deepgen (> 1: deepgen is faster; "
        f"target >= {TARGET:g}). {isa}, {rounds} round(s), measured in {elapsed:.0f} s."
    )
    idx = {(r["model"], r["M"], r["threads"], r["engine"]): r for r in records}
    head = (
        f"{'model':>5} {'M':>4} {'thr':>3} | "
        + " ".join(f"{e:>11}" for e in engines)
        + (" | " + " ".join(f"{SHORT[e] + '/dg':>7}" for e in others) if others else "")
    )
    print(head)
    print("-" * len(head))
    for label in MODELS:
        for m in MS:
            for threads in THREADS:
                row = [idx[(label, m, threads, e)] for e in engines]
                print(
                    f"{label:>5} {m:>4} {threads:>3} | "
                    + " ".join(f"{r['median_us']:11.1f}" for r in row)
                    + (" | " + " ".join(f"{r['ratio_to_deepgen']:7.2f}" for r in row[1:]) if others else "")
                )
    for engine in others:
        rows = [r for r in records if r["engine"] == engine]
        misses = [r for r in rows if r["ratio_to_deepgen"] < TARGET]
        print(
            f"vs {engine}: {len(rows) - len(misses)} of {len(rows)} cells at >= {TARGET:g}x"
            + (
                f"; below: "
                + ", ".join(
                    f"{r['model']} M{r['M']} {r['threads']}thr {r['ratio_to_deepgen']:.2f}" for r in misses
                )
                if misses
                else ""
            )
        )
    preempted = [r for r in records if r["threads"] == 1 and r["cpu_per_wall"] < 0.9]
    if preempted:
        print(
            "NOTE: preempted while measuring (1 thread, CPU time < 0.9 x wall time): "
            + ", ".join(f"{r['model']} M{r['M']} {r['engine']} ({r['cpu_per_wall']:.2f})" for r in preempted)
        )
    busy = [max(r["other_cores"], r["steal_cores"]) for r in results if r.get("other_cores") is not None]
    if any(b > BUSY_LIMIT for b in busy):
        print(
            f"WARNING: other processes took up to {max(busy):.2f} cores while measuring; the figures are "
            "noisy (2-thread ones most). Rerun on an idle machine."
        )
    if args.json:
        env = {
            **facts,
            "isa": isa,
            **{k: v for k, v in versions.items()},
            "engines": engines,
            "rounds": rounds,
            "quick": args.quick,
            "atol": ATOL,
            "max_abs_diff": diff,
            "measure_seconds": round(elapsed, 1),
            "children": [
                {
                    k: r.get(k)
                    for k in ("round", "threads", "engine", "deepgen_threads", "other_cores", "steal_cores")
                }
                for r in results
            ],
        }
        Path(args.json).write_text(
            json.dumps({"environment": env, "modules": modules, "records": records}, indent=1) + "\n"
        )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
