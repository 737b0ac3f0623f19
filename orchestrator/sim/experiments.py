"""The paper's experiments (MoE-SpAc §4) in simulation: plain functions over a trace.

- `compare`: all policies side by side (Table 2 in spirit).
- `sweep_cache_ratio`: tokens/s against the expert cache ratio (Fig. 5 left).
- `sweep_k`: MoE-SpAc's tokens/s against the utility bound K (Fig. 5 right).
- `ablation`: MoE-SpAc with one component removed at a time (Table 4).
- `hot_cold_accuracy`: how well the paper's utilities, spac's and "used in the previous step"
  predict which experts the next step uses (Fig. 4: τ = 1, hot ⇔ utility ≥ τ).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np

from orchestrator.policies import POLICIES, make_policy
from orchestrator.policies.base import PolicyContext
from orchestrator.policies.default import LookaheadUtility
from orchestrator.policies.estimator import UtilityEstimator
from orchestrator.policies.spac import Ablations
from orchestrator.sim.simulator import SimConfig, SimResult, Simulator
from orchestrator.sim.trace import Trace

# Table 4's rows: MoE-SpAc, then each policy switch alone ("w/o SD" is a trace property)
ABLATIONS = {"MoE-SpAc": {}, **{f.metadata["label"]: {f.name: True} for f in fields(Ablations) if f.name != "no_sd"}}


@dataclass
class Skipped:
    policy: str
    reason: str


def runnable(trace: Trace, names) -> tuple[list[str], list[Skipped]]:
    """Split policy names into those that can replay `trace` and those that cannot (and why)."""
    ok, skipped = [], []
    for name in names:
        policy = make_policy(name)
        if policy.uses_draft_routing and not trace.has_draft_routing and not policy.draft_optional:
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
    return [sim.run(make_policy("moe-spac-paper", k_max=k), n_steps) for k in ks]


def ablation(trace: Trace, config: SimConfig, ar_trace: Trace | None = None, n_steps: int | None = None) -> list[tuple[str, SimResult]]:
    """Table 4; "w/o SD" replays `ar_trace` (the same routing model decoded autoregressively)."""
    sim = Simulator(trace, config)
    rows = [(label, sim.run(make_policy("moe-spac-paper", **kw), n_steps)) for label, kw in ABLATIONS.items()]
    if ar_trace is not None:
        ar = Simulator(ar_trace, replace(config, draft=None))
        rows.append(("w/o SD", ar.run(make_policy("moe-spac-paper"))))
    return rows


def hot_cold_accuracy(trace: Trace, k_max: int = 4, tau: int = 1, lam: float = 0.1, layer: int | None = None) -> dict[str, float]:
    """How well each predictor says, before verify pass t+1, which experts it will use.

    Predictors: "previous step" (hot ⇔ used in step t: the binary signal an autoregressive
    scheduler such as HybriMoE has, here given the whole verify pass); "paper" (MoE-SpAc's
    Algorithm 1, hot ⇔ utility ≥ τ, as in the paper's Fig. 4); "spac" (the default policy's
    learned utility, hot ⇔ p ≥ 1/2, with the draft's routing of the tokens it drafts for pass
    t+1 when the trace has it). For each: accuracy over (expert, step) pairs, precision and
    recall of "hot". Also the mean calibrated boundaries θ↑, θ↓ of Algorithm 1 at the end
    (the finding: they sink to 1). `layer`: one MoE layer (the paper plots its 47th), or all.
    """
    gamma = int(trace.n_drafted.max()) or 2
    est = UtilityEstimator(trace.n_layer, trace.n_expert, gamma=gamma, k_max=k_max, lam=lam)
    spac = LookaheadUtility()
    spac.reset(PolicyContext(trace.n_layer, trace.n_expert, trace.top_k, capacity=0, gamma=gamma))
    resident = np.zeros((trace.n_layer, trace.n_expert), dtype=bool)
    spac.plan(None, resident)
    rows = slice(None) if layer is None else slice(layer, layer + 1)
    tally = {k: np.zeros(4) for k in ("previous step", "paper", "spac")}  # right, tp, predicted hot, actual hot
    total = 0
    prev_hot = None
    for s, step in enumerate(trace.steps()):
        drafted = trace.draft_step(s)
        if drafted is not None:
            for j in range(len(drafted)):
                spac.draft_plan(drafted[: j + 1], resident)
        freq = step.frequency(trace.n_expert)
        used = freq[rows] > 0
        if prev_hot is not None:
            for name, hot in (("previous step", prev_hot), ("paper", est.utility[rows] >= tau), ("spac", spac.hot()[rows])):
                tally[name] += [(hot == used).sum(), (hot & used).sum(), hot.sum(), used.sum()]
            total += used.size
        est.update(freq)
        spac.plan(step, resident)
        prev_hot = used
    out = {}
    for name, (right, tp, pred, actual) in tally.items():
        out[f"{name} accuracy"] = right / total if total else float("nan")
        out[f"{name} precision"] = tp / pred if pred else float("nan")
        out[f"{name} recall"] = tp / actual if actual else float("nan")
    out["share used"] = tally["spac"][3] / total if total else float("nan")
    out["paper mean θ↑"] = float(est.theta_up[rows].mean())
    out["paper mean θ↓"] = float(est.theta_down[rows].mean())
    return out


def tokens_per_s(results) -> np.ndarray:
    return np.array([np.nan if r is None else r.tokens_per_s for r in results])
