"""One elementwise kernel per distinct body, named for what it computes.

`ewise_kernel` prints a kernel that names nothing of the model's (operands x0,
x1, ..., out; sizes as arguments), so nodes computing the same expression over
the same broadcast pattern get the same text whatever their values are called
and however large they are: the ReLU after every batch norm of a ResNet is one
`relu` called with each layer's element count. The table keeps one kernel per
body and names it after its function chain (relu, add_relu, d_relu). Two
different bodies with the same chain are told apart by how they read their
operands (`shape_words`: add_bias, add_rows, mul_strided; then by the value
the first of them computed: mul_strided_mapped_for_node_c); a number is the
last resort. The name of
a body depends only on the bodies before it, so every call of one body,
wherever it is, calls the same name.
"""

from __future__ import annotations

from ..ir.names import fresh_name, is_reserved

# A shared kernel's comment cites the DSL statements it was made for, up to this many.
MAX_PLACES = 4


def body_key(kernel) -> tuple:
    """Everything a kernel's definition prints except its name and comment."""
    return (tuple((a.ctype, a.name) for a in kernel.args), tuple(kernel.loops), tuple(kernel.temps),
            kernel.assign, kernel.work)


class KernelTable:
    """The project's kernels (`kernels`, the plan's list, which epilogue functors
    and update kernels join too) with each elementwise body once."""

    def __init__(self, kernels: list):
        self.kernels = kernels
        self._by_body = {}  # body_key -> the Kernel
        self._places = {}  # kernel name -> (header line or "", [DSL lines it was made for])

    def add(self, use, header: str, places: list) -> str:
        """The name of the kernel computing `use.kernel`'s body: the one made before,
        or this one, named and added. `header` ("fuses add, relu:") and `places`
        (the DSL statements) make its comment, which later uses extend."""
        key = body_key(use.kernel)
        kernel = self._by_body.get(key)
        if kernel is None:
            kernel = use.kernel
            kernel.name = self._name(use)
            self._by_body[key] = kernel
            self._places[kernel.name] = (header, [])
            self.kernels.append(kernel)
        header, seen = self._places[kernel.name]
        seen.extend(p for p in places if p not in seen)
        kernel.comment = _comment(header, seen)
        return kernel.name

    def _name(self, use) -> str:
        """The chain, with the ways it reads its operands (each way once; then each
        operand's: add_x0_strided_x1_bias), or at last a number."""
        taken = {k.name for k in self.kernels}
        base = use.chain if not is_reserved(use.chain) else f"{use.chain}_kernel"
        words = use.shape_words
        end = ["epilogue"] if use.kernel.kind == "epilogue" else []  # a functor: add_bias_epilogue
        first = "_".join([base] + _ways(words) + end)
        candidates = [first]
        value = "_".join(p for p in use.value.split("_") if not p.isdigit())  # node_c_2 -> node_c
        if value and not is_reserved(value):  # the value it was first made for: ..._for_node_c
            candidates.append(f"{first}_for_{value}")
        for name in candidates:
            if name not in taken:
                return name
        return fresh_name(candidates[-1], taken)


# A way of reading an operand that several operands share, said once in the plural
# (add_biases_epilogue adds two biases; add_bias_epilogue one).
_PLURAL = {"bias": "biases", "scalar": "scalars"}


def _ways(words: list) -> list:
    """Each way the kernel reads its operands, once, in the order of their first operand."""
    counts = {}
    for _, w in words:
        counts[w] = counts.get(w, 0) + 1
    return [_PLURAL.get(w, w) if n > 1 else w for w, n in counts.items()]


def _comment(header: str, places: list) -> str:
    shown = places[:MAX_PLACES]
    if len(places) > MAX_PLACES:
        shown.append(f"and {len(places) - MAX_PLACES} more statements")
    return "\n".join(([header] if header else []) + shown)
