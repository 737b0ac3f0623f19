"""Real files (issue 26): models written by llama.cpp's own converter and quantizer, held
against transformers (the implementation they come from), stock llama.cpp, and spac's own
target-only output on every path.

The files come from scripts/make_real_files.py (tiny random HF models of every MoE family in its
ARCHS, converted to F32/F16 by the pinned convert_hf_to_gguf.py, quantized to Q8_0/Q4_K_M (some families
also BF16, IQ4_XS, Q3_K_M, Q2_K or MXFP4_MOE: the types of CPU_EXACT's newer kernels) and a Q4_0
self-draft by stock llama-quantize), cached under runs/real-files/. For each file, three
prompts, 16 greedy tokens, compared by token id:

    reference   transformers' greedy tokens (float32); on F32 files spac's must equal them, except
                after a position where the reference's own top-1/top-2 margin is below EPS_REFERENCE
    stock       stock llama.cpp's `llama-simple` (its default: repacked weights) prints the same
                bytes as spac's target-only run with --no-exact --repack on (llama.cpp's kernels
                in llama.cpp's layouts; on a CPU with AMX, AMX hidden: stock's build has it
                compiled out, and the cell says so)
    target      spac target-only (--repack off: the layout every path below shares)
    pool10/25/50  the expert pool on a second CPU buffer with 10/25/50% of the expert bytes,
                every MoE layer split between pool and host, autoregressive
    pool-draft  speculative, the target drafting through its pool (25%)
    q4_0-draft  speculative with the Q4_0 self-draft (pool 25%, its routing as the lookahead)
    default     spac target-only with the default flags (--repack auto, exact mode on); where its
                layouts sum in another order than --repack off's, the cell notes where the
                texts part
    <path> auto every path above again with the default flags, against `default`

Every path must give its target's tokens exactly: the sessions' batch-invariant mode
(SessionConfig.exact) computes a verify pass's rows as one-token decodes. Every cell is listed
in the table that the module writes to runs/real-files/<key>/table.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

from conftest import LLAMA_CPP_TREE, compile_native, llama_common_dir

import make_real_files as mrf  # noqa: E402  (scripts/, on pytest's pythonpath)
from build_native import stock_program  # noqa: E402

from orchestrator.decoding.sampling import SamplingParams  # noqa: E402
from orchestrator.decoding.speculative import POOL_DRAFT, Session, SessionConfig  # noqa: E402
from orchestrator.runtime.llm import Context, Model  # noqa: E402
from orchestrator.runtime.native import NativeError  # noqa: E402
from orchestrator.runtime.pool import Budget, PoolDevice  # noqa: E402

EPS_REFERENCE = 1e-3  # F32 file against float32 transformers: summation order only (~1e-5)
ENGINE_PATHS = {"pool10": (0.10, None), "pool25": (0.25, None), "pool50": (0.50, None),
                "pool-draft": (0.25, POOL_DRAFT), "q4_0-draft": (0.25, "q4_0")}
DEFAULT = "auto"  # the suffix of a path run with the default flags
PATHS = ["reference", "stock", "target", *ENGINE_PATHS, "default", *(f"{p} {DEFAULT}" for p in ENGINE_PATHS)]
GREEDY = SamplingParams(temperature=0.0)


def first_mismatch(got: list[list[int]], want: list[list[int]]) -> tuple[int, int] | None:
    """(prompt, position) of the first token where got leaves want."""
    for p, (g, w) in enumerate(zip(got, want)):
        for i, (a, b) in enumerate(zip(g, w)):
            if a != b:
                return p, i
        if len(g) != len(w):
            return p, min(len(g), len(w))
    return None


def margins_of(model_path: Path, prompt_tokens: list[int], tokens: list[int]) -> np.ndarray:
    """Target-only's top-1/top-2 margin at every generated position (one prefill, then single
    tokens, as the target-only loop decodes): how near a tie a reported difference was."""
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


@contextlib.contextmanager
def as_stock_build():
    """spac's CPU buffer types as stock llama.cpp's build has them. Stock is built with AMX
    compiled out (its AMX matmul crashes unpatched, patch 0011), so on a CPU with AMX spac's
    choices run with it hidden (the switch users and tests have: SPAC_HIDE_CPU_FEATURES=amx).
    Yields what the cell should say about it ("" where nothing was hidden)."""
    from orchestrator.runtime import host_layout

    if "AMX" not in host_layout.cpu_buffer_types():
        yield ""
        return
    with mock.patch.dict(os.environ, {host_layout.HIDE_ENV: "amx"}):
        yield "AMX hidden: compiled out of stock's build"


@pytest.fixture(scope="module")
def files() -> Path:
    """The cached files, else built now (~1.5 min on 2 cores). Building needs the `test` extra's
    torch and transformers; only a run without them (CI's Python 3.10 pass, which leaves torch
    out) and without the cache skips."""
    if mrf.cached() is None:
        for dep in ("torch", "transformers", "tokenizers"):
            pytest.importorskip(dep, reason="building the real files needs the `test` extra (scripts/install.sh --test)")
    return mrf.build()


@pytest.fixture(scope="module")
def llama_simple() -> Path:
    return stock_program("llama-simple")


@dataclass
class Cell:
    """One (file, path): 'match', or the first mismatch (prompt, position) and its margin."""

    ok: bool = True
    first: tuple[int, int] | None = None   # (prompt, position); position -1: text only
    margin: float | None = None
    note: str = ""
    word: str = "tie"                      # what a tolerated difference is: tie | quantized

    def text(self) -> str:
        note = f" ({self.note})" if self.note else ""
        if self.first is None:
            return ("match" if not self.note.startswith("n/a") else "") + note
        p, i = self.first
        m = "" if self.margin is None else f", margin {self.margin:.2g}"
        return f"{self.word if self.ok else 'MISMATCH'} p{p}@{i}{m}" + note


@dataclass
class Table:
    rows: dict[tuple[str, str], dict[str, Cell]] = field(default_factory=dict)

    def markdown(self) -> str:
        out = ["| arch | type | " + " | ".join(PATHS) + " |", "|---|---|" + "---|" * len(PATHS)]
        for (arch, t), cells in self.rows.items():
            out.append(f"| {arch} | {t} | " + " | ".join(cells[p].text() if p in cells else "-" for p in PATHS) + " |")
        return "\n".join(out) + "\n"


@pytest.fixture(scope="module")
def table(files):
    t = Table()
    yield t
    (files / "table.md").write_text(t.markdown())
    print("\n" + t.markdown())


def special_piece(model: Model, token: int) -> bytes:
    """A token's text with control tokens rendered (llama-simple prints them; spac, like
    llama-server, leaves them out of the text)."""
    import ctypes

    import llama_cpp as L

    buf = ctypes.create_string_buffer(256)
    n = L.llama_token_to_piece(model.vocab, token, buf, len(buf), 0, True)
    return buf.raw[:n].split(b"\0")[0]  # llama-simple prints a piece with printf("%s")


def run_session(cfg: SessionConfig, prompts: list[str]) -> list[list[int]]:
    with Session(cfg) as s:
        return [s.complete(p, mrf.N_PREDICT, (), GREEDY).tokens for p in prompts]


def stock_tokens_bytes(exe: Path, path: Path, prompt: str) -> bytes:
    res = subprocess.run([str(exe), "-m", str(path), "-n", str(mrf.N_PREDICT), prompt], capture_output=True, timeout=120)
    assert res.returncode == 0, res.stderr.decode(errors="replace")[-2000:]
    return res.stdout


CASES = [(a, t) for a in mrf.ARCHS for t in mrf.types_of(a)]


@pytest.mark.parametrize("arch,ftype", CASES, ids=[f"{a}-{t}" for a, t in CASES])
def test_real_file(files, llama_simple, table, tmp_path_factory, arch, ftype):
    info = json.loads((files / arch / "reference.json").read_text())
    path = files / arch / info["files"][ftype]
    draft = files / arch / info["files"][mrf.DRAFT_TYPE]
    ref = info["reference"]
    prompts = [r["prompt"] for r in ref]
    cells: dict[str, Cell] = {}
    table.rows[(arch, ftype)] = cells
    cal = tmp_path_factory.mktemp("cal") / "calibration.json"
    base = dict(model=path, n_ctx=128, n_threads=2, calibration_cache=cal)

    # the file's tokenizer is the HF one: same prompt ids
    model = Model(path, repack="off")
    try:
        assert [model.tokenize(p) for p in prompts] == [r["prompt_tokens"] for r in ref], "tokenizer differs"
        eog = {t for t in range(model.n_vocab) if model.is_eog(t)}
        piece = {t: special_piece(model, t) for t in range(model.n_vocab)}
    finally:
        model.close()

    def text_of(prompt_tokens, tokens) -> bytes:
        """What llama-simple prints: every piece, control tokens too, up to an EOG token."""
        return b"".join(piece[t] for t in [*prompt_tokens, *tokens] if t not in eog)

    target = run_session(SessionConfig(**base, expert_engine=False, repack="off"), prompts)
    with as_stock_build() as hidden:  # llama.cpp's kernels and layouts, as llama-simple runs them
        target_on = run_session(SessionConfig(**base, expert_engine=False, repack="on", exact=False), prompts)

    # reference: spac's output is the reference's, up to an end-of-generation token
    want = []
    for r, got in zip(ref, target):
        toks = r["tokens"]
        cut = next((i + 1 for i, t in enumerate(toks) if t in eog), len(toks))
        want.append(toks[:cut])
    mm = first_mismatch(target, want)
    c = cells["reference"] = Cell()
    if mm is not None:
        c.first, c.margin = mm, ref[mm[0]]["margins"][mm[1]]
        c.ok = ftype != "f32" or c.margin < EPS_REFERENCE
        c.word = "tie" if ftype == "f32" else "quantized"

    # stock llama.cpp (llama-simple, repacked weights as upstream's default) against --repack on
    c = cells["stock"] = Cell(note=hidden)
    for p, (r, toks) in enumerate(zip(ref, target_on)):
        stock = stock_tokens_bytes(llama_simple, path, r["prompt"])
        if stock.rstrip(b"\n") != text_of(r["prompt_tokens"], toks).rstrip(b"\n"):
            c.ok, c.first, c.note = False, (p, -1), "; ".join(filter(None, (hidden, f"stock {stock!r}")))
            break
    if target_on != target:  # repacked kernels sum in another order: report where, with the margin
        p, i = first_mismatch(target_on, target)
        m = margins_of(path, ref[p]["prompt_tokens"], target[p])[i]
        cells["stock"].note = (cells["stock"].note + "; " if cells["stock"].note else "") + \
            f"repack on/off differ p{p}@{i}, margin {m:.2g}"

    cells["target"] = Cell(note=f"{sum(map(len, target))} tokens")

    # the default flags (--repack auto, exact mode on): their own target-only run is the reference
    # of their paths; where their layouts sum in another order than plain, say where the texts part
    default = run_session(SessionConfig(**base, expert_engine=False), prompts)
    cells["default"] = Cell(note=f"{sum(map(len, default))} tokens")
    if default != target:
        p, i = first_mismatch(default, target)
        m = margins_of(path, ref[p]["prompt_tokens"], target[p])[i]
        cells["default"].note += f"; --repack off differs p{p}@{i}, margin {m:.2g}"

    for name, (ratio, drafting) in ENGINE_PATHS.items():
        d = None if drafting is None else POOL_DRAFT if drafting == POOL_DRAFT else draft
        for column, flags, want in ((name, {"repack": "off"}, target), (f"{name} {DEFAULT}", {}, default)):
            cfg = SessionConfig(**base, expert_engine=True, pool=(PoolDevice("CPU", Budget(ratio=ratio)),), draft=d, gamma=4,
                                **flags)
            try:
                got = run_session(cfg, prompts)
            except NativeError as e:
                if "below one expert slot" not in str(e):
                    raise
                cells[column] = Cell(note="n/a: below one expert slot")
                continue
            c = cells[column] = Cell()
            mm = first_mismatch(got, want)
            if mm is not None:
                p, i = mm
                c.ok, c.first = False, mm
                c.margin = float(margins_of(path, ref[p]["prompt_tokens"], want[p])[i])

    bad = {p: c.text() for p, c in cells.items() if not c.ok}
    assert not bad, f"{arch} {ftype}: {bad}"


def test_a_layout_with_no_kernel_for_a_weights_op_leaves_it_plain(files, tmp_path, monkeypatch):
    """DeepSeek-V3's Q8_0 attn_k_b and attn_v_b are 3-D, read by a MUL_MAT batched over heads, which
    no repacked layout computes: with the dense Q8_0 weights given CPU_EXACT (forced here, whatever
    this CPU measured), `auto` keeps those two plain and says so, and the file runs (the default
    layout once put them in CPU_EXACT, and the scheduler stopped: GGML_ASSERT(*cur_backend_id != -1))."""
    from orchestrator.runtime import host_layout

    info = json.loads((files / "deepseek3" / "reference.json").read_text())
    path = files / "deepseek3" / info["files"]["q8_0"]
    monkeypatch.setenv("SPAC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(host_layout, "dense_layout", lambda ms: host_layout.EXACT_BUFT if host_layout.EXACT_BUFT in ms else "CPU")
    model = Model(path, repack="auto", n_threads=2, exact=True)
    try:
        fallbacks = model.layout.fallbacks
        batched = [n for n, _, ne in host_layout.read_weights(path).tensors if n.endswith(("attn_k_b.weight", "attn_v_b.weight"))]
        assert batched and set(batched) <= set(fallbacks), fallbacks  # (and the 484-row output head: no row group)
        assert set(fallbacks.values()) == {host_layout.EXACT_BUFT} and model.layout.placed[host_layout.EXACT_BUFT]
        assert "plain where their layout has no kernel for their op" in model.layout.report()
        ctx = Context(model, n_ctx=64, n_batch=16, n_threads=2)
        try:
            ctx.decode(model.tokenize(info["reference"][0]["prompt"]), logits_all=False)
            assert np.isfinite(ctx.logits()[-1]).all()
        finally:
            ctx.close()
    finally:
        model.close()


# ----------------------------------------------------------------------------- chat templates

RENDER_SRC = Path(__file__).with_name("render_chat.cpp")
CONVERSATION = [
    {"role": "system", "content": "You are a tiny random model."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "<think>\nThe user asks about France.\n</think>\n\nParis."},
    {"role": "user", "content": "And of Italy?"},
]


def render_tool():
    """A small program over llama.cpp's common chat code (what llama-server and llama-cli call:
    common_chat_templates_init/apply with their defaults), linked to the build's common lib."""
    bin_dir = llama_common_dir()
    assert bin_dir is not None, "llama.cpp's common library is not in vendor/build (run scripts/build_native.py)"
    extra = [f"-I{LLAMA_CPP_TREE / 'common'}", f"-L{bin_dir}", "-lllama-common", f"-Wl,-rpath,{bin_dir}"]
    return compile_native([RENDER_SRC], "render-chat", cxx=True, libs=("llama", "ggml", "ggml-base"), extra=extra)


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_chat_template_renders_as_llama_cpp(files, arch):
    """`spac chat` and `spac serve` turn a conversation into prompt tokens through
    Session.chat_tokens: its text and tokens equal what llama.cpp's own chat code renders from
    the model's template (Qwen3's with its <think> handling; gpt-oss's harmony format)."""
    info = json.loads((files / arch / "reference.json").read_text())
    path = files / arch / info["files"]["q8_0"]
    res = subprocess.run([str(render_tool()), str(path)], input=json.dumps(CONVERSATION), capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-3000:]
    theirs = res.stdout
    with Session(SessionConfig(model=path, expert_engine=False, n_ctx=256, repack="off")) as s:
        ours = s.chat_template.render(CONVERSATION, add_generation_prompt=True)
        assert ours == theirs
        # llama-server tokenizes a rendered prompt with special tokens parsed and BOS as the vocab says
        assert s.chat_tokens(CONVERSATION) == s.target.tokenize(theirs, add_special=True, parse_special=True)


def test_serve_renders_the_chat_template_as_llama_cpp(files, tmp_path):
    """`spac serve`'s /v1/chat/completions: the prompt is llama.cpp's rendering of the model's
    template (usage.prompt_tokens), and the answer is the target's greedy continuation of it."""
    import httpx

    from test_serve import Server

    info = json.loads((files / "qwen3moe" / "reference.json").read_text())
    path = files / "qwen3moe" / info["files"]["q8_0"]
    res = subprocess.run([str(render_tool()), str(path)], input=json.dumps(CONVERSATION), capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-3000:]
    import os

    server = Server(["-m", str(path), "--no-engine", "--draft", "none", "-c", "256", "-t", "2", "--temp", "0",
                     "--repack", "off"], dict(os.environ, SPAC_CACHE_DIR=str(tmp_path)))
    try:
        server.wait_ready()
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                       json={"messages": CONVERSATION, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
    finally:
        server.stop()
    with Session(SessionConfig(model=path, expert_engine=False, n_ctx=256, repack="off")) as s:
        tokens = s.target.tokenize(res.stdout, add_special=True, parse_special=True)
        assert body["usage"]["prompt_tokens"] == len(tokens)
        assert body["choices"][0]["message"]["content"] == s.complete(tokens, 8, (), GREEDY).text
