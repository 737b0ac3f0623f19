"""Convert the checkpoints of scripts/train_tiny_moe.py to GGUF.

    python scripts/export_tiny_models.py --run runs/tiny --out runs/tiny/gguf

Writes, from <run>/target.pt, draft.pt and tokenizer.json:
    target-f32.gguf        qwen3moe, F32 (fidelity reference)
    target-f16.gguf        qwen3moe, F16 (shipped target)
    target-q4_0.gguf       quantized self-draft, through llama.cpp's quantizer
    draft-dense-f16.gguf   qwen3 dense draft, F16
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from gguf import MODEL_TENSOR, TENSOR_NAMES

from orchestrator.gguf_files.gguf_export import (
    ModelConfig,
    Tokenizer,
    quantize_gguf,
    write_gguf,
)

# PyTorch parameter name (train_tiny_moe.LM) -> GGUF tensor; "{i}" is the block index.
TORCH_TO_GGUF: dict[str, MODEL_TENSOR] = {
    "embed.weight": MODEL_TENSOR.TOKEN_EMBD,
    "norm.weight": MODEL_TENSOR.OUTPUT_NORM,
    "blocks.{i}.attn_norm.weight": MODEL_TENSOR.ATTN_NORM,
    "blocks.{i}.attn.wq.weight": MODEL_TENSOR.ATTN_Q,
    "blocks.{i}.attn.wk.weight": MODEL_TENSOR.ATTN_K,
    "blocks.{i}.attn.wv.weight": MODEL_TENSOR.ATTN_V,
    "blocks.{i}.attn.wo.weight": MODEL_TENSOR.ATTN_OUT,
    "blocks.{i}.attn.q_norm.weight": MODEL_TENSOR.ATTN_Q_NORM,
    "blocks.{i}.attn.k_norm.weight": MODEL_TENSOR.ATTN_K_NORM,
    "blocks.{i}.ffn_norm.weight": MODEL_TENSOR.FFN_NORM,
    "blocks.{i}.ffn.router.weight": MODEL_TENSOR.FFN_GATE_INP,
    "blocks.{i}.ffn.w_gate": MODEL_TENSOR.FFN_GATE_EXP,
    "blocks.{i}.ffn.w_up": MODEL_TENSOR.FFN_UP_EXP,
    "blocks.{i}.ffn.w_down": MODEL_TENSOR.FFN_DOWN_EXP,
    "blocks.{i}.ffn.gate.weight": MODEL_TENSOR.FFN_GATE,
    "blocks.{i}.ffn.up.weight": MODEL_TENSOR.FFN_UP,
    "blocks.{i}.ffn.down.weight": MODEL_TENSOR.FFN_DOWN,
}


def gguf_name(torch_name: str) -> str:
    parts = torch_name.split(".")
    if parts[0] == "blocks":
        i = int(parts[1])
        key = ".".join(["blocks", "{i}", *parts[2:]])
        t = TORCH_TO_GGUF.get(key)
        if t is None:
            raise KeyError(f"no GGUF tensor for checkpoint parameter {torch_name}")
        return TENSOR_NAMES[t].format(bid=i) + ".weight"
    t = TORCH_TO_GGUF.get(torch_name)
    if t is None:
        raise KeyError(f"no GGUF tensor for checkpoint parameter {torch_name}")
    return TENSOR_NAMES[t] + ".weight"


def load_checkpoint(path: Path) -> tuple[ModelConfig, dict[str, np.ndarray], dict]:
    """ModelConfig and GGUF-named float32 arrays of one checkpoint (tied embeddings)."""
    ck = torch.load(path, weights_only=True, map_location="cpu")
    c = ck["config"]
    cfg = ModelConfig(
        arch=c["arch"], n_vocab=c["n_vocab"], n_embd=c["n_embd"], n_layer=c["n_layer"], n_head=c["n_head"],
        n_head_kv=c["n_head_kv"], head_dim=c["head_dim"], n_ff=c.get("n_ff", 0),
        n_expert=c.get("n_expert", 0), n_expert_used=c.get("n_expert_used", 0), n_ff_exp=c.get("n_ff_exp", 0),
        rope_freq_base=c["rope_freq_base"], rms_norm_eps=c["rms_norm_eps"], tie_embeddings=True,
        n_ctx_train=4096, name=f"spac-tiny-{c['arch']}")
    tensors = {gguf_name(k): v.detach().float().numpy() for k, v in ck["model"].items()}
    return cfg, tensors, ck


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, default=Path("runs/tiny"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    out = args.out or args.run / "gguf"
    metrics = json.loads((args.run / "metrics.json").read_text()) if (args.run / "metrics.json").exists() else {}
    tok_json = (args.run / "tokenizer.json").read_text()
    for tag, name in (("target", "target"), ("draft", "draft-dense")):
        cfg, tensors, ck = load_checkpoint(args.run / f"{tag}.pt")
        tok = Tokenizer.from_hf_json(tok_json, n_vocab=cfg.n_vocab)
        tok.pre = ck.get("tokenizer_pre", "qwen2")  # checkpoints before the pre-tokenizer was a choice: qwen2
        meta = {"spac.corpus_fingerprint": ck.get("corpus_fingerprint", ""),
                "spac.training_command": metrics.get("command", "")}
        dtypes = ("f32", "f16") if tag == "target" else ("f32", "f16")
        for dt in dtypes:
            p = write_gguf(out / f"{name}-{dt}.gguf", cfg, tensors, tok, dtype=dt, metadata=meta)
            print(f"wrote {p} ({p.stat().st_size / 1e6:.1f} MB)")
        if tag == "target":
            p = quantize_gguf(out / "target-f32.gguf", out / "target-q4_0.gguf", "q4_0")
            print(f"wrote {p} ({p.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
