"""Does the generated code compute the same bits as before a change?

    python benchmarks/same_bits.py --save /tmp/bits-before      # on the old tree
    python benchmarks/same_bits.py --check /tmp/bits-before     # on the new one

For each example (the CNNs at the small sizes the tests use) it generates the project,
builds it with CMake (once per distinct source: a cache keyed by the files' hash), and in
a child process records the forward outputs on the project's own sample inputs, then
two train steps (losses, outputs, every parameter and buffer). `--check` compares those
arrays byte for byte and names the first that differs. A codegen change that claims to
be a pure restructuring ("same bits") is checked this way.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> build options (the tests' small sizes)
EXAMPLES = {
    "mlp": {},
    "resnet18": {"image": 16, "width": 8},
    "bert_encoder": {},
    "lstm_classifier": {},
    "treelstm_sentiment": {},
    "gru_tagger": {},
    "childsum_treelstm": {},
}

CHILD = r"""
import sys, numpy as np
sys.path.insert(0, sys.argv[1])
module = __import__(sys.argv[2])
data = np.load(sys.argv[3])
inputs = {k[len("input/"):]: data[k] for k in data.files if k.startswith("input/")}
out = {}
model = module.Model(seed=0)
for k, v in model.forward(**inputs).items():
    out["forward/" + k] = np.asarray(v)
if hasattr(model, "train_step"):
    for step in range(2):
        out[f"loss/{step}"] = np.asarray(model.train_step(**inputs), np.float64)
    for k, v in model.forward(**inputs).items():
        out["trained/" + k] = np.asarray(v)
    for k, v in model.parameters().items():
        out["param/" + k] = np.array(v)
    for k, v in (model.buffers() if hasattr(model, "buffers") else {}).items():
        out["buffer/" + k] = np.array(v)
np.savez(sys.argv[4], **out)
"""


def record(name: str, options: dict, out: Path, cache: Path) -> None:
    from generator.codegen.writer import write_project
    from generator.frontend.loader import load_model
    from generator.pipeline import project_files
    from generator.tools.build import cmake_build

    graph = load_model(str(ROOT / "examples" / f"{name}.py")).build(None, **options)
    files = project_files(graph)
    digest = hashlib.sha256(b"".join(k.encode() + hashlib.sha256(v).digest() for k, v in sorted(files.items())))
    where = cache / f"{graph.name}-{digest.hexdigest()[:16]}"
    if not (where / "build" / ".ok").is_file():
        write_project(where / "src", files, force=True)
        cmake_build(where / "src", where / "build")
        (where / "build" / ".ok").write_text("ok\n")
    subprocess.run([sys.executable, "-c", CHILD, str(where / "build"), graph.name,
                    str(where / "src" / "tests" / "expected.npz"), str(out / f"{name}.npz")], check=True)


def compare(name: str, before: Path, after: Path) -> str | None:
    import numpy as np

    a, b = np.load(before / f"{name}.npz"), np.load(after / f"{name}.npz")
    if sorted(a.files) != sorted(b.files):
        return f"arrays differ: {sorted(set(a.files) ^ set(b.files))}"
    for key in a.files:
        if a[key].shape != b[key].shape or a[key].tobytes() != b[key].tobytes():
            return f"{key} differs (max |diff| {np.max(np.abs(a[key].astype(np.float64) - b[key])):.3g})"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--save", type=Path, help="record the current tree's results here")
    what.add_argument("--check", type=Path, help="record into a temporary folder and compare with this one")
    parser.add_argument("--only", nargs="*", default=list(EXAMPLES), help="examples (default: all)")
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "deepgen-same-bits")
    args = parser.parse_args()
    out = args.save or Path(str(args.check).rstrip("/") + "-now")
    out.mkdir(parents=True, exist_ok=True)
    failures = 0
    for name in args.only:
        record(name, EXAMPLES[name], out, args.cache)
        if args.check:
            problem = compare(name, args.check, out)
            failures += problem is not None
            print(f"{name:22s} {'same bits' if problem is None else 'DIFFERENT: ' + problem}")
        else:
            print(f"{name:22s} recorded")
    (out / "examples.json").write_text(json.dumps(args.only))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
