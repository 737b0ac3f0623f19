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
    # llama.cpp's cache: the same global LRU (hits touched first, misses in id order take the least
    # recently used slots), every routed expert on the device
    ("llama-moe-cache", False, lru_rank, 10),
    ("llama-moe-cache", False, lru_rank, 30),
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


def test_llama_moe_cache_reads_back_every_layer_and_uploads_on_the_critical_path(trace):
    """Master's cache pays a device synchronize per layer (the router's choice read back) whether
    it hits or not, and computes a layer only once its misses are uploaded; the same LRU without
    the readback (lru-global: fetch each miss as its turn comes) is faster by the readbacks in
    every pass, exactly so in a pass without a miss (a miss also waits for the layer's uploads)."""
    n_all = trace.n_layer * trace.n_expert
    sim = Simulator(trace, SimConfig(capacity=n_all))
    cache, plain = sim.run(make_policy("llama-moe-cache")), sim.run(make_policy("lru-global"))
    assert cache.hit_rate == plain.hit_rate and cache.fetch_bytes == plain.fetch_bytes
    sync = sim.costs.sync_s
    extra = cache.step_time - plain.step_time
    assert (extra >= trace.n_layer * sync * (1 - 1e-9)).all()
    assert np.median(extra[trace.n_steps // 2:]) == pytest.approx(trace.n_layer * sync, rel=1e-9)  # mostly no miss


def test_llama_moe_cache_leaves_larger_passes_to_the_host_and_itself_unchanged():
    """A ubatch of more than 32 tokens runs its layers without the cache: every expert on the
    host, nothing uploaded (as master's prompts, which only read the cache)."""
    big = synthesize_trace(20, SHAPE, gamma=40, acceptance=0.6, draft_fidelity=None, seed=3)
    r = Simulator(big, SimConfig(capacity=20)).run(make_policy("llama-moe-cache"))
    assert r.cpu_share == 1.0 and r.hit_rate == 0.0 and r.fetch_bytes == 0


@pytest.mark.parametrize("gamma, on_device", [(0, True), (3, False)])
def test_the_decode_only_lru_caches_one_token_passes_only(gamma, on_device):
    t = synthesize_trace(30, SHAPE, gamma=gamma, acceptance=0.6, draft_fidelity=None, seed=5)
    r = Simulator(t, SimConfig(capacity=24)).run(make_policy("lru-decode-only"))
    assert r.cpu_share == (0.0 if on_device else 1.0)
    if on_device:  # the per-layer LRU's hit rate, every expert then on the device
        assert r.hit_rate == pytest.approx(brute_force(t, 24, True, lru_rank), abs=1e-12)
