"""Draft-making tools (quantized and hot-expert self-drafts) and synthetic scale models."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest

from orchestrator.gguf_files.gguf_export import (
    byte_level_bpe_tokenizer,
    make_random_model,
    read_config,
    tensor_shapes,
    tiny_config,
    write_gguf,
)
from orchestrator.gguf_files.hot_experts import hot_experts, slice_experts
from orchestrator.gguf_files.synthetic_models import PRESETS, synthetic_tensors

ROOT = Path(__file__).resolve().parents[1]

needs_llama = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python not built")
TEXT = b"def forward(self, x):\n    return self.down(x)"


def logits(path: Path) -> np.ndarray:
    from orchestrator.shipped_models import load_llama

    llm = load_llama(path, n_ctx=64)
    toks = llm.tokenize(TEXT)
    llm.eval(toks)
    return np.asarray(llm.scores[: len(toks)]).copy()


def tensor(path: Path, name: str) -> np.ndarray:
    return next(t for t in gguf.GGUFReader(path).tensors if t.name == name).data


def test_hot_experts_picks_most_used():
    prof = np.array([[5, 1, 9, 9, 0], [0, 0, 0, 1, 2]])
    assert hot_experts(prof, 2) == [[2, 3], [3, 4]]
    with pytest.raises(ValueError, match="n_keep"):
        hot_experts(prof, 6)
    with pytest.raises(ValueError, match="n_layer, n_expert"):
        hot_experts(prof[0], 2)


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "olmoe"])
@pytest.mark.parametrize("dtype", ["f32", "q8_0"])
def test_slice_keeps_router_rows_and_expert_blocks(tmp_path, arch, dtype):
    src = make_random_model(tmp_path / "m.gguf", arch, dtype=dtype)
    keep = [[1, 4, 6], [0, 2, 7]]
    dst = slice_experts(src, tmp_path / "hot.gguf", keep)
    cfg = read_config(dst)
    assert (cfg.n_expert, cfg.n_expert_used) == (3, 2)
    for i, ids in enumerate(keep):
        for t in ("ffn_gate_inp", "ffn_up_exps", "ffn_down_exps"):
            name = f"blk.{i}.{t}.weight"
            np.testing.assert_array_equal(tensor(dst, name), tensor(src, name)[ids])
    assert tensor_shapes(cfg).keys() == {t.name for t in gguf.GGUFReader(dst).tensors}


@needs_llama
@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
def test_keep_all_experts_is_bit_identical(tmp_path, arch):
    src = make_random_model(tmp_path / "m.gguf", arch)
    dst = slice_experts(src, tmp_path / "all.gguf", [list(range(8))] * 2)
    np.testing.assert_array_equal(logits(src), logits(dst))
    hot = slice_experts(src, tmp_path / "hot.gguf", [[0, 1, 2, 3]] * 2)
    assert np.isfinite(logits(hot)).all()


def test_slice_bad_input(tmp_path):
    dense = make_random_model(tmp_path / "dense.gguf", "qwen3")
    with pytest.raises(ValueError, match="not a MoE model"):
        slice_experts(dense, tmp_path / "x.gguf", [[0]] * 2)
    moe = make_random_model(tmp_path / "moe.gguf", "qwen3moe")
    with pytest.raises(ValueError, match="same number"):
        slice_experts(moe, tmp_path / "x.gguf", [[0, 1], [0]])
    with pytest.raises(ValueError, match="distinct"):
        slice_experts(moe, tmp_path / "x.gguf", [[0, 8], [0, 1]])
    assert not (tmp_path / "x.gguf").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


@pytest.mark.parametrize("entry", ["script", "spac draft"])
def test_make_draft_script(tmp_path, entry):
    src = make_random_model(tmp_path / "m.gguf", "qwen3moe", dtype="q8_0")
    prof = tmp_path / "p.npz"
    np.savez(prof, selected=np.random.default_rng(0).integers(0, 8, (100, 2, 2)))
    script = ([sys.executable, str(ROOT / "scripts" / "make_draft.py")] if entry == "script"
              else [sys.executable, "-m", "orchestrator.cli", "draft"])
    subprocess.run([*script, "hot-experts", str(src), str(tmp_path / "h.gguf"), "--profile", str(prof),
                    "--keep", "4"], check=True, capture_output=True)
    assert read_config(tmp_path / "h.gguf").n_expert == 4
    np.save(tmp_path / "bad.npy", np.ones((3, 8)))
    bad = subprocess.run([*script, "hot-experts", str(src), str(tmp_path / "b.gguf"), "--profile",
                          str(tmp_path / "bad.npy"), "--keep", "4"], capture_output=True, text=True)
    assert bad.returncode == 2 and "profile shape" in bad.stderr
    bad = subprocess.run([*script, "quantized", str(src), str(tmp_path / "b.gguf"), "--type", "q3_zz"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown quant type" in bad.stderr
    assert not (tmp_path / "b.gguf").exists()


def test_presets_have_the_real_sizes():
    def n_params(cfg):
        return sum(int(np.prod(s)) for s in tensor_shapes(cfg).values())

    assert 6.8e9 < n_params(PRESETS["olmoe-1b-7b"]) < 7.0e9
    assert 30.0e9 < n_params(PRESETS["qwen3-30b-a3b"]) < 31.0e9
    # the hybrid: the simulator's profile of the same model (which leaves out norms and biases)
    from orchestrator.sim.profiles import model

    hybrid = PRESETS["qwen3.6-35b-a3b"]
    assert n_params(hybrid) == pytest.approx(model("qwen3.6-35b-a3b").params, rel=1e-4)
    assert [hybrid.is_recurrent(i) for i in range(8)] == [True, True, True, False] * 2
    shapes = tensor_shapes(hybrid)
    assert shapes["blk.0.attn_qkv.weight"] == (8192, 2048) and shapes["blk.0.ssm_conv1d.weight"] == (8192, 4)
    assert shapes["blk.3.attn_q.weight"] == (2 * 16 * 256, 2048) and shapes["blk.3.attn_k.weight"] == (512, 2048)
    assert shapes["blk.0.ffn_down_exps.weight"] == (256, 2048, 512) and "blk.0.attn_q.weight" not in shapes


@needs_llama
def test_synthetic_q4_0_loads_and_generates(tmp_path):
    cfg = replace(tiny_config("olmoe"), n_embd=128, head_dim=32, n_ff=64, n_ff_exp=64)
    path = write_gguf(tmp_path / "s.gguf", cfg, synthetic_tensors(cfg, seed=0),
                      byte_level_bpe_tokenizer(cfg.n_vocab), dtype="q4_0")
    assert {t.tensor_type for t in gguf.GGUFReader(path).tensors if len(t.shape) > 1} == {
        gguf.GGMLQuantizationType.Q4_0}
    assert np.isfinite(logits(path)).all()



def small_hybrid(**kw):
    """The qwen3.6-35b-a3b preset on a small shape (4 layers: three delta nets, one full attention)."""
    return replace(PRESETS["qwen3.6-35b-a3b"], n_vocab=512, n_embd=128, n_layer=4, n_head=2, n_head_kv=1,
                   head_dim=64, n_expert=8, n_expert_used=2, n_ff_exp=64, n_ff_shexp=64, linear_k_heads=2,
                   linear_v_heads=4, linear_head_dim=32, rope_dim=16, **kw)

@needs_llama
def test_synthetic_hybrid_loads_and_generates(tmp_path):
    """The qwen35moe preset's writer on a small shape: Q4_0 weights, the conv kernel and the one-row
    shared-expert gate F32, the decay rates negative; llama.cpp decodes it to finite logits."""
    cfg = small_hybrid()
    path = write_gguf(tmp_path / "h.gguf", cfg, synthetic_tensors(cfg, seed=0, zero_mean=True),
                      byte_level_bpe_tokenizer(cfg.n_vocab), dtype="q4_0")
    r = gguf.GGUFReader(path)
    f32 = {t.name for t in r.tensors if len(t.shape) > 1 and t.tensor_type == gguf.GGMLQuantizationType.F32}
    assert f32 == {f"blk.{i}.ffn_gate_inp_shexp.weight" for i in range(4)} | {
        f"blk.{i}.ssm_conv1d.weight" for i in range(3)}
    assert (np.asarray(next(t for t in r.tensors if t.name == "blk.0.ssm_a").data) < 0).all()
    assert np.isfinite(logits(path)).all()


@needs_llama
def test_synthetic_hybrid_with_mtp_layer_drafts(tmp_path):
    """The preset with --mtp-layers 1 on a small shape: block n_layer is a full-attention MoE
    block with the nextn tensors llama.cpp's qwen35moe MTP loader reads, nextn_predict_layers = 1;
    `--draft mtp` loads it and drafts, its greedy text target-only's."""
    from orchestrator.decoding.mtp_draft import MTP_DRAFT, MtpDraft
    from orchestrator.decoding.sampling import SamplingParams
    from orchestrator.decoding.speculative import Session, SessionConfig

    cfg = small_hybrid(n_mtp=1)
    shapes = tensor_shapes(cfg)
    assert shapes["blk.4.nextn.eh_proj.weight"] == (128, 256) and shapes["blk.4.attn_q.weight"] == (256, 128)
    assert "blk.4.ssm_a" not in shapes and "blk.4.ffn_down_exps.weight" in shapes
    with pytest.raises(ValueError, match="n_mtp"):
        tiny_config("qwen3moe", n_mtp=1)
    path = write_gguf(tmp_path / "h.gguf", cfg, synthetic_tensors(cfg, seed=0, zero_mean=True),
                      byte_level_bpe_tokenizer(cfg.n_vocab), dtype="q4_0")
    assert (read_config(path).n_layer, read_config(path).n_mtp) == (4, 1)
    base = dict(model=path, n_ctx=256, n_threads=2, repack="off", expert_engine=False)
    prompt = "def forward(self, x):"

    def run(**kw):
        with Session(SessionConfig(**base, **kw)) as s:
            toks = s.complete(prompt, 16, (), SamplingParams(temperature=0.0)).tokens
            return toks, s.tokenize(prompt), isinstance(s.draft_ctx, MtpDraft), s.last_metrics.n_drafted

    want, _, _, _ = run()
    got, _, mtp, drafted = run(draft=MTP_DRAFT, gamma=3, adaptive_gamma=False)
    assert mtp and drafted > 0
    assert got == want
