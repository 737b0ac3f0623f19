"""Thin wrapper over llama-cpp-python's low-level API: one model, one context, one sequence.

Everything per token stays in numpy views of llama.cpp's own buffers: the batch arrays are
written through views, logits are read through a view (no copies).

Why ~460 lines: Context carries a hybrid model's recurrent state too (llama.cpp's snapshots,
checkpoints, forks and replays, so that every trim is exact), and Model the load options
(devices, tensor split, host layout, MTP layers); the engine's own bindings are native.py.
"""

from __future__ import annotations

import ctypes
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

import llama_cpp as L

from orchestrator.runtime import exact_variant, host_layout
from orchestrator.runtime.native import ggml_device_api, ggml_library, model_plain_twins
from orchestrator.runtime.progress import report_fraction

GGML_TYPE_F32 = 0
_GGUF_MAGIC = b"GGUF"


class ModelError(RuntimeError):
    """A model file that cannot be used; the message says which and why."""


def check_gguf(path: str | Path) -> Path:
    """Fail with one clear line on a missing, unreadable or non-GGUF file."""
    p = Path(path)
    if not p.is_file():
        raise ModelError(f"model file not found: {p}")
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelError(f"cannot read {p}: {e.strerror}") from None
    if magic != _GGUF_MAGIC:
        raise ModelError(f"{p} is not a GGUF file")
    return p


_backend_ready = False
_load_errors: list[str] | None = None  # while a model loads: llama.cpp's error lines, for the ModelError


def init_backend(verbose: bool = False) -> None:
    """llama.cpp's backend, once; verbose=False keeps only its errors (on stderr)."""
    global _backend_ready
    if not _backend_ready:
        if not verbose:
            _silence_logs()
        L.llama_backend_init()
        _backend_ready = True


@L.llama_log_callback
def _quiet_log(level, text, user_data):  # keep errors (on stderr: stdout is the user's), drop the chatter
    if level == 4 and text:  # GGML_LOG_LEVEL_ERROR
        line = text.decode(errors="replace")
        if _load_errors is not None:
            _load_errors.append(line.strip())
        else:
            sys.stderr.write(line)
            sys.stderr.flush()


def _silence_logs() -> None:
    L.llama_log_set(_quiet_log, ctypes.c_void_p())


# the host weights' layout (host_layout.Repack): AUTO repacks each tensor type where this CPU's
# measurement says decoding is faster repacked; ON is llama.cpp's default (every weight its extra
# CPU buffer types take), OFF the plain layout (the test device's bit-identical checks)
DEFAULT_REPACK = host_layout.Repack.AUTO


@contextmanager
def sigint_noted() -> Iterator[Callable[[], bool]]:
    """Ctrl-C only noted while the block runs (the yielded function says whether it came); the
    caller stops where it chooses. Python's own handler raises KeyboardInterrupt in whatever code
    runs when the signal is handled, and where that is a finalizer (a generator closed by the
    garbage collector, an object's __del__) or a ctypes callback, the exception is printed and
    lost: the run goes on as if no key was pressed."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    hit: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: hit.append(signum))
    try:
        yield lambda: bool(hit)
    finally:
        signal.signal(signal.SIGINT, previous)


@contextmanager
def deferred_sigint() -> Iterator[Callable[[], bool]]:
    """Hold Ctrl-C during a long native call: it is noted (`sigint_noted`) and raised as
    KeyboardInterrupt once the block has run."""
    with sigint_noted() as interrupted:
        yield interrupted
    if interrupted():
        raise KeyboardInterrupt


def _cpu_buffer_type() -> int:
    f = ggml_library("ggml-cpu").ggml_backend_cpu_buffer_type
    f.restype = ctypes.c_void_p
    return f()


class _TensorBuftOverride(ctypes.Structure):
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


# llama.h's LLAMA_LAZY_MODE_EXPERTS (patch 0030): the routed experts read from the disk when used
_LAZY_MODE_EXPERTS = 3
# llama.cpp's --cpu-moe: the routed experts stay in host RAM whatever -ngl offloads
_EXPERTS_PATTERN = rb"\.ffn_(up|down|gate|gate_up)_(ch|)exps"


class Model:
    """A loaded GGUF model (weights on the CPU unless n_gpu_layers > 0)."""

    def __init__(self, path: str | Path, n_gpu_layers: int = 0, repack: host_layout.Repack | str = DEFAULT_REPACK, n_threads: int = 1,
                 verbose: bool = False, check_tensors: bool = False, mmap: bool = True, devices: tuple[str, ...] = (),
                 tensor_split: tuple[float, ...] = (), mtp: bool = False, exact: bool | None = None,
                 experts_on_disk: bool = False, mlock: bool = False):
        """n_gpu_layers > 0 offloads that many layers' non-expert weights; the routed experts
        stay in host RAM (the expert pool holds device copies); devices: the ggml devices that take
        them (llama.cpp's --device; default: every GPU it sees), tensor_split their shares of the
        layers (llama.cpp's --tensor-split; default: in proportion to their free memory).
        repack: the host weights' layout, a `host_layout.Repack` or its name (auto measures with
        n_threads, the contexts' threads); exact: whether the layout is for exact mode (CPU_EXACT is
        used only then; None: as the process's batch-invariant mode is set now).
        check_tensors: llama.cpp's validation of every tensor's data (NaN/Inf) on load.
        mmap=False: llama.cpp's --no-mmap (host weights read into memory; with a GPU, its pinned
        host buffers, which the GPU copies from several times faster than from a mapped file). The
        plain twins of repacked weights read the mapping, so without one a prompt runs the
        repacked kernels (layout.n_plain_twins is 0).
        mtp: also load the file's multi-token-prediction layers (llama.cpp's load_mtp), which only
        an MTP draft runs (`orchestrator.decoding.mtp_draft`).
        experts_on_disk: a model larger than RAM: the routed experts stay in the file mapping, read
        when used (patch 0030; runtime/host_tier.py keeps some in memory); they keep the file's layout.
        mlock: llama.cpp's --mlock (lock the weights in memory; with the experts on the disk, the
        other weights only)."""
        global _load_errors
        self.path = check_gguf(path)
        self.ptr = None
        init_backend(verbose)
        self.layout = host_layout.choose(self.path, n_threads, repack, n_gpu_layers=n_gpu_layers, exact=exact,
                                         experts_on_disk=experts_on_disk)
        if self.layout.kernel_variant:  # process-wide, as batch-invariant mode: no graph computes during a load
            exact_variant.set_variant(exact_variant.Variant.of_key(self.layout.kernel_variant))
        params = L.llama_model_default_params()
        # llama.cpp's -ngl counts the output layer too: N + 1 puts the last N repeating layers and the
        # output on the device (N alone would leave the first of them on the host)
        params.n_gpu_layers = n_gpu_layers + 1 if n_gpu_layers > 0 else n_gpu_layers
        if devices:  # llama.cpp's --device: only these take layers (in proportion to their free memory)
            g = ggml_device_api()
            self._devices = (ctypes.c_void_p * (len(devices) + 1))(*[g.ggml_backend_dev_by_name(d.encode()) for d in devices], None)
            params.devices = ctypes.cast(self._devices, ctypes.c_void_p)
        if tensor_split:  # llama.cpp's --tensor-split: the devices' shares of the offloaded layers
            self._split = (ctypes.c_float * L.llama_max_devices())(*tensor_split)
            params.tensor_split = self._split
        params.use_extra_bufts = self.layout.use_extra_bufts
        params.no_host = self.layout.no_host
        params.check_tensors = check_tensors
        params.load_mtp = mtp
        if not mmap:
            params.load_mode = L.LLAMA_LOAD_MODE_MLOCK if mlock else L.LLAMA_LOAD_MODE_NONE
        elif mlock:
            params.load_mode = L.LLAMA_LOAD_MODE_MMAP_MLOCK
        if experts_on_disk:  # llama.h LLAMA_LAZY_MODE_EXPERTS (patch 0030)
            params.lazy_mode = _LAZY_MODE_EXPERTS
        overrides = self.layout.overrides()
        if n_gpu_layers != 0:  # llama.cpp's --cpu-moe (plain unless --repack on: see host_layout)
            overrides.append((_EXPERTS_PATTERN, _cpu_buffer_type()))
        if overrides:
            self._overrides = (_TensorBuftOverride * (len(overrides) + 1))(*(_TensorBuftOverride(*o) for o in overrides))
            params.tensor_buft_overrides = ctypes.cast(self._overrides, ctypes.c_void_p)
        with deferred_sigint() as interrupted:
            # False aborts the load; the fraction goes to the progress display (runtime/progress.py)
            progress = L.llama_progress_callback(
                lambda p, user_data: report_fraction(f"loading {self.path.name}", p) and not interrupted())
            params.progress_callback = progress
            _load_errors = [] if not verbose else None
            try:
                self.ptr = L.llama_model_load_from_file(str(self.path).encode(), params)
            finally:
                errors, _load_errors = _load_errors or [], None
            if interrupted():
                if self.ptr:
                    L.llama_model_free(self.ptr)
                    self.ptr = None
                return  # deferred_sigint raises KeyboardInterrupt on leaving
        if not self.ptr:
            bad = [e.split(": ", 1)[-1] for e in errors if "has invalid data" in e]  # --check-tensors
            why = ", ".join(bad[:3]) + " (NaN or Inf)" if bad else (errors[-1].split(": ")[-1] if errors else "")
            raise ModelError(f"llama.cpp could not load {self.path}: {why or 'corrupt file or unsupported architecture'}")
        expert_types, dense_types = self.layout.plain_prefill_types()
        if expert_types or dense_types:  # decoding on the repacked layout, prefill on the file's (host_layout)
            self.layout.n_plain_twins = model_plain_twins(self.ptr, self.path, host_layout.PREFILL_MIN_TOKENS,
                                                          expert_types, dense_types)
        self.vocab = L.llama_model_get_vocab(self.ptr)
        self.n_vocab = int(L.llama_vocab_n_tokens(self.vocab))
        self.n_layer = int(L.llama_model_n_layer(self.ptr))

    def layout_report(self) -> str:
        return self.layout.report()

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = L.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return buf.value.decode(errors="replace") if n >= 0 else None

    @property
    def arch(self) -> str:
        return self.meta("general.architecture") or "?"

    @property
    def n_expert(self) -> int:
        v = self.meta(f"{self.arch}.expert_count")
        return int(v) if v else 0

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """parse_special: special tokens written as text (as chat templates do) become tokens."""
        data = text.encode("utf-8", "surrogateescape")  # bytes a non-UTF-8 shell passed through
        n_max = len(data) + 16
        buf = (L.llama_token * n_max)()
        n = L.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            buf = (L.llama_token * -n)()
            n = L.llama_tokenize(self.vocab, data, len(data), buf, -n, add_special, parse_special)
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        return buf.raw[:n]

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode(errors="replace")

    def token_text(self, token: int) -> str:
        return L.llama_vocab_get_text(self.vocab, token).decode(errors="replace")

    def is_eog(self, token: int) -> bool:
        return bool(L.llama_vocab_is_eog(self.vocab, token))

    def bos_token(self) -> int:
        return int(L.llama_vocab_bos(self.vocab))

    def eos_token(self) -> int:
        return int(L.llama_vocab_eos(self.vocab))

    def chat_template(self) -> str | None:
        """The GGUF's default chat template (`tokenizer.chat_template`), or None."""
        ptr = L.llama_model_chat_template(self.ptr, None)
        if not ptr:
            return None
        return ptr.decode(errors="replace") if isinstance(ptr, bytes) else ctypes.string_at(ptr).decode(errors="replace")

    def close(self) -> None:
        if self.ptr:
            L.llama_model_free(self.ptr)
            self.ptr = None


class Context:
    """One sequence on one model: decode token runs, read logits, trim the cache.

    The cache is llama.cpp's memory: a KV cache, or on a hybrid model (Qwen3.5/3.6-MoE,
    Qwen3-Next) a KV cache beside a recurrent state that cannot be cut back anywhere. Such a
    state rolls back only through llama.cpp's snapshots of the last decode's trailing tokens
    (`rollback`: how many, llama.cpp's n_rs_seq). A trim deeper than that restores the latest
    `checkpoint` at or before the kept position (a copy of the recurrent state, as llama-server's
    context checkpoints), else starts from an empty state, and computes the kept tokens after it
    again (`n_replays` counts those). A recurrent trim is applied at the next decode, so that
    several trims in a row (a rejected draft, then a stop string) cost one rollback."""

    MAX_CHECKPOINTS = 4  # each holds one recurrent state in host memory

    def __init__(self, model: Model, n_ctx: int = 2048, n_batch: int = 512, n_threads: int = 2,
                 kv_f32: bool = False, cb_eval=None, cb_eval_user_data=None, op_offload: bool = True,
                 rollback: int = 0, forks: bool = False):
        """op_offload: llama.cpp's default for a batch of 32+ tokens on a model with device layers,
        computing host-resident weights' ops on the device by copying the weights there
        (False: llama.cpp's --no-op-offload, they compute on the host).
        rollback: on a recurrent model, the deepest trim after a multi-token decode that must
        not recompute (a verify pass's rejected drafts: γ); each costs one state's memory.
        forks: on a recurrent model, room for a scratch sequence (`fork`), for a draft whose
        single-token decodes leave nothing to roll back to."""
        self.model = model
        self.recurrent = bool(L.llama_model_is_recurrent(model.ptr) or L.llama_model_is_hybrid(model.ptr))
        params = L.llama_context_default_params()
        params.op_offload = op_offload
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = n_batch
        params.n_threads = params.n_threads_batch = n_threads
        params.n_seq_max = 2 if forks and self.recurrent else 1
        params.kv_unified = params.n_seq_max > 1  # a fork shares the KV cells of what it forked from
        if self.recurrent:
            params.n_rs_seq = max(0, min(rollback, n_batch - 1))
        if kv_f32:
            params.type_k = params.type_v = GGML_TYPE_F32
        if cb_eval is not None:
            params.cb_eval = cb_eval
            params.cb_eval_user_data = cb_eval_user_data
        self.ptr = L.llama_init_from_model(model.ptr, params)
        if not self.ptr:
            raise ModelError(f"could not create a context of {n_ctx} tokens for {model.path.name}")
        self.n_ctx, self.n_batch, self.n_vocab = n_ctx, n_batch, model.n_vocab
        # the deepest cheap trim: any for a KV cache; what llama.cpp granted for a recurrent state
        # (0 where the architecture has no snapshots)
        self.rollback = int(L.llama_n_rs_seq(self.ptr)) if self.recurrent else n_ctx
        self.forks = params.n_seq_max > 1
        self.n_replays = 0
        self.memory = L.llama_get_memory(self.ptr)
        self._batch = L.llama_batch_init(n_batch, 0, 1)
        self._tokens = np.ctypeslib.as_array(self._batch.token, shape=(n_batch,))
        self._pos = np.ctypeslib.as_array(self._batch.pos, shape=(n_batch,))
        self._n_seq_id = np.ctypeslib.as_array(self._batch.n_seq_id, shape=(n_batch,))
        self._logits = np.ctypeslib.as_array(self._batch.logits, shape=(n_batch,))
        self._n_seq_id[:] = 1
        self._set_seq(0)
        self.n_past = 0  # tokens in the cache, as the caller sees it
        self._history = np.zeros(n_ctx, dtype=np.int32)  # the tokens at positions 0..: what a replay decodes
        self._last_run = 0  # tokens of the last llama_decode (its trailing ones have snapshots); 0: unknown
        self._fork_at: int | None = None
        self._checkpoints: list[tuple[int, ctypes.Array]] = []  # (position, recurrent state there)
        # called after each llama_decode with its first position and its number of tokens (an MTP
        # draft reads the hidden states the decode exported)
        self.after_decode: Callable[[int, int], None] | None = None

    def _set_seq(self, seq: int) -> None:
        self._seq = seq
        for i in range(self.n_batch):
            self._batch.seq_id[i][0] = seq

    def decode(self, tokens, logits_all: bool = True) -> None:
        """Append tokens at the end of the sequence (one llama_decode per n_batch tokens)."""
        tokens = np.asarray(tokens, dtype=np.int32)
        if self.recurrent:
            self._settle()
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start:start + self.n_batch]
            n = len(chunk)
            if self.n_past + n > self.n_ctx:
                raise ModelError(f"context full: {self.n_past + n} tokens > n_ctx {self.n_ctx}")
            self._tokens[:n] = chunk
            self._history[self.n_past:self.n_past + n] = chunk
            self._pos[:n] = np.arange(self.n_past, self.n_past + n, dtype=np.int32)
            last = start + n == len(tokens)
            self._logits[:n] = 1 if logits_all else 0
            if last:
                self._logits[n - 1] = 1
            self._batch.n_tokens = n
            self._last_run = 0  # until this decode is known to have completed
            rc = L.llama_decode(self.ptr, self._batch)
            if rc != 0:
                raise ModelError(f"llama_decode failed with code {rc}")
            self._last_run = n
            self.n_past += n
            self._n_out = n if logits_all else 1
            if self.after_decode is not None:
                self.after_decode(self.n_past - n, n)

    def logits(self) -> np.ndarray:
        """float32 [n_outputs, n_vocab] of the last decode: a view, valid until the next decode."""
        ptr = L.llama_get_logits(self.ptr)
        return np.ctypeslib.as_array(ptr, shape=(self._n_out, self.n_vocab))

    def trim(self, n_keep: int, force: bool = False) -> None:
        """Drop every cached position >= n_keep (rejected draft tokens). force: remove them even
        past n_past, in case a decode was interrupted after writing the cache."""
        if self.recurrent:  # applied at the next decode (_settle), which reads the memory's own end
            self.n_past = min(self.n_past, n_keep)
            # a checkpoint past the kept tokens describes tokens that the next decodes replace
            self._checkpoints = [c for c in self._checkpoints if c[0] <= self.n_past]
            return
        if force or n_keep < self.n_past:
            L.llama_memory_seq_rm(self.memory, self._seq, n_keep, -1)
            self.n_past = min(self.n_past, n_keep)

    def can_trim(self, n_keep: int) -> bool:
        """Whether trimming to n_keep now keeps the cache without computing it again."""
        return self.reusable(n_keep) == n_keep

    def reusable(self, n_keep: int) -> int:
        """How many of the first n_keep cached tokens a trim keeps without computing them again:
        all of them in a KV cache or within a snapshot's reach, else up to the latest checkpoint."""
        if not self.recurrent or self._snapshot_reaches(n_keep):
            return n_keep
        return self._latest_checkpoint(n_keep)

    def _snapshot_reaches(self, n_keep: int) -> bool:
        end = self._memory_end()
        return n_keep >= end or end - n_keep <= min(self.rollback, self._last_run - 1)

    def _latest_checkpoint(self, n_keep: int) -> int:
        return max((pos for pos, _ in self._checkpoints if pos <= n_keep), default=0)

    def checkpoint(self) -> None:
        """Keep a copy of the recurrent state at this position (the end of a prompt, of an
        answer): a later trim back to it, or past it, restores it instead of computing every
        kept token again. Nothing on a KV cache, nor in a fork."""
        if not self.recurrent or self._fork_at is not None:
            return
        self._settle()
        if self.n_past == 0 or any(pos == self.n_past for pos, _ in self._checkpoints):
            return
        size = L.llama_state_seq_get_size_ext(self.ptr, 0, L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
        state = (ctypes.c_uint8 * size)()
        L.llama_state_seq_get_data_ext(self.ptr, state, size, 0, L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
        self._checkpoints = [*self._checkpoints, (self.n_past, state)][-self.MAX_CHECKPOINTS:]

    def _memory_end(self) -> int:
        return int(L.llama_memory_seq_pos_max(self.memory, self._seq)) + 1

    def _settle(self) -> None:
        """Make a recurrent memory end at n_past: one rollback to a snapshot where the last
        decode kept one, else the kept tokens computed again from the latest checkpoint before
        them or from an empty state."""
        end = self._memory_end()
        if end == self.n_past:
            return
        if end > self.n_past and self._snapshot_reaches(self.n_past):
            if L.llama_memory_seq_rm(self.memory, self._seq, self.n_past, -1):
                self._last_run = 0  # a snapshot is used once: the next trim needs the next decode's
                return
        keep = self.n_past
        self._last_run = 0
        start = self._latest_checkpoint(keep) if self._seq == 0 else 0
        if start:  # the latest checkpoint at or before keep: its state, and the KV cache cut there
            state = next(st for pos, st in self._checkpoints if pos == start)
            L.llama_state_seq_set_data_ext(self.ptr, state, len(state), 0, L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
            L.llama_memory_seq_rm(self.memory, 0, start, -1)
        else:
            L.llama_memory_seq_rm(self.memory, self._seq, -1, -1)
            if self._seq == 0:
                L.llama_memory_clear(self.memory, True)
        self.n_past = start
        if keep > start:
            self.n_replays += 1
            self.decode(self._history[start:keep].copy(), logits_all=False)

    def fork(self) -> None:
        """Go on in a scratch sequence that starts as this one (a recurrent draft's drafted
        tokens, which single-token decodes leave no snapshot to roll back over); `join` drops it."""
        if self._fork_at is not None:
            return
        self._settle()
        L.llama_memory_seq_cp(self.memory, 0, 1, -1, -1)
        self._fork_at = self.n_past
        self._set_seq(1)

    def join(self) -> None:
        """Forget the scratch sequence: the cache is what it was at `fork`."""
        if self._fork_at is None:
            return
        L.llama_memory_seq_rm(self.memory, 1, -1, -1)
        self.n_past, self._fork_at = self._fork_at, None
        self._last_run = 0
        self._set_seq(0)

    def clear(self) -> None:
        L.llama_memory_clear(self.memory, True)
        self.n_past = 0
        self._last_run = 0
        self._checkpoints = []
        self._fork_at = None
        self._set_seq(0)

    def close(self) -> None:
        if self.ptr:
            L.llama_batch_free(self._batch)
            L.llama_free(self.ptr)
            self.ptr = None
