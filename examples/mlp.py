"""A multilayer perceptron for 28x28 images: x[N, 784] -> 512 relu -> 256 relu -> 10 logits."""

import generator as dg

N = dg.dim("N")  # batch size: a run-time size, one build serves every N


@dg.model
def mlp():
    x = dg.input("x", (N, 784))
    h1 = dg.dense(x, 512, act=dg.relu)
    h2 = dg.dense(h1, 256, act=dg.relu)
    logits = dg.dense(h2, 10)
    return {"logits": logits}
