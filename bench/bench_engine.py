"""Native expert engine: forward-time ratios and per-step overhead, measured in one run.

    .venv/bin/python bench/bench_engine.py [--threads 2] [--repeats 30]

1. Pool on with every expert on the CPU side vs pool off: the cost of the split graph itself.
2. Pool on a CPU buffer holding every expert vs pool off.
3. Per-step overhead of set_plan + reading the routing at a 48-layer x 128-expert shape.
Timings are medians of interleaved runs (these machines are noisy); ratios < 1 mean faster.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from orchestrator.gguf_export import make_random_model, tiny_config
from orchestrator.llm import Context, Model
from orchestrator.native import ExpertEngine, Routing
from orchestrator.plan import Plan

VERIFY = [11, 22, 33, 44, 55, 66, 77, 88, 99]  # a γ = 8 verify batch


def time_verify(ctx: Context, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        ctx.trim(0)
        t0 = time.perf_counter()
        ctx.decode(VERIFY)
        ctx.logits()[0, 0]  # synchronizes
        out.append(time.perf_counter() - t0)
    return out


def forward_ratios(tmp: Path, threads: int, repeats: int) -> None:
    cfg = tiny_config("qwen3moe", n_layer=4, n_embd=512, n_head=8, n_head_kv=4, head_dim=64,
                      n_expert=32, n_expert_used=4, n_ff_exp=512, n_vocab=512)
    path = make_random_model(tmp / "bench-moe-q4_0.gguf", cfg, seed=0, dtype="f16", quant="q4_0")
    model = Model(path)
    ctx = Context(model, n_ctx=64, n_batch=16, n_threads=threads)
    time_verify(ctx, 3)  # warm-up

    off, cpu_side, all_dev = [], [], []
    for _ in range(3):  # interleave the three configurations
        off += time_verify(ctx, repeats)
        with ExpertEngine(ctx.ptr, path, budget_ratio=0.05):  # nothing resident: all experts on the CPU side
            time_verify(ctx, 2)
            cpu_side += time_verify(ctx, repeats)
        with ExpertEngine(ctx.ptr, path, budget_ratio=1.0) as engine:
            L, E = engine.n_moe_layers, engine.n_expert
            engine.set_plan(Plan(np.full((L, E), 4, np.uint8), np.ones(L, np.int32)))
            engine.wait_idle(60)
            time_verify(ctx, 2)
            all_dev += time_verify(ctx, repeats)
    m_off, m_cpu, m_dev = (statistics.median(x) * 1e3 for x in (off, cpu_side, all_dev))
    print(f"verify batch of {len(VERIFY)} tokens, {cfg.n_layer} layers x {cfg.n_expert} experts (Q4_0), {threads} threads")
    print(f"  pool off                          {m_off:8.3f} ms")
    print(f"  pool on, all experts CPU side     {m_cpu:8.3f} ms   ratio {m_cpu / m_off:.3f}")
    print(f"  pool on (CPU buffer), all on pool {m_dev:8.3f} ms   ratio {m_dev / m_off:.3f}")
    ctx.close()
    model.close()


def step_overhead(tmp: Path, iters: int) -> None:
    cfg = tiny_config("qwen3moe", n_layer=48, n_embd=64, n_expert=128, n_expert_used=8, n_ff_exp=32)
    path = make_random_model(tmp / "bench-48x128.gguf", cfg, seed=0, dtype="f16")
    model = Model(path)
    ctx = Context(model, n_ctx=64, n_batch=16, n_threads=1)
    routing = Routing(ctx.ptr, n_expert_used=8)
    rng = np.random.default_rng(0)
    with ExpertEngine(ctx.ptr, path, budget_ratio=0.17, no_evict=True) as engine:
        L, E = engine.n_moe_layers, engine.n_expert
        ctx.decode(VERIFY)
        plans = [Plan(rng.integers(0, 5, (L, E)).astype(np.uint8), rng.integers(1, 5, L).astype(np.int32))
                 for _ in range(16)]
        # fill the pool once so later plans queue nothing new to copy (we time the call, not copies)
        engine.set_plan(Plan(np.full((L, E), 4, np.uint8), np.ones(L, np.int32)))
        engine.wait_idle(120)
        # back to back: the calls alone
        back_to_back = []
        for i in range(iters):
            t0 = time.perf_counter()
            ids, weights = routing.last()
            engine.set_plan(plans[i % len(plans)])
            back_to_back.append(time.perf_counter() - t0)
        # in a step: right after a verify decode (caches cold, decode threads winding down)
        in_step = []
        for i in range(iters):
            ctx.trim(0)
            ctx.decode(VERIFY)
            t0 = time.perf_counter()
            ids, weights = routing.last()
            engine.set_plan(plans[i % len(plans)])
            in_step.append(time.perf_counter() - t0)
        assert ids.shape == (48, len(VERIFY), 8)
    for name, times in (("back to back", back_to_back), ("after a decode", in_step)):
        print(f"set_plan + routing read at 48 layers x 128 experts, {name}: median {statistics.median(times) * 1e6:.1f} us, "
              f"p90 {float(np.percentile(times, 90)) * 1e6:.1f} us ({iters} steps)")
    ctx.close()
    model.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--iters", type=int, default=500)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        forward_ratios(Path(d), args.threads, args.repeats)
        step_overhead(Path(d), args.iters)


if __name__ == "__main__":
    main()
