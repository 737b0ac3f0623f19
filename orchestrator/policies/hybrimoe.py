"""HybriMoE-like hybrid scheduling (Zhong et al. 2025, as described in MoE-SpAc §5 / App. G).

Per layer, the simulator's "greedy" miss mode splits the experts that are not on the device
between the two sides with HybriMoE's two-ended greedy: experts sorted by token count, the
device takes from the hot end (copying the expert if needed), the host from the cold end,
each time the side that would finish earlier. The cache is score-aware (HybriMoE's "minus
recent score"): every pass, an expert's score becomes α·(routing weight it got in the pass) +
(1−α)·(old score), and the lowest score is evicted. Divided by α that is `ScoreBased` with
decay 1−α, which ranks the same, so this class is that with HybriMoE's miss mode.

Not modelled: HybriMoE's impact-driven prefetch of the next layer from its gate (a routing
trace has no gate logits to predict from). HybriMoE is not speculative; here it replays the
same speculative trace as every other policy, so it gets the same draft and verify batches.
"""

from __future__ import annotations

from orchestrator.policies.cache import ScoreBased


class HybriMoE(ScoreBased):
    name = "hybrimoe"

    def __init__(self, alpha: float = 0.5, miss: str = "greedy") -> None:
        super().__init__(miss=miss, per_layer=False, decay=1.0 - alpha)
        self.alpha = alpha
