"""Time to first token of a long prompt whose routed experts live in host RAM (`spac sim prefill`).

Simulated, not measured: roofline arithmetic on a datasheet hardware profile and a model profile,
like the decode simulator's cost model (profiles.py). Six rows:

    op-offload  llama.cpp with the experts in host RAM (`--n-cpu-moe`) and a GPU: for a ubatch of
                32 tokens or more its scheduler copies each layer's whole expert tensors to the
                GPU and computes the layer there. Copy and compute take turns (one stream), and the
                copies ignore what a pool may already hold.
    llama-moe-cache  llama.cpp master's GPU expert cache: op offload as above, but the experts its
                cache holds (here the pool's share, as decoding left it) are copied device to
                device instead of uploaded; the prompt does not change the cache.
    cpu         llama.cpp with repacked host experts (no op offload): the experts compute on the
                CPU, everything else on the GPU, one crossing each way per layer.
    spac        streamed prefill through the pool: while layer l computes on the GPU, the
                non-resident experts of layer l+1 are copied into staging slots (two layers'
                worth: double buffering). Resident experts are not moved. The copies start before
                layer l+1's router has run, so they cannot depend on its routing: every
                non-resident expert of the layer is copied. From 65 tokens on, a ubatch of
                Qwen3-30B-A3B's routing uses nearly every expert anyway ((1 - 8/128)^65 = 1.5%
                unused under uniform routing).
    spac-used   spac's other mode: after each layer's router, only the non-resident experts some
                token chose are copied (while the resident ones compute), then computed; no copy
                overlaps another layer. Fewer bytes when routing is concentrated or the ubatch short.
    limit       a lower bound on the time of any prefill that computes the experts on the GPU:
                the larger of (a) every non-resident expert the prompt uses crossing the link once
                and (b) the prompt's flops at the GPU's rate, with nothing else charged.

Each system runs the ubatch size among `UBATCHES` (llama.cpp's default 512 up to 8192, `-ub`) that
is fastest for it: a larger ubatch amortises each copied expert over more tokens.

Per ubatch of u tokens after p cached ones, the unit times are
    an expert with n tokens       max(W_e / B, n · 2 · P_e / F)     (B, F: the side's bandwidth and rate)
    a layer's non-expert part     max(W_blk / B_gpu, (2 · P_blk · u + 4 · d_model · u · (p + u/2)) / F_gpu)
                                  + the profile's per-layer overhead
    a copied expert               W_e / B_pcie
with F_gpu the profile's `prefill_tflops` and F_cpu its `cpu_gflops`. Routing is uniform unless a
popularity is given (each token picks top_k of n_expert; an expert is used by u tokens with
probability 1 - (1 - p_e)^u); the pool holds the `cache_ratio` most popular experts of each layer.
Attention's flops take d_model as the query width (an assumption: Qwen3-30B-A3B's is 4096 against
a d_model of 2048, so attention is undercharged there, equally for every system).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from orchestrator.sim.profiles import BITS_PER_WEIGHT, HardwareProfile, ModelProfile

UBATCHES = (512, 1024, 2048, 4096, 8192)
SYSTEMS = ("op-offload", "llama-moe-cache", "cpu", "spac", "spac-used", "limit")
OP_OFFLOAD_MIN_BATCH = 32  # llama.cpp's CUDA backend offloads a host weight's op from this batch size


@dataclass(frozen=True)
class Prefill:
    """One system's time to first token for one prompt."""

    system: str
    prompt_tokens: int
    ttft_s: float
    ubatch: int
    bytes_copied: float
    copy_hidden: float = 0.0  # share of the copy time that overlapped compute (spac)


class PrefillModel:
    """Unit times of one (hardware, model, quantisation, pool) setting; `run` gives a system's TTFT."""

    def __init__(self, hw: HardwareProfile, model: ModelProfile, quant: str = "Q4_K", cache_ratio: float = 0.17,
                 popularity: np.ndarray | None = None):
        if not model.n_layer:
            raise ValueError(f"{model.key} has no MoE layers")
        if not 0.0 <= cache_ratio <= 1.0:
            raise ValueError(f"cache ratio {cache_ratio} is not between 0 and 1")
        self.hw, self.model, self.quant = hw, model, quant
        L, E, k = model.n_layer, model.n_expert, model.top_k
        self.bpw = BITS_PER_WEIGHT[quant] / 8
        self.w_e = model.expert_bytes(quant)
        self.f_e = 2.0 * model.expert_params
        if not hw.prefill_tflops > 0:
            raise ValueError(f"hardware profile {hw.key} has no prefill_tflops")
        self.gpu_flops = hw.prefill_tflops * 1e12
        self.cpu_flops = hw.cpu_gflops * 1e9
        # probability that one token picks each expert (rows sum to top_k)
        p = np.full((L, E), k / E) if popularity is None else np.asarray(popularity, dtype=np.float64)
        if p.shape != (L, E):
            raise ValueError(f"popularity has shape {p.shape}, the model has {(L, E)}")
        self.p = np.clip(p / p.sum(axis=1, keepdims=True) * k, 0.0, 1.0)
        n_res = int(round(cache_ratio * E))
        order = np.argsort(-self.p, axis=1, kind="stable")
        self.resident = np.zeros((L, E), dtype=bool)
        np.put_along_axis(self.resident, order[:, :n_res], True, axis=1)
        self.n_nonresident = (~self.resident).sum(axis=1)  # per layer
        self.overhead = hw.layer_overhead_us * 1e-6
        self.sync = hw.sync_us * 1e-6
        self._expert_times: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}

    # -- unit times ------------------------------------------------------------------------

    def _block_s(self, params: int, u: int, pos: int) -> float:
        flops = 2.0 * params * u + 4.0 * self.model.d_model * u * (pos + u / 2)
        return max(params * self.bpw / self.hw.gpu_bw, flops / self.gpu_flops) + self.overhead

    def nonexpert_s(self, u: int, pos: int) -> float:
        """One MoE block's attention, router (and shared experts) for a ubatch, on the GPU."""
        return self._block_s(self.model.block_params, u, pos)

    def dense_blocks_s(self, u: int, pos: int) -> float:
        """The blocks without routed experts (whole, on the GPU)."""
        m = self.model
        return m.n_dense_block * self._block_s(m.dense_block_params or m.block_params, u, pos)

    def experts_s(self, u: int, side: str, which: np.ndarray | None = None) -> np.ndarray:
        """Per layer: the experts a ubatch of u tokens uses (of `which`, bool [n_layer, n_expert],
        default all), computed on "gpu" or "cpu"."""
        key = (u, side)
        if key not in self._expert_times:  # `run` asks again per layer and per ubatch: once per size
            bw, rate = (self.hw.gpu_bw, self.gpu_flops) if side == "gpu" else (self.hw.cpu_bw, self.cpu_flops)
            used = 1.0 - (1.0 - self.p) ** u                # probability each expert is used
            tokens = u * self.p / np.maximum(used, 1e-300)  # its tokens, given that it is used
            t = used * np.maximum(self.w_e / bw, tokens * self.f_e / rate)
            self._expert_times[key] = (t, t.sum(axis=1))
        t, per_layer = self._expert_times[key]
        return per_layer if which is None else np.where(which, t, 0.0).sum(axis=1)

    @property
    def copy_s(self) -> float:
        return self.hw.expert_copy_s(self.w_e)  # several cards: a link each

    def head_s(self) -> float:
        """The output head for the prompt's last token (the only logits prefill needs)."""
        return self.model.head_params * self.bpw / self.hw.gpu_bw

    # -- systems ---------------------------------------------------------------------------

    @staticmethod
    def _chunks(n_tokens: int, u: int):
        for pos in range(0, n_tokens, u):
            yield pos, min(u, n_tokens - pos)

    def run(self, system: str, n_tokens: int, ubatch: int) -> Prefill:
        if system == "limit":
            return self.limit(n_tokens)
        u_max = min(ubatch, n_tokens)
        t, copied, hidden, copy_total = 0.0, 0.0, 0.0, 0.0
        if system == "spac":
            # two staging buffers: layer i's copy waits for its own link and for layer i-2's
            # compute to free the buffer; layer i's compute waits for its copy and layer i-1
            copy_end, done = 0.0, [0.0, 0.0]
            for pos, u in self._chunks(n_tokens, u_max):
                gpu = self.experts_s(u, "gpu")
                done[-1] += self.dense_blocks_s(u, pos)
                for layer in range(self.model.n_layer):
                    c = self.n_nonresident[layer] * self.copy_s
                    start = max(copy_end, done[-2])
                    copy_end = start + c
                    compute_start = max(done[-1], copy_end)
                    hidden += max(0.0, min(copy_end, done[-1]) - start)
                    done = [done[-1], compute_start + self.nonexpert_s(u, pos) + gpu[layer]]
                    copied += self.n_nonresident[layer] * self.w_e
                    copy_total += c
            t = done[-1] + self.head_s()
            return Prefill(system, n_tokens, t, u_max, copied, hidden / copy_total if copy_total else 0.0)
        if system == "spac-used":
            # after each router: the chosen non-resident experts cross while the resident ones
            # compute, then the copied ones compute; nothing overlaps the next layer
            for pos, u in self._chunks(n_tokens, u_max):
                t += self.dense_blocks_s(u, pos)
                used = 1.0 - (1.0 - self.p) ** u
                n_copy = (used * ~self.resident).sum(axis=1)
                on_res, on_copy = self.experts_s(u, "gpu", self.resident), self.experts_s(u, "gpu", ~self.resident)
                for layer in range(self.model.n_layer):
                    t += (self.nonexpert_s(u, pos) + max(n_copy[layer] * self.copy_s, on_res[layer])
                          + on_copy[layer])
                    copied += n_copy[layer] * self.w_e
            return Prefill(system, n_tokens, t + self.head_s(), u_max, copied)
        for pos, u in self._chunks(n_tokens, u_max):
            t += self.dense_blocks_s(u, pos)
            for layer in range(self.model.n_layer):
                if system == "op-offload" and u >= OP_OFFLOAD_MIN_BATCH:
                    t += self.model.n_expert * self.copy_s + self.nonexpert_s(u, pos) + self.experts_s(u, "gpu")[layer]
                    copied += self.model.n_expert * self.w_e
                elif system == "llama-moe-cache" and u >= OP_OFFLOAD_MIN_BATCH:
                    n_up = int(self.n_nonresident[layer])  # the cached ones: a copy within the GPU
                    t += (n_up * self.copy_s + (self.model.n_expert - n_up) * self.w_e / self.hw.gpu_bw
                          + self.nonexpert_s(u, pos) + self.experts_s(u, "gpu")[layer])
                    copied += n_up * self.w_e
                elif system in ("op-offload", "llama-moe-cache", "cpu"):
                    t += self.nonexpert_s(u, pos) + 2 * self.sync + self.experts_s(u, "cpu")[layer]
                else:
                    raise ValueError(f"unknown system {system!r}; known: {', '.join(SYSTEMS)}")
        return Prefill(system, n_tokens, t + self.head_s(), u_max, copied)

    def limit(self, n_tokens: int) -> Prefill:
        """(a) the non-resident experts the whole prompt uses, each copied once; (b) the prompt's
        flops on the GPU. Every system above that computes experts on the GPU is charged at least
        each of them (tested in test_sim_prefill)."""
        m = self.model
        used = 1.0 - (1.0 - self.p) ** n_tokens
        copy = float((used * ~self.resident).sum()) * self.copy_s
        dense = m.n_dense_block * (m.dense_block_params or m.block_params)
        expert_flops = n_tokens * self.f_e * float(self.p.sum())  # each (token, expert) pair once
        flops = (2.0 * n_tokens * (m.n_layer * m.block_params + dense) + expert_flops
                 + 4.0 * m.d_model * m.n_block * n_tokens * n_tokens / 2)
        return Prefill("limit", n_tokens, max(copy, flops / self.gpu_flops), n_tokens,
                       float((used * ~self.resident).sum()) * self.w_e)

    def best(self, system: str, n_tokens: int) -> Prefill:
        """The system at its fastest ubatch size among UBATCHES (capped at the prompt)."""
        sizes = sorted({min(u, n_tokens) for u in UBATCHES})
        return min((self.run(system, n_tokens, u) for u in sizes), key=lambda r: r.ttft_s)

    def staging_bytes(self) -> float:
        """Device memory spac's streamed prefill needs besides the pool: two layers of experts."""
        return 2.0 * self.model.n_expert * self.w_e


def table(hw: HardwareProfile, model: ModelProfile, prompts, quant: str = "Q4_K", cache_ratio: float = 0.17,
          popularity: np.ndarray | None = None) -> list[Prefill]:
    """Every system at its best ubatch for every prompt length."""
    pm = PrefillModel(hw, model, quant, cache_ratio, popularity)
    return [pm.best(s, n) for n in prompts for s in SYSTEMS]
