"""What exact mode (`--exact`, the default) costs: the time of one verify pass of b tokens with
ggml-cpu's batch-invariant mode on and off, on the same context, alternated pass by pass.

A verify pass of b tokens, exact, computes the dense weights (attention, shared experts, output
head) row by row with the one-token kernels instead of llama.cpp's GEMMs (tiled, repacked,
tinyBLAS), and attention on flash attention's one-chunk path; the experts of a real MoE get about
one row each either way. This prints, per b, the median milliseconds of a pass in both modes and
their ratio, and the one-token decode's (b = 1: only the split-KV attention path differs, from
512 cached tokens on). Nothing is asserted; say whether the machine was idle.

    .venv/bin/python bench/bench_exact.py -m T.gguf [--batches 1,2,5,9] [--context 256] [--passes 15]
        [--repack auto|on|off] [-t 2]
    .venv/bin/python bench/bench_exact.py -m T.gguf --batches 64,512 --exact-rows 512   # prompts exact too?
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from orchestrator.decoding.speculative import EXACT_ROWS  # noqa: E402
from orchestrator.runtime.host_layout import cpu_model_and_flags, set_batch_invariant_rows  # noqa: E402
from orchestrator.runtime.llm import Context, Model, init_backend  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--batches", default="1,2,5,9", help="verify pass sizes (γ + 1)")
    ap.add_argument("--context", type=int, default=256, help="tokens in the cache before each pass")
    ap.add_argument("--passes", type=int, default=15, help="timed passes per size and mode")
    ap.add_argument("--repack", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--exact-rows", type=int, default=EXACT_ROWS,
                    help="the mode's row limit (a session's: %(default)s); larger to price exact prompt passes")
    args = ap.parse_args()

    init_backend()
    cpu, flags = cpu_model_and_flags()
    print(f"CPU: {cpu}; flags {' '.join(sorted(f for f in flags if f.startswith(('avx', 'amx', 'fma', 'f16c'))))}")
    model = Model(args.model, repack=args.repack, n_threads=args.threads, exact=True)  # exact mode's layout, both kernels
    batches = [int(b) for b in args.batches.split(",")]
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.n_vocab, args.context).tolist()
    drafts = rng.integers(0, model.n_vocab, max(batches)).tolist()
    ctx = Context(model, n_ctx=args.context + max(batches) + 16, n_batch=512, n_threads=args.threads)
    print(f"{Path(args.model).name}, layout: {model.layout_report()}, {args.threads} threads, "
          f"{args.context} cached tokens; median of {args.passes} passes\n")
    print("| tokens in the pass | llama.cpp's kernels ms | exact ms | exact ÷ llama.cpp |")
    print("|---|---|---|---|")
    try:
        ctx.decode(prompt, logits_all=False)
        for b in batches:
            times: dict[int, list[float]] = {0: [], args.exact_rows: []}
            for i in range(args.passes + 1):  # the first pass of each mode warms up
                for rows in times:
                    set_batch_invariant_rows(rows)
                    ctx.trim(len(prompt))
                    t0 = time.perf_counter()
                    ctx.decode(drafts[:b])
                    ctx.logits()
                    if i:
                        times[rows].append(time.perf_counter() - t0)
            off, on = (statistics.median(times[r]) * 1e3 for r in (0, args.exact_rows))
            print(f"| {b} | {off:.2f} | {on:.2f} | {on / off:.2f} |", flush=True)
    finally:
        set_batch_invariant_rows(0)
        ctx.close()
        model.close()


if __name__ == "__main__":
    main()
