"""The child process of the binding fuzzer (tests/test_fuzz.py launches it):

    python tests/fuzz_child.py --child EXAMPLE BUILD_DIR RESULTS PROGRESS TARGET...

fuzzes the TARGETs (forward, train_step, trees, nested, equal_dtypes, non_finite) of
EXAMPLE's module built in BUILD_DIR, one hypothesis test each, and after each target
writes {target: (ok, report, seconds)} as JSON to RESULTS. Before every call it writes
the call, as Python code, to PROGRESS, for the parent to show if the child dies in it.

The Fuzzer joins the input side (tests/fuzz_inputs.py) and the oracle
(tests/fuzz_oracle.py) and adds the hypothesis tests. Run as a script, this file's
directory (tests/) is sys.path[0], and the parent puts the repository root and tests/
on PYTHONPATH, so the imports below work either way.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings
from math import inf, nan
from pathlib import Path

import numpy as np

import fuzz_arrays
from fuzz_arrays import chain, setitems
from fuzz_inputs import FuzzInputs, Value, nested_trees
from fuzz_oracle import SEED, Finding, FuzzOracle, plain_nested

ROOT = Path(__file__).resolve().parents[1]

# Examples per hypothesis test (all of tests/test_fuzz.py runs in well under two minutes warm on two cores).
MAX_EXAMPLES = {"forward": 200, "train_step": 70, "trees": 250, "nested": 200,
                "equal_dtypes": 12, "non_finite": 20}
CHILD_MEMORY_BYTES = 8 << 30  # address space of a child (plus some per CPU)
DEADLINE_S = 20  # per hypothesis example (an ordinary call takes milliseconds)
SHRINK_S = 5  # hypothesis' time for shrinking the failures of one target


class Fuzzer(FuzzInputs, FuzzOracle):
    """The fuzzer of one example's compiled module: run(target) is one hypothesis test."""

    def __init__(self, example, module, progress):
        from generator.ir.graph import needed_for
        from generator.frontend.loader import load_model
        from generator.reference.samples import id_limit

        self.example, self.module = example, module
        self.progress = open(progress, "w", encoding="utf-8")  # noqa: SIM115  (open while the child lives)
        self.graph = load_model(str(ROOT / "examples" / f"{example}.py")).build()
        g = self.graph
        self.decl = {v.name: v for v in g.inputs}
        need = needed_for(g, [v for _, v in g.outputs])
        self.forward_names = [v.name for v in g.inputs if id(v) in need]
        self.train_names = (
            [v.name for v in g.inputs if id(v) in needed_for(g, [g.train.loss])] if g.train else []
        )
        self.limit = {v.name: id_limit(g, v) for v in g.inputs if v.dtype != "float32"}
        self.trees = []
        for n in g.nodes:
            if n.op == "recurse" and not n.attrs["spec"].sequences:  # a scan's lengths are fuzzed as ids
                spec = n.attrs["spec"]
                self.trees.append(
                    dict(
                        children=n.inputs[0].name,
                        words=n.inputs[1].name,
                        roots=n.inputs[2].name,
                        arity=spec.arity,
                        dag=spec.dag,
                        vocab=id_limit(g, n.inputs[1]),
                    )
                )
        self.nested_fn = next((name for name in dir(module) if name.endswith("_from_nested")), None)
        self.model = module.Model(seed=SEED)
        self.stats = {}

    def record(self, code):
        """The call about to be made, for the parent to show if this process dies in it
        (the data reaches the OS at flush(), so it outlives a crash)."""
        self.progress.seek(0)
        self.progress.truncate()
        self.progress.write(code + "\n")
        self.progress.flush()

    def tally(self, entry, outcome):
        """With DEEPGEN_FUZZ_STATS set, the child prints how often each outcome came up."""
        if os.environ.get("DEEPGEN_FUZZ_STATS"):
            import re

            key = f"{entry}: " + re.sub(r"\d+", "#", outcome)
            self.stats[key] = self.stats.get(key, 0) + 1

    def trained_model(self, data):
        """A fresh model after 0-2 ordinary train steps: (model, setup code)."""
        from hypothesis import strategies as st

        m, setup = self.module.Model(seed=SEED), []
        for _ in range(data.draw(st.integers(0, 2), label="warm-up steps")):
            batch = self.base_inputs(data, self.train_names, special=False)
            m.train_step(**{k: v.value for k, v in batch.items()})
            setup.append("m.train_step(" + ", ".join(f"{k}={v.code}" for k, v in batch.items()) + ")")
        return m, setup

    # -- the hypothesis tests ----------------------------------------------------------

    def run(self, target):
        from datetime import timedelta

        from hypothesis import HealthCheck, given, settings
        from hypothesis import strategies as st

        body = getattr(self, "fuzz_" + target)

        @settings(
            max_examples=MAX_EXAMPLES[target],
            derandomize=True,
            database=None,
            deadline=timedelta(seconds=DEADLINE_S),
            suppress_health_check=list(HealthCheck),
            print_blob=False,
        )
        @given(data=st.data())
        def fuzz(data):
            try:
                body(data)
            except Finding as e:
                # Hypothesis keeps failing examples' exceptions while it shrinks; their
                # frames would keep every model and array of those examples alive.
                traceback.clear_frames(e.__traceback__)
                raise

        fuzz.__name__ = fuzz.__qualname__ = f"fuzz_{self.example}_{target}"
        fuzz()

    def fuzz_forward(self, data):
        from hypothesis import strategies as st

        names = list(self.forward_names)
        if self.graph.train and data.draw(st.booleans(), label="labels too"):
            names = list(self.decl)
        inputs = self.base_inputs(data, names)
        self.mutate(data, inputs, names)
        self.check_forward(inputs)

    def fuzz_train_step(self, data):
        m, setup = self.trained_model(data)
        inputs = self.base_inputs(data, self.train_names, finite=True)
        self.mutate(data, inputs, self.train_names, finite=True)
        self.check_train_step(inputs, setup, m)

    def fuzz_trees(self, data):
        from hypothesis import strategies as st

        t = self.trees[0]
        inputs = self.base_inputs(data, self.forward_names)
        if data.draw(st.booleans(), label="random arrays"):
            arrays = self.random_tree_arrays(data, t)
        else:
            arrays = tuple(inputs[t[k]].value for k in ("children", "words", "roots"))
        for _ in range(data.draw(st.integers(0, 3), label="tree mutations")):
            arrays = self.mutate_tree(data, t, *arrays)
        inputs.update(self.tree_values(arrays, t))
        if data.draw(st.integers(0, 4), label="other mutations") == 0:
            self.mutate(data, inputs, self.forward_names)
        self.check_forward(inputs)

    def fuzz_equal_dtypes(self, data):
        from hypothesis import strategies as st

        train = bool(self.graph.train) and data.draw(st.booleans(), label="train_step")
        names = self.train_names if train else self.forward_names
        inputs = self.base_inputs(data, names, finite=True)
        for name in data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=len(names), unique=True)):
            v = inputs[name]
            hows = ["pickled", "with_metadata"] + (["longlong"] if v.value.dtype == np.int64 else [])
            how = data.draw(st.sampled_from(hows), label="descriptor")
            inputs[name] = Value(getattr(fuzz_arrays, how)(v.value), f"{how}({v.code})")
        if train:
            m, setup = self.trained_model(data)
            self.check_train_step(inputs, setup, m)
        else:
            self.check_forward(inputs)

    def fuzz_non_finite(self, data):
        """PENDING NonFiniteLossError: train_step on NaN/inf inputs, or with an inf parameter."""
        from hypothesis import assume
        from hypothesis import strategies as st

        from generator.reference import interpreter as reference

        m, setup = self.trained_model(data)
        inputs = self.base_inputs(data, self.train_names, finite=True)
        floats_in = [k for k in self.train_names if self.decl[k].dtype == "float32"]
        if data.draw(st.booleans(), label="poison a parameter"):
            name = data.draw(st.sampled_from(sorted(m.parameters())), label="parameter")
            value = data.draw(st.sampled_from([nan, inf, -inf]), label="value")
            m.parameters()[name].reshape(-1)[0] = value
            setup.append(f"m.parameters()[{name!r}].reshape(-1)[0] = {value!r}")
        else:
            name = data.draw(st.sampled_from(floats_in), label="input")
            v = inputs[name]
            items = data.draw(
                st.lists(
                    st.tuples(st.integers(0, v.value.size - 1), st.sampled_from([nan, inf, -inf])),
                    min_size=1,
                    max_size=3,
                ),
                label="values",
            )
            inputs[name] = Value(setitems(v.value, items), f"setitems({v.code}, {items!r})")
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            params = {k: v.copy() for k, v in m.parameters().items()}
            loss, _ = reference.gradients(self.graph, {k: v.value for k, v in inputs.items()}, params)
        assume(not np.isfinite(loss))
        self.check_train_step(inputs, setup, m)

    def fuzz_nested(self, data):
        from hypothesis import note
        from hypothesis import strategies as st

        from generator.treebatch import from_nested

        t = self.trees[0]
        if data.draw(st.integers(0, 5), label="deep") == 0:  # too deep for repr() and for recursion
            depth = data.draw(st.sampled_from([2000, 50000]), label="depth")
            fanout = data.draw(st.integers(1, t["arity"] + 1), label="fan-out")
            trees, shown = [chain(depth, fanout)], f"[chain({depth}, {fanout})]"
        else:
            trees = data.draw(nested_trees(t["arity"]), label="trees")
            shown = repr(trees)
        code = f"{self.module.__name__}.{self.nested_fn}({shown})"
        note(code)
        self.record(f"import {self.module.__name__}\n{code}")
        try:
            want, ok = from_nested(trees, t["arity"]), True
        except Exception as e:  # noqa: BLE001
            want, ok = f"{type(e).__name__}: {e}", False
        try:
            got, status = getattr(self.module, self.nested_fn)(trees), "ok"
            self.tally(self.nested_fn, "ok")
        except (ValueError, MemoryError) as e:
            got, status = e, "error"
            self.tally(self.nested_fn, f"{type(e).__name__}: {str(e)[:60]}")
        except Exception as e:  # noqa: BLE001
            raise Finding(
                f"{self.nested_fn} raised {type(e).__name__} (only ValueError or MemoryError may be "
                f"raised): {str(e)[:300]}\n{code}"
            ) from None
        if status == "error":
            if ok and plain_nested(trees):
                raise Finding(f"{self.nested_fn} refused trees from_nested accepts: {got}\n{code}")
            return
        if not ok:
            raise Finding(f"{self.nested_fn} accepted trees from_nested refuses ({want})\n{code}")
        for key in ("children", "words", "roots"):
            g, w = got[t[key]], want[key]
            if g.dtype != np.int64 or g.shape != w.shape or not np.array_equal(g, w):
                raise Finding(f"{self.nested_fn}: {t[key]} is {g!r}, from_nested gives {w!r}\n{code}")


def _child_main(argv):
    import faulthandler
    import importlib
    import resource

    faulthandler.enable()
    # A bound on the child's memory, so that a runaway allocation is a MemoryError
    # (bad_alloc) here rather than the machine's OOM killer.
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    want = CHILD_MEMORY_BYTES + (256 << 20) * (os.cpu_count() or 1)  # thread stacks and malloc arenas
    limit = want if hard == resource.RLIM_INFINITY else min(want, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    example, build_dir, out, progress, *targets = argv
    sys.path.insert(0, build_dir)
    module = importlib.import_module(example)
    try:  # a bound on the time hypothesis spends shrinking a failure (its own default: 300 s)
        from hypothesis.internal.conjecture import engine

        engine.MAX_SHRINKING_SECONDS = SHRINK_S
    except ImportError:
        pass
    fuzzer = Fuzzer(example, module, Path(progress))
    results = {}
    for target in targets:
        start = time.monotonic()
        fuzzer.record(f"({target}: setting up)")
        try:
            fuzzer.run(target)
            results[target] = (True, "", time.monotonic() - start)
        except Exception as e:  # noqa: BLE001  (hypothesis' report: the shrunk call is in its notes)
            report = "".join(traceback.format_exception(e))
            results[target] = (
                False,
                f"{example} {target} (build dir {build_dir}):\n{report[-8000:]}",
                time.monotonic() - start,
            )
        Path(out).write_text(json.dumps(results))
        if fuzzer.stats:
            print(
                f"{example} {target}:",
                *(f"{n:5d} {k}" for k, n in sorted(fuzzer.stats.items(), key=lambda kv: -kv[1])),
                sep="\n",
                file=sys.stderr,
            )
            fuzzer.stats.clear()


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    _child_main(sys.argv[2:])
