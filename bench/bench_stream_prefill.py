"""A prompt's experts streamed through the pool (patch 0016), measured on the RPC device or a GPU.

    .venv/bin/python bench/bench_stream_prefill.py [--preset olmoe-1b-7b] [--n-layer 4] [--tokens 512]
    python bench/bench_stream_prefill.py --device CUDA0 -t 8 --preset qwen3-30b-a3b --tokens 2048

Model: synthetic layers of a named shape (random zero-mean Q4_0 weights: a prompt's routing spreads
over the experts). The pool holds --budget of the experts, filled by a plan from the prompt's own
routing (the experts it uses most). Per prefill of --tokens tokens (one ubatch, --repeats times,
medians):

  all-host   no pool: llama.cpp's prefill with the experts in host RAM, on this CPU
  streamed   every expert on the device: the resident ones in place, the others copied into
             staging slots, the next layer's while one computes

--device rpc (default): a ggml RPC server on 127.0.0.1 computing with 1 thread, the host computing
with 1 thread, every non-expert weight on the host. The RPC server copies and computes on its
one thread, so copies cannot overlap its compute: what hides is the host-side work. Time is
reported, not a target: the stand-in device is this CPU.

--device CUDA0 (a GPU): every layer's non-expert weights on the GPU, the experts in host RAM
(llama.cpp's -ngl 99 --cpu-moe), and llama.cpp's own two ways with that placement beside spac's:

  op offload      llama.cpp's default: each ubatch copies every expert of a layer to the GPU,
                  then computes there (the copies not overlapped)
  no op offload   --no-op-offload: the experts computed on the host's -t threads
  streamed 100%   every expert resident: the GPU's compute alone, the bound on any streaming

Printed beside the time: the bytes the prefill staged against the bytes of the distinct
non-resident experts the ubatch used (from the routing export), and how much of the copy time
the graph did not wait for (1 - stage_wait / stage_copy).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from orchestrator.runtime.host_layout import cpu_model_and_flags
from orchestrator.runtime.llm import Context, Model
from orchestrator.runtime.native import ExpertEngine, Routing
from orchestrator.runtime.rpc import rpc_device
from orchestrator.gguf_files.gguf_export import byte_level_bpe_tokenizer, write_gguf
from orchestrator.gguf_files.synthetic_models import PRESETS, synthetic_tensors
from orchestrator.policies.plan import Plan


def prefill_rows(args, cfg, path: Path, model: Model, device: str, n_tokens: int) -> list[dict]:
    """llama.cpp's own prefill with this placement, then spac's streamed prefill (each mode, and
    on a GPU every expert resident), for one ubatch of n_tokens; prints them, returns them."""
    gpu = args.device != "rpc"
    tokens = np.random.default_rng(0).integers(0, cfg.n_vocab, n_tokens)

    def context(**kw) -> Context:
        return Context(model, n_ctx=n_tokens + 16, n_batch=n_tokens, n_threads=args.threads, **kw)

    def timed(ctx: Context) -> float:
        ctx.clear()
        t0 = time.perf_counter()
        # logits of every position: the routing export then holds the last layer's rows too
        # (with only the last position's, that layer computes, and exports, one row)
        ctx.decode(tokens, logits_all=True)
        ctx.logits()[0, 0]  # synchronizes
        return time.perf_counter() - t0

    def median_of(ctx: Context) -> float:
        timed(ctx)  # warm-up: graph reserve, first touch
        return statistics.median(timed(ctx) for _ in range(args.repeats))

    peers = {}  # llama.cpp's own prefill with this placement: name -> seconds
    first = context(op_offload=gpu)
    routing = Routing(first.ptr, n_expert_used=cfg.n_expert_used)
    timed(first)
    ids, _ = routing.last()  # [n_layer, n_tokens, top_k] of the prompt
    freq = np.stack([np.bincount(row[row >= 0], minlength=cfg.n_expert) for row in ids.reshape(ids.shape[0], -1)])
    peers["op offload (llama.cpp's default)" if gpu else "all-host"] = median_of(first)
    first.close()
    if gpu:
        ctx = context(op_offload=False)
        peers[f"no op offload ({args.threads} host threads)"] = median_of(ctx)
        ctx.close()

    results = {}
    runs = [(mode, args.budget) for mode in (["ahead", "used"] if args.mode == "both" else [args.mode])]
    if gpu:
        runs.append(("ahead", 1.0))
    for mode, budget in runs:
        ctx = context()
        with ExpertEngine(ctx.ptr, path, device=device, budget_ratio=budget, stream_prefill=mode) as engine:
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
            results[mode, budget] = (statistics.median(times), engine.stats(), int((used & ~resident).sum()),
                                     int(resident.sum()))
        ctx.close()

    expert_bytes = next((s["bytes_staged"] / s["n_staged"] for _, s, _, _ in results.values() if s["n_staged"]), 0.0)
    print(f"{args.preset} shape, {args.n_layer} MoE layers x {cfg.n_expert} experts (top-{cfg.n_expert_used}), "
          f"Q4_0, {expert_bytes / 1e6:.2f} MB per expert; prompt {n_tokens} tokens (one ubatch); device "
          f"{args.device}, {args.threads} host threads")
    base_name, base_s = next(iter(peers.items()))
    rows = []
    for name, t in peers.items():
        print(f"  {name:38} {1e3 * t:8.1f} ms")
        rows.append({"tokens": n_tokens, "row": name, "ms": 1e3 * t})
    per = args.repeats
    for (mode, budget), (t, s, used_nonresident, n_resident) in results.items():
        copy, wait = s["stage_copy_us"] / per, s["stage_wait_us"] / per
        hidden = f"{100 * max(0.0, 1 - wait / copy):.0f}%" if copy else "-"
        name = f"streamed, {mode}, pool {100 * budget:.0f}%"
        print(f"  {name:38} {1e3 * t:8.1f} ms ({base_s / t:.2f}x {base_name.split(' (')[0]}); {n_resident} resident, "
              f"staged {s['n_staged'] / per:.0f} experts, {s['bytes_staged'] / per / 1e6:.1f} MB, against "
              f"{used_nonresident} distinct non-resident experts the ubatch chose "
              f"({used_nonresident * expert_bytes / 1e6:.1f} MB); copies {copy / 1e3:.1f} ms "
              f"({copy / 1e3 / args.n_layer:.2f} ms per layer, {s['n_copy_calls'] / per:.0f} copy calls), the graph waited "
              f"{wait / 1e3:.1f} ms ({hidden} of the copy time not waited for)")
        rows.append({"tokens": n_tokens, "row": name, "ms": 1e3 * t, "resident": n_resident,
                     "n_staged": s["n_staged"] / per, "bytes_staged": s["bytes_staged"] / per,
                     "used_nonresident": used_nonresident, "stage_copy_ms": copy / 1e3, "stage_wait_ms": wait / 1e3,
                     "copy_calls": s["n_copy_calls"] / per})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="olmoe-1b-7b")
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--tokens", type=lambda v: [int(x) for x in v.split(",")], default=[512],
                    help="prompt length, one ubatch (a comma-separated list runs each on the same model)")
    ap.add_argument("--budget", type=float, default=0.25, help="pool share of all experts")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--mode", choices=["ahead", "used", "both"], default="both",
                    help="ahead: every non-resident expert of the next layer while one computes; used: the "
                         "experts a layer's router chose, once it has run")
    ap.add_argument("--device", default="rpc",
                    help="'rpc' (an RPC server on 127.0.0.1, 1 thread) or a ggml device name such as CUDA0")
    ap.add_argument("-t", "--threads", type=int, default=1, help="host threads")
    ap.add_argument("--json", type=Path, help="also write the rows here (a JSON list of objects)")
    ap.add_argument("--no-mmap", dest="mmap", action="store_false",
                    help="llama.cpp's --no-mmap: host weights in the GPU's pinned host buffers, which both "
                         "llama.cpp's op offload and the pool's staging (patch 0017) copy from")
    args = ap.parse_args()

    model_name, flags = cpu_model_and_flags()
    print(f"CPU: {model_name}, flags {' '.join(sorted(f for f in flags if f.startswith(('avx', 'amx'))))}; "
          f"load average {os.getloadavg()[0]:.2f} at start")
    gpu = args.device != "rpc"
    pool_device = contextlib.nullcontext(args.device) if gpu else rpc_device(n_threads=1)
    with tempfile.TemporaryDirectory() as tmp, pool_device as device:
        cfg = replace(PRESETS[args.preset], n_layer=args.n_layer, n_vocab=512)
        path = Path(tmp) / f"{args.preset}-{args.n_layer}l-q4_0.gguf"
        # zero-mean weights: a prompt's routing spread over the experts as a trained model's is
        write_gguf(path, cfg, synthetic_tensors(cfg, seed=0, zero_mean=True), byte_level_bpe_tokenizer(cfg.n_vocab),
                   dtype="q4_0")
        # on a GPU, llama.cpp's -ngl 99 --cpu-moe: the pool and llama.cpp's peers share that placement
        model = Model(path, n_gpu_layers=-1 if gpu else 0, repack="off", mmap=args.mmap)
        rows = []
        for n_tokens in args.tokens:
            rows += prefill_rows(args, cfg, path, model, device, n_tokens)
        model.close()
    print(f"  load average {os.getloadavg()[0]:.2f} at the end")
    if args.json:
        args.json.write_text(json.dumps([{"device": args.device, "preset": args.preset, "n_layer": args.n_layer,
                                          "threads": args.threads, "mmap": args.mmap, **r} for r in rows], indent=1))


if __name__ == "__main__":
    main()
