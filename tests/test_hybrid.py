"""Hybrid models (Qwen3.5/3.6-MoE `qwen35moe`, Qwen3-Next `qwen3next`): linear-attention layers
keep a recurrent state beside the full-attention layers' KV cache, and that state cannot be cut
back anywhere. A verify pass's rejected drafts roll back through llama.cpp's snapshots of the
pass's trailing tokens (n_rs_seq = γ; patch 0019 gives qwen3next the ones qwen35moe has); a trim
deeper than the snapshots computes the kept tokens again; a recurrent draft drafts in a forked
sequence. The files are tests/real_files' tiny random models (transformers' classes, the pinned
converter, stock llama-quantize)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import make_real_files as mrf  # scripts/, on pytest's pythonpath
from orchestrator.decoding.sampling import SamplingParams
from orchestrator.decoding.speculative import EXACT_ROWS, POOL_DRAFT, Session, SessionConfig
from orchestrator.runtime.host_layout import set_batch_invariant_rows
from orchestrator.runtime.llm import Context, Model
from orchestrator.runtime.pool import Budget, PoolDevice

HYBRIDS = ["qwen35moe", "qwen3next"]
GREEDY = SamplingParams(temperature=0.0)
PROMPT = "The expert pool holds"
GAMMA = 6
VERIFY = [5, 17, 29, 41, 53, 65, 77]  # a verify pass of γ+1 tokens
NEXT = 99


@pytest.fixture(autouse=True)
def batch_invariant():
    """What a session sets (SessionConfig.exact): batches up to EXACT_ROWS give one-token rows, so a
    verify pass of γ+1 tokens and the same tokens decoded apart give bit-identical logits."""
    set_batch_invariant_rows(EXACT_ROWS)
    yield
    set_batch_invariant_rows(0)


@pytest.fixture(scope="module")
def files():
    if mrf.cached() is None:
        for dep in ("torch", "transformers", "tokenizers"):
            pytest.importorskip(dep, reason="building the real files needs the `test` extra (scripts/install.sh --test)")
    return mrf.build()


def path_of(files, arch: str, ftype: str):
    info = json.loads((files / arch / "reference.json").read_text())
    return files / arch / info["files"][ftype]


def next_logits(model: Model, runs: list[list[int]], rollback: int = GAMMA, keep: int | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """Decode each run (one llama_decode each), trim to `keep` if given, decode NEXT: its logits,
    the last run's logits rows, and how many trims computed the kept tokens again."""
    ctx = Context(model, n_ctx=64, n_batch=16, rollback=rollback)
    try:
        for run in runs:
            ctx.decode(run)
        rows = ctx.logits().copy()
        if keep is not None:
            ctx.trim(keep)
        ctx.decode([NEXT])
        return ctx.logits()[-1].copy(), rows, ctx.n_replays
    finally:
        ctx.close()


@pytest.mark.parametrize("ftype", ["f32", "q8_0", "q4_k_m"])
@pytest.mark.parametrize("arch", HYBRIDS)
def test_a_rollback_leaves_the_state_of_the_kept_tokens(files, arch, ftype):
    """After a verify pass of γ+1 tokens, a trim to each depth 1..γ rolls the recurrent state back
    through a snapshot (nothing computed again), and the next position's logits are those of a
    context that decoded only the kept tokens, bit for bit (the kept rows too)."""
    model = Model(path_of(files, arch, ftype), repack="off")
    try:
        prompt = model.tokenize(PROMPT)
        for keep in range(1, GAMMA + 1):
            got, rows, replays = next_logits(model, [prompt, VERIFY], keep=len(prompt) + keep)
            want, kept_rows, _ = next_logits(model, [prompt, VERIFY[:keep]])
            assert replays == 0, f"keep {keep}: the rollback computed the tokens again"
            np.testing.assert_array_equal(rows[:keep], kept_rows, err_msg=f"{arch} {ftype} keep {keep}: kept rows")
            np.testing.assert_array_equal(got, want, err_msg=f"{arch} {ftype} keep {keep}")
    finally:
        model.close()


@pytest.mark.parametrize("arch", HYBRIDS)
def test_a_trim_past_the_snapshots_computes_the_kept_tokens_again(files, arch):
    """Deeper than the snapshots (or than the last decode), a trim empties the state and decodes
    the kept tokens in one pass: exactly a new context's prefill of them. Two trims in a row
    before a decode cost one rollback (the trim is applied at the next decode)."""
    model = Model(path_of(files, arch, "q8_0"), repack="off")
    try:
        prompt = model.tokenize(PROMPT)
        n = len(prompt)
        got, _, replays = next_logits(model, [prompt, VERIFY], rollback=2, keep=n + 1)
        want, _, _ = next_logits(model, [prompt + VERIFY[:1]], rollback=2)
        assert replays == 1
        np.testing.assert_array_equal(got, want)
        # a whole verify pass dropped: its first token has no snapshot before it
        got, _, replays = next_logits(model, [prompt, VERIFY], keep=n)
        want, _, _ = next_logits(model, [prompt])
        assert replays == 1
        np.testing.assert_array_equal(got, want)
        # two trims, one rollback
        ctx = Context(model, n_ctx=64, n_batch=16, rollback=GAMMA)
        try:
            ctx.decode(prompt)
            ctx.decode(VERIFY)
            ctx.trim(n + 5)
            ctx.trim(n + 3)
            assert ctx.n_past == n + 3 and ctx.can_trim(n + 3)
            ctx.decode([NEXT])
            assert ctx.n_replays == 0
            want, _, _ = next_logits(model, [prompt, VERIFY], keep=n + 3)
            np.testing.assert_array_equal(ctx.logits()[-1], want)
        finally:
            ctx.close()
    finally:
        model.close()


@pytest.mark.parametrize("arch", HYBRIDS)
def test_a_fork_leaves_the_sequence_as_it_was(files, arch):
    """A recurrent draft drafts in a scratch sequence: after `join`, decoding the accepted tokens
    gives what a context that never forked gives."""
    model = Model(path_of(files, arch, "q8_0"), repack="off")
    try:
        prompt = model.tokenize(PROMPT)
        ctx = Context(model, n_ctx=64, n_batch=16, forks=True)
        ref = Context(model, n_ctx=64, n_batch=16)
        try:
            assert ctx.forks and ctx.recurrent
            ctx.decode(prompt)
            ctx.fork()
            for t in VERIFY[:4]:
                ctx.decode([t])
            ctx.join()
            assert ctx.n_past == len(prompt)
            ctx.decode(VERIFY[:2])
            ref.decode(prompt)
            ref.decode(VERIFY[:2])
            np.testing.assert_array_equal(ctx.logits(), ref.logits())
        finally:
            ctx.close()
            ref.close()
    finally:
        model.close()


def session_tokens(cfg: SessionConfig, prompts: list[str], n: int = 24, steps: list | None = None) -> list[list[int]]:
    with Session(cfg) as s:
        if steps is not None:
            step = s._step

            def counted(gamma, sampling, rng):
                out = step(gamma, sampling, rng)
                steps.append(out[:2])
                return out

            s._step = counted
        out = [s.complete(p, n, (), GREEDY).tokens for p in prompts]
        assert s.ctx.n_replays == 0, "a verify pass's rejection computed the target's tokens again"
        return out


@pytest.mark.parametrize("arch", HYBRIDS)
def test_speculative_greedy_equals_target_only_on_a_hybrid(files, arch, tmp_path):
    """γ fixed at 4, the pool at 25% on the CPU test device: the F16 file drafting for the Q8_0
    target (acceptance between none and all, so that rejections of every depth roll back) and
    the pool draft (a recurrent draft context on the target's own weights, drafting in its fork)
    give target-only's tokens."""
    target = path_of(files, arch, "q8_0")
    prompts = [r["prompt"] for r in json.loads((files / arch / "reference.json").read_text())["reference"]]
    base = dict(model=target, n_ctx=128, n_threads=2, repack="off", calibration_cache=tmp_path / "cal.json")
    want = session_tokens(SessionConfig(**base, expert_engine=False), prompts)
    for draft in (path_of(files, arch, "f16"), POOL_DRAFT):
        steps: list[tuple[int, int]] = []
        cfg = SessionConfig(**base, draft=draft, gamma=4, adaptive_gamma=False, pool=(PoolDevice("CPU", Budget(ratio=0.25)),))
        assert session_tokens(cfg, prompts, steps=steps) == want
        if draft != POOL_DRAFT:
            assert any(0 < a < d for d, a in steps), steps  # some partial rejections


@pytest.mark.parametrize("arch", HYBRIDS)
def test_a_second_turn_reuses_the_state_or_starts_over(files, arch, tmp_path):
    """Chat turns on one Session (`spac chat`, `spac serve`): the next prompt extends the cached
    one, so the state is kept (cache_n > 0) and the answer is a new Session's; a prompt that
    leaves the cached one where no snapshot reaches starts over (cache_n = 0), same answer."""
    target = path_of(files, arch, "q8_0")
    cfg = SessionConfig(model=target, n_ctx=256, n_threads=2, repack="off", draft=POOL_DRAFT, gamma=4,
                        adaptive_gamma=False, pool=(PoolDevice("CPU", Budget(ratio=0.5)),), calibration_cache=tmp_path / "cal.json")
    with Session(cfg) as s:
        first = s.complete(PROMPT, 12, (), GREEDY)
        turn = s.target.tokenize(PROMPT) + first.tokens + s.target.tokenize(" and then")
        second = s.complete(turn, 12, (), GREEDY)
        assert second.metrics.n_prompt_cached > 0
        other = s.complete("def fibonacci(n):", 12, (), GREEDY)
        assert other.metrics.n_prompt_cached == 0
    for prompt, got in ((turn, second), ("def fibonacci(n):", other)):
        with Session(cfg) as fresh:  # every pass here ≤ EXACT_ROWS tokens: no batch-size rounding
            assert got.tokens == fresh.complete(prompt, 12, (), GREEDY).tokens


@pytest.mark.parametrize("mode", ["ahead", "used"])
@pytest.mark.parametrize("arch", HYBRIDS)
def test_streamed_prefill_of_a_hybrid_is_bit_identical(files, arch, mode):
    """A prompt's ubatches above the split size stream their experts through the pool's staging
    slots (patch 0016) on a hybrid too: the logits of every position equal an all-host prefill's."""
    from orchestrator.runtime.native import ExpertEngine

    path = path_of(files, arch, "q8_0")
    model = Model(path, repack="off")
    ctx = Context(model, n_ctx=512, n_batch=128, n_threads=2)
    tokens = np.random.default_rng(0).integers(0, model.n_vocab, 160)  # one streamed ubatch, one split
    try:
        ctx.decode(tokens)
        want = ctx.logits().copy()
        ctx.clear()
        with ExpertEngine(ctx.ptr, path, budget_ratio=0.25, stream_prefill=mode) as engine:
            ctx.decode(tokens)
            np.testing.assert_array_equal(ctx.logits(), want)
            assert engine.stats()["n_staged"] > 0
            ctx.clear()
    finally:
        ctx.close()
        model.close()


@pytest.mark.parametrize("arch", HYBRIDS)
def test_a_prompt_that_leaves_the_cached_one_restores_a_checkpoint(files, arch, tmp_path):
    """The state is copied at the end of every prompt and answer (llama-server's context
    checkpoints): a next prompt that shares the last prompt but not the answer after it (an
    edited answer, a regenerated turn) restores the state at the prompt's end and computes only
    the rest (cache_n = that prompt), with a fresh Session's answer."""
    target = path_of(files, arch, "q8_0")
    cfg = SessionConfig(model=target, n_ctx=256, n_threads=2, repack="off", draft=POOL_DRAFT, gamma=4,
                        adaptive_gamma=False, pool=(PoolDevice("CPU", Budget(ratio=0.5)),), calibration_cache=tmp_path / "cal.json")
    with Session(cfg) as s:
        prompt = s.tokenize(PROMPT)
        first = s.complete(prompt, 12, (), GREEDY)
        edited = prompt + [t + 1 for t in first.tokens[:4]]
        second = s.complete(edited, 12, (), GREEDY)
        assert second.metrics.n_prompt_cached == len(prompt)
        assert s.ctx.n_replays == 0
    with Session(cfg) as fresh:
        assert second.tokens == fresh.complete(edited, 12, (), GREEDY).tokens
