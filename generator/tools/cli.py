"""The `deepgen` command line: generate, build, quantize, check, ir, memory, from-torch, from-onnx, compare."""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

from ..errors import DeepgenError


def _graph(args):
    from ..frontend.loader import load_model
    from ..transforms.precision import set_precision
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
    graph = model.build(name, **_options(getattr(args, "option", None) or []))
    for note in set_precision(graph, getattr(args, "precision", "fp32")):
        print(note)
    return graph


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
    result = generate(graph, args.output, target=args.target, force=args.force, opt=args.opt, report=report,
                      restore=args.restore)
    if report is not None:
        print(f"passes ({args.opt}): nodes before -> after")
        width = max((len(name) for name, _, _ in report), default=0)
        for name, before, after in report:
            print(f"  {name:<{width}} {before:>5} -> {after:<5}{'  (no change)' if before == after else ''}")
    for note in result.notes:  # merged edits, files kept deleted or kept
        print(f"  {note}")
    print(f"generated {graph.name} ({args.target}) in {args.output}: {len(result.written)} files, "
          f"{time.perf_counter() - start:.2f} s")
    # A bare folder name given to pip is a requirement looked up in the package index: say ./name.
    shown = args.output if os.sep in args.output or os.path.isabs(args.output) else os.path.join(".", args.output)
    print(f"next: deepgen build {shown}   (or: pip install {shown})")


def cmd_build(args):
    from .build import build_project, cross_build

    if args.cross:
        cross_build(args.project, args.cross, build_dir=args.build_dir, march=args.march)
        return
    if args.build_dir or args.march:
        raise DeepgenError("--build-dir and --march go with --cross (a native build installs the module with pip)")
    build_project(args.project, target_dir=args.target_dir, replace_installed=args.replace_installed)


def cmd_quantize(args):
    from .quantize import quantize

    quantize(args.model, args.weights, args.calibrate, args.output, force=args.force,
             options=_options(args.option or []))


def cmd_check(args):
    graph = _graph(args)
    print(f"{graph.name}: shapes check out ({len(graph.nodes)} ops, {len(graph.params)} parameters)")
    for name, v in graph.outputs:
        print(f"  output {name}: {v.type_str()}")


def cmd_ir(args):
    from .. import pipeline

    graph = _graph(args)
    if args.grad and args.after in _STAGES:
        raise DeepgenError(f"--grad with --after {args.after}: --grad goes with one pass (--after dce ... remat) "
                           "or alone; of the whole stages, differentiate, lower and plan_memory print a trainable "
                           "model's backward pass anyway")
    if (args.dot or args.svg) and args.after in ("lower", "plan_memory"):
        raise DeepgenError(f"--dot and --svg draw a graph; --after {args.after} makes a lowered plan (print it without them)")
    if args.after in _STAGES:
        pipeline.optimize(graph, "O2")
        if args.after != "optimize":
            pipeline.differentiate(graph, "O2")
        if args.after == "lower":
            print(pipeline.plan_text(pipeline.lower(graph, "cpu")), end="")
            return
        if args.after == "plan_memory":
            print(pipeline.plan_text(pipeline.lowered(graph, "cpu")), end="")
            return
        _show(args, graph)
        return
    if args.after is not None:
        from ..transforms.passes import optimize

        optimize(graph, "O2", until=args.after)
    if args.grad:
        from ..transforms.autodiff import prepare_training

        if graph.train is None:
            raise DeepgenError(f"{args.model}: --grad needs a trainable model (call dg.train(loss, ...) in it)")
        prepare_training(graph)
        print(f"# training: {graph.train.optimizer.describe()}, weight_decay={graph.train.weight_decay:g}; "
              f"loss '{graph.train.loss.name}'; gradients of: {', '.join(graph.train.grads)}")
    _show(args, graph)


def _show(args, graph):
    """Print the graph, or write it as DOT (--dot FILE) or SVG (--svg FILE, with Graphviz)."""
    from ..fileio import write_atomic
    from ..ir.dot import to_dot, to_svg

    if not (args.dot or args.svg):
        print(graph, end="")
        return
    text = to_dot(graph)
    outputs = [(args.dot, text.encode())] if args.dot else []
    if args.svg:
        outputs.append((args.svg, to_svg(text, args.model)))
    for path, data in outputs:
        write_atomic(path, data)
        print(f"graph {graph.name} ({len(graph.nodes)} ops) written to {path}")


_STAGES = ("optimize", "differentiate", "lower", "plan_memory")  # ir --after: whole stages (the rest are passes)


def _after(text: str) -> str:
    """ir --after: a stage or one -O2 pass, checked here so a typo is an error, not a crash."""
    from ..transforms.passes import LEVELS

    known = list(_STAGES) + list(dict.fromkeys(LEVELS["O2"]))
    if text not in known:
        raise argparse.ArgumentTypeError(f"unknown stage or pass {text!r} (choose from {', '.join(known)})")
    return text


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a size (at least 1)")
    return value


def _path(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (name one, e.g. -o build/mlp)")
    return text


def cmd_memory(args):
    from ..memory.report import parse_bytes, plot_png, report
    from ..pipeline import lowered, prepare

    graph = prepare(_graph(args), args.opt)
    plan = lowered(graph, "cpu")
    dims = {}
    for item in args.dim or []:
        name, _, value = item.partition("=")
        match = [d for d in graph.dims if str(d) == name]
        if not match or not value.isdigit() or int(value) < 1:
            raise DeepgenError(f"--dim {item!r}: expected NAME=INT (INT at least 1) with NAME one of {', '.join(map(str, graph.dims))}")
        dims[match[0]] = int(value)
    budget = parse_bytes(args.budget) if args.budget else None
    print(report(graph, plan, batch=args.batch, dims=dims, budget=budget), end="")
    if args.plot:
        plot_png(graph, plan, args.plot, batch=args.batch, dims=dims)
        print(f"plot written to {args.plot}")


def cmd_from_torch(args):
    from ..importers import from_torch, write_model
    from ..importers.torch_cli import example_inputs, factory_file, load_factory
    from ..importers.torch_import import check_targets

    # Absolute before the factory runs (it may chdir); checked now, before the slow part, and again
    # when written. The factory's own file is never written over, not even with --force.
    weights_arg = args.weights or os.path.splitext(args.output)[0] + ".npz"
    protect = [factory_file(args.factory)]
    paths = check_targets(args.output, weights_arg, replace=args.force, protect=protect)
    examples, dims = example_inputs(args.example_input)
    module = load_factory(args.factory)
    source, weights = from_torch(module, examples, name=args.name, dims=dims)
    write_model(source, weights, *paths, replace=args.force, protect=protect)
    print(f"wrote {args.output} and {weights_arg} ({len(weights)} arrays)")
    print(f"next: deepgen generate {args.output} -o {os.path.splitext(os.path.basename(args.output))[0]}_project")


def cmd_compare(args):
    from .compare import run_compare

    first = run_compare(args.model, args.weights, args.torch, args.example_input, args.tolerance, args.build_dir,
                        onnx_file=args.onnx)
    return 0 if first is None else 1


def cmd_from_onnx(args):
    from ..importers.onnx_import import command

    command(args)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepgen", description="Compile a Python DSL model into a readable C++ project.")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="write a standalone C++ project for a model")
    g.add_argument("model", help="model file, FILE.py or FILE.py:NAME")
    g.add_argument("-o", "--output", required=True, type=_path, help="folder to write the project into")
    from ..codegen.targets import available
    from ..transforms.precision import PRECISIONS

    g.add_argument("--target", default="cpu", choices=available())
    g.add_argument("--name", help="project and module name (default: the model's name)")
    g.add_argument("--force", action="store_true",
                   help="write the generation as it is instead of merging your edits into it (your versions are "
                        "kept under .deepgen/premerge/); also writes generated files you deleted")
    g.add_argument("--restore", action="store_true", help="write again the generated files you deleted")
    g.add_argument("-O", dest="opt", default="O2", choices=["O0", "O1", "O2"], type=lambda s: s if s.startswith("O") else "O" + s,
                   help="optimization level: -O0 none, -O1 SSA passes and constant folding, "
                        "-O2 also elementwise and GEMM-epilogue fusion (default)")
    g.add_argument("--report", action="store_true", help="print what each optimization pass changed")
    g.add_argument("--precision", default="fp32", choices=PRECISIONS,
                   help="fp32 (default), or bf16: every product's operands (weights included) rounded to "
                        "bfloat16, accumulation and elementwise math in float32; or int8: every product by a weight "
                        "(dense layers) in int8 with int32 sums, scales from `deepgen quantize` (both inference only)")
    g.add_argument("--replace-installed", action="store_true",
                   help="allow a project name that is an installed distribution or module (building replaces it)")
    g.set_defaults(func=cmd_generate)
    b = sub.add_parser("build", help="build a generated project and install its Python module")
    b.add_argument("project")
    b.add_argument("--target-dir", help="install the module into this folder instead of the environment")
    b.add_argument("--replace-installed", action="store_true",
                   help="let the build replace an installed distribution or module of the same name")
    b.add_argument("--cross", choices=["aarch64"],
                   help="cross-compile the C++ library and example program for this CPU instead (CMake with "
                        "the project's cmake/aarch64-linux-gnu.cmake; needs Debian's g++-aarch64-linux-gnu)")
    b.add_argument("--build-dir", help="with --cross: the build folder (default: PROJECT/build-aarch64)")
    b.add_argument("--march", help="with --cross: the target CPU, a -march value (default: armv8.2-a+fp16+dotprod)")
    b.set_defaults(func=cmd_build)
    q = sub.add_parser("quantize", help="calibrate the int8 scales of a model (--precision int8) and write them beside its weights")
    q.add_argument("model", help="model file, FILE.py or FILE.py:NAME")
    q.add_argument("--weights", required=True, help="its float32 weights (.npz, as Model.save writes)")
    q.add_argument("--calibrate", required=True, metavar="DATA.npz",
                   help="calibration inputs, one array per input of the model (with the labels, the report gives both accuracies)")
    q.add_argument("-o", "--output", required=True, type=_path, help="the weights file to write: every array of --weights and the scales")
    q.add_argument("--force", action="store_true", help="replace the -o file if it exists")
    q.set_defaults(func=cmd_quantize)
    c = sub.add_parser("check", help="check a model's shapes without generating code")
    c.add_argument("model")
    c.set_defaults(func=cmd_check)
    mem = sub.add_parser("memory", help="static memory analysis: per-statement table, peak formula, budget")
    mem.add_argument("model")
    mem.add_argument("--batch", type=_positive, default=32, help="value of the symbolic sizes in the table (default 32)")
    mem.add_argument("--dim", action="append", help="NAME=INT: a symbolic size other than the batch")
    mem.add_argument("--budget", help="memory budget, e.g. 2GiB: prints the largest batch that fits")
    mem.add_argument("--plot", help="write a PNG of live bytes over the schedule")
    mem.add_argument("-O", dest="opt", default="O2", choices=["O0", "O1", "O2"], type=lambda s: s if s.startswith("O") else "O" + s,
                     help="optimization level the analysis assumes (as for generate)")
    mem.add_argument("--precision", default="fp32", choices=PRECISIONS, help="the precision the analysis assumes (as for generate)")
    mem.set_defaults(func=cmd_memory)
    i = sub.add_parser("ir", help="print a model's graph")
    i.add_argument("model")
    i.add_argument("--grad", action="store_true", help="include the backward pass (gradient nodes)")
    i.add_argument("--after", type=_after, help="stop after a stage (optimize, differentiate, lower: the lowered statements "
                                   "and kernels, plan_memory: with the arena offsets) or after one pass of -O2 (dce, cse, fold, copyprop, fuse, "
                                   "simplify, epilogue, remat) and print what it made (a pass over the forward graph; "
                                   "remat changes only the training graph: see --after differentiate)")
    i.add_argument("--dot", metavar="FILE", help="write the graph as Graphviz DOT text to FILE instead of printing it")
    i.add_argument("--svg", metavar="FILE", help="draw the graph as SVG into FILE (needs Graphviz's `dot` program)")
    i.set_defaults(func=cmd_ir)
    ft = sub.add_parser("from-torch", help="write a model file and its weights from a PyTorch nn.Module (torch.fx)")
    ft.add_argument("factory", help="MODULE.py:FACTORY, a function returning the nn.Module (put in eval mode)")
    ft.add_argument("-o", "--output", required=True, type=_path, help="the model file to write (.py)")
    ft.add_argument("--weights", help="the weights file to write (default: the model file's name with .npz)")
    ft.add_argument("--example-input", action="append", metavar="NAME=SHAPE[:dtype]",
                    help="an argument of forward and its example shape, e.g. x=4,784 or tokens=4,12:int64 "
                         "(repeatable); axis 0 becomes the batch N; name dims explicitly with x=N=4,T=12,16")
    ft.add_argument("--name", help="the model's name (default: the module's class name in snake_case)")
    ft.add_argument("--force", action="store_true",
                    help="replace a model or weights file that exists (never the PyTorch source of the module)")
    ft.set_defaults(func=cmd_from_torch)
    fo = sub.add_parser("from-onnx", help="write a model file and its weights from an ONNX file")
    fo.add_argument("model", help="the ONNX file (.onnx)")
    fo.add_argument("-o", "--output", required=True, type=_path, help="the model file to write (.py)")
    fo.add_argument("--weights", help="the weights file to write (default: the model file's name with .npz)")
    fo.add_argument("--name", help="the model's name (default: the ONNX file's name, as an identifier)")
    fo.add_argument("--outputs", metavar="NAME[,NAME...]", help="import these graph outputs only (default: all)")
    fo.add_argument("--force", action="store_true", help="replace a model or weights file that exists (never the ONNX file)")
    fo.set_defaults(func=cmd_from_onnx)
    cm = sub.add_parser("compare", help="run an imported model beside its PyTorch or ONNX original and name the "
                                        "first statement whose output differs")
    cm.add_argument("model", help="the model file (from deepgen from-torch or from-onnx), FILE.py or FILE.py:NAME")
    cm.add_argument("--weights", required=True, help="its weights (.npz)")
    original = cm.add_mutually_exclusive_group(required=True)
    original.add_argument("--torch", metavar="FILE.py:FACTORY", help="the PyTorch module it came from")
    original.add_argument("--onnx", metavar="FILE.onnx", type=_path,
                          help="the ONNX file it came from (run by onnxruntime, which must be installed)")
    cm.add_argument("--example-input", action="append", metavar="NAME=SHAPE[:dtype]", required=True,
                    help="an input of forward and its shape, as for from-torch (repeatable)")
    cm.add_argument("--tolerance", type=float, default=1e-4, help="largest relative error taken as equal (default 1e-4)")
    cm.add_argument("--build-dir", type=_path, help="keep the debug project and its build here (default: a "
                                                     "temporary folder, removed afterwards)")
    cm.set_defaults(func=cmd_compare)
    for command in (g, c, mem, i, q):
        command.add_argument("--option", action="append", metavar="NAME=VALUE",
                             help="a keyword argument of the model function (repeatable), e.g. --option size=base")
    for command in sub.choices.values():
        command.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    return p


def main(argv=None) -> int:
    try:
        args = parser().parse_args(argv)
    except KeyboardInterrupt:
        print("deepgen: interrupted", file=sys.stderr)
        return 130
    try:
        rc = args.func(args)
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
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
