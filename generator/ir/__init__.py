"""The intermediate representation every stage shares: the Graph of Nodes and
Values (graph.py), symbolic shapes (shapes.py), names (names.py) and the
readable printing of a graph (printing.py)."""
