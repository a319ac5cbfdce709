"""Hugging Face transformers through from_torch (#37): torch.fx cannot trace them, so the
torch.export front end does (generator/importers/export.py). Config-built models (no
download), small sizes, random weights, eval mode, attention masks with padding; the
written file is checked by the numpy reference interpreter against PyTorch at the example
sizes and at another batch and sequence length (N and T stay symbolic), and BERT is also
compiled and run with the .npz loaded. Skipped without transformers."""

from __future__ import annotations

import numpy as np
import pytest

from generator.frontend.loader import load_model
from generator.importers import write_model
from generator.reference import interpreter as reference
from vision_models import torchvision

torch = pytest.importorskip("torch")
torchvision()  # transformers imports torchvision when it is installed: its schemas first
transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
             max_position_embeddings=32)
MODELS = {
    "bert": lambda t: t.BertModel(t.BertConfig(**SMALL)),
    "distilbert": lambda t: t.DistilBertModel(t.DistilBertConfig(vocab_size=50, dim=16, n_layers=2, n_heads=2,
                                                                 hidden_dim=32, max_position_embeddings=32)),
    "roberta": lambda t: t.RobertaModel(t.RobertaConfig(**SMALL)),
    "gpt2": lambda t: t.GPT2Model(t.GPT2Config(vocab_size=50, n_embd=16, n_layer=2, n_head=2, n_positions=32,
                                               use_cache=False, bos_token_id=0, eos_token_id=0)),
    "bart_encoder": lambda t: t.BartModel(t.BartConfig(vocab_size=50, d_model=16, encoder_layers=2, decoder_layers=1,
                                                       encoder_attention_heads=2, decoder_attention_heads=2,
                                                       encoder_ffn_dim=32, decoder_ffn_dim=32,
                                                       max_position_embeddings=32)).get_encoder(),
}


def make(kind):
    torch.manual_seed(0)
    module = MODELS[kind](transformers).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms and biases start constant: random, so that a mix-up shows
        for _, t in module.named_parameters():
            if bool((t == t.flatten()[0]).all()):
                t.add_(torch.randn(t.shape, generator=g) * 0.1)
    return module


def batch(n, t, seed):
    """Token ids (none is a padding id: RoBERTa's positions count them) and a mask padding
    the tails of two rows."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 50, (n, t), generator=g)
    mask = torch.ones(n, t, dtype=torch.int64)
    mask[1, t - 2:] = 0
    mask[-1, 3:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _import(kind, tmp_path):
    import generator as dg

    module = make(kind)
    source, weights = dg.from_torch(module, batch(2, 7, 2), name=kind)
    model_path, weights_path = write_model(source, weights, str(tmp_path / f"{kind}.py"))
    return module, source, load_model(model_path).build(), weights, weights_path


@pytest.mark.parametrize("kind", list(MODELS))
def test_imports_and_matches_torch(kind, tmp_path):
    module, source, graph, weights, _ = _import(kind, tmp_path)
    assert "(torch.export)" in source and "dg.key_mask(attention_mask)" in source
    assert ("dg.causal_mask(T)" in source) == (kind == "gpt2")
    for n, t in ((2, 7), (3, 5)):  # the example's sizes, and others: N and T are symbolic
        inputs = batch(n, t, 3 + n)
        with torch.no_grad():
            want = module(**inputs)
        got = reference.run(graph, {k: v.numpy() for k, v in inputs.items()}, dict(weights), training=False)
        assert set(got) == {k for k, v in want.items() if torch.is_tensor(v)}
        for key, value in got.items():
            expected = want[key].numpy()
            assert float(np.abs(value - expected).max() / np.abs(expected).max()) <= 1e-4, (key, n, t)


def test_statements_are_named_after_module_paths_and_cite_the_source(tmp_path):
    _, source, _, weights, _ = _import("bert", tmp_path)
    # (inside bert_layer(x, ..., name="encoder_layer_0"): the path after the layer's prefix)
    assert "attention_self_query = dg.linear_t(" in source and 'name="encoder_layer_0"' in source
    assert "# modeling_bert.py:" in source
    assert weights.torch_keys["encoder_layer_0_attention_self_query_weight"] == [
        "encoder.layer.0.attention.self.query.weight"]


def test_padding_only_row_is_a_run_time_error(tmp_path):
    _, _, graph, weights, _ = _import("distilbert", tmp_path)
    inputs = {k: v.numpy() for k, v in batch(2, 5, 4).items()}
    inputs["attention_mask"][1] = 0
    with pytest.raises(ValueError, match="row 1 keeps no position"):
        reference.run(graph, inputs, dict(weights), training=False)


def test_generated_bert_matches_torch(tmp_path, builds):
    module, _, graph, _, weights_path = _import("bert", tmp_path)
    compiled, _ = builds.module(graph)
    model = compiled.Model()
    model.load(weights_path)
    model.eval()
    inputs = batch(3, 6, 5)
    with torch.no_grad():
        want = module(**inputs)
    got = model.forward(**{k: v.numpy() for k, v in inputs.items()})
    for key in ("last_hidden_state", "pooler_output"):
        np.testing.assert_allclose(got[key], want[key].numpy(), rtol=1e-4, atol=1e-4)
