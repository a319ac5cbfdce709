"""Benchmark: real networks through deepgen against PyTorch eager, ONNX Runtime and OpenVINO (#37, #40).

    python benchmarks/real_models.py [--quick] [--json FILE] [--image 64] [--models NAME ...] [--rounds R]

Models (--models picks some by name; --quick takes QUICK, one round, batch 1 only):

  torchvision   resnet18 resnet50 mobilenet_v2 mobilenet_v3_small efficientnet_b0 mnasnet0_5
                shufflenet_v2_x0_5 densenet121 regnet_y_400mf convnext_tiny vgg11 alexnet
                squeezenet1_1 googlenet: random weights (seeded; batch norm statistics and the
                weights initialized to a constant get random values, so that a mix-up between
                them shows), eval mode, imported with deepgen's from_torch at --image x --image
                (64 by default; 224 is the usual deployment size and takes ~12x longer)
  our examples  ex_resnet18 (examples/resnet18.py, CIFAR-style, 32x32), ex_vgg11 (32x32, its only size),
                ex_lenet (8x8), ex_lstm (examples/lstm_classifier.py with token ids: 2-layer
                bidirectional LSTM, hidden 128, T 32), ex_bert (examples/bert_encoder.py, BERT-base
                shape: hidden 768, 12 heads, FFN 3072, 2 layers, T 32); each against a PyTorch
                twin made of torch.nn modules whose state_dict keys are the DSL's parameter
                names (dots as underscores); the twin's seeded weights are copied into the
                generated module. The sequences are full length (lengths = T): the twins take
                no lengths and run no padding mask, so all three peers do the same work
  hf_bert       transformers' BertModel built from a config (no download; BERT-base shape, 2
                layers, T 32; inputs input_ids and an all-ones attention_mask), when from_torch
                can import it; otherwise a line says why

A model that fails to import or build is skipped with a line saying why; the table goes on.

Per model, once: the DSL file is written (imports: build/bench/real_models/<model>/) and the
generated module built (build/bench/rm_<model>..., reused when its sources are unchanged);
its output on a batch of 2 is checked against PyTorch eager's: relative error = max |deepgen -
torch| / max |torch|, at most 1e-4, else the model is reported as not matching and not timed.
The ONNX file comes from torch.onnx.export of the same module with the same weights (TorchScript
exporter, opset 17, batch axis dynamic); ONNX Runtime and OpenVINO both run that file, and
each one's output is checked the same way (a mismatch drops only its column). A peer that is
not installed (pip install -e .[bench]) has no column: a line says so and the run goes on.

Peers, each (round, thread count, peer) in a child process of its own, with the thread
variables set before anything is imported (benchmarks/_common.py):

  deepgen       the generated module's forward(**inputs) in eval mode, set_num_threads(n)
  torch         PyTorch eager under torch.inference_mode(), torch.set_num_threads(n)
  onnxruntime   InferenceSession.run, all graph optimizations (ORT_ENABLE_ALL), intra_op_num_threads
                n, inter_op_num_threads 1, sequential execution, CPU provider
  openvino      OpenVINO's CPU plugin on the same ONNX file (read_model, not ov.convert_model of the
                PyTorch module: the graph and its export workarounds are ONNX Runtime's), compiled
                per batch with the batch made static (its best case; the compile is in the warm-up
                call), INFERENCE_PRECISION_HINT f32 forced (the plugin's default is bf16 on a CPU
                with AMX or avx512_bf16: not the same arithmetic as the others), INFERENCE_NUM_THREADS
                n, PERFORMANCE_HINT LATENCY, one stream, one infer request (_common.openvino_compiled)
  sgemm         numpy's 2048^3 float32 product at n threads: the machine's peak, "% peak" below

Cells: batch 1 and 32 (sequence models: 1 and 64), threads 1 and 2. Timings are medians of
single calls after a warm-up, pooled over 3 rounds (--rounds; 1 with --quick), the peers'
order reversed every other round. Table columns, per peer (dg = deepgen, torch, ort = ONNX
Runtime, ov = OpenVINO): ms per call; ratio = peer time / deepgen time (> 1: deepgen is
faster); GFLOP/s = the forward's convolution and matrix-product FLOPs counted on the
DSL graph (2 per multiply-add; the same count for every peer) / time; % peak = that / the
sgemm peak at the same thread count, measured in the same run. Below the table: the checks'
errors, then per peer and thread count "deepgen faster than <peer> in X of Y cells" with the
ratios' range and median. The contention other processes caused while each child ran is
measured (CPU time outside the child, hypervisor steal) and reported: on a busy machine the
figures are noisy, the 2-thread ones most.

Run time on a 2-core AVX-512 VM, builds cached: --quick about 3 minutes, the full run about 30
(with another process taking one core; 2-thread cells then take several times longer). The
first run also builds the ~20 modules: about 20 minutes more.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

from _common import (
    BUSY_LIMIT,
    CACHE,
    PEAK_N,
    ROOT,
    build_module,
    import_module,
    import_torchvision,
    installed,
    machine_facts,
    measure,
    openvino_compiled,
    quiet_blas,
    run_child,
    set_threads,
    sgemm_peak_gflops,
)

TORCHVISION = ["resnet18", "resnet50", "mobilenet_v2", "mobilenet_v3_small", "efficientnet_b0", "mnasnet0_5",
               "shufflenet_v2_x0_5", "densenet121", "regnet_y_400mf", "convnext_tiny", "vgg11", "alexnet",
               "squeezenet1_1", "googlenet"]
EXAMPLES = ["ex_resnet18", "ex_vgg11", "ex_lenet", "ex_lstm", "ex_bert"]
ALL = TORCHVISION + EXAMPLES + ["hf_bert"]
QUICK = ["resnet18", "mnasnet0_5", "ex_lenet", "ex_lstm", "ex_bert", "hf_bert"]
PEERS = ("deepgen", "torch", "onnxruntime", "openvino")
SHORT = {"deepgen": "dg", "torch": "torch", "onnxruntime": "ort", "openvino": "ov"}
THREADS = (1, 2)
IMAGE_BATCHES, SEQUENCE_BATCHES = (1, 32), (1, 64)
SEQ_LEN = 32  # tokens per sequence (ex_lstm, ex_bert, hf_bert)
CHECK_BATCH = 2
TOLERANCE = 1e-4  # relative error of the check (max |diff| / max |torch|), #37's bound
OPSET = 17
WORK = CACHE / "real_models"  # DSL files, weights, ONNX files, PyTorch state dicts
LSTM = {"hidden": 128, "layers": 2, "bidirectional": True, "tokens": True}
BERT = {"size": "base", "layers": 2}


# ----------------------------------------------------------------------------
# The models: a description each (JSON, read by the children too)
# ----------------------------------------------------------------------------


def describe(key: str, image: int) -> dict:
    """What every step needs to know about model `key`: its kind, its inputs (the
    generated module's; `torch_args` of them, in order, are the PyTorch module's and the
    ONNX graph's), the output compared, the batches timed and the build's name."""
    img = [{"name": "x", "shape": ["B", 3, image, image], "dtype": "float32"}]
    if key in TORCHVISION:
        return {"key": key, "kind": "torchvision", "family": "image", "inputs": img, "torch_args": ["x"],
                "output": None, "size": f"{image}px", "build_name": f"rm_{key}_{image}"}
    if key == "hf_bert":
        ids = [{"name": "input_ids", "shape": ["B", SEQ_LEN], "dtype": "int64", "high": 30522},
               {"name": "attention_mask", "shape": ["B", SEQ_LEN], "dtype": "int64", "fill": 1}]
        return {"key": key, "kind": "hf", "family": "sequence", "inputs": ids,
                "torch_args": ["input_ids", "attention_mask"],
                "output": "last_hidden_state", "size": f"T{SEQ_LEN}", "build_name": "rm_hf_bert"}
    example = {"ex_resnet18": "resnet18", "ex_vgg11": "vgg11", "ex_lenet": "lenet", "ex_lstm": "lstm_classifier",
               "ex_bert": "bert_encoder"}[key]
    d = {"key": key, "kind": "example", "example": example, "family": "image", "options": {}}
    if key == "ex_resnet18":  # CIFAR-style (no stem downsampling): at 64px it does 4x the work of 32px
        d.update(inputs=[{"name": "images", "shape": ["B", 3, 32, 32], "dtype": "float32"}], output="logits",
                 size="32px")
    elif key == "ex_vgg11":
        d.update(inputs=[{"name": "images", "shape": ["B", 3, 32, 32], "dtype": "float32"}], output="logits",
                 size="32px")
    elif key == "ex_lenet":
        d.update(inputs=[{"name": "images", "shape": ["B", 1, 8, 8], "dtype": "float32"}], output="probs",
                 size="8px")
    else:
        vocab = 50 if key == "ex_lstm" else 30522  # (checked against the DSL's table when weights are copied)
        d.update(family="sequence", size=f"T{SEQ_LEN}",
                 inputs=[{"name": "tokens", "shape": ["B", SEQ_LEN], "dtype": "int64", "high": vocab},
                         {"name": "lengths", "shape": ["B"], "dtype": "int64", "fill": SEQ_LEN}],
                 output="probs" if key == "ex_lstm" else "hidden",
                 options=dict(LSTM) if key == "ex_lstm" else dict(BERT))
    d["torch_args"] = [d["inputs"][0]["name"]]
    d["build_name"] = f"rm_{key}"
    return d


def batches(model: dict, quick: bool) -> tuple:
    if quick:
        return (1,)
    return SEQUENCE_BATCHES if model["family"] == "sequence" else IMAGE_BATCHES


def make_feeds(model: dict, batch: int, seed: int = 0) -> dict:
    """The generated module's inputs at `batch` (seeded: the same in every process)."""
    import numpy as np

    rng = np.random.default_rng(seed + 1000 * batch)
    feeds = {}
    for spec in model["inputs"]:
        shape = tuple(batch if s == "B" else s for s in spec["shape"])
        if "fill" in spec:
            feeds[spec["name"]] = np.full(shape, spec["fill"], dtype=spec["dtype"])
        elif spec["dtype"] == "int64":
            feeds[spec["name"]] = rng.integers(0, spec["high"], shape, dtype=np.int64)
        else:
            feeds[spec["name"]] = rng.standard_normal(shape, dtype=np.float32)
    return feeds


# ----------------------------------------------------------------------------
# PyTorch modules: torchvision's, the examples' twins, Hugging Face's BERT
# ----------------------------------------------------------------------------


def example_constants(example: str) -> dict:
    """The module-level constants of examples/<example>.py (its sizes and vocabulary)."""
    import runpy

    return runpy.run_path(str(ROOT / "examples" / f"{example}.py"), run_name="real_models_constants")


def torch_module(model: dict, meta: bool = False):
    """A fresh PyTorch module of `model` (weights not yet loaded), in eval mode. meta=True:
    a torchvision model's tensors are made on the meta device, without data or the seconds
    VGG's initialization takes; load_state_dict(..., assign=True) then gives them theirs."""
    kind = model["kind"]
    if kind == "torchvision":
        import torch

        tv = import_torchvision()
        kwargs = {"aux_logits": False, "init_weights": False} if model["key"] == "googlenet" else {}
        with torch.device("meta") if meta else contextlib.nullcontext():
            return tv.models.get_model(model["key"], weights=None, **kwargs).eval()
    if kind == "hf":
        import_torchvision()  # (transformers imports it)
        import transformers

        config = transformers.BertConfig(hidden_size=768, num_hidden_layers=2, num_attention_heads=12,
                                         intermediate_size=3072, max_position_embeddings=512)
        return transformers.BertModel(config, add_pooling_layer=False).eval()
    example = model["example"]
    if example in ("resnet18", "vgg11", "lenet"):
        sys.path.insert(0, str(ROOT / "tests"))
        try:
            from torch_models import TWINS  # the twins tests/test_cnn.py holds the examples to
        finally:
            sys.path.remove(str(ROOT / "tests"))
        cls = _probabilities(TWINS[example]) if example == "lenet" else TWINS[example]  # lenet: probabilities
        return cls().eval()
    if example == "lstm_classifier":
        c = example_constants(example)
        return _torch_classes()[0](c["VOCAB"], c["EMBED"], c["CLASSES"], model["options"]).eval()
    c = example_constants(example)["SIZES"][model["options"]["size"]]
    return _torch_classes()[1](c, model["options"]["layers"] or c["layers"]).eval()


def _torch_classes():
    """The twins' classes (defined on first use: torch is imported only where it runs)."""
    import torch
    from torch import nn

    class LSTMTwin(nn.Module):
        """examples/lstm_classifier.py (tokens=True): embedding, nn.LSTM, the last layer's final
        states of both directions side by side, a linear classifier, softmax."""

        def __init__(self, vocab, embed, classes, options):
            super().__init__()
            self.directions = 2 if options["bidirectional"] else 1
            self.embed = nn.Embedding(vocab, embed)
            self.lstm = nn.LSTM(embed, options["hidden"], num_layers=options["layers"],
                                bidirectional=options["bidirectional"], batch_first=True)
            self.classifier = nn.Linear(self.directions * options["hidden"], classes)

        def forward(self, tokens):
            _, (h_n, _) = self.lstm(self.embed(tokens))
            last = h_n[-self.directions:].transpose(0, 1).reshape(tokens.shape[0], -1)
            return torch.softmax(self.classifier(last), dim=1)

    class BertTwin(nn.Module):
        """examples/bert_encoder.py: token and position embeddings, layer norm, post-norm GELU
        nn.TransformerEncoderLayer's (no padding mask: every sequence is full)."""

        def __init__(self, cfg, layers):
            super().__init__()
            hidden = cfg["hidden"]
            self.embeddings = nn.Module()
            self.embeddings.word_embeddings = nn.Embedding(cfg["vocab"], hidden)
            self.embeddings.position_embeddings = nn.Embedding(cfg["max_len"], hidden)
            self.embeddings.norm = nn.LayerNorm(hidden, eps=1e-12)
            layer = nn.TransformerEncoderLayer(hidden, cfg["heads"], cfg["ffn"], dropout=0.0, activation="gelu",
                                               batch_first=True, layer_norm_eps=1e-12)
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

        def forward(self, tokens):
            e = self.embeddings
            x = e.word_embeddings(tokens) + e.position_embeddings.weight[: tokens.shape[1]]
            return self.encoder(e.norm(x))

    return LSTMTwin, BertTwin


def _probabilities(cls):
    """A subclass of the classifier `cls` that returns softmax(logits), as the example does
    (the state_dict keys stay the classifier's)."""
    import torch

    class Probabilities(cls):
        def forward(self, images):
            return torch.softmax(super().forward(images), dim=1)

    return Probabilities


def perturb(module) -> None:
    """Seeded weights where the initialization left a constant (biases, norms' scales and
    shifts, zero-initialized heads) and random batch norm statistics, so that a mix-up
    between such tensors changes the output."""
    import torch

    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for key, t in [*module.named_parameters(), *module.named_buffers()]:
            if not t.dtype.is_floating_point or t.numel() == 0:
                continue
            if key.endswith("running_var"):
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)
            elif key.endswith("running_mean"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.1)
            elif t.numel() == 1 or bool((t == t.flatten()[0]).all()):
                t.add_(torch.randn(t.shape, generator=g) * 0.1)


def torch_output(result):
    """The tensor a PyTorch module returned (a Hugging Face output: its first field)."""
    if hasattr(result, "last_hidden_state"):
        return result.last_hidden_state
    if isinstance(result, (tuple, list)):
        return result[0]
    return result


# ----------------------------------------------------------------------------
# Peers: prepare(model, threads) -> run(feeds) -> the compared output as numpy
# ----------------------------------------------------------------------------


def deepgen_peer(model: dict, threads):
    import numpy as np

    module = import_module(model["module"], model["build"])
    if threads is not None:
        set_threads(module, threads)
    net = module.Model(seed=0)
    load_weights(net, model["weights"])
    if hasattr(net, "eval"):
        net.eval()
    output = model["dg_output"]
    return lambda feeds: net.forward(**feeds), lambda result: np.asarray(result[output])


def load_weights(net, path: str) -> None:
    """The .npz's arrays into the generated model's parameters and buffers (by name,
    through their writable views, before any call); every one must be there."""
    import numpy as np

    views = {**net.parameters(), **(net.buffers() if hasattr(net, "buffers") else {})}
    with np.load(path) as f:
        arrays = {k: f[k] for k in f.files if not k.startswith("meta/")}
    missing, extra = sorted(set(views) - set(arrays)), sorted(set(arrays) - set(views))
    if missing or extra:
        raise RuntimeError(f"weights do not fit the module: missing {missing[:5]}, unknown {extra[:5]}")
    for name, view in views.items():
        if view.shape != arrays[name].shape:
            raise RuntimeError(f"weight {name}: shape {arrays[name].shape}, the module's {view.shape}")
        view[...] = arrays[name]


def torch_peer(model: dict, threads):
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    meta = model["kind"] == "torchvision"
    try:
        net = torch_module(model, meta=meta)
    except (NotImplementedError, RuntimeError):  # an __init__ that reads its tensors (RegNet's): make it for real
        meta = False
        net = torch_module(model)
    net.load_state_dict(torch.load(model["torch_state"], weights_only=True), assign=meta)
    if any(t.is_meta for t in [*net.parameters(), *net.buffers()]):
        raise RuntimeError("a tensor outside the state dict stayed on the meta device")
    net.eval()
    names = model["torch_args"]

    def run(feeds):
        with torch.inference_mode():
            return torch_output(net(*(torch.from_numpy(feeds[n]) for n in names)))

    return run, lambda result: result.numpy()


def onnxruntime_peer(model: dict, threads):
    import numpy as np
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.inter_op_num_threads = 1
    if threads is not None:
        opts.intra_op_num_threads = threads
    session = ort.InferenceSession(model["onnx"], opts, providers=["CPUExecutionProvider"])
    names = model["torch_args"]
    return (lambda feeds: session.run(None, {n: feeds[n] for n in names})), lambda result: np.asarray(result[0])


def openvino_peer(model: dict, threads):
    """OpenVINO fp32 on the ONNX file, compiled for a batch on the first call at that batch
    (the previous batch's compiled model is dropped first)."""
    names, compiled = model["torch_args"], {}

    def run(feeds):
        batch = feeds[names[0]].shape[0]
        if batch not in compiled:
            compiled.clear()
            compiled[batch] = openvino_compiled(model["onnx"], names, batch, "f32", threads)
        return compiled[batch][0](feeds)

    return run, lambda result: next(iter(compiled.values()))[1](result)


PEER_FACTORIES = {"deepgen": deepgen_peer, "torch": torch_peer, "onnxruntime": onnxruntime_peer,
                  "openvino": openvino_peer}


# ----------------------------------------------------------------------------
# FLOPs of the forward pass, from the DSL graph
# ----------------------------------------------------------------------------


def _size(expr, values: dict) -> int:
    import sympy

    e = sympy.sympify(expr)
    return int(e.subs({s: values[s.name] for s in e.free_symbols if s.name in values}))


def _count(nodes, values: dict) -> int:
    """2 x the multiply-adds of the conv2d, matmul and bmm nodes; a recurrence's cells
    counted once per sequence and step (every sequence full: N x T rows in all)."""
    total = 0
    for node in nodes:
        if node.phase != "forward":
            continue
        if node.op == "conv2d":
            out = math.prod(_size(d, values) for d in node.outputs[0].shape)
            total += 2 * out * math.prod(_size(d, values) for d in node.inputs[1].shape[1:])
        elif node.op in ("matmul", "bmm"):
            a = node.inputs[0].shape
            k = a[-2] if node.attrs.get("ta") else a[-1]
            out = math.prod(_size(d, values) for d in node.outputs[0].shape)
            total += 2 * out * _size(k, values)
        elif node.op == "recurse":
            spec = node.attrs["spec"]
            n, steps = values["N"], _size(spec.steps, values) if getattr(spec, "steps", None) is not None else 1
            row_dim = str(getattr(spec, "rows", "rows"))  # the cells' row count: a symbol of their own
            for cell, rows in ((spec.leaf, n), (spec.internal, n * max(steps - 1, 0))):
                if cell is not None:
                    total += _count(cell.nodes, {**values, row_dim: rows})
    return total


def forward_flops(graph, model: dict, batch: int):
    """The forward's conv/matmul FLOPs at `batch` (None where the graph's sizes do not resolve)."""
    values = {"N": batch, "T": SEQ_LEN}
    try:
        return _count(graph.nodes, values)
    except Exception:  # a symbolic size this count does not know: no GFLOP/s for the model
        return None


# ----------------------------------------------------------------------------
# Preparing one model (in the main process): DSL, build, weights, ONNX, checks
# ----------------------------------------------------------------------------


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def relative_error(got, want) -> float:
    import numpy as np

    if got.shape != want.shape:
        return float("inf")
    return float(np.abs(got.astype(np.float64) - want).max() / max(float(np.abs(want).max()), 1e-30))


def to_deepgen_names(state: dict, graph, rename: dict) -> dict:
    """A twin's state_dict as the DSL's parameter names: dots as underscores, a dg.dense
    layer's `<name>_weight` as `<name>_w` transposed ([in, out]) and `_bias` as `_b`."""
    import numpy as np

    wanted = {p.name: tuple(int(d) for d in p.shape) for p in graph.params}
    out = {}
    for key, tensor in state.items():
        if key.endswith("num_batches_tracked"):
            continue
        name, array = key.replace(".", "_"), tensor.detach().numpy()
        name = rename.get(name, name)
        if name not in wanted and name.endswith("_weight") and name[: -len("_weight")] + "_w" in wanted:
            name, array = name[: -len("_weight")] + "_w", array.T
        elif name not in wanted and name.endswith("_bias") and name[: -len("_bias")] + "_b" in wanted:
            name = name[: -len("_bias")] + "_b"
        if name not in wanted or tuple(array.shape) != wanted[name]:
            raise RuntimeError(f"the twin's {key} {tuple(array.shape)} has no DSL parameter of that shape")
        out[name] = np.ascontiguousarray(array, dtype=np.float32)
    missing = sorted(set(wanted) - set(out))
    if missing:
        raise RuntimeError(f"the DSL parameters {missing[:5]} have no weight in the twin")
    return out


RENAME = {"ex_lstm": {"embed_weight": "embed_table"}}


def prepare(model: dict, quick: bool) -> dict:
    """Import (or load) the DSL model, build it, write the weights, the state dict and the
    ONNX file, and check deepgen, ONNX Runtime and OpenVINO against PyTorch eager. Fills in
    model and returns it; model["status"] is "ok", or says why the model is not timed."""
    import numpy as np
    import torch

    import generator as dg
    from generator.frontend.loader import load_model

    key, folder = model["key"], WORK / model["key"]
    folder.mkdir(parents=True, exist_ok=True)
    model["batches"] = list(batches(model, quick))
    t0 = time.perf_counter()
    torch.manual_seed(0)
    try:
        net = torch_module(model)
    except Exception as e:
        model["status"] = f"not made: {one_line(e)}"
        return model
    perturb(net)
    net.eval()
    torch.save(net.state_dict(), folder / "torch_state.pt")
    model["torch_state"] = str(folder / "torch_state.pt")
    check_feeds = make_feeds(model, CHECK_BATCH, seed=7)
    args = tuple(torch.from_numpy(check_feeds[n]) for n in model["torch_args"])

    # the DSL model: imported (from_torch), or the example's file
    try:
        if model["kind"] == "example":
            model_def = load_model(str(ROOT / "examples" / f"{model['example']}.py"))
        else:
            example = {n: a for n, a in zip(model["torch_args"], args)}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                source, weights = dg.from_torch(net, example, name=key)
            from generator.importers import write_model

            path, weights_path = write_model(source, weights, str(folder / f"{key}.py"))
            model_def = load_model(path)
            model["weights"] = weights_path
            model["dsl_lines"] = len(source.splitlines())
        graph = model_def.build(**model["options"]) if model.get("options") else model_def.build()
    except Exception as e:
        model["status"] = f"import failed: {one_line(e)}"
        return model
    model["import_s"] = round(time.perf_counter() - t0, 1)
    outputs = dict(graph.outputs)
    model["dg_output"] = model["output"] if model.get("output") in outputs else graph.outputs[0][0]
    made = {spec["name"] for spec in model["inputs"]}
    unknown = [v.name for v in graph.inputs if v.name not in made and v.name != "labels"]  # (labels: loss only)
    if unknown:
        model["status"] = f"the imported model takes inputs {unknown} this benchmark does not make"
        return model
    if model["kind"] == "example":
        try:
            arrays = to_deepgen_names(net.state_dict(), graph, RENAME.get(key, {}))
        except Exception as e:
            model["status"] = f"weights do not map: {one_line(e)}"
            return model
        np.savez(folder / "deepgen_weights.npz", **arrays)
        model["weights"] = str(folder / "deepgen_weights.npz")
    model["flops"] = {str(b): forward_flops(graph, model, b) for b in model["batches"]}

    # build (cached)
    try:
        info = build_module(model_def, name=model["build_name"], **model.get("options", {}))
    except BaseException as e:  # a failed compile: the model is skipped, the run goes on
        if isinstance(e, KeyboardInterrupt):
            raise
        model["status"] = f"build failed: {one_line(e)}"
        return model
    model.update(module=info["name"], build=info["build"], build_s=info["seconds"], build_reused=info["reused"],
                 compiler=info["compiler"])

    # the check: deepgen against PyTorch eager
    with torch.inference_mode():
        want = torch_output(net(*args)).numpy().astype(np.float64)
    try:
        run, named = deepgen_peer(model, None)
        model["rel_err"] = relative_error(named(run(check_feeds)), want)
    except Exception as e:
        model["status"] = f"generated module failed: {one_line(e)}"
        return model
    if not model["rel_err"] <= TOLERANCE:
        model["status"] = f"does not match PyTorch: relative error {model['rel_err']:.2e} > {TOLERANCE:g}"
        return model

    # the ONNX file, then the same check of each peer that runs it
    model["peers"] = ["deepgen", "torch"]
    onnx_path = folder / f"{key}.onnx"
    try:
        note = export_onnx(net, args, model["torch_args"], onnx_path)
        if note:
            model["onnx_note"] = note
        model["onnx"] = str(onnx_path)
    except Exception as e:
        model["ort_status"] = model["ov_status"] = f"ONNX export failed: {one_line(e)}"
    for peer, short, label in (("onnxruntime", "ort", "ONNX Runtime"), ("openvino", "ov", "OpenVINO")):
        if "onnx" not in model:
            break
        if not installed(peer):
            model[f"{short}_status"] = f"{peer} is not installed"
            continue
        try:
            run, named = PEER_FACTORIES[peer](model, None)
            err = model[f"{short}_rel_err"] = relative_error(named(run(check_feeds)), want)
            if err <= TOLERANCE:
                model["peers"].append(peer)
            else:
                model[f"{short}_status"] = f"{label} does not match PyTorch: relative error {err:.2e}"
        except Exception as e:
            model[f"{short}_status"] = f"{label} failed: {one_line(e)}"
        run = named = None
    model["status"] = "ok"
    model["prepare_s"] = round(time.perf_counter() - t0, 1)
    return model


def export_onnx(net, args, names, path: Path) -> str:
    """torch.onnx.export with the TorchScript exporter (the dynamo one needs onnxscript), the
    batch axis dynamic; re-exported on every run (seconds). Returns a note on how it was
    exported ("" for plainly).

    Two workarounds, each giving ONNX Runtime the same function (checked against PyTorch
    after the export like any other):
      - a Hugging Face model is exported through a module that passes the inputs by keyword
        and returns last_hidden_state (its forward's positional order clashes with the
        exporter's keyword arguments);
      - the exporter refuses nn.AdaptiveAvgPool2d to a size that does not divide the input's
        (VGG's and AlexNet's 7x7 / 6x6 pooling of a 2x2 / 1x1 map at 64x64 images): it is
        exported as what it computes, the mean of each output cell's window, one Slice +
        ReduceMean per output row and column, concatenated."""
    import torch

    module, note = net, ""
    if hasattr(net, "config") and hasattr(net.config, "model_type"):
        module, note = _KeywordInputs(net, names), "through a keyword wrapper"
    try:
        _export(module, args, names, path)
    except Exception as e:
        if "adaptive_avg_pool2d" not in str(e):
            raise
        from torch.onnx import register_custom_op_symbolic, unregister_custom_op_symbolic

        register_custom_op_symbolic("aten::adaptive_avg_pool2d", _adaptive_avg_pool2d_windows, OPSET)
        try:
            _export(module, args, names, path)
        finally:
            unregister_custom_op_symbolic("aten::adaptive_avg_pool2d", OPSET)
        note = "adaptive average pooling as window means (Slice + ReduceMean)"
    return note


@contextlib.contextmanager
def _silenced():
    """File descriptors 1 and 2 to /dev/null for the duration: a failed export prints the
    whole TorchScript graph from C++ (kept out of the table's way; the error says why)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


def _export(module, args, names, path: Path) -> None:
    import torch

    with warnings.catch_warnings(), _silenced():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), dynamo=False, opset_version=OPSET, input_names=list(names),
                          output_names=["output"],
                          dynamic_axes={**{n: {0: "batch"} for n in names}, "output": {0: "batch"}})


def _KeywordInputs(net, names):
    from torch import nn

    class KeywordInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, *inputs):
            return torch_output(self.net(**dict(zip(names, inputs))))

    return KeywordInputs()


def _adaptive_avg_pool2d_windows(g, x, output_size):
    """ONNX symbolic of adaptive_avg_pool2d (static spatial sizes): output cell i of an axis of
    n_in is the mean over [floor(i n_in / n_out), ceil((i + 1) n_in / n_out)), as PyTorch
    defines it; one axis after the other."""
    import torch
    from torch.onnx import symbolic_helper

    out = symbolic_helper._parse_arg(output_size, "is")
    sizes = symbolic_helper._get_tensor_sizes(x)

    def const(v):
        return g.op("Constant", value_t=torch.tensor([v], dtype=torch.int64))

    for axis, n_out in ((2, out[0]), (3, out[1])):
        n_in = sizes[axis]
        if n_out is None or n_out == n_in:
            continue
        parts = []
        for i in range(n_out):
            start, end = (i * n_in) // n_out, -((-(i + 1) * n_in) // n_out)
            window = g.op("Slice", x, const(start), const(end), const(axis))
            parts.append(g.op("ReduceMean", window, axes_i=[axis], keepdims_i=1))
        x = g.op("Concat", *parts, axis_i=axis)
    return x


# ----------------------------------------------------------------------------
# Child: one (round, thread count, peer); every model, every batch
# ----------------------------------------------------------------------------


def child(config: dict) -> None:
    threads, peer = config["threads"], config["peer"]
    out = {"threads": threads, "peer": peer, "round": config["round"], "records": [], "errors": {}}
    path = Path(config["out"])

    def save():
        path.write_text(json.dumps(out))

    if peer == "sgemm":
        out["peak_gflops"] = sgemm_peak_gflops(config["peak_s"])
        print(f"  [round {config['round'] + 1}, {threads} thr] sgemm peak {out['peak_gflops']:.1f} GFLOP/s "
              f"({PEAK_N}^3)", flush=True)
        save()
        return
    if peer == "deepgen":
        quiet_blas()  # numpy only makes the inputs here (see _common.quiet_blas)
    elif peer == "torch":
        import torch

        torch.set_num_threads(threads)
        out["torch"] = torch.__version__
    elif peer == "onnxruntime":
        import onnxruntime

        out["onnxruntime"] = onnxruntime.__version__
    else:
        import openvino

        out["openvino"] = openvino.__version__
    for model in config["models"]:
        if peer not in model["peers"]:
            continue
        out["current"] = model["key"]
        save()
        try:
            run, _ = PEER_FACTORIES[peer](model, threads)
            for batch in model["batches"]:
                feeds = make_feeds(model, batch)
                t = measure(lambda: run(feeds), config["target_s"], config["min_reps"])
                ms = [1000 * s for s in t["times"]]
                out["records"].append({"model": model["key"], "batch": batch, "times_ms": ms,
                                       "cpu_per_wall": t["cpu_per_wall"]})
                print(f"  [round {config['round'] + 1}, {threads} thr] {model['key']:18s} batch {batch:2d} "
                      f"{peer:11s} {statistics.median(ms):10.3f} ms ({len(ms)} calls)", flush=True)
        except Exception as e:
            out["errors"][model["key"]] = one_line(e)
            print(f"  [round {config['round'] + 1}, {threads} thr] {model['key']}: {peer} failed: {one_line(e)}",
                  flush=True)
            traceback.print_exc(limit=3)
        run = None
        gc.collect()
    out.pop("current", None)
    save()


def run_all_rounds(config: dict, rounds: int, peers) -> list:
    """Every (round, thread count, peer) in a child of its own, peers in alternating order
    from round to round; a child that dies is reported and its finished models kept."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(rounds):
            for threads in THREADS:
                for peer in peers if rnd % 2 == 0 else peers[::-1]:
                    out = Path(tmp) / f"r{rnd}-t{threads}-{peer}.json"
                    cfg = dict(config, threads=threads, peer=peer, round=rnd, out=str(out))
                    try:
                        results.append(run_child(Path(__file__).resolve(), cfg, threads, f"real_models {peer}"))
                    except SystemExit as e:  # the child died (a crash in a module): keep what it wrote
                        partial = json.loads(out.read_text()) if out.is_file() else {
                            "threads": threads, "peer": peer, "round": rnd, "records": [], "errors": {}}
                        if partial.get("current"):
                            partial["errors"][partial["current"]] = f"the child died: {e}"
                        print(f"  {e}", flush=True)
                        results.append(partial)
    return results


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------


def isa_name(flags) -> str:
    if "avx512f" in flags:
        return "AVX-512" + (" + AMX" if "amx_tile" in flags else "")
    return "AVX2" if "avx2" in flags else "no AVX2"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"models {' '.join(QUICK)}; 1 round, batch 1 only")
    parser.add_argument("--json", metavar="FILE", help="write every figure to FILE as JSON")
    parser.add_argument("--image", type=int, default=64, help="image height and width (default 64)")
    parser.add_argument("--models", nargs="+", metavar="NAME", choices=ALL, help="only these models")
    parser.add_argument("--rounds", type=int, help="rounds (default 3, 1 with --quick)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return

    t_start = time.perf_counter()
    keys = args.models or (QUICK if args.quick else ALL)
    rounds = args.rounds or (1 if args.quick else 3)
    if not installed("onnx"):
        print("onnx is not installed (pip install -e .[bench]): no ONNX Runtime and no OpenVINO column")
    for peer, label in (("onnxruntime", "ONNX Runtime"), ("openvino", "OpenVINO")):
        if not installed(peer):
            print(f"{peer} is not installed (pip install -e .[bench]): no {label} column")
    print(f"Preparing {len(keys)} models (DSL files, weights and builds under {WORK.parent}):", flush=True)
    models = []
    for key in keys:
        model = prepare(describe(key, args.image), args.quick)
        models.append(model)
        if model["status"] == "ok":
            print(f"  {key}: relative error vs PyTorch {model['rel_err']:.1e}{peer_checks(model, '; ')} "
                  f"(prepared in {model['prepare_s']:.0f} s)", flush=True)
        else:
            print(f"  {key}: SKIPPED, {model['status']}", flush=True)
        gc.collect()
    timed = [m for m in models if m["status"] == "ok"]
    peers = [p for p in PEERS if any(p in m["peers"] for m in timed)]
    config = {"models": timed, "target_s": 0.15 if args.quick else 0.25, "min_reps": 3,
              "peak_s": 0.3 if args.quick else 0.5}
    t0 = time.perf_counter()
    results = run_all_rounds(config, rounds, peers + ["sgemm"]) if timed else []
    measure_s = time.perf_counter() - t0
    report(args, models, results, rounds, measure_s, time.perf_counter() - t_start)


def peer_checks(model: dict, sep: str) -> str:
    """The ONNX peers' relative errors against PyTorch, each with why it is not timed where it is not:
    "<sep>onnxruntime 3.1e-07<sep>openvino - (openvino is not installed)"."""
    text = ""
    for peer, short in (("onnxruntime", "ort"), ("openvino", "ov")):
        err, why = model.get(f"{short}_rel_err"), model.get(f"{short}_status")
        text += f"{sep}{peer} " + ("-" if err is None else f"{err:.1e}") + (f" ({why})" if why else "")
    return text


def report(args, models, results, rounds, measure_s, total_s) -> None:
    facts = machine_facts(build=next((m["build"] for m in models if m.get("build")), None))
    isa = isa_name(facts["cpu_isa"])
    pooled, by_round, errors = {}, {}, {}
    peaks = {}
    for res in results:
        if "peak_gflops" in res:
            peaks.setdefault(res["threads"], []).append(res["peak_gflops"])
        for r in res.get("records", []):
            k = (r["model"], r["batch"], res["threads"], res["peer"])
            pooled.setdefault(k, []).extend(r["times_ms"])
            by_round.setdefault(k, []).append(statistics.median(r["times_ms"]))
        for key, text in res.get("errors", {}).items():
            errors.setdefault((key, res["peer"]), text)
    peak = {t: statistics.median(v) for t, v in peaks.items()}
    versions = {k: res[k] for res in results for k in ("torch", "onnxruntime", "openvino") if k in res}

    print(f"\nMachine: {facts['cpu']}, {facts['cores']} cores, {isa} ({' '.join(facts['cpu_isa'])}); "
          f"python {facts['python']}, torch {facts['torch']}, onnxruntime {versions.get('onnxruntime', '-')}, "
          f"openvino {versions.get('openvino', '-')}; "
          f"git {facts['git']}; compiler: {facts.get('compiler') or '?'}")
    print("sgemm peak (numpy float32 2048^3, this run): "
          + ", ".join(f"{t} thr {peak[t]:.1f} GFLOP/s" for t in sorted(peak)))
    print(f"Median ms per call over {rounds} round(s), measured in {measure_s:.0f} s (whole run {total_s:.0f} s); "
          "B = batch; dg = deepgen, ort = ONNX Runtime, ov = OpenVINO fp32; ratio = peer / deepgen (> 1: deepgen "
          "faster); GF/s = conv+matmul GFLOP/s; %pk = of the sgemm peak.")
    others = PEERS[1:]
    ratio_w = {p: max(6, len(SHORT[p]) + 3) for p in others}
    head = (f"{'model':18} {'size':>5} {'B':>3} {'thr':>3} | " + " ".join(f"{SHORT[p] + ' ms':>8}" for p in PEERS)
            + " | " + " ".join(f"{SHORT[p] + '/dg':>{ratio_w[p]}}" for p in others)
            + f" | {'GF/s dg':>7} " + " ".join(f"{SHORT[p]:>6}" for p in others)
            + f" | {'%pk dg':>6} " + " ".join(f"{SHORT[p]:>5}" for p in others))
    print(head + "\n" + "-" * len(head))
    records = []
    for m in models:
        if m["status"] != "ok":
            continue
        for batch in m["batches"]:
            for threads in THREADS:
                cell = {}
                for peer in PEERS:
                    times = pooled.get((m["key"], batch, threads, peer))
                    cell[peer] = statistics.median(times) if times else None
                flops = (m.get("flops") or {}).get(str(batch))
                dg = cell["deepgen"]
                rec = {"model": m["key"], "size": m["size"], "batch": batch, "threads": threads,
                       "flops": flops, "peak_gflops": peak.get(threads)}
                for peer in PEERS:
                    ms = cell[peer]
                    rec[f"{peer}_ms"] = None if ms is None else round(ms, 4)
                    rounds_ms = by_round.get((m["key"], batch, threads, peer), [])
                    rec[f"{peer}_by_round_ms"] = [round(x, 4) for x in rounds_ms]
                    rec[f"{peer}_gflops"] = None if ms is None or not flops else round(flops / ms / 1e6, 2)
                    rec[f"{peer}_of_peak"] = (None if rec[f"{peer}_gflops"] is None or not peak.get(threads)
                                              else round(rec[f"{peer}_gflops"] / peak[threads], 4))
                    if peer != "deepgen":
                        rec[f"{peer}_over_deepgen"] = None if ms is None or dg is None else round(ms / dg, 3)
                records.append(rec)

                def f(x, fmt, width):
                    return f"{'-':>{width}}" if x is None else f"{x:{width}{fmt}}"

                def pct(x, width):
                    return f"{'-':>{width}}" if x is None else f"{100 * x:{width - 1}.0f}%"

                print(f"{m['key']:18} {m['size']:>5} {batch:3d} {threads:3d} | "
                      + " ".join(f(cell[p], ".3f", 8) for p in PEERS) + " | "
                      + " ".join(f(rec[f"{p}_over_deepgen"], ".2f", ratio_w[p]) for p in others)
                      + f" | {f(rec['deepgen_gflops'], '.1f', 7)} "
                      + " ".join(f(rec[f"{p}_gflops"], ".1f", 6) for p in others)
                      + f" | {pct(rec['deepgen_of_peak'], 6)} " + " ".join(pct(rec[f"{p}_of_peak"], 5) for p in others))

    print("\nChecks against PyTorch eager (batch 2; relative error = max |diff| / max |torch|, bound "
          f"{TOLERANCE:g}):")
    for m in models:
        if m["status"] != "ok":
            print(f"  {m['key']:18} SKIPPED: {m['status']}")
            continue
        note = f" (exported {m['onnx_note']})" if m.get("onnx_note") else ""
        print(f"  {m['key']:18} deepgen {m['rel_err']:.1e}{peer_checks(m, ', ')}{note}")
    for (key, peer), text in sorted(errors.items()):
        print(f"  {key}: the {peer} measurement failed: {text}")
    for side in ("onnxruntime", "openvino", "torch"):
        for threads in THREADS:
            ratios = [r[f"{side}_over_deepgen"] for r in records
                      if r["threads"] == threads and r.get(f"{side}_over_deepgen") is not None]
            if ratios:
                wins = sum(1 for x in ratios if x >= 1.0)
                print(f"{threads} thread(s): deepgen faster than {side} in {wins} of {len(ratios)} cells "
                      f"(ratios {min(ratios):.2f} .. {max(ratios):.2f}, median {statistics.median(ratios):.2f})")
    busy = [r for r in results if r.get("other_cores") is not None]
    if busy:
        other = [r["other_cores"] for r in busy]
        steal = [r["steal_cores"] for r in busy]
        print(f"Load from other processes while measuring: median {statistics.median(other):.2f} cores, "
              f"max {max(other):.2f} (of {facts['cores']}); hypervisor steal max {max(steal):.2f} cores"
              + (". The figures are NOISY, the 2-thread ones most: rerun on an idle machine."
                 if max(max(other), max(steal)) > BUSY_LIMIT else "."))

    if args.json:
        env = {**facts, "isa": isa, **versions, "rounds": rounds, "quick": args.quick, "image": args.image,
               "tolerance": TOLERANCE, "measure_seconds": round(measure_s, 1), "total_seconds": round(total_s, 1),
               "peak_gflops": {str(t): round(v, 2) for t, v in peak.items()},
               "children": [{k: r.get(k) for k in ("round", "threads", "peer", "other_cores", "steal_cores")}
                            for r in results]}
        keep = ("key", "kind", "size", "status", "rel_err", "ort_rel_err", "ort_status", "ov_rel_err", "ov_status",
                "onnx_note", "flops", "batches", "peers", "module", "build_s", "build_reused", "import_s", "prepare_s",
                "dsl_lines", "compiler")
        Path(args.json).write_text(json.dumps(
            {"environment": env, "models": [{k: m[k] for k in keep if k in m} for m in models],
             "records": records, "errors": [{"model": k, "peer": p, "error": t} for (k, p), t in errors.items()]},
            indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
