"""SpecMoE-like hot set (SpecMoE §III-B): after each verify pass, the N experts of each layer that the
pass used most are pinned on the device (SpecMoE's draft experts, chosen by temporal hotness);
the verification fetches any other expert on demand into the rest of the pool, and those
transient experts are the first to give their slot back.

N = `hot_fraction` of the per-layer share of the pool (the rest is the staging area for
on-demand copies). Ties in hotness keep the expert that is already pinned.
"""

from __future__ import annotations

import numpy as np

from orchestrator.policies.base import Feedback, Policy, PolicyContext, keep_plan, order_rows, smallest_rows
from orchestrator.policies.plan import Plan, StepRouting


class SpecMoEHotSet(Policy):
    name = "specmoe"
    miss = "fetch"

    def __init__(self, hot_fraction: float = 0.75) -> None:
        self.hot_fraction = hot_fraction

    def reset(self, ctx: PolicyContext) -> None:
        super().reset(ctx)
        self.n_hot = max(1, int(self.hot_fraction * ctx.capacity / ctx.n_layer))
        self.hot = np.zeros((ctx.n_layer, ctx.n_expert), dtype=bool)
        self.clock = 0
        self.last_use = np.full((ctx.n_layer, ctx.n_expert), -np.inf)
        self.counts = np.zeros((ctx.n_layer, ctx.n_expert))

    def on_layer(self, layer: int, counts: np.ndarray, weights: np.ndarray) -> None:
        self.clock += 1
        self.last_use[layer, counts > 0] = self.clock
        self.counts[layer] = counts

    def plan(self, routing: StepRouting | None, resident: np.ndarray, feedback: Feedback | None = None) -> Plan:
        if routing is not None:
            # hotness of this pass, pinned experts win ties
            key = self.counts + 0.5 * self.hot
            order = np.argsort(-key, axis=1, kind="stable")[:, : self.n_hot]
            self.hot = np.zeros_like(self.hot)
            np.put_along_axis(self.hot, order, True, axis=1)
            self.hot &= self.counts > 0
        return keep_plan(self.hot, evict=order_rows(self.last_use, resident & ~self.hot))

    def victims(self, allocated: np.ndarray, protected: np.ndarray, layer: int, n: int) -> np.ndarray:
        rank = np.where(self.hot, 1e18 + self.counts, self.last_use)  # transient (LRU) first, then coldest pinned
        return smallest_rows(rank, allocated & ~protected, n)
