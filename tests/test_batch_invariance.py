"""Batch invariance (ggml-cpu's batch-invariant mode, patch 0022; `SessionConfig.exact`, on by
default): a verify pass of up to γ+1 tokens computes every row bit for bit as a one-token decode
does, so greedy speculative output is exactly target-only output. Checked per op (every weight
type, CPU buffer type, MUL_MAT and MUL_MAT_ID, batches 1..γ+1) and per model (the whole verify
path: matmuls, flash attention, norms, the recurrent layers of a hybrid), on each host layout.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from orchestrator.decoding.speculative import EXACT_ROWS
from orchestrator.runtime import host_layout
from orchestrator.runtime.llm import Context, Model
from orchestrator.runtime.native import engine_built, model_tensor_buft
from orchestrator.gguf_files.gguf_export import make_random_model, tiny_config

pytestmark = pytest.mark.skipif(not engine_built(), reason="needs the patched llama.cpp")

GAMMA_MAX = 8
ROWS = GAMMA_MAX + 1  # the largest verify pass
OP_TYPES = ("f16", "bf16", "q4_0", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs", "mxfp4")
FILE_TYPES = ("q4_0", "q8_0", "q2_k", "q3_k_m", "q4_k_m", "q5_k_m", "q6_k", "iq4_nl", "iq4_xs", "mxfp4_moe")
# rows of 256 (the K-quants' block) so that a K-quant file really holds K-quants; 8 | rows for repacking
CFG = tiny_config("qwen3moe", n_layer=2, n_embd=256, n_expert=8, n_expert_used=2, n_ff_exp=256)


@pytest.fixture(autouse=True)
def batch_invariant():
    host_layout.set_batch_invariant_rows(EXACT_ROWS)  # what a session sets
    yield
    host_layout.set_batch_invariant_rows(0)


@pytest.fixture(autouse=True)
def layout_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPAC_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("type_name", OP_TYPES)
def test_every_matmul_row_equals_one_row(type_name):
    """Each CPU buffer type that takes the weight (plain, CPU_REPACK, AMX), MUL_MAT (a dense
    weight) and MUL_MAT_ID (experts; 8 experts, 2 per token, so an expert gets up to 9 rows): the
    rows of an n-token matmul, n = 1..γ+1, are the rows of n one-token matmuls, 1 and 2 threads."""
    ggml_type = int(GGMLQuantizationType[type_name.upper()])
    rng = np.random.default_rng(0)
    n_in, n_out = 512, 64
    checked = 0
    for buft_name, buft in host_layout.cpu_buffer_types().items():
        for n_expert, n_used in ((0, 1), (8, 2)):
            xs = rng.standard_normal((ROWS, n_used, n_in), dtype=np.float32)
            ids = np.argsort(rng.random((ROWS, n_expert)), axis=1)[:, :n_used].astype(np.int32) if n_expert else None

            def run(start, n, threads=1):
                return host_layout.matmul_output(ggml_type, n_in, n_out, n_expert, xs[start:start + n],
                                                 None if ids is None else ids[start:start + n], buft, threads)

            first = run(0, 1)
            if first is None:
                continue  # this buffer type does not take the weight
            single = np.concatenate([first] + [run(i, 1) for i in range(1, ROWS)])
            for n in range(2, ROWS + 1):
                for threads in (1, 2):
                    got = run(0, n, threads)
                    assert got.tobytes() == single[:n].tobytes(), \
                        f"{type_name} {buft_name} {'MUL_MAT_ID' if n_expert else 'MUL_MAT'}: n={n}, {threads} threads"
            checked += 1
    assert checked >= 2  # at least the plain layout's MUL_MAT and MUL_MAT_ID


@pytest.mark.parametrize("type_name", [t for t in OP_TYPES if t not in ("f16", "bf16")])
def test_exact_rows_equal_one_row_at_prompt_batches(type_name):
    """CPU_EXACT's quantized kernels sum every output in one order at any batch, not only up to
    the verify sizes: a dense weight's rows of a 16-, 64- and 512-token matmul (register tiles of
    8 tokens, several threads) are one-token matmuls' bits. F16 and BF16 prompts keep llama.cpp's
    GEMM (above the batch-invariant rows), so they are held to this up to γ+1 only."""
    ggml_type = int(GGMLQuantizationType[type_name.upper()])
    buft = host_layout.cpu_buffer_types()[host_layout.EXACT_BUFT]
    rng = np.random.default_rng(1)
    n_in, n_out, n_max = 512, 64, 512
    xs = rng.standard_normal((n_max, 1, n_in), dtype=np.float32)
    single = np.concatenate([host_layout.matmul_output(ggml_type, n_in, n_out, 0, xs[i:i + 1], None, buft, 1)
                             for i in range(n_max)])
    for n in (16, 64, 512):
        got = host_layout.matmul_output(ggml_type, n_in, n_out, 0, xs[:n], None, buft, 2)
        assert got.tobytes() == single[:n].tobytes(), f"{type_name} CPU_EXACT MUL_MAT: n={n}"


def verify_rows_match_decodes(model: Model, prompt: list[int], tokens: list[int], n_ctx: int = 128,
                              rollback: int = 0) -> None:
    """Logits of `tokens[:n]` decoded as one batch after `prompt`, n = 1..len(tokens), equal those
    of the same tokens decoded one at a time, bit for bit."""
    ctx = Context(model, n_ctx=n_ctx, n_batch=64, n_threads=2, rollback=rollback)
    try:
        ctx.decode(prompt, logits_all=False)
        singles = []
        for t in tokens:
            ctx.decode([t])
            singles.append(ctx.logits()[-1].copy())
        want = np.stack(singles)
        for n in range(1, len(tokens) + 1):
            ctx.clear()
            ctx.decode(prompt, logits_all=False)
            ctx.decode(tokens[:n])
            got = ctx.logits()
            assert got.tobytes() == want[:n].tobytes(), \
                f"{model.path.name}: a {n}-token pass differs from one-token decodes (rows {np.flatnonzero((got != want[:n]).any(axis=1)).tolist()})"
    finally:
        ctx.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("invariance")
    return {q: make_random_model(d / f"m-{q}.gguf", CFG, seed=3, quant=q) for q in FILE_TYPES}


@pytest.mark.parametrize("repack", ["off", "on"])
@pytest.mark.parametrize("quant", FILE_TYPES)
def test_a_verify_pass_gives_the_one_token_logits(files, quant, repack):
    """The whole target, plain and repacked layout: attention (flash, F16 cache), norms, router,
    experts, output head."""
    model = Model(files[quant], repack=repack)
    try:
        rng = np.random.default_rng(1)
        verify_rows_match_decodes(model, rng.integers(0, 256, 12).tolist(), rng.integers(0, 256, ROWS).tolist())
    finally:
        model.close()


def test_a_verify_pass_past_512_cached_tokens(files):
    """From 512 cached tokens on, one-token flash attention would split the cache over threads
    (llama.cpp's split-KV path), which sums in another order: the mode keeps it on one path."""
    model = Model(files["q4_k_m"], repack="on")
    try:
        rng = np.random.default_rng(2)
        verify_rows_match_decodes(model, rng.integers(0, 256, 520).tolist(), rng.integers(0, 256, ROWS).tolist(),
                                  n_ctx=1024)
    finally:
        model.close()


@pytest.mark.parametrize("quant", ["q8_0", "q4_k_m"])
def test_a_hybrids_verify_pass_gives_the_one_token_logits(tmp_path, quant):
    """Qwen3.5/3.6-MoE: linear-attention layers with a recurrent state (snapshots kept for the
    rollback, as a speculative session keeps them) between the attention layers."""
    path = make_random_model(tmp_path / "hybrid.gguf", tiny_config("qwen35moe", n_embd=256, n_ff_exp=256), seed=4,
                             quant=quant)
    model = Model(path, repack="on")
    try:
        rng = np.random.default_rng(3)
        verify_rows_match_decodes(model, rng.integers(0, 256, 12).tolist(), rng.integers(0, 256, ROWS).tolist(),
                                  rollback=GAMMA_MAX)
    finally:
        model.close()


@pytest.mark.parametrize("quant", FILE_TYPES)
def test_every_layout_prints_the_same_text(files, quant):
    """For the types CPU_EXACT takes (patch 0029: every weight type of these files), which layout `--repack` chose changes the speed,
    never the text: the file's plain layout (interleaved on the fly into the same kernels), CPU_EXACT
    and auto's own choice give the same logits, bit for bit, for a 40-token prompt (past the
    batch-invariant rows), greedy one-token decodes and a verify pass, and so the same tokens."""
    rng = np.random.default_rng(4)
    prompt = rng.integers(0, 256, 40).tolist()
    runs, where = {}, {}
    for repack in ("off", "on", "auto"):
        model = Model(files[quant], repack=repack)
        ctx = Context(model, n_ctx=128, n_batch=64, n_threads=2)
        try:
            where[repack] = {model_tensor_buft(model.ptr, n) for n in ("blk.0.ffn_up_exps.weight", "blk.0.attn_q.weight")}
            ctx.decode(prompt, logits_all=False)
            logits, tokens = [ctx.logits()[-1].copy()], []
            for _ in range(ROWS):
                tokens.append(int(np.argmax(logits[-1])))
                ctx.decode([tokens[-1]])
                logits.append(ctx.logits()[-1].copy())
            ctx.clear()
            ctx.decode(prompt, logits_all=False)
            ctx.decode(tokens)
            runs[repack] = (tokens, np.stack(logits).tobytes(), ctx.logits().tobytes())
        finally:
            ctx.close()
            model.close()
    assert where["off"] <= {"CPU", "CPU_Mapped"} and where["on"] == {"CPU_EXACT"}, where
    assert runs["on"] == runs["off"] and runs["auto"] == runs["off"]


def test_the_report_runs_on_a_device():
    """bench/batch_invariance.py --device: the same comparison on a device's own kernels (a GPU's
    on a lease, bench/gpu_checks.sh correct; here the RPC stand-in, in a process of its own: an RPC
    device cannot be unregistered). Which cells read "=" is llama.cpp's kernels' business on that
    device, so only the table is checked; an unknown device is exit 2, naming the flag."""
    bench = [sys.executable, str(Path(__file__).resolve().parent.parent / "bench" / "batch_invariance.py")]
    res = subprocess.run([*bench, "--device", "rpc", "--types", "q8_0", "--n-in", "256", "--n-out", "32"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    rows = [line.strip(" |").split(" | ") for line in res.stdout.splitlines() if line.startswith("| q8_0 | RPC0 |")]
    assert [r[2] for r in rows] == ["MUL_MAT", "MUL_MAT_ID"]
    for r in rows:
        cells = r[3:]
        assert len(cells) == 12 and cells[-1] == "-"  # n = 2..512; threads: the CPU's question only
        assert all(c == "=" or float(c) < 1e-3 for c in cells[:-1])
    bad = subprocess.run([*bench, "--device", "NOPE", "--types", "q8_0"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--device" in bad.stderr


# Every stored value at its largest magnitude, for the kernels' integer sums at their bounds (the AVX2
# kernel adds up to 8 maddubs results in 16 bits: exact only if they fit): per type, the byte that
# fills a block, then its float scales as (offset, fp16 bits, or None: MXFP4's E8M0 byte). dmin 0:
# the sums stay positive and large.
FULL_BLOCKS = {
    "q4_0": (0xFF, ((0, 0x2000),)),
    "q8_0": (0x80, ((0, 0x2000),)),            # -128
    "iq4_nl": (0x00, ((0, 0x2000),)),          # the table's -127
    "iq4_xs": (0x00, ((0, 0x2000),)),
    "mxfp4": (0x77, ((0, None),)),             # 12
    "q4_k": (0xFF, ((0, 0x2000), (2, 0))),
    "q5_k": (0xFF, ((0, 0x2000), (2, 0))),
    "q6_k": (0xFF, ((208, 0x2000),)),
    "q2_k": (0xFF, ((80, 0x2000), (82, 0))),
    "q3_k": (0xFF, ((108, 0x2000),)),
}


def full_row(type_name: str, n_in: int) -> np.ndarray:
    """One row of `n_in` weights of FULL_BLOCKS' blocks, as stored."""
    fill, scales = FULL_BLOCKS[type_name]
    per_block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name.upper()]]
    block = np.full(size, fill, dtype=np.uint8)
    for offset, bits in scales:
        if bits is None:
            block[offset] = 120  # a small power of two
        else:
            block[offset:offset + 2] = np.frombuffer(np.uint16(bits).tobytes(), dtype=np.uint8)
    return np.tile(block, n_in // per_block)


@pytest.mark.parametrize("type_name", sorted(FULL_BLOCKS))
def test_largest_weights_and_activations_sum_exactly(type_name):
    """Weights at their largest stored values and activations all 1 (quantized to 127): CPU_EXACT's
    outputs, one token and a tile of 8, agree with llama.cpp's own kernels (within their activation
    rounding), so no integer sum of the AVX2 or AVX-512 kernel wrapped."""
    ggml_type = int(GGMLQuantizationType[type_name.upper()])
    n_in, n_out = 512, 32
    row = full_row(type_name, n_in)
    bufts = host_layout.cpu_buffer_types()
    def output(buft_name: str, xs: np.ndarray) -> np.ndarray:
        with host_layout.matmul_runner(ggml_type, n_in, n_out, 0, xs, None, bufts[buft_name], raw_row=row) as run:
            return run(1)

    for n_tokens in (1, 8):
        xs = np.ones((n_tokens, 1, n_in), dtype=np.float32)
        got = output(host_layout.EXACT_BUFT, xs)
        host_layout.set_batch_invariant_rows(0)  # llama.cpp's kernels on the plain layout
        want = output("CPU", xs)
        host_layout.set_batch_invariant_rows(EXACT_ROWS)
        assert np.all(np.isfinite(want)) and np.abs(want).min() > 0
        np.testing.assert_allclose(got, want, rtol=2e-3, err_msg=f"{type_name}, {n_tokens} tokens")
