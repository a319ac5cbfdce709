"""LeNet-5 on scikit-learn's bundled 8x8 digits (no download), its strides adapted to
the small images: two 3x3 convolutions with 2x2 max pooling, then three dense layers.

    python examples/lenet.py        # generates, builds, trains; prints the loss per epoch and the accuracy

needs scikit-learn (`pip install scikit-learn`) for the data.
"""

import sys
from pathlib import Path

import numpy as np

import generator as dg

N = dg.dim("N")


@dg.model
def lenet(precision: str = "fp32"):
    images = dg.input("images", (N, 1, 8, 8))
    labels = dg.input("labels", (N,), dtype="int64")
    c1 = dg.conv2d_layer(images, 6, 3, padding=1, act=dg.relu)  # [N, 6, 8, 8]
    s2 = dg.max_pool2d(c1, 2)  # [N, 6, 4, 4]
    c3 = dg.conv2d_layer(s2, 16, 3, padding=1, act=dg.relu)  # [N, 16, 4, 4]
    s4 = dg.max_pool2d(c3, 2)  # [N, 16, 2, 2]
    f5 = dg.dense(dg.flatten(s4), 120, act=dg.relu)
    f6 = dg.dense(f5, 84, act=dg.relu)
    logits = dg.dense(f6, 10)
    loss = dg.softmax_cross_entropy(logits, labels)
    dg.train(loss, dg.adam(lr=0.005), precision=precision)  # precision=bf16: bf16 products
    return {"probs": dg.softmax(logits)}


def load_data(seed=0):
    """(train, test) dicts of images [count, 1, 8, 8] scaled to [0, 1] and labels; 20% held out."""
    from sklearn.datasets import load_digits

    data = load_digits()
    order = np.random.default_rng(seed).permutation(len(data.target))
    images = (data.images[order] / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    labels = data.target[order].astype(np.int64)
    cut = int(0.8 * len(labels))
    return (
        {"images": images[:cut], "labels": labels[:cut]},
        {"images": images[cut:], "labels": labels[cut:]},
    )


def train(module, epochs=20, batch=32, seed=0, log=print):
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
            losses.append(model.train_step(images=train_set["images"][pick], labels=train_set["labels"][pick]))
        log(f"epoch {epoch + 1:2d}  loss {np.mean(losses):.4f}")
    probs = model.forward(images=test_set["images"])["probs"]
    accuracy = float(np.mean(probs.argmax(axis=1) == test_set["labels"]))
    log(f"held-out accuracy {accuracy:.4f} on {len(test_set['labels'])} images")
    return accuracy


def main():
    from generator.tools.build import build_project
    from generator.pipeline import generate

    here = Path(__file__).resolve().parent
    project = here.parent / "build" / "lenet"
    generate(lenet.build(), project, force=True)
    build_project(project, target_dir=project / "site")
    sys.path.insert(0, str(project / "site"))
    import lenet as module  # noqa: E402  (the module just built)

    train(module)


if __name__ == "__main__":
    main()
