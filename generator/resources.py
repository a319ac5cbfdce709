"""Where templates/ and targets/ are: inside the installed package (the wheel
puts them at generator/templates and generator/targets) or, in a source
checkout or editable install, beside the package at the repository's top."""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def resource_dir(name: str) -> Path:
    for candidate in (_PACKAGE / name, _PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"deepgen's {name}/ folder is missing (looked in {_PACKAGE} and its parent)")
