"""Benchmark: data-parallel training over MPI, 2 ranks x 1 thread against 1 process x 1 thread.

    python benchmarks/distributed.py [--json FILE] [--quick] [--batch 512] [--ranks 2]

Model: examples/mlp.py (x[N, 784] -> 512 relu -> 256 relu -> 10, softmax
cross-entropy, SGD with momentum), generated and built once (build/bench/mlp_dp/).
Both sides train at the same global batch (512): the single process runs
Model.train_step on the whole batch; each of the 2 ranks (mpirun, OMP_NUM_THREADS=1,
one core each) runs generator.distributed.DataParallel.train_step, i.e. its half
of the batch, an allreduce of the gradients (1.7 MB) and the update, with the
allreduce started per gradient as the backward pass completes it ("overlap") or
once after it ("one allreduce"; "ring": with OpenMPI's ring allreduce algorithm
chosen through its MCA settings, which the MPI library's own default does not pick
for this size on this machine).

Check before timing: after 3 steps from the same start, the 2-rank run's losses
must equal the single process's within 1e-4.

Timing: after 3 warm-up steps, rank 0 times STEPS steps (150; 30 with --quick)
between barriers; throughput = examples / second. Rounds: 3 (1 with --quick), the
order of the configurations reversed every other round; medians. Ratio = 2-rank
throughput / 1-process throughput. Target: >= 1.8.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, build_module, import_module, machine_facts, thread_env

TARGET = 1.8
# OpenMPI settings (other MPI libraries ignore them): the ring allreduce algorithm.
RING = {"OMPI_MCA_coll_tuned_use_dynamic_rules": "1", "OMPI_MCA_coll_tuned_allreduce_algorithm": "4"}


def make_batches(steps, batch):
    import numpy as np

    rng = np.random.default_rng(0)
    return [
        {"x": rng.random((batch, 784), dtype=np.float32), "labels": rng.integers(0, 10, batch).astype(np.int64)}
        for _ in range(min(steps, 8))
    ]


def child(config):
    """One process of a measurement: plain train_step (ranks == 1) or one MPI rank."""
    module = import_module(config["name"], config["build"])
    module.set_num_threads(1)
    model = module.Model(seed=0)
    batches = make_batches(config["steps"], config["batch"])
    if config["ranks"] == 1:
        step, barrier, rank = (lambda b: model.train_step(**b)), (lambda: None), 0
    else:
        from mpi4py import MPI

        from generator.distributed import DataParallel

        trainer = DataParallel(model, overlap=config["overlap"])
        step, barrier, rank = (lambda b: trainer.train_step(**b)), MPI.COMM_WORLD.Barrier, MPI.COMM_WORLD.Get_rank()
    losses = [step(batches[i % len(batches)]) for i in range(3)]  # the check, and the warm-up
    barrier()
    t0 = time.perf_counter()
    for i in range(config["steps"]):
        step(batches[i % len(batches)])
    barrier()
    seconds = time.perf_counter() - t0
    if rank == 0:
        Path(config["out"]).write_text(json.dumps({"losses": losses, "seconds": seconds}))


def run(config, tmp, label):
    out = Path(tmp) / f"{label}.json"
    cfg = dict(config, out=str(out))
    command = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(cfg)]
    env = thread_env(1)
    if config["ranks"] > 1:
        command = [shutil.which("mpirun"), "-n", str(config["ranks"]), "--oversubscribe", "--bind-to", "core"] + command
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **config.get("env", {}))
    proc = subprocess.run(command, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"the {label} run failed (exit {proc.returncode})")
    return json.loads(out.read_text())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child")
    parser.add_argument("--json")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))
    if shutil.which("mpirun") is None:
        raise SystemExit("mpirun not found: install an MPI library (apt-get install openmpi-bin libopenmpi-dev)")
    from generator.frontend.loader import load_model

    built = build_module(load_model(str(ROOT / "examples" / "mlp.py")), name="mlp_dp")
    steps, rounds = (30, 1) if args.quick else (150, 3)
    base = {"name": built["name"], "build": built["build"], "batch": args.batch, "steps": steps}
    configs = {
        "1 process": dict(base, ranks=1, overlap=False),
        f"{args.ranks} ranks, overlap": dict(base, ranks=args.ranks, overlap=True),
        f"{args.ranks} ranks, one allreduce": dict(base, ranks=args.ranks, overlap=False),
        # OpenMPI's default allreduce for 2 MB on 2 ranks takes ~2x its ring algorithm here.
        f"{args.ranks} ranks, one allreduce, ring": dict(base, ranks=args.ranks, overlap=False, env=RING),
    }
    seconds = {label: [] for label in configs}
    losses = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(rounds):
            order = list(configs) if rnd % 2 == 0 else list(configs)[::-1]
            for label in order:
                result = run(configs[label], tmp, label.replace(" ", "_").replace(",", ""))
                seconds[label].append(result["seconds"])
                losses[label] = result["losses"]
    single = losses["1 process"]
    for label, got in losses.items():
        if any(abs(a - b) > 1e-4 for a, b in zip(got, single)):
            raise SystemExit(f"{label}: losses {got} differ from one process's {single}")
    facts = machine_facts()
    print(f"\nMLP 784-512-256-10 train step, global batch {args.batch}, 1 thread per process "
          f"({facts.get('cpu', '?')}; {', '.join(facts.get('cpu_isa', [])) or '?'})")
    rows = []
    base_rate = args.batch * steps / statistics.median(seconds["1 process"])
    for label in configs:
        rate = args.batch * steps / statistics.median(seconds[label])
        ratio = rate / base_rate
        target = None if label == "1 process" else TARGET
        rows.append({"config": label, "examples_per_s": round(rate, 1), "ratio": round(ratio, 3), "target": target,
                     "met": None if target is None else ratio >= target})
        flag = "" if target is None else ("  met" if ratio >= target else f"  MISSED (target {target})")
        print(f"  {label:<26} {rate:10.0f} examples/s  {ratio:5.2f}x{flag}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "machine": facts, "seconds": seconds}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
