"""An LSTM reads each handwritten digit (scikit-learn's bundled 8x8 images, no
download) column by column, left to right, and a classifier reads its last state.

    python examples/lstm_classifier.py   # generates, builds, trains; prints the loss per epoch and the accuracy

Blank columns at either side of an image are dropped, so the sequences in a
batch have different lengths (2 to 8 columns): the generated code runs one
batched step per column over the images still being read (PyTorch's packed
sequences). With
`tokens=True` the model reads token ids through an embedding instead (the
usual text classifier; the tests use it). Parameters follow PyTorch's names:
`lstm_weight_ih_l0` is nn.LSTM's `weight_ih_l0`.

needs scikit-learn (`pip install scikit-learn`) for the data.
"""

import sys
from pathlib import Path

import numpy as np

import generator as dg

N, T = dg.dim("N"), dg.dim("T")
COLUMN, CLASSES = 8, 10  # an image column's pixels; digit classes
VOCAB, EMBED = 50, 16  # tokens=True


@dg.model
def lstm_classifier(hidden: int = 64, layers: int = 1, bidirectional: bool = False, tokens: bool = False):
    if tokens:
        ids = dg.input("tokens", (N, T), dtype="int64")
        x = dg.embedding(ids, VOCAB, EMBED, name="embed")
    else:
        x = dg.input("columns", (N, T, COLUMN))
    lengths = dg.input("lengths", (N,), dtype="int64")
    labels = dg.input("labels", (N,), dtype="int64")
    outputs, (h_n, c_n) = dg.lstm(x, lengths, hidden, num_layers=layers, bidirectional=bidirectional, name="lstm")
    # The last layer's final states (both directions side by side): [N, D * hidden].
    directions = 2 if bidirectional else 1
    top = dg.slice_axis(h_n, 0, (layers - 1) * directions, layers * directions)
    last = dg.reshape(dg.transpose(top, (1, 0, 2)), (N, directions * hidden))
    logits = dg.dense(last, CLASSES, name="classifier")
    dg.train(dg.softmax_cross_entropy(logits, labels), dg.adam(lr=0.01))
    return {"probs": dg.softmax(logits)}


def load_data(seed=0):
    """(train, test) dicts: each image's columns with ink, from the first to the
    last, as a sequence of 8-pixel vectors scaled to [0, 1] (padded to [N, 8, 8]
    with zeros), its length and its label; 20% held out."""
    from sklearn.datasets import load_digits

    data = load_digits()
    order = np.random.default_rng(seed).permutation(len(data.target))
    images = (data.images[order] / 16.0).astype(np.float32).transpose(0, 2, 1)  # [N, column, pixel]
    inked = images.max(axis=2) > 0
    first = np.argmax(inked, axis=1)
    lengths = (COLUMN - np.argmax(inked[:, ::-1], axis=1) - first).astype(np.int64)
    columns = np.zeros(images.shape, np.float32)
    for n, (start, length) in enumerate(zip(first, lengths)):
        columns[n, :length] = images[n, start : start + length]
    labels = data.target[order].astype(np.int64)
    cut = int(0.8 * len(labels))
    split = lambda part: {"columns": columns[part], "lengths": lengths[part], "labels": labels[part]}  # noqa: E731
    return split(slice(None, cut)), split(slice(cut, None))


def train(module, epochs=12, batch=32, seed=0, log=print):
    """Train a fresh Model on the training split; returns the held-out accuracy."""
    train_set, test_set = load_data(seed)
    model = module.Model(seed=seed)
    rng = np.random.default_rng(seed)
    count = len(train_set["labels"])
    for epoch in range(epochs):
        order = rng.permutation(count)
        losses = [model.train_step(**{k: v[order[start : start + batch]] for k, v in train_set.items()})
                  for start in range(0, count, batch)]
        log(f"epoch {epoch + 1:2d}  loss {np.mean(losses):.4f}")
    probs = model.forward(columns=test_set["columns"], lengths=test_set["lengths"])["probs"]
    accuracy = float(np.mean(probs.argmax(axis=1) == test_set["labels"]))
    log(f"held-out accuracy {accuracy:.4f} on {len(test_set['labels'])} images "
        f"(lengths {test_set['lengths'].min()}..{test_set['lengths'].max()} columns)")
    return accuracy


def main():
    from generator.pipeline import generate
    from generator.tools.build import build_project

    here = Path(__file__).resolve().parent
    project = here.parent / "build" / "lstm_classifier"
    generate(lstm_classifier.build(), project, force=True)
    build_project(project, target_dir=project / "site")
    sys.path.insert(0, str(project / "site"))
    import lstm_classifier as module  # noqa: E402  (the module just built)

    train(module)


if __name__ == "__main__":
    main()
