"""examples/seq2seq_decode.py (issue #42): greedy decoding by dg.while_loop until each
string's end token. The generated module's decoded tokens and step counts against a
PyTorch twin with the module's weights that decodes one example at a time, eagerly,
in a Python while loop; then the example trained to its held-out exact match."""

from __future__ import annotations

import runpy

import numpy as np
import pytest

from conftest import ROOT, build_example


@pytest.fixture(scope="module")
def seq2seq(builds):
    example = runpy.run_path(str(ROOT / "examples" / "seq2seq_decode.py"))
    module, _ = builds.module(build_example("seq2seq_decode"))  # the build tests/test_examples.py checks
    return example, module


def _twin_decode(torch, p, source, length, ex):
    """One example, eagerly: nn.GRU over its digits, then the decoder cell fed its own
    best token until EOS or MAX_STEPS."""
    hidden = p["decoder_w_hh"].shape[0]
    gru = torch.nn.GRU(ex["EMBED"], hidden, batch_first=True).double()
    with torch.no_grad():
        for key in ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0"):
            getattr(gru, key).copy_(p[f"encoder_{key}"])
    embed = p["embed"]
    _, h_n = gru(embed[source[:length]][None])
    context, h = h_n[0], torch.zeros(1, hidden, dtype=torch.float64)
    token, tokens = ex["BOS"], []
    while len(tokens) < ex["MAX_STEPS"] and token != ex["EOS"]:
        x = torch.cat([embed[token][None], context], dim=1)
        r_x, z_x, n_x = (x @ p["decoder_w_ih"] + p["decoder_b_ih"]).chunk(3, dim=1)
        r_h, z_h, n_h = (h @ p["decoder_w_hh"] + p["decoder_b_hh"]).chunk(3, dim=1)
        r, z = torch.sigmoid(r_x + r_h), torch.sigmoid(z_x + z_h)
        h = (1 - z) * torch.tanh(n_x + r * n_h) + z * h
        token = int((h @ p["out_w"] + p["out_b"]).argmax())
        tokens.append(token)
    return tokens


def _check_against_twin(torch, example, model, data):
    p = {k: torch.tensor(np.asarray(v), dtype=torch.float64) for k, v in model.parameters().items()}
    out = model.forward(source=data["source"], source_lengths=data["source_lengths"])
    assert out["steps"].dtype == np.int64
    got = example["decoded"](out)
    want = [_twin_decode(torch, p, s, n, example) for s, n in zip(data["source"], data["source_lengths"])]
    assert got == want
    assert list(out["steps"]) == [len(w) for w in want]
    for t, n in zip(out["tokens"], out["steps"]):  # zeros past each example's count
        assert not t[n:].any() and (t[:n].sum(axis=1) == 1).all()
    return want


def test_decoding_matches_a_per_example_pytorch_twin(seq2seq):
    torch = pytest.importorskip("torch")
    example, module = seq2seq
    model = module.Model(seed=3)
    data = example["make_strings"](6, 7)
    _check_against_twin(torch, example, model, data)


def test_trained_model_reverses_held_out_strings(seq2seq):
    torch = pytest.importorskip("torch")
    example, module = seq2seq
    model, exact = example["train"](module, log=lambda *_: None)
    assert exact >= 0.95
    # trained, the examples stop at different steps (their own EOS), as the twin does
    data = example["make_strings"](8, 11)
    want = _check_against_twin(torch, example, model, data)
    assert len({len(w) for w in want}) >= 2


def test_decoding_loop_reads_as_compaction_over_the_examples_still_decoding():
    """The generated while loop: each step one batched block of the examples still
    decoding (cond_fn `still_decoding`), listed by index in `live`; no per-example loop."""
    from generator.pipeline import project_files

    example = runpy.run_path(str(ROOT / "examples" / "seq2seq_decode.py"))
    code = project_files(example["seq2seq_decode"].build())["src/model.cpp"].decode()
    loop = code[code.index("// One batched step per loop step, over the examples still decoding only"):]
    loop = loop[: loop.index("\n  }\n")]
    assert "// The examples still decoding (their previous step ran), listed by index in `live`:" in loop
    assert "const std::int64_t rows_2 = dg::still_running(" in loop
    assert "// No example is still decoding: the steps left would change nothing.\n    if (rows_2 == 0) break;" in loop
    assert "dg::any_running" not in code and "for (std::int64_t n" not in loop
    masked = project_files(example["seq2seq_decode"].build(compact=False))["src/model.cpp"].decode()
    assert "dg::still_running" not in masked and "if (!dg::any_running(running_prev.data(), rows_2)) break;" in masked
