"""`spac sim profile measure`: this machine's unit times, timed on the patched engine, written as
a measured hardware profile (`orchestrator.sim.profiles.MeasuredProfile`) that `spac sim run
--hardware FILE` replays traces with.

What is timed, on a model (default: a synthetic MoE of real expert shapes in a temporary file;
`--gguf FILE`: your own, whose kernels and shapes are then exactly those measured) with every
layer's non-expert weights on the device (llama.cpp's -ngl 99) and the expert pool on it:

    verify passes of n = 1, 2, 4 .. γ+1 tokens after the same prefix (the KV cache trimmed back
    after each, so the routing of the tokens is the same every time), with the pool holding none,
    half or all of the experts the passes use, in three engines:
      device half alone   (only_half = device, absent experts skipped): base_d(n) + Σ resident experts
      host half alone     (only_half = host):                            base_h(n) + Σ host experts
      both halves         (the live engine): the check, predicted from the rest vs timed
    expert cost model     t(m tokens) = W_e · s_per_byte(m), a table over m = 1 .. γ+1 filled
                          from a line t(1) .. t(γ+1) fitted by least squares over the passes of
                          each half (one intercept per n): per distinct expert plus per token.
                          A free value per m is not determined (few experts get more than 4 of
                          9 tokens); the line leaves residuals of ±5 ms on 40-420 ms passes here
    crossing              base_h(n) − base_d(n) is the host half's output going back to the
                          device; the hidden state going to the host costs the same again (it
                          happens in both engines, so it cannot be told apart from the pass: the
                          one assumption of the measurement)
    non-expert part       base_d(n) minus that one-way crossing and the attention over the
                          prefix, affine in n, per non-expert byte
    attention             the device half alone with nothing resident (the non-expert part and
                          the crossings) after 16, 144 and 272 tokens of context: c(n) + p ·
                          (a + n · b), per byte of KV cache of the context (a: reading it once
                          per pass, b: each token's dot products with it)
    copy                  the copy engine's busy time per byte while it filled the pool
    stage                 copies inside a pass (the staging queue that uploads on miss and the
                          miss gate's take): the passes' wait for them, per byte and per layer
                          batch, from llama.cpp's cache ablation at 1 and 9 tokens
    draft                 single-token decodes of the draft on the host (its routing exported,
                          as the live loop does), per token and per byte it reads
    disk                  sequential read rate, 4 KiB read latency and the reads in flight the
                          rate needs (sim/disk.py: `measure_disk`), on --disk-file or a 512 MiB
                          file written beside the profile and deleted after
    every context holds at least 256 cells, the attention window of any run with fewer than 256
    tokens in its cache; the time still grows with the tokens in it (masked cells cost little)

The host computes as a session in exact mode does (the default: batches of up to 32 tokens row by
row, `host_layout.batch_invariant`; `--no-exact`: ggml's batched kernels), so that the rates are
those of the runs they predict. Each rate is per byte of the weights read, so a profile measured on one model predicts another
of the same weight type. Every timed pass routes a new random batch (`repeats` per point), as a
live run routes new tokens every step (a batch repeated would meet weights that a large
last-level cache, 480 MiB on the test machine, has just seen); the whole measurement takes
seconds on the test models and about a minute on a 4.6 GB target over the RPC device.

This module drives the live engine (like `orchestrator.cli.record`), so it lives outside `sim/`.

Why ~540 lines: each cost-model term has its measurement here (a synthetic model per preset,
the rate fits, the checks of a fit), all of them driving the live engine; the profile file
format is sim/profiles.py.
"""

from __future__ import annotations

import platform
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Optional

import numpy as np
import typer

from orchestrator.decoding.speculative import EXACT_ROWS
from orchestrator.runtime.host_layout import batch_invariant
from orchestrator.runtime.llm import Context, Model
from orchestrator.runtime.native import ExpertEngine, Routing, copies_block_compute
from orchestrator.runtime.placement import devices, first_gpu
from orchestrator.runtime.rpc import rpc_device
from orchestrator.gguf_files.gguf_export import byte_level_bpe_tokenizer, write_gguf
from orchestrator.gguf_files.synthetic_models import PRESETS, synthetic_tensors
from orchestrator.policies.plan import Plan
from orchestrator.sim import profiles
from orchestrator.sim.disk import measure_disk, write_measure_file
from orchestrator.sim.profiles import MeasuredProfile

TOKENS = (1, 2, 4, 9)  # verify batch sizes: γ + 1 for γ = 0, 1, 3, 8
PREFIX = 16
LEVELS = (0.0, 0.5, 1.0)  # share of the used experts resident
# llama.cpp attends over max(256, used cells rounded up to 256) KV cells, capped at the context:
# any context of 256 or more with fewer than 256 tokens in it attends over 256 cells, and so do
# the passes timed here (a context just big enough for them would attend over a few dozen and
# time the attention several times too cheap)
N_CTX = 256
# attention: the same passes after this many more tokens of context (the cost grows with the
# tokens in the cache, not with the cells attended over)
CONTEXT = (0, 128, 256)
# the live session's batch (SessionConfig.n_batch): the passes are timed with the graph and
# buffers llama.cpp sizes for the ubatch the session uses
N_BATCH = 512


def synthetic_model(tmp: Path, preset: str = "qwen3-30b-a3b", n_layer: int = 4, n_expert: int = 16) -> Path:
    """A small file with a real model's expert and attention shapes (random Q4_0 weights)."""
    cfg = replace(PRESETS[preset], n_layer=n_layer, n_expert=min(n_expert, PRESETS[preset].n_expert), n_vocab=512)
    path = tmp / f"{preset}-{n_layer}l-q4_0.gguf"
    write_gguf(path, cfg, synthetic_tensors(cfg, seed=0), byte_level_bpe_tokenizer(cfg.n_vocab), dtype="q4_0")
    return path


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.processor())
    except OSError:
        return platform.processor()


class _Bench:
    """One context with its own engine (or none) on the shared model; timed passes of fixed batches."""

    def __init__(self, model, path: Path, device: str | None, n_threads: int, prefix: np.ndarray,
                 budget_bytes: int, n_ctx: int = N_CTX, **engine_args):
        self.ctx = Context(model, n_ctx=n_ctx, n_batch=N_BATCH, n_threads=n_threads)
        self.engine = ExpertEngine(self.ctx.ptr, path, device=device, budget_bytes=budget_bytes, **engine_args)
        self.routing = Routing(self.ctx.ptr, self.engine.n_expert_used)
        self.ctx.decode(prefix, logits_all=False)
        self.base = self.ctx.n_past

    def resident(self, utility: np.ndarray) -> np.ndarray:
        n_layer = self.engine.n_moe_layers
        self.engine.set_plan(Plan(utility=utility.astype(np.uint8), threshold=np.ones(n_layer, dtype=np.int32)))
        if not self.engine.wait_idle(600):
            raise RuntimeError("the expert pool did not fill in 10 minutes")
        return self.engine.residency() >= 0

    def run(self, n: int, batch: np.ndarray) -> tuple[float, np.ndarray]:
        """Seconds of one pass of the first n tokens of `batch`, and its routing [n_layer, n, top_k]."""
        t0 = time.perf_counter()
        self.ctx.decode(batch[:n], logits_all=True)
        self.ctx.logits()[0, 0]  # synchronizes
        dt = time.perf_counter() - t0
        ids = self.routing.last()[0].copy()
        self.ctx.trim(self.base)
        return dt, ids

    def extend(self, tokens: np.ndarray) -> None:
        """More context before the timed passes."""
        self.ctx.decode(tokens, logits_all=False)
        self.base = self.ctx.n_past

    def close(self) -> None:
        self.engine.close()
        self.ctx.close()


def _used(model, batches: list, prefix: np.ndarray, n_threads: int, n_expert: int) -> np.ndarray:
    """[n_layer, n_expert] bool: the experts the batches use after the prefix (the passes of fewer
    tokens are their prefixes, so they use a subset), from a plain context's routing export."""
    ctx = Context(model, n_ctx=N_CTX, n_batch=N_BATCH, n_threads=n_threads)
    try:
        n_used = int(model.meta(f"{model.arch}.expert_used_count") or 1)
        routing = Routing(ctx.ptr, n_used)
        ctx.decode(prefix, logits_all=False)
        used = np.zeros((routing.n_moe_layers, n_expert), dtype=bool)
        for batch in batches:
            ctx.decode(batch, logits_all=True)
            used |= _counts(routing.last()[0], n_expert) > 0
            ctx.trim(len(prefix))
        return used
    finally:
        ctx.close()


def _counts(ids: np.ndarray, n_expert: int) -> np.ndarray:
    """Tokens per (layer, expert) of one pass."""
    counts = np.zeros((ids.shape[0], n_expert), dtype=np.int64)
    for layer in range(ids.shape[0]):
        np.add.at(counts[layer], ids[layer].ravel(), 1)
    return counts


def _knot_weights(m: np.ndarray, knots) -> np.ndarray:
    """Σ over experts with m tokens of their piecewise-linear weights on the knots: t(m) = this · t(knots)
    (beyond the last knot, along the last segment)."""
    xs = np.asarray(knots, dtype=np.float64)
    out = np.zeros(len(xs))
    for v in np.asarray(m, dtype=np.float64):
        if len(xs) == 1:
            out[0] += v / xs[0]
            continue
        i = min(max(int(np.searchsorted(xs, v)) - 1, 0), len(xs) - 2)
        f = (v - xs[i]) / (xs[i + 1] - xs[i])
        out[i] += 1.0 - f
        out[i + 1] += f
    return out


def _fit_attention(rows: list[tuple[int, int, float]]) -> tuple[float, float]:
    """Least squares of time = c(n) + position · (a + n · b) over (n, position, time) rows: (a, b),
    seconds per token of context per pass and per token of the pass."""
    sizes = sorted({n for n, _, _ in rows})
    x = np.zeros((len(rows), len(sizes) + 2))
    y = np.zeros(len(rows))
    for r, (n, pos, t) in enumerate(rows):
        x[r, sizes.index(n)] = 1.0
        x[r, -2:] = pos, pos * n
        y[r] = t
    sol, *_ = np.linalg.lstsq(x, y, rcond=None)
    return max(float(sol[-2]), 0.0), max(float(sol[-1]), 0.0)


def _fit(rows: list[tuple[int, np.ndarray, float]], tokens) -> tuple[tuple, np.ndarray, dict]:
    """Least squares of time = base(n) + Σ_experts t(m) over (n, token counts of the side's
    experts, time) rows, t linear from 1 to the largest n (and beyond):
    ((1 .. largest n), t there, {n: base(n)})."""
    index = {n: i for i, n in enumerate(tokens)}
    knots = tuple(sorted({1, tokens[-1]}))
    k = len(tokens)
    x = np.zeros((len(rows), k + len(knots)))
    y = np.zeros(len(rows))
    for r, (n, m, t) in enumerate(rows):
        x[r, index[n]] = 1.0
        x[r, k:] = _knot_weights(m, knots)
        y[r] = t
    sol, *_ = np.linalg.lstsq(x, y, rcond=None)
    at = np.arange(1, tokens[-1] + 1)
    table = np.maximum(np.interp(at, knots, sol[k:]), 1e-9)
    return tuple(int(v) for v in at), table, {n: float(sol[index[n]]) for n in tokens}


def measure(model_path: Path, device: str | None, n_threads: int = 1, draft_path: Path | None = None,
            tokens=TOKENS, repeats: int = 3, name: str = "", progress: Callable[[str], None] = lambda s: None,
            seed: int = 0, layers_on_device: bool | None = None, repack: str | None = None,
            skip_absent: bool = False, raw: dict | None = None, mmap: bool = True, exact: bool = True) -> MeasuredProfile:
    """Time the passes described in the module docstring and return the profile.

    layers_on_device: the non-expert weights on the pool device (-ngl 99; default with a device
    other than the CPU) or on the host. repack: the host weights' layout (default: spac's).
    skip_absent: the live engine's setting on the device (the check pass and the zero slot).
    raw: filled with the timed passes, {"device"|"host": [(n, token counts of that side's experts, s)]}.
    mmap=False: the model as --no-mmap loads it (with a GPU, the pool copies from pinned memory).
    exact: the host computes as a session in exact mode (its default) does: passes of up to
    EXACT_ROWS tokens row by row, process-wide while measuring. Without it the passes ran ggml's
    batched kernels, and one token's split pass measured 27 ms where a session's took 32 (F16
    target, CPU device, Zen 5)."""
    with batch_invariant(EXACT_ROWS if exact else 0):
        return _measure(model_path, device, n_threads, draft_path, tokens, repeats, name, progress, seed,
                        layers_on_device, repack, skip_absent, raw, mmap, exact)


def _measure(model_path: Path, device: str | None, n_threads: int, draft_path: Path | None, tokens, repeats: int,
             name: str, progress: Callable[[str], None], seed: int, layers_on_device: bool | None, repack: str | None,
             skip_absent: bool, raw: dict | None, mmap: bool, exact: bool) -> MeasuredProfile:
    tokens = tuple(sorted(set(int(n) for n in tokens)))
    target, quant = profiles.from_gguf(model_path)
    w_e = target.expert_bytes(quant)
    on_cpu_pool = device in (None, "CPU")
    if layers_on_device is None:
        layers_on_device = not on_cpu_pool
    progress(f"loading {Path(model_path).name}")
    layout = {} if repack is None else {"repack": repack}
    # spac's layout as a session in this mode has it: what the live host computes with
    model = Model(model_path, n_gpu_layers=-1 if layers_on_device else 0, n_threads=n_threads, mmap=mmap, exact=exact,
                  **layout)
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, model.n_vocab, PREFIX)
    # a new batch for every timed pass, as a live run routes new tokens every step (a repeated
    # batch would meet experts a large last-level cache has just seen)
    batches = [rng.integers(0, model.n_vocab, max(tokens)) for _ in range(repeats + 1)]
    n_layer, n_expert = target.n_layer, target.n_expert
    slot = int(np.ceil(w_e))
    timed: dict[str, list] = {"device": [], "host": []}
    check = {}
    try:
        used = _used(model, batches, prefix, n_threads, n_expert)
        pairs = np.argwhere(used)
        budget = slot * len(pairs) + slot // 2
        for half in ("device", "host", None):
            label = f"{half} half alone" if half else "both halves (check)"
            # skip_absent: the device half computes only its resident experts (a clean fit); the
            # check runs the live engine's setting
            bench = _Bench(model, model_path, device, n_threads, prefix, budget, only_half=half,
                           skip_absent=(half is not None or skip_absent) and not on_cpu_pool)
            try:
                order = rng.permutation(len(pairs))
                levels = LEVELS if half else (0.5,)
                for level in levels:
                    progress(f"{label}: {level:.0%} of the used experts resident")
                    utility = np.zeros((n_layer, n_expert))
                    chosen = pairs[order[:int(round(level * len(pairs)))]]
                    utility[chosen[:, 0], chosen[:, 1]] = 1
                    s0 = bench.engine.stats()
                    t0 = time.perf_counter()
                    resident = bench.resident(utility)
                    s1 = bench.engine.stats()
                    # the last fill's rate: by then the host half has read every used expert, so
                    # the mapping's pages are faulted in, as in a running decode (a first fill also
                    # pays a page fault per 4 KiB: 1.65 GB/s against 1.95-2.54 warm on the RPC stand-in)
                    if s1["bytes_copied"] > s0["bytes_copied"]:
                        busy = (s1["copy_busy_us"] - s0["copy_busy_us"]) * 1e-6 or (time.perf_counter() - t0)
                        check["copy_bytes_per_s"] = (s1["bytes_copied"] - s0["bytes_copied"]) / busy
                    for n in tokens:
                        bench.run(n, batches[0])  # warm-up of this size
                        for batch in batches[1:]:
                            t, ids = bench.run(n, batch)
                            counts = _counts(ids, n_expert)
                            if half is None:
                                check.setdefault("passes", []).append((n, t, counts, resident))
                            else:
                                side = counts * (resident if half == "device" else ~resident)
                                timed[half].append((n, side[side > 0], t))
            finally:
                bench.close()

        # the non-expert part alone (device half, nothing resident) after more and more context
        progress("attention: " + ", ".join(str(PREFIX + c) for c in CONTEXT) + " tokens of context")
        attention = []
        bench = _Bench(model, model_path, device, n_threads, prefix, budget, n_ctx=N_CTX + max(CONTEXT),
                       only_half="device", skip_absent=not on_cpu_pool)
        try:
            for extra in CONTEXT:
                bench.extend(rng.integers(0, model.n_vocab, PREFIX + extra - bench.base))
                for n in tokens:
                    bench.run(n, batches[0])
                    attention += [(n, bench.base, bench.run(n, batch)[0]) for batch in batches[1:]]
        finally:
            bench.close()

        progress("copies inside a pass: uploads on miss at 1 and " + str(tokens[-1]) + " tokens")
        stage_bw, stage_batch = _stage_rate(model, model_path, device, n_threads, prefix, slot, n_layer * n_expert,
                                            tokens, rng, repeats, skip_absent=skip_absent and not on_cpu_pool)

        progress("fitting")
        att_a, att_b = _fit_attention(attention)
        if raw is not None:
            raw.update(timed)
        sizes, dev_t, base_d = _fit(timed["device"], tokens)
        _, host_t, base_h = _fit(timed["host"], tokens)
        ne_bytes = target.non_expert_bytes(quant)
        if layers_on_device:
            # the host half alone pays both ways, the device half alone one (the hidden state goes to
            # the host in both engines); the other way is taken to cost the same
            one_way = float(np.median([max(base_h[n] - base_d[n], 0.0) / n_layer for n in tokens]))
            crossing = 2.0 * one_way
            ne = np.array([base_d[n] - n_layer * one_way for n in tokens])
        else:  # layers on the host: the device half alone pays the round trip, the host half none
            crossing = float(np.median([max(base_d[n] - base_h[n], 0.0) / n_layer for n in tokens]))
            ne = np.array([base_h[n] for n in tokens])
        ne -= PREFIX * (att_a + att_b * np.array(tokens))  # the passes above attended over the prefix
        ne_b, ne_a = np.polyfit(np.array(tokens, dtype=float), ne, 1)

        draft_file, draft_s, draft_per_byte = "", 0.0, 0.0
        if draft_path is not None:
            progress(f"draft {Path(draft_path).name}: single-token decodes on the host")
            draft_s = measure_draft(draft_path, n_threads, rng)
            dprof, dquant = profiles.from_gguf(draft_path, draft=True)
            draft_file = Path(draft_path).name
            draft_per_byte = draft_s / profiles._draft_token_bytes(dprof, dquant)
        dev_name = device or "CPU"
        free = next((f for nm, _, f, _ in devices() if nm == dev_name), 0)
        prof = MeasuredProfile(
            key="measured", name=name or f"{cpu_name()} + {dev_name}, {n_threads} host thread(s)",
            cpu=cpu_name(), device=dev_name, host_threads=n_threads, vram_GB=free / 1e9,
            host={quant: (sizes, tuple(float(v) / w_e for v in host_t))},
            device_rates={quant: (sizes, tuple(float(v) / w_e for v in dev_t))},
            copy_bytes_per_s=check.get("copy_bytes_per_s", 0.0) or 1e9, copy_latency_s=0.0,
            crossing_s=crossing, non_expert_s_per_byte=max(float(ne_a), 0.0) / ne_bytes,
            non_expert_s_per_byte_token=max(float(ne_b), 0.0) / ne_bytes,
            kv_s_per_byte=att_a / target.kv_bytes_per_token, kv_s_per_byte_token=att_b / target.kv_bytes_per_token,
            stage_bytes_per_s=stage_bw, stage_batch_s=stage_batch,
            draft_s_per_byte=draft_per_byte or float(host_t[0]) / w_e, draft_s_per_token=draft_s, draft_file=draft_file,
            zero_slot=not (on_cpu_pool or skip_absent), overlap=not on_cpu_pool,
            non_expert_on="device" if layers_on_device else "host",
            # ggml's RPC server receives tensors and computes graphs on one thread, in order; the
            # CPU test device's copies are memcpy on the host's own cores
            copy_blocks_device=copies_block_compute(device), measured_with=Path(model_path).name,
            measured_at=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
        extra = {f"tokens_{n}_base_{side}_half_s": base[n] for side, base in (("device", base_d), ("host", base_h))
                 for n in tokens}
        return replace(prof, check={**_check(prof, target, quant, check.get("passes", [])), **extra})
    finally:
        model.close()


def _stage_rate(model, path: Path, device: str | None, n_threads: int, prefix: np.ndarray, slot: int,
                n_experts: int, tokens, rng: np.random.Generator, repeats: int, skip_absent: bool) -> tuple[float, float]:
    """The staging path's rate and its cost per batch: what the passes wait for the experts copied
    inside them (llama.cpp's cache ablation, a quarter of the experts' slots, uploads every miss;
    the miss gate's uploads take the same queue, a layer's as one batch). Least squares of each
    pass's wait = batches · batch_s + bytes / bytes_per_s over passes of 1 and the most tokens
    (the cache hands every layer of its passes to the copy worker, misses or not: each is a batch);
    a negative batch cost: the wait per byte alone; (0, 0) where nothing was copied."""
    bench = _Bench(model, path, device, n_threads, prefix, slot * max(n_experts // 4, 1) + slot // 2,
                   skip_absent=skip_absent, upload_on_miss_tokens=max(tokens))
    rows = []
    try:
        for n in (tokens[0], tokens[-1]):
            for i in range(max(repeats, 8) + 1):
                s0 = bench.engine.stats()
                bench.run(n, rng.integers(0, model.n_vocab, n))
                s1 = bench.engine.stats()
                if i:  # the first fills the cache's free slots
                    rows.append([s1[k] - s0[k] for k in ("n_stage_batches", "bytes_staged", "stage_wait_us")])
    finally:
        bench.close()
    a = np.array(rows, dtype=np.float64)
    if not a[:, 1].sum():
        return 0.0, 0.0
    (batch_us, us_per_byte), *_ = np.linalg.lstsq(a[:, :2], a[:, 2], rcond=None)
    if us_per_byte <= 0 or batch_us < 0:  # no cost per batch beside the rate: the whole wait per byte
        return float(a[:, 1].sum() / max(a[:, 2].sum(), 1.0) * 1e6), 0.0
    return 1e6 / float(us_per_byte), float(batch_us) * 1e-6


def _check(prof: MeasuredProfile, target, quant: str, passes) -> dict:
    """The split passes of the live engine, predicted from the fitted profile vs timed (seconds)."""
    costs = profiles.CostModel.from_measured(prof, target, quant=quant)
    predicted, measured = {}, {}
    for n, t, counts, resident in passes:
        total = costs.fixed_pass_time(n, PREFIX)
        for layer in range(counts.shape[0]):
            c, r = counts[layer], resident[layer]
            dev = float(costs.gpu_expert_s(c[(c > 0) & r]).sum())
            host_tokens = c[(c > 0) & ~r]
            host = float(costs.cpu_expert_s(host_tokens).sum())
            if costs.zero_slot and host_tokens.sum():
                dev += costs.zero_slots_s(int(host_tokens.sum()), target.top_k)
            if not costs.overlap:
                both = dev + host + costs.sync_s
            elif costs.sync_on_device:
                both = max(dev + costs.sync_s, host)
            else:
                both = max(dev + costs.sync_serial_s, host + costs.sync_s)
            total += costs.dense_layer_time(n, PREFIX) + both
        predicted.setdefault(n, []).append(total)
        measured.setdefault(n, []).append(t)
    out = {}
    for n in predicted:
        out[f"tokens_{n}_predicted_s"] = float(np.median(predicted[n]))
        out[f"tokens_{n}_measured_s"] = float(np.median(measured[n]))
    return out


def measure_draft(path: Path, n_threads: int, rng: np.random.Generator, n: int = 16) -> float:
    """Median seconds of one single-token draft decode, routing exported as the live loop does."""
    draft = Model(path, n_threads=n_threads)
    ctx = Context(draft, n_ctx=N_CTX, n_batch=N_BATCH, n_threads=n_threads)
    try:
        if draft.n_expert:
            Routing(ctx.ptr, int(draft.meta(f"{draft.arch}.expert_used_count") or 1))
        ctx.decode(rng.integers(0, draft.n_vocab, PREFIX), logits_all=False)
        times = []
        for t in rng.integers(0, draft.n_vocab, n):
            t0 = time.perf_counter()
            ctx.decode([int(t)], logits_all=True)
            ctx.logits()[-1].argmax()
            times.append(time.perf_counter() - t0)
        return float(np.median(times[2:]))
    finally:
        ctx.close()
        draft.close()


def measure_to_file(out: Path, gguf: Path | None, device: str | None, n_threads: int, draft: Path | None,
                    rpc_threads: int = 1, tokens=TOKENS, repeats: int = 3, name: str = "",
                    progress: Callable[[str], None] = lambda s: None, disk_file: Path | None = None,
                    disk: bool = True, exact: bool = True) -> MeasuredProfile:
    """`spac sim profile measure`: measure and write `out`. device "rpc" starts an RPC server on
    127.0.0.1 with rpc_threads threads for the duration (the test machine's stand-in GPU). The
    disk: timed on `disk_file`, else on a file written beside `out` (the disk a model would be
    read from, rather than a /tmp that may be in memory); disk=False: not measured."""
    with ExitStack() as stack:
        if device == "rpc":
            device = stack.enter_context(rpc_device(n_threads=rpc_threads))
        if gguf is None:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            progress("writing a synthetic Qwen3-30B-A3B-shaped model (4 layers, 16 experts, Q4_0)")
            gguf = synthetic_model(tmp)
        prof = measure(gguf, device, n_threads, draft, tokens=tokens, repeats=repeats, name=name, progress=progress,
                       exact=exact)
        if disk:
            if disk_file is None:
                out.parent.mkdir(parents=True, exist_ok=True)
                scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=out.parent)))
                progress("writing a 512 MiB file to time the disk")
                disk_file = write_measure_file(scratch / "disk.bin")
            progress(f"disk: reading {disk_file}")
            prof = replace(prof, disk=measure_disk(disk_file))
    comment = (f"spac measured hardware profile: {prof.name}\n"
               f"measured {prof.measured_at} on {prof.measured_with}; device {prof.device}"
               + (f" ({rpc_threads} server thread(s))" if str(prof.device).startswith("RPC") else ""))
    profiles.write_measured(out, prof, comment)
    return prof



def measure_cmd(
    out: Path = typer.Argument(..., help="profile file to write (.toml)"),
    gguf: Optional[Path] = typer.Option(None, "--gguf", help="measure with this model's kernels and shapes "
                                        "[default: a synthetic Qwen3-30B-A3B-shaped Q4_0 model]"),
    device: Optional[str] = typer.Option(None, "--device", help="pool device: a ggml name (CUDA0, ...), 'rpc' (an RPC "
                                         "server on 127.0.0.1, the test stand-in) or CPU [default: the first GPU, else CPU]"),
    threads: int = typer.Option(1, "-t", "--threads", help="host threads"),
    rpc_threads: int = typer.Option(1, "--rpc-threads", help="threads of the RPC server (--device rpc)"),
    draft: Optional[Path] = typer.Option(None, "-md", "--model-draft", help="time this draft's tokens too"),
    repeats: int = typer.Option(3, "--repeats", help="timed passes per point (medians)"),
    name: str = typer.Option("", "--name", help="the profile's name [default: CPU + device]"),
    disk_file: Optional[Path] = typer.Option(None, "--disk-file", help="time the disk that holds this file (some "
                                             "hundred MiB or more) [default: a 512 MiB file written beside the "
                                             "profile, deleted after]"),
    no_disk: bool = typer.Option(False, "--no-disk", help="do not time the disk"),
    exact: bool = typer.Option(True, "--exact/--no-exact", help="time the host as spac generate's --exact (its "
                               "default) or --no-exact computes"),
) -> None:
    """Measure this machine (host and pool device) and write a hardware profile for `spac sim
    run --hardware FILE`: expert matmul rates by batch size on both sides, the crossing, the
    non-expert part of a pass, copy bandwidth, the draft's cost per token, and the disk (read rate,
    latency, queue depth) for models larger than the host RAM."""
    if device is None:
        gpu = first_gpu()
        device = gpu.name if gpu is not None else "CPU"
    t0 = time.monotonic()

    def progress(text: str) -> None:
        print(f"[{time.monotonic() - t0:5.1f} s] {text}", file=sys.stderr, flush=True)

    try:
        prof = measure_to_file(out, gguf, None if device.upper() == "CPU" else device, threads, draft,
                               rpc_threads=rpc_threads, repeats=repeats, name=name, progress=progress,
                               disk_file=disk_file, disk=not no_disk, exact=exact)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"spac: error: {e}", file=sys.stderr)
        raise typer.Exit(code=2) from None
    print(f"wrote {out} in {time.monotonic() - t0:.0f} s: {prof.name}")
    print(f"  copies: a plan's {prof.copy_bytes_per_s / 1e9:.2f} GB/s; inside a pass "
          + (f"{prof.stage_bytes_per_s / 1e9:.2f} GB/s and {1e6 * prof.stage_batch_s:.0f} µs per layer"
             if prof.stage_bytes_per_s else "none timed"))
    if prof.disk is not None:
        print(f"  disk: {prof.disk.read_bytes_per_s / 1e9:.2f} GB/s, {1e6 * prof.disk.latency_s:.0f} µs per 4 KiB "
              f"read, {prof.disk.queue_depth} reads in flight for the rate")
    for k, v in prof.check.items():
        if k.endswith("_predicted_s") and f"tokens_{k.split('_')[1]}_measured_s" in prof.check:
            n = k.split("_")[1]
            m = prof.check[f"tokens_{n}_measured_s"]
            print(f"  check, split pass of {n} token(s), half the experts on the device: predicted "
                  f"{1e3 * v:.1f} ms, measured {1e3 * m:.1f} ms ({100 * (v / m - 1):+.0f}%)")
