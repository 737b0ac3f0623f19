"""The MTP head as a draft (issue 40, `orchestrator.decoding.mtp_draft`, patch 0020).

On scripts/make_real_files.py's qwen35moe-mtp and qwen3next-mtp files (tiny random Qwen3.5-MoE
and Qwen3-Next hybrids with one MTP layer, converted by llama.cpp's own converter with their
`mtp.*` weights):

    lossless   greedy tokens with `--draft mtp` equal target-only's, F32 and Q8_0, with the expert
               pool on (a second CPU buffer, 25%) and off, over prompts that reuse the cache
    pairing    each step's catch-up pairs every token with the target's hidden state of the
               position before it: the head's logits equal those of a fresh MTP context fed the
               whole sequence and the hidden states of one target pass over it
    pool       loading the MTP block leaves the expert pool and the routing export on the trunk's
               MoE layers (patch 0020)
    errors     `--draft mtp` on a target without MTP layers: exit 2, one line naming the file
"""

from __future__ import annotations

import ctypes
import json

import numpy as np
import pytest
from typer.testing import CliRunner

import make_real_files as mrf  # noqa: E402  (scripts/, on pytest's pythonpath)

import llama_cpp as L
from orchestrator.cli.main import app
from orchestrator.decoding.mtp_draft import MTP_DRAFT, MtpDraft, mtp_layers
from orchestrator.decoding.sampling import SamplingParams
from orchestrator.decoding.speculative import Session, SessionConfig
from orchestrator.runtime.llm import Context, Model, ModelError
from orchestrator.runtime.native import ExpertEngine, Routing, engine_built, lib
from orchestrator.runtime.pool import Budget, PoolDevice
from orchestrator.gguf_files.gguf_export import make_random_model, tiny_config

ARCHS = ["qwen35moe-mtp", "qwen3next-mtp"]
GREEDY = SamplingParams(temperature=0.0)
N_TOKENS = 24
runner = CliRunner()


@pytest.fixture(scope="module")
def real_files():
    """The MTP real files, arch -> type -> path (cached under runs/real-files/, else built: ~1 min)."""
    if mrf.cached(archs=ARCHS) is None:
        for dep in ("torch", "transformers", "tokenizers"):
            pytest.importorskip(dep, reason="building the real files needs the `test` extra (scripts/install.sh --test)")
    out = mrf.build(archs=ARCHS)
    infos = {a: json.loads((out / a / "reference.json").read_text()) for a in ARCHS}
    return {a: {t: out / a / f for t, f in info["files"].items()} for a, info in infos.items()}


@pytest.fixture
def files(real_files):
    return real_files[ARCHS[0]]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPAC_CACHE_DIR", str(tmp_path / "cache"))


def run(cfg: SessionConfig) -> tuple[list[list[int]], list[list[int]], dict]:
    """Greedy tokens of every prompt, then of a second turn on the last one (its prompt, its
    output and more: the cache keeps the prefix); the prompts' tokens; what the session was."""
    with Session(cfg) as s:
        prompts = [s.tokenize(p) for p in mrf.PROMPTS]
        out = [s.complete(p, N_TOKENS, (), GREEDY).tokens for p in prompts]
        prompts.append(prompts[-1] + out[-1] + s.tokenize(" and the router")[:3])
        out.append(s.complete(prompts[-1], N_TOKENS, (), GREEDY).tokens)
        return out, prompts, dict(mode=s.mode, mtp=isinstance(s.draft_ctx, MtpDraft), pool=s.engine is not None,
                                  n_drafted=s.last_metrics.n_drafted, n_prompt_cached=s.last_metrics.n_prompt_cached)


LOSSLESS = [(ARCHS[0], t, pool) for t in ("f32", "q8_0") for pool in ("off", "on")] + \
    [(ARCHS[1], "f32", "off"), (ARCHS[1], "q8_0", "on")]


@pytest.mark.parametrize("arch,ftype,pool", LOSSLESS, ids=["-".join(c) for c in LOSSLESS])
def test_mtp_draft_is_lossless(real_files, tmp_path, arch, ftype, pool):
    if pool == "on" and not engine_built():
        pytest.skip("native engine not built")
    files = real_files[arch]
    base = dict(model=files[ftype], n_ctx=256, n_threads=2, repack="off", calibration_cache=tmp_path / "cal.json")
    want, prompts, _ = run(SessionConfig(**base, expert_engine=False))
    engine = dict(expert_engine=True, pool=(PoolDevice("CPU", Budget(ratio=0.25)),)) if pool == "on" else dict(expert_engine=False)
    for adaptive in (False, True):  # every step drafts γ = 4; then γ as the governor picks it
        got, _, s = run(SessionConfig(**base, **engine, draft=MTP_DRAFT, gamma=4, adaptive_gamma=adaptive))
        assert s["mode"] == "speculative" and s["mtp"] and s["pool"] == (pool == "on")
        assert got == want
        assert s["n_prompt_cached"] > 0 and (s["n_drafted"] > 0 or adaptive)


def test_mtp_draft_samples(files):
    """Sampling (rejection sampling against the head's distribution): the same seed gives the
    same tokens, as with any draft."""
    cfg = SessionConfig(model=files["q8_0"], n_ctx=256, n_threads=2, repack="off", expert_engine=False, draft=MTP_DRAFT, gamma=3)
    sampling = SamplingParams(temperature=0.8, top_k=40, seed=7)
    with Session(cfg) as s:
        runs = [s.complete(mrf.PROMPTS[0], 16, (), sampling) for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens and len(runs[0].tokens) > 0
    assert runs[0].metrics.n_drafted > 0


def reference_logits(path, tokens: list[int]) -> np.ndarray:
    """The head's next-token logits after `tokens`, computed from scratch: one target pass over
    tokens[:-1] for their hidden states, then one MTP decode of every token at position q
    paired with the state of q - 1 (zeros at 0), as common/speculative.cpp pairs them."""
    f = lib()
    model = Model(path, repack="off", mtp=True)
    ctx = Context(model, n_ctx=256, n_batch=256, n_threads=2)
    params = L.llama_context_default_params()
    params.ctx_type = L.LLAMA_CONTEXT_TYPE_MTP
    params.n_ctx, params.n_batch, params.n_ubatch = 256, 256, 256
    mctx = L.llama_init_from_model(model.ptr, params)
    batch = L.llama_batch_ext_init(mctx)
    try:
        n_embd = L.llama_model_n_embd_out(model.ptr)
        f["set_embeddings_nextn"](ctx.ptr, True, False)
        ctx.decode(tokens[:-1], logits_all=False)
        addr = f["get_embeddings_nextn"](ctx.ptr)
        states = np.ctypeslib.as_array((ctypes.c_float * ((len(tokens) - 1) * n_embd)).from_address(addr))
        states = np.concatenate([np.zeros(n_embd, np.float32), states])  # row q: the state of q - 1
        for q, t in enumerate(tokens):
            idx = L.llama_batch_ext_add_token(batch, 0, t)
            L.llama_batch_ext_set_pos(batch, idx, (ctypes.c_int32 * 1)(q))
            row = states[q * n_embd:(q + 1) * n_embd]
            assert L.llama_batch_ext_set_embd_token(
                batch, idx, L.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, n_embd))
        L.llama_batch_ext_set_output_logits(batch, len(tokens) - 1, True)
        assert L.llama_process(mctx, L.LLAMA_PROCESS_TYPE_DECODE, batch) == 0
        return np.ctypeslib.as_array(L.llama_get_logits(mctx), shape=(model.n_vocab,)).copy()
    finally:
        L.llama_batch_ext_free(batch)
        L.llama_free(mctx)
        ctx.close()
        model.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_catch_up_pairs_each_token_with_the_previous_state(real_files, arch):
    """Every step's first draft comes from the head fed the sequence so far: its logits equal
    `reference_logits` of that sequence (F32: the verify passes' states round as one pass's do)."""
    seen: list[tuple[list[int], np.ndarray]] = []
    cfg = SessionConfig(model=real_files[arch]["f32"], n_ctx=256, n_threads=2, repack="off", expert_engine=False, draft=MTP_DRAFT,
                        gamma=3, adaptive_gamma=False)
    with Session(cfg) as s:
        dctx = s.draft_ctx
        decode = dctx.decode

        def spy(tokens, logits_all=False):
            catch_up = dctx._fork_at is None
            decode(tokens, logits_all)
            if catch_up:
                seen.append((list(s._tokens), dctx.logits()[-1].copy()))

        dctx.decode = spy
        s.complete(mrf.PROMPTS[1], 12, (), GREEDY)
    assert len(seen) >= 4
    for tokens, got in seen:
        want = reference_logits(real_files[arch]["f32"], tokens)
        assert int(got.argmax()) == int(want.argmax())
        np.testing.assert_allclose(got, want, atol=1e-3 * float(np.abs(want).max()))


@pytest.mark.skipif(not engine_built(), reason="native engine not built")
def test_mtp_block_is_not_a_pool_layer(files):
    """Patch 0020: with the MTP block loaded, the pool and the routing export hold the trunk's
    MoE layers, as without it (the block's experts run only in the MTP context)."""
    shapes = []
    for mtp in (False, True):
        model = Model(files["f32"], repack="off", mtp=mtp)
        ctx = Context(model, n_ctx=128, n_batch=32, n_threads=2, rollback=4)
        engine = ExpertEngine(ctx.ptr, files["f32"], device="CPU", budget_ratio=0.25)
        try:
            routing = Routing(ctx.ptr, engine.n_expert_used)
            ctx.decode(model.tokenize(mrf.PROMPTS[0]))
            ids = routing.last()[0]
            assert (ids >= 0).all()  # every exported layer was routed by the target
            shapes.append((engine.n_moe_layers, engine.stats()["n_slots"], routing.n_moe_layers, ids.shape))
        finally:
            engine.close()
            ctx.close()
            model.close()
    assert mtp_layers_of(files["f32"]) == 1
    assert shapes[0] == shapes[1] and shapes[0][0] == mrf.N_LAYER


def mtp_layers_of(path) -> int:
    model = Model(path, repack="off")
    try:
        return mtp_layers(model)
    finally:
        model.close()


def test_cli_draft_mtp(files):
    """`spac generate --draft mtp`: the target's tokens, drafted by its MTP head; a file with an MTP
    head drafts with it by default (setup.session_setup), pool or not."""
    args = ["generate", mrf.PROMPTS[1], "-m", str(files["q8_0"]), "-n", "16", "--temp", "0", "-t", "2", "-c", "256",
            "--json", "--repack", "off", "--no-engine"]
    r = runner.invoke(app, [*args, "--draft", "none"])
    assert r.exit_code == 0, r.output
    want = json.loads(r.stdout.strip().splitlines()[-1])
    r = runner.invoke(app, [*args, "--draft", "mtp", "--draft-max", "3"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["draft"] == "mtp" and got["mode"] == "speculative"
    assert got["tokens"] == want["tokens"]
    r = runner.invoke(app, [*args, "--draft-max", "3"])
    assert r.exit_code == 0, r.output
    default = json.loads(r.stdout.strip().splitlines()[-1])
    assert default["draft"] == "mtp" and default["tokens"] == want["tokens"]


def test_draft_mtp_without_mtp_layers(tmp_path):
    """A target without MTP layers: one line naming the file, exit 2 (the CLI); ModelError (the API)."""
    target = make_random_model(tmp_path / "no-mtp.gguf", tiny_config("qwen3moe", n_layer=2, n_embd=64, n_expert=8,
                                                                     n_expert_used=2, n_ff_exp=64), seed=1)
    r = runner.invoke(app, ["generate", "hi", "-m", str(target), "--draft", "mtp", "--no-engine", "-n", "4"])
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(target) in lines[0] and "MTP" in lines[0], r.stderr
    with pytest.raises(ModelError, match="no MTP layers"):
        Session(SessionConfig(model=target, draft=MTP_DRAFT, expert_engine=False, n_ctx=64))
    r = runner.invoke(app, ["generate", "hi", "-m", str(target), "-md", str(target), "--draft", "mtp"])
    assert r.exit_code == 2 and "exclusive" in r.stderr
