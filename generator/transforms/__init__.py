"""Stages optimize and differentiate: Graph -> Graph functions (passes.py) and
the symbolic backward pass (autodiff.py).

Loading the package registers the differentiator of a recursion's cells with the
recursive op's grad rule (cell_grad.py: ops import nothing above them)."""

from . import cell_grad  # noqa: F401  (registers itself: ops/recurse.py, register_cell_grad)
