"""Which runtime headers a project uses, read off the code and the headers.

A target's runtime/ folder holds every header it may need; a project gets only
those its files use. What a header defines is read from its text: the types,
functions, namespaces and macros it declares at the top level (column 0, as the
headers are formatted). A generated file includes the headers that define the
`dg::` names and `DG_` macros it uses; the project receives the headers its files
include and, in turn, what those include.
"""

from __future__ import annotations

import re

_INCLUDE = re.compile(r'^#include "(dg_\w+\.h)"', re.M)
_STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"')  # what a string literal or a comment names is not used
_COMMENT = re.compile(r"//.*$", re.M)
_USE = re.compile(r"\bdg::(\w+)|\b(DG_[A-Z0-9_]+)\b")
# Top-level declarations: a type, a namespace, an alias, a macro ...
_DEFINES = (
    re.compile(r"^(?:template\s*<.*>\s*)?(?:struct|class|union|enum(?:\s+class)?)\s+(\w+)", re.M),
    re.compile(r"^namespace\s+(?:dg::)?(\w+)", re.M),
    re.compile(r"^using\s+(\w+)\s*=", re.M),
    re.compile(r"^#\s*define\s+(\w+)", re.M),
)
_FALLBACK = re.compile(r"^#ifndef (\w+)\n#define \1\b", re.M)  # a default, not the definition
# ... or a function or variable: a line at column 0 (template arguments taken out)
# that names something before `(`, `=`, `{` or `;`.
_LINE = re.compile(r"^(?!namespace|using|template|return|typedef|static_assert|#|//|}|\s)(.+)$", re.M)
_NAMED = re.compile(r"(\w+)\s*[(={;\[]")
_ANGLES = re.compile(r"<[^<>]*>")


def _declared(line: str) -> str | None:
    while _ANGLES.search(line):
        line = _ANGLES.sub("", line)
    found = _NAMED.search(line)
    return found.group(1) if found else None


class RuntimeHeaders:
    """The headers of one target: {file name in the project: its source path}."""

    def __init__(self, sources: dict):
        self.sources = sources
        self.texts = {name: path.read_text() for name, path in sources.items()}
        self.defined_in = {}  # name -> {header}
        for header, text in self.texts.items():
            names = [name for pattern in _DEFINES for name in pattern.findall(text)]
            names += [_declared(line) for line in _LINE.findall(text)]
            names = [n for n in names if n not in _FALLBACK.findall(text)]
            for name in filter(None, names):
                self.defined_in.setdefault(name, set()).add(header)

    def used_by(self, text: str) -> list:
        """The headers defining the names `text`'s code (not its comments or strings) uses, sorted;
        a name no header defines is an error (a runtime name the target's headers lack)."""
        found = set()
        code = _COMMENT.sub("", _STRING.sub('""', text))
        for qualified, macro in _USE.findall(code):
            name = qualified or macro
            if name not in self.defined_in:
                raise KeyError(f"no runtime header defines {'dg::' if qualified else ''}{name}")
            found |= self.defined_in[name]
        return sorted(found)

    def missing(self, text: str) -> list:
        """The headers `text` uses that it does not include itself."""
        own = set(_INCLUDE.findall(text))
        return [h for h in self.used_by(text) if h not in own]

    def included(self, texts) -> dict:
        """{header: source path} of the headers the given files include, with what they include."""
        todo = [h for text in texts for h in _INCLUDE.findall(text)]
        seen = set()
        while todo:
            header = todo.pop()
            if header in seen or header not in self.texts:
                continue
            seen.add(header)
            todo += _INCLUDE.findall(self.texts[header])
        return {h: self.sources[h] for h in sorted(seen)}
