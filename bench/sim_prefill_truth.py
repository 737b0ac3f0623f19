"""The prefill simulator (`spac sim prefill`) held against a GPU run of bench_stream_prefill.py.

    python bench/sim_prefill_truth.py ROWS.json [ROWS.json ...]

ROWS.json: `bench_stream_prefill.py --device CUDA0 --json ROWS.json` (synthetic layers of a preset's
shape, Q4_0). Per file and prompt length, two rates come from the run itself:

  link     the rate spac's staging copies reached (bytes staged / the copy worker's copy time)
  compute  the GPU's prefill rate: the `prefill_tflops` at which the simulator's time with every
           expert resident equals the measured one (bisection)

With those, orchestrator/sim/prefill.py predicts llama.cpp's op offload, spac (`ahead`) and
spac-used at the run's pool and prompt length (one ubatch, as the bench runs it, uniform routing),
each printed beside its measurement. What the simulator is then tested on is its structure:
op offload's copies and compute taking turns, spac's copies hidden behind the previous layer's
compute, spac-used's copies after each router. The hardware profile's other fields (HBM rate,
per-layer overhead) are H100 datasheet values and assumptions, written below.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from orchestrator.gguf_files.gguf_export import ModelConfig
from orchestrator.gguf_files.synthetic_models import PRESETS
from orchestrator.sim import profiles
from orchestrator.sim.prefill import PrefillModel

# an H100 SXM: 3.35 TB/s HBM3 (NVIDIA datasheet); the rest as the rtx4090 profile's assumptions
H100 = replace(profiles.hardware("rtx4090"), key="h100-measured", name="H100 SXM (rates from the run)",
               vram_GB=80.0, gpu_mem_GBps=3350.0, pcie_efficiency=1.0, layer_overhead_us=10.0)
SYSTEMS = {"op-offload": "op offload", "spac": "streamed, ahead", "spac-used": "streamed, used"}


def model_profile(cfg: ModelConfig) -> profiles.ModelProfile:
    """The simulator's profile of a synthetic preset (every block an MoE block)."""
    attn = cfg.n_embd * cfg.head_dim * (2 * cfg.n_head + 2 * cfg.n_head_kv)  # q, o; k, v
    return profiles.ModelProfile(
        key=f"synthetic:{cfg.name}", name=cfg.name, source="orchestrator/gguf_files/synthetic_models.py", n_block=cfg.n_layer,
        d_model=cfg.n_embd, block_params=attn + cfg.n_embd * cfg.n_expert, head_params=cfg.n_vocab * cfg.n_embd,
        kv_bytes_per_token=cfg.n_layer * 2 * cfg.n_head_kv * cfg.head_dim * 2, moe_blocks=(0, cfg.n_layer - 1),
        n_expert=cfg.n_expert, top_k=cfg.n_expert_used, expert_params=3 * cfg.n_embd * cfg.n_ff_exp)


def fit_tflops(model: profiles.ModelProfile, link_GBps: float, n_tokens: int, measured_s: float) -> float:
    """The prefill rate at which every expert resident takes the measured time."""
    lo, hi = 0.01, 10_000.0
    for _ in range(80):
        mid = (lo * hi) ** 0.5
        pm = PrefillModel(replace(H100, pcie_GBps=link_GBps, prefill_tflops=mid), model, "Q4_0", cache_ratio=1.0)
        lo, hi = (mid, hi) if pm.run("spac", n_tokens, n_tokens).ttft_s > measured_s else (lo, mid)
    return (lo * hi) ** 0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", type=Path, nargs="+", help="bench_stream_prefill.py --json files of a GPU run")
    args = ap.parse_args()
    errors = []
    print("| run | prompt | link GB/s | fitted TFLOP/s | system | predicted ms | measured ms | error |")
    print("|---|---|---|---|---|---|---|---|")
    for path in args.rows:
        rows = json.loads(path.read_text())
        first = rows[0]
        if first["device"] == "rpc":
            raise SystemExit(f"{path}: an RPC-device run (the simulator models a GPU)")
        cfg = replace(PRESETS[first["preset"]], n_layer=first["n_layer"], n_vocab=512)
        model = model_profile(cfg)
        run = f"{path.stem}{'' if first.get('mmap', True) else ' (--no-mmap)'}"
        for n in sorted({r["tokens"] for r in rows}):
            at = {r["row"]: r for r in rows if r["tokens"] == n}
            ahead = next(r for name, r in at.items() if name.startswith("streamed, ahead") and r["n_staged"])
            full = next(r for name, r in at.items() if name.startswith("streamed, ahead") and not r["n_staged"])
            link = ahead["bytes_staged"] / (ahead["stage_copy_ms"] * 1e-3) / 1e9
            tflops = fit_tflops(model, link, n, full["ms"] * 1e-3)
            pool = ahead["resident"] / (cfg.n_layer * cfg.n_expert)
            pm = PrefillModel(replace(H100, pcie_GBps=link, prefill_tflops=tflops), model, "Q4_0", cache_ratio=pool)
            for system, prefix in SYSTEMS.items():
                measured = next((r["ms"] for name, r in at.items() if name.startswith(prefix) and r.get("n_staged", 1)), None)
                if measured is None:
                    continue
                predicted = 1e3 * pm.run(system, n, n).ttft_s
                errors.append((system, predicted / measured - 1))
                print(f"| {run} | {n} | {link:.1f} | {tflops:.1f} | {system} | {predicted:.1f} | {measured:.1f} | "
                      f"{100 * (predicted / measured - 1):+.0f}% |")
    for system in SYSTEMS:
        e = [abs(x) for s, x in errors if s == system]
        if e:
            print(f"{system}: largest |error| {100 * max(e):.0f}%, mean {100 * sum(e) / len(e):.0f}% over {len(e)} rows")


if __name__ == "__main__":
    main()
