"""TreeRNN (TreeFC): h = tanh(W [h_left; h_right] + b), leaves from a word embedding."""

import generator as dg

VOCAB, HIDDEN = 1000, 128
CLASSES = 5  # sentiment classes of the per-node labels (train=True)


@dg.model
def treernn(train: bool = False):
    trees = dg.trees("trees", arity=2)
    emb = dg.param("emb", (VOCAB, HIDDEN), init=dg.normal(0, 0.1))
    w = dg.param("w", (2 * HIDDEN, HIDDEN))
    b = dg.param("b", (HIDDEN,), init=dg.zeros())

    def leaf(words):
        return (dg.gather(emb, words),)

    def internal(words, children):
        ((h_l,), (h_r,)) = children
        return (dg.tanh(dg.concat([h_l, h_r], axis=1) @ w + b),)

    h = dg.recurse(trees, leaf, internal, names=("h",))
    if train:  # per-node labels (SST-style: every node of every tree), -1 where a node has none
        labels = dg.input("labels", (h.shape[0],), dtype="int64")
        logits = dg.dense(h, CLASSES)
        dg.train(dg.softmax_cross_entropy(logits, labels, ignore_index=-1), dg.adam(lr=1e-3))
    return {"h": h, "root_h": dg.roots(trees, h)}
