"""DAG-RNN: a node of a directed acyclic graph may have several parents; its state is computed
once, after all its children, and read by every parent. h = tanh(W x + U sum(children h) + b)."""

import generator as dg

VOCAB, EMBED, HIDDEN, ARITY = 1000, 64, 96, 3
CLASSES = 5  # sentiment classes of the per-node labels (train=True)


@dg.model
def dagrnn(train: bool = False):
    dag = dg.trees("dag", arity=ARITY, dag=True)
    emb = dg.param("emb", (VOCAB, EMBED), init=dg.normal(0, 0.1))
    w = dg.param("w", (EMBED, HIDDEN))
    u = dg.param("u", (HIDDEN, HIDDEN))
    b = dg.param("b", (HIDDEN,), init=dg.zeros())

    def leaf(words):
        return (dg.tanh(dg.gather(emb, words) @ w + b),)

    def internal(words, children):
        total = children[0][0]
        for (h_k,) in children[1:]:
            total = total + h_k
        return (dg.tanh(dg.gather(emb, words) @ w + total @ u + b),)

    h = dg.recurse(dag, leaf, internal, names=("h",))
    if train:  # per-node labels (SST-style: every node of every tree), -1 where a node has none
        labels = dg.input("labels", (h.shape[0],), dtype="int64")
        logits = dg.dense(h, CLASSES)
        dg.train(dg.softmax_cross_entropy(logits, labels, ignore_index=-1), dg.adam(lr=1e-3))
    return {"h": h, "root_h": dg.roots(dag, h)}
