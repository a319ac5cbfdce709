"""Tracing a torch.nn.Module with torch.fx, and where each node came from.

Errors name the user's source line: fx nodes record the stack of the call that
made them (`record_stack_traces`), and the innermost frame outside torch is the
line in the user's `forward`.
"""

from __future__ import annotations

import os
import re
import traceback

from ..errors import DeepgenError

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in [^\n]*\n([^\n]*)')


def torch_dir() -> str:
    import torch

    return os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def trace(module):
    """The fx GraphModule of `module`; a DeepgenError naming the reason (and the
    user's line) when torch.fx cannot trace it."""
    import torch
    import torch.fx

    class Tracer(torch.fx.Tracer):
        record_stack_traces = True

    what = type(module).__name__
    try:
        graph = Tracer().trace(module)
    except Exception as e:  # fx raises TraceError, TypeError, NotImplementedError, ...
        where = _traceback_site(e)
        raise DeepgenError(f"torch.fx cannot trace {what}{where}: {type(e).__name__}: {e} "
                           "(deepgen imports modules whose forward torch.fx.symbolic_trace can follow: no "
                           "Python control flow on tensor values)") from None
    return torch.fx.GraphModule(module, graph, what)


def _traceback_site(exc) -> str:
    """' at file:line (`text`)' of the innermost frame outside torch and deepgen."""
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not os.path.abspath(f.filename).startswith((torch_dir(), ours))]
    if not frames:
        return ""
    f = frames[-1]
    return f" at {f.filename}:{f.lineno} (`{(f.line or '').strip()}`)"


def source_site(node) -> tuple[str, int, str] | None:
    """(file, line, text) of the user's line that made `node`, or None."""
    stack = node.meta.get("stack_trace") or getattr(node, "stack_trace", None) or ""
    frames = [(f, int(line), text.strip()) for f, line, text in _FRAME.findall(stack)
              if not os.path.abspath(f).startswith(torch_dir())]
    return frames[-1] if frames else None


def describe(node) -> str:
    """What a node calls, as the user wrote it: `torch.fft.fft`, `Tensor.unfold`, `self.pool (nn.Unfold)`."""
    if node.op == "call_module":
        return f"self.{node.target}"
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.op == "call_function":
        target = node.target
        module = getattr(target, "__module__", None) or ""
        name = getattr(target, "__name__", str(target))
        if module in ("_operator", "operator"):
            return f"operator.{name}"
        if module.startswith("torch") or not module:
            return _torch_name(target) or name
        return f"{module}.{name}"
    return f"{node.op} {node.target}"


def _torch_name(target) -> str | None:
    """The public torch path of a builtin such as torch._C._fft.fft_fft (torch.fft.fft)."""
    import torch

    for prefix, namespace in (("torch.nn.functional", torch.nn.functional), ("torch.fft", torch.fft),
                              ("torch.linalg", torch.linalg), ("torch.special", torch.special), ("torch", torch)):
        for key, value in vars(namespace).items():
            if value is target and not key.startswith("_"):
                return f"{prefix}.{key}"
    return None


def node_error(node, message: str) -> DeepgenError:
    """A DeepgenError for `node`: `file:line: message` and the line itself."""
    site = source_site(node)
    if site is None:
        return DeepgenError(f"{message} (fx node '{node.name}')")
    filename, line, text = site
    return DeepgenError(f"{filename}:{line}: {message}\n    {text}")
