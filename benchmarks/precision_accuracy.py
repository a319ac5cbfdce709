"""The accuracy table of benchmarks/precision.py (issue #41): trained models generated in
fp32, bf16 and int8; each one's accuracy, its change against fp32 and its top-1
agreement with fp32. Each model is trained once in fp32, then the three modules run
the same held-out inputs with the same weights (int8: plus the scales `deepgen
quantize` calibrates on the training inputs, max-abs).

- digits MLP (examples/digits.py): trained by the numpy reference (8 epochs of Adam,
  batches of 32, seed 0: the tests' trained_digits); 360 held-out images.
- LeNet (examples/lenet.py), scikit-learn's 8x8 digits: trained by the generated fp32
  module's train_step (the example's loop: 20 epochs, batches of 32, seed 0); 360
  held-out images.
- LSTM classifier (examples/lstm_classifier.py), the same digits read column by column:
  trained by the generated fp32 module (12 epochs, batches of 32, seed 0); 360 held-out images.
- TreeLSTM sentiment (examples/treelstm_sentiment.py): its seeded synthetic treebank (no
  data set ships one), trained by the generated fp32 module (8 epochs over 2000 trees,
  batches of 25, seed 0); root accuracy on 500 held-out trees; int8 calibrated on the
  first 200 training trees as one batch.
- torchvision ResNet-18 (10 classes), imported by from_torch at 3x32x32: no pretrained
  weights (nothing can be downloaded here), so torch's seeded random initialization
  (torch.manual_seed(0)), eval mode, and no accuracy: only the top-1 agreement with fp32
  on 256 fixed random images (normal, seed 7); int8 calibrated on 64 other random images
  (seed 8).

int8 quantizes the products by a weight (dense layers, the classifiers); convolutions
and the products inside a recursion's cells (the LSTM's and TreeLSTM's gates) stay
float32 (ARCHITECTURE, *int8*); bf16 rounds the operands of every product, the cells'
included. Needs scikit-learn (the digits), torch and torchvision (ResNet-18; its row is
left out without them).

As measured (2-core AMD EPYC Zen 3, AVX2 + FMA, no AVX512-BF16 / VNNI: bf16 and int8 run
their portable / AVX2 paths; `python benchmarks/precision.py --accuracy-only`): accuracy
fp32 / bf16 / int8, top-1 agreement of bf16 and int8 with fp32:
  digits MLP          0.9778 / 0.9778 / 0.9778 (+0.00%), agreement 1.0000 / 1.0000
  LeNet               0.9778 / 0.9778 / 0.9750 (int8 -0.28%), agreement 1.0000 / 0.9972
  LSTM classifier     0.9722 / 0.9722 / 0.9722, agreement 1.0000 / 1.0000
  TreeLSTM sentiment  0.9840 / 0.9840 / 0.9840, agreement 1.0000 / 1.0000
  ResNet-18 (random)  agreement bf16 0.9922, int8 0.9688
Every accuracy is within 1% of fp32's. ResNet-18's int8 agreement misses 99%: with random
weights its logits barely separate the classes (top-1 over top-2 by 0.057 at the median,
of a 1.1 spread), and int8 (its fc layer only) moves a logit by up to 0.016; the 8 images
that change class had margins of 0.011 or less. A trained network's margins are wider;
none can be downloaded here.
"""

from __future__ import annotations

import runpy
import tempfile
from pathlib import Path

from _common import ROOT, build_module, import_module, import_torchvision

PRECISIONS = ("fp32", "bf16", "int8")


def _example(name: str) -> dict:
    return runpy.run_path(str(ROOT / "examples" / f"{name}.py"))


def quantize_weights(model_file: Path, params: dict, calibration: dict, out: Path) -> None:
    """`deepgen quantize` of `params` on `calibration`, written to `out`."""
    import numpy as np

    from generator.tools.cli import main as cli

    with tempfile.TemporaryDirectory() as tmp:
        np.savez(Path(tmp) / "w.npz", **params)
        np.savez(Path(tmp) / "calib.npz", **calibration)
        code = cli(["quantize", str(model_file), "--weights", str(Path(tmp) / "w.npz"), "--calibrate",
                    str(Path(tmp) / "calib.npz"), "-o", str(out), "--force"])
    if code != 0:
        raise SystemExit(f"deepgen quantize {model_file.name} failed")


def _set(model, arrays: dict) -> None:
    """The arrays into the model's parameters and buffers, by name."""
    views = {**model.parameters(), **(model.buffers() if hasattr(model, "buffers") else {})}
    for name, view in views.items():
        if name in arrays:
            view[...] = arrays[name]
    del views


def _train_generated(module, batches, epochs: int, seed: int = 0):
    """A fresh fp32 Model trained by its train_step over `batches(rng)` (one epoch)."""
    import numpy as np

    model = module.Model(seed=seed)
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        for batch in batches(rng):
            model.train_step(**batch)
    return model


def _row(name: str, what: str, model_def, model_file: Path, params: dict, calibration: dict, predict, truth,
         cache: Path) -> dict:
    """The three precisions of one trained model: `predict(model)` gives the top-1 class
    of each held-out input, `truth` the labels (None: agreement only)."""
    import numpy as np

    results = {}
    for precision in PRECISIONS:
        built = build_module(model_def, name=f"{name}_{precision}", cache=cache, precision=precision)
        model = import_module(built["name"], built["build"]).Model(seed=0)
        if precision == "int8":
            weights = cache / f"{name}_int8_weights.npz"
            quantize_weights(model_file, params, calibration, weights)
            model.load(str(weights))
        else:
            _set(model, params)
        if hasattr(model, "eval"):
            model.eval()
        results[precision] = np.asarray(predict(model))
    rows = []
    for precision in PRECISIONS:
        top1 = results[precision]
        row = {"model": name, "what": what, "precision": precision,
               "agreement": float(np.mean(top1 == results["fp32"])), "accuracy": None, "relative": None}
        if truth is not None:
            row["accuracy"] = float(np.mean(top1 == truth))
        rows.append(row)
    if truth is not None:
        for row in rows:
            row["relative"] = row["accuracy"] / rows[0]["accuracy"] - 1.0
    return rows


def digits(cache: Path) -> list:
    from generator.reference import interpreter as reference

    example = _example("digits")
    train_set, test_set = example["load_data"](0)
    model_def = example["digits"]
    params = reference.train_epochs(model_def.build(), train_set, epochs=8, batch=32, seed=0)
    return _row("digits", "digits MLP, 360 held-out images", model_def, ROOT / "examples" / "digits.py", params,
                train_set, lambda m: m.forward(pixels=test_set["pixels"])["probs"].argmax(1), test_set["labels"],
                cache)


def _trained(name: str, train_set: dict, epochs: int, cache: Path, batch: int = 32) -> tuple:
    """(model_def, trained fp32 parameters) of examples/<name>.py, trained by its generated fp32 module."""
    import numpy as np

    example = _example(name)
    built = build_module(example[name], name=f"{name}_fp32", cache=cache)
    module = import_module(built["name"], built["build"])
    count = len(train_set["labels"])

    def batches(rng):
        order = rng.permutation(count)
        for start in range(0, count, batch):
            yield {k: v[order[start : start + batch]] for k, v in train_set.items()}

    model = _train_generated(module, batches, epochs)
    return example[name], {k: np.array(v) for k, v in model.parameters().items()}


def lenet(cache: Path) -> list:
    train_set, test_set = _example("lenet")["load_data"](0)
    model_def, params = _trained("lenet", train_set, 20, cache)
    return _row("lenet", "LeNet, 360 held-out digits", model_def, ROOT / "examples" / "lenet.py", params,
                {"images": train_set["images"]}, lambda m: m.forward(images=test_set["images"])["probs"].argmax(1),
                test_set["labels"], cache)


def lstm_classifier(cache: Path) -> list:
    train_set, test_set = _example("lstm_classifier")["load_data"](0)
    model_def, params = _trained("lstm_classifier", train_set, 12, cache)
    feed = {k: test_set[k] for k in ("columns", "lengths")}
    return _row("lstm_classifier", "LSTM classifier, 360 held-out digits", model_def,
                ROOT / "examples" / "lstm_classifier.py", params, {k: train_set[k] for k in ("columns", "lengths")},
                lambda m: m.forward(**feed)["probs"].argmax(1), test_set["labels"], cache)


def treelstm_sentiment(cache: Path) -> list:
    import numpy as np

    example = _example("treelstm_sentiment")
    train_trees, test_trees = example["make_treebank"](2000, 0), example["make_treebank"](500, 1)
    built = build_module(example["treelstm_sentiment"], name="treelstm_sentiment_fp32", cache=cache)
    module = import_module(built["name"], built["build"])

    def batches(rng):
        order = rng.permutation(len(train_trees))
        for start in range(0, len(order), 25):
            yield example["batch_of"]([train_trees[i] for i in order[start : start + 25]])

    model = _train_generated(module, batches, 8)
    params = {k: np.array(v) for k, v in model.parameters().items()}
    test = example["batch_of"](test_trees)
    roots = test["trees_roots"]
    feed = {k: v for k, v in test.items() if k != "labels"}
    calibration = {k: v for k, v in example["batch_of"](train_trees[:200]).items() if k != "labels"}
    return _row("treelstm_sentiment", "TreeLSTM sentiment, roots of 500 held-out trees", example["treelstm_sentiment"],
                ROOT / "examples" / "treelstm_sentiment.py", params, calibration,
                lambda m: m.forward(**feed)["probs"][roots].argmax(1), test["labels"][roots], cache)


def resnet18(cache: Path) -> list:
    import warnings

    import numpy as np

    tv = import_torchvision()
    if tv is None:
        print("  (torchvision not installed: the ResNet-18 row is left out)")
        return []
    import torch

    import generator as dg
    from generator.frontend.loader import load_model
    from generator.importers import write_model

    torch.manual_seed(0)
    net = tv.models.resnet18(num_classes=10).eval()
    images = np.random.default_rng(7).normal(size=(256, 3, 32, 32)).astype(np.float32)
    calibration = np.random.default_rng(8).normal(size=(64, 3, 32, 32)).astype(np.float32)
    folder = cache / "tv_resnet18"
    folder.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        source, weights = dg.from_torch(net, (torch.from_numpy(images[:2]),), name="tv_resnet18")
    path, weights_path = write_model(source, weights, str(folder / "tv_resnet18.py"))
    with np.load(weights_path) as f:
        params = {k: f[k] for k in f.files if not k.startswith("meta/")}
    model_def = load_model(path)
    (input_name,) = [v.name for v in model_def.build().inputs]
    output = model_def.build().outputs[0][0]
    return _row("tv_resnet18", "torchvision ResNet-18 (random init), 256 random images", model_def, Path(path), params,
                {input_name: calibration}, lambda m: m.forward(**{input_name: images})[output].argmax(1), None, cache)


MODELS = (digits, lenet, lstm_classifier, treelstm_sentiment, resnet18)


def accuracy_table(cache: Path) -> list:
    return [row for make in MODELS for row in make(cache)]
