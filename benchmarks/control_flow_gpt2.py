"""Benchmark: data-dependent control flow (#42), the GPT-2 generator's dg.while_loop
against Hugging Face's generate().

    python benchmarks/control_flow_gpt2.py [--quick] [--json FILE] [--rounds R]
    (also: python benchmarks/control_flow.py --gpt2 [--quick] ...)

The model is examples/gpt2_generate.py (2 layers, 4 heads, embedding 32, vocabulary 64,
prompts of 6 tokens, up to 10 new ones): a prefill, then greedy steps with the key/value
cache as the loop's state, each sequence until its EOS. The weights are a config-built
GPT2LMHeadModel's (the example's hf_model(), seeded: the same in every process), saved
once by the generated module's names (build/bench/gpt2_generate/hf_weights.npz) and loaded
by the generated peers, whose children do not import torch. Peers:

  deepgen         the generated module's forward(prompt=...), set_num_threads(n); its loop
                  compacted (each step one batched block of the sequences still generating)
  deepgen-masked  the same model built with while_loop(compact=False): every step runs every
                  sequence, the finished ones keep their state by `where`
  hf-generate     GPT2LMHeadModel.generate(do_sample=False, max_new_tokens=10, eos_token_id=EOS,
                  pad_token_id=EOS, use_cache=True), PyTorch eager, torch.inference_mode(),
                  torch.set_num_threads(n)

Workload: seeded prompts (the example's prompts(), seed 201 + batch), batch 1 (a set of 16
single prompts, so that the lengths vary from call to call) and batch 32 (a set of 2
batches; --quick: 8 and 1), timed as a set, reported per batch. Before timing, every child
checks its peer's tokens against the generated module's on every batch and refuses to time
different functions. Each (round, thread count, peer) runs in a child process of its own
with the thread variables set before numpy or torch is imported (benchmarks/_common.py);
the peers' order alternates from round to round; medians pooled over 3 rounds (--rounds;
1 with --quick). Table: ms per batch (median); ratio = peer time / deepgen time (> 1:
deepgen is faster). A 2-thread cell whose median is over twice the same peer's 1-thread
one is starred: its threads waited for a core.

Run time on a 2-core VM with another process holding about one core: about 3.5 minutes (the
builds cached; the first run builds both modules, about a minute each); --quick under 2.
"""

from __future__ import annotations

import argparse
import json
import runpy
import statistics
import time
from pathlib import Path

from _common import (
    BUSY_LIMIT,
    ROOT,
    WAITED_NOTE,
    build_module,
    import_module,
    machine_facts,
    machine_line,
    peer_records,
    pooled_rows,
    quiet_blas,
    run_rounds,
    set_threads,
    time_batches,
    waited_marks,
)

PEERS = ("deepgen", "deepgen-masked", "hf-generate")
THREADS = (1, 2)
BATCHES = (1, 32)
SETS = {1: 16, 32: 2}
QUICK_SETS = {1: 8, 32: 1}
EXAMPLE = ROOT / "examples" / "gpt2_generate.py"


def example():
    return runpy.run_path(str(EXAMPLE), run_name="control_flow_gpt2_example")


def workloads(ex: dict, sets: dict) -> dict:
    """{batch: [prompt arrays]}: seeded prompts, the same in every process."""
    return {
        size: list(ex["prompts"](size * count, 201 + size).reshape(count, size, -1))
        for size, count in sets.items()
    }


def loaded(info: dict, weights: str):
    module = import_module(info["name"], info["build"])
    model = module.Model(seed=0)
    model.load(weights)
    return module, model.eval()


def hf_weights(ex: dict, info: dict) -> str:
    """The Hugging Face model's weights by the generated module's names, saved once beside
    the build: the generated peers' children load them without importing torch."""
    import numpy as np

    from _common import import_torchvision

    import_torchvision()
    path = Path(info["build"]).parent / "hf_weights.npz"
    np.savez(path, **ex["hf_weights"](ex["hf_model"]()))
    return str(path)


def child(config: dict) -> None:
    threads, peer = config["threads"], config["peer"]
    out = {"threads": threads, "peer": peer, "round": config["round"], "rows": []}
    if peer == "hf-generate":
        import torch

        torch.set_num_threads(threads)
        out["torch_threads"] = torch.get_num_threads()
    else:
        quiet_blas()
    ex = example()
    weights = config["weights"]
    module, model = loaded(config["module"], weights)
    out["generated_threads"] = set_threads(module, threads if peer == "deepgen" else 1)

    def reference(prompt):
        return ex["continuations"](model.forward(prompt=prompt))

    if peer == "deepgen":
        fn, tokens = (lambda prompt: model.forward(prompt=prompt)), ex["continuations"]
    elif peer == "deepgen-masked":
        masked, masked_model = loaded(config["masked"], weights)
        out["generated_threads"] = set_threads(masked, threads)
        fn, tokens = (lambda prompt: masked_model.forward(prompt=prompt)), ex["continuations"]
    else:
        from _common import import_torchvision

        import_torchvision()
        hf = ex["hf_model"]()  # seeded: the weights the generated peers loaded (the tokens check it)
        fn, tokens = (lambda prompt: ex["hf_generate"](hf, prompt)), (lambda got: got)
    for size, batches in workloads(ex, {int(k): v for k, v in config["sets"].items()}).items():
        agree = total = 0
        lengths, loop_steps = [], []
        for prompt in batches:
            want, got = reference(prompt), tokens(fn(prompt))
            agree += sum(g == w for g, w in zip(got, want))
            total += len(want)
            lengths += [len(w) for w in want]
            loop_steps.append(max(len(w) for w in want))
        if agree != total:
            raise SystemExit(
                f"{peer}: {total - agree} of {total} sequences differ from the generated module's "
                f"(batch {size}); refusing to time different functions"
            )

        per_batch, cpu_per_wall = time_batches(fn, batches, config)
        out["rows"].append(
            {
                "batch": size,
                "times_ms": per_batch,
                "cpu_per_wall": cpu_per_wall,
                "agree": agree,
                "examples": total,
                "lengths": lengths,
                "loop_steps": loop_steps,
            }
        )
        print(
            f"  [round {config['round'] + 1}, {threads} thr] batch {size:2d} {peer:14s} "
            f"{statistics.median(per_batch):9.3f} ms/batch ({len(per_batch)} reps, cpu/wall {cpu_per_wall:.2f}; "
            f"tokens agree {agree}/{total})",
            flush=True,
        )
    Path(config["out"]).write_text(json.dumps(out))


def report(results: list, ex: dict, info: dict) -> list:
    """Prints the table and the profile; returns the records for --json."""
    pooled, cpu, med, facts = pooled_rows(results)
    print("\n" + machine_line(machine_facts()))
    print(
        f"Model: examples/gpt2_generate.py, {ex['LAYERS']} layers, {ex['HEADS']} heads, embedding {ex['EMBED']}, "
        f"vocabulary {ex['VOCAB']}, prompt {ex['PROMPT']}, up to {ex['MAX_NEW']} new tokens, EOS {ex['EOS']}"
    )
    for size in BATCHES:
        r = facts[(size, "deepgen")]
        print(
            f"Tokens: every peer agreed with the generated module on all {r['examples']} sequences at batch {size}."
        )
    print("\nms per batch (median); ratio = peer / deepgen (> 1: deepgen faster):")
    head = (
        f"{'batch':>5} {'thr':>3} | {'deepgen':>8} {'dg-masked':>9} {'hf-generate':>11} | "
        f"{'masked/dg':>9} {'hf/dg':>8}"
    )
    print(head)
    print("-" * len(head))
    records, flagged = [], False
    for size in BATCHES:
        for threads in THREADS:
            dg_ms, masked_ms, hf_ms = (med[(size, threads, p)] for p in PEERS)
            mark = waited_marks(lambda t, p: med[(size, t, p)], threads, PEERS)
            flagged = flagged or "*" in mark.values()
            print(
                f"{size:>5} {threads:>3} | {dg_ms:7.3f}{mark['deepgen']} {masked_ms:8.3f}{mark['deepgen-masked']} "
                f"{hf_ms:10.3f}{mark['hf-generate']} | {masked_ms / dg_ms:8.2f}x {hf_ms / dg_ms:7.2f}x"
            )
            records += peer_records(size, threads, PEERS, pooled, cpu, med, dg_ms)
    if flagged:
        print(WAITED_NOTE)
    print("\nProfile (1 thread):")
    for size in BATCHES:
        r = facts[(size, "deepgen")]
        lengths, loops = r["lengths"], r["loop_steps"]
        print(
            f"  batch {size:2d}: new tokens per sequence mean {statistics.mean(lengths):.2f} (min {min(lengths)}, "
            f"max {max(lengths)}); tokens per batch call {statistics.mean(loops):.2f} (the batch runs until its "
            f"longest sequence ends: {100 * (1 - sum(lengths) / (size * sum(loops))):.0f}% of the masked build's "
            f"rows are finished sequences); deepgen {1000 * med[(size, 1, 'deepgen')] / statistics.mean(loops):.1f} "
            f"us per generated position of the batch, hf-generate "
            f"{1000 * med[(size, 1, 'hf-generate')] / statistics.mean(loops):.1f} us"
        )
    return records


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE", help="write every figure to FILE as JSON")
    parser.add_argument("--quick", action="store_true", help="fewer batches, repetitions and rounds")
    parser.add_argument("--rounds", type=int, help="rounds of children (default 3; 1 with --quick)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return
    t_start = time.perf_counter()
    ex = example()
    print("Building the generated modules (cached under build/bench/):", flush=True)
    info = build_module(ex["gpt2_generate"])
    masked_info = build_module(ex["gpt2_generate"], name="gpt2_generate_masked", compact=False)
    rounds = args.rounds or (1 if args.quick else 3)
    config = {
        "module": info,
        "masked": masked_info,
        "weights": hf_weights(ex, info),
        "sets": QUICK_SETS if args.quick else SETS,
        "min_reps": 3 if args.quick else 5,
        "target_s": 0.3 if args.quick else 1.0 / rounds,
    }
    print(f"\n{rounds} round(s) x {len(THREADS)} thread counts, a child per peer:", flush=True)
    results = run_rounds(__file__, config, rounds, THREADS, PEERS, "control_flow_gpt2")
    records = report(results, ex, info)
    contention = max([max(r["other_cores"] or 0, r["steal_cores"] or 0) for r in results], default=0.0)
    if contention > BUSY_LIMIT:
        print(
            f"\nWARNING: other processes or the hypervisor took up to {contention:.2f} cores while children ran: "
            "the figures are noisy, the 2-thread ones most."
        )
    print(f"\n(ran in {time.perf_counter() - t_start:.0f} s)")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"machine": machine_facts(), "module": info, "records": records, "children": results},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
