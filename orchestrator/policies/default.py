"""spac's default policy: a learned utility from the verify pass and the draft's own routing.

Why not Algorithm 1 (MoE-SpAc §3.2) as written: its boundaries are floored integers calibrated
towards |Δ|, and with γ+1 ≤ 17 verified tokens most Δ are 0 or ±1, so θ↑ and θ↓ sink to 1
within a few steps (`spac sim accuracy` prints their mean): from then on any change moves the
utility, the state machine only lags "used in the previous step", and it predicts the next
step worse than that binary signal does.

What the default uses instead, per (layer, expert), before each verify pass:

    c   tokens of the last verify pass that chose it (0, 1, 2, 3+)       verify-pass frequency
    r   an exponential average of "used" over past passes (4 buckets)    recency
    w   its routing weight share in the last pass (high / low)           routing weight
    d   tokens of the current draft that chose it (0, 1, 2, 3+)          the draft's lookahead

The draft (the target's quantised self-draft, an MoE with the same experts) routes γ of the
γ+1 tokens the next verify pass will route: its choices are a lookahead (MoE-SpeQ §3.3)
fused here with the verify-pass statistics of MoE-SpAc. Rather than fixing weights for these
features, the utility is learned online: a table over the feature cells counts, step after
step, how often an expert in that cell was used by the following verify pass, and the utility
is that empirical probability p (Beta(1, 1) prior). No constant is tuned to a model or trace.

Plan: want the `capacity` experts of highest p (global, not per layer: a layer whose routing is
spread needs more slots; with a pool over several devices, per device among its own layers),
prefetch in p order, evict lowest p first. The first plan fills the
pool, and free slots are always filled. Copies that evict are issued only as far as the link
can finish them before the verify pass starts (measured copy and draft times from `Feedback`;
each device's link on its own)
where copies would delay the pass (`Feedback.copies_block_device`: an RPC
server copies on its compute thread); a GPU copies while it computes, so there every wanted
expert is issued at once (`paced="auto"`; an H100 run that paced filled 116 of 256 slots in 27
verify steps and hit 0.25 where static placement hit 0.53). Without a draft (autoregressive)
there is nothing to hide a copy behind, so where copies block the device only free slots are
filled after the first plan. Each draft token refreshes d and the plan, so prefetch runs while
the draft drafts. Misses follow the miss rule (default "greedy": a missing expert is copied in
the pass when that finishes sooner than the host would, else computed on the host). Hot/cold for
`spac sim accuracy`: hot ⇔ p ≥ 1/2.
"""

from __future__ import annotations

import numpy as np

from orchestrator.policies.base import (Feedback, Policy, PolicyContext, layer_usage, order_rows, smallest_rows,
                                        top_per_device)
from orchestrator.policies.plan import Plan, StepRouting

N_C, N_R, N_W, N_D = 4, 4, 2, 4


class LookaheadUtility(Policy):
    name = "spac"
    uses_draft_routing = True
    draft_optional = True  # without the draft's routing (dense draft) d stays 0

    def __init__(self, miss: str = "greedy", recency: float = 0.5, lookahead: bool = True,
                 paced: bool | str = "auto") -> None:
        self.miss, self.recency, self.lookahead, self.paced = miss, recency, lookahead, paced
        self.free_slots: tuple[int, ...] = (0,)  # per pool device
        self.uses_draft_routing = lookahead

    def reset(self, ctx: PolicyContext) -> None:
        super().reset(ctx)
        shape = (ctx.n_layer, ctx.n_expert)
        self.count = np.zeros(shape, dtype=np.int64)
        self.avg = np.zeros(shape)
        self.weight_high = np.zeros(shape, dtype=np.int64)
        self.drafted = np.zeros(shape, dtype=np.int64)
        self.used_table = np.ones(N_C * N_R * N_W * N_D)     # Beta(1, 1)
        self.seen_table = np.full(N_C * N_R * N_W * N_D, 2.0)
        self.p = np.zeros(shape)
        self.t_io = np.zeros(len(ctx.device_spans()))  # per device: copy time per expert
        self.t_draft = 0.0
        self.copies_block = (True,) * len(ctx.device_spans())  # per device: its copies delay its passes
        self.gamma = ctx.gamma
        self.link_free = np.zeros(len(ctx.device_spans()))  # per device: when the copies issued so far
                                                              # finish, relative to the plan after the pass
        self.elapsed = 0.0

    # ---- the utility -------------------------------------------------------------------
    def cells(self) -> np.ndarray:
        r = np.minimum((self.avg * N_R).astype(np.int64), N_R - 1)
        return (((np.minimum(self.count, N_C - 1) * N_R + r) * N_W + self.weight_high) * N_D
                + np.minimum(self.drafted, N_D - 1))

    def probability(self) -> np.ndarray:
        return (self.used_table / self.seen_table)[self.cells()]

    def hot(self) -> np.ndarray:
        return self.p >= 0.5

    @property
    def utility(self) -> np.ndarray:
        return self.p

    def learn(self, used: np.ndarray) -> None:
        """The verify pass that the current features predicted has run: count the outcome."""
        cells = self.cells().ravel()
        n = len(self.seen_table)
        self.seen_table += np.bincount(cells, minlength=n)
        self.used_table += np.bincount(cells, weights=used.ravel(), minlength=n)

    def observe_pass(self, routing: StepRouting) -> None:
        counts, weights = layer_usage(routing, self.ctx.n_expert)
        used = counts > 0
        self.learn(used)
        share = weights / np.maximum(counts.sum(axis=1, keepdims=True), 1)  # mean weight per token
        self.count = counts.astype(np.int64)
        self.weight_high = (share * self.ctx.n_expert / self.ctx.top_k > 1.0).astype(np.int64)
        self.avg = self.recency * self.avg + (1.0 - self.recency) * used
        self.drafted[...] = 0

    # ---- the plan ----------------------------------------------------------------------
    def plan(self, routing: StepRouting | None, resident: np.ndarray, feedback: Feedback | None = None) -> Plan:
        if feedback is not None:
            # a step without copies (or without drafting) measures nothing: keep the last value,
            # else pacing would switch itself off on every such step
            n_dev = len(self.link_free)
            t_io = feedback.t_io_per_device or (feedback.t_io_unit,) * n_dev
            self.t_io = np.array([new if new > 0 else old for new, old in zip(t_io, self.t_io)])
            if feedback.t_draft_token > 0:
                self.t_draft = feedback.t_draft_token
            self.copies_block = feedback.copies_block_per_device or (feedback.copies_block_device,) * n_dev
            self.free_slots = feedback.free_slots_per_device or (feedback.free_slots,)
        if routing is not None:
            self.observe_pass(routing)
            self.gamma = routing.n_drafted or self.gamma
        self.link_free[:] = 0.0
        self.elapsed = 0.0
        # copies run while the draft drafts; the first plan fills the pool before decoding starts
        return self._plan(resident, tokens_left=self.gamma, filling=routing is None)

    def draft_plan(self, draft_selected: np.ndarray, resident: np.ndarray) -> Plan | None:
        n = len(draft_selected)
        last = draft_selected[-1].astype(np.intp)  # [n_layer, top_k]: the newest draft token
        np.add.at(self.drafted, (np.arange(self.ctx.n_layer)[:, None], last), 1)
        self.elapsed = n * self.t_draft
        return self._plan(resident, tokens_left=max(self.gamma - n, 0))

    def _plan(self, resident: np.ndarray, tokens_left: int, filling: bool = False) -> Plan:
        self.p = self.probability()
        score = self.p + 1e-3 * self.avg  # ties: the more recently used
        wanted = top_per_device(score, self.ctx)
        prefetch = order_rows(-score, wanted & ~resident)
        if not filling:  # each device's link on its own
            prefetch = np.concatenate([self._paced(d, prefetch[(prefetch[:, 0] >= first) & (prefetch[:, 0] < end)],
                                                   tokens_left)
                                       for d, (first, end, _) in enumerate(self.ctx.device_spans())])
        evict = order_rows(score, resident & ~wanted)
        return Plan(utility=wanted.astype(np.uint8), threshold=np.ones(self.ctx.n_layer, dtype=np.int32),
                    prefetch=prefetch, evict=evict)

    def _paced(self, device: int, prefetch: np.ndarray, tokens_left: int) -> np.ndarray:
        """The part of one device's prefetch list to issue now, where copies delay its passes."""
        paced = self.copies_block[device] if self.paced == "auto" else self.paced
        t_io = self.t_io[device]
        if not paced or (self.gamma > 0 and not (t_io > 0 and self.t_draft > 0)):
            return prefetch
        free = max(self.free_slots[device] if device < len(self.free_slots) else 0, 0)
        if self.gamma == 0:
            # no draft to hide a copy behind: where the device copies on the thread that computes,
            # every copy holds up a pass (RPC device, autoregressive: 7.9 tok/s swapping experts
            # against 10.4 for a pool that stays as filled), so only free slots are still filled
            # (a new plan drops the first plan's copies that had not started)
            return prefetch[:free]
        # issue only what the link finishes before the verify pass starts; free slots are
        # filled whatever the window (once: the pool then stays full), else a draft faster
        # than one copy would never fill it (RPC device: 8 drafts took 2.2 ms, a copy 4 ms)
        start = max(self.elapsed, self.link_free[device])
        budget = int(max(tokens_left * self.t_draft - (start - self.elapsed), 0.0) // t_io)
        prefetch = prefetch[:max(budget, free)]
        self.link_free[device] = start + len(prefetch) * t_io
        return prefetch

    def victims(self, allocated: np.ndarray, protected: np.ndarray, layer: int, n: int) -> np.ndarray:
        """In-pass copies ("greedy"/"fetch"): give up a slot of a layer this pass has already
        computed first (it can be copied back while the next draft drafts), lowest p first;
        an expert of a layer still to come only after those (evicting it risks a miss now)."""
        ahead = np.arange(self.ctx.n_layer)[:, None] > layer
        return smallest_rows(self.p + 2.0 * ahead, self._victim_scope(allocated, protected, layer), n)
