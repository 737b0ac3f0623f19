"""A prompt's experts streamed through the pool (patch 0016), measured on the RPC device.

    .venv/bin/python bench/bench_stream_prefill.py [--preset olmoe-1b-7b] [--n-layer 4] [--tokens 512]

The device is a ggml RPC server on 127.0.0.1 computing with 1 thread, the host computes with 1
thread (weights not repacked). Model: synthetic layers of a named shape (random Q4_0 weights).
The pool holds --budget of the experts, filled by a plan from the prompt's own routing (the
experts it uses most). Per prefill of --tokens tokens (one ubatch, --repeats times, medians):

  all-host   no pool: llama.cpp's prefill with the experts in host RAM, on this CPU
  streamed   every expert on the device: the resident ones in place, the others copied into
             staging slots, the next layer's while one computes

Printed beside the time: the bytes the prefill staged against the bytes of the distinct
non-resident experts the ubatch used (from the routing export), and how much of the copy time
the graph did not wait for (1 - stage_wait / stage_copy). The RPC server copies and computes on
its one thread, so copies cannot overlap its compute: what hides is the host-side work (the
attention, router, norms computed on the device meanwhile are the server's too). Time is reported,
not a target: the stand-in device is this CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from orchestrator.gguf_export import byte_level_bpe_tokenizer, write_gguf
from orchestrator.host_layout import cpu_model_and_flags
from orchestrator.llm import Context, Model
from orchestrator.native import ExpertEngine, Routing
from orchestrator.plan import Plan
from orchestrator.rpc import rpc_device
from orchestrator.synthetic_models import PRESETS, synthetic_tensors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="olmoe-1b-7b")
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--budget", type=float, default=0.25, help="pool share of all experts")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--mode", choices=["ahead", "used", "both"], default="both",
                    help="ahead: every non-resident expert of the next layer while one computes; used: the "
                         "experts a layer's router chose, once it has run")
    args = ap.parse_args()

    model_name, flags = cpu_model_and_flags()
    print(f"CPU: {model_name}, flags {' '.join(sorted(f for f in flags if f.startswith(('avx', 'amx'))))}; "
          f"load average {os.getloadavg()[0]:.2f} at start")
    with tempfile.TemporaryDirectory() as tmp, rpc_device(n_threads=1) as device:
        cfg = replace(PRESETS[args.preset], n_layer=args.n_layer, n_vocab=512)
        path = Path(tmp) / f"{args.preset}-{args.n_layer}l-q4_0.gguf"
        write_gguf(path, cfg, synthetic_tensors(cfg, seed=0), byte_level_bpe_tokenizer(cfg.n_vocab), dtype="q4_0")
        model = Model(path, repack="off")
        tokens = np.random.default_rng(0).integers(0, cfg.n_vocab, args.tokens)
        n_ctx = args.tokens + 16

        def timed(ctx: Context) -> float:
            ctx.clear()
            t0 = time.perf_counter()
            # logits of every position: the routing export then holds the last layer's rows too
            # (with only the last position's, that layer computes, and exports, one row)
            ctx.decode(tokens, logits_all=True)
            ctx.logits()[0, 0]  # synchronizes
            return time.perf_counter() - t0

        host = Context(model, n_ctx=n_ctx, n_batch=args.tokens, n_threads=1)
        routing = Routing(host.ptr, n_expert_used=cfg.n_expert_used)
        timed(host)
        ids, _ = routing.last()  # [n_layer, n_tokens, top_k] of the prompt
        freq = np.stack([np.bincount(row[row >= 0], minlength=cfg.n_expert) for row in ids.reshape(ids.shape[0], -1)])
        host_s = statistics.median(timed(host) for _ in range(args.repeats))
        host.close()

        results = {}
        for mode in (["ahead", "used"] if args.mode == "both" else [args.mode]):
            ctx = Context(model, n_ctx=n_ctx, n_batch=args.tokens, n_threads=1)
            with ExpertEngine(ctx.ptr, path, device=device, budget_ratio=args.budget, stream_prefill=mode) as engine:
                # the pool holds the experts the prompt uses most, as a plan from its routing would
                utility = np.zeros(freq.shape, np.uint8)
                order = np.argsort(-freq, axis=1, kind="stable")
                np.put_along_axis(utility, order[:, : engine.stats()["n_slots"] // freq.shape[0]], 1, axis=1)
                engine.set_plan(Plan(utility, np.ones(freq.shape[0], np.int32)))
                assert engine.wait_idle(600)
                resident = engine.residency() >= 0
                timed(ctx)  # warm-up: graph reserve, first touch
                engine.reset_stats()
                times = [timed(ctx) for _ in range(args.repeats)]
                # the distinct non-resident experts this ubatch chose (its own routing export)
                ids = Routing(ctx.ptr, n_expert_used=cfg.n_expert_used).last()[0].reshape(freq.shape[0], -1)
                used = np.stack([np.bincount(row[row >= 0], minlength=cfg.n_expert) > 0 for row in ids])
                results[mode] = statistics.median(times), engine.stats(), int((used & ~resident).sum())
            ctx.close()
        model.close()

    expert_bytes = next((s["bytes_staged"] / s["n_staged"] for _, s, _ in results.values() if s["n_staged"]), 0.0)
    print(f"{args.preset} shape, {args.n_layer} MoE layers x {cfg.n_expert} experts (top-{cfg.n_expert_used}), "
          f"Q4_0, {expert_bytes / 1e6:.2f} MB per expert; prompt {args.tokens} tokens (one ubatch); pool "
          f"{100 * args.budget:.0f}% ({int(resident.sum())} experts resident)")
    print(f"  all-host prefill        {1e3 * host_s:8.1f} ms")
    per = args.repeats
    for mode, (t, s, used_nonresident) in results.items():
        copy, wait = s["stage_copy_us"] / per, s["stage_wait_us"] / per
        hidden = f"{100 * max(0.0, 1 - wait / copy):.0f}%" if copy else "-"
        print(f"  streamed, {mode:5}         {1e3 * t:8.1f} ms ({host_s / t:.2f}x all-host); staged {s['n_staged'] / per:.0f} "
              f"experts, {s['bytes_staged'] / per / 1e6:.1f} MB, against {used_nonresident} distinct non-resident experts "
              f"the ubatch chose ({used_nonresident * expert_bytes / 1e6:.1f} MB); copies {copy / 1e3:.1f} ms, the graph "
              f"waited {wait / 1e3:.1f} ms ({hidden} of the copy time not waited for)")
    print(f"  load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
