"""The digits MLP (examples/digits.py) trained data-parallel over MPI.

    mpirun -n 2 python examples/digits_mpi.py      # 2 processes on this machine
    mpirun -n 4 -H a:2,b:2 python examples/digits_mpi.py   # 2 machines (docs/DISTRIBUTED.md)

Rank 0 generates and builds the module (the others wait), every rank trains on its
share of each global batch of 64, gradients are averaged with MPI allreduce, and
rank 0 prints the loss per epoch and the held-out accuracy: the same numbers a
single process prints at batch 64. Needs mpi4py and an MPI library (OpenMPI:
`apt-get install openmpi-bin libopenmpi-dev`, `pip install mpi4py`) and
scikit-learn for the data.
"""

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from digits import digits, load_data  # noqa: E402  (the model and data of examples/digits.py)


def build_on_rank0(comm, project):
    """Rank 0 generates and builds; every rank then imports the module (or all stop)."""
    error = None
    if comm.Get_rank() == 0:
        try:
            from generator.pipeline import generate
            from generator.tools.build import build_project

            generate(digits.build(), project, force=True)
            build_project(project, target_dir=project / "site")
        except Exception as e:  # the other ranks must not wait for a module that never comes
            error = f"{type(e).__name__}: {e}"
    error = comm.bcast(error, root=0)
    if error is not None:
        raise SystemExit(f"rank {comm.Get_rank()}: building the module on rank 0 failed: {error}")
    sys.path.insert(0, str(project / "site"))
    import digits as module  # noqa: E402  (the module just built; shadows the example of the same name)

    return module


def main(argv=None):
    import argparse

    from mpi4py import MPI

    parser = argparse.ArgumentParser(description="the digits MLP trained data-parallel over MPI")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64, help="global batch (split over the ranks)")
    parser.add_argument("--module-dir", help="import an already built digits module from here instead of building")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    sys.modules.pop("digits", None)  # the example file above; the built module takes the name
    if args.module_dir:
        sys.path.insert(0, args.module_dir)
        import digits as module  # noqa: E402
    else:
        module = build_on_rank0(comm, HERE.parent / "build" / "digits_mpi")
    return train(module, comm, args.epochs, args.batch)


def train(module, comm, epochs=30, batch=64, seed=0):
    """examples/digits.py's training loop, data-parallel: the same batches, each rank its share."""
    from generator.distributed import DataParallel

    train_set, test_set = load_data(seed)
    model = module.Model(seed=seed)
    rng = np.random.default_rng(seed)  # the same order on every rank: each takes its shard
    count = len(train_set["labels"])
    log = print if comm.Get_rank() == 0 else (lambda *a: None)
    log(f"{comm.Get_size()} ranks, global batch {batch}")
    # rank 0's parameters on every rank; leaving the block tells the others this rank is done
    with DataParallel(model) as trainer:
        for epoch in range(epochs):
            order = rng.permutation(count)
            losses = []
            for start in range(0, count - comm.Get_size() + 1, batch):
                pick = order[start : start + batch]
                losses.append(trainer.train_step(pixels=train_set["pixels"][pick], labels=train_set["labels"][pick]))
            log(f"epoch {epoch + 1:2d}  loss {np.mean(losses):.4f}")
    probs = model.forward(pixels=test_set["pixels"])["probs"]
    accuracy = float(np.mean(probs.argmax(axis=1) == test_set["labels"]))
    log(f"held-out accuracy {accuracy:.4f} on {len(test_set['labels'])} images")
    return accuracy


if __name__ == "__main__":
    main()
