"""Shape-faithful synthetic MoE models for scale tests: the real dimensions of named models
(`PRESETS`) with random Q4_0 weights, produced tensor by tensor (`synthetic_tensors` returns
one loader per tensor for `gguf_export.write_gguf`, so the whole model is never in RAM).

Weights are random 4-bit blocks (uniform nibbles, per-block scale giving std 1/sqrt(fan_in)),
norms are ones: the numbers mean nothing, the shapes, sizes and kernels are the real ones.
`scripts/make_synthetic_moe.py` writes them as files.
"""

from __future__ import annotations

import numpy as np

from orchestrator.gguf_files.gguf_export import SSM_A, ModelConfig, keeps_f32, ssm_a, tensor_shapes

# Dimensions from the models' published configs.
PRESETS: dict[str, ModelConfig] = {
    "olmoe-1b-7b": ModelConfig(
        arch="olmoe", n_vocab=50304, n_embd=2048, n_layer=16, n_head=16, n_head_kv=16, head_dim=128,
        n_ff=1024, n_expert=64, n_expert_used=8, n_ff_exp=1024, n_ctx_train=4096, rope_freq_base=10000.0,
        rms_norm_eps=1e-5, name="synthetic-OLMoE-1B-7B"),
    "qwen3-30b-a3b": ModelConfig(
        arch="qwen3moe", n_vocab=151936, n_embd=2048, n_layer=48, n_head=32, n_head_kv=4, head_dim=128,
        n_ff=6144, n_expert=128, n_expert_used=8, n_ff_exp=768, n_ctx_train=40960, rope_freq_base=1e6,
        rms_norm_eps=1e-6, name="synthetic-Qwen3-30B-A3B"),
    # Mixtral's dimensions on qwen3moe's graph (the writer has no llama-arch MoE; the q/k norms
    # this adds are head_dim-sized vectors): few, wide experts, so expert work dominates a verify pass.
    "mixtral-8x7b": ModelConfig(
        arch="qwen3moe", n_vocab=32000, n_embd=4096, n_layer=32, n_head=32, n_head_kv=8, head_dim=128,
        n_ff=14336, n_expert=8, n_expert_used=2, n_ff_exp=14336, n_ctx_train=32768, rope_freq_base=1e6,
        rms_norm_eps=1e-5, name="synthetic-Mixtral-8x7B"),
    # Qwen3.6-35B-A3B (Qwen3.5-MoE's architecture): three gated-delta-net layers (16 key and 32
    # value heads of 128, conv kernel 4) to one full-attention layer (16 query heads with an output
    # gate, 2 KV heads of 256, rope on a quarter of each head), 256 experts top-8 and a shared expert
    "qwen3.6-35b-a3b": ModelConfig(
        arch="qwen35moe", n_vocab=248320, n_embd=2048, n_layer=40, n_head=16, n_head_kv=2, head_dim=256,
        n_expert=256, n_expert_used=8, n_ff_exp=512, n_ff_shexp=512, n_ctx_train=262144, rope_freq_base=1e7,
        rms_norm_eps=1e-6, full_attention_interval=4, linear_k_heads=16, linear_v_heads=32, linear_head_dim=128,
        conv_kernel=4, rope_dim=64, name="synthetic-Qwen3.6-35B-A3B"),
}

Q4_0_BLOCK = 32
NIBBLE_STD = float(np.sqrt(((np.arange(16) - 8.0) ** 2).mean()))  # std of (q - 8), q uniform in 0..15
# zero_mean: nibble 0 (-8) drawn as 8 (0), so q - 8 is uniform over -7..7 plus extra zeros: mean 0
ZERO_MEAN_NIBBLE_STD = float(np.sqrt(((np.arange(1, 16) - 8.0) ** 2).sum() / 16))


def random_q4_0(shape: tuple[int, ...], std: float, rng: np.random.Generator, zero_mean: bool = False) -> np.ndarray:
    """Raw Q4_0 blocks (f16 scale + 16 bytes of nibbles) for a float tensor of `shape`.

    Uniform nibbles give weights of mean -0.5 scale: every layer then adds a vector common to
    all tokens to the residual stream, and from the second MoE layer on every token of a prompt
    picks the same top-k experts. zero_mean keeps the routing of a prompt spread over the
    experts (all 128 used by 512 tokens of the qwen3-30b-a3b shape, the 32 busiest taking a third
    of the picks, as in a trained model) at the cost of one value in 16 being 0."""
    rows, n = int(np.prod(shape[:-1])), shape[-1]
    blocks = np.empty((rows, n // Q4_0_BLOCK, 18), dtype=np.uint8)
    scale = std / (ZERO_MEAN_NIBBLE_STD if zero_mean else NIBBLE_STD)
    blocks[:, :, :2] = np.frombuffer(np.float16(scale).tobytes(), dtype=np.uint8)
    q = rng.integers(0, 256, size=(rows, n // Q4_0_BLOCK, 16), dtype=np.uint8)
    if zero_mean:
        lo, hi = q & 15, q >> 4
        lo[lo == 0] = 8
        hi[hi == 0] = 8
        q = lo | (hi << 4)
    blocks[:, :, 2:] = q
    return blocks.reshape(*shape[:-1], n // Q4_0_BLOCK * 18)


def synthetic_tensors(cfg: ModelConfig, seed: int, zero_mean: bool = False, floats: bool = False) -> dict:
    """Random Q4_0 weights (norms 1) of a preset's shape, as callables; zero_mean: see random_q4_0.
    The tensors a file keeps in F32 besides the norms (a delta net's conv kernel, a one-row
    shared-expert gate) are zero-mean normal floats, a delta net's decay rates negative.
    floats: every weight a zero-mean normal float of the same std (for an F16 file, from which
    llama.cpp's quantizer can make a Q4_0 self-draft)."""
    def make(name: str, shape: tuple[int, ...], i: int):
        def f():
            rng = np.random.default_rng([seed, i])
            if name.endswith(SSM_A):
                return ssm_a(rng, shape)
            if len(shape) == 1:
                return np.ones(shape, np.float32)
            std = shape[-1] ** -0.5 if "token_embd" not in name else 1.0
            if floats or keeps_f32(name, shape):
                return std * rng.standard_normal(shape, dtype=np.float32)
            return random_q4_0(shape, std, rng, zero_mean)
        return f
    return {n: make(n, s, i) for i, (n, s) in enumerate(tensor_shapes(cfg).items())}
