"""`deepgen quantize MODEL.py --weights W.npz --calibrate DATA.npz -o Wq.npz`: the
scales of the model's int8 products (transforms/quantize.py), calibrated by the
numpy reference on DATA.npz, written beside every array of W.npz (but its optimizer
state, which an int8 project, inference only, refuses to load); then a report of
how the int8 model agrees with the fp32 one on the calibration data.

A model over a batch of trees (dg.trees) reads arrays with one row per node (its
children, words, per-node labels) beside one with a row per tree (its roots): the
calibration file is then one batch of trees, run whole, and the report counts the
output's rows (one per node)."""

from __future__ import annotations

import io
import os

import numpy as np

from ..errors import DeepgenError
from ..fileio import write_atomic
from ..frontend.loader import load_model
from ..ops import get_op
from ..ops.quantize import int8_nodes
from ..reference.interpreter import run
from ..reference.quantize import calibrate
from ..transforms.autodiff import train_only_inputs
from ..transforms.precision import set_precision

BATCH = 256  # calibration rows per reference run


def _tree_batch(graph) -> bool:
    """Whether some of the model's inputs describe a batch of trees (a recursion over
    dg.trees reads them: children and words per node, roots per tree)."""
    inputs = {id(v) for v in graph.inputs}
    for node in graph.nodes:
        spec = node.attrs.get("spec")
        if get_op(node.op).regions(node) and not spec.sequences and any(id(v) in inputs for v in node.inputs[:spec.nb]):
            return True
    return False


def _load_npz(path: str, what: str) -> dict:
    if not os.path.isfile(path):
        raise DeepgenError(f"{what} {path}: no such file")
    try:
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}
    except (OSError, ValueError) as e:
        raise DeepgenError(f"{what} {path}: not a readable .npz file ({e})") from None


def quantize(model_spec: str, weights: str, calibrate_path: str, output: str, force: bool = False,
             options: dict | None = None, log=print) -> dict:
    """Writes `output` and returns the report's figures: {"agreement", "fp32_accuracy", "int8_accuracy",
    "count", "scales"} (accuracies None without labels)."""
    if os.path.exists(output) and not force:
        raise DeepgenError(f"-o {output} exists; pass --force to replace it")
    model = load_model(model_spec)
    fp32 = model.build(None, **(options or {}))
    label_inputs = train_only_inputs(fp32) if fp32.train is not None else []
    graph = model.build(None, **(options or {}))
    set_precision(graph, "int8")
    if not int8_nodes(graph):
        raise DeepgenError(f"'{graph.name}' has no product by a weight that int8 would quantize (only matmuls "
                           "whose right operand is a parameter run in int8)")
    params = _load_npz(weights, "--weights")
    data = _load_npz(calibrate_path, "--calibrate")

    forward_names = [v.name for v in graph.inputs]
    labels = [v for v in label_inputs if v.name in data and v.dtype != "float32"]
    known = forward_names + [v.name for v in label_inputs]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise DeepgenError(f"--calibrate {calibrate_path}: unknown array(s) {', '.join(unknown)}; the model's inputs "
                           f"are: {', '.join(known)}")
    missing = [n for n in forward_names if n not in data]
    if missing:
        raise DeepgenError(f"--calibrate {calibrate_path}: missing input(s) {', '.join(missing)} (the model's inputs "
                           f"are: {', '.join(forward_names)})")
    scale_names = {p.name for p in graph.params if p.kind == "state" and p.name.endswith("scale")}
    needed = [p for p in graph.params if p.name not in scale_names]
    absent = [p.name for p in needed if p.name not in params]
    if absent:
        raise DeepgenError(f"--weights {weights}: missing parameter(s) {', '.join(absent)}")
    for p in needed:
        if tuple(params[p.name].shape) != tuple(p.shape):
            raise DeepgenError(f"--weights {weights}: '{p.name}' has shape {params[p.name].shape}, the model's is "
                               f"{tuple(p.shape)}")
    count = {len(data[n]) for n in forward_names}
    trees = _tree_batch(graph)  # one batch of trees: rows per node and per tree
    if len(count) != 1 and not trees:
        raise DeepgenError(f"--calibrate {calibrate_path}: the inputs have different numbers of rows (axis 0)")
    count = max(count)
    if count == 0:
        raise DeepgenError(f"--calibrate {calibrate_path}: no rows to calibrate on")

    def batches():
        if trees:
            yield {n: data[n] for n in forward_names}
            return
        for start in range(0, count, BATCH):
            yield {n: data[n][start : start + BATCH] for n in forward_names}

    try:
        scales = calibrate(graph, batches(), {k: np.asarray(v) for k, v in params.items()})
        quantized = {**params, **scales}
        output_name, _ = graph.outputs[0]
        fp32_out, int8_out = [], []
        for batch in batches():
            fp32_out.append(run(fp32, batch, params, training=False)[output_name])
            int8_out.append(run(graph, batch, quantized, training=False)[output_name])
    except ValueError as e:
        raise DeepgenError(f"the reference could not run the model on the calibration data: {e}") from None
    count = len(fp32_out[0]) if trees else count  # a batch of trees: the output's rows (nodes)
    fp32_top = np.concatenate(fp32_out).reshape(count, -1).argmax(axis=1)
    int8_top = np.concatenate(int8_out).reshape(count, -1).argmax(axis=1)
    report = {"agreement": float(np.mean(fp32_top == int8_top)), "fp32_accuracy": None, "int8_accuracy": None,
              "count": count, "scales": scales, "output": output_name}
    if labels:
        truth = np.asarray(data[labels[0].name]).reshape(-1)
        if truth.size != count:
            raise DeepgenError(f"--calibrate {calibrate_path}: '{labels[0].name}' holds {truth.size} labels for "
                               f"{count} rows (one class id per row is what the report reads)")
        report["fp32_accuracy"] = float(np.mean(fp32_top == truth))
        report["int8_accuracy"] = float(np.mean(int8_top == truth))

    # An fp32 Model's save() after training adds its optimizer state: the int8 project runs
    # inference only and its load() refuses such arrays, so they are left out.
    dropped = sorted(k for k in quantized if k.startswith("optimizer/"))
    for k in dropped:
        del quantized[k]
    buf = io.BytesIO()
    np.savez(buf, **quantized)
    write_atomic(output, buf.getvalue())
    products = int8_nodes(graph)
    log(f"quantized {graph.name}: {len(products)} product(s) by a weight in int8, scales calibrated (max |x| / 127, "
        f"weights max |w_j| / 63) on {count} rows of {calibrate_path}")
    for n in products:
        xs, ws = n.inputs[2].name, n.inputs[3].name
        log(f"  {n.inputs[1].name}: {xs} = {float(scales[xs][0]):.6g}, {ws} [{scales[ws].size}] in "
            f"[{float(scales[ws].min()):.3g}, {float(scales[ws].max()):.3g}]")
    log(f"top-1 of '{output_name}': int8 agrees with fp32 on {report['agreement']:.2%} of {count} rows")
    if labels:
        log(f"accuracy against '{labels[0].name}': fp32 {report['fp32_accuracy']:.2%}, int8 {report['int8_accuracy']:.2%}")
    kept = len(params) - len(dropped)
    log(f"wrote {output}: the {kept} arrays of {weights}{' (not its optimizer state: ' + str(len(dropped)) + ' arrays the int8 project would refuse)' if dropped else ''} and {len(scales)} scales")
    return report
