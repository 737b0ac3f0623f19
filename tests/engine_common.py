"""Helpers shared by the engine tests: a small MoE shape and a fixed decode sequence."""

from __future__ import annotations

import numpy as np

from orchestrator.gguf_export import tiny_config
from orchestrator.llm import Context

PROMPT = [5, 17, 42, 99, 7, 250, 31, 64]   # one 8-token ubatch (split), then single tokens
NEXT = [12, 200, 3]


def model_config(arch: str):
    # dims every tested quant type can hold (rows of 32); 4 layers, 16 experts top-4
    return tiny_config(arch, n_layer=4, n_embd=64, n_expert=16, n_expert_used=4, n_ff_exp=64,
                       **({"n_ff_shexp": 64} if arch == "qwen2moe" else {}))


def run_sequence(ctx: Context) -> np.ndarray:
    """Logits of the prompt (all 8 positions) and of 3 single-token decodes."""
    ctx.clear()
    ctx.decode(PROMPT)
    out = [ctx.logits().copy()]
    for t in NEXT:
        ctx.decode([t])
        out.append(ctx.logits().copy())
    return np.concatenate(out)
