"""Batches of trees and DAGs as flat arrays, as recursive models take them.

A batch of trees is three int64 arrays: `children` [nodes, arity] (child node ids, -1 for
an empty slot), `words` [nodes] (a word id per node, -1 where there is none) and
`roots` [trees]. `from_nested` builds them from nested tuples; `check_batch` is
the validation that the generated inspector (runtime/dg_tree.h) also performs,
with the same messages. A batch of padded sequences is one int64 array of
lengths; `sequence_schedule` is its inspector (dg_schedule.h's inspect_sequences).
"""

from __future__ import annotations

import numpy as np


def from_nested(trees, arity: int) -> dict:
    """Flat arrays for a list of nested trees. A leaf is a word id (int); an
    internal node is a tuple of children, or `(word, [children...])` when the
    node has a word of its own. Iterative, so deep trees do not hit Python's
    recursion limit. Children come before their parents in the numbering."""
    children, words, roots = [], [], []
    for tree in trees:
        # Post-order without recursion: (item, expanded?) on a stack.
        stack, done = [(tree, False)], []
        while stack:
            item, expanded = stack.pop()
            word, kids = _split(item)
            if kids is None or expanded:
                ids = [done.pop() for _ in range(len(kids or ()))][::-1]
                if len(ids) > arity:
                    raise ValueError(f"a node has {len(ids)} children, more than the arity {arity}")
                children.append(ids + [-1] * (arity - len(ids)))
                words.append(word)
                done.append(len(words) - 1)
            else:
                stack.append((item, True))
                stack.extend((child, False) for child in reversed(kids))
        roots.append(done.pop())
    if not roots:
        raise ValueError("empty batch: no trees")
    return {
        "children": np.array(children, dtype=np.int64).reshape(-1, arity),
        "words": np.array(words, dtype=np.int64),
        "roots": np.array(roots, dtype=np.int64),
    }


def _split(item):
    """(word, children or None) of a nested-tree item."""
    if isinstance(item, (int, np.integer)) and not isinstance(item, bool):
        return int(item), None
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], list):
        return int(item[0]), list(item[1])
    if isinstance(item, (tuple, list)) and len(item) > 0:
        return -1, list(item)
    raise ValueError(f"a tree node must be a word id, a tuple of children or (word, [children]), got {item!r}")


def check_batch(children, roots, dag: bool, what: str = "trees"):
    """Validate a batch; returns (height per node, order by height). Raises
    ValueError naming the offending node (range, cycles, shared children in trees,
    empty batches)."""
    children = np.asarray(children)
    nodes, arity = children.shape
    if nodes == 0:
        raise ValueError(f"{what}: empty batch: there are no nodes")
    if len(roots) == 0:
        raise ValueError(f"{what}: empty batch: there are no roots")
    parents = np.zeros(nodes, dtype=np.int64)
    parent_lists = [[] for _ in range(nodes)]
    pending = np.zeros(nodes, dtype=np.int64)
    for n in range(nodes):
        for c in children[n]:
            c = int(c)
            if c == -1:
                continue
            if c < 0 or c >= nodes:
                raise ValueError(f"{what}: node {n} has child {c}, outside [0, {nodes})")
            if c == n:
                raise ValueError(f"{what}: node {n} is its own child (a cycle)")
            parents[c] += 1
            pending[n] += 1
            parent_lists[c].append(n)
            if not dag and parents[c] > 1:
                raise ValueError(
                    f"{what}: node {c} has more than one parent (node {n} is another); "
                    "trees cannot share a child, declare a DAG for that"
                )
    for r, root in enumerate(roots):
        root = int(root)
        if root < 0 or root >= nodes:
            raise ValueError(f"{what}: root {r} is node {root}, outside [0, {nodes})")
        if not dag and parents[root] != 0:
            raise ValueError(f"{what}: root {r} (node {root}) has a parent")
    height = np.zeros(nodes, dtype=np.int64)
    ready = [n for n in range(nodes) if pending[n] == 0]
    i = 0
    while i < len(ready):
        n = ready[i]
        i += 1
        for p in parent_lists[n]:
            height[p] = max(height[p], height[n] + 1)
            pending[p] -= 1
            if pending[p] == 0:
                ready.append(p)
    if len(ready) != nodes:
        bad = int(np.flatnonzero(pending)[0])
        raise ValueError(f"{what}: node {bad} lies on a cycle")
    return height, ready


def random_batch(rng, trees: int, arity: int, vocab: int, min_leaves: int = 1, max_leaves: int = 8,
                 dag: bool = False) -> dict:
    """A random batch for tests and samples: each tree grows by merging up to
    `arity` random subtrees until one remains (so shapes vary); every node gets a
    word id in [0, vocab). With dag=True some nodes also get a second parent."""
    children, roots = [], []
    for _ in range(trees):
        pending = []
        for _ in range(int(rng.integers(min_leaves, max_leaves + 1))):
            children.append([-1] * arity)
            pending.append(len(children) - 1)
        while len(pending) > 1:
            take = int(rng.integers(2, min(arity, len(pending)) + 1)) if arity > 1 else 1
            picks = sorted(rng.choice(len(pending), size=take, replace=False).tolist(), reverse=True)
            kids = [pending.pop(i) for i in picks]
            if dag and len(children) > 1 and rng.random() < 0.3 and len(kids) < arity:
                extra = int(rng.integers(0, len(children)))
                if extra not in kids:
                    kids.append(extra)  # a second parent for an earlier node (no cycle: it is older)
            children.append(kids + [-1] * (arity - len(kids)))
            pending.append(len(children) - 1)
        if arity == 1 and len(children) == len(pending):
            pass
        roots.append(pending[0])
    words = rng.integers(0, vocab, len(children))
    return {
        "children": np.array(children, dtype=np.int64).reshape(-1, arity),
        "words": words.astype(np.int64),
        "roots": np.array(roots, dtype=np.int64),
    }


def check_lengths(lengths, steps: int, what: str):
    """Lengths of padded sequences, each in [1, steps]; a ValueError names the first that is not."""
    lengths = np.asarray(lengths)
    if len(lengths) == 0:
        raise ValueError(f"{what}: empty batch: there are no sequences")
    for n, length in enumerate(lengths.tolist()):
        if not 1 <= length <= steps:
            raise ValueError(f"{what}: lengths[{n}] is {length}, outside [1, {steps}] (the padded length)")
    return lengths


def sequence_schedule(lengths, steps: int, reverse: bool, what: str = "sequences"):
    """The schedule of `len(lengths)` padded sequences of up to `steps` steps, as
    the generated inspector computes it: node n * steps + t is step t of sequence
    n, a chain whose child is the step before (after, with `reverse`); level l
    holds the l-th step taken of every sequence longer than l, longest sequences
    first. Returns (children [nodes, 1], order: present nodes level by level,
    row: each node's row or -1 past its sequence's length). Raises ValueError
    naming the offending index for a length outside [1, steps]."""
    lengths = check_lengths(lengths, steps, what)
    count = len(lengths)
    by_length = sorted(range(count), key=lambda n: -int(lengths[n]))
    children = np.full((count * steps, 1), -1, dtype=np.int64)
    row = np.full(count * steps, -1, dtype=np.int64)
    order = []
    for level in range(int(lengths.max())):
        for n in by_length:
            if lengths[n] <= level:
                break
            t = int(lengths[n]) - 1 - level if reverse else level
            node = n * steps + t
            if level > 0:
                children[node, 0] = node + 1 if reverse else node - 1
            row[node] = len(order)
            order.append(node)
    return children, order, row
