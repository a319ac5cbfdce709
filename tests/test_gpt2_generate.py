"""examples/gpt2_generate.py (issue #42): greedy generation with a key/value cache as a
dg.while_loop's state. The generated module with a config-built Hugging Face
GPT2LMHeadModel's weights (loaded by name) against that model's generate(do_sample=False),
the module against the numpy reference, the C++ example program printing the
continuation, and the loop's code (one batched step over the sequences still generating)."""

from __future__ import annotations

import runpy
import subprocess

import numpy as np
import pytest

from conftest import ROOT, build_example
from generator.reference import interpreter as reference
from vision_models import torchvision

torch = pytest.importorskip("torch")
torchvision()  # transformers imports torchvision when it is installed: its schemas first
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gpt2(builds):
    example = runpy.run_path(str(ROOT / "examples" / "gpt2_generate.py"))
    graph = build_example("gpt2_generate")  # the build tests/test_examples.py checks
    module, where = builds.module(graph)
    hf = example["hf_model"]()
    weights = example["hf_weights"](hf)
    model = module.Model()
    for name, value in weights.items():
        model.parameters()[name][...] = value
    return example, graph, model, where, hf, weights


def test_weights_map_by_name_onto_every_parameter(gpt2):
    example, _, model, _, hf, weights = gpt2
    assert set(weights) == set(model.parameters())
    assert (
        "transformer_h_1_attn_c_attn_weight" in weights
    )  # transformer.h.1.attn.c_attn.weight, Conv1D [in, out]
    assert weights["transformer_h_1_attn_c_attn_weight"].shape == (example["EMBED"], 3 * example["EMBED"])
    np.testing.assert_array_equal(weights["transformer_wte_weight"], hf.lm_head.weight.detach().numpy())


def test_tokens_equal_hugging_face_generate(gpt2):
    example, _, model, _, hf, _ = gpt2
    prompts = example["prompts"](24, 5)
    out = model.forward(prompt=prompts)
    got, want = example["continuations"](out), example["hf_generate"](hf, prompts)
    assert got == want
    # the loop is data dependent: sequences end at different steps, some at EOS, some at MAX_NEW
    lengths = [len(w) for w in want]
    assert len(set(lengths)) >= 3 and min(lengths) < example["MAX_NEW"] == max(lengths), lengths
    assert list(out["length"]) == lengths and list(out["steps"]) == [n - 1 for n in lengths]
    eos = example["EOS"]
    for row, n in zip(out["continuation"], lengths):  # padded with EOS, as generate() pads with pad_token_id
        assert (row[n:] == eos).all() and (row[n - 1] == eos or n == example["MAX_NEW"])
        assert eos not in row[: n - 1]


def test_one_prompt_at_a_time_gives_the_same_tokens(gpt2):
    example, _, model, _, hf, _ = gpt2
    prompts = example["prompts"](6, 8)
    batched = example["continuations"](model.forward(prompt=prompts))
    assert batched == [example["continuations"](model.forward(prompt=p[None]))[0] for p in prompts]
    assert batched == example["hf_generate"](hf, prompts)


def test_module_matches_the_numpy_reference(gpt2):
    example, graph, model, _, _, weights = gpt2
    prompts = example["prompts"](9, 3)
    want = reference.run(graph, {"prompt": prompts}, dict(weights), training=False)
    got = model.forward(prompt=prompts)
    assert set(got) == set(want) == {"continuation", "length", "steps"}
    for key in want:
        assert got[key].dtype == np.int64
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_example_program_prints_the_continuation(gpt2, tmp_path):
    """The generated project is a standalone generator: prompt ids on the command line,
    weights from the .npz the Hugging Face model's state_dict makes, the continuation
    printed a line per prompt."""
    example, graph, _, where, hf, weights = gpt2
    np.savez(tmp_path / "gpt2.npz", **weights)
    prompts = example["prompts"](3, 12)
    ids = ",".join(str(int(v)) for v in prompts.reshape(-1))
    proc = subprocess.run(
        [
            str(where / "build" / f"{graph.name}_example"),
            "--weights",
            str(tmp_path / "gpt2.npz"),
            "--values",
            f"prompt={ids}",
            "--print",
            "continuation",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("continuation[")]
    printed = [[int(v) for v in r.split(":")[1].split()] for r in rows]
    want = example["hf_generate"](hf, prompts)
    eos, longest = example["EOS"], example["MAX_NEW"]
    assert printed == [w + [eos] * (longest - len(w)) for w in want]


def test_loop_reads_as_one_batched_step_over_the_sequences_still_generating():
    """The generated while loop: each step one batched block of the sequences still
    generating (cond_fn `still_generating`), listed by index; no per-example loop."""
    from generator.pipeline import project_files

    example = runpy.run_path(str(ROOT / "examples" / "gpt2_generate.py"))
    code = project_files(example["gpt2_generate"].build())["src/model.cpp"].decode()
    loop = code[code.index("// One batched step per loop step, over the examples still generating only") :]
    loop = loop[: loop.index("\n  }\n")]
    assert "// The examples still generating (their previous step ran), listed by index in `live`:" in loop
    assert "dg::still_running(" in loop and "// No example is still generating" in loop
    assert "for (std::int64_t n" not in loop and "dg::any_running" not in code
