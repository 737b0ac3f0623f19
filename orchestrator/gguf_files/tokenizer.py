"""The tokenizer a GGUF carries (`tokenizer.ggml.*`): a byte-level BPE vocabulary, read from a
`tokenizers` tokenizer.json (`Tokenizer.from_hf_json`, for the trained tiny models) or learnt
deterministically from a few lines of text (`byte_level_bpe_tokenizer`, for random test models).
`gguf_export.write_gguf` writes it."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass

from gguf import TokenType

@dataclass
class Tokenizer:
    """A byte-level BPE vocabulary as llama.cpp reads it (`tokenizer.ggml.*`)."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]  # "a b"
    eos_id: int
    bos_id: int | None = None
    pad_id: int | None = None
    pre: str = "qwen2"
    add_bos: bool = False
    chat_template: str | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_hf_json(cls, text: str, eos: str = "<|endoftext|>", n_vocab: int | None = None) -> Tokenizer:
        """From a `tokenizers` tokenizer.json (BPE model, byte-level); pads to `n_vocab` with
        unused tokens when the model's embedding has more rows than the tokenizer has tokens."""
        j = json.loads(text)
        model = j["model"]
        if model.get("type") != "BPE":
            raise ValueError(f"expected a BPE tokenizer, got {model.get('type')}")
        vocab: dict[str, int] = dict(model["vocab"])
        special = set()
        for t in j.get("added_tokens", []):
            vocab[t["content"]] = t["id"]
            if t.get("special"):
                special.add(t["content"])
        size = max(vocab.values()) + 1
        if sorted(vocab.values()) != list(range(size)):
            raise ValueError("tokenizer ids are not contiguous")
        tokens = [""] * size
        for tok, i in vocab.items():
            tokens[i] = tok
        types = [int(TokenType.CONTROL if t in special else TokenType.NORMAL) for t in tokens]
        merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
        _pad_vocab(tokens, types, n_vocab)
        return cls(tokens=tokens, token_types=types, merges=merges, eos_id=vocab[eos], bos_id=vocab[eos])


def _pad_vocab(tokens: list[str], types: list[int], n_vocab: int | None) -> None:
    if n_vocab is None:
        return
    if n_vocab < len(tokens):
        raise ValueError(f"n_vocab {n_vocab} is smaller than the tokenizer ({len(tokens)} tokens)")
    for i in range(len(tokens), n_vocab):
        tokens.append(f"<|unused_{i}|>")
        types.append(int(TokenType.UNUSED))


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Text the random-model tokenizer learns its merges from (any text would do).
_BPE_SEED_TEXT = '''
def forward(self, x, mask=None):
    """Return the output of the layer for the input x."""
    for i in range(len(self.layers)):
        x = self.layers[i](x) + x
    if mask is not None:
        return x * mask
    return x

class Expert:
    def __init__(self, n_embd, n_ff):
        self.gate = Linear(n_embd, n_ff)
        self.up = Linear(n_embd, n_ff)
        self.down = Linear(n_ff, n_embd)

    def __call__(self, x):
        return self.down(silu(self.gate(x)) * self.up(x))
The quick brown fox jumps over the lazy dog. Experts are selected by the router, and the
selected experts are computed on the device or on the host, then their outputs are summed.
'''
_PRETOKENIZE = re.compile(r"'(?:s|t|re|ve|m|ll|d)| ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")


def byte_level_bpe_tokenizer(n_vocab: int = 320, text: str = _BPE_SEED_TEXT) -> Tokenizer:
    """A small deterministic byte-level BPE tokenizer of exactly `n_vocab` tokens: the 256
    bytes, merges learnt from `text`, the special tokens, then unused padding if needed."""
    n_merges = n_vocab - 256 - len(SPECIAL_TOKENS)
    if n_merges < 0:
        raise ValueError(f"n_vocab must be >= {256 + len(SPECIAL_TOKENS)}, got {n_vocab}")
    b2u = bytes_to_unicode()
    words = Counter(tuple(b2u[b] for b in w.encode()) for w in _PRETOKENIZE.findall(text))
    tokens = [b2u[b] for b in range(256)]
    known, merges = set(tokens), []
    while len(merges) < n_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for w, c in words.items():
            for p in zip(w, w[1:]):
                pairs[p] += c
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]
        merged = best[0] + best[1]
        merges.append(f"{best[0]} {best[1]}")
        if merged not in known:
            known.add(merged)
            tokens.append(merged)
        words = Counter({_merge_word(w, best, merged): c for w, c in words.items()})
    types = [int(TokenType.NORMAL)] * len(tokens)
    eos = len(tokens)
    tokens += SPECIAL_TOKENS
    types += [int(TokenType.CONTROL)] * len(SPECIAL_TOKENS)
    _pad_vocab(tokens, types, n_vocab)
    return Tokenizer(tokens=tokens, token_types=types, merges=merges, eos_id=eos, bos_id=eos)


def _merge_word(word: tuple[str, ...], pair: tuple[str, str], merged: str) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(merged)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)
