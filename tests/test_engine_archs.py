"""Split MoE execution on every architecture family the issue names.

Upstream's test-llama-archs writes a small random model of any architecture (its `-o DIR`
mode, through llama.cpp's own model saver); each MoE one is then run split and unsplit:
  olmoe, llama (Mixtral-style MoE), deepseek2 (shared experts, expert groups, MLA),
  gpt-oss (expert biases), qwen3moe, qwen2moe.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import LLAMA_CPP_TREE, compile_native, llama_common_dir
from engine_common import rpc_main, run_in_own_process
from orchestrator.runtime.llm import Context, Model
from orchestrator.runtime.native import ExpertEngine
from orchestrator.runtime.pool import StreamPrefill
from orchestrator.policies.plan import Plan

ARCHS = ["olmoe", "llama", "deepseek2", "gpt-oss", "qwen3moe", "qwen2moe"]


def build_arch_writer():
    """test-llama-archs, compiled against the installed libllama and the build's common lib."""
    bin_dir = llama_common_dir()
    if bin_dir is None:
        pytest.skip("llama.cpp's common library is not in vendor/build (run scripts/build_native.py)")
    src = LLAMA_CPP_TREE / "tests" / "test-llama-archs.cpp"
    extra = [f"-I{LLAMA_CPP_TREE / 'common'}", f"-I{LLAMA_CPP_TREE / 'src'}", f"-L{bin_dir}", "-lllama-common",
             f"-Wl,-rpath,{bin_dir}"]
    return compile_native([src], "test-llama-archs", cxx=True, libs=("llama", "ggml", "ggml-base", "ggml-cpu"),
                          extra=extra)


@pytest.fixture(scope="module")
def arch_models(tmp_path_factory):
    binary = build_arch_writer()
    out = tmp_path_factory.mktemp("archs")
    regex = "^(" + "|".join(a.replace("-", "\\-") for a in ARCHS) + ")$"
    res = subprocess.run([str(binary), "-a", regex, "-o", str(out)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_split_is_bit_identical_on(arch_models, arch):
    path = arch_models / f"{arch}-moe.gguf"
    assert path.exists(), sorted(p.name for p in arch_models.iterdir())
    model = Model(path, repack="off")
    ctx = Context(model, n_ctx=64, n_batch=16, n_threads=2)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]

    def run():
        ctx.clear()
        ctx.decode(tokens)
        out = [ctx.logits().copy()]
        for t in (7, 11):
            ctx.decode([t])
            out.append(ctx.logits().copy())
        return np.concatenate(out)

    try:
        reference = run()
        rng = np.random.default_rng(0)
        with ExpertEngine(ctx.ptr, path, budget_ratio=0.6) as engine:
            L, E = engine.n_moe_layers, engine.n_expert
            assert L >= 1 and E >= 2
            for _ in range(20):
                plan = Plan(rng.integers(0, 5, (L, E)).astype(np.uint8), rng.integers(1, 5, L).astype(np.int32))
                engine.set_plan(plan)
                assert engine.wait_idle()
                assert run().tobytes() == reference.tobytes()
            assert engine.stats()["n_expert_tokens_device"] > 0
    finally:
        ctx.close()
        model.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_streamed_prefill_is_bit_identical_on(arch_models, arch):
    """A 100-token prompt streamed through the pool (patch 0016) gives the all-host logits."""
    path = arch_models / f"{arch}-moe.gguf"
    model = Model(path, repack="off")
    ctx = Context(model, n_ctx=256, n_batch=128, n_threads=2)
    tokens = np.random.default_rng(1).integers(0, min(model.n_vocab, 200), 100)

    def prefill():
        ctx.clear()
        ctx.decode(tokens, logits_all=True)
        return ctx.logits().copy()

    try:
        reference = prefill()
        rng = np.random.default_rng(0)
        with ExpertEngine(ctx.ptr, path, budget_ratio=0.6, stream_prefill=StreamPrefill.AHEAD) as engine:
            L, E = engine.n_moe_layers, engine.n_expert
            for _ in range(3):
                engine.set_plan(Plan(rng.integers(0, 5, (L, E)).astype(np.uint8), rng.integers(1, 5, L).astype(np.int32)))
                assert engine.wait_idle()
                assert prefill().tobytes() == reference.tobytes()
            stats = engine.stats()
            assert stats["n_staged"] > 0 and stats["n_expert_tokens_cpu"] == 0
    finally:
        ctx.close()
        model.close()


def check_batched_copies(device: str, models: Path) -> None:
    """On the RPC device, every architecture: a plan's copies in batches of one layer's experts
    queued on the copy worker's own backend (patch 0024's default) leave the same experts resident
    as synchronous one-by-one copies (copy_batch_experts=1) and give the same logits bit for bit,
    decodes and a streamed prefill alike."""
    from engine_common import model_config
    from orchestrator.gguf_files.gguf_export import make_random_model

    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    batched_any = False
    # the archs' files have 1-2 MoE layers of few experts; a 4-layer, 16-expert one copies more at once
    files = {arch: models / f"{arch}-moe.gguf" for arch in ARCHS}
    files["qwen3moe-16x4"] = make_random_model(models / "qwen3moe-16x4.gguf", model_config("qwen3moe"), seed=2, quant="q8_0")
    for arch, path in files.items():
        model = Model(path, repack="off")
        ctx = Context(model, n_ctx=128, n_batch=64, n_threads=2)
        prompt = np.random.default_rng(1).integers(0, min(model.n_vocab, 200), 40)  # streamed: > 16 tokens
        try:
            runs = {}
            for batch in (1, 8):
                rng = np.random.default_rng(0)
                with ExpertEngine(ctx.ptr, path, device=device, budget_ratio=0.6, copy_batch_experts=batch,
                                  max_split_tokens=16, stream_prefill=StreamPrefill.AHEAD) as engine:
                    L, E = engine.n_moe_layers, engine.n_expert
                    out = []
                    for _ in range(4):
                        engine.set_plan(Plan(rng.integers(0, 5, (L, E)).astype(np.uint8), rng.integers(1, 5, L).astype(np.int32)))
                        assert engine.wait_idle(60)
                        ctx.clear()
                        ctx.decode(tokens)
                        out += [engine.residency().copy(), ctx.logits().copy()]
                        ctx.clear()
                        ctx.decode(prompt, logits_all=True)
                        out.append(ctx.logits().copy())
                    runs[batch] = out, engine.stats()
            (one, s1), (batched, s8) = runs[1], runs[8]
            assert all(a.tobytes() == b.tobytes() for a, b in zip(one, batched)), arch
            assert s1["n_copy_batches"] == s1["n_copies"] > 0, (arch, s1)
            assert 0 < s8["n_copy_batches"] <= s8["n_copies"] == s1["n_copies"], (arch, s8)
            assert s8["n_stage_batches"] > 0 and s8["n_staged"] == s1["n_staged"] > 0, (arch, s8)
            batched_any = batched_any or s8["n_copy_batches"] < s8["n_copies"]
        finally:
            ctx.close()
            model.close()
    assert batched_any  # some file's pool had room for several experts of a layer at once


def test_batched_copies_are_bit_identical_on_rpc(arch_models):
    run_in_own_process(__file__, arch_models)


if __name__ == "__main__":
    rpc_main(check_batched_copies)
