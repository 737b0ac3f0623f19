"""The default policy against every other policy and the limit, on every trace family.

    python bench/sim_policies.py [--steps 100] [--sweep-steps 60] [--recorded tiny.npz] [--quick]

For each hardware profile (RTX 4090 24 GB with a Qwen3-4B Q8_0 draft; RTX 4060 8 GB with a
Qwen3-0.6B Q8_0 draft, the 4B draft plus a pool not fitting in 8 GB), each family
(`orchestrator.sim.synthetic.FAMILIES`, acceptance 0.75, γ 8, MoE draft routing with per-expert
fidelity 0.9) and cache ratios 10 / 17 / 30 %: tokens/s of every policy, the default's ratio to
each, to the best baseline (every policy but the default, its own ranking with host misses
(spac/host) and belady, which sees the future), to
static + SD and to the limit (`orchestrator.sim.limit`, an upper bound). Then the default
against the best baseline and the limit over acceptance 0.5 / 0.75 / 0.9 × γ 4 / 8 / 16 at 17 %,
and on a recorded trace if one is given (`spac trace record`, simulated from its own GGUF and
its draft's).
Targets (issue 11): ≥ 1.05× best baseline, ≥ 0.92× limit, ≥ 1.42× static + SD.
Prints Markdown. Single process; run it under an exclusive lock for timings of its own run
time (the tokens/s it prints are simulated, not measured).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


from orchestrator.policies import DEFAULT, POLICIES, make_policy
from orchestrator.sim import profiles
from orchestrator.sim.limit import limit
from orchestrator.sim.simulator import SimConfig, Simulator
from orchestrator.sim.synthetic import FAMILIES, family_trace
from orchestrator.sim.trace import read_trace

HARDWARE = {"rtx4090": "qwen3-4b", "rtx4060": "qwen3-0.6b"}
RATIOS = (0.10, 0.17, 0.30)
NOT_BASELINES = {DEFAULT, "belady", "spac/host"}  # the default ranking itself; future knowledge
SWEEP_POLICIES = ("static", "lru/host", "score/host", "hybrimoe", "lookahead/host", "moe-spac-paper", DEFAULT)


def run_all(trace, config: SimConfig, names) -> tuple[dict[str, float], float, bool]:
    sim = Simulator(trace, config)
    out = {}
    fits = True
    for name in names:
        try:
            r = sim.run(make_policy(name))
        except ValueError:  # per-layer cache with fewer slots than layers
            continue
        out[name] = r.tokens_per_s
        fits = r.fits_vram
    return out, limit(trace, sim.capacity, sim.costs).tokens_per_s, fits


def summary(tps: dict[str, float], bound: float) -> dict:
    d = tps[DEFAULT]
    base = {k: v for k, v in tps.items() if k not in NOT_BASELINES}
    best = max(base, key=base.get)
    return {"default": d, "limit": bound, "best": best, "vs best": d / base[best], "vs limit": d / bound,
            "limit vs best": bound / base[best],
            "vs static": d / tps["static"] if "static" in tps else float("nan")}


def md(header, rows):
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print()


def ok(x, target):
    return f"{x:.2f}" + ("" if x >= target else " ✗")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--sweep-steps", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--recorded", type=Path, help="a trace from `spac trace record` (simulated from its GGUF)")
    ap.add_argument("--quick", action="store_true", help="main tables only, no acceptance × γ sweep")
    args = ap.parse_args()
    t0 = time.time()
    names = list(POLICIES)
    verdicts = []
    for hw, draft in HARDWARE.items():
        print(f"## {profiles.hardware(hw).name}, draft {draft} Q8_0\n")
        for fam in FAMILIES:
            trace = family_trace(fam, args.steps, gamma=8, acceptance=0.75, seed=args.seed)
            results = {}
            for ratio in RATIOS:
                cfg = SimConfig(hardware=hw, model=FAMILIES[fam].profile, draft=draft, cache_ratio=ratio)
                results[ratio] = run_all(trace, cfg, names)
            print(f"### {fam} (acceptance 0.75, γ 8, {trace.n_steps} steps): default ({DEFAULT}) tok/s ÷ each policy's\n")
            rows = []
            for name in names:
                cells = []
                for ratio in RATIOS:
                    tps = results[ratio][0]
                    cells.append(f"{tps[name]:.1f} ({tps[DEFAULT] / tps[name]:.2f})" if name in tps else "-")
                rows.append([name] + cells)
            rows.append(["**limit**"] + [f"{results[r][1]:.1f} ({results[r][0][DEFAULT] / results[r][1]:.2f})" for r in RATIOS])
            rows.append(["fits VRAM"] + ["yes" if results[r][2] else "NO" for r in RATIOS])
            md(["policy: tok/s (default ÷ it)"] + [f"{100 * r:.0f}%" for r in RATIOS], rows)
            for ratio in RATIOS:
                s = summary(*results[ratio][:2])
                verdicts.append([hw, fam, f"{100 * ratio:.0f}%", f"{s['default']:.1f}", s["best"], ok(s["vs best"], 1.05),
                                 ok(s["vs limit"], 0.92), ok(s["vs static"], 1.42), f"{s['limit vs best']:.2f}"])
    print("## Summary (acceptance 0.75, γ 8): default ÷ best baseline / limit / static+SD; ✗ = target missed\n")
    md(["hardware", "family", "cache", "default tok/s", "best baseline", "÷ best (≥1.05)", "÷ limit (≥0.92)",
        "÷ static (≥1.42)", "limit ÷ best (< 1.05: target out of reach)"], verdicts)

    if not args.quick:
        print(f"## Acceptance × γ at 17% ({args.sweep_steps} steps; baselines: {', '.join(SWEEP_POLICIES[:-1])})\n")
        rows = []
        for hw, draft in HARDWARE.items():
            for fam in FAMILIES:
                for acc in (0.5, 0.75, 0.9):
                    for gamma in (4, 8, 16):
                        trace = family_trace(fam, args.sweep_steps, gamma=gamma, acceptance=acc, seed=args.seed)
                        cfg = SimConfig(hardware=hw, model=FAMILIES[fam].profile, draft=draft, cache_ratio=0.17)
                        tps, bound, _ = run_all(trace, cfg, SWEEP_POLICIES)
                        s = summary(tps, bound)
                        rows.append([hw, fam, f"{acc}", f"{gamma}", f"{s['default']:.1f}", s["best"],
                                     ok(s["vs best"], 1.05), ok(s["vs limit"], 0.92), ok(s["vs static"], 1.42),
                                     f"{s['limit vs best']:.2f}"])
        md(["hardware", "family", "α", "γ", "default tok/s", "best baseline", "÷ best", "÷ limit", "÷ static",
            "limit ÷ best"], rows)

    if args.recorded is not None:
        trace = read_trace(args.recorded)
        profile, quant = profiles.from_gguf(trace.meta["gguf"])
        key = profiles.register(profile)
        draft_profile, draft_quant = profiles.from_gguf(trace.meta["draft_gguf"], draft=True)
        own_draft = profiles.register(draft_profile)
        print(f"## Recorded trace {args.recorded.name}: {trace.model}, {trace.n_steps} steps, "
              f"draft routing {'yes' if trace.has_draft_routing else 'no'}; experts {quant}\n")
        rows = []
        for hw in HARDWARE:
            for ratio in RATIOS:
                cfg = SimConfig(hardware=hw, model=key, draft=own_draft, cache_ratio=ratio, quant=quant,
                                draft_quant=draft_quant)
                tps, bound, _ = run_all(trace, cfg, names)
                s = summary(tps, bound)
                rows.append([hw, f"{100 * ratio:.0f}%", f"{s['default']:.1f}", s["best"], ok(s["vs best"], 1.05),
                             ok(s["vs limit"], 0.92), ok(s["vs static"], 1.42), f"{s['limit vs best']:.2f}"])
        md(["hardware", "cache", "default tok/s", "best baseline", "÷ best", "÷ limit", "÷ static", "limit ÷ best"], rows)
    print(f"({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
