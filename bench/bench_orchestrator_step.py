"""Orchestrator time per verification step: f_t, estimator, balancer, plan; the governor; the loop.

48 MoE layers × 128 experts, top-8 routing of 9 verified tokens (γ = 8), random routing.
Prints the median time per step in µs, the median of each part, and the median cost of one
trivial numpy call on this machine (a step makes ~100 numpy calls, so a busy or slow machine
shows up there first).

Then the governor alone (`next_gamma` + `observe`, median µs per step) on two simulated
targets: one where γ = 0 stays in force (a draft that costs a target token) and one where it
drafts every step.

With --loop, the speculative loop itself on the shipped models: the Python time per step outside
llama_decode (wall time of the decode loop minus the time spent in llama_decode, per step), with
`--draft none` and with the default draft: medians of --loop-runs fresh sessions of -n tokens.

    .venv/bin/python bench/bench_orchestrator_step.py [--steps N] [--loop [-n 256] [-t 1]]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from orchestrator.decoding.governor import Governor, GovernorConfig
from orchestrator.policies.balancer import UnitCosts, WorkloadBalancer
from orchestrator.policies.estimator import UtilityEstimator
from orchestrator.policies.plan import Plan, StepRouting

N_LAYER, N_EXPERT, TOP_K, GAMMA = 48, 128, 8, 8


def random_routing(rng: np.random.Generator, n_steps: int) -> list[StepRouting]:
    # top-8 distinct experts per token and layer, with a skew so that some experts stay hot
    logits = rng.gumbel(size=(n_steps, GAMMA + 1, N_LAYER, N_EXPERT)) - 0.05 * np.arange(N_EXPERT)
    selected = np.argpartition(-logits, TOP_K, axis=-1)[..., :TOP_K].astype(np.int32)
    return [StepRouting(selected=s, n_drafted=GAMMA) for s in selected]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--loop", action="store_true", help="also time the loop on the shipped models")
    parser.add_argument("-n", type=int, default=256, help="--loop: tokens per run")
    parser.add_argument("-t", "--threads", type=int, default=1, help="--loop: llama.cpp threads")
    parser.add_argument("--loop-runs", type=int, default=5)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    routings = random_routing(rng, args.steps + args.warmup)
    estimator = UtilityEstimator(N_LAYER, N_EXPERT, gamma=GAMMA)
    balancer = WorkloadBalancer(N_LAYER, N_EXPERT, top_k=TOP_K, k_max=estimator.k_max)
    costs = UnitCosts(t_cpu_unit=2e-4, t_gpu_unit=5e-5, t_io_unit=1e-3, expert_bytes=4.5e6,
                      t_draft_token=3e-3, t_total=2e-3, vram_left=2e8)
    resident = np.zeros((N_LAYER, N_EXPERT), dtype=bool)

    parts = np.zeros((len(routings), 4))
    clock = time.perf_counter_ns
    for i, routing in enumerate(routings):
        t0 = clock()
        freq = routing.frequency(N_EXPERT)
        t1 = clock()
        utility = estimator.update(freq)
        t2 = clock()
        threshold = balancer.update(freq, utility, resident, costs, GAMMA)
        t3 = clock()
        plan = Plan(utility=utility, threshold=threshold)
        t4 = clock()
        parts[i] = (t1 - t0, t2 - t1, t3 - t2, t4 - t3)
        resident = plan.wanted()  # as if the engine had carried out the plan before the next step

    parts = parts[args.warmup:] / 1e3
    total = np.median(parts.sum(axis=1))
    names = ("frequency", "estimator", "balancer", "plan")
    detail = ", ".join(f"{n} {m:.1f}" for n, m in zip(names, np.median(parts, axis=0)))
    print(f"orchestrator step median {total:.1f} us ({N_LAYER}x{N_EXPERT}, top-{TOP_K}, "
          f"{GAMMA + 1} tokens; {detail}; one numpy call {numpy_call_us():.2f})")
    for name, accept, verify in (("gamma 0 in force", 0.9, lambda n: 5e-4 * n), ("drafting", 0.9, lambda n: 5e-3)):
        print(f"governor step median {governor_us(accept, verify, 4e-4, args.steps):.1f} us ({name})")
    if args.loop:
        for draft in ("none", "default"):
            us, tps, gamma = loop_us(draft, args.n, args.threads, args.loop_runs)
            print(f"loop outside llama_decode {us:.1f} us/step (--draft {draft}, {args.n} tokens, -t {args.threads}, "
                  f"{tps:.0f} tok/s, {gamma:.2f} drafts/step; medians of {args.loop_runs} runs)")


def governor_us(accept: float, verify, draft_s: float, n_steps: int) -> float:
    """Median µs of next_gamma + observe on a simulated target: verify(n) seconds for n tokens,
    draft_s per drafted token, each draft accepted with probability `accept`."""
    rng = np.random.default_rng(1)
    gov = Governor(GovernorConfig(gamma_max=GAMMA))
    times = np.empty(n_steps)
    clock = time.perf_counter_ns
    for i in range(n_steps):
        t0 = clock()
        g = gov.next_gamma()
        t1 = clock()
        a = 0
        while a < g and rng.random() < accept:
            a += 1
        v = verify(g + 1)
        t2 = clock()
        gov.observe(g, a, g * draft_s, v, 2e-5)
        times[i] = (t1 - t0) + (clock() - t2)
    return float(np.median(times[n_steps // 10:])) / 1e3


def loop_us(draft: str, n_tokens: int, n_threads: int, runs: int) -> tuple[float, float, float]:
    """Medians over `runs` fresh sessions on the shipped target (as `spac generate` runs it):
    (µs per step outside llama_decode, tok/s, drafted tokens per step)."""
    import orchestrator.runtime.llm as llm
    from orchestrator.cli.setup import default_models
    from orchestrator.decoding.speculative import Session, SessionConfig

    target, default_draft = default_models()
    inside = [0.0]
    decode = llm.L.llama_decode

    def timed_decode(ctx, batch):
        t0 = time.perf_counter()
        rc = decode(ctx, batch)
        inside[0] += time.perf_counter() - t0
        return rc

    cfg = SessionConfig(model=target, draft=default_draft if draft == "default" else None, n_threads=n_threads,
                        expert_engine=False)
    rows = []
    llm.L.llama_decode = timed_decode
    try:
        for _ in range(runs):
            with Session(cfg) as session:
                inside[0] = 0.0
                m = session.complete("class Stack:", max_tokens=n_tokens).metrics
                rows.append(((m.decode_s - inside[0]) / m.n_steps * 1e6, m.tokens_per_s, m.n_drafted / m.n_steps))
    finally:
        llm.L.llama_decode = decode
    return tuple(float(x) for x in np.median(rows, axis=0))

def numpy_call_us(n: int = 2000) -> float:
    """Median time of a trivial ufunc call, in µs."""
    one = np.ones(1)
    times = np.empty(n)
    for i in range(n):
        t0 = time.perf_counter_ns()
        np.add(one, one)
        times[i] = time.perf_counter_ns() - t0
    return float(np.median(times)) / 1e3


if __name__ == "__main__":
    main()
