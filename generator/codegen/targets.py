"""Targets differ by configuration, not by `if target == ...` in the generator.

A target is a folder targets/<name>/ with a target.json (kernel file extension,
runtime headers to copy, template folder) and a printer class named here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..resources import resource_dir
from .printer import FloatPrinter

PRINTERS = {"FloatPrinter": FloatPrinter}


@dataclass(frozen=True)
class Target:
    name: str
    folder: Path
    kernel_ext: str
    runtime: tuple  # header file names under folder/runtime, copied into the project
    templates: str  # folder under templates/
    printer_cls: type


def available() -> list:
    return sorted(p.name for p in resource_dir("targets").iterdir() if (p / "target.json").is_file())


def load_target(name: str) -> Target:
    if name not in available():
        raise ValueError(f"unknown target {name!r}; available targets: {', '.join(available())}")
    folder = resource_dir("targets") / name
    conf = json.loads((folder / "target.json").read_text())
    return Target(
        name=name,
        folder=folder,
        kernel_ext=conf["kernel_ext"],
        runtime=tuple(conf["runtime"]),
        templates=conf["templates"],
        printer_cls=PRINTERS[conf["printer"]],
    )
