"""Device half and host half of every split MoE layer: serial vs overlapped, on the RPC device.

    .venv/bin/python bench/bench_overlap.py [--preset olmoe-1b-7b] [--n-layer 4] [--repeats 9]
    .venv/bin/python bench/bench_overlap.py --preset mixtral-8x7b --n-layer 2

The device is a ggml RPC server on 127.0.0.1 computing with 1 thread; the host computes with 1
thread. Model: synthetic layers of a named model (orchestrator.gguf_files.synthetic_models.PRESETS: the real
shapes, random Q4_0 weights, a 512-token vocabulary). Pass: a verify batch of γ+1 = 9 tokens.

The work outside the experts (attention, router, norms) runs on the host in every configuration
and bounds what any split can save: a pass costs at least its host half alone (non-expert work
plus the host's experts), printed as "floor at this split" = host half alone / all-host.
OLMoE's attention is a large share of a 9-token pass on a CPU (its 4·d² projections see all 9
tokens, each expert about 1); Mixtral's wide experts make the expert work dominate.

Weights load without llama.cpp's repacking (repack="off"): the pool's experts are plain
copies from the file, so the host experts then run the same kernels and the RPC "device" is as
fast per expert as the host. Repacked, the host's Q4_0 experts run about 2x faster on an
AVX512-VNNI CPU: a GPU pool would not notice, a CPU-emulated device would look slow.

Residency is set per layer from the pass's own routing: experts sorted by how often the 9 tokens
chose them get utility levels 1..K (K = 8) by their share of the activations, so that τ = 5 puts
about half of every layer's expert work on the device. The pool holds exactly the wanted
experts (its budget is their bytes). Medians (ms) of passes run in rotation over one context
per configuration:
  all-host            no pool
  serial              τ = 5, the previous graph (every expert matmul split, halves one after the other)
  overlapped          τ = 5, one crossing each way per layer, the device half queued first
  host / device alone τ = 5, overlap graph with the other half left out (wrong outputs, timing only)
Then a sweep of τ = 1..K+1 (overlapped; K+1 = nothing on the device) with each half alone at
every τ, unit costs fitted to those (host: per activation, device: per distinct expert), and
the balancer's τ (orchestrator.policies.balancer.solve_threshold fed those costs) timed against the
sweep's best.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from orchestrator.runtime.llm import Context, Model
from orchestrator.runtime.native import ExpertEngine, Routing
from orchestrator.runtime.rpc import rpc_device
from orchestrator.gguf_files.gguf_export import byte_level_bpe_tokenizer, write_gguf
from orchestrator.gguf_files.synthetic_models import PRESETS, synthetic_tensors
from orchestrator.policies.balancer import UnitCosts, WorkloadStats, solve_threshold
from orchestrator.policies.plan import Plan

VERIFY = [11, 22, 33, 44, 55, 66, 77, 88, 99]  # γ = 8: a verify batch of 9 tokens
K = 8
HALF = K // 2 + 1  # τ giving the device about half of the activations


def synthetic_layers(tmp: Path, preset: str, n_layer: int) -> Path:
    cfg = replace(PRESETS[preset], n_layer=n_layer, n_vocab=512)
    path = tmp / f"{preset}-{n_layer}l-q4_0.gguf"
    write_gguf(path, cfg, synthetic_tensors(cfg, seed=0), byte_level_bpe_tokenizer(cfg.n_vocab), dtype="q4_0")
    return path


def routing_freq(model: Model, n_threads: int, n_expert: int, n_expert_used: int) -> np.ndarray:
    """Activations per (layer, expert) of the verify pass."""
    ctx = Context(model, n_ctx=64, n_batch=16, n_threads=n_threads)
    try:
        routing = Routing(ctx.ptr, n_expert_used=n_expert_used)
        ctx.decode(VERIFY)
        ids, _ = routing.last()
        n_layer = ids.shape[0]
        freq = np.zeros((n_layer, n_expert))
        for m in range(n_layer):
            np.add.at(freq[m], ids[m].ravel(), 1)
        return freq
    finally:
        ctx.close()


def utility_from_share(freq: np.ndarray) -> np.ndarray:
    """Levels 1..K by cumulative share of activations (most chosen first); unused experts 0."""
    utility = np.zeros(freq.shape, np.uint8)
    for m, row in enumerate(freq):
        order = np.argsort(-row, kind="stable")
        before = np.concatenate([[0.0], np.cumsum(row[order])[:-1]]) / row.sum()
        levels = K - np.floor(before * K).astype(int)
        utility[m, order] = np.where(row[order] > 0, np.clip(levels, 1, K), 0)
    return utility


class Config:
    """One context on the shared model, with its own pool holding the experts with utility ≥ τ."""

    def __init__(self, name: str, model: Model, path: Path, device: str | None, utility: np.ndarray,
                 tau: np.ndarray | None, slot_bytes: int, n_threads: int, **engine_args):
        self.name = name
        self.ctx = Context(model, n_ctx=64, n_batch=16, n_threads=n_threads)
        self.engine = None
        self.times: list[float] = []
        if tau is None or not (utility >= tau[:, None]).any():
            return  # nothing on the device: the unsplit graph
        wanted = int((utility >= tau[:, None]).sum())
        # the RPC server runs this patch series' ggml-cpu, so non-resident rows are skipped there:
        # the zero slot's rows, cheap next to a GPU's weight reads, would cost the server's one
        # core as much as real experts
        self.engine = ExpertEngine(self.ctx.ptr, path, device=device, budget_bytes=wanted * slot_bytes + slot_bytes // 2,
                                   skip_absent=True, **engine_args)
        self.engine.set_plan(Plan(utility, tau.astype(np.int32)))
        if not self.engine.wait_idle(600):
            raise RuntimeError(f"{name}: the pool did not fill")
        resident = self.engine.residency() >= 0
        assert (resident == (utility >= tau[:, None])).all(), f"{name}: residency differs from the plan"

    def run(self) -> None:
        self.ctx.trim(0)
        t0 = time.perf_counter()
        self.ctx.decode(VERIFY)
        self.ctx.logits()[0, 0]  # synchronizes
        self.times.append(time.perf_counter() - t0)

    def median_ms(self) -> float:
        return 1e3 * statistics.median(self.times)

    def close(self) -> None:
        if self.engine:
            self.engine.close()
        self.ctx.close()


def rotate(configs: list[Config], repeats: int) -> None:
    for c in configs:
        c.run()  # warm-up (graph reserve, first touch), not counted
        c.times.clear()
    for _ in range(repeats):
        for c in configs:
            c.run()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="olmoe-1b-7b")
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1, help="host threads (the RPC server always uses 1)")
    ap.add_argument("--model", type=Path, help="reuse this synthetic file of --preset's shape instead of writing one")
    args = ap.parse_args()

    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp, rpc_device(n_threads=1) as device:
        cfg = PRESETS[args.preset]
        path = args.model or synthetic_layers(Path(tmp), args.preset, args.n_layer)
        model = Model(path, repack="off")  # the pool and the host experts on the same kernels
        freq = routing_freq(model, args.threads, cfg.n_expert, cfg.n_expert_used)
        L, E = freq.shape
        utility = utility_from_share(freq)
        slot_bytes = 3 * cfg.n_ff_exp * cfg.n_embd // 32 * 18  # up, gate, down in Q4_0
        n_act = freq.sum()

        def share_on_device(tau: np.ndarray) -> float:
            return float((freq * (utility >= tau[:, None])).sum() / n_act)

        def make(name, tau, **kw):
            return Config(name, model, path, device, utility, tau, slot_bytes, args.threads, **kw)

        print(f"model: {L} {cfg.name} layers (d {cfg.n_embd}, {cfg.n_expert} experts of ff {cfg.n_ff_exp}, "
              f"top-{cfg.n_expert_used}, Q4_0); verify pass of "
              f"{len(VERIFY)} tokens; RPC server 1 thread, host {args.threads} thread(s); "
              f"load average before start {load:.2f}")
        half = np.full(L, HALF)
        configs = [make("all-host", None),
                   make("serial (per-matmul graph)", half, split_graph="per-matmul"),
                   make("overlapped", half),
                   make("host half alone", half, only_half="host"),
                   make("device half alone", half, only_half="device")]
        rotate(configs, args.repeats)
        ms = {c.name: c.median_ms() for c in configs}
        for c in configs:
            c.close()
        print(f"\nτ = {HALF}: {share_on_device(half):.0%} of the activations on the device "
              f"(medians of {args.repeats} passes, ms)")
        for name, v in ms.items():
            print(f"  {name:28s} {v:8.1f}")
        worst_half = max(ms["host half alone"], ms["device half alone"])
        print(f"  overlapped / all-host            {ms['overlapped'] / ms['all-host']:.3f}   (target ≤ 0.65; "
              f"floor at this split {ms['host half alone'] / ms['all-host']:.3f})")
        print(f"  overlapped / max(halves alone)   {ms['overlapped'] / worst_half:.3f}   (target ≤ 1.15)")
        print(f"  overlapped / serial              {ms['overlapped'] / ms['serial (per-matmul graph)']:.3f}")

        # sweep of fixed splits, each half alone at every τ for the unit costs
        print("\nsweep (overlapped, ms): τ, share of activations on the device, pass, host half alone, device half alone")
        sweep = {}
        host_pts, dev_pts = [], []
        for t in range(1, K + 2):
            tau = np.full(L, t)
            if t == K + 1:
                trio = [make("overlapped", None)]
            else:
                trio = [make("overlapped", tau), make("host", tau, only_half="host"),
                        make("device", tau, only_half="device")]
            rotate(trio, args.repeats)
            row = [c.median_ms() for c in trio]
            for c in trio:
                c.close()
            sweep[t] = row[0]
            on_dev = utility >= tau[:, None]
            if len(row) == 3:
                host_pts.append(((freq * ~on_dev).sum(), row[1]))
                dev_pts.append(((on_dev & (freq > 0)).sum(), row[2]))
            print(f"  τ={t}  {share_on_device(tau):4.0%}  {row[0]:7.1f}" +
                  ("".join(f"  {v:7.1f}" for v in row[1:]) if len(row) == 3 else ""))
        best = min(sweep, key=sweep.get)

        # unit costs: slope of each half's time over its work (activations / distinct experts)
        t_cpu_unit = np.polyfit(*np.array(host_pts).T, 1)[0] * 1e-3
        t_gpu_unit = np.polyfit(*np.array(dev_pts).T, 1)[0] * 1e-3
        stats = WorkloadStats(L, K)
        stats.observe(freq, utility)
        costs = UnitCosts(t_cpu_unit=t_cpu_unit, t_gpu_unit=t_gpu_unit, t_io_unit=0.0, expert_bytes=1.0,
                          t_draft_token=0.0, t_total=1.0, vram_left=float("inf"))
        tau_bal = solve_threshold(stats.r_cpu, stats.r_gpu, stats.b, np.zeros((L, K)), costs, gamma=len(VERIFY) - 1,
                                  top_k=cfg.n_expert_used, n_layer_target=L)
        pair = [make("balancer", tau_bal), make("best fixed", np.full(L, best) if best <= K else None)]
        rotate(pair, args.repeats)
        t_bal, t_best = (c.median_ms() for c in pair)
        for c in pair:
            c.close()
        print(f"\nunit costs fitted: host {t_cpu_unit * 1e6:.1f} µs per activation, device "
              f"{t_gpu_unit * 1e6:.1f} µs per distinct expert")
        print(f"balancer τ per layer {tau_bal.tolist()} ({share_on_device(tau_bal):.0%} on the device): {t_bal:.1f} ms; "
              f"best fixed τ = {best} ({share_on_device(np.full(L, best)):.0%}): {t_best:.1f} ms; "
              f"ratio {t_bal / t_best:.3f} (target ≤ 1.10)")
        model.close()
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
