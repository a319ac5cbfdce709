"""Identifiers in generated code.

User strings become C++ and Python identifiers only through this module. A user
name (an input, output, parameter, dim or node name, or a project name) is any
ASCII identifier that does not start with '_', is not a keyword of C++ or Python,
and is not a macro the generated C++ sees (a macro would replace the name
wherever the code uses it). Explicit names that break these rules are rejected
with an error; inferred names are made safe by a numeric suffix.

The generated code never takes a name from the user: its own identifiers live
where no user name can reach (docs/ARCHITECTURE.md, "Names"): deepgen's API in
the Model class, the user's names in its `net` (a `Network`); a leading '_' for
what the generated code declares beside user names (locals such as `_arena`,
kernel loop indices, Network members such as `_run`); qualified names (`std::`,
`dg::`, `kernels::`) for the rest. Names derived from user names (`d_h1_w`,
`h1_w_packed`) come from the same NameTable as the user's, so they are unique.

A project name is also a C++ namespace at global scope, a Python module, a CMake
target and a folder: it may not be a global name of the C/C++ libraries the
generated code includes (exp, read, std, dg), `main`, or a target name CMake
reserves (test, install, ...).
"""

from __future__ import annotations

import keyword
import re
from pathlib import Path

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

CPP_KEYWORDS = frozenset(
    """alignas alignof and and_eq asm auto bitand bitor bool break case catch char
    char8_t char16_t char32_t class compl concept const consteval constexpr constinit
    const_cast continue co_await co_return co_yield decltype default delete do double
    dynamic_cast else enum explicit export extern false float for friend goto if inline
    int long mutable namespace new noexcept not not_eq nullptr operator or or_eq private
    protected public register reinterpret_cast requires return short signed sizeof static
    static_assert static_cast struct switch template this thread_local throw true try
    typedef typeid typename union unsigned using virtual void volatile wchar_t while xor
    xor_eq final override import module""".split()
)


def _name_list(file: str) -> frozenset:
    """A list of names in this folder, one a line ('#' starts a comment line)."""
    text = (Path(__file__).with_name(file)).read_text()
    return frozenset(line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#"))


# Macros of the headers a generated project includes, as the compiler here sees them
# (tests/platform_names.py writes the list and checks it), plus the ones the build
# defines: NDEBUG, and (names_macro) the runtime's DG_* and CMake's <target>_EXPORTS.
MACROS = _name_list("cpp_macros.txt") | {"NDEBUG", "linux", "unix"}
# Names declared at global scope in the generated C++ (C and C++ libraries, Python's
# C API, pybind11, the runtime's dg): a project name is a namespace there.
CPP_GLOBALS = _name_list("cpp_globals.txt") | {"dg", "std", "pybind11", "main"}
# Target names CMake reserves (a project name names its Python module's target).
CMAKE_RESERVED = frozenset("""all clean help install test package package_source edit_cache rebuild_cache
    list_install_components depend ALL_BUILD ZERO_CHECK RUN_TESTS INSTALL PACKAGE""".split())

MAX_PROJECT_NAME = 100

KEYWORDS = CPP_KEYWORDS | frozenset(keyword.kwlist)
RESERVED = KEYWORDS | MACROS  # what no user name may be (besides the patterns of names_macro)


def is_identifier(name: str) -> bool:
    # A leading underscore is the generated code's (locals _arena, _check; kernel indices _i0, ...).
    return bool(_IDENT.match(name)) and not name.startswith("_")


def names_macro(name: str) -> bool:
    """Whether `name` is, or may be, a macro in the generated C++."""
    return name in MACROS or name.startswith("DG_") or name.endswith("_EXPORTS")


def is_reserved(name: str) -> bool:
    """A keyword or a macro: what no user name may be."""
    return name in KEYWORDS or names_macro(name)


def problem_with(name: str) -> str | None:
    """Why `name` cannot be used as a generated identifier, or None if it can."""
    if not isinstance(name, str):
        return f"a name must be a string, got {type(name).__name__}"
    if not is_identifier(name):
        return (
            f"name {name!r} is not a valid identifier "
            "(use ASCII letters, digits and '_', not starting with a digit or '_')"
        )
    if name in KEYWORDS:
        return f"name {name!r} is reserved: a C++ or Python keyword; choose another"
    if names_macro(name):
        why = ("the runtime's macros begin DG_" if name.startswith("DG_") else
               "CMake defines <target>_EXPORTS" if name.endswith("_EXPORTS") else "a macro of the C/C++ headers")
        return f"name {name!r} is reserved in the generated C++ ({why}); choose another"
    return None


def check_project_name(name: str) -> str:
    """Validate a project/module name (it becomes a folder, a namespace at global
    scope, a Python module and a CMake target)."""
    problem = problem_with(name)
    if problem:
        raise ValueError(f"invalid project name: {problem}")
    if name in CPP_GLOBALS:
        raise ValueError(f"invalid project name: {name!r} is a global name in the generated C++ (of the C/C++ "
                         "libraries, Python, pybind11 or deepgen's runtime), where the project's namespace goes")
    if name in CMAKE_RESERVED:
        raise ValueError(f"invalid project name: {name!r} is a target name CMake reserves")
    if len(name) > MAX_PROJECT_NAME:
        raise ValueError(f"invalid project name: {len(name)} characters, more than {MAX_PROJECT_NAME} (it names the "
                         "module file, folders and a C++ namespace; file systems allow 255 bytes per name)")
    return name


class NameTable:
    """Hands out unique identifiers; inferred names that clash get `_1`, `_2`, ..."""

    def __init__(self):
        self.used: set[str] = set()
        self.bases: dict[str, str] = {}  # a name handed out with a suffix -> the name asked for

    def claim(self, name: str) -> bool:
        """Take `name` exactly; False if it is taken or reserved."""
        if name in self.used or is_reserved(name) or not is_identifier(name):
            return False
        self.used.add(name)
        return True

    def unique(self, base: str) -> str:
        """`base` made into a free, safe identifier."""
        return self.unique_group(base, [""])[0]

    def unique_group(self, base: str, suffixes) -> list[str]:
        """Free, safe identifiers `<base>_<suffix>` for each suffix ("" for `base`
        itself), all with the same numeric suffix when one is needed: x_w, x_b,
        then x_w_1, x_b_1."""
        base = safe_identifier(base)
        names = [f"{base}_{s}" if s else base for s in suffixes]
        k = 0
        while True:
            candidates = [f"{n}_{k}" if k else n for n in names]
            if len(set(candidates)) == len(candidates) and all(self._free(c) for c in candidates):
                for c, n in zip(candidates, names):
                    self.used.add(c)
                    if c != n:
                        self.bases[c] = n
                return candidates
            k += 1

    def _free(self, name: str) -> bool:
        return name not in self.used and not is_reserved(name) and is_identifier(name)


def fresh_name(wanted: str, taken) -> str:
    """`wanted`, or else `wanted_2`, `wanted_3`, ...: the first that is not in `taken`
    and not reserved (the second function, kernel or local of a name is its `_2`).
    The caller claims it (adds it to `taken`) when it keeps it. The one way the
    stages after the graph (lowering, outlining, kernels, arena regions, a loop's
    scope) number a generated name; the graph's own names come from NameTable."""
    name, k = wanted, 1
    while name in taken or is_reserved(name):
        k += 1
        name = f"{wanted}_{k}"
    return name


def safe_identifier(text: str) -> str:
    """`text` (say, a variable name like `_h` or `größe`) made into an identifier
    that passes `is_identifier` (it may still be reserved or taken)."""
    base = re.sub(r"[^A-Za-z0-9_]", "_", str(text).encode("ascii", "replace").decode())
    base = base.lstrip("_") or "v"
    if base[0].isdigit():
        base = "v_" + base
    return base


def comment_text(text: str) -> str:
    """User text made safe for a // comment: printable ASCII, no line continuation."""
    clean = "".join(c if " " <= c <= "~" else "?" for c in text)
    return clean.rstrip("\\ ")


def cpp_string(text: str) -> str:
    """A C++ string literal holding `text` (printable ASCII; others become '?')."""
    clean = "".join(c if " " <= c <= "~" else "?" for c in text)
    return '"' + clean.replace("\\", "\\\\").replace('"', '\\"') + '"'
