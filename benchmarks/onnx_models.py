"""ONNX graphs of the models benchmarks/engines.py times, built with onnx.helper from a
generated module's parameters (the same numbers, no PyTorch export needed).

deepgen keeps a dense layer's weight as [in, out] (y = x @ w + b); an exported
nn.Linear stores PyTorch's [out, in] and a Gemm node with transB=1. The graphs below
are written the way torch.onnx.export writes the equivalent PyTorch code, so an
engine sees what a deployer would hand it:

  mlp_graph       x[M, 784] -> Gemm(transB) + Relu -> Gemm(transB) + Relu -> Gemm(transB)
                  (three nn.Linear layers; weights transposed to [out, in])
  level_cell_graph  gates = MatMul(hcat, u) + b (u a plain [2H, 5H] parameter), Split into
                  i, o, u, f_l, f_r, then the TreeLSTM cell's elementwise tail

The batch dimension is symbolic ("M"), as in the generated module.
"""

from __future__ import annotations

OPSET = 17
IR_VERSION = 8  # the IR version of opset 17: readable by every engine of the extra's versions


def _model(nodes, inputs, outputs, initializers, name: str) -> bytes:
    """A checked, serialized ModelProto."""
    import onnx
    from onnx import helper

    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=initializers)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        ir_version=IR_VERSION,
        producer_name="deepgen-bench",
    )
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _tensor(name: str, array):
    import numpy as np
    from onnx import numpy_helper

    return numpy_helper.from_array(np.ascontiguousarray(array, dtype=np.float32), name)


def _value(name: str, shape):
    from onnx import TensorProto, helper

    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def mlp_graph(params: dict, layers=("h1", "h2", "logits")) -> bytes:
    """x[M, in] -> dense layers named `layers` (params <layer>_w [in, out], <layer>_b [out]),
    relu between them, as exported nn.Linear layers: Gemm with a transposed [out, in] weight."""
    from onnx import helper

    nodes, inits, current = [], [], "x"
    for k, layer in enumerate(layers):
        w, b = params[f"{layer}_w"], params[f"{layer}_b"]
        inits += [_tensor(f"{layer}.weight", w.T), _tensor(f"{layer}.bias", b)]
        out = layer if k == len(layers) - 1 else f"{layer}_pre"
        nodes.append(helper.make_node("Gemm", [current, f"{layer}.weight", f"{layer}.bias"], [out], transB=1))
        if k < len(layers) - 1:
            nodes.append(helper.make_node("Relu", [out], [f"{layer}_act"]))
            current = f"{layer}_act"
    first, last = params[f"{layers[0]}_w"], params[f"{layers[-1]}_w"]
    return _model(
        nodes, [_value("x", ("M", first.shape[0]))], [_value(layers[-1], ("M", last.shape[1]))], inits, "mlp"
    )


def level_cell_graph(params: dict, hidden: int) -> bytes:
    """One TreeLSTM level (examples/treelstm.py's internal cell): inputs hcat [M, 2H]
    (the children's h side by side), c_l, c_r [M, H]; outputs h, c [M, H]."""
    from onnx import TensorProto, helper

    inits = [
        _tensor("u", params["u"]),
        _tensor("b", params["b"]),
        helper.make_tensor("split", TensorProto.INT64, [5], [hidden] * 5),
    ]
    gate_names = ("i", "o", "g", "f_l", "f_r")  # examples/treelstm.py's split order
    nodes = [
        helper.make_node("MatMul", ["hcat", "u"], ["gates_mm"]),
        helper.make_node("Add", ["gates_mm", "b"], ["gates"]),
        helper.make_node("Split", ["gates", "split"], [f"{g}_pre" for g in gate_names], axis=1),
    ]
    for g in ("i", "o", "f_l", "f_r"):
        nodes.append(helper.make_node("Sigmoid", [f"{g}_pre"], [g]))
    nodes += [
        helper.make_node("Tanh", ["g_pre"], ["g"]),
        helper.make_node("Mul", ["i", "g"], ["ig"]),
        helper.make_node("Mul", ["f_l", "c_l"], ["fc_l"]),
        helper.make_node("Mul", ["f_r", "c_r"], ["fc_r"]),
        helper.make_node("Add", ["ig", "fc_l"], ["c_part"]),
        helper.make_node("Add", ["c_part", "fc_r"], ["c"]),
        helper.make_node("Tanh", ["c"], ["tanh_c"]),
        helper.make_node("Mul", ["o", "tanh_c"], ["h"]),
    ]
    assert params["u"].shape == (2 * hidden, 5 * hidden), params["u"].shape
    inputs = [_value("hcat", ("M", 2 * hidden)), _value("c_l", ("M", hidden)), _value("c_r", ("M", hidden))]
    outputs = [_value("h", ("M", hidden)), _value("c", ("M", hidden))]
    return _model(nodes, inputs, outputs, inits, f"treelstm_level_h{hidden}")
