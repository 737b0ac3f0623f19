"""The paper's experiments (seed 004 §4) in simulation: plain functions over a trace.

- `compare`: all policies side by side (Table 2 in spirit).
- `sweep_cache_ratio`: tokens/s against the expert cache ratio (Fig. 5 left).
- `sweep_k`: MoE-SpAc's tokens/s against the utility bound K (Fig. 5 right).
- `ablation`: MoE-SpAc with one component removed at a time (Table 4).
- `hot_cold_accuracy`: how well a step's utilities predict which experts the next step uses
  (Fig. 4: τ = 1, hot ⇔ utility ≥ τ, compared with "used in the previous step").
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from orchestrator.estimator import UtilityEstimator
from orchestrator.policies import POLICIES, make_policy
from orchestrator.sim.simulator import SimConfig, SimResult, Simulator
from orchestrator.sim.trace import Trace

ABLATIONS = {
    "MoE-SpAc": {},
    "w/o SpecUE": dict(no_utility=True),
    "w/o AdaBC": dict(no_adabc=True),
    "w/o HetWB": dict(no_balancer=True),
    "w/o SG-Prefetcher": dict(no_prefetch=True),
    "w/o SG-Evictor": dict(no_evict=True),
}


@dataclass
class Skipped:
    policy: str
    reason: str


def runnable(trace: Trace, names) -> tuple[list[str], list[Skipped]]:
    """Split policy names into those that can replay `trace` and those that cannot (and why)."""
    ok, skipped = [], []
    for name in names:
        policy = make_policy(name)
        if policy.uses_draft_routing and not trace.has_draft_routing:
            skipped.append(Skipped(name, "needs the draft's routing (an MoE draft); the trace has none"))
        else:
            ok.append(name)
    return ok, skipped


def compare(trace: Trace, config: SimConfig, names=None, n_steps: int | None = None) -> tuple[list[SimResult], list[Skipped]]:
    names, skipped = runnable(trace, list(POLICIES) if names is None else names)
    sim = Simulator(trace, config)
    results = []
    for name in names:
        try:
            results.append(sim.run(make_policy(name), n_steps))
        except ValueError as e:  # e.g. a per-layer cache with fewer slots than layers
            skipped.append(Skipped(name, str(e)))
    return results, skipped


def sweep_cache_ratio(trace: Trace, config: SimConfig, names, ratios, n_steps: int | None = None) -> dict[str, list[SimResult | None]]:
    names, _ = runnable(trace, names)
    out: dict[str, list[SimResult | None]] = {name: [] for name in names}
    for ratio in ratios:
        sim = Simulator(trace, replace(config, cache_ratio=ratio, capacity=None))
        for name in names:
            try:
                out[name].append(sim.run(make_policy(name), n_steps))
            except ValueError:
                out[name].append(None)
    return out


def sweep_k(trace: Trace, config: SimConfig, ks=range(1, 9), n_steps: int | None = None) -> list[SimResult]:
    sim = Simulator(trace, config)
    return [sim.run(make_policy("moe-spac", k_max=k), n_steps) for k in ks]


def ablation(trace: Trace, config: SimConfig, ar_trace: Trace | None = None, n_steps: int | None = None) -> list[tuple[str, SimResult]]:
    """Table 4; "w/o SD" replays `ar_trace` (the same routing model decoded autoregressively)."""
    sim = Simulator(trace, config)
    rows = [(label, sim.run(make_policy("moe-spac", **kw), n_steps)) for label, kw in ABLATIONS.items()]
    if ar_trace is not None:
        ar = Simulator(ar_trace, replace(config, draft=None))
        rows.append(("w/o SD", ar.run(make_policy("moe-spac"))))
    return rows


def hot_cold_accuracy(trace: Trace, k_max: int = 4, tau: int = 1, lam: float = 0.1, layer: int | None = None) -> dict[str, float]:
    """Share of (expert, step) pairs whose hot/cold prediction for step t+1 was right.

    estimator: hot ⇔ utility ≥ τ after step t (Algorithm 1); previous step: hot ⇔ used in
    step t (the binary signal an autoregressive scheduler such as HybriMoE has, here given
    the whole verify pass). Also precision and recall of "hot" for the estimator. `layer`:
    one MoE layer (the paper plots its 47th), or all layers.
    """
    gamma = int(trace.n_drafted.max()) or 2
    est = UtilityEstimator(trace.n_layer, trace.n_expert, gamma=gamma, k_max=k_max, lam=lam)
    rows = slice(None) if layer is None else slice(layer, layer + 1)
    right_est = right_prev = tp = pred_hot = actual_hot = total = 0
    prev_hot = None
    for step in trace.steps():
        used = step.frequency(trace.n_expert)[rows] > 0
        if prev_hot is not None:
            hot = est.utility[rows] >= tau
            right_est += int((hot == used).sum())
            right_prev += int((prev_hot == used).sum())
            tp += int((hot & used).sum())
            pred_hot += int(hot.sum())
            actual_hot += int(used.sum())
            total += used.size
        est.update(step.frequency(trace.n_expert))
        prev_hot = used
    return {
        "estimator accuracy": right_est / total,
        "previous-step accuracy": right_prev / total,
        "estimator precision": tp / pred_hot if pred_hot else float("nan"),
        "estimator recall": tp / actual_hot if actual_hot else float("nan"),
        "share used": actual_hot / total,
    }


def tokens_per_s(results) -> np.ndarray:
    return np.array([np.nan if r is None else r.tokens_per_s for r in results])
