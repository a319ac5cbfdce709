"""What `deepgen from-torch` reads from its command line: the factory that makes
the module (`MODULE.py:FACTORY`) and the example inputs (`NAME=SHAPE[:dtype]`)."""

from __future__ import annotations

import os
import sys

from ..errors import DeepgenError
from ..frontend.loader import module_from_file
from ..frontend.source import describe_exception, error_site

_DTYPES = ("float32", "int64", "int32")


def load_factory(spec: str):
    """Run FACTORY() from MODULE.py; the nn.Module it returns, in eval mode."""
    path, sep, factory = spec.rpartition(":")
    if not sep or not path or not factory.isidentifier():
        raise DeepgenError(f"{spec!r}: expected MODULE.py:FACTORY, a Python file and a function in it "
                           "that returns the torch.nn.Module")
    module, loader, name = module_from_file(path, "deepgen_torch_", "module file")
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))  # its own imports of neighbouring files
    try:
        loader.exec_module(module)
        make = getattr(module, factory, None)
        if not callable(make):
            raise DeepgenError(f"{path} has no function {factory!r}")
        made = make()
    except DeepgenError:
        raise
    except (Exception, SystemExit) as e:
        where, text = error_site(e, path)
        raise DeepgenError(f"{where}: {describe_exception(e)} (while running {spec}){text}") from e
    finally:
        sys.path.pop(0)
        sys.modules.pop(name, None)
    import torch

    if not isinstance(made, torch.nn.Module):
        raise DeepgenError(f"{spec} returned {type(made).__name__}, not a torch.nn.Module")
    return made.eval()


def example_inputs(items) -> tuple[dict, dict]:
    """({name: example tensor}, {name: dim names}) from NAME=SHAPE[:dtype] items. SHAPE
    is comma-separated sizes; a size may name its symbolic dim (`x=N=4,T=10,16`),
    and when one does, the axes without a name are concrete."""
    import torch

    examples, dims = {}, {}
    generator = torch.Generator().manual_seed(0)
    for item in items or []:
        name, sep, rest = item.partition("=")
        shape_text, _, dtype = rest.partition(":")
        dtype = dtype or "float32"
        if name in examples:
            raise DeepgenError(f"--example-input {item!r}: {name!r} is given twice")
        if not sep or not name.isidentifier() or dtype not in _DTYPES or not shape_text:
            raise DeepgenError(f"--example-input {item!r}: expected NAME=SHAPE[:dtype], e.g. x=4,784 or "
                               f"tokens=N=4,T=12:int64 (dtype one of {', '.join(_DTYPES)})")
        shape, names = [], []
        for entry in shape_text.split(","):
            dim, _, size = entry.rpartition("=")
            if not size.isdigit() or (dim and not dim.isidentifier()):
                raise DeepgenError(f"--example-input {item!r}: {entry!r} is not a size (an int, or NAME=int)")
            shape.append(int(size))
            names.append(dim or None)
        if any(names):
            dims[name] = tuple(names)
        if dtype == "float32":
            examples[name] = torch.randn(*shape, generator=generator)
        else:
            examples[name] = torch.zeros(*shape, dtype=getattr(torch, dtype))
    if not examples:
        raise DeepgenError("from-torch needs the shape of each input of forward: --example-input NAME=SHAPE[:dtype]")
    return examples, dims
