#!/usr/bin/env python3
"""Real files (issue 26): tiny random MoE models made the way a user's GGUF is made.

    python scripts/make_real_files.py                 # every architecture, into runs/real-files/<key>/
    python scripts/make_real_files.py --arch olmoe --out /tmp/rf

For each architecture in ARCHS: a random HuggingFace model of transformers' own class (seeded),
with one byte-level BPE tokenizer trained by `tokenizers` on CORPUS below and a real chat
template in its tokenizer_config.json (the pinned llama.cpp tree's copy of Qwen3's template;
gpt-oss: its harmony template); then
    convert_hf_to_gguf.py of the pinned tree, run where the build extracted it  →  F32, F16 (BF16)
    stock llama-quantize (scripts/build_native.py --stock)  →  Q8_0, Q4_K_M, and a Q4_0 self-draft
    (some families also IQ4_XS, Q3_K_M, Q2_K or MXFP4_MOE: MORE_TYPES_OF)
    transformers' greedy tokens of PROMPTS on the float32 model, with the top-1/top-2 margin of
    every position  →  reference.json
Everything lands in OUT/<key>/<arch>/ (key: a hash of this script and the lock file);
manifest.json, written last, names the versions that made them, and a directory that has it is
reused as it is (`cached`: no torch needed to use the files, e.g. CI's Python 3.10 run).

The converter knows a BPE pre-tokenizer by the hash of a tokenization of its own test text,
which a freshly trained tokenizer cannot match: the conversion runs the converter's own
`main()` with `get_vocab_base_pre` answering "gpt-2" (GPT-2's split regex, which is the one
`tokenizers`' ByteLevel pre-tokenizer applies). Nothing of the converter is copied here.

Needs torch, transformers and tokenizers (the `test` extra). ~1 minute on 2 cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from build_native import stock_program

ROOT = Path(__file__).resolve().parent.parent
LLAMA_CPP_TREE = ROOT / "vendor" / "llama-cpp-python" / "vendor" / "llama.cpp"
DEFAULT_OUT = ROOT / "runs" / "real-files"

# the GGUF file types made of every model (the converter's F32/F16, llama-quantize's others)
TYPES = ["f32", "f16", "q8_0", "q4_k_m"]
# the families added last (issue 40) are made in two (CI's time): F32, held against transformers,
# and Q4_K_M, K-quant experts; the F16 and Q8_0 kernels are the ones the other families run
TYPES_OF = {a: ["f32", "q4_k_m"] for a in ("glm4moe", "llama4", "minimax-m2", "ernie4_5-moe")}
# DeepSeek-V3 in Q8_0 too: its 3-D attn_k_b/attn_v_b (MUL_MAT batched over heads) are Q8_0 there, a
# type every repacked layout takes as a matrix but not batched (the default layout once placed them)
TYPES_OF["deepseek3"] = ["f32", "q8_0", "q4_k_m"]
# the types big MoEs ship in that CPU_EXACT took last (issue 52), each on the families that ship in
# it: Qwen3's BF16, IQ4_XS, Q3_K_M and Q2_K files, gpt-oss's MXFP4 experts, a hybrid's IQ4_XS
MORE_TYPES_OF = {"qwen3moe": ["bf16", "iq4_xs", "q3_k_m", "q2_k"], "gpt-oss": ["mxfp4_moe"], "qwen35moe": ["iq4_xs"]}
CONVERTED = ("f32", "f16", "bf16")  # the converter's outtypes; the others are llama-quantize's, from F32


def types_of(arch: str) -> list[str]:
    """The file types made of `arch` (and held to every path by tests/real_files), the draft's aside."""
    return [*TYPES_OF.get(arch, TYPES), *MORE_TYPES_OF.get(arch, [])]

DRAFT_TYPE = "q4_0"  # the self-draft, quantized from F32

PROMPTS = ["The expert pool holds", "def fibonacci(n):", "Once upon a time, the router"]
N_PREDICT = 16
SEED = 26
# near-ties at SEED that llama.cpp's float noise flips: llama4's top-1 routing (a router gap of
# 2e-4), deepseek3's first token after its first prompt (a logit margin of 2e-3)
SEED_OF = {"llama4": 28, "deepseek3": 29}

# dims: rows of 256 so that K-quants apply to the expert matrices (Q4_K_M's mix of Q4_K and
# Q6_K over the layers' ffn_down_exps needs 4 layers); 8 experts, 2 used
N_EMBD, N_FF_EXP, N_EXPERT, N_USED, N_LAYER = 256, 256, 8, 2, 4
COMMON = dict(hidden_size=N_EMBD, num_hidden_layers=N_LAYER, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, tie_word_embeddings=False, num_experts_per_tok=N_USED,
              initializer_range=0.05)

HYBRID = dict(layer_types=["linear_attention"] * 3 + ["full_attention"], full_attention_interval=4,
              linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2,
              linear_num_value_heads=4)

# architecture: (transformers config class, its arguments)
ARCHS: dict[str, tuple[str, dict]] = {
    "qwen3moe": ("Qwen3MoeConfig", dict(intermediate_size=512, moe_intermediate_size=N_FF_EXP, num_experts=N_EXPERT,
                                        norm_topk_prob=True, head_dim=64)),
    # shared expert with its sigmoid gate, q/k/v biases
    "qwen2moe": ("Qwen2MoeConfig", dict(intermediate_size=512, moe_intermediate_size=N_FF_EXP, num_experts=N_EXPERT,
                                        shared_expert_intermediate_size=N_FF_EXP, qkv_bias=True)),
    # q/k norms over the whole projection, no top-k renormalisation; no GQA (llama.cpp's olmoe
    # sizes the k norm by n_embd, as OLMoE has it)
    "olmoe": ("OlmoeConfig", dict(intermediate_size=N_FF_EXP, num_experts=N_EXPERT, norm_topk_prob=False,
                                  num_key_value_heads=4)),
    # llama.cpp's `llama` architecture with experts
    "mixtral": ("MixtralConfig", dict(intermediate_size=N_FF_EXP, num_local_experts=N_EXPERT, head_dim=64)),
    # MLA attention with a q LoRA (a model that is not the 26/27-layer Lite), one dense lead layer,
    # a shared expert, group-limited routing (4 groups of 2, 2 groups used), a routed scale
    "deepseek2": ("DeepseekV2Config", dict(intermediate_size=512, moe_intermediate_size=N_FF_EXP,
                                           n_routed_experts=N_EXPERT, n_shared_experts=1, first_k_dense_replace=1,
                                           kv_lora_rank=64, q_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32,
                                           v_head_dim=64, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                           routed_scaling_factor=2.0, norm_topk_prob=False, num_key_value_heads=4)),
    # DeepSeek-V2-Lite's shape: no q LoRA, which llama.cpp recognises only by the layer count
    # (26 or 27), so 26 thin layers; greedy top-k over 4 experts, two shared experts
    "deepseek2-lite": ("DeepseekV2Config", dict(num_hidden_layers=26, intermediate_size=512, moe_intermediate_size=N_FF_EXP,
                                                n_routed_experts=4, n_shared_experts=2, first_k_dense_replace=1,
                                                kv_lora_rank=64, q_lora_rank=None, qk_nope_head_dim=32,
                                                qk_rope_head_dim=32, v_head_dim=64, topk_method="greedy",
                                                norm_topk_prob=False, routed_scaling_factor=1.0,
                                                num_key_value_heads=4)),
    # expert biases, attention sinks, sliding-window layers, clamped SwiGLU
    "gpt-oss": ("GptOssConfig", dict(intermediate_size=N_FF_EXP, num_local_experts=N_EXPERT, head_dim=64,
                                     sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
                                     attention_bias=True, max_position_embeddings=4096)),
    # hybrids: gated-delta-net linear attention (a recurrent state, no KV cache) in three layers
    # of four, full attention in the fourth (Qwen3.5/3.6-MoE's full_attention_interval); fewer
    # key than value heads in the linear layers (the converter's V-head reorder); a shared expert
    "qwen35moe": ("Qwen3_5MoeTextConfig", dict(moe_intermediate_size=N_FF_EXP, num_experts=N_EXPERT, head_dim=64,
                                               shared_expert_intermediate_size=N_FF_EXP, **HYBRID)),
    "qwen3next": ("Qwen3NextConfig", dict(intermediate_size=512, moe_intermediate_size=N_FF_EXP, num_experts=N_EXPERT,
                                          head_dim=64, shared_expert_intermediate_size=N_FF_EXP,
                                          norm_topk_prob=True, **HYBRID)),
    # Qwen3.5/3.6-MoE and Qwen3-Next with one multi-token-prediction layer (the MTP draft):
    # transformers' classes make no MTP weights, so random `mtp.*` tensors are added to the
    # checkpoint (`add_mtp_weights`)
    "qwen35moe-mtp": ("Qwen3_5MoeTextConfig", dict(moe_intermediate_size=N_FF_EXP, num_experts=N_EXPERT, head_dim=64,
                                                   shared_expert_intermediate_size=N_FF_EXP, mtp_num_hidden_layers=1,
                                                   **HYBRID)),
    "qwen3next-mtp": ("Qwen3NextConfig", dict(intermediate_size=512, moe_intermediate_size=N_FF_EXP, num_experts=N_EXPERT,
                                              head_dim=64, shared_expert_intermediate_size=N_FF_EXP,
                                              norm_topk_prob=True, mtp_num_hidden_layers=1, **HYBRID)),
    # GLM-4.5/4.6/4.7: a dense lead layer, a shared expert, sigmoid routing with a correction bias
    # (randomised: ROUTER_BIAS), a routed scale; half-rotary heads with q/k norms and q/k/v biases
    "glm4moe": ("Glm4MoeConfig", dict(intermediate_size=512, moe_intermediate_size=N_FF_EXP, n_routed_experts=N_EXPERT,
                                      n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.0,
                                      norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
                                      num_nextn_predict_layers=0)),
    # DeepSeek-V3/R1/V3.1 (also Kimi-K2's shape): MLA with a q LoRA, a dense lead layer, a shared
    # expert, noaux_tc routing (sigmoid scores + correction bias, the top 2 groups of 4 by their
    # best two scores), a routed scale, V3's YaRN (factor 40: the softmax scale's mscale² too);
    # llama.cpp's deepseek2 architecture
    "deepseek3": ("DeepseekV3Config", dict(intermediate_size=512, moe_intermediate_size=N_FF_EXP, n_routed_experts=N_EXPERT,
                                           n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=64,
                                           q_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64,
                                           n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                                           num_key_value_heads=4, num_nextn_predict_layers=0,
                                           max_position_embeddings=163840,
                                           rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0,
                                                                original_max_position_embeddings=4096, beta_fast=32,
                                                                beta_slow=1, mscale=1.0, mscale_all_dim=1.0))),
    # Llama 4 (Maverick's interleaving): MoE in every second layer, dense FFNs between, a shared
    # expert, top-1 sigmoid routing applied before the experts; chunked attention in three layers of
    # four and no RoPE (with temperature tuning) in the fourth; L2 q/k norms; Scout's llama3 RoPE
    # scaling (the converter's rope_freqs)
    "llama4": ("Llama4TextConfig", dict(num_hidden_layers=8, intermediate_size=N_FF_EXP, intermediate_size_mlp=512,
                                        num_local_experts=N_EXPERT, num_experts_per_tok=1, interleave_moe_layer_step=2,
                                        head_dim=64, use_qk_norm=True,
                                        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=16.0,
                                                             low_freq_factor=1.0, high_freq_factor=1.0,
                                                             original_max_position_embeddings=8192))),
    # MiniMax-M2: sigmoid routing with a correction bias, partial rotary (rotary_dim), q/k norms over
    # the whole projection
    "minimax-m2": ("MiniMaxM2Config", dict(intermediate_size=N_FF_EXP, num_local_experts=N_EXPERT, head_dim=64,
                                           rotary_dim=32)),
    # ERNIE 4.5 MoE (21B-A3B's shape): a dense lead layer, two shared experts, softmax routing with
    # a correction bias (moe_statics), tied embeddings; a SentencePiece vocabulary (SENTENCEPIECE).
    # The converter sizes the shared experts by intermediate_size / n_head_kv (ERNIE's own ratio)
    "ernie4_5-moe": ("Ernie4_5_MoeConfig", dict(intermediate_size=1024, moe_intermediate_size=N_FF_EXP,
                                                moe_num_experts=N_EXPERT, moe_k=N_USED, moe_num_shared_experts=2,
                                                moe_layer_start_index=1, moe_layer_end_index=N_LAYER - 1,
                                                moe_layer_interval=1, tie_word_embeddings=True)),
}
# config.json fields the converter reads that transformers' class does not write: without
# scoring_func the converter writes no gating function and llama.cpp falls back to softmax
CONFIG_JSON = {"deepseek3": dict(scoring_func="sigmoid", topk_method="noaux_tc"),
               "minimax-m2": dict(scoring_func="sigmoid", use_routing_bias=True, rotary_dim=32)}
ROUTER_BIAS = 0.1  # std of the random e_score_correction_bias (transformers initialises it to zeros)
# converter flags per architecture: the hybrids' tiny configs have no MTP layers to convert
CONVERT_FLAGS = {"qwen35moe": ["--no-mtp"], "qwen3next": ["--no-mtp"]}
# the chat template each model carries, a file of the pinned tree (read at build time, not copied)
TEMPLATES = {"gpt-oss": "models/templates/openai-gpt-oss-120b.jinja", "glm4moe": "models/templates/GLM-4.6.jinja",
             "deepseek3": "models/templates/deepseek-ai-DeepSeek-V3.1.jinja",
             "minimax-m2": "models/templates/MiniMax-M2.jinja"}
DEFAULT_TEMPLATE = "models/templates/Qwen-Qwen3-0.6B.jinja"

# special tokens of both template families: ChatML/Qwen3 and gpt-oss's harmony
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
           "<|return|>", "<|call|>", "<|constrain|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]  # plain added tokens, as Qwen3 has them
# and the special tokens of the other families' templates (GLM's also name its BOS, EOT and EOM)
SPECIAL_OF = {"glm4moe": ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"],
              "deepseek3": ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"],
              "minimax-m2": ["]~!b[", "]~b]", "[e~["]}
EOS = {"gpt-oss": "<|return|>", "glm4moe": "<|endoftext|>", "deepseek3": "<｜end▁of▁sentence｜>", "minimax-m2": "[e~[",
       "ernie4_5-moe": "</s>"}
DEFAULT_EOS = "<|im_end|>"
N_VOCAB_BPE = 480
# the architectures whose converter reads only a SentencePiece tokenizer.model (train_sentencepiece)
SENTENCEPIECE = {"ernie4_5-moe"}
N_VOCAB_SPM = 600  # 256 byte-fallback pieces among them

# the tokenizer's training text: written for this file
CORPUS = """\
The expert pool holds the hot experts on the device, and the router picks two of eight for every token.
A draft proposes a few tokens; the target verifies them in one pass and keeps the longest prefix it agrees with.
Once upon a time, the router sent every token to the same expert, and the others waited in host memory.
def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)
for i in range(10):
    print(i, fibonacci(i))
class ExpertPool:
    def __init__(self, slots):
        self.slots = slots
        self.resident = {}
    def prefetch(self, layer, expert):
        self.resident[(layer, expert)] = True
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 32 64 128 256 512 1024 2048.
The quick brown fox jumps over the lazy dog while the slow green turtle watches the river.
She said: "It's fine, we'll verify it again", and they're sure the output didn't change.
Questions? Answers! Lists, tuples; dictionaries -- and sets. (Parentheses) [brackets] {braces} <angles>.
user: What is the capital of France?
assistant: The capital of France is Paris.
"""


# ----------------------------------------------------------------------------- building blocks

def cache_key() -> str:
    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update((ROOT / "vendor" / "llama-cpp-python.lock").read_bytes())
    return h.hexdigest()[:12]


def cached(out_root: Path = DEFAULT_OUT, archs: list[str] | None = None) -> Path | None:
    """OUT/<key> when it holds every architecture asked for, else None."""
    out = out_root / cache_key()
    manifest = out / "manifest.json"
    if manifest.exists() and set(archs or ARCHS) <= set(json.loads(manifest.read_text())["archs"]):
        return out
    return None


def train_tokenizer(out: Path, template: str, eos: str, special: list[str] = ()):
    """A byte-level BPE with GPT-2's split, trained on CORPUS; saved as a fast tokenizer with
    the chat template in tokenizer_config.json; `special`: special tokens besides SPECIAL.
    Returns the transformers tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=N_VOCAB_BPE, special_tokens=[*SPECIAL, *special], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS.splitlines(keepends=True) * 4, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token="<|endoftext|>",
                                 unk_token=None, bos_token=None)
    hf.chat_template = template
    hf.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(add_bos_token=False, add_eos_token=False)
    cfg_path.write_text(json.dumps(cfg, indent=1))
    return hf


class SentencePieceTokenizer:
    """A tokenizer.model through SentencePiece itself, with what build_arch and reference() use of
    a transformers tokenizer (ERNIE's own repository wraps SentencePiece too; transformers' import
    of a tokenizer.model would need protobuf)."""

    def __init__(self, path: Path, eos: str):
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor(model_file=str(path))
        self.eos_token, self.eos_token_id, self.pad_token_id = eos, self.sp.PieceToId(eos), self.sp.unk_id()

    def __len__(self) -> int:
        return self.sp.GetPieceSize()

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": self.sp.encode(text)}


def train_sentencepiece(out: Path, template: str, eos: str) -> SentencePieceTokenizer:
    """A SentencePiece BPE with byte fallback and no normalisation (as Llama's and ERNIE's),
    trained on CORPUS: tokenizer.model, with SPECIAL as control pieces; tokenizer_config.json
    carries the chat template and no BOS."""
    import sentencepiece as spm

    out.mkdir(parents=True, exist_ok=True)
    with open(out / "tokenizer.model", "wb") as f:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS.splitlines() * 4), model_writer=f,
                                       vocab_size=N_VOCAB_SPM, model_type="bpe", byte_fallback=True,
                                       character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                                       control_symbols=SPECIAL, normalization_rule_name="identity",
                                       remove_extra_whitespaces=False, num_threads=1, minloglevel=2)
    tok = SentencePieceTokenizer(out / "tokenizer.model", eos)
    cfg = dict(add_bos_token=False, add_eos_token=False, bos_token="<s>", eos_token=eos, unk_token="<unk>",
               chat_template=template)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    return tok


def make_hf_model(arch: str, out: Path, n_vocab: int, eos_id: int, pad_id: int):
    """The seeded random model of `arch`, saved (safetensors, float32) to out."""
    import torch
    import transformers

    cls_name, extra = ARCHS[arch]
    config = getattr(transformers, cls_name)(**{**COMMON, **extra}, vocab_size=n_vocab, eos_token_id=eos_id,
                                              pad_token_id=pad_id, bos_token_id=None)
    torch.manual_seed(SEED_OF.get(arch, SEED))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # spread the router's scores and the logits: fewer near-ties, in routing too
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight", "lm_head.weight")) and p.dim() == 2:
                p.normal_(0.0, 0.5 if "lm_head" not in name else 0.2)
        for name, b in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, ROUTER_BIAS)
    model.save_pretrained(out, safe_serialization=True)
    if arch in CONFIG_JSON:
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**cfg, **CONFIG_JSON[arch]}, indent=1))
    if extra.get("mtp_num_hidden_layers"):
        add_mtp_weights(out, model)
    return model


def add_mtp_weights(out: Path, model) -> None:
    """A random MTP block in the saved checkpoint, under the names of Qwen3.5's own checkpoints
    (what the converter's _QwenMtpMixin remaps to blk.<n_layer>.nextn.*): `mtp.layers.0.*` a
    full-attention MoE decoder layer shaped as the model's last one, `mtp.fc` the projection of
    [token embedding, hidden state], its two input norms and the output norm. Seeded, and drawn
    after the model's own weights, which it leaves as they were."""
    import torch
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    tensors = load_file(path)
    last = model.config.num_hidden_layers - 1
    prefix = f"model.layers.{last}."
    n = model.config.hidden_size
    gen = torch.Generator().manual_seed(SEED + 1)
    for name, t in list(tensors.items()):
        if name.startswith(prefix):
            noise = torch.randn(t.shape, generator=gen) * (float(t.std()) if t.numel() > 1 else 0.0)
            tensors["mtp.layers.0." + name[len(prefix):]] = (t + noise).contiguous()
    tensors["mtp.fc.weight"] = torch.randn((n, 2 * n), generator=gen) * 0.05
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = torch.zeros(n)  # Qwen3.5's norms store weight - 1
    save_file(tensors, path, metadata={"format": "pt"})


def reference(model, tokenizer) -> list[dict]:
    """transformers' greedy continuation of every prompt (float32, no cache: one full forward
    per token), with the top-1/top-2 logit margin at every position."""
    import torch

    model.eval()
    out = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        seq = list(ids)
        tokens, margins = [], []
        with torch.no_grad():
            for _ in range(N_PREDICT):
                logits = model(torch.tensor([seq])).logits[0, -1].double()
                top = torch.topk(logits, 2)
                t = int(top.indices[0])
                tokens.append(t)
                margins.append(float(top.values[0] - top.values[1]))
                seq.append(t)
        out.append({"prompt": prompt, "prompt_tokens": ids, "tokens": tokens, "margins": margins})
    return out


CONVERT_SHIM = """
import runpy, sys
sys.path.insert(0, sys.argv[1])
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
script = sys.argv[1] + "/convert_hf_to_gguf.py"
for job in sys.argv[2:]:
    model_dir, outtype, outfile, *flags = job.split("|")
    sys.argv = [script, model_dir, "--outtype", outtype, "--outfile", outfile, *flags]
    runpy.run_path(script, run_name="__main__")
"""


def convert(jobs: list[tuple[Path, str, Path]], flags: list[str] = ()) -> None:
    """The pinned tree's convert_hf_to_gguf.py on every (model dir, outtype, outfile), in one
    process, each with the extra command-line flags."""
    script = LLAMA_CPP_TREE / "convert_hf_to_gguf.py"
    if not script.exists():
        raise SystemExit(f"{script} not found: run scripts/build_native.py (it extracts the pinned tree)")
    args = ["|".join([str(d), t, str(f), *flags]) for d, t, f in jobs]
    res = subprocess.run([sys.executable, "-c", CONVERT_SHIM, str(LLAMA_CPP_TREE), *args], capture_output=True,
                         text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if res.returncode != 0:
        raise SystemExit(f"convert_hf_to_gguf.py failed:\n{res.stdout[-2000:]}{res.stderr[-4000:]}")


def quantize(quantizer: Path, src: Path, dst: Path, qtype: str) -> None:
    res = subprocess.run([str(quantizer), str(src), str(dst), qtype.upper(), "2"], capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"llama-quantize {qtype} failed:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")


def tensor_types(path: Path) -> dict[str, str]:
    """tensor name → ggml type name, from the GGUF's header (the pinned tree's gguf-py)."""
    sys.path.insert(0, str(LLAMA_CPP_TREE / "gguf-py"))
    import gguf

    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


# ----------------------------------------------------------------------------- one architecture

def build_arch(arch: str, out: Path, quantizer: Path) -> dict:
    import torch

    torch.set_num_threads(2)
    t0 = time.monotonic()
    hf_dir = out / "hf"
    if hf_dir.exists():
        shutil.rmtree(hf_dir)
    template = (LLAMA_CPP_TREE / TEMPLATES.get(arch, DEFAULT_TEMPLATE)).read_text()
    if arch in SENTENCEPIECE:
        tokenizer = train_sentencepiece(hf_dir, template, EOS.get(arch, DEFAULT_EOS))
    else:
        tokenizer = train_tokenizer(hf_dir, template, EOS.get(arch, DEFAULT_EOS), SPECIAL_OF.get(arch, []))
    model = make_hf_model(arch, hf_dir, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    ref = reference(model, tokenizer)
    del model
    files = {t: out / f"{arch}-{t}.gguf" for t in [*types_of(arch), DRAFT_TYPE]}
    convert([(hf_dir, t, files[t]) for t in CONVERTED if t in files], CONVERT_FLAGS.get(arch, []))
    for t in files:
        if t not in CONVERTED:
            quantize(quantizer, files["f32"], files[t], t)
    types = {t: sorted(set(tensor_types(f).values())) for t, f in files.items()}
    exps = {n: ty for n, ty in tensor_types(files["q4_k_m"]).items() if "ffn_down_exps" in n}
    info = {"arch": arch, "hf_class": ARCHS[arch][0], "eos": tokenizer.eos_token, "eos_id": tokenizer.eos_token_id,
            "n_vocab": len(tokenizer), "files": {t: f.name for t, f in files.items()}, "tensor_types": types,
            "q4_k_m_ffn_down_exps": exps, "reference": ref, "seconds": round(time.monotonic() - t0, 1)}
    (out / "reference.json").write_text(json.dumps(info, indent=1))
    for f in hf_dir.glob("*.safetensors"):  # the weights live on in the F32 GGUF; keep the configs
        f.unlink()
    return info


def build(out_root: Path = DEFAULT_OUT, archs: list[str] | None = None) -> Path:
    """Build (or reuse) the files; returns OUT/<key>."""
    found = cached(out_root, archs)
    if found is not None:
        return found
    import tokenizers
    import torch
    import transformers

    out = out_root / cache_key()
    archs = archs or list(ARCHS)
    quantizer = stock_program("llama-quantize")
    done = {}
    t0 = time.monotonic()
    for arch in archs:
        d = out / arch
        d.mkdir(parents=True, exist_ok=True)
        info = build_arch(arch, d, quantizer)
        done[arch] = info["seconds"]
        print(f"[real-files] {arch}: {info['seconds']} s", flush=True)
    versions = {m.__name__: m.__version__ for m in (torch, transformers, tokenizers)}
    (out / "manifest.json").write_text(json.dumps({"archs": archs, "seconds": done, "versions": versions,
                                                   "total_s": round(time.monotonic() - t0, 1)}, indent=1))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="cache root (default: runs/real-files)")
    ap.add_argument("--arch", action="append", choices=list(ARCHS), help="only these (repeatable)")
    args = ap.parse_args()
    print(build(args.out, args.arch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
