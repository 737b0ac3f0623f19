"""Synthetic Qwen3-30B-A3B routing: calibration (±5 points) and the reference cache models."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.sim.locality import (
    access_order,
    belady_hit_curve,
    lru_hit_curve,
    repeat_rates,
)
from orchestrator.sim.synthetic import QWEN3_30B_A3B, RoutingModel, generate_routing, synthesize_trace

CAPACITIES = (8, 16, 32, 64)
LRU_TARGET = np.array([42, 65, 81, 92]) / 100
BELADY_TARGET = np.array([61, 78, 89, 93]) / 100


@pytest.fixture(scope="module")
def qwen3_routing():
    selected, _ = generate_routing(1000, QWEN3_30B_A3B, seed=0)
    return selected


def test_lru_and_belady_curves_match_published_numbers(qwen3_routing):
    lru = lru_hit_curve(qwen3_routing, CAPACITIES).mean(axis=1)
    belady = belady_hit_curve(qwen3_routing, CAPACITIES).mean(axis=1)
    assert np.abs(lru - LRU_TARGET).max() <= 0.05, lru
    assert np.abs(belady - BELADY_TARGET).max() <= 0.05, belady


def test_repeat_rates_and_flat_first_layer(qwen3_routing):
    rates = repeat_rates(qwen3_routing, QWEN3_30B_A3B.n_expert)
    assert abs(rates[1].mean() - 0.45) <= 0.05 and abs(rates[8].mean() - 0.80) <= 0.05
    assert rates[1][0] < 0.15  # layer 0: little temporal locality
    counts = np.bincount(qwen3_routing[:, 0].ravel(), minlength=128)
    p = counts / counts.sum()
    assert -(p * np.log(p)).sum() / np.log(128) > 0.97  # and a near-uniform marginal


def brute_force_lru(seq, capacity):
    cache, hits = [], 0
    for e in seq:
        if e in cache:
            hits += 1
            cache.remove(e)
        elif len(cache) == capacity:
            cache.pop(0)
        cache.append(e)
    return hits / len(seq)


def brute_force_belady(seq, capacity):
    cache, hits = set(), 0
    for i, e in enumerate(seq):
        if e in cache:
            hits += 1
            continue
        if len(cache) == capacity:
            def next_use(x):
                return next((j for j in range(i + 1, len(seq)) if seq[j] == x), len(seq) + 1)
            cache.remove(max(sorted(cache), key=next_use))
        cache.add(e)
    return hits / len(seq)


def test_reference_cache_models_against_brute_force():
    selected, _ = generate_routing(60, RoutingModel(n_layer=3, n_expert=12, top_k=3), seed=4)
    ordered = access_order(selected)
    caps = (3, 5, 8)
    lru, belady = lru_hit_curve(selected, caps), belady_hit_curve(selected, caps)
    for layer in range(3):
        seq = [int(e) for e in ordered[:, layer].ravel()]
        for i, c in enumerate(caps):
            assert lru[i, layer] == pytest.approx(brute_force_lru(seq, c))
            assert belady[i, layer] == pytest.approx(brute_force_belady(seq, c))
    # hits first: LRU with one token's worth of cache is exactly the next-token repeat rate
    assert lru[0] == pytest.approx(repeat_rates(selected, 12, (1,))[1], abs=0.02)


def test_speculative_trace():
    gamma, alpha = 6, 0.7
    t = synthesize_trace(300, RoutingModel(n_layer=4, n_expert=32, top_k=4), gamma=gamma,
                         acceptance=alpha, draft_fidelity=0.9, seed=3)
    assert t.n_steps == 300 and (t.n_drafted == gamma).all() and t.n_rows == 300 * (gamma + 1)
    expected = alpha * (1 - alpha ** gamma) / (1 - alpha)  # E[min(γ, Geometric − 1)]
    assert abs(t.n_accepted.mean() - expected) < 0.4
    # the draft agrees with the target on ≈ draft_fidelity of the experts of the same token
    agree = [np.isin(t.draft_step(i)[j, l], t.step(i).selected[j, l]).mean()
             for i in range(0, 300, 7) for j in range(gamma) for l in range(4)]
    assert abs(np.mean(agree) - 0.9) < 0.03
    np.testing.assert_allclose(t.weights.astype(np.float32).sum(axis=2), 1.0, atol=1e-2)
    again = synthesize_trace(300, RoutingModel(n_layer=4, n_expert=32, top_k=4), gamma=gamma,
                             acceptance=alpha, draft_fidelity=0.9, seed=3)
    np.testing.assert_array_equal(t.selected, again.selected)


def test_autoregressive_trace_has_no_drafts():
    t = synthesize_trace(20, RoutingModel(n_layer=2, n_expert=16, top_k=2), gamma=0, draft_fidelity=None)
    assert t.n_rows == 20 and t.n_generated == 20 and t.draft_selected is None
