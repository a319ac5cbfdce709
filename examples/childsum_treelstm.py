"""Child-sum TreeLSTM (Tai et al. 2015) for dependency trees: every node has a word, and up to
ARITY children whose states are summed (their order does not matter), each with its own forget gate.

The input projection W x of internal nodes does not depend on the children: deepgen hoists it out
of the level loop and computes it for all internal nodes at once.
"""

import generator as dg

VOCAB, EMBED, HIDDEN, ARITY = 1000, 64, 128, 4
CLASSES = 5  # sentiment classes of the per-node labels (train=True)


@dg.model
def childsum_treelstm(train: bool = False):
    trees = dg.trees("trees", arity=ARITY)
    emb = dg.param("emb", (VOCAB, EMBED), init=dg.normal(0, 0.1))
    w = dg.param("w", (EMBED, 4 * HIDDEN))  # i, o, u, f from the node's word
    b = dg.param("b", (4 * HIDDEN,), init=dg.zeros())
    u_iou = dg.param("u_iou", (HIDDEN, 3 * HIDDEN))  # i, o, u from the children's summed h
    u_f = dg.param("u_f", (HIDDEN, HIDDEN))  # a forget gate per child

    def leaf(words):
        wx = dg.gather(emb, words) @ w + b
        i, o, g, _ = dg.split(wx, 4, axis=1)
        c = dg.sigmoid(i) * dg.tanh(g)
        return dg.sigmoid(o) * dg.tanh(c), c

    def internal(words, children):
        wx = dg.gather(emb, words) @ w + b  # hoisted: no children involved
        x_iou, x_f = dg.split(wx, [3 * HIDDEN, HIDDEN], axis=1)
        h_sum = children[0][0]
        for h_k, _ in children[1:]:
            h_sum = h_sum + h_k
        i, o, g = dg.split(x_iou + h_sum @ u_iou, 3, axis=1)
        c = dg.sigmoid(i) * dg.tanh(g)
        for h_k, c_k in children:  # empty slots have h_k = c_k = 0: no contribution
            c = c + dg.sigmoid(x_f + h_k @ u_f) * c_k
        return dg.sigmoid(o) * dg.tanh(c), c

    h, c = dg.recurse(trees, leaf, internal, names=("h", "c"))
    if train:  # per-node labels (SST-style: every node of every tree), -1 where a node has none
        labels = dg.input("labels", (h.shape[0],), dtype="int64")
        logits = dg.dense(h, CLASSES)
        dg.train(dg.softmax_cross_entropy(logits, labels, ignore_index=-1), dg.adam(lr=1e-3))
    return {"h": h, "root_h": dg.roots(trees, h)}
