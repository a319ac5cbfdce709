"""Data-parallel training of a generated module over MPI (mpi4py).

    from generator.distributed import DataParallel

    model = digits.Model(seed=0)
    trainer = DataParallel(model)              # rank 0's parameters reach every rank
    for batch in batches:                      # the same global batches on every rank
        loss = trainer.train_step(**batch)     # this rank's shard; gradients averaged
    # run with: mpirun -n 2 python train.py

Each step every rank runs `compute_gradients` on its shard of the global batch,
the gradients are summed over the ranks with MPI allreduce (each rank's weighted
by its share of the batch, so the result is the gradient of the global batch's
mean loss), and every rank takes the same optimizer step (`apply_update`): the
parameters stay equal on every rank, and equal to a single process's at the
global batch. The allreduce of a gradient starts as soon as the backward pass
has finished it (the generated code reports each one; the update scheduling
knows when), so communication overlaps the rest of the backward pass.

A rank that fails in a step (bad input, a non-finite loss, an error in its
backward pass) does not leave the others waiting: every rank learns of it at
the step's next agreement point and raises DistributedError naming the rank and
its error. An exception that escapes a rank's program altogether aborts the job
(`abort_on_uncaught`), so no rank hangs in a collective for a dead peer.
"""

from __future__ import annotations

import sys
import traceback

import numpy as np

__all__ = ["DataParallel", "DistributedError", "shard", "abort_on_uncaught"]


class DistributedError(RuntimeError):
    """A rank failed: raised on every rank, naming the rank(s) and their errors."""


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as e:  # mpi4py missing, or no MPI library beneath it
        raise ImportError(
            f"data-parallel training needs mpi4py and an MPI library ({e}); install one, e.g. "
            "`apt-get install openmpi-bin libopenmpi-dev` and `pip install mpi4py`"
        ) from e
    return MPI


def shard(inputs: dict, rank: int, size: int) -> dict:
    """This rank's contiguous share (np.array_split) of a global batch: every input
    is split along its first axis, which must be the batch axis of them all."""
    counts = {name: len(value) for name, value in inputs.items()}
    if not counts:
        raise ValueError("cannot shard an empty set of inputs")
    if len(set(counts.values())) > 1:
        raise ValueError(
            f"cannot shard the batch: the inputs' first dimensions differ ({counts}); "
            "give each rank its own inputs with train_step_local(count, **inputs)"
        )
    count = next(iter(counts.values()))
    if count < size:
        raise ValueError(f"a global batch of {count} cannot give each of {size} ranks an example")
    return {name: np.array_split(np.asarray(value), size)[rank] for name, value in inputs.items()}


def abort_on_uncaught(comm) -> None:
    """An exception nothing catches ends this rank's program: print it and abort the
    whole MPI job, so the other ranks do not wait for this one forever."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        sys.stderr.write(f"rank {comm.Get_rank()}: uncaught {kind.__name__}; aborting every rank\n")
        sys.stderr.flush()
        comm.Abort(1)

    sys.excepthook = hook


class DataParallel:
    """One generated Model trained data-parallel over the ranks of `comm`.

    reduce: "mean" (the loss is a mean over the batch, as the DSL's losses are:
    each rank's gradient is weighted by its share of the global batch) or "sum"
    (a loss summed over the batch: gradients are added). overlap: while the
    backward pass goes on, start a non-blocking allreduce of the gradients it has
    completed as soon as they lie side by side in the gradient buffer and hold at
    least bucket_bytes (one gradient at a time on a target without the buffer);
    what is left, all of it without overlap, is reduced with one blocking
    allreduce after the backward pass.
    """

    def __init__(self, model, comm=None, reduce: str = "mean", overlap: bool = True, abort_uncaught: bool = True,
                 bucket_bytes: int = 1 << 20):
        self.MPI = _mpi()
        self.comm = comm if comm is not None else self.MPI.COMM_WORLD
        if reduce not in ("mean", "sum"):
            raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
        for method in ("compute_gradients", "apply_update", "gradients"):
            if not hasattr(model, method):
                raise TypeError(f"{type(model).__name__} has no {method}(): generate the model with dg.train(...)")
        self.model, self.reduce, self.overlap = model, reduce, overlap
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        if abort_uncaught:
            abort_on_uncaught(self.comm)
        self.names = list(model.gradients())
        # With one gradient buffer, ready gradients side by side in it are reduced together,
        # once at least bucket_bytes of them are ready (fewer, larger messages).
        self.bucket_bytes = bucket_bytes if hasattr(model, "gradient_buffer") else 0
        sizes = [g.size for g in model.gradients().values()]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._check_same_model()
        self.broadcast()

    # -- setup ---------------------------------------------------------------------------

    def _check_same_model(self) -> None:
        """Every rank must hold the same model: names, shapes and optimizer."""
        mine = (type(self.model).__module__, [(n, a.shape) for n, a in self.model.gradients().items()],
                sorted(self.model.hyperparameters()))
        every = self.comm.allgather(mine)
        differ = [r for r, theirs in enumerate(every) if theirs != every[0]]
        if differ:
            raise DistributedError(
                f"ranks {differ} hold a different model than rank 0 "
                f"(rank 0: module {every[0][0]}, gradients {every[0][1]}; rank {differ[0]}: "
                f"module {every[differ[0]][0]}, gradients {every[differ[0]][1]})"
            )

    def broadcast(self, root: int = 0) -> None:
        """Copy root's parameters, running statistics, optimizer state, step and
        hyperparameters to every rank."""
        groups = [self.model.parameters(), self.model.optimizer_state()]
        if hasattr(self.model, "buffers"):
            groups.append(self.model.buffers())
        for group in groups:
            for name in sorted(group):
                self.comm.Bcast(group[name], root=root)
        settings = self.comm.bcast((self.model.step, self.model.hyperparameters()), root=root)
        self.model.step = settings[0]
        for name, value in settings[1].items():
            setattr(self.model, name, value)

    # -- a step --------------------------------------------------------------------------

    def train_step(self, **inputs) -> float:
        """One step on a global batch that every rank passes whole: this rank trains
        on its shard. Returns the global batch's loss (before the update)."""
        try:
            local = shard(inputs, self.rank, self.size)
        except Exception as e:  # the other ranks must hear of it: fail inside the step
            return self._step(None, 1.0, e)
        total = len(next(iter(inputs.values())))
        count = len(next(iter(local.values())))
        return self._step(local, count / total if self.reduce == "mean" else 1.0, None)

    def train_step_local(self, count: int, global_count: int, **inputs) -> float:
        """One step on inputs this rank chose itself: `count` of the `global_count`
        examples of the global batch (its weight under reduce='mean')."""
        return self._step(inputs, count / global_count if self.reduce == "mean" else 1.0, None)

    def _step(self, inputs, weight: float, error) -> float:
        MPI = self.MPI
        grads = self.model.gradients()
        requests, started, agreed = [], [], []

        def agree(failure):
            """The step's first collective: every rank says whether it got this far.
            Every error a step can meet (inputs, labels, a non-finite loss) comes
            before the first gradient is complete, so before this point."""
            every = self.comm.allgather(failure)
            agreed.append(True)
            failed = [(r, msg) for r, msg in enumerate(every) if msg is not None]
            if failed:
                raise DistributedError("; ".join(f"rank {r} failed: {msg}" for r, msg in failed))

        buffer = self.model.gradient_buffer() if self.bucket_bytes else None
        ready = [False] * len(self.names)
        index = {name: i for i, name in enumerate(self.names)}

        def start(first, last, blocking=False):
            """Reduce gradients first..last-1 (side by side in the buffer, or one gradient)."""
            view = buffer[self.offsets[first] : self.offsets[last]] if buffer is not None else grads[self.names[first]]
            if weight != 1.0:
                view *= np.float32(weight)
            started.extend(self.names[first:last])
            if blocking:  # after the backward pass: the library's tuned blocking algorithm
                self.comm.Allreduce(MPI.IN_PLACE, view, op=MPI.SUM)
                return
            requests.append(self.comm.Iallreduce(MPI.IN_PLACE, view, op=MPI.SUM))
            MPI.Request.Testall(requests)  # lets the library progress the earlier ones

        def flush(least_bytes, blocking=False):
            """Start every run of ready, unstarted gradients holding at least least_bytes
            (runs in buffer order: the same on every rank, as the ready order is)."""
            i = 0
            while i < len(ready):
                if not ready[i]:
                    i += 1
                    continue
                j = i
                while j < len(ready) and ready[j] and (buffer is not None or j == i):
                    j += 1
                if 4 * (self.offsets[j] - self.offsets[i]) >= least_bytes:
                    start(i, j, blocking)
                    for k in range(i, j):
                        ready[k] = False
                i = j

        def on_ready(name):
            if not agreed:
                agree(None)
            ready[index[name]] = True
            flush(self.bucket_bytes)

        loss = 0.0
        if error is None:
            try:
                loss = self.model.compute_gradients(on_ready if self.overlap else None, **inputs)
            except DistributedError:
                raise  # a rank failed: every rank raises it, from agree()
            except Exception as e:
                if agreed:  # the others are reducing gradients already: no clean way back
                    self._abort(f"failed after the gradients began to be reduced: {_describe(e)}")
                error = e
        if not agreed:
            agree(None if error is None else _describe(error))
        for i, name in enumerate(self.names):  # the rest (all of them without overlap)
            ready[i] = name not in started
        flush(0, blocking=True)
        MPI.Request.Waitall(requests)
        self.model.apply_update()
        return float(self.comm.allreduce(weight * loss if self.reduce == "mean" else loss, op=MPI.SUM))

    def _abort(self, why: str) -> None:
        sys.stderr.write(f"rank {self.rank} {why}; aborting every rank\n")
        sys.stderr.flush()
        self.comm.Abort(1)


def _describe(error: BaseException) -> str:
    where = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ else []
    at = f" (at {where[0].filename}:{where[0].lineno})" if where and "generator/distributed" not in where[0].filename else ""
    return f"{type(error).__name__}: {error}{at}"
