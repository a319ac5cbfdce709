"""Identifiers in generated code.

User strings become C++ and Python identifiers only through this module: a name
must be an ASCII identifier, and must not be a keyword of either language or a
name the generated code uses itself. Explicit names that break these rules are
rejected with an error; inferred names are made safe by a numeric suffix.
"""

from __future__ import annotations

import keyword
import re

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

# Names the generated C++ and bindings use for their own purposes, plus common
# macros and std names that would shadow or clash.
GENERATED_NAMES = frozenset(
    """dg std kernels Model Inputs Outputs Dims Tensor View in out seed dims self
    model result check i j k n i0 i1 i2 i3 i4 i5 i6 i7 int8_t int16_t int32_t int64_t
    uint8_t uint16_t uint32_t uint64_t size_t main NULL EOF assert errno stdin stdout
    stderr PYBIND11_MODULE m py np numpy inputs outputs parameters forward save load
    memory_stats train_step gradients expf logf log1pf expm1f fmaxf fminf fabsf tanhf
    sqrtf cbrtf powf sinf cosf erff erfcf""".split()
)

MAX_PROJECT_NAME = 100

RESERVED = CPP_KEYWORDS | GENERATED_NAMES | frozenset(keyword.kwlist)


def is_identifier(name: str) -> bool:
    # A leading underscore is left to generated code (kernel temporaries _t0, ...).
    return bool(_IDENT.match(name)) and not name.startswith("_")


def problem_with(name: str) -> str | None:
    """Why `name` cannot be used as a generated identifier, or None if it can."""
    if not isinstance(name, str):
        return f"a name must be a string, got {type(name).__name__}"
    if not is_identifier(name):
        return (
            f"name {name!r} is not a valid identifier "
            "(use ASCII letters, digits and '_', not starting with a digit or '_')"
        )
    if name in RESERVED:
        return f"name {name!r} is reserved in the generated C++/Python code; choose another"
    return None


def check_project_name(name: str) -> str:
    """Validate a project/module name (it becomes a folder, a namespace and a module)."""
    problem = problem_with(name)
    if problem:
        raise ValueError(f"invalid project name: {problem}")
    if len(name) > MAX_PROJECT_NAME:
        raise ValueError(f"invalid project name: {len(name)} characters, more than {MAX_PROJECT_NAME} (it names the "
                         "module file, folders and a C++ namespace; file systems allow 255 bytes per name)")
    return name


class NameTable:
    """Hands out unique identifiers; inferred names that clash get `_1`, `_2`, ..."""

    def __init__(self):
        self.used: set[str] = set()

    def claim(self, name: str) -> bool:
        """Take `name` exactly; False if it is taken or reserved."""
        if name in self.used or name in RESERVED or not is_identifier(name):
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
                for c in candidates:
                    self.used.add(c)
                return candidates
            k += 1

    def _free(self, name: str) -> bool:
        return name not in self.used and name not in RESERVED and is_identifier(name)


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
