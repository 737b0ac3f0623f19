"""Adaptive draft length: MoE-SpeQ's Speculative Governor (seed 000 §3.2).

Before every verification step the governor picks the draft length γ ∈ [γ_min, γ_max]
(γ_max: `--draft-max`) that maximises the expected tokens per second of that step, the
Amortization Roofline objective of the paper:

    E(γ) = 1 + Σ_{i=1..γ} Π_{j≤i} p_j          expected tokens of a step: accepted drafts + the
                                               target's own token
    T(γ) = γ · t_draft + T_verify(γ + 1) + t_step
    γ*   = argmax_γ E(γ) / T(γ)

- p_i: the probability that draft i is accepted given drafts 1..i−1 were (seed 000, Eq. 2),
  from decayed counts of what the verify passes accepted, shrunk towards the geometric rate α
  for positions that are seldom reached (a short γ never observes p_8).
- t_draft: measured seconds per drafted token (the draft is cheap and linear in γ).
- T_verify(n): measured seconds of the verify pass of n tokens (the median of the last few
  measurements of that size, so a passing load spike does not count much): the roofline of
  the target. A memory-bound target streams its weights once whatever n is, so T_verify stays
  nearly flat until compute catches up; a small compute-bound target pays about n times one
  token. Between measured sizes it is interpolated linearly; outside them it follows the slope of
  a line fitted through the measurements (never negative) from the nearest measured size.
- t_step: the rest of a step (acceptance, KV trims, the expert policy), measured.

The first steps probe the batch sizes the model needs (γ_max, γ_min, 1, γ_max/2, and γ_max again:
the very first step of a session runs on cold caches and its times are dropped); afterwards
every `probe_every`-th step takes the neighbour of the best γ whose verify cost was measured
longest ago (if the model puts it close to the best), and every `probe_far`-th probe the γ
measured longest ago of all that are not far worse, so the model follows the machine's load
and the text's acceptance.

The governor only chooses how many tokens to draft: greedy output is the target's whatever γ is.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class GovernorConfig:
    gamma_max: int
    gamma_min: int = 0            # 0 allows a plain autoregressive step where drafting cannot pay
    acceptance_decay: float = 0.97  # per step: the counts remember about 1/(1 − decay) steps
    cost_weight: float = 0.3      # weight of a new draft / step time in its running average
    verify_window: int = 5        # T_verify(n): the median of the last measurements of size n
    prior_acceptance: float = 0.7
    prior_weight: float = 2.0     # pseudo-observations behind α and behind each p_i's shrinkage
    switch_margin: float = 0.02   # leave the γ in force only for a predicted gain above 2%
    probe_every: int = 16         # every n-th step may try a neighbour of the best γ ...
    probe_margin: float = 0.15    # ... when the model puts it within 15% of the best;
    probe_far: int = 8            # every 8th probe tries the γ measured longest ago ...
    probe_far_margin: float = 0.5  # ... of those within 50% of the best

    def __post_init__(self) -> None:
        if not 0 <= self.gamma_min <= self.gamma_max:
            raise ValueError(f"need 0 ≤ gamma_min ≤ gamma_max, got {self.gamma_min}, {self.gamma_max}")


class Governor:
    """Chooses γ for the next verification step from what the previous steps measured.

        gov = Governor(GovernorConfig(gamma_max=8))
        while generating:
            g = gov.next_gamma()
            ... draft up to g tokens, verify ...
            gov.observe(n_drafted, n_accepted, draft_s, verify_s, other_s)
    """

    def __init__(self, cfg: GovernorConfig) -> None:
        self.cfg = cfg
        n = cfg.gamma_max
        self.succ = np.zeros(n + 1)   # decayed counts, index i = draft position (1-based)
        self.tried = np.zeros(n + 1)
        self.n_accept = self.n_reject = 0.0
        self.t_draft = np.nan        # seconds per drafted token
        self.t_step = np.nan         # seconds per step outside drafting and verifying
        self.t_verify = np.full(n + 2, np.nan)  # index n = batch size
        self.measured_at = np.full(n + 2, -1)
        self._verify_times: list[deque] = [deque(maxlen=cfg.verify_window) for _ in range(n + 2)]
        self.steps = 0
        self.last_gamma = n
        self.current: int | None = None  # the γ in force (probes aside)
        self._tps: np.ndarray | None = None
        # the first step pays for cold caches and first-touch page faults: its times are not
        # kept, and its γ is probed again last
        probes = [g for g in (n, cfg.gamma_min, min(1, n), max(cfg.gamma_min, n // 2)) if cfg.gamma_min <= g <= n]
        self._probes = [*dict.fromkeys(probes), n]

    # -- measurements ---------------------------------------------------------------------

    def observe(self, n_drafted: int, n_accepted: int, draft_s: float, verify_s: float,
                other_s: float = 0.0) -> None:
        """One verification step: `n_drafted` drafts (0: an autoregressive step), the first
        `n_accepted` of them accepted, and its measured times in seconds."""
        if not 0 <= n_accepted <= n_drafted:
            raise ValueError(f"accepted {n_accepted} of {n_drafted} drafts")
        c = self.cfg
        self.succ *= c.acceptance_decay
        self.tried *= c.acceptance_decay
        self.n_accept *= c.acceptance_decay
        self.n_reject *= c.acceptance_decay
        g = min(n_drafted, c.gamma_max)
        a = min(n_accepted, g)
        self.succ[1:a + 1] += 1
        self.tried[1:a + 1] += 1
        self.n_accept += a
        if a < g:  # draft a+1 was rejected; the ones after it were never judged
            self.tried[a + 1] += 1
            self.n_reject += 1
        if self.steps > 0:
            if n_drafted > 0:
                self.t_draft = _average(self.t_draft, draft_s / n_drafted, c.cost_weight)
            self.t_step = _average(self.t_step, other_s, c.cost_weight)
            b = min(n_drafted + 1, c.gamma_max + 1)
            self._verify_times[b].append(verify_s)
            self.t_verify[b] = float(np.median(self._verify_times[b]))
            self.measured_at[b] = self.steps
        self.steps += 1
        self._tps = None

    # -- the model ------------------------------------------------------------------------

    @property
    def alpha(self) -> float:
        """Geometric acceptance rate: accepted drafts / judged drafts, with the prior."""
        c = self.cfg
        a0 = c.prior_acceptance * c.prior_weight
        return (self.n_accept + a0) / (self.n_accept + self.n_reject + c.prior_weight)

    def acceptance(self) -> np.ndarray:
        """p_i for i = 1..γ_max (index 0 unused, 1.0)."""
        k = self.cfg.prior_weight
        p = (self.succ + k * self.alpha) / (self.tried + k)
        p[0] = 1.0
        return p

    def expected_tokens(self) -> np.ndarray:
        """E(γ) for γ = 0..γ_max."""
        return 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(self.acceptance()[1:]))])

    def verify_cost(self, n: int) -> float:
        """Estimated seconds of a verify pass of n tokens (NaN before any measurement)."""
        return float(self.verify_costs(np.array([n]))[0])

    def verify_costs(self, n: np.ndarray) -> np.ndarray:
        """verify_cost for an array of batch sizes, in one pass (this runs every step)."""
        known = np.flatnonzero(~np.isnan(self.t_verify))
        if known.size == 0:
            return np.full(len(n), np.nan)
        t = self.t_verify[known]
        slope = 0.0
        if known.size > 1:  # least-squares line through the measurements
            dx = known - known.mean()
            slope = max(float(dx @ (t - t.mean()) / (dx @ dx)), 0.0)
        below = np.maximum(t[0] + slope * (n - known[0]), 0.0)
        above = t[-1] + slope * (n - known[-1])
        return np.where(n < known[0], below, np.where(n > known[-1], above, np.interp(n, known, t)))

    def throughput(self) -> np.ndarray:
        """Expected tokens per second of a step with γ = 0..γ_max (NaN where not estimable);
        computed once per observed step."""
        if self._tps is None:
            self._tps = self._throughput()
        return self._tps

    def _throughput(self) -> np.ndarray:
        g = np.arange(self.cfg.gamma_max + 1)
        t_draft = 0.0 if np.isnan(self.t_draft) else self.t_draft
        t_step = 0.0 if np.isnan(self.t_step) else self.t_step
        cost = g * t_draft + self.verify_costs(g + 1) + t_step
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.expected_tokens() / cost

    # -- the decision ---------------------------------------------------------------------

    def best_gamma(self) -> int:
        """The γ the model puts highest; the one in force stays unless another beats it by more
        than `switch_margin` (near the top the curve is flat, and noise must not make γ dither)."""
        c = self.cfg
        tps = self.throughput()
        if np.all(np.isnan(tps[c.gamma_min:])):
            return c.gamma_max
        best = c.gamma_min + int(np.nanargmax(tps[c.gamma_min:]))
        keep = self.current
        if keep is not None and keep != best and not tps[best] > (1 + c.switch_margin) * tps[keep]:
            return keep
        return best

    def next_gamma(self) -> int:
        """γ for the next step: a warm-up probe, a periodic probe next to the best, or the best."""
        c = self.cfg
        if self.steps < len(self._probes):
            g = self._probes[self.steps]
        else:
            g = self.current = self.best_gamma()
            if c.probe_every and self.steps % c.probe_every == 0:
                g = self._probe_near(g)
        self.last_gamma = g
        return g

    def _probe_near(self, best: int) -> int:
        """The neighbour of `best` measured longest ago, if the model puts it within
        `probe_margin` of the best; every `probe_far`-th probe instead the γ measured longest
        ago of all those within `probe_far_margin` (a measurement taken under a passing load must
        not stay forever)."""
        c = self.cfg
        tps = self.throughput()
        if (self.steps // c.probe_every) % c.probe_far == 0:
            cand, margin = [x for x in range(c.gamma_min, c.gamma_max + 1) if x != best], c.probe_far_margin
        else:
            cand, margin = [x for x in (best - 1, best + 1) if c.gamma_min <= x <= c.gamma_max], c.probe_margin
        cand = [x for x in cand if not tps[x] < (1 - margin) * tps[best]]
        return min(cand, key=lambda x: self.measured_at[x + 1]) if cand else best


def _average(old: float, new: float, weight: float) -> float:
    return new if np.isnan(old) else (1 - weight) * old + weight * new
