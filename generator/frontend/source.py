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
    # built by `basic_block(x, ...)`): the line of that call, which call it was (numbered
    # in the order calls began), and the call with its arguments' values
    # (`basic_block(x, channels=128, stride=2, name='layer2_0')`).
    call: "Loc | None" = field(default=None, compare=False)
    call_id: int = field(default=0, compare=False)
    call_text: str = field(default="", compare=False)
    # That call's arguments: ((parameter name, value), ...), a DSL Tensor as its IR value.
    call_args: tuple = field(default=(), compare=False)
    # The call of deepgen's function that the user's line made (a layer helper such as
    # `transformer_encoder_layer(x, ..., name='encoder_layers_0')`): (number, text, args).
    helper: tuple = field(default=(), compare=False)
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
            helper = _call_of(entry) if entry is not None else ()
            return replace(_user_frame_loc(frame), run=_run_of(frame, entry), helper=helper)
        frame, entry = frame.f_back, frame
    return None


def _user_frame_loc(frame) -> Loc:
    caller = frame.f_back
    call = _frame_loc(caller) if caller is not None and _is_users(caller) and caller.f_back else None
    if call is None:
        return _frame_loc(frame)
    number, text, args = _call_of(frame)
    return _frame_loc(frame, call, number, text, args)


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


# The calls of the user's functions seen while a model is built: id(frame) ->
# (frame, number, evaluated call). The frame is held so that its address, the key,
# is not reused by a later call (calls in a loop can get the same address); the
# builder forgets them when the model is built.
_CALLS: dict = {}


def _call_of(frame) -> tuple:
    entry = _CALLS.get(id(frame))
    if entry is None or entry[0] is not frame:
        entry = (frame, len(_CALLS) + 1, _evaluated_call(frame), _arguments(frame))
        _CALLS[id(frame)] = entry
    return entry[1:]


def forget_calls() -> None:
    _CALLS.clear()
    _last_call[:] = [None, None, -1, 0]


def _arguments(frame) -> tuple:
    """((parameter name, value), ...) of the call `frame` runs; a DSL Tensor as its IR value."""
    code = frame.f_code
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    values = [frame.f_locals.get(name) for name in names]
    return tuple((n, v.value if hasattr(v, "shape") and hasattr(v, "value") else v) for n, v in zip(names, values))


def _evaluated_call(frame) -> str:
    """`basic_block(x, channels=128, stride=2, name='layer2_0')`: the function's
    parameters with the values they had at the first DSL call inside it (tensors by
    the parameter's name, plain values by their repr, anything else by its type)."""
    code = frame.f_code
    count = code.co_argcount + code.co_kwonlyargcount
    names = code.co_varnames[:count]
    parts = []
    for name in names:
        value = frame.f_locals.get(name)
        if hasattr(value, "shape") and hasattr(value, "value"):  # a DSL Tensor
            parts.append(name)
        else:
            parts.append(f"{name}={_plain(value)}")
    return f"{code.co_name}({', '.join(parts)})"


def _plain(value) -> str:
    if value is None or isinstance(value, (bool, int, float, str)):
        text = repr(value)
    elif isinstance(value, (tuple, list)) and all(isinstance(v, (bool, int, float, str)) for v in value):
        text = repr(value)
    else:
        text = type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _is_users(frame) -> bool:
    return not os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR + os.sep)


def _frame_loc(frame, call: Loc | None = None, call_id: int = 0, call_text: str = "", call_args: tuple = ()) -> Loc:
    filename, line = os.path.abspath(frame.f_code.co_filename), frame.f_lineno
    stmt = _statement_at(filename, line)
    stmt_line = stmt.lineno if stmt is not None else line
    return Loc(filename, line, stmt_line, _call_text(filename, line), call, call_id, call_text, call_args)


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
    return _one_line([text.strip() for text in lines if text.strip()])


def _one_line(parts: list) -> str:
    """Lines of a call as one line, as a person writes it on one: no space inside its
    brackets, no trailing comma before a closing one (`dg.relu(x @ w)`, not `dg.relu( x @ w, )`)."""
    out = ""
    for text in parts:
        if not out or out[-1] in "([{":
            out += text
        elif text[0] in ")]}":
            out = out[:-1] + text if out[-1] == "," else out + text
        else:
            out += " " + text
    return out


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

