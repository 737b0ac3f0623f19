"""The target's multi-token-prediction (MTP) head as the draft (issue 40).

Qwen3.5/3.6-MoE and Qwen3-Next files can carry MTP layers (GGUF `<arch>.nextn_predict_layers`):
a decoder block after the trunk that reads a token together with the target's hidden state of the
position before it, and predicts the token after it. llama.cpp runs it in a context of its own
type (LLAMA_CONTEXT_TYPE_MTP) on the same loaded model, with a KV cache of that one block; this
module drives it as common/speculative.cpp's MTP draft does:

    export    the target's context keeps the hidden state of every token it decodes (nextn,
              unmasked: prefill and verify passes alike), read after each decode
    catch-up  each token the head has not seen, at position q, paired with the target's hidden
              state of position q - 1, in one decode; its last output predicts the first draft
    draft     each drafted token paired with the head's own hidden state of the position before
              (its last output), one decode per token

Only the catch-up's entries are the target's: the drafted ones are dropped after the verify pass
(`fork`/`join`, which Session's draft loop calls for a draft whose drafted tokens cannot stay),
and the next catch-up decodes the accepted tokens again with the verify pass's hidden states.

`MtpDraft` has what Session's draft loop uses of an `llm.Context` (decode, logits, trim,
reusable, fork, join, clear), so the loop is the same for every draft. The head's own MoE layer
is not one of the target's: its routing says nothing about the target's experts and is left out
of the lookahead (patch 0020 keeps it out of the pool and of the routing export too).
"""

from __future__ import annotations

import ctypes

import numpy as np

import llama_cpp as L

from orchestrator.decoding.draft import MTP_DRAFT  # noqa: F401 - SessionConfig.draft: the target's MTP head
from orchestrator.runtime.llm import Context, Model, ModelError
from orchestrator.runtime.native import lib



def mtp_layers(model: Model) -> int:
    """How many MTP layers the file declares (0: none)."""
    return int(L.llama_model_n_layer_nextn(model.ptr))


def require_mtp(model: Model) -> None:
    """A clear error for an MTP draft on a target that has no MTP layers."""
    if mtp_layers(model) == 0:
        raise ModelError(f"{model.path} has no MTP layers ({model.arch}.nextn_predict_layers): the MTP draft "
                         "needs a file converted with them")


class MtpDraft:
    """An MTP context on the target's model, fed the target context's hidden states.

    The target must have been loaded with `Model(..., mtp=True)`. Decodes pair each token with
    the target's hidden state of the position before it (zeros where none is known: position 0,
    a state computed before a prompt reused the cache, a calibration's made-up tokens); after
    `fork`, with the head's own state of its last output (the drafted tokens)."""

    forks = True            # drafted tokens are dropped by `join` (they pair with the head's own states)

    def __init__(self, target: Model, ctx: Context, n_batch: int, n_threads: int):
        require_mtp(target)
        self.model, self._target = target, ctx
        self._lib = lib()
        params = L.llama_context_default_params()
        params.ctx_type = L.LLAMA_CONTEXT_TYPE_MTP
        params.n_ctx = ctx.n_ctx
        params.n_batch = params.n_ubatch = n_batch
        params.n_threads = params.n_threads_batch = n_threads
        params.n_seq_max = 1
        self.ptr = L.llama_init_from_model(target.ptr, params)
        if not self.ptr:
            raise ModelError(f"could not create an MTP context for {target.path.name} (llama.cpp has no MTP "
                             f"graph for {target.arch}, or it does not fit)")
        self.n_ctx, self.n_batch, self.n_vocab = ctx.n_ctx, n_batch, target.n_vocab
        self.n_embd = int(L.llama_model_n_embd_out(target.ptr))
        self.memory = L.llama_get_memory(self.ptr)
        self._batch = L.llama_batch_ext_init(self.ptr)
        self._pos = (ctypes.c_int32 * 4)()
        self._zeros = np.zeros(self.n_embd, np.float32)
        self._lib["set_embeddings_nextn"](ctx.ptr, True, False)    # every token's state, in batch order
        self._lib["set_embeddings_nextn"](self.ptr, True, True)    # the head's own: its outputs'
        ctx.after_decode = self._target_decoded
        # the target's hidden states of positions [_h_start, _h_start + len(_h)) not yet consumed
        self._h_start = 0
        self._h = np.zeros((0, self.n_embd), np.float32)
        self._own = self._zeros        # the head's state of its last output: the next drafted token's pair
        self.n_past = 0
        self._n_out = 0
        self._fork_at: int | None = None

    # -- the target's side ------------------------------------------------------------------

    def _target_decoded(self, first: int, n: int) -> None:
        """After a target decode of positions [first, first + n): keep their hidden states (a
        decode from an earlier position replaces what was kept from there on: rejected drafts)."""
        addr = self._lib["get_embeddings_nextn"](self._target.ptr)
        if not addr:
            return
        rows = np.ctypeslib.as_array((ctypes.c_float * (n * self.n_embd)).from_address(addr)).reshape(n, self.n_embd)
        end = self._h_start + len(self._h)
        # the rows the head still needs start at its n_past - 1 (the pair of its next token)
        lo = max(self._h_start, min(first, self.n_past - 1))
        if first > end or first < lo:
            self._h_start, kept = first, self._h[:0]
        else:
            kept = self._h[lo - self._h_start:first - self._h_start]
            self._h_start = lo
        self._h = np.concatenate([kept, rows])

    def _state_of(self, pos: int) -> np.ndarray:
        i = pos - self._h_start
        return self._h[i] if 0 <= i < len(self._h) else self._zeros

    # -- what Session's draft loop uses -------------------------------------------------------

    def decode(self, tokens, logits_all: bool = False) -> None:
        """Append tokens: paired with the target's states (catch-up), or after `fork` with the
        head's own (drafting, one token at a time). Logits of the last token (all with logits_all)."""
        tokens = [int(t) for t in tokens]
        if self._fork_at is not None:
            for t in tokens:  # each drafted token pairs with the head's output of the one before
                self._process([t], [self._own], True)
            return
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start:start + self.n_batch]
            last = start + len(chunk) == len(tokens)
            states = [self._state_of(self.n_past + i - 1) for i in range(len(chunk))]
            self._process(chunk, states, logits_all, last)
        self._drop_consumed()

    def _process(self, tokens: list[int], states: list[np.ndarray], logits_all: bool, last: bool = True) -> None:
        if self.n_past + len(tokens) > self.n_ctx:
            raise ModelError(f"context full: {self.n_past + len(tokens)} tokens > n_ctx {self.n_ctx}")
        b = self._batch
        L.llama_batch_ext_clear(b)
        for i, (t, h) in enumerate(zip(tokens, states)):
            idx = L.llama_batch_ext_add_token(b, 0, t)
            self._pos[0] = self.n_past + i
            L.llama_batch_ext_set_pos(b, idx, self._pos)
            h = np.ascontiguousarray(h, dtype=np.float32)
            L.llama_batch_ext_set_embd_token(b, idx, L.llama_embd(h.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1,
                                                                  self.n_embd))
            if logits_all or (last and i == len(tokens) - 1):
                L.llama_batch_ext_set_output_logits(b, idx, True)
        rc = L.llama_process(self.ptr, L.LLAMA_PROCESS_TYPE_DECODE, b)
        if rc != 0:
            raise ModelError(f"llama_process (MTP) failed with code {rc}")
        self.n_past += len(tokens)
        self._n_out = len(tokens) if logits_all else int(last)
        if last:
            addr = self._lib["get_embeddings_nextn_ith"](self.ptr, len(tokens) - 1)
            if addr:
                self._own = np.ctypeslib.as_array((ctypes.c_float * self.n_embd).from_address(addr)).copy()

    def _drop_consumed(self) -> None:
        """Forget the target's states before n_past - 1: no token the head has still to see pairs with them."""
        cut = self.n_past - 1 - self._h_start
        if cut > 0:
            self._h = self._h[min(cut, len(self._h)):]
            self._h_start += cut

    def logits(self) -> np.ndarray:
        """float32 [n_outputs, n_vocab] of the last decode: a view, valid until the next decode."""
        return np.ctypeslib.as_array(L.llama_get_logits(self.ptr), shape=(self._n_out, self.n_vocab))

    def trim(self, n_keep: int, force: bool = False) -> None:
        if self._fork_at is not None:  # interrupted while drafting: the drafted tokens go too
            n_keep, self._fork_at = min(n_keep, self._fork_at), None
        if force or n_keep < self.n_past:
            L.llama_memory_seq_rm(self.memory, 0, n_keep, -1)
            self.n_past = min(self.n_past, n_keep)

    def reusable(self, n_keep: int) -> int:
        return n_keep  # a KV cache: a trim keeps every token before n_keep

    def fork(self) -> None:
        """From here on, drafted tokens: `join` drops them."""
        if self._fork_at is None:
            self._fork_at = self.n_past

    def join(self) -> None:
        """Drop the drafted tokens: the cache is what it was at `fork`."""
        if self._fork_at is not None:
            at, self._fork_at = self._fork_at, None
            self.trim(at)

    def clear(self) -> None:
        L.llama_memory_clear(self.memory, True)
        self.n_past = 0
        self._fork_at = None

    def close(self) -> None:
        if self.ptr:
            if self._target.after_decode == self._target_decoded:
                self._target.after_decode = None
            if self._target.ptr:
                self._lib["set_embeddings_nextn"](self._target.ptr, False, False)
            L.llama_batch_ext_free(self._batch)
            L.llama_free(self.ptr)
            self.ptr = None
