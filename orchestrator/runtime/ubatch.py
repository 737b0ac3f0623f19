"""The prompt's ubatch (`-ub auto`, the default): how many tokens one prompt pass takes.

    u = prompt_ubatch(sizes, pool_bytes, n_ctx, room)   # 512 .. 4096

A streamed prefill (patch 0016) copies every expert the pool does not hold once per pass,
whatever the pass's length, so a pass of u tokens spreads one pass of copies over u tokens (on an
H100, 2,048-token passes took a third of the time per token of 512-token ones). The rule:

- no streamed prefill, or a pool that holds every expert (nothing is copied): llama.cpp's 512;
- else the smallest of UBATCHES whose compute hides the pass's copies (a longer pass then buys
  nothing but memory), or the largest one whose compute buffer fits `room` when none does. On the
  consumer cards spac targets the copies never hide (Qwen3-30B-A3B Q4_K_M on 8 GB: 11 GB per pass
  over a 25 GB/s link against 30 ms of compute for 512 tokens), so memory decides.

The compute buffer is llama.cpp's per-pass scratch, of which the placement's margin already
holds the 512-token one. `compute_buffer_bytes` estimates its peak: the output logits that
llama.cpp reserves for every token of the pass (u × n_vocab floats, the largest term on the files
tried), or one layer's activations if larger (the residual stream, the routed experts'
intermediates and, without flash attention, the attention scores of every head: u × n_ctx ×
n_head floats).
"""

from __future__ import annotations

from orchestrator.gguf_files.model_sizes import ModelSizes

DEFAULT_UBATCH = 512                 # llama.cpp's -ub
UBATCHES = (512, 1024, 2048, 4096)   # the candidates, smallest first
LINK_BYTES_PER_S = 25e9              # PCIe 4.0 x16 from pinned memory (a slower link only favours longer passes)
GPU_FLOPS = 100e12                   # an RTX 4090's effective prompt rate (a slower GPU hides copies sooner)


def compute_buffer_bytes(sizes: ModelSizes, u: int, n_ctx: int, flash_attn: bool) -> int:
    """An estimate of llama.cpp's compute buffer for a pass of u tokens at a context of n_ctx, F32:
    the larger of a layer's activations (the graph allocator reuses one layer's memory for the
    next) and the output head's logits, which llama.cpp reserves for every token of the pass.
    Held against llama.cpp's own count on a 4-layer Qwen3-30B-A3B-shaped file, n_ctx 4096: 316
    and 1,265 MiB estimated against 305 and 1,219 MiB reserved at 512 and 2,048 tokens."""
    layer = 6 * sizes.n_embd + 3 * sizes.n_ff_active + sizes.n_expert
    if not flash_attn:
        layer += n_ctx * sizes.n_head  # the attention scores: each query row against up to n_ctx keys
    return 4 * u * max(layer, sizes.n_vocab + 2 * sizes.n_embd)


def buffer_growth(sizes: ModelSizes, u: int, n_ctx: int, flash_attn: bool = False) -> int:
    """How much more compute buffer a pass of u tokens takes than llama.cpp's 512-token one."""
    return compute_buffer_bytes(sizes, u, n_ctx, flash_attn) - compute_buffer_bytes(sizes, DEFAULT_UBATCH, n_ctx, flash_attn)


def prompt_ubatch(sizes: ModelSizes, pool_bytes: int, n_ctx: int, room: int, flash_attn: bool = False,
                  stream: bool = True, link: float = LINK_BYTES_PER_S, flops: float = GPU_FLOPS) -> int:
    """The prompt pass's length for this model, pool and context. room: device bytes the compute
    buffer may grow by beyond the 512-token one (the placement's margin holds that one);
    flash_attn False counts the attention scores (llama.cpp's auto may still turn it on)."""
    copied = max(sizes.expert_bytes - pool_bytes, 0)
    if not stream or copied == 0 or not sizes.n_embd:
        return DEFAULT_UBATCH
    n_ctx = max(n_ctx, DEFAULT_UBATCH)
    fits = [u for u in UBATCHES if u <= n_ctx and buffer_growth(sizes, u, n_ctx, flash_attn) <= room]
    if not fits:
        return DEFAULT_UBATCH
    copy_s = copied / link
    for u in fits:
        if 2.0 * sizes.active_params * u / flops >= copy_s:
            return u
    return fits[-1]
