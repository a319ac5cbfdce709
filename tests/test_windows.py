"""The DSL's pad, roll, strided slices and window tables (frontend/windows.py): bad arguments
are errors that name the problem and the user's line. Values and gradients are checked in
the op table (tests/op_cases.py: pad_constant, roll, slice_step, shifted_window_mask, ...)."""

from __future__ import annotations

import pytest

import generator as dg
from generator.errors import DeepgenError

N = dg.dim("N")


def _build(body):
    @dg.model
    def net():
        return body(dg.input("x", (N, 4, 6)))

    return net.build()


@pytest.mark.parametrize("body, message", [
    (lambda x: dg.pad(x, (1, 1), mode="reflect"), "mode='reflect' is not supported"),
    (lambda x: dg.pad(x, (1, 1, 0)), r"pads \(1, 1, 0\) must be \(before, after\) pairs"),
    (lambda x: dg.pad(x, (1.5, 0)), "each pad must be an int, got 1.5"),
    (lambda x: dg.roll(x, 1, 0), r"roll along the symbolic axis 0 \(N\)"),
    (lambda x: dg.roll(x, (1, 2), (1,)), "2 shifts for 1 dims"),
    (lambda x: x[:, ::-1], "a slice step must be an int >= 1, got -1"),
    (lambda x: x[:, 5:1:2], "is empty"),
    (lambda x: x[::2], "step 2 of the symbolic axis 0"),
    (lambda x: x + dg.shifted_window_mask((4, 6), (3, 3), (1, 1)), "windows 3x3 must tile the map 4x6"),
    (lambda x: x + dg.shifted_window_mask((4, 6), (2, 3), (2, 1)), r"the shift \(2, 1\) be smaller"),
    (lambda x: x + dg.relative_coords_table((1, 3)), "window must be an int >= 2"),
], ids=["pad_mode", "pad_pairs", "pad_float", "roll_symbolic", "roll_counts", "step_negative", "step_empty",
        "step_symbolic", "mask_tiling", "mask_shift", "coords_window"])
def test_bad_arguments_name_the_problem_and_the_line(body, message):
    with pytest.raises(DeepgenError, match=message) as e:
        _build(body)
    assert "test_windows.py" in str(e.value)  # the user's line


def test_strided_slice_past_the_end_keeps_python_semantics():
    """x[:, 1::4] of 4 rows keeps row 1 and of 6 columns 0 and 5 (the zero padding that completes the last step is
    never picked), as Python's slicing does."""
    import numpy as np

    from generator.reference import interpreter as reference

    graph = _build(lambda x: x[:, 1::4, 0:6:5])
    x = np.arange(2 * 4 * 6, dtype=np.float32).reshape(2, 4, 6)
    (got,) = reference.run(graph, {"x": x}).values()
    np.testing.assert_array_equal(got, x[:, 1::4, 0:6:5])
