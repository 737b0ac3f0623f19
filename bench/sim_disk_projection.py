"""Simulated projection for models larger than the host RAM (docs/simulator.md, "Models larger
than RAM"): spac's host tier with reads ahead against llama.cpp's mmap, on desktops with 32 and
64 GB of RAM, an 8, 12 or 24 GB card and a 3.5 or 7 GB/s NVMe SSD.

    .venv/bin/python bench/sim_disk_projection.py [--steps 60] [--model KEY ...] [--card KEY ...] [--ablations]
                                                  [--json FILE]

Setting: bench/sim_gpu_projection.py's (synthetic traces with Qwen3-30B-A3B's dynamics in each
model's shape, acceptance 0.75, a dense Qwen3-0.6B Q8_0 draft, the pool each card leaves, tok/s
over the last two thirds of the steps), speculative rows at the best γ of 2 and 4, and a host
RAM of the desktop's less 4 GiB for the OS and the desktop (an assumption); of what is left the
non-expert weights, the draft, the KV caches and 1 GiB come first, the experts that do not fit
stay on the disk (orchestrator/sim/host_tier.py). Systems:
- spac: the default policy (`spac`: greedy misses, the draft's lookahead) over the live host
  tier's rule: ranked by decayed use counts, exclusive of the device pool, reading ahead after
  each verify pass what ranks in and was chosen lately at least twice as often as uniform routing
  would (orchestrator/sim/host_tier.py, RankedTier).
- llama.cpp's mmap without its GPU expert cache (`static`, --n-cpu-moe) and with it
  (`llama-moe-cache`): the page cache an LRU of the same RAM, experts faulted in when touched.
--ablations: two more spac columns, the tier inclusive of the device pool (the earlier design)
and ranked by the policy's scores instead of the counts.
--json FILE: one object per row, {"card", "ram_gb", "disk_gbps", "model", "tok_s": {SYSTEM: {"ar":
tok/s, "sd": tok/s}}}, SYSTEM `spac` or llama.cpp's (`llama-...`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from orchestrator.sim import profiles
from sim_gpu_projection import MULTI_MODELS, best_row, card_name

CARDS = ("rtx4060", "rtx3060", "rtx4090")          # 8, 12 and 24 GB
RAM_GB = (32, 64)
DISKS = ("nvme-pcie3", "nvme-pcie4")
OS_RESERVE = 4 << 30                                 # assumption: the OS and the desktop's share of the RAM
SYSTEMS = {"spac": "spac", "static": "llama-mmap", "llama-moe-cache": "llama-mmap-moe-cache"}
SD_GAMMAS = (2, 4)
ABLATIONS = {"inclusive": dict(host_exclusive=False), "utility": dict(host_rank="utility")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", action="append", help="only this model profile's rows (repeatable)")
    ap.add_argument("--card", action="append", help=f"only this card's rows (repeatable; {', '.join(CARDS)})")
    ap.add_argument("--ablations", action="store_true", help="also spac with the inclusive tier and the utility ranking")
    ap.add_argument("--json", type=Path, help="write the rows as JSON to this file")
    args = ap.parse_args()
    models = {k: v for k, v in MULTI_MODELS.items() if not args.model or k in args.model}
    cards = [c for c in CARDS if not args.card or c in args.card]
    ablations = ABLATIONS if args.ablations else {}
    print("| model | RAM | card | disk | host tier (experts) | " + " | ".join(f"{s} | + spec." for s in SYSTEMS.values())
          + "".join(f" | spac, {a} tier | + spec." for a in ablations)
          + " | spac ÷ best llama.cpp | + spec. ÷ + spec. | GB read per token (spac + spec. / llama-mmap + spec.) |")
    print("|---|---|---|---|---|" + "---|---|" * (len(SYSTEMS) + len(ablations)) + "---|---|---|")
    out = []
    for model, quant in models.items():
        for ram in RAM_GB:
            for card in cards:
                for disk in DISKS:
                    config = dict(host_ram=ram * 1e9 - OS_RESERVE, disk=disk)
                    cells = {(p, sd): best_row(card, model, quant, sd, p, args.steps, args.seed, SD_GAMMAS, **config)
                             for p in SYSTEMS for sd in (False, True)}
                    extra = {(a, sd): best_row(card, model, quant, sd, "spac", args.steps, args.seed, SD_GAMMAS,
                                               **config, **ablation)
                             for a, ablation in ablations.items() for sd in (False, True)}
                    tok = {name: {"ar": cells[(p, False)]["tok_s"], "sd": cells[(p, True)]["tok_s"]}
                           for p, name in SYSTEMS.items()}
                    llama = {k: max(v[k] for n, v in tok.items() if n.startswith("llama")) for k in ("ar", "sd")}
                    n_all = profiles.model(model).n_layer * profiles.model(model).n_expert
                    host = cells[("spac", False)]["host_slots"]
                    gbps = profiles.disk(disk).read_bytes_per_s / 1e9
                    print(f"| {profiles.model(model).name} {quant} | {ram} GB | {card_name(card)} | {gbps:g} GB/s | "
                          f"{'all' if host is None else f'{host / n_all:.0%}'} | "
                          + " | ".join(f"{tok[n]['ar']:.2f} | {tok[n]['sd']:.2f} (γ {cells[(p, True)]['gamma']})"
                                       for p, n in SYSTEMS.items())
                          + "".join(f" | {extra[(a, False)]['tok_s']:.2f} | {extra[(a, True)]['tok_s']:.2f} "
                                    f"(γ {extra[(a, True)]['gamma']})" for a in ablations)
                          + f" | {tok['spac']['ar'] / llama['ar']:.2f} | {tok['spac']['sd'] / llama['sd']:.2f} | "
                          f"{cells[('spac', True)]['disk_GB_per_token']:.2f} / "
                          f"{cells[('static', True)]['disk_GB_per_token']:.2f} |", flush=True)
                    out.append({"card": card, "ram_gb": ram, "disk_gbps": gbps, "model": model, "tok_s": tok})
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
