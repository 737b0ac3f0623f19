"""The pool draft (issue 17): a second context on the target's own model whose MoE layers route
only among the experts resident in the expert pool and compute on the pool device alone.

- lossless: greedy output with the pool draft equals target-only greedy decoding, on the
  speculative tests' prompts and on every architecture of the split tests;
- masked routing: the draft's routing export holds resident experts only (as many as a layer
  has, up to top-k), and the unmasked router's choice (the lookahead) is exported beside it;
- everything resident: the draft computes exactly what the target does;
- the pool draft is dropped (autoregressive) when there is no pool; the CLI options default to it;
- on a real second device (RPC) the draft's experts run there, with no host half.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from orchestrator.decoding.speculative import POOL_DRAFT, Session, SessionConfig
from orchestrator.runtime.llm import Context, Model
from orchestrator.runtime.native import ExpertEngine, NativeError, Routing, engine_built
from orchestrator.runtime.pool import Budget, PoolDevice
from orchestrator.policies.plan import Plan
from engine_common import rpc_main, run_in_own_process
from test_engine_archs import ARCHS, arch_models  # noqa: F401 - the module-scoped fixture
from test_speculative import models, prompts, target_greedy  # noqa: F401

pytestmark = pytest.mark.skipif(not engine_built(), reason="native engine not built")

N_TOKENS = 48


def pool_session(path, tmp_path, draft=POOL_DRAFT, **kw) -> Session:
    # a fixed γ: the governor may rightly stop drafting on a random model, and these tests need drafts
    cfg = dict(model=path, draft=draft, gamma=4, adaptive_gamma=False, n_ctx=256, n_threads=1, expert_engine=True,
               pool=(PoolDevice("CPU", Budget(ratio=0.5)),), calibration_cache=tmp_path / "cal.json")
    cfg.update(kw)
    return Session(SessionConfig(**cfg))


def check_masked_routing(s: Session, tokens: list[int]) -> None:
    """Decode `tokens` on the draft context with the pool idle: every token's experts are the
    resident ones the router ranks highest (all of them when a layer has fewer than top-k)."""
    assert s.engine.wait_idle()
    resident = s.engine.residency() >= 0
    routing = Routing(s.draft_ctx.ptr, s.engine.n_expert_used)
    s.draft_ctx.decode(tokens, logits_all=True)  # (the last layer computes the output rows only)
    ids = routing.last()[0].copy()
    unmasked = routing.unmasked()
    assert unmasked is not None and unmasked.shape == ids.shape
    k = s.engine.n_expert_used
    n_same = 0
    for m in range(ids.shape[0]):
        n_res = int(resident[m].sum())
        for t in range(ids.shape[1]):
            assert resident[m, ids[m, t]].sum() == min(k, n_res), (m, t, ids[m, t], np.flatnonzero(resident[m]))
            if resident[m, unmasked[m, t]].all():  # the router's own choice is resident: unchanged
                assert set(ids[m, t]) == set(unmasked[m, t])
                n_same += 1
    assert n_same < ids.shape[0] * ids.shape[1], "the mask never changed a choice: nothing was tested"
    routing.disable()


def test_pool_draft_is_lossless(models, tmp_path):
    refs = [target_greedy(models["target"], p, N_TOKENS) for p in prompts(6)]
    with pool_session(models["target"], tmp_path) as s:
        assert s.mode == "speculative" and s.draft is s.target and len(s._models) == 1
        for prompt, ref in zip(prompts(6), refs):
            assert s.complete(prompt, max_tokens=N_TOKENS).tokens == ref
        m = s.last_metrics
        assert m.n_drafted > 0 and m.n_accepted > 0
        print(f"pool draft: {m.summary()}")
        # the policy's lookahead is the unmasked router's choice of the tokens being drafted
        unmasked, seen = [], []
        s.draft_routing.unmasked = lambda f=s.draft_routing.unmasked: unmasked.append(f()) or unmasked[-1]
        s.policy.draft_plan = lambda rows, resident, f=s.policy.draft_plan: seen.append(rows[-1].copy()) or f(rows, resident)
        s.complete(prompts(1, seed=5)[0], max_tokens=16)
        assert len(seen) == len(unmasked) > 0
        for rows, u in zip(seen, unmasked):
            np.testing.assert_array_equal(rows, u[:, -1, :])
        del s.draft_routing.unmasked, s.policy.draft_plan
        check_masked_routing(s, prompts(1, seed=3)[0])


def greedy(ctx: Context, prompt: list[int], n: int) -> list[int]:
    """Target alone, one token per decode, argmax."""
    ctx.clear()
    ctx.decode(prompt, logits_all=False)
    out = []
    for _ in range(n):
        out.append(int(ctx.logits()[-1].argmax()))
        ctx.decode([out[-1]], logits_all=False)
    return out


def speculative_greedy(ctx: Context, dctx: Context, engine: ExpertEngine, prompt: list[int], n: int,
                       gamma: int = 3, seed: int = 0) -> tuple[list[int], int]:
    """Session's loop in a few lines (draft γ on dctx, verify on ctx, accept, trim), a random plan
    handed to the copy worker before every drafting: (tokens, accepted drafts)."""
    rng = np.random.default_rng(seed)
    L, E = engine.n_moe_layers, engine.n_expert
    ctx.clear()
    dctx.clear()
    tokens = list(prompt)
    ctx.decode(tokens[:-1], logits_all=False)
    n_accepted = 0
    while len(tokens) - len(prompt) < n:
        engine.set_plan(Plan(rng.integers(0, 5, (L, E)).astype(np.uint8), rng.integers(1, 5, L).astype(np.int32)))
        drafts, feed = [], tokens[dctx.n_past:]
        for _ in range(gamma):
            dctx.decode(feed, logits_all=False)
            drafts.append(int(dctx.logits()[-1].argmax()))
            feed = drafts[-1:]
        base = len(tokens)
        ctx.decode([tokens[-1], *drafts], logits_all=True)
        logits = ctx.logits()
        a = 0
        while a < len(drafts) and int(logits[a].argmax()) == drafts[a]:
            a += 1
        tokens += [*drafts[:a], int(logits[a].argmax())]
        n_accepted += a
        ctx.trim(base + a)
        dctx.trim(min(dctx.n_past, base + min(a, gamma - 1)))
    return tokens[len(prompt):len(prompt) + n], n_accepted


@pytest.mark.parametrize("arch", ARCHS)
def test_pool_draft_is_lossless_on(arch_models, arch):  # noqa: F811
    """Every architecture of the split tests (shared experts, biases, MLA, ...): the target,
    verifying a pool draft of its own model while plans change the pool, decodes what it
    decodes alone; the draft's routing stays inside the pool."""
    path = arch_models / f"{arch}-moe.gguf"
    model = Model(path, repack="off")
    ctx = Context(model, n_ctx=128, n_batch=16, n_threads=1)
    dctx = Context(model, n_ctx=128, n_batch=16, n_threads=1)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    try:
        ref = greedy(ctx, prompt, 24)
        with ExpertEngine(ctx.ptr, path, budget_ratio=0.5) as engine:
            engine.attach_draft(dctx.ptr)
            routing = Routing(dctx.ptr, engine.n_expert_used)
            out, n_accepted = speculative_greedy(ctx, dctx, engine, prompt, 24)
            assert out == ref
            print(f"{arch}: {n_accepted} drafts accepted for 24 tokens")
            assert engine.wait_idle()
            resident = engine.residency() >= 0
            dctx.decode([7, 11, 13], logits_all=True)
            ids = routing.last()[0]
            k = engine.n_expert_used
            for m in range(ids.shape[0]):
                n_res = int(resident[m].sum())
                assert all(resident[m, row].sum() == min(k, n_res) for row in ids[m])
            assert routing.unmasked() is not None
    finally:
        dctx.close()
        ctx.close()
        model.close()


def everything_resident(path, device: str | None, check) -> None:
    """Target and pool draft contexts on one model, every expert in the pool (on `device`), the
    draft attached: check(ctx, dctx, engine, tokens, reference logits of the target)."""
    model = Model(path, repack="off")
    ctx = Context(model, n_ctx=64, n_batch=16, n_threads=2)
    # the layers stay on the host here, and llama.cpp's op offload would move any op that reads a
    # host weight and has 32 rows to a GPU (ggml-cuda counts rows, not tokens): Qwen3's per-head
    # q-norm multiply on these 8 tokens x 4 heads is 32 rows, so on CUDA each layer gained a
    # round trip (16 crossings for 4 layers) that the RPC device, which never offloads, cannot show
    dctx = Context(model, n_ctx=64, n_batch=16, n_threads=2, op_offload=False)
    tokens = [5, 17, 42, 99, 7, 250, 31, 64]
    try:
        ctx.decode(tokens, logits_all=True)
        reference = ctx.logits().copy()
        with ExpertEngine(ctx.ptr, path, device=device, budget_ratio=1.0) as engine:
            L, E = engine.n_moe_layers, engine.n_expert
            engine.set_plan(Plan(np.full((L, E), 4, np.uint8), np.ones(L, np.int32)))
            assert engine.wait_idle(60) and (engine.residency() >= 0).all()
            engine.attach_draft(dctx.ptr)
            dctx.decode(tokens, logits_all=True)
            check(ctx, dctx, engine, tokens, reference)
        # the engine is gone: the draft context is the plain model again
        dctx.clear()
        dctx.decode(tokens, logits_all=True)
        np.testing.assert_array_equal(dctx.logits(), reference)
    finally:
        dctx.close()
        ctx.close()
        model.close()


def test_everything_resident_drafts_exactly_the_target(models):
    """With every expert in the pool the mask changes nothing: the draft's logits are the target's."""
    def check(ctx, dctx, engine, tokens, reference):
        np.testing.assert_array_equal(dctx.logits(), reference)
        with pytest.raises(NativeError, match="already"):
            engine.attach_draft(dctx.ptr)
        with pytest.raises(NativeError, match="second context"):
            engine.attach_draft(ctx.ptr)
        # the draft's decodes leave the target's unchanged
        ctx.clear()
        ctx.decode(tokens, logits_all=True)
        np.testing.assert_array_equal(ctx.logits(), reference)

    everything_resident(models["target"], None, check)


def test_no_pool_no_pool_draft(models, tmp_path):
    with pool_session(models["target"], tmp_path, expert_engine=False) as s:
        assert s.draft is None and s.draft_ctx is None and s.mode == "autoregressive" and s.gamma == 0
        assert len(s.complete(prompts(1)[0], max_tokens=4).tokens) == 4


def test_options_default_to_the_pool_draft(models):
    """-m without -md: the pool draft when the pool is on; --draft none, the pool off or -md: not."""
    from orchestrator.cli.options import RunOptions
    from orchestrator.cli.setup import session_setup

    def setup(**kw):
        return session_setup(RunOptions.of(model=models["target"], **kw))

    assert setup(pool=(PoolDevice("CPU"),)).config.draft == POOL_DRAFT
    assert setup(pool=(PoolDevice("CPU"),), draft="pool").config.draft == POOL_DRAFT
    s = setup(pool=(PoolDevice("CPU"),), draft="none")
    assert s.config.draft.none and "no draft (--draft none)" in s.notes
    s = setup(expert_engine=False)
    assert s.config.draft.none and any("no draft (-md" in n for n in s.notes)
    assert setup(pool=(PoolDevice("CPU"),), model_draft=models["self_draft"]).config.draft.path == models["self_draft"]


def check_pool_draft_on_rpc_device(device: str, tmp: Path) -> None:
    """The pool on a real second device: the draft context's device half is pinned to its own
    backend of that device; everything resident, it computes what the target computes."""
    from engine_common import model_config
    from orchestrator.gguf_files.gguf_export import make_random_model
    from orchestrator.runtime.native import graph_crossings, graph_n_crossings

    def check(ctx, dctx, engine, tokens, reference):
        np.testing.assert_allclose(dctx.logits(), reference, rtol=1e-4, atol=1e-4 * np.abs(reference).max())
        # the experts ran on the device, and no host half: one crossing there and back per MoE layer at most
        # (the message names the nodes where the backend changes)
        n = graph_n_crossings(dctx.ptr)
        named = graph_crossings(dctx.ptr)
        assert len(named) == n
        assert 0 < n <= 2 * engine.n_moe_layers, (n, engine.n_moe_layers, named)

    path = make_random_model(tmp / "m.gguf", model_config("qwen3moe"), seed=2, dtype="f32", quant="q8_0")
    everything_resident(path, device, check)


def test_pool_draft_on_rpc_device(tmp_path):
    run_in_own_process(__file__, tmp_path)


if __name__ == "__main__":
    rpc_main(check_pool_draft_on_rpc_device)
