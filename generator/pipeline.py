"""The pipeline: every stage is a plain function from one value to the next, and
`generate` drives them in order (docs/ARCHITECTURE.md, "The pipeline"):

  stage          input -> output                  where
  load           model file -> ModelDef           frontend/loader.load_model
  build          ModelDef -> Graph                frontend/builder.ModelDef.build
  optimize       Graph -> Graph                   transforms/passes.optimize (the forward graph)
  differentiate  Graph -> Graph                   transforms/autodiff.prepare_training, then optimize again
  lower          Graph -> ProjectPlan             codegen/lower.lower (typed lines, codegen/stmt.py)
  plan_memory    ProjectPlan -> ProjectPlan       memory/planner.plan_memory (liveness from the lines,
                                                  update placement, in-place choices, offsets, arena size)
  record         (Graph, ProjectPlan) -> plan     codegen/record.record (reference outputs, examples)
  outline        ProjectPlan -> ProjectPlan       codegen/outline.outline (a repeated user function: one C++ function)
  render         ProjectPlan -> {path: bytes}     codegen/emit.render (pure: the plan in, files out)
  write          {path: bytes} -> project folder  codegen/writer.write_project

`deepgen ir MODEL --after STAGE` stops after optimize, differentiate, lower or
plan_memory and prints what that stage made.
"""

from __future__ import annotations

from .codegen.emit import render
from .codegen.lower import lower as lower_graph
from .codegen.outline import outline
from .codegen.plan import ArenaDecl
from .codegen.record import record
from .codegen.stmt import nested_lines
from .codegen.targets import load_target
from .codegen.writer import write_project
from .memory.planner import plan_memory as place
from .memory.report import report as memory_report
from .transforms.autodiff import prepare_training
from .transforms.passes import optimize as run_passes

STAGES = ("load", "build", "optimize", "differentiate", "lower", "plan_memory", "record", "render", "write")


def optimize(graph, opt: str = "O2", report=None):
    """Stage `optimize`: the passes of level `opt` over the forward graph."""
    return run_passes(graph, opt, report=report)


def differentiate(graph, opt: str = "O2", report=None):
    """Stage `differentiate`: for a trainable model, the backward pass (autodiff),
    optimized with the same passes; other graphs pass through."""
    if graph.train is not None and not graph.train.prepared:
        prepare_training(graph)
        run_passes(graph, opt, report=report)
    return graph


def prepare(graph, opt: str = "O2", report=None):
    """optimize then differentiate: the graph as lowering receives it."""
    return differentiate(optimize(graph, opt, report), opt, report)


def lower(graph, target_name: str = "cpu"):
    """Stage `lower`: the graph as a ProjectPlan for a target (its buffers not yet placed)."""
    return lower_graph(graph, load_target(target_name))


def plan_memory(plan):
    """Stage `plan_memory`: in-place decisions and arena offsets (memory.plan_memory)."""
    return place(plan)


def lowered(graph, target_name: str = "cpu"):
    """lower then plan_memory: the plan as recording and rendering receive it."""
    return plan_memory(lower(graph, target_name))


def project_files(graph, target: str = "cpu", opt: str = "O2", report=None) -> dict:
    """Every stage from optimize to render: the files of the project for `graph`."""
    plan = outline(_recorded(graph, opt, report, target), graph)
    return render(plan, load_target(target))


def _recorded(graph, opt: str, report, target: str):
    """optimize to record: the plan that rendering receives, with the memory report at batch 32."""
    plan = lowered(prepare(graph, opt, report), target)
    return record(graph, plan, memory_report(graph, plan, batch=32))


def generate(graph, out_dir, target: str = "cpu", force: bool = False, opt: str = "O2", report=None,
             restore: bool = False):
    """Every stage from optimize to write: the project for `graph` in `out_dir`
    (a writer.WriteResult; hand edits are merged, see writer.write_project)."""
    return write_project(out_dir, project_files(graph, target, opt, report), force, restore)


def plan_text(plan) -> str:
    """A lowered plan, readably: each statement's comment and typed lines, printed
    as C++ after the schedule position that runs them (@3), the training part, the
    kernels and the arena plan (`deepgen ir --after lower`)."""
    out = [f"# plan of {plan.name} ({plan.target}): {len(plan.statements)} forward statements, "
           f"{len(plan.kernels)} kernels"]

    def block(title, statements):
        out.append(f"\n## {title}")
        for s in statements:
            out.append(f"// {s.comment}")
            for line in s.lines:  # a block (a recursion's loop) on lines of its own, indented
                first, *rest = str(line).split("\n")
                out.append(f"  @{line.at:<3} {first}")
                out.extend(f"        {text}" for text in rest)

    block("forward", plan.statements)
    if plan.train is not None:
        block("loss", plan.train.loss_statements)
        block("backward and updates", plan.train.backward_statements)
        out.append("// after the backward pass: gradient copies, then the updates not placed earlier")
        out.extend(f"  @{getattr(line, 'at', plan.end):<3} {line}" for line in plan.train.copies + plan.train.updates)
    out.append("\n## kernels")
    out.extend(f"{k.name}: {k.comment.replace(chr(10), ' | ')}" for k in plan.kernels)
    if plan.memory:
        out.append(f"\n## arena: {plan.memory['arena']} floats")
    out.append("\n## buffers (name, offset, floats, written at, last read at, phase)")
    buffers = plan.buffers or _declared_buffers(plan)  # before plan_memory: as lowering declared them
    out.extend(f"{b.name:<24} {b.offset if b.offset is not None else '(unplaced)'}  {b.size}  "
               f"[{'?' if b.first is None else b.first}, {'?' if b.last is None else b.last}] {b.phase}"
               + (f"  in place of {b.inplace_of.name}" if b.inplace_of else "")
               for b in buffers)
    return "\n".join(out) + "\n"


def _declared_buffers(plan) -> list:
    """The arena buffers the lowered lines declare, in order (positions unknown yet)."""
    groups = [plan.statements] + ([plan.train.loss_statements, plan.train.backward_statements] if plan.train else [])
    return [line.buffer for group in groups for s in group for line in nested_lines(s.lines)
            if isinstance(line, ArenaDecl)]
