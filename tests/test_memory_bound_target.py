"""scripts/make_memory_bound_target.py: the widened target writes the tiny target's text.

The scaled-down preset (8 blocks, 8 heads, experts of ff 128) is built in a few seconds; its
logits must be bit-identical to the shipped target's, for a prompt batch and for a verify-sized
batch, and its greedy text equal."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from orchestrator.decoding.speculative import Session, SessionConfig
from orchestrator.runtime.llm import Context, Model
from orchestrator.gguf_files.gguf_export import read_config
from orchestrator.shipped_models import MODELS_DIR

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import make_memory_bound_target as mb  # noqa: E402

TINY = MODELS_DIR / "spac-tiny-moe-f16.gguf"
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\nclass Stack:\n    def __init__(self):",
           "    for key, value in sorted(items.items()):\n"]


@pytest.fixture(scope="module")
def padded(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mb") / "small.gguf"
    assert mb.main([str(out), "--preset", "small"]) == 0
    return out


def test_shape_and_bytes_grow(padded):
    src, cfg = read_config(TINY), read_config(padded)
    small = mb.PRESETS["small"]
    assert (cfg.n_layer, cfg.n_head, cfg.n_ff_exp) == (small["n_layer"], small["n_head"], small["n_ff_exp"])
    assert cfg.n_head // cfg.n_head_kv == src.n_head // src.n_head_kv
    assert (cfg.n_expert, cfg.n_expert_used, cfg.n_embd, cfg.n_vocab) == (src.n_expert, src.n_expert_used,
                                                                          src.n_embd, src.n_vocab)
    assert mb.bytes_per_token(padded)["bytes_per_token"] > 2 * mb.bytes_per_token(TINY)["bytes_per_token"]
    assert mb.real_positions(6, 8) == [0, 1, 2, 4, 5, 6]


def logits(path: Path, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    m = Model(path, verbose=False)
    c = Context(m, n_ctx=256, n_batch=64, n_threads=2)
    try:
        c.decode(tokens[:-9], logits_all=False)
        c.decode(tokens[-9:], logits_all=True)  # a verify pass of γ = 8
        batch = c.logits().copy()
        c.decode([int(batch[-1].argmax())], logits_all=True)
        return batch, c.logits().copy()
    finally:
        c.close()
        m.close()


def test_logits_are_bit_identical(padded):
    m = Model(TINY, verbose=False)
    tokens = m.tokenize(PROMPTS[1], add_special=True)
    m.close()
    for a, b in zip(logits(TINY, tokens), logits(padded, tokens)):
        assert np.array_equal(a, b)


def test_greedy_text_equals_the_tiny_target(padded):
    texts = []
    for path in (TINY, padded):
        with Session(SessionConfig(model=path, n_ctx=256, n_threads=2, expert_engine=False)) as s:
            texts.append([s.complete(p, max_tokens=32).text for p in PROMPTS])
    assert texts[0] == texts[1]


def test_never_overwrites(padded, capsys):
    before = padded.stat().st_mtime_ns
    assert mb.main([str(padded), "--preset", "small"]) == 1
    assert "exists" in capsys.readouterr().err
    assert padded.stat().st_mtime_ns == before
    with pytest.raises(ValueError):
        mb.pad_target(TINY, padded.with_name("bad.gguf"), n_layer=8, n_head=5, n_ff_exp=128)
