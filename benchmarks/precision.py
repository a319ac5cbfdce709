"""Benchmark: reduced precision (issue #41): accuracy and speed of bf16 and int8 against fp32.

    python benchmarks/precision.py [--quick] [--accuracy-only | --speed-only] [--json FILE]

Accuracy (in this process; benchmarks/precision_accuracy.py says how each model is trained
and on what): the digits MLP, LeNet on the digits, the LSTM classifier, the TreeLSTM
sentiment example and torchvision's ResNet-18 (imported, random initialization: top-1
agreement only), each trained in fp32, then generated and built three times: fp32,
`--precision bf16`, `--precision int8` (scales by `deepgen quantize` on the training
inputs, max-abs). The table gives each one's held-out accuracy, its relative change
against fp32 (target: within 1%) and its top-1 agreement with fp32. Needs scikit-learn
(the digits); torch and torchvision for the ResNet-18 row.

Speed: examples/mlp.py (784 -> 512 relu -> 256 relu -> 10) forward() at batch 1 and 64,
one thread, fp32 / bf16 / int8 generated modules (int8 scales from 256 uniform random
images), and ONNX Runtime on the same weights in fp32 and in int8 (`quantize_dynamic`,
weights int8 per channel) when torch, onnx and onnxruntime are installed. Each (peer,
round) runs in a child process of its own; medians pooled over rounds (3, 1 with
--quick), peers in alternating order. Ratio = fp32 median / peer median (> 1: faster than
our fp32). The issue sets no speed target on an AVX2-only core. The int8 kernel is the
one the module was compiled for (AMX tiles, AVX-512 VNNI, AVX2...: printed, from
build_info()["int8_kernel"]; the bf16 one is build_info()["bf16_kernel"]); DG_AMX=0 in
the environment turns the tiles off.
"""

from __future__ import annotations

import argparse
import json
import runpy
import statistics
import tempfile
from pathlib import Path

from _common import ROOT, build_module, import_module, machine_facts, measure, quiet_blas, run_rounds, set_threads
from precision_accuracy import accuracy_table, quantize_weights

PRECISIONS = ("fp32", "bf16", "int8")
BATCHES = (1, 64)
ORT = ("ort_fp32", "ort_int8")


def _ort_session(module, int8: bool, folder: Path):
    """The MLP as a torch module with the generated fp32 model's weights, exported to
    ONNX (and quantized dynamically for int8), as an ONNX Runtime session on one thread."""
    import numpy as np
    import onnxruntime as ort
    import torch

    weights = {k: np.array(v) for k, v in module.Model(seed=0).parameters().items()}
    layers = [torch.nn.Linear(*weights[f"{n}_w"].shape) for n in ("h1", "h2", "logits")]
    for layer, n in zip(layers, ("h1", "h2", "logits")):
        layer.weight.data = torch.from_numpy(weights[f"{n}_w"].T.copy())
        layer.bias.data = torch.from_numpy(weights[f"{n}_b"].copy())
    net = torch.nn.Sequential(layers[0], torch.nn.ReLU(), layers[1], torch.nn.ReLU(), layers[2]).eval()
    path = folder / "mlp.onnx"
    torch.onnx.export(net, (torch.zeros(1, 784),), str(path), input_names=["x"], output_names=["logits"],
                      dynamic_axes={"x": {0: "N"}}, dynamo=False)
    if int8:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(str(path), str(folder / "mlp_int8.onnx"), per_channel=True, weight_type=QuantType.QInt8)
        path = folder / "mlp_int8.onnx"
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def child(config: dict) -> None:
    quiet_blas()
    import logging
    import warnings

    import numpy as np

    warnings.filterwarnings("ignore")  # the legacy ONNX exporter's notice, onnxruntime's advice
    logging.disable(logging.WARNING)

    peer, builds = config["peer"], config["builds"]
    run = {}
    rng = np.random.default_rng(0)
    xs = {n: rng.uniform(0.0, 1.0, (n, 784)).astype(np.float32) for n in BATCHES}
    if peer in PRECISIONS:
        module = import_module(builds[peer]["name"], builds[peer]["build"])
        set_threads(module, 1)
        model = module.Model(seed=0)
        if peer == "int8":
            model.load(config["int8_weights"])
        for n in BATCHES:
            run[n] = lambda x=xs[n]: model.forward(x=x)
    else:
        fp32 = import_module(builds["fp32"]["name"], builds["fp32"]["build"])
        with tempfile.TemporaryDirectory() as tmp:
            session = _ort_session(fp32, peer == "ort_int8", Path(tmp))
        for n in BATCHES:
            run[n] = lambda x=xs[n]: session.run(None, {"x": x})
    result = {"peer": peer, **{str(n): measure(run[n], config["seconds"], 20)["times"] for n in BATCHES}}
    Path(config["out"]).write_text(json.dumps(result))


def speed_table(cache: Path, rounds: int, seconds: float) -> list:
    import numpy as np

    model_def = runpy.run_path(str(ROOT / "examples" / "mlp.py"))["mlp"]
    builds = {p: build_module(model_def, name=f"mlp_{p}", cache=cache, precision=p) for p in PRECISIONS}
    fp32 = import_module(builds["fp32"]["name"], builds["fp32"]["build"])
    int8 = import_module(builds["int8"]["name"], builds["int8"]["build"])
    print(f"  int8 kernel: {int8.build_info().get('int8_kernel', '?')}")
    params = {k: np.array(v) for k, v in fp32.Model(seed=0).parameters().items()}
    weights = cache / "mlp_int8_weights.npz"
    calibration = {"x": np.random.default_rng(1).uniform(0.0, 1.0, (256, 784)).astype(np.float32)}
    quantize_weights(ROOT / "examples" / "mlp.py", params, calibration, weights)
    peers = list(PRECISIONS)
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
        import torch  # noqa: F401

        peers += list(ORT)
    except ImportError:
        print("  (ONNX Runtime, onnx or torch not installed: its columns are left out)")
    config = {"builds": builds, "int8_weights": str(weights), "seconds": seconds}
    results = run_rounds(Path(__file__), config, rounds, [1], peers, "mlp forward")
    rows = []
    for n in BATCHES:
        medians = {p: statistics.median(t for r in results if r["peer"] == p for t in r[str(n)]) for p in peers}
        rows.append({"batch": n, **{p: medians[p] * 1e3 for p in peers},
                     **{f"{p}_ratio": medians["fp32"] / medians[p] for p in peers}})
    return rows


def print_accuracy(rows: list) -> None:
    """One block per model: accuracy, change against fp32, top-1 agreement with fp32."""
    print(f"\n{'model':>20} {'precision':>9} {'accuracy':>9} {'vs fp32':>8} {'top-1 agreement':>16}")
    for row in rows:
        if row["precision"] == "fp32":
            print(f"  {row['what']}")
        accuracy = "-" if row["accuracy"] is None else f"{row['accuracy']:.4f}"
        relative = "-" if row["relative"] is None else f"{row['relative']:+.2%}"
        print(f"{row['model']:>20} {row['precision']:>9} {accuracy:>9} {relative:>8} {row['agreement']:16.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="one round, shorter timings")
    parser.add_argument("--accuracy-only", action="store_true", help="the accuracy table only (no timings)")
    parser.add_argument("--speed-only", action="store_true", help="the speed table only (no accuracy)")
    parser.add_argument("--json", type=Path, help="write the tables here")
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    cache = ROOT / "build" / "bench" / "precision"
    cache.mkdir(parents=True, exist_ok=True)
    facts = machine_facts()
    print(f"machine: {facts.get('cpu')} ({', '.join(facts.get('cpu_isa') or [])})")
    accuracy = [] if args.speed_only else accuracy_table(cache)
    if accuracy:
        print_accuracy(accuracy)
    speed = [] if args.accuracy_only else speed_table(cache, 1 if args.quick else 3, 0.3 if args.quick else 1.0)
    if speed:
        print("\nmlp forward(), 1 thread: median ms (ratio = our fp32 / peer)")
        peers = [p for p in PRECISIONS + ORT if p in speed[0]]
        print(f"{'batch':>6} " + " ".join(f"{p:>16}" for p in peers))
        for row in speed:
            print(f"{row['batch']:>6} " + " ".join(f"{row[p]:8.3f} ({row[p + '_ratio']:4.2f}x)" for p in peers))
    if args.json:
        args.json.write_text(json.dumps({"machine": facts, "accuracy": accuracy, "speed": speed}, indent=1))


if __name__ == "__main__":
    main()
