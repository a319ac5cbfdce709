"""Loading a model file.

A model file is ordinary Python that imports `generator as dg` and marks one or
more functions with `@dg.model`. `FILE.py` picks the only model in the file;
`FILE.py:NAME` picks the model whose function (or `name=`) is NAME."""

from __future__ import annotations

import importlib.util
import os
import sys

from .builder import ModelDef
from ..errors import DeepgenError
from .source import describe_exception, error_site


def module_from_file(path: str, prefix: str, what: str = "file"):
    """(module, loader, its sys.modules name) for the Python file at `path`, not run yet:
    registered under `prefix` + the path made an identifier, which the caller removes
    when it is done."""
    if not path:
        raise DeepgenError(f"no {what} named (expected FILE.py or FILE.py:NAME)")
    if os.path.isdir(path):
        raise DeepgenError(f"{path} is a folder; name the {what} in it (FILE.py or FILE.py:NAME)")
    if not os.path.isfile(path):
        raise DeepgenError(f"{what} not found: {path}")
    name = prefix + "".join(c if c.isalnum() else "_" for c in os.path.abspath(path))
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise DeepgenError(f"cannot load {path} as a Python file")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    return module, loader_spec.loader, name


def load_model(spec: str) -> ModelDef:
    path, _, wanted = spec.partition(":") if not os.path.exists(spec) else (spec, "", "")
    module, loader, module_name = module_from_file(path, "deepgen_model_", "model file")
    try:
        loader.exec_module(module)
    except SyntaxError as e:  # the model file is not valid Python (IndentationError too)
        where = f"{e.filename or path}:{e.lineno}" if e.lineno else (e.filename or path)
        text = f"\n    {e.text.strip()}" if e.text and e.text.strip() else ""
        raise DeepgenError(f"{where}: syntax error: {e.msg}{text}") from None
    except DeepgenError:
        raise
    except (Exception, SystemExit) as e:  # the file's own code failed while it was imported
        where, text = error_site(e, path)
        raise DeepgenError(f"{where}: {describe_exception(e)} (while loading {path}){text}") from e
    finally:
        sys.modules.pop(module_name, None)
    models = [v for v in vars(module).values() if isinstance(v, ModelDef)]
    models.sort(key=lambda m: m.loc.line)
    names = ", ".join(m.name for m in models)
    if wanted:
        chosen = [m for m in models if m.name == wanted or m.fn.__name__ == wanted]
        if not chosen:
            raise DeepgenError(f"{path} has no model named {wanted!r}; its models: {names or 'none'}")
        return chosen[0]
    if not models:
        raise DeepgenError(f"{path} defines no model: mark the function that builds it with @dg.model")
    if len(models) > 1:
        raise DeepgenError(f"{path} defines several models ({names}); pick one with {path}:NAME")
    return models[0]
