"""GGUF writer: metadata and tensors llama.cpp needs, bad input, atomic writes."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from orchestrator.gguf_files.gguf_export import (
    ARCHES,
    byte_level_bpe_tokenizer,
    make_random_model,
    quantize_gguf,
    random_weights,
    read_config,
    tensor_shapes,
    tiny_config,
    write_gguf,
)

HAVE_LLAMA = importlib.util.find_spec("llama_cpp") is not None
needs_llama = pytest.mark.skipif(not HAVE_LLAMA, reason="llama-cpp-python not built yet")


def no_partials(d: Path) -> bool:
    return not [p for p in d.iterdir() if p.name.endswith(".partial")]


@pytest.mark.parametrize("arch", sorted(ARCHES))
@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0"])
def test_random_model_roundtrip(tmp_path, arch, dtype):
    cfg = tiny_config(arch)
    path = make_random_model(tmp_path / "m.gguf", cfg, seed=3, dtype=dtype)
    r = gguf.GGUFReader(path)
    assert read_config(path) == cfg
    keys = set(r.fields)
    for key in (gguf.Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, gguf.Keys.Attention.LAYERNORM_RMS_EPS):
        if key == gguf.Keys.LLM.EXPERT_FEED_FORWARD_LENGTH and not cfg.is_moe:
            continue
        assert key.format(arch=arch) in keys
    assert r.get_field(gguf.Keys.Tokenizer.PRE).contents() == "qwen2"
    merges = r.get_field(gguf.Keys.Tokenizer.MERGES).contents()
    assert all(len(m.split(" ")) == 2 for m in merges)
    shapes = tensor_shapes(cfg)
    assert {t.name for t in r.tensors} == set(shapes)
    for t in r.tensors:  # ggml shapes are numpy's reversed
        assert tuple(int(x) for x in t.shape) == tuple(reversed(shapes[t.name]))
    if dtype == "f32":
        w = random_weights(cfg, seed=3)
        for t in r.tensors:
            np.testing.assert_array_equal(np.asarray(t.data).reshape(shapes[t.name]), w[t.name])
    assert no_partials(tmp_path)


def test_qwen2moe_has_shared_expert_and_gate():
    names = tensor_shapes(tiny_config("qwen2moe"))
    assert names["blk.0.ffn_gate_inp_shexp.weight"] == (64,)
    assert names["blk.1.ffn_down_shexp.weight"] == (64, 64)


def test_seeded_and_distinct():
    cfg = tiny_config("qwen3moe")
    a, b, c = random_weights(cfg, 0), random_weights(cfg, 0), random_weights(cfg, 1)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["blk.0.ffn_gate_inp.weight"], c["blk.0.ffn_gate_inp.weight"])


def test_tokenizer_is_exact_size_and_unique():
    for n in (259, 300, 512, 2000):
        tok = byte_level_bpe_tokenizer(n)
        assert len(tok) == n and len(set(tok.tokens)) == n
    with pytest.raises(ValueError, match="n_vocab"):
        byte_level_bpe_tokenizer(100)


def test_mismatched_shapes_clear_error_and_no_file(tmp_path):
    cfg = tiny_config("qwen3moe")
    w = random_weights(cfg)
    w["blk.1.ffn_up_exps.weight"] = w["blk.1.ffn_up_exps.weight"][:, :16]
    del w["output_norm.weight"]
    with pytest.raises(ValueError) as e:
        write_gguf(tmp_path / "bad.gguf", cfg, w, byte_level_bpe_tokenizer(cfg.n_vocab))
    assert "blk.1.ffn_up_exps.weight" in str(e.value) and "missing tensor output_norm.weight" in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_dense_weights_for_moe_writer(tmp_path):
    dense = tiny_config("qwen3")
    with pytest.raises(ValueError, match="unexpected tensor blk.0.ffn_gate.weight"):
        write_gguf(tmp_path / "x.gguf", tiny_config("qwen3moe"), random_weights(dense),
                   byte_level_bpe_tokenizer(dense.n_vocab))
    with pytest.raises(ValueError, match="n_expert > 0"):
        tiny_config("qwen3moe", n_expert=0)
    with pytest.raises(ValueError, match="dense"):
        tiny_config("qwen3", n_expert=8)
    assert list(tmp_path.iterdir()) == []


def test_failure_mid_write_leaves_nothing(tmp_path):
    cfg = tiny_config("qwen3moe")
    w: dict = dict(random_weights(cfg))
    w["output.weight"] = lambda: np.full((cfg.n_vocab, cfg.n_embd), np.nan, np.float32)
    with pytest.raises(ValueError, match="NaN"):
        write_gguf(tmp_path / "x.gguf", cfg, w, byte_level_bpe_tokenizer(cfg.n_vocab))
    assert list(tmp_path.iterdir()) == []


def test_unknown_types(tmp_path):
    cfg = tiny_config("qwen3")
    with pytest.raises(ValueError, match="unknown dtype"):
        make_random_model(tmp_path / "x.gguf", cfg, dtype="q3_zz")
    with pytest.raises(ValueError, match="unknown quant type"):
        make_random_model(tmp_path / "x.gguf", cfg, quant="q3_zz")
    with pytest.raises(ValueError, match="unknown arch"):
        tiny_config("llama9")
    assert list(tmp_path.iterdir()) == []


def test_script(tmp_path):
    out = tmp_path / "s.gguf"
    script = Path(__file__).resolve().parents[1] / "scripts" / "make_random_moe.py"
    subprocess.run([sys.executable, str(script), str(out), "--arch", "qwen2moe", "--n-layer", "3"], check=True)
    assert read_config(out).n_layer == 3
    bad = subprocess.run([sys.executable, str(script), str(tmp_path / "b.gguf"), "--n-expert-used", "99"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "n_expert_used" in bad.stderr


@needs_llama
@pytest.mark.parametrize("arch", sorted(ARCHES))
def test_llama_cpp_loads_and_quantizes(tmp_path, arch):
    from orchestrator.shipped_models import load_llama

    src = make_random_model(tmp_path / "m.gguf", arch, seed=0)
    q = quantize_gguf(src, tmp_path / "m-q4_0.gguf", "q4_0")
    assert q.stat().st_size < src.stat().st_size
    for p in (src, q):
        llm = load_llama(p, n_ctx=64)
        toks = llm.tokenize(b"def forward(self, x):\n    return x")
        assert llm.detokenize(toks) == b"def forward(self, x):\n    return x"
        llm.eval(toks)
        assert np.all(np.isfinite(np.asarray(llm.scores[: len(toks)])))
        del llm
    assert no_partials(tmp_path)
