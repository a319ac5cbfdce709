"""tiny_train: type stubs of the module deepgen 0.1.0 generated from tiny.py.

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

class NonFiniteLossError(ValueError):
    """train_step's loss was NaN or infinite; nothing changed."""

def set_num_threads(n: int) -> None:
    """Threads the kernels may use from now on (OpenMP)."""

def get_num_threads() -> int:
    """Threads the kernels use."""

def build_info() -> Dict[str, Any]:
    """How this module was built: GEMM micro-kernel, OpenMP, compiler."""

class Model:
    """The model tiny_train: parameters, forward(), train_step(), save() and load()."""

    def __init__(self, seed: int = 0) -> None:
        """Parameters drawn from `seed`, as deepgen's numpy reference draws them."""

    def forward(self, *, x: ArrayLike, labels: ArrayLike = ...) -> Dict[str, np.ndarray]:
        """Runs the network; returns the outputs by name.

        Inputs (numpy arrays, or C-contiguous buffers, DLPack tensors or objects
        with __array__ of the same dtype, read without a copy):
            x: float32 [N, 3]
            labels: int64 [N]

        Outputs (numpy arrays):
            logits: float32 [N, 2]
        """

    def parameters(self) -> Dict[str, np.ndarray]:
        """Parameter name -> writable float32 view of the model's memory. While a view is alive
        the products read the weights unpacked (slower); drop views when done."""

    def train(self, mode: bool = True) -> "Model":
        """Training mode (no op of this model depends on the mode); returns the model."""

    def eval(self) -> "Model":
        """Evaluation mode; returns the model."""
    training: bool

    def train_step(self, *, x: ArrayLike, labels: ArrayLike) -> float:
        """One step of momentum(lr=0.1, momentum=0.9); returns the loss before the update.

        Inputs (numpy arrays, or C-contiguous buffers, DLPack tensors or objects
        with __array__ of the same dtype, read without a copy):
            x: float32 [N, 3]
            labels: int64 [N]

        """

    def gradients(self) -> Dict[str, np.ndarray]:
        """Parameter name -> gradient of the last compute_gradients, or of the last
        train_step while keep_gradients is True."""

    def compute_gradients(
        self, on_ready: Optional[Callable[[str], None]] = None, /, *, x: ArrayLike, labels: ArrayLike
    ) -> float:
        """Forward, loss and gradients without an update (then apply_update()); returns the loss."""

    def apply_update(self) -> None:
        """One optimizer step from the gradients as they are now."""

    def gradient_buffer(self) -> np.ndarray:
        """Every gradient end to end in one writable float32 array, in gradients() order."""

    def allocate_training_state(self) -> None:
        """Allocates the gradients and optimizer state now (zeros); the first training call does it otherwise."""

    def optimizer_state(self) -> Dict[str, np.ndarray]:
        """'parameter/slot' -> optimizer state."""

    def hyperparameters(self) -> Dict[str, float]:
        """The current hyperparameters."""
    lr: float
    momentum: float
    weight_decay: float
    step: int  # train_steps taken so far
    # True (default): train_step leaves its gradients in gradients(); False: each
    # gradient lives only until its update used it (lower peak, none kept between steps).
    keep_gradients: bool

    def memory_stats(self) -> Dict[str, int]:
        """Arena bytes of the last call: peak_bytes, predicted_peak_bytes, calls; packed_weight_bytes: what the kept weight packings hold; parameter_bytes: what the parameters hold as stored; training_state_bytes: gradients and optimizer state (allocated when training starts)."""

    def release_packed_weights(self) -> None:
        """Frees the weights kept packed for the matrix products (the next call packs them again)."""
    # False (default here): forward() frees a weight once packed when the packing is all
    # it reads (weights held once), and parameters(), save, load and training write it
    # back exactly; True: weights kept packed keep their stored copy too (the C++ default).
    keep_plain_weights: bool

    def save(self, path: PathLike) -> None:
        """Writes the parameters and optimizer state to an .npz file (".npz" added when missing):
        a new file renamed over the old one. An empty path is a ValueError; a folder, a
        device or a FIFO an OSError."""

    def load(self, path: PathLike) -> None:
        """Reads what save() wrote (or np.savez/np.savez_compressed), from a regular file
        only; checks everything first. A file without optimizer state resets it (zeros,
        step 0) as a new Model's, with a UserWarning when that discards state the model had."""
