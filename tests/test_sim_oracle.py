"""The oracle is the limit: no policy gets a higher hit rate on any trace."""

from __future__ import annotations

import pytest

from orchestrator.policies import POLICIES, make_policy
from orchestrator.sim.simulator import SimConfig, Simulator
from orchestrator.sim.synthetic import RoutingModel, synthesize_trace

TRACES = {
    "qwen-like": (RoutingModel(n_layer=6, n_expert=32, top_k=4), dict(gamma=4, acceptance=0.7)),
    "mixtral-like": (RoutingModel(n_layer=4, n_expert=8, top_k=2), dict(gamma=6, acceptance=0.8)),
    "autoregressive": (RoutingModel(n_layer=5, n_expert=16, top_k=2), dict(gamma=0)),
}


@pytest.fixture(scope="module", params=sorted(TRACES))
def trace(request):
    model, kw = TRACES[request.param]
    return synthesize_trace(40, model, draft_fidelity=0.85, seed=11, **kw)


@pytest.mark.parametrize("ratio, visibility", [(0.25, "pass"), (0.5, "layer"), (0.8, "pass")])
def test_oracle_hit_rate_bounds_every_policy(trace, ratio, visibility):
    sim = Simulator(trace, SimConfig(cache_ratio=ratio, visibility=visibility))
    oracle = sim.run(make_policy("oracle"))
    for name in POLICIES:
        if name == "oracle":
            continue
        result = sim.run(make_policy(name))
        assert result.hit_rate <= oracle.hit_rate + 1e-12, (name, result.hit_rate, oracle.hit_rate)
