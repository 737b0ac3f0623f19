"""The expert pool's copy rate: per expert and per layer batch, from pageable, registered and
pinned host memory, with each load's time and resident memory.

    python bench/bench_copies.py [-m runs/mb/olmoe-bytes-f16.gguf] [--device rpc|CUDA0] [--budget 0.5]

Rows (one model load each, one after the other):
  mapped       the file mapped (llama.cpp's default): the pool copies its own mapping, pageable
  registered   mapped, with --pin-mapping (patch 0025): that mapping registered as the device's
               pinned memory, where the device can (else the row says "not pinned")
  no-mmap      llama.cpp's --no-mmap: with a GPU the host weights sit in its pinned host buffers,
               which the pool copies from (patch 0017)
and per row the plan's copies one expert at a time (copy_batch_experts 1: three synchronous sets
per expert, the copies before patch 0024) and in batches of a layer's experts (8 and 64, one
synchronize each). Each fill copies the same experts into an empty pool (a new engine): GB/s is
bytes over the copy worker's busy time (a first fill of a mapping also pays its page faults: each
cell fills once before its timed fills). Printed with the machine's load; resident memory is the process's RSS
after the fills (the mapping's pages the pool read count in it).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_TARGET = ROOT / "runs" / "mb" / "olmoe-bytes-f16.gguf"
ROWS = {"mapped": dict(mmap=True, pin=False), "registered": dict(mmap=True, pin=True), "no-mmap": dict(mmap=False, pin=False)}
BATCHES = (1, 8, 64)


def fill_rate(ctx, path: Path, device: str, budget: float, batch: int, pin: bool, repeats: int) -> dict:
    """Fill an empty pool (a new engine each time) with one plan, `repeats` times after one
    untimed fill."""
    import numpy as np

    from orchestrator.runtime.native import ExpertEngine
    from orchestrator.policies.plan import Plan

    rates, busy = [], []
    for i in range(repeats + 1):
        with ExpertEngine(ctx.ptr, path, device=device, budget_ratio=budget, copy_batch_experts=batch,
                          pin_mapping=pin) as engine:
            L, E = engine.n_moe_layers, engine.n_expert
            engine.set_plan(Plan(np.ones((L, E), np.uint8), np.ones(L, np.int32)))
            assert engine.wait_idle(600)
            stats = engine.stats()
        if i:  # the first fill faults the mapping's pages in
            seconds = stats["copy_busy_us"] * 1e-6
            rates.append(stats["bytes_copied"] / seconds / 1e9)
            busy.append(seconds / max(stats["n_copy_batches"], 1))
    return dict(gb_s=float(np.median(rates)), batch_ms=float(np.median(busy)) * 1e3, pinned=stats["bytes_pinned"],
                n_copies=stats["n_copies"])


def row(name: str, args, device: str) -> list[dict]:
    import psutil

    from orchestrator.runtime.llm import Context, Model

    t0 = time.perf_counter()
    model = Model(args.model, n_gpu_layers=99, repack="off", n_threads=args.threads, mmap=ROWS[name]["mmap"])
    ctx = Context(model, n_ctx=256, n_batch=64, n_threads=args.threads)
    load_s = time.perf_counter() - t0
    try:
        out = []
        for batch in BATCHES:
            r = fill_rate(ctx, args.model, device, args.budget, batch, ROWS[name]["pin"], args.repeats)
            out.append(dict(row=name, batch=batch, load_s=load_s, rss_GB=psutil.Process().memory_info().rss / 1e9, **r))
        return out
    finally:
        ctx.close()
        model.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", type=Path, default=DEFAULT_TARGET)
    ap.add_argument("--device", default="rpc", help="the pool device: rpc (a ggml RPC server on 127.0.0.1) or a ggml name")
    ap.add_argument("--budget", type=float, default=0.5, help="the pool's share of the expert bytes")
    ap.add_argument("--repeats", type=int, default=3, help="timed fills per cell (the median is printed)")
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"of {', '.join(ROWS)}")
    args = ap.parse_args()
    rows = args.rows.split(",")
    if bad := [r for r in rows if r not in ROWS]:
        ap.error(f"--rows: unknown {', '.join(bad)} (of {', '.join(ROWS)})")
    if not args.model.exists():
        ap.error(f"-m/--model: {args.model} does not exist (scripts/make_memory_bound_target.py writes the default)")
    from orchestrator.runtime.rpc import rpc_devices

    load0 = os.getloadavg()[0]
    with rpc_devices(1) if args.device == "rpc" else contextlib.nullcontext([args.device]) as devices:
        results = [r for name in rows for r in row(name, args, devices[0])]
    print(f"{args.model.name}, pool {args.budget:.0%} on {devices[0]}, {args.repeats} timed fills per cell (median)")
    print("| host memory | experts per batch | GB/s | ms per batch | experts per fill | pinned GB | load s | RSS GB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        pinned = f"{r['pinned'] / 1e9:.2f}" if r["pinned"] else ("not pinned" if r["row"] == "registered" else "-")
        print(f"| {r['row']} | {r['batch']} | {r['gb_s']:.2f} | {r['batch_ms']:.2f} | {r['n_copies']} | {pinned} "
              f"| {r['load_s']:.2f} | {r['rss_GB']:.2f} |")
    print(f"load average {load0:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
    print("command: python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]))


if __name__ == "__main__":
    main()
