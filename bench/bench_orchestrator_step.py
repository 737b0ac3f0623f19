"""Orchestrator time per verification step: f_t, estimator, balancer, plan.

48 MoE layers × 128 experts, top-8 routing of 9 verified tokens (γ = 8), random routing.
Prints the median time per step in µs, the median of each part, and the median cost of one
trivial numpy call on this machine (a step makes ~100 numpy calls, so a busy or slow machine
shows up there first).

    .venv/bin/python bench/bench_orchestrator_step.py [--steps N]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from orchestrator.balancer import UnitCosts, WorkloadBalancer
from orchestrator.estimator import UtilityEstimator
from orchestrator.plan import Plan, StepRouting

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
