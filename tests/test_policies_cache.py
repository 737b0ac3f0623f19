"""Cache policies in the simulator against independent brute-force caches."""

from __future__ import annotations

import math

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
    ("llama-moe-cache-lru", False, lru_rank, 10),
    ("llama-moe-cache-lru", False, lru_rank, 30),
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
    cache, plain = sim.run(make_policy("llama-moe-cache-lru")), sim.run(make_policy("lru-global"))
    assert cache.hit_rate == plain.hit_rate and cache.fetch_bytes == plain.fetch_bytes
    sync = sim.costs.sync_s
    extra = cache.step_time - plain.step_time
    assert (extra >= trace.n_layer * sync * (1 - 1e-9)).all()
    assert np.median(extra[trace.n_steps // 2:]) == pytest.approx(trace.n_layer * sync, rel=1e-9)  # mostly no miss


@pytest.mark.parametrize("name", ["llama-moe-cache", "llama-moe-cache-lru"])
def test_llama_moe_cache_leaves_larger_passes_to_the_host_and_itself_unchanged(name):
    """A ubatch of more than 32 tokens runs its layers without the cache: every expert on the
    host, nothing uploaded (as master's prompts, which only read the cache)."""
    big = synthesize_trace(20, SHAPE, gamma=40, acceptance=0.6, draft_fidelity=None, seed=3)
    r = Simulator(big, SimConfig(capacity=20)).run(make_policy(name))
    assert r.cpu_share == 1.0 and r.hit_rate == 0.0 and r.fetch_bytes == 0


@pytest.mark.parametrize("gamma, on_device", [(0, True), (3, False)])
def test_the_decode_only_lru_caches_one_token_passes_only(gamma, on_device):
    t = synthesize_trace(30, SHAPE, gamma=gamma, acceptance=0.6, draft_fidelity=None, seed=5)
    r = Simulator(t, SimConfig(capacity=24)).run(make_policy("lru-decode-only"))
    assert r.cpu_share == (0.0 if on_device else 1.0)
    if on_device:  # the per-layer LRU's hit rate, every expert then on the device
        assert r.hit_rate == pytest.approx(brute_force(t, 24, True, lru_rank), abs=1e-12)


def class_lru(trace, capacity, half_life=128.0, n_class=8):
    """llama.cpp master's ClassLRU written out (docs/simulator.md): per (layer, expert) a use count
    decayed by its age in tokens with a half-life of 128 and the clock of its last use; class =
    min(floor(log2(count)), 7); a miss takes a free slot, else the cached expert not chosen by its
    layer with the largest age / 2^class (ties: lowest layer, then id). The clock advances by each
    pass's tokens; the layers of a pass are ordered within it. Token-weighted hit rate."""
    cache, crf, klass, last = set(), {}, {}, {}
    tokens = hits = total = 0
    for step in trace.steps():
        tokens += step.selected.shape[0]
        for layer in range(trace.n_layer):
            now = tokens + layer / trace.n_layer
            ids, counts = np.unique(step.selected[:, layer], return_counts=True)
            for e, n in zip(ids.tolist(), counts.tolist()):
                key = (layer, e)
                total += n
                hits += n if key in cache else 0
                crf[key] = crf.get(key, 0.0) * np.exp2(-(now - last.get(key, now)) / half_life) + n
                klass[key] = min(math.floor(np.log2(crf[key])), n_class - 1)
                last[key] = now
            chosen = {(layer, e) for e in ids.tolist()}
            for e in [e for e in ids.tolist() if (layer, e) not in cache]:
                if len(cache) >= capacity:
                    score = {x: (now - last[x]) / np.exp2(klass[x]) for x in cache - chosen}
                    best = max(score.values())
                    cache.remove(min(x for x, v in score.items() if v == best))
                cache.add((layer, e))
    return hits / total


@pytest.mark.parametrize("capacity", [8, 14, 30])
def test_the_class_lru_equals_master_rule_written_out(trace, capacity):
    r = Simulator(trace, SimConfig(capacity=capacity)).run(make_policy("llama-moe-cache"))
    assert r.hit_rate == pytest.approx(class_lru(trace, capacity), abs=1e-12)
    assert r.cpu_share == 0


def test_the_class_lru_keeps_a_frequent_expert_that_plain_lru_evicts():
    """An expert used by every token of a run survives a burst of one-off experts that would push
    it out of a plain LRU: its class (count ~ tokens since it started, up to 7) outweighs their age."""
    from orchestrator.policies.base import PolicyContext

    ctx = PolicyContext(n_layer=1, n_expert=8, top_k=1, capacity=2)
    cache = make_policy("llama-moe-cache")
    cache.reset(ctx)
    for _ in range(40):  # expert 0, one token per pass
        cache.on_layer(0, np.eye(8)[0], np.eye(8)[0])
    for e in (1, 2):  # two one-off experts, newer than expert 0
        cache.on_layer(0, np.eye(8)[e], np.eye(8)[e])
    allocated = np.zeros((1, 8), dtype=bool)
    allocated[0, :3] = True
    protected = np.zeros_like(allocated)
    protected[0, 2] = True  # the miss being served
    assert cache.victims(allocated, protected, 0, 1).tolist() == [[0, 1]]


def test_a_cpu_share_computes_that_share_of_a_full_caches_misses_on_the_host(trace):
    """--moe-cache-cpu-share: until the cache is full every miss is uploaded; then round(share x
    misses) of each layer's misses run on the host, the lowest class first, and are not cached."""
    n_all = trace.n_layer * trace.n_expert
    sim = Simulator(trace, SimConfig(capacity=n_all // 2))
    none, half, every = (sim.run(make_policy("llama-moe-cache", cpu_share=s)) for s in (0.0, 0.5, 1.0))
    assert none.cpu_share == 0 and 0 < half.cpu_share < every.cpu_share
    # the fill (the layer that fills it uploads all its misses), then nothing more
    slots = n_all // 2
    assert slots * sim.costs.expert_bytes <= every.fetch_bytes < (slots + trace.n_expert) * sim.costs.expert_bytes
    assert half.fetch_bytes < none.fetch_bytes
    policy = make_policy("llama-moe-cache", cpu_share=0.5)
    policy.reset(sim.context(policy))
    policy.klass[0, :4] = [3, 0, 0, 2]
    assert policy.host_misses(0, np.arange(4), np.array([1, 5, 2, 1])).tolist() == [1, 2]
    with pytest.raises(ValueError, match="cpu_share"):
        make_policy("llama-moe-cache", cpu_share=1.5)
