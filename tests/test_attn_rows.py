"""Batch-invariant flash attention (patch 0032, ggml-cpu/attn_rows.cpp): in batch-invariant mode the
query rows that share a KV head walk the cache together, and every row keeps the bits of flash
attention's one-chunk path (llama.cpp's own, for one row under 512 cached tokens), at every row
count, thread count and cache length. One FLASH_ATTN_EXT op through ggml's C API."""

from __future__ import annotations

import ctypes
from ctypes import c_bool, c_float, c_int, c_int64, c_size_t, c_void_p

import numpy as np
import pytest

from orchestrator.runtime import host_layout
from orchestrator.runtime.native import engine_built, ggml_library

pytestmark = pytest.mark.skipif(not engine_built(), reason="needs the patched llama.cpp")

F32, F16, Q8_0 = 0, 1, 8
N_MAX = 9  # the largest verify pass of γ 8


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", c_size_t), ("mem_buffer", c_void_p), ("no_alloc", c_bool)]


def _bind():
    base, cpu = ggml_library("ggml-base"), ggml_library("ggml-cpu")
    p = c_void_p
    for lib, name, res, args in (
            (base, "ggml_init", p, [_InitParams]), (base, "ggml_free", None, [p]),
            (base, "ggml_new_tensor_4d", p, [p, c_int, c_int64, c_int64, c_int64, c_int64]),
            (base, "ggml_new_tensor_1d", p, [p, c_int, c_int64]),
            (base, "ggml_flash_attn_ext", p, [p, p, p, p, p, c_float, c_float, c_float]),
            (base, "ggml_flash_attn_ext_add_sinks", None, [p, p]),
            (base, "ggml_new_graph", p, [p]), (base, "ggml_build_forward_expand", None, [p, p]),
            (base, "ggml_get_data", p, [p]), (base, "ggml_nbytes", c_size_t, [p]),
            (base, "ggml_quantize_chunk", c_size_t, [c_int, p, p, c_int64, c_int64, c_int64, p]),
            (cpu, "ggml_graph_compute_with_ctx", c_int, [p, p, c_int])):
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args
    return base, cpu


def _fill(base, t, values: np.ndarray, ggml_type: int) -> None:
    """Write float values into tensor t as its type (rows along the first dimension)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if ggml_type == F32:
        data = values
    elif ggml_type == F16:
        data = values.astype(np.float16)
    else:
        rows = values.reshape(-1, values.shape[-1])
        data = np.empty(base.ggml_nbytes(t), dtype=np.uint8)
        base.ggml_quantize_chunk(ggml_type, rows.ctypes.data, data.ctypes.data, 0, rows.shape[0], rows.shape[1], None)
    ctypes.memmove(base.ggml_get_data(t), data.ctypes.data, base.ggml_nbytes(t))


def attention(q, k, v, mask, kv_type=F16, sinks=None, scale=0.125, max_bias=0.0, softcap=0.0, threads=1):
    """FLASH_ATTN_EXT of q [N, n_head, DK] over k [n_kv, n_kv_head, DK], v [n_kv, n_kv_head, DV] (stored
    as kv_type), mask [N, n_kv] (float; -inf masks): the output [N, n_head, DV]."""
    base, cpu = _bind()
    n, n_head, dk = q.shape
    n_kv, n_kv_head, dv = v.shape
    ctx = base.ggml_init(_InitParams(256 << 20, None, False))
    try:
        tq = base.ggml_new_tensor_4d(ctx, F32, dk, n, n_head, 1)
        tk = base.ggml_new_tensor_4d(ctx, kv_type, dk, n_kv, n_kv_head, 1)
        tv = base.ggml_new_tensor_4d(ctx, kv_type, dv, n_kv, n_kv_head, 1)
        tm = base.ggml_new_tensor_4d(ctx, F16, n_kv, n, 1, 1)
        _fill(base, tq, q.transpose(1, 0, 2), F32)  # [head][token][d]
        _fill(base, tk, k.transpose(1, 0, 2), kv_type)
        _fill(base, tv, v.transpose(1, 0, 2), kv_type)
        _fill(base, tm, mask, F16)
        out = base.ggml_flash_attn_ext(ctx, tq, tk, tv, tm, scale, max_bias, softcap)
        if sinks is not None:
            ts = base.ggml_new_tensor_1d(ctx, F32, n_head)
            _fill(base, ts, sinks, F32)
            base.ggml_flash_attn_ext_add_sinks(out, ts)
        graph = base.ggml_new_graph(ctx)
        base.ggml_build_forward_expand(graph, out)
        assert cpu.ggml_graph_compute_with_ctx(ctx, graph, threads) == 0
        result = np.empty((n, n_head, dv), dtype=np.float32)  # dst is [DV, head, token]
        ctypes.memmove(result.ctypes.data, base.ggml_get_data(out), result.nbytes)
        return result
    finally:
        base.ggml_free(ctx)


def inputs(n_kv, n_head=8, n_kv_head=2, dk=64, dv=64, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((N_MAX, n_head, dk), dtype=np.float32)
    k = rng.standard_normal((n_kv, n_kv_head, dk), dtype=np.float32)
    v = rng.standard_normal((n_kv, n_kv_head, dv), dtype=np.float32)
    # a verify pass's causal mask: token t sees the cache and itself, and the first position is
    # masked for all (a sliding window's edge)
    mask = np.zeros((N_MAX, n_kv), dtype=np.float32)
    for t in range(N_MAX):
        mask[t, n_kv - N_MAX + t + 1:] = -np.inf
    mask[:, 0] = -np.inf
    return q, k, v, mask


@pytest.fixture
def rows_mode():
    host_layout.set_batch_invariant_rows(32)
    yield
    host_layout.set_batch_invariant_rows(0)


CASES = {
    "f16": dict(),
    "f32": dict(kv_type=F32),
    "q8_0": dict(kv_type=Q8_0),
    "sinks": dict(sinks=np.linspace(-1.0, 2.0, 8, dtype=np.float32)),
    "softcap": dict(softcap=30.0),
    "alibi": dict(max_bias=8.0),
}


@pytest.mark.parametrize("case", CASES)
def test_one_row_has_the_one_chunk_paths_bits(case):
    """One row under 512 cached tokens takes llama.cpp's one-chunk path out of batch-invariant mode
    (no split KV, no tiles): the batch-invariant kernel gives its bits, row by row."""
    q, k, v, mask = inputs(300)
    for t in (0, N_MAX - 1):
        host_layout.set_batch_invariant_rows(0)
        want = attention(q[t:t + 1], k, v, mask[t:t + 1], **CASES[case])
        host_layout.set_batch_invariant_rows(32)
        try:
            got = attention(q[t:t + 1], k, v, mask[t:t + 1], **CASES[case])
        finally:
            host_layout.set_batch_invariant_rows(0)
        assert got.tobytes() == want.tobytes(), f"{case}, token {t}"


@pytest.mark.parametrize("n_kv", [40, 700])
@pytest.mark.parametrize("case", ["f16", "q8_0", "sinks"])
def test_every_row_of_a_pass_is_the_one_row_ops(rows_mode, case, n_kv):
    """A pass of 2-9 rows (GQA: 4 query heads per KV head, so 8-36 rows per KV head, more than walk
    together), 1 and 2 threads, under and over 512 cached tokens: each row is the one-row op's."""
    q, k, v, mask = inputs(n_kv, seed=1)
    single = np.concatenate([attention(q[t:t + 1], k, v, mask[t:t + 1], **CASES[case]) for t in range(N_MAX)])
    for n in (2, 5, N_MAX):
        for threads in (1, 2):
            got = attention(q[:n], k, v, mask[:n], threads=threads, **CASES[case])
            assert got.tobytes() == single[:n].tobytes(), f"{case}, {n} rows, {threads} threads"


def test_heads_of_other_sizes_and_no_gqa(rows_mode):
    """DK ≠ DV (DeepSeek's MLA shapes, smaller) and one query head per KV head."""
    q, k, v, mask = inputs(100, n_head=4, n_kv_head=4, dk=192, dv=128, seed=2)
    single = np.concatenate([attention(q[t:t + 1], k, v, mask[t:t + 1]) for t in range(N_MAX)])
    assert attention(q, k, v, mask, threads=2).tobytes() == single.tobytes()


def test_the_result_is_attention():
    """Against numpy (float64) softmax attention: the kernel computes what it should, not only the
    same bits twice."""
    q, k, v, mask = inputs(64, seed=3)
    host_layout.set_batch_invariant_rows(32)
    try:
        got = attention(q, k, v, mask, kv_type=F32, threads=2)
    finally:
        host_layout.set_batch_invariant_rows(0)
    rep = q.shape[1] // k.shape[1]
    kk, vv = np.repeat(k, rep, axis=1).astype(np.float64), np.repeat(v, rep, axis=1).astype(np.float64)
    s = np.einsum("thd,khd->thk", q.astype(np.float64), kk) * 0.125 + mask[:, None, :]
    p = np.exp(s - s.max(axis=2, keepdims=True))
    want = np.einsum("thk,khd->thd", p / p.sum(axis=2, keepdims=True), vv)
    assert np.abs(got - want).max() < 1e-4
