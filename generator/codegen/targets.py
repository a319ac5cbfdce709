"""Targets differ by configuration, not by `if target == ...` in the generator.

A target is a folder targets/<name>/ with a target.json:

- `kernel_ext`, `model_ext`: file extensions of src/kernels and src/model
  (".cpp" for the CPU, ".cu" for CUDA);
- `printer`: the sympy printer class for kernel expressions (named here);
- `templates`: a template folder under templates/, or a list of them searched in
  order, so a target overrides only the templates that differ;
- `runtime`: the header files a project may get in its runtime/ folder (those its
  code includes, and what they include: codegen/runtime_headers.py), from the
  target's own runtime/ folder, or `other:file.h` from another target's;
- `vector`, `copy`: how lowered code declares an owned buffer (`std::vector<T>`)
  and copies between buffers (`std::copy(first, last, dest)`); the CUDA target
  names device versions with the same interface;
- `scratch`: the type of per-call buffers no caller keeps (a recursive op's level
  buffers): `dg::Scratch<T>` on the CPU, uninitialized memory reused across
  calls (runtime/dg_arena.h); defaults to `vector`;
- `names`: what the shared templates call the target's things (`tensor`, the
  model's tensor type; `host_data`/`host_written`, reading and writing a
  tensor's host values; `view`, the numpy view maker; `state_lock`, the lock
  type of dg_state_lock.h; ...), rendered as `target.<name>`;
- `packs_weights`: the runtime has `dg::PackedB` and `dg::matmul(a, packed, ...)`,
  so a loop's matmuls by a weight pack it once before the loop.
- `weight_grad_partials`: the runtime's `dg::conv2d_grad_weight` sums slices of its
  K in a workspace of one group's weight gradient (CUDA, for parallel work), so the
  workspace the memory plan gives it holds that too; the CPU adds each image's
  product into the gradient in place and needs only the column matrix.
- `update_rows`: the runtime's GEMM takes a row-block epilogue that updates the
  parameter whose gradient it writes (`dg::update_rows`), so the memory stage may
  fuse an update into that product (memory/liveness.py).
- `bf16_products`: the runtime has bf16 products of its own (`dg::matmul_bf16` and the
  other functions an op's `kept_as` names, runtime/dg_bf16.h), which the products of a
  bf16 model call; without it they run the plain functions on the rounded values.
- `early_ready`: compute_gradients() can report a gradient ready as soon as the
  backward pass completes it (CUDA: a gradient is ready when the device is).
- `files`: {path in the project: path under templates/} of files copied verbatim
  into every project (the CPU's CMake toolchain file for cross builds to aarch64).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..resources import resource_dir
from .cuda_printer import CudaPrinter
from .printer import FloatPrinter

PRINTERS = {"FloatPrinter": FloatPrinter, "CudaPrinter": CudaPrinter}


@dataclass(frozen=True)
class Target:
    name: str
    folder: Path
    kernel_ext: str
    runtime: tuple  # header file names copied into the project's runtime/ (see runtime_sources)
    templates: str  # the first template folder under templates/
    printer_cls: type
    template_dirs: tuple = ()  # every template folder, searched in order
    model_ext: str = ".cpp"
    vector_type: str = "std::vector"
    scratch_type: str = "std::vector"
    packs_weights: bool = False
    weight_grad_partials: bool = False
    update_rows: bool = False
    early_ready: bool = False
    bf16_products: bool = False
    copy_fn: str = "std::copy"
    names: dict = None  # template-facing names (see the module docstring)
    files: dict = None  # {project path: file under templates/} copied verbatim

    def runtime_sources(self) -> dict:
        """{header name in the project: file it is copied from}."""
        sources = {}
        for entry in self.runtime:
            owner, _, header = entry.rpartition(":")
            folder = resource_dir("targets") / owner if owner else self.folder
            sources[header] = folder / "runtime" / header
        return sources


def available() -> list:
    return sorted(p.name for p in resource_dir("targets").iterdir() if (p / "target.json").is_file())


def load_target(name: str) -> Target:
    if name not in available():
        raise ValueError(f"unknown target {name!r}; available targets: {', '.join(available())}")
    folder = resource_dir("targets") / name
    conf = json.loads((folder / "target.json").read_text())
    templates = conf["templates"]
    template_dirs = (templates,) if isinstance(templates, str) else tuple(templates)
    return Target(
        name=name,
        folder=folder,
        kernel_ext=conf["kernel_ext"],
        runtime=tuple(conf["runtime"]),
        templates=template_dirs[0],
        printer_cls=PRINTERS[conf["printer"]],
        template_dirs=template_dirs,
        model_ext=conf.get("model_ext", ".cpp"),
        vector_type=conf.get("vector", "std::vector"),
        names=dict(conf.get("names", {})),
        scratch_type=conf.get("scratch", conf.get("vector", "std::vector")),
        packs_weights=bool(conf.get("packs_weights", False)),
        weight_grad_partials=bool(conf.get("weight_grad_partials", False)),
        update_rows=bool(conf.get("update_rows", False)),
        early_ready=bool(conf.get("early_ready", False)),
        bf16_products=bool(conf.get("bf16_products", False)),
        copy_fn=conf.get("copy", "std::copy"),
        files=dict(conf.get("files", {})),
    )
