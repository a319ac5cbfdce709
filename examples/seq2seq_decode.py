"""A GRU encoder-decoder that reverses digit strings, decoding greedily until each
string's end token with dg.while_loop.

    python examples/seq2seq_decode.py   # generates, builds, trains; prints the held-out exact match

The task (synthetic, seeded, no download): a string of 2..5 digits in, the same
digits reversed and then EOS out. The encoder is a GRU over the source digits; its
last state, the context, goes to every step of the decoder, a GRU cell written
once below (`decoder_step`) that training runs over the target with teacher
forcing (dg.scan) and decoding runs in a while loop: each example feeds back its
own best token until it emits EOS (or MAX_STEPS), so examples stop at different
steps and the loop stops when no example is still decoding.
"""

import sys
from pathlib import Path

import numpy as np

import generator as dg

N, S = dg.dim("N"), dg.dim("S")
DIGITS, BOS, EOS = 10, 10, 11  # tokens 0..9 are digits
VOCAB, EMBED = 12, 16
SHORTEST, LONGEST = 2, 5
MAX_STEPS = LONGEST + 1  # the digits and EOS
T = MAX_STEPS  # targets are padded to it


@dg.model
def seq2seq_decode(hidden: int = 96, compact=None):
    # compact: the while loop's rule (None; docs/ARCHITECTURE.md), or True (compaction) / False
    # (masking) to compare them (benchmarks/control_flow.py builds both).
    source = dg.input("source", (N, S), dtype="int64")  # digits, padded with 0
    source_lengths = dg.input("source_lengths", (N,), dtype="int64")
    target_in = dg.input("target_in", (N, T), dtype="int64")  # BOS, then the reversed digits
    target_lengths = dg.input("target_lengths", (N,), dtype="int64")
    target = dg.input("target", (N, T), dtype="int64")  # the reversed digits, then EOS; -1 past
    embed = dg.param("embed", (VOCAB, EMBED), init=dg.normal(0.0, 1.0), seed=1)
    _, encoded = dg.gru(dg.gather(embed, source), source_lengths, hidden, name="encoder")
    context = dg.reshape(encoded, (N, hidden))

    # The decoder's GRU cell (gates r, z, n as torch.nn.GRUCell), its input the token's embedding and the context.
    bound = 1.0 / hidden**0.5
    w_ih = dg.param("decoder_w_ih", (EMBED + hidden, 3 * hidden), init=dg.uniform(-bound, bound), seed=2)
    w_hh = dg.param("decoder_w_hh", (hidden, 3 * hidden), init=dg.uniform(-bound, bound), seed=3)
    b_ih = dg.param("decoder_b_ih", (3 * hidden,), init=dg.uniform(-bound, bound), seed=4)
    b_hh = dg.param("decoder_b_hh", (3 * hidden,), init=dg.uniform(-bound, bound), seed=5)
    out_w = dg.param("out_w", (hidden, VOCAB), init=dg.uniform(-bound, bound), seed=6)
    out_b = dg.param("out_b", (VOCAB,), init=dg.zeros(), seed=7)

    def decoder_step(token_embedding, context_t, h):
        x = dg.concat([token_embedding, context_t], axis=1)
        r_x, z_x, n_x = dg.split(x @ w_ih + b_ih, 3, axis=1)
        r_h, z_h, n_h = dg.split(h @ w_hh + b_hh, 3, axis=1)
        r, z = dg.sigmoid(r_x + r_h), dg.sigmoid(z_x + z_h)
        n = dg.tanh(n_x + r * n_h)
        return (1.0 - z) * n + z * h

    # Training: teacher forcing, every target step at once per time step.
    every_context = dg.expand(dg.reshape(context, (N, 1, hidden)), (N, T, hidden))
    states, _ = dg.scan(decoder_step, [dg.gather(embed, target_in), every_context], target_lengths, state=hidden,
                        names=["h"])
    logits = dg.reshape(states, (N * T, hidden)) @ out_w + out_b
    dg.train(dg.softmax_cross_entropy(logits, dg.reshape(target, (N * T,)), ignore_index=-1), dg.adam(lr=0.005))

    # Decoding: greedy, each example until it emits EOS.
    def still_decoding(s):
        _, token, _ = s
        return dg.sum(dg.slice_axis(token, 1, EOS, EOS + 1), 1) < 0.5

    def decode_step(s):
        h, token, context = s
        h = decoder_step(token @ embed, context, h)
        scores = h @ out_w + out_b
        best = dg.cast(scores >= dg.max(scores, 1, keepdims=True), "float32")  # one-hot of the best token
        return h, best, context

    ones = dg.expand(dg.reshape(dg.cast(source_lengths >= 0, "float32"), (N, 1)), (N, VOCAB))
    bos = dg.cast(dg.cumsum(ones, 1) == float(BOS + 1), "float32")  # one-hot of BOS per example
    _, steps, (_, tokens, _) = dg.while_loop(still_decoding, decode_step, (context * 0.0, bos, context), MAX_STEPS,
                                             outputs=True, names=("h", "token", "context"), compact=compact)
    return {"tokens": tokens, "steps": steps}


def make_strings(count: int, seed: int) -> dict:
    """`count` digit strings of SHORTEST..LONGEST digits and their reversals, padded."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(SHORTEST, LONGEST + 1, count).astype(np.int64)
    source = np.zeros((count, LONGEST), np.int64)
    target_in = np.zeros((count, MAX_STEPS), np.int64)
    target = np.full((count, MAX_STEPS), -1, np.int64)
    for i, n in enumerate(lengths):
        digits = rng.integers(0, DIGITS, n)
        source[i, :n] = digits
        target_in[i, : n + 1] = [BOS, *digits[::-1]]
        target[i, : n + 1] = [*digits[::-1], EOS]
    return {"source": source, "source_lengths": lengths, "target_in": target_in, "target_lengths": lengths + 1,
            "target": target}


def decoded(outputs) -> list:
    """Each example's tokens, the loop's outputs read up to its step count."""
    return [list(t[:n].argmax(axis=1)) for t, n in zip(outputs["tokens"], outputs["steps"])]


def exact_match(model, data) -> float:
    got = decoded(model.forward(source=data["source"], source_lengths=data["source_lengths"]))
    want = [list(t[t >= 0]) for t in data["target"]]
    return float(np.mean([g == w for g, w in zip(got, want)]))


def train(module, epochs=12, batch=64, seed=0, log=print):
    """Train a fresh Model on 4000 strings (Adam, its learning rate times 0.8 after each
    epoch of the second half); returns (the model, its exact match on 500 others)."""
    train_set, test_set = make_strings(4000, seed), make_strings(500, seed + 1)
    model = module.Model(seed=seed)
    rng = np.random.default_rng(seed)
    for epoch in range(epochs):
        order = rng.permutation(len(train_set["source"]))
        losses = [model.train_step(**{k: v[order[start : start + batch]] for k, v in train_set.items()})
                  for start in range(0, len(order), batch)]
        if epoch >= epochs // 2:
            model.lr = model.lr * 0.8
        log(f"epoch {epoch + 1:2d}  loss {np.mean(losses):.4f}")
    result = exact_match(model, test_set)
    log(f"held-out exact match {result:.4f} on {len(test_set['source'])} strings")
    return model, result


def main():
    from generator.pipeline import generate
    from generator.tools.build import build_project

    here = Path(__file__).resolve().parent
    project = here.parent / "build" / "seq2seq_decode"
    generate(seq2seq_decode.build(), project, force=True)
    build_project(project, target_dir=project / "site")
    sys.path.insert(0, str(project / "site"))
    import seq2seq_decode as module  # noqa: E402  (the module just built)

    train(module)


if __name__ == "__main__":
    main()
