"""The GGUF files spac writes load and generate in stock llama.cpp, with no patch applied.

Stock = upstream's `llama-simple` built from the pinned sdist by `build_native.py --stock`
(a few minutes the first time, cached under vendor/build/). Its greedy text must equal the
patched build's (llama-cpp-python with spac's patches, engine off), byte for byte.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from build_native import stock_program
from orchestrator.gguf_files.gguf_export import byte_level_bpe_tokenizer, read_config, write_gguf
from orchestrator.gguf_files.synthetic_models import PRESETS, synthetic_tensors
from orchestrator.shipped_models import MODELS_DIR, load_llama

ROOT = Path(__file__).resolve().parents[1]

PROMPT = "def fibonacci(n):"
N_PREDICT = 16
SHIPPED = sorted(p.name for p in MODELS_DIR.glob("*.gguf"))


@pytest.fixture(scope="module")
def llama_simple() -> Path:
    return stock_program("llama-simple")


def stock_text(exe: Path, model: Path) -> bytes:
    res = subprocess.run([str(exe), "-m", str(model), "-n", str(N_PREDICT), PROMPT], capture_output=True, timeout=300)
    assert res.returncode == 0, res.stderr.decode(errors="replace")[-3000:]
    return res.stdout.rstrip(b"\n")  # the prompt's pieces, then the generated ones


def patched_text(model: Path) -> bytes:
    # llama-simple leaves flash attention on "auto", which the CPU backend takes; llama-cpp-python
    # defaults to off. The two round differently: the stop-34 shipped models happened to give the
    # same 16 greedy tokens either way, the retrained Q4_0 self-draft does not.
    llm = load_llama(model, n_ctx=64, flash_attn=True)
    out = llm.create_completion(PROMPT, max_tokens=N_PREDICT, temperature=0.0)["choices"][0]["text"]
    llm.close()
    return (PROMPT + out).encode()


def test_shipped_models_generate_the_same_text_in_stock_llama(llama_simple):
    assert len(SHIPPED) == 3
    for name in SHIPPED:
        assert stock_text(llama_simple, MODELS_DIR / name) == patched_text(MODELS_DIR / name), name


def test_self_draft_tools_write_files_stock_llama_loads(llama_simple, tmp_path):
    target = MODELS_DIR / "spac-tiny-moe-f16.gguf"
    cfg = read_config(target)
    profile = tmp_path / "usage.npy"
    np.save(profile, np.random.default_rng(0).integers(0, 100, (cfg.n_layer, cfg.n_expert)))
    drafts = {
        "quantized": (tmp_path / "draft-q8_0.gguf", ["--type", "q8_0"]),
        "hot-experts": (tmp_path / "draft-hot8.gguf", ["--profile", str(profile), "--keep", "8"]),
    }
    for tool, (out, opts) in drafts.items():
        res = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_draft.py"), tool, str(target), str(out), *opts],
                             capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        assert read_config(out).n_expert == (8 if tool == "hot-experts" else cfg.n_expert)
        assert stock_text(llama_simple, out) == patched_text(out), tool


def test_synthetic_olmoe_layer_loads_in_stock_llama(llama_simple, tmp_path):
    cfg = replace(PRESETS["olmoe-1b-7b"], n_layer=1, n_vocab=512)
    path = tmp_path / "olmoe-1l-q4_0.gguf"
    write_gguf(path, cfg, synthetic_tensors(cfg, seed=0), byte_level_bpe_tokenizer(cfg.n_vocab), dtype="q4_0")
    assert stock_text(llama_simple, path).startswith(PROMPT.encode())
