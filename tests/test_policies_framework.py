"""The factored framework: every registered policy is the combination it claims, and each miss
and split rule does what it says on hand-built cases (cost model of test_sim_costs)."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.policies import COMBINATIONS, DEFAULT, POLICIES, ZOO, make_policy
from orchestrator.policies.base import Feedback, PolicyContext
from orchestrator.policies.default import LookaheadUtility
from orchestrator.policies.plan import StepRouting
from tests.test_sim_costs import run

MISS = {"host": "cpu", "fetch": "fetch", "greedy": "greedy"}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_is_its_combination(name):
    ranking, miss, window, split = COMBINATIONS[name]
    policy = make_policy(name)
    assert policy.miss == MISS[miss]
    assert policy.uses_draft_routing == (window == "draft")
    assert (policy.name == "moe-spac-paper") == (split == "tau")


def test_zoo_computes_every_miss_on_the_host():
    assert all(make_policy(n).miss == "cpu" for n in ZOO if n in POLICIES)
    assert COMBINATIONS[DEFAULT][0] == "spac"


def test_miss_rules_by_hand():
    # 2 layers × 3 needed experts, pool of 2 slots that the first plan fills; nothing else lands
    # before step 0 (paced: the draft's 2 ms leave the 5 ms copies no time before the pass):
    # host: every miss on the host, nothing copied in the pass
    host = run(LookaheadUtility(miss="cpu", paced=True), capacity=2, n_steps=1)
    assert host.fetch_share == 0 and host.fetch_bytes == 0 and 0 < host.hit_rate < 1
    assert host.cpu_share == pytest.approx(1 - host.hit_rate)
    # fetch: every miss copied and computed on the device
    fetch = run(LookaheadUtility(miss="fetch", paced=True), capacity=2, n_steps=1)
    assert fetch.cpu_share == 0 and fetch.fetch_share == pytest.approx(1 - fetch.hit_rate)
    # greedy: copies only what lands before the host would finish (copy 5 ms + 1 vs host 10 ms),
    # the rest goes to the host
    greedy = run(LookaheadUtility(miss="greedy", paced=True), capacity=2, n_steps=1)
    assert 0 < greedy.fetch_share < 1 and 0 < greedy.cpu_share < 1
    assert greedy.step_time[0] < min(host.step_time[0], fetch.step_time[0])


def test_split_rules_by_hand():
    # layer: static keeps whole layers (4 slots hold layer 1), every expert of layer 0 on the host
    static = make_policy("static")
    static.reset(PolicyContext(n_layer=2, n_expert=4, top_k=2, capacity=4))
    np.testing.assert_array_equal(static.plan(None, np.zeros((2, 4), bool)).wanted(), [[0] * 4, [1] * 4])
    # tau: after each pass the plan wants exactly utility ≥ τ of each layer, τ per layer
    policy = make_policy("moe-spac-paper")
    r = run(policy, capacity=4, n_steps=2)
    plan = policy.plan(None, np.zeros((2, 4), bool))
    assert plan.threshold.shape == (2,) and ((1 <= plan.threshold) & (plan.threshold <= 4)).all()
    np.testing.assert_array_equal(plan.wanted(), plan.utility >= plan.threshold[:, None])
    # resident: the default wants its `capacity` most probable experts over all layers
    d = LookaheadUtility()
    d.reset(PolicyContext(n_layer=2, n_expert=4, top_k=2, capacity=3, gamma=1))
    assert d.plan(None, np.zeros((2, 4), bool)).wanted().sum() == 3
    assert r.step_time[1] > 0


def step_feedback(t_io: float, t_draft: float, blocks: bool, free: int, n_drafted: int) -> Feedback:
    """A step's measurements on 2 layers, only the fields pacing reads set."""
    return Feedback(t_cpu_unit=np.nan, t_gpu_unit=np.nan, t_io_unit=t_io, t_draft_token=t_draft, t_layer=np.zeros(2),
                    expert_bytes=1.0, free_slots=free, n_drafted=n_drafted, copies_block_device=blocks)


def test_pacing_keeps_the_last_copy_time_and_follows_the_device():
    """A step without copies measures no copy time (NaN): the policy keeps the last one rather
    than stop pacing; it paces only where copies block the device (paced='auto')."""
    def feedback(t_io, blocks):
        return step_feedback(t_io, t_draft=1e-3, blocks=blocks, free=0, n_drafted=2)

    ctx = PolicyContext(n_layer=2, n_expert=8, top_k=2, capacity=6, gamma=2)
    paced = LookaheadUtility(miss="cpu")
    paced.reset(ctx)
    step = StepRouting(selected=np.array([[[0, 1], [2, 3]]] * 3), weights=np.full((3, 2, 2), 0.5), n_drafted=2,
                       n_accepted=2)
    full = np.zeros((2, 8), bool)
    full[:, :3] = True  # 6 slots, all taken
    paced.plan(None, np.zeros((2, 8), bool), feedback(1e-3, True))
    assert paced.t_io[0] == 1e-3
    plan = paced.plan(step, full, feedback(np.nan, True))
    assert paced.t_io[0] == 1e-3 and len(plan.prefetch) == 2  # two draft tokens' time, 1 ms a copy
    free = LookaheadUtility(miss="cpu")
    free.reset(ctx)
    assert len(free.plan(None, np.zeros((2, 8), bool), feedback(1e-3, False)).prefetch) == 6


def test_the_pool_fills_however_short_the_drafting_window():
    """Speculative, on a device that copies on its compute thread, with drafts faster than a copy
    (no copy fits the window): the first plan still fills the pool, and later plans fill free
    slots; swaps stay paced to the window (none here)."""
    ctx = PolicyContext(n_layer=2, n_expert=8, top_k=2, capacity=6, gamma=4)
    step = StepRouting(selected=np.array([[[0, 1], [2, 3]]] * 5), weights=np.full((5, 2, 2), 0.5), n_drafted=4,
                       n_accepted=4)
    policy = LookaheadUtility(miss="cpu")
    policy.reset(ctx)
    empty = np.zeros((2, 8), bool)
    assert len(policy.plan(None, empty, step_feedback(4e-3, 0.25e-3, True, free=6, n_drafted=0)).prefetch) == 6
    partly = empty.copy()
    partly[0, 4:8] = True  # 2 slots free; the plan wants experts 0-3 of both layers
    assert len(policy.plan(step, partly, step_feedback(4e-3, 0.25e-3, True, free=2, n_drafted=4)).prefetch) == 2
    full = partly.copy()
    full[1, 6:8] = True
    assert len(policy.plan(step, full, step_feedback(4e-3, 0.25e-3, True, free=0, n_drafted=4)).prefetch) == 0


def test_no_copies_without_a_draft_where_copies_block_the_device():
    """Autoregressive (γ = 0) on a device that copies on its compute thread: the first plan fills
    the pool, later plans only fill free slots, never swap (no draft to hide a copy behind); a GPU
    keeps swapping."""
    def feedback(blocks, free=0):
        return step_feedback(1e-3, t_draft=np.nan, blocks=blocks, free=free, n_drafted=0)

    ctx = PolicyContext(n_layer=2, n_expert=8, top_k=2, capacity=6, gamma=0)
    step = StepRouting(selected=np.array([[[0, 1], [2, 3]]]), weights=np.full((1, 2, 2), 0.5), n_drafted=0, n_accepted=0)
    for blocks in (True, False):
        policy = LookaheadUtility(miss="cpu")
        policy.reset(ctx)
        assert len(policy.plan(None, np.zeros((2, 8), bool), feedback(blocks, free=6)).prefetch) == 6
        assert len(policy.plan(step, np.zeros((2, 8), bool), feedback(blocks, free=2)).prefetch) == (2 if blocks else 6)
        assert (len(policy.plan(step, np.zeros((2, 8), bool), feedback(blocks)).prefetch) == 0) == blocks


def test_a_pool_over_two_devices_is_planned_per_device():
    """Two devices, layers 0-1 with 3 slots and layers 2-3 with 1: each device wants the best of
    its own layers, as many as its slots (one global top 4 would want all of them in layers 0-1,
    which the first device cannot hold, and leave the second's slot empty); each device's link
    is paced on its own (one copy's time of drafting: one copy per device)."""
    ctx = PolicyContext(n_layer=4, n_expert=8, top_k=2, capacity=4, gamma=2, devices=((0, 2, 3), (2, 4, 1)))
    policy = LookaheadUtility(miss="cpu")
    policy.reset(ctx)
    hot = np.array([[[0, 1], [0, 1], [5, 6], [5, 6]]] * 3)  # layers 0-1 reuse two experts more
    step = StepRouting(selected=hot, weights=np.full((3, 4, 2), 0.5), n_drafted=2, n_accepted=2)
    for _ in range(3):
        policy.plan(step, np.zeros((4, 8), bool))
    plan = policy.plan(step, np.zeros((4, 8), bool))
    wanted = plan.utility.astype(bool)
    assert wanted[:2].sum() == 3 and wanted[2:].sum() == 1
    # paced: both devices full, each link gets one copy of the 1 ms drafting window
    fb = Feedback(t_cpu_unit=np.nan, t_gpu_unit=np.nan, t_io_unit=1e-3, t_draft_token=0.5e-3, t_layer=np.zeros(4),
                  expert_bytes=1.0, free_slots=0, n_drafted=2, copies_block_device=True, free_slots_per_device=(0, 0))
    resident = np.zeros((4, 8), bool)
    resident[0, [3, 4]] = resident[1, 3] = True  # the first device's 3 slots, cold experts
    resident[2, 2] = True                         # the second's one
    plan = policy.plan(step, resident, fb)
    layers = plan.prefetch[:, 0]
    assert (layers < 2).sum() == 1 and (layers >= 2).sum() == 1, plan.prefetch


def test_static_and_paper_policies_plan_per_device():
    """llama.cpp's --n-cpu-moe placement over two devices: each device takes whole layers from its
    own last layer down; MoE-SpAc's balancer sees each layer's share of its own device's slots."""
    from orchestrator.policies.spac import MoESpAc
    from orchestrator.policies.static import StaticPlacement

    ctx = PolicyContext(n_layer=6, n_expert=4, top_k=2, capacity=12, devices=((0, 4, 8), (4, 6, 4)))
    static = StaticPlacement()
    static.reset(ctx)
    assert static.placement.any(axis=1).tolist() == [False, False, True, True, False, True]
    with pytest.raises(ValueError, match="needs 12 slots on a device, the pool has 8"):
        StaticPlacement(n_cpu_moe=1).reset(ctx)
    paper = MoESpAc()
    paper.reset(ctx)
    assert paper.slots_per_layer.tolist() == [2, 2, 2, 2, 2, 2]
    paper.reset(PolicyContext(n_layer=6, n_expert=4, top_k=2, capacity=12, devices=((0, 2, 8), (2, 6, 4))))
    assert paper.slots_per_layer.tolist() == [4, 4, 1, 1, 1, 1]


def test_each_device_paces_its_own_link():
    """A GPU beside an RPC server: only the server's copies delay its passes, so only its link is
    paced (one copy of its 1 ms window at 1 ms a copy, none at 2 ms); the GPU takes every copy."""
    ctx = PolicyContext(n_layer=4, n_expert=8, top_k=2, capacity=4, gamma=2, devices=((0, 2, 2), (2, 4, 2)))
    step = StepRouting(selected=np.array([[[0, 1], [0, 1], [0, 1], [0, 1]]] * 3), weights=np.full((3, 4, 2), 0.5),
                       n_drafted=2, n_accepted=2)
    resident = np.zeros((4, 8), bool)
    resident[[0, 2], 5] = resident[[1, 3], 6] = True  # every slot taken by a cold expert
    for t_io, n_rpc in ((1e-3, 1), (2e-3, 0)):
        policy = LookaheadUtility(miss="cpu")
        policy.reset(ctx)
        fb = Feedback(t_cpu_unit=np.nan, t_gpu_unit=np.nan, t_io_unit=t_io, t_draft_token=0.5e-3, t_layer=np.zeros(4),
                      expert_bytes=1.0, free_slots=0, n_drafted=2, free_slots_per_device=(0, 0),
                      t_io_per_device=(t_io, t_io), copies_block_per_device=(False, True))
        policy.plan(step, resident, fb)
        plan = policy.plan(step, resident, fb)
        layers = plan.prefetch[:, 0]
        assert (layers < 2).sum() == 2 and (layers >= 2).sum() == n_rpc, (t_io, plan.prefetch)


def _one_layer_trace(experts):
    """One MoE layer, one token a pass (no draft), top-1: pass i uses experts[i]; one more expert
    that no pass uses, so that a one-slot pool never holds every expert (the engine's graph differs)."""
    from orchestrator.sim.trace import TraceWriter

    w = TraceWriter("unused.npz", n_layer=1, n_expert=max(experts) + 2, top_k=1)
    for e in experts:
        w.append(StepRouting(selected=np.array([[[e]]]), n_drafted=0, n_accepted=0))
    return w.to_trace()


def _reuse_run(policy, experts, copy_ms, capacity=1):
    """Built costs: a one-token expert takes 10 ms on the host, 1 ms on the device; a copy copy_ms."""
    from dataclasses import replace

    from orchestrator.sim.simulator import SimConfig, Simulator
    from tests.test_sim_costs import COSTS

    costs = replace(COSTS, pcie_bw=COSTS.expert_bytes / (copy_ms * 1e-3), draft_token_s=0.0)
    return Simulator(_one_layer_trace(experts), SimConfig(capacity=capacity), costs=costs).run(make_policy(policy))


def test_the_reuse_rule_uploads_on_a_fast_link_and_computes_on_the_host_over_a_slow_one():
    # a link that lands the expert before the host would finish it: uploaded at once, one-off or not
    fast = _reuse_run("spac-reuse", list(range(20)), copy_ms=2)
    assert fast.cpu_share == 0 and fast.fetch_share == 1
    # a link far slower than the host (100 ms against 10): even an expert every token uses stays on
    # the host for the 32 tokens of credit it could earn (32 x 9 ms < 100 ms + 1 ms)
    slow = _reuse_run("spac-reuse", [0] * 60, copy_ms=100)
    assert slow.fetch_bytes == 0 and slow.cpu_share == 1


def test_the_reuse_rule_admits_what_is_reused_and_not_a_one_token_expert():
    """A copy (15 ms + 1 on the device) slower than the host (10 ms) for this pass alone: HybriMoE's
    greedy never uploads; the reuse rule uploads an expert once its decayed use count says its
    later uses repay the copy, and never a one-token expert no later pass uses."""
    reused = [0] * 60
    assert _reuse_run("hybrimoe", reused, copy_ms=15).fetch_bytes == 0
    r = _reuse_run("spac-reuse", reused, copy_ms=15)
    assert r.fetch_bytes == 1000 and r.hit_rate > 0.5  # uploaded once, then resident
    one_off = _reuse_run("spac-reuse", list(range(40)), copy_ms=15)
    assert one_off.fetch_bytes == 0 and one_off.cpu_share == 1


def test_the_reuse_rule_holds_both_halves_until_its_uploads_land():
    """The engine's gate is a host op ahead of both halves that returns once its uploads have landed
    (native miss_gate): the host half's experts start after them. One token, experts 0 and 1 missing,
    a 6 ms copy: both rules upload 0 (lands at 6 ms, 1 ms on the device) and leave 1 on the host
    (10 ms). HybriMoE's greedy overlaps them: 1 + 0.5 + 10 + 0.25 (sync) = 11.75 ms; the gate's host
    half starts at 6: 17.75 ms."""
    from dataclasses import replace

    from orchestrator.sim.simulator import SimConfig, Simulator
    from orchestrator.sim.trace import TraceWriter
    from tests.test_sim_costs import COSTS

    w = TraceWriter("unused.npz", n_layer=1, n_expert=3, top_k=2)
    w.append(StepRouting(selected=np.array([[[0, 1]]]), n_drafted=0, n_accepted=0))
    costs = replace(COSTS, pcie_bw=COSTS.expert_bytes / 6e-3, draft_token_s=0.0)
    times = {p: Simulator(w.to_trace(), SimConfig(capacity=2), costs=costs).run(make_policy(p)) for p in ("hybrimoe", "spac-reuse")}
    for r in times.values():
        assert r.fetch_bytes == 1000 and r.cpu_share == 0.5
    assert times["hybrimoe"].step_time[0] == pytest.approx(11.75e-3)
    assert times["spac-reuse"].step_time[0] == pytest.approx(17.75e-3)


def test_the_reuse_rule_waits_for_the_router_on_the_device():
    """Decided in a gate after the router: the device half waits for the router's choice on the
    host (one synchronize) before it computes, where greedy's starts at once."""
    from orchestrator.policies.cache import ReuseCredited

    policy = ReuseCredited()
    assert policy.gate_readback and policy.readback_max_tokens is None and policy.miss == "greedy"
    a = _reuse_run("spac-reuse", [0, 0], copy_ms=2)
    b = _reuse_run("hybrimoe", [0, 0], copy_ms=2)
    assert a.step_time[1] == pytest.approx(b.step_time[1] + 0.25e-3)  # both hit in pass 1
    # a pool of every expert (both of the trace's) has no gate in the engine (patch 0026): no wait
    a, b = (_reuse_run(p, [0, 0], copy_ms=2, capacity=2) for p in ("spac-reuse", "hybrimoe"))
    assert a.step_time[1] == pytest.approx(b.step_time[1])
