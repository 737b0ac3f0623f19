"""Hot/cold prediction of the next verify pass on every family: the default utility (spac)
against "used in the previous step" and Algorithm 1 as written (the paper, τ = 1, K = 4).

    python bench/sim_accuracy.py [--steps 60] [--recorded tiny.npz ...]

Target (issue 11): spac's accuracy ≥ previous step's + 0.03 on every family. Prints Markdown.
"""

from __future__ import annotations

import argparse
from pathlib import Path


from orchestrator.sim.experiments import hot_cold_accuracy
from orchestrator.sim.synthetic import FAMILIES, family_trace
from orchestrator.sim.trace import read_trace


def row(label, acceptance, gamma, trace) -> str:
    a = hot_cold_accuracy(trace)
    margin = a["spac accuracy"] - a["previous step accuracy"]
    cells = [a[k] for k in ("previous step accuracy", "spac accuracy", "spac precision", "spac recall",
                            "paper accuracy", "paper precision", "paper recall")]
    return (f"| {label} | {acceptance} | {gamma} | " + " | ".join(f"{x:.3f}" for x in cells)
            + f" | {margin:+.3f}{'' if margin >= 0.03 else ' ✗'} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--recorded", type=Path, action="append", default=[])
    args = ap.parse_args()
    print("| family | α | γ | previous step | spac | spac precision | spac recall | paper | paper precision "
          "| paper recall | spac − previous (≥ +0.03) |")
    print("|" + "---|" * 11)
    for fam in FAMILIES:
        for acceptance in (0.5, 0.75, 0.9):
            for gamma in (4, 8, 16):
                trace = family_trace(fam, args.steps, gamma=gamma, acceptance=acceptance)
                print(row(fam, acceptance, gamma, trace), flush=True)
    for path in args.recorded:
        trace = read_trace(path)
        label = f"{path.name} ({trace.model}, draft routing {'yes' if trace.has_draft_routing else 'no'})"
        print(row(label, "-", int(trace.n_drafted.max()), trace))


if __name__ == "__main__":
    main()
