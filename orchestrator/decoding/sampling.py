"""Sampling maths of speculative decoding: the sampling distribution of one row of logits, and the
two verify rules (greedy: longest agreeing prefix; sampled: Leviathan et al. rejection sampling).
Pure numpy: no model, no context."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """temperature ≤ 0: greedy. top_k ≤ 0 and top_p ≥ 1: off. Applied alike to draft and target."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The sampling distribution (float64 [n_vocab], sums to 1) of one row of logits:
    temperature, then top-k (ties at the k-th value kept), then top-p (smallest prefix of the
    sorted distribution whose mass reaches top_p), renormalised. With top-k on, the softmax and
    the top-p sort see only the k candidates (a 150k vocabulary costs one partition)."""
    n = logits.shape[-1]
    k = params.top_k
    if 0 < k < n:
        kth = np.partition(logits, n - k)[n - k]
        idx = np.flatnonzero(logits >= kth)
        z = logits[idx].astype(np.float64)
    else:
        idx = None
        z = logits.astype(np.float64)
    z -= z.max()
    if params.temperature != 1.0:
        z /= params.temperature
    np.exp(z, out=z)
    z /= z.sum()
    if params.top_p < 1.0:
        z = _nucleus(z, params.top_p)
    if idx is None:
        return z
    p = np.zeros(n)
    p[idx] = z
    return p


def _nucleus(z: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the most probable entries up to mass top_p, renormalised. The nucleus is found among
    the top m candidates, m growing ×8 until their mass reaches top_p (no full sort)."""
    n, m = z.size, 64
    while True:
        cand = np.argpartition(z, n - m)[n - m:] if m < n else np.arange(n)
        order = cand[np.argsort(-z[cand], kind="stable")]
        mass = np.cumsum(z[order])
        if mass[-1] >= top_p or m >= n:
            break
        m = min(m * 8, n)
    keep = order[:int(np.searchsorted(mass, top_p)) + 1]
    out = np.zeros_like(z)
    out[keep] = z[keep]
    out /= out.sum()
    return out


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """One token from a (possibly unnormalised) non-negative distribution, by inverse CDF."""
    c = np.cumsum(p)
    i = int(np.searchsorted(c, rng.random() * c[-1], side="right"))
    return min(i, len(p) - 1)


def verify_greedy(drafts: Sequence[int], logits: np.ndarray) -> tuple[int, int]:
    """(accepted drafts, the target's next token) from the verify logits [len(drafts)+1, V]."""
    best = logits.argmax(axis=1)
    n = len(drafts)
    miss = np.flatnonzero(best[:n] != np.asarray(drafts, dtype=best.dtype))
    a = int(miss[0]) if miss.size else n
    return a, int(best[a])


def verify_sampled(drafts: Sequence[int], q: Sequence[np.ndarray], logits: np.ndarray,
                   params: SamplingParams, rng: np.random.Generator) -> tuple[int, int]:
    """Leviathan et al. (2023) rejection sampling: (accepted drafts, next token).

    q[i]: the draft distribution d_i was sampled from; logits: target rows [len(drafts)+1, V].
    The returned tokens are distributed exactly as sampling the target alone would give."""
    for i, d in enumerate(drafts):
        p = distribution(logits[i], params)
        if rng.random() * q[i][d] < p[d]:  # accept with probability min(1, p/q)
            continue
        residual = np.maximum(p - q[i], 0.0)
        return i, sample(residual if residual.sum() > 0 else p, rng)
    return len(drafts), sample(distribution(logits[len(drafts)], params), rng)
