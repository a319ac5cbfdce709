"""Data-parallel training: compute_gradients / gradient_buffer / apply_update
against train_step, and 2 MPI ranks against one process at the same global batch
(SGD, momentum, Adam), a failing rank, an uncaught error, a rank that stops early,
settings or batches that differ between ranks, a peer that never comes (no hang)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mpi_worker import batches
from test_training import OPTIMIZERS, _mlp

WORKER = Path(__file__).resolve().parent / "mpi_worker.py"


@pytest.fixture(scope="module", params=list(OPTIMIZERS))
def built(request, builds):
    module, where = builds.module(_mlp(request.param))
    return request.param, module, where


def _arrays(d):
    return {k: np.array(v) for k, v in d.items()}


def test_two_halves_equal_train_step(built):
    _, module, _ = built
    whole, halves = module.Model(seed=3), module.Model(seed=3)
    for inputs in batches(4, 10):
        expected = whole.train_step(**inputs)
        reported = []
        loss = halves.compute_gradients(reported.append, **inputs)
        assert loss == expected
        assert sorted(reported) == sorted(halves.gradients())  # each gradient reported once
        np.testing.assert_array_equal(halves.gradient_buffer(), np.concatenate(
            [g.ravel() for g in whole.gradients().values()]))
        halves.apply_update()
    assert halves.step == whole.step == 4
    for name, value in whole.parameters().items():
        np.testing.assert_array_equal(halves.parameters()[name], value, err_msg=name)
    for name, value in whole.optimizer_state().items():
        np.testing.assert_array_equal(halves.optimizer_state()[name], value, err_msg=name)


def test_compute_gradients_changes_nothing_and_update_reads_the_buffer(built):
    kind, module, _ = built
    model = module.Model(seed=4)
    inputs = batches(1, 6)[0]
    before, state = _arrays(model.parameters()), _arrays(model.optimizer_state())
    model.compute_gradients(**inputs)
    assert model.step == 0
    for name, value in before.items():
        np.testing.assert_array_equal(model.parameters()[name], value)
    for name, value in state.items():
        np.testing.assert_array_equal(model.optimizer_state()[name], value)
    buffer = model.gradient_buffer()
    grads = model.gradients()
    assert buffer.dtype == np.float32 and buffer.size == sum(g.size for g in grads.values())
    assert all(np.shares_memory(g, buffer) for g in grads.values())  # views into the one buffer
    # The update uses the gradients as they are at apply_update(): doubled here.
    buffer *= 2
    doubled = _arrays(grads)
    reference = module.Model(seed=4)
    reference.compute_gradients(**inputs)
    for name, g in reference.gradients().items():
        np.testing.assert_array_equal(doubled[name], 2 * g)
        g[...] = doubled[name]
    model.apply_update()
    reference.apply_update()
    for name, value in reference.parameters().items():
        np.testing.assert_array_equal(model.parameters()[name], value)
    first = next(iter(before))
    assert not np.array_equal(model.parameters()[first], before[first])


def test_compute_gradients_errors(built):
    _, module, _ = built
    model = module.Model(seed=5)
    inputs = batches(1, 6)[0]
    with pytest.raises(TypeError, match="on_ready must be callable"):
        model.compute_gradients(3, **inputs)

    def fails(name):
        raise KeyError(f"callback saw {name}")

    before = _arrays(model.parameters())
    with pytest.raises(KeyError, match="callback saw"):
        model.compute_gradients(fails, **inputs)
    with pytest.raises(ValueError, match="labels"):
        model.compute_gradients(x=inputs["x"], labels=inputs["labels"] + 10)
    for name, value in before.items():
        np.testing.assert_array_equal(model.parameters()[name], value)
    assert model.step == 0


# ---- over MPI ------------------------------------------------------------------------


def _mpirun():
    """The mpirun command for 2 local ranks, or a skip reason."""
    try:
        from mpi4py import MPI  # noqa: F401
    except (ImportError, RuntimeError) as e:
        return None, f"mpi4py with an MPI library is needed ({e})"
    launcher = shutil.which("mpirun")
    if launcher is None:
        return None, "mpirun is not installed (apt-get install openmpi-bin)"
    return [launcher, "-n", "2", "--oversubscribe", "--mca", "btl", "self,vader"], ""


def _run_ranks(where, module, *args, timeout=180):
    """Run tests/mpi_worker.py on 2 ranks: (exit status, stdout and stderr). Ranks still
    running after `timeout` seconds are a hang: they are ended and the test fails."""
    command, why = _mpirun()
    if command is None:
        pytest.skip(why)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    run = subprocess.Popen(command + [sys.executable, str(WORKER), str(where / "build"), module.__name__,
                                      *map(str, args)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        out, _ = run.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        run.terminate()  # mpirun passes SIGTERM on to the ranks (a SIGKILL would leave them running)
        try:
            out, _ = run.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            run.kill()
            out, _ = run.communicate()
        pytest.fail(f"the ranks still ran after {timeout} s (a hang):\n{out}")
    return run.returncode, out


@pytest.mark.parametrize("overlap", ["1", "each", "0"])
def test_two_ranks_equal_one_process(built, overlap, tmp_path):
    kind, module, where = built
    steps, batch = 5, 51  # ranks get 26 and 25 examples: the weighting matters
    out = tmp_path / "ranks.npz"
    rc, log = _run_ranks(where, module, steps, batch, overlap, out)
    assert rc == 0, log
    single = module.Model(seed=11)
    losses = [single.train_step(**inputs) for inputs in batches(steps, batch)]
    got = np.load(out)
    np.testing.assert_allclose(got["losses"], losses, rtol=1e-5)
    for name, value in single.parameters().items():
        np.testing.assert_allclose(got[f"param/{name}"], value, rtol=1e-5, atol=1e-5, err_msg=f"{kind}: {name}")


def test_a_failing_rank_stops_every_rank(sgd, tmp_path):
    module, where = sgd
    rc, log = _run_ranks(where, module, 4, 8, "1", tmp_path / "x.npz", "bad-input", timeout=120)
    assert rc != 0
    for rank in (0, 1):
        assert f"rank {rank} stopped: rank 1 failed: ValueError: input 'x'" in log, log
    rc, log = _run_ranks(where, module, 4, 8, "1", tmp_path / "x.npz", "uncaught", timeout=120)
    assert rc != 0 and "rank 1: uncaught RuntimeError; aborting every rank" in log, log


def _seconds(log, before):
    """The number of seconds the worker printed after `before` ("... after 0.01 s: ...")."""
    assert before in log, log
    return float(log.split(before)[1].split(" s")[0])


@pytest.fixture(scope="module")
def sgd(builds):
    """The SGD model alone (one optimizer is enough for the failure cases): (module, where)."""
    return builds.module(_mlp("sgd"))


def test_a_rank_whose_program_ends_early_stops_the_others(sgd, tmp_path):
    """Rank 1 trains 2 of 5 steps and its program ends without close(): its exit says
    goodbye, so rank 0's step 3 raises DistributedError at once (the default timeout is
    600 s), and so does any later step, without a collective."""
    module, where = sgd
    rc, log = _run_ranks(where, module, 5, 8, "1", tmp_path / "x.npz", "early-exit", timeout=60)
    assert rc == 0, log
    said = "rank 1 stopped training after step 2 (its program ended without close())"
    assert f"s: {said}" in log and f"DistributedError: {said}" in log, log
    assert _seconds(log, "rank 0 stopped after ") < 10 and _seconds(log, "rank 0 again after ") < 1, log
    assert "finished every step" not in log, log


def test_leaving_the_with_block_says_goodbye(sgd, tmp_path):
    """Rank 1 leaves `with DataParallel(...)` after step 2 and lives on, waiting for rank 0:
    rank 0's next step raises DistributedError, so rank 0 can send it the message it waits for."""
    module, where = sgd
    rc, log = _run_ranks(where, module, 5, 8, "1", tmp_path / "x.npz", "with-early", timeout=60)
    assert rc == 0, log
    assert "rank 0 stopped: rank 1 stopped training after step 2 (it left its `with DataParallel(...)` block)" in log
    assert "rank 1 left its with-block; then got: rank 0 heard it" in log, log


def test_settings_and_batches_that_differ_between_ranks_are_refused(sgd, tmp_path):
    """reduce, bucket_bytes or overlap that differ between the ranks, different global
    batches, and shares that do not add up to the global batch: every rank raises
    DistributedError in that step (before any gradient is exchanged: no parameter
    changes), and close() on both ranks ends each trainer cleanly."""
    module, where = sgd
    rc, log = _run_ranks(where, module, 1, 8, "1", tmp_path / "x.npz", "mismatch", timeout=60)
    assert rc == 0, log
    expected = {
        "reduce": "rank 1: reduce='sum', overlap=True, bucket_bytes=1048576",
        "bucket_bytes": "rank 1: reduce='mean', overlap=True, bucket_bytes=0",
        "overlap": "rank 1: reduce='mean', overlap=False, bucket_bytes=1048576",
        "global batch": "the ranks train on different global batches: rank 0: 8 examples, rank 1: 7 examples",
        "global count": "the ranks train on different global batches: rank 0: 8 examples, rank 1: 14 examples",
        "shares": "the ranks' shares add up to 7 examples, not to the global batch of 8: rank 0: 4, rank 1: 3",
    }
    for label, message in expected.items():
        for rank in (0, 1):
            assert f"{label}: rank {rank}: " in log and message in log, (label, log)
            assert f"{label}: rank {rank} parameters unchanged" in log, (label, log)
            assert f"{label}: rank {rank} trained" not in log, (label, log)
    for label in ("reduce", "bucket_bytes", "overlap"):
        assert f"{label}: rank 0: the ranks' DataParallel settings differ: rank 0: reduce='mean', overlap=True, " \
               "bucket_bytes=1048576; " in log, log
    assert "rank 0 trained after the mismatches" in log and "rank 1 trained after the mismatches" in log, log


def test_a_peer_that_never_comes_times_out_and_aborts_the_job(sgd, tmp_path):
    """Rank 1 leaves its loop without close() and waits in a barrier of its own: rank 0
    (timeout=1) raises DistributedError after 1 s, at once on a second try, and its
    process's end aborts the job instead of waiting in MPI_Finalize for rank 1."""
    module, where = sgd
    started = time.monotonic()
    rc, log = _run_ranks(where, module, 5, 8, "1", tmp_path / "x.npz", "timeout", timeout=60)
    assert rc != 0, log
    assert "rank 0 waited 1 s at the start of step 2" in log, log
    assert 1 <= _seconds(log, "rank 0 stopped after ") < 10 and _seconds(log, "rank 0 again after ") < 1, log
    assert "aborting every rank" in log and "rank 1 passed its barrier" not in log, log
    assert time.monotonic() - started < 30, log


def test_digits_mpi_example_trains_like_one_process(builds):
    """examples/digits_mpi.py on 2 ranks prints the losses a single process training at
    the same global batch prints (examples/digits.py's loop)."""
    pytest.importorskip("sklearn")
    import runpy

    from conftest import ROOT

    command, why = _mpirun()
    if command is None:
        pytest.skip(why)
    example = runpy.run_path(str(ROOT / "examples" / "digits.py"))
    module, where = builds.module(example["digits"].build())
    single = []
    example["train"](module, epochs=3, batch=64, log=single.append)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    run = subprocess.run(command + [sys.executable, str(ROOT / "examples" / "digits_mpi.py"), "--epochs", "3",
                                    "--module-dir", str(where / "build")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [line for line in run.stdout.splitlines() if line.startswith(("epoch", "held-out"))]
    assert len(lines) == 4, run.stdout  # rank 0 alone prints
    for got, expected in zip(lines, single):
        if got.startswith("epoch"):
            assert abs(float(got.split()[-1]) - float(expected.split()[-1])) <= 2e-4, (got, expected)
    assert float(lines[-1].split()[2]) >= 0.9
