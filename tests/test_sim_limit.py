"""The limit (`orchestrator.sim.limit`) is an upper bound on every policy's tokens/s."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from orchestrator.policies import POLICIES, make_policy
from orchestrator.sim.limit import layer_costs, limit
from orchestrator.sim.profiles import CostModel
from orchestrator.sim.simulator import SimConfig, Simulator
from orchestrator.sim.synthetic import RoutingModel, synthesize_trace
from tests.test_sim_costs import COSTS, MS, tiny_trace

TRACES = {
    "qwen-like": (RoutingModel(n_layer=6, n_expert=32, top_k=4), dict(gamma=4, acceptance=0.7)),
    "mixtral-like": (RoutingModel(n_layer=4, n_expert=8, top_k=2), dict(gamma=6, acceptance=0.8)),
    "deepseek-like": (RoutingModel(n_layer=5, n_expert=64, top_k=6), dict(gamma=8, acceptance=0.5)),
    "autoregressive": (RoutingModel(n_layer=5, n_expert=16, top_k=2), dict(gamma=0)),
}


@pytest.fixture(scope="module", params=sorted(TRACES))
def trace(request):
    model, kw = TRACES[request.param]
    return synthesize_trace(30, model, draft_fidelity=0.85, seed=11, **kw)


@pytest.mark.parametrize("ratio, visibility, hardware, engine", [
    (0.1, "pass", "rtx4090", False), (0.17, "pass", "rtx4060", False), (0.3, "layer", "rtx4090", False),
    (0.8, "pass", "rtx4060", False), (0.3, "pass", "rtx3090-remote-10gbe", False),
    # spac's engine's costs (a crossing in every split layer) with a slot for every expert: the pool
    # filled at load, no crossing, no gate (patch 0026)
    (1.0, "pass", "rtx4090", True)])
def test_limit_bounds_every_policy(trace, ratio, visibility, hardware, engine):
    config = SimConfig(cache_ratio=ratio, visibility=visibility, hardware=hardware)
    sim = Simulator(trace, config)
    if engine:
        sim = Simulator(trace, config, costs=replace(sim.costs, sync_every_layer=True, zero_slot=True))
    assert_bounds(trace, sim)


@pytest.mark.parametrize("ratio", [0.17, 0.3])
def test_limit_bounds_every_policy_with_a_staging_path(trace, ratio):
    """A measured profile's copies inside a pass: their own rate (here 4x a plan's) and a cost per
    layer batch, which the bound leaves out (it only adds time)."""
    sim = Simulator(trace, SimConfig(cache_ratio=ratio, hardware="rtx4060"))
    staged = replace(sim.costs, stage_bw=4 * sim.costs.pcie_bw, stage_batch_s=0.2e-3)
    assert_bounds(trace, Simulator(trace, SimConfig(cache_ratio=ratio, hardware="rtx4060"), costs=staged))


def assert_bounds(trace, sim: Simulator) -> None:
    bound = limit(trace, sim.capacity, sim.costs)
    for name in POLICIES:
        try:
            result = sim.run(make_policy(name))
        except ValueError:  # a per-layer cache with fewer slots than layers
            continue
        assert result.tokens == bound.tokens
        # step by step, not only in total
        assert (result.step_time >= bound.step_time * (1 - 1e-9)).all(), name
        assert result.tokens_per_s <= bound.tokens_per_s * (1 + 1e-9), (name, result.tokens_per_s, bound.tokens_per_s)


def test_limit_by_hand():
    # tiny_trace (test_sim_costs): per step draft 2 + fixed 1; each layer needs 3 experts
    # (device 1 ms, host 10 ms each, copy 5 ms, sync 0.25, dense 0.5)
    # 8 slots: all 6 resident, each layer 0.5 + 3 → 10 ms per step (what belady reaches)
    assert limit(tiny_trace(), 8, COSTS).step_time == pytest.approx([10 * MS] * 2)
    # 2 slots: one layer with both (2 on device, 1 copied: max(3, 5 + 1) = 6) and the other
    # with none (2 copied, 1 on the host: max(2, 10 + 1, 10.25) = 11): 3 + 6.5 + 11.5 = 21
    assert limit(tiny_trace(), 2, COSTS).step_time == pytest.approx([21 * MS] * 2)
    # 0 slots: nothing can be copied, all on the host: 3 + 2 · (0.5 + 30.25)
    assert limit(tiny_trace(), 0, COSTS).step_time == pytest.approx([64.5 * MS] * 2)
    r = Simulator(tiny_trace(), SimConfig(capacity=0), costs=COSTS).run(make_policy("static"))
    np.testing.assert_allclose(r.step_time, [64.5 * MS] * 2)


def test_layer_costs_fall_with_slots():
    c = layer_costs(np.array([2, 1, 1]), COSTS)
    np.testing.assert_allclose(c / MS, [11.5, 10.75, 6.5, 3.5])
    assert (np.diff(layer_costs(np.arange(1, 40), CostModel(**{**COSTS.__dict__, "pcie_bw": 1e9}))) <= 0).all()
