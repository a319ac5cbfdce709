"""Importers: models from other frameworks as deepgen model files.

`from_torch` (torch_import.py) turns a torch.nn.Module into a DSL file plus its
weights: trace.py traces it with torch.fx, modules.py and functions.py translate
its nodes, emitter.py writes and checks the statements. torch is imported only
when an import runs.
"""

from .torch_import import from_torch, torch_keys, write_model

__all__ = ["from_torch", "torch_keys", "write_model"]
