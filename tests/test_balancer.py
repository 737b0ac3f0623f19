"""Heterogeneous Workload Balancer against brute-force search over τ (MoE-SpAc §3.3, Eq. 9–12)."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.policies.balancer import (
    FIXED_THRESHOLD,
    UnitCosts,
    WorkloadBalancer,
    WorkloadStats,
    prefetch_count,
    solve_threshold,
    utility_levels,
)


def brute_force_threshold(r_cpu, r_gpu, b, n_new, costs: UnitCosts, gamma, top_k, n_layer_target):
    """Try every τ = 1..K for each instance (row): the feasible τ with the smallest
    |T_cpu − T_gpu|, the larger τ on ties; K when no τ is feasible. Eq. 7–11 as the paper
    writes them (the module divides the budgets instead; only an exact float tie could tell)."""
    n, k_max = r_cpu.shape
    window = costs.t_total + gamma * costs.t_draft_token / n_layer_target
    best_tau = np.full(n, k_max)
    best_obj = np.full(n, np.inf)
    for tau in range(1, k_max + 1):
        t_cpu = r_cpu[:, tau - 1] * (gamma + 1) * top_k * costs.t_cpu_unit
        t_gpu = r_gpu[:, tau - 1] * b * costs.t_gpu_unit
        obj = np.abs(t_cpu - t_gpu)
        n_tau = n_new[:, tau - 1]
        ok = (costs.t_io_unit * n_tau <= window) & (costs.expert_bytes * n_tau <= costs.vram_left)
        better = ok & (obj <= best_obj)
        best_tau[better] = tau
        best_obj[better] = obj[better]
    return best_tau


def random_costs(rng: np.random.Generator, n: int) -> UnitCosts:
    log_uniform = lambda lo, hi: 10.0 ** rng.uniform(np.log10(lo), np.log10(hi), n)  # noqa: E731
    return UnitCosts(
        t_cpu_unit=log_uniform(1e-5, 1e-3),
        t_gpu_unit=log_uniform(1e-5, 1e-3),
        t_io_unit=log_uniform(1e-5, 1e-3),
        expert_bytes=log_uniform(1e5, 1e7),
        t_draft_token=log_uniform(1e-4, 1e-2),
        t_total=log_uniform(1e-4, 1e-2),
        vram_left=log_uniform(1e6, 1e9),
    )


def random_instances(rng: np.random.Generator, n: int, k_max: int, gamma: int, n_expert: int):
    """Tables as the balancer builds them, from random utilities, routing and residency."""
    stats = WorkloadStats(n, k_max, decay=rng.uniform(0.05, 1.0))
    for _ in range(rng.integers(1, 4)):
        utility = rng.integers(0, k_max + 1, (n, n_expert)).astype(np.uint8)
        # a few experts used often, most rarely
        p_use = rng.uniform(0.0, 0.6, (n, 1)) ** 3 * 3 / (1 + np.arange(n_expert))
        stats.observe(rng.binomial(gamma + 1, np.minimum(p_use, 1.0)).astype(np.int32), utility)
    utility = rng.integers(0, k_max + 1, (n, n_expert)).astype(np.uint8)
    resident = rng.random((n, n_expert)) < rng.random((n, 1))
    n_new = prefetch_count(utility_levels(utility, k_max), resident, n, k_max)
    return stats.r_cpu, stats.r_gpu, stats.b, n_new


def mirrored_instances(rng: np.random.Generator, n: int, k_max: int, gamma: int, top_k: int,
                       n_expert: int, costs: UnitCosts):
    """Monotone tables in eighths with r_g = 1 − r_c and (γ+1)·k·T^u_cpu = b·T^u_gpu, all
    dyadic: the gap is exact and often equal in size on both sides of its sign change, the
    tie the fast path must break like the brute force. Sets costs.t_gpu_unit to match."""
    r_cpu = np.sort(rng.integers(0, 9, (n, k_max)) / 8, axis=1)
    b = 2.0 ** rng.integers(0, 6, n)
    costs.t_cpu_unit = 2.0 ** rng.integers(-12, -6, n)
    costs.t_gpu_unit = (gamma + 1) * top_k * costs.t_cpu_unit / b
    n_new = np.sort(rng.integers(0, n_expert + 1, (n, k_max)), axis=1)[:, ::-1]
    return r_cpu, 1.0 - r_cpu, b, n_new


def test_equals_brute_force_on_10000_instances() -> None:
    rng = np.random.default_rng(5)
    n_group, n_per_group = 20, 500
    seen = {"infeasible": 0, "flat gap": 0, "equal |gap| across the crossing": 0, "interior": 0}
    for group in range(n_group):
        k_max = int(rng.integers(1, 9))
        gamma = int(rng.integers(1, 12))
        top_k = int(rng.integers(1, 9))
        n_layer_target = int(rng.integers(1, 64))
        n_expert = int(rng.integers(4, 40))
        costs = random_costs(rng, n_per_group)
        if group % 2:
            tables = mirrored_instances(rng, n_per_group, k_max, gamma, top_k, n_expert, costs)
        else:
            tables = random_instances(rng, n_per_group, k_max, gamma, n_expert)
        args = (*tables, costs, gamma, top_k, n_layer_target)
        tau = solve_threshold(*args)
        np.testing.assert_array_equal(tau, brute_force_threshold(*args), err_msg=f"group {group}")
        assert tau.dtype == np.int32 and tau.min() >= 1 and tau.max() <= k_max

        # the instances must reach every case
        r_cpu, r_gpu, b, n_new = tables
        window = costs.t_total + gamma * costs.t_draft_token / n_layer_target
        feasible = (costs.t_io_unit[:, None] * n_new <= window[:, None]) & (
            costs.expert_bytes[:, None] * n_new <= costs.vram_left[:, None])
        gap = r_cpu * ((gamma + 1) * top_k * costs.t_cpu_unit)[:, None] - r_gpu * (b * costs.t_gpu_unit)[:, None]
        seen["infeasible"] += int((~feasible.any(axis=1)).sum())
        seen["interior"] += int(((tau > 1) & (tau < k_max) & feasible.all(axis=1)).sum())
        seen["flat gap"] += int((gap[:, :-1] == gap[:, 1:]).any(axis=1).sum())
        crossing_tie = (gap[:, :-1] < 0) & (gap[:, :-1] == -gap[:, 1:])
        seen["equal |gap| across the crossing"] += int(crossing_tie.any(axis=1).sum())
    assert min(seen.values()) > 200, seen


def test_infeasible_gives_k() -> None:
    costs = UnitCosts(1e-4, 1e-4, t_io_unit=1.0, expert_bytes=1.0, t_draft_token=0.0, t_total=2.5, vram_left=1e9)
    r_cpu = np.array([[0.1, 0.5, 0.9, 1.0]] * 2)
    r_gpu = np.array([[0.9, 0.5, 0.1, 0.0]] * 2)
    b = np.array([8.0, 8.0])
    # window 2.5 s, one expert per second: n(τ) ≤ 2 is feasible, row 0 never gets there
    n_new = np.array([[9, 7, 5, 3], [9, 7, 2, 0]])
    tau = solve_threshold(r_cpu, r_gpu, b, n_new, costs, gamma=4, top_k=2, n_layer_target=1)
    assert tau.tolist() == [4, 3]


def test_constraint_boundary_is_feasible() -> None:
    # the balance is best at τ = 1; n(1) = 3 experts take exactly the 3 s window
    costs = UnitCosts(1.0, 1.0, t_io_unit=1.0, expert_bytes=2.0, t_draft_token=1.0, t_total=1.0, vram_left=6.0)
    tau = solve_threshold(np.array([[0.0, 0.5]]), np.array([[0.0, 0.0]]), np.array([4.0]),
                          np.array([[3, 0]]), costs, gamma=2, top_k=1, n_layer_target=1)
    assert tau.tolist() == [1]
    tight = UnitCosts(1.0, 1.0, t_io_unit=1.0, expert_bytes=2.0, t_draft_token=1.0, t_total=1.0, vram_left=5.9)
    tau = solve_threshold(np.array([[0.0, 0.5]]), np.array([[0.0, 0.0]]), np.array([4.0]),
                          np.array([[3, 0]]), tight, gamma=2, top_k=1, n_layer_target=1)
    assert tau.tolist() == [2]


def test_ties_prefer_larger_threshold() -> None:
    free = UnitCosts(1.0, 1.0, 1e-9, 1.0, 0.0, 1.0, 1e9)
    # gap = [−1, 0, 0, 1]: τ = 2 and 3 balance equally, 3 copies fewer experts
    tau = solve_threshold(np.array([[0.0, 0.1, 0.1, 0.2]]), np.array([[1.0, 1.0, 1.0, 1.0]]),
                          np.array([1.0]), np.array([[4, 3, 2, 1]]), free, gamma=4, top_k=2, n_layer_target=1)
    assert tau.tolist() == [3]


def test_stats_on_the_paper_example() -> None:
    """Appendix C.1: two draft tokens pick {0, 3} and {2, 3}; expert 3 is hot."""
    stats = WorkloadStats(1, 4)
    freq = np.array([[1, 0, 1, 2]], dtype=np.int32)
    utility = np.array([[0, 0, 1, 3]], dtype=np.uint8)
    stats.observe(freq, utility)
    # τ = 1: experts 2 and 3 hot; τ = 2, 3: only expert 3; τ = 4: none
    np.testing.assert_allclose(stats.r_cpu, [[1 / 4, 2 / 4, 2 / 4, 1.0]])
    np.testing.assert_allclose(stats.r_gpu, [[2 / 3, 1 / 3, 1 / 3, 0.0]])
    np.testing.assert_allclose(stats.b, [3.0])
    # a second step is blended in with weight `decay`
    stats.observe(np.array([[0, 0, 0, 1]], dtype=np.int32), utility)
    np.testing.assert_allclose(stats.r_cpu, [[0.9 / 4, 0.9 * 2 / 4, 0.9 * 2 / 4, 1.0]])
    np.testing.assert_allclose(stats.b, [0.9 * 3 + 0.1 * 1])


def test_prefetch_count() -> None:
    utility = np.array([[0, 1, 2, 2, 4], [3, 3, 3, 0, 4]], dtype=np.uint8)
    resident = np.array([[False, False, True, False, False], [True, False, False, False, False]])
    level = utility_levels(utility, 4)
    assert prefetch_count(level, resident, 2, 4).tolist() == [[3, 2, 1, 1], [3, 3, 3, 1]]
    assert prefetch_count(level, None, 2, 4).tolist() == [[4, 3, 1, 1], [4, 4, 4, 1]]


def test_balancer_pairs_routing_with_the_utilities_in_force() -> None:
    costs = UnitCosts(1e-4, 1e-4, 1e-4, 1e6, 1e-3, 1e-3, 1e9)
    bal = WorkloadBalancer(1, 4, top_k=2, k_max=4)
    freq = np.array([[1, 0, 1, 2]], dtype=np.int32)
    first = bal.update(freq, np.array([[0, 0, 1, 3]], dtype=np.uint8), None, costs, gamma=1)
    # step 1 ran with all utilities 0: every activation on the host
    np.testing.assert_allclose(bal.stats.r_cpu, [[1.0] * 4])
    assert first.tolist() == [4]  # nothing can balance yet; ties go to K
    bal.update(freq, np.zeros((1, 4), dtype=np.uint8), None, costs, gamma=1)
    np.testing.assert_allclose(bal.stats.r_cpu, [[0.9 + 0.1 / 4, 0.9 + 0.2 / 4, 0.9 + 0.2 / 4, 1.0]])
    bal.reset()
    assert bal.stats.n_observed == 0


@pytest.mark.parametrize(("k_max", "expected"), [(4, FIXED_THRESHOLD), (1, 1)])
def test_fixed_threshold(k_max: int, expected: int) -> None:
    costs = UnitCosts(1e-4, 1e-4, 1e-4, 1e6, 1e-3, 1e-3, 1e9)
    bal = WorkloadBalancer(3, 8, top_k=2, k_max=k_max, fixed_threshold=FIXED_THRESHOLD)
    rng = np.random.default_rng(0)
    for _ in range(3):
        utility = rng.integers(0, k_max + 1, (3, 8)).astype(np.uint8)
        tau = bal.update(rng.integers(0, 3, (3, 8)), utility, None, costs, gamma=4)
        assert tau.tolist() == [expected] * 3 and tau.dtype == np.int32


def test_free_copies_and_per_layer_costs() -> None:
    """t_io_unit = 0 (a device sharing host memory) leaves only the memory bound; costs may
    differ per layer."""
    costs = UnitCosts(1.0, 1.0, t_io_unit=np.array([0.0, 1.0]), expert_bytes=1.0,
                      t_draft_token=0.0, t_total=1.0, vram_left=np.array([10.0, 10.0]))
    r_cpu = np.array([[0.0, 1.0]] * 2)
    r_gpu = np.array([[1.0, 0.0]] * 2)
    # gap: τ = 1 → −b·1 = −1, τ = 2 → (γ+1)·k = 2; τ = 1 balances better, if it fits
    n_new = np.array([[5.0, 0.0], [5.0, 0.0]])
    tau = solve_threshold(r_cpu, r_gpu, np.array([1.0, 1.0]), n_new, costs, gamma=1, top_k=1, n_layer_target=1)
    assert tau.tolist() == [1, 2]
