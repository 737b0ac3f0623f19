"""The native expert engine (ggml-patches 0002-0008): pool, split MoE FFN, copy engine, routing export.

The sharpest test: with the pool on a second CPU buffer, the same kernels run on both halves,
so split execution must give logits bit-identical to unsplit execution, for any residency.
"""

from __future__ import annotations

import gc

import numpy as np
import psutil
import pytest

from orchestrator.runtime.llm import Context, Model
from orchestrator.runtime.native import ExpertEngine, NativeError, Routing
from orchestrator.gguf_files.gguf_export import byte_level_bpe_tokenizer, make_random_model, tiny_config, write_gguf
from orchestrator.gguf_files.synthetic_models import synthetic_tensors
from orchestrator.shipped_models import MODELS_DIR
from orchestrator.policies.plan import Plan

from engine_common import PROMPT, model_config, run_sequence, tensor_reader


K_MAX = 4


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """(arch, quant) -> path of a seeded random model."""
    d = tmp_path_factory.mktemp("models")
    out = {}
    for arch in ("qwen3moe", "qwen2moe"):
        for quant in ("f32", "q8_0", "q4_0"):
            path = d / f"{arch}-{quant}.gguf"
            make_random_model(path, model_config(arch), seed=1, dtype="f32", quant=None if quant == "f32" else quant)
            out[arch, quant] = path
    return out


def random_plan(rng, n_layer, n_expert) -> Plan:
    utility = rng.integers(0, K_MAX + 1, size=(n_layer, n_expert)).astype(np.uint8)
    threshold = rng.integers(1, K_MAX + 1, size=n_layer).astype(np.int32)
    return Plan(utility=utility, threshold=threshold)


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
@pytest.mark.parametrize("quant", ["f32", "q8_0", "q4_0"])
@pytest.mark.parametrize("threads", [1, 2])
def test_split_is_bit_identical(models, arch, quant, threads):
    path = models[arch, quant]
    # no CPU_REPACK: the host experts and the CPU pool then use the same kernels
    model = Model(path, repack="off")
    ctx = Context(model, n_ctx=64, n_batch=16, n_threads=threads)
    try:
        reference = run_sequence(ctx)
        rng = np.random.default_rng(hash((arch, quant, threads)) % 2**32)
        checked = 0
        # none resident (fresh pool), then random plans, then everything resident
        with ExpertEngine(ctx.ptr, path, budget_ratio=0.5) as engine:
            L, E = engine.n_moe_layers, engine.n_expert
            assert (engine.residency() < 0).all()
            assert run_sequence(ctx).tobytes() == reference.tobytes()
            checked += 1
            for _ in range(100):
                engine.set_plan(random_plan(rng, L, E))
                assert engine.wait_idle()
                got = run_sequence(ctx)
                assert got.tobytes() == reference.tobytes(), f"plan {checked}: residency {engine.residency()}"
                checked += 1
            stats = engine.stats()
            assert stats["n_expert_tokens_device"] > 0 and stats["n_expert_tokens_cpu"] > 0
            assert stats["bytes_copied"] > 0
        with ExpertEngine(ctx.ptr, path, budget_ratio=1.0) as engine:
            engine.set_plan(Plan(np.full((L, E), K_MAX, np.uint8), np.ones(L, np.int32)))
            assert engine.wait_idle()
            assert (engine.residency() >= 0).all()
            assert run_sequence(ctx).tobytes() == reference.tobytes()
            assert engine.stats()["n_expert_tokens_cpu"] == 0
            checked += 1
        # detached again: upstream graph
        assert run_sequence(ctx).tobytes() == reference.tobytes()
        assert checked >= 102
    finally:
        ctx.close()
        model.close()


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
@pytest.mark.parametrize("split_graph, join", [("per-matmul", "auto"), ("overlap", "partial-sums")])
def test_other_split_graphs(models, arch, split_graph, join):
    """The per-matmul baseline is bit-identical too; partial sums differ by rounding only."""
    path = models[arch, "q8_0"]
    model = Model(path, repack="off")
    ctx = Context(model, n_ctx=64, n_batch=16, n_threads=2)
    try:
        reference = run_sequence(ctx)
        rng = np.random.default_rng(3)
        with ExpertEngine(ctx.ptr, path, budget_ratio=0.5, split_graph=split_graph, join=join) as engine:
            L, E = engine.n_moe_layers, engine.n_expert
            for _ in range(10):
                engine.set_plan(random_plan(rng, L, E))
                assert engine.wait_idle()
                got = run_sequence(ctx)
                if join == "partial-sums":
                    np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())
                else:
                    assert got.tobytes() == reference.tobytes()
            assert engine.stats()["n_expert_tokens_device"] > 0
        with pytest.raises(ValueError, match="split_graph must be one of"):
            ExpertEngine(ctx.ptr, path, split_graph="sideways")
    finally:
        ctx.close()
        model.close()


def test_late_prefetch_stays_exact(models):
    """Verify passes run while copies are still in flight (slowed by a test-only delay)."""
    path = models["qwen3moe", "q8_0"]
    model = Model(path, repack="off")
    ctx = Context(model, n_ctx=64, n_batch=16, n_threads=2)
    try:
        reference = run_sequence(ctx)
        rng = np.random.default_rng(7)
        with ExpertEngine(ctx.ptr, path, budget_ratio=0.5, copy_delay_us=3000) as engine:
            L, E = engine.n_moe_layers, engine.n_expert
            for _ in range(20):
                engine.set_plan(random_plan(rng, L, E))
                # no wait: decode while the worker is copying
                assert run_sequence(ctx).tobytes() == reference.tobytes()
            stats = engine.stats()
            assert stats["n_prefetch_late"] > 0
            assert engine.wait_idle(30)
            assert run_sequence(ctx).tobytes() == reference.tobytes()
    finally:
        ctx.close()
        model.close()


def test_copies_refused_by_frozen_slots_are_made_once_they_thaw(models):
    """A plan that arrives while a decode's graph still references every resident slot finds no
    victim. Its copies are made once the context synchronizes, not only if another plan comes:
    a plan that does not change (a static placement) is sent once."""
    path = models["qwen3moe", "q8_0"]
    model = Model(path, repack="off")
    ctx = Context(model, n_ctx=64, n_batch=16, n_threads=1)
    try:
        with ExpertEngine(ctx.ptr, path, budget_ratio=0.5) as engine:
            L, E = engine.n_moe_layers, engine.n_expert
            first, second = np.zeros((L, E), np.uint8), np.zeros((L, E), np.uint8)
            first[:, :E // 2] = K_MAX
            second[:, E // 2:] = K_MAX
            engine.set_plan(Plan(first, np.ones(L, np.int32)))
            assert engine.wait_idle()
            assert ((engine.residency() >= 0) == (first > 0)).all()  # the pool is full
            ctx.decode(PROMPT[:3], logits_all=False)  # its graph freezes every resident slot
            engine.set_plan(Plan(second, np.ones(L, np.int32)))
            assert engine.wait_idle()
            assert ((engine.residency() >= 0) == (first > 0)).all()  # no victim while frozen
            ctx.logits()  # synchronizes: the slots thaw
            assert engine.wait_idle()
            assert ((engine.residency() >= 0) == (second > 0)).all()
    finally:
        ctx.close()
        model.close()


def test_routing_export_equals_eval_callback(models):
    path = models["qwen3moe", "f32"]
    from llama_cpp import llama_cpp as low

    ggml = tensor_reader()
    seen: dict[str, np.ndarray] = {}

    @low.ggml_backend_sched_eval_callback
    def cb(tensor, ask, user_data):
        name = ggml.ggml_get_name(tensor).decode()
        if ask or not name.startswith("ffn_moe_argsort-"):
            return name.startswith("ffn_moe_argsort-") if ask else True
        arr = np.empty(ggml.ggml_nelements(tensor), dtype=np.int32)
        ggml.ggml_backend_tensor_get(tensor, arr.ctypes.data, 0, arr.nbytes)
        seen[name] = arr
        return True

    model = Model(path)
    ctx = Context(model, n_ctx=64, n_batch=16, n_threads=2, cb_eval=cb)
    try:
        routing = Routing(ctx.ptr, n_expert_used=4)
        ctx.decode(PROMPT)
        ids, weights = routing.last()
        assert ids.shape == (4, len(PROMPT), 4)
        for m in range(4):
            argsort = seen[f"ffn_moe_argsort-{m}"].reshape(len(PROMPT), 16)
            assert (ids[m] == argsort[:, :4]).all()
        np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-5)  # qwen3moe renormalises top-k
    finally:
        ctx.close()
        model.close()


def test_bad_arguments_are_errors_not_crashes(models, tmp_path):
    path = models["qwen3moe", "f32"]
    model = Model(path)
    ctx = Context(model, n_ctx=64, n_batch=16)
    try:
        with pytest.raises(NativeError, match="below one expert slot"):
            ExpertEngine(ctx.ptr, path, budget_bytes=1)
        with pytest.raises(NativeError, match="exceeds the free memory"):
            ExpertEngine(ctx.ptr, path, budget_bytes=10**16)
        with pytest.raises(NativeError, match="no device named"):
            ExpertEngine(ctx.ptr, path, device="NoSuchGPU0")
        other = tmp_path / "other.gguf"
        make_random_model(other, model_config("qwen2moe"), seed=3)
        with pytest.raises(NativeError, match="does not match"):
            ExpertEngine(ctx.ptr, other)
        with ExpertEngine(ctx.ptr, path) as engine:
            L, E = engine.n_moe_layers, engine.n_expert
            with pytest.raises(NativeError, match="already have a pool on CPU"):  # one engine per layer
                ExpertEngine(ctx.ptr, path)
            good_u, good_t = np.zeros((L, E), np.uint8), np.ones(L, np.int32)
            with pytest.raises(ValueError, match="uint8"):
                engine.set_plan(Plan(good_u.astype(np.int64), good_t))
            with pytest.raises(ValueError, match="int32"):
                engine.set_plan(Plan(good_u, good_t[:-1]))
            with pytest.raises(ValueError, match="MoE layer 99 out of range"):
                engine.set_plan(Plan(good_u, good_t, prefetch=np.array([[99, 0]])))
            with pytest.raises(ValueError, match="expert 16 out of range"):
                engine.set_plan(Plan(good_u, good_t, evict=np.array([[0, 16]])))
            with pytest.raises(ValueError, match="must be >= 1"):
                engine.set_plan(Plan(good_u, np.zeros(L, np.int32)))
            with pytest.raises(ValueError, match="uint8"):
                engine.set_plan(Plan(good_u.tolist(), good_t))
            engine.set_plan(Plan(np.asfortranarray(good_u), good_t[::-1]))  # strided arrays are fine
            engine.set_plan(Plan(good_u, good_t, prefetch=np.array([[1, 3], [0, 2]])))
            assert engine.wait_idle()
            res = engine.residency()
            assert res[1, 3] >= 0 and res[0, 2] >= 0
        with pytest.raises(NativeError, match="closed"):
            engine.set_plan(Plan(good_u, good_t))
    finally:
        ctx.close()
        model.close()


def test_model_with_a_repacked_router(tmp_path):
    """All 2-D tensors Q4_0, router included, loaded with CPU_REPACK: the router cannot be read
    back in file layout, so the file check falls back to the token embeddings (used to crash)."""
    cfg = tiny_config("qwen3moe", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=16,
                      n_expert_used=4, n_ff_exp=256, n_vocab=512)
    paths = [tmp_path / f"q4_0-router-{seed}.gguf" for seed in (0, 1)]
    for seed, path in enumerate(paths):
        write_gguf(path, cfg, synthetic_tensors(cfg, seed), byte_level_bpe_tokenizer(cfg.n_vocab), dtype="q4_0")
    model = Model(paths[0], repack="on")
    ctx = Context(model, n_ctx=64, n_batch=16, n_threads=2)
    try:
        reference = run_sequence(ctx)
        with pytest.raises(NativeError, match="does not match"):
            ExpertEngine(ctx.ptr, paths[1])
        with ExpertEngine(ctx.ptr, paths[0], budget_ratio=0.5) as engine:
            L, E = engine.n_moe_layers, engine.n_expert
            # nothing resident: the repacked host kernel alone, skipping -1 ids: exact
            assert run_sequence(ctx).tobytes() == reference.tobytes()
            engine.set_plan(Plan(np.full((L, E), K_MAX, np.uint8), np.ones(L, np.int32)))
            assert engine.wait_idle()
            got = run_sequence(ctx)
            assert engine.stats()["n_expert_tokens_device"] > 0
        # half the experts in the plain-layout pool: other kernels (activation blocks, summation
        # order) than the repacked host experts, so close, not exact
        np.testing.assert_allclose(got, reference, rtol=0, atol=1e-2 * np.abs(reference).max())
    finally:
        ctx.close()
        model.close()


def test_dense_model_is_refused(tmp_path):
    path = tmp_path / "dense.gguf"
    make_random_model(path, tiny_config("qwen3"), seed=0)
    model = Model(path)
    ctx = Context(model, n_ctx=32, n_batch=8)
    try:
        with pytest.raises(NativeError, match="no MoE layers"):
            ExpertEngine(ctx.ptr, path)
    finally:
        ctx.close()
        model.close()


def test_create_free_does_not_leak(models):
    path = models["qwen3moe", "f32"]
    model = Model(path)
    ctx = Context(model, n_ctx=64, n_batch=16)
    proc = psutil.Process()
    try:
        def cycle():
            with ExpertEngine(ctx.ptr, path, budget_ratio=1.0) as engine:
                engine.set_plan(Plan(np.full((engine.n_moe_layers, engine.n_expert), 4, np.uint8),
                                     np.ones(engine.n_moe_layers, np.int32)))
                engine.wait_idle()
                run_sequence(ctx)
        for _ in range(5):
            cycle()
        gc.collect()
        before = proc.memory_info().rss
        for _ in range(40):
            cycle()
        gc.collect()
        grown = proc.memory_info().rss - before
        assert grown < 8 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB over 40 engine lifetimes"
    finally:
        ctx.close()
        model.close()


SHIPPED = ["spac-tiny-moe-f16.gguf", "spac-tiny-moe-q4_0.gguf"]


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("threads", [1, 2])
def test_split_is_bit_identical_on_shipped_models(name, threads):
    """The embedded trained target and its Q4_0 self-draft (both qwen3moe)."""
    path = MODELS_DIR / name
    model = Model(path, repack="off")
    ctx = Context(model, n_ctx=64, n_batch=16, n_threads=threads)
    try:
        reference = run_sequence(ctx)
        rng = np.random.default_rng(threads)
        with ExpertEngine(ctx.ptr, path, budget_ratio=0.3) as engine:
            for _ in range(20):
                engine.set_plan(random_plan(rng, engine.n_moe_layers, engine.n_expert))
                assert engine.wait_idle()
                assert run_sequence(ctx).tobytes() == reference.tobytes()
            assert engine.stats()["n_expert_tokens_device"] > 0
    finally:
        ctx.close()
        model.close()


def test_python_budget_default_is_the_c_default():
    from orchestrator.runtime.native import DEFAULT_BUDGET_RATIO, lib

    assert lib()["default_params"]().budget_ratio == pytest.approx(DEFAULT_BUDGET_RATIO)
