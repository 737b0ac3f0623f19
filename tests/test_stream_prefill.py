"""Streamed prefill (patch 0016): a ubatch above the split size computes every expert on the pool
device, the non-resident ones copied into staging slots layer by layer. Its logits equal an
all-host prefill's: bit for bit on the CPU test device, within 1e-4 on the RPC device."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from orchestrator.runtime.llm import Context, Model
from orchestrator.runtime.native import ExpertEngine, Routing, engine_built
from orchestrator.runtime.placement import model_sizes
from orchestrator.runtime.pool import StreamPrefill
from orchestrator.gguf_files.gguf_export import make_random_model
from orchestrator.policies.plan import Plan

from engine_common import model_config, rpc_main, run_in_own_process

pytestmark = pytest.mark.skipif(not engine_built(), reason="native engine not built")
N_BATCH = 512  # the ubatch size: a prompt above 64 tokens streams, 512 at a time


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("stream-models")
    return {(arch, quant): make_random_model(d / f"{arch}-{quant}.gguf", model_config(arch), seed=1, dtype="f32",
                                             quant=None if quant == "f32" else quant)
            for arch in ("qwen3moe", "qwen2moe") for quant in ("f32", "q8_0", "q4_0", "q4_k_m")}


def prompt(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 250, n)


def prefill(ctx: Context, tokens) -> np.ndarray:
    ctx.clear()
    ctx.decode(tokens, logits_all=True)
    return ctx.logits().copy()


def some_resident(engine: ExpertEngine, seed: int) -> np.ndarray:
    """A random plan in force (part of the pool filled): the streamed ubatch mixes slots."""
    rng = np.random.default_rng(seed)
    L, E = engine.n_moe_layers, engine.n_expert
    engine.set_plan(Plan(rng.integers(0, 5, (L, E)).astype(np.uint8), rng.integers(1, 5, L).astype(np.int32)))
    assert engine.wait_idle()
    return engine.residency() >= 0


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
@pytest.mark.parametrize("quant", ["f32", "q8_0", "q4_0", "q4_k_m"])
def test_streamed_prefill_is_bit_identical(models, arch, quant):
    path = models[arch, quant]
    model = Model(path, repack="off")
    ctx = Context(model, n_ctx=2304, n_batch=N_BATCH, n_threads=2)
    try:
        lengths = (65, 300, 2048) if quant == "q4_0" else (65, 300)
        references = {n: prefill(ctx, prompt(n)) for n in lengths}
        for mode, ratio in (("ahead", 0.1), ("ahead", 0.25), ("ahead", 0.5), ("used", 0.1), ("used", 0.5)):
            with ExpertEngine(ctx.ptr, path, budget_ratio=ratio, stream_prefill=mode) as engine:
                routing = Routing(ctx.ptr, n_expert_used=engine.n_expert_used)
                for n in lengths:
                    resident = some_resident(engine, seed=n)
                    engine.reset_stats()
                    got = prefill(ctx, prompt(n))
                    assert got.tobytes() == references[n].tobytes(), (mode, ratio, n)
                    n_streamed = sum(1 for start in range(0, n, N_BATCH) if min(N_BATCH, n - start) > 64)
                    stats = engine.stats()
                    assert stats["n_expert_tokens_cpu"] == 0 or n % N_BATCH <= 64
                    if mode == "ahead":  # each layer's non-resident experts, once per streamed ubatch
                        assert stats["n_staged"] == n_streamed * int((~resident).sum()), (ratio, n)
                    elif n <= N_BATCH:  # the distinct non-resident experts the ubatch chose
                        ids = routing.last()[0]
                        used = np.zeros_like(resident)
                        np.put_along_axis(used, ids.reshape(ids.shape[0], -1), True, axis=1)
                        assert stats["n_staged"] == int((used & ~resident).sum()), (ratio, n)
                    else:
                        assert 0 < stats["n_staged"] <= n_streamed * int((~resident).sum())
    finally:
        ctx.close()
        model.close()


def test_streamed_prefill_leaves_decoding_and_the_plan_alone(models):
    """After a streamed prompt, decoding splits as before (bit-identical) and the plan's copies
    go on: staging never touches the pool's own slots."""
    path = models["qwen3moe", "q8_0"]
    model = Model(path, repack="off")
    ctx = Context(model, n_ctx=512, n_batch=N_BATCH, n_threads=2)
    try:
        def run():
            ctx.clear()
            ctx.decode(prompt(200), logits_all=False)
            out = [ctx.logits().copy()]
            for t in (7, 11, 13):
                ctx.decode([t])
                out.append(ctx.logits().copy())
            return np.concatenate(out)

        reference = run()
        with ExpertEngine(ctx.ptr, path, budget_ratio=0.25, stream_prefill=StreamPrefill.AHEAD) as engine:
            resident = some_resident(engine, seed=3)
            assert run().tobytes() == reference.tobytes()
            assert ((engine.residency() >= 0) == resident).all()
            stats = engine.stats()
            assert stats["n_staged"] > 0 and stats["n_expert_tokens_cpu"] > 0  # the single tokens split
            # a layer's non-resident experts are staged in runs of consecutive experts, one copy per
            # tensor and run (patch 0021): fewer calls than experts, three tensors each
            staged_calls = stats["n_copy_calls"] - 3 * stats["n_copies"]  # a plan's copy: one call per tensor
            assert 0 < staged_calls < stats["n_staged"], stats
    finally:
        ctx.close()
        model.close()



def test_streamed_prefill_with_repacked_host_experts(models):
    """With llama.cpp's repacked CPU kernels for the host experts, single tokens still split
    (their host half on the repacked kernels) and a prompt streams through the pool, which
    copies from the file's plain layout. Rounding differs from the plain-kernel reference only."""
    path = models["qwen3moe", "q4_0"]
    packed = Model(path, repack="on")
    ctx = Context(packed, n_ctx=512, n_batch=N_BATCH, n_threads=2)
    try:
        tokens = prompt(300)
        reference = prefill(ctx, tokens)  # every expert on the host's repacked kernels
        with ExpertEngine(ctx.ptr, path, budget_ratio=0.25, stream_prefill=StreamPrefill.AHEAD) as engine:
            some_resident(engine, seed=7)
            engine.reset_stats()
            got = prefill(ctx, tokens)
            err = np.abs(got - reference).max() / np.abs(reference).max()
            print(f"largest difference {err:.2e} of the largest logit")
            assert err < 2e-2  # kernels that round differently, through a random model
            stats = engine.stats()
            assert stats["n_staged"] > 0 and stats["n_expert_tokens_cpu"] == 0
            ctx.decode([7])
            ctx.logits()
            assert engine.stats()["n_expert_tokens_cpu"] > 0  # the single token's host half
    finally:
        ctx.close()
        packed.close()

def check_streamed_prefill_on_rpc_device(device: str, tmp) -> None:
    path = make_random_model(tmp / "m.gguf", model_config("qwen3moe"), seed=1, dtype="f32", quant="q8_0")
    model = Model(path, repack="off")
    ctx = Context(model, n_ctx=1024, n_batch=N_BATCH, n_threads=1)
    try:
        tokens = prompt(700)
        reference = prefill(ctx, tokens)
        with ExpertEngine(ctx.ptr, path, device=device, budget_ratio=0.25, stream_prefill=StreamPrefill.AHEAD) as engine:
            resident = some_resident(engine, seed=5)
            engine.reset_stats()
            got = prefill(ctx, tokens)
            np.testing.assert_allclose(got, reference, rtol=1e-4, atol=1e-4 * np.abs(reference).max())
            stats = engine.stats()
            assert stats["n_staged"] == 2 * int((~resident).sum())  # 512 + 188 tokens: two streamed ubatches
            assert stats["n_expert_tokens_cpu"] == 0
    finally:
        ctx.close()
        model.close()


def test_streamed_prefill_on_rpc_device(tmp_path):
    run_in_own_process(__file__, tmp_path)


if __name__ == "__main__":
    rpc_main(check_streamed_prefill_on_rpc_device)


def test_a_model_read_without_mmap_gives_the_same_logits(models):
    """--no-mmap (llama.cpp's load mode none): the host weights are read into memory, which on a GPU
    is its pinned host buffer and the pool's copy source (patch 0017; the CPU device has no such
    buffer, so the pool reads its mapping of the file): the same logits as a mapped model's, for a
    streamed prefill and the split decode after it."""
    path = models["qwen3moe", "q4_0"]
    out = []
    for mmap in (True, False):
        model = Model(path, repack="off", mmap=mmap)
        ctx = Context(model, n_ctx=1024, n_batch=N_BATCH, n_threads=1)
        try:
            with ExpertEngine(ctx.ptr, path, device="CPU", budget_ratio=0.25, stream_prefill="ahead") as engine:
                some_resident(engine, seed=3)
                a = prefill(ctx, prompt(300))
                ctx.decode(prompt(3, seed=1), logits_all=True)
                out.append((a, ctx.logits().copy(), engine.stats()["n_staged"]))
        finally:
            ctx.close()
            model.close()
    (a0, b0, staged0), (a1, b1, staged1) = out
    assert staged0 > 0 and staged1 == staged0
    np.testing.assert_array_equal(a0, a1)
    np.testing.assert_array_equal(b0, b1)


@pytest.mark.parametrize("mode", ["ahead", "used"])
def test_a_pool_smaller_than_one_layer_streams_through_its_staging_slots(models, mode):
    """The staging slots, not the pool, hold a streamed layer's experts: a pool of fewer slots
    than one layer has experts (here 3 in all) still streams the whole prompt, bit-identically."""
    path = models["qwen3moe", "q4_0"]
    model = Model(path, repack="off")
    ctx = Context(model, n_ctx=1024, n_batch=N_BATCH, n_threads=2)
    try:
        reference = prefill(ctx, prompt(300))
        one_expert = model_sizes(path).one_expert
        with ExpertEngine(ctx.ptr, path, budget_bytes=3 * one_expert, stream_prefill=mode) as engine:
            n_expert = engine.n_expert
            assert 0 < engine.stats()["n_slots"] < n_expert
            engine.set_plan(Plan(np.ones((engine.n_moe_layers, n_expert), np.uint8),
                                 np.ones(engine.n_moe_layers, np.int32)))
            assert engine.wait_idle()
            engine.reset_stats()
            assert prefill(ctx, prompt(300)).tobytes() == reference.tobytes()
            stats = engine.stats()
            assert stats["n_staged"] > 0 and stats["n_expert_tokens_cpu"] == 0
    finally:
        ctx.close()
        model.close()
