"""The live ablation of llama.cpp's own expert cache (patch 0023, `upload_on_miss_tokens`): a
ubatch of at most 32 tokens uploads, at each MoE layer once its router has run, the chosen
experts the pool lacks into its least recently used slots, then computes every routed expert on
the pool device. On the CPU test device its logits equal the unsplit model's bit for bit; no
expert is computed on the host; the pool keeps what was used, evicting the least recently used."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.runtime.llm import Context, Model
from orchestrator.runtime.native import ExpertEngine, engine_built
from orchestrator.gguf_files.gguf_export import make_random_model

from engine_common import decode_runs, model_config, session_engine_stats

pytestmark = pytest.mark.skipif(not engine_built(), reason="native engine not built")
CACHE_TOKENS = 32  # llama.cpp's: a verify pass's ubatch


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("upload-on-miss")
    return {q: make_random_model(d / f"m-{q}.gguf", model_config("qwen3moe"), seed=2, dtype="f32",
                                 quant=None if q == "f32" else q) for q in ("f32", "q4_k_m")}


RUNS = [list(range(10, 22)), [5], [7, 8, 9], [200, 201, 202, 203, 204, 205, 206, 207, 208], [33], [34, 35]]


@pytest.mark.parametrize("quant", ["f32", "q4_k_m"])
@pytest.mark.parametrize("budget", [0.1, 0.5])
def test_every_routed_expert_runs_on_the_device_and_the_logits_are_unchanged(models, quant, budget):
    model = Model(models[quant], repack="off")
    ctx = Context(model, n_ctx=256, n_batch=64, n_threads=2)
    try:
        want = decode_runs(ctx, RUNS)
        with ExpertEngine(ctx.ptr, models[quant], budget_ratio=budget, upload_on_miss_tokens=CACHE_TOKENS) as engine:
            got = decode_runs(ctx, RUNS)
            s = engine.stats()
            for a, b in zip(got, want):
                np.testing.assert_array_equal(a, b)
            assert s["n_expert_tokens_cpu"] == 0 and s["n_expert_tokens_device"] > 0
            assert s["n_staged"] > 0          # misses were uploaded on the critical path
            assert s["n_copies"] == 0         # and no plan copied anything
            if budget < 0.5:
                assert s["n_evictions"] > 0   # a small pool turns over
    finally:
        ctx.close()
        model.close()


def test_the_pool_keeps_what_was_used(models):
    """A second pass over the same tokens finds every expert it routes to resident: nothing more
    uploaded, nothing evicted (3 tokens route to at most 48 of the 60 slots of 15/16 of the experts;
    a pool of every expert is filled at load instead, below)."""
    model = Model(models["f32"], repack="off")
    ctx = Context(model, n_ctx=256, n_batch=64, n_threads=2)
    try:
        with ExpertEngine(ctx.ptr, models["f32"], budget_ratio=15 / 16, upload_on_miss_tokens=CACHE_TOKENS) as engine:
            tokens = [40, 41, 42]
            ctx.decode(tokens)
            first = engine.stats()
            ctx.clear()
            ctx.decode(tokens)
            second = engine.stats()
            assert first["n_staged"] > 0
            assert second["n_staged"] == first["n_staged"] and second["n_evictions"] == 0
            resident = engine.residency() >= 0
            assert resident.sum() == first["n_staged"]  # exactly the experts it uploaded
    finally:
        ctx.close()
        model.close()


def test_a_later_layer_evicts_what_an_earlier_layer_used_as_llama_cpp_does(models):
    """6 slots for 4 layers of top-4 routing: llama.cpp's cache gives each layer's misses the least
    recently used slots, those an earlier layer of the same pass used included (its router has
    run: the device is done with them), so after one token the last layer's 4 experts and 2 of
    the layer before are cached; the logits stay the target's."""
    model = Model(models["f32"], repack="off")
    ctx = Context(model, n_ctx=64, n_batch=16, n_threads=2)
    try:
        ctx.decode([7])
        want = ctx.logits().copy()
        ctx.clear()
        with ExpertEngine(ctx.ptr, models["f32"], budget_ratio=6.5 / 64, upload_on_miss_tokens=CACHE_TOKENS) as engine:
            ctx.decode([7])
            np.testing.assert_array_equal(ctx.logits(), want)
            s = engine.stats()
            resident = engine.residency() >= 0
            assert s["n_slots"] == 6 and resident.sum() == 6 and s["n_evictions"] == 16 - 6
            assert resident[-1].sum() == 4 and resident[-2].sum() == 2
    finally:
        ctx.close()
        model.close()


@pytest.mark.parametrize("stream", ["off", "ahead"])
def test_a_pool_of_every_expert_is_filled_at_load_and_never_stages(models, stream):
    """A slot for every expert: the pool is full before the first pass (one batch of copies per
    layer), has no staging slots, and neither llama.cpp's cache (≤ 32 tokens) nor a streamed
    prefill (a 40-token prompt) stages anything; the logits are the target's, bit for bit."""
    model = Model(models["f32"], repack="off")
    ctx = Context(model, n_ctx=256, n_batch=64, n_threads=2)
    runs = RUNS + [list(range(60, 100))]
    try:
        want = decode_runs(ctx, runs)
        with ExpertEngine(ctx.ptr, models["f32"], budget_ratio=1.0, upload_on_miss_tokens=CACHE_TOKENS,
                          stream_prefill=stream, max_split_tokens=16) as engine:
            L, E = engine.n_moe_layers, engine.n_expert
            assert (engine.residency() >= 0).all()
            s = engine.stats()
            assert s["n_copies"] == L * E and s["n_copy_batches"] == L and s["n_slots"] == L * E
            got = decode_runs(ctx, runs)
            s = engine.stats()
            for a, b in zip(got, want):
                np.testing.assert_array_equal(a, b)
            assert s["n_staged"] == 0 and s["n_evictions"] == 0 and s["n_copies"] == L * E
            assert s["n_expert_tokens_cpu"] == 0 and s["n_expert_tokens_device"] > 0
    finally:
        ctx.close()
        model.close()


def test_a_larger_ubatch_keeps_the_split(models):
    """Above 32 tokens (a prompt) the ablation is off: the split computes the misses on the host."""
    model = Model(models["f32"], repack="off")
    ctx = Context(model, n_ctx=256, n_batch=64, n_threads=2)
    try:
        with ExpertEngine(ctx.ptr, models["f32"], budget_ratio=0.25, upload_on_miss_tokens=CACHE_TOKENS) as engine:
            ctx.decode(list(range(60, 100)))  # 40 tokens: split (≤ 64), not cached
            ctx.logits()                      # synchronized: the counts are in
            s = engine.stats()
            assert s["n_staged"] == 0 and s["n_expert_tokens_cpu"] > 0
    finally:
        ctx.close()
        model.close()


def test_a_session_with_llama_cpps_cache_gives_target_only_tokens(models, tmp_path):
    """`Session(cfg, policy=LlamaMoeCacheLRU())`: the live ablation, speculative (the Q4_K_M target
    drafting for itself through its pool) and not, gives target-only's greedy tokens, with every
    routed expert of its passes on the device and no plan sent."""
    from orchestrator.policies.cache import LlamaMoeCacheLRU

    for st in session_engine_stats(models["q4_k_m"], tmp_path, LlamaMoeCacheLRU):
        assert st["n_staged"] > 0 and st["n_copies"] == 0
