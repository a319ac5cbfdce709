"""Binary TreeLSTM (Tai et al. 2015, N-ary form with N = 2) over a batch of parse trees.

Leaves read a word embedding; an internal node combines its left and right
children's (h, c) with a forget gate per child. deepgen runs all leaves as one
batched step and then one step per tree level (see the generated src/model.cpp).
"""

import generator as dg

VOCAB, EMBED, HIDDEN = 1000, 128, 256
CLASSES = 5  # sentiment classes of the per-node labels (train=True)


def treelstm_model(hidden: int = HIDDEN, name: str = "treelstm"):
    """The model at a given hidden size (benchmarks/treelstm.py builds 256 and 512)."""

    @dg.model(name=name)
    def treelstm(train: bool = False):
        trees = dg.trees("trees", arity=2)
        emb = dg.param("emb", (VOCAB, EMBED), init=dg.normal(0, 0.1))
        w_leaf = dg.param("w_leaf", (EMBED, 3 * hidden))  # input, output and update gates of a leaf
        b_leaf = dg.param("b_leaf", (3 * hidden,), init=dg.zeros())
        u = dg.param("u", (2 * hidden, 5 * hidden))  # i, o, u, f_left, f_right from both children
        b = dg.param("b", (5 * hidden,), init=dg.zeros())

        def leaf(words):
            x = dg.gather(emb, words)
            i, o, g = dg.split(x @ w_leaf + b_leaf, 3, axis=1)
            c = dg.sigmoid(i) * dg.tanh(g)
            h = dg.sigmoid(o) * dg.tanh(c)
            return h, c

        def internal(words, children):
            (h_l, c_l), (h_r, c_r) = children
            gates = dg.concat([h_l, h_r], axis=1) @ u + b
            i, o, g, f_l, f_r = dg.split(gates, 5, axis=1)
            c = dg.sigmoid(i) * dg.tanh(g) + dg.sigmoid(f_l) * c_l + dg.sigmoid(f_r) * c_r
            h = dg.sigmoid(o) * dg.tanh(c)
            return h, c

        h, c = dg.recurse(trees, leaf, internal, names=("h", "c"))
        root_h = dg.roots(trees, h)
        if train:  # per-node labels (SST-style: every node of every tree), -1 where a node has none
            labels = dg.input("labels", (h.shape[0],), dtype="int64")
            logits = dg.dense(h, CLASSES)
            dg.train(dg.softmax_cross_entropy(logits, labels, ignore_index=-1), dg.adam(lr=1e-3))
        return {"h": h, "root_h": root_h}

    return treelstm


treelstm = treelstm_model()
