"""Expert-placement policies, shared by the live engine and the simulator.

The interface is in `base` (`Policy`, `PolicyContext`, `Feedback`); a policy turns the routing
of the last verify pass and its own state into an `orchestrator.policies.plan.Plan`.

A policy is a combination (SpecMD's framework, SpecMD §3.1) of four choices:

    ranking   which experts deserve a slot: lru, lfu, least-stale, score (routing weight),
              utility (MoE-SpAc's Algorithm 1), lookahead (the draft's routing, MoE-SpeQ),
              belady (future knowledge), spac (learned from verify pass and draft: `default`)
    miss      what happens to a needed expert that is not on the device: "fetch" (copy it in
              the pass, compute on the device), "host" (compute it on the host; `Policy.miss`
              "cpu"), "greedy" (HybriMoE's two-ended split: copy when that finishes first)
    window    when copies are issued: "pass" (after each verify pass, for the next one) or
              "draft" (also while the draft drafts, from its routing)
    split     how the device/host split is decided: "resident" (an expert runs where it is),
              "tau" (MoE-SpAc's balancer: a threshold per layer), "layer" (whole layers on one
              side, llama.cpp --n-cpu-moe)

Named systems are combinations (`SYSTEMS`); the zoo (`ZOO`) is every ranking with host compute
on miss, which is what a llama.cpp user gets (upstream computes misses on the CPU).

    name            ranking       miss    window  split     from
    static          layer order   host    -       layer     llama.cpp --n-cpu-moe (the paper's llama.cpp-w/SD)
    lru             lru/layer     fetch   pass    resident  Mixtral-offloading
    lru-global      lru           fetch   pass    resident  one LRU pool over all layers
    llama-moe-cache class-lru     fetch*  -       resident  llama.cpp master's GPU expert cache (* after
                                                            reading the router back; passes ≤ 32 tokens;
                                                            cpu_share: a share of a full cache's misses
                                                            on the host, --moe-cache-cpu-share)
    llama-moe-cache-lru lru       fetch*  -       resident  the same cache with its first, plain LRU
    lru-decode-only lru/layer     fetch*  -       resident  the per-layer LRU of earlier llama.cpp PRs
                                                            (* one-token passes only)
    lfu             lfu           fetch   pass    resident  MoE-Infinity
    least-stale     least-stale   fetch   pass    resident  SpecMD §4.2
    score           score         fetch   pass    resident  Zhu et al., as benchmarked by SpecMD
    hybrimoe        score (decay) greedy  pass    resident  HybriMoE
    specmoe         hot set       fetch   pass    resident  SpecMoE §III-B
    moe-speq        lookahead     fetch   draft   resident  MoE-SpeQ §3.3
    moe-spac-paper  utility       host    pass    tau       MoE-SpAc §3.2, Algorithm 1 as written
    spac            spac          greedy  draft   resident  spac's default (`default`)
    spac-reuse      class-lru     greedy+ -       resident  spac's miss rule of issue 51 (+ the host time
                                                            an upload's reuse saves; decided after the router)
    belady          belady        host    pass    resident  future knowledge (not the limit: `sim.limit`)
    <ranking>/host  the zoo: each ranking above with host compute on miss
"""

from __future__ import annotations

from typing import Callable

from orchestrator.policies.base import Feedback, Policy, PolicyContext, observe
from orchestrator.policies.cache import (
    LFU,
    LRU,
    DecodeOnlyLRU,
    LeastStale,
    LlamaMoeCache,
    LlamaMoeCacheLRU,
    ReuseCredited,
    ScoreBased,
)
from orchestrator.policies.default import LookaheadUtility
from orchestrator.policies.hybrimoe import HybriMoE
from orchestrator.policies.lookahead import MoESpeQLookahead
from orchestrator.policies.oracle import Oracle
from orchestrator.policies.spac import MoESpAc
from orchestrator.policies.specmoe import SpecMoEHotSet
from orchestrator.policies.static import StaticPlacement

DEFAULT = "spac"
MISS_RULES = {"fetch": "fetch", "host": "cpu", "greedy": "greedy"}


def _named(name: str, factory: Callable[..., Policy], **fixed) -> Callable[..., Policy]:
    def make(**kw) -> Policy:
        policy = factory(**{**fixed, **kw})
        policy.name = name
        return policy
    make.__doc__ = f"{factory.__name__}({', '.join(f'{k}={v!r}' for k, v in fixed.items())})"
    return make


def _moe_spac(**kw) -> Policy:
    policy = MoESpAc(**kw)
    policy.name = "moe-spac-paper"
    return policy


SYSTEMS: dict[str, Callable[..., Policy]] = {
    "static": StaticPlacement,
    "lru": LRU,
    "lru-global": _named("lru-global", LRU, per_layer=False),
    "llama-moe-cache": LlamaMoeCache,
    "llama-moe-cache-lru": LlamaMoeCacheLRU,
    "lru-decode-only": DecodeOnlyLRU,
    "lfu": LFU,
    "least-stale": LeastStale,
    "score": ScoreBased,
    "hybrimoe": HybriMoE,
    "specmoe": SpecMoEHotSet,
    "moe-speq": MoESpeQLookahead,
    "moe-spac-paper": _moe_spac,
    DEFAULT: LookaheadUtility,
    "spac-reuse": ReuseCredited,
    "belady": Oracle,
}

# every ranking with host compute on miss (the settings a llama.cpp user would pick)
ZOO: dict[str, Callable[..., Policy]] = {
    "lru/host": _named("lru/host", LRU, miss="cpu"),
    "lfu/host": _named("lfu/host", LFU, miss="cpu"),
    "least-stale/host": _named("least-stale/host", LeastStale, miss="cpu"),
    "score/host": _named("score/host", ScoreBased, miss="cpu", decay=0.8),
    "utility/host": _moe_spac,
    "lookahead/host": _named("lookahead/host", MoESpeQLookahead, miss="cpu"),
    "spac/host": _named("spac/host", LookaheadUtility, miss="cpu"),
    "belady/host": _named("belady/host", Oracle),
}

# name → (ranking, miss rule, prefetch window, split rule): the table above as data
COMBINATIONS: dict[str, tuple[str, str, str, str]] = {
    "static": ("layer order", "host", "-", "layer"),
    "lru": ("lru/layer", "fetch", "pass", "resident"),
    "lru-global": ("lru", "fetch", "pass", "resident"),
    "llama-moe-cache": ("class-lru, after a readback, passes ≤ 32 tokens", "fetch", "-", "resident"),
    "llama-moe-cache-lru": ("lru, after a readback, passes ≤ 32 tokens", "fetch", "-", "resident"),
    "lru-decode-only": ("lru/layer, after a readback, 1-token passes", "fetch", "-", "resident"),
    "lfu": ("lfu", "fetch", "pass", "resident"),
    "least-stale": ("least-stale", "fetch", "pass", "resident"),
    "score": ("score", "fetch", "pass", "resident"),
    "hybrimoe": ("score (decay)", "greedy", "pass", "resident"),
    "specmoe": ("hot set", "fetch", "pass", "resident"),
    "moe-speq": ("lookahead", "fetch", "draft", "resident"),
    "moe-spac-paper": ("utility", "host", "pass", "tau"),
    DEFAULT: ("spac", "greedy", "draft", "resident"),
    "spac-reuse": ("class-lru, an upload credited with its reuse, decided after the router", "greedy", "-", "resident"),
    "belady": ("belady", "host", "pass", "resident"),
    # the zoo: each ranking (and its prefetch window) with host compute on miss, whole experts resident
    **{name: (ranking, "host", window, "resident") for name, ranking, window in (
        ("lru/host", "lru/layer", "pass"), ("lfu/host", "lfu", "pass"), ("least-stale/host", "least-stale", "pass"),
        ("score/host", "score (decay)", "pass"), ("lookahead/host", "lookahead", "draft"),
        ("spac/host", "spac", "draft"))},
}

ALIASES = {"utility/host": "moe-spac-paper", "belady/host": "belady"}  # zoo rows that are systems already
POLICIES: dict[str, Callable[..., Policy]] = {**SYSTEMS, **{k: v for k, v in ZOO.items() if k not in ALIASES}}


def make_policy(name: str, **kwargs) -> Policy:
    """A fresh policy object by registry name (see the table above)."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise KeyError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None
    return factory(**kwargs)


__all__ = ["ALIASES", "COMBINATIONS", "DEFAULT", "POLICIES", "SYSTEMS", "ZOO", "Feedback", "Policy", "PolicyContext", "make_policy", "observe"]
