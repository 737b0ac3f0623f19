"""Simulated GPU projections (docs/simulator.md, "GPU projections"): spac against llama.cpp's two
ways of running an MoE larger than the card, its GPU expert cache (llama-moe-cache, master) and
--n-cpu-moe, with and without speculative decoding, on the datasheet profiles of
orchestrator/profiles/hardware.toml (8, 12, 16 and 24 GB consumer cards), at the expert-pool
budget each card leaves (the same VRAM for every system).

    .venv/bin/python bench/sim_gpu_projection.py [--steps 600] [--validation rows.json] [--model KEY ...] [--card KEY ...] [--json FILE]

Setting: synthetic routing traces of each model family (`spac sim families`), a per-token
acceptance of 0.75 and the best γ of 1, 2, 4, 8 for the speculative rows (spac's governor picks
γ live; the simulator replays a fixed one) (the draft: Qwen3-0.6B at Q8_0, dense, so
no lookahead routing), the target at Q4_K (gpt-oss at MXFP4, its release format), 4096 tokens
of KV cache. The pool is what the card's memory leaves after the non-expert weights, the draft,
the KV caches and a 1 GiB margin (as `spac` places it), capped at every expert. The hybrid
Qwen3.6-35B-A3B has KV in its 10 full-attention blocks only and a recurrent state in the other
30 (63 MiB per sequence), 1 + γ of them in memory when speculating (llama.cpp's snapshots for
rollback), each pass reading the state and writing a snapshot per token; Qwen3-0.6B stands in
for its draft's cost in llama.cpp's rows, as it does for gpt-oss (neither shares that tokenizer).
spac drafts Qwen3.6 with what it has of the target itself (profiles.SELF_DRAFTS, SPAC_DRAFTS): the
MTP head, its default for a file with one, and the pool draft (a whole target pass per token on
the device, whose unmasked routing is a lookahead of per-expert fidelity 0.9); llama.cpp's rows
take the faster of its own MTP draft (the same block at the same costs) and Qwen3-0.6B's cost
(LLAMA_DRAFTS). Every draft at the same acceptance unless --acceptance sets one; the table's last
spac column is spac's other draft at its best.
- llama.cpp --n-cpu-moe: the `static` policy (whole layers on the device, the first ones' experts
  on the host); a crossing only in the layers with host experts.
- llama.cpp's GPU expert cache: the `llama-moe-cache` policy, as master's src/llama-moe-cache.cpp
  runs a verify pass of at most 32 tokens: one cache over every layer's slots whose victims go by
  frequency class and age (ClassLRU, release b12170), each layer reading its router's choice back
  (a device synchronize, the profile's sync time), uploading its misses on the critical path and
  computing every routed expert on the device. It starts empty, as at load (a prompt leaves it as
  it is), and is measured in the same steady-state window. Also with `--moe-cache-cpu-share` at
  the best of master's tuning script's shares for each row (0 and 0.5-0.98, at the cache's own
  best γ: that share of a full cache's misses on the CPU), and with its first, plain LRU (`llama-moe-cache-lru`, the live
  ablation of spac's engine).
- spac: the default policy with host compute on miss (`spac/host`, what the engine runs today);
  with a miss uploaded or computed on the host, whichever finishes first (`spac`, HybriMoE's
  two-ended greedy, and the draft's lookahead); and with issue 51's rule (`spac-reuse`: the
  upload credited with the host time the expert's later uses save, decided after the router, so
  the device half waits for the router's choice). `spac/host` and `spac-reuse` run live
  (`--miss-rule host|reuse`). The engine's graph splits every MoE layer, so every layer pays the
  crossing, and the device multiplies the host experts' tokens by its zero slot (both measured
  facts of the engine, bench/bench_sim_truth.py), except where the pool holds every expert: then
  the device half alone, no crossing and no gate (patch 0026). The JSON's `spac` is the best of the three on each row, as
  llama.cpp's best is the best of its configurations.
tok/s over the last two thirds of the steps (the pool, and the cache, have filled by then).
--validation: the JSON of bench_sim_truth.py, whose error on this machine is printed beside.
--json FILE: one object per (card, model), {"card", "model", "fits" (every expert fits the pool),
"tok_s": {SYSTEM: {"ar": tok/s, "sd": tok/s}}}, SYSTEM `spac` (its sd with its default draft) or
one of llama.cpp's (`llama-...`), and what drafted: "drafts", "spac_sd_by_draft", "acceptance".
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
from dataclasses import replace
from pathlib import Path

from orchestrator.policies import make_policy
from orchestrator.sim import profiles
from orchestrator.sim.simulator import SimConfig, Simulator
from orchestrator.sim.synthetic import FAMILIES, QWEN3_30B_A3B, family_trace, synthesize_trace

CARDS = ("rtx4060", "rtx3060", "rtx4060ti16", "rtx4090")  # 8, 12, 16 and 24 GB
MODELS = {"qwen3-30b-a3b": "Q4_K", "qwen3.6-35b-a3b": "Q4_K", "gpt-oss-120b": "MXFP4"}
# the rows: simulator policy → the JSON's system name (None: the table only)
SYSTEMS = {"static": "llama-n-cpu-moe", "llama-moe-cache": "llama-moe-cache",
           "llama-moe-cache+cpu-share": "llama-moe-cache-cpu-share", "spac/host": "spac", "spac": "spac",
           "spac-reuse": "spac"}  # the JSON's spac: the best of spac's rules on the row, as llama.cpp's best is taken
CPU_SHARES = (0.5, 0.8, 0.9, 0.95, 0.98)  # master's scripts/moe-cache-tune.py searches these (and 0)
ENGINE = ("spac/host", "spac", "spac-reuse")  # policies the spac engine runs: its split graph's costs
# --multi-card: one RTX 3090 against two (layer split), both in this machine or the second in
# another one over the network (ggml RPC), on models too big for either
MULTI_CARDS = ("rtx3090", "2x-rtx3090", "rtx3090-remote-25gbe", "rtx3090-remote-10gbe")
MULTI_MODELS = {"qwen3-235b-a22b": "Q4_K", "gpt-oss-120b": "MXFP4"}
DRAFT, DRAFT_QUANT = "qwen3-0.6b", "Q8_0"
# the drafts of a target with an MTP block (profiles.SELF_DRAFTS). spac's, its default first: the
# MTP head, and the pool draft (the target routed among the pool's experts, whose unmasked routing
# is a lookahead). llama.cpp's: its own MTP draft (the same block, modelled at spac's costs) or
# DRAFT, whichever is faster (as its users would pick). The other targets: DRAFT for both.
SPAC_DRAFTS = {"qwen3.6-35b-a3b": ("mtp", "pool")}
LLAMA_DRAFTS = {"qwen3.6-35b-a3b": ("mtp", DRAFT)}
ACCEPTANCE = 0.75  # per drafted token, every draft (--acceptance DRAFT=X sets one draft's)
POOL_DRAFT_FIDELITY = 0.9  # the pool draft's unmasked routing: each target expert kept with this probability
MARGIN = 1 << 30
GAMMAS = (1, 2, 4, 8)


REMOTE_LABELS = {"rtx3090-remote-25gbe": "RTX 3090 + a second PC's RTX 3090 over 25 GbE",
                 "rtx3090-remote-10gbe": "RTX 3090 + a second PC's RTX 3090 over 10 GbE"}


def card_name(key: str) -> str:
    """The table's name of a hardware profile: its cards, without the host."""
    return REMOTE_LABELS.get(key) or profiles.hardware(key).name.split(' + ')[0].split(',')[0]


def capacity(config: SimConfig) -> int:
    c = config.costs()
    m = profiles.model(config.model)
    n_all = m.n_layer * m.n_expert
    free = c.vram_bytes - c.static_bytes - MARGIN
    return max(0, min(n_all, int(math.floor(free / c.expert_bytes))))


def best_row(card: str, model: str, quant: str, speculative: bool, policy: str, steps: int, seed: int,
             gammas=GAMMAS, draft: str = DRAFT, acceptance: float = ACCEPTANCE, **config_args) -> dict:
    """The row at its best γ (as the governor picks γ live): γ = 0, or the best of 1, 2, 4, 8; the
    cache with a CPU share also at its best share (as a user tunes it). config_args: SimConfig's
    fields besides the setting (host_ram, disk: bench/sim_disk_projection.py)."""
    gammas = gammas if speculative else (0,)
    if config_args:
        return max((row(card, model, quant, g, policy, steps, seed, config_args, draft, acceptance)
                    for g in gammas), key=lambda r: r["tok_s"])
    if policy == "llama-moe-cache+cpu-share":  # the shares tried at the cache's own best γ (share 0)
        best = best_row(card, model, quant, speculative, "llama-moe-cache", steps, seed, gammas, draft, acceptance)
        tuned = (row(card, model, quant, best["gamma"], "llama-moe-cache", steps, seed, None, draft, acceptance,
                     cpu_share=share) for share in CPU_SHARES)
        return max([{**best, "cpu_share": 0.0}, *tuned], key=lambda r: r["tok_s"])
    return max((row(card, model, quant, g, policy, steps, seed, None, draft, acceptance) for g in gammas),
               key=lambda r: r["tok_s"])


def row(card: str, model: str, quant: str, gamma: int, policy: str, steps: int, seed: int,
        config_args: dict | None = None, draft: str = DRAFT, acceptance: float = ACCEPTANCE, **policy_args) -> dict:
    speculative = gamma > 0
    fidelity = POOL_DRAFT_FIDELITY if draft == "pool" else None  # a dense draft or the MTP head: no lookahead
    if model in FAMILIES:
        trace = family_trace(model, steps, gamma=gamma, acceptance=acceptance, draft_fidelity=fidelity, seed=seed)
    else:  # no calibrated family: Qwen3-30B-A3B's dynamics in this model's shape
        m = profiles.model(model)
        trace = synthesize_trace(steps, QWEN3_30B_A3B.with_shape(m.n_layer, m.n_expert, m.top_k), gamma=gamma,
                                 acceptance=acceptance, draft_fidelity=fidelity, seed=seed,
                                 name=f"synthetic {m.name}", layer_index=m.layer_index)
    config = SimConfig(hardware=card, model=model, draft=draft if speculative else None, quant=quant,
                       draft_quant=DRAFT_QUANT, snapshots=gamma,  # a hybrid's n_rs_seq: --draft-max γ
                       **(config_args or {}))
    config = replace(config, capacity=capacity(config))
    costs = config.costs()
    if policy in ENGINE:  # spac's engine: a crossing in every split layer, the zero slot on the device
        costs = replace(costs, sync_every_layer=True, zero_slot=True)
    r = Simulator(trace, config, costs=costs).run(make_policy(policy, **policy_args))
    warm = steps // 3  # steady state: the pool fills at the link's pace first (spac paces its copies)
    tok_s = float((trace.n_accepted[warm:] + 1).sum() / r.step_time[warm:].sum())
    n_all = profiles.model(model).n_layer * profiles.model(model).n_expert
    return {"slots": config.capacity, "share": config.capacity / n_all, "tok_s": tok_s, "gamma": gamma, "draft": draft,
            "host_slots": r.host_slots, "disk_GB_per_token": r.disk_bytes / 1e9 / r.tokens, **policy_args}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--validation", type=Path, help="bench_sim_truth.py --json output")
    ap.add_argument("--multi-card", action="store_true",
                    help="one RTX 3090 against two (x8 each, or the second in another PC over 25 or 10 GbE), on "
                    "Qwen3-235B-A22B and gpt-oss-120b (Qwen3's dynamics)")
    ap.add_argument("--model", action="append", help="only this model profile's rows (repeatable)")
    ap.add_argument("--card", action="append", help="only this card's rows (a hardware profile, repeatable)")
    ap.add_argument("--json", type=Path, help="write the rows as JSON to this file")
    ap.add_argument("--acceptance", action="append", default=[], metavar="DRAFT=X",
                    help=f"one draft's per-token acceptance (default {ACCEPTANCE} for every draft; DRAFT: "
                    f"{DRAFT} or one of {', '.join(profiles.SELF_DRAFTS)}; repeatable)")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="processes (default: one per core)")
    args = ap.parse_args()
    cards, models = (MULTI_CARDS, MULTI_MODELS) if args.multi_card else (CARDS, MODELS)

    def only(flag: str, asked: list[str] | None, known) -> list[str]:
        """The keys of `known` that --flag names (all when it is not given); an unknown one is an error."""
        if not asked:
            return list(known)
        if unknown := set(asked) - set(known):
            ap.error(f"{flag}: not in this table: {', '.join(sorted(unknown))} (known: {', '.join(known)})")
        return [k for k in known if k in asked]

    models = {k: models[k] for k in only("--model", args.model, models)}
    cards = tuple(only("--card", args.card, cards))
    acceptance = {}
    for item in args.acceptance:
        name, _, value = item.partition("=")
        try:
            acceptance[name] = float(value)
        except ValueError:
            ap.error(f"--acceptance {item}: not DRAFT=X with X a number")
        if name not in (DRAFT, *profiles.SELF_DRAFTS) or not 0 <= acceptance[name] < 1:
            ap.error(f"--acceptance {item}: DRAFT is {DRAFT}, {' or '.join(profiles.SELF_DRAFTS)}, X in [0, 1)")

    note = ""
    if args.validation:
        rows = [r for r in json.loads(args.validation.read_text()) if r.get("measured_tok_s")]
        def worst(spec: bool) -> float:
            return max(abs(r["predicted_tok_s"] / r["measured_tok_s"] - 1) for r in rows if r["speculative"] == spec)

        note = f"≤ {100 * worst(False):.0f}% / ≤ {100 * worst(True):.0f}%"
    print("| card | model | pool (experts) | " + " | ".join(f"{COLUMN[p]} | + spec." for p in SYSTEMS)
          + " | spac + its other draft | best spac ÷ best llama.cpp | + spec. ÷ + spec. | validation error (AR / spec.) |")
    print("|---|---|---|" + "---|---|" * len(SYSTEMS) + "---|---|---|---|")
    out = []
    workers = multiprocessing.Pool(args.jobs)  # the cells of a row in parallel (a row takes minutes)
    for card in cards:
        for model, quant in models.items():
            config = SimConfig(hardware=card, model=model, draft=DRAFT, quant=quant, draft_quant=DRAFT_QUANT, snapshots=8)
            if not capacity(config):
                print(f"| {card_name(card)} | {profiles.model(model).name} {quant} | no room: the non-expert weights "
                      f"and the KV cache leave no expert slot |" + " |" * (2 * len(SYSTEMS) + 4))
                continue
            drafts, llama_drafts = SPAC_DRAFTS.get(model, (DRAFT,)), LLAMA_DRAFTS.get(model, (DRAFT,))
            # (policy, speculative, draft): each system with each of its drafts
            keys = [(p, False, None) for p in SYSTEMS]
            keys += [(p, True, d) for p in SYSTEMS for d in (drafts if p in ENGINE else llama_drafts)]
            cells = dict(zip(keys, workers.starmap(best_row, [
                (card, model, quant, s, p, args.steps, args.seed, GAMMAS, d or DRAFT, acceptance.get(d or DRAFT, ACCEPTANCE))
                for p, s, d in keys])))
            for p in SYSTEMS:  # the columns: spac with its default draft, llama.cpp with its faster one
                cells[(p, False)] = cells[(p, False, None)]
                cells[(p, True)] = (cells[(p, True, drafts[0])] if p in ENGINE else
                                    max((cells[(p, True, d)] for d in llama_drafts), key=lambda c: c["tok_s"]))
            ar, spec = cells[("static", False)], cells[("static", True)]
            pool = f"{ar['share']:.0%} / {spec['share']:.0%} with the draft"

            def tok(p: str, s: bool) -> str:
                c = cells[(p, s)]
                extra = [f"γ {c['gamma']}"] if s else []
                extra += [c["draft"]] if s and c["draft"] != DRAFT else []
                extra += [f"share {c['cpu_share']:g}"] if "cpu_share" in c else []
                return f"{c['tok_s']:.1f}" + (f" ({', '.join(extra)})" if extra else "")

            # spac's best with each of its drafts (the default's is its column's)
            best_by_draft = {d: max((cells[(p, True, d)] for p in ENGINE), key=lambda c: c["tok_s"]) for d in drafts}
            by_draft = {d: c["tok_s"] for d, c in best_by_draft.items()}
            other = ", ".join(f"{d} {c['tok_s']:.1f} (γ {c['gamma']})" for d, c in best_by_draft.items()
                              if d != drafts[0]) or "-"

            best = {(name, s): max(cells[(p, s)]["tok_s"] for p, n in SYSTEMS.items() if n == name)
                    for name in dict.fromkeys(SYSTEMS.values()) for s in (False, True)}
            best_llama = {s: max(v for (name, s2), v in best.items() if s2 == s and name.startswith("llama"))
                          for s in (False, True)}
            print(f"| {card_name(card)} | {profiles.model(model).name} {quant} | {pool} | "
                  + " | ".join(tok(p, s) for p in SYSTEMS for s in (False, True)) + f" | {other}"
                  + f" | {best[('spac', False)] / best_llama[False]:.2f}"
                  + f" | {best[('spac', True)] / best_llama[True]:.2f} | {note} |")
            n_all = profiles.model(model).n_layer * profiles.model(model).n_expert
            out.append({"card": card, "model": model, "fits": ar["slots"] >= n_all,
                        "tok_s": {name: {"ar": best[(name, False)], "sd": best[(name, True)]}
                                  for name in dict.fromkeys(SYSTEMS.values())},
                        # what drafted: spac's sd is its default draft's; spac_sd_by_draft has each of its drafts
                        "drafts": {"spac": drafts[0], "llama": llama_drafts}, "spac_sd_by_draft": by_draft,
                        "acceptance": {d: acceptance.get(d, ACCEPTANCE) for d in dict.fromkeys((*drafts, *llama_drafts))}})
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


COLUMN = {"static": "llama.cpp --n-cpu-moe", "llama-moe-cache": "llama.cpp cache (ClassLRU)",
          "llama-moe-cache+cpu-share": "llama.cpp cache + CPU share", "spac/host": "spac, host misses (the engine today)",
          "spac": "spac, greedy misses + draft lookahead", "spac-reuse": "spac, reuse-credited misses"}


if __name__ == "__main__":
    main()
