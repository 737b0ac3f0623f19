"""Split MoE execution on every architecture family the issue names.

Upstream's test-llama-archs writes a small random model of any architecture (its `-o DIR`
mode, through llama.cpp's own model saver); each MoE one is then run split and unsplit:
  olmoe, llama (Mixtral-style MoE), deepseek2 (shared experts, expert groups, MLA),
  gpt-oss (expert biases), qwen3moe, qwen2moe.
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from conftest import LLAMA_CPP_TREE, ROOT, compile_native
from orchestrator.engine.llm import Context, Model
from orchestrator.engine.native import ExpertEngine
from orchestrator.engine.pool import StreamPrefill
from orchestrator.policies.plan import Plan

ARCHS = ["olmoe", "llama", "deepseek2", "gpt-oss", "qwen3moe", "qwen2moe"]


def build_arch_writer():
    """test-llama-archs, compiled against the installed libllama and the build's common lib."""
    common = sorted(ROOT.glob("vendor/build/*/bin/libllama-common.so.0"), key=lambda p: p.stat().st_mtime)
    if not common:
        pytest.skip("llama.cpp's common library is not in vendor/build (run scripts/build_native.py)")
    src = LLAMA_CPP_TREE / "tests" / "test-llama-archs.cpp"
    bin_dir = common[-1].parent
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
