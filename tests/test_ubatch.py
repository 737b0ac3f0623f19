"""-ub auto: the prompt pass's length from the copy/compute balance and the memory it takes
(orchestrator/runtime/ubatch.py), and the placement that pays for it."""

from __future__ import annotations

from dataclasses import replace

from orchestrator.runtime.placement import GPU, UBATCH_SHARE, place
from orchestrator.runtime.pool import Budget
from orchestrator.runtime.ubatch import DEFAULT_UBATCH, UBATCHES, buffer_growth, compute_buffer_bytes, prompt_ubatch
from orchestrator.gguf_files.model_sizes import ModelSizes

GiB = 1 << 30
# Qwen3-30B-A3B Q4_K_M: 48 layers of 128 experts (8 used, 768 wide), 2048 wide, 32 heads
QWEN = ModelSizes(n_layer=48, expert_bytes=int(16.5 * GiB), non_expert_bytes=int(1.5 * GiB), kv_bytes_per_token=98304,
                  n_experts_total=48 * 128, n_ctx_train=40960, staging_bytes=2 * int(16.5 * GiB) // 48,
                  n_embd=2048, n_vocab=151936, n_head=32, n_expert=128, n_ff_active=8 * 768, active_params=3_300_000_000)


def test_nothing_copied_keeps_llama_cpps_pass():
    assert prompt_ubatch(QWEN, QWEN.expert_bytes, 4096, room=100 * GiB) == DEFAULT_UBATCH
    assert prompt_ubatch(QWEN, 0, 4096, room=100 * GiB, stream=False) == DEFAULT_UBATCH


def test_copies_that_never_hide_take_the_longest_pass_that_fits():
    """8 GB of experts missing over 25 GB/s against 3.3 B weights at 100 TFLOPS: no pass up to
    4,096 tokens hides its copies, so memory decides."""
    for u in UBATCHES:
        grown = buffer_growth(QWEN, u, 4096)
        assert grown == compute_buffer_bytes(QWEN, u, 4096, False) - compute_buffer_bytes(QWEN, 512, 4096, False)
        assert prompt_ubatch(QWEN, 8 * GiB, 4096, room=grown) == u
        assert prompt_ubatch(QWEN, 8 * GiB, 4096, room=grown - 1) == max(DEFAULT_UBATCH, u // 2)
    assert prompt_ubatch(QWEN, 8 * GiB, 1024, room=100 * GiB) == 1024  # never past the context


def test_the_shortest_pass_that_hides_its_copies_wins():
    """A few experts missing: 512 tokens of compute hide them, and a longer pass buys nothing."""
    few = QWEN.expert_bytes - 64 * QWEN.one_expert
    assert prompt_ubatch(QWEN, few, 4096, room=100 * GiB) == DEFAULT_UBATCH
    # copies 4x the 512-token compute: the first pass that hides them is 2048
    copy_s = 4 * 2.0 * QWEN.active_params * 512 / 100e12
    assert prompt_ubatch(QWEN, QWEN.expert_bytes - int(copy_s * 25e9), 4096, room=100 * GiB) == 2048


def test_attention_scores_count_without_flash_attention():
    long = 32768
    assert compute_buffer_bytes(QWEN, 2048, long, False) > compute_buffer_bytes(QWEN, 2048, long, True)
    room = buffer_growth(QWEN, 2048, long, flash_attn=True)
    assert prompt_ubatch(QWEN, 8 * GiB, long, room, flash_attn=True) == 2048
    assert prompt_ubatch(QWEN, 8 * GiB, long, room, flash_attn=False) < 2048


def test_the_placement_pays_for_the_pass_from_the_pool():
    """8 GB card: the pass grows as far as 1/8 of the pool's room allows, the pool gives up exactly
    the compute buffer's growth, and the note says so; the staging slots stay."""
    gpu = GPU("CUDA0", free=int(7.5 * GiB), total=8 * GiB)
    p = place(QWEN, 4096, gpu, None, Budget())
    fixed = place(replace(QWEN, n_embd=0), 4096, gpu, None, Budget())  # sizes without widths: 512, as before
    assert fixed.ubatch == DEFAULT_UBATCH and p.ubatch > DEFAULT_UBATCH
    grown = buffer_growth(QWEN, p.ubatch, 4096)
    assert fixed.pool[0].budget.nbytes - p.pool[0].budget.nbytes == grown
    assert grown <= UBATCH_SHARE * (fixed.pool[0].budget.nbytes)
    assert f"prompt passes of {p.ubatch} tokens" in p.note and "staging slots" in p.note


def test_a_pool_of_every_expert_has_no_staging_slots():
    """24 GB card with a smaller file: every expert fits, so the pool takes them all, copied at
    load, no staging slots are set aside and the pass stays llama.cpp's."""
    small = replace(QWEN, expert_bytes=12 * GiB, staging_bytes=2 * 12 * GiB // 48)
    p = place(small, 4096, GPU("CUDA0", free=23 * GiB, total=24 * GiB), None, Budget())
    assert p.pool[0].budget.nbytes == small.expert_bytes and p.stream_prefill and p.ubatch == DEFAULT_UBATCH
    assert "every expert, copied at load" in p.note and "staging" not in p.note


def test_a_given_budget_leaves_the_rest_to_the_pass():
    """--expert-budget 25% on a 24 GB card: the pass may take what the pool and staging leave."""
    p = place(QWEN, 4096, GPU("CUDA0", free=23 * GiB, total=24 * GiB), None, Budget(ratio=0.25))
    assert p.pool[0].budget.ratio == 0.25 or p.pool[0].budget.nbytes == int(0.25 * QWEN.expert_bytes)
    assert p.ubatch == UBATCHES[-1] and "prompt passes of 4096 tokens" in p.note


def test_a_given_pass_length_leaves_the_pool_alone():
    """-ub N: the placement chooses no pass and the pool keeps the room a chosen one would take."""
    gpu = GPU("CUDA0", free=int(7.5 * GiB), total=8 * GiB)
    given = place(QWEN, 4096, gpu, None, Budget(), auto_ubatch=False)
    unsized = place(replace(QWEN, n_embd=0), 4096, gpu, None, Budget())
    assert given.ubatch == DEFAULT_UBATCH and "-ub auto" not in given.note
    assert given.pool[0].budget.nbytes == unsized.pool[0].budget.nbytes
