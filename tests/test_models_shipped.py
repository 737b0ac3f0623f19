"""The shipped default models: intact, small, loadable through llama-cpp-python, trained."""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest

from orchestrator.models import MODELS_DIR, default_model, load_llama, manifest, sha256_file

needs_llama = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python not built")

# Not from the training corpus (written for this test).
SNIPPET = b'''import os
import sys


def read_lines(path):
    """Return the lines of a text file without their newlines."""
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\\n") for line in f]


class Counter:
    def __init__(self):
        self.count = 0

    def increment(self, n=1):
        self.count += n
        return self.count
'''


@pytest.fixture(scope="module")
def man():
    return manifest()


def test_manifest_files_intact(man):
    assert {f["role"] for f in man["files"]} >= {"target", "draft-quantized", "draft-dense"}
    for f in man["files"]:
        path = MODELS_DIR / f["file"]
        assert path.stat().st_size == f["bytes"] <= 30 * 10**6
        assert sha256_file(path) == f["sha256"], f"{f['file']} does not match the manifest"
    assert default_model("draft").exists()
    assert man["training"]["target"]["held_out_ppl"] < man["training"]["unigram_held_out_ppl"] / 5


@needs_llama
@pytest.mark.parametrize("role", ["target", "draft-quantized", "draft-dense"])
def test_loads_and_generates_python(role):
    llm = load_llama(default_model(role), n_ctx=256)
    prompt = llm.tokenize(b"import os\n\n\ndef main():\n    ")
    llm.eval(prompt)
    out = []
    for _ in range(32):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    text = llm.detokenize(out).decode("utf-8", errors="replace")
    assert text.strip() and len(set(out)) > 3, text


@needs_llama
def test_target_is_trained():
    llm = load_llama(default_model("target"), n_ctx=256)
    toks = llm.tokenize(SNIPPET)
    llm.eval(toks)
    logits = np.asarray(llm.scores[: len(toks) - 1], dtype=np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -logp[np.arange(len(toks) - 1), toks[1:]].mean()
    assert math.exp(nll) < 80  # unigram perplexity is ~10^3


@needs_llama
def test_all_share_one_vocabulary():
    vocabs = []
    for f in manifest()["files"]:
        llm = load_llama(MODELS_DIR / f["file"], n_ctx=32)
        vocabs.append((llm.n_vocab(), llm.tokenize(SNIPPET)))
    assert all(v == vocabs[0] for v in vocabs)


@needs_llama
def test_default_draft_agrees_with_target():
    def argmax(path):
        llm = load_llama(path, n_ctx=256)
        toks = llm.tokenize(SNIPPET)
        llm.eval(toks)
        return np.asarray(llm.scores[: len(toks)]).argmax(-1)

    agree = (argmax(default_model("target")) == argmax(default_model("draft"))).mean()
    assert agree > 0.8, agree
