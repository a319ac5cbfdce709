"""The peers of benchmarks/precision.py's speed table (issue #41): how each one loads a model
that precision_models.prepare() described, and runs it.

  dg_fp32 / dg_bf16 / dg_int8   the generated modules, set_num_threads(n); fp32 and bf16 load
                                the fp32 weights, int8 the weights and scales (Model.load)
  ov_bf16    OpenVINO on the ONNX graph, INFERENCE_PRECISION_HINT bf16
  ov_int8    OpenVINO on nncf.quantize's model, INFERENCE_PRECISION_HINT f32 (what stays float
             runs in float32, as in deepgen int8)
  ort_int8   ONNX Runtime on the quantized graph, all graph optimizations,
             intra_op_num_threads n, inter_op_num_threads 1, sequential execution

OpenVINO compiles the model once per batch, reshaped to its static shape (its best case), with
INFERENCE_NUM_THREADS n, PERFORMANCE_HINT LATENCY and one stream, and runs one infer request
(_common.openvino_compiled, shared with real_models.py's fp32 OpenVINO peer).
"""

from __future__ import annotations

from _common import import_module, installed, openvino_compiled, set_threads

PEERS = ("dg_fp32", "dg_bf16", "dg_int8", "ov_bf16", "ov_int8", "ort_int8")
PRECISION = {"dg_fp32": "fp32", "dg_bf16": "bf16", "dg_int8": "int8", "ov_bf16": "bf16", "ov_int8": "int8",
             "ort_int8": "int8"}

# Each factory(desc, peer, threads) gives for_batch(n) -> (call(feeds), output(result) as numpy).


def deepgen_peer(desc: dict, peer: str, threads: int):
    import numpy as np

    from real_models import load_weights

    precision = PRECISION[peer]
    b = desc["builds"][precision]
    module = import_module(b["name"], b["build"])
    set_threads(module, threads)
    net = module.Model(seed=0)
    if precision == "int8":
        net.load(desc["int8_weights"])
    else:
        load_weights(net, desc["weights"])
    if hasattr(net, "eval"):
        net.eval()
    name = desc["dg_output"]
    return lambda n: ((lambda feeds: net.forward(**feeds)), (lambda result: np.asarray(result[name])))


def ort_peer(desc: dict, peer: str, threads: int):
    import numpy as np
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(desc["ort_int8"], opts, providers=["CPUExecutionProvider"])
    names = desc["torch_args"]
    call = lambda feeds: session.run(None, {k: feeds[k] for k in names})  # noqa: E731
    return lambda n: (call, lambda result: np.asarray(result[0]))


def ov_peer(desc: dict, peer: str, threads: int):
    """A model compiled per batch (static shapes: OpenVINO's best case), one infer request."""
    path = desc["onnx"] if peer == "ov_bf16" else desc["ov_int8"]
    precision = "bf16" if peer == "ov_bf16" else "f32"
    return lambda n: openvino_compiled(path, desc["torch_args"], n, precision, threads)


FACTORIES = {"dg": deepgen_peer, "ort": ort_peer, "ov": ov_peer}


def peers_of(desc: dict) -> list:
    """The peers that can run model `desc` here."""
    have = {"dg_fp32": True, "dg_bf16": "bf16" in desc["builds"], "dg_int8": desc.get("int8_weights") is not None,
            "ov_bf16": installed("openvino"), "ov_int8": desc.get("ov_int8") is not None,
            "ort_int8": installed("onnxruntime")}
    return [p for p in PEERS if have[p]]


