"""The limit: an upper bound on tokens/s that no policy can exceed under the simulator's cost model.

`Simulator` charges one verification step (see `simulator`) as

    draft_s + stall + fixed_pass_s + Σ_layers [dense_layer_s + max(device end, host end)]

where, in layer l, every needed expert e (token count n_e) is served one of three ways:

    resident   allocated in the pool when the pass started: device time gpu(n_e)
    fetched    copied inside the pass ("fetch"/"greedy" miss rules): its copy is queued on the
               one link no earlier than the layer's expert phase starts, so the k-th such copy
               of the layer lands ≥ k·fetch_s after that (the staging path; its batch cost only
               adds to it), and its device time follows
    host       computed on the host: cpu(n_e), plus one sync_s if the layer has any

The bound relaxes everything that couples steps or layers, and nothing else:

1. Prefetch is free and omniscient: before every pass the pool may hold *any* set of at most
   `capacity` experts (no copy time, no stall, knowledge of the coming routing). The
   simulator's pool never holds more than `capacity` allocated experts, and only experts
   allocated at pass start can be hits (`_verify`: `hit ⊆ at_start`), so Σ_l j_l ≤ capacity
   where j_l counts layer l's needed experts served as "resident".
2. Per layer, with j resident, f fetched and h = m − j − f on the host (m needed experts):
       device end − start ≥ G(j + f)                       sum of the j+f smallest gpu(n_e)
       device end − start ≥ f·fetch_s + min_e gpu(n_e)      if f > 0 (the link is serial)
       host end   − start ≥ H(h) + sync_s·[h > 0]          sum of the h smallest cpu(n_e)
   Whatever subsets a policy picks, its sums are at least these (the smallest costs of sets of
   that size), so the layer costs at least  dense + min_f max(G, f·T + g_min, H + sync) =: c_l(j),
   and c_l is made non-increasing (any j' ≤ j is allowed too).
3. Layers share only the capacity: the step's minimum is the min-plus convolution of the c_l
   under Σ j_l ≤ capacity, computed exactly by dynamic programming over layers.

Every policy's step time is therefore ≥ draft_s + fixed_pass_s + DP minimum, step by step, and
its tokens (fixed by the trace) over its time ≤ tokens over the bound's time.

With a host tier of H experts (a model larger than the host RAM, `host_tier`), memory holds at
most H + capacity experts when a step starts (the host tier, and the pool, which spac's tier
leaves out and a page cache need not hold); a pass needing m distinct experts must read at least m − H − capacity of them
from the disk within the step, and the disk reads at most its rate. The step costs at least
that many experts' bytes at the full rate, overlapped perfectly with everything else:
max(the bound above, disk bytes / rate). Latency, queue depth and page faults only add to it. The bound is
tight where prefetch bandwidth and foresight are not the bottleneck; where they are (small
caches, slow links), it is optimistic: no policy can reach it, and the gap says how much a
perfect predictor with an unlimited link would add.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from orchestrator.sim import profiles
from orchestrator.sim.profiles import CostModel
from orchestrator.sim.trace import Trace


@dataclass(frozen=True)
class Limit:
    tokens: int
    time_s: float
    step_time: np.ndarray
    capacity: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.time_s if self.time_s > 0 else float("nan")


def layer_costs(counts: np.ndarray, costs: CostModel, fetch: bool = True, n_tokens: int = 1,
                position: int = 0) -> np.ndarray:
    """c_l(j), j = 0..m: the least time of one layer with at most j of its m needed experts
    resident (counts: token counts of the needed experts, all > 0). fetch=False: no in-pass
    copies (a pool of 0 slots has none to copy into). n_tokens, position: the pass's tokens and
    the tokens cached before it (non-expert time of measured profiles). A measured profile's
    crossing in every layer and zero slot are left out: the bound only gets looser."""
    m = len(counts)
    dense = costs.dense_layer_time(n_tokens, position)
    if m == 0:
        return np.array([dense])
    gpu = np.sort(np.asarray(costs.gpu_expert_s(counts), dtype=np.float64))
    cpu = np.sort(np.asarray(costs.cpu_expert_s(counts), dtype=np.float64))
    g = np.concatenate([[0.0], np.cumsum(gpu)])   # G(d), d = 0..m
    h = np.concatenate([[0.0], np.cumsum(cpu)])   # H(k), k = 0..m
    j = np.arange(m + 1)[:, None]
    f = np.arange(m + 1)[None, :]
    d = j + f                                     # device-served experts
    ok = (d <= m) & ((f == 0) | fetch)
    d = np.minimum(d, m)
    host_n = m - d
    host = h[host_n] + np.where(host_n > 0, costs.sync_s, 0.0)
    link = np.where(f > 0, f * costs.fetch_s + gpu[0], 0.0)
    t = np.maximum(np.maximum(g[d], link), host)
    t = np.where(ok, t, np.inf).min(axis=1)
    return dense + np.minimum.accumulate(t)


def step_bound(counts: np.ndarray, capacity: int, costs: CostModel, n_tokens: int = 1, position: int = 0) -> float:
    """Least Σ_l c_l(j_l) subject to Σ j_l ≤ capacity. counts: int [n_layer, n_expert]."""
    best = np.zeros(1)  # best[c]: least time of the layers so far using exactly ≤ c slots
    for row in counts:
        c = layer_costs(row[row > 0], costs, fetch=capacity > 0, n_tokens=n_tokens, position=position)
        width = min(len(best) + len(c) - 1, capacity + 1)
        # new[x] = min_{j ≤ x} best[x − j] + c[j]  (best is non-increasing: extend with its last)
        padded = np.concatenate([np.full(len(c) - 1, np.inf), best,
                                 np.full(max(width - len(best), 0), best[-1])])
        window = np.lib.stride_tricks.sliding_window_view(padded, len(c))[:width]
        best = (window + c[::-1]).min(axis=1)
        best = np.minimum.accumulate(best)
    return float(best[-1])


def limit(trace: Trace, capacity: int, costs: CostModel, n_steps: int | None = None,
          host_slots: int | None = None) -> Limit:
    """The bound for replaying `trace` (its first n_steps) with `capacity` pool slots and a host
    tier of `host_slots` experts over costs.disk (None: every expert in host RAM)."""
    n_steps = trace.n_steps if n_steps is None else min(n_steps, trace.n_steps)
    step_time = np.empty(n_steps)
    disk_rate = (costs.disk or profiles.disk(profiles.DEFAULT_DISK)).read_bytes_per_s
    for s in range(n_steps):
        routing = trace.step(s)
        n_tokens, position = routing.n_drafted + 1, routing.position or 0
        counts = routing.frequency(trace.n_expert)
        step_time[s] = (costs.draft_time(routing.n_drafted) + costs.fixed_pass_time(n_tokens, position)
                        + step_bound(counts, capacity, costs, n_tokens, position))
        if host_slots is not None:
            unavoidable = max(int((counts > 0).sum()) - host_slots - capacity, 0)
            step_time[s] = max(step_time[s], unavoidable * costs.expert_bytes / disk_rate)
    tokens = int(trace.n_accepted[:n_steps].sum()) + n_steps
    return Limit(tokens=tokens, time_s=float(step_time.sum()), step_time=step_time, capacity=capacity)
