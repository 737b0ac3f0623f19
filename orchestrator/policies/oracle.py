"""Belady with full knowledge of the future routing (a ranking, not the limit on tokens/s:
that is `orchestrator.sim.limit`, which also optimises split and miss rule per layer).

Before each pass the pool holds the `capacity` experts that the coming pass uses most (token
count), so no policy can have more token-weighted hits in any pass; remaining slots (and
ties) keep the experts needed soonest afterwards, and eviction takes the expert whose next use
is farthest away (Belady). Prefetch is perfect in content; in time the simulator makes the
pass wait until the copies are done (`wait_for_prefetch`), so its step time stays honest.
Host computes whatever is not resident.
"""

from __future__ import annotations

import numpy as np

from orchestrator.policies.base import Feedback, Policy, PolicyContext, ranked_plan
from orchestrator.policies.plan import Plan, StepRouting

NEVER = 1 << 30


class Oracle(Policy):
    name = "belady"
    miss = "cpu"
    needs_future = True
    wait_for_prefetch = True

    def __init__(self, horizon: int = 256) -> None:
        self.horizon = horizon

    def reset(self, ctx: PolicyContext) -> None:
        if ctx.future is None:
            raise ValueError("the oracle needs the future routing (PolicyContext.future)")
        super().reset(ctx)
        self.freq = np.stack([r.frequency(ctx.n_expert) for r in ctx.future]) if len(ctx.future) else None
        self.next_step = 0

    def plan(self, routing: StepRouting | None, resident: np.ndarray, feedback: Feedback | None = None) -> Plan:
        step = self.next_step
        self.next_step += 1
        n_steps = 0 if self.freq is None else len(self.freq)
        if step >= n_steps:
            return ranked_plan(np.full(resident.shape, -np.inf), self.ctx.capacity, resident)
        distance = np.full(resident.shape, NEVER, dtype=np.int64)  # steps until next use after `step`
        for d, f in enumerate(self.freq[step + 1: step + 1 + self.horizon], start=1):
            distance = np.where((distance == NEVER) & (f > 0), d, distance)
        counts = self.freq[step].astype(np.float64)
        # needed now: by count (then sooner next use); not needed now: by next use
        score = np.where(counts > 0, counts * 1e9 - distance, -distance.astype(np.float64))
        score[(counts == 0) & (distance == NEVER)] = -np.inf
        return ranked_plan(score, self.ctx.capacity, resident)
