"""The models of benchmarks/precision.py's speed table (issue #41): how each one is built in
deepgen fp32, bf16 and int8, and the ONNX / OpenVINO graphs its peers run, all on the same
weights. prepare(key, ...) does it once, in the main process, and returns a description
(JSON: the children read it) of what each peer loads.

  mlp           examples/mlp.py (784 -> 512 relu -> 256 relu -> 10); weights Model(seed=0)'s
                with seeded biases (engines.seeded_model); ONNX: onnx_models.mlp_graph
  level_cell    one level of examples/treelstm.py's internal cell at H = 256
                (engines.level_cell_model); same weights; ONNX: onnx_models.level_cell_graph;
                the output compared is h (c feeds it)
  resnet18      torchvision's, random seeded weights, imported by from_torch at --image pixels,
  resnet50      ONNX by torch.onnx.export: benchmarks/real_models.py's prepare() (which also
                checks deepgen and ONNX Runtime fp32 against PyTorch eager, relative error 1e-4)
  bert_encoder  examples/bert_encoder.py at BERT-base's shape, 2 layers, T 32, full-length
                sequences; its PyTorch twin is real_models.py's BertTwin (the same weights),
                exported to ONNX there

Inputs: real_models.make_feeds (standard normal floats, uniform token ids), seeded per batch.

int8, from the fp32 weights and CALIBRATION[family] calibration inputs (standard normal, or
random token ids; seed 3; the same inputs for all three engines):
  deepgen       the scales `deepgen quantize` computes (generator.reference.quantize.calibrate:
                max |x| / 127 per product's input, max |w_j| / 63 per output channel), written
                beside the weights; dense layers and one-group convolutions are int8
                (conv2d_int8), depthwise/grouped convolutions and the rest float32
  onnxruntime   quantize_static (QDQ, per-channel int8 weights, uint8 activations, MinMax) for
                the CNNs; quantize_dynamic (per-channel int8 weights) for the others
  openvino      nncf.quantize (post-training, default preset) of the ONNX graph, saved as IR,
                when nncf is installed: model_type TRANSFORMER for BERT; for the MLP and the
                level cell Multiply and Add are ignored, so that only the products are int8 as
                in deepgen (nncf's default also quantizes the cell's gate arithmetic: 0.13
                relative error at batch 64, over the int8 tolerance; 0.028 without it)
"""

from __future__ import annotations

import logging
import runpy
import warnings
from pathlib import Path

import numpy as np

from _common import ROOT, build_module, import_module, installed

MODELS = ("mlp", "level_cell", "resnet18", "resnet50", "bert_encoder")
CALIBRATION = {"dense": 256, "image": 8, "sequence": 16}  # calibration rows / images / sequences
BERT_KEY = "ex_bert"  # real_models.py's name of examples/bert_encoder.py (base shape, 2 layers, T 32)


def prepare(key: str, cache: Path, image: int, batches) -> dict:
    """The description of model `key`: "status" is "ok" or says why it is not timed."""
    desc, model_def = (_dsl(key, cache) if key in ("mlp", "level_cell") else _imported(key, image))
    if desc["status"] != "ok":
        return desc
    options = desc.get("options") or {}
    desc["build_errors"] = {}
    for precision in ("bf16", "int8"):
        try:
            info = build_module(model_def, name=f"{desc['build_name']}_{precision}", cache=cache,
                                precision=precision, **options)
        except BaseException as e:  # a failed generation or compile: that column is left out, the run goes on
            if isinstance(e, KeyboardInterrupt):
                raise
            lines = str(e).strip().splitlines() or [""]  # a compile's first error, else the message's first line
            first = next((line for line in lines if "error:" in line), lines[0])
            desc["build_errors"][precision] = f"{type(e).__name__}: {' '.join(first.split())[:240]}"
            print(f"  {key} {precision}: not built ({desc['build_errors'][precision]}); its column is left out")
            continue
        desc["builds"][precision] = {"name": info["name"], "build": info["build"]}
    folder = Path(desc["folder"])
    calibration = _calibration(desc)
    desc["calibration"] = len(calibration)
    desc["int8_weights"] = None
    if "int8" in desc["builds"]:
        desc["int8_weights"] = _deepgen_int8(model_def, options, desc, calibration, folder / "deepgen_int8.npz")
    desc["kernels"] = _kernels(desc)
    desc["reference"] = _reference(desc, folder, batches)
    desc["ort_int8"] = _ort_int8(desc, calibration, folder)
    if installed("openvino", "nncf"):
        try:
            desc["ov_int8"] = _ov_int8(desc, calibration, folder)
        except Exception as e:  # noqa: BLE001 (the column is left out, the reason printed)
            desc["ov_int8_status"] = f"nncf.quantize failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    else:
        desc["ov_int8_status"] = "nncf or openvino not installed"
    return desc


# ----------------------------------------------------------------------------
# The fp32 model, its weights and its ONNX graph
# ----------------------------------------------------------------------------


def _dsl(key: str, cache: Path) -> tuple:
    """The MLP or the level cell: DSL models of this repository, ONNX from onnx_models."""
    from engines import HIDDEN, level_cell_model, seeded_model
    from onnx_models import level_cell_graph, mlp_graph

    if key == "mlp":
        model_def, base, output = runpy.run_path(str(ROOT / "examples" / "mlp.py"))["mlp"], "mlp", "logits"
        inputs = [("x", 784)]
    else:
        model_def, base, output = level_cell_model(HIDDEN), f"treelstm_level_h{HIDDEN}", "h"
        inputs = [("hcat", 2 * HIDDEN), ("c_l", HIDDEN), ("c_r", HIDDEN)]
    folder = cache / f"prec_{key}"
    folder.mkdir(parents=True, exist_ok=True)
    info = build_module(model_def, name=f"{base}_fp32", cache=cache)
    params = {k: np.array(v) for k, v in seeded_model(import_module(info["name"], info["build"])).parameters().items()}
    np.savez(folder / "weights.npz", **params)
    graph = mlp_graph(params) if key == "mlp" else level_cell_graph(params, HIDDEN)
    (folder / f"{key}.onnx").write_bytes(graph)
    desc = {"key": key, "status": "ok", "family": "dense", "size": "", "folder": str(folder), "build_name": base,
            "inputs": [{"name": n, "shape": ["B", width], "dtype": "float32"} for n, width in inputs],
            "torch_args": [n for n, _ in inputs], "dg_output": output, "weights": str(folder / "weights.npz"),
            "onnx": str(folder / f"{key}.onnx"), "builds": {"fp32": {"name": info["name"], "build": info["build"]}}}
    return desc, model_def


def _imported(key: str, image: int) -> tuple:
    """torchvision's ResNets and the BERT example through real_models.prepare()."""
    import real_models as rm
    from generator.frontend.loader import load_model

    model = rm.describe(BERT_KEY if key == "bert_encoder" else key, image)
    rm.prepare(model, quick=True)
    if model["status"] == "ok" and "onnxruntime" not in model.get("peers", []):
        model["status"] = model.get("ort_status", "no ONNX graph")
    desc = dict(model, key=key, folder=str(rm.WORK / model["key"]))
    if model["status"] != "ok":
        return desc, None
    path = ROOT / "examples" / "bert_encoder.py" if key == "bert_encoder" else rm.WORK / model["key"] / f"{model['key']}.py"
    desc["builds"] = {"fp32": {"name": model["module"], "build": model["build"]}}
    return desc, load_model(str(path))


# ----------------------------------------------------------------------------
# Calibration, int8 weights, references, kernels
# ----------------------------------------------------------------------------


def _calibration(desc: dict) -> list:
    """The calibration inputs, one feed dict of batch 1 each (ONNX names for the peers)."""
    from real_models import make_feeds

    count = CALIBRATION[desc["family"]]
    whole = make_feeds(desc, count, seed=3)
    return [{k: v[i : i + 1] for k, v in whole.items()} for i in range(count)]


def _weights(path: str) -> dict:
    with np.load(path) as f:
        return {k: f[k] for k in f.files if not k.startswith("meta/")}


def _deepgen_int8(model_def, options: dict, desc: dict, calibration: list, out: Path) -> str | None:
    """The fp32 weights and the int8 scales (what `deepgen quantize` writes), calibrated on
    the calibration inputs as one batch; None where the model has no int8 product."""
    from generator.ops.quantize import int8_nodes
    from generator.reference.quantize import calibrate
    from generator.transforms.precision import set_precision

    graph = model_def.build(None, **options)
    set_precision(graph, "int8")
    if not int8_nodes(graph):
        return None
    params = _weights(desc["weights"])
    batch = {k: np.concatenate([c[k] for c in calibration]) for k in calibration[0]}
    names = {v.name for v in graph.inputs}
    scales = calibrate(graph, [{k: v for k, v in batch.items() if k in names}], params)
    np.savez(out, **params, **scales)
    return str(out)


def _kernels(desc: dict) -> dict:
    """Each module's build_info() *_kernel entries: {precision: {"gemm_kernel": ..., "bf16_kernel": ...}}
    (int8 projects report int8_kernel where the generator has it)."""
    found = {}
    for precision, b in desc["builds"].items():
        info = getattr(import_module(b["name"], b["build"]), "build_info", None)
        info = dict(info() if callable(info) else info or {})
        found[precision] = {k: str(v) for k, v in sorted(info.items()) if k.endswith("_kernel")}
    return found


def _reference(desc: dict, folder: Path, batches) -> str:
    """Our fp32 outputs at every timed batch (one thread), which each child checks its peer
    against before timing: an .npz, one array per batch ("b1", "b64")."""
    from real_models import load_weights, make_feeds

    b = desc["builds"]["fp32"]
    net = import_module(b["name"], b["build"]).Model(seed=0)
    load_weights(net, desc["weights"])
    if hasattr(net, "eval"):
        net.eval()
    out = folder / "reference.npz"
    np.savez(out, **{f"b{n}": np.asarray(net.forward(**make_feeds(desc, n))[desc["dg_output"]]) for n in batches})
    return str(out)


# ----------------------------------------------------------------------------
# The peers' int8 graphs
# ----------------------------------------------------------------------------


def _ort_int8(desc: dict, calibration: list, folder: Path) -> str:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_dynamic, quantize_static

    out = folder / "ort_int8.onnx"
    names = desc["torch_args"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)  # its advice to pre-process the graph first
        if desc["family"] == "image":

            class Reader(CalibrationDataReader):
                def __init__(self):
                    self.items = iter([{n: c[n] for n in names} for c in calibration])

                def get_next(self):
                    return next(self.items, None)

            quantize_static(desc["onnx"], str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
        else:
            quantize_dynamic(desc["onnx"], str(out), per_channel=True, weight_type=QuantType.QInt8)
        logging.disable(logging.NOTSET)
    return str(out)


def _ov_int8(desc: dict, calibration: list, folder: Path) -> str:
    import nncf
    import openvino as ov

    logging.getLogger("nncf").setLevel(logging.ERROR)
    net = ov.Core().read_model(desc["onnx"])
    names = desc["torch_args"]
    data = nncf.Dataset([{n: c[n] for n in names} for c in calibration])
    kind = nncf.ModelType.TRANSFORMER if desc["family"] == "sequence" else None
    # the products only, as deepgen int8 (its default also quantizes the level cell's gate arithmetic)
    ignored = nncf.IgnoredScope(types=["Multiply", "Add"]) if desc["family"] == "dense" else None
    quantized = nncf.quantize(net, data, subset_size=len(calibration), model_type=kind, ignored_scope=ignored)
    out = folder / "ov_int8.xml"
    ov.save_model(quantized, str(out))
    return str(out)
