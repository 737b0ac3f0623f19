"""Per-run metrics of a generation: speed, speculation, expert placement, prediction quality.

`RunRecorder` is fed by the speculative loop (one call per verification step, one per
emitted chunk of tokens); `RunRecorder.finish()` returns a `RunMetrics`, which prints as one
summary line (`summary()`) or as JSON (`to_json()`).

Definitions:
    ttft_s          from the start of the request to the first emitted token (prefill included)
    tokens_per_s    generated tokens / decode time, the decode time running from the end of the
                    prefill to the last token (so a long prompt does not lower it)
    latency_ms      decode time / generated tokens, per token
    acceptance_rate accepted draft tokens / drafted tokens
    tokens_per_step generated tokens / verification steps (1.0 for autoregressive decoding)
    device_share    expert-token computations done on the device pool / all of them (engine
                    stats, this run only); None without an engine
    tau_histogram   per MoE layer, how many steps used each threshold τ = 1..K (column τ−1)
    hot_cold_accuracy  MoE-SpAc §4.3: at step t+1 an expert is predicted hot when the plan made
                    after step t had utility ≥ τ for it, and is actually hot when the verify
                    pass of step t+1 used it at least τ times (the utility scale maps frequency
                    f to min(f, K), so "utility ≥ τ" and "frequency ≥ τ" match). Accuracy is the
                    share of (layer, expert) pairs where the two agree, over all steps that had
                    a plan in force; also given per layer.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import numpy as np


@dataclass
class RunMetrics:
    n_prompt_tokens: int = 0
    n_prompt_cached: int = 0     # of them, already in the KV cache from the previous request
    n_tokens: int = 0
    n_steps: int = 0
    n_drafted: int = 0
    n_accepted: int = 0
    prefill_s: float = 0.0
    ttft_s: float | None = None
    decode_s: float = 0.0
    total_s: float = 0.0
    tokens_per_s: float = 0.0
    latency_ms: float | None = None
    acceptance_rate: float | None = None
    tokens_per_step: float | None = None
    device_share: float | None = None
    n_expert_tokens_device: int = 0
    n_expert_tokens_cpu: int = 0
    bytes_copied: int = 0
    n_copies: int = 0
    n_evictions: int = 0
    n_prefetch_late: int = 0
    bytes_staged: int = 0         # streamed prefill: experts copied into staging slots
    copy_layer_ms: float | None = None  # one batch of a layer's copies (a plan's, a staged layer's), mean
    # per pool device: {"device", "n_slots", and this run's bytes_copied, n_copies, n_expert_tokens_device}
    per_device: list[dict] | None = None
    tau_histogram: list[list[int]] | None = None
    hot_cold_accuracy: float | None = None
    hot_cold_accuracy_per_layer: list[float] | None = None
    orchestrator_ms_median: float | None = None
    stop_reason: str = ""
    mode: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    def summary(self) -> str:
        """One line, e.g. `128 tokens, 96.3 tok/s, TTFT 41 ms, accept 0.72, 3.4 tok/step, ...`."""
        parts = [f"{self.n_tokens} tokens", f"{self.tokens_per_s:.1f} tok/s"]
        if self.ttft_s is not None:
            parts.append(f"TTFT {self.ttft_s * 1e3:.0f} ms")
        if self.acceptance_rate is not None:
            parts.append(f"accept {self.acceptance_rate:.2f}")
        if self.tokens_per_step is not None:
            parts.append(f"{self.tokens_per_step:.2f} tok/step")
        if self.device_share is not None:
            parts.append(f"device {self.device_share:.0%} of expert tokens")
            parts.append(f"{_bytes(self.bytes_copied)} copied")
            if self.per_device and len(self.per_device) > 1:
                parts[-1] += " (" + ", ".join(f"{d['device']} {_bytes(d['bytes_copied'])}" for d in self.per_device) + ")"
            if self.bytes_staged:  # copied inside the passes: a streamed prompt's, or uploads on miss
                parts.append(f"{_bytes(self.bytes_staged)} staged")
        if self.hot_cold_accuracy is not None:
            parts.append(f"hot/cold acc {self.hot_cold_accuracy:.2f}")
        if self.stop_reason:
            parts.append(f"stop: {self.stop_reason}")
        return ", ".join(parts)


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


ENGINE_COUNTERS = ("n_expert_tokens_device", "n_expert_tokens_cpu", "bytes_copied", "n_copies",
                   "n_evictions", "n_prefetch_late", "bytes_staged")


class RunRecorder:
    """Collects one run; all times from `clock` (time.perf_counter).

    n_layer, n_expert, k_max: shape of the plans (0: no engine, no placement metrics).
    Live numbers for a status line: `live()` at any time.
    """

    def __init__(self, n_layer: int = 0, n_expert: int = 0, k_max: int = 0, mode: str = "speculative",
                 clock=time.perf_counter) -> None:
        self.n_layer, self.n_expert, self.k_max = n_layer, n_expert, k_max
        self.mode = mode
        self.clock = clock
        self._placement = bool(n_layer and n_expert and k_max)
        self.start(0)

    def start(self, n_prompt_tokens: int, engine_stats: dict | None = None) -> None:
        self._t_start = self.clock()
        self._t_prefill: float | None = None
        self._t_first: float | None = None
        self._t_last: float | None = None
        self._m = RunMetrics(n_prompt_tokens=n_prompt_tokens, mode=self.mode)
        self._stats0 = dict(engine_stats) if engine_stats is not None else None
        self._stats_last = self._stats0
        self._tau_hist = np.zeros((self.n_layer, self.k_max), dtype=np.int64) if self._placement else None
        self._hot_correct = np.zeros(self.n_layer, dtype=np.int64)
        self._hot_steps = 0
        self._orch_s: list[float] = []

    def prefill_done(self) -> None:
        self._t_prefill = self.clock()

    def step(self, n_drafted: int, n_accepted: int) -> None:
        """One verification step (or one autoregressive decode: n_drafted = 0)."""
        m = self._m
        m.n_steps += 1
        m.n_drafted += n_drafted
        m.n_accepted += n_accepted

    def emitted(self, n_tokens: int) -> None:
        """n_tokens more tokens are final (counted towards the output)."""
        if n_tokens <= 0:
            return
        now = self.clock()
        if self._t_first is None:
            self._t_first = now
        self._t_last = now
        self._m.n_tokens += n_tokens

    def plan(self, threshold: np.ndarray, orchestrator_s: float) -> None:
        """The threshold τ chosen per layer this step, and the time the policy took."""
        if self._tau_hist is not None:
            t = np.clip(np.asarray(threshold, dtype=np.intp), 1, self.k_max) - 1
            self._tau_hist[np.arange(self.n_layer), t] += 1
        self._orch_s.append(orchestrator_s)

    def hot_cold(self, utility: np.ndarray, threshold: np.ndarray, freq: np.ndarray) -> None:
        """Score the plan that was in force (utility, τ) against this step's frequencies f."""
        if not self._placement:
            return
        tau = np.asarray(threshold)[:, None]
        self._hot_correct += ((utility >= tau) == (freq >= tau)).sum(axis=1)
        self._hot_steps += 1

    def engine_stats(self, stats: dict) -> None:
        """The engine's counters now (for `live`)."""
        self._stats_last = stats

    def live(self) -> dict:
        """tokens/s, acceptance and device share so far, for a status line."""
        m = self._m
        t0 = self._t_prefill if self._t_prefill is not None else self._t_start
        dt = (self._t_last or t0) - t0
        out = {"n_tokens": m.n_tokens, "tokens_per_s": m.n_tokens / dt if dt > 0 else 0.0,
               "acceptance_rate": m.n_accepted / m.n_drafted if m.n_drafted else None,
               "device_share": None}
        if self._stats0 is not None and self._stats_last is not None:
            dev = self._stats_last["n_expert_tokens_device"] - self._stats0["n_expert_tokens_device"]
            cpu = self._stats_last["n_expert_tokens_cpu"] - self._stats0["n_expert_tokens_cpu"]
            out["device_share"] = dev / (dev + cpu) if dev + cpu else 0.0
        return out

    def finish(self, stop_reason: str = "", engine_stats: dict | None = None) -> RunMetrics:
        end = self.clock()
        m = self._m
        m.stop_reason = stop_reason
        t_prefill = self._t_prefill if self._t_prefill is not None else self._t_start
        t_last = self._t_last if self._t_last is not None else end
        m.prefill_s = t_prefill - self._t_start
        m.total_s = end - self._t_start
        m.decode_s = max(t_last - t_prefill, 0.0)
        if self._t_first is not None:
            m.ttft_s = self._t_first - self._t_start
        if m.n_tokens and m.decode_s > 0:
            m.tokens_per_s = m.n_tokens / m.decode_s
            m.latency_ms = m.decode_s / m.n_tokens * 1e3
        if m.n_drafted:
            m.acceptance_rate = m.n_accepted / m.n_drafted
        if m.n_steps:
            m.tokens_per_step = m.n_tokens / m.n_steps
        if engine_stats is not None and self._stats0 is not None:
            for name in ENGINE_COUNTERS:
                setattr(m, name, int(engine_stats[name] - self._stats0[name]))
            n_expert_tokens = m.n_expert_tokens_device + m.n_expert_tokens_cpu
            m.device_share = m.n_expert_tokens_device / n_expert_tokens if n_expert_tokens else 0.0
            delta = lambda k: engine_stats.get(k, 0) - self._stats0.get(k, 0)  # noqa: E731
            n_batches = delta("n_copy_batches") + delta("n_stage_batches")
            if n_batches:
                m.copy_layer_ms = (delta("copy_busy_us") + delta("stage_copy_us")) / n_batches / 1e3
            if "per_device" in engine_stats and "per_device" in self._stats0:
                m.per_device = [{"device": now["device"], "n_slots": now["n_slots"],
                                 **{k: int(now[k] - then[k]) for k in ("bytes_copied", "n_copies", "n_expert_tokens_device")}}
                                for now, then in zip(engine_stats["per_device"], self._stats0["per_device"])]
        if self._tau_hist is not None:
            m.tau_histogram = self._tau_hist.tolist()
        if self._hot_steps:
            pairs = self._hot_steps * self.n_expert
            m.hot_cold_accuracy_per_layer = [round(float(c / pairs), 4) for c in self._hot_correct]
            m.hot_cold_accuracy = float(self._hot_correct.sum() / (pairs * self.n_layer))
        if self._orch_s:
            m.orchestrator_ms_median = float(np.median(self._orch_s) * 1e3)
        return m

    @property
    def metrics(self) -> RunMetrics:
        """The metrics so far (times are filled in by `finish`)."""
        return self._m
