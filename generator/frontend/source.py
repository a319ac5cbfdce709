"""Where in the user's model file a DSL call came from, and what it was assigned to.

The DSL records, for each node, the first stack frame outside this package: that
is the user's line. From the statement at that line we also read the name of the
variable it was assigned to, so generated code can use the user's own names.
"""

from __future__ import annotations

import ast
import functools
import linecache
import os
import sys
import tokenize
import traceback
from dataclasses import dataclass, field, replace

# The package root (generator/): frames from any of its modules are deepgen's own.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Loc:
    """A position in the user's source: file, line, and the statement's first line."""

    filename: str
    line: int
    stmt_line: int
    text: str
    # In a function of the user's called from another of theirs (a residual block
    # built by `basic_block(x, ...)`): the line of that call, and which call it was.
    call: "Loc | None" = field(default=None, compare=False)
    call_id: int = field(default=0, compare=False)
    # Which execution of the statement: a statement run again (a layer helper called in a
    # loop) starts a new one, so each call's code comes under a comment of its own.
    run: int = field(default=0, compare=False)

    @property
    def short(self) -> str:
        """File name without its folder: stable across machines, used in generated code."""
        return f"{os.path.basename(self.filename)}:{self.line}"

    def __str__(self) -> str:
        return f"{self.filename}:{self.line}"


def user_loc() -> Loc | None:
    """The innermost stack frame that is not deepgen's own code (with the line that
    called its function, when user code called it directly)."""
    frame, entry = sys._getframe(1), None
    while frame is not None:
        if _is_users(frame):
            return replace(_user_frame_loc(frame), run=_run_of(frame, entry))
        frame, entry = frame.f_back, frame
    return None


def _user_frame_loc(frame) -> Loc:
    caller = frame.f_back
    call = _frame_loc(caller) if caller is not None and _is_users(caller) and caller.f_back else None
    # Calls in a loop run one after the other: the frame's address tells them apart
    # from the call before (they are only compared, never printed).
    return _frame_loc(frame, call, id(frame) if call else 0)


# The last DSL call seen: [the user's frame, the deepgen frame it called, the call's
# bytecode offset, the run number]. Holding the frames keeps their identities from
# being reused while they are compared.
_last_call: list = [None, None, -1, 0]


def _run_of(frame, entry) -> int:
    """The run number of the statement that `frame` executes: the same while it calls
    on (each DSL call of `h = relu(x @ w + b)` sits at a later offset than the one
    before, and one call asks for its location many times), the next one once the
    frame calls again at the same or an earlier offset (a loop's next pass)."""
    last_frame, last_entry, last_offset, run = _last_call
    offset = frame.f_lasti
    if frame is last_frame and entry is not last_entry and offset <= last_offset:
        run += 1
    _last_call[:] = [frame, entry, offset, run]
    return run


def _is_users(frame) -> bool:
    return not os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR + os.sep)


def _frame_loc(frame, call: Loc | None = None, call_id: int = 0) -> Loc:
    filename, line = os.path.abspath(frame.f_code.co_filename), frame.f_lineno
    stmt = _statement_at(filename, line)
    stmt_line = stmt.lineno if stmt is not None else line
    return Loc(filename, line, stmt_line, _call_text(filename, line), call, call_id)


def _call_text(filename: str, line: int) -> str:
    """The source of the DSL call at `line`, whole: the lines of the outermost call
    of the statement that contains `line` (`x = dg.layer(x, 64,` and its next line
    `name="enc")`), joined into one line, the comments of all but the last dropped."""
    first = last = line
    stmt = _statement_at(filename, line)
    if stmt is not None:
        body = {id(n) for part in ("body", "orelse", "finalbody", "handlers") for n in getattr(stmt, part, ())}
        pending = [c for c in ast.iter_child_nodes(stmt) if id(c) not in body]
        while pending:
            node = pending.pop()
            if isinstance(node, ast.Call) and node.lineno <= line <= (node.end_lineno or node.lineno):
                first, last = min(first, node.lineno), max(last, node.end_lineno or node.lineno)
            elif not isinstance(node, ast.stmt):
                pending.extend(ast.iter_child_nodes(node))
    lines = [linecache.getline(filename, n) for n in range(first, last + 1)]
    if len(lines) > 1:
        try:
            comments = [t for t in tokenize.generate_tokens(iter(lines).__next__) if t.type == tokenize.COMMENT]
        except (tokenize.TokenError, SyntaxError):
            comments = []
        for t in reversed(comments):
            row, col = t.start
            if row < len(lines):  # a comment on the last line stays, as on a one-line call
                lines[row - 1] = lines[row - 1][:col]
    return " ".join(text.strip() for text in lines if text.strip())


def assigned_names(loc: Loc | None) -> list[str] | None:
    """Names on the left of the assignment at `loc`: ['h'] for `h = ...`,
    ['a', 'b'] for `a, b = ...`; None when the statement is not a plain assignment."""
    if loc is None:
        return None
    stmt = _statement_at(loc.filename, loc.line)
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
        target = stmt.targets[0]
    elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
        target = stmt.target
    else:
        return None
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)) and all(
        isinstance(e, ast.Name) for e in target.elts
    ):
        return [e.id for e in target.elts]
    return None


def in_return(loc: Loc | None) -> bool:
    """Whether `loc` is inside a return statement."""
    return loc is not None and isinstance(_statement_at(loc.filename, loc.line), ast.Return)


def _statement_at(filename: str, line: int) -> ast.stmt | None:
    """The innermost statement whose lines include `line`."""
    best = None
    for stmt in _statements(filename):
        if stmt.lineno <= line <= (stmt.end_lineno or stmt.lineno):
            if best is None or stmt.lineno >= best.lineno:
                best = stmt
    return best


@functools.lru_cache(maxsize=64)
def _statements(filename: str) -> tuple[ast.stmt, ...]:
    source = "".join(linecache.getlines(filename))
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ()
    return tuple(n for n in ast.walk(tree) if isinstance(n, ast.stmt))


def error_site(exc: BaseException, filename: str) -> tuple:
    """('file:line', quoted source line) of the innermost traceback entry of `exc` in `filename` (the
    user's model file), else in any file outside deepgen; `filename` if none."""
    entries = traceback.extract_tb(exc.__traceback__)
    target = os.path.abspath(filename)
    for pick in (lambda f: os.path.abspath(f) == target, lambda f: not os.path.abspath(f).startswith(_PACKAGE_DIR + os.sep)):
        chosen = [e for e in entries if pick(e.filename)]
        if chosen:
            e = chosen[-1]
            text = f"\n    {e.line.strip()}" if e.line and e.line.strip() else ""
            return f"{e.filename}:{e.lineno}", text
    return filename, ""


def describe_exception(exc: BaseException) -> str:
    """One line for an exception the user's code raised."""
    if isinstance(exc, SystemExit):
        return f"the model file called sys.exit({exc.code!r})"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

