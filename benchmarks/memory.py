"""Benchmark: peak memory of one step, the generated module against PyTorch.

    python benchmarks/memory.py [--json FILE]

Models and steps (the same computation on both sides, checked before measuring):

  mlp       examples/mlp.py, 784-512-256-10 with relu: forward() (PyTorch: the same
            three nn.Linear layers under torch.no_grad()) and train_step()
            (softmax cross-entropy + SGD with momentum, the module's own
            hyperparameters; PyTorch: F.cross_entropy, loss.backward(),
            torch.optim.SGD.step()), at batch 64 and 256; train and train*:
            gradients kept or not (see below).
  treelstm  examples/treelstm.py, the binary TreeLSTM, forward only (deepgen does
            not generate training through recursion yet), over a seeded batch of
            1 and of 10 random binary trees (generator.treebatch.random_batch,
            2..34 leaves per tree, 18 on average). PyTorch runs the same
            level-batched algorithm the generated code runs (leaves as one batch,
            then one addmm per tree level, children gathered with index_select)
            under torch.no_grad(), and returns the same outputs (h for every node
            in the input's order, root_h).
  Before measuring, PyTorch gets the generated model's weights and its outputs
  (forward), losses and updated weights (two train steps) must match the module's.

What is counted

  deepgen  activation peak = arena peak + outputs (+ recursion workspace).
           arena peak: model.memory_stats()["peak_bytes"], the measured
             high-water mark of the one arena that holds every intermediate of
             the call; it must equal predicted_peak_bytes (the arena the code
             allocated from the plan) and the plan's formula evaluated here
             (generator.memory.report.MemoryModel), both printed.
           outputs: MemoryModel's "outputs" category (buffers handed to the
             caller; in train_step the logits live in such a buffer too) and,
             in train_step, its "loss" (the loss value's own buffer).
           recursion workspace (TreeLSTM only): buffers the recursive op
             allocates outside the arena, as the generated src/model.cpp
             declares them (every std::vector that is not an output, sized with
             this batch's schedule: nodes, leaves, the largest internal level),
             plus the schedule's own index arrays (order, row_of, child_row,
             level_start). They all live to the end of forward(), so their sum is
             added to the peak. The inspector's short-lived temporaries (freed
             before the first float buffer is allocated) are not counted.
           persistent: MemoryModel's parameters, gradients and optimizer state
             (the last two once a train_step allocated them: memory_stats()'s
             training_state_bytes must equal the plan's), plus the weights forward()
             keeps packed (memory_stats()["packed_weight_bytes"]). forward rows
             use the module's default, keep_plain_weights = False: a weight whose
             packing is all the forward pass reads is held packed only, and the
             parameters count what memory_stats()["parameter_bytes"] measures;
             forward+ rows set it True (the C++ Model's default: each such weight
             held stored and packed), and there, as in train rows, it must equal
             the plan's.
  torch    transient peak: the highest running total of bytes allocated minus
             bytes freed during the step, over what was live when it began
             (parameters, .grad, momentum buffers), including the outputs
             still alive at its end.
           persistent: parameters, .grad and optimizer state tensors after the
             step (forward rows use an inference model: parameters only).
  Neither side counts allocator overhead, BLAS-internal scratch space (MKL or
  oneDNN buffers that do not come from torch's allocator), the inputs (numpy
  arrays both sides read in place) or Python objects.

How PyTorch is measured, and why this way

  torch.profiler.profile(activities=[ProfilerActivity.CPU], profile_memory=True)
  records one "[memory]" event per CPU tensor allocation (+bytes) and free
  (-bytes). prof.events() folds the events that happen inside an operator into
  that operator's totals (nested operators count them again), which loses the
  order needed for a peak, so this script reads the profiler's raw records
  (prof.profiler.kineto_results.events(): the "[memory]" events with
  nbytes(), in start_ns() order) and takes the maximum of their running sum
  inside a record_function("deepgen_memory_step") window. The profiler knows
  the size of a block only if it was allocated while memory profiling was on:
  a free of an older block is not reported at all. So the whole case (creating
  the model and optimizer, copying weights, the warm-up step and the measured
  step) runs in one profiling session, and only the window is summed. torch's
  CPU allocator keeps no statistics of its own (torch.cuda.memory_stats has no
  CPU counterpart), so the profiler is the public tool that sees every tensor.
  The step: opt.zero_grad(set_to_none=False) (so .grad, like the generated
  module's gradient buffers, persists and is zeroed in place), forward, loss,
  backward, opt.step(). With .grad already allocated, autograd computes each
  weight gradient into a new tensor and adds it into .grad, so the transient
  peak includes the largest weight gradient once more. The train* rows run
  PyTorch's default, opt.zero_grad() (set_to_none=True): .grad is freed at the
  start of the step and backward's gradient tensors become the new .grad (the
  running sum first drops by the gradients' size), against the generated
  module with keep_gradients = False (each gradient lives in the arena from the
  statement that makes it to its update; none is held between steps). The
  comparable figure is the total: persistent + the step's peak. torch runs with
  one thread, as the generated code does.

Builds: the generated projects go to build/bench-memory/<model>/src and are
built with plain CMake (Release) into build/bench-memory/<model>/build; a build
is reused when the generated sources (and the Python) are unchanged.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # keep the profiler's start/stop lines off stderr

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "build" / "bench-memory"
MLP_BATCHES = (64, 256)
TREE_BATCHES = (1, 10)
MIN_LEAVES, MAX_LEAVES = 2, 34  # uniform: 18 leaves per tree on average
VOCAB = 1000
ATOL = 1e-4
WINDOW = "deepgen_memory_step"
CTYPE_BYTES = {"float": 4, "double": 8, "int64_t": 8, "int32_t": 4, "uint8_t": 1}


# ----------------------------------------------------------------------------
# Generated modules
# ----------------------------------------------------------------------------


def cmake_build(project, build, jobs):
    from generator.tools.build import cmake_build as build_project

    build_project(project, build, jobs)


def build_example(name: str) -> dict:
    """Generate examples/<name>.py into build/bench-memory/<name>/src, build it
    (or reuse the build) and import it. Returns the graph, the lowered plan the
    sources came from, the module and the generated model.cpp."""
    from generator.codegen.writer import write_project
    from generator.pipeline import project_files
    from generator.pipeline import lowered
    from generator.frontend.loader import load_model

    graph = load_model(str(ROOT / "examples" / f"{name}.py")).build()
    t0 = time.perf_counter()
    files = project_files(graph)  # runs the generator's passes on graph, as `deepgen generate` does
    plan = lowered(graph)  # the plan those sources were rendered from
    folder = CACHE / graph.name
    src, build = folder / "src", folder / "build"
    write_project(src, files, force=True)  # unchanged files keep their mtimes
    digest = hashlib.sha256()
    for rel, data in sorted(files.items()):
        digest.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
    digest.update(sys.executable.encode() + b"\0" + sys.version.encode())
    key = digest.hexdigest()
    from generator.tools.build import build_if_changed

    reused = build_if_changed(src, build, graph.name, key, jobs=os.cpu_count() or 2)
    seconds = time.perf_counter() - t0
    sys.path.insert(0, str(build))
    try:
        module = importlib.import_module(graph.name)
    finally:
        sys.path.remove(str(build))
    if not str(Path(module.__file__).resolve()).startswith(str(build.resolve())):
        raise SystemExit(f"imported {graph.name} from {module.__file__}, not from {build}")
    print(f"  {graph.name}: {'reused' if reused else 'built'} in {seconds:.1f} s ({build})", flush=True)
    return {"graph": graph, "plan": plan, "module": module, "cpp": (src / "src" / "model.cpp").read_text(),
            "build": str(build), "reused": reused, "seconds": round(seconds, 2)}


def vectors_outside_arena(cpp: str) -> list:
    """(ctype, name, size expression) of every `std::vector<T> name(size);` and
    `dg::Scratch<T> name(size);` (a recursive op's per-call buffers) in the
    generated model.cpp: the buffers that do not live in the arena."""
    found = []
    for ctype, name, size in re.findall(r"(?:std::vector|dg::Scratch)<([\w:]+)>\s+(\w+)\(([^;{}]+)\);", cpp):
        found.append((ctype.removeprefix("std::"), name, " ".join(size.split())))
    return found


def tree_schedule(children, arity: int = 2) -> dict:
    """What dg::schedule_levels computes for this batch: heights (0 for leaves),
    the number of leaves, the number of levels and the largest internal level."""
    heights = [0] * len(children)
    for n, kids in enumerate(children.tolist()):  # children come before parents
        kids = [k for k in kids if k >= 0]
        if kids:
            heights[n] = max(heights[k] for k in kids) + 1
    counts = [0] * (max(heights) + 1)
    for h in heights:
        counts[h] += 1
    return {"nodes": len(children), "leaves": counts[0], "levels": len(counts),
            "max_rows": max(counts[1:], default=0), "arity": arity}


def recursion_workspace(built: dict, dims: dict, sched: dict) -> dict:
    """Bytes of the recursive op's buffers outside the arena (see the docstring)."""
    import sympy

    outputs = {name for name, _ in built["graph"].outputs}
    values = {str(d): int(v) for d, v in dims.items()}
    values.update({"leaves": sched["leaves"], "max_rows": sched["max_rows"]})
    parts, unknown = {}, []
    for ctype, name, size in vectors_outside_arena(built["cpp"]):
        if name in outputs:
            continue
        try:
            expr = sympy.sympify(size, locals={k: sympy.Symbol(k) for k in values})
            free = {str(s) for s in expr.free_symbols} - set(values)
        except (sympy.SympifyError, TypeError, SyntaxError):
            expr, free = None, {size}
        if free or ctype not in CTYPE_BYTES or not isinstance(expr, sympy.Expr):
            unknown.append(f"{name}({size})")
            continue
        parts[name] = CTYPE_BYTES[ctype] * int(expr.subs({sympy.Symbol(k): v for k, v in values.items()}))
    if "schedule_levels" in built["cpp"]:  # LevelSchedule: order, row_of, child_row, level_start (int64)
        parts["schedule"] = 8 * ((2 + sched["arity"]) * sched["nodes"] + sched["levels"] + 1)
    return {"bytes": sum(parts.values()), "parts": parts, "not_counted": unknown}


def deepgen_case(built: dict, step: str, inputs: dict, dims: dict, sched: dict | None) -> dict:
    """Run one step of the generated module and collect its figures."""
    from generator.memory.report import MemoryModel

    graph = built["graph"]
    model = built["module"].Model(seed=0)
    mm = MemoryModel(graph, built["plan"])
    at = {d: dims[str(d)] for d in graph.dims}
    arena = {"train": mm.arena, "train*": mm.freed_arena, "forward": mm.forward_arena,
             "forward+": mm.forward_arena}[step]
    training = step.startswith("train")
    if training:
        model.keep_gradients = step == "train"  # train*: each gradient freed by its update
        model.train_step(**inputs)  # warm-up (the buffers are members: nothing changes, but the same protocol)
        model.train_step(**inputs)
    else:
        if step == "forward+" and hasattr(model, "keep_plain_weights"):
            model.keep_plain_weights = True  # forward+: a packed weight keeps its stored copy
        model.forward(**{k: v for k, v in inputs.items() if k != "labels"})  # warm-up
        model.forward(**{k: v for k, v in inputs.items() if k != "labels"})
    formula = mm.at(arena, at)
    stats = dict(model.memory_stats())
    outputs = mm.at(mm.categories["outputs"], at)
    params = mm.at(mm.categories["parameters"], at)
    held = int(stats.get("parameter_bytes", params))  # measured: less where packings stand in for weights
    if step != "forward" or not hasattr(model, "keep_plain_weights"):
        assert held == params, f"the parameters hold {held} bytes, the plan says {params}"
    else:  # the default frees every weight its packing stands in for
        assert held < params, f"forward() freed no stored weight ({held} of {params} bytes held)"
    if training:  # the loss train_step returns: a buffer of its own too
        outputs += mm.at(mm.categories["loss"], at)
    work = recursion_workspace(built, dims, sched) if sched is not None else {"bytes": 0, "parts": {}, "not_counted": []}
    return {
        "arena_peak_bytes": int(stats["peak_bytes"]),
        "predicted_peak_bytes": int(stats["predicted_peak_bytes"]),
        "formula_peak_bytes": formula,
        "formula": str(arena),
        "peak_equals_prediction": int(stats["peak_bytes"]) == int(stats["predicted_peak_bytes"]) == formula,
        "outputs_bytes": outputs,
        "recursion_workspace_bytes": work["bytes"],
        "recursion_workspace_parts": work["parts"],
        "recursion_workspace_not_counted": work["not_counted"],
        "activation_peak_bytes": int(stats["peak_bytes"]) + outputs + work["bytes"],
        "parameters_bytes": held,
        **training_state(stats, mm, at, gradients_kept=step != "train*"),
        # weights kept packed for the products (runtime/dg_packed_weights.h): forward() keeps them
        "packed_weights_bytes": int(stats.get("packed_weight_bytes", 0)),
    }


def training_state(stats: dict, mm, at: dict, gradients_kept: bool = True) -> dict:
    """Gradients and optimizer state the Model holds: allocated at the first training
    call (memory_stats' training_state_bytes, measured), split as MemoryModel plans them
    (no gradients when train_step does not keep them)."""
    grads, state = mm.at(mm.categories["gradients"], at), mm.at(mm.categories["optimizer state"], at)
    grads = grads if gradients_kept else 0
    held = int(stats.get("training_state_bytes", grads + state))
    if held == 0:
        return {"gradients_bytes": 0, "optimizer_state_bytes": 0}
    assert held == grads + state, f"the Model holds {held} bytes of training state, the plan says {grads + state}"
    return {"gradients_bytes": grads, "optimizer_state_bytes": state}


# ----------------------------------------------------------------------------
# PyTorch peers
# ----------------------------------------------------------------------------


def torch_mlp(params: dict):
    """The MLP with the generated model's weights (x @ w layout -> nn.Linear's w.T)."""
    import torch

    layers = []
    for name in ("h1", "h2", "logits"):
        w, b = params[f"{name}_w"], params[f"{name}_b"]
        lin = torch.nn.Linear(w.shape[0], w.shape[1])
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(w.T))
            lin.bias.copy_(torch.from_numpy(b))
        layers.append(lin)
    return torch.nn.Sequential(layers[0], torch.nn.ReLU(), layers[1], torch.nn.ReLU(), layers[2])


def torch_mlp_train_step(model, opt, x, labels, set_to_none: bool = False):
    import torch.nn.functional as F

    opt.zero_grad(set_to_none=set_to_none)
    loss = F.cross_entropy(model(x), labels)
    loss.backward()
    opt.step()
    return loss.detach()


def torch_treelstm(params: dict):
    """The level-batched TreeLSTM forward (the generated code's algorithm)."""
    import torch

    tp = {k: torch.from_numpy(v.copy()) for k, v in params.items()}
    emb, w_leaf, b_leaf, u, b = (tp[k] for k in ("emb", "w_leaf", "b_leaf", "u", "b"))
    hidden = u.shape[1] // 5
    sig, tanh = torch.sigmoid, torch.tanh

    @torch.no_grad()
    def forward(batch):
        children = torch.from_numpy(batch["trees_children"])  # views of the caller's arrays
        words = torch.from_numpy(batch["trees_words"])
        roots = torch.from_numpy(batch["trees_roots"])
        # Inspector: heights, rows sorted by height (leaves first), each row's children as rows.
        heights = [0] * len(children)
        for n, (left, right) in enumerate(batch["trees_children"].tolist()):
            if left >= 0:
                heights[n] = max(heights[left], heights[right]) + 1
        order = torch.tensor(sorted(range(len(heights)), key=heights.__getitem__))
        counts = torch.bincount(torch.tensor(heights)).tolist()
        start = [0]
        for c in counts:
            start.append(start[-1] + c)
        row_of = torch.empty_like(order)
        row_of[order] = torch.arange(len(order))
        child_rows = row_of[children.index_select(0, order).clamp(min=0)]  # leaves' rows are never read
        hs, cs = torch.empty(len(order), hidden), torch.empty(len(order), hidden)
        leaves = start[1]
        x = emb.index_select(0, words.index_select(0, order[:leaves]))
        i, o, g = torch.addmm(b_leaf, x, w_leaf).chunk(3, 1)
        c = sig(i) * tanh(g)
        cs[:leaves], hs[:leaves] = c, sig(o) * tanh(c)
        del x, i, o, g, c
        for level in range(1, len(start) - 1):
            lo, hi = start[level], start[level + 1]
            idx = child_rows[lo:hi].reshape(-1)  # [left0, right0, left1, ...]
            hcat = hs.index_select(0, idx).view(hi - lo, 2 * hidden)  # = concat([h_l, h_r], 1)
            cc = cs.index_select(0, idx).view(hi - lo, 2, hidden)
            i, o, g, f_l, f_r = torch.addmm(b, hcat, u).chunk(5, 1)
            c = sig(i) * tanh(g) + sig(f_l) * cc[:, 0] + sig(f_r) * cc[:, 1]
            cs[lo:hi], hs[lo:hi] = c, sig(o) * tanh(c)
            del hcat, cc, i, o, g, f_l, f_r, c
        h = hs.index_select(0, row_of)  # back to the input's node order
        return {"h": h, "root_h": h.index_select(0, roots)}

    return forward


def profile_window(setup, step):
    """Run setup() and step(state) in one memory-profiling session; the peak of
    the running sum of allocated-minus-freed bytes inside step (see the docstring)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        state = setup()
        with record_function(WINDOW):
            result = step(state)
        keep = result  # outputs stay alive past the window, as the caller would hold them
    events = prof.profiler.kineto_results.events()
    windows = [e for e in events if e.name() == WINDOW]
    if len(windows) != 1:
        raise SystemExit(f"expected one '{WINDOW}' event in the profile, found {len(windows)}")
    lo, hi = windows[0].start_ns(), windows[0].end_ns()
    cpu = torch.device("cpu").type
    mem = sorted((e.start_ns(), k, e.nbytes()) for k, e in enumerate(events)
                 if e.name() == "[memory]" and lo <= e.start_ns() <= hi and str(e.device_type()).lower().endswith(cpu))
    running = peak = allocated = 0
    for _, _, nbytes in mem:
        running += nbytes
        allocated += max(nbytes, 0)
        peak = max(peak, running)
    del keep
    return {"transient_peak_bytes": peak, "net_bytes": running, "allocated_bytes": allocated,
            "memory_events": len(mem)}, state


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def torch_mlp_case(params: dict, hyper: dict, step: str, x, labels, set_to_none: bool = False) -> dict:
    import torch

    tx, tl = torch.from_numpy(x), torch.from_numpy(labels)

    def setup():
        model = torch_mlp(params)
        if step == "forward":
            model.requires_grad_(False)
            with torch.no_grad():
                model(tx)  # warm-up
            return model, None
        opt = torch.optim.SGD(model.parameters(), lr=hyper["lr"], momentum=hyper["momentum"],
                              weight_decay=hyper.get("weight_decay", 0.0))
        torch_mlp_train_step(model, opt, tx, tl)  # warm-up: .grad and the momentum buffers now exist
        return model, opt

    def run(state):
        model, opt = state
        if step == "forward":
            with torch.no_grad():
                return model(tx)
        return torch_mlp_train_step(model, opt, tx, tl, set_to_none)

    figures, (model, opt) = profile_window(setup, run)
    ps = list(model.parameters())
    figures.update({
        "parameters_bytes": tensor_bytes(ps),
        "gradients_bytes": tensor_bytes(p.grad for p in ps),
        "optimizer_state_bytes": tensor_bytes(t for s in (opt.state.values() if opt else [])
                                              for t in s.values() if torch.is_tensor(t)),
    })
    return figures


def torch_tree_case(params: dict, batch: dict) -> dict:
    def setup():
        forward = torch_treelstm(params)
        forward(batch)  # warm-up
        return forward

    figures, _ = profile_window(setup, lambda forward: forward(batch))
    figures.update({"parameters_bytes": sum(v.nbytes for v in params.values()), "gradients_bytes": 0,
                    "optimizer_state_bytes": 0})
    return figures


# ----------------------------------------------------------------------------
# Same computation: checked before anything is measured
# ----------------------------------------------------------------------------


def check_mlp(module, x, labels) -> str:
    import numpy as np
    import torch

    gen = module.Model(seed=0)
    params = {k: np.array(v, copy=True) for k, v in gen.parameters().items()}
    hyper = dict(gen.hyperparameters())
    model = torch_mlp(params)
    with torch.no_grad():
        want, got = gen.forward(x=x)["logits"], model(torch.from_numpy(x)).numpy()
    if not np.allclose(got, want, atol=ATOL):
        raise SystemExit(f"mlp forward differs from PyTorch: max |diff| {np.max(np.abs(got - want)):.3g}")
    opt = torch.optim.SGD(model.parameters(), lr=hyper["lr"], momentum=hyper["momentum"],
                          weight_decay=hyper.get("weight_decay", 0.0))
    for k in range(2):
        lg = gen.train_step(x=x, labels=labels)
        lt = float(torch_mlp_train_step(model, opt, torch.from_numpy(x), torch.from_numpy(labels)))
        if abs(lg - lt) > 1e-4 * max(1.0, abs(lt)):
            raise SystemExit(f"mlp train step {k + 1}: loss {lg} (deepgen) vs {lt} (PyTorch)")
    for name, lin in (("h1", model[0]), ("h2", model[2]), ("logits", model[4])):
        w = gen.parameters()[f"{name}_w"]
        if not np.allclose(lin.weight.detach().numpy().T, w, atol=ATOL):
            raise SystemExit(f"mlp weights {name}_w differ from PyTorch's after two train steps")
    return f"mlp: logits, two losses and the updated weights match PyTorch (atol {ATOL})"


def check_treelstm(module, batches: dict) -> str:
    import numpy as np

    gen = module.Model(seed=0)
    forward = torch_treelstm({k: np.array(v, copy=True) for k, v in gen.parameters().items()})
    for size, batch in batches.items():
        want, got = gen.forward(**batch), forward(batch)
        for name in ("h", "root_h"):
            if not np.allclose(got[name].numpy(), want[name], atol=ATOL):
                raise SystemExit(f"treelstm {name} (batch {size}) differs from PyTorch")
    return f"treelstm: h and root_h match PyTorch on every batch (atol {ATOL})"


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------


def tree_batch(trees: int, seed: int) -> dict:
    import numpy as np
    from generator.treebatch import random_batch

    one = random_batch(np.random.default_rng(seed), trees, 2, VOCAB, min_leaves=MIN_LEAVES, max_leaves=MAX_LEAVES)
    return {f"trees_{k}": np.ascontiguousarray(v, dtype=np.int64) for k, v in one.items()}


def kib(n) -> str:
    return f"{n / 1024:,.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE", help="write every figure to FILE as JSON")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import numpy as np
    import torch

    torch.set_num_threads(1)
    print(f"Building the generated modules (plain CMake, Release; cached under {CACHE.relative_to(ROOT)}/):",
          flush=True)
    built = {name: build_example(name) for name in ("mlp", "treelstm")}
    t0 = time.perf_counter()

    rng = np.random.default_rng(0)
    mlp_inputs = {b: {"x": rng.standard_normal((b, 784), dtype=np.float32),
                      "labels": rng.integers(0, 10, b).astype(np.int64)} for b in MLP_BATCHES}
    trees = {b: tree_batch(b, seed=100 + b) for b in TREE_BATCHES}
    scheds = {b: tree_schedule(batch["trees_children"]) for b, batch in trees.items()}

    print("\nSame computation (with the generated model's weights):")
    print("  " + check_mlp(built["mlp"]["module"], mlp_inputs[64]["x"], mlp_inputs[64]["labels"]))
    print("  " + check_treelstm(built["treelstm"]["module"], trees))

    mlp_params = {k: np.array(v, copy=True) for k, v in built["mlp"]["module"].Model(seed=0).parameters().items()}
    mlp_hyper = dict(built["mlp"]["module"].Model(seed=0).hyperparameters())
    tree_params = {k: np.array(v, copy=True)
                   for k, v in built["treelstm"]["module"].Model(seed=0).parameters().items()}
    rows = []
    for step in ("forward", "forward+", "train", "train*"):
        for b in MLP_BATCHES:
            inputs = mlp_inputs[b]
            dg = deepgen_case(built["mlp"], step, inputs, {"N": b}, None)
            # train*: PyTorch's default zero_grad() (set_to_none=True): .grad freed, then made again by backward
            pt = torch_mlp_case(mlp_params, mlp_hyper, step.rstrip("*+"), inputs["x"], inputs["labels"],
                                set_to_none=step == "train*")
            rows.append({"model": "mlp", "step": step, "batch": b, "workload": {"N": b}, "deepgen": dg, "torch": pt})
    for step in ("forward", "forward+"):
        for b in TREE_BATCHES:
            batch, sched = trees[b], scheds[b]
            dims = {"trees_nodes": sched["nodes"], "trees_count": b}
            dg = deepgen_case(built["treelstm"], step, batch, dims, sched)
            pt = torch_tree_case(tree_params, batch)
            rows.append({"model": "treelstm", "step": step, "batch": b, "workload": {**dims, **sched},
                         "deepgen": dg, "torch": pt})
    for r in rows:
        r["ratio_torch_to_deepgen"] = round(r["torch"]["transient_peak_bytes"] / r["deepgen"]["activation_peak_bytes"], 3)
        for side, peak in (("deepgen", "activation_peak_bytes"), ("torch", "transient_peak_bytes")):
            s = r[side]
            s["persistent_bytes"] = (s["parameters_bytes"] + s["gradients_bytes"] + s["optimizer_state_bytes"]
                                     + s.get("packed_weights_bytes", 0))
            s["total_peak_bytes"] = s["persistent_bytes"] + s[peak]
        r["total_ratio_torch_to_deepgen"] = round(r["torch"]["total_peak_bytes"] / r["deepgen"]["total_peak_bytes"], 3)
    elapsed = time.perf_counter() - t0

    print("""
Legend (bytes in KiB = 1024 bytes; one step, after a warm-up step):
  dg arena    deepgen: measured high-water mark of the arena holding every intermediate
              (memory_stats()["peak_bytes"])
  dg out      deepgen: outputs, in buffers of their own (MemoryModel "outputs")
  dg rec.ws   deepgen: recursion workspace outside the arena (leaf and level buffers
              sized for the largest level, the words in row order, the schedule), from
              the generated model.cpp and this batch's schedule; '-' for no recursion
  dg act.pk   deepgen activation peak = dg arena + dg out + dg rec.ws
  torch pk    PyTorch transient peak: max running sum of (allocated - freed) bytes
              during the step, from the CPU memory profiler, over the tensors live at
              its start; includes the outputs
  torch/dg    torch pk / dg act.pk
  persistent  parameters + gradients + optimizer state (+ deepgen's packed weights), held
              between steps. deepgen: gradients and optimizer state as the Model holds
              them (allocated by the first train_step: none in forward rows), weights
              kept packed by forward() (none after train steps); PyTorch forward rows
              use an inference model: parameters only
  total       persistent + the step's peak (dg act.pk, torch pk): the most bytes the step holds
  tot t/dg    torch total / deepgen total
  pk==pred    deepgen: peak_bytes == predicted_peak_bytes == the plan's formula at these sizes
  train       deepgen's default (keep_gradients: gradients() holds the step's gradients) against
              PyTorch with opt.zero_grad(set_to_none=False) (.grad persists, zeroed in place)
  train*      deepgen with keep_gradients = False (each gradient in the arena until its update
              has used it; none held between steps) against PyTorch's default
              opt.zero_grad(set_to_none=True) (.grad freed at the start, made again by backward)
  forward     the module's default (keep_plain_weights = False): forward() frees a weight's stored
              copy once packed (the packing stands in for it), so each weight is held once;
              parameters are then what memory_stats()["parameter_bytes"] measures (the biases)
  forward+    keep_plain_weights = True, the C++ Model's default (C++ code may hold a Tensor* or
              read a member): a weight kept packed keeps its stored copy too""")
    head = (f"{'model':<9} {'step':<8} {'batch':>5} | {'dg arena':>9} {'dg out':>8} {'dg rec.ws':>9} "
            f"{'dg act.pk':>9} | {'torch pk':>9} | {'torch/dg':>8} | {'dg persist':>10} {'torch pers':>10} | "
            f"{'dg total':>9} {'torch tot':>9} {'tot t/dg':>8} | pk==pred")
    print("\n" + head)
    print("-" * len(head))
    for r in rows:
        d, t = r["deepgen"], r["torch"]
        ws = kib(d["recursion_workspace_bytes"]) if r["model"] == "treelstm" else "-"
        print(f"{r['model']:<9} {r['step']:<8} {r['batch']:>5} | {kib(d['arena_peak_bytes']):>9} "
              f"{kib(d['outputs_bytes']):>8} {ws:>9} {kib(d['activation_peak_bytes']):>9} | "
              f"{kib(t['transient_peak_bytes']):>9} | {r['ratio_torch_to_deepgen']:>8.2f} | "
              f"{kib(d['persistent_bytes']):>10} {kib(t['persistent_bytes']):>10} | "
              f"{kib(d['total_peak_bytes']):>9} {kib(t['total_peak_bytes']):>9} "
              f"{r['total_ratio_torch_to_deepgen']:>8.2f} | {'yes' if d['peak_equals_prediction'] else 'NO'}")

    print("\nPersistent bytes (KiB), parameters / gradients / optimizer state (/ deepgen's packed weights):")
    for r in rows:
        d, t = r["deepgen"], r["torch"]
        print(f"  {r['model']:<9} {r['step']:<8} {r['batch']:>4}: deepgen "
              f"{kib(d['parameters_bytes'])} / {kib(d['gradients_bytes'])} / {kib(d['optimizer_state_bytes'])}"
              f" / {kib(d['packed_weights_bytes'])};"
              f"  torch {kib(t['parameters_bytes'])} / {kib(t['gradients_bytes'])} / "
              f"{kib(t['optimizer_state_bytes'])}")
    print("\ndeepgen arena formulas (bytes): " + "; ".join(
        sorted({f"{r['model']} {r['step']}: {r['deepgen']['formula']}" for r in rows})))
    for r in rows:
        if r["model"] == "treelstm":
            w, d = r["workload"], r["deepgen"]
            parts = sorted(d["recursion_workspace_parts"].items(), key=lambda kv: -kv[1])
            print(f"treelstm batch {r['batch']}: {w['nodes']} nodes, {w['leaves']} leaves, {w['levels']} levels, "
                  f"largest internal level {w['max_rows']} rows; workspace {kib(d['recursion_workspace_bytes'])} KiB, "
                  f"largest parts: " + ", ".join(f"{k} {kib(v)}" for k, v in parts[:4])
                  + (f"; NOT counted (unknown size): {', '.join(d['recursion_workspace_not_counted'])}"
                     if d["recursion_workspace_not_counted"] else ""))
    bad = [r for r in rows if not r["deepgen"]["peak_equals_prediction"]]
    verdict = "holds for every row" if not bad else "FAILS for " + ", ".join(
        f"{r['model']} {r['step']} {r['batch']}" for r in bad)
    print(f"\npeak_bytes == predicted_peak_bytes == formula: {verdict} "
          f"(measured in {elapsed:.1f} s; torch {torch.__version__}, {torch.get_num_threads()} thread)")

    if args.json:
        env = {"python": sys.version.split()[0], "numpy": np.__version__, "torch": torch.__version__,
               "torch_threads": torch.get_num_threads(), "machine": platform.machine(), "cores": os.cpu_count(),
               "measure_seconds": round(elapsed, 2)}
        modules = {k: {"build": v["build"], "reused": v["reused"], "seconds": v["seconds"]} for k, v in built.items()}
        Path(args.json).write_text(json.dumps({"environment": env, "modules": modules, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
