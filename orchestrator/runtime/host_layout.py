"""Where the host's weights live: llama.cpp's plain CPU layout or a repacked one (spac's
CPU_EXACT for the types it takes, llama.cpp's CPU_REPACK for the others), chosen per tensor type
and per phase from a measurement on this CPU (`--repack auto|on|off`, llama.cpp's flag name).

CPU_EXACT (patch 0029: Q4_0, Q8_0, IQ4_NL, IQ4_XS, MXFP4, Q2_K-Q6_K) sums every output in one order at
every batch size, thread count and layout, and in batch-invariant mode (a session's default,
`--exact`) the plain layout of those types takes the same kernels: for them the choice changes
the speed, never the text. So a type CPU_EXACT takes is never given to CPU_REPACK or AMX, which round their own way.
Out of exact mode (`--no-exact`) CPU_EXACT is never used: the layouts are llama.cpp's own, and
spac computes what stock llama.cpp computes. `on` is llama.cpp's own rule, weight by weight: the
first buffer type in its list that takes the op reading the weight (CPU_EXACT first in exact mode).
Every weight a layout names is asked that question first, as llama.cpp's loader asks it: an
override to a buffer type with no kernel for the op would stop the scheduler mid-graph.

llama.cpp repacks every weight its CPU_REPACK buffer type takes (`--repack 1`, its default).
Which layout is faster depends on the type, the batch and the CPU (on an AVX2 EPYC and on an
AVX-512 one: repacked Q4_0 is faster at every batch, repacked Q4_K faster at one token and
slower on a 512-token prompt), so `auto` times one expert matmul (MUL_MAT_ID, the model's own
shape, random routing) in both layouts at one token, at a verify batch and at a prefill ubatch,
its weights read from memory as a decode reads them (copies of the weight in turn, together eight
times the last-level cache, at most 1 GiB of them: a few MB timed again and again would run from
the cache, and so does part of a rotation through twice it).
A type is repacked where decoding (one token and the verify batch) is faster repacked; where a
prompt is faster on the plain layout (by PLAIN_TWIN_MIN_GAIN), prompt ubatches read plain twins of
its weights (the file's bytes in place, patch 0010: `native.model_plain_twins`). The dense weights that stay on the host
(attention, output head: MUL_MAT) go, per type, to whichever CPU buffer type decodes them fastest:
the plain one, CPU_REPACK, or AMX on CPUs that have it (patches 0011-0012 make it safe), with plain
twins for prompts where the plain layout is faster there by the same margin (Q4_K in CPU_EXACT on an
AVX2 CPU). The
times are cached per CPU (model name and flags), build, threads and shape, beside the warm-up
calibration. SPAC_HIDE_CPU_FEATURES=amx hides AMX from every choice, so that a CPU with it runs
as the many without it do (the tests run both ways).

The micro-benchmark speaks ggml's public C API through ctypes (the libraries llama.cpp loaded):
a weight in the layout's buffer type, F32 activations, a graph of one MUL_MAT_ID on the CPU
backend. A layout that does not take a tensor (type or row count) is reported as such.

Why ~820 lines: the choice is made from measurements, so the ggml bindings the micro-benchmark
needs (buffer types, one MUL_MAT_ID graph), the timing (weights out of cache), its per-CPU cache, the loader's question
per weight and the choice per type and phase sit together; llama.cpp is told the choice in llm.py.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import re
import time
from ctypes import c_bool, c_char_p, c_int, c_int64, c_size_t, c_void_p
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import NamedTuple

import numpy as np

from orchestrator.runtime import exact_variant, progress
from orchestrator.runtime.calibrate import cache_path
from orchestrator.runtime.native import ggml_library



class Repack(str, Enum):
    """--repack: AUTO chooses per tensor type from a measurement on this CPU, ON puts each weight in
    the first layout that takes it (llama.cpp's --repack 1), OFF keeps the file's plain layout."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"

    @classmethod
    def of(cls, value: Repack | str) -> Repack:
        """A mode or its name (case and spaces ignored); ValueError names the choices."""
        try:
            return cls(str(getattr(value, "value", value)).strip().lower())
        except ValueError:
            raise ValueError(f"--repack must be one of {', '.join(m.value for m in cls)}, not {value!r}") from None

    def __str__(self) -> str:
        return self.value


# the CPU features SPAC_HIDE_CPU_FEATURES can hide, and the buffer type each one brings
HIDE_ENV = "SPAC_HIDE_CPU_FEATURES"
HIDEABLE = {"amx": "AMX"}
MUL_MAT, MUL_MAT_ID = "MUL_MAT", "MUL_MAT_ID"
# llama.cpp's loader asks a buffer type about a weight's op at this many tokens
LOADER_TOKENS = 512
REPACK_BUFT = "CPU_REPACK"
EXACT_BUFT = "CPU_EXACT"
# the batches a layout is timed at: one token (decoding, drafting), a verify pass, a prefill ubatch
DECODE_TOKENS, VERIFY_TOKENS, PREFILL_TOKENS = 1, 9, 512
# ubatches of at least this many tokens are prefill: a verify batch never has as many (the expert
# pool splits ubatches of up to 64 tokens), so decoding keeps the repacked layout whatever happens
PREFILL_MIN_TOKENS = 65
# timing more experts than this buys nothing: fewer experts at the same tokens per expert is the
# same kernel work per expert, and the benchmark stays within seconds for a 128-expert model
MAX_BENCH_EXPERTS = 32
# likewise rows of a dense weight (the output head has a row per vocabulary entry): the time per
# row is the same for every block of rows
MAX_BENCH_ROWS = 4096
# a dense weight leaves the file's mapping for AMX's layout only for a clear gain: the sampled rows
# run from cache where a real pass streams them (in a run, Q6_K's 1.2x measured in AMX's layout
# bought no decode speed). Its copy replaces the mapped pages it was read from (patch 0014), so
# memory is not the cost. CPU_REPACK is llama.cpp's own default for these weights and is kept
# wherever it measures no slower: Q4_0 attention at 1.15-1.19x here was worth 1.38x in whole decode
# passes of a 4-layer Qwen3-30B-A3B shape (spac 0.72x llama.cpp's default with it plain, 1.14x repacked).
DENSE_MIN_GAIN = 1.25
# a plain twin keeps the file's bytes of a weight resident beside its repacked copy: taken only where
# a prompt ubatch is this much faster plain (a 1.00x tie on an AVX2 build's IQ4_XS twinned for nothing)
PLAIN_TWIN_MIN_GAIN = 1.05
# timings read their weights from memory: copies of the weight in turn, reading together this many
# times the last-level cache, at most this many copies (`cold_copies`). Twice was not enough: on a
# Zen 5 (32 MiB L3) one token of Q4_0 experts read 73.5-75.0 GB/s over copies twice the L3, above
# the 75 GB/s the machine streams, and 62-64 over copies 8 or 16 times it (2026-11-30). The copies
# take at most COLD_MAX_BYTES at once (a model's first load times its weights beside its own
# memory): a large expert matrix on a CPU with a large L3 reads fewer times the cache then
COLD_CACHE_FACTOR, COLD_MAX_COPIES, COLD_MAX_BYTES = 8, 64, 1 << 30
_GGML_TYPE_F32, _GGML_TYPE_I32 = 0, 26


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", c_size_t), ("mem_buffer", c_void_p), ("no_alloc", c_bool)]


class _GGUFInitParams(ctypes.Structure):
    _fields_ = [("no_alloc", c_bool), ("ctx", ctypes.POINTER(c_void_p))]


class _TensorHead(ctypes.Structure):
    """The first fields of ggml.h's struct ggml_tensor (type, buffer, ne): ggml has no getter for ne."""
    _fields_ = [("type", c_int), ("buffer", c_void_p), ("ne", c_int64 * 4)]


def _bind() -> dict:
    base, reg, cpu = ggml_library("ggml-base"), ggml_library("ggml"), ggml_library("ggml-cpu")

    def fn(lib, name, restype, *argtypes):
        f = getattr(lib, name)
        f.restype, f.argtypes = restype, list(argtypes)
        return f

    p = c_void_p
    return {
        "init": fn(base, "ggml_init", p, _InitParams),
        "free": fn(base, "ggml_free", None, p),
        "tensor_overhead": fn(base, "ggml_tensor_overhead", c_size_t),
        "graph_overhead": fn(base, "ggml_graph_overhead", c_size_t),
        "new_tensor_2d": fn(base, "ggml_new_tensor_2d", p, p, c_int, c_int64, c_int64),
        "new_tensor_3d": fn(base, "ggml_new_tensor_3d", p, p, c_int, c_int64, c_int64, c_int64),
        "new_tensor_4d": fn(base, "ggml_new_tensor_4d", p, p, c_int, c_int64, c_int64, c_int64, c_int64),
        "mul_mat": fn(base, "ggml_mul_mat", p, p, p, p),
        "mul_mat_id": fn(base, "ggml_mul_mat_id", p, p, p, p, p),
        "new_graph": fn(base, "ggml_new_graph", p, p),
        "build_forward_expand": fn(base, "ggml_build_forward_expand", None, p, p),
        "nbytes": fn(base, "ggml_nbytes", c_size_t, p),
        "row_size": fn(base, "ggml_row_size", c_size_t, c_int, c_int64),
        "quantize_chunk": fn(base, "ggml_quantize_chunk", c_size_t, c_int, p, p, c_int64, c_int64, c_int64, p),
        "alloc_ctx_tensors": fn(base, "ggml_backend_alloc_ctx_tensors_from_buft", p, p, p),
        "buft_alloc_buffer": fn(base, "ggml_backend_buft_alloc_buffer", p, p, c_size_t),
        "buffer_free": fn(base, "ggml_backend_buffer_free", None, p),
        "tensor_set": fn(base, "ggml_backend_tensor_set", None, p, p, c_size_t, c_size_t),
        "tensor_get": fn(base, "ggml_backend_tensor_get", None, p, p, c_size_t, c_size_t),
        "dev_by_type": fn(reg, "ggml_backend_dev_by_type", p, c_int),
        "dev_by_name": fn(reg, "ggml_backend_dev_by_name", p, c_char_p),
        "dev_init": fn(base, "ggml_backend_dev_init", p, p, c_char_p),
        "dev_backend_reg": fn(base, "ggml_backend_dev_backend_reg", p, p),
        "dev_buffer_type": fn(base, "ggml_backend_dev_buffer_type", p, p),
        "dev_supports_op": fn(base, "ggml_backend_dev_supports_op", c_bool, p, p),
        "reg_get_proc_address": fn(base, "ggml_backend_reg_get_proc_address", p, p, c_char_p),
        "buft_name": fn(base, "ggml_backend_buft_name", c_char_p, p),
        "graph_compute": fn(base, "ggml_backend_graph_compute", c_int, p, p),
        "backend_free": fn(base, "ggml_backend_free", None, p),
        "gguf_init": fn(base, "gguf_init_from_file", p, c_char_p, _GGUFInitParams),
        "gguf_free": fn(base, "gguf_free", None, p),
        "gguf_find_key": fn(base, "gguf_find_key", c_int64, p, c_char_p),
        "gguf_get_val_str": fn(base, "gguf_get_val_str", c_char_p, p, c_int64),
        "gguf_get_val_u32": fn(base, "gguf_get_val_u32", ctypes.c_uint32, p, c_int64),
        "first_tensor": fn(base, "ggml_get_first_tensor", p, p),
        "next_tensor": fn(base, "ggml_get_next_tensor", p, p, p),
        "get_name": fn(base, "ggml_get_name", c_char_p, p),
        "cpu_init": fn(cpu, "ggml_backend_cpu_init", p),
        "cpu_set_n_threads": fn(cpu, "ggml_backend_cpu_set_n_threads", None, p, c_int),
        "set_batch_invariant_rows": fn(cpu, "ggml_cpu_set_batch_invariant_rows", None, c_int),
        "get_batch_invariant_rows": fn(cpu, "ggml_cpu_get_batch_invariant_rows", c_int),
    }


_lib = functools.cache(_bind)  # bound once, on first use


def set_batch_invariant_rows(n_rows: int) -> None:
    """Host matmuls and attention of at most n_rows tokens compute every row as one token does, bit
    for bit (ggml-cpu's switch, process-wide; 0: llama.cpp's batched kernels at every size)."""
    _lib()["set_batch_invariant_rows"](n_rows)


def batch_invariant_rows() -> int:
    return _lib()["get_batch_invariant_rows"]()


@contextmanager
def batch_invariant(n_rows: int) -> Iterator[None]:
    """set_batch_invariant_rows(n_rows) for the block, the process's own setting back after it."""
    before = batch_invariant_rows()
    set_batch_invariant_rows(n_rows)
    try:
        yield
    finally:
        set_batch_invariant_rows(before)


def hidden_features() -> set[str]:
    """The CPU features hidden from spac's choices by SPAC_HIDE_CPU_FEATURES (comma-separated):
    `amx` takes AMX's buffer type out of every layout spac chooses and its flags out of
    `cpu_model_and_flags`, so that a CPU with AMX runs as one without does (the tests' switch;
    ISA levels below that are compiled in, and take a build of their own: scripts/test_avx2.sh)."""
    names = {f.strip().lower() for f in os.environ.get(HIDE_ENV, "").split(",") if f.strip()}
    unknown = names - set(HIDEABLE)
    if unknown:
        raise ValueError(f"{HIDE_ENV}: unknown feature {', '.join(sorted(unknown))} (known: {', '.join(HIDEABLE)})")
    return names


def cpu_buffer_types() -> dict[str, int]:
    """The CPU device's buffer types by name, in llama.cpp's order: the plain one ("CPU") and
    llama.cpp's extra ones (CPU_EXACT, AMX or KleidiAI where the build and the CPU have them,
    CPU_REPACK), less those of hidden features."""
    g = _lib()
    dev = g["dev_by_type"](0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    out = {"CPU": g["dev_buffer_type"](dev)}
    get = g["reg_get_proc_address"](g["dev_backend_reg"](dev), b"ggml_backend_dev_get_extra_bufts")
    hidden = {HIDEABLE[f] for f in hidden_features()}
    if get:
        extra = ctypes.CFUNCTYPE(ctypes.POINTER(c_void_p), c_void_p)(get)(dev)
        i = 0
        while extra and extra[i]:
            name = g["buft_name"](extra[i]).decode()
            if name not in hidden:
                out[name] = extra[i]
            i += 1
    return out


def usable_buffer_types(exact: bool) -> dict[str, int]:
    """The CPU buffer types a layout may use: CPU_EXACT only in exact mode (out of it, llama.cpp's
    own kernels and layouts, as stock llama.cpp has them)."""
    return {name: buft for name, buft in cpu_buffer_types().items() if exact or name != EXACT_BUFT}


def _device(name: str) -> int:
    g = _lib()
    dev = g["dev_by_type"](0) if name == "CPU" else g["dev_by_name"](name.encode())
    if not dev:
        raise ValueError(f"no ggml device named {name}")
    return dev


def device_buffer_type(name: str) -> int:
    """The default buffer type of the ggml device `name` (CPU, CUDA0, RPC0, ...)."""
    return _lib()["dev_buffer_type"](_device(name))


@contextmanager
def _matmul_graph(ggml_type: int, n_in: int, n_out: int, n_expert: int, n_used: int, n_tokens: int, buft: int,
                  n_threads: int, seed: int = 0, device: str = "CPU", copies: int = 1,
                  sample_rows: int = 64, raw_row: np.ndarray | None = None) -> Iterator[tuple | None]:
    """One MUL_MAT_ID (weight [n_in, n_out, n_expert] of `ggml_type` in buffer type `buft`, F32
    activations [n_in, n_used, n_tokens], n_used distinct random experts per token), or with
    n_expert = 0 one MUL_MAT (weight [n_in, n_out]), on a backend of `device` (the CPU: n_threads
    threads), its weights a few random quantized rows (seeded) repeated: yields (x, ids, out,
    graph, backend), or None where that buffer type does not take the weight. copies > 1: the
    graph computes the matmul `copies` times in a row, each reading its own copy of the weight
    (`out` is the first's). sample_rows: how many distinct rows are repeated; raw_row: one row's
    blocks as stored (uint8), repeated in every row instead."""
    g = _lib()
    dev = _device(device)
    overhead = g["tensor_overhead"]()
    ctx_w = g["init"](_InitParams(overhead * (copies + 1), None, True))
    ctx = g["init"](_InitParams(overhead * (8 + copies) + g["graph_overhead"](), None, True))
    buffers, backend = [], None
    try:
        if n_expert:
            ws = [g["new_tensor_3d"](ctx_w, ggml_type, n_in, n_out, n_expert) for _ in range(copies)]
            x = g["new_tensor_3d"](ctx, _GGML_TYPE_F32, n_in, n_used, n_tokens)
            ids = g["new_tensor_2d"](ctx, _GGML_TYPE_I32, n_used, n_tokens)
            outs = [g["mul_mat_id"](ctx, w, x, ids) for w in ws]
        else:
            ws = [g["new_tensor_2d"](ctx_w, ggml_type, n_in, n_out) for _ in range(copies)]
            x = g["new_tensor_2d"](ctx, _GGML_TYPE_F32, n_in, n_tokens)
            ids, n_used = None, 1
            outs = [g["mul_mat"](ctx, w, x) for w in ws]
        w, out = ws[0], outs[0]
        for c, b in ((ctx_w, buft), (ctx, g["dev_buffer_type"](dev))):
            buffers.append(g["alloc_ctx_tensors"](c, b))
            if not buffers[-1]:
                yield None
                return
        if not g["dev_supports_op"](dev, out):  # e.g. CPU_REPACK and a type or row count it has no kernel for
            yield None
            return
        rng = np.random.default_rng(seed)
        # a few quantized rows repeated: the kernels' speed does not depend on the values, and
        # quantizing a whole tensor (IQ4_NL searches per block) would take longer than timing it
        rows = n_out * max(n_expert, 1)
        sample = min(rows, sample_rows)
        if raw_row is not None:
            block = np.ascontiguousarray(raw_row, dtype=np.uint8)
        else:
            # float32 for ggml (numpy 2 would make the quotient float64, read by ggml as garbage floats)
            src = (rng.standard_normal((sample, n_in), dtype=np.float32) / np.float32(np.sqrt(n_in))).astype(np.float32)
            block = np.empty(g["nbytes"](w) // rows * sample, dtype=np.uint8)
            g["quantize_chunk"](ggml_type, src.ctypes.data, block.ctypes.data, 0, sample, n_in, None)
        data = np.resize(block, g["nbytes"](w))
        for copy in ws:
            g["tensor_set"](copy, data.ctypes.data, 0, data.nbytes)
        xs = rng.standard_normal((n_tokens, n_used, n_in), dtype=np.float32)
        g["tensor_set"](x, xs.ctypes.data, 0, xs.nbytes)
        if ids:
            chosen = np.argsort(rng.random((n_tokens, n_expert)), axis=1)[:, :n_used].astype(np.int32)
            g["tensor_set"](ids, chosen.ctypes.data, 0, chosen.nbytes)
        graph = g["new_graph"](ctx)
        for o in outs:
            g["build_forward_expand"](graph, o)
        if device == "CPU":
            backend = g["cpu_init"]()
            g["cpu_set_n_threads"](backend, n_threads)
        else:
            backend = g["dev_init"](dev, None)
        yield x, ids, out, graph, backend
    finally:
        if backend:
            g["backend_free"](backend)
        for b in buffers:
            if b:
                g["buffer_free"](b)
        g["free"](ctx)
        g["free"](ctx_w)


@functools.lru_cache(maxsize=1)
def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (sysfs, read once), or 64 MiB where it is not told."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        m = re.fullmatch(r"(\d+)([KMG]?)", f.read_text().strip())
        if m:
            sizes.append(int(m[1]) << {"": 0, "K": 10, "M": 20, "G": 30}[m[2]])
    return max(sizes, default=64 << 20)


def cold_copies(weight_bytes: int, touched: float = 1.0) -> int:
    """How many copies of a weight a timing rotates through so that a run reads them from memory,
    as a model's decode does (a few MB of experts timed again and again would sit in the
    last-level cache): COLD_CACHE_FACTOR times the cache's size in the bytes a matmul reads (`touched`: its share of
    the weight), at most COLD_MAX_COPIES and COLD_MAX_BYTES of copies."""
    read = max(weight_bytes * touched, 1.0)
    wanted = -(-COLD_CACHE_FACTOR * last_level_cache_bytes() // read)
    return int(max(1, min(COLD_MAX_COPIES, COLD_MAX_BYTES // max(weight_bytes, 1), wanted)))


def time_matmul(ggml_type: int, n_in: int, n_out: int, n_expert: int, n_used: int, n_tokens: int,
                buft: int, n_threads: int, repeats: int = 3, seed: int = 0, cold: bool | None = None) -> float | None:
    """Seconds of one MUL_MAT_ID or MUL_MAT (`_matmul_graph`), the best of at least `repeats` runs
    after a warm-up; None where that buffer type does not take the weight. cold: the weights come
    from memory, not the cache (`cold_copies` copies in turn; the time is per copy); by default
    for a decode's batches (a prompt's ubatch computes long enough per weight for the read not
    to matter)."""
    with matmul_timer(ggml_type, n_in, n_out, n_expert, n_used, n_tokens, buft, n_threads, seed, cold) as timer:
        return None if timer is None else timer(repeats)


@contextmanager
def matmul_timer(ggml_type: int, n_in: int, n_out: int, n_expert: int, n_used: int, n_tokens: int,
                 buft: int, n_threads: int, seed: int = 0, cold: bool | None = None) -> Iterator:
    """time_matmul's graph, built once: yields timer(repeats) -> seconds per matmul (a warm-up,
    then the best of the runs), to be called as often as wanted (exact_variant.py times every
    kernel variant on one graph), or None where the buffer type does not take the weight."""
    g = _lib()
    copies = 1
    if cold if cold is not None else n_tokens < PREFILL_MIN_TOKENS:
        rows = n_out * max(n_expert, 1)
        row_bytes = g["row_size"](ggml_type, n_in)
        # a MUL_MAT_ID reads the experts its tokens chose: about this share of them
        touched = 1.0 if not n_expert else min(1.0, 1.0 - (1.0 - n_used / n_expert) ** n_tokens)
        copies = cold_copies(rows * row_bytes, touched)
    with _matmul_graph(ggml_type, n_in, n_out, n_expert, n_used, n_tokens, buft, n_threads, seed,
                       copies=copies) as built:
        if built is None:
            yield None
            return
        _, _, _, graph, backend = built

        def timer(repeats: int = 3) -> float:
            t = time.perf_counter()
            g["graph_compute"](backend, graph)  # warm-up
            first = time.perf_counter() - t
            best = float("inf")
            # at least `repeats`, and ~20 ms in all: a sub-millisecond matmul is noisy one run at a time
            for _ in range(max(repeats, min(50, int(0.02 / max(first, 1e-6))))):
                t = time.perf_counter()
                g["graph_compute"](backend, graph)
                best = min(best, time.perf_counter() - t)
            return best / copies

        yield timer


def matmul_output(ggml_type: int, n_in: int, n_out: int, n_expert: int, xs: np.ndarray, ids: np.ndarray | None,
                  buft: int, n_threads: int, seed: int = 0, device: str = "CPU", sample_rows: int = 64) -> np.ndarray | None:
    """The output of `_matmul_graph`'s matmul (the weights of `seed`) for these activations
    (F32 [n_tokens, n_used, n_in]; MUL_MAT: n_used 1) and experts (int32 [n_tokens, n_used];
    None for MUL_MAT): F32 [n_tokens, n_used, n_out]. None where the buffer type does not take
    the weight. What bench/batch_invariance.py compares between batch sizes."""
    with matmul_runner(ggml_type, n_in, n_out, n_expert, xs, ids, buft, seed, device, sample_rows) as run:
        return None if run is None else run(n_threads)


@contextmanager
def matmul_runner(ggml_type: int, n_in: int, n_out: int, n_expert: int, xs: np.ndarray, ids: np.ndarray | None,
                  buft: int, seed: int = 0, device: str = "CPU", sample_rows: int = 64,
                  raw_row: np.ndarray | None = None) -> Iterator:
    """matmul_output's graph, built once: yields run(n_threads) -> the output, to be called as often
    as wanted (tests/test_exact_variant.py computes it under every kernel variant), or None.
    raw_row: one row's stored blocks for every row, instead of random rows (see `_matmul_graph`)."""
    g = _lib()
    n_tokens, n_used, _ = xs.shape
    with _matmul_graph(ggml_type, n_in, n_out, n_expert, n_used, n_tokens, buft, 1, seed, device,
                       sample_rows=sample_rows, raw_row=raw_row) as built:
        if built is None:
            yield None
            return
        x, ids_t, out, graph, backend = built
        xs = np.ascontiguousarray(xs, dtype=np.float32)
        g["tensor_set"](x, xs.ctypes.data, 0, xs.nbytes)
        if ids_t:
            chosen = np.ascontiguousarray(ids, dtype=np.int32)
            g["tensor_set"](ids_t, chosen.ctypes.data, 0, chosen.nbytes)

        def run(n_threads: int) -> np.ndarray:
            if device == "CPU":
                g["cpu_set_n_threads"](backend, n_threads)
            g["graph_compute"](backend, graph)
            result = np.empty((n_tokens, n_used, n_out), dtype=np.float32)
            g["tensor_get"](out, result.ctypes.data, 0, result.nbytes)
            return result

        yield run


@functools.lru_cache(maxsize=4096)
def supports(ggml_type: int, ne: tuple[int, ...], buft: int, op: str = MUL_MAT, n_used: int = 1) -> bool:
    """Whether the buffer type takes a weight of this type and shape (ne, ggml's order) for `op`,
    asked as llama.cpp's loader asks (weight_buft_supported): the op at LOADER_TOKENS tokens, the
    weight in an empty buffer of the type, no data, no compute. MUL_MAT_ID: ne is
    (n_in, n_out, n_expert) and n_used experts per token; MUL_MAT of a 3-D weight is batched over
    its third dimension (DeepSeek's per-head attn_k_b and attn_v_b)."""
    g = _lib()
    dev = g["dev_by_type"](0)
    overhead = g["tensor_overhead"]()
    ctx = g["init"](_InitParams(overhead * 8, None, True))
    buf = None
    try:
        n_in, n_out, n_mat = (*ne, 1, 1)[:3]
        w = g["new_tensor_3d"](ctx, ggml_type, n_in, n_out, n_mat)
        if op == MUL_MAT_ID:
            x = g["new_tensor_3d"](ctx, _GGML_TYPE_F32, n_in, n_used, LOADER_TOKENS)
            node = g["mul_mat_id"](ctx, w, x, g["new_tensor_2d"](ctx, _GGML_TYPE_I32, n_used, LOADER_TOKENS))
        else:
            node = g["mul_mat"](ctx, w, g["new_tensor_4d"](ctx, _GGML_TYPE_F32, n_in, LOADER_TOKENS, n_mat, 1))
        buf = g["buft_alloc_buffer"](buft, 0)
        if not buf:
            return False
        _TensorHead.from_address(w).buffer = buf
        return bool(g["dev_supports_op"](dev, node))
    finally:
        if buf:
            g["buffer_free"](buf)
        g["free"](ctx)


def weight_op(name: str, ne: list[int]) -> str | None:
    """The op that reads a weight, as llama.cpp's tensor table has it, for the weights a layout can
    place: the routed experts' MUL_MAT_ID, every other matrix's MUL_MAT; None for the token
    embeddings (GET_ROWS) and vectors (norms, biases)."""
    if len(ne) < 2 or name.startswith(("token_embd", "per_layer_token_embd")):
        return None
    return MUL_MAT_ID if "_exps" in name and len(ne) == 3 else MUL_MAT


# ----------------------------------------------------------------------------- the choice

@dataclass
class TypeChoice:
    """The layout of one tensor type's host weights and why, with the expert matmul's times
    (ms at DECODE_TOKENS, VERIFY_TOKENS and PREFILL_TOKENS per model; None: no such kernel)."""

    type: str
    repack: bool
    why: str
    plain_ms: list[float] = field(default_factory=list)
    repack_ms: list[float] | None = None
    plain_prefill: bool = False  # repacked for decoding, and prefill reads the file's plain layout
    buft: str = REPACK_BUFT      # the repacked layout: CPU_EXACT where it takes the type

    @property
    def layout(self) -> str:
        repacked = "repacked" if self.buft == REPACK_BUFT else self.buft
        return (f"{repacked}, plain for prefill" if self.plain_prefill else repacked) if self.repack else "plain"


@dataclass
class DenseChoice:
    """The buffer type of one tensor type's dense host weights (attention, shared experts, output
    head: MUL_MAT, where llama.cpp also has AMX) and why, with the times (ms at DECODE_TOKENS,
    VERIFY_TOKENS and PREFILL_TOKENS) of every buffer type that takes them."""

    type: str
    buft: str
    why: str
    ms: dict[str, list[float]] = field(default_factory=dict)
    plain_prefill: bool = False  # in buft for decoding, and prefill reads the file's plain layout


@dataclass
class HostLayout:
    mode: Repack                                # --repack
    use_extra_bufts: bool                       # llama.cpp's own choice (mode "on")
    # mode "on" with layers on a GPU: llama.cpp lists the GPU's pinned host buffer type before its
    # repacked one, and a mapped file then turns that choice into plain CPU_Mapped; skipping the
    # host type (llama.cpp's --no-host) lets every weight it can repack be repacked
    no_host: bool = False
    repacked: list[str] = field(default_factory=list)   # tensor names given CPU_REPACK
    types: dict[str, TypeChoice] = field(default_factory=dict)
    dense: dict[str, DenseChoice] = field(default_factory=dict)
    placed: dict[str, list[str]] = field(default_factory=dict)  # other buffer types (CPU_EXACT, AMX): tensor names
    n_plain_twins: int = 0                      # repacked tensors with a plain twin for prefill
    exact: bool = True                          # chosen for exact mode (CPU_EXACT is used only then)
    experts_on_disk: bool = False               # the routed experts stay in the file mapping (host_tier.py): plain
    # tensors whose type's chosen layout has no kernel for the op that reads them (DeepSeek's 3-D
    # attn_k_b, MUL_MAT batched over heads): name -> the layout refused; they stay plain
    fallbacks: dict[str, str] = field(default_factory=dict)
    # auto with experts in CPU_EXACT: its one-token kernels' variant (exact_variant.Variant.key),
    # chosen by the times of each variant tried (ms of one token through the experts)
    kernel_variant: str | None = None
    variant_ms: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.mode = Repack.of(self.mode)

    def overrides(self) -> list[tuple[bytes, int]]:
        """llama.cpp tensor-buffer overrides (regex, buffer type) putting `repacked` in CPU_REPACK
        and `placed` in theirs."""
        bufts = cpu_buffer_types()
        return [(names_pattern(names), bufts[buft])
                for buft, names in ((REPACK_BUFT, self.repacked), *self.placed.items()) if names]

    def place(self, name: str, buft: str) -> None:
        """The tensor `name` goes to the buffer type `buft` (not the plain one)."""
        (self.repacked if buft == REPACK_BUFT else self.placed.setdefault(buft, [])).append(name)

    def placement(self) -> dict[str, int]:
        """Tensors per buffer type other than the plain one."""
        return {b: len(n) for b, n in ((REPACK_BUFT, self.repacked), *self.placed.items()) if n}

    def report(self) -> str:
        text = self._report()
        return f"experts plain, on the disk; other weights: {text}" if self.experts_on_disk else text

    def _report(self) -> str:
        fallback = f"; {len(self.fallbacks)} tensors plain where their layout has no kernel for their op" \
            if self.fallbacks else ""
        if self.mode is Repack.OFF:
            return "plain (--repack off)"
        if self.mode is Repack.ON:
            placed = ", ".join(f"{b} {n}" for b, n in self.placement().items()) or "none"
            first = "CPU_EXACT, then " if self.exact else ""
            return f"each weight in the first of {first}llama.cpp's layouts that takes it: {placed} tensors (--repack on)"
        experts = "; ".join(f"{c.type} {c.layout} ({c.why})" for c in self.types.values()) or "plain (no quantized experts)"
        dense = "; ".join(f"{c.type} {'plain' if c.buft == 'CPU' else c.buft}{', plain for prefill' if c.plain_prefill else ''}"
                          f" ({c.why})" for c in self.dense.values())
        return (f"{experts}; dense weights: {dense}" if dense else experts) + self._variant_report() + fallback

    def _variant_report(self) -> str:
        if self.kernel_variant is None:
            return ""
        ms, default = self.variant_ms, exact_variant.DEFAULT.key
        gain = f", {ms[default] / ms[self.kernel_variant]:.2f}x the default's" if default in ms else ""
        return f"; {EXACT_BUFT} one-token kernels: {exact_variant.Variant.of_key(self.kernel_variant)}{gain}"

    def plain_prefill_types(self) -> tuple[list[int], list[int]]:
        """ggml types whose repacked weights read a plain twin on prefill ubatches: the experts', the
        dense weights'."""
        import gguf

        def twinned(choices) -> list[int]:
            return [gguf.GGMLQuantizationType[c.type].value for c in choices if c.plain_prefill]

        return twinned(self.types.values()), twinned(self.dense.values())

    def to_dict(self) -> dict:
        return {"mode": self.mode.value, "types": {k: {**asdict(v), "layout": v.layout} for k, v in self.types.items()},
                "dense": {k: asdict(v) for k, v in self.dense.items()},
                "n_repacked_tensors": len(self.repacked) if self.mode is not Repack.OFF else None,
                "placement": self.placement(), "exact": self.exact, "fallbacks": self.fallbacks,
                "n_plain_twins": self.n_plain_twins, "experts_on_disk": self.experts_on_disk,
                "kernel_variant": self.kernel_variant, "variant_ms": self.variant_ms}


def names_pattern(names: list[str]) -> bytes:
    """One regex matching exactly these tensor names, the layers of a name folded into one group
    (llama.cpp compiles each override once per tensor it loads: a model's thousand names would be
    a thousand alternatives)."""
    layers: dict[str, set[str]] = {}
    parts = []
    for name in names:
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
        if m:
            layers.setdefault(m[2], set()).add(m[1])
        else:
            parts.append(re.escape(name))
    parts += [rf"blk\.({'|'.join(sorted(blocks, key=int))})\.{re.escape(rest)}" for rest, blocks in layers.items()]
    return f"^({'|'.join(parts)})$".encode()


class Weights(NamedTuple):
    n_used: int                               # experts per token
    tensors: list[tuple[str, int, list[int]]]  # (name, ggml type, ne) of every tensor
    n_block: int                              # repeating layers (block_count)


def read_weights(path: str | Path) -> Weights:
    """The weights of a GGUF from its header, read by ggml's own parser (gguf-py's reader parses
    the whole vocabulary: seconds on a 150k-token file)."""
    g = _lib()
    ctx = c_void_p()
    gguf_ctx = g["gguf_init"](str(path).encode(), _GGUFInitParams(True, ctypes.pointer(ctx)))
    if not gguf_ctx:
        raise ValueError(f"{path}: not a readable GGUF file")
    try:
        arch_key = g["gguf_find_key"](gguf_ctx, b"general.architecture")
        arch = g["gguf_get_val_str"](gguf_ctx, arch_key).decode() if arch_key >= 0 else ""
        used_key = g["gguf_find_key"](gguf_ctx, f"{arch}.expert_used_count".encode())
        n_used = int(g["gguf_get_val_u32"](gguf_ctx, used_key)) if used_key >= 0 else 1
        block_key = g["gguf_find_key"](gguf_ctx, f"{arch}.block_count".encode())
        n_block = int(g["gguf_get_val_u32"](gguf_ctx, block_key)) if block_key >= 0 else 0
        tensors = []
        t = g["first_tensor"](ctx)
        while t:
            head = _TensorHead.from_address(t)
            ne = list(head.ne)
            while len(ne) > 1 and ne[-1] == 1:
                ne.pop()
            tensors.append((g["get_name"](t).decode(), int(head.type), ne))
            t = g["next_tensor"](ctx, t)
        return Weights(n_used, tensors, n_block)
    finally:
        g["free"](ctx)
        g["gguf_free"](gguf_ctx)


def layout_cache_path() -> Path:
    return cache_path().with_name("host_layout.json")


def cpu_model_and_flags() -> tuple[str, set[str]]:
    """This CPU's model name and feature flags, from /proc/cpuinfo (x86 "flags", Arm "Features")."""
    model, flags = "?", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "?":
                model = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    for feature in hidden_features():
        flags = {f for f in flags if not f.startswith(feature)}
    return model, flags


def _cpu_key() -> str:
    """What the times depend on: the CPU (a model name alone is ambiguous: "AMD EPYC" comes with
    and without AVX-512), the build of ggml-cpu and how the timing keeps the weights out of cache."""
    model, flags = cpu_model_and_flags()
    lib = Path(ggml_library("ggml-cpu")._name).stat()
    key = f"{model}|{' '.join(sorted(flags))}|{os.cpu_count()}|{lib.st_size}-{lib.st_mtime_ns}|cold{COLD_CACHE_FACTOR}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def repacked_buft(ggml_type: int, shapes: list[tuple[int, ...]], bufts: dict, experts: bool = True) -> str | None:
    """The repacked layout a type's weights of these shapes (experts: (n_in, n_out, n_expert, ...);
    else dense: (n_in, n_out)) would take: CPU_EXACT where it takes them all, else CPU_REPACK where
    it does (None: neither)."""
    for name in (EXACT_BUFT, REPACK_BUFT):
        if name in bufts and all(supports(ggml_type, s[:3], bufts[name], MUL_MAT_ID, s[3]) if experts
                                 else supports(ggml_type, s[:2], bufts[name]) for s in shapes):
            return name
    return None


def _timed(ggml_type: int, shapes: list[tuple[int, int, int, int]], n_threads: int, bufts: dict,
           repacked: str | None) -> tuple[list, list | None]:
    """The summed time (ms) of the type's expert matmuls at each batch, plain and in the
    `repacked` buffer type (None: no repacked kernel for them)."""
    if repacked is None:
        return [], None  # nothing to choose: not timed
    out = {}
    for layout in ("CPU", repacked):
        out[layout] = []
        for n_tokens in (DECODE_TOKENS, VERIFY_TOKENS, PREFILL_TOKENS):
            total = 0.0
            for n_in, n_out, n_expert, n_used in shapes:
                ne = min(n_expert, MAX_BENCH_EXPERTS)
                toks = max(1, n_tokens * ne // n_expert) if n_tokens == PREFILL_TOKENS else n_tokens
                t = time_matmul(ggml_type, n_in, n_out, ne, min(n_used, ne), toks, bufts[layout], n_threads)
                total += t * 1e3 * (n_tokens / toks)  # the prefill's share, rescaled to its token count
            out[layout].append(total)
    return out["CPU"], out[repacked]


def _timed_dense(ggml_type: int, shapes: list[tuple[int, int]], n_threads: int, bufts: dict) -> dict[str, list[float]]:
    """Per buffer type that takes every one of the type's dense weights, the summed time (ms) of
    their matmuls at each batch. Where CPU_EXACT takes them, only it and the plain layout (the
    others sum in other orders)."""
    out = {}
    exact = repacked_buft(ggml_type, shapes, bufts, experts=False) == EXACT_BUFT
    for name, buft in bufts.items():
        if exact and name not in ("CPU", EXACT_BUFT):
            continue
        if not all(supports(ggml_type, (n_in, n_out), buft) for n_in, n_out in shapes):
            continue
        out[name] = []
        for n_tokens in (DECODE_TOKENS, VERIFY_TOKENS, PREFILL_TOKENS):
            total = 0.0
            for n_in, n_out in shapes:
                rows = min(n_out, MAX_BENCH_ROWS)
                if rows < n_out and not supports(ggml_type, (n_in, rows), buft):
                    rows = n_out
                t = time_matmul(ggml_type, n_in, rows, 0, 1, n_tokens, buft, n_threads)
                total += t * 1e3 * (n_out / rows)
            out[name].append(total)
    return out


def dense_layout(ms: dict[str, list[float]]) -> str:
    """The dense weights' buffer type from their times per buffer type: decode (one token and the
    verify batch) decides, as for the experts; the fastest layout that beats the plain one by its
    margin (none for CPU_REPACK and CPU_EXACT, DENSE_MIN_GAIN for any other), else plain."""
    plain = ms["CPU"][0] + ms["CPU"][1]
    for buft in sorted(ms, key=lambda b: ms[b][0] + ms[b][1]):
        if buft == "CPU":
            return "CPU"
        if plain / (ms[buft][0] + ms[buft][1]) >= (1.0 if buft in (REPACK_BUFT, EXACT_BUFT) else DENSE_MIN_GAIN):
            return buft
    return "CPU"


def plain_prompts_pay(plain_ms: list[float], repacked_ms: list[float]) -> bool:
    """Whether a prompt ubatch (the times' third entry) in the plain layout beats the repacked one by
    PLAIN_TWIN_MIN_GAIN: then prompts read a plain twin."""
    return plain_ms[2] * PLAIN_TWIN_MIN_GAIN < repacked_ms[2]


def on_host(name: str, n_gpu_layers: int, n_block: int) -> bool:
    """Whether llama.cpp keeps a weight in host memory with n_gpu_layers layers on a GPU (spac's
    count: the last n repeating layers and the output; -1 every layer): the routed experts always
    (--cpu-moe), the repeating layers below the offloaded ones, the input layer."""
    if n_gpu_layers == 0 or "_exps" in name:
        return True
    block = re.match(r"blk\.(\d+)\.", name)
    if block is None:
        return name.startswith("token_embd")
    return 0 <= n_gpu_layers and int(block[1]) < n_block - n_gpu_layers


def first_taking(ggml_type: int, ne: list[int], op: str, n_used: int, bufts: dict[str, int]) -> str:
    """llama.cpp's rule for a weight (select_weight_buft over its CPU list): the first extra
    buffer type that takes it for its op, else the plain layout."""
    for name, buft in bufts.items():
        if name != "CPU" and supports(ggml_type, tuple(ne), buft, op, n_used):
            return name
    return "CPU"


def _choose_variant(layout: HostLayout, experts: dict[int, set], n_threads: int, bufts: dict, cached: dict,
                    key_base: str) -> None:
    """Under auto, the variant of CPU_EXACT's one-token kernels for the expert types placed in it,
    timed on their shapes (`exact_variant`, cached like the layouts' times)."""
    import gguf

    exact_types = {t: sorted(shapes) for t, shapes in experts.items()
                   if (c := layout.types.get(gguf.GGMLQuantizationType(t).name)) and c.repack and c.buft == EXACT_BUFT}
    if not exact_types:
        return
    key = f"{key_base}|variant|{sorted(exact_types.items())}"
    if key not in cached:
        # as many experts as _timed takes: one token reads n_used of them whatever their count
        timed = {t: [(n_in, n_out, min(ne, MAX_BENCH_EXPERTS), min(nu, ne, MAX_BENCH_EXPERTS)) for n_in, n_out, ne, nu in shapes]
                 for t, shapes in exact_types.items()}
        with progress.phase(f"timing {EXACT_BUFT}'s kernel variants"):
            cached[key] = exact_variant.measure(matmul_timer, timed, n_threads, bufts[EXACT_BUFT])
    layout.variant_ms = cached[key]
    layout.kernel_variant = exact_variant.choose(layout.variant_ms).key


def choose(path: str | Path, n_threads: int, mode: Repack | str = Repack.AUTO, n_gpu_layers: int = 0,
           cache: Path | None = None, exact: bool | None = None, experts_on_disk: bool = False) -> HostLayout:
    """The host layout of the weights of the GGUF at `path` under `--repack mode`, for exact mode
    or not (None: as the process's batch-invariant mode is set now, which the session sets before
    it loads). Every weight a layout names is asked whether its buffer type takes the op that
    reads it; the overrides name every placed tensor, and nothing else is repacked.

    on: each host weight in the first buffer type of llama.cpp's list that takes it (its own
    `--repack 1` rule): CPU_EXACT first in exact mode, else AMX, CPU_REPACK; out of exact mode
    that is stock llama.cpp's placement.

    n_gpu_layers != 0: layers go to a GPU. llama.cpp's scheduler copies a large ubatch's host weights to
    the GPU only from a host buffer, which neither CPU_REPACK nor CPU_EXACT is: under auto,
    experts of the types CPU_EXACT takes go to it in exact mode with plain twins (host buffers
    over the file's bytes) for a prompt's ubatches, the others stay plain.

    experts_on_disk: the routed experts stay in the file mapping, in its layout (patch 0030), so
    only the other weights are chosen for. In exact mode this computes what the in-memory layout
    does: the plain layout of CPU_EXACT's types takes its kernels in batch-invariant mode."""
    mode = Repack.of(mode)
    exact = batch_invariant_rows() > 0 if exact is None else exact
    if mode is Repack.OFF:
        return HostLayout(mode, use_extra_bufts=False, exact=exact, experts_on_disk=experts_on_disk)
    import gguf

    offloaded = n_gpu_layers != 0
    bufts = usable_buffer_types(exact)
    layout = HostLayout(mode, use_extra_bufts=False, no_host=mode is Repack.ON, exact=exact, experts_on_disk=experts_on_disk)
    try:
        n_used, tensors, n_block = read_weights(path)
    except ValueError:  # not a GGUF ggml can read: llama.cpp's loader says why in its own words
        return layout
    host = [(name, t, ne, weight_op(name, ne)) for name, t, ne in tensors if on_host(name, n_gpu_layers, n_block)]
    host = [w for w in host if w[3] is not None and not (experts_on_disk and w[3] == MUL_MAT_ID)]
    if mode is Repack.ON:
        for name, ggml_type, ne, op in host:
            buft = first_taking(ggml_type, ne, op, n_used, bufts)
            if buft != "CPU":
                layout.place(name, buft)
        return layout
    if REPACK_BUFT not in bufts and EXACT_BUFT not in bufts:
        return layout
    experts: dict[int, set] = {}
    dense: dict[int, set] = {}
    weights = []  # (name, type, shape, op) of every matrix the choice may place
    for name, ggml_type, shape, op in host:
        if ggml_type in (0, 1, 30):  # F32, F16, BF16
            continue
        if offloaded and (op != MUL_MAT_ID or repacked_buft(ggml_type, [(*shape, n_used)], bufts) != EXACT_BUFT):
            continue
        weights.append((name, ggml_type, shape, op))
        if op == MUL_MAT_ID:
            experts.setdefault(ggml_type, set()).add((shape[0], shape[1], shape[2], n_used))
        elif len(shape) == 2 and not offloaded:  # with a GPU the dense weights are on it
            dense.setdefault(ggml_type, set()).add((shape[0], shape[1]))
    cache = cache or layout_cache_path()
    try:
        cached = json.loads(cache.read_text())
    except (OSError, ValueError):
        cached = {}
    # exact mode changes what the plain layout computes with (CPU_EXACT's kernels or llama.cpp's)
    # and which layouts may be chosen
    key_base = f"{_cpu_key()}|{n_threads}|exact={exact}"
    for ggml_type, shapes in sorted(experts.items()):
        name = gguf.GGMLQuantizationType(ggml_type).name
        if offloaded:  # only CPU_EXACT's types, not timed: the host decodes exactly and fast, a prompt goes to the GPU
            layout.types[name] = TypeChoice(name, True, f"{EXACT_BUFT}, plain twins for the GPU's prompts",
                                            plain_prefill=True, buft=EXACT_BUFT)
            continue
        buft = repacked_buft(ggml_type, sorted(shapes), bufts)
        key = f"{key_base}|{name}|{buft}|{sorted(shapes)}"
        if key not in cached:
            with progress.phase(f"timing host layouts: {name} experts"):  # a cache miss: seconds on a large model
                plain, repacked = _timed(ggml_type, sorted(shapes), n_threads, bufts, buft)
            cached[key] = {"plain_ms": plain, "repack_ms": repacked}
        plain, repacked = cached[key]["plain_ms"], cached[key]["repack_ms"]
        if repacked is None:
            choice = TypeChoice(name, False, "no repacked kernel on this CPU", plain, None)
        else:
            gain = (plain[0] + plain[1]) / (repacked[0] + repacked[1])
            why = f"{buft}: decode {gain:.2f}x, prefill {plain[2] / repacked[2]:.2f}x"
            choice = TypeChoice(name, gain > 1.0, why, plain, repacked,
                                plain_prefill=gain > 1.0 and plain_prompts_pay(plain, repacked), buft=buft)
        layout.types[name] = choice
    for ggml_type, shapes in sorted(dense.items()):
        name = gguf.GGMLQuantizationType(ggml_type).name
        # timed on the shapes some layout other than the plain one takes (a tiny model's output head
        # of 484 rows fits no row group): the others stay plain, as fallbacks, whatever is chosen
        shapes = {sh for sh in shapes if any(supports(ggml_type, sh, bufts[b]) for b in bufts if b != "CPU")}
        if not shapes:
            continue
        key = f"{key_base}|dense|{name}|{sorted(shapes)}"
        if key not in cached:
            with progress.phase(f"timing host layouts: {name} dense weights"):
                cached[key] = _timed_dense(ggml_type, sorted(shapes), n_threads, bufts)
        ms = cached[key]
        if not ms:
            continue
        chosen = dense_layout(ms)
        shown = chosen if chosen != "CPU" else min(ms, key=lambda b: ms[b][0] + ms[b][1])  # else the best refused
        plain = ms["CPU"]
        gain = (plain[0] + plain[1]) / (ms[shown][0] + ms[shown][1])
        why = f"{shown}: decode {gain:.2f}x, prefill {plain[2] / ms[shown][2]:.2f}x"
        # as the experts: decoding in the chosen layout, a prompt in the file's where that is faster
        layout.dense[name] = DenseChoice(name, chosen, why, ms,
                                         plain_prefill=chosen != "CPU" and plain_prompts_pay(plain, ms[chosen]))
    _choose_variant(layout, experts, n_threads, bufts, cached, key_base)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps(cached, indent=1))
        tmp.replace(cache)
    except OSError:
        pass  # a read-only cache dir only costs the measurement next time
    expert_buft = {gguf.GGMLQuantizationType[n].value: c.buft for n, c in layout.types.items() if c.repack}
    dense_buft = {gguf.GGMLQuantizationType[n].value: c.buft for n, c in layout.dense.items()}
    for name, ggml_type, shape, op in weights:
        buft = (expert_buft if op == MUL_MAT_ID else dense_buft).get(ggml_type, "CPU")
        if buft == "CPU":
            continue
        if not supports(ggml_type, tuple(shape), bufts[buft], op, n_used):
            layout.fallbacks[name] = buft  # e.g. a 3-D MUL_MAT: that layout's kernels take matrices only
            continue
        layout.place(name, buft)
    return layout
