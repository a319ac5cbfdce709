"""One rank of tests/test_distributed.py's MPI runs (started by mpirun; not a test file).

    mpirun -n 2 python tests/mpi_worker.py MODULE_DIR MODULE STEPS BATCH OVERLAP OUT [SCENARIO]

Trains MODULE (a built generated module in MODULE_DIR) data-parallel for STEPS
steps on the global batches `batches(STEPS, BATCH)` and rank 0 writes the final
parameters and the losses to OUT (.npz). SCENARIO: "bad-input" (rank 1 passes a
wrongly shaped input in step 2: every rank must raise DistributedError) or
"uncaught" (rank 1 raises outside the driver: the job must abort, not hang), or
one of SCENARIOS below (each prints what every rank saw; the test reads it).
"""

import sys
import time
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


def _stopped(trainer, rank, inputs):
    """After a DistributedError: a second train_step must fail at once (no collective)."""
    again = time.monotonic()
    try:
        trainer.train_step(**inputs)
        print(f"rank {rank} trained again", flush=True)
    except Exception as e:
        print(f"rank {rank} again after {time.monotonic() - again:.2f} s: {type(e).__name__}: {e}", flush=True)


def early_exit(module, comm, steps, batch):
    """Rank 1 leaves its loop after step 2 and its program ends, without close():
    rank 0's step 3 must raise DistributedError (said at rank 1's exit), not hang."""
    from generator.distributed import DataParallel, DistributedError

    rank = comm.Get_rank()
    trainer = DataParallel(module.Model(seed=11))
    for step, inputs in enumerate(batches(steps, batch)):
        if rank == 1 and step == 2:
            print("rank 1 leaves after step 2", flush=True)
            return
        started = time.monotonic()
        try:
            trainer.train_step(**inputs)
        except DistributedError as e:
            print(f"rank {rank} stopped after {time.monotonic() - started:.2f} s: {e}", flush=True)
            return _stopped(trainer, rank, inputs)
    print(f"rank {rank} finished every step", flush=True)


def with_early(module, comm, steps, batch):
    """Rank 1 leaves its `with DataParallel(...)` block after step 2 and lives on,
    waiting for a message from rank 0: rank 0 hears of it in its step 3 and sends it."""
    from generator.distributed import DataParallel, DistributedError

    rank = comm.Get_rank()
    with DataParallel(module.Model(seed=11)) as trainer:
        for step, inputs in enumerate(batches(steps, batch)):
            if rank == 1 and step == 2:
                break
            try:
                trainer.train_step(**inputs)
            except DistributedError as e:
                print(f"rank {rank} stopped: {e}", flush=True)
                break
    if rank == 1:
        print(f"rank 1 left its with-block; then got: {comm.recv(source=0)}", flush=True)
    else:
        comm.send("rank 0 heard it", dest=1)


def mismatch(module, comm, steps, batch):
    """Rank 1 differs from rank 0 in one thing per case: every rank must raise
    DistributedError in that step, and no parameter may change."""
    from generator.distributed import DataParallel, DistributedError, shard

    rank = comm.Get_rank()
    inputs = batches(1, batch)[0]
    mine = shard(inputs, rank, 2)
    short = {k: v[:-1] for k, v in inputs.items()}
    cases = [  # label, rank 1's constructor arguments, the step on rank 0, the step on rank 1
        ("reduce", dict(reduce="sum"), None, None),
        ("bucket_bytes", dict(bucket_bytes=0), None, None),
        ("overlap", dict(overlap=False), None, None),
        ("global batch", {}, None, lambda t: t.train_step(**short)),
        ("global count", {}, lambda t: t.train_step_local(len(mine["x"]), batch, **mine),
         lambda t: t.train_step_local(len(mine["x"]), batch + 6, **mine)),
        ("shares", {}, lambda t: t.train_step_local(len(mine["x"]), batch, **mine),
         lambda t: t.train_step_local(len(mine["x"]) - 1, batch, **mine)),
    ]
    for label, arguments, step0, step1 in cases:
        model = module.Model(seed=11)
        trainer = DataParallel(model, **(arguments if rank == 1 else {}))
        before = {k: v.copy() for k, v in model.parameters().items()}
        step = (step1 if rank == 1 else step0) or (lambda t: t.train_step(**inputs))
        try:
            step(trainer)
            print(f"{label}: rank {rank} trained", flush=True)
        except DistributedError as e:
            print(f"{label}: rank {rank}: {e}", flush=True)
        same = all(np.array_equal(v, before[k]) for k, v in model.parameters().items())
        print(f"{label}: rank {rank} parameters {'unchanged' if same else 'CHANGED'}", flush=True)
        trainer.close()  # both ranks: the goodbyes meet each other
    # the matching settings still train
    with DataParallel(module.Model(seed=11)) as trainer:
        trainer.train_step(**inputs)
        print(f"rank {rank} trained after the mismatches", flush=True)


def timeout(module, comm, steps, batch):
    """Rank 1 leaves its loop after step 1 without close() and waits in a collective
    of its own: rank 0 (timeout 1 s) must raise DistributedError, and its process's
    end must abort the job rather than wait for rank 1 forever."""
    from generator.distributed import DataParallel, DistributedError

    rank = comm.Get_rank()
    trainer = DataParallel(module.Model(seed=11), timeout=1.0 if rank == 0 else None)
    for step, inputs in enumerate(batches(steps, batch)):
        if rank == 1 and step == 1:
            print("rank 1 waits in a barrier of its own", flush=True)
            comm.Barrier()
            print("rank 1 passed its barrier", flush=True)
            return
        started = time.monotonic()
        try:
            trainer.train_step(**inputs)
        except DistributedError as e:
            print(f"rank {rank} stopped after {time.monotonic() - started:.2f} s: {e}", flush=True)
            return _stopped(trainer, rank, inputs)


SCENARIOS = {f.__name__.replace("_", "-"): f for f in (early_exit, with_early, mismatch, timeout)}


if __name__ == "__main__":
    if len(sys.argv) > 7 and sys.argv[7] in SCENARIOS:
        from mpi4py import MPI

        sys.path.insert(0, sys.argv[1])
        SCENARIOS[sys.argv[7]](__import__(sys.argv[2]), MPI.COMM_WORLD, int(sys.argv[3]), int(sys.argv[4]))
    else:
        main(*sys.argv[1:])
