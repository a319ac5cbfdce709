"""A graph as Graphviz DOT text (`deepgen ir MODEL.py --dot FILE`), and SVG through
Graphviz's `dot` program when it is installed (`--svg FILE`).

One DOT node per graph input (blue ellipse), parameter (yellow box; batch norm's
running statistics dashed), op node (white box: the op, then each output's name
and type; backward nodes grey) and graph output (double ellipse); one edge per
operand an op reads. Ids follow the graph's order, so the text is deterministic.
"""

from __future__ import annotations

import shutil
import subprocess

from ..errors import DeepgenError
from .optable import get_op

_INPUT = 'shape=ellipse, style=filled, fillcolor="#dbeafe"'
_PARAM = 'shape=box, style="rounded,filled", fillcolor="#fef3c7"'
_STATE = 'shape=box, style="rounded,filled,dashed", fillcolor="#fef3c7"'
_MODE = 'shape=ellipse, style=filled, fillcolor="#e5e7eb"'
_OP = {"forward": "shape=box", "loss": 'shape=box, style=filled, fillcolor="#fee2e2"',
       "backward": 'shape=box, style=filled, fillcolor="#f3f4f6", color="#6b7280"'}
_OUTPUT = 'shape=ellipse, peripheries=2, style=filled, fillcolor="#dcfce7"'
_EXPR_WIDTH = 48  # a fused expression longer than this is cut short in the label (the tooltip has it all)


def quote(text: str) -> str:
    """text as a DOT string literal: backslashes and quotes escaped, newlines as DOT's \\n."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _op_label(node, description: str) -> str:
    head, sep, expr = description.partition(" := ")
    lines = [head.split("(", 1)[0]]
    if sep:  # an elementwise op: its expression in the operands' names
        lines.append(expr if len(expr) <= _EXPR_WIDTH else expr[:_EXPR_WIDTH - 3] + "...")
    lines += [f"{v.name}: {v.type_str()}" for v in node.outputs]
    return "\n".join(lines)


def to_dot(graph) -> str:
    """The DOT text of `graph` (see the module docstring)."""
    ids = {}  # id(Value) -> DOT node id
    lines = [f"digraph {quote(graph.name)} {{", "  rankdir=TB;",
             '  node [fontname="Helvetica", fontsize=10];', '  edge [fontname="Helvetica", fontsize=9];']

    def declare(key: str, label: str, style: str, tooltip: str | None = None) -> None:
        extra = f", tooltip={quote(tooltip)}" if tooltip else ""
        lines.append(f"  {key} [label={quote(label)}, {style}{extra}];")

    for i, v in enumerate(graph.inputs):
        ids[id(v)] = f"in{i}"
        declare(f"in{i}", f"input {v.name}\n{v.type_str()}", _INPUT)
    for i, p in enumerate(graph.params):
        ids[id(p)] = f"p{i}"
        kind = "state" if p.kind == "state" else "param"
        declare(f"p{i}", f"{kind} {p.name}\n{p.type_str()}", _STATE if p.kind == "state" else _PARAM,
                p.loc.short if p.loc is not None else None)
    if graph.mode is not None:
        ids[id(graph.mode)] = "mode"
        declare("mode", f"{graph.mode.name}\n(train/eval mode)", _MODE)
    edges = []
    for i, node in enumerate(graph.nodes):
        description = get_op(node.op).describe(node)
        where = f"  ({node.loc.short})" if node.loc is not None else ""
        declare(f"n{i}", _op_label(node, description), _OP.get(node.phase, _OP["forward"]), description + where)
        for v in node.inputs:
            edges.append((v, f"n{i}"))
        for v in node.outputs:
            ids[id(v)] = f"n{i}"
    for i, (name, v) in enumerate(graph.outputs):
        declare(f"out{i}", f"output {name}\n{v.type_str()}", _OUTPUT)
        edges.append((v, f"out{i}"))
    for v, dest in edges:
        source = ids.get(id(v))
        if source is None:
            raise DeepgenError(f"graph {graph.name}: {dest} reads value {v.name}, which nothing in the graph makes")
        producer = v.producer
        many = producer is not None and len(producer.outputs) > 1
        lines.append(f"  {source} -> {dest}" + (f" [label={quote(v.name)}];" if many else ";"))
    lines.append("}")
    return "\n".join(lines) + "\n"


def to_svg(dot_text: str, what: str) -> bytes:
    """dot_text drawn as SVG by Graphviz's `dot` program; a clear error when it is missing."""
    exe = shutil.which("dot")
    if exe is None:
        raise DeepgenError(f"{what}: --svg needs Graphviz's `dot` program, which is not installed (not on PATH); "
                           "install Graphviz (e.g. `apt install graphviz`), or write the DOT text with --dot FILE, "
                           "which works without it")
    proc = subprocess.run([exe, "-Tsvg"], input=dot_text.encode(), capture_output=True)
    if proc.returncode != 0:
        raise DeepgenError(f"{what}: Graphviz's dot failed: {proc.stderr.decode(errors='replace').strip()}")
    return proc.stdout
