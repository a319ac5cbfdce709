"""What `deepgen from-torch` reads from its command line: the factory that makes
the module (`MODULE.py:FACTORY`) and the example inputs (`NAME=SHAPE[:dtype]`)."""

from __future__ import annotations

import os
import re
import sys

from ..errors import DeepgenError
from ..frontend.loader import module_from_file
from ..frontend.source import describe_exception, error_site
from ..ir.names import problem_with

_DTYPES = ("float32", "int64", "int32")
_SIZE = re.compile(r"[0-9]+")  # ASCII digits only (str.isdigit also takes '²' and other scripts' digits)
# An example only has to trace the module: the symbolic axes take any size at run time.
# It is allocated (and run through the module), so its elements are bounded: 2**28 is 1 GiB
# of float32, and keeps every size far inside int64 before torch sees it.
MAX_EXAMPLE_ELEMENTS = 2**28


def factory_file(spec: str) -> str:
    """The MODULE.py of a MODULE.py:FACTORY spec, as an absolute path."""
    path, sep, factory = spec.rpartition(":")
    if not sep or not path or not factory.isidentifier():
        raise DeepgenError(f"{spec!r}: expected MODULE.py:FACTORY, a Python file and a function in it "
                           "that returns the torch.nn.Module")
    return os.path.abspath(path)


def load_factory(spec: str):
    """Run FACTORY() from MODULE.py; the nn.Module it returns, in eval mode."""
    factory_file(spec)  # (checks the form)
    path, _, factory = spec.rpartition(":")
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
            raise DeepgenError(f"--example-input {_short(item)}: {name!r} is given twice")
        if not sep or not name.isidentifier() or dtype not in _DTYPES or not shape_text:
            raise DeepgenError(f"--example-input {_short(item)}: expected NAME=SHAPE[:dtype], e.g. x=4,784 or "
                               f"tokens=N=4,T=12:int64 (dtype one of {', '.join(_DTYPES)})")
        shape, names = _shape(item, shape_text)
        if any(names):
            dims[name] = tuple(names)
        try:
            if dtype == "float32":
                examples[name] = torch.randn(*shape, generator=generator)
            else:
                examples[name] = torch.zeros(*shape, dtype=getattr(torch, dtype))
        except (RuntimeError, MemoryError) as e:  # e.g. no memory for it: torch's message has a C++ stack
            raise DeepgenError(f"--example-input {_short(item)}: PyTorch cannot make the example tensor "
                               f"({str(e).strip().splitlines()[0][:200]})") from None
    for item in items or []:  # (after all: a dim may take the name of a later input)
        name, _, rest = item.partition("=")
        clash = next((d for d in dims.get(name, ()) if d in examples), None)
        if clash:
            raise DeepgenError(f"--example-input {_short(item)}: dim name {clash!r} is also an input's name")
    if not examples:
        raise DeepgenError("from-torch needs the shape of each input of forward: --example-input NAME=SHAPE[:dtype]")
    return examples, dims


def _shape(item: str, shape_text: str) -> tuple[list, list]:
    """The sizes and dim names (None: concrete) of one --example-input's SHAPE."""
    shape, names, sizes = [], [], {}
    for entry in shape_text.split(","):
        dim, _, size = entry.rpartition("=")
        if not _SIZE.fullmatch(size):
            raise DeepgenError(f"--example-input {_short(item)}: {_short(entry)} is not a size (an int, or NAME=int)")
        if dim:
            problem = problem_with(dim)
            if problem:
                raise DeepgenError(f"--example-input {_short(item)}: dim {problem}")
        digits = size.lstrip("0") or "0"  # (int() refuses over 4300 digits: compare the length first)
        value = int(digits) if len(digits) <= 18 else None
        if value is None or value > MAX_EXAMPLE_ELEMENTS:
            shown = size if len(size) <= 30 else f"{size[:12]}... ({len(size)} digits)"
            raise DeepgenError(f"--example-input {_short(item)}: size {shown} is larger than an example may be "
                               f"({MAX_EXAMPLE_ELEMENTS} elements); give small sizes: the batch N and other "
                               "named dims take any size at run time")
        if dim and sizes.setdefault(dim, value) != value:
            raise DeepgenError(f"--example-input {_short(item)}: dim {dim} is {sizes[dim]} and {value}")
        shape.append(value)
        names.append(dim or None)
    count = 0 if 0 in shape else 1
    for value in shape if count else ():
        count *= value
        if count > MAX_EXAMPLE_ELEMENTS:  # (stops early: 10**5 axes would make the product slow)
            raise DeepgenError(f"--example-input {_short(item)}: more elements than an example may have "
                               f"({MAX_EXAMPLE_ELEMENTS}); give small sizes: the batch N and other named dims take "
                               "any size at run time")
    return shape, names


def _short(item: str) -> str:
    """The argument quoted for a message, shortened when it is long (a size of 10**5 digits)."""
    return repr(item) if len(item) <= 80 else repr(item[:60]) + f"... ({len(item)} characters)"
