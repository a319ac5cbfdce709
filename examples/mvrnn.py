"""MV-RNN (Socher et al. 2012): every word has a vector and a matrix. A parent combines its
children (a, A) and (b, B) as p = tanh(W [B a; A b] + b_w) and P = W_M [A; B]."""

import generator as dg

VOCAB, HIDDEN = 500, 16
CLASSES = 5  # sentiment classes of the per-node labels (train=True)


@dg.model
def mvrnn(train: bool = False):
    trees = dg.trees("trees", arity=2)
    vectors = dg.param("vectors", (VOCAB, HIDDEN), init=dg.normal(0, 0.1))
    matrices = dg.param("matrices", (VOCAB, HIDDEN * HIDDEN), init=dg.normal(0, 0.1))
    w = dg.param("w", (2 * HIDDEN, HIDDEN))
    b_w = dg.param("b_w", (HIDDEN,), init=dg.zeros())
    w_m = dg.param("w_m", (2 * HIDDEN, HIDDEN))  # applied as [A; B]^T-stacked: P^T = [A^T B^T] W_M

    def leaf(words):
        vector = dg.gather(vectors, words)
        matrix = dg.reshape(dg.gather(matrices, words), (-1, HIDDEN, HIDDEN))
        return vector, matrix

    def matvec(m, v):  # per row: m [rows, H, H] times v [rows, H]
        return dg.sum(m * dg.reshape(v, (-1, 1, HIDDEN)), axis=2)

    def internal(words, children):
        (a, a_mat), (b, b_mat) = children
        p = dg.tanh(dg.concat([matvec(b_mat, a), matvec(a_mat, b)], axis=1) @ w + b_w)
        stacked = dg.concat([dg.transpose(a_mat, (0, 2, 1)), dg.transpose(b_mat, (0, 2, 1))], axis=2)
        p_mat = dg.transpose(stacked @ w_m, (0, 2, 1))  # = W_M-combination of A and B, [rows, H, H]
        return p, p_mat

    p, p_mat = dg.recurse(trees, leaf, internal, names=("p", "p_mat"))
    if train:  # per-node labels (SST-style: every node of every tree), -1 where a node has none
        labels = dg.input("labels", (p.shape[0],), dtype="int64")
        logits = dg.dense(p, CLASSES)
        dg.train(dg.softmax_cross_entropy(logits, labels, ignore_index=-1), dg.adam(lr=1e-3))
    return {"p": p, "root_p": dg.roots(trees, p)}
