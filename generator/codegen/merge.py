"""Three-way merge of text files, line by line (diff3), for regeneration.

base is what deepgen generated last time, ours the file as the user left it,
theirs the new generation. Both sides are aligned to base with difflib; a base
line that both sides kept unchanged is a sync point. Between two sync points
each side either left base alone or changed it:

- only one side changed it: take that side;
- both made the same change: take it once;
- both changed it differently: a conflict, written with the standard markers
  (ours, then base, then theirs) so that any merge tool understands it.

As in diff3 and git, changes on adjacent lines (with no unchanged line between
them) are one region, so they conflict when both sides touched it.
"""

from __future__ import annotations

from dataclasses import dataclass
from difflib import SequenceMatcher

OURS_MARKER = "<<<<<<< ours (your edits)\n"
BASE_MARKER = "||||||| base\n"
SEP_MARKER = "=======\n"
THEIRS_MARKER = ">>>>>>> theirs (new generation)\n"


@dataclass
class Merged:
    """The merged text and the 1-based line of each conflict's first marker in it."""

    text: str
    conflict_lines: list

    @property
    def clean(self) -> bool:
        return not self.conflict_lines


def split_lines(text: str) -> list:
    """text as lines that keep their "\\n" (the last may have none); joining them gives text back."""
    lines = text.split("\n")
    out = [line + "\n" for line in lines[:-1]]
    if lines[-1]:
        out.append(lines[-1])
    return out


def _kept_lines(base: list, side: list) -> dict:
    """{base line index: side line index} for the base lines the side kept unchanged."""
    matcher = SequenceMatcher(None, base, side, autojunk=False)
    kept = {}
    for block in matcher.get_matching_blocks():
        for i in range(block.size):
            kept[block.a + i] = block.b + i
    return kept


def _ended(lines: list) -> list:
    """lines, the last given a newline so that a marker after it starts a line of its own."""
    if lines and not lines[-1].endswith("\n"):
        return lines[:-1] + [lines[-1] + "\n"]
    return lines


def merge3(base: str, ours: str, theirs: str) -> Merged:
    """Merge the changes ours and theirs each made to base (see the module docstring)."""
    b, o, t = split_lines(base), split_lines(ours), split_lines(theirs)
    in_ours, in_theirs = _kept_lines(b, o), _kept_lines(b, t)
    syncs = [i for i in range(len(b)) if i in in_ours and i in in_theirs]
    out, conflicts = [], []
    i = j = k = 0  # next unmerged line of base, ours, theirs

    def region(base_end: int, ours_end: int, theirs_end: int) -> None:
        rb, ro, rt = b[i:base_end], o[j:ours_end], t[k:theirs_end]
        if ro == rb or ro == rt:
            out.extend(rt)
        elif rt == rb:
            out.extend(ro)
        else:
            conflicts.append(len(out) + 1)
            out.extend([OURS_MARKER, *_ended(ro), BASE_MARKER, *_ended(rb), SEP_MARKER, *_ended(rt), THEIRS_MARKER])

    for s in syncs:
        # Matching blocks are increasing in both sequences, so a sync point never lies
        # behind what was already merged on either side.
        region(s, in_ours[s], in_theirs[s])
        out.append(b[s])
        i, j, k = s + 1, in_ours[s] + 1, in_theirs[s] + 1
    region(len(b), len(o), len(t))
    return Merged("".join(out), conflicts)


def conflict_marker_line(text: str) -> int | None:
    """The 1-based line of the first conflict marker left in text (ours or another
    merge tool's opening or closing marker), None if there is none."""
    for number, line in enumerate(text.split("\n"), 1):
        if line.startswith(("<<<<<<< ", ">>>>>>> ")) or line in ("<<<<<<<", ">>>>>>>"):
            return number
    return None


def as_text(data: bytes) -> str | None:
    """data decoded as UTF-8 text, or None for binary content (a NUL byte, not UTF-8)."""
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


@dataclass
class FileMerge:
    """What regeneration does with one file the user edited.

    data: what the file holds from now on (None: leave the user's file as it is);
    beside: the new generation, written next to the file when it could not be merged;
    conflict: why the user has to look at the file (None when the merge was clean)."""

    data: bytes | None
    beside: bytes | None = None
    conflict: str | None = None


def merge_file(base: bytes | None, ours: bytes, theirs: bytes, pending: bool = False,
               base_problem: str | None = None) -> FileMerge:
    """Merge one edited file. base is None when there is no earlier generation to
    merge with, and base_problem then says why (none stored, or damaged); pending
    says that the new generation written beside the file last time is still there,
    not yet merged by hand."""
    if base is None:
        return FileMerge(None, theirs, base_problem or "no stored earlier generation to merge with (a project made by "
                                                       "an older deepgen, or a file deepgen did not write): merge the "
                                                       "new generation by hand")
    if pending:
        return FileMerge(None, theirs, "the new generation written beside it last time is still there: "
                                       "merge it by hand, then delete it")
    if base == theirs:  # the generator's output did not change: the user's file stands
        return FileMerge(None)
    texts = [as_text(data) for data in (base, ours, theirs)]
    if None in texts:
        return FileMerge(None, theirs, "binary or not UTF-8, so it cannot be merged line by line: "
                                       "merge the new generation by hand")
    merged = merge3(*texts)
    if merged.clean:
        return FileMerge(merged.text.encode())
    lines = ", ".join(map(str, merged.conflict_lines))
    return FileMerge(merged.text.encode(), conflict=f"conflict markers at line{'s' if len(merged.conflict_lines) > 1 else ''} {lines}")
