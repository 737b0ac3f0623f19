"""The host weights' layout (`--repack auto|on|off`, orchestrator.runtime.host_layout): where every weight
lands for each mode, with and without a GPU (the RPC device stands in for it), the plain twins
a prompt reads, and greedy speculative decoding staying lossless on the new default kernels.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from orchestrator.runtime import host_layout
from orchestrator.runtime.llm import Context, Model
from orchestrator.runtime.native import engine_built, model_tensor_buft
from orchestrator.gguf_files.gguf_export import make_random_model, tiny_config

from engine_common import rpc_main, run_in_own_process

pytestmark = pytest.mark.skipif(not engine_built(), reason="needs the patched llama.cpp")

# rows of 256 (Q4_K's block) so that a Q4_K_M file really holds Q4_K and Q6_K; 8 | rows for repacking
CFG = tiny_config("qwen3moe", n_layer=2, n_embd=256, n_expert=8, n_expert_used=2, n_ff_exp=256)
EXPERTS = ("ffn_up_exps", "ffn_gate_exps", "ffn_down_exps")
# the file's layout in host memory: a CPU buffer, or the file's mapping wrapped as one
PLAIN = {"CPU", "CPU_Mapped"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("layout")
    return {q: make_random_model(d / f"m-{q}.gguf", CFG, seed=5, quant=q) for q in ("q4_0", "q4_k_m", "iq4_xs", "mxfp4_moe")}


@pytest.fixture(autouse=True)
def layout_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPAC_CACHE_DIR", str(tmp_path / "cache"))


def expert_bufts(model: Model) -> dict[str, str]:
    return {f"blk.{il}.{k}.weight": model_tensor_buft(model.ptr, f"blk.{il}.{k}.weight")
            for il in range(CFG.n_layer) for k in EXPERTS}


def test_auto_measures_each_type_and_caches_it(files, tmp_path):
    layout = host_layout.choose(files["q4_k_m"], n_threads=2)
    assert set(layout.types) == {"Q4_K", "Q6_K"} and layout.mode == "auto"
    for choice in layout.types.values():
        if choice.repack_ms is None:
            assert not choice.repack and "no repacked kernel" in choice.why
        else:  # times at one token, a verify batch and a prefill ubatch, in both layouts
            assert len(choice.plain_ms) == len(choice.repack_ms) == 3
            decode_gain = sum(choice.plain_ms[:2]) / sum(choice.repack_ms[:2])
            assert choice.repack == (decode_gain > 1.0)
            assert choice.plain_prefill == (choice.repack and host_layout.plain_prompts_pay(choice.plain_ms, choice.repack_ms))
    cache = json.loads((tmp_path / "cache" / "host_layout.json").read_text())
    experts = [k for k in cache if "|dense|" not in k]
    assert len(experts) == sum(c.repack_ms is not None or c.plain_ms == [] for c in layout.types.values())
    for choice in layout.dense.values():  # the dense weights' buffer type: the fastest at decoding, by a margin
        assert choice.buft == host_layout.dense_layout(choice.ms)  # and plain twins where a prompt is faster plain
        assert choice.plain_prefill == (choice.buft != "CPU" and host_layout.plain_prompts_pay(choice.ms["CPU"], choice.ms[choice.buft]))
    again = host_layout.choose(files["q4_k_m"], n_threads=2)
    assert again.report() == layout.report() and again.repacked == layout.repacked


@pytest.mark.parametrize("quant", ["q4_0", "q4_k_m", "iq4_xs", "mxfp4_moe"])
def test_every_expert_lands_where_the_mode_says(files, quant):
    """Without a GPU, in exact mode: off keeps the file's layout, on is llama.cpp's default rule
    (the first extra buffer type with a kernel: CPU_EXACT for every type it takes), auto repacks
    the types the measurement chose, in the buffer type it timed; twins are host buffers."""
    repacked = "CPU_EXACT"
    for mode in ("off", "on", "auto"):
        model = Model(files[quant], repack=mode, n_threads=2, exact=True)
        try:
            bufts = expert_bufts(model)
            chosen = {n: "CPU_REPACK" for n in model.layout.repacked}
            chosen.update({n: b for b, names in model.layout.placed.items() for n in names})
            if mode == "off":
                assert set(bufts.values()) <= PLAIN
            elif mode == "auto":
                assert all(b == chosen[n] if n in chosen else b in PLAIN for n, b in bufts.items()), bufts
                assert {chosen[n] for n in bufts if n in chosen} <= {repacked}
                for name in bufts:
                    twin = model_tensor_buft(model.ptr, name, twin=True)
                    assert twin is None or twin in PLAIN
            else:
                assert repacked in bufts.values()
        finally:
            model.close()


@pytest.mark.parametrize("hide", ["", "amx"])
@pytest.mark.parametrize("quant", ["q4_0", "q4_k_m"])
def test_no_exact_is_llama_cpps_layouts(files, quant, hide, monkeypatch):
    """--no-exact --repack on is stock llama.cpp's placement: every weight in the first of its own
    buffer types that takes it (AMX where spac's build and the CPU have it and it is not hidden,
    then CPU_REPACK), nothing in CPU_EXACT; auto out of exact mode chooses among llama.cpp's
    layouts only. Run with AMX hidden and not, on any CPU (where there is no AMX both are the same
    run, and the AMX half of the assertion is about an empty set)."""
    monkeypatch.setenv(host_layout.HIDE_ENV, hide)
    bufts = host_layout.cpu_buffer_types()
    assert host_layout.EXACT_BUFT in bufts and ("AMX" not in bufts if hide else True)
    for mode in ("on", "auto"):
        model = Model(files[quant], repack=mode, n_threads=2, exact=False)
        try:
            placed = {n: model_tensor_buft(model.ptr, n) for n, _, ne in host_layout.read_weights(files[quant]).tensors
                      if len(ne) >= 2}
            assert host_layout.EXACT_BUFT not in placed.values(), placed
            assert not model.layout.exact and host_layout.EXACT_BUFT not in model.layout.placement()
            if hide:
                assert "AMX" not in placed.values()
            if mode == "on":  # each weight where llama.cpp's own rule puts it
                for name, t, ne in host_layout.read_weights(files[quant]).tensors:
                    op = host_layout.weight_op(name, ne)
                    if op is not None:
                        want = host_layout.first_taking(t, ne, op, CFG.n_expert_used, host_layout.usable_buffer_types(False))
                        assert placed[name] in ({want} if want != "CPU" else PLAIN), (name, placed[name], want)
                experts = {placed[n] for n in expert_bufts(model)}
                assert experts == {"CPU_REPACK"} if quant == "q4_0" else experts <= {"CPU_REPACK", *PLAIN}, experts
        finally:
            model.close()


def test_a_layout_never_takes_an_op_it_has_no_kernel_for(tmp_path):
    """A 3-D weight read by a batched MUL_MAT (DeepSeek's attn_k_b) is not an expert: the layout
    its type chose for matrices has no kernel for it, so it stays plain and --json says so."""
    bufts = host_layout.usable_buffer_types(True)
    q8_0 = 8
    assert host_layout.supports(q8_0, (512, 256), bufts["CPU_EXACT"])
    assert not host_layout.supports(q8_0, (512, 256, 4), bufts["CPU_EXACT"])  # batched over 4 heads
    assert host_layout.supports(q8_0, (512, 256, 4), bufts["CPU_EXACT"], host_layout.MUL_MAT_ID, 2)
    assert host_layout.weight_op("blk.0.attn_k_b.weight", [128, 64, 4]) == host_layout.MUL_MAT
    assert host_layout.weight_op("blk.0.ffn_up_exps.weight", [128, 64, 4]) == host_layout.MUL_MAT_ID
    assert host_layout.weight_op("token_embd.weight", [128, 64]) is None
    layout = host_layout.HostLayout("auto", use_extra_bufts=False, fallbacks={"blk.0.attn_k_b.weight": "CPU_EXACT"})
    assert layout.to_dict()["fallbacks"] == {"blk.0.attn_k_b.weight": "CPU_EXACT"} and "1 tensors plain" in layout.report()


def test_hiding_an_unknown_feature_says_which(monkeypatch):
    monkeypatch.setenv(host_layout.HIDE_ENV, "amx,avx9")
    with pytest.raises(ValueError, match="SPAC_HIDE_CPU_FEATURES: unknown feature avx9"):
        host_layout.cpu_buffer_types()


def mapped_resident_bytes(path) -> int:
    """Resident bytes of this process's mappings of `path` (Linux's /proc/self/smaps)."""
    total, ours = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if len(head) >= 5 and "-" in head[0] and ":" in head[3]:  # a mapping's header line
            ours = line.endswith(str(path))
        elif ours and head[0] == "Rss:":
            total += int(head[1]) * 1024
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")
def test_copied_weights_leave_no_pages_in_the_mapping(tmp_path):
    """A weight copied out of the file mapping (repacked) keeps none of its file pages resident
    (patch 0014): the copy does not count twice. The weights used in place are still faulted in
    at load, as llama.cpp's MAP_POPULATE does."""
    import gguf

    # experts of 2.25 MiB, so that the pages at the edges of a tensor are noise
    cfg = tiny_config("qwen3moe", n_layer=1, n_embd=512, n_expert=8, n_expert_used=2, n_ff_exp=1024)
    original = make_random_model(tmp_path / "m.gguf", cfg, seed=5, quant="q4_0")
    page = os.sysconf("SC_PAGESIZE")
    tensors = [(t.name, int(t.n_bytes)) for t in gguf.GGUFReader(original).tensors]
    for mode in ("on", "off"):
        path = tmp_path / f"{mode}.gguf"  # a copy of its own: no other model maps it
        shutil.copyfile(original, path)
        model = Model(path, repack=mode, n_threads=2)
        try:
            copied = [n for n, _ in tensors if model_tensor_buft(model.ptr, n) not in PLAIN]
            resident = mapped_resident_bytes(path)
        finally:
            model.close()
        in_place = sum(b for n, b in tensors if n not in copied)
        if mode == "on":
            assert any("_exps" in n for n in copied)
            assert resident <= in_place + 2 * page * (len(copied) + 1), (resident, in_place)
        else:
            assert not copied and resident >= in_place


def check_gpu_keeps_plain_experts(device, tmp_path):
    """With layers on a GPU (here the RPC device), auto leaves a prompt's expert matmuls a host
    buffer (llama.cpp offloads them only from host buffers): Q4_0 experts go to CPU_EXACT with
    plain twins for the prompt's ubatches, others stay plain; --repack on repacks them (Q4_0:
    CPU_EXACT, the first of the CPU's extra buffer types). On CUDA that needs llama.cpp's no_host: its pinned host buffer type comes first
    in the CPU list, and with a mapped file the loader turns it into plain CPU_Mapped (the RPC
    device has no host buffer type, so here the flag changes nothing and is checked as passed)."""
    path = make_random_model(tmp_path / "m.gguf", CFG, seed=5, quant="q4_0")
    for mode in ("auto", "off", "on"):
        model = Model(path, n_gpu_layers=99, repack=mode, n_threads=1, exact=True)
        try:
            bufts = set(expert_bufts(model).values())
            assert bufts == {"CPU_EXACT"} if mode in ("on", "auto") else bufts <= PLAIN, (mode, bufts)
            if mode == "auto":
                assert model.layout.n_plain_twins == len(expert_bufts(model))
                assert {model_tensor_buft(model.ptr, n, twin=True) for n in expert_bufts(model)} <= PLAIN
            assert model.layout.no_host == (mode == "on")
            # device RPC0: buffer type "RPC[host:port]"; device CUDA0: "CUDA0"
            assert model_tensor_buft(model.ptr, "blk.0.attn_q.weight").startswith(device.rstrip("0123456789"))
        finally:
            model.close()


def test_gpu_run_keeps_plain_host_experts(tmp_path):
    run_in_own_process(__file__, tmp_path)


def prefill_logits(path, repack: str, n: int = 96) -> np.ndarray:
    model = Model(path, repack=repack, n_threads=2)
    ctx = Context(model, n_ctx=256, n_batch=128, n_threads=2)
    try:
        # every position's logits: the last layer then multiplies all n rows too (with one output
        # llama.cpp computes its FFN for that row alone: a decode-sized matmul, repacked)
        ctx.decode(np.random.default_rng(3).integers(0, 256, n), logits_all=True)
        return ctx.logits().copy()
    finally:
        ctx.close()
        model.close()


def test_prompt_reads_the_plain_twins(files, monkeypatch):
    """A type repacked for decoding whose prefill is faster plain reads the file's layout on a
    prompt: forced here for Q4_K whatever this CPU measured, the prompt's logits are then those of
    the plain layout up to the repacked weights the twins do not replace (none here)."""
    real = host_layout.choose

    def forced(*args, **kw):
        layout = real(*args, **kw)
        for c in layout.types.values():
            c.plain_prefill = c.repack_ms is not None
            c.repack = c.repack or c.plain_prefill
        if layout.mode == "auto":  # the Q4_K experts alone: the dense weights keep the file's layout
            layout.repacked = [n for n, t, shape in host_layout.read_weights(args[0])[1] if "_exps" in n and t == 12]
            layout.placed = {}
        return layout

    monkeypatch.setattr(host_layout, "choose", forced)
    with_twins = prefill_logits(files["q4_k_m"], "auto")
    model = Model(files["q4_k_m"], repack="auto", n_threads=2)
    n_twins = model.layout.n_plain_twins
    assert model_tensor_buft(model.ptr, "blk.0.ffn_up_exps.weight") == "CPU_REPACK"
    assert model_tensor_buft(model.ptr, "blk.0.ffn_up_exps.weight", twin=True) in PLAIN
    model.close()
    monkeypatch.setattr(host_layout, "choose", real)
    plain = prefill_logits(files["q4_k_m"], "off")
    assert n_twins > 0
    np.testing.assert_array_equal(with_twins, plain)


@pytest.mark.parametrize("quant", ["q4_0", "q4_k_m"])
def test_greedy_speculative_is_lossless_on_the_default_kernels(files, tmp_path, quant):
    """On llama.cpp's kernels a verify batch would take the repacked GEMM, a single token the GEMV
    (and K-quants a tiled kernel from 8 rows); the session's batch-invariant mode computes every
    row of a verify pass as one token: greedy speculative output equals target-only output, token
    for token, by construction (tests/test_batch_invariance.py holds the rows bit-identical)."""
    from orchestrator.decoding.sampling import SamplingParams
    from orchestrator.decoding.speculative import Session, SessionConfig

    target = files[quant]
    draft = make_random_model(tmp_path / "draft.gguf", CFG, seed=5, quant="q4_0")
    prompts = [np.random.default_rng(s).integers(0, 256, 6).tolist() for s in range(6)]
    greedy = SamplingParams(temperature=0)
    with Session(SessionConfig(model=target, draft=None, n_threads=2, expert_engine=False)) as plain:
        refs = [plain.complete(p, 48, sampling=greedy).tokens for p in prompts]
        assert plain.target.layout.mode == "auto"
    with Session(SessionConfig(model=target, draft=draft, gamma=8, adaptive_gamma=False, n_threads=2,
                               expert_engine=False)) as spec:
        for p, ref in zip(prompts, refs):
            assert spec.complete(p, 48, sampling=greedy).tokens == ref
        assert spec.last_metrics.n_drafted > 0


if __name__ == "__main__":
    rpc_main(check_gpu_keeps_plain_experts)


def mul_mat(buft_name: str, ggml_type: int, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """ggml's MUL_MAT of `w` [N, K] (quantized to ggml_type, in the named CPU buffer type) and
    `x` [B, M, K] (F32) on the CPU backend, 2 threads: [B, M, N]."""
    g = host_layout._lib()
    ip = host_layout._InitParams
    dev = g["dev_by_type"](0)
    ctx_w = g["init"](ip(g["tensor_overhead"]() * 2, None, True))
    ctx = g["init"](ip(g["tensor_overhead"]() * 8 + g["graph_overhead"](), None, True))
    (n, k), (b, m, _) = w.shape, x.shape
    wt = g["new_tensor_2d"](ctx_w, ggml_type, k, n)
    xt = g["new_tensor_3d"](ctx, 0, k, m, b)
    out = g["mul_mat"](ctx, wt, xt)
    bufs = [g["alloc_ctx_tensors"](ctx_w, host_layout.cpu_buffer_types()[buft_name]),
            g["alloc_ctx_tensors"](ctx, g["dev_buffer_type"](dev))]
    backend = g["cpu_init"]()
    try:
        q = np.empty(g["nbytes"](wt), dtype=np.uint8)
        g["quantize_chunk"](ggml_type, np.ascontiguousarray(w).ctypes.data, q.ctypes.data, 0, n, k, None)
        g["tensor_set"](wt, q.ctypes.data, 0, q.nbytes)
        g["tensor_set"](xt, np.ascontiguousarray(x).ctypes.data, 0, x.nbytes)
        graph = g["new_graph"](ctx)
        g["build_forward_expand"](graph, out)
        g["cpu_set_n_threads"](backend, 2)
        g["graph_compute"](backend, graph)
        res = np.empty((b, m, n), dtype=np.float32)
        g["tensor_get"](out, res.ctypes.data, 0, res.nbytes)
        return res
    finally:
        g["backend_free"](backend)
        for buf in bufs:
            g["buffer_free"](buf)
        g["free"](ctx)
        g["free"](ctx_w)


def test_the_micro_benchmark_multiplies_real_numbers():
    """The matmul that --repack auto times (and bench/batch_invariance.py reads) quantizes float32
    rows: its outputs are the size of N(0, 1) dot products. Under numpy 2 the rows were float64,
    which ggml read as garbage floats (outputs of 1e20 or NaN)."""
    bufts = host_layout.cpu_buffer_types()
    xs = np.random.default_rng(1).standard_normal((9, 1, 256), dtype=np.float32)
    for ggml_type in (0, 8, 12):  # F32, Q8_0, Q4_K
        out = host_layout.matmul_output(ggml_type, 256, 64, 0, xs, None, bufts["CPU"], 1)
        assert np.isfinite(out).all() and 0.1 < np.abs(out).max() < 20, (ggml_type, np.abs(out).max())


@pytest.mark.parametrize("type_name", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_amx_mul_mat_equals_the_plain_kernel(type_name, request):
    """Patches 0011 and 0012: llama.cpp's AMX matmul at one token, a verify batch, full tiles and
    3-D activations (batch dims, the weight broadcast) gives the plain kernel's result. Unpatched,
    a GCC 12 -O3 build crashed on every matmul of more than one row, and batches after the first
    were read and written at the wrong place."""
    if "AMX" not in host_layout.cpu_buffer_types():
        pytest.skip("this CPU (or build) has no AMX")
    import gguf

    ggml_type = gguf.GGMLQuantizationType[type_name].value
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 256), dtype=np.float32)
    previous = host_layout.batch_invariant_rows()
    host_layout.set_batch_invariant_rows(0)  # llama.cpp's plain kernel (exact mode would take CPU_EXACT's)
    request.addfinalizer(lambda: host_layout.set_batch_invariant_rows(previous))
    for m, b in ((1, 1), (9, 1), (32, 1), (1, 3), (9, 2)):
        x = rng.standard_normal((b, m, 256), dtype=np.float32)
        plain, amx = mul_mat("CPU", ggml_type, w, x), mul_mat("AMX", ggml_type, w, x)
        assert np.abs(amx - plain).max() <= 1e-5 * np.abs(plain).max(), (type_name, m, b)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q8_0", "IQ4_NL", "IQ4_XS", "MXFP4", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16"])
def test_exact_mul_mat_is_llama_cpps_product(type_name, request):
    """CPU_EXACT's kernels (the SIMD variant this build has) compute what llama.cpp's plain kernel
    does, to rounding: the batch-invariance tests hold every row to a one-row op, which a kernel
    reading the layout wrongly would pass too. Activations are quantized per 32 (llama.cpp: per 32,
    or per 256 for the K-quants and IQ4_XS), so the two differ by a small fraction of the output.
    F16 and BF16 stay in the plain layout, where exact mode gives them CPU_EXACT's float kernels
    (F32 activations, where llama.cpp rounds them to the weight's type)."""
    import gguf

    from orchestrator.decoding.speculative import EXACT_ROWS

    ggml_type = gguf.GGMLQuantizationType[type_name].value
    floats = type_name in ("F16", "BF16")
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 512), dtype=np.float32)
    previous = host_layout.batch_invariant_rows()
    request.addfinalizer(lambda: host_layout.set_batch_invariant_rows(previous))
    for m in (1, 9, 32):
        x = rng.standard_normal((1, m, 512), dtype=np.float32)
        host_layout.set_batch_invariant_rows(0)  # the plain layout's own kernel, llama.cpp's
        plain = mul_mat("CPU", ggml_type, w, x)
        if floats:
            host_layout.set_batch_invariant_rows(EXACT_ROWS)
        exact = mul_mat("CPU" if floats else host_layout.EXACT_BUFT, ggml_type, w, x)
        assert np.abs(exact - plain).max() <= 0.02 * np.abs(plain).max(), (type_name, m, np.abs(exact - plain).max())


def test_dense_weights_keep_llama_cpps_repacked_layout_unless_slower_and_need_a_margin_for_amx():
    ms = lambda plain, repack, amx: {"CPU": [plain, plain, 1.0], "CPU_REPACK": [repack, repack, 1.0],
                                     "AMX": [amx, amx, 1.0]}
    assert host_layout.dense_layout(ms(1.0, 0.95, 2.0)) == "CPU_REPACK"  # 1.05x: llama.cpp's default kept
    assert host_layout.dense_layout(ms(1.0, 1.05, 2.0)) == "CPU"         # repacked measured slower
    assert host_layout.dense_layout(ms(1.0, 0.9, 0.85)) == "CPU_REPACK"  # AMX 1.18x: under its margin
    assert host_layout.dense_layout(ms(1.0, 0.9, 0.7)) == "AMX"
    assert host_layout.dense_layout({"CPU": [1.0, 1.0, 1.0], "AMX": [0.9, 0.9, 1.0]}) == "CPU"


def test_a_decode_timing_reads_its_weights_from_memory(monkeypatch):
    """`--repack auto` times a decode batch over copies of the weight that read together at
    least COLD_CACHE_FACTOR times the last-level cache (a real decode streams its weights; a few MB
    timed again and again would run from the cache, and so does part of a rotation through twice
    it on a Zen 5), at most COLD_MAX_COPIES and COLD_MAX_BYTES of copies; one copy where the weight
    alone is that large."""
    monkeypatch.setattr(host_layout, "last_level_cache_bytes", lambda: 32 << 20)
    assert host_layout.COLD_CACHE_FACTOR >= 8
    want = host_layout.COLD_CACHE_FACTOR * (32 << 20)
    for weight, touched in ((8 << 20, 1.0), (7 << 20, 0.75), (20 << 20, 0.5), (5 << 20, 1.0)):
        n = host_layout.cold_copies(weight, touched)
        assert n * weight * touched >= want and (n - 1) * weight * touched < want
    assert host_layout.cold_copies(1 << 10) == host_layout.COLD_MAX_COPIES
    assert host_layout.cold_copies(want) == 1
    # a large expert matrix of which one token reads a quarter: no more than COLD_MAX_BYTES of copies
    big = 200 << 20
    assert host_layout.cold_copies(big, 0.25) == host_layout.COLD_MAX_BYTES // big
    assert host_layout.cold_copies(2 * host_layout.COLD_MAX_BYTES, 0.25) == 1
