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

Each step begins with an agreement: one small non-blocking allgather, waited for
at most `timeout` seconds, in which every rank says whether it got this far, with
what settings (reduce, overlap, bucket_bytes) and which share of which global
batch. A rank that fails in a step (bad input, a non-finite loss), settings or
batch sizes that differ between ranks, and a rank that stopped training
(`close()`, leaving a `with DataParallel(...)` block, or its program ending) make
every other rank raise DistributedError there, before any gradient is exchanged.
A rank whose agreement gets no answer within `timeout` raises DistributedError
and, as its peers may be stuck for good, aborts the MPI job when its process
ends. An exception that escapes a rank's program altogether aborts the job
(`abort_on_uncaught`), so no rank hangs in a collective for a dead peer.
"""

from __future__ import annotations

import atexit
import operator
import sys
import time
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


# The agreement a step, a broadcast and a goodbye begin with: every rank puts in these
# int64 fields and gets every rank's (one non-blocking allgather of len(_FIELDS) * 8 bytes).
# The first _ALIKE must be the same on every rank (global_count: broadcast()'s root there).
_FIELDS = ("state", "op", "reduce", "overlap", "bucket_bytes", "global_count", "steps", "count")
_STATE, _OP, _REDUCE, _OVERLAP, _BUCKET, _GLOBAL, _STEPS, _COUNT = range(len(_FIELDS))
_ALIKE = _STEPS
_READY, _FAILED, _STOPPING = 0, 1, 2  # state
_STEP, _BROADCAST = 0, 1  # op, while READY or FAILED
_OPS = {_STEP: "train_step", _BROADCAST: "broadcast"}
_CLOSED, _LEFT_WITH, _RAISED_IN_WITH, _EXITED = 0, 1, 2, 3  # op, while STOPPING: why
_WHY = {
    _CLOSED: "it called close()",
    _LEFT_WITH: "it left its `with DataParallel(...)` block",
    _RAISED_IN_WITH: "an exception left its `with DataParallel(...)` block",
    _EXITED: "its program ended without close()",
}
_REDUCES = ("mean", "sum")
DEFAULT_TIMEOUT_S = 600.0
_SPIN_S, _MAX_NAP_S = 0.02, 0.05


def _wait(request, timeout) -> bool:
    """Poll a non-blocking request until it completes (True) or `timeout` seconds pass
    (False; None waits for ever). Spins for the first 20 ms (a step's ranks usually
    arrive within that of each other), then naps a tenth of the time waited so far
    (at most 50 ms) between polls."""
    if request.Test():
        return True
    start = time.monotonic()
    while True:
        waited = time.monotonic() - start
        if timeout is not None and waited >= timeout:
            return False
        if waited > _SPIN_S:
            nap = min(0.1 * waited, _MAX_NAP_S)
            time.sleep(nap if timeout is None else max(0.0, min(nap, timeout - waited)))
        if request.Test():
            return True


def _listing(items, most: int = 4) -> str:
    items = list(items)
    return ", ".join(items[:most]) + (f" and {len(items) - most} more" if len(items) > most else "")


class _Session:
    """A trainer's own communicator (a duplicate: the driver's messages never meet the
    program's own) and where it stands. It holds what the goodbye at the program's end
    needs and no more, so it does not keep the model alive."""

    def __init__(self, MPI, comm, timeout):
        self.MPI = MPI
        self.comm = comm.Dup()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.timeout = timeout
        self.steps = 0  # steps this trainer completed
        self.over = None  # why no collective may run on self.comm any more, or None
        self.stuck = False  # an agreement never completed: abort the job when this process ends
        self.mine = np.zeros(len(_FIELDS), np.int64)
        self.every = np.zeros((self.size, len(_FIELDS)), np.int64)
        self.pending = None  # a goodbye nobody met in time (its request and buffers, kept alive)
        atexit.register(self.at_exit)

    def agree(self, op, failure=None, settings=(0, 0, 0), global_count=0, count=0) -> None:
        """The first collective of a step (or broadcast): every rank says whether it got
        this far (failure: its error, or None), in which call, with which settings and
        which share of which global batch. Raises the same DistributedError on every
        rank unless all of them are here, well and alike; raises it after `timeout`
        seconds on a rank whose peers never came."""
        if self.over is not None:
            raise DistributedError(self.over)
        self.mine[:] = (_FAILED if failure is not None else _READY, op, *settings, global_count, self.steps, count)
        request = self.comm.Iallgather(self.mine, self.every)
        if not _wait(request, self.timeout):
            self.stuck = True
            what = f"step {self.steps + 1}" if op == _STEP else "broadcast()"
            self.over = (
                f"rank {self.rank} waited {self.timeout:g} s at the start of {what} and the other ranks never came "
                "(one stopped training without close(), is stuck, or ran something else that long; "
                "DataParallel(timeout=...) sets the wait): this trainer cannot go on, and this process aborts "
                "the MPI job when it ends"
            )
            raise DistributedError(self.over)
        self._judge(op, failure)

    def _judge(self, op, failure) -> None:
        rows = self.every.tolist()  # plain ints: the usual case costs a few microseconds
        alike = rows[0][:_ALIKE]
        if (alike[_STATE] == _READY and alike[_OP] == op and all(row[:_ALIKE] == alike for row in rows)
                and (op != _STEP or sum(row[_COUNT] for row in rows) == alike[_GLOBAL])):
            return
        stopped = [r for r, row in enumerate(rows) if row[_STATE] == _STOPPING]
        failed = [r for r, row in enumerate(rows) if row[_STATE] == _FAILED]
        if stopped:  # for good: no collective runs on this communicator again
            self.over = "; ".join(
                f"rank {r} stopped training after step {rows[r][_STEPS]} ({_WHY.get(rows[r][_OP], 'it stopped')})"
                for r in stopped
            )
            self._finish()
            if failed:  # (the stopped ranks take no part in exchanging the messages)
                mine = f"; rank {self.rank} failed: {failure}" if failure is not None else ""
                others = [str(r) for r in failed if r != self.rank]
                self.over += mine + (f"; rank(s) {', '.join(others)} failed too" if others else "")
            raise DistributedError(self.over)
        if failed:
            messages = self.comm.allgather(failure)
            raise DistributedError("; ".join(f"rank {r} failed: {m}" for r, m in enumerate(messages) if m is not None))
        if any(row[_OP] != op for row in rows):
            raise DistributedError("the ranks are in different calls: " + _listing(
                f"rank {r} in {_OPS.get(row[_OP], '?')}()" for r, row in enumerate(rows)))
        if op == _BROADCAST:
            raise DistributedError("the ranks broadcast from different roots: " + _listing(
                f"rank {r}: root {row[_GLOBAL]}" for r, row in enumerate(rows)))
        settings = [row[_REDUCE:_GLOBAL] for row in rows]
        differ = [r for r, theirs in enumerate(settings) if theirs != settings[0]]
        if differ:
            raise DistributedError("the ranks' DataParallel settings differ: " + "; ".join(
                f"rank {r}: {_settings_text(settings[r])}" for r in [0] + differ[:3]))
        if any(row[_GLOBAL] != alike[_GLOBAL] for row in rows):
            raise DistributedError(
                "the ranks train on different global batches: "
                + _listing(f"rank {r}: {row[_GLOBAL]} examples" for r, row in enumerate(rows))
                + " (every rank passes the same global batch to train_step, or the same global_count "
                "to train_step_local)"
            )
        raise DistributedError(
            f"the ranks' shares add up to {sum(row[_COUNT] for row in rows)} examples, not to the global batch of "
            f"{alike[_GLOBAL]}: " + _listing(f"rank {r}: {row[_COUNT]}" for r, row in enumerate(rows))
        )

    def goodbye(self, why) -> None:
        """Tell every other rank this one trains no more, and wait (at most timeout)
        until they heard it: in their next agreement, which raises DistributedError
        there, or in their own goodbye."""
        if self.over is not None:  # finished already (or stuck: no collective can follow)
            return
        self.over = f"rank {self.rank} closed this trainer after step {self.steps}"
        mine = np.zeros(len(_FIELDS), np.int64)
        mine[[_STATE, _OP, _STEPS]] = (_STOPPING, why, self.steps)
        every = np.zeros_like(self.every)
        request = self.comm.Iallgather(mine, every)
        if _wait(request, self.timeout):
            self._finish()
            return
        self.pending = (request, mine, every)
        atexit.unregister(self.at_exit)
        sys.stderr.write(
            f"rank {self.rank}: DataParallel: the other ranks did not come to hear that this rank stopped "
            f"training within {self.timeout:g} s; going on without them\n"
        )
        sys.stderr.flush()

    def _finish(self) -> None:
        """Every rank has seen the end of this trainer: release the communicator."""
        atexit.unregister(self.at_exit)
        if not self.MPI.Is_finalized():
            self.comm.Free()

    def at_exit(self) -> None:
        """The program ends: say goodbye if the trainer is still open; abort the job if
        an agreement never completed (a peer may be stuck for good, and MPI_Finalize
        would wait for it)."""
        if self.MPI.Is_finalized():
            return
        if self.stuck:
            sys.stderr.write(
                f"rank {self.rank}: a DataParallel step never got its answer from the other ranks; "
                "aborting every rank so that none waits for another forever\n"
            )
            sys.stderr.flush()
            self.comm.Abort(1)
        self.goodbye(_EXITED)


def _settings_text(row) -> str:
    reduce = _REDUCES[row[0]] if 0 <= row[0] < len(_REDUCES) else "?"
    return f"reduce={reduce!r}, overlap={bool(row[1])}, bucket_bytes={row[2]}"


class DataParallel:
    """One generated Model trained data-parallel over the ranks of `comm`.

    reduce: "mean" (the loss is a mean over the batch, as the DSL's losses are:
    each rank's gradient is weighted by its share of the global batch) or "sum"
    (a loss summed over the batch: gradients are added). overlap: while the
    backward pass goes on, start a non-blocking allreduce of the gradients it has
    completed as soon as they lie side by side in the gradient buffer and hold at
    least bucket_bytes (one gradient at a time on a target without the buffer);
    what is left, all of it without overlap, is reduced with one blocking
    allreduce after the backward pass. reduce, overlap and bucket_bytes must be
    the same on every rank (each step checks).

    timeout: the most seconds a step (or broadcast, or goodbye) waits for the other
    ranks to arrive (None: for ever). A rank that waited that long raises
    DistributedError; its trainer cannot go on, and its process aborts the MPI job
    when it ends. The default, 10 minutes, leaves room for one rank's evaluation or
    checkpoint between steps.

    close(), or leaving `with DataParallel(...) as trainer:`, says goodbye: the other
    ranks' next train_step raises DistributedError("rank 1 stopped training after
    step 12 (...)") instead of waiting. A program that ends without close() says it
    at exit.
    """

    def __init__(self, model, comm=None, reduce: str = "mean", overlap: bool = True, abort_uncaught: bool = True,
                 bucket_bytes: int = 1 << 20, timeout: float | None = DEFAULT_TIMEOUT_S):
        self.MPI = _mpi()
        self.comm = comm if comm is not None else self.MPI.COMM_WORLD
        if reduce not in _REDUCES:
            raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
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
        self._session = _Session(self.MPI, self.comm, timeout)
        self._check_same_model()
        self.broadcast()

    @property
    def timeout(self):
        return self._session.timeout

    @property
    def steps(self) -> int:
        """The steps this trainer has completed."""
        return self._session.steps

    # -- setup and the end ---------------------------------------------------------------

    def _check_same_model(self) -> None:
        """Every rank must hold the same model: names, shapes and optimizer."""
        mine = (type(self.model).__module__, [(n, a.shape) for n, a in self.model.gradients().items()],
                sorted(self.model.hyperparameters()))
        every = self._session.comm.allgather(mine)
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
        self._session.agree(_BROADCAST, global_count=root)
        comm = self._session.comm
        groups = [self.model.parameters(), self.model.optimizer_state()]
        if hasattr(self.model, "buffers"):
            groups.append(self.model.buffers())
        for group in groups:
            for name in sorted(group):
                comm.Bcast(group[name], root=root)
        settings = comm.bcast((self.model.step, self.model.hyperparameters()), root=root)
        self.model.step = settings[0]
        for name, value in settings[1].items():
            setattr(self.model, name, value)

    def close(self) -> None:
        """This rank trains no more with this trainer: tell the other ranks (their next
        train_step raises DistributedError naming this rank) and wait, at most timeout
        seconds, until each has heard it or closed too. Calling it again does nothing."""
        self._session.goodbye(_CLOSED)

    def __enter__(self) -> DataParallel:
        return self

    def __exit__(self, kind, value, tb) -> bool:
        self._session.goodbye(_LEFT_WITH if kind is None else _RAISED_IN_WITH)
        return False

    # -- a step --------------------------------------------------------------------------

    def train_step(self, **inputs) -> float:
        """One step on a global batch that every rank passes whole: this rank trains
        on its shard. Returns the global batch's loss (before the update)."""
        try:
            local = shard(inputs, self.rank, self.size)
        except Exception as e:  # the other ranks must hear of it: fail inside the step
            return self._step(None, 0, 0, e)
        return self._step(local, len(next(iter(local.values()))), len(next(iter(inputs.values()))), None)

    def train_step_local(self, count: int, global_count: int, **inputs) -> float:
        """One step on inputs this rank chose itself: `count` of the `global_count`
        examples of the global batch (its weight under reduce='mean'). Every rank
        passes the same global_count, and the ranks' counts add up to it."""
        error = None
        try:
            count, global_count = _index(count, "count"), _index(global_count, "global_count")
            if global_count < 1 or not 0 <= count <= global_count:
                raise ValueError(f"need 0 <= count <= global_count and global_count >= 1, got count={count}, "
                                 f"global_count={global_count}")
        except (TypeError, ValueError) as e:
            count, global_count, error = 0, 0, e
        return self._step(inputs, count, global_count, error)

    def _step(self, inputs, count: int, global_count: int, error) -> float:
        MPI = self.MPI
        comm = self._session.comm
        grads = self.model.gradients()
        requests, started, agreed = [], [], []
        settings = (_REDUCES.index(self.reduce) if self.reduce in _REDUCES else -1, int(bool(self.overlap)),
                    int(self.bucket_bytes))

        def agree(failure):
            """The step's first collective (_Session.agree). Every error a step can meet
            (inputs, labels, a non-finite loss) comes before the first gradient is
            complete, so before this point."""
            self._session.agree(_STEP, failure, settings, global_count, count)
            agreed.append(True)

        weight = 1.0
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
                comm.Allreduce(MPI.IN_PLACE, view, op=MPI.SUM)
                return
            requests.append(comm.Iallreduce(MPI.IN_PLACE, view, op=MPI.SUM))
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

        if self.reduce == "mean" and error is None:  # the agreement checks the shares add up to 1
            weight = count / global_count
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
        self._session.steps += 1
        return float(comm.allreduce(weight * loss if self.reduce == "mean" else loss, op=MPI.SUM))

    def _abort(self, why: str) -> None:
        sys.stderr.write(f"rank {self.rank} {why}; aborting every rank\n")
        sys.stderr.flush()
        self.comm.Abort(1)


def _index(value, name: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None


def _describe(error: BaseException) -> str:
    where = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ else []
    at = f" (at {where[0].filename}:{where[0].lineno})" if where and "generator/distributed" not in where[0].filename else ""
    return f"{type(error).__name__}: {error}{at}"
