"""Stages optimize and differentiate: Graph -> Graph functions (passes.py) and
the symbolic backward pass (autodiff.py)."""
