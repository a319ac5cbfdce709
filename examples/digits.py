"""Handwritten digits (scikit-learn's bundled 8x8 images, no download): an MLP trained with Adam.

    python examples/digits.py        # generates, builds, trains; prints the loss per epoch and the accuracy

needs scikit-learn (`pip install scikit-learn`) for the data.
"""

import sys
from pathlib import Path

import numpy as np

import generator as dg

N = dg.dim("N")


@dg.model
def digits(precision: str = "fp32"):
    pixels = dg.input("pixels", (N, 64))
    labels = dg.input("labels", (N,), dtype="int64")
    hidden = dg.dense(pixels, 64, act=dg.relu)
    logits = dg.dense(hidden, 10)
    loss = dg.softmax_cross_entropy(logits, labels)
    dg.train(loss, dg.adam(lr=0.01), weight_decay=1e-4, precision=precision)  # precision=bf16: bf16 products
    return {"probs": dg.softmax(logits)}


def load_data(seed=0):
    """(train, test) dicts of pixels scaled to [0, 1] and labels; 20% held out."""
    from sklearn.datasets import load_digits

    data = load_digits()
    order = np.random.default_rng(seed).permutation(len(data.target))
    pixels = (data.data[order] / 16.0).astype(np.float32)
    labels = data.target[order].astype(np.int64)
    cut = int(0.8 * len(labels))
    return (
        {"pixels": pixels[:cut], "labels": labels[:cut]},
        {"pixels": pixels[cut:], "labels": labels[cut:]},
    )


def train(module, epochs=30, batch=32, seed=0, log=print):
    """Train a fresh Model on the training split; returns the held-out accuracy."""
    train_set, test_set = load_data(seed)
    model = module.Model(seed=seed)
    rng = np.random.default_rng(seed)
    count = len(train_set["labels"])
    for epoch in range(epochs):
        order = rng.permutation(count)
        losses = []
        for start in range(0, count, batch):
            pick = order[start : start + batch]
            losses.append(model.train_step(pixels=train_set["pixels"][pick], labels=train_set["labels"][pick]))
        log(f"epoch {epoch + 1:2d}  loss {np.mean(losses):.4f}")
    probs = model.forward(pixels=test_set["pixels"])["probs"]
    accuracy = float(np.mean(probs.argmax(axis=1) == test_set["labels"]))
    log(f"held-out accuracy {accuracy:.4f} on {len(test_set['labels'])} images")
    return accuracy


def main():
    from generator.tools.build import build_project
    from generator.pipeline import generate

    here = Path(__file__).resolve().parent
    project = here.parent / "build" / "digits"
    generate(digits.build(), project, force=True)
    build_project(project, target_dir=project / "site")
    sys.path.insert(0, str(project / "site"))
    import digits as module  # noqa: E402  (the module just built)

    train(module)


if __name__ == "__main__":
    main()
