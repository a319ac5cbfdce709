"""The names a generated project's C++ translation units hold before deepgen adds
any: the preprocessor's macros and the global names of the C and C++ libraries,
Python's C API and pybind11, as this machine's compiler sees them.

generator/ir/cpp_macros.txt and cpp_globals.txt are these lists (written by
`python -m pytest tests/test_names.py --update-golden`); tests/test_names.py
checks that they still cover what the compiler here declares. User names may not
be macros (a macro would replace the name wherever the C++ uses it), and a project
name, which becomes a C++ namespace at global scope, may not be a global name.
"""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _includes() -> list[str]:
    import pybind11

    return [sysconfig.get_paths()["include"], pybind11.get_include(), str(ROOT / "targets" / "cpu" / "runtime"),
            str(ROOT / "targets" / "cuda" / "runtime")]


def _translation_unit(tmp: Path, cuda: bool) -> Path:
    """Everything a generated TU may include: the runtime headers, pybind11, the
    example program's <cstdio> (the CUDA runtime in its CPU emulation)."""
    runtime = ROOT / "targets" / ("cuda" if cuda else "cpu") / "runtime"
    lines = [f'#include "{h.name}"' for h in sorted(runtime.glob("*.h"))]
    lines += ["#include <pybind11/numpy.h>", "#include <pybind11/pybind11.h>", "#include <cstdio>"]
    tu = tmp / ("cuda_tu.cpp" if cuda else "cpu_tu.cpp")
    tu.write_text("\n".join(lines) + "\n")
    return tu


def _preprocess(tmp: Path, extra: list[str]) -> list[str]:
    outputs = []
    for cuda in (False, True):
        for std in ("-std=c++17", "-std=gnu++17"):
            cmd = ["g++", std, "-fopenmp", "-DNDEBUG", *extra, *(f"-I{i}" for i in _includes())]
            if cuda:
                cmd.append("-DDG_CUDA_EMULATE")
            proc = subprocess.run(cmd + [str(_translation_unit(tmp, cuda))], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(proc.stderr[-3000:])
            outputs.append(proc.stdout)
    return outputs


def compiler_macros(tmp: Path) -> set[str]:
    """Every macro the generated TUs see that a user name could be (no leading '_')."""
    names = set()
    for text in _preprocess(tmp, ["-dM", "-E"]):
        for line in text.splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "#define":
                name = parts[1].split("(")[0]
                if not name.startswith("_"):
                    names.add(name)
    return names


def compiler_globals(tmp: Path) -> set[str] | None:
    """Every name declared at global scope in the generated TUs (functions,
    types, variables, enumerators, namespaces; no leading '_'), read off the
    preprocessed sources by Universal Ctags; None without ctags."""
    ctags = shutil.which("ctags")
    if ctags is None:
        return None
    names = set()
    for k, text in enumerate(_preprocess(tmp, ["-E", "-P"])):
        source = tmp / f"tu{k}.ii"
        source.write_text(text)
        proc = subprocess.run([ctags, "--language-force=C++", "-x", "--kinds-C++=+p-m-l-z-L-A-N-U",
                               "--_xformat=%N %s", "-f", "-", str(source)], capture_output=True, text=True)
        if proc.returncode != 0:
            return None
        for line in proc.stdout.splitlines():
            parts = line.split()
            # No scope (or "-"): declared at global scope, not inside a class or namespace.
            if parts and not parts[0].startswith("_") and (len(parts) == 1 or parts[1] == "-"):
                names.add(parts[0])
    return names


def write_list(path: Path, names: set[str], what: str) -> None:
    header = (f"# {what}\n# Written by `python -m pytest tests/test_names.py --update-golden` "
              "(tests/platform_names.py); one name a line.\n")
    path.write_text(header + "".join(f"{n}\n" for n in sorted(names)))
