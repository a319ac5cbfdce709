"""A bag-of-words text classifier: token ids [N, T] -> mean embedding -> tanh -> class probabilities.

Both the batch size N and the sequence length T are symbolic: one build serves any of them.
"""

import sympy

import generator as dg

N = dg.dim("N")  # sentences per batch
T = dg.dim("T")  # tokens per sentence

VOCAB, WIDTH, HIDDEN, CLASSES = 1000, 64, 32, 5

# A user-defined activation: its C++ code (and later its gradient) come from this expression.
swish = dg.elementwise(lambda x: x / (1 + sympy.exp(-x)), "swish")


@dg.model
def bow():
    tokens = dg.input("tokens", (N, T), dtype="int64")
    words = dg.embedding(tokens, VOCAB, WIDTH)  # [N, T, WIDTH]
    sentence = dg.mean(words, axis=1)  # [N, WIDTH]
    hidden = swish(dg.dense(sentence, HIDDEN, name="proj"))
    logits = dg.dense(hidden, CLASSES)
    return {"probs": dg.softmax(logits), "sentence": sentence}
