"""Simulator step times against hand-computed tiny cases (cost model in ms, see each case)."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.policies import make_policy
from orchestrator.policies.plan import StepRouting
from orchestrator.sim.profiles import CostModel, hardware, model
from orchestrator.sim.simulator import Pool, SimConfig, Simulator
from orchestrator.sim.trace import TraceWriter

MS = 1e-3
# one expert: 1000 bytes, 4000 flop per token
#   device: 1000 B / 1e6 B/s = 1 ms per expert (flops free)
#   host:   max(1000 B / 1e5 B/s = 10 ms, n · 4000 / 1e6 = 4n ms)
#   copy:   1000 B / 2e5 B/s = 5 ms
COSTS = CostModel(expert_bytes=1000, expert_flops=4000, gpu_bw=1e6, gpu_flops=1e18, cpu_bw=1e5, cpu_flops=1e6,
                  pcie_bw=2e5, dense_layer_s=0.5 * MS, fixed_pass_s=1 * MS, draft_token_s=2 * MS, sync_s=0.25 * MS)

# 2 MoE layers, 4 experts, top-2; each step verifies 2 tokens (1 draft)
#   layer 0 uses e0 ×2, e1, e2;  layer 1 uses e2 ×2, e0, e3
STEP = np.array([[[0, 1], [0, 2]], [[0, 2], [3, 2]]])


def tiny_trace(n_steps=2, prompt=False):
    """n_steps of STEP; prompt: a prompt pass of STEP's rows before the first."""
    w = TraceWriter("unused.npz", n_layer=2, n_expert=4, top_k=2)
    if prompt:
        w.append_prompt(STEP)
    for _ in range(n_steps):
        w.append(StepRouting(selected=STEP, n_drafted=1, n_accepted=1))
    return w.to_trace()


def run(policy, capacity, costs=COSTS, visibility="pass", n_steps=2):
    sim = Simulator(tiny_trace(n_steps), SimConfig(capacity=capacity, visibility=visibility), costs=costs)
    return sim.run(make_policy(policy) if isinstance(policy, str) else policy)


def test_static_placement_splits_layers():
    # one layer fits (4 slots): layer 1 on the device, layer 0 on the host
    #   draft 2 + fixed 1 + layer 0: 0.5 + 3 host experts × 10 + sync 0.25 + layer 1: 0.5 + 3 × 1 = 37.25
    r = run("static", capacity=4)
    np.testing.assert_allclose(r.step_time, [37.25 * MS, 37.25 * MS])
    assert r.tokens == 4 and r.tokens_per_s == pytest.approx(4 / (74.5 * MS))
    assert r.hit_rate == pytest.approx(4 / 8) and r.cpu_share == pytest.approx(4 / 8)
    assert r.prefetch_bytes == 0  # the initial placement is loaded before the run


def test_a_pool_of_every_expert_pays_no_crossing():
    """spac's engine crosses to the host in every split layer (sync_every_layer), but a pool of every
    expert is filled at load and computes on the device alone (patch 0026): no crossing in any layer."""
    from dataclasses import replace

    engine = replace(COSTS, sync_every_layer=True, sync_s=5 * MS)  # a crossing longer than a layer's device half
    # every expert resident: 2 + 1 + 2 x (0.5 + 3 x 1) = 10, as without the engine's crossing
    np.testing.assert_allclose(run("static", capacity=8, costs=engine).step_time, [10 * MS, 10 * MS])
    # and the engine fills it at load, whatever the policy copies: on-demand fetches find every expert
    # resident from the first pass (36 ms in test_on_demand_fetch_then_hits, without the engine)
    np.testing.assert_allclose(run("lru", capacity=8, costs=engine).step_time, [10 * MS, 10 * MS])
    # one slot fewer: static leaves layer 0 on the host, and both layers cross:
    #   2 + 1 + (0.5 + 3 x 10 + 5) + (0.5 + max(3 x 1, 5)) = 44
    np.testing.assert_allclose(run("static", capacity=7, costs=engine).step_time, [44 * MS, 44 * MS])


def test_on_demand_fetch_then_hits():
    # step 0, everything copied on demand, one link:
    #   layer 0 starts its experts at 3.5: e0 arrives 8.5 (done 9.5), e1 13.5 (14.5), e2 18.5 (19.5)
    #   layer 1 starts at 20: e0 25 (26), e2 30 (31), e3 35 (36)  -> 36
    # step 1, everything resident: 2 + 1 + (0.5 + 3) + (0.5 + 3) = 10
    r = run("lru", capacity=8)
    np.testing.assert_allclose(r.step_time, [36 * MS, 10 * MS])
    assert r.fetch_bytes == 6000 and r.hit_rate == pytest.approx(0.5)


def test_a_prompt_fills_an_in_pass_cache_untimed():
    """A prompt pass before a step (the trace's prompt_rows) is replayed as live: the experts a cache
    copies inside the passes upload in it are hits in the first step, and its time is not the
    decode's; a policy that plans between verify passes is not shown it."""
    trace = tiny_trace(prompt=True)
    # lru fetches the prompt's experts in the prompt pass (36 ms, test_on_demand_fetch_then_hits):
    # both steps then hit, 10 ms each, and the run takes 20 ms
    r = Simulator(trace, SimConfig(capacity=8), costs=COSTS).run(make_policy("lru"))
    np.testing.assert_allclose(r.step_time, [10 * MS, 10 * MS])
    assert r.time_s == pytest.approx(20 * MS) and r.hit_rate == 1.0 and r.fetch_bytes == 6000
    # static computes its misses on the host and sees no layer of the prompt: as without it
    static = make_policy("static")
    seen = []
    static.on_layer = lambda layer, counts, weights: seen.append(layer)
    r = Simulator(trace, SimConfig(capacity=4), costs=COSTS).run(static)
    np.testing.assert_allclose(r.step_time, [37.25 * MS, 37.25 * MS])
    assert r.time_s == pytest.approx(74.5 * MS) and seen == [0, 1, 0, 1]


def test_a_warm_up_is_replayed_untimed():
    """SimConfig.warm_up_steps: the first steps fill the pool, then timing starts once their copies
    are done; only the later steps count (time, tokens, hits, bytes)."""
    r = Simulator(tiny_trace(3), SimConfig(capacity=8, warm_up_steps=1), costs=COSTS).run(make_policy("lru"))
    # step 0 fetched every expert (36 ms, test_on_demand_fetch_then_hits): the two timed steps hit
    np.testing.assert_allclose(r.step_time, [10 * MS, 10 * MS])
    assert (r.n_steps, r.tokens, r.time_s) == (2, 4, pytest.approx(20 * MS))
    assert r.hit_rate == 1.0 and r.bytes_moved == 0
    r = Simulator(tiny_trace(2), SimConfig(capacity=8, warm_up_steps=2), costs=COSTS).run(make_policy("lru"))
    assert (r.n_steps, r.tokens, r.time_s) == (0, 0, 0.0)  # all warm-up: nothing timed


def test_hybrimoe_greedy_split():
    # layer 0 at 3.5, missing by count e0(2) e1 e2:
    #   e0 device 3.5+5+1 = 9.5 ≤ host e2 13.5 -> device; e1 device 14.5 > host e2 13.5 -> host;
    #   e1 device 14.5 ≤ host 23.5 -> device; layer ends max(14.5, 13.5 + 0.25) = 14.5
    # layer 1 at 15, missing e2(2) e0 e3:
    #   e2 device 20+1 = 21 ≤ host e3 25 -> device; e0 device 26 > host e3 25 -> host;
    #   e0 device 26 ≤ host 35 -> device; ends max(26, 25.25) = 26
    r = run("hybrimoe", capacity=8, n_steps=1)
    np.testing.assert_allclose(r.step_time, [26 * MS])
    assert r.fetch_share == pytest.approx(6 / 8) and r.cpu_share == pytest.approx(2 / 8)


def test_prefetch_during_drafting_and_visibility():
    # LRU computing misses on the host: step 0 all on the host
    #   2 + 1 + (0.5 + 30 + 0.25) · 2 = 64.5; the plan then copies the 6 used experts (30 ms)
    slow_draft = CostModel(**{**COSTS.__dict__, "draft_token_s": 40 * MS})
    r = run(make_policy("lru", miss="cpu"), capacity=8, costs=slow_draft)
    # with a 40 ms draft the copies are done before step 1 verifies: 40 + 1 + 3.5 + 3.5
    np.testing.assert_allclose(r.step_time, [102.5 * MS, 48 * MS])
    # with a 2 ms draft nothing has arrived when the pass starts ("pass" visibility): same as step 0
    r = run(make_policy("lru", miss="cpu"), capacity=8)
    np.testing.assert_allclose(r.step_time, [64.5 * MS, 64.5 * MS])
    # "layer" visibility: copies started at 64.5 land at 69.5 … 94.5; step 1's layer 0 starts its
    # experts at 68 (none there: host, 30.25), layer 1 at 98.75 (e0, e2, e3 all landed: device)
    #   2 + 1 + 0.5 + 30.25 + 0.5 + 3 = 37.25
    r = run(make_policy("lru", miss="cpu"), capacity=8, visibility="layer")
    np.testing.assert_allclose(r.step_time, [64.5 * MS, 37.25 * MS])


def test_oracle_waits_for_its_copies():
    # the oracle wants all 6 experts before step 0 (loaded free) and keeps them: 10 ms per step
    r = run("belady", capacity=8)
    np.testing.assert_allclose(r.step_time, [10 * MS, 10 * MS])
    assert r.hit_rate == 1.0 and r.stall_s == 0.0


def plan_of(utility, evict=None):
    from orchestrator.policies.plan import Plan

    u = np.array(utility, dtype=np.uint8)
    return Plan(utility=u, threshold=np.ones(u.shape[0], dtype=np.int32),
                evict=None if evict is None else np.array(evict, dtype=np.int32))


def test_pool_applies_plans_by_the_engine_rules():
    pool = Pool(2, 4, capacity=3, costs=COSTS)
    pool.apply(plan_of([[1, 1, 0, 0], [1, 0, 0, 0]]), now=0.0)
    assert pool.allocated.sum() == 3 and pool.link_free_at == pytest.approx(15 * MS)
    np.testing.assert_allclose(pool.ready_at[pool.allocated], [5 * MS, 10 * MS, 15 * MS])  # layer order
    # (1, 3) wanted instead of (0, 1): the unwanted expert gives its slot
    pool.apply(plan_of([[1, 0, 0, 0], [1, 0, 0, 1]]), now=1.0)
    assert pool.allocated[1, 3] and not pool.allocated[0, 1] and pool.n_allocated == 3
    # a utility-2 request may take the slot of a wanted utility-1 expert (the lowest (layer, expert))
    pool.apply(plan_of([[1, 0, 2, 0], [1, 0, 0, 1]]), now=2.0)
    assert pool.allocated[0, 2] and not pool.allocated[0, 0]
    # an equally useful request does not: skipped
    pool.apply(plan_of([[0, 0, 2, 1], [1, 0, 0, 1]]), now=3.0)
    assert not pool.allocated[0, 3]
    # an explicit eviction list goes first, wanted or not
    pool.apply(plan_of([[0, 0, 2, 1], [1, 0, 0, 1]], evict=[[1, 3]]), now=4.0)
    assert pool.allocated[0, 3] and not pool.allocated[1, 3]
    # the engine's no_evict: nothing leaves, so nothing new comes
    pool.apply(plan_of([[0, 1, 0, 0], [0, 0, 0, 0]]), now=5.0, evicts=False)
    assert not pool.allocated[0, 1] and pool.n_allocated == 3


def test_a_pass_freezes_the_slots_it_names():
    """The engine's maps freeze every resident slot until the pass ends: a copy that must evict
    starts only before the next pass (the worker copies one at a time), a free slot any time."""
    pool = Pool(1, 6, capacity=2, costs=COSTS)
    pool.apply(plan_of([[1, 1, 0, 0, 0, 0]]), now=0.0, free=True)
    want_new = plan_of([[0, 0, 1, 1, 1, 1]])
    pool.frozen_from = 1.0  # the next pass starts right away: one eviction, then every slot frozen
    pool.apply(want_new, now=1.0)
    assert pool.allocated[0, 2] and pool.n_allocated == 2 and pool.allocated[0, :2].sum() == 1
    pool.frozen_from = 2.0 + 5 * MS  # a draft of one copy's length between the passes: two
    pool.apply(plan_of([[0, 0, 0, 0, 1, 1]]), now=2.0)
    assert pool.allocated[0, 4] and pool.allocated[0, 5]


def test_profiles_are_consistent():
    qwen = model("qwen3-30b-a3b")
    assert qwen.n_layer == 48 and qwen.params == pytest.approx(30.5e9, rel=0.01)
    assert qwen.expert_bytes("Q4_K") == 4718592 * 4.5 / 8 == 2654208
    assert model("deepseek-v2-lite").layer_index == list(range(1, 27))
    assert model("mixtral-8x7b").params == pytest.approx(46.7e9, rel=0.01)
    assert model("gpt-oss-20b").params == pytest.approx(20.9e9, rel=0.01)
    assert model("qwen3-4b").params == pytest.approx(4.0e9, rel=0.02)
    hw = hardware("rtx4090")
    c = CostModel.build(hw, qwen, model("qwen3-4b"))
    assert c.transfer_s == pytest.approx(2654208 / (31.5e9 * 0.8))
    assert c.cpu_expert_s(1) == pytest.approx(2654208 / (83.2e9 * 0.65))


def test_two_cards_add_memory_and_links_and_one_crossing():
    """A layer split over two cards: twice the memory and (one x8 link each) twice one x8 link;
    the cards compute one after the other, the hidden state crossing once per pass."""
    from dataclasses import replace

    from orchestrator.sim import profiles

    two = profiles.hardware("2x-rtx3090")
    one = replace(two, n_devices=1)
    m = profiles.model("qwen3-235b-a22b")
    c2, c1 = profiles.CostModel.build(two, m), profiles.CostModel.build(one, m)
    assert c2.vram_bytes == 2 * c1.vram_bytes and c2.pcie_bw == 2 * c1.pcie_bw
    assert c2.fixed_pass_s == pytest.approx(c1.fixed_pass_s + two.sync_us * 1e-6)
    assert c2.gpu_bw == c1.gpu_bw and c2.static_bytes == c1.static_bytes


def test_a_card_in_another_machine_pays_the_network():
    """The second card over 25 GbE (ggml RPC): the copies spread over the two links, each link
    copying its half back to back, so the slower one (the network's bandwidth and latency) sets
    the pace; every MoE layer on the remote card sends the hidden state to the host half and back
    over the network (charged per layer as the average over all layers, with a per-token part for
    the bytes); the pass's input crosses to it and its output back once."""
    from dataclasses import replace

    from orchestrator.sim import profiles

    remote = profiles.hardware("rtx3090-remote-25gbe")
    local = replace(remote, remote_GBps=0.0, remote_latency_us=0.0)
    m = profiles.model("qwen3-235b-a22b")
    cr, cl = profiles.CostModel.build(remote, m), profiles.CostModel.build(local, m)
    w = m.expert_bytes("Q4_K")
    network = remote.remote_latency_us * 1e-6 + w / (remote.remote_GBps * 1e9)
    assert cr.transfer_s == pytest.approx(network / 2) and network > w / remote.pcie_bw
    assert cl.transfer_s == pytest.approx(w / remote.pcie_bw / 2)  # two local x16 links
    assert cr.sync_s == pytest.approx(cl.sync_s + remote.remote_latency_us * 1e-6)  # 2 × latency on half the layers
    assert cr.sync_token_s == pytest.approx(4 * m.d_model / (remote.remote_GBps * 1e9))
    assert cr.fixed_pass_s == pytest.approx(cl.fixed_pass_s + 2 * remote.remote_latency_us * 1e-6)
    assert cr.vram_bytes == cl.vram_bytes and cl.sync_token_s == 0.0
    # a slower network costs more in the simulated steady state
    from orchestrator.sim.simulator import SimConfig, Simulator
    from orchestrator.sim.synthetic import QWEN3_30B_A3B, synthesize_trace
    from orchestrator.policies import make_policy

    trace = synthesize_trace(60, QWEN3_30B_A3B.with_shape(m.n_layer, m.n_expert, m.top_k), gamma=4, acceptance=0.75,
                             draft_fidelity=None, seed=0, layer_index=m.layer_index)
    tok_s = {}
    for key in ("rtx3090-remote-25gbe", "rtx3090-remote-10gbe", "2x-rtx3090"):
        config = SimConfig(hardware=key, model="qwen3-235b-a22b", draft=None, capacity=3000)
        r = Simulator(trace, config).run(make_policy("spac/host"))
        tok_s[key] = r.tokens / r.time_s
    assert tok_s["rtx3090-remote-10gbe"] < tok_s["rtx3090-remote-25gbe"] < tok_s["2x-rtx3090"], tok_s


def test_a_hybrid_keeps_kv_in_its_full_attention_blocks_and_a_state_in_the_others():
    """Qwen3.6-35B-A3B: 30 gated-delta-net blocks beside 10 full-attention ones. KV only in the
    10; in memory 1 + n_rs_seq recurrent states (snapshots = γ: spac's target context when it
    speculates); every pass reads each state once and writes a snapshot per token (3 state bytes
    each with its copy into the cache), charged to the non-expert part of the MoE blocks."""
    from dataclasses import replace

    m = model("qwen3.6-35b-a3b")
    assert m.n_layer == 40 and m.n_expert == 256 and m.top_k == 8 and m.recurrent_blocks == 30
    assert m.params == pytest.approx(34.7e9, rel=0.01)
    assert m.kv_bytes_per_token == 10 * 2 * 2 * 256 * 2
    assert m.state_bytes == 30 * 4 * (3 * (32 * 128 + 2 * 16 * 128) + 128 * 32 * 128)
    hw = hardware("rtx4060")
    plain = replace(m, recurrent_blocks=0, state_bytes=0)
    c0, c8, cp = CostModel.build(hw, m), CostModel.build(hw, m, snapshots=8), CostModel.build(hw, plain)
    assert c0.static_bytes == cp.static_bytes + m.state_bytes and c8.static_bytes == cp.static_bytes + 9 * m.state_bytes
    per_block = m.state_bytes / 40
    assert c0.dense_layer_s == pytest.approx(cp.dense_layer_s + per_block / hw.gpu_bw)
    assert c0.dense_layer_time(9) - c0.dense_layer_time(1) == pytest.approx(8 * 3 * per_block / hw.gpu_bw)
    assert cp.dense_layer_token_s == 0.0  # the other models' costs are as before
    # the simulator's memory: the pool that fits shrinks by the snapshots
    assert SimConfig(hardware="rtx4060", model=m.key, snapshots=8).costs().static_bytes == \
        CostModel.build(hw, m, model("qwen3-4b"), snapshots=8).static_bytes



def test_drafts_made_of_the_target_cost_its_own_weights():
    """--draft pool: one token through every block and the head with top_k device experts per MoE
    layer, no crossing, no weights of its own; a second context's KV and two recurrent states.
    --draft mtp: the MTP block's weights and the head on the device, top_k host experts behind one
    crossing, and once per drafting step the catch-up decode's other tokens' experts."""
    from orchestrator.sim.profiles import MTP_CATCH_UP_TOKENS, SELF_DRAFTS

    m, hw = model("qwen3.6-35b-a3b"), hardware("rtx4060")
    assert SELF_DRAFTS == ("pool", "mtp")
    bare = CostModel.build(hw, m)
    w_e, bpw = m.expert_bytes("Q4_K"), m.expert_bytes("Q4_K") / m.expert_params
    overhead = hw.layer_overhead_us * 1e-6

    pool = CostModel.build(hw, m, "pool")
    state = sum(m.state_traffic())  # one token: each block reads its state and writes a snapshot
    one_token = (m.non_expert_bytes() + m.n_layer * (state + m.top_k * w_e)) / hw.gpu_bw + m.n_block * overhead
    assert pool.draft_token_s == pytest.approx(one_token) and pool.draft_step_s == 0.0
    assert pool.static_bytes == pytest.approx(bare.static_bytes + 4096 * m.kv_bytes_per_token + 2 * m.state_bytes)

    mtp = CostModel.build(hw, m, "mtp")
    host_expert = w_e / hw.cpu_bw
    device = (m.mtp_block_params + m.head_params) * bpw / hw.gpu_bw + overhead + hw.sync_us * 1e-6
    assert mtp.draft_token_s == pytest.approx(device + m.top_k * host_expert)
    assert mtp.draft_step_s == pytest.approx((MTP_CATCH_UP_TOKENS - 1) * m.top_k * host_expert)
    kv_block = m.kv_bytes_per_token / 10  # one of the 10 full-attention blocks
    assert mtp.static_bytes == pytest.approx(bare.static_bytes + m.mtp_block_params * bpw + 4096 * kv_block)
    assert mtp.draft_time(0) == 0.0 and mtp.draft_time(3) == pytest.approx(3 * mtp.draft_token_s + mtp.draft_step_s)

    # the names go where a draft model's would; a target without an MTP block refuses "mtp"
    assert SimConfig(hardware="rtx4060", model=m.key, draft="mtp").costs() == mtp
    with pytest.raises(ValueError, match="no MTP block"):
        SimConfig(hardware="rtx4060", model="qwen3-30b-a3b", draft="mtp").costs()
    with pytest.raises(ValueError, match="unknown draft"):
        CostModel.build(hw, m, "eagle")


def test_the_simulator_charges_a_drafting_steps_own_time_once():
    """draft_step_s (the MTP head's catch-up) once per step that drafts, before its draft tokens:
    the tiny case's step with one draft token, 2 ms, takes 3 ms more (host misses, as in
    test_prefetch_during_drafting_and_visibility's 64.5 ms). Step 1 drafts for 5 ms, long enough
    for the first of step 0's copies (issued at 67.5, 5 ms each) to land before its pass: that
    expert's 10 ms on the host becomes 1 ms on the device, beside the layer's other host experts."""
    with_step = CostModel(**{**COSTS.__dict__, "draft_step_s": 3 * MS})
    r = run(make_policy("lru", miss="cpu"), capacity=8, costs=with_step)
    np.testing.assert_allclose(r.step_time, [67.5 * MS, 57.5 * MS])

def test_a_hybrid_profile_from_its_gguf(tmp_path):
    """A qwen35moe file's profile counts its KV and recurrent state as the placement does."""
    from orchestrator.gguf_files.gguf_export import make_random_model, tiny_config
    from orchestrator.runtime.placement import model_sizes
    from orchestrator.sim.profiles import from_gguf

    path = make_random_model(tmp_path / "h.gguf", tiny_config("qwen35moe"))
    p, _ = from_gguf(path)
    s = model_sizes(path)
    assert p.recurrent_blocks == 3 and p.state_bytes == s.state_bytes > 0
    assert p.kv_bytes_per_token == s.kv_bytes_per_token
    assert from_gguf(make_random_model(tmp_path / "q.gguf", tiny_config("qwen3moe")))[0].state_bytes == 0


def test_the_gpu_projection_has_the_hybrid_rows():
    """bench/sim_gpu_projection.py: Qwen3.6-35B-A3B beside the earlier models, its pool on a card
    sized after 1 + γ recurrent states (the target's snapshots when it speculates at γ)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "sim_gpu_projection.py"
    spec = importlib.util.spec_from_file_location("sim_gpu_projection", path)
    proj = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(proj)
    assert list(proj.MODELS) == ["qwen3-30b-a3b", "qwen3.6-35b-a3b", "gpt-oss-120b"]
    assert "llama-moe-cache" in proj.SYSTEMS and len(proj.CARDS) == 4  # 8, 12, 16 and 24 GB
    m = model("qwen3.6-35b-a3b")
    cap = {g: proj.capacity(SimConfig(hardware="rtx4060", model=m.key, draft=None, snapshots=g)) for g in (0, 8)}
    assert cap[0] - cap[8] == pytest.approx(8 * m.state_bytes / m.expert_bytes("Q4_K"), abs=1)
    r = proj.row("rtx4060", m.key, "Q4_K", 2, "spac/host", steps=30, seed=0)
    assert r["tok_s"] > 0 and 0 < r["share"] < 1 and r["gamma"] == 2
    # spac drafts it with its MTP head by default, llama.cpp with the faster of its MTP draft and Qwen3-0.6B
    assert proj.SPAC_DRAFTS[m.key] == ("mtp", "pool") and proj.LLAMA_DRAFTS[m.key] == ("mtp", proj.DRAFT)
    r = proj.row("rtx4060", m.key, "Q4_K", 2, "spac", steps=30, seed=0, draft="mtp")
    assert r["tok_s"] > 0 and r["draft"] == "mtp"
