"""Training in the DSL: losses, optimizers and `dg.train(loss, optimizer)`.

    loss = dg.softmax_cross_entropy(logits, labels)
    dg.train(loss, dg.adam(lr=1e-3), weight_decay=1e-4)

Each optimizer's update is a set of sympy expressions over the parameter w, its
gradient g, its state slots and scalar hyperparameters; the generated C++ update
kernel is printed from them, the numpy reference evaluates them, and the
hyperparameters stay settable at run time (fields of the one struct the update
kernel takes, filled at every step).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import numpy as np
import sympy
from sympy.codegen.cfunctions import log1p

from . import dsl
from .builder import Tensor, current
from ..errors import ModelError
from .source import user_loc

W, G = sympy.symbols("w g", real=True)
STEP_SYMBOLS = {name: sympy.Symbol(name, real=True) for name in ("lr", "momentum", "beta1", "beta2", "eps",
                                                                   "weight_decay", "c1", "c2")}

# The hyperparameters each step makes from a setting: Adam's bias corrections 1 - beta^step
# (the generated code computes them in double, as `apply` does), and what they are.
BIAS_CORRECTIONS = {"c1": "beta1", "c2": "beta2"}
STEP_NOTES = {"c1": "1 - beta1^step: the bias correction of m", "c2": "1 - beta2^step: the bias correction of v"}


class FlushSubnormal(sympy.Function):
    """x, or 0 where x is subnormal (0 < |x| < 2^-126, float32's smallest normal).

    An optimizer's state that decays geometrically (a momentum buffer, Adam's m
    and v) reaches the subnormals after some 800 steps of zero gradient (a dead
    ReLU unit, an embedding row no batch reads; 0.9^800 ~ 1e-37), and stays
    there: each operation on a subnormal costs an Intel core a microcode assist,
    and an MLP train step was seen 4.5x slower (PyTorch's as well). A value that
    small moves no weight (lr * 1e-38 is below the resolution of any weight that
    is not itself that small), so the state is flushed to 0 instead: printed as
    dg::math::flush_subnormal_f, evaluated by the reference below."""

    nargs = 1

    @staticmethod
    def numpy(x):
        x = np.asarray(x)
        tiny = np.finfo(x.dtype if x.dtype.kind == "f" else np.float32).tiny
        return np.where(np.abs(x) < tiny, np.zeros_like(x), x)


@dataclass(frozen=True)
class Optimizer:
    """kind: sgd | momentum | adam. hyper: defaults of the run-time settable
    hyperparameters. slots: per-parameter state arrays."""

    kind: str
    hyper: tuple  # ((name, default), ...)
    slots: tuple

    def updates(self) -> list:
        """[(target, expr)] in order: slots first, then "w". Symbols: w, g, the
        slots, the hyperparameters, weight_decay, and for Adam the bias
        corrections c1 = 1 - beta1^t, c2 = 1 - beta2^t (computed per step).
        A slot's new value is flushed to 0 where subnormal (FlushSubnormal)."""
        s = STEP_SYMBOLS
        grad = G + s["weight_decay"] * W  # L2 weight decay, as PyTorch's weight_decay
        if self.kind == "sgd":
            return [("w", W - s["lr"] * grad)]
        if self.kind == "momentum":
            buf = sympy.Symbol("buf", real=True)
            new_buf = FlushSubnormal(s["momentum"] * buf + grad)
            return [("buf", new_buf), ("w", W - s["lr"] * buf)]  # w uses the updated buf
        m, v = sympy.symbols("m v", real=True)
        return [
            ("m", FlushSubnormal(s["beta1"] * m + (1 - s["beta1"]) * grad)),
            ("v", FlushSubnormal(s["beta2"] * v + (1 - s["beta2"]) * grad**2)),
            ("w", W - s["lr"] * (m / s["c1"]) / (sympy.sqrt(v / s["c2"]) + s["eps"])),
        ]

    def apply(self, w, g, slots: dict, hyper: dict, step: int):
        """numpy: (new w, {slot: new value}) in float32, the update rules evaluated
        in the order the generated kernel evaluates them."""
        env = {W: w, G: g, **{sympy.Symbol(k, real=True): v for k, v in slots.items()}}
        scalars = dict(hyper)
        if self.kind == "adam":
            for c, beta in BIAS_CORRECTIONS.items():
                scalars[c] = 1.0 - float(hyper[beta]) ** step
        env.update({STEP_SYMBOLS[k]: np.float32(v) for k, v in scalars.items() if k in STEP_SYMBOLS})
        new_slots, new_w = {}, None
        for target, expr in self.updates():
            symbols = sorted(expr.free_symbols, key=str)
            value = sympy.lambdify(symbols, expr, [{"FlushSubnormal": FlushSubnormal.numpy}, "numpy"])(
                *(env[s] for s in symbols))
            value = np.asarray(value, dtype=np.float32)
            if target == "w":
                new_w = value
            else:
                new_slots[target] = value
                env[sympy.Symbol(target, real=True)] = value
        return new_w, new_slots

    def describe(self) -> str:
        return f"{self.kind}(" + ", ".join(f"{k}={v:g}" for k, v in self.hyper) + ")"


# The range of each run-time hyperparameter, as the dg_range_checks.h check that the
# generated module applies when it is set and at every train_step.
HYPER_RANGES = {
    "lr": "require_non_negative",
    "momentum": "require_non_negative",
    "beta1": "require_unit_interval",
    "beta2": "require_unit_interval",
    "eps": "require_positive",
    "weight_decay": "require_non_negative",
}


def _positive(name, value, allow_zero=False):
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or value < 0 or (value == 0 and not allow_zero):
        raise ModelError(f"{name} must be a {'non-negative' if allow_zero else 'positive'} number, got {value!r}",
                         user_loc())
    return float(value)


def sgd(lr: float = 0.01, momentum: float = 0.0) -> Optimizer:
    """Stochastic gradient descent; with momentum: buf = momentum * buf + g; w -= lr * buf."""
    lr = _positive("lr", lr)
    momentum = _positive("momentum", momentum, allow_zero=True)
    if momentum:
        return Optimizer("momentum", (("lr", lr), ("momentum", momentum)), ("buf",))
    return Optimizer("sgd", (("lr", lr),), ())


def adam(lr: float = 0.001, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8) -> Optimizer:
    for name, b in (("beta1", beta1), ("beta2", beta2)):
        if not 0 <= b < 1:
            raise ModelError(f"{name} must be in [0, 1), got {b!r}", user_loc())
    return Optimizer("adam", (("lr", _positive("lr", lr)), ("beta1", float(beta1)), ("beta2", float(beta2)),
                              ("eps", _positive("eps", eps))), ("m", "v"))


@dataclass
class TrainSpec:
    loss: object  # Value
    optimizer: Optimizer
    weight_decay: float
    loc: object = None
    precision: str = "fp32"  # "bf16": products in bf16, fp32 master weights (autodiff.prepare_training)
    grads: dict = field(default_factory=dict)  # param name -> gradient Value (after prepare)
    prepared: bool = False

    @property
    def hyper(self) -> list:
        """[(name, default)] of every run-time hyperparameter, weight decay last."""
        return list(self.optimizer.hyper) + [("weight_decay", self.weight_decay)]


def train(loss, optimizer: Optimizer | None = None, weight_decay: float = 0.0, precision: str = "fp32"):
    """Make the model trainable: the generated module gets train_step(**inputs),
    which minimizes `loss` (a scalar) with `optimizer` (default sgd(0.01)).
    `precision` "bf16": the forward and backward products multiply bfloat16 values
    (their operands rounded, float32 sums), the weights, gradients and optimizer
    state stay float32 (master weights), as forward() does in bf16."""
    b, loc = current(), user_loc()
    if precision not in ("fp32", "bf16"):
        raise ModelError(f"dg.train(precision={precision!r}): expected 'fp32' or 'bf16'", loc, "train")
    if not isinstance(loss, Tensor):
        raise ModelError(f"dg.train needs the loss Tensor, got {type(loss).__name__}", loc, "train")
    if loss.shape != () or loss.dtype != "float32":
        raise ModelError(f"the loss must be a float32 scalar, got '{loss.name}' {loss.value.type_str()}", loc, "train")
    if b.graph.train is not None:
        raise ModelError(f"dg.train was already called at {b.graph.train.loc}", loc, "train")
    optimizer = optimizer or sgd()
    if not isinstance(optimizer, Optimizer):
        raise ModelError(f"optimizer must be dg.sgd(...) or dg.adam(...), got {optimizer!r}", loc, "train")
    b.graph.train = TrainSpec(loss.value, optimizer, _positive("weight_decay", weight_decay, True), loc,
                              precision=precision)


# -- losses --------------------------------------------------------------------


def softmax_cross_entropy(logits, labels, name=None, ignore_index=None):
    """Mean over rows of -log softmax(logits)[label]: logits [N, C], labels int [N].
    Rows labeled `ignore_index` (an int, e.g. -1 for a tree's unlabeled nodes) are
    skipped and the mean is over the others (0 when none is labeled), as PyTorch's
    ignore_index."""
    attrs = {}
    if ignore_index is not None:
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int) or not -2**62 < ignore_index < 2**62:
            raise ModelError(f"ignore_index must be an int, got {ignore_index!r}", user_loc(), "softmax_cross_entropy")
        attrs["ignore_index"] = ignore_index
    return current().add("softmax_xent", [logits, labels], attrs, label="softmax_cross_entropy", name=name)[0]


def mse(pred, target, name=None):
    """Mean squared error over all elements."""
    diff = dsl.sub(pred, target)
    return dsl.mean(dsl.square(diff), name=name)


def bce_with_logits(logits, targets, name=None):
    """Binary cross-entropy of sigmoid(logits) against targets in [0, 1], averaged;
    written as max(x, 0) - x t + log(1 + exp(-|x|)), which cannot overflow."""
    per_element = dsl.elementwise(
        lambda x, t: sympy.Max(x, 0) - x * t + log1p(sympy.exp(-sympy.Abs(x))), "bce_with_logits"
    )(logits, targets)
    return dsl.mean(per_element, name=name)
