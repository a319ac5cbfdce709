"""Readable text form of a graph, for `deepgen ir` and for debugging."""

from __future__ import annotations

from .optable import get_op


def format_node(node) -> str:
    lhs = ", ".join(f"{v.name}: {v.type_str()}" for v in node.outputs)
    rhs = get_op(node.op).describe(node)
    return f"{lhs} = {rhs}"


def format_graph(graph, with_locs: bool = True) -> str:
    args = ", ".join(f"{v.name}: {v.type_str()}" for v in graph.inputs)
    outs = ", ".join(
        f"{name}: {v.type_str()}" + ("" if name == v.name else f" = {v.name}") for name, v in graph.outputs
    )
    lines = [f"graph {graph.name}({args}) -> ({outs})"]
    rows = []
    for p in graph.params:
        rows.append((f"{'state' if p.kind == 'state' else 'param'} {p.name}: {p.type_str()} = {p.init.describe()}", p.loc))
    for node in graph.nodes:
        rows.append((format_node(node), node.loc))
    width = max((len(r.split("\n")[0]) for r, _ in rows if "\n" not in r), default=0)
    for text, loc in rows:
        first, *rest = text.split("\n")
        if with_locs and loc is not None:
            lines.append(f"  {first.ljust(width)}  # {loc.short}")
        else:
            lines.append(f"  {first}")
        lines += [f"  {line}" for line in rest]
    return "\n".join(lines) + "\n"
