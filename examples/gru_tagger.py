"""A GRU tagger: a tag for every token of sentences of different lengths.

    python examples/gru_tagger.py   # generates, builds, trains on a synthetic task; prints the accuracy

The task (synthetic, seeded, no download): each token's tag is its class (the
id modulo 3) plus 3 when the token before it is from the upper half of the
vocabulary, so a tagger must remember the previous step. Tags past a sentence's
length are -1 and take no part in the loss. Parameters follow PyTorch's names
(`gru_weight_ih_l0` is nn.GRU's `weight_ih_l0`).
"""

import sys
from pathlib import Path

import numpy as np

import generator as dg

N, T = dg.dim("N"), dg.dim("T")
VOCAB, EMBED, TAGS = 40, 16, 6


@dg.model
def gru_tagger(hidden: int = 32, layers: int = 1, bidirectional: bool = False):
    tokens = dg.input("tokens", (N, T), dtype="int64")
    lengths = dg.input("lengths", (N,), dtype="int64")
    tags = dg.input("tags", (N, T), dtype="int64")  # -1 past each length
    x = dg.embedding(tokens, VOCAB, EMBED, name="embed")
    states, h_n = dg.gru(x, lengths, hidden, num_layers=layers, bidirectional=bidirectional, name="gru")
    logits = dg.dense(states, TAGS, name="tagger")  # [N, T, TAGS]
    flat = dg.reshape(logits, (N * T, TAGS))
    loss = dg.softmax_cross_entropy(flat, dg.reshape(tags, (N * T,)), ignore_index=-1)
    dg.train(loss, dg.adam(lr=0.01))
    return {"probs": dg.softmax(logits)}


def make_sentences(count: int, seed: int, longest: int = 20) -> dict:
    """`count` sentences of 3..longest tokens, padded; tags as the docstring says."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, longest + 1, count).astype(np.int64)
    tokens = rng.integers(0, VOCAB, (count, longest)).astype(np.int64)
    previous = np.concatenate([np.zeros((count, 1), np.int64), tokens[:, :-1]], axis=1)
    tags = tokens % 3 + 3 * (previous >= VOCAB // 2)
    tags[:, 0] = tokens[:, 0] % 3
    past = np.arange(longest)[None, :] >= lengths[:, None]
    tokens[past], tags[past] = 0, -1
    return {"tokens": tokens, "lengths": lengths, "tags": tags.astype(np.int64)}


def accuracy(model, data) -> float:
    probs = model.forward(tokens=data["tokens"], lengths=data["lengths"])["probs"]
    tagged = data["tags"] >= 0
    return float(np.mean(probs.argmax(axis=2)[tagged] == data["tags"][tagged]))


def train(module, epochs=10, batch=32, seed=0, log=print):
    """Train a fresh Model on 2000 sentences; returns the tag accuracy on 500 others."""
    train_set, test_set = make_sentences(2000, seed), make_sentences(500, seed + 1)
    model = module.Model(seed=seed)
    rng = np.random.default_rng(seed)
    for epoch in range(epochs):
        order = rng.permutation(len(train_set["lengths"]))
        losses = [model.train_step(**{k: v[order[start : start + batch]] for k, v in train_set.items()})
                  for start in range(0, len(order), batch)]
        log(f"epoch {epoch + 1:2d}  loss {np.mean(losses):.4f}")
    result = accuracy(model, test_set)
    log(f"held-out tag accuracy {result:.4f} on {int((test_set['tags'] >= 0).sum())} tokens")
    return result


def main():
    from generator.pipeline import generate
    from generator.tools.build import build_project

    here = Path(__file__).resolve().parent
    project = here.parent / "build" / "gru_tagger"
    generate(gru_tagger.build(), project, force=True)
    build_project(project, target_dir=project / "site")
    sys.path.insert(0, str(project / "site"))
    import gru_tagger as module  # noqa: E402  (the module just built)

    train(module)


if __name__ == "__main__":
    main()
