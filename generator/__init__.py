"""deepgen: a compiler from a small Python DSL to readable, standalone C++ projects.

Model files use this package as the DSL: `import generator as dg`.
"""

import importlib as _importlib

from .version import __version__  # noqa: F401


def __getattr__(name: str):
    """The DSL's names, loaded on first use: importing deepgen's command line or a
    stage does not pay for sympy and every op until it needs them (and Ctrl-C while
    the command line starts is a one-line message, not a traceback)."""
    if name.startswith("__"):
        raise AttributeError(f"module 'generator' has no attribute {name!r}")
    namespace = _importlib.import_module(f"{__name__}.namespace")
    exported = {k: v for k, v in vars(namespace).items() if not k.startswith("_") and k != "annotations"}
    globals().update(exported)
    if name not in exported:
        raise AttributeError(f"module 'generator' has no attribute {name!r}")
    return exported[name]


def __dir__():
    namespace = _importlib.import_module(f"{__name__}.namespace")
    return sorted(set(globals()) | {k for k in vars(namespace) if not k.startswith("_")})
