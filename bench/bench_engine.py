"""Native expert engine: forward-time ratios and per-step overhead, measured in one run.

    .venv/bin/python bench/bench_engine.py [--threads 2] [--repeats 30]

1. Pool on with every expert on the CPU side vs pool off: the cost of the split graph itself.
2. Pool on a CPU buffer holding every expert vs pool off.
   Both on a tiny MoE (where the split's extra graph nodes weigh most) and on a few layers with
   Qwen3-30B-A3B's real dimensions (synthetic Q4_0 weights, ~0.34 GB per layer).
3. Per-step overhead of set_plan + reading the routing at a 48-layer x 128-expert shape.
Timings are medians of runs that alternate verify by verify (these machines are noisy);
ratios < 1 mean faster.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from orchestrator.runtime.llm import Context, Model
from orchestrator.runtime.native import ExpertEngine, Routing
from orchestrator.gguf_files.gguf_export import byte_level_bpe_tokenizer, make_random_model, tiny_config, write_gguf
from orchestrator.gguf_files.synthetic_models import PRESETS, synthetic_tensors
from orchestrator.policies.plan import Plan


VERIFY = [11, 22, 33, 44, 55, 66, 77, 88, 99]  # a γ = 8 verify batch


def time_verify(ctx: Context) -> float:
    ctx.trim(0)
    t0 = time.perf_counter()
    ctx.decode(VERIFY)
    ctx.logits()[0, 0]  # synchronizes
    return time.perf_counter() - t0


def tiny_moe(tmp: Path) -> tuple[Path, str]:
    cfg = tiny_config("qwen3moe", n_layer=4, n_embd=512, n_head=8, n_head_kv=4, head_dim=64,
                      n_expert=32, n_expert_used=4, n_ff_exp=512, n_vocab=512)
    path = make_random_model(tmp / "bench-moe-q4_0.gguf", cfg, seed=0, dtype="f16", quant="q4_0")
    return path, "tiny: 4 layers, d 512, 32 experts of ff 512, top-4"


def qwen3_30b_layers(tmp: Path, n_layer: int = 4) -> tuple[Path, str]:
    """Qwen3-30B-A3B's real layer (d 2048, 128 experts of ff 768, top-8), a few of them, tiny vocab."""
    cfg = replace(PRESETS["qwen3-30b-a3b"], n_layer=n_layer, n_vocab=512)
    path = tmp / "bench-qwen3-30b-layers-q4_0.gguf"
    write_gguf(path, cfg, synthetic_tensors(cfg, seed=0), byte_level_bpe_tokenizer(cfg.n_vocab), dtype="q4_0")
    return path, f"Qwen3-30B-A3B layer shape: {n_layer} layers, d 2048, 128 experts of ff 768, top-8"


def forward_ratios(path: Path, label: str, threads: int, repeats: int) -> None:
    model = Model(path)
    # one context per configuration, sharing the model's weights, so the three can alternate
    # verify by verify: the host's load drifts slower than that
    off, cpu_side, all_dev = (Context(model, n_ctx=64, n_batch=16, n_threads=threads) for _ in range(3))
    engines = [ExpertEngine(cpu_side.ptr, path, budget_ratio=0.05),  # nothing resident: all on the CPU side
               ExpertEngine(all_dev.ptr, path, budget_ratio=1.0)]
    L, E = engines[1].n_moe_layers, engines[1].n_expert
    engines[1].set_plan(Plan(np.full((L, E), 4, np.uint8), np.ones(L, np.int32)))
    engines[1].wait_idle(60)
    assert (engines[1].residency() >= 0).all()
    contexts = {"off": off, "cpu_side": cpu_side, "all_dev": all_dev}
    times: dict[str, list[float]] = {name: [] for name in contexts}
    for name, ctx in contexts.items():  # warm-up
        for _ in range(3):
            time_verify(ctx)
    order = list(contexts)
    for i in range(3 * repeats):
        for name in order[i % 3:] + order[:i % 3]:  # rotate who goes first
            times[name].append(time_verify(contexts[name]))
    m_off, m_cpu, m_dev = (statistics.median(times[k]) * 1e3 for k in order)
    print(f"{label} (Q4_0): verify batch of {len(VERIFY)} tokens, {threads} threads, "
          f"{3 * repeats} verifies each, alternating")
    print(f"  pool off                          {m_off:8.3f} ms")
    print(f"  pool on, all experts CPU side     {m_cpu:8.3f} ms   ratio {m_cpu / m_off:.3f}")
    print(f"  pool on (CPU buffer), all on pool {m_dev:8.3f} ms   ratio {m_dev / m_off:.3f}")
    for engine in engines:
        engine.close()
    for ctx in contexts.values():
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
        # in a step: right after a verify decode whose logits were read (every step reads them to
        # accept tokens, and that read waits for the decode), with caches cold from the decode;
        # the policy writes the plan between the two calls, so the plan itself is warm (untimed)
        in_step = []
        for i in range(iters):
            ctx.trim(0)
            ctx.decode(VERIFY)
            ctx.logits()[0, 0]
            t0 = time.perf_counter()
            ids, weights = routing.last()
            t1 = time.perf_counter()
            plan = Plan(plans[i % len(plans)].utility.copy(), plans[i % len(plans)].threshold.copy())
            t2 = time.perf_counter()
            engine.set_plan(plan)
            in_step.append(time.perf_counter() - t2 + t1 - t0)
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
        for path, label in (tiny_moe(Path(d)), qwen3_30b_layers(Path(d))):
            forward_ratios(path, label, args.threads, args.repeats)
            path.unlink()
        step_overhead(Path(d), args.iters)


if __name__ == "__main__":
    main()
