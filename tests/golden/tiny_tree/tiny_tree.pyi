"""tiny_tree: type stubs of the module deepgen 0.1.0 generated from tiny.py.

Editors read this file to complete and check calls; the module itself is the
compiled extension next to it.
"""

import os
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import numpy as np

ArrayLike = Any  # np.ndarray, or a C-contiguous buffer / DLPack tensor / __array__ object
PathLike = Union[str, bytes, os.PathLike]  # a path for save() and load(): str, bytes, pathlib.Path

INPUTS: Dict[str, Tuple[str, str]]  # name -> (dtype, declared shape)
OUTPUTS: Dict[str, Tuple[str, str]]  # name -> (dtype, declared shape)

def trees_from_nested(trees: Sequence[Any]) -> Dict[str, np.ndarray]:
    """Inputs trees_children, trees_words, trees_roots for a list of nested trees."""

def set_num_threads(n: int) -> None:
    """Threads the kernels may use from now on (OpenMP)."""

def get_num_threads() -> int:
    """Threads the kernels use."""

def build_info() -> Dict[str, Any]:
    """How this module was built: GEMM micro-kernel, OpenMP, compiler."""

class Model:
    """The model tiny_tree: parameters, forward(), save() and load()."""

    def __init__(self, seed: int = 0) -> None:
        """Parameters drawn from `seed`, as deepgen's numpy reference draws them."""

    def forward(
        self, *, trees_children: ArrayLike, trees_words: ArrayLike, trees_roots: ArrayLike
    ) -> Dict[str, np.ndarray]:
        """Runs the network; returns the outputs by name.

        Inputs (numpy arrays, or C-contiguous buffers, DLPack tensors or objects
        with __array__ of the same dtype, read without a copy):
            trees_children: int64 [trees_nodes, 2]
            trees_words: int64 [trees_nodes]
            trees_roots: int64 [trees_count]

        Outputs (numpy arrays):
            root_h: float32 [trees_count, 4]
        """

    def parameters(self) -> Dict[str, np.ndarray]:
        """Parameter name -> writable float32 view of the model's memory. While a view is alive
        the products read the weights unpacked (slower); drop views when done."""

    def train(self, mode: bool = True) -> "Model":
        """Training mode (no op of this model depends on the mode); returns the model."""

    def eval(self) -> "Model":
        """Evaluation mode; returns the model."""
    training: bool

    def memory_stats(self) -> Dict[str, int]:
        """Arena bytes of the last call: peak_bytes, predicted_peak_bytes, calls; packed_weight_bytes: what the kept weight packings hold; parameter_bytes: what the parameters hold as stored."""

    def release_packed_weights(self) -> None:
        """Frees the weights kept packed for the matrix products (the next call packs them again)."""
    # False (default here): forward() frees a weight once packed when the packing is all
    # it reads (weights held once), and parameters(), save, load and training write it
    # back exactly; True: weights kept packed keep their stored copy too (the C++ default).
    keep_plain_weights: bool

    def save(self, path: PathLike) -> None:
        """Writes the parameters to an .npz file (".npz" added when missing):
        a new file renamed over the old one. An empty path is a ValueError; a folder, a
        device or a FIFO an OSError."""

    def load(self, path: PathLike) -> None:
        """Reads what save() wrote (or np.savez/np.savez_compressed), from a regular file
        only; checks everything first."""
