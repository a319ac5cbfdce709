"""Data-parallel training: compute_gradients / gradient_buffer / apply_update
against train_step, and 2 MPI ranks against one process at the same global batch
(SGD, momentum, Adam), a failing rank, an uncaught error (no hang)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
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
    command, why = _mpirun()
    if command is None:
        pytest.skip(why)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    run = subprocess.run(command + [sys.executable, str(WORKER), str(where / "build"), module.__name__, *map(str, args)],
                         capture_output=True, text=True, timeout=timeout, env=env)
    return run.returncode, run.stdout + run.stderr


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


def test_a_failing_rank_stops_every_rank(built, tmp_path):
    kind, module, where = built
    if kind != "sgd":
        pytest.skip("one optimizer is enough")
    rc, log = _run_ranks(where, module, 4, 8, "1", tmp_path / "x.npz", "bad-input", timeout=120)
    assert rc != 0
    for rank in (0, 1):
        assert f"rank {rank} stopped: rank 1 failed: ValueError: input 'x'" in log, log
    rc, log = _run_ranks(where, module, 4, 8, "1", tmp_path / "x.npz", "uncaught", timeout=120)
    assert rc != 0 and "rank 1: uncaught RuntimeError; aborting every rank" in log, log


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
