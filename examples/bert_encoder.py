"""A BERT-style encoder over a batch of padded token sequences: token and position
embeddings, layer norm, then L post-norm Transformer encoder layers (GELU) whose
attention ignores the padding past each sequence's length.

    deepgen memory examples/bert_encoder.py --batch 8 --dim T=128               # the small model
    deepgen memory examples/bert_encoder.py --option size=base --batch 8 --dim T=128
    deepgen generate examples/bert_encoder.py -o build/bert                      # the C++ project

`size="small"` (the default, what the tests build) or `"base"` (BERT-base's shape:
hidden 768, 12 heads, FFN 3072, 12 layers; `layers=` picks another depth). With
`train=True` a classifier on the first token ([CLS]) is trained with Adam.

Parameter names are the state_dict keys of the PyTorch twin (an nn.Embedding per
table, nn.LayerNorm, nn.TransformerEncoder(batch_first=True), a tanh pooler and a
classifier) with dots as underscores: `embeddings_word_embeddings_weight`,
`encoder_layers_0_self_attn_in_proj_weight`, ..., so its weights load one to one.
"""

import generator as dg

N, T = dg.dim("N"), dg.dim("T")

SIZES = {
    "small": {"vocab": 100, "hidden": 32, "heads": 4, "ffn": 64, "layers": 2, "max_len": 64},
    "base": {"vocab": 30522, "hidden": 768, "heads": 12, "ffn": 3072, "layers": 12, "max_len": 512},
}
CLASSES = 2  # of the sequence classifier (train=True)


@dg.model
def bert_encoder(size: str = "small", layers: int = 0, train: bool = False):
    """`layers`: the encoder's depth (0: the size's own)."""
    cfg = SIZES[size]
    H, depth = cfg["hidden"], layers or cfg["layers"]
    tokens = dg.input("tokens", (N, T), dtype="int64")
    lengths = dg.input("lengths", (N,), dtype="int64")  # each in [1, T]; tokens past it are padding
    word = dg.param("embeddings_word_embeddings_weight", (cfg["vocab"], H), init=dg.normal(0, 0.02))
    position = dg.param("embeddings_position_embeddings_weight", (cfg["max_len"], H), init=dg.normal(0, 0.02))
    norm_w = dg.param("embeddings_norm_weight", (H,), init=dg.ones())
    norm_b = dg.param("embeddings_norm_bias", (H,), init=dg.zeros())
    embedded = dg.gather(word, tokens) + position[:T]  # needs T <= max_len
    x = dg.layer_norm(embedded, norm_w, norm_b, eps=1e-12)
    for i in range(depth):
        x = dg.transformer_encoder_layer(x, lengths, H, cfg["heads"], cfg["ffn"], activation="gelu", eps=1e-12,
                                         name=f"encoder_layers_{i}")
    outputs = {"hidden": x}
    if train:
        first = dg.reshape(x[:, :1], (N, H))  # the [CLS] token's state
        pooled = dg.tanh(dg.linear_t(first, dg.param("pooler_weight", (H, H), init=dg.normal(0, 0.02)),
                                     dg.param("pooler_bias", (H,), init=dg.zeros())))
        logits = dg.linear_t(pooled, dg.param("classifier_weight", (CLASSES, H), init=dg.normal(0, 0.02)),
                             dg.param("classifier_bias", (CLASSES,), init=dg.zeros()))
        labels = dg.input("labels", (N,), dtype="int64")
        dg.train(dg.softmax_cross_entropy(logits, labels), dg.adam(lr=1e-4))
        outputs["logits"] = logits
    return outputs
