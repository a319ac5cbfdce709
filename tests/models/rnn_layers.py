"""dg.lstm / dg.gru layers on their own, and a scan with a hand-written cell, for
tests/test_sequences.py. The loss weighs every output so that every step's and
every final state's gradient matters."""

import generator as dg

N, T = dg.dim("N"), dg.dim("T")
FEATURES, HIDDEN = 5, 7


@dg.model
def rnn_layers(kind: str = "lstm", layers: int = 1, bidirectional: bool = False):
    x = dg.input("x", (N, T, FEATURES))
    lengths = dg.input("lengths", (N,), dtype="int64")
    weights = dg.input("weights", (N, T, (2 if bidirectional else 1) * HIDDEN))  # the loss's weights
    if kind == "lstm":
        states, (h_n, c_n) = dg.lstm(x, lengths, HIDDEN, num_layers=layers, bidirectional=bidirectional, name="rnn")
        result = {"states": states, "h_n": h_n, "c_n": c_n}
        finals = dg.sum(h_n) + dg.sum(dg.square(c_n))
    else:
        states, h_n = dg.gru(x, lengths, HIDDEN, num_layers=layers, bidirectional=bidirectional, name="rnn")
        result = {"states": states, "h_n": h_n}
        finals = dg.sum(dg.square(h_n))
    dg.train(dg.sum(states * weights) + finals, dg.sgd(lr=0.1))
    return result


@dg.model
def two_input_scan(reverse: bool = False):
    """An Elman cell over two input sequences with a [2, 3] state: exercises
    several inputs, a state of rank 2 and the backward direction."""
    a = dg.input("a", (N, T, 4))
    b = dg.input("b", (N, T, 3))
    lengths = dg.input("lengths", (N,), dtype="int64")
    wa = dg.param("wa", (4, 6), init=dg.normal(0, 0.5))
    wb = dg.param("wb", (3, 6), init=dg.normal(0, 0.5))
    u = dg.param("u", (6, 6), init=dg.normal(0, 0.5))
    bias = dg.param("bias", (6,), init=dg.normal(0, 0.1))

    def step(a_t, b_t, prev):
        flat = dg.reshape(prev, (prev.shape[0], 6))
        h = dg.tanh(a_t @ wa + b_t @ wb + flat @ u + bias)
        return dg.reshape(h, (h.shape[0], 2, 3))

    states, last = dg.scan(step, [a, b], lengths, state=(2, 3), reverse=reverse, names=["h"])
    dg.train(dg.sum(dg.square(states)) + dg.sum(last), dg.sgd(lr=0.1))
    return {"states": states, "last": last}
