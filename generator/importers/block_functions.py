"""The functions of blocks.py written: one per structure of a repeated module class, its
arguments the slots that differ between the instances, and each instance's call."""

from __future__ import annotations

import ast
import copy
import inspect

from .blocks import _identifier, _reads, _snake


def functions(instances, taken, top) -> tuple:
    """(function texts, {path: (result variable(s), function name, the call's keyword arguments)});
    `taken`: the names of the model function and the file's top level, `top`: the latter."""
    variants: dict = {}  # (class, key) -> instances
    for inst in instances:
        variants.setdefault((inst.cls, inst.key), []).append(inst)
    names = _variant_names(variants, taken)
    texts, calls = [], {}
    results = set(names.values())
    for (cls, _), insts in variants.items():
        fname, what = names[cls, insts[0].key]
        first = insts[0]
        used = set(first.names) | {"name", "dg"} | set(top)
        ext_names = []
        for k in range(len(first.externals)):
            same = len(insts) > 1 and all(inst.externals[k] == first.externals[k] for inst in insts)
            listed = isinstance(first.externals[k], tuple)
            ext_names.append(_free("inputs" if listed else first.externals[k] if same else "x", used))
        args: dict = {}  # argument name -> (the DSL parameter it fills, its values instance by instance)
        slot_code = {}
        for j, (node, ctx, target, default) in enumerate(first.slots):
            values = _alike([ast.literal_eval(inst.slots[j][0]) for inst in insts])
            if len(set(values)) == 1:
                # (None: a keyword whose value is the DSL's default in every instance, left out)
                slot_code[j] = None if values[0] == default else copy.deepcopy(node)
                continue
            # One argument per DSL parameter and values: conv1's and conv2's channels are
            # `out_channels`, conv3's (other values) `conv3_out_channels`.
            name = next((a for a, (c, v) in args.items() if c == ctx and v == values), None)
            if name is None:
                name = _free(ctx if ctx.isidentifier() and ctx not in args else f"{target}_{ctx}", used)
                args[name] = (ctx, values)
            slot_code[j] = ast.Name(name, ast.Load())
        stmts = [_Fill(ext_names, slot_code).visit(copy.deepcopy(s)) for s in first.stmts]
        params = ", ".join([*ext_names, *args, "name"])
        lines = [
            f"def {fname}({params}):",
            f'    """{_origin(cls)}{f" with {what}" if what else ""}, one call per instance.',
            "",
            f'    `name`: the instance\'s module path as the prefix of its names{_example(first)}."""',
        ]
        for stmt, comment in zip(stmts, first.comments):
            lines += [f"    # {c}" for c in (comment.split("\n") if comment else ())]
            lines.append(f"    {ast.unparse(stmt)}")
        lines.append(f"    return {', '.join(c for _, c in first.outputs)}")
        texts.append("\n".join(lines))
        for i, inst in enumerate(insts):
            given = [f"{a}={values[i]}" for a, (_, values) in args.items()] + [f'name="{inst.prefix}"']
            single = len(inst.outputs) == 1
            result = (
                inst.prefix
                if single and inst.prefix not in taken and inst.prefix not in results
                else ", ".join(v for v, _ in inst.outputs)
            )
            results.add(result)
            calls[inst.path] = (result, fname, given)
    return texts, calls


def _origin(cls) -> str:
    """`BasicBlock (resnet.py:59)`: the class and where it is defined, as statements cite lines."""
    import os

    try:
        _, line = inspect.getsourcelines(cls)
        return f"{cls.__qualname__} ({os.path.basename(inspect.getsourcefile(cls))}:{line})"
    except (OSError, TypeError):
        return f"{cls.__module__}.{cls.__qualname__}"


def _alike(values) -> tuple:
    """The values' reprs, an int written as a tuple where another instance has a tuple
    (`stride=1` beside `stride=(2, 2)` is `(1, 1)`)."""
    sizes = {len(v) for v in values if isinstance(v, tuple)}
    if len(sizes) == 1:
        size = sizes.pop()
        values = [(v,) * size if isinstance(v, int) else v for v in values]
    return tuple(repr(v) for v in values)


def _example(inst) -> str:
    return f' ({inst.path} -> "{inst.prefix}")' if len(inst.path) + len(inst.prefix) <= 24 else ""


def argument(external, renames) -> str:
    """A tensor argument of a call: a variable, or a list of them."""
    if isinstance(external, tuple):
        return f"[{', '.join(renames.get(e, e) for e in external)}]"
    return renames.get(external, external)


def _free(base, used) -> str:
    name, k = base, 1
    while name in used:
        name, k = f"{base}_{k}", k + 1
    used.add(name)
    return name


def _variant_names(variants, taken) -> dict:
    """{(class, key): (function name, what its instances have)}: the class in snake case;
    where a class has several structures, the ones with submodules the others lack are
    named after them (`bottleneck_downsample`), else the ones whose last statement reads
    the block's input, where the others' does not, `_residual` (`_shortcut` where the class
    says residual already); the rest are numbered in order of first use."""
    by_class: dict = {}
    for cls, key in variants:
        by_class.setdefault(cls, []).append(key)
    names, used = {}, set(taken)
    for cls, keys in by_class.items():
        base = _snake(cls.__name__).lstrip("_") or "block"
        sets = [frozenset().union(*(i.subpaths for i in variants[cls, k])) for k in keys]
        common = frozenset.intersection(*sets)
        sums = [_sums_input(variants[cls, k][0]) for k in keys]
        extras = [
            sorted(p for p in paths - common if not any(p.startswith(q + ".") for q in paths - common))
            for paths in sets
        ]
        told = len(keys) > 1 and any(1 <= len(extra) <= 2 for extra in extras)  # by their submodules
        for key, extra, adds in zip(keys, extras, sums):
            word, what = "", ""
            if told and 1 <= len(extra) <= 2:
                word = "_".join(_identifier(p) for p in extra)
                what = " and ".join(f"`{p}`" for p in extra)
            elif len(keys) > 1 and not told and adds and not all(sums):
                word = "shortcut" if "residual" in base else "residual"
                what = "the sum with its input"
            names[cls, key] = (_free(f"{base}_{word}" if word else base, used), what)
    return names


def _sums_input(inst) -> bool:
    """The instance's last statement reads its first input (a residual sum)."""
    return "__ext0" in _reads(inst.stmts[-1])


class _Fill(ast.NodeTransformer):
    """A template's placeholders as the function's names, literals and f-strings."""

    def __init__(self, ext_names, slot_code):
        self.ext_names, self.slot_code = ext_names, slot_code

    def visit_keyword(self, node):
        value = node.value
        if (
            isinstance(value, ast.Name)
            and value.id.startswith("__slot")
            and self.slot_code[int(value.id[6:])] is None
        ):
            return None
        self.generic_visit(node)
        return node

    def visit_Name(self, node):
        if node.id.startswith("__ext"):
            return ast.Name(self.ext_names[int(node.id[5:])], ast.Load())
        if node.id.startswith("__slot"):
            return copy.deepcopy(self.slot_code[int(node.id[6:])])
        return node

    def visit_Call(self, node):
        if isinstance(node.func, ast.Name) and node.func.id == "__prefixed":
            rest = node.args[0].value
            name = ast.Name("name", ast.Load())
            if not rest:
                return name
            return ast.JoinedStr([ast.FormattedValue(name, -1, None), ast.Constant(rest)])
        self.generic_visit(node)
        return node
