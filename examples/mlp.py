"""A multilayer perceptron for 28x28 images: x[N, 784] -> 512 relu -> 256 relu -> 10 logits,
trained with softmax cross-entropy and SGD with momentum."""

import generator as dg

N = dg.dim("N")  # batch size: a run-time size, one build serves every N


@dg.model
def mlp(precision: str = "fp32"):
    x = dg.input("x", (N, 784))
    labels = dg.input("labels", (N,), dtype="int64")  # only train_step needs these
    h1 = dg.dense(x, 512, act=dg.relu)
    h2 = dg.dense(h1, 256, act=dg.relu)
    logits = dg.dense(h2, 10)
    loss = dg.softmax_cross_entropy(logits, labels)
    dg.train(loss, dg.sgd(lr=0.05, momentum=0.9), precision=precision)  # precision=bf16: bf16 products
    return {"logits": logits}
