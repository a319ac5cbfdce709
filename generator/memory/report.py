"""`deepgen memory`: the static memory analysis as a report.

Per arena buffer in schedule order: the statement, the value, its shape, its
bytes and the bytes live after it; totals by category; the arena (peak) as a
formula in the symbolic dims next to the lower bound; and the largest batch
that fits a budget. `plot_png` draws live bytes over the schedule.
"""

from __future__ import annotations

import math
import re
import struct
import zlib

import sympy

from ..errors import DeepgenError
from ..fileio import write_atomic
from ..ops import get_op
from ..ir.shapes import fmt_shape, numel

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    try:
        if not match or match.group(2).upper() not in _UNITS:
            raise ValueError(text)
        value = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    except (ValueError, OverflowError):  # "e", "1..2", or a number past a float's range
        raise DeepgenError(f"cannot read the budget {text!r}; write e.g. 2GiB, 512MiB, 100MB or 1000000") from None
    if value <= 0:
        raise DeepgenError(f"the budget {text!r} is not a positive number of bytes")
    return value


def human(n) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


class MemoryModel:
    """Bytes by category as formulas, from a lowered plan."""

    def __init__(self, graph, plan):
        self.graph, self.plan = graph, plan
        memory = plan.memory
        self.buffers = memory["buffers"]
        self.train = graph.train is not None
        self.arena = 4 * sympy.sympify(memory["train_floats"] if self.train else memory["forward_floats"])
        self.bound = 4 * sympy.sympify(memory["train_bound"] if self.train else memory["forward_bound"])
        self.forward_arena = 4 * sympy.sympify(memory["forward_floats"])
        # train_step() with keep_gradients off: the gradients live in the arena until
        # their updates, and none are kept between steps.
        self.freed_arena = 4 * sympy.sympify(memory["train_freed_floats"]) if self.train else None
        params = sum(numel(p.shape) for p in graph.params)
        trained = sum(numel(p.shape) for p in graph.params if self.train and p.name in graph.train.grads)
        slots = len(graph.train.optimizer.slots) if self.train else 0
        self.categories = {
            "parameters": 4 * params,
            "gradients": 4 * trained,
            "optimizer state": 4 * trained * slots,
            "activations (arena)": self.arena,
            "outputs": 4 * sympy.expand(sum((sympy.sympify(numel(v.shape)) for _, v in graph.outputs), sympy.Integer(0))),
        }
        if self.train:  # train_step's loss: a buffer of its own, like the outputs
            self.categories["loss"] = 4 * sympy.sympify(numel(graph.train.loss.shape))
        self.total = sympy.expand(sum((sympy.sympify(v) for v in self.categories.values()), sympy.Integer(0)))
        self.freed_total = (sympy.expand(self.total - self.categories["gradients"] - self.arena + self.freed_arena)
                            if self.train else None)

    def at(self, expr, dims) -> int:
        return int(sympy.sympify(expr).subs(dims))

    def live_after(self, dims) -> list:
        """(buffer, live bytes once it is written) in schedule order, gradients kept
        (they are not in the arena then)."""
        rows = []
        buffers = [b for b in self.buffers if b.phase != "gradient"]
        for b in sorted(buffers, key=lambda b: (b.first, b.name)):
            live = [x for x in buffers if x.first <= b.first <= x.last and not (x.inplace_of is not None and x.first > b.first)]
            shared = {id(x.inplace_of) for x in live if x.inplace_of is not None}
            total = sum(self.at(x.size, dims) for x in live if id(x) not in shared)
            rows.append((b, 4 * total))
        return rows

    def largest_batch(self, budget: int, batch_dim, dims) -> int:
        """The largest value of batch_dim (others as in dims) whose total fits."""
        def total(n):
            return self.at(self.total, {**dims, batch_dim: n})

        if total(1) > budget:
            raise DeepgenError(
                f"a budget of {human(budget)} cannot hold even batch 1: it needs at least {human(total(1))} "
                f"({total(1)} bytes)"
            )
        lo, hi = 1, 2
        while total(hi) <= budget and hi < 2**40:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if total(mid) <= budget else (lo, mid)
        return lo


def report(graph, plan, batch: int = 32, dims: dict | None = None, budget: int | None = None) -> str:
    m = MemoryModel(graph, plan)
    values = {d: batch for d in graph.dims}
    values.update(dims or {})
    sizes = ", ".join(f"{d}={v}" for d, v in values.items()) or "no symbolic sizes"
    kind = "train_step" if m.train else "forward"
    lines = [f"Memory of {graph.name} ({kind}), at {sizes}", ""]
    lines.append(f"{'statement':<44} {'value':<22} {'shape':<20} {'bytes':>12} {'live bytes':>12}")
    for b, live in m.live_after(values):
        where = (b.label or b.phase)[:44]
        note = " (in place)" if b.inplace_of is not None else ""
        lines.append(f"{where:<44} {(b.name + note)[:22]:<22} {fmt_shape(b.shape)[:20]:<20} "
                     f"{4 * m.at(b.size, values):>12,} {live:>12,}")
    lines += ["", "totals by category:"]
    for name, expr in m.categories.items():
        lines.append(f"  {name:<22} {m.at(expr, values):>14,} bytes   = {sympy.sympify(expr)}")
    lines.append(f"  {'total':<22} {m.at(m.total, values):>14,} bytes   = {m.total}")
    lines += [
        "",
        f"peak (planned arena)     = {m.arena} bytes = {m.at(m.arena, values):,} at {sizes}",
        f"lower bound (max live)   = {m.bound} bytes = {m.at(m.bound, values):,} "
        f"(planned / bound = {m.at(m.arena, values) / max(m.at(m.bound, values), 1):.3f})",
    ]
    if m.train:
        lines.append(f"forward() arena          = {m.forward_arena} bytes = {m.at(m.forward_arena, values):,}")
        lines.append(f"keep_gradients off       = arena {m.freed_arena} bytes = {m.at(m.freed_arena, values):,}, "
                     f"total {m.at(m.freed_total, values):,} (each gradient in the arena until its update)")
    for note in dict.fromkeys(get_op(n.op).memory_note for n in graph.nodes):
        if note:
            lines.append(note)
    if budget is not None:
        batch_dim = graph.dims[0] if graph.dims else None
        if batch_dim is None:
            if m.at(m.total, values) > budget:
                raise DeepgenError(f"a budget of {human(budget)} cannot hold the model: it needs "
                                   f"{human(m.at(m.total, values))}")
            lines.append(f"fits a budget of {human(budget)} (no symbolic batch size)")
        else:
            others = {d: v for d, v in values.items() if d != batch_dim}
            best = m.largest_batch(budget, batch_dim, others)
            lines.append(f"largest {batch_dim} within {human(budget)}: {best:,}"
                         + (f" (with {', '.join(f'{d}={v}' for d, v in others.items())})" if others else ""))
    return "\n".join(lines) + "\n"


def plot_png(graph, plan, path, batch: int = 32, dims: dict | None = None, width: int = 640, height: int = 240):
    """Live bytes after each buffer is written, as bars (a PNG written without
    plotting libraries: rows of RGB pixels, zlib-compressed)."""
    m = MemoryModel(graph, plan)
    values = {d: batch for d in graph.dims}
    values.update(dims or {})
    series = [live for _, live in m.live_after(values)] or [0]
    top = max(max(series), m.at(m.arena, values), 1)
    pixels = [[(255, 255, 255)] * width for _ in range(height)]
    bar = max(1, (width - 20) // len(series))
    for i, live in enumerate(series):
        h = int((height - 20) * live / top)
        for x in range(10 + i * bar, min(10 + (i + 1) * bar - (1 if bar > 2 else 0), width - 10)):
            for y in range(height - 10 - h, height - 10):
                pixels[y][x] = (60, 110, 200)
    arena_y = height - 10 - int((height - 20) * m.at(m.arena, values) / top)
    for x in range(10, width - 10):
        pixels[max(arena_y, 0)][x] = (220, 50, 50)  # the planned arena
    raw = b"".join(b"\x00" + bytes(c for px in row for c in px) for row in pixels)

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    write_atomic(path, png)
    return math.ceil(top)
