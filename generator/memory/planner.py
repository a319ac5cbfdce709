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

import re

import sympy

from .bases import Bases
from ..codegen.printer import exact_size_expr
from ..errors import DeepgenError
from .buffer import Buffer
from .frames import call_frames, place_members
from .workspaces import call_workspaces
from .liveness import liveness, place_updates
from .sizes import Size, from_expr

FLOAT_BYTES = 4


def _symbols(*exprs) -> tuple:
    found = set()
    for e in exprs:
        found |= getattr(sympy.sympify(e), "free_symbols", set())
    return tuple(sorted(found, key=str))


def dominates(a, b) -> bool:
    """a >= b for every value >= 1 of the symbols (symbolic sizes are at least 1;
    the generated code checks it). A sufficient test: with each symbol s written
    as 1 + t (t >= 0), the expanded difference has no negative coefficient; Max
    is split up (memory/sizes.py)."""
    symbols = _symbols(a, b)
    return from_expr(a, symbols).dominates(from_expr(b, symbols))


def sym_max(a, b):
    symbols = _symbols(a, b)
    return from_expr(a, symbols).max(from_expr(b, symbols)).expr()


KEPT = {"forward", "loss", "backward"}  # what a call that keeps its gradients (or has none) uses


def plan(buffers: list):
    """Assign offsets with each planner below and keep the plan whose arena is
    smallest at a typical size for train_step() (gradients kept), then forward(),
    then train_step() with gradients freed by their updates (phase "gradient");
    returns the arena size of the whole plan (floats). Offsets are computed as
    memory.sizes.Size and stored as sympy."""
    symbols = _symbols(*[b.size for b in buffers])
    sizes = {id(b): from_expr(b.size, symbols) for b in buffers}
    zero = Size.const(0, symbols)
    kept = [b for b in buffers if b.phase in KEPT]
    freed = [b for b in buffers if b.phase not in KEPT]
    planners = (_plan_online, lambda *a: _plan_by_size(*a, True), lambda *a: _plan_by_size(*a, False))
    candidates = [planner(buffers, sizes, zero) for planner in planners]
    if freed:  # the gradients train_step() may free, fitted around a plan of the rest
        candidates += [_plan_by_size(freed, sizes, zero, False, planner(kept, sizes, zero), kept)
                       for planner in planners]
    best = None
    for offsets in candidates:
        peak = _top(buffers, sizes, offsets, zero, None)
        key = tuple(_top(buffers, sizes, offsets, zero, phases).typical() for phases in (KEPT, {"forward"}, None))
        if best is None or key < best[0]:
            best = (key, peak, offsets)
    _, peak, offsets = best
    for b in buffers:
        b.offset = offsets[id(b)].expr()
    return peak.expr()


def _parts(frame, zero) -> list:
    """A frame's (memory/frames.py) or a workspace's (memory/workspaces.py) members as
    (start in it, size, first, last): the block is placed as one, but each member's part of it
    is checked against the blocks live with that member only; the online planner frees a
    frame's parts one by one, a workspace's (whose parts may share places) all at once."""
    out, at = [], zero
    for m in frame.members:
        size = from_expr(m.size, zero.symbols)
        start = at if m.frame_start is None else from_expr(m.frame_start, zero.symbols)
        out.append((start, size, m.first, m.last))
        at = at + size
    return out


def _rectangles(b, size, first, last, zero) -> list:
    """(start within the block, size, first, last) of each part of block b that lives on its own."""
    return _parts(b, zero) if b.members else [(zero, size, first, last)]


def _top(buffers, sizes, offsets, zero, phases):
    top = zero
    for b in buffers:
        if phases is None or b.phase in phases:
            top = top.max(offsets[id(b)] + sizes[id(b)])
    return top


def _plan_by_size(buffers: list, sizes: dict, zero, phase_first: bool, offsets=None, around=()) -> dict:
    """Offline "greedy by size": the largest blocks are placed first, each at the
    lowest offset where it overlaps no placed block that is live at the same time.
    With `phase_first`, phases are planned in order (forward first), so forward()
    touches only the bottom of the arena. An in-place chain is one block living as
    long as all of it. `offsets` of the buffers `around`, when given, are kept and
    the new blocks fitted around them."""
    chains = {}
    for b in buffers:
        root = b
        while root.inplace_of is not None:
            root = root.inplace_of
        members = chains.setdefault(id(root), [root])
        if b is not root:
            members.append(b)
    blocks = []  # (size, first, last, phase rank, members)
    rank = {"forward": 0, "loss": 1, "backward": 2, "gradient": 3}
    for members in chains.values():
        root = members[0]
        blocks.append((sizes[id(root)], min(b.first for b in members), max(b.last for b in members),
                       rank.get(root.phase, 2), members))
    blocks.sort(key=lambda k: (k[3] if phase_first else 0, -k[0].typical(), k[1]))
    offsets = dict(offsets or {})
    # (offset, end, first, last, their typical values): a >= b for every size implies it at the
    # typical one, so a pair that fails there needs no proof (the same plan, many fewer proofs)
    placed = []
    proofs = {}  # (id(offset), id(end)) -> offset >= end: both are placed blocks' ends (or zero), asked again and again

    def above(offset, e):
        key = (id(offset), id(e))
        if key not in proofs:
            proofs[key] = offset.dominates(e)
        return proofs[key]

    for b in around:
        o = offsets[id(b)]
        e = o + sizes[id(b)]
        placed.append((o, e, b.first, b.last, o.typical(), e.typical()))
    for size, first, last, _, members in blocks:
        live = [p for p in placed if p[2] <= last and first <= p[3]]
        candidates = sorted([(zero, zero.typical())] + [(p[1], p[5]) for p in live], key=lambda c: c[1])
        rects = _rectangles(members[0], size, first, last, zero)
        for offset, at in candidates:
            if all(_fits(offset, at, r, live, above) for r in rects):
                break
        else:  # no gap is safe for every size: on top of everything live
            offset = zero
            for p in live:
                offset = offset.max(p[1])
        for b in members:
            offsets[id(b)] = offset
        for start, part, part_first, part_last in rects:
            o, e = offset + start, offset + start + part
            placed.append((o, e, part_first, part_last, o.typical(), e.typical()))
    return offsets


def _fits(offset, at, rect, placed, above) -> bool:
    """Whether a block at `offset` (`at` at the typical size) keeps its part `rect` clear of
    every placed block that lives at the same time as the part, for every size."""
    start, size, first, last = rect
    # (`above` remembers proofs by the objects' ids: the block's own offset, not a new sum)
    low = offset if start.is_zero() else offset + start
    low_at = at + start.typical()
    ends = low_at + size.typical()
    live = [p for p in placed if p[2] <= last and first <= p[3]]
    if any(o_at < ends and low_at < e_at for _, _, _, _, o_at, e_at in live):
        return False  # overlaps a live block at the typical size: no proof can place it here
    end = low + size
    return all((o_at >= ends and o.dominates(end))
               or (low_at >= e_at and (above(low, e) if low is offset else low.dominates(e)))
               for o, e, _, _, o_at, e_at in live)


def _plan_online(buffers: list, sizes: dict, zero) -> dict:
    """Buffers in order of first use; a freed block is reused (best fit) when it is
    large enough for every size, else the buffer goes on top."""
    top, free, offsets = zero, [], {}  # free: [(offset, size)]
    order = sorted(buffers, key=lambda b: b.first)
    parts = {id(b): _parts(b, zero) for b in buffers if b.members and b.kind != "work"}
    positions = sorted({b.first for b in buffers} | {b.last + 1 for b in buffers}
                       | {last + 1 for b in buffers for _, _, _, last in parts.get(id(b), ())})
    owner = {}  # id(buffer) -> the buffer whose block it holds (in-place chains)
    released = set()
    by_last = {}
    for b in buffers:
        if id(b) in parts:  # a frame: each member's part is free once the member is
            for start, size, _, last in parts[id(b)]:
                by_last.setdefault(last + 1, []).append((b, start, size))
            continue
        by_last.setdefault(b.last + 1, []).append(b)
    pending = []
    for p in positions:
        pending += by_last.get(p, [])
        still = []
        for b in pending:  # release blocks whose holders are no longer read
            if isinstance(b, tuple):  # a part of a frame
                frame, start, size = b
                top = _release(free, offsets[id(frame)] + start, size, top)
                continue
            if id(b) in released:
                continue
            if owner.get(id(b), b) is b:
                released.add(id(b))
                top = _release(free, offsets[id(b)], sizes[id(b)], top)
            else:
                still.append(b)
        pending = still
        for b in (b for b in order if b.first == p):
            if b.inplace_of is not None:
                offsets[id(b)] = offsets[id(b.inplace_of)]
                owner[id(b.inplace_of)] = b  # the block now lives as long as b
                released.add(id(b.inplace_of))
                continue
            need = sizes[id(b)]
            fits = [i for i, (_, size) in enumerate(free) if size.dominates(need)]
            if fits:  # best fit: the smallest block at a typical size (dims = 64)
                i = min(fits, key=lambda i: (free[i][1].typical(), i))
                offset, size = free.pop(i)
                offsets[id(b)] = offset
                rest = size.minus(need)
                if not rest.is_zero():
                    free.append((offset + need, rest))
            else:
                offsets[id(b)] = top
                top = top + need
    return offsets


def _release(free, offset, size, top):
    """Return a block to the free list, merging neighbours; a block at the top lowers it."""
    block = (offset, size)
    merged = True
    while merged:
        merged = False
        for i, (o, s) in enumerate(free):
            if (o + s).same(block[0]):
                block = (o, s + block[1])
            elif (block[0] + block[1]).same(o):
                block = (block[0], block[1] + s)
            else:
                continue
            free.pop(i)
            merged = True
            break
    if (block[0] + block[1]).same(top):
        return block[0]
    free.append(block)
    return top


def lower_bound(buffers: list, phases=None):
    """max over statements of the floats live there (in-place pairs count once)."""
    chosen = [b for b in buffers if phases is None or b.phase in phases]
    symbols = _symbols(*[b.size for b in chosen])
    bound = Size.const(0, symbols)
    for p in sorted({b.first for b in chosen}):
        live = [b for b in chosen if b.first <= p <= b.last]
        shared = {id(b.inplace_of) for b in live if b.inplace_of is not None and b.first <= p}
        total = Size.const(0, symbols)
        for b in live:
            if id(b) not in shared or b.first > p:
                total = total + from_expr(b.size, symbols)
        bound = bound.max(total)
    return bound.expr()


def arena_size(buffers: list, phases) -> object:
    """The top of the blocks used by buffers of these phases (the arena a call of
    that kind touches)."""
    chosen = [b for b in buffers if b.phase in phases]
    symbols = _symbols(*[e for b in chosen for e in (b.size, b.offset)])
    top = Size.const(0, symbols)
    for b in chosen:
        top = top.max(from_expr(b.offset, symbols) + from_expr(b.size, symbols))
    return top.expr()


def _arena_text(bases, train: bool, forward, kept, freed) -> str:
    """The arena's size in C++ for the call: forward(), or train_step() with its
    gradients kept or freed; equal sizes printed once."""
    if not train:
        return bases.size(forward, "arena_top")
    texts = [bases.size(e, name) for e, name in ((forward, "forward_top"), (kept, "kept_top"), (freed, "freed_top"))]
    if texts[1] == texts[2]:
        return texts[0] if texts[0] == texts[1] else f"_outputs != nullptr ? {texts[0]} : {texts[1]}"
    if texts[0] == texts[1]:
        return f"_outputs != nullptr || _gradients_kept ? {texts[0]} : {texts[2]}"
    return f"_outputs != nullptr ? {texts[0]} : _gradients_kept ? {texts[1]} : {texts[2]}"


def _names_in(project) -> set:
    """Every identifier the lowered lines of the call use (names a new local must avoid)."""
    groups = [project.statements] + ([project.train.loss_statements, project.train.backward_statements,
                                       project.train.copies, project.train.updates] if project.train else [])
    text = " ".join(repr(group) for group in groups) + " " + repr(project.dims)
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))


def plan_memory(project):
    """Stage `plan_memory`: liveness from the lowered lines (codegen/liveness.py),
    the place of each parameter update, which elementwise results take their
    operand's block (in place), every buffer's offset (the ArenaDecl lines print
    it), and project.memory with the arena's size for forward() and train_step()."""

    live = liveness(project)
    place_updates(project, live)
    taken = set()
    for b in live.buffers:
        for src in live.in_place_candidates.get(b.name, []):
            if src.last == b.first and id(src) not in taken:
                b.inplace_of = src
                taken.add(id(src))
                break
    names = _names_in(project)
    frames = call_frames(project, live, names)
    frames += call_workspaces(project, live, names, {id(b) for f in frames for b in f.members})
    framed = {id(b) for f in frames for b in f.members}
    ordered = [b for b in live.buffers if id(b) not in framed] + frames
    project.buffers = ordered
    plan(ordered)
    place_members(frames)
    forward = arena_size(ordered, {"forward"})
    everything = arena_size(ordered, KEPT)
    freed = arena_size(ordered, KEPT | {"gradient"})
    train = project.train is not None
    if train and not sympy.sympify(freed).free_symbols <= project.bound:
        raise DeepgenError("the training arena depends on sizes only training inputs determine; "
                           "declare them on a forward input too")
    symbols = _symbols(*[e for b in ordered for e in (b.size, b.offset)])
    bases = Bases(symbols, names)
    members = [b for f in frames for b in f.members]
    bases.place(ordered + members)
    for b in ordered + members:
        b.printed = bases.offset(b)
    arena = _arena_text(bases, train, forward, everything, freed)
    pieces = [b for b in ordered if not b.members] + members
    tops = [forward, everything, freed] if train else [forward]
    bound = bases.bound([e for b in ordered for e in (b.offset, sympy.sympify(b.offset) + b.size)] + tops)
    project.memory = {
        "arena": arena,
        "bases": bases.declarations(),  # [(name, C++ value)]: the regions' starts, named once
        # every offset and size computed in int64 is at most this, checked in double first
        "arena_bound": exact_size_expr(bound),
        "arena_symbolic": bool(getattr(everything if train else forward, "free_symbols", ())),
        "buffers": ordered,
        "forward_floats": forward,
        "train_floats": everything if train else None,  # train_step(), gradients kept; compute_gradients()
        "train_freed_floats": freed if train else None,  # train_step() with keep_gradients off
        # what is live, piece by piece (a frame's members each as long as it is read)
        "forward_bound": lower_bound(pieces, {"forward"}),
        "train_bound": lower_bound([b for b in pieces if b.phase in KEPT]) if train else None,
        "train_freed_bound": lower_bound(pieces) if train else None,
        "float_bytes": FLOAT_BYTES,
    }
    return project

