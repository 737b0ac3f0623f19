"""Numbers for the simulator issue's note: synthetic Qwen3-30B-A3B trace, RTX 4090 profile,
17% expert cache, every policy side by side, plus the estimator's hot/cold accuracy.

    .venv/bin/python bench/sim_issue_note.py [--steps 400] [--seed 0] [--draft qwen3-4b]

Prints a Markdown table (a few minutes: the on-demand-fetch baselines evict one expert at a time).
"""

from __future__ import annotations

import argparse
import time


from orchestrator.policies import POLICIES
from orchestrator.sim.experiments import compare, hot_cold_accuracy
from orchestrator.sim.simulator import SimConfig
from orchestrator.sim.synthetic import synthesize_trace


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hardware", default="rtx4090")
    ap.add_argument("--draft", default="qwen3-4b")
    ap.add_argument("--cache-ratio", type=float, default=0.17)
    ap.add_argument("--visibility", default="pass")
    ap.add_argument("--quant", default="Q4_K")
    ap.add_argument("--policy", "-p", action="append")
    args = ap.parse_args()

    t0 = time.time()
    trace = synthesize_trace(args.steps, seed=args.seed)
    config = SimConfig(hardware=args.hardware, draft=None if args.draft == "none" else args.draft,
                       cache_ratio=args.cache_ratio, visibility=args.visibility, quant=args.quant)
    results, skipped = compare(trace, config, args.policy or list(POLICIES))
    print(f"trace: {trace.n_steps} steps, {trace.n_generated} tokens, mean accepted {trace.n_accepted.mean():.2f}; "
          f"{config}\n")
    cols = list(results[0].row())
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        print("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in r.row().values()) + " |")
    for s in skipped:
        print(f"skipped {s.policy}: {s.reason}")
    print()
    for label, layer in (("all layers", None), (f"layer {trace.n_layer - 1}", trace.n_layer - 1)):
        acc = hot_cold_accuracy(trace, tau=1, layer=layer)
        print(f"hot/cold (τ=1, K=4), {label}: " + ", ".join(f"{k} {v:.3f}" for k, v in acc.items()))
    print(f"\n({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
