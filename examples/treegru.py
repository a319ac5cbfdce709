"""TreeGRU over binary parse trees: a GRU-style update of the mean of the children's states."""

import generator as dg

VOCAB, EMBED, HIDDEN = 1000, 64, 128
CLASSES = 5  # sentiment classes of the per-node labels (train=True)


@dg.model
def treegru(train: bool = False):
    trees = dg.trees("trees", arity=2)
    emb = dg.param("emb", (VOCAB, EMBED), init=dg.normal(0, 0.1))
    w_leaf = dg.param("w_leaf", (EMBED, HIDDEN))
    u_zr = dg.param("u_zr", (2 * HIDDEN, 3 * HIDDEN))  # update gate z, reset gates r_left, r_right
    u_h = dg.param("u_h", (2 * HIDDEN, HIDDEN))
    b = dg.param("b", (3 * HIDDEN,), init=dg.zeros())

    def leaf(words):
        return (dg.tanh(dg.gather(emb, words) @ w_leaf),)

    def internal(words, children):
        ((h_l,), (h_r,)) = children
        both = dg.concat([h_l, h_r], axis=1)
        z, r_l, r_r = dg.split(dg.sigmoid(both @ u_zr + b), 3, axis=1)
        candidate = dg.tanh(dg.concat([r_l * h_l, r_r * h_r], axis=1) @ u_h)
        h = z * (h_l + h_r) * 0.5 + (1 - z) * candidate
        return (h,)

    h = dg.recurse(trees, leaf, internal, names=("h",))
    if train:  # per-node labels (SST-style: every node of every tree), -1 where a node has none
        labels = dg.input("labels", (h.shape[0],), dtype="int64")
        logits = dg.dense(h, CLASSES)
        dg.train(dg.softmax_cross_entropy(logits, labels, ignore_index=-1), dg.adam(lr=1e-3))
    return {"h": h, "root_h": dg.roots(trees, h)}
