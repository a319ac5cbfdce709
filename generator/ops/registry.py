"""The op registry: every op is declared once, as one OpDef, with all that the
pipeline needs to know about it.

- `infer`     shape and dtype rule: operand values + attrs -> [(dtype, shape)];
              raises ValueError with a message naming expected vs actual.
- `reference` the numpy implementation used by the reference interpreter.
- `lower`     the C++ statements that compute the node, as calls into the
              target's runtime (`dg::...`) or into printed kernels; the call
              names are the same for every target, only the runtime differs.
- `describe`  how `deepgen ir` prints the node.
- `grad`      adjoint rule (added with autodiff; None until then).

What the stages need to know about an op beyond that is a property or hook
here too, so that a new op needs no edit in the stages:

- `view`          the output is its operand's data under another shape (reshape):
                  lowering names a pointer instead of writing a buffer.
- `in_place`      the output may take the buffer of a same-shaped operand that dies
                  at this node (elementwise ops: each element read before written).
- `reads_views`   the op's lowering reads an operand that is a row-strided piece of
                  a larger buffer (a split's gate, LowerCtx.slice_view) in place,
                  and reads or writes a value whose rows a map places (a recursive
                  op's state, written in node order: the loop's row_maps, ops/recurse_scope.py).
- `reads_strided` the op's lowering reads a row-strided piece in place (slice_view),
                  but knows no row maps (transpose); `reads_views` implies it.
- `multi_output`  the node returns a list of outputs even when it has one (split),
                  and its grad rule takes None for an output nothing reads.
- `cse`           whether common-subexpression elimination may merge two equal nodes.
- `output_hints`  names of a multi-output node's outputs (batch norm: the result,
                  "mean", "invstd"): the assigned variable names the first, `<var>_<hint>` the rest.
- `updates_state` operand indices the op writes in place (batch norm's running
                  statistics, values of kind "state"): its one kind of side effect.
- `regions(node)` sub-graphs the node runs (a recursive op's cells): the passes
                  optimize each, `replace(node, old, new)` renames a value in them.
- `constant(node)`  the one value of the output of an op that makes a constant
                  tensor (fill), else None; `copy_of(node)` the operand that an op
                  which only copies it returns (x * 1), else None.
- `fold(node, consts)` constant folding: consts[i] is the value of operand i when it
                  is a `fill`, else None; returns the output's one value, or None.
- `id_limit(node, value)` for an integer input `value`: the ids the node needs it
                  to stay below (a table's rows, a class count), or None.
- `sample_inputs(node, rng, dims)` inputs the node needs made together (a batch of
                  trees), for recorded outputs and examples; {} by default.
- `products`      operand indices that are the factors of a product the op computes
                  (matmul's a and b, a convolution's x and w): `--precision bf16` rounds
                  them to bfloat16 before the op (transforms/precision.py).
- `packed_read(node)` the operand the node's lowering reads through the Model's kept
                  packing when that operand is a parameter (codegen/lower.py keeps_packed):
                  (index, tb, the [rows, cols] matrix it is read as or None), else None.
- `prepared_by_packing` for an op of one operand: the runtime function `f(x, y, n)` a
                  kept packing of that operand can apply as it packs it (`dg::round_bf16`):
                  where every reader reads the op's result through such a packing, the op
                  itself is lowered to nothing (the weight is rounded once per change).
- `kept_as`       with `prepared_by_packing`: (the Model member type that keeps a weight the
                  op prepares, {runtime function of a product: the function that reads
                  such a member, or two operands that are both the op's results, instead})
                  where the products have kernels of their own (`dg::KeptBf16Weight`;
                  `dg::matmul` -> `dg::matmul_bf16`, `dg::conv2d` -> `dg::conv2d_bf16`: bf16
                  instructions where the CPU has them); empty: a `dg::KeptPackedB` that
                  applies the function as it packs, and the products as they are.
- `rounds_on_read(node)` operand indices whose bf16 rounding the node's bf16 kernel does
                  as it reads them (dg::conv2d_bf16 converts its input as it copies it
                  channels last, dg::matmul_bf16 as it packs a's rows): transforms/rounding.py
                  then drops a `round_bf16` that only such reads read and sets the node's attr
                  `rounded` (those indices), which the reference applies and a lowering
                  without that kernel emits as a call (ops/precision.py read_rounded).
- `memory_note`   a line the memory report adds for a model that holds the op.
- `helpers(node)` module functions the bindings generate for it (trees from nested
                  Python tuples), as plain data.
"""

from __future__ import annotations

from ..ir.optable import REGISTRY, get_op  # the table this module fills, and its lookup


class OpDef:
    name = ""
    grad = None
    view = False
    in_place = False
    reads_views = False
    reads_strided = False
    multi_output = False
    moves_elements = False  # its outputs' elements are its inputs' (reshape, slice): ids keep their limit
    cse = True
    updates_state = ()
    output_hints = ()
    products = ()
    prepared_by_packing = ""
    kept_as = ()
    memory_note = ""

    def regions(self, node) -> list:
        """[(nodes, values the region must keep)] of the sub-graphs the node runs."""
        return []

    def replace(self, node, old, new) -> None:
        """Every read of `old` in the node's sub-graphs and attrs reads `new`."""

    def fold(self, node, consts):
        return None

    def packed_read(self, node):
        return None

    def rounds_on_read(self, node) -> tuple:
        return ()

    def constant(self, node):
        return None

    def copy_of(self, node):
        return None

    def id_limit(self, node, value):
        return None

    def sample_inputs(self, node, rng, dims, graph) -> dict:
        return {}

    def helpers(self, node) -> list:
        return []

    def infer(self, inputs, attrs):
        raise NotImplementedError

    def reference(self, args, attrs, dims):
        raise NotImplementedError

    def lower(self, node, ctx):
        raise NotImplementedError

    def describe(self, node) -> str:
        args = [v.name for v in node.inputs]
        args += [f"{k}={_fmt(v)}" for k, v in sorted(node.attrs.items())]
        return f"{self.name}({', '.join(args)})"


def _fmt(value) -> str:
    if isinstance(value, tuple):
        return "(" + ", ".join(str(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return str(value)


def register(cls):
    """Class decorator: add one instance of an OpDef subclass to the registry."""
    if cls.name in REGISTRY:
        raise RuntimeError(f"op {cls.name!r} registered twice")
    REGISTRY[cls.name] = cls()
    return cls


def id_limit(graph, value) -> int:
    """Ids for `value` must index every table it gathers from (labels: every class
    count): the least limit any node states for it (OpDef.id_limit), else 10."""
    limits = [get_op(n.op).id_limit(n, value) for n in graph.nodes]
    # Ids reshaped or sliced first (a tagger's [N, T] tags flattened for the loss) have the result's limit.
    limits += [id_limit(graph, out) for n in graph.nodes if get_op(n.op).moves_elements
               and any(v is value for v in n.inputs) for out in n.outputs]
    limits = [x for x in limits if x is not None]
    return min(limits) if limits else 10


def require_float(inputs, what="operand"):
    for i, v in enumerate(inputs):
        if v.dtype != "float32":
            raise ValueError(f"{what} {i} ('{v.name}') must be float32, got {v.dtype}")
