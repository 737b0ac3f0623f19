"""Expert-placement policies, one class each, shared by the live engine and the simulator.

The interface is in `base` (`Policy`, `PolicyContext`, `Feedback`); a policy turns the routing
of the last verify pass and its own state into an `orchestrator.plan.Plan`.

    name          class                        from
    static        StaticPlacement              llama.cpp --n-cpu-moe (the paper's llama.cpp-w/SD)
    lru           LRU(per_layer=True)          Mixtral-offloading: on-demand fetch + LRU per layer
    lru-global    LRU(per_layer=False)         one LRU pool over all layers
    lfu           LFU                          least frequently used (MoE-Infinity)
    least-stale   LeastStale                   SpecMD (seed 001)
    score         ScoreBased                   lowest accumulated routing weight (Zhu et al.)
    hybrimoe      HybriMoE                     greedy two-ended CPU/GPU split, score-aware cache
    specmoe       SpecMoEHotSet                SpecMoE's hot set (seed 003)
    moe-speq      MoESpeQLookahead             MoE-SpeQ's lookahead from an MoE draft (seed 000)
    moe-spac      MoESpAc                      estimator + balancer (seed 004)
    oracle        Oracle                       future knowledge: per-pass optimum + Belady
"""

from __future__ import annotations

from typing import Callable

from orchestrator.policies.base import Feedback, Policy, PolicyContext, observe
from orchestrator.policies.cache import LFU, LRU, LeastStale, ScoreBased
from orchestrator.policies.hybrimoe import HybriMoE
from orchestrator.policies.lookahead import MoESpeQLookahead
from orchestrator.policies.oracle import Oracle
from orchestrator.policies.specmoe import SpecMoEHotSet
from orchestrator.policies.static import StaticPlacement


def _lru_global(**kw) -> LRU:
    policy = LRU(per_layer=False, **kw)
    policy.name = "lru-global"
    return policy


def _moe_spac(**kw) -> Policy:
    from orchestrator.policies.spac import MoESpAc  # needs orchestrator.estimator / .balancer

    return MoESpAc(**kw)


POLICIES: dict[str, Callable[..., Policy]] = {
    "static": StaticPlacement,
    "lru": LRU,
    "lru-global": _lru_global,
    "lfu": LFU,
    "least-stale": LeastStale,
    "score": ScoreBased,
    "hybrimoe": HybriMoE,
    "specmoe": SpecMoEHotSet,
    "moe-speq": MoESpeQLookahead,
    "moe-spac": _moe_spac,
    "oracle": Oracle,
}


def make_policy(name: str, **kwargs) -> Policy:
    """A fresh policy object by registry name (see the table above)."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise KeyError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None
    return factory(**kwargs)


__all__ = ["POLICIES", "Feedback", "Policy", "PolicyContext", "make_policy", "observe"]
