"""The oracle of the binding fuzzer (tests/fuzz_child.py): a call's only allowed
outcomes are the numpy reference's result (generator.reference.interpreter, run with the module's
own parameters and optimizer state), or a ValueError or MemoryError that leaves the
model bit-identical (for inputs outside the README's contract or that the reference
refuses); anything else raises a Finding (see tests/test_fuzz.py).
"""

from __future__ import annotations

import warnings

import numpy as np

from fuzz_arrays import INT64_MAX, INT64_MIN

SEED = 3  # every fuzzed Model is Model(seed=SEED)


class Finding(AssertionError):
    """Something the bindings must never do. Each kind is raised at its own line, so
    hypothesis reports distinct kinds as distinct failures."""


class PendingNonFiniteLoss(Finding):
    """PENDING NonFiniteLossError: train_step did not refuse a non-finite loss."""


class FuzzOracle:
    """The Fuzzer's (fuzz_child.Fuzzer's) checks of one call: it sets graph, decl,
    module, model, forward_names and train_names, and provides record() and tally()."""

    def snapshot(self, m, copy=True):
        """Everything a call must leave alone: parameters, and for a trainable model
        the optimizer state, the gradients, the step and the hyperparameters."""
        take = (lambda v: v.copy()) if copy else (lambda v: v)
        state = {"param " + k: take(v) for k, v in m.parameters().items()}
        if self.graph.train:
            state.update({"optimizer " + k: take(v) for k, v in m.optimizer_state().items()})
            state.update({"gradient " + k: take(v) for k, v in m.gradients().items()})
            state["step"] = np.asarray(m.step)
            state.update({"hyperparameter " + k: np.asarray(v) for k, v in m.hyperparameters().items()})
        return state

    def changed(self, m, before):
        """The names of what is no longer bit-identical to the snapshot `before`."""
        now = self.snapshot(m, copy=False)
        return [k for k in before if k not in now or not same_bits(before[k], now[k])]

    def repro(self, entry, inputs, setup=()):
        args = ", ".join(f"{k!r}: {v.code}" for k, v in inputs.items())
        lines = [
            f"import {self.module.__name__}",
            f"m = {self.module.__name__}.Model(seed={SEED})",
            *setup,
            f"m.{entry}(**{{{args}}})",
        ]
        return "\n".join(lines)

    def contract_valid(self, inputs, required):
        """The README's contract: the required names (and no unknown one), numpy arrays
        of exactly the declared dtype, C-contiguous (and aligned)."""
        if not set(required) <= set(inputs) <= set(self.decl):
            return False
        return all(
            isinstance(v.value, np.ndarray)
            and v.value.dtype == np.dtype(self.decl[k].dtype)
            and v.value.flags.c_contiguous
            and v.value.flags.aligned
            for k, v in inputs.items()
        )

    def call(self, m, entry, inputs, code):
        """The module's answer: ("ok", result) or ("error", exception)."""
        from hypothesis import note

        note(code)
        self.record(code)
        kwargs = {k: v.value for k, v in inputs.items()}
        try:
            with np.errstate(all="ignore"):
                result = getattr(m, entry)(**kwargs)
            self.tally(entry, "ok")
            return "ok", result
        except (ValueError, MemoryError) as e:
            self.tally(entry, f"{type(e).__name__}: {str(e)[:60]}")
            return "error", e
        except Exception as e:  # noqa: BLE001
            raise Finding(
                f"{entry} raised {type(e).__name__} (only ValueError or MemoryError may be raised): "
                f"{str(e)[:500]}\n{code}"
            ) from None

    def reference_forward(self, inputs, params, needed_only=False):
        """(True, outputs) or (False, the reason the reference refuses)."""
        from generator.reference import interpreter as reference

        kwargs = {k: v.value for k, v in inputs.items() if not needed_only or k in self.forward_names}
        try:
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore")
                return True, reference.run(self.graph, kwargs, params=params)
        except Exception as e:  # noqa: BLE001  (the reference refuses: any exception)
            return False, f"{type(e).__name__}: {e}"

    def check_forward(self, inputs):
        m = self.model
        before = self.snapshot(m)
        params = {k[len("param ") :]: v for k, v in before.items() if k.startswith("param ")}
        code = self.repro("forward", inputs)
        status, got = self.call(m, "forward", inputs, code)
        moved = self.changed(m, before)
        if moved:
            raise Finding(f"forward ({status}) changed the model: {moved[:5]}\n{code}")
        if status == "error":
            if self.contract_valid(inputs, self.forward_names) and self.reference_forward(inputs, params)[0]:
                raise Finding(
                    f"forward refused inputs the contract and the reference accept: "
                    f"{type(got).__name__}: {got}\n{code}"
                )
            return
        ok, want = self.reference_forward(inputs, params)
        if not ok:  # unused inputs (labels in forward) the reference checks and the module ignores
            ok, want = self.reference_forward(inputs, params, needed_only=True)
        if not ok:
            raise Finding(f"forward accepted inputs the reference refuses ({want})\n{code}")
        problem = compare_outputs(got, want)
        if problem:
            raise Finding(f"forward's result differs from the reference: {problem}\n{code}")

    def check_train_step(self, inputs, setup, m):
        """One train_step on model `m` (already set up by the code in `setup`)."""
        from generator.reference import interpreter as reference

        before = self.snapshot(m)
        step, hyper = m.step + 1, m.hyperparameters()
        code = self.repro("train_step", inputs, setup)
        status, got = self.call(m, "train_step", inputs, code)
        moved = self.changed(m, before)
        valid = self.contract_valid(inputs, self.train_names)
        if status == "error" and not moved and not valid:
            return  # refused inputs outside the contract, and changed nothing: whatever the reference says
        params = {k[len("param ") :]: v.copy() for k, v in before.items() if k.startswith("param ")}
        state = {k[len("optimizer ") :]: v.copy() for k, v in before.items() if k.startswith("optimizer ")}
        try:
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore")
                want = reference.train_step(
                    self.graph, {k: v.value for k, v in inputs.items()}, params, state, step=step, hyper=hyper
                )
            ok = True
        except Exception as e:  # noqa: BLE001
            ok, want = False, f"{type(e).__name__}: {e}"
        if ok and not np.isfinite(want) and valid:
            if status == "ok" or type(got).__name__ != "NonFiniteLossError" or moved:
                what = f"returned the loss {got}" if status == "ok" else f"raised {type(got).__name__}: {got}"
                raise PendingNonFiniteLoss(
                    f"PENDING NonFiniteLossError: the loss is not finite (the reference gives {want}); train_step "
                    f"must raise NonFiniteLossError (a ValueError) and change nothing, but it {what}"
                    + (f" and changed {moved[:5]}" if moved else "")
                    + f"\n{code}"
                )
            return
        if status == "error":
            if moved:
                raise Finding(
                    f"train_step raised {type(got).__name__} but changed the model: {moved[:5]}\n{code}"
                )
            if ok and valid:
                raise Finding(
                    f"train_step refused inputs the contract and the reference accept: "
                    f"{type(got).__name__}: {got}\n{code}"
                )
            return
        if not ok:
            raise Finding(f"train_step accepted inputs the reference refuses ({want})\n{code}")
        if m.step != int(before["step"]) + 1:
            raise Finding(f"train_step took step {int(before['step'])} to {m.step}\n{code}")
        problem = compare_outputs({"loss": np.float32(got)}, {"loss": np.float32(want)})
        # Adam divides by sqrt(v) + eps: where the step's gradient (weight decay
        # included: it can cancel the loss's part) is within ~1e3 eps of zero, the step
        # moves by up to lr on float32 rounding alone (seen with a 1e30 input). There
        # the parameters and slots may differ by lr. The gradient comes from the change
        # of the first moment: g = (m_new - beta1 m_old) / (1 - beta1).
        loose = {}
        if hasattr(m, "beta1"):
            slots = m.optimizer_state()
            for name in m.parameters():
                m_old, m_new = before["optimizer " + f"{name}/m"], slots[f"{name}/m"]
                g = (m_new.astype(np.float64) - m.beta1 * m_old) / (1.0 - m.beta1)
                loose[name] = (np.abs(g) < 1e3 * m.eps, m.lr)
        for name, value in m.parameters().items():
            problem = problem or compare_update(value, params[name], before["param " + name], name, loose.get(name))
        for name, value in m.optimizer_state().items():
            problem = problem or compare_update(value, state[name], before["optimizer " + name], name,
                                                loose.get(name.split("/")[0]))
        if problem:
            raise Finding(f"train_step differs from the reference: {problem}\n{code}")


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.itemsize == 4 and a.ndim:  # float32 tensors: compare the bits as int32
        return np.array_equal(a.view(np.int32), b.view(np.int32))
    return a.tobytes() == b.tobytes()


def plain_nested(item) -> bool:
    """Only Python ints in int64's range (not bools), tuples and lists (iteratively:
    trees may be deep)."""
    stack = [item]
    while stack:
        x = stack.pop()
        if isinstance(x, bool):
            return False
        if isinstance(x, int):
            if not INT64_MIN <= x <= INT64_MAX:
                return False
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        else:
            return False
    return True


def compare_outputs(got, want) -> str | None:
    """None when `got` matches the reference's `want` (NaN where it has NaN, the same
    infinities, finite values within 1e-4 relative to the row's largest value)."""
    if not isinstance(got, dict) or set(got) != set(want):
        return (
            f"outputs {sorted(got) if isinstance(got, dict) else type(got).__name__}, expected {sorted(want)}"
        )
    for name, w in want.items():
        g = got[name]
        w = np.asarray(w)
        if not isinstance(g, (np.ndarray, np.generic)) or g.shape != w.shape or g.dtype != w.dtype:
            return (
                f"{name}: {type(g).__name__} {getattr(g, 'dtype', '')}{list(getattr(g, 'shape', ()))}, "
                f"expected {w.dtype}{list(w.shape)}"
            )
        bad = _mismatch(np.asarray(g, np.float64), w.astype(np.float64))
        if bad is not None:
            return f"{name}{list(bad)}: got {g[bad]!r}, the reference gives {w[bad]!r}"
    return None


def _mismatch(g, w):
    """The first index where g and w disagree, or None."""
    finite = np.isfinite(w)
    scale = (
        np.max(np.where(finite, np.abs(w), 0), axis=-1, keepdims=True) if w.ndim else np.abs(np.nan_to_num(w))
    )
    tol = 1e-5 + 1e-4 * np.abs(np.where(finite, w, 0)) + 1e-4 * scale
    same = np.where(finite, np.abs(g - w) <= tol, (np.isnan(w) & np.isnan(g)) | (g == w))
    if same.all():
        return None
    return tuple(int(i) for i in np.argwhere(~same)[0]) if w.ndim else ()


def compare_update(got, want, before, name, loose=None) -> str | None:
    """A parameter or optimizer slot after one step against the reference's, within
    1e-3 of the largest change (the update amplifies rounding differences); `loose`
    = (mask, tolerance) widens it where the optimizer is ill-conditioned (Adam at a
    gradient near zero)."""
    delta = np.abs(np.nan_to_num(want.astype(np.float64) - before, posinf=0, neginf=0)).max(initial=0)
    tol = 1e-6 + 1e-4 * np.abs(np.nan_to_num(want)) + 1e-3 * delta
    if loose is not None and loose[0].shape == np.shape(want):
        tol = np.where(loose[0], np.maximum(tol, loose[1]), tol)
    g, w = got.astype(np.float64), want.astype(np.float64)
    same = np.where(np.isfinite(w), np.abs(g - w) <= tol, (np.isnan(w) & np.isnan(g)) | (g == w))
    if same.all():
        return None
    i = tuple(int(k) for k in np.argwhere(~same)[0])
    return f"{name}{list(i)}: got {got[i]!r}, the reference gives {want[i]!r} (was {before[i]!r})"
