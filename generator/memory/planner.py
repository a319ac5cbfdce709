"""Static memory planning: liveness over the lowered schedule and one arena per
call, with offsets that are sympy expressions in the symbolic dims.

The plan is valid for every value of the dims (each at least 1, which the
generated code checks): a buffer only reuses a freed block whose size is at
least its own for all such values (the
difference, expanded, has no negative coefficient), and otherwise goes on top,
at an offset that is a sum of sizes below it. An elementwise output whose input
dies at that statement, with the same shape, is computed in place. The arena's
size is the largest top reached; the lower bound is the largest total of live
bytes at any statement. Sizes and offsets are counted in floats (4 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

FLOAT_BYTES = 4


@dataclass(eq=False)
class Buffer:
    name: str
    size: object  # floats, a sympy expression or int
    first: int  # schedule position that writes it
    last: int  # last position that reads it
    phase: str  # forward | loss | backward
    inplace_of: "Buffer | None" = None  # shares this buffer's block (elementwise in place)
    offset: object = None
    label: str = ""  # the statement, for reports
    shape: tuple = ()


def dominates(a, b) -> bool:
    """a >= b for every value >= 1 of the symbols (symbolic sizes are at least 1;
    the generated code checks it). A sufficient test: with each symbol s written
    as 1 + t (t >= 0), the expanded difference has no negative coefficient; Max
    is split up."""
    a, b = sympy.sympify(a), sympy.sympify(b)
    if isinstance(b, sympy.Max):
        return all(dominates(a, x) for x in b.args)
    if isinstance(a, sympy.Max):
        return any(dominates(x, b) for x in a.args)
    diff = sympy.expand(a - b)
    if diff.is_number:
        return diff >= 0
    diff = sympy.expand(diff.xreplace({s: s + 1 for s in diff.free_symbols}))
    if diff.is_number:
        return diff >= 0
    poly = sympy.Poly(diff, *sorted(diff.free_symbols, key=str))
    return all(c >= 0 for c in poly.coeffs())


def sym_max(a, b):
    if dominates(a, b):
        return a
    if dominates(b, a):
        return b
    return sympy.Max(a, b)


def _same(a, b) -> bool:
    return sympy.expand(sympy.sympify(a) - sympy.sympify(b)) == 0


def plan(buffers: list):
    """Assign offsets with each planner below and keep the plan whose whole arena,
    then forward() arena, is smallest at a typical size; returns the arena size
    (floats)."""
    best = None
    for planner in (_plan_online, lambda bs: _plan_by_size(bs, True), lambda bs: _plan_by_size(bs, False)):
        peak = planner(buffers)
        key = (_typical(peak), _typical(arena_size(buffers, {"forward"})))
        if best is None or key < best[0]:
            best = (key, peak, {id(b): b.offset for b in buffers})
    _, peak, offsets = best
    for b in buffers:
        b.offset = offsets[id(b)]
    return peak


def _plan_by_size(buffers: list, phase_first: bool):
    """Offline "greedy by size": the largest blocks are placed first, each at the
    lowest offset where it overlaps no placed block that is live at the same time.
    With `phase_first`, phases are planned in order (forward first), so forward()
    touches only the bottom of the arena. An in-place chain is one block living as
    long as all of it."""
    chains = {}
    for b in buffers:
        root = b
        while root.inplace_of is not None:
            root = root.inplace_of
        members = chains.setdefault(id(root), [root])
        if b is not root:
            members.append(b)
    blocks = []  # (size, first, last, phase rank, members)
    rank = {"forward": 0, "loss": 1, "backward": 2}
    for members in chains.values():
        root = members[0]
        blocks.append((root.size, min(b.first for b in members), max(b.last for b in members),
                       rank.get(root.phase, 2), members))
    blocks.sort(key=lambda k: (k[3] if phase_first else 0, -_typical(k[0]), k[1]))
    placed, peak = [], sympy.Integer(0)  # placed: (offset, size, first, last)
    for size, first, last, _, members in blocks:
        live = [(o, s) for o, s, f, l in placed if f <= last and first <= l]
        candidates = sorted({sympy.Integer(0)} | {sympy.expand(o + s) for o, s in live}, key=_typical)
        for offset in candidates:
            end = sympy.expand(offset + size)
            if all(dominates(o, end) or dominates(offset, o + s) for o, s in live):
                break
        else:  # no gap is safe for every size: on top of everything live
            offset = sympy.Integer(0)
            for o, s in live:
                offset = sym_max(offset, sympy.expand(o + s))
        for b in members:
            b.offset = offset
        placed.append((offset, size, first, last))
        peak = sym_max(peak, sympy.expand(offset + size))
    return peak


def _plan_online(buffers: list):
    """Buffers in order of first use; a freed block is reused (best fit) when it is
    large enough for every size, else the buffer goes on top."""
    top, peak, free = sympy.Integer(0), sympy.Integer(0), []  # free: [(offset, size)]
    order = sorted(buffers, key=lambda b: b.first)
    positions = sorted({b.first for b in buffers} | {b.last + 1 for b in buffers})
    owner = {}  # id(buffer) -> the buffer whose block it holds (in-place chains)
    released = set()
    for p in positions:
        for b in buffers:  # release blocks whose holders are no longer read
            if b.last < p and id(b) not in released and owner.get(id(b), b) is b:
                released.add(id(b))
                top = _release(free, b.offset, b.size, top)
        for b in (b for b in order if b.first == p):
            if b.inplace_of is not None:
                b.offset = b.inplace_of.offset
                owner[id(b.inplace_of)] = b  # the block now lives as long as b
                released.add(id(b.inplace_of))
                continue
            fits = [i for i, (_, size) in enumerate(free) if dominates(size, b.size)]
            if fits:  # best fit: the smallest block at a typical size (dims = 64)
                i = min(fits, key=lambda i: (_typical(free[i][1]), i))
                offset, size = free.pop(i)
                b.offset = offset
                rest = sympy.expand(size - b.size)
                if rest != 0:
                    free.append((sympy.expand(offset + b.size), rest))
            else:
                b.offset = top
                top = sympy.expand(top + b.size)
                peak = sym_max(peak, top)
    return peak


def _typical(expr) -> float:
    expr = sympy.sympify(expr)
    return float(expr.xreplace({s: 64 for s in expr.free_symbols}))


def _release(free, offset, size, top):
    """Return a block to the free list, merging neighbours; a block at the top lowers it."""
    block = (offset, size)
    merged = True
    while merged:
        merged = False
        for i, (o, s) in enumerate(free):
            if _same(o + s, block[0]):
                block = (o, sympy.expand(s + block[1]))
            elif _same(block[0] + block[1], o):
                block = (block[0], sympy.expand(block[1] + s))
            else:
                continue
            free.pop(i)
            merged = True
            break
    if _same(block[0] + block[1], top):
        return block[0]
    free.append(block)
    return top


def lower_bound(buffers: list, phases=None):
    """max over statements of the floats live there (in-place pairs count once)."""
    chosen = [b for b in buffers if phases is None or b.phase in phases]
    positions = sorted({b.first for b in chosen})
    bound = sympy.Integer(0)
    for p in positions:
        live = [b for b in chosen if b.first <= p <= b.last]
        shared = {id(b.inplace_of) for b in live if b.inplace_of is not None and b.first <= p}
        total = sum((b.size for b in live if id(b) not in shared or b.first > p), sympy.Integer(0))
        bound = sym_max(bound, sympy.expand(total))
    return bound


def arena_size(buffers: list, phases) -> object:
    """The top of the blocks used by buffers of these phases (the arena a call of
    that kind touches)."""
    size = sympy.Integer(0)
    for b in buffers:
        if b.phase in phases:
            size = sym_max(size, sympy.expand(b.offset + b.size))
    return size


def plan_memory(project):
    """Stage `plan_memory`: liveness from the lowered lines (codegen/liveness.py),
    the place of each parameter update, which elementwise results take their
    operand's block (in place), every buffer's offset (the ArenaDecl lines print
    it), and project.memory with the arena's size for forward() and train_step()."""
    from ..errors import DeepgenError
    from .liveness import liveness, place_updates
    from ..codegen.printer import exact_size_expr, size_expr

    live = liveness(project)
    place_updates(project, live)
    taken = set()
    for b in live.buffers:
        for src in live.in_place_candidates.get(b.name, []):
            if src.last == b.first and id(src) not in taken:
                b.inplace_of = src
                taken.add(id(src))
                break
    ordered = list(live.buffers)
    project.buffers = ordered
    plan(ordered)
    forward = arena_size(ordered, {"forward"})
    everything = arena_size(ordered, {"forward", "loss", "backward"})
    train = project.train is not None
    if train and not sympy.sympify(everything).free_symbols <= project.bound:
        raise DeepgenError("the training arena depends on sizes only training inputs determine; "
                           "declare them on a forward input too")
    if train:
        size = f"outputs != nullptr ? {size_expr(forward)} : {size_expr(everything)}"
        exact = f"outputs != nullptr ? {exact_size_expr(forward)} : {exact_size_expr(everything)}"
    else:
        size, exact = size_expr(forward), exact_size_expr(forward)
    project.memory = {
        "arena": size,
        "arena_exact": exact,  # the same in double, checked before int64 arithmetic could wrap
        "arena_symbolic": bool(getattr(everything if train else forward, "free_symbols", ())),
        "buffers": ordered,
        "forward_floats": forward,
        "train_floats": everything if train else None,
        "forward_bound": lower_bound(ordered, {"forward"}),
        "train_bound": lower_bound(ordered) if train else None,
        "float_bytes": FLOAT_BYTES,
    }
    return project

