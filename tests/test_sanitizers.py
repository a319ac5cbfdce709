"""Every example built with AddressSanitizer + UndefinedBehaviorSanitizer, then run
in a child process: (a) the generated project's own tests; (b) a batch of calls:
the module_checks checks, then bad inputs (wrong dtypes, ranks, sizes, layouts,
NaN/inf, empty and huge arrays, out-of-range ids, tree batches with bad children,
cycles, bad roots, odd nested trees), large batches, forward/train_step, save/load
and threads sharing a Model; (c) each input at an unaligned address; (d) train_step
at the largest step count. A child must exit 0 and print no sanitizer report; in (b)
every documented refusal must also be a ValueError.

The instrumented builds (model and kernels at -O1 -g1, the pybind11 bindings at -O0,
no example program) are cached like conftest's builds, under their own key
(`<name>-<hash>-asan`). The extension is instrumented but Python is not, so the
child runs with g++'s libasan and libubsan in LD_PRELOAD (leak checking off: Python
itself never frees some memory at exit). Without those runtimes, or where they do
not start, the tests skip.

A failure can be reproduced by hand, from the repository root:

    LD_PRELOAD="$(g++ -print-file-name=libasan.so) $(g++ -print-file-name=libubsan.so)" \\
    ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \\
    python tests/test_sanitizers.py EXAMPLE BUILD_DIR [--unaligned]

with BUILD_DIR the cached project's `build` folder (the failure message names it).
The child prints `== step` before each step, so the last one shown is the culprit.

Not seen by ASan: an overrun that stays inside memory the runtime owns, e.g. a
piece of the arena (dg::Arena) or a dg::Scratch block, which can be up to twice as
large as asked (blocks are reused between calls).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import re
import shutil
import subprocess
import sys
import threading
import traceback
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, _cache_root, build_example, child_env
from generator.tools.build import cmake_build

from conftest import EXAMPLES  # noqa: E402  (the example model files)

# float-cast-overflow is not part of -fsanitize=undefined in GCC (NaN -> int is UB);
# vptr is: it only slows the pybind11 code's compile down, and the generated code
# has no virtual classes to check.
SANITIZE = ("-fsanitize=address,undefined,float-cast-overflow -fno-sanitize=vptr "
            "-fno-sanitize-recover=all -fno-omit-frame-pointer")
OPT = "-O1 -g1"  # -g1: file:line in the reports at a fraction of -g's compile time
REPORT = re.compile(r"ERROR: AddressSanitizer|ERROR: LeakSanitizer|runtime error:|SUMMARY: \w+Sanitizer")
CHILD_TIMEOUT_S = 300


# -- the toolchain and the environment the children run in ----------------------


def _compiler():
    """(g++, [libasan.so, libubsan.so]), or a reason why there are none. GCC only:
    the runtimes LD_PRELOAD needs must be the ones the module was linked with."""
    cxx = shutil.which("g++")
    if cxx is None:
        return None, "no g++ on PATH"
    libs = []
    for lib in ("libasan.so", "libubsan.so"):
        found = subprocess.run([cxx, f"-print-file-name={lib}"], capture_output=True, text=True).stdout.strip()
        if not os.path.isabs(found) or not os.path.exists(found):  # g++ prints the bare name when it has none
            return None, f"g++ has no {lib}"
        libs.append(os.path.realpath(found))
    return cxx, libs


@pytest.fixture(scope="session")
def sanitizer_env():
    cxx, libs = _compiler()
    if cxx is None:
        pytest.skip(f"sanitizers unavailable: {libs}")
    env = child_env(LD_PRELOAD=" ".join(libs),
                    ASAN_OPTIONS="detect_leaks=0:abort_on_error=0:strict_string_checks=1:detect_stack_use_after_return=1",
                    UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1", PYTHONDONTWRITEBYTECODE="1",
                    OMP_NUM_THREADS="2")
    env.pop("PYTHONPATH", None)
    probe = subprocess.run([sys.executable, "-c", "import numpy; print('ok')"], env=env, capture_output=True,
                           text=True, timeout=120)
    if probe.returncode != 0 or probe.stdout.strip() != "ok":  # e.g. ASan cannot map its shadow memory here
        pytest.skip(f"the ASan runtime does not start under this Python: {(probe.stdout + probe.stderr)[-600:]}")
    return {"cxx": cxx, "env": env}


# Under the sanitizers pybind11's code compiles slowly at -O1: the bindings, which
# only check and convert inputs, are compiled at -O0 (about two thirds of the time;
# ASan checks -O0 code fully). The model and the kernels stay at -O1.
PROJECT_INCLUDE = """# deepgen's sanitizer tests (tests/test_sanitizers.py): bindings at -O0.
set_source_files_properties(src/bindings.cpp PROPERTIES COMPILE_OPTIONS -O0)
"""


def _configure_args(cxx: str, name: str, flags: str = SANITIZE) -> list:
    """CMake settings of an instrumented build (cmake_build puts them last, so they
    override its Release)."""
    return [f"-DCMAKE_CXX_COMPILER={cxx}", "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
            f"-DCMAKE_CXX_FLAGS_RELWITHDEBINFO={OPT}", f"-DCMAKE_CXX_FLAGS={flags}",
            # every link, the try_compile checks (-march=native, OpenMP) included, needs the runtimes
            f"-DCMAKE_EXE_LINKER_FLAGS={flags}", f"-DCMAKE_SHARED_LINKER_FLAGS={flags}",
            f"-DCMAKE_MODULE_LINKER_FLAGS={flags}", f"-D{name.upper()}_EXAMPLE=OFF"]


class AsanBuilds:
    """Instrumented builds of the examples, cached across sessions under
    `<name>-<hash>-asan` next to conftest's builds. The first request renders every
    example the session wants and compiles those not cached, two at a time (one
    job each; two jobs when only one needs building), while the tests of the
    finished ones run."""

    def __init__(self, cxx: str, names: list):
        from concurrent.futures import ThreadPoolExecutor

        self.cxx, self.names = cxx, names
        self.version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
        self.pool = ThreadPoolExecutor(max_workers=2)
        self.futures = {}

    def project(self, name: str) -> Path:
        """The folder holding src_tree/ and build/ of example `name`."""
        if name not in self.futures:
            self._start([name] + [n for n in self.names if n != name and n not in self.futures])
        return self.futures[name].result()

    def close(self):
        self.pool.shutdown(wait=True, cancel_futures=True)

    def _start(self, names):
        from concurrent.futures import Future

        from generator.codegen.writer import write_project
        from generator.pipeline import project_files

        todo = []
        for name in names:  # rendering traces the DSL (one global builder): here, not in the pool
            graph = build_example(name)
            files = project_files(graph)  # as conftest's builds
            digest = hashlib.sha256()
            for rel, data in files.items():
                digest.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
            settings = [sys.version, self.version, PROJECT_INCLUDE, *_configure_args(self.cxx, graph.name)]
            digest.update("\0".join(settings).encode())
            cached = _cache_root() / f"{name}-{digest.hexdigest()[:16]}-asan"
            if (cached / "build" / ".ok").is_file():
                self.futures[name] = Future()
                self.futures[name].set_result(cached)
                continue
            # Built beside its cache folder, then renamed: a temporary folder elsewhere
            # could be cleaned up under a running build, and the rename is atomic.
            staging = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
            shutil.rmtree(staging, ignore_errors=True)
            staging.parent.mkdir(parents=True, exist_ok=True)
            write_project(staging / "src_tree", files, force=True)
            (staging / "asan.cmake").write_text(PROJECT_INCLUDE)
            # -ffile-prefix-map: stack traces name the files of the cache folder, not the staging one's
            args = _configure_args(self.cxx, graph.name, f"{SANITIZE} -ffile-prefix-map={staging}={cached}")
            args.append(f"-DCMAKE_PROJECT_INCLUDE={staging / 'asan.cmake'}")
            todo.append((name, staging, cached, args))
        for name, staging, cached, args in todo:
            jobs = 2 if len(todo) == 1 else 1
            self.futures[name] = self.pool.submit(self._build, staging, cached, args, jobs)

    @staticmethod
    def _build(staging: Path, cached: Path, args: list, jobs: int) -> Path:
        try:
            cmake_build(staging / "src_tree", staging / "build", jobs=jobs, extra_args=args)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        (staging / "build" / ".ok").write_text("ok\n")
        try:
            staging.rename(cached)
        except OSError:  # another session cached the same build first, or a stale folder is in the way
            if (cached / "build" / ".ok").is_file():
                shutil.rmtree(staging, ignore_errors=True)
                return cached
            return staging
        return cached


@pytest.fixture(scope="session")
def asan_builds(request, sanitizer_env):
    wanted = [item.callspec.params["asan_example"] for item in request.session.items
              if "asan_example" in getattr(getattr(item, "callspec", None), "params", {})]
    builds = AsanBuilds(sanitizer_env["cxx"], list(dict.fromkeys(wanted)))
    yield builds
    builds.close()


@pytest.fixture(scope="module", params=EXAMPLES)
def asan_example(request, sanitizer_env, asan_builds):
    graph = build_example(request.param)
    where = asan_builds.project(request.param)
    built = list((where / "build").glob(f"{graph.name}*.so"))
    assert built and b"__asan_report" in built[0].read_bytes(), f"{built}: not instrumented"
    return graph, where, sanitizer_env["env"], request.param


def _run_child(cmd, env, cwd) -> str:
    try:
        proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(map(str, cmd))}: no result after {CHILD_TIMEOUT_S} s:\n{(e.stdout or '')[-3000:]}")
    out = proc.stdout + proc.stderr
    report = REPORT.search(out)
    where = f"{' '.join(map(str, cmd))} (in {cwd}) exited {proc.returncode}"
    assert report is None, f"{where} with a sanitizer report:\n{out[max(0, report.start() - 3000):][:12000]}"
    assert proc.returncode == 0, f"{where}:\n{out[-8000:]}"
    return out


def test_generated_project_tests_pass_under_sanitizers(asan_example):
    """(a) The project's own tests/test_model.py, as test_examples.py runs it."""
    graph, where, env, _ = asan_example
    tests = where / "src_tree" / "tests"
    out = _run_child([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)],
                     dict(env, PYTHONPATH=str(where / "build")), where)
    assert re.search(r"\d+ passed", out) and "failed" not in out, out[-3000:]


def test_bad_inputs_and_calls_under_sanitizers(asan_example):
    """(b) The batch of calls below (_child), in a child process."""
    graph, where, env, example = asan_example
    out = _run_child([sys.executable, __file__, example, str(where / "build")], env, ROOT)
    assert f"sanitizer child {graph.name}: done" in out, out[-3000:]


def test_step_count_at_its_limit_under_sanitizers(asan_example):
    """train_step with model.step at INT64_MAX (set, or loaded from a weights file):
    a ValueError, or a step, without signed overflow. A test of its own, so that a
    failure here does not hide the batch's."""
    graph, where, env, example = asan_example
    if graph.train is None:
        pytest.skip(f"{graph.name} is not trainable")
    out = _run_child([sys.executable, __file__, example, str(where / "build"), "--step-limit"], env, ROOT)
    assert f"sanitizer child {graph.name}: done" in out, out[-3000:]


def test_unaligned_inputs_under_sanitizers(asan_example):
    """(c) Each input in turn as a C-contiguous array at an odd address: refused with
    a ValueError, or computed without undefined behaviour (reading a float or an
    int64 at a misaligned address is)."""
    graph, where, env, example = asan_example
    out = _run_child([sys.executable, __file__, example, str(where / "build"), "--unaligned"], env, ROOT)
    assert f"sanitizer child {graph.name}: done" in out, out[-3000:]


# -- the child: python tests/test_sanitizers.py EXAMPLE BUILD_DIR [--unaligned | --step-limit]


INT64_MAX, INT64_MIN = 2**63 - 1, -(2**63)
REFUSED = "refused"  # the call must raise ValueError
EITHER = "either"  # a result or a ValueError; what matters is that nothing goes wrong in memory
ANY = "any"  # a result or any exception (e.g. OSError, TypeError)


class Calls:
    """Runs calls, prints each step first (the last one printed is the culprit of a
    crash), and collects the calls whose outcome broke the contract."""

    def __init__(self):
        self.problems, self.count = [], 0

    def step(self, what):
        print(f"== {what}", flush=True)

    def expect(self, what, outcome, fn):
        self.step(what)
        self.count += 1
        try:
            fn()
        except ValueError:
            return
        except Exception as e:  # noqa: BLE001
            if outcome != ANY:
                self.problems.append(f"{what}: {type(e).__name__}: {e}")
            return
        if outcome == REFUSED:
            self.problems.append(f"{what}: accepted, expected a ValueError")

    def check(self, what, fn, *args):
        """A module_checks function: it must pass."""
        self.step(what)
        self.count += 1
        try:
            fn(*args)
        except Exception:  # noqa: BLE001
            self.problems.append(f"{what}:\n{traceback.format_exc()}")


def _changed(a, axis, n):
    shape = list(a.shape)
    shape[axis] = n
    return np.resize(a, shape) if n > 0 else np.zeros(shape, a.dtype)


def _unaligned(a):
    buf = np.zeros(a.nbytes + 1, np.uint8)
    out = buf[1:].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def _input_cases(graph, good):
    """(input name, what, outcome, inputs) for every input of the model."""
    for v in graph.inputs:
        x = good[v.name]
        other = np.int32 if x.dtype == np.int64 else np.float64

        def with_(value, _name=v.name):
            return dict(good, **{_name: value})

        yield v.name, f"{v.name}: dtype {np.dtype(other)}", REFUSED, with_(x.astype(other))
        yield v.name, f"{v.name}: dtype float16", REFUSED, with_(x.astype(np.float16))
        yield v.name, f"{v.name}: a 0-d array", REFUSED, with_(np.array(x.reshape(-1)[0]))
        yield v.name, f"{v.name}: one dimension more", REFUSED, with_(x[..., None])
        if x.ndim > 1:
            yield v.name, f"{v.name}: one dimension less", REFUSED, with_(x.reshape(-1))
        # (numpy calls an axis of length 1 contiguous whatever its stride)
        yield v.name, f"{v.name}: every other element", REFUSED if x.shape[-1] > 1 else EITHER, with_(
            np.repeat(x, 2, axis=-1)[..., ::2])
        yield v.name, f"{v.name}: reversed", REFUSED if x.shape[0] > 1 else EITHER, with_(x[::-1])
        if x.ndim > 1 and x.shape[0] > 1 and x.shape[1] > 1:
            yield v.name, f"{v.name}: Fortran order", REFUSED, with_(np.asfortranarray(x))
        yield v.name, f"{v.name}: broadcast (stride 0)", EITHER, with_(np.broadcast_to(x[:1], x.shape))
        yield v.name, f"{v.name}: read-only", EITHER, with_(_readonly(x))
        yield v.name, f"{v.name}: None", REFUSED, with_(None)
        yield v.name, f"{v.name}: a list", REFUSED, with_(x.tolist())
        for axis in range(x.ndim):
            yield v.name, f"{v.name}: empty along axis {axis}", REFUSED, with_(_changed(x, axis, 0))
            longer = _changed(x, axis, x.shape[axis] + 1)  # a symbolic size may change alone
            yield v.name, f"{v.name}: one more along axis {axis}", EITHER, with_(longer)
            if x.ndim > 1:  # holds no data, but its shape multiplies past int64
                huge = list(x.shape)
                huge[axis], huge[(axis + 1) % x.ndim] = 2**40, 0
                yield v.name, f"{v.name}: huge and empty {huge}", REFUSED, with_(np.empty(huge, x.dtype))
        if x.dtype == np.float32:
            for value in (np.nan, np.inf, -np.inf, 3e38, 1e-45):
                yield v.name, f"{v.name}: all {value}", EITHER, with_(np.full_like(x, value))
        else:
            for value in (-1, -2, x.max() + 1000, INT64_MAX, INT64_MIN):
                bad = x.copy()
                bad.reshape(-1)[-1] = value
                yield v.name, f"{v.name}: an id {value}", EITHER, with_(bad)
        yield v.name, f"{v.name}: zeros", EITHER, with_(np.zeros_like(x))


def _readonly(a):
    a = np.array(a, copy=True)
    a.flags.writeable = False
    return a


def _tree_cases(graph, node):
    """(what, outcome, inputs) for the batch inputs of the recursive op `node`."""
    from generator.reference.samples import id_limit
    from generator.treebatch import from_nested, random_batch

    spec = node.attrs["spec"]
    names = [v.name for v in node.inputs[:3]]
    vocab = id_limit(graph, node.inputs[1])
    arity = spec.arity

    def batch(b):
        return dict(zip(names, (b["children"], b["words"], b["roots"])))

    def base():  # nodes: 0, 1 leaves; 2 = (0, 1); 3 leaf; 4 = (2, 3); 5 a single-node tree
        b = from_nested([((1,),), 4, 2] if arity == 1 else [((1, 2), 3), 4], arity)
        b["words"][b["words"] < 0] = 0
        return b

    def changed(**edits):
        b = base()
        for key, (index, value) in edits.items():
            b[key][index] = value
        return batch(b)

    n = len(base()["words"])
    last = base()["roots"][0]  # a root with children
    first_parent = int(np.flatnonzero((base()["children"] >= 0).any(axis=1))[0])
    yield "the base batch", EITHER, batch(base())
    for value in (n, n + 1000, -2, INT64_MAX, INT64_MIN):
        yield f"a child {value}", REFUSED, changed(children=((first_parent, 0), value))
    yield "a node its own child", REFUSED, changed(children=((first_parent, 0), first_parent))
    yield "a two-node cycle", REFUSED, changed(children=((0, 0), first_parent))
    cyc = base()
    cyc["children"] = np.full((n + 2, arity), -1, np.int64)
    cyc["children"][n, 0], cyc["children"][n + 1, 0] = n + 1, n  # a cycle no root reaches
    cyc["words"] = np.zeros(n + 2, np.int64)
    yield "a cycle off the trees", REFUSED, batch(cyc)
    if arity > 1:
        shared = base()
        shared["children"][last, arity - 1] = shared["children"][first_parent, 0]
        yield "a child with two parents", EITHER if spec.dag else REFUSED, batch(shared)
    for value in (n, -1, INT64_MAX, INT64_MIN):
        yield f"a root {value}", REFUSED, changed(roots=(0, value))
    yield "a root that has a parent", EITHER if spec.dag else REFUSED, changed(roots=(0, first_parent))
    b = base()
    yield "no roots", REFUSED, batch(dict(b, roots=np.zeros(0, np.int64)))
    yield "no nodes", REFUSED, batch({"children": np.zeros((0, arity), np.int64), "words": np.zeros(0, np.int64),
                                      "roots": np.zeros(1, np.int64)})
    yield "words one short", REFUSED, batch(dict(b, words=b["words"][:-1]))
    yield "children of the wrong arity", REFUSED, batch(dict(b, children=np.full((n, arity + 1), -1, np.int64)))
    yield "children as int32", REFUSED, batch(dict(b, children=b["children"].astype(np.int32)))
    strided = np.repeat(b["children"], 2, axis=-1)[..., ::2]
    yield "children every other", REFUSED, batch(dict(b, children=strided))
    for value in (vocab, vocab + 10**6, -1, -2, INT64_MAX, INT64_MIN):
        yield f"a leaf's word {value}", EITHER, changed(words=(0, value))
        yield f"an internal node's word {value}", EITHER, changed(words=(last, value))
    yield "every node a leaf", EITHER, batch(dict(b, children=np.full_like(b["children"], -1),
                                                  roots=np.arange(n, dtype=np.int64)))
    yield "the same root twice", EITHER, batch(dict(b, roots=np.array([last, last], np.int64)))
    chain = np.full((300, arity), -1, np.int64)
    chain[1:, 0] = np.arange(299)
    yield "a chain of 300", EITHER, batch({"children": chain, "words": np.arange(300, dtype=np.int64) % vocab,
                                            "roots": np.array([299], np.int64)})
    yield "5000 single-node trees", EITHER, batch({"children": np.full((5000, arity), -1, np.int64),
                                                   "words": np.arange(5000, dtype=np.int64) % vocab,
                                                   "roots": np.arange(5000, dtype=np.int64)})
    wide = random_batch(np.random.default_rng(4), 60, arity, vocab, 1, 12, dag=spec.dag)
    yield "60 random trees", EITHER, batch(wide)


def _big_inputs(graph):
    """A large batch: every symbolic dim of a plain input grown to 500 or more."""
    from generator.reference.samples import sample_dims, sample_inputs

    if any(n.op == "recurse" for n in graph.nodes):
        return None
    dims = {d: 500 + 7 * i for i, d in enumerate(sample_dims(graph))}
    return sample_inputs(graph, dims, seed=9)


def _report(name, calls) -> int:
    for problem in calls.problems:
        print(f"PROBLEM {problem}", flush=True)
    print(f"sanitizer child {name}: {'done' if not calls.problems else 'problems'}, {calls.count} calls, "
          f"{len(calls.problems)} problems", flush=True)
    return 1 if calls.problems else 0


def _child_unaligned(name, graph, module) -> int:
    from generator.reference.samples import sample_inputs

    calls, model, good = Calls(), module.Model(seed=3), sample_inputs(graph)
    for v in graph.inputs:
        inputs = dict(good, **{v.name: _unaligned(good[v.name])})
        calls.expect(f"forward, {v.name} unaligned", EITHER, lambda inputs=inputs: model.forward(**inputs))
        if graph.train is not None:
            calls.expect(f"train_step, {v.name} unaligned", EITHER,
                         lambda inputs=inputs: model.train_step(**inputs))
    return _report(name, calls)


def _child_step_limit(name, graph, module, tmp_path: Path) -> int:
    from generator.reference.samples import sample_inputs

    calls, good = Calls(), sample_inputs(graph)
    model = module.Model(seed=3)
    model.train_step(**good)

    def set_and_train():
        model.step = INT64_MAX
        model.train_step(**good)

    calls.expect("step = INT64_MAX, train_step", EITHER, set_and_train)
    model = module.Model(seed=3)
    model.train_step(**good)
    model.save(str(tmp_path / "w.npz"))
    saved = dict(np.load(tmp_path / "w.npz"))
    np.savez(tmp_path / "max.npz", **dict(saved, **{"optimizer/step": np.int64(INT64_MAX)}))

    def load_and_train():
        other = module.Model(seed=4)
        other.load(str(tmp_path / "max.npz"))
        other.train_step(**good)

    calls.expect("load a step of INT64_MAX, train_step", EITHER, load_and_train)
    return _report(name, calls)


def _child(name: str, build: str, mode: str, tmp_path: Path) -> int:
    graph = build_example(name)
    name = graph.name  # the module's name: `<example>_small` for those in conftest.SMALL
    sys.path.insert(0, build)
    module = importlib.import_module(name)
    print(f"sanitizer child {name}: {module.__file__}, {module.build_info()}", flush=True)
    if mode == "--unaligned":
        return _child_unaligned(name, graph, module)
    if mode == "--step-limit":
        return _child_step_limit(name, graph, module, tmp_path)
    return _child_batch(name, graph, module, tmp_path)


def _child_batch(name, graph, module, tmp_path: Path) -> int:
    import module_checks as mc
    from generator.reference.samples import sample_inputs

    calls = Calls()
    train = graph.train is not None

    calls.check("check_forward(1)", mc.check_forward, graph, module, 1)
    calls.check("check_forward(7)", mc.check_forward, graph, module, 7)
    calls.check("check_init", mc.check_init, graph, module)
    calls.check("check_parameter_views", mc.check_parameter_views, graph, module)
    (tmp_path / "save_load").mkdir(exist_ok=True)
    calls.check("check_save_load", mc.check_save_load, graph, module, tmp_path / "save_load")
    calls.check("check_bad_inputs", mc.check_bad_inputs, graph, module)
    # The newer module checks, where this checkout has them (not check_threads_share_a_model:
    # its 900 train_steps take a minute here; the threads step at the end is a smaller one).
    (tmp_path / "load").mkdir(exist_ok=True)
    newer = [("check_load_validates_everything_first", (graph, module, tmp_path / "load"))]
    if train:
        newer += [("check_hyperparameters_are_validated", (module,)),
                  ("check_non_finite_loss_changes_nothing", (graph, module))]
    for check, args in newer:
        if hasattr(mc, check):
            calls.check(check, getattr(mc, check), *args)

    model = module.Model(seed=3)
    good = sample_inputs(graph)
    forward_names = set(good)
    if train:
        from generator.transforms.autodiff import train_only_inputs

        forward_names -= {v.name for v in train_only_inputs(graph)}
    for input_name, what, outcome, inputs in _input_cases(graph, good):
        # forward() accepts the training-only inputs (labels) too, but need not read them
        calls.expect(f"forward, {what}", outcome if input_name in forward_names else EITHER,
                     lambda inputs=inputs: model.forward(**inputs))
        if train:
            calls.expect(f"train_step, {what}", outcome, lambda inputs=inputs: model.train_step(**inputs))
    # Batches of trees (a scan's lengths are ids above: out of range, zero, negative, extremes).
    for node in [n for n in graph.nodes if n.op == "recurse" and not n.attrs["spec"].sequences]:
        for what, outcome, inputs in _tree_cases(graph, node):
            full = dict(good, **inputs)
            calls.expect(f"forward, trees: {what}", outcome, lambda full=full: model.forward(**full))
        convert = getattr(module, node.inputs[0].name.removesuffix("_children") + "_from_nested")
        deep = 0
        for _ in range(300):
            deep = (deep,)
        arity = node.attrs["spec"].arity
        nested = [("deep", EITHER, [deep]), ("too many children", REFUSED, [tuple(range(arity + 1))]),
                  ("a word past int64", REFUSED, [2**70]), ("a bool", REFUSED, [True]), ("nothing", REFUSED, []),
                  ("an empty tuple", REFUSED, [()]), ("a negative word", EITHER, [(-5, [1])])]
        for what, outcome, trees in nested:
            calls.expect(f"from_nested, {what}", outcome,
                         lambda trees=trees: model.forward(**dict(good, **convert(trees))))
    big = _big_inputs(graph)
    if big is not None:
        calls.expect("forward, a large batch", EITHER, lambda: model.forward(**{k: big[k] for k in forward_names}))
        if train:
            calls.expect("train_step, a large batch", EITHER, lambda: model.train_step(**big))
    if train:
        for _ in range(3):
            calls.expect("train_step", EITHER, lambda: model.train_step(**good))
        calls.expect("gradients, optimizer_state, memory_stats", EITHER,
                     lambda: (model.gradients(), model.optimizer_state(), model.memory_stats()))
        model.save(str(tmp_path / "trained.npz"))
        calls.expect("load after training", EITHER,
                     lambda: module.Model(seed=1).load(str(tmp_path / "trained.npz")))
        saved = dict(np.load(tmp_path / "trained.npz"))
        for step in (np.float64(1e300), np.float64(2.0**63), np.float64(np.nan), np.uint64(2**64 - 1),
                     np.float16(60000), np.int8(-5), np.array([1, 2]), np.array("x")):
            np.savez(tmp_path / "step.npz", **dict(saved, **{"optimizer/step": step}))
            calls.expect(f"load a step of {step!r}", EITHER,
                         lambda: module.Model(seed=1).load(str(tmp_path / "step.npz")))
    calls.expect("save into a missing folder", ANY, lambda: model.save(str(tmp_path / "missing" / "w.npz")))
    for seed in (-1, 2**64 - 1, 2**64, 1.5):
        calls.expect(f"Model(seed={seed})", ANY, lambda seed=seed: module.Model(seed=seed).forward(**good))

    # Views and outputs outlive their Model (a use after free would show here).
    def outlive():
        m = module.Model(seed=5)
        views = [m.parameters()]
        if train:
            m.train_step(**good)
            views += [m.gradients(), m.optimizer_state()]
        out = m.forward(**good)
        del m
        for group in views:
            for v in group.values():
                v[...] = v * 2 + 1
        return [float(a.sum()) for a in out.values()]

    calls.expect("views and outputs outlive the Model", EITHER, outlive)
    calls.expect("memory_stats", EITHER, lambda: model.memory_stats())
    for n in (0, -1, 3, 2):
        calls.expect(f"set_num_threads({n}), forward", EITHER,
                     lambda n=n: (module.set_num_threads(n), model.forward(**{k: good[k] for k in forward_names})))

    # Threads: forward() from two threads (train_step from a third) on one Model.
    calls.step("threads")
    errors = []

    def work(fn):
        try:
            for _ in range(20):
                fn()
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    fwd = {k: good[k] for k in forward_names}
    workers = [threading.Thread(target=work, args=(lambda: model.forward(**fwd),)) for _ in range(2)]
    if train:
        workers.append(threading.Thread(target=work, args=(lambda: model.train_step(**good),)))
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    calls.problems += [f"threads: {e}" for e in errors]
    return _report(name, calls)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        sys.exit(_child(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "", Path(scratch)))
