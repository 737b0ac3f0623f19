"""ctypes bindings to spac's native engine (native/include/spac.h, built into the patched llama.cpp).

The functions live in the same libllama that llama-cpp-python loads, so they are bound to
its handle. `ExpertEngine` owns one `spac_engine` (one device), `SeveralPools` one per device;
routing is read through numpy views of the context's host buffer (no copies).

Why ~670 lines: one ctypes binding per C function of spac.h (with its struct layouts, held
against the header by tests/test_spac_header.py) and the wrappers that own native memory
(ExpertEngine, SeveralPools, Routing, ExpertsOnDisk); the pool's devices and budgets are pool.py,
the RPC backend's server and client side rpc.py, the host tier's rule host_tier.py.
"""

from __future__ import annotations

import ctypes
import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from ctypes import POINTER, c_bool, c_char_p, c_double, c_float, c_int32, c_size_t, c_uint64, c_void_p

import numpy as np

from orchestrator.runtime.pool import DEFAULT_BUDGET_RATIO, PoolDevice, StreamPrefill
from orchestrator.policies.plan import Plan

_ERR_LEN = 512
_UINT8, _INT32 = np.dtype(np.uint8), np.dtype(np.int32)


class SpacEngineParams(ctypes.Structure):
    _fields_ = [
        ("model_path", c_char_p),
        ("device", c_char_p),
        ("budget_bytes", c_uint64),
        ("budget_ratio", c_float),
        ("max_split_tokens", c_int32),
        ("no_evict", c_bool),
        ("copy_delay_us", c_int32),
        ("split_graph", c_int32),
        ("join", c_int32),
        ("skip_absent", c_bool),
        ("only_half", c_int32),
        ("stream_prefill", c_int32),
        ("layer_begin", c_int32),
        ("layer_end", c_int32),
        ("upload_on_miss_tokens", c_int32),
        ("copy_batch_experts", c_int32),
        ("pin_mapping", c_bool),
        ("miss_gate_tokens", c_int32),
    ]


MISS_MAX_TOKENS = 64  # spac.h SPAC_MISS_MAX_TOKENS


class SpacMissCosts(ctypes.Structure):
    _fields_ = [
        ("upload_us", c_float),
        ("sync_us", c_float),
        ("horizon_tokens", c_float),
        ("host_us", c_float * MISS_MAX_TOKENS),
        ("device_us", c_float * MISS_MAX_TOKENS),
    ]


# how a split MoE layer is laid out (spac.h enum spac_split_graph): "overlap" runs the device
# experts on the device and the host experts on the host, the device half queued first, one
# crossing each way; "per-matmul" splits every expert matmul and sums it at once (the baseline)
SPLIT_GRAPHS = {"overlap": 0, "per-matmul": 1}
# a large ubatch's experts through the pool (pool.StreamPrefill): its value in enum spac_stream_prefill
STREAM_PREFILL = {StreamPrefill.OFF: 0, StreamPrefill.AHEAD: 1, StreamPrefill.USED: 2}
# where the halves meet (enum spac_join): "auto" = per expert on a CPU pool, partial sums on a device
JOINS = {"auto": 0, "per-expert": 1, "partial-sums": 2}
# a plan's copies per batch where the device queues copies without copying them again (patch 0024)
COPY_BATCH_EXPERTS = 8
# benchmarks only: time one half of every split layer alone (the outputs are then wrong)
ONLY_HALF = {None: 0, "device": 1, "host": 2}


class SpacEngineStats(ctypes.Structure):
    _fields_ = [
        ("n_expert_tokens_device", c_uint64),
        ("n_expert_tokens_cpu", c_uint64),
        ("bytes_copied", c_uint64),
        ("n_copies", c_uint64),
        ("n_evictions", c_uint64),
        ("n_prefetch_late", c_uint64),
        ("copy_busy_us", c_double),
        ("n_slots", c_int32),
        ("n_resident", c_int32),
        ("n_staged", c_uint64),
        ("bytes_staged", c_uint64),
        ("stage_copy_us", c_double),
        ("stage_wait_us", c_double),
        ("n_copy_calls", c_uint64),
        ("n_copy_batches", c_uint64),
        ("n_stage_batches", c_uint64),
        ("bytes_pinned", c_uint64),
        ("n_gate_uploads", c_uint64),
        ("n_gate_host", c_uint64),
        ("n_gate_streamed", c_uint64),
    ]


class SpacDiskStats(ctypes.Structure):
    _fields_ = [
        ("n_gate_experts", c_uint64),
        ("n_stalls", c_uint64),
        ("bytes_stalled", c_uint64),
        ("n_read_ahead", c_uint64),
        ("bytes_read_ahead", c_uint64),
        ("n_dropped", c_uint64),
        ("gate_advise_ns", c_uint64),
    ]


# spac.h enum spac_disk_advice: read an expert from the disk in the background, or drop its pages
DISK_READ, DISK_DROP = 0, 1


@dataclass(frozen=True)
class MissCosts:
    """spac's miss rule's costs, in seconds (spac.h struct spac_miss_costs): one expert's upload,
    the device half's wait for the gate, an upload's credit horizon in tokens, and one expert's
    compute on the host and on the device as functions of its token count."""

    upload_s: float
    sync_s: float
    horizon_tokens: float
    host_s: Callable[[np.ndarray], np.ndarray]
    device_s: Callable[[np.ndarray], np.ndarray]

    def native(self) -> SpacMissCosts:
        c = SpacMissCosts()
        c.upload_us, c.sync_us, c.horizon_tokens = self.upload_s * 1e6, self.sync_s * 1e6, self.horizon_tokens
        n = np.arange(1, MISS_MAX_TOKENS + 1, dtype=np.float64)
        c.host_us[:] = (np.broadcast_to(self.host_s(n), n.shape) * 1e6).tolist()
        c.device_us[:] = (np.broadcast_to(self.device_s(n), n.shape) * 1e6).tolist()
        return c


class NativeError(RuntimeError):
    """The native engine refused a request; the message says why."""


def _bind():
    from llama_cpp import llama_cpp as low

    lib = low._lib
    if not hasattr(lib, "spac_engine_create"):
        raise NativeError("this llama-cpp-python was not built from spac's patch series: run scripts/build_native.py")

    def fn(name, restype, *argtypes):
        f = getattr(lib, name)
        f.restype, f.argtypes = restype, list(argtypes)
        return f

    ctx_p, eng_p = c_void_p, c_void_p
    i32p = POINTER(c_int32)
    return {
        "default_params": fn("spac_engine_default_params", SpacEngineParams),
        "create": fn("spac_engine_create", eng_p, ctx_p, POINTER(SpacEngineParams), c_char_p, c_size_t),
        "free": fn("spac_engine_free", None, eng_p),
        "n_moe_layers": fn("spac_engine_n_moe_layers", c_int32, eng_p),
        "moe_begin": fn("spac_engine_moe_begin", c_int32, eng_p),
        "moe_end": fn("spac_engine_moe_end", c_int32, eng_p),
        "n_expert": fn("spac_engine_n_expert", c_int32, eng_p),
        "n_expert_used": fn("spac_engine_n_expert_used", c_int32, eng_p),
        # arrays go in as plain addresses: the Python wrapper checks dtype and shape first
        "set_plan": fn("spac_engine_set_plan", c_int32, eng_p, c_void_p, c_void_p, c_void_p, c_int32, c_void_p, c_int32,
                       c_char_p, c_size_t),
        "set_miss_costs": fn("spac_engine_set_miss_costs", c_int32, eng_p, POINTER(SpacMissCosts), c_char_p, c_size_t),
        "wait_idle": fn("spac_engine_wait_idle", c_int32, eng_p, c_int32),
        "get_stats": fn("spac_engine_get_stats", None, eng_p, POINTER(SpacEngineStats)),
        "reset_stats": fn("spac_engine_reset_stats", None, eng_p),
        "get_residency": fn("spac_engine_get_residency", None, eng_p, i32p),
        "attach_draft": fn("spac_engine_attach_draft", c_int32, eng_p, ctx_p, c_char_p, c_size_t),
        "detach_draft": fn("spac_engine_detach_draft", None, eng_p, ctx_p),
        "routing_enable": fn("spac_routing_enable", None, ctx_p, c_bool),
        "routing_get": fn("spac_routing_get", c_int32, ctx_p, POINTER(c_void_p), POINTER(c_void_p)),
        "routing_get_unmasked": fn("spac_routing_get_unmasked", c_int32, ctx_p, POINTER(c_void_p)),
        "routing_n_moe_layers": fn("spac_routing_n_moe_layers", c_int32, ctx_p),
        # the MTP draft (orchestrator.decoding.mtp_draft): llama.cpp's nextn hidden states (patch 0020)
        "set_embeddings_nextn": fn("spac_set_embeddings_nextn", None, ctx_p, c_bool, c_bool),
        "get_embeddings_nextn": fn("spac_get_embeddings_nextn", c_void_p, ctx_p),
        "get_embeddings_nextn_ith": fn("spac_get_embeddings_nextn_ith", c_void_p, ctx_p, c_int32),
        "graph_n_splits": fn("spac_graph_n_splits", c_int32, ctx_p),
        "graph_n_crossings": fn("spac_graph_n_crossings", c_int32, ctx_p),
        "graph_crossings_text": fn("spac_graph_crossings_text", c_int32, ctx_p, c_char_p, c_size_t),
        "model_plain_twins": fn("spac_model_plain_twins", c_int32, c_void_p, c_char_p, c_int32, POINTER(c_int32),
                                c_int32, POINTER(c_int32), c_int32, c_char_p, c_size_t),
        "model_layer_device": fn("spac_model_layer_device", c_char_p, c_void_p, c_int32),
        "host_read_rate": fn("spac_host_read_rate", c_double, c_int32, c_size_t),
        "model_tensor_buft": fn("spac_model_tensor_buft", c_char_p, c_void_p, c_char_p),
        "model_tensor_twin_buft": fn("spac_model_tensor_twin_buft", c_char_p, c_void_p, c_char_p),
        # a model larger than RAM: its routed experts read from the disk (patch 0030)
        "model_experts_on_disk": fn("spac_model_experts_on_disk", c_bool, c_void_p),
        "disk_advise": fn("spac_disk_advise", c_int32, c_void_p, c_void_p, c_int32, c_int32),
        "disk_missing": fn("spac_disk_missing", c_int32, c_void_p, c_void_p, c_int32, c_void_p),
        "disk_set_on_device": fn("spac_disk_set_on_device", None, c_void_p, c_void_p),
        "disk_get_stats": fn("spac_disk_get_stats", None, c_void_p, POINTER(SpacDiskStats)),
        "disk_reset_stats": fn("spac_disk_reset_stats", None, c_void_p),
    }


def _unchecked(f, restype):
    """The same C function without argtypes: called with ctypes objects made once, it skips the
    per-argument conversion, which costs µs per call right after a decode has evicted the caches."""
    return ctypes.CFUNCTYPE(restype)(ctypes.cast(f, c_void_p).value)


_lib: dict | None = None


def lib() -> dict:
    global _lib
    if _lib is None:
        _lib = _bind()
    return _lib


def engine_built() -> bool:
    """Whether the installed llama.cpp carries spac's native engine."""
    try:
        lib()
        return True
    except NativeError:
        return False


def ggml_library(name: str = "ggml") -> ctypes.CDLL:
    """The instance of lib<name> that libllama itself uses (the wheel holds copies, not
    symlinks, of each .so: only the soname file is the one already loaded)."""
    from llama_cpp import llama_cpp as low

    return ctypes.CDLL(str(Path(low._lib._name).parent / f"lib{name}.so.0"))


@functools.lru_cache(maxsize=None)
def ggml_device_api() -> ctypes.CDLL:
    """libggml with its device registry's functions typed (placement, the RPC backend)."""
    g = ggml_library("ggml")
    for name, restype, argtypes in (
            ("ggml_backend_dev_count", c_size_t, []), ("ggml_backend_dev_get", c_void_p, [c_size_t]),
            ("ggml_backend_dev_type", ctypes.c_int, [c_void_p]), ("ggml_backend_dev_name", c_char_p, [c_void_p]),
            ("ggml_backend_dev_memory", None, [c_void_p, POINTER(c_size_t), POINTER(c_size_t)]),
            ("ggml_backend_dev_by_type", c_void_p, [ctypes.c_int]), ("ggml_backend_dev_by_name", c_void_p, [c_char_p]),
            ("ggml_backend_register", None, [c_void_p])):
        fn = getattr(g, name)
        fn.restype, fn.argtypes = restype, argtypes
    return g


def _ctx_ptr(ctx) -> c_void_p:
    """Accept a llama_context_p (ctypes) or an int address."""
    return ctx if isinstance(ctx, c_void_p) else c_void_p(ctx if isinstance(ctx, int) else ctypes.cast(ctx, c_void_p).value)


def graph_n_splits(ctx) -> int:
    """Scheduler splits of the context's last computed graph (one per run on one backend)."""
    return int(lib()["graph_n_splits"](_ctx_ptr(ctx)))


def model_plain_twins(model_ptr, model_path: Path, min_tokens: int, expert_types: list[int],
                      dense_types: list[int]) -> int:
    """Give the model's repacked weights of these types (routed experts' and dense ones') plain twins,
    read from the file, for matmuls of at least min_tokens rows (spac.h spac_model_plain_twins); the
    number twinned."""
    experts = (c_int32 * max(len(expert_types), 1))(*expert_types)
    dense = (c_int32 * max(len(dense_types), 1))(*dense_types)
    err = ctypes.create_string_buffer(_ERR_LEN)
    n = lib()["model_plain_twins"](_ctx_ptr(model_ptr), str(model_path).encode(), min_tokens, experts,
                                   len(expert_types), dense, len(dense_types), err, _ERR_LEN)
    if n < 0:
        raise NativeError(err.value.decode(errors="replace"))
    return int(n)


def model_tensor_buft(model_ptr, name: str, twin: bool = False) -> str | None:
    """The buffer type a weight of the model (or its plain twin) lives in: CPU, CPU_REPACK, CUDA0..."""
    got = lib()["model_tensor_twin_buft" if twin else "model_tensor_buft"](_ctx_ptr(model_ptr), name.encode())
    return got.decode() if got else None


def model_layer_devices(model_ptr, n_layer: int) -> list[str]:
    """The ggml device llama.cpp placed each model layer on ("CPU": left on the host)."""
    f = lib()["model_layer_device"]
    return [(f(_ctx_ptr(model_ptr), il) or b"?").decode() for il in range(n_layer)]


def host_read_rate(n_threads: int, n_bytes: int) -> float:
    """Bytes/s that n_threads threads read from host memory together (spac_host_read_rate):
    what a memory-bound decode's kernels are held to."""
    return float(lib()["host_read_rate"](n_threads, n_bytes))


class ExpertsOnDisk:
    """The routed experts of a model loaded with them on the disk (spac.h spac_disk_*): read some
    ahead, drop some, ask what is in memory. Pairs are int32 [n, 2] of (MoE layer, expert)."""

    def __init__(self, model_ptr):
        self._model = _ctx_ptr(model_ptr)
        if not lib()["model_experts_on_disk"](self._model):
            raise NativeError("the model's routed experts are in memory, not on the disk")

    @staticmethod
    def _pairs(pairs) -> np.ndarray:
        return np.ascontiguousarray(pairs, dtype=np.int32).reshape(-1, 2)

    def advise(self, pairs, advice: int) -> int:
        """DISK_READ: read them in the background; DISK_DROP: drop their pages. The valid pairs."""
        a = self._pairs(pairs)
        return int(lib()["disk_advise"](self._model, a.ctypes.data, len(a), advice)) if len(a) else 0

    def missing(self, pairs) -> np.ndarray:
        """int64 per pair: its bytes not in memory now (0: all in memory; -1: no such pair)."""
        a = self._pairs(pairs)
        out = np.zeros(len(a), np.int64)
        if len(a):
            lib()["disk_missing"](self._model, a.ctypes.data, len(a), out.ctypes.data)
        return out

    def set_on_device(self, on_device: np.ndarray | None) -> None:
        """What a device pool holds ([n_moe_layers, n_expert] bool): the gates leave it to the device."""
        mask = None if on_device is None else np.ascontiguousarray(on_device, dtype=np.uint8)
        lib()["disk_set_on_device"](self._model, None if mask is None else mask.ctypes.data)

    def stats(self) -> dict:
        s = SpacDiskStats()
        lib()["disk_get_stats"](self._model, ctypes.byref(s))
        return {name: int(getattr(s, name)) for name, _ in SpacDiskStats._fields_}

    def reset_stats(self) -> None:
        lib()["disk_reset_stats"](self._model)


def model_moe_layers(model_ptr, n_layer: int) -> list[int]:
    """The model layers that have routed experts (a router), in order: the engines' MoE layers."""
    return [il for il in range(n_layer) if model_tensor_buft(model_ptr, f"blk.{il}.ffn_gate_inp.weight")]


def graph_n_crossings(ctx) -> int:
    """Changes of backend from one compute node to the next in the context's last graph."""
    return int(lib()["graph_n_crossings"](_ctx_ptr(ctx)))


def graph_crossings(ctx) -> list[str]:
    """Those changes named: "node (backend) -> node (backend)", in graph order."""
    buf = ctypes.create_string_buffer(1 << 16)
    lib()["graph_crossings_text"](_ctx_ptr(ctx), buf, len(buf))
    return [c for c in buf.value.decode(errors="replace").split("; ") if c]


class Routing:
    """Routing export of one llama context: which experts the last decode's tokens chose."""

    def __init__(self, ctx, n_expert_used: int):
        self._ctx = _ctx_ptr(ctx)
        self.n_expert_used = n_expert_used
        lib()["routing_enable"](self._ctx, True)
        self.n_moe_layers = int(lib()["routing_n_moe_layers"](self._ctx))
        self._key = None
        self._views = None
        self._get = _unchecked(lib()["routing_get"], c_int32)  # runs every step: ready-made arguments
        self._ids_addr, self._w_addr = c_void_p(), c_void_p()
        self._get_args = (self._ctx, ctypes.pointer(self._ids_addr), ctypes.pointer(self._w_addr))

    def last(self) -> tuple[np.ndarray, np.ndarray]:
        """ids int32 and weights float32, both [n_moe_layers, n_tokens, n_expert_used].

        Views of the context's buffer, valid until its next decode: copy to keep them.
        """
        key = (self._get(*self._get_args), self._ids_addr.value, self._w_addr.value)
        if key != self._key:  # the buffers moved or changed size: new views (else reuse, no copy)
            n_tokens, ids_addr, w_addr = key
            shape = (self.n_moe_layers, n_tokens, self.n_expert_used)
            if n_tokens == 0 or not ids_addr:
                self._views = np.zeros(shape, np.int32), np.zeros(shape, np.float32)
            else:
                n = int(np.prod(shape))
                ids = np.frombuffer((ctypes.c_int32 * n).from_address(ids_addr), dtype=np.int32).reshape(shape)
                w = np.frombuffer((ctypes.c_float * n).from_address(w_addr), dtype=np.float32).reshape(shape)
                self._views = ids, w
            self._key = key
        return self._views

    def unmasked(self) -> np.ndarray | None:
        """A pool draft context's lookahead: what the unmasked router chose in the last decode,
        int32 [n_moe_layers, n_tokens, n_expert_used] (a copy); None on any other context."""
        addr = c_void_p()
        n_tokens = int(lib()["routing_get_unmasked"](self._ctx, ctypes.byref(addr)))
        if n_tokens == 0 or not addr.value:
            return None
        shape = (self.n_moe_layers, n_tokens, self.n_expert_used)
        n = int(np.prod(shape))
        return np.frombuffer((ctypes.c_int32 * n).from_address(addr.value), dtype=np.int32).reshape(shape).copy()

    def disable(self) -> None:
        lib()["routing_enable"](self._ctx, False)


class ExpertEngine:
    """A device expert pool attached to one llama context (see spac.h).

    device: None or "CPU" for a second CPU buffer, else a ggml device name ("CUDA0", "RPC0[...]").
    skip_absent: the device skips id -1 like ggml-cpu (an RPC server built from this patch
    series), so non-resident rows cost it nothing instead of a multiply by the all-zero slot.
    Budget: budget_bytes if > 0, else budget_ratio of all expert bytes.
    stream_prefill: a ubatch of more than max_split_tokens computes its experts on the device,
    the non-resident ones streamed through two layers of staging slots (stats: n_staged, ...):
    StreamPrefill.AHEAD or USED (or their names).
    layers: the model layers [begin, end) whose experts this pool holds, (0, 0) every layer
    (several devices: `SeveralPools`, one engine per device on the same context).
    upload_on_miss_tokens: the live ablation of llama.cpp's own expert cache (0: off; its value
    32): ubatches of at most this many tokens upload each layer's chosen non-resident experts into
    the pool's least recently used slots, then compute every routed expert on the device; send no
    plans then (the pool is the cache).
    copy_batch_experts: a plan's copies go in batches of up to this many experts of one layer, one
    synchronize per batch on the copy worker's own backend of the device (1: each expert waits
    for its own copies, as before patch 0024; stats: n_copy_batches, n_stage_batches). None: 8,
    but 1 on an RPC device, whose asynchronous set copies the bytes once more before sending them
    (bench/bench_copies.py on the 2-core stand-in: 1.76-1.93 GB/s batched against 2.05 one by one).
    pin_mapping: register the file mapping's expert range as the device's pinned host memory
    (patch 0025; ggml-cuda registers only with GGML_CUDA_REGISTER_HOST set, which this sets): a
    GPU then copies mapped experts at the pinned rate. Logged where the device cannot.
    miss_gate_tokens: spac's miss rule (issue 51; 0: off): a split ubatch of at most this many
    tokens decides at each MoE layer, once its router has run, whether each chosen expert the
    pool lacks is uploaded (into ClassLRU's victim), computed on the host or streamed once through
    a staging slot, by the costs given to `set_miss_costs` (none: every miss on the host).
    """

    def __init__(self, ctx, model_path: str, device: str | None = None, budget_bytes: int = 0,
                 budget_ratio: float = DEFAULT_BUDGET_RATIO, max_split_tokens: int = 64, no_evict: bool = False,
                 copy_delay_us: int = 0, split_graph: str = "overlap", join: str = "auto",
                 skip_absent: bool = False, only_half: str | None = None,
                 stream_prefill: StreamPrefill | str = StreamPrefill.OFF,
                 layers: tuple[int, int] = (0, 0), upload_on_miss_tokens: int = 0, copy_batch_experts: int | None = None,
                 pin_mapping: bool = False, miss_gate_tokens: int = 0):
        self._ctx = _ctx_ptr(ctx)
        self.device = device or "CPU"
        self.layers = layers
        p = lib()["default_params"]()
        p.model_path = str(model_path).encode()
        p.device = device.encode() if device else None
        p.budget_bytes = int(budget_bytes)
        p.budget_ratio = float(budget_ratio)
        p.max_split_tokens = int(max_split_tokens)
        p.no_evict = bool(no_evict)
        p.copy_delay_us = int(copy_delay_us)
        p.skip_absent = bool(skip_absent)
        p.layer_begin, p.layer_end = int(layers[0]), int(layers[1])
        p.upload_on_miss_tokens = int(upload_on_miss_tokens)
        if copy_batch_experts is None:
            copy_batch_experts = 1 if self.device.startswith("RPC") else COPY_BATCH_EXPERTS
        p.copy_batch_experts = int(copy_batch_experts)
        p.pin_mapping = bool(pin_mapping)
        if not 0 <= miss_gate_tokens <= MISS_MAX_TOKENS:
            raise ValueError(f"miss_gate_tokens must be in [0, {MISS_MAX_TOKENS}], got {miss_gate_tokens}")
        p.miss_gate_tokens = int(miss_gate_tokens)
        if pin_mapping:
            os.environ.setdefault("GGML_CUDA_REGISTER_HOST", "1")  # ggml-cuda's opt-in to host registration
        stream = StreamPrefill(stream_prefill)
        if stream not in STREAM_PREFILL:  # AUTO: resolved by the caller, which knows the device
            raise ValueError(f"stream_prefill must be one of {', '.join(STREAM_PREFILL)}, got {stream_prefill!r}")
        p.stream_prefill = STREAM_PREFILL[stream]
        for name, value, choices in (("split_graph", split_graph, SPLIT_GRAPHS), ("join", join, JOINS),
                                     ("only_half", only_half, ONLY_HALF)):
            if value not in choices:
                raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")
            setattr(p, name, choices[value])
        err = ctypes.create_string_buffer(_ERR_LEN)
        # the device/CPU counts in stats() are taken from the routing export
        lib()["routing_enable"](self._ctx, True)
        self._eng = lib()["create"](self._ctx, ctypes.byref(p), err, _ERR_LEN)
        if not self._eng:
            raise NativeError(err.value.decode(errors="replace"))
        self.n_moe_layers = int(lib()["n_moe_layers"](self._eng))
        self.moe_range = (int(lib()["moe_begin"](self._eng)), int(lib()["moe_end"](self._eng)))  # the MoE layers it holds
        self.n_expert = int(lib()["n_expert"](self._eng))
        self.n_expert_used = int(lib()["n_expert_used"](self._eng))
        self._shape = (self.n_moe_layers, self.n_expert)
        self._err = err
        # staging arrays with fixed addresses: a step copies its plan in (6 KB at 48 x 128) instead
        # of asking numpy for each array's pointer, which costs tens of µs when caches are cold
        self._utility = np.zeros(self._shape, np.uint8)
        self._threshold = np.ones(self.n_moe_layers, np.int32)
        self._set_plan = lib()["set_plan"]
        self._plan_args = (self._eng, self._utility.ctypes.data, self._threshold.ctypes.data)
        # the per-step call with ready-made ctypes arguments and no argument conversion
        self._set_plan_fast = _unchecked(self._set_plan, c_int32)
        self._fast_args = tuple(c_void_p(a) for a in self._plan_args) + (
            c_void_p(None), c_int32(0), c_void_p(None), c_int32(0), self._err, c_size_t(_ERR_LEN))

    def set_plan(self, plan: Plan) -> None:
        """Hand one step's plan to the copy engine (returns at once; copies run in the background)."""
        self._live()
        utility, threshold = plan.utility, plan.threshold
        # identity checks on the dtype singletons are the cheap test that runs every step
        if not (getattr(utility, "dtype", None) is _UINT8 and getattr(threshold, "dtype", None) is _INT32
                and utility.shape == self._shape and threshold.shape == self._threshold.shape):
            self._check_plan_arrays(utility, threshold)
        self._utility[...] = utility
        self._threshold[...] = threshold
        if plan.prefetch is None and plan.evict is None:  # the utility-driven plans of MoE-SpAc
            rc = self._set_plan_fast(*self._fast_args)
        else:
            prefetch, evict = _pairs(plan.prefetch, "prefetch"), _pairs(plan.evict, "evict")
            rc = self._set_plan(*self._plan_args,
                                prefetch.ctypes.data if prefetch is not None else None,
                                len(prefetch) if prefetch is not None else 0,
                                evict.ctypes.data if evict is not None else None,
                                len(evict) if evict is not None else 0, self._err, _ERR_LEN)
        if rc != 0:
            raise ValueError(self._err.value.decode(errors="replace"))

    def _check_plan_arrays(self, utility, threshold) -> None:
        if not (getattr(utility, "dtype", None) == _UINT8 and getattr(threshold, "dtype", None) == _INT32
                and utility.shape == self._shape and threshold.shape == self._threshold.shape):
            raise ValueError(f"plan.utility must be uint8 {self._shape} and plan.threshold int32 "
                             f"({self.n_moe_layers},), got {_describe(utility)} and {_describe(threshold)}")

    def set_miss_costs(self, costs: MissCosts | None) -> None:
        """The miss rule's costs from the next ubatch on (None: every miss on the host again)."""
        c = costs.native() if costs is not None else None
        if lib()["set_miss_costs"](self._live(), ctypes.byref(c) if c is not None else None, self._err, _ERR_LEN) != 0:
            raise ValueError(self._err.value.decode(errors="replace"))

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        return bool(lib()["wait_idle"](self._live(), int(timeout_s * 1000)))

    def stats(self) -> dict:
        s = SpacEngineStats()
        lib()["get_stats"](self._live(), ctypes.byref(s))
        out = {name: getattr(s, name) for name, _ in SpacEngineStats._fields_}
        out["resident_per_layer"] = (self.residency() >= 0).sum(axis=1).tolist()
        out["per_device"] = [{"device": self.device, **{k: out[k] for k in _PER_DEVICE}}]
        return out

    def reset_stats(self) -> None:
        lib()["reset_stats"](self._live())

    def residency(self) -> np.ndarray:
        """int32 [n_moe_layers, n_expert]: pool slot of each resident expert, -1 elsewhere."""
        out = np.empty((self.n_moe_layers, self.n_expert), dtype=np.int32)
        lib()["get_residency"](self._live(), out.ctypes.data_as(POINTER(c_int32)))
        return out

    def attach_draft(self, ctx) -> None:
        """Make `ctx`, a second context on this engine's model, a pool draft: its MoE layers route
        only among the resident experts and compute on the pool device alone (see spac.h).
        Detached by detach_draft, close, or freeing that context."""
        if lib()["attach_draft"](self._live(), _ctx_ptr(ctx), self._err, _ERR_LEN) != 0:
            raise NativeError(self._err.value.decode(errors="replace"))

    def detach_draft(self, ctx) -> None:
        lib()["detach_draft"](self._live(), _ctx_ptr(ctx))

    def _live(self) -> int:
        if self._eng is None:
            raise NativeError("the engine is closed")
        return self._eng

    def close(self) -> None:
        """Stop the copy worker and free the pool; the context runs unsplit again."""
        if self._eng:
            lib()["free"](self._eng)
            self._eng = None

    def __enter__(self) -> ExpertEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# the stats `SeveralPools.stats()` keeps per device (the totals are summed over the devices)
_PER_DEVICE = ("bytes_copied", "n_copies", "n_slots", "n_resident", "n_expert_tokens_device", "copy_busy_us",
               "bytes_staged", "stage_copy_us", "n_copy_calls", "n_copy_batches", "n_stage_batches")


class SeveralPools:
    """The expert pool over several devices: one ExpertEngine per device on the same context,
    each holding the experts of the layers llama.cpp placed on that device (`PoolDevice.layers`,
    from `placement.pool_layer_ranges`). Same interface as one engine: a plan goes to every engine
    (each takes its own layers' part), stats are summed, with `per_device` rows besides."""

    def __init__(self, ctx, model_path: str, devices: tuple[PoolDevice, ...], **engine_args):
        """A device whose layers are None holds no MoE layer (leading dense layers): no pool there."""
        self.engines: list[ExpertEngine] = []
        try:
            for dev in devices:
                if dev.layers is not None:
                    self.engines.append(ExpertEngine(ctx, model_path, device=dev.name, budget_bytes=dev.budget.nbytes,
                                                     budget_ratio=dev.budget.ratio, layers=dev.layers, **engine_args))
        except BaseException:
            self.close()
            raise
        first = self.engines[0]
        self.n_moe_layers, self.n_expert, self.n_expert_used = first.n_moe_layers, first.n_expert, first.n_expert_used
        self.device = ",".join(e.device for e in self.engines)

    def set_plan(self, plan: Plan) -> None:
        for e in self.engines:
            e.set_plan(plan)

    def set_miss_costs(self, costs: MissCosts | None) -> None:
        for e in self.engines:
            e.set_miss_costs(costs)

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """Every device's worker idle within timeout_s in all."""
        deadline = time.monotonic() + timeout_s
        return all([e.wait_idle(max(deadline - time.monotonic(), 0.0)) for e in self.engines])

    def stats(self) -> dict:
        rows = [e.stats() for e in self.engines]
        out = {k: sum(r[k] for r in rows) for k, _ in SpacEngineStats._fields_}
        # each engine counts only its own layers' residents (0 elsewhere)
        out["resident_per_layer"] = np.sum([r["resident_per_layer"] for r in rows], axis=0).tolist()
        out["per_device"] = [r["per_device"][0] for r in rows]
        return out

    def reset_stats(self) -> None:
        for e in self.engines:
            e.reset_stats()

    def residency(self) -> np.ndarray:
        """int32 [n_moe_layers, n_expert]: slot of each resident expert in its device's pool, -1 elsewhere."""
        return np.max([e.residency() for e in self.engines], axis=0)

    def attach_draft(self, ctx) -> None:
        """To every device's pool, or to none (a draft masked on some layers only would not be
        the pool draft)."""
        attached = []
        try:
            for e in self.engines:
                e.attach_draft(ctx)
                attached.append(e)
        except BaseException:
            for e in attached:
                e.detach_draft(ctx)
            raise

    def detach_draft(self, ctx) -> None:
        for e in self.engines:
            e.detach_draft(ctx)

    def close(self) -> None:
        for e in reversed(self.engines):
            e.close()

    def __enter__(self) -> SeveralPools:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _describe(arr) -> str:
    return f"{getattr(arr, 'dtype', type(arr).__name__)} {getattr(arr, 'shape', '')}"


def _pairs(rows, what: str) -> np.ndarray | None:
    if rows is None:
        return None
    arr = np.ascontiguousarray(rows, dtype=np.int32)
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise ValueError(f"plan.{what} must be int32 [n, 2] (layer, expert) rows, got shape {arr.shape}")
    return arr


def copies_block_compute(device: str | None) -> bool:
    """Whether the pool device receives copies on the thread that computes: the CPU test device
    and an RPC server do (a copy delays the pass behind it); a GPU copies on its own engine."""
    return device in (None, "CPU") or str(device).startswith("RPC")
