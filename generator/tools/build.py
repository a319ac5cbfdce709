"""`deepgen build DIR`: compile a generated project and install its module.
(`deepgen build DIR --cross aarch64`: cross-compile its C++ library and example
program instead, see cross_build.)

It runs `pip install` on the project (scikit-build-core drives CMake), without
build isolation so the build uses this environment's pybind11 and
scikit-build-core, and with the project's persistent build folder, so a rebuild
after a hand edit recompiles only what changed. Each step is timed from the
build log's own step markers; on failure the compiler's messages are shown.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ..codegen.writer import pending_generation
from ..errors import BuildError
from .installed import check_name_free

# scikit-build-core's progress lines -> our step names
_STEPS = [
    (re.compile(r"\*\*\* Configuring CMake"), "configure (cmake)"),
    (re.compile(r"\*\*\* Building project"), "compile"),
    (re.compile(r"\*\*\* Installing project"), "package wheel"),
    (re.compile(r"Installing collected packages|Successfully built"), "install into this environment"),
]


def project_name(root: Path) -> str:
    """The distribution name in a generated project's pyproject.toml."""
    match = re.search(r'^name = "([A-Za-z_][A-Za-z0-9_]*)"$', (root / "pyproject.toml").read_text(), re.M)
    if match is None:
        raise BuildError(f"{root / 'pyproject.toml'}: no project name (is this a deepgen project?)")
    return match.group(1)


def build_project(project_dir, echo=print, target_dir=None, replace_installed: bool = False) -> float:
    """Build and install (into this environment, or into the folder `target_dir`);
    returns total seconds. Raises BuildError with the compiler's errors.

    pip is given the project as a file:// URL of its resolved folder, so that a
    bare folder name is never looked up in a package index as a requirement, and
    refuses (unless replace_installed) a name that would replace an installed
    distribution or module (see installed.py)."""
    root = Path(project_dir).resolve()
    if not (root / "pyproject.toml").is_file() or not (root / "CMakeLists.txt").is_file():
        raise BuildError(f"{project_dir} is not a generated project (no pyproject.toml / CMakeLists.txt)")
    if pending_generation(root):
        raise BuildError(f"{project_dir}: a `deepgen generate` into it was interrupted half-way; run the same "
                         "generate again (it completes the interrupted one first), then build")
    if target_dir is None:
        check_name_free(project_name(root), replace_installed, "generate --name")
    cmd = [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "-v", root.as_uri()]
    if target_dir is not None:
        cmd[5:5] = ["--target", str(target_dir), "--upgrade"]
    echo(f"building {root} with: {' '.join(cmd)}")
    start = last = time.perf_counter()
    step = "prepare"
    log = []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        log.append(line)
        for pattern, name in _STEPS:
            if pattern.search(line) and name != step:
                now = time.perf_counter()
                echo(f"  {step:<32} {now - last:6.1f} s")
                step, last = name, now
    code = proc.wait()
    now = time.perf_counter()
    echo(f"  {step:<32} {now - last:6.1f} s")
    if code != 0:
        raise BuildError(f"build of {project_dir} failed (pip exit {code}):\n{_errors(log)}")
    echo(f"built and installed in {now - start:.1f} s")
    return now - start


def cmake_build(project, build, jobs: int = 2, extra_args=(), python: bool = True) -> None:
    """Configure and build a generated project with plain CMake, as a user would
    (Release; Ninja when available; the module for this Python unless `python` is
    False). Used by the tests and the benchmarks; raises BuildError with CMake's
    output on failure. `extra_args` go at the end of the configure command (e.g.
    `-D` settings, which override the defaults above)."""
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    pick_python = [f"-DPython_EXECUTABLE={sys.executable}"] if python else []
    configure = ["cmake", "-S", str(project), "-B", str(build), *gen, "-DCMAKE_BUILD_TYPE=Release",
                 *pick_python, *extra_args]
    for cmd in (configure, ["cmake", "--build", str(build), "--parallel", str(jobs)]):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")


# --cross TARGET -> (its GNU triple, the Debian package of its cross compiler). A CPU
# project ships the toolchain file cmake/<triple>.cmake, which names <triple>-g++.
CROSS_TARGETS = {
    "aarch64": ("aarch64-linux-gnu", "g++-aarch64-linux-gnu"),
}
DEFAULT_ARM_ARCH = "armv8.2-a+fp16+dotprod"  # the projects' <NAME>_ARM_ARCH default


def cross_build(project_dir, target: str = "aarch64", build_dir=None, march=None, jobs: int = 2,
                echo=print) -> Path:
    """Cross-compile a generated CPU project's C++ library and example program
    with CMake and the toolchain file the project ships (cmake/<triple>.cmake);
    returns the build folder (default: DIR/build-<target>). `march` overrides
    the project's default target CPU (-march=armv8.2-a+fp16+dotprod). The Python
    module is not built: it would need the target's Python. Raises BuildError
    when the cross compiler or the toolchain file is missing, or the build fails."""
    if target not in CROSS_TARGETS:
        raise BuildError(f"--cross {target}: unknown target (known: {', '.join(CROSS_TARGETS)})")
    triple, package = CROSS_TARGETS[target]
    toolchain, compiler = f"cmake/{triple}.cmake", f"{triple}-g++"
    root = Path(project_dir).resolve()
    if not (root / "CMakeLists.txt").is_file():
        raise BuildError(f"{project_dir} is not a generated project (no CMakeLists.txt)")
    if not (root / toolchain).is_file():
        raise BuildError(f"{project_dir} has no {toolchain} (a CPU project generated by this deepgen has it; "
                         "generate it again)")
    if shutil.which(compiler) is None:
        raise BuildError(f"--cross {target} needs the cross compiler {compiler}, which is not on PATH; "
                         f"on Debian or Ubuntu: apt-get install {package}")
    if shutil.which("cmake") is None:
        raise BuildError("--cross needs cmake on PATH (pip install cmake, or your system's package)")
    build = Path(build_dir).resolve() if build_dir else root / f"build-{target}"
    extra = [f"-DCMAKE_TOOLCHAIN_FILE={root / toolchain}"]
    if march:
        extra.append(f"-D{project_name(root).upper()}_ARM_ARCH={march}")
    echo(f"cross-building {root} for {target} in {build} (-march={march or 'the project default, ' + DEFAULT_ARM_ARCH})")
    start = time.perf_counter()
    cmake_build(root, build, jobs, extra, python=False)
    echo(f"built in {time.perf_counter() - start:.1f} s: {build / (project_name(root) + '_example')} "
         f"(run it on {target}, or here: qemu-{target} -L /usr/{triple} PROGRAM)")
    return build


def build_if_changed(project, build, module: str, key: str, jobs: int = 2) -> bool:
    """cmake_build unless `build` already holds module `module` built from sources
    whose digest is `key` (a stamp file records it). Returns True if reused."""
    build = Path(build)
    stamp = build / ".deepgen-build-key"
    built = list(build.glob(f"{module}*.so")) + list(build.glob(f"{module}*.pyd"))
    if stamp.is_file() and stamp.read_text() == key and built:
        return True
    if stamp.is_file():
        stamp.unlink()
    cmake_build(project, build, jobs)
    stamp.write_text(key)
    return False


def _errors(log: list) -> str:
    """The compiler's error lines with a little context, or the log's tail."""
    picked = []
    for i, line in enumerate(log):
        if re.search(r"\berror\b|Error|FAILED", line):
            picked.extend(log[max(0, i - 1) : i + 4])
    text = "".join(dict.fromkeys(picked)) if picked else "".join(log[-40:])
    return text[-8000:]
