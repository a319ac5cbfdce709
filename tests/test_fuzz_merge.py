"""Fuzzing the three-way merge of regeneration (codegen/merge.py) with hypothesis:
random edit scripts (insert, delete, replace runs of lines) applied by the user
(ours) and by the generator (theirs) to the same file.

- On a file of distinct lines the alignment is unambiguous, so the outcome is
  known exactly: a conflict is marked where, and only where, both sides changed
  lines between the same two lines that both kept (diff3's rule: overlapping or
  adjacent edits); everywhere else each side's change is taken.
- On real generated C++ (the MLP's model.cpp, many repeated lines such as `}`),
  against a real other generation (a narrower hidden layer), no line the user
  added is ever lost: it is in the merged file, clean or between markers.
"""

from __future__ import annotations

from functools import lru_cache

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from generator.codegen.merge import BASE_MARKER, OURS_MARKER, SEP_MARKER, THEIRS_MARKER, merge3, split_lines

SETTINGS = settings(max_examples=300, derandomize=True, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def edit_script(draw, length: int, tag: str):
    """Disjoint edits of a file of `length` lines: (start, end, new lines) replacing
    base[start:end] (end == start: an insertion before line start)."""
    edits, at, n = [], 0, 0
    while at <= length and draw(st.integers(0, 3)) > 0:
        start = draw(st.integers(at, length))
        end = draw(st.integers(start, min(length, start + 3)))
        count = draw(st.integers(0 if end > start else 1, 3))
        new = [f"{tag}{n + i}\n" for i in range(count)]
        n += count
        edits.append((start, end, new))
        at = end + 1  # one untouched line between two edits of one side
    return edits


def apply(base: list, edits: list) -> list:
    out, at = [], 0
    for start, end, new in edits:
        out += base[at:start] + new
        at = end
    return out + base[at:]


def expected_conflicts(length: int, ours: list, theirs: list) -> int:
    """Chunks between lines both sides kept in which the two sides made different changes."""
    changes = {"o": {}, "t": {}}  # side -> chunk -> (base lines removed, lines added)
    removed = {"o": set(), "t": set()}
    for side, edits in (("o", ours), ("t", theirs)):
        for start, end, _ in edits:
            removed[side].update(range(start, end))
    kept_by_both = [i for i in range(length) if i not in removed["o"] and i not in removed["t"]]
    for side, edits in (("o", ours), ("t", theirs)):
        for start, end, new in edits:
            # An edit's chunk: the number of lines kept by both before it.
            chunk = sum(1 for s in kept_by_both if s < start)
            gone, added = changes[side].setdefault(chunk, (set(), []))
            gone.update(range(start, end))
            added.extend(new)
    both = set(changes["o"]) & set(changes["t"])
    return sum(1 for c in both if changes["o"][c] != changes["t"][c])


@st.composite
def scenario(draw):
    length = draw(st.integers(0, 30))
    base = [f"base{i}\n" for i in range(length)]
    return base, draw(edit_script(length, "mine")), draw(edit_script(length, "gen"))


@SETTINGS
@given(scenario())
def test_distinct_lines_merge_exactly(case):
    base, ours_edits, theirs_edits = case
    ours, theirs = apply(base, ours_edits), apply(base, theirs_edits)
    merged = merge3("".join(base), "".join(ours), "".join(theirs))
    lines = split_lines(merged.text)
    want = expected_conflicts(len(base), ours_edits, theirs_edits)
    assert len(merged.conflict_lines) == want, (ours_edits, theirs_edits, merged.text)
    assert lines.count(OURS_MARKER) == lines.count(THEIRS_MARKER) == want
    for line in set(ours) - set(base):  # no edit lost
        assert line in lines
    if want == 0:
        # Clean: every change of either side, in base order (the edits lie in different chunks).
        assert lines == apply(base, sorted(ours_edits + theirs_edits))
    # Between the markers: the user's side, the base, the new generation, in that order.
    for at in merged.conflict_lines:
        i = at - 1
        assert lines[i] == OURS_MARKER
        assert lines.index(BASE_MARKER, i) < lines.index(SEP_MARKER, i) < lines.index(THEIRS_MARKER, i)


@lru_cache(maxsize=None)
def _generations() -> tuple:
    import generator as dg
    from generator.pipeline import project_files

    def mlp(hidden):
        @dg.model(name="mlp")
        def net():
            x = dg.input("x", (dg.dim("N"), 16))
            h = dg.dense(x, hidden, act=dg.relu)
            logits = dg.dense(h, 4)
            return {"logits": logits}

        return project_files(net.build())["src/model.cpp"].decode()

    return mlp(32), mlp(24)


@settings(max_examples=150, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_no_user_line_is_lost_in_generated_code(data):
    base_text, theirs_text = _generations()
    base = split_lines(base_text)
    edits = data.draw(edit_script(len(base), "// mine "))
    ours = apply(base, edits)
    merged = merge3(base_text, "".join(ours), theirs_text)
    lines = split_lines(merged.text)
    for line in set(ours) - set(base):
        assert line in lines, line
    if not edits:
        assert merged.text == theirs_text and merged.clean
    assert merge3(base_text, "".join(ours), base_text).text == "".join(ours)  # nothing new: the user's file
