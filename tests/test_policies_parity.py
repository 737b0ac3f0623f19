"""One policy, two callers: the simulator (on_layer inside the pass) and the live loop's path
(`observe` after the pass, then `plan`) make the same decisions on the same routing.

The native half of the parity check (plans handed to the engine through `set_plan`) needs the
native engine and lives with its tests."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.policies import make_policy, observe
from orchestrator.sim.simulator import SimConfig, Simulator
from orchestrator.sim.synthetic import RoutingModel, synthesize_trace


class Recorder:
    """Wraps a policy, records what `plan` was given and what it returned."""

    def __init__(self, policy):
        self.policy, self.calls = policy, []

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def plan(self, routing, resident, feedback=None):
        out = self.policy.plan(routing, resident, feedback)
        self.calls.append((routing, resident.copy(), feedback, out))
        return out

    def draft_plan(self, drafted, resident):
        out = self.policy.draft_plan(drafted, resident)
        self.calls.append(("draft", drafted.copy(), resident.copy(), out))
        return out


@pytest.mark.parametrize("name, kw", [
    ("static", {}), ("moe-spac-paper", {}), ("moe-spac-paper", dict(no_adabc=True)), ("lru", dict(miss="cpu")),
    ("lfu", dict(miss="cpu")), ("least-stale", dict(miss="cpu")), ("score", dict(miss="cpu")), ("belady", {}),
    ("spac", {}), ("spac", dict(miss="cpu")), ("lookahead/host", {}),
])
def test_simulator_and_live_path_agree(name, kw):
    # with the draft's routing: the live loop hands the policy the draft's routing token by
    # token while it drafts (draft_plan), as the simulator does
    trace = synthesize_trace(30, RoutingModel(n_layer=4, n_expert=16, top_k=2), gamma=3, draft_fidelity=0.8, seed=5)
    sim = Simulator(trace, SimConfig(cache_ratio=0.3))
    recorded = Recorder(make_policy(name, **kw))
    sim.run(recorded)

    live = make_policy(name, **kw)
    live.reset(sim.context(live))
    assert any(c[0] == "draft" for c in recorded.calls) == live.uses_draft_routing
    for routing, resident, feedback, plan in recorded.calls:
        if isinstance(routing, str):  # a draft token: (drafted so far, resident, plan)
            drafted, resident, plan = resident, feedback, plan
            again = live.draft_plan(drafted, resident)
            assert (again is None) == (plan is None)
            if plan is not None:
                _same(again, plan)
            continue
        if routing is not None:
            observe(live, routing, trace.n_expert)
        again = live.plan(routing, resident, feedback)
        _same(again, plan)


def _same(again, plan):
    np.testing.assert_array_equal(again.utility, plan.utility)
    np.testing.assert_array_equal(again.threshold, plan.threshold)
    for a, b in ((again.prefetch, plan.prefetch), (again.evict, plan.evict)):
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_array_equal(a, b)
