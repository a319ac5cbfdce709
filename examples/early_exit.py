"""A small BERT-style encoder with a classifier after each layer, whose examples leave
the encoder as soon as their classifier is sure (Berxit / DeeBERT early exit).

    python examples/early_exit.py   # generates, builds, trains; prints the exit layers and accuracies

The task (synthetic, seeded, no download): a [CLS] token and seven words, each
positive, negative, neutral or "not"; "not" turns the sentiment of the word after it.
The class is the sign of the sentence's sentiment (never 0). Sentences without "not"
are easy (their words' counts decide); a "not" needs a token to read the word before
it, and the [CLS] token to gather that, more layers.

After each encoder layer a classifier reads the [CLS] token. Training runs every layer
on every example and adds the classifiers' losses (the joint training of Berxit and
DeeBERT). Inference: after layer k, the examples whose prediction's entropy is under
`threshold` exit, keeping layer k's logits; the next layer is a dg.cond over the
examples still running, one batched block of their rows, and those that exited are
only carried along (docs/ARCHITECTURE.md, "dg.cond compacts"). A threshold of 0 runs
every layer on every example (an entropy is never below 0): train_step takes it so.

Parameter names are the state_dict keys of the PyTorch twin (an nn.Embedding per
table, nn.LayerNorm, nn.TransformerEncoderLayer(batch_first=True, activation="gelu")
per layer, an nn.Linear classifier per layer) with dots as underscores.
"""

import math
import sys
from pathlib import Path

import numpy as np

import generator as dg

N = dg.dim("N")
CLS, NOT = 0, 1
POSITIVE, NEGATIVE, NEUTRAL = (2, 3, 4), (5, 6, 7), (8, 9, 10, 11)
VOCAB, WORDS, CLASSES = 12, 7, 2
T = WORDS + 1  # [CLS] and the words


@dg.model
def early_exit(layers: int = 3, hidden: int = 32, heads: int = 2, ffn: int = 64):
    tokens = dg.input("tokens", (N, T), dtype="int64")
    threshold = dg.input("threshold", (1,))  # in nats: an example exits once its entropy is under it
    labels = dg.input("labels", (N,), dtype="int64")
    word = dg.param("embeddings_word_embeddings_weight", (VOCAB, hidden), init=dg.normal(0.0, 1.0))
    position = dg.param("embeddings_position_embeddings_weight", (T, hidden), init=dg.normal(0.0, 1.0))
    norm = (
        dg.param("embeddings_norm_weight", (hidden,), init=dg.ones()),
        dg.param("embeddings_norm_bias", (hidden,), init=dg.zeros()),
    )

    def fan_in(n):  # nn.Linear's default: uniform in +-1/sqrt(fan_in)
        return dg.uniform(-1 / math.sqrt(n), 1 / math.sqrt(n))

    xavier = math.sqrt(6.0 / (4 * hidden))
    shapes = {  # nn.TransformerEncoderLayer's parameters and their initializers
        "self_attn_in_proj_weight": ((3 * hidden, hidden), dg.uniform(-xavier, xavier)),
        "self_attn_in_proj_bias": ((3 * hidden,), dg.zeros()),
        "self_attn_out_proj_weight": ((hidden, hidden), fan_in(hidden)),
        "self_attn_out_proj_bias": ((hidden,), dg.zeros()),
        "linear1_weight": ((ffn, hidden), fan_in(hidden)),
        "linear1_bias": ((ffn,), fan_in(hidden)),
        "linear2_weight": ((hidden, ffn), fan_in(ffn)),
        "linear2_bias": ((hidden,), fan_in(ffn)),
        "norm1_weight": ((hidden,), dg.ones()),
        "norm1_bias": ((hidden,), dg.zeros()),
        "norm2_weight": ((hidden,), dg.ones()),
        "norm2_bias": ((hidden,), dg.zeros()),
    }
    encoder = [
        {
            key: dg.param(f"encoder_layers_{i}_{key}", shape, init=init)
            for key, (shape, init) in shapes.items()
        }
        for i in range(layers)
    ]
    classifiers = [
        (
            dg.param(f"classifiers_{i}_weight", (CLASSES, hidden), init=fan_in(hidden)),
            dg.param(f"classifiers_{i}_bias", (CLASSES,), init=fan_in(hidden)),
        )
        for i in range(layers)
    ]

    def encoder_layer(p, x):
        """nn.TransformerEncoderLayer, post-norm, GELU, no padding."""
        projections = [
            p[f"self_attn_{key}"]
            for key in ("in_proj_weight", "in_proj_bias", "out_proj_weight", "out_proj_bias")
        ]
        attended = dg.multi_head_attention(x, None, *projections, heads)
        x = dg.layer_norm(x + attended, p["norm1_weight"], p["norm1_bias"])
        expanded = dg.gelu(dg.linear_t(x, p["linear1_weight"], p["linear1_bias"]))
        fed = dg.linear_t(expanded, p["linear2_weight"], p["linear2_bias"])
        state = dg.layer_norm(x + fed, p["norm2_weight"], p["norm2_bias"])
        return state

    def classify(classifier, x):
        """The classifier on the [CLS] token's state."""
        cls_state = dg.reshape(x[:, :1], (x.shape[0], hidden))
        logits = dg.linear_t(cls_state, *classifier)
        return logits

    def entropy(logits):
        log_p = dg.log_softmax(logits, 1)
        return -dg.sum(dg.exp(log_p) * log_p, 1)

    def exited(x, logits):  # the examples that left: their state and logits carried as they are
        return x, logits

    x = dg.layer_norm(dg.gather(word, tokens) + position, *norm)
    x = encoder_layer(encoder[0], x)
    logits = classify(classifiers[0], x)
    every_layer_logits = [logits]
    running = entropy(logits) >= threshold
    exit_layer = dg.cast(running, "float32") + 1.0
    for k in range(1, layers):

        def next_layer(x, logits, k=k):  # noqa: ARG001  (the logits are replaced)
            x = encoder_layer(encoder[k], x)
            return x, classify(classifiers[k], x)

        who = (f"still running after layer {k}", f"that exited by layer {k}")  # the C++ comments' words
        x, logits = dg.cond(running, next_layer, exited, x, logits, examples=who)
        every_layer_logits.append(logits)
        if k + 1 < layers:
            running = running & (entropy(logits) >= threshold)
            exit_layer = exit_layer + dg.cast(running, "float32")

    # Training: threshold 0, every example through every layer; each layer's classifier learns.
    loss = dg.softmax_cross_entropy(every_layer_logits[0], labels)
    for later in every_layer_logits[1:]:
        loss = loss + dg.softmax_cross_entropy(later, labels)
    dg.train(loss, dg.adam(lr=0.003))
    return {"logits": logits, "exit_layer": dg.cast(exit_layer, "int64")}


def make_sentences(count: int, seed: int) -> dict:
    """`count` sentences, half of them with one or two "not"s, and their classes."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros((count, T), np.int64)
    labels = np.zeros(count, np.int64)
    for i in range(count):
        while True:
            words = rng.choice(POSITIVE + NEGATIVE + NEUTRAL, WORDS)
            if i % 2:
                for at in rng.choice(WORDS - 1, rng.integers(1, 3), replace=False):
                    words[at] = NOT
            score = sentiment(words)
            if score:
                break
        tokens[i, 1:], labels[i] = words, int(score > 0)
    return {"tokens": tokens, "labels": labels}


def sentiment(words) -> int:
    """+1 per positive word, -1 per negative one, the sign turned by a "not" right before it."""
    score, sign = 0, 1
    for w in words:
        score += sign * ((w in POSITIVE) - (w in NEGATIVE))
        sign = -1 if w == NOT else 1
    return score


def evaluate(model, data, threshold: float) -> dict:
    """At `threshold`: the accuracy, the average exit layer, and that of the sentences
    with a "not" and without."""
    out = model.forward(tokens=data["tokens"], threshold=np.array([threshold], np.float32))
    negated = (data["tokens"] == NOT).any(axis=1)
    return {
        "accuracy": float(np.mean(out["logits"].argmax(1) == data["labels"])),
        "exit_layer": float(np.mean(out["exit_layer"])),
        "exit_layer_with_not": float(np.mean(out["exit_layer"][negated])),
        "exit_layer_without_not": float(np.mean(out["exit_layer"][~negated])),
    }


def train(module, epochs=20, batch=64, seed=0, thresholds=(0.05, 0.2), log=print):
    """Train a fresh Model on 4000 sentences (Adam, every layer: threshold 0); returns (the
    model, {threshold: evaluate(...)} on 1000 others, threshold 0 being every layer)."""
    train_set, test_set = make_sentences(4000, seed), make_sentences(1000, seed + 1)
    model = module.Model(seed=seed)
    every_layer = np.zeros(1, np.float32)
    rng = np.random.default_rng(seed)
    for epoch in range(epochs):
        order = rng.permutation(len(train_set["tokens"]))
        losses = [
            model.train_step(
                tokens=train_set["tokens"][rows], labels=train_set["labels"][rows], threshold=every_layer
            )
            for rows in (order[start : start + batch] for start in range(0, len(order), batch))
        ]
        log(f"epoch {epoch + 1:2d}  loss {np.mean(losses):.4f}")
    results = {t: evaluate(model, test_set, t) for t in (0.0, *thresholds)}
    for t, r in results.items():
        what = "every layer" if t == 0 else f"exit under entropy {t}"
        log(
            f"{what:24s}  held-out accuracy {r['accuracy']:.4f}  average exit layer {r['exit_layer']:.2f} "
            f"(sentences with a \"not\" {r['exit_layer_with_not']:.2f}, without {r['exit_layer_without_not']:.2f})"
        )
    return model, results


def main():
    from generator.pipeline import generate
    from generator.tools.build import build_project

    here = Path(__file__).resolve().parent
    project = here.parent / "build" / "early_exit"
    generate(early_exit.build(), project, force=True)
    build_project(project, target_dir=project / "site")
    sys.path.insert(0, str(project / "site"))
    import early_exit as module  # noqa: E402  (the module just built)

    train(module)


if __name__ == "__main__":
    main()
