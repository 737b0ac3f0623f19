"""PyTorch checkpoint of scripts/train_tiny_moe.py -> GGUF: llama.cpp reproduces its logits."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
# scripts/ is on pytest's pythonpath (pyproject.toml)
from export_tiny_models import load_checkpoint  # noqa: E402
from train_tiny_moe import LM  # noqa: E402

from orchestrator.gguf_files.gguf_export import byte_level_bpe_tokenizer, write_gguf  # noqa: E402

needs_llama = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python not built")

TINY = dict(n_vocab=300, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, rope_freq_base=10000.0, rms_norm_eps=1e-6)


def tiny_checkpoint(tmp_path: Path, arch: str) -> Path:
    c = dict(TINY, arch=arch, n_layer=2)
    c.update(dict(n_expert=8, n_expert_used=2, n_ff_exp=32) if arch == "qwen3moe" else dict(n_ff=96))
    torch.manual_seed(0)
    m = LM(c)
    with torch.no_grad():  # bigger than the training init so that routing and norms matter
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    path = tmp_path / f"{arch}.pt"
    torch.save(dict(model=m.state_dict(), config=c, corpus_fingerprint="test"), path)
    return path


@needs_llama
@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3"])
def test_llama_logits_match_pytorch(tmp_path, arch):
    from orchestrator.shipped_models import load_llama

    ck = tiny_checkpoint(tmp_path, arch)
    cfg, tensors, raw = load_checkpoint(ck)
    path = write_gguf(tmp_path / "m.gguf", cfg, tensors, byte_level_bpe_tokenizer(cfg.n_vocab), dtype="f32")
    model = LM(raw["config"])
    model.load_state_dict(raw["model"])
    model.eval()
    toks = torch.randint(0, cfg.n_vocab, (48,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(toks[None])[0][0].double().numpy()
    llm = load_llama(path, n_ctx=64, f32_kv=True)
    llm.eval(toks.tolist())
    got = np.asarray(llm.scores[:48], dtype=np.float64)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-3
    assert (got.argmax(-1) == ref.argmax(-1)).mean() > 0.95


def test_mismatched_checkpoint_shapes(tmp_path):
    ck = tiny_checkpoint(tmp_path, "qwen3moe")
    raw = torch.load(ck, weights_only=True)
    raw["model"]["blocks.1.ffn.w_down"] = raw["model"]["blocks.1.ffn.w_down"][:, :, :16]
    raw["config"]["n_ff_exp"] = 32
    torch.save(raw, ck)
    cfg, tensors, _ = load_checkpoint(ck)
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_down_exps\.weight: shape \(8, 64, 16\), expected \(8, 64, 32\)"):
        write_gguf(tmp_path / "out.gguf", cfg, tensors, byte_level_bpe_tokenizer(cfg.n_vocab))
    assert not (tmp_path / "out.gguf").exists()
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".partial"]


def test_unknown_checkpoint_parameter(tmp_path):
    ck = tiny_checkpoint(tmp_path, "qwen3")
    raw = torch.load(ck, weights_only=True)
    raw["model"]["blocks.0.ffn.extra.weight"] = torch.zeros(3)
    torch.save(raw, ck)
    with pytest.raises(KeyError, match="blocks.0.ffn.extra.weight"):
        load_checkpoint(ck)
