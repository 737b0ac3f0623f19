"""Adaptive draft length: MoE-SpeQ's Speculative Governor (MoE-SpeQ §3.2).

Before every verification step the governor picks the draft length γ ∈ [γ_min, γ_max]
(γ_max: `--draft-max`) that maximises the expected tokens per second of that step, the
Amortization Roofline objective of the paper:

    E(γ) = 1 + Σ_{i=1..γ} Π_{j≤i} p_j          expected tokens of a step: accepted drafts + the
                                               target's own token
    T(γ) = γ · t_draft + T_verify(γ + 1) + t_step
    γ*   = argmax_γ E(γ) / T(γ)

- p_i: the probability that draft i is accepted given drafts 1..i−1 were (MoE-SpeQ Eq. 2),
  from decayed counts of what the verify passes accepted, each shrunk towards p_{i−1} (p_1
  towards the geometric rate α) for positions that are seldom reached (a short γ never observes
  p_8): where acceptance is not geometric, the later positions follow the last one measured.
- t_draft: measured seconds per drafted token (the draft is cheap and linear in γ).
- T_verify(n): measured seconds of the verify pass of n tokens (the median of the last few
  measurements of that size, so a passing load spike does not count much): the roofline of
  the target. A memory-bound target streams its weights once whatever n is, so T_verify stays
  nearly flat until compute catches up; a small compute-bound target pays about n times one
  token. Each size's median is shrunk towards a line fitted through all sizes (weighted by their
  measurements; its slope never negative) as if the line were `verify_shrink` more measurements:
  an MoE target's verify time swings by a quarter with the experts the text routes to, so a size
  probed once, on other text, must not outweigh the sizes measured all along. Between measured
  sizes it is interpolated linearly; outside them it follows the line's slope from the nearest
  measured size. The times are kept divided by a level that all sizes share (the machine's speed,
  the text's experts): a size measured again moves it by `level_weight` of its log distance from
  that size's median, so a size measured long ago, on a slower machine, scales with the ones in use
  instead of keeping its γ out. From one size in use a faster machine and a cheaper size look
  alike, and the level takes only a share of such a change (the size's median the rest).
  A size not measured for `stale_after` steps is stale: its times, taken on other text or on cold
  caches (a model file still coming from the disk makes the first steps several times slower), are
  left out of the roofline while a fresh size remains, and dropped when it is measured again (from
  one fresh size the roofline is flat, so the others look no dearer and are measured before use).
  Below the smallest size measured a pass costs no less per token than it, above the largest no
  more (more tokens never cost more per token), so a steep local slope never makes a short pass free.
- t_step: the rest of a step (acceptance, KV trims, the expert policy), measured.

The first steps probe the batch sizes the model needs: γ_min twice (the very first step of a
session runs on cold caches and its times are dropped; a plain step costs what decoding without
a draft costs), then 1, γ_max/2 and γ_max, the last two only if they could beat the best γ
measured so far with every draft accepted and a verify pass no cheaper than the largest one
measured below them (a small compute-bound target with a draft as slow as itself pays for none of
them: their cost is a tenth of a 256-token answer there). Afterwards every `probe_every`-th step
takes the neighbour of the best γ whose verify cost was measured longest ago (if the model puts
it close to the best), and every `probe_far`-th probe the γ measured longest ago of all that are
not far worse, so the model follows the machine's load and the text's acceptance. A short γ never
judges the later positions nor measures the longer passes again, so their values from other text
keep it in force: after `climb_after` steps in a row with every draft accepted it tries γ_max (if
that could pay), which measures both; each such try that is rejected doubles the wait (up to
`climb_backoff_max` times). A γ whose time is stale or only inferred is measured once before it is
put in force. While γ = 0 is
in force only every `plain_probe_every`-th probe is taken, and the plain steps in between do not
ask the model at all (`next_gamma`); each probe that leaves γ = 0 in force doubles that interval
(up to `plain_backoff_max` times: 1,024 steps), since a probe from γ = 0 costs the most (the draft
catches up on every token it skipped) and a draft that cannot pay keeps finding so: on the shipped
model the probes every 64 steps cost 3% of a plain decode loop's speed.

The governor only chooses how many tokens to draft: greedy output is the target's whatever γ is.

Why ~480 lines: the model (acceptance per position, the verify roofline with its shrink and level),
the decision with its probes, and the plain runs decided ahead are one object's state, read and
written by each other at every step; split, each part would reach into the others' counters.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class GovernorConfig:
    gamma_max: int
    gamma_min: int = 0            # 0 allows a plain autoregressive step where drafting cannot pay
    acceptance_decay: float = 0.97  # per step: the counts remember about 1/(1 − decay) steps
    cost_weight: float = 0.3      # weight of a new draft / step time in its running average
    verify_window: int = 5        # T_verify(n): the median of the last measurements of size n ...
    verify_shrink: float = 3.0    # ... shrunk towards the line through all sizes as if it were 3 more (0: not)
    level_weight: float = 0.1     # weight of a new measurement in the level all sizes share (0: no level)
    prior_acceptance: float = 0.7
    prior_weight: float = 2.0     # pseudo-observations behind α and behind each p_i's shrinkage
    switch_margin: float = 0.02   # leave the γ in force only for a predicted gain above 2%
    probe_every: int = 16         # every n-th step may try a neighbour of the best γ ...
    probe_margin: float = 0.15    # ... when the model puts it within 15% of the best;
    probe_far: int = 8            # every 8th probe tries the γ measured longest ago ...
    probe_far_margin: float = 0.5  # ... of those within 50% of the best
    plain_probe_every: int = 4    # while γ = 0 is in force, only every n-th probe step is taken
    plain_backoff_max: int = 4    # ... and each probe that leaves γ = 0 in force doubles that, up to 2^4 times
    climb_after: int = 4          # after this many steps in a row with every draft accepted, try γ_max (0: never) ...
    climb_backoff_max: int = 5    # ... and each such try that is rejected doubles that, up to 2^5 times
    stale_after: int = 48         # a size not measured for this many steps is left out of the roofline (0: never)

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

    It runs twice per step of the loop, on a dozen numbers: plain Python floats, a fifth of the
    time numpy's calls take on arrays that small; the public methods return arrays.
    """

    def __init__(self, cfg: GovernorConfig) -> None:
        self.cfg = cfg
        n = cfg.gamma_max
        self._succ = [0.0] * (n + 1)  # decayed counts, index i = draft position (1-based)
        self._tried = [0.0] * (n + 1)
        self._n_accept = self._n_reject = 0.0
        self._decay = 1.0             # decay the counts still owe (applied when they are next used)
        self.t_draft = math.nan      # seconds per drafted token
        self.t_step = math.nan       # seconds per step outside drafting and verifying
        self.t_verify = [math.nan] * (n + 2)  # index n = batch size: its median over the level
        self.measured_at = [-1] * (n + 2)  # the step of the last measurement of each batch size
        self._verify_times: list[deque] = [deque(maxlen=cfg.verify_window) for _ in range(n + 2)]
        self._log_level = 0.0         # log of the level the verify times of every size share now
        self.steps = 0
        self.last_gamma = n
        self.current: int | None = None  # the γ in force (probes aside)
        self._tps: list[float] | None = None
        self._judged = False          # the last step judged drafts (its acceptance moved the model)
        self._quiet = 0               # steps still to run at γ = 0 without asking the model
        self._plain_runs = 0          # plain runs in a row, each started by a probe that kept γ = 0
        self._full_steps = 0          # steps in a row whose every draft was accepted
        self._climbs_failed = 0       # climbs to γ_max in a row whose drafts were rejected
        self._climbing = False        # the step in flight is a climb
        self._plain: list[tuple[float, float]] | None = None  # (verify, other) s of steps decided ahead
        # the first step pays for cold caches and first-touch page faults: its times are not
        # kept, and its γ is probed again next
        probes = [g for g in (cfg.gamma_min, min(1, n), max(cfg.gamma_min, n // 2), n) if cfg.gamma_min <= g <= n]
        self._probes = [cfg.gamma_min, *dict.fromkeys(probes)]

    # -- measurements ---------------------------------------------------------------------

    def observe(self, n_drafted: int, n_accepted: int, draft_s: float, verify_s: float,
                other_s: float = 0.0) -> None:
        """One verification step: `n_drafted` drafts (0: an autoregressive step), the first
        `n_accepted` of them accepted, and its measured times in seconds."""
        if not 0 <= n_accepted <= n_drafted:
            raise ValueError(f"accepted {n_accepted} of {n_drafted} drafts")
        c = self.cfg
        if self._plain is not None:
            if n_drafted == 0:  # a step decided ahead: its times wait for the model's next use
                self._plain.append((verify_s, other_s))
                self._decay *= c.acceptance_decay
                self.steps += 1
                return
            self._end_plain_run()
        self._decay *= c.acceptance_decay
        g = min(n_drafted, c.gamma_max)
        if g:
            a = min(n_accepted, g)
            succ, tried = self.succ, self.tried
            for i in range(1, a + 1):
                succ[i] += 1
                tried[i] += 1
            self._n_accept += a
            if a < g:  # draft a+1 was rejected; the ones after it were never judged
                tried[a + 1] += 1
                self._n_reject += 1
            self._full_steps = self._full_steps + 1 if a == g else 0
            if self._climbing:
                self._climbs_failed = 0 if a == g else min(self._climbs_failed + 1, c.climb_backoff_max)
        self._climbing = False
        if self.steps > 0:
            if n_drafted > 0:
                self.t_draft = _average(self.t_draft, draft_s / n_drafted, c.cost_weight)
            self.t_step = _average(self.t_step, other_s, c.cost_weight)
            b = min(n_drafted + 1, c.gamma_max + 1)
            self._forget_if_stale(b, self.steps)
            self._measured(b, verify_s)
            self.measured_at[b] = self.steps
        self.steps += 1
        self._tps = None
        self._judged = g > 0

    def _fold(self) -> None:
        """Take in the times of the steps decided ahead so far, as `observe` would have one by one."""
        plain = self._plain
        if not plain:
            return
        self._plain = []
        self._forget_if_stale(1, self.steps - len(plain))  # judged at the first of them, as one by one
        for verify_s, other_s in plain:
            self.t_step = _average(self.t_step, other_s, self.cfg.cost_weight)
            self._measured(1, verify_s)
        self.measured_at[1] = self.steps - 1
        self._tps = None
        self._judged = False

    def _measured(self, batch: int, verify_s: float) -> None:
        """One verify time of `batch` tokens: it moves the level by how far it is from what that
        size measured before (a size measured for the first time, or stale, has nothing to compare
        with), and is kept divided by the level."""
        times = self._verify_times[batch]
        if times and self.cfg.level_weight:
            seen = math.log(max(verify_s, 1e-9)) - math.log(max(self.t_verify[batch], 1e-9))
            self._log_level += self.cfg.level_weight * (seen - self._log_level)
        times.append(verify_s / self.level)
        self.t_verify[batch] = _median(times)

    def _stale(self, batch: int, step: int | None = None) -> bool:
        """Whether the times of `batch` tokens are older than `stale_after` steps at `step` (now):
        taken on other text, or on cold caches (a model file still being read from the disk makes
        the first steps several times slower), they no longer say what that size costs. A stale
        size's times are dropped when it is measured again (`_forget_if_stale`)."""
        c = self.cfg
        now = self.steps if step is None else step
        return c.stale_after > 0 and 0 <= self.measured_at[batch] < now - c.stale_after

    def _forget_if_stale(self, batch: int, step: int) -> None:
        """Before a measurement of `batch` tokens at `step`: a stale size starts again."""
        if self._stale(batch, step):
            self._verify_times[batch].clear()

    def _fresh(self, gamma: int) -> bool:
        """Whether γ's verify pass has a time measured and not stale."""
        return self.measured_at[gamma + 1] >= 0 and not self._stale(gamma + 1)

    @property
    def level(self) -> float:
        """The factor the verify times of every size share now (the machine's speed, the text's
        experts): T_verify(n) = level × the roofline's shape at n."""
        return math.exp(self._log_level)

    def _end_plain_run(self) -> None:
        self._fold()
        self._plain, self._quiet = None, 0

    # -- the model ------------------------------------------------------------------------

    def _counts(self) -> None:
        """Apply the decay the counts owe: a step without drafts only multiplies `_decay`."""
        d = self._decay
        if d != 1.0:
            self._succ = [x * d for x in self._succ]
            self._tried = [x * d for x in self._tried]
            self._n_accept *= d
            self._n_reject *= d
            self._decay = 1.0

    @property
    def succ(self) -> list[float]:
        """Decayed count of accepted drafts at each position i = 1..γ_max."""
        self._counts()
        return self._succ

    @property
    def tried(self) -> list[float]:
        """Decayed count of judged drafts at each position."""
        self._counts()
        return self._tried

    @property
    def alpha(self) -> float:
        """Geometric acceptance rate: accepted drafts / judged drafts, with the prior."""
        c = self.cfg
        self._counts()
        a0 = c.prior_acceptance * c.prior_weight
        return (self._n_accept + a0) / (self._n_accept + self._n_reject + c.prior_weight)

    def acceptance(self) -> np.ndarray:
        """p_i for i = 1..γ_max (index 0 unused, 1.0)."""
        return np.array(self._acceptance())

    def _acceptance(self) -> list[float]:
        # each p_i shrunk towards the one before it (p_1 towards α): a position seldom reached is
        # taken to be like the last one measured. Where acceptance is geometric that is α again;
        # where it is not (a self-draft agrees for long runs or fails early: p_1 low, the later
        # p_i high), α would undercount what a long draft brings
        k = self.cfg.prior_weight
        p, prior = [1.0], self.alpha
        for s, t in zip(self.succ[1:], self.tried[1:]):
            prior = (s + k * prior) / (t + k)
            p.append(prior)
        return p

    def expected_tokens(self) -> np.ndarray:
        """E(γ) for γ = 0..γ_max."""
        return np.array(self._expected_tokens())

    def _expected_tokens(self) -> list[float]:
        e, reach, total = [1.0], 1.0, 0.0
        for p in self._acceptance()[1:]:
            reach *= p      # Π_{j≤i} p_j: draft i is accepted
            total += reach
            e.append(1.0 + total)
        return e

    def verify_cost(self, n: int) -> float:
        """Estimated seconds of a verify pass of n tokens (NaN before any measurement)."""
        self._fold()
        roofline = self._roofline()
        return math.nan if roofline is None else _interpolate(roofline, n)

    def verify_costs(self, n: np.ndarray) -> np.ndarray:
        """verify_cost for an array of batch sizes."""
        self._fold()
        roofline = self._roofline()
        if roofline is None:
            return np.full(len(n), np.nan)
        return np.array([_interpolate(roofline, x) for x in np.asarray(n).tolist()])

    def _roofline(self) -> tuple[list[int], list[float], float] | None:
        """(measured batch sizes, their verify times shrunk towards the least-squares line through
        them, weighted by how many measurements each median has, the line's slope, never
        negative), in seconds at the level now, or None before any measurement. Stale sizes are
        left out while a fresh one remains."""
        known = [b for b, t in enumerate(self.t_verify) if t == t]  # t == t: not NaN
        if not known:
            return None
        known = [b for b in known if not self._stale(b)] or known
        t = [self.t_verify[b] for b in known]
        slope = 0.0
        if len(known) > 1:
            w = [len(self._verify_times[b]) for b in known]
            total = sum(w)
            mean_b = sum(wi * b for wi, b in zip(w, known)) / total
            mean_t = sum(wi * y for wi, y in zip(w, t)) / total
            dx = [b - mean_b for b in known]
            slope = max(sum(wi * x * (y - mean_t) for wi, x, y in zip(w, dx, t))
                        / sum(wi * x * x for wi, x in zip(w, dx)), 0.0)
            k = self.cfg.verify_shrink
            t = [(wi * y + k * (mean_t + slope * x)) / (wi + k) for wi, x, y in zip(w, dx, t)]
        level = self.level
        return known, [level * y for y in t], level * slope

    def throughput(self) -> np.ndarray:
        """Expected tokens per second of a step with γ = 0..γ_max (NaN where not estimable);
        computed once per observed step."""
        return np.array(self._throughput())

    def _throughput(self) -> list[float]:
        self._fold()
        if self._tps is None:
            n = self.cfg.gamma_max
            roofline = self._roofline()
            if roofline is None:
                self._tps = [math.nan] * (n + 1)
                return self._tps
            t_draft = 0.0 if math.isnan(self.t_draft) else self.t_draft
            t_step = 0.0 if math.isnan(self.t_step) else self.t_step
            tps = []
            for g, e in enumerate(self._expected_tokens()):
                cost = g * t_draft + _interpolate(roofline, g + 1) + t_step
                tps.append(e / cost if cost else math.inf)
            self._tps = tps
        return self._tps

    # -- the decision ---------------------------------------------------------------------

    def best_gamma(self) -> int:
        """The γ the model puts highest; the one in force stays unless another beats it by more
        than `switch_margin` (near the top the curve is flat, and noise must not make γ dither)."""
        c = self.cfg
        tps = self._throughput()
        best, top = None, -math.inf
        for g in range(c.gamma_min, c.gamma_max + 1):
            if tps[g] > top:  # NaN never is
                best, top = g, tps[g]
        if best is None:
            return c.gamma_max
        keep = self.current
        if keep is not None and keep != best and not top > (1 + c.switch_margin) * tps[keep]:
            return keep
        return best

    def next_gamma(self) -> int:
        """γ for the next step: a warm-up probe, a periodic probe next to the best, or the best.

        The best is chosen again after every step that judged drafts and at probes: a step
        without drafts only refines the time of γ = 0. While γ = 0 is in force only every
        `plain_probe_every`-th probe step is taken, and the steps up to it are answered without
        the model, their times waiting in a list until the model is next used: a plain step is
        the cheapest of all, so asking the model (its code and data come back from memory after
        a decode: ~50 µs) weighs most there, and a probe from γ = 0 costs the most (the draft
        catches up on every token it skipped). The loop then costs what a plain decode loop does.
        """
        if self._quiet:
            self._quiet -= 1
            return 0
        self._end_plain_run()
        c = self.cfg
        if self.steps < len(self._probes) and (self.steps < 3 or self._could_pay(self._probes[self.steps])):
            g = self._probes[self.steps]
        else:
            probe = c.probe_every > 0 and self.steps % c.probe_every == 0
            g = None
            if probe or self._judged or self.current is None:
                best = self.best_gamma()
                if self.current is None or best == self.current or self._fresh(best):
                    self.current = best
                    if self.current:
                        self._plain_runs = 0
                else:  # its time is stale or only inferred: measured once before it is put in force
                    g = best
            if g is None and self._should_climb():
                g, self._full_steps, self._climbing = c.gamma_max, 0, True
            if g is None:
                g = self._probe_near(self.current) if probe else self.current
            every = (c.probe_every * c.plain_probe_every) << min(self._plain_runs, c.plain_backoff_max)
            if g == self.current == 0 and every and self.steps + 1 >= len(self._probes):
                self._quiet, self._plain = every - 1 - self.steps % every, []
                self._plain_runs += 1
        self.last_gamma = g
        return g

    def _should_climb(self) -> bool:
        """Whether to try γ_max now: the γ in force (short of γ_max, not 0) had every draft of its
        last `climb_after` steps accepted (doubled for each climb in a row that was rejected), and
        γ_max could beat it. A short γ never judges the later positions, so their acceptance and
        the longer passes' times stay as they were when it came into force, on other text; every
        draft accepted is a sign the text changed, and one step at γ_max measures both."""
        c, g = self.cfg, self.current
        if not c.climb_after or not g or g >= c.gamma_max:
            return False
        return self._full_steps >= c.climb_after << self._climbs_failed and self._could_pay(c.gamma_max)

    def _could_pay(self, gamma: int) -> bool:
        """Whether γ could beat the best measured γ even with every draft accepted and a verify
        pass that costs what the largest batch measured below γ + 1 did (more tokens never cost
        less): a warm-up probe that cannot is skipped."""
        measured = [b for b in range(1, gamma + 2) if self.t_verify[b] == self.t_verify[b]]
        if not measured or math.isnan(self.t_draft):
            return True
        tps = self._throughput()
        best = max(tps[b - 1] for b in measured)
        t_step = 0.0 if math.isnan(self.t_step) else self.t_step
        return (gamma + 1) / (gamma * self.t_draft + self.level * self.t_verify[measured[-1]] + t_step) > best

    def _probe_near(self, best: int) -> int:
        """The neighbour of `best` measured longest ago, if the model puts it within
        `probe_margin` of the best; every `probe_far`-th probe instead the γ measured longest
        ago of all those within `probe_far_margin` (a measurement taken under a passing load must
        not stay forever)."""
        c = self.cfg
        tps = self._throughput()
        if (self.steps // c.probe_every) % c.probe_far == 0:
            cand, margin = [x for x in range(c.gamma_min, c.gamma_max + 1) if x != best], c.probe_far_margin
        else:
            cand, margin = [x for x in (best - 1, best + 1) if c.gamma_min <= x <= c.gamma_max], c.probe_margin
        cand = [x for x in cand if not tps[x] < (1 - margin) * tps[best]]
        return min(cand, key=lambda x: self.measured_at[x + 1]) if cand else best


def _average(old: float, new: float, weight: float) -> float:
    return new if math.isnan(old) else (1 - weight) * old + weight * new


def _median(values) -> float:
    v = sorted(values)
    h = len(v) // 2
    return v[h] if len(v) % 2 else (v[h - 1] + v[h]) / 2


def _interpolate(roofline: tuple[list[int], list[float], float], n: int) -> float:
    """T_verify(n): linear between the measured sizes; outside them, the fitted slope from the
    nearest one, no cheaper per token than it below it and no dearer above it."""
    known, t, slope = roofline
    if n <= known[0]:  # a shorter pass costs no less per token than the smallest size measured
        return max(t[0] + slope * (n - known[0]), t[0] * n / known[0])
    if n >= known[-1]:  # and a longer one no more than the largest
        return min(t[-1] + slope * (n - known[-1]), t[-1] * n / known[-1])
    j = bisect_left(known, n)
    if known[j] == n:
        return t[j]
    x0, x1 = known[j - 1], known[j]
    return t[j - 1] + (t[j] - t[j - 1]) * (n - x0) / (x1 - x0)
