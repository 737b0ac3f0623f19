"""The one known way speculative output may leave target-only output: a verify pass computes its
rows in a batch, and some kernels sum a batch in another order than a single token (llama.cpp's
repacked and tiled quantized matmuls, F32/F16 GEMM: ~1e-4 of a logit); a near-tie turns that
into another token. A lossless test accepts a difference only where it is proven to be that:
target-only's own token there changes when the tokens before it are computed in batches."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from orchestrator.engine.llm import Context, Model


def first_mismatch(got: list[list[int]], want: list[list[int]]) -> tuple[int, int] | None:
    for p, (g, w) in enumerate(zip(got, want)):
        for i, (a, b) in enumerate(zip(g, w)):
            if a != b:
                return p, i
        if len(g) != len(w):
            return p, min(len(g), len(w))
    return None


def margins_of(model_path: Path, prompt_tokens: list[int], tokens: list[int]) -> np.ndarray:
    """Target-only's top-1/top-2 margin at every generated position (one prefill, then single
    tokens, as the target-only loop decodes)."""
    model = Model(model_path, repack="off")
    ctx = Context(model, n_ctx=128, n_batch=64, n_threads=2)
    try:
        out = []
        ctx.decode(prompt_tokens, logits_all=False)
        for t in [None, *tokens[:-1]]:
            if t is not None:
                ctx.decode([t])
            row = np.sort(ctx.logits()[-1].astype(np.float64))
            out.append(row[-1] - row[-2])
        return np.array(out)
    finally:
        ctx.close()
        model.close()


def batch_dependent(model_path: Path, prompt_tokens: list[int], tokens: list[int], pos: int, max_batch: int = 9,
                    repack: str = "off") -> bool:
    """Whether target-only's own token at `pos` changes when the tokens before it are computed in
    batches of 2..max_batch rows at any alignment, as verify passes compute them: the known
    rounding gap between batched and single-token kernels, which a routing near-tie (a router's
    k-th and k+1-th expert almost equal, in any layer) turns into a different token. repack: the
    host layout the compared runs used."""
    if pos == 0:
        return False
    model = Model(model_path, repack=repack)
    ctx = Context(model, n_ctx=128, n_batch=64, n_threads=2)
    try:
        for nb in range(2, max_batch + 1):
            for off in range(nb):
                # batches of nb rows from `off` on, running past pos as a verify pass's drafts do
                # (rows only see earlier rows: what the later tokens are does not matter)
                ctx.clear()
                ctx.decode(prompt_tokens, logits_all=False)
                start = 0
                for size in [off, *[nb] * len(tokens)]:
                    chunk = tokens[start:start + size]
                    if not chunk:
                        continue
                    ctx.decode(chunk)
                    if start <= pos - 1 < start + len(chunk):
                        if int(ctx.logits()[pos - 1 - start].argmax()) != tokens[pos]:
                            return True
                        break
                    start += len(chunk)
        return False
    finally:
        ctx.close()
        model.close()


def assert_lossless(model_path: Path, prompt_tokens: list[int], got: list[int], want: list[int], repack: str = "off") -> None:
    """got (a speculative or cached run) equals want (target-only from scratch), or leaves it first
    where want's own token is proven batch-dependent; what follows that point is another text."""
    i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if i is None:
        assert got == want
    else:
        assert batch_dependent(model_path, prompt_tokens, want, i, repack=repack), \
            f"position {i}: {got[i]} instead of {want[i]}, and target-only's token there does not depend on batching"
