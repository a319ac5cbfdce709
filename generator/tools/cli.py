"""The `deepgen` command line: generate, build, check, ir."""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

from ..errors import DeepgenError


def _graph(args):
    from ..frontend.loader import load_model
    from ..ir.names import check_project_name

    model = load_model(args.model)
    name = getattr(args, "name", None)
    if name is not None:
        try:
            check_project_name(name)
        except ValueError as e:
            raise DeepgenError(str(e)) from None
    else:
        try:
            check_project_name(model.name)
        except ValueError as e:
            raise DeepgenError(f"{e} (the model's function name); pass --name") from None
    return model.build(name, **_options(getattr(args, "option", None) or []))


def _options(items) -> dict:
    """--option NAME=VALUE pairs as the model function's keyword arguments: a Python
    literal (8, True, 'base') or else the text itself (size=base)."""
    import ast

    options = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name.isidentifier():
            raise DeepgenError(f"--option {item!r}: expected NAME=VALUE, e.g. --option size=base")
        try:
            options[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            options[name] = text
    return options


def cmd_generate(args):
    from ..pipeline import generate

    from .installed import check_name_free

    start = time.perf_counter()
    graph = _graph(args)
    check_name_free(graph.name, args.replace_installed, "--name" if args.name else "--name (the model's name is the default)")
    report = [] if args.report else None
    files = generate(graph, args.output, target=args.target, force=args.force, opt=args.opt, report=report)
    if report is not None:
        print(f"passes ({args.opt}): nodes before -> after")
        for name, before, after in report:
            print(f"  {name:<10} {before:>5} -> {after:<5}{'  (no change)' if before == after else ''}")
    print(f"generated {graph.name} ({args.target}) in {args.output}: {len(files)} files, "
          f"{time.perf_counter() - start:.2f} s")
    # A bare folder name given to pip is a requirement looked up in the package index: say ./name.
    shown = args.output if os.sep in args.output or os.path.isabs(args.output) else os.path.join(".", args.output)
    print(f"next: deepgen build {shown}   (or: pip install {shown})")


def cmd_build(args):
    from .build import build_project

    build_project(args.project, target_dir=args.target_dir, replace_installed=args.replace_installed)


def cmd_check(args):
    graph = _graph(args)
    print(f"{graph.name}: shapes check out ({len(graph.nodes)} ops, {len(graph.params)} parameters)")
    for name, v in graph.outputs:
        print(f"  output {name}: {v.type_str()}")


def cmd_ir(args):
    from .. import pipeline

    graph = _graph(args)
    if args.after in ("optimize", "differentiate", "lower", "plan_memory"):
        pipeline.optimize(graph, "O2")
        if args.after != "optimize":
            pipeline.differentiate(graph, "O2")
        if args.after == "lower":
            print(pipeline.plan_text(pipeline.lower(graph, "cpu")), end="")
            return
        if args.after == "plan_memory":
            print(pipeline.plan_text(pipeline.lowered(graph, "cpu")), end="")
            return
        print(graph, end="")
        return
    if args.after:
        from ..transforms.passes import optimize

        optimize(graph, "O2", until=args.after)
    if args.grad:
        from ..transforms.autodiff import prepare_training

        if graph.train is None:
            raise DeepgenError(f"{args.model}: --grad needs a trainable model (call dg.train(loss, ...) in it)")
        prepare_training(graph)
        print(f"# training: {graph.train.optimizer.describe()}, weight_decay={graph.train.weight_decay:g}; "
              f"loss '{graph.train.loss.name}'; gradients of: {', '.join(graph.train.grads)}")
    print(graph, end="")


def cmd_memory(args):
    from ..memory.report import parse_bytes, plot_png, report
    from ..pipeline import lowered, prepare

    graph = prepare(_graph(args), args.opt)
    plan = lowered(graph, "cpu")
    dims = {}
    for item in args.dim or []:
        name, _, value = item.partition("=")
        match = [d for d in graph.dims if str(d) == name]
        if not match or not value.isdigit():
            raise DeepgenError(f"--dim {item!r}: expected NAME=INT with NAME one of {', '.join(map(str, graph.dims))}")
        dims[match[0]] = int(value)
    budget = parse_bytes(args.budget) if args.budget else None
    print(report(graph, plan, batch=args.batch, dims=dims, budget=budget), end="")
    if args.plot:
        plot_png(graph, plan, args.plot, batch=args.batch, dims=dims)
        print(f"plot written to {args.plot}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepgen", description="Compile a Python DSL model into a readable C++ project.")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="write a standalone C++ project for a model")
    g.add_argument("model", help="model file, FILE.py or FILE.py:NAME")
    g.add_argument("-o", "--output", required=True, help="folder to write the project into")
    from ..codegen.targets import available

    g.add_argument("--target", default="cpu", choices=available())
    g.add_argument("--name", help="project and module name (default: the model's name)")
    g.add_argument("--force", action="store_true", help="overwrite files edited since the last generation")
    g.add_argument("-O", dest="opt", default="O2", choices=["O0", "O1", "O2"], type=lambda s: s if s.startswith("O") else "O" + s,
                   help="optimization level: -O0 none, -O1 SSA passes and constant folding, "
                        "-O2 also elementwise and GEMM-epilogue fusion (default)")
    g.add_argument("--report", action="store_true", help="print what each optimization pass changed")
    g.add_argument("--replace-installed", action="store_true",
                   help="allow a project name that is an installed distribution or module (building replaces it)")
    g.set_defaults(func=cmd_generate)
    b = sub.add_parser("build", help="build a generated project and install its Python module")
    b.add_argument("project")
    b.add_argument("--target-dir", help="install the module into this folder instead of the environment")
    b.add_argument("--replace-installed", action="store_true",
                   help="let the build replace an installed distribution or module of the same name")
    b.set_defaults(func=cmd_build)
    c = sub.add_parser("check", help="check a model's shapes without generating code")
    c.add_argument("model")
    c.set_defaults(func=cmd_check)
    mem = sub.add_parser("memory", help="static memory analysis: per-statement table, peak formula, budget")
    mem.add_argument("model")
    mem.add_argument("--batch", type=int, default=32, help="value of the symbolic sizes in the table (default 32)")
    mem.add_argument("--dim", action="append", help="NAME=INT: a symbolic size other than the batch")
    mem.add_argument("--budget", help="memory budget, e.g. 2GiB: prints the largest batch that fits")
    mem.add_argument("--plot", help="write a PNG of live bytes over the schedule")
    mem.add_argument("-O", dest="opt", default="O2", choices=["O0", "O1", "O2"], type=lambda s: s if s.startswith("O") else "O" + s,
                     help="optimization level the analysis assumes (as for generate)")
    mem.set_defaults(func=cmd_memory)
    i = sub.add_parser("ir", help="print a model's graph")
    i.add_argument("model")
    i.add_argument("--grad", action="store_true", help="include the backward pass (gradient nodes)")
    i.add_argument("--after", help="stop after a stage (optimize, differentiate, lower: the lowered statements "
                                   "and kernels, plan_memory: with the arena offsets) or after one pass of -O2 (dce, cse, fold, copyprop, fuse, "
                                   "simplify, epilogue, remat) and print what it made (a pass over the forward graph; "
                                   "remat changes only the training graph: see --after differentiate)")
    i.set_defaults(func=cmd_ir)
    for command in (g, c, mem, i):
        command.add_argument("--option", action="append", metavar="NAME=VALUE",
                             help="a keyword argument of the model function (repeatable), e.g. --option size=base")
    for command in sub.choices.values():
        command.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        args.func(args)
    except DeepgenError as e:
        if args.debug:
            traceback.print_exc()
        print(f"deepgen {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"deepgen {args.command}: interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # a file system problem outside deepgen's own checks
        if args.debug:
            traceback.print_exc()
        print(f"deepgen {args.command}: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # a bug in deepgen: say so in one line, details with --debug
        if args.debug:
            traceback.print_exc()
        print(f"deepgen {args.command}: internal error: {type(e).__name__}: {e} "
              "(run with --debug for the traceback, and please report it)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
