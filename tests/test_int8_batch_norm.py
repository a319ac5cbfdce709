"""`deepgen quantize` on a model with batch norm: calibration runs the model as the int8
project does (evaluation mode: the running statistics normalize, and stay as they are in
Wq.npz), not in training mode (the batch's statistics, which would also move the running
ones that the command writes out)."""

from __future__ import annotations

import numpy as np

from generator.reference import interpreter as reference
from generator.tools.cli import main as cli

MODEL_FILE = '''
import generator as dg
N = dg.dim("N")

@dg.model
def bn_int8():
    x = dg.input("x", (N, 8))
    h = dg.dense(x, 6, name="fc1")
    h = dg.relu(dg.batch_norm_layer(h, name="bn"))
    return {"y": dg.dense(h, 3, name="fc2")}
'''


def test_quantize_calibrates_batch_norm_in_evaluation_mode(tmp_path, capsys):
    from generator.frontend.loader import load_model

    model = tmp_path / "bn_int8.py"
    model.write_text(MODEL_FILE)
    fp32 = load_model(str(model)).build()
    params = reference.init_params(fp32, seed=0)
    rng = np.random.default_rng(1)
    params["bn_running_mean"] = rng.normal(size=6).astype(np.float32)
    params["bn_running_var"] = rng.uniform(0.5, 3.0, 6).astype(np.float32)
    np.savez(tmp_path / "w.npz", **params)
    x = rng.normal(size=(300, 8)).astype(np.float32)
    np.savez(tmp_path / "calib.npz", x=x)
    assert cli(["quantize", str(model), "--weights", str(tmp_path / "w.npz"), "--calibrate",
                str(tmp_path / "calib.npz"), "-o", str(tmp_path / "wq.npz")]) == 0
    capsys.readouterr()
    with np.load(tmp_path / "wq.npz") as f:
        wq = {k: f[k] for k in f.files}
    for k, v in params.items():  # every array of W.npz as it was, the running statistics included
        np.testing.assert_array_equal(wq[k], v, err_msg=k)
    # fc2 reads relu(batch norm of fc1) normalized by the running statistics
    h = x @ params["fc1_w"] + params["fc1_b"]
    h = (h - params["bn_running_mean"]) / np.sqrt(params["bn_running_var"] + np.float32(1e-5))
    h = np.maximum(h * params["bn_weight"] + params["bn_bias"], 0)
    np.testing.assert_allclose(wq["fc2_w_input_scale"], [np.abs(h).max() / 127], rtol=1e-5)
