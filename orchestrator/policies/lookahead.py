"""MoE-SpeQ-like expert lookahead (MoE-SpeQ §3.3): when the draft is itself an MoE (MoE-SpeQ's
quantised copy of the target), its routing of each drafted token predicts the experts the
verify pass will need. As the draft produces tokens, the experts it chose are prefetched,
layer by layer in execution order, into slots of experts it did not choose (least recently
used first); the verify pass fetches on demand whatever was mispredicted (GPU-centric).

Needs a trace with `draft_selected`. The simplification: MoE-SpeQ's three prefetch phases are
collapsed into one rule (prefetch each draft token's experts as soon as it is drafted).
"""

from __future__ import annotations

import numpy as np

from orchestrator.policies.base import Feedback, PolicyContext, keep_plan, order_rows
from orchestrator.policies.cache import LRU
from orchestrator.policies.plan import Plan, StepRouting


class MoESpeQLookahead(LRU):
    name = "moe-speq"
    uses_draft_routing = True
    per_layer = False

    def __init__(self, miss: str = "fetch") -> None:
        super().__init__(miss=miss, per_layer=False)

    def reset(self, ctx: PolicyContext) -> None:
        super().reset(ctx)
        self.predicted = np.zeros((ctx.n_layer, ctx.n_expert))

    def plan(self, routing: StepRouting | None, resident: np.ndarray, feedback: Feedback | None = None) -> Plan:
        self.predicted[...] = 0  # a new draft starts: nothing predicted yet, keep what is there
        return keep_plan(resident, prefetch=np.zeros((0, 2), dtype=np.int32),
                         evict=order_rows(self.rank, resident))

    def draft_plan(self, draft_selected: np.ndarray, resident: np.ndarray) -> Plan | None:
        n_tokens, n_layer, top_k = draft_selected.shape
        layer = np.broadcast_to(np.arange(n_layer)[None, :, None], draft_selected.shape)
        self.predicted[...] = 0
        np.add.at(self.predicted, (layer.ravel(), draft_selected.ravel().astype(np.intp)), 1)
        wanted = self.predicted > 0
        # layer order first (the verify pass needs layer 0 first), then how often predicted
        key = np.arange(n_layer)[:, None] * (n_tokens + 1) - self.predicted
        return keep_plan(wanted, prefetch=order_rows(key, wanted & ~resident),
                         evict=order_rows(self.rank, resident & ~wanted))

    def key(self) -> np.ndarray:
        # in-pass victims: experts the draft did not predict go first, least recently used first
        return np.where(self.predicted > 0, 1e18 + self.rank, self.rank)
