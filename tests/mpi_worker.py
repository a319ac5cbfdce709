"""One rank of tests/test_distributed.py's MPI runs (started by mpirun; not a test file).

    mpirun -n 2 python tests/mpi_worker.py MODULE_DIR MODULE STEPS BATCH OVERLAP OUT [SCENARIO]

Trains MODULE (a built generated module in MODULE_DIR) data-parallel for STEPS
steps on the global batches `batches(STEPS, BATCH)` and rank 0 writes the final
parameters and the losses to OUT (.npz). SCENARIO: "bad-input" (rank 1 passes a
wrongly shaped input in step 2: every rank must raise DistributedError) or
"uncaught" (rank 1 raises outside the driver: the job must abort, not hang).
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def batches(steps, batch, features=12, classes=4):
    rng = np.random.default_rng(5)
    return [
        {"x": rng.normal(size=(batch, features)).astype(np.float32),
         "labels": rng.integers(0, classes, batch).astype(np.int64)}
        for _ in range(steps)
    ]


def main(module_dir, name, steps, batch, overlap, out, scenario=""):
    from mpi4py import MPI

    from generator.distributed import DataParallel, DistributedError

    sys.path.insert(0, module_dir)
    module = __import__(name)
    comm = MPI.COMM_WORLD
    model = module.Model(seed=11 + comm.Get_rank())  # rank 0's parameters must win
    # OVERLAP: "1" the defaults, "each" a reduction started for every completed gradient, "0" none.
    trainer = DataParallel(model, overlap=overlap != "0", bucket_bytes=0 if overlap == "each" else 1 << 20)
    losses = []
    for step, inputs in enumerate(batches(int(steps), int(batch))):
        if scenario == "bad-input" and step == 2 and comm.Get_rank() == 1:
            inputs = {"x": inputs["x"][:, :5].copy(), "labels": inputs["labels"]}
        if scenario == "uncaught" and step == 2 and comm.Get_rank() == 1:
            raise RuntimeError("rank 1 gives up outside the driver")
        try:
            losses.append(trainer.train_step(**inputs))
        except DistributedError as e:
            print(f"rank {comm.Get_rank()} stopped: {e}", flush=True)
            sys.exit(3)
    if comm.Get_rank() == 0:
        np.savez(out, losses=np.array(losses), **{f"param/{k}": v for k, v in model.parameters().items()})


if __name__ == "__main__":
    main(*sys.argv[1:])
