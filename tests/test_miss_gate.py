"""spac's miss rule, live (issue 51; `miss_gate_tokens`, patch 0031): a split ubatch's gate after
each MoE layer's router uploads a miss into a slot, computes it on the host, or streams it once
through a staging slot, by the costs given to `set_miss_costs`. On the CPU test device the logits
equal the unsplit model's bit for bit whichever way each expert goes; the rule's choices follow
the costs; the pool never loses a slot."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.runtime.llm import Context, Model
from orchestrator.runtime.native import ExpertEngine, MissCosts, engine_built
from orchestrator.gguf_files.gguf_export import make_random_model

from engine_common import decode_runs, model_config, session_engine_stats

pytestmark = pytest.mark.skipif(not engine_built(), reason="native engine not built")
GATE_TOKENS = 32
RUNS = [list(range(10, 22)), [5], [7, 8, 9], [200, 201, 202, 203, 204, 205, 206, 207, 208], [33], [34, 35]]


def costs(upload_s: float, host_s: float = 100e-6, device_s: float = 10e-6, horizon: float = 0.0) -> MissCosts:
    """Built costs: one expert's upload, and its host and device time per token."""
    return MissCosts(upload_s=upload_s, sync_s=0.0, horizon_tokens=horizon,
                     host_s=lambda n: n * host_s, device_s=lambda n: n * device_s)


# a free link to a device far faster than a host that takes a second per token: every miss goes
# to the device; a link that takes a second: none does
FAST_LINK, SLOW_LINK = costs(0.0, host_s=1.0), costs(1.0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("miss-gate")
    return {q: make_random_model(d / f"m-{q}.gguf", model_config("qwen3moe"), seed=2, dtype="f32",
                                 quant=None if q == "f32" else q) for q in ("f32", "q4_k_m")}


@pytest.fixture
def opened(models):
    opened = []

    def open_(quant="f32", n_ctx=256):
        model = Model(models[quant], repack="off")
        ctx = Context(model, n_ctx=n_ctx, n_batch=64, n_threads=2)
        opened.append((model, ctx))
        return ctx

    yield open_
    for model, ctx in opened:
        ctx.close()
        model.close()


@pytest.mark.parametrize("quant", ["f32", "q4_k_m"])
@pytest.mark.parametrize("rule", ["fast-link", "slow-link", "mixed", "no-costs"])
@pytest.mark.parametrize("budget,stream", [(0.1, "off"), (0.1, "ahead"), (0.5, "off")])
def test_each_miss_goes_one_way_and_the_logits_are_the_unsplit_models(models, opened, quant, rule, budget, stream):
    """Bit for bit on the CPU device, every expert on exactly one side: uploaded, streamed or on the
    host as the rule chose (a fast link uploads, a slow one keeps every miss on the host, a 1-token
    miss under costs that favour the host stays there while a hot one is uploaded)."""
    ctx = opened(quant)
    want = decode_runs(ctx, RUNS)
    rules = {"fast-link": FAST_LINK, "slow-link": SLOW_LINK, "mixed": costs(150e-6), "no-costs": None}
    with ExpertEngine(ctx.ptr, models[quant], budget_ratio=budget, miss_gate_tokens=GATE_TOKENS,
                      stream_prefill=stream) as engine:
        engine.set_miss_costs(rules[rule])
        got = decode_runs(ctx, RUNS)
        s = engine.stats()
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    decided = s["n_gate_uploads"] + s["n_gate_host"] + s["n_gate_streamed"]
    assert decided > 0
    if rule in ("slow-link", "no-costs"):
        assert s["n_gate_uploads"] == s["n_gate_streamed"] == s["n_staged"] == 0 and s["n_expert_tokens_cpu"] > 0
    elif rule == "fast-link":
        assert s["n_gate_uploads"] > 0
        if stream == "ahead":  # a pool too small for a layer's misses streams the rest
            assert s["n_gate_host"] == 0 and s["n_gate_streamed"] > 0
    else:
        assert s["n_gate_uploads"] > 0 and s["n_gate_host"] > 0
    assert s["n_staged"] == s["n_gate_uploads"] + s["n_gate_streamed"]
    assert s["n_copies"] == 0  # no plan was sent
    assert s["n_expert_tokens_device"] + s["n_expert_tokens_cpu"] == sum(len(r) for r in RUNS) * 4 * 4


def test_a_one_token_expert_never_used_again_is_not_admitted_and_reuse_earns_a_slot(models, opened):
    """Host 100 µs, device 10 µs per token, an upload 500 µs: a layer's 4 one-token misses take the
    host at most 400 µs and the device 510 for the first, so without credit they stay on the host
    however often they come back; with the reuse credit (horizon 128 tokens), experts that token
    after token uses earn their upload."""
    ctx = opened()
    for horizon, admitted in ((0.0, False), (128.0, True)):
        ctx.clear()
        with ExpertEngine(ctx.ptr, models["f32"], budget_ratio=0.5, miss_gate_tokens=GATE_TOKENS) as engine:
            engine.set_miss_costs(costs(500e-6, horizon=horizon))
            ctx.decode([9])
            ctx.logits()
            first = engine.stats()
            assert first["n_gate_uploads"] == 0 and first["n_gate_host"] == 16  # 4 layers of top-4
            for _ in range(12):
                ctx.decode([9])  # the same token: the same experts, every pass
                ctx.logits()
            s = engine.stats()
            assert (s["n_gate_uploads"] > 0) == admitted, s


def test_no_slot_is_lost_when_the_pool_is_full(models, opened):
    """Many passes through a full pool under the fast link: every slot is held by one expert, no
    expert by two slots, the count of residents equals the slots."""
    ctx = opened(n_ctx=512)
    rng = np.random.default_rng(0)
    with ExpertEngine(ctx.ptr, models["f32"], budget_ratio=0.25, miss_gate_tokens=GATE_TOKENS) as engine:
        engine.set_miss_costs(FAST_LINK)
        for _ in range(40):
            ctx.decode(rng.integers(1, 250, size=int(rng.integers(1, 9))).tolist())
            ctx.logits()
        s = engine.stats()
        slots = engine.residency()
        held = slots[slots >= 0]
        assert s["n_evictions"] > 0
        assert len(held) == s["n_slots"] == s["n_resident"] and len(np.unique(held)) == len(held)
        assert held.min() >= 0 and held.max() < s["n_slots"]


def test_a_larger_ubatch_and_bad_costs(models, opened):
    """Above miss_gate_tokens the split keeps the plan's residency (nothing decided); bad costs and
    a gate beyond SPAC_MISS_MAX_TOKENS are refused with the reason."""
    ctx = opened()
    with ExpertEngine(ctx.ptr, models["f32"], budget_ratio=0.25, miss_gate_tokens=8) as engine:
        engine.set_miss_costs(FAST_LINK)
        ctx.decode(list(range(60, 80)))  # 20 tokens: split (<= 64), not gated
        ctx.logits()
        s = engine.stats()
        assert s["n_gate_uploads"] + s["n_gate_host"] == 0 and s["n_expert_tokens_cpu"] > 0
        with pytest.raises(ValueError, match="finite and >= 0"):
            engine.set_miss_costs(costs(-1.0))
    with pytest.raises(ValueError, match="miss_gate_tokens"):
        ExpertEngine(ctx.ptr, models["f32"], miss_gate_tokens=65)


def test_a_session_with_spacs_miss_rule_gives_target_only_tokens(models, tmp_path):
    """`Session(cfg, policy=ReuseCredited())`: the rule live on the calibrated costs, speculative (the
    Q4_K_M target drafting for itself through its pool) and not, gives target-only's greedy tokens;
    the gates decided every miss of the passes and no plan was sent."""
    from orchestrator.policies.cache import ReuseCredited

    for st in session_engine_stats(models["q4_k_m"], tmp_path, ReuseCredited):
        assert st["n_gate_host"] + st["n_gate_uploads"] + st["n_gate_streamed"] > 0 and st["n_copies"] == 0


def test_the_calibration_times_the_gates_own_uploads(models, tmp_path, monkeypatch):
    """A session whose gates decide the misses calibrates their uploads (the staging queue, not the
    plan's copy worker) and hands the rule that time; a session without gates does not time them."""
    from orchestrator.decoding.speculative import Session, SessionConfig
    from orchestrator.policies.cache import ReuseCredited
    from orchestrator.policies.default import LookaheadUtility
    from orchestrator.runtime.pool import Budget, PoolDevice

    sent = []
    monkeypatch.setattr(ExpertEngine, "set_miss_costs", lambda self, c, _set=ExpertEngine.set_miss_costs: (
        sent.append(c), _set(self, c))[-1])
    base = dict(model=models["q4_k_m"], n_ctx=256, n_threads=2, repack="off", calibration_cache=tmp_path / "cal.json",
                pool=(PoolDevice("CPU", Budget(ratio=0.25)),))
    with Session(SessionConfig(**base), policy=ReuseCredited()) as s:
        cal = s.calibration
    assert cal.t_upload_unit > 0 and sent[-1].upload_s == cal.t_upload_unit
    with Session(SessionConfig(**base), policy=LookaheadUtility(miss="cpu")) as s:
        assert s.calibration.t_upload_unit == 0
