"""int8 over a batch of trees: `deepgen quantize` on the TreeLSTM sentiment example,
whose calibration file is one batch of trees (children and words per node, roots per
tree: arrays whose row counts differ, run whole), and the generated int8 module with
those scales against the reference (built at CHECK_BUILD_FLAGS' -O0: the test compares
values, not speed)."""

from __future__ import annotations

import runpy

import numpy as np

from conftest import CHECK_BUILD_FLAGS, ROOT, load_example
from generator.reference import interpreter as reference
from generator.tools.cli import main as cli
from generator.transforms.precision import set_precision

EXAMPLE = ROOT / "examples" / "treelstm_sentiment.py"


def _trees(count, seed) -> dict:
    example = runpy.run_path(str(EXAMPLE))
    return example["batch_of"](example["make_treebank"](count, seed))


def test_quantize_calibrates_on_a_batch_of_trees(tmp_path, builds, capsys):
    fp32 = load_example("treelstm_sentiment").build()
    params = reference.init_params(fp32, seed=0)
    np.savez(tmp_path / "w.npz", **params)
    calibration = _trees(60, seed=4)
    assert len(calibration["trees_roots"]) == 60 < len(calibration["trees_children"])  # rows per tree, per node
    np.savez(tmp_path / "calib.npz", **calibration)  # with the per-node labels, which the report reads
    assert cli(["quantize", str(EXAMPLE), "--weights", str(tmp_path / "w.npz"), "--calibrate",
                str(tmp_path / "calib.npz"), "-o", str(tmp_path / "wq.npz")]) == 0
    out = capsys.readouterr().out
    nodes = len(calibration["trees_children"])
    assert f"on {nodes} rows" in out and f"of {nodes} rows" in out, out
    with np.load(tmp_path / "wq.npz") as f:
        wq = {k: f[k] for k in f.files}
    # the classifier reads every node's h: its input scale is max |h| / 127 over the whole batch
    (h,) = [v for v in fp32.nodes[[n.op for n in fp32.nodes].index("recurse")].outputs if v.name == "h"]
    forward = {k: v for k, v in calibration.items() if k != "labels"}
    states = reference.run(fp32, forward, params, values=[h], training=False)["h"]
    np.testing.assert_array_equal(wq["logits_w_input_scale"], [np.abs(states).max() / np.float32(127)])

    graph = load_example("treelstm_sentiment").build("treelstm_sentiment_int8")
    set_precision(graph, "int8")
    module, _ = builds.module(graph, flags=CHECK_BUILD_FLAGS)
    model = module.Model(seed=0)
    model.load(str(tmp_path / "wq.npz"))
    for count, seed in ((1, 5), (30, 6)):
        feed = {k: v for k, v in _trees(count, seed).items() if k != "labels"}
        got = model.forward(**feed)["probs"]
        want = reference.run(graph, feed, wq)["probs"]
        exact = reference.run(fp32, feed, params)["probs"]
        # the recursion's float32 sums may differ from the reference's in the last bit, which
        # can move an activation across a quantizer boundary (as LeNet's, tests/test_int8.py)
        print(f"treelstm int8, {count} trees: generated vs reference {np.abs(got - want).max():.2e}, "
              f"int8 vs fp32 {np.abs(want - exact).max():.2e}")
        assert np.abs(got - want).max() <= 1e-3
        assert 0 < np.abs(want - exact).max() < 0.05
        assert np.mean(got.argmax(1) == want.argmax(1)) == 1.0
