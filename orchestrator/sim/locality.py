"""Token-level locality of a routing sequence: repeat rates and per-layer LRU / Belady curves, and
the fewest reads a host tier of a given size can make (`fewest_reads`).

These are the statistics the synthetic generator is calibrated against (published numbers for
Qwen3-30B-A3B decoding), measured on the token sequence of autoregressive decoding: one
`selected` row [n_layer, top_k] per generated token.

Cache model of the curves: one cache of C experts per MoE layer, accessed token by token.
A token's experts are served hits first (most recently used first), then its misses, each
loaded on demand; an expert may be evicted as soon as the current token has used it. With this
order LRU(C = top_k) equals the next-token repeat rate, and Belady (evict the cached expert
whose next use is farthest away) can keep an expert across tokens that LRU cannot.
"""

from __future__ import annotations

import numpy as np

NEVER = np.iinfo(np.int64).max


def repeat_rates(selected: np.ndarray, n_expert: int, windows=(1, 8)) -> dict[int, np.ndarray]:
    """Per window w: float [n_layer], share of selections chosen again within the next w tokens."""
    n_tokens, n_layer, _ = selected.shape
    chosen = np.zeros((n_tokens, n_layer, n_expert), dtype=bool)
    np.put_along_axis(chosen, selected.astype(np.intp), True, axis=2)
    out = {}
    for w in windows:
        if n_tokens <= w:
            raise ValueError(f"need more than {w} tokens, got {n_tokens}")
        later = np.zeros_like(chosen[:-w])
        for d in range(1, w + 1):
            later |= chosen[d:n_tokens - w + d]
        out[w] = (chosen[:-w] & later).sum(axis=(0, 2)) / chosen[:-w].sum(axis=(0, 2))
    return out


def access_order(selected: np.ndarray) -> np.ndarray:
    """Each token's experts reordered per layer: most recently used first, never used last."""
    n_tokens, n_layer, _ = selected.shape
    last = np.full((n_layer, int(selected.max()) + 1), -1, dtype=np.int64)
    rows = np.arange(n_layer)[:, None]
    out = np.empty_like(selected)
    for t in range(n_tokens):
        order = np.argsort(-last[rows, selected[t]], axis=1, kind="stable")
        out[t] = np.take_along_axis(selected[t], order, axis=1)
        last[rows, selected[t]] = t
    return out


def lru_hit_curve(selected: np.ndarray, capacities) -> np.ndarray:
    """float [len(capacities), n_layer]: per-layer LRU hit rate for each cache size."""
    seq = _access_sequence(selected)  # [n_layer, n]
    n_layer, n = seq.shape
    last = np.full((n_layer, int(seq.max()) + 1), -1, dtype=np.int64)
    rows = np.arange(n_layer)
    distance = np.empty((n_layer, n), dtype=np.int64)  # LRU stack distance of each access
    for i in range(n):
        e = seq[:, i]
        prev = last[rows, e]
        d = (last > prev[:, None]).sum(axis=1)
        distance[:, i] = np.where(prev < 0, NEVER, d)
        last[rows, e] = i
    return np.stack([(distance < c).mean(axis=1) for c in capacities])


def belady_hit_curve(selected: np.ndarray, capacities) -> np.ndarray:
    """float [len(capacities), n_layer]: per-layer hit rate of Belady's MIN for each cache size."""
    seq = _access_sequence(selected)
    n_layer, n = seq.shape
    n_expert = int(seq.max()) + 1
    rows = np.arange(n_layer)
    next_use = np.empty((n_layer, n), dtype=np.int64)
    seen = np.full((n_layer, n_expert), NEVER, dtype=np.int64)
    for i in range(n - 1, -1, -1):
        next_use[:, i] = seen[rows, seq[:, i]]
        seen[rows, seq[:, i]] = i
    # every (capacity, layer) pair is one independent cache: simulate them side by side
    caps = np.repeat(np.asarray(capacities, dtype=np.int64), n_layer)
    seq, next_use = np.tile(seq, (len(capacities), 1)), np.tile(next_use, (len(capacities), 1))
    rows = np.arange(len(caps))
    cached = np.zeros((len(caps), n_expert), dtype=bool)
    due = np.full((len(caps), n_expert), -1, dtype=np.int64)  # next use if cached, else −1
    size = np.zeros(len(caps), dtype=np.int64)
    hits = np.zeros(len(caps))
    for i in range(n):
        e = seq[:, i]
        hit = cached[rows, e]
        hits += hit
        full = ~hit & (size >= caps)
        if full.any():
            r = rows[full]
            victim = due[r].argmax(axis=1)
            cached[r, victim] = False
            due[r, victim] = -1
            size[r] -= 1
        cached[rows, e] = True
        size += ~hit
        due[rows, e] = next_use[:, i]
    return (hits / n).reshape(len(capacities), n_layer)


def fewest_reads(passes: list[np.ndarray], capacity: int) -> np.ndarray:
    """int [len(passes)]: the experts each pass must read when a host tier of `capacity` experts
    (every layer's together) holds, between passes, the ones whose next use is soonest (Belady's
    MIN at pass granularity). passes: bool [n_layer, n_expert] per pass, the experts it uses, all of
    which are in memory during the pass. No tier of that size reads fewer in total, whatever it reads
    ahead: a read ahead is a read too, and swapping a kept expert for one used sooner never costs a
    read (MIN's exchange argument). The first pass reads everything it uses."""
    never = len(passes)
    next_use = []
    upcoming = np.full(passes[0].shape, never, dtype=np.int64)
    for i in range(len(passes) - 1, -1, -1):
        next_use.append(upcoming.copy())
        upcoming[passes[i]] = i
    next_use.reverse()  # next_use[i]: for every expert, the first pass after i that uses it
    held = np.zeros(passes[0].shape, dtype=bool)
    reads = np.zeros(len(passes), dtype=np.int64)
    for i, used in enumerate(passes):
        reads[i] = int((used & ~held).sum())
        candidates = np.flatnonzero((held | used).ravel())
        soon = next_use[i].ravel()[candidates]
        keep = candidates[np.argsort(soon, kind="stable")[:capacity]]
        keep = keep[next_use[i].ravel()[keep] < never]  # never used again: not worth a slot
        held = np.zeros_like(held)
        held.ravel()[keep] = True
    return reads


def _access_sequence(selected: np.ndarray) -> np.ndarray:
    ordered = access_order(selected)
    n_tokens, n_layer, top_k = ordered.shape
    return ordered.transpose(1, 0, 2).reshape(n_layer, n_tokens * top_k).astype(np.int64)


def shared_expert_rate(selected: np.ndarray) -> float:
    """Share of consecutive token pairs (per layer) that choose at least one common expert: the
    Mixtral paper's "first or second choice" repetition for top-2 routing (§5, Fig. 10)."""
    a, b = selected[:-1], selected[1:]
    return float((a[:, :, :, None] == b[:, :, None, :]).any(axis=(2, 3)).mean())
