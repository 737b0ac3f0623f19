"""MoE-SpAc §3: Speculative Utility Estimator + Heterogeneous Workload Balancer → Plan.

After each verify pass: f_t → utilities s_{t+1} (`orchestrator.policies.estimator.UtilityEstimator`,
Algorithm 1) → τ per layer (`orchestrator.policies.balancer.WorkloadBalancer`, Eq. 9–12) → a plan
wanting the experts with utility ≥ τ. The execution engine's rules (prefetch from utility K
down to τ, FIFO by layer inside a level; evict the lowest utility first, only below τ) are
the default plan semantics of `orchestrator.policies.base`, so the plan carries no lists.
Misses are computed on the host.

Unit costs for Eq. 9–11 come from the executor's `Feedback` (the engine's statistics or the
simulator's), smoothed by an exponential moving average; the first plan uses the warm-up
calibration the executor passes in. VRAM_left of a layer (Eq. 11) is its share of the pool,
capacity / L, less the resident experts it keeps at the previous threshold.

Ablations of Table 4 (constructor flags): no_utility (binary utility, K = 1), no_adabc (fixed
boundaries θ↑ = 3, θ↓ = 1), no_balancer (τ = 2 everywhere), no_prefetch (static allocation:
the most used experts of the first step, up to each layer's share, never updated), no_evict
(keep experts until the pool is full: `evicts = False`, the engine's no_evict). "w/o SD" is a trace property
(replay an autoregressive trace).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from orchestrator.policies.balancer import FIXED_THRESHOLD, UnitCosts, WorkloadBalancer
from orchestrator.policies.base import Feedback, Policy, PolicyContext, top_per_device
from orchestrator.policies.estimator import UtilityEstimator
from orchestrator.policies.plan import Plan, StepRouting


def _switch(label: str, help: str):
    return field(default=False, metadata={"label": label, "help": help})


@dataclass(frozen=True)
class Ablations:
    """The paper's Table 4 switches, defined once: each field's metadata gives the row label of
    the simulator's ablation table and the help of the CLI flag (`--no-utility`, ...). All but
    `no_sd` are MoESpAc constructor flags; `no_sd` is a decoding switch (in the simulator, a
    trace property: replay an autoregressive trace)."""

    no_utility: bool = _switch("w/o SpecUE", "binary utility (K = 1)")
    no_adabc: bool = _switch("w/o AdaBC", "fixed boundaries θ↑=3, θ↓=1")
    no_balancer: bool = _switch("w/o HetWB", "fixed τ = 2")
    no_prefetch: bool = _switch("w/o SG-Prefetcher", "static expert placement")
    no_evict: bool = _switch("w/o SG-Evictor", "keep experts until the pool is full")
    no_sd: bool = _switch("w/o SD", "autoregressive decoding on the same engine")

    def names(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name)]

    def policy_flags(self) -> dict[str, bool]:
        """The MoESpAc constructor flags (every switch but no_sd)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "no_sd"}


class MoESpAc(Policy):
    name = "moe-spac"
    miss = "cpu"

    def __init__(
        self,
        k_max: int = 4,
        lam: float = 0.1,
        cost_decay: float = 0.2,
        no_utility: bool = False,
        no_adabc: bool = False,
        no_balancer: bool = False,
        no_prefetch: bool = False,
        no_evict: bool = False,
    ) -> None:
        self.k_max, self.lam, self.cost_decay = k_max, lam, cost_decay
        self.no_utility, self.no_adabc, self.no_balancer = no_utility, no_adabc, no_balancer
        self.no_prefetch, self.no_evict = no_prefetch, no_evict
        self.evicts = not no_evict

    def reset(self, ctx: PolicyContext) -> None:
        super().reset(ctx)
        # autoregressive steps (γ = 0) have f ∈ {0, 1}: boundaries ⌊2/2⌋ = 1 react to one step
        self.estimator = UtilityEstimator(ctx.n_layer, ctx.n_expert, gamma=ctx.gamma or 2, k_max=self.k_max,
                                          lam=self.lam, adaptive=not self.no_adabc, binary=self.no_utility)
        self.balancer = WorkloadBalancer(ctx.n_layer, ctx.n_expert, ctx.top_k, k_max=self.estimator.k_max,
                                         fixed_threshold=FIXED_THRESHOLD if self.no_balancer else None)
        self.threshold = np.full(ctx.n_layer, self.estimator.k_max, dtype=np.int32)
        # each layer's share of its device's slots (one device: capacity / L everywhere)
        self.slots_per_layer = np.zeros(ctx.n_layer)
        for first, end, slots in ctx.device_spans():
            self.slots_per_layer[first:end] = slots / max(end - first, 1)
        self.costs: UnitCosts | None = None
        self.static: Plan | None = None

    @property
    def utility(self) -> np.ndarray:
        return self.estimator.utility

    def plan(self, routing: StepRouting | None, resident: np.ndarray, feedback: Feedback | None = None) -> Plan:
        ctx = self.ctx
        if feedback is not None:
            self._measure(feedback)
        if routing is None:  # before the first step nothing is known: nothing is hot
            return Plan(utility=np.zeros((ctx.n_layer, ctx.n_expert), dtype=np.uint8), threshold=self.threshold.copy())
        freq = routing.frequency(ctx.n_expert)
        if self.no_prefetch:
            if self.static is None:
                keep = top_per_device(np.where(freq > 0, freq, -np.inf).astype(np.float64), ctx, per_layer=True)
                self.static = Plan(utility=keep.astype(np.uint8), threshold=np.ones(ctx.n_layer, dtype=np.int32))
            return self.static
        utility = self.estimator.update(freq)
        kept = (resident & (utility >= self.threshold[:, None])).sum(axis=1)
        self.costs.vram_left = self.costs.expert_bytes * np.maximum(self.slots_per_layer - kept, 0.0)
        self.threshold = self.balancer.update(freq, utility, resident, self.costs, routing.n_drafted)
        return Plan(utility=utility.astype(np.uint8), threshold=self.threshold.copy())

    def _measure(self, fb: Feedback) -> None:
        """Fold one step's measurements into the unit costs (EMA; NaN: no sample this step)."""
        fresh = dict(t_cpu_unit=fb.t_cpu_unit, t_gpu_unit=fb.t_gpu_unit, t_io_unit=fb.t_io_unit,
                     t_draft_token=fb.t_draft_token, t_total=np.asarray(fb.t_layer, dtype=np.float64))
        if self.costs is None:
            self.costs = UnitCosts(expert_bytes=fb.expert_bytes, vram_left=0.0,
                                   **{k: np.nan_to_num(v, nan=0.0) for k, v in fresh.items()})
            return
        a = self.cost_decay
        for name, value in fresh.items():
            old = getattr(self.costs, name)
            new = np.where(np.isnan(value), old, (1.0 - a) * old + a * value)
            setattr(self.costs, name, float(new) if np.ndim(new) == 0 else new)
