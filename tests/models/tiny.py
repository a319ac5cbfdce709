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


@dg.model
def tiny_train():
    # Trainable: the golden file of a train_step (momentum SGD, weight decay).
    x = dg.input("x", (N, 3))
    labels = dg.input("labels", (N,), dtype="int64")
    h = dg.dense(x, 4, act=dg.relu)
    logits = dg.dense(h, 2)
    dg.train(dg.softmax_cross_entropy(logits, labels), dg.sgd(lr=0.1, momentum=0.9), weight_decay=1e-4)
    return {"logits": logits}


@dg.model
def tiny_tree():
    # Recursive: the golden file of a level loop (leaf block, hoisted work, level body).
    trees = dg.trees("trees", arity=2)
    emb = dg.param("emb", (10, 4), init=dg.normal(0, 0.1))
    w = dg.param("w", (8, 4))

    def leaf(words):
        return (dg.gather(emb, words),)

    def internal(words, children):
        ((h_l,), (h_r,)) = children
        return (dg.tanh(dg.concat([h_l, h_r], axis=1) @ w),)

    h = dg.recurse(trees, leaf, internal, names=("h",))
    return {"root_h": dg.roots(trees, h)}
