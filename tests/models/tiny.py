"""A tiny model for golden-file and hand-edit tests: x[N, 3] -> 4 relu -> 2."""

import generator as dg

N = dg.dim("N")


@dg.model
def tiny():
    x = dg.input("x", (N, 3))
    h = dg.dense(x, 4, act=dg.relu)
    y = dg.dense(h, 2)
    return {"y": y}


@dg.model
def tiny_tanh():
    # The same network with tanh: the oracle for the hand-edit test.
    x = dg.input("x", (N, 3))
    h = dg.dense(x, 4, act=dg.tanh)
    y = dg.dense(h, 2)
    return {"y": y}
