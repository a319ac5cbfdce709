"""Bad input on the Python side gives clear errors, never a crash or silent garbage.

Every model error must name the user's file and line, the op, and the expected
versus actual shapes. User strings that become identifiers are rejected when
they are explicit names and made safe when they are inferred from variable names.

Lines are located with marker comments (`# @marker` at the end of a line), so the
tests stay correct when lines move.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import sympy

import generator as dg
from generator.tools.cli import main
from generator.errors import DeepgenError, ModelError, ShapeError
from generator.ir.names import problem_with

N = dg.dim("N")
M = dg.dim("M")

THIS_FILE = os.path.abspath(__file__)
BASENAME = os.path.basename(THIS_FILE)


# -- helpers -------------------------------------------------------------------


def line_of(marker: str, path: str = THIS_FILE) -> int:
    """The line that ends with the comment `# @marker` (exactly one must)."""
    with open(path, encoding="utf-8") as f:
        hits = [i for i, text in enumerate(f, 1) if text.rstrip().endswith(f"# @{marker}")]
    assert len(hits) == 1, f"marker @{marker} found on lines {hits}"
    return hits[0]


def where(marker: str) -> str:
    return f"{BASENAME}:{line_of(marker)}"


def names_line(msg: str, line: int, basename: str = BASENAME) -> bool:
    """`msg` names basename:line (and not, say, basename:line0)."""
    return re.search(rf"{re.escape(basename)}:{line}(?!\d)", msg) is not None


def names_any_line(msg: str, lines) -> bool:
    return any(names_line(msg, n) for n in lines)


def _without_source(err) -> str:
    """The message without the quoted source line (which may spell the op by chance)."""
    msg = str(err)
    loc = getattr(err, "loc", None)
    if loc is not None and getattr(loc, "text", ""):
        msg = msg.replace(f"\n    {loc.text}", "")
    return msg


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def expect(excinfo, marker: str, op: str | None = None, shapes=(), parts=()):
    """The error names this file and the marker's line, the op, every shape in
    `shapes` (compared without spaces, so [N, 4] and [N,4] both match), and
    every string in `parts`."""
    msg = str(excinfo.value)
    assert isinstance(excinfo.value, DeepgenError), msg
    assert names_line(msg, line_of(marker)), f"expected {where(marker)} in:\n{msg}"
    if op is not None:
        assert op in _without_source(excinfo.value), f"expected the op {op!r} in:\n{msg}"
    for shape in shapes:
        assert _squash(shape) in _squash(msg), f"expected shape {shape} in:\n{msg}"
    for part in parts:
        assert part in msg, f"expected {part!r} in:\n{msg}"
    return msg


# -- shape inference -------------------------------------------------------------


def test_matmul_inner_dimension_mismatch():
    @dg.model
    def net():
        x = dg.input("feats", (N, 4))
        w = dg.param("w", (5, 3))
        return x @ w  # @matmul_inner

    with pytest.raises(ShapeError) as e:
        net.build()
    expect(e, "matmul_inner", "matmul", shapes=["[N, 4]", "[5, 3]"], parts=["feats", "'w'"])


def test_matmul_function_inner_dimension_mismatch():
    @dg.model
    def net():
        x = dg.input("feats", (N, 7))
        w = dg.param("w", (6, 2))
        y = dg.matmul(x, w)  # @matmul_fn
        return y

    with pytest.raises(ShapeError) as e:
        net.build()
    expect(e, "matmul_fn", "matmul", shapes=["[N, 7]", "[6, 2]"])


@pytest.mark.parametrize("wshape", [(4,), (2, 4, 3)], ids=["1d", "3d"])
def test_matmul_b_must_be_2d(wshape):
    @dg.model
    def net():
        x = dg.input("feats", (N, 4))
        w = dg.param("w", wshape)
        return dg.matmul(x, w)  # @matmul_rank

    with pytest.raises(ShapeError) as e:
        net.build()
    expect(e, "matmul_rank", "matmul", shapes=["[N, 4]", "[" + ", ".join(map(str, wshape)) + "]"])


def test_add_broadcast_mismatch_concrete():
    @dg.model
    def net():
        x = dg.input("feats", (N, 4))
        y = dg.input("other", (N, 5))
        return x + y  # @add_concrete

    with pytest.raises(ShapeError) as e:
        net.build()
    expect(e, "add_concrete", "add", shapes=["[N, 4]", "[N, 5]"])


def test_add_broadcast_symbolic_vs_concrete():
    """N against 3 is an error: the model must be valid for every N."""

    @dg.model
    def net():
        x = dg.input("feats", (N, 4))
        y = dg.input("other", (3, 4))
        z = dg.add(x, y)  # @add_symbolic
        return z

    with pytest.raises(ShapeError) as e:
        net.build()
    msg = expect(e, "add_symbolic", "add", shapes=["[N, 4]", "[3, 4]"])
    assert "N vs 3" in msg or "3 vs N" in msg, msg


def test_add_two_symbolic_dims_do_not_broadcast():
    @dg.model
    def net():
        x = dg.input("feats", (N, 4))
        y = dg.input("other", (M, 4))
        return x + y  # @add_two_dims

    with pytest.raises(ShapeError) as e:
        net.build()
    expect(e, "add_two_dims", "add", shapes=["[N, 4]", "[M, 4]"])


def test_reshape_wrong_element_count():
    @dg.model
    def net():
        x = dg.input("feats", (N, 4))
        return dg.reshape(x, (N, 5))  # @reshape_count

    with pytest.raises(ShapeError) as e:
        net.build()
    expect(e, "reshape_count", "reshape", shapes=["[N, 4]", "[N, 5]"])


def test_reshape_concrete_wrong_element_count():
    @dg.model
    def net():
        x = dg.input("feats", (N, 2, 3))
        return dg.reshape(x, (N, 7))  # @reshape_count_concrete

    with pytest.raises(ShapeError) as e:
        net.build()
    expect(e, "reshape_count_concrete", "reshape", shapes=["[N, 2, 3]", "[N, 7]"])


@pytest.mark.parametrize(
    "shape, target",
    [((N, 6), (-1, 4)), ((2, 6), (-1, 5))],
    ids=["symbolic", "concrete"],
)
def test_reshape_minus_one_not_divisible(shape, target):
    """A shape mismatch, so a ShapeError like every other reshape mismatch."""

    @dg.model
    def net():
        x = dg.input("feats", shape)
        return dg.reshape(x, target)  # @reshape_minus_one

    with pytest.raises(ShapeError) as e:
        net.build()
    expect(e, "reshape_minus_one", "reshape", shapes=["[" + ", ".join(map(str, shape)) + "]"], parts=["-1"])


def test_reshape_two_minus_ones():
    @dg.model
    def net():
        x = dg.input("feats", (N, 6))
        return dg.reshape(x, (-1, -1))  # @reshape_two

    with pytest.raises(ModelError) as e:
        net.build()
    expect(e, "reshape_two", "reshape", parts=["-1"])


def test_concat_mismatch_outside_axis():
    @dg.model
    def net():
        x = dg.input("feats", (N, 4))
        y = dg.input("other", (3, 5))
        return dg.concat([x, y], axis=1)  # @concat_outside

    with pytest.raises(ShapeError) as e:
        net.build()
    expect(e, "concat_outside", "concat", shapes=["[N, 4]", "[3, 5]"], parts=["axis 1"])


def test_concat_rank_mismatch():
    @dg.model
    def net():
        x = dg.input("feats", (N, 4))
        y = dg.input("other", (N, 5, 2))
        return dg.concat([x, y], axis=1)  # @concat_rank

    with pytest.raises(ShapeError) as e:
        net.build()
    expect(e, "concat_rank", "concat", shapes=["[N, 4]", "[N, 5, 2]"])


def test_concat_dtype_mismatch():
    @dg.model
    def net():
        x = dg.input("feats", (N, 4))
        y = dg.input("ids", (N, 4), dtype="int32")
        return dg.concat([x, y], axis=1)  # @concat_dtype

    with pytest.raises(ShapeError) as e:
        net.build()
    expect(e, "concat_dtype", "concat", parts=["float32", "int32"])


def test_split_sizes_do_not_add_up():
    """The error names the sizes, their total, and the split tensor's shape."""

    @dg.model
    def net():
        x = dg.input("feats", (N, 10))
        a, b = dg.split(x, [3, 4], axis=1)  # @split_sizes
        return a + 1, b + 1

    with pytest.raises(ShapeError) as e:
        net.build()
    expect(e, "split_sizes", "split", shapes=["[3, 4]", "[N, 10]"], parts=["7", "10"])


def test_split_into_unequal_pieces():
    @dg.model
    def net():
        x = dg.input("feats", (N, 10))
        a, b, c = dg.split(x, 3, axis=1)  # @split_equal
        return a, b, c

    with pytest.raises(ShapeError) as e:
        net.build()
    expect(e, "split_equal", "split", shapes=["[N, 10]"], parts=["3"])


def test_slice_symbolic_start_past_the_end():
    @dg.model
    def net():
        x = dg.input("feats", (N, 4))
        return x[N + 1 :]  # @slice_symbolic

    with pytest.raises(ShapeError) as e:
        net.build()
    expect(e, "slice_symbolic", "slice", shapes=["[N, 4]"])


def test_slice_concrete_out_of_range():
    """x[:, 5:7] of an axis of size 4 is out of range: an error, not a silently
    empty [N, 0] tensor."""

    @dg.model
    def net():
        x = dg.input("feats", (N, 4))
        return x[:, 5:7]  # @slice_concrete

    with pytest.raises(ShapeError) as e:
        net.build()
    expect(e, "slice_concrete", "slice", shapes=["[N, 4]"], parts=["5"])


def test_slice_axis_stop_out_of_range():
    @dg.model
    def net():
        x = dg.input("feats", (N, 4))
        return dg.slice_axis(x, 1, 1, 6)  # @slice_axis_stop

    with pytest.raises(ShapeError) as e:
        net.build()
    expect(e, "slice_axis_stop", "slice", shapes=["[N, 4]"], parts=["6"])


def test_slice_axis_out_of_range():
    @dg.model
    def net():
        x = dg.input("feats", (N, 4))
        return dg.slice_axis(x, 2, 0, 1)  # @slice_bad_axis

    with pytest.raises(ModelError) as e:
        net.build()
    expect(e, "slice_bad_axis", "slice", parts=["2"])


def test_indexing_with_an_int_is_rejected():
    @dg.model
    def net():
        x = dg.input("feats", (N, 4))
        return x[:, 0]  # @index_int

    with pytest.raises(ModelError) as e:
        net.build()
    expect(e, "index_int", "slice")


def test_slice_step_below_one_is_rejected():
    """Strided slices take a step >= 1 (x[:, ::2] is Swin's patch merging); a reversed one is an error."""
    @dg.model
    def net():
        x = dg.input("feats", (N, 4))
        return x[:, ::-1]  # @slice_step

    with pytest.raises(ModelError) as e:
        net.build()
    expect(e, "slice_step", "slice", parts=["step"])


def test_softmax_axis_out_of_range():
    """An axis beyond the rank is a shape error; it names the tensor's shape."""

    @dg.model
    def net():
        x = dg.input("feats", (N, 4))
        return dg.softmax(x, axis=2)  # @softmax_axis

    with pytest.raises(ShapeError) as e:
        net.build()
    expect(e, "softmax_axis", "softmax", shapes=["[N, 4]"], parts=["axis 2"])


@pytest.mark.parametrize("axis", [-3, 2, (0, 5)], ids=["neg", "pos", "tuple"])
def test_sum_axis_out_of_range(axis):
    @dg.model
    def net():
        x = dg.input("feats", (N, 4))
        return dg.sum(x, axis=axis)  # @sum_axis

    with pytest.raises(ShapeError) as e:
        net.build()
    expect(e, "sum_axis", "sum", shapes=["[N, 4]"])


def test_sum_axis_not_an_int():
    @dg.model
    def net():
        x = dg.input("feats", (N, 4))
        return dg.sum(x, axis="1")  # @sum_axis_str

    with pytest.raises(ModelError) as e:
        net.build()
    expect(e, "sum_axis_str", "sum")


def test_transpose_bad_perm():
    @dg.model
    def net():
        x = dg.input("feats", (N, 4))
        return dg.transpose(x, (0, 0))  # @transpose_perm

    with pytest.raises(ShapeError) as e:
        net.build()
    expect(e, "transpose_perm", "transpose", shapes=["[N, 4]"])


def test_gather_with_float_ids():
    @dg.model
    def net():
        ids = dg.input("ids", (N,))
        table = dg.param("table", (10, 3))
        return dg.gather(table, ids)  # @gather_float

    with pytest.raises(ShapeError) as e:
        net.build()
    expect(e, "gather_float", "gather", parts=["ids", "float32", "int32"])


def test_embedding_with_float_ids():
    @dg.model
    def net():
        ids = dg.input("ids", (N,))
        emb = dg.embedding(ids, 10, 3)  # @embedding_float
        return emb

    with pytest.raises(ShapeError) as e:
        net.build()
    expect(e, "embedding_float", "gather", parts=["ids", "float32"])


@pytest.mark.parametrize("how", ["relu", "mul", "radd", "custom"])
def test_elementwise_on_int_tensor(how):
    mish = dg.elementwise(lambda x: x * sympy.tanh(x), "mish")

    def apply(ids):
        if how == "relu":
            return dg.relu(ids)  # @ewise_int_relu
        if how == "mul":
            return ids * 2  # @ewise_int_mul
        if how == "radd":
            return 1.5 + ids  # @ewise_int_radd
        return mish(ids)  # @ewise_int_custom

    @dg.model
    def net():
        ids = dg.input("ids", (N,), dtype="int32")
        return apply(ids)

    with pytest.raises(ShapeError) as e:
        net.build()
    op = {"relu": "relu", "mul": "mul", "radd": "add", "custom": "mish"}[how]
    expect(e, f"ewise_int_{how}", op, parts=["ids", "int32", "float32"])


def test_matmul_on_int_tensor():
    @dg.model
    def net():
        ids = dg.input("ids", (N, 4), dtype="int64")
        w = dg.param("w", (4, 3))
        return ids @ w  # @matmul_int

    with pytest.raises(ShapeError) as e:
        net.build()
    expect(e, "matmul_int", "matmul", parts=["ids", "int64"])


def test_operand_that_is_not_a_tensor():
    @dg.model
    def net():
        x = dg.input("feats", (N, 4))
        return dg.add(x, "1")  # @ewise_str

    with pytest.raises(ModelError) as e:
        net.build()
    expect(e, "ewise_str", "add")


def test_dense_on_symbolic_last_dim():
    @dg.model
    def net():
        x = dg.input("feats", (4, N))
        h = dg.dense(x, 8)  # @dense_symbolic
        return h

    with pytest.raises(ModelError) as e:
        net.build()
    expect(e, "dense_symbolic", "dense", shapes=["[4, N]"])


@pytest.mark.parametrize("units", [0, -3, 2.5])
def test_dense_bad_units(units):
    @dg.model
    def net():
        x = dg.input("feats", (N, 4))
        h = dg.dense(x, units)  # @dense_units
        return h

    with pytest.raises(ModelError) as e:
        net.build()
    expect(e, "dense_units", "dense", parts=[repr(units)])


def test_dense_unknown_activation():
    @dg.model
    def net():
        x = dg.input("feats", (N, 4))
        h = dg.dense(x, 8, act="nope")  # @dense_act
        return h

    with pytest.raises(ModelError) as e:
        net.build()
    expect(e, "dense_act", "dense", parts=["'nope'", "relu"])


def test_errors_name_the_line_inside_a_helper_function():
    """A DSL call in a user helper is reported at the helper's line."""

    def block(x, units):
        return dg.matmul(x, dg.param("blk_w", (units + 1, units)))  # @helper_line

    @dg.model
    def net():
        x = dg.input("feats", (N, 4))
        return block(x, 4)

    with pytest.raises(ShapeError) as e:
        net.build()
    expect(e, "helper_line", "matmul", shapes=["[N, 4]", "[5, 4]"])


def test_error_attributes():
    @dg.model
    def net():
        x = dg.input("feats", (N, 4))
        return x @ dg.param("w", (5, 3))  # @attrs_line

    with pytest.raises(ShapeError) as e:
        net.build()
    err = e.value
    assert err.loc.line == line_of("attrs_line")
    assert os.path.basename(err.loc.filename) == BASENAME
    assert err.op == "matmul"
    assert "x @ dg.param" in str(err)  # the line's text is quoted


# -- declarations: shapes and dtypes ---------------------------------------------


@pytest.mark.parametrize("shape", [(-1, 4), (N, -4)], ids=["first", "last"])
def test_input_negative_dim(shape):
    """A negative size is rejected, not carried into the graph as f32[-1, 4]."""

    @dg.model
    def net():
        x = dg.input("feats", shape)  # @input_negative
        return x + 0

    with pytest.raises(ModelError) as e:
        net.build()
    expect(e, "input_negative", "input", shapes=["[" + ", ".join(map(str, shape)) + "]"])


def test_param_negative_dim():
    @dg.model
    def net():
        x = dg.input("feats", (N, 4))
        w = dg.param("w", (4, -3))  # @param_negative
        return x @ w

    with pytest.raises(ModelError) as e:
        net.build()
    expect(e, "param_negative", "param", parts=["-3"])


def test_input_float_dim():
    @dg.model
    def net():
        x = dg.input("feats", (N, 4.0))  # @input_float_dim
        return x + 0

    with pytest.raises(ModelError) as e:
        net.build()
    expect(e, "input_float_dim", "input", parts=["4.0"])


def test_input_bad_dtype():
    @dg.model
    def net():
        x = dg.input("feats", (N, 4), dtype="float64")  # @input_dtype
        return x + 0

    with pytest.raises(ModelError) as e:
        net.build()
    expect(e, "input_dtype", "input", parts=["float64", "float32"])


def test_input_without_shape():
    @dg.model
    def net():
        x = dg.input("feats")  # @input_no_shape
        return x + 0

    with pytest.raises(ModelError) as e:
        net.build()
    expect(e, "input_no_shape", "input", parts=["shape"])


def test_input_dim_that_is_an_expression():
    @dg.model
    def net():
        x = dg.input("feats", (N + 1, 4))  # @input_expr_dim
        return x + 0

    with pytest.raises(ModelError) as e:
        net.build()
    expect(e, "input_expr_dim", parts=["N + 1", "feats"])


@pytest.mark.parametrize("shape", [(N, 4), N, (3, M)], ids=["tuple", "bare", "second"])
def test_param_with_symbolic_shape(shape):
    @dg.model
    def net():
        x = dg.input("feats", (N, 4))
        w = dg.param("w", shape)  # @param_symbolic
        return x, w

    with pytest.raises(ModelError) as e:
        net.build()
    expect(e, "param_symbolic", "param", parts=["concrete"])


def test_param_bad_init():
    @dg.model
    def net():
        w = dg.param("w", (4, 3), init=0.5)  # @param_init
        return w + 0

    with pytest.raises(ModelError) as e:
        net.build()
    expect(e, "param_init", "param", parts=["0.5"])


@pytest.mark.parametrize("seed", [-1, 1.5, "7"])
def test_param_bad_seed(seed):
    @dg.model
    def net():
        w = dg.param("w", (4, 3), seed=seed)  # @param_seed
        return w + 0

    with pytest.raises(ModelError) as e:
        net.build()
    expect(e, "param_seed", "param", parts=[repr(seed)])


def test_dim_used_by_no_input():
    @dg.model
    def net():
        x = dg.input("feats", (N, 4))
        y = dg.reshape(x, (M, 4 * N / M))  # @unbound_dim
        return y

    with pytest.raises(ModelError) as e:
        net.build()
    expect(e, "unbound_dim", parts=["M"])


# -- names -----------------------------------------------------------------------

INVALID_NAMES = ['x; system("rm")', "../a", "1x", "_x", "ñ", "名前", "a-b", "x y", "a\nb", ""]
# Keywords of C++ or Python and macros of the headers the generated C++ includes (#38:
# names the generated code uses itself, Model, std, out, int32_t, are a user's to take).
RESERVED_NAMES = ["float", "class", "new", "def", "NULL", "assert", "stdin", "INT32_MAX"]


def _use_name(kind, name):
    """One DSL call that takes `name` explicitly; each on its own marked line."""
    x = dg.input("feats", (N, 4))
    if kind == "input":
        return dg.input(name, (N, 4))  # @name_input
    if kind == "param":
        return dg.param(name, (4, 3))  # @name_param
    if kind == "node":
        return dg.relu(x, name=name)  # @name_node
    if kind == "dense":
        return dg.dense(x, 3, name=name)  # @name_dense
    if kind == "embedding":
        ids = dg.input("ids", (N,), dtype="int32")
        return dg.embedding(ids, 10, 3, name=name)  # @name_embedding
    raise AssertionError(kind)


_NAME_OPS = {"input": "input", "param": "param", "node": "relu", "dense": "dense", "embedding": "embedding"}


@pytest.mark.parametrize("kind", ["input", "param", "node", "dense"])
@pytest.mark.parametrize("bad", INVALID_NAMES)
def test_explicit_invalid_name_rejected(kind, bad):
    @dg.model
    def net():
        return _use_name(kind, bad)

    with pytest.raises(ModelError) as e:
        net.build()
    msg = expect(e, f"name_{kind}", _NAME_OPS[kind])
    assert repr(bad) in msg or (bad and bad in msg), msg


@pytest.mark.parametrize("bad", ['x; system("rm")', "../a", "_x"])
def test_explicit_invalid_embedding_name_rejected(bad):
    """The error is reported for the embedding call the user wrote (its op and
    name), not as a `param` error about a derived name like '../a_table'."""

    @dg.model
    def net():
        return _use_name("embedding", bad)

    with pytest.raises(ModelError) as e:
        net.build()
    msg = expect(e, "name_embedding", "embedding")
    assert repr(bad) in msg, msg


@pytest.mark.parametrize("kind", ["input", "param", "node"])
@pytest.mark.parametrize("bad", RESERVED_NAMES)
def test_explicit_reserved_name_rejected(kind, bad):
    @dg.model
    def net():
        return _use_name(kind, bad)

    with pytest.raises(ModelError) as e:
        net.build()
    msg = expect(e, f"name_{kind}", _NAME_OPS[kind], parts=[repr(bad)])
    assert "reserved" in msg, msg


@pytest.mark.parametrize("kind", ["dense", "embedding"])
@pytest.mark.parametrize("bad", RESERVED_NAMES)
def test_reserved_base_name_rejected_or_made_safe(kind, bad):
    """A dense/embedding `name=` is a base for parameter names (float_w); either
    rejecting it or producing safe names is fine, garbage is not."""

    @dg.model
    def net():
        return _use_name(kind, bad)

    try:
        graph = net.build()
    except ModelError as e:
        assert names_line(str(e), line_of(f"name_{kind}")), str(e)
        assert repr(bad) in str(e), str(e)
    else:
        _assert_safe(graph)


def _declare_twice(case):
    if case == "input-input":
        a = dg.input("x", (N, 4))
        b = dg.input("x", (N, 4))  # @dup_input_input
    elif case == "input-param":
        a = dg.input("x", (N, 4))
        b = dg.param("x", (4, 4))  # @dup_input_param
    elif case == "param-param":
        a = dg.param("w", (4, 4))
        b = dg.param("w", (4, 4))  # @dup_param_param
    elif case == "node-input":
        a = dg.input("x", (N, 4))
        b = dg.relu(a, name="x")  # @dup_node_input
    elif case == "node-node":
        a = dg.relu(dg.input("x", (N, 4)), name="h")
        b = dg.sigmoid(a, name="h")  # @dup_node_node
    elif case == "dense-dense":
        a = dg.dense(dg.input("x", (N, 4)), 4, name="fc")
        b = dg.dense(a, 4, name="fc")  # @dup_dense_dense
    elif case == "input-dim":
        a = dg.input("x", (N, 4))
        b = dg.input("N", (N, 4))  # @dup_input_dim
    else:
        raise AssertionError(case)
    return a, b


@pytest.mark.parametrize(
    "case", ["input-input", "input-param", "param-param", "node-input", "node-node", "dense-dense", "input-dim"]
)
def test_duplicate_explicit_names(case):
    @dg.model
    def net():
        return _declare_twice(case)

    with pytest.raises(ModelError) as e:
        net.build()
    msg = expect(e, "dup_" + case.replace("-", "_"))
    assert "already used" in msg, msg


def test_duplicate_output_names():
    @dg.model  # @dup_out2_decorator
    def net2():
        x = dg.input("x", (N, 4))
        y = dg.relu(x, name="y")
        return [y, y]  # @dup_out2_return

    with pytest.raises(ModelError) as e:
        net2.build()
    msg = str(e.value)
    assert "'y'" in msg and "twice" in msg, msg
    assert names_any_line(msg, range(line_of("dup_out2_decorator"), line_of("dup_out2_return") + 1)), msg


def test_dsl_call_outside_a_model():
    with pytest.raises(ModelError) as e:
        dg.input("x", (N, 4))  # @outside_input
    expect(e, "outside_input", parts=["@dg.model"])


def test_op_outside_a_model():
    leaked = []

    @dg.model
    def leaky():
        x = dg.input("x", (N, 4))
        leaked.append(x)
        return x + 0

    leaky.build()
    with pytest.raises(ModelError) as e:
        dg.relu(leaked[0])  # @outside_relu
    expect(e, "outside_relu", parts=["@dg.model"])


def _returning(kind):
    x = dg.input("x", (N, 4))
    return {
        "none": None,
        "int": 3,
        "str": "x",
        "ndarray-like": [[1.0, 2.0]],
        "empty": [],
        "empty-dict": {},
        "set": {x},
    }[kind]


@pytest.mark.parametrize("kind", ["none", "int", "str", "ndarray-like", "empty", "empty-dict", "set"])
def test_model_returning_no_tensor(kind):
    @dg.model  # @ret_decorator
    def net():
        return _returning(kind)  # @ret_return

    with pytest.raises(ModelError) as e:
        net.build()
    msg = str(e.value)
    assert names_any_line(msg, range(line_of("ret_decorator"), line_of("ret_return") + 1)), msg


def test_model_without_return():
    @dg.model  # @noret_decorator
    def net():
        x = dg.input("x", (N, 4))
        dg.relu(x)  # @noret_last

    with pytest.raises(ModelError) as e:
        net.build()
    msg = str(e.value)
    assert names_any_line(msg, range(line_of("noret_decorator"), line_of("noret_last") + 2)), msg
    assert "NoneType" in msg or "None" in msg or "return" in msg, msg


def test_output_list_with_non_tensor_names_the_position():
    @dg.model
    def net():
        x = dg.input("x", (N, 4))
        return [x + 1, 3]

    with pytest.raises(ModelError) as e:
        net.build()
    msg = str(e.value)
    assert BASENAME in msg and "int" in msg, msg
    # The message says which output is wrong: index 1 (the second one).
    assert re.search(r"\b1\b", e.value.detail), f"which output? {msg}"


# ("Model" is a name like any other since #38: test_names.py holds that.)
@pytest.mark.parametrize("key", ["a b", "1x", "_x", "../a", 'x; system("rm")', "float", "class", 3])
def test_output_key_not_an_identifier(key):
    @dg.model  # @outkey_decorator
    def net():
        x = dg.input("x", (N, 4))
        return {key: x + 1}  # @outkey_return

    with pytest.raises(ModelError) as e:
        net.build()
    msg = str(e.value)
    assert names_any_line(msg, range(line_of("outkey_decorator"), line_of("outkey_return") + 1)), msg
    assert repr(key) in msg or str(key) in msg or type(key).__name__ in msg, msg


@pytest.mark.parametrize("bad", ['x; system("rm")', "../a", "1N", "_N", "float", "NULL"])
def test_dim_bad_name_rejected(bad):
    with pytest.raises((DeepgenError, ValueError)) as e:
        dg.dim(bad)
    assert repr(bad) in str(e.value) or bad in str(e.value)


@pytest.mark.parametrize("bad", ['x; system("rm")', "../a", "1f", "_f", "float", "NULL"])
def test_elementwise_bad_name_rejected(bad):
    with pytest.raises((DeepgenError, ValueError)) as e:
        dg.elementwise(lambda x: x * 2, bad)
    assert repr(bad) in str(e.value) or bad in str(e.value)


@pytest.mark.parametrize("name", ["../a", 'x; system("rm")'])
def test_model_name_rejected_by_build(name):
    """The model name becomes a folder, a C++ namespace and a Python module; the
    Python API rejects a bad one just as `deepgen generate --name` does."""

    @dg.model(name=name)
    def net():
        return dg.relu(dg.input("x", (N, 4)))

    with pytest.raises(DeepgenError) as e:
        net.build()
    assert name in str(e.value)
    ok = dg.model(lambda: dg.relu(dg.input("x", (N, 4))), name="fine")
    with pytest.raises(DeepgenError):
        ok.build(name=name)


def _all_names(graph):
    return [v.name for v in graph.values()] + [name for name, _ in graph.outputs]


def _assert_safe(graph):
    names = [v.name for v in graph.values()]
    for name in _all_names(graph):
        assert problem_with(name) is None, f"{name!r}: {problem_with(name)}"
    assert len(names) == len(set(names)), names


def test_inferred_names_that_are_reserved_become_safe():
    @dg.model
    def net():
        x = dg.input("x", (N, 4))
        new = dg.relu(x)
        int = dg.sigmoid(new)  # noqa: A001
        Model = int * 2  # noqa: N806
        std = Model + 1
        delete = dg.tanh(std)
        out = delete - 1
        return out

    graph = net.build()
    _assert_safe(graph)
    names = {v.name for v in graph.values()}
    assert not names & {"new", "int", "delete"}, names
    assert {"Model", "std", "out"} <= names, names  # not keywords: the user's names, kept (#38)


def test_inferred_input_and_param_names_that_are_reserved_become_safe():
    @dg.model
    def net():
        float = dg.input((N, 4))  # noqa: A001
        class_ = dg.input((N, 4))
        double = dg.param((4, 4))
        std = (float + class_) @ double
        return std

    graph = net.build()
    _assert_safe(graph)
    assert {v.name for v in graph.inputs} >= {"class_"}
    assert "float" not in {v.name for v in graph.inputs}


def test_inferred_names_with_underscores_and_unicode_become_safe():
    @dg.model
    def net():
        x = dg.input("x", (N, 4))
        _h = dg.relu(x)
        __ = dg.sigmoid(_h)
        ñ = __ * 2
        größe = ñ + 1
        return größe

    _assert_safe(net.build())


def test_inferred_names_that_clash_get_suffixes():
    @dg.model
    def net():
        x = dg.input("x", (N, 4))
        h = dg.relu(x)
        h = dg.relu(h)
        h = dg.relu(h)
        relu = dg.relu(h)
        return relu

    graph = net.build()
    _assert_safe(graph)


@pytest.mark.parametrize("var", ["_h", "ñ", "new", "h"])
def test_dense_and_embedding_with_inferred_base_names_become_safe(var, tmp_path):
    """`_h = dg.dense(x, 3)`: the parameter names come from the variable, so
    they are inferred names and must be made safe rather than rejected. (The DSL
    reads variable names from the source, so the model is written to a file.)"""
    from generator.frontend.loader import load_model

    path = tmp_path / "model_var.py"
    path.write_text(
        "import generator as dg\n"
        "N = dg.dim('N')\n\n\n"
        "@dg.model\n"
        "def net():\n"
        "    x = dg.input('x', (N, 4))\n"
        "    ids = dg.input('ids', (N,), dtype='int32')\n"
        f"    {var} = dg.dense(x, 3)\n"
        f"    {var}_emb = dg.embedding(ids, 10, 3)\n"
        f"    return {var}, {var}_emb\n",
        encoding="utf-8",
    )
    graph = load_model(str(path)).build()
    _assert_safe(graph)
    assert len(graph.params) == 3


def test_dense_reusing_a_variable_name():
    """`x = dg.dense(x, ...)` twice is ordinary Keras-style code; the inferred
    parameter names must not clash (x_w, then x_w_1 or similar)."""

    @dg.model
    def net():
        x = dg.input("x", (N, 4))
        x = dg.dense(x, 8, act=dg.relu)
        x = dg.dense(x, 2)
        return x

    graph = net.build()
    _assert_safe(graph)
    assert len(graph.params) == 4


def _custom(kind):
    return {
        "str": lambda x: "abc",
        "none": lambda x: None,
        "list": lambda x: [x],
        "relational": lambda x: x > 0,
        "object": lambda x: object(),
        "foreign-symbol": lambda x: x + sympy.Symbol("y"),
        "raises": lambda x: 1 / 0,
        "bool": lambda x: True,
        "float()": lambda x: float(x),
        "tuple": lambda x: (x, x),
    }[kind]


@pytest.mark.parametrize(
    "kind", ["str", "none", "list", "relational", "object", "foreign-symbol", "raises", "bool", "float()", "tuple"]
)
def test_user_elementwise_returning_non_sympy(kind):
    fn = dg.elementwise(_custom(kind), "myfn")

    @dg.model
    def net():
        x = dg.input("x", (N, 4))
        return fn(x)  # @custom_ewise

    with pytest.raises(ModelError) as e:
        net.build()
    expect(e, "custom_ewise", "myfn")


def test_user_elementwise_wrong_arity():
    fn = dg.elementwise(lambda a, b: a * b, "prod")

    @dg.model
    def net():
        x = dg.input("x", (N, 4))
        return fn(x)  # @custom_arity

    with pytest.raises(ModelError) as e:
        net.build()
    expect(e, "custom_arity", "prod")


# -- loader and CLI ----------------------------------------------------------------

GOOD_MODEL = """\
import generator as dg

N = dg.dim("N")


@dg.model
def net():
    x = dg.input("x", (N, 4))
    return {"y": dg.relu(x)}
"""

TWO_MODELS = """\
import generator as dg

N = dg.dim("N")


@dg.model
def first():
    return dg.relu(dg.input("x", (N, 4)))


@dg.model
def second():
    return dg.sigmoid(dg.input("x", (N, 4)))
"""

SHAPE_ERROR = """\
import generator as dg

N = dg.dim("N")


@dg.model
def net():
    x = dg.input("x", (N, 4))
    w = dg.param("w", (5, 3))
    y = x @ w  # line 10
    return y
"""


def cli(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _assert_cli_error(rc, err, cmd, *parts):
    assert rc == 1, err
    assert err.startswith(f"deepgen {cmd}: error: "), err
    assert "Traceback" not in err, err
    for part in parts:
        assert part in err, f"expected {part!r} in:\n{err}"


@pytest.mark.parametrize("cmd", ["check", "ir"])
def test_cli_missing_model_file(cmd, tmp_path, capsys):
    missing = tmp_path / "nope.py"
    rc, _, err = cli(capsys, cmd, missing)
    _assert_cli_error(rc, err, cmd, "not found", "nope.py")
    rc, _, err = cli(capsys, cmd, f"{missing}:net")
    _assert_cli_error(rc, err, cmd, "not found", "nope.py")


def test_cli_missing_model_file_generate(tmp_path, capsys):
    out = tmp_path / "out"
    rc, _, err = cli(capsys, "generate", tmp_path / "nope.py", "-o", out)
    _assert_cli_error(rc, err, "generate", "not found")
    assert not out.exists()


def test_cli_file_without_model(tmp_path, capsys):
    path = tmp_path / "plain.py"
    path.write_text("import generator as dg\nx = 1\n")
    rc, _, err = cli(capsys, "check", path)
    _assert_cli_error(rc, err, "check", "plain.py", "@dg.model")


def test_cli_two_models_without_name(tmp_path, capsys):
    path = tmp_path / "two.py"
    path.write_text(TWO_MODELS)
    rc, _, err = cli(capsys, "check", path)
    _assert_cli_error(rc, err, "check", "first", "second", ":NAME")
    rc, out, err = cli(capsys, "check", f"{path}:second")
    assert rc == 0, err
    assert "second" in out


def test_cli_unknown_model_name(tmp_path, capsys):
    path = tmp_path / "two.py"
    path.write_text(TWO_MODELS)
    rc, _, err = cli(capsys, "check", f"{path}:third")
    _assert_cli_error(rc, err, "check", "'third'", "first", "second")


@pytest.mark.parametrize("name", ["../a", 'x; system("rm")', "float", "1net", "a/b"])
def test_cli_generate_rejects_bad_project_name(name, tmp_path, capsys):
    path = tmp_path / "good.py"
    path.write_text(GOOD_MODEL)
    out = tmp_path / "out"
    before = sorted(p.name for p in tmp_path.iterdir())
    rc, stdout, err = cli(capsys, "generate", path, "-o", out, "--name", name)
    _assert_cli_error(rc, err, "generate", name)
    assert not out.exists(), "nothing may be written for a rejected name"
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert not (tmp_path.parent / "a").exists()
    assert stdout == ""


@pytest.mark.parametrize("cmd", ["check", "ir"])
def test_cli_shape_error_names_file_and_line(cmd, tmp_path, capsys):
    path = tmp_path / "broken.py"
    path.write_text(SHAPE_ERROR)
    line = next(i for i, t in enumerate(SHAPE_ERROR.splitlines(), 1) if "# line 10" in t)
    rc, _, err = cli(capsys, cmd, path)
    _assert_cli_error(rc, err, cmd, f"broken.py:{line}", "matmul", "[N, 4]", "[5, 3]")


def test_cli_shape_error_generate_writes_nothing(tmp_path, capsys):
    path = tmp_path / "broken.py"
    path.write_text(SHAPE_ERROR)
    out = tmp_path / "out"
    rc, _, err = cli(capsys, "generate", path, "-o", out)
    _assert_cli_error(rc, err, "generate", "broken.py:10", "matmul")
    assert not out.exists()


def test_cli_model_function_name_is_checked(tmp_path, capsys):
    path = tmp_path / "named.py"
    path.write_text(GOOD_MODEL.replace("@dg.model\n", '@dg.model(name="../evil")\n'))
    rc, _, err = cli(capsys, "check", path)
    _assert_cli_error(rc, err, "check", "../evil")


@pytest.mark.parametrize(
    "line",
    ['N = dg.dim("1N")', "N = dg.dim('x; system(\"rm\")')", 'f = dg.elementwise(lambda x: x, "../a")'],
    ids=["dim-digit", "dim-injection", "elementwise-path"],
)
def test_cli_bad_name_at_module_level(line, tmp_path, capsys):
    """A bad name in a module-level dg.dim / dg.elementwise is a user error: the
    CLI reports it (with the file and line), it does not crash with a traceback."""
    path = tmp_path / "modlevel.py"
    path.write_text(GOOD_MODEL.replace('N = dg.dim("N")', 'N = dg.dim("N")\n' + line))
    rc, _, err = cli(capsys, "check", path)
    _assert_cli_error(rc, err, "check", "modlevel.py:4")


def test_cli_model_function_with_parameters(tmp_path, capsys):
    """@dg.model on a function that needs arguments: a clear error, not a TypeError traceback."""
    path = tmp_path / "args.py"
    path.write_text(GOOD_MODEL.replace("def net():", "def net(width):"))
    rc, _, err = cli(capsys, "check", path)
    _assert_cli_error(rc, err, "check", "net", "args.py")


def test_cli_syntax_error_in_model_file(tmp_path, capsys):
    path = tmp_path / "syntax.py"
    path.write_text("import generator as dg\n\n@dg.model\ndef net(:\n    pass\n")
    rc, _, err = cli(capsys, "check", path)
    _assert_cli_error(rc, err, "check", "syntax.py", "4")


def test_cli_good_model_checks(tmp_path, capsys):
    path = tmp_path / "good.py"
    path.write_text(GOOD_MODEL)
    rc, out, err = cli(capsys, "check", path)
    assert rc == 0, err
    assert "output y: f32[N, 4]" in out


@pytest.mark.parametrize("argv, part", [
    (["ir", "{mlp}", "--after", "nosuch"], "unknown stage or pass 'nosuch' (choose from optimize,"),
    (["ir", "{mlp}", "--after", ""], "unknown stage or pass ''"),
    (["memory", "{mlp}", "--batch", "-3"], "argument --batch: -3 is not a size (at least 1)"),
    (["memory", "{mlp}", "--batch", "x"], "argument --batch: 'x' is not an integer"),
    (["generate", "{mlp}", "-o", ""], "argument -o/--output: an empty path"),
])
def test_cli_rejects_bad_arguments_before_running(argv, part, capsys):
    """Argument errors are argparse's usage errors (exit 2), never an internal error."""
    mlp = str(Path(__file__).resolve().parents[1] / "examples" / "mlp.py")
    with pytest.raises(SystemExit) as e:
        main([a.format(mlp=mlp) for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and part in err, err


@pytest.mark.parametrize("argv, parts", [
    (["memory", "{mlp}", "--budget", "e"], ["cannot read the budget 'e'"]),
    (["memory", "{mlp}", "--budget", "1e400"], ["cannot read the budget '1e400'"]),
    (["memory", "{mlp}", "--budget", "0"], ["the budget '0' is not a positive number of bytes"]),
    (["memory", "{mlp}", "--dim", "N=0"], ["--dim 'N=0': expected NAME=INT (INT at least 1)"]),
    (["ir", "{mlp}", "--grad", "--after", "lower"], ["--grad with --after lower"]),
    (["check", ":mlp"], ["no model file named"]),
    (["check", "{folder}"], ["is a folder; name the model file in it"]),
])
def test_cli_bad_values_are_one_line_errors(argv, parts, capsys):
    examples = Path(__file__).resolve().parents[1] / "examples"
    rc, _, err = cli(capsys, *[a.format(mlp=examples / "mlp.py", folder=examples) for a in argv])
    _assert_cli_error(rc, err, argv[0], *parts)
