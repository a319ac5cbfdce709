"""A GPT-2-style decoder that generates greedily, its key/value cache the state of a
dg.while_loop, each sequence until its end token (EOS) or MAX_NEW tokens.

    python examples/gpt2_generate.py   # generates, builds; the tokens against Hugging Face's generate()

(then it saves the Hugging Face weights beside the project and prints how to build and run the
project's C++ example program, a text generator: prompt ids in, the continuation printed).

The decoder is written here in the DSL (the importer traces a forward pass over whole
sequences; it has no step function that reads and writes a cache). Its parameters have
the names of a Hugging Face GPT2LMHeadModel's state_dict, dots as underscores
(`transformer.h.0.attn.c_attn.weight` is `transformer_h_0_attn_c_attn_weight`; the LM
head is tied to `transformer.wte.weight`, as GPT-2's is), and their shapes (Conv1D keeps
its weight [in, out]): `hf_weights` reads a model's weights by name, so a config-built
GPT2LMHeadModel and this file compute the same tokens.

`prompt` [N, PROMPT] (every prompt PROMPT tokens long) is first run whole, with causal
attention (the prefill): its keys and values fill positions 0..PROMPT-1 of each layer's
cache [N, heads, POSITIONS, head] (zeros past them) and its last position's logits give
the first new token. Then the loop: each step feeds every sequence still generating its
last token at its position, writes the token's key and value into the cache at that
position, attends over the positions up to it, and takes the best next token (greedy).
A sequence stops after its EOS; each loop step is one batched step over the sequences
still generating (compaction by index lists), and the loop ends when none is.

Outputs: `continuation` int64 [N, MAX_NEW], the new tokens, padded with EOS after a
sequence's EOS (as generate() pads with pad_token_id = EOS), and `length` int64 [N],
the new tokens of each sequence (its EOS counted).
"""

import sys
from pathlib import Path

import numpy as np

import generator as dg

N = dg.dim("N")
VOCAB, EMBED, LAYERS, HEADS = 64, 32, 2, 4
HEAD = EMBED // HEADS
PROMPT, MAX_NEW = 6, 10
POSITIONS = PROMPT + MAX_NEW - 1  # the cache: the last new token is never fed back
N_POSITIONS = PROMPT + MAX_NEW  # the Hugging Face config's n_positions (wpe's rows)
EOS = 22  # a token the seeded model below emits often (one new token in ten): sequences stop at varied steps
NEG = -1e30  # the additive mask past the current position


def gelu_tanh(x):
    """GPT-2's GELU (Hugging Face's "gelu_new"): the tanh approximation."""
    return 0.5 * x * (1.0 + dg.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


def block_params(i):
    """Layer i's parameters, named after the Hugging Face state_dict."""
    p = f"transformer_h_{i}_"
    shapes = {
        "ln_1_weight": (EMBED,),
        "ln_1_bias": (EMBED,),
        "attn_c_attn_weight": (EMBED, 3 * EMBED),
        "attn_c_attn_bias": (3 * EMBED,),
        "attn_c_proj_weight": (EMBED, EMBED),
        "attn_c_proj_bias": (EMBED,),
        "ln_2_weight": (EMBED,),
        "ln_2_bias": (EMBED,),
        "mlp_c_fc_weight": (EMBED, 4 * EMBED),
        "mlp_c_fc_bias": (4 * EMBED,),
        "mlp_c_proj_weight": (4 * EMBED, EMBED),
        "mlp_c_proj_bias": (EMBED,),
    }

    def init(key):  # GPT-2's: layer norm weights 1, biases 0, weights normal(0, 0.02)
        if key.startswith("ln") and key.endswith("weight"):
            return dg.ones()
        return dg.zeros() if key.endswith("bias") else dg.normal(0.0, 0.02)

    return {k: dg.param(p + k, s, init=init(k)) for k, s in shapes.items()}


def heads(x, rows, length):
    """[rows * length, EMBED] -> [rows, HEADS, length, HEAD] (one position: a view)."""
    if length == 1:
        return dg.reshape(x, (rows, HEADS, 1, HEAD))
    return dg.transpose(dg.reshape(x, (rows, length, HEADS, HEAD)), (0, 2, 1, 3))


def project_qkv(x, p):
    """The block's first half begins: ln_1, then c_attn; q, k and v of x [rows, EMBED]."""
    h = dg.layer_norm(x, p["ln_1_weight"], p["ln_1_bias"])
    qkv = h @ p["attn_c_attn_weight"] + p["attn_c_attn_bias"]
    q, k, v = dg.split(qkv, 3, axis=1)
    return q, k, v


def mlp(x, p):
    """The block's second half: x + the MLP of ln_2(x); x is [rows, EMBED]."""
    h = dg.layer_norm(x, p["ln_2_weight"], p["ln_2_bias"])
    h = gelu_tanh(h @ p["mlp_c_fc_weight"] + p["mlp_c_fc_bias"])
    return x + (h @ p["mlp_c_proj_weight"] + p["mlp_c_proj_bias"])


def attention(q, keys, values, mask, p, rows, length):
    """Attention of q [rows, HEADS, length, HEAD] over keys and values [rows, HEADS, T, HEAD]
    (additive mask broadcast to [rows, HEADS, length, T]), heads joined and projected:
    [rows * length, EMBED]."""
    weights = dg.softmax(dg.bmm(q * (1.0 / HEAD**0.5), keys, tb=True), axis=-1, mask=mask)
    context = dg.bmm(weights, values)  # [rows, HEADS, length, HEAD]
    joined = dg.reshape(
        context if length == 1 else dg.transpose(context, (0, 2, 1, 3)), (rows * length, EMBED)
    )
    return joined @ p["attn_c_proj_weight"] + p["attn_c_proj_bias"]


def counting(zero, length):
    """0, 1, ..., length - 1 in each row, [rows, length], from a column of zeros [rows, 1]."""
    return dg.cumsum(dg.expand(zero + 1.0, (zero.shape[0], length)), 1) - 1.0


def best_token(x, ln_f_weight, ln_f_bias, wte):
    """The one-hot [rows, VOCAB] of the greedy next token after the hidden states x
    [rows, EMBED]: the LM head is wte transposed."""
    logits = dg.matmul(dg.layer_norm(x, ln_f_weight, ln_f_bias), wte, tb=True)
    return dg.cast(logits >= dg.max(logits, 1, keepdims=True), "float32")


@dg.model
def gpt2_generate(compact=None):
    # compact: the while loop's rule (None: compaction), or False (masking) to compare them.
    prompt = dg.input("prompt", (N, PROMPT), dtype="int64")
    wte = dg.param("transformer_wte_weight", (VOCAB, EMBED), init=dg.normal(0.0, 0.02))
    wpe = dg.param("transformer_wpe_weight", (N_POSITIONS, EMBED), init=dg.normal(0.0, 0.01))
    layers = [block_params(i) for i in range(LAYERS)]
    ln_f_weight = dg.param("transformer_ln_f_weight", (EMBED,), init=dg.ones())
    ln_f_bias = dg.param("transformer_ln_f_bias", (EMBED,), init=dg.zeros())
    wpe_used = dg.slice_axis(wpe, 0, 0, POSITIONS)  # [POSITIONS, EMBED]: the positions a cache holds

    # The prefill: the whole prompt, causal attention; the caches hold its keys and values.
    embedded = dg.gather(wte, prompt)  # [N, PROMPT, EMBED]
    x = dg.reshape(
        embedded + dg.reshape(dg.slice_axis(wpe, 0, 0, PROMPT), (1, PROMPT, EMBED)), (N * PROMPT, EMBED)
    )
    causal = dg.causal_mask(PROMPT)
    zero = dg.slice_axis(dg.cast(prompt, "float32"), 1, 0, 1) * 0.0  # [N, 1]
    later = dg.expand(dg.reshape(zero, (N, 1, 1, 1)), (N, HEADS, POSITIONS - PROMPT, HEAD))  # past the prompt
    caches = []
    for p in layers:
        q, k, v = (heads(t, N, PROMPT) for t in project_qkv(x, p))
        x = mlp(x + attention(q, k, v, causal, p, N, PROMPT), p)
        caches += [dg.concat([k, later], axis=2), dg.concat([v, later], axis=2)]
    last = dg.reshape(dg.slice_axis(dg.reshape(x, (N, PROMPT, EMBED)), 1, PROMPT - 1, PROMPT), (N, EMBED))
    first = best_token(last, ln_f_weight, ln_f_bias, wte)
    # the one-hot of the position the first new token takes
    place = dg.cast(counting(zero, POSITIONS) == float(PROMPT), "float32")

    # The loop: one batched step over the sequences still generating.
    def still_generating(s):
        token = s[0]
        return dg.sum(dg.slice_axis(token, 1, EOS, EOS + 1), 1) < 0.5

    def generate_step(s):
        token, place, *cache = s
        rows = token.shape[0]
        x = token @ wte + place @ wpe_used  # the token's embedding at its position, [rows, EMBED]
        at = dg.reshape(place, (rows, 1, POSITIONS, 1))
        upto = 1.0 - dg.cumsum(place, 1) + place  # 1 at the positions up to the token's
        mask = dg.reshape(dg.where(upto > 0.5, 0.0, NEG), (rows, 1, 1, POSITIONS))
        written = []
        for i, p in enumerate(layers):
            q, k, v = (heads(t, rows, 1) for t in project_qkv(x, p))
            keys = cache[2 * i] + at * k  # the new key written at its position
            values = cache[2 * i + 1] + at * v
            x = mlp(x + attention(q, keys, values, mask, p, rows, 1), p)
            written += [keys, values]
        before = dg.slice_axis(place, 1, 0, POSITIONS - 1)
        step = dg.concat([dg.slice_axis(place, 1, 0, 1) * 0.0, before], axis=1)  # the next position
        return (best_token(x, ln_f_weight, ln_f_bias, wte), step, *written)

    names = ["token", "place"] + [f"layer{i}_{kv}" for i in range(LAYERS) for kv in ("keys", "values")]
    _, steps, every = dg.while_loop(
        still_generating,
        generate_step,
        (first, place, *caches),
        MAX_NEW - 1,
        outputs=True,
        names=names,
        compact=compact,
    )
    tokens = dg.concat(
        [dg.reshape(first, (N, 1, VOCAB)), every[0]], axis=1
    )  # [N, MAX_NEW, VOCAB], zeros past
    ids = dg.reshape(counting(zero, VOCAB), (N, 1, VOCAB))  # each token's id
    made = dg.sum(tokens, 2)  # 1 for a new token, 0 past the sequence's end
    continuation = dg.sum(tokens * ids, 2) + float(EOS) * (1.0 - made)
    return {
        "continuation": dg.cast(continuation, "int64"),
        "length": dg.cast(dg.sum(made, 1), "int64"),
        "steps": steps,
    }


# ----------------------------------------------------------------------------
# Hugging Face: the same model, its weights by name, its generate()
# ----------------------------------------------------------------------------


def _transformers():
    """transformers, imported. It imports torchvision when that is installed, whose import
    fails beside a CPU-only torch unless the schemas of its ops nms and qnms exist: they
    are defined first when missing (tests/vision_models.py does the same)."""
    import importlib.util

    import torch

    if "torchvision" not in sys.modules and importlib.util.find_spec("torchvision") is not None:
        try:
            torch.ops.torchvision.nms.default
        except (AttributeError, RuntimeError):
            global _SCHEMAS
            _SCHEMAS = torch.library.Library("torchvision", "DEF")
            for op in ("nms", "qnms"):
                _SCHEMAS.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    import transformers

    return transformers


def hf_model(seed: int = 0):
    """A config-built GPT2LMHeadModel of this file's sizes, seeded random weights (no
    download), eval mode. initializer_range 0.5: GPT-2's 0.02 makes near-uniform logits
    and continuations that barely depend on the prompt."""
    import torch

    transformers = _transformers()

    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=EMBED,
        n_layer=LAYERS,
        n_head=HEADS,
        n_positions=N_POSITIONS,
        bos_token_id=EOS,
        eos_token_id=EOS,
        initializer_range=0.5,
    )  # pad_token_id: generate()'s argument
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # layer norms and biases start constant: random instead
        for name, t in model.named_parameters():
            if ".ln_" in name or name.endswith("bias"):
                t.add_(torch.randn(t.shape, generator=g) * 0.1)
    return model


def hf_weights(model) -> dict:
    """The model's parameters by this file's names (state_dict keys, dots as
    underscores); lm_head.weight is wte's (tied), checked and left out."""
    state = model.state_dict()
    assert (
        state["lm_head.weight"].data_ptr() == state["transformer.wte.weight"].data_ptr()
    ), "lm_head is not tied"
    return {
        k.replace(".", "_"): v.detach().numpy().astype(np.float32)
        for k, v in state.items()
        if k != "lm_head.weight" and not k.endswith(".attn.bias") and not k.endswith(".masked_bias")
    }


def hf_generate(model, prompt: np.ndarray) -> list:
    """generate(do_sample=False) with the model's cache: each sequence's new tokens up
    to and with its EOS."""
    import torch

    ids = torch.as_tensor(prompt, dtype=torch.int64)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=MAX_NEW,
            eos_token_id=EOS,
            pad_token_id=EOS,
            use_cache=True,
        )
    result = []
    for row in out[:, PROMPT:].tolist():
        result.append(row[: row.index(EOS) + 1] if EOS in row else row)
    return result


def continuations(outputs) -> list:
    """Each sequence's new tokens from the generated module's outputs."""
    return [list(map(int, c[:n])) for c, n in zip(outputs["continuation"], outputs["length"])]


def prompts(count: int, seed: int) -> np.ndarray:
    """`count` seeded prompts without EOS."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB - 1, (count, PROMPT))
    return np.where(ids >= EOS, ids + 1, ids).astype(np.int64)


def main():
    from generator.pipeline import generate
    from generator.tools.build import build_project

    here = Path(__file__).resolve().parent
    project = here.parent / "build" / "gpt2_generate"
    generate(gpt2_generate.build(), project, force=True)
    build_project(project, target_dir=project / "site")
    sys.path.insert(0, str(project / "site"))
    import gpt2_generate as module  # noqa: E402  (the module just built)

    hf = hf_model()
    model = module.Model()
    for name, value in hf_weights(hf).items():
        model.parameters()[name][...] = value
    batch = prompts(8, 1)
    got, want = continuations(model.forward(prompt=batch)), hf_generate(hf, batch)
    for p, g in zip(batch, got):
        print(" ".join(map(str, p)), "->", " ".join(map(str, g)))
    print(f"equal to Hugging Face generate(do_sample=False): {got == want}")
    model.save(str(project / "hf_weights.npz"))
    ids = ",".join(map(str, batch[0]))
    print(
        f"The C++ text generator (weights saved to {project / 'hf_weights.npz'}):\n"
        f"  cmake -S {project} -B {project / 'cpp'} -DCMAKE_BUILD_TYPE=Release && cmake --build {project / 'cpp'}\n"
        f"  {project / 'cpp' / 'gpt2_generate_example'} --weights {project / 'hf_weights.npz'} "
        f"--values prompt={ids} --print continuation"
    )


if __name__ == "__main__":
    main()
