"""Classic expert caches: each keeps the experts it ranks highest and evicts the lowest.

- `LRU`: least recently used. `per_layer=True` (the default) is Mixtral-offloading's cache,
  capacity // n_layer experts per layer; `per_layer=False` one pool over all layers.
- `LFU`: least frequently used, token-weighted counts over the whole run (MoE-Infinity's
  "least visit count" eviction).
- `ScoreBased`: lowest accumulated routing weight (Zhu et al., as benchmarked by SpecMD).
- `LlamaMoeCache`: llama.cpp's own GPU expert cache (`src/llama-moe-cache.cpp` on master): one
  cache over all the layers of a device, filled on demand after the router's choice is read back,
  every routed expert then on the device (or, with `cpu_share`, a share of the misses on the
  host once it is full), passes of at most 32 tokens; its victims by frequency class and age
  (ClassLRU, release b12170). `LlamaMoeCacheLRU`: the plain LRU it had before (4b060f27), which
  spac's engine runs live as its cache ablation. `DecodeOnlyLRU`: the per-layer, decode-only LRU
  of the open pull requests that preceded both.
- `LeastStale`: SpecMD's policy (SpecMD §4.2): experts used in the current pass are
  "current", the others "stale"; stale experts go first, current ones only when nothing else
  is left; inside each group first-in-first-out by layer position.

By default they fetch missing experts on demand (`miss="fetch"`, the GPU-centric systems they
come from) and their plans copy nothing ahead; with `miss="cpu"` the same ranking becomes a
plan: after each pass, admit the experts ranked highest, compute the rest on the host.
Ties: the lower (layer, expert) is evicted first and, consistently, kept last.

A verify pass runs each layer once, so recency is tracked per layer access. With that clock a
global LRU orders its victims exactly as Least-Stale does (oldest pass first, then lower
layer): `lru-global` and `least-stale` are one policy here and print identical rows. With fetch
on demand both thrash once a pass needs more experts than the pool (each in-pass copy evicts
what the next layers need, hit rate ≈ 0: LRU on a loop), which is why the zoo shows them with
host compute on miss. The gap SpecMD measures comes from token-by-token access within a pass,
where LRU can evict an expert the pass itself just used and Least-Stale does not:
`bench/sim_least_stale.py` measures both access models side by side.
"""

from __future__ import annotations

import numpy as np

from orchestrator.policies.base import (
    Feedback,
    Policy,
    PolicyContext,
    keep_plan,
    order_rows,
    ranked_plan,
    smallest_rows,
)
from orchestrator.policies.plan import Plan, StepRouting


class RankingPolicy(Policy):
    """Keep the highest `rank` (float [n_layer, n_expert], kept up to date by `on_layer`);
    -inf means "never wanted" (e.g. never used)."""

    per_layer = False

    def __init__(self, miss: str = "fetch", per_layer: bool | None = None) -> None:
        self.miss = miss
        if per_layer is not None:
            self.per_layer = per_layer

    def reset(self, ctx: PolicyContext) -> None:
        super().reset(ctx)
        if self.per_layer and ctx.capacity < ctx.n_layer:
            raise ValueError(f"{self.name}: a per-layer cache needs at least one slot per layer "
                             f"({ctx.n_layer}), the pool has {ctx.capacity}")
        self.per_layer_capacity = ctx.capacity // ctx.n_layer if self.per_layer else None
        self.rank = np.full((ctx.n_layer, ctx.n_expert), -np.inf)

    def key(self) -> np.ndarray:
        return self.rank

    def plan(self, routing: StepRouting | None, resident: np.ndarray, feedback: Feedback | None = None) -> Plan:
        if self.miss != "cpu":  # a demand cache: it copies inside the pass, never ahead of it
            return keep_plan(resident, prefetch=np.zeros((0, 2), dtype=np.int32), evict=order_rows(self.key(), resident))
        return ranked_plan(self.key(), self.ctx.capacity, resident, self.per_layer)

    def victims(self, allocated: np.ndarray, protected: np.ndarray, layer: int, n: int) -> np.ndarray:
        return smallest_rows(self.key(), self._victim_scope(allocated, protected, layer), n)


class LRU(RankingPolicy):
    """rank: the layer access (one per layer per pass, counted over the run) of the last use."""

    name = "lru"
    per_layer = True

    def reset(self, ctx: PolicyContext) -> None:
        super().reset(ctx)
        self.clock = 0

    def on_layer(self, layer: int, counts: np.ndarray, weights: np.ndarray) -> None:
        self.clock += 1
        self.rank[layer, counts > 0] = self.clock


class LlamaMoeCacheLRU(LRU):
    """llama.cpp's GPU expert cache as it first shipped (src/llama-moe-cache.cpp at 4b060f27; the
    live ablation of spac's engine, patch 0023): the layers of a device share one LRU over all its
    slots. For a ubatch of at most 32 tokens whose distinct experts fit the slots, each layer reads
    the router's choice back to the host (a device synchronize), touches its hits, gives each miss
    (ascending ids) the least recently used slot, uploads the misses and then runs every routed
    expert on the device (one op, after the uploads: a miss costs an upload on the critical
    path, never host compute). A larger ubatch runs the layer on the host and leaves the cache as
    it is (prompts: `sim prefill`). Nothing is copied ahead of a pass."""

    name = "llama-moe-cache-lru"
    per_layer = False
    readback_max_tokens = 32


class LlamaMoeCache(LlamaMoeCacheLRU):
    """llama.cpp master's cache since release b12170 (PR 31233, "ClassLRU"), as its source's header
    states it: each expert keeps a use count that decays with a half-life of 128 tokens (`crf`,
    kept across evictions) and the clock of its last use; its class is floor(log2(crf)), at most
    7. The clock advances by each ubatch's token count. A miss takes a free slot, else a victim:
    of the slots not chosen by the layer being served, the one with the largest age / 2^class
    (age: clock - last use), which is the least recently used slot of some class list, as master
    picks it. Read, filled and computed as `LlamaMoeCacheLRU`.

    `cpu_share` (`--moe-cache-cpu-share`, default 0): once the cache is full, that share of each
    layer's misses is computed on the host from the host experts instead of uploaded. Which misses
    was not found in what could be read (docs/simulator.md): here the ones of the lowest class
    (then the fewest tokens), rounded to the nearest count, an inference."""

    name = "llama-moe-cache"
    N_CLASS = 8
    HALF_LIFE = 128.0

    def __init__(self, miss: str = "fetch", per_layer: bool | None = None, cpu_share: float = 0.0) -> None:
        super().__init__(miss, per_layer)
        if not 0.0 <= cpu_share <= 1.0:
            raise ValueError(f"cpu_share must be in [0, 1], got {cpu_share}")
        self.cpu_share = cpu_share

    def reset(self, ctx: PolicyContext) -> None:
        super().reset(ctx)
        self.crf = np.zeros((ctx.n_layer, ctx.n_expert))
        self.klass = np.zeros((ctx.n_layer, ctx.n_expert))
        self.last_use = np.zeros((ctx.n_layer, ctx.n_expert))
        self.tokens = 0.0  # the clock: tokens of the ubatches seen
        self.last_layer = ctx.n_layer
        self.layer_key = self._key(0.0)

    def _now(self, layer: int) -> float:
        # the layers of one ubatch in order, within its token count (recency between layers)
        return self.tokens + layer / self.ctx.n_layer

    def on_layer(self, layer: int, counts: np.ndarray, weights: np.ndarray) -> None:
        if layer <= self.last_layer:  # a new ubatch: the clock advances by its tokens
            self.tokens += float(counts.sum()) / self.ctx.top_k
        self.last_layer = layer
        used = counts > 0
        now = self._now(layer)
        age = now - self.last_use[layer, used]
        self.crf[layer, used] = self.crf[layer, used] * np.exp2(-age / self.HALF_LIFE) + counts[used]
        self.klass[layer, used] = np.minimum(np.floor(np.log2(self.crf[layer, used])), self.N_CLASS - 1)
        self.last_use[layer, used] = now
        self.rank[layer, used] = now
        # the victims' order while this layer is served (its misses are uploaded next): computed
        # once, its own chosen experts never victims
        self.layer_key = self._key(now)
        self.layer_key[layer, used] = np.inf

    def key(self) -> np.ndarray:
        """Higher is kept longer: minus age / 2^class (-inf: never used)."""
        return self._key(self._now(self.ctx.n_layer))

    def _key(self, now: float) -> np.ndarray:
        return np.where(np.isfinite(self.rank), -(now - self.last_use) / np.exp2(self.klass), -np.inf)

    def victims(self, allocated: np.ndarray, protected: np.ndarray, layer: int, n: int) -> np.ndarray:
        """The largest age / 2^class first, at the clock of the layer being served, whose own
        chosen experts (used at that clock) are never victims."""
        scope = self._victim_scope(allocated, protected, layer)
        if layer == self.last_layer:
            key = self.layer_key
        else:
            now = self._now(layer)
            key = self._key(now)
            key[layer, self.last_use[layer] >= now] = np.inf
        scope &= key != np.inf  # never one the layer chose
        return smallest_rows(key, scope, n)

    def host_misses(self, layer: int, misses: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """The misses of a full cache computed on the host: round(cpu_share · misses) of them, the
        lowest class first, then the fewest tokens, then the lower id."""
        k = int(round(self.cpu_share * len(misses)))
        if not k:
            return misses[:0]
        order = np.lexsort((misses, counts[misses], self.klass[layer, misses]))
        return np.sort(misses[order[:k]])


class DecodeOnlyLRU(LRU):
    """The per-layer LRU of the open pull requests before master's cache: capacity // n_layer
    slots per layer, filled on demand as llama-moe-cache is, for one-token ubatches only; a
    speculative verify pass (more tokens) runs every expert on the host."""

    name = "lru-decode-only"
    per_layer = True
    readback_max_tokens = 1


class LFU(RankingPolicy):
    """rank: tokens that used the expert over the whole run."""

    name = "lfu"

    def on_layer(self, layer: int, counts: np.ndarray, weights: np.ndarray) -> None:
        used = counts > 0
        row = self.rank[layer]
        row[used] = np.where(np.isfinite(row[used]), row[used], 0.0) + counts[used]


class ScoreBased(RankingPolicy):
    """rank: accumulated routing weight; `decay` < 1 forgets old passes geometrically."""

    name = "score"

    def __init__(self, miss: str = "fetch", per_layer: bool | None = None, decay: float = 1.0) -> None:
        super().__init__(miss, per_layer)
        self.decay = decay

    def on_layer(self, layer: int, counts: np.ndarray, weights: np.ndarray) -> None:
        row = self.rank[layer]
        seen = np.isfinite(row)
        row[seen] *= self.decay
        row[seen] += weights[seen]
        new = ~seen & (counts > 0)
        row[new] = weights[new]


class LeastStale(RankingPolicy):
    """rank (victims lowest first): the stale queue, oldest pass first and FIFO by layer inside a
    pass, then the current queue (used in this pass) by layer: pass · n_layer + layer."""

    name = "least-stale"

    def reset(self, ctx: PolicyContext) -> None:
        super().reset(ctx)
        self.pass_index = 0

    def on_layer(self, layer: int, counts: np.ndarray, weights: np.ndarray) -> None:
        self.rank[layer, counts > 0] = self.pass_index * self.ctx.n_layer + layer

    def plan(self, routing: StepRouting | None, resident: np.ndarray, feedback: Feedback | None = None) -> Plan:
        if routing is not None:
            self.pass_index += 1  # the pass is over: everything it used becomes stale
        return super().plan(routing, resident, feedback)


class ReuseCredited(LlamaMoeCache):
    """spac's miss rule (issue 51), simulated: every routed expert the pool lacks is uploaded or
    computed on the host, decided in a gate after the layer's router. The upload is chosen when
    the copy and the device's compute finish no later than the host would, plus the host time
    the expert's later uses are expected to save once it is resident: its reuse rate (the
    decayed use count of llama.cpp's ClassLRU over its saturation, uses per token) times a
    horizon in tokens times one token's host-minus-device time. A one-token expert no later
    pass reuses earns no credit and stays on the host. Victims as the ClassLRU's. The horizon,
    32 tokens, was the best of 8-512 on the 8 and 12 GB Qwen3-30B-A3B rows of
    bench/sim_gpu_projection.py (docs/simulator.md)."""

    name = "spac-reuse"
    miss = "greedy"
    readback_max_tokens = None
    gate_readback = True
    SATURATION = 1.0 / (1.0 - 2.0 ** (-1.0 / LlamaMoeCache.HALF_LIFE))  # the count of an expert every token uses

    def __init__(self, horizon: float = 32.0) -> None:
        super().__init__(miss="greedy")
        self.horizon = horizon

    def upload_credit(self, layer: int, experts: np.ndarray, costs) -> np.ndarray:
        rate = self.crf[layer, experts] / self.SATURATION
        return rate * self.horizon * max(float(costs.cpu_expert_s(1)) - float(costs.gpu_expert_s(1)), 0.0)
