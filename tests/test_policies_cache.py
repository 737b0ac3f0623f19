"""Cache policies in the simulator against independent brute-force caches."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.policies import make_policy
from orchestrator.sim.simulator import SimConfig, Simulator
from orchestrator.sim.synthetic import RoutingModel, synthesize_trace

SHAPE = RoutingModel(n_layer=3, n_expert=16, top_k=2)


@pytest.fixture(scope="module")
def trace():
    return synthesize_trace(60, SHAPE, gamma=3, acceptance=0.6, draft_fidelity=None, seed=7)


def brute_force(trace, capacity, per_layer, rank):
    """Token-weighted hit rate of a fetch-on-miss cache, pass by pass and layer by layer.

    A layer's needed experts are all touched first (hits counted against the cache as it was
    when the layer started), then its misses are loaded in expert-id order, each evicting the
    cached expert with the smallest rank(layer, expert, state) (ties: lowest layer, then id).
    """
    cache = set()
    last_use, uses = {}, {}
    clock = hits = total = 0
    for step in trace.steps():
        for layer in range(trace.n_layer):
            ids, counts = np.unique(step.selected[:, layer], return_counts=True)
            clock += 1
            for e, n in zip(ids.tolist(), counts.tolist()):
                key = (layer, e)
                total += n
                hits += n if key in cache else 0
                last_use[key] = clock
                uses[key] = uses.get(key, 0) + n
            for e in [e for e in ids.tolist() if (layer, e) not in cache]:  # hits were computed first
                pool = [x for x in cache if x[0] == layer] if per_layer else list(cache)
                limit = capacity // trace.n_layer if per_layer else capacity
                if len(pool) >= limit:
                    cache.remove(min(pool, key=lambda x: (rank(x, last_use, uses), x)))
                cache.add((layer, e))
    return hits / total


def lru_rank(x, last_use, uses):
    return last_use[x]


def lfu_rank(x, last_use, uses):
    return uses[x]


@pytest.mark.parametrize("name, per_layer, rank, capacity", [
    ("lru", True, lru_rank, 12),
    ("lru", True, lru_rank, 24),
    ("lru-global", False, lru_rank, 10),
    ("lfu", False, lfu_rank, 10),
    ("lfu", False, lfu_rank, 20),
])
def test_hit_rate_equals_brute_force(trace, name, per_layer, rank, capacity):
    sim = Simulator(trace, SimConfig(capacity=capacity))
    result = sim.run(make_policy(name))
    assert result.hit_rate == pytest.approx(brute_force(trace, capacity, per_layer, rank), abs=1e-12)
    assert result.cpu_share == 0 and result.hit_rate + result.fetch_share == pytest.approx(1.0)


def test_least_stale_orders_victims_like_global_lru(trace):
    # one layer access per pass: stale-FIFO-by-layer and least-recent coincide (see cache.py)
    sim = Simulator(trace, SimConfig(capacity=14))
    a, b = sim.run(make_policy("least-stale")), sim.run(make_policy("lru-global"))
    assert (a.hit_rate, a.collision_misses, a.fetch_bytes) == (b.hit_rate, b.collision_misses, b.fetch_bytes)


def test_cyclic_passes_defeat_a_global_recency_cache():
    # a pass that needs more experts than the pool evicts, in LRU order, exactly the experts the
    # next layers are about to use: collision misses everywhere; per-layer LRU keeps its hits
    t = synthesize_trace(30, RoutingModel(n_layer=8, n_expert=32, top_k=4), gamma=7, draft_fidelity=None, seed=1)
    sim = Simulator(t, SimConfig(capacity=64))
    glob, per_layer = sim.run(make_policy("lru-global")), sim.run(make_policy("lru"))
    assert glob.hit_rate < 0.05 and glob.collision_misses > 100
    assert per_layer.hit_rate > 0.3
