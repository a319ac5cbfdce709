"""Benchmark: bf16 training (issue #41): `dg.train(..., precision="bf16")` against fp32.

    python benchmarks/bf16_training.py [--quick] [--json FILE]

Accuracy: examples/digits.py (the MLP, Adam, 8 epochs) and examples/lenet.py (20
epochs), scikit-learn's 8x8 digits, 20% held out; each generated twice (`--option
precision=fp32` and `precision=bf16`), each trained by its own train_step from the same
seed on the same batches (32, shuffled with seed 0), then the held-out accuracy of each
and bf16's change against fp32 (target: within 1%). Every product of a bf16 step, forward
and backward, multiplies bf16 values; weights, gradients and Adam's state stay float32.

Speed: examples/mlp.py (784 -> 512 relu -> 256 relu -> 10, SGD with momentum)
train_step at batch 64 and 256, 1 and 2 threads, fp32 and bf16; each (precision, round)
in a child process of its own, medians pooled over rounds (3, 1 with --quick),
alternating order. Ratio = fp32 median / bf16 median. The bf16 products use AMX tiles or
vdpbf16ps where the CPU has them (the bf16 module's build_info()["bf16_kernel"]); on
other CPUs they are float32 products of the rounded values (no speed target there).
"""

from __future__ import annotations

import argparse
import json
import runpy
import statistics
from pathlib import Path

from _common import ROOT, build_module, import_module, machine_facts, measure, quiet_blas, run_rounds, set_threads

PRECISIONS = ("fp32", "bf16")
BATCHES = (64, 256)


class _Option:
    """examples/<name>.py's model with its own option precision=... (build_module's
    `precision` is --precision, the inference rewrite: not this)."""

    def __init__(self, name: str, precision: str):
        self.model = runpy.run_path(str(ROOT / "examples" / f"{name}.py"))[name]
        self.precision = precision

    def build(self, name: str, **options):
        return self.model.build(name=name, precision=self.precision, **options)


def _build(name: str, precision: str, cache: Path) -> dict:
    return build_module(_Option(name, precision), name=f"{name}_train_{precision}", cache=cache)


def _accuracy(name: str, inputs: str, epochs: int, cache: Path) -> dict:
    """Held-out accuracy of examples/<name>.py trained in fp32 and in bf16."""
    import numpy as np

    train_set, test_set = runpy.run_path(str(ROOT / "examples" / f"{name}.py"))["load_data"](0)
    row = {"model": name, "epochs": epochs}
    for precision in PRECISIONS:
        built = _build(name, precision, cache)
        module = import_module(built["name"], built["build"])
        model, rng, count = module.Model(seed=0), np.random.default_rng(0), len(train_set["labels"])
        for _ in range(epochs):
            order = rng.permutation(count)
            for start in range(0, count, 32):
                model.train_step(**{k: v[order[start : start + 32]] for k, v in train_set.items()})
        if hasattr(model, "eval"):
            model.eval()
        probs = model.forward(**{inputs: test_set[inputs]})["probs"]
        row[precision] = float(np.mean(probs.argmax(axis=1) == test_set["labels"]))
        if precision == "bf16":
            row["bf16_kernel"] = module.build_info().get("bf16_kernel")
    row["relative"] = row["bf16"] / row["fp32"] - 1
    return row


def child(config: dict) -> None:
    quiet_blas()
    import numpy as np

    built = config["builds"][config["peer"]]
    module = import_module(built["name"], built["build"])
    set_threads(module, config["threads"])
    rng = np.random.default_rng(0)
    times = {}
    for n in config["batches"]:
        model = module.Model(seed=0)
        batch = {"x": rng.uniform(0.0, 1.0, (n, 784)).astype(np.float32), "labels": rng.integers(0, 10, n)}
        times[str(n)] = measure(lambda: model.train_step(**batch), config["seconds"], 10)["times"]
    Path(config["out"]).write_text(json.dumps({"peer": config["peer"], "threads": config["threads"], **times}))


def speed_table(cache: Path, rounds: int, seconds: float, threads_list) -> list:
    builds = {p: _build("mlp", p, cache) for p in PRECISIONS}
    config = {"builds": builds, "seconds": seconds, "batches": list(BATCHES)}
    results = run_rounds(Path(__file__), config, rounds, threads_list, list(PRECISIONS), "mlp train_step")
    rows = []
    for threads in threads_list:
        for n in BATCHES:
            med = {p: statistics.median(t for r in results if r["peer"] == p and r["threads"] == threads
                                        for t in r[str(n)]) for p in PRECISIONS}
            rows.append({"batch": n, "threads": threads, **{p: med[p] * 1e3 for p in PRECISIONS},
                         "ratio": med["fp32"] / med["bf16"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="one round, shorter timings")
    parser.add_argument("--json", type=Path, help="write the tables here")
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    cache = ROOT / "build" / "bench" / "bf16_training"
    cache.mkdir(parents=True, exist_ok=True)
    facts = machine_facts()
    print(f"machine: {facts.get('cpu')} ({', '.join(facts.get('cpu_isa') or [])})")
    accuracy = [_accuracy("digits", "pixels", 8, cache), _accuracy("lenet", "images", 20, cache)]
    print(f"\n{'model':>8} {'epochs':>6} {'fp32':>7} {'bf16':>7} {'vs fp32':>8}  bf16 products")
    for row in accuracy:
        print(f"{row['model']:>8} {row['epochs']:>6} {row['fp32']:7.4f} {row['bf16']:7.4f} {row['relative']:+8.2%}"
              f"  {row['bf16_kernel']}")
    speed = speed_table(cache, 1 if args.quick else 3, 0.3 if args.quick else 1.0, (1, 2))
    print("\nmlp train_step: median ms (ratio = fp32 / bf16)")
    print(f"{'batch':>6} {'threads':>7} {'fp32':>9} {'bf16':>9} {'ratio':>6}")
    for row in speed:
        print(f"{row['batch']:>6} {row['threads']:>7} {row['fp32']:9.3f} {row['bf16']:9.3f} {row['ratio']:5.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"machine": facts, "accuracy": accuracy, "speed": speed}, indent=1))


if __name__ == "__main__":
    main()
