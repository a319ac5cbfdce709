"""The independent oracle: a numpy interpreter of the graph (interpreter.py),
the sample inputs it runs on (samples.py) and the Python twin of the generated
code's random initialization (rng.py)."""
